"""The sampler: logits of one sequence -> its next token id.

Order of operations (the usual one of vLLM / llama.cpp, written out so tests can pin it):
1. constraint mask: disallowed ids get -inf (an all-false mask is a dead end: `DeadEndError`);
2. greedy (or temperature 0): argmax, lowest id on ties; nothing below applies;
3. presence / frequency penalties over the tokens this request has committed as output:
   `logit -= presence * [count > 0] + frequency * count`;
4. top-k (1..20; the command line's 0 means the cap of 20), then temperature;
5. softmax, top-p (smallest prefix of the sorted distribution whose mass reaches p), min-p
   (drop tokens below min_p times the most likely one), renormalise;
6. one uniform draw picks by inverse CDF: draw number n of a request is
   `draw_uniform(seed, n)` (runtime/model/sampling.py, a counter-based generator), n counting the
   tokens it sampled (greedy steps draw nothing). The same seed, prompt and settings reproduce
   the same output, also after a preemption and replay, and whether a step was sampled here or
   by a runner on its device (`RowSampling` carries the same inputs to the GPU kernels).

Candidates are ordered by (logit desc, id asc) before any cut, so ties never depend on sort
stability or on the vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from runtime.engine.api import SamplingParams
from runtime.model.sampling import (DEAD_END, GREEDY_TEMPERATURE, TOP_K_CAP, RowSampling,
                                    draw_uniform, unpack_mask)


class DeadEndError(Exception):
    """The output constraint allows no token at all."""


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the model's raw distribution) of the chosen token and the top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class SamplerState:
    """Per-request sampler state: the draw counter and the output-token counts."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.counts: dict[int, int] = {}
        self.num_draws = 0

    def observe(self, token_id: int) -> None:
        """Count a committed output token (sampled or inserted) for the penalties."""
        self.counts[token_id] = self.counts.get(token_id, 0) + 1

    @property
    def greedy(self) -> bool:
        return self.params.greedy or self.params.temperature <= GREEDY_TEMPERATURE

    def penalties(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, deltas float32): `logit[id] -= delta` for the committed output tokens;
        empty when no penalty applies."""
        p = self.params
        if not self.counts or not (p.presence_penalty or p.frequency_penalty):
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
        counts = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
        keep = ids < vocab_size
        deltas = (p.presence_penalty + p.frequency_penalty * counts[keep]).astype(np.float32)
        return ids[keep].astype(np.int32), deltas

    def row_sampling(self, vocab_size: int, bitmask: Optional[np.ndarray]) -> RowSampling:
        """This step's inputs for a device sampler (the same decision `sample_token` makes)."""
        p = self.params
        if self.greedy:
            return RowSampling(greedy=True, bitmask=bitmask)
        ids, deltas = self.penalties(vocab_size)
        return RowSampling(greedy=False, temperature=p.temperature, top_k=resolved_top_k(p),
                           top_p=p.top_p, min_p=p.min_p, seed=p.seed, draw_index=self.num_draws,
                           penalty_ids=ids, penalty_deltas=deltas, bitmask=bitmask)

    def took(self, token_id: int) -> int:
        """Account for a token a device sampler picked from `row_sampling()`'s inputs."""
        if token_id == DEAD_END:
            raise DeadEndError("the output constraint allows no token")
        if not self.greedy:
            self.num_draws += 1
        return token_id


def resolved_top_k(params: SamplingParams) -> int:
    return min(params.top_k if params.top_k > 0 else TOP_K_CAP, TOP_K_CAP)


def apply_penalties(logits: np.ndarray, state: SamplerState) -> np.ndarray:
    """`logits` with the penalties applied (float32, as a device sampler does): a penalised
    copy, or `logits` itself when no penalty applies (never modified in place)."""
    ids, deltas = state.penalties(logits.shape[0])
    if ids.shape[0] == 0:
        return logits
    out = logits.astype(np.float32, copy=True)
    out[ids] -= deltas
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


def candidate_distribution(logits: np.ndarray, state: SamplerState) -> tuple[np.ndarray, np.ndarray]:
    """The (ids, probabilities) the draw picks from, ids ordered by (logit desc, id asc).

    `logits` must already carry the constraint mask (-inf for disallowed ids).
    """
    params = state.params
    scores = apply_penalties(logits, state)
    ids = top_ids(scores, resolved_top_k(params))
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
    """Next token id for one sequence. `logits`: float [V]; `mask`: bool [V], a packed uint32
    bitmask [ceil(V / 32)], or None."""
    if mask is not None and mask.dtype != np.bool_:
        mask = unpack_mask(mask, logits.shape[0])
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
    if state.greedy:
        return int(np.argmax(logits))
    ids, probs = candidate_distribution(logits, state)
    draw = draw_uniform(state.params.seed, state.num_draws)
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
