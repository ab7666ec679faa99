"""The sampler: logits of one sequence -> its next token id.

Order of operations (the usual one of vLLM / llama.cpp, written out so tests can pin it):
1. constraint mask: disallowed ids get -inf (an all-false mask is a dead end: `DeadEndError`);
2. greedy (or temperature 0): argmax, lowest id on ties; nothing below applies;
3. presence / frequency penalties over the tokens this request has committed as output:
   `logit -= presence * [count > 0] + frequency * count`;
4. top-k (1..20; the command line's 0 means the cap of 20), then temperature;
5. softmax, top-p (smallest prefix of the sorted distribution whose mass reaches p), min-p
   (drop tokens below min_p times the most likely one), renormalise;
6. one uniform draw from the request's own generator (PCG64 seeded with the request seed) picks
   by inverse CDF. The generator advances exactly once per sampled token, so the same seed,
   prompt and settings reproduce the same output, also after a preemption and replay.

Candidates are ordered by (logit desc, id asc) before any cut, so ties never depend on sort
stability or on the vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from runtime.engine.api import SamplingParams

TOP_K_CAP = 20
GREEDY_TEMPERATURE = 1e-5   # at or below: treat as greedy (division would overflow)


class DeadEndError(Exception):
    """The output constraint allows no token at all."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the model's raw distribution) of the chosen token and the top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class SamplerState:
    """Per-request sampler state: the seeded generator and the output-token counts."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self.counts: dict[int, int] = {}
        self.num_draws = 0

    def observe(self, token_id: int) -> None:
        """Count a committed output token (sampled or inserted) for the penalties."""
        self.counts[token_id] = self.counts.get(token_id, 0) + 1


def _is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature <= GREEDY_TEMPERATURE


def apply_penalties(logits: np.ndarray, params: SamplingParams,
                    counts: dict[int, int]) -> np.ndarray:
    """`logits` with the penalties applied: a penalised copy, or `logits` itself when no
    penalty applies (never modified in place)."""
    if not counts or not (params.presence_penalty or params.frequency_penalty):
        return logits
    out = logits.copy()
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    ids_count = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
    keep = ids < out.shape[0]
    ids, ids_count = ids[keep], ids_count[keep]
    out[ids] = out[ids] - (params.presence_penalty + params.frequency_penalty * ids_count)
    return out


SAMPLE_STRIDE = 64        # top-k pre-filter: every 64th logit bounds the k-th largest from below


def top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest scores, ordered by (score desc, id asc); -inf ids are dropped.

    A full selection over 248k logits costs milliseconds, so the k-th largest value of a strided
    sample (a lower bound of the true k-th largest) first cuts the vocabulary down to the few
    ids that can be in the top k; ties are all kept, so the result is exact.
    """
    n = scores.shape[0]
    pool = None
    if n > SAMPLE_STRIDE * k * 4:
        sample = scores[::SAMPLE_STRIDE]
        threshold = np.partition(sample, sample.shape[0] - k)[sample.shape[0] - k]
        if threshold > -np.inf:
            pool = np.flatnonzero(scores >= threshold)
    if pool is None or pool.shape[0] > 16 * SAMPLE_STRIDE * k:
        pool = np.flatnonzero(scores > -np.inf)
        if pool.shape[0] > k:
            part = np.argpartition(-scores[pool], k - 1)[:k]
            kth = scores[pool[part]].min()
            pool = pool[scores[pool] >= kth]
    values = scores[pool]
    keep = values > -np.inf
    pool, values = pool[keep], values[keep]
    return pool[np.lexsort((pool, -values))[:k]]


def candidate_distribution(logits: np.ndarray, params: SamplingParams,
                           counts: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The (ids, probabilities) the draw picks from, ids ordered by (logit desc, id asc).

    `logits` must already carry the constraint mask (-inf for disallowed ids).
    """
    scores = apply_penalties(logits, params, counts)
    k = min(params.top_k if params.top_k > 0 else TOP_K_CAP, TOP_K_CAP)
    ids = top_ids(scores, k)
    if ids.shape[0] == 0:
        raise DeadEndError("no token is allowed")
    z = scores[ids].astype(np.float64) / max(params.temperature, GREEDY_TEMPERATURE)
    z -= z[0]
    probs = np.exp(z)
    probs /= probs.sum()
    if params.top_p < 1.0:
        # The tolerance keeps p = 0.8 over {0.5, 0.3, ...} at two tokens despite rounding.
        cutoff = int(np.searchsorted(np.cumsum(probs), params.top_p - 1e-9, side="left")) + 1
        ids, probs = ids[:cutoff], probs[:cutoff]
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs[0]
        ids, probs = ids[keep], probs[keep]
    probs = probs / probs.sum()
    return ids, probs


def sample_token(logits: np.ndarray, state: SamplerState,
                 mask: Optional[np.ndarray] = None) -> int:
    """Next token id for one sequence. `logits`: float [V]; `mask`: bool [V] or None."""
    params = state.params
    if mask is not None:
        if mask.shape[0] < logits.shape[0]:
            padded = np.zeros(logits.shape[0], dtype=bool)
            padded[:mask.shape[0]] = mask
            mask = padded
        elif mask.shape[0] > logits.shape[0]:
            mask = mask[:logits.shape[0]]
        if not mask.any():
            raise DeadEndError("the output constraint allows no token")
        logits = np.where(mask, logits, -np.inf)
    if _is_greedy(params):
        return int(np.argmax(logits))
    ids, probs = candidate_distribution(logits, params, state.counts)
    draw = state.rng.random()
    state.num_draws += 1
    index = int(np.searchsorted(np.cumsum(probs), draw, side="right"))
    return int(ids[min(index, ids.shape[0] - 1)])


def token_logprobs(logits: np.ndarray, token_id: int, top: int) -> TokenLogprobs:
    """Raw-distribution logprobs of `token_id` and the `top` most likely ids (0 = none)."""
    x = logits.astype(np.float64)
    peak = x.max()
    log_total = peak + np.log(np.exp(x - peak).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, x.shape[0])
        part = np.argpartition(-x, k - 1)[:k]
        part = part[np.lexsort((part, -x[part]))]
        best = tuple((int(i), float(x[i] - log_total)) for i in part)
    return TokenLogprobs(token_id=token_id, logprob=float(x[token_id] - log_total), top=best)
