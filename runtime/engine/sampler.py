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
stability or on the vocabulary size. The decision itself is `runtime.model.sampling.decide`,
shared with the GPU sampling kernels' reference; this module keeps each request's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from runtime.engine.api import SamplingParams
from runtime.model.sampling import (DEAD_END, GREEDY_TEMPERATURE, TOP_K_CAP, RowSampling, decide,
                                    pack_mask, penalized)


class DeadEndError(Exception):
    """No token can be sampled: the output constraint allows none, or every allowed token's
    logit is NaN or -inf (a broken model or artifact)."""


NON_FINITE = ("no allowed token has a finite logit (the model produced NaN or infinite "
              "logits)")
NON_FINITE_OR_DEAD_END = ("no token can be sampled: the model produced NaN or infinite logits "
                          "for every allowed token, or the output constraint allows none")


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

    def row_sampling(self, vocab_size: int, bitmask: Optional[np.ndarray], ahead: int = 0) -> RowSampling:
        """This step's inputs for a device sampler (the same decision `sample_token` makes).
        ahead: the inputs `ahead` sampled tokens later, for a request whose inputs change with
        nothing but the draw count (`unchanged_by_tokens`): a verification row's later positions."""
        p = self.params
        if self.greedy:
            return RowSampling(greedy=True, bitmask=bitmask)
        ids, deltas = self.penalties(vocab_size)
        return RowSampling(greedy=False, temperature=p.temperature, top_k=resolved_top_k(p),
                           top_p=p.top_p, min_p=p.min_p, seed=p.seed, draw_index=self.num_draws + ahead,
                           penalty_ids=ids, penalty_deltas=deltas, bitmask=bitmask)

    @property
    def unchanged_by_tokens(self) -> bool:
        """Whether committing a token changes this request's sampling inputs only by one draw:
        no presence or frequency penalty (their deltas count the output tokens)."""
        p = self.params
        return self.greedy or not (p.presence_penalty or p.frequency_penalty)

    def took(self, token_id: int) -> int:
        """Account for a token a device sampler picked from `row_sampling()`'s inputs."""
        if token_id == DEAD_END:  # the device cannot say which of the two it was
            raise DeadEndError(NON_FINITE_OR_DEAD_END)
        if not self.greedy:
            self.num_draws += 1
        return token_id


def resolved_top_k(params: SamplingParams) -> int:
    return min(params.top_k if params.top_k > 0 else TOP_K_CAP, TOP_K_CAP)


def apply_penalties(logits: np.ndarray, state: SamplerState) -> np.ndarray:
    """A float32 copy of `logits` with the request's penalties applied (as a device sampler
    applies them)."""
    return penalized(logits, *state.penalties(logits.shape[0]))


def candidate_distribution(logits: np.ndarray, state: SamplerState) -> tuple[np.ndarray, np.ndarray]:
    """The (ids, probabilities) the draw picks from, ids ordered by (logit desc, id asc).

    `logits` must already carry the constraint mask (-inf for disallowed ids).
    """
    draw = decide(logits, state.row_sampling(logits.shape[0], None))
    if draw.token == DEAD_END:
        raise DeadEndError(NON_FINITE_OR_DEAD_END)
    return draw.ids, draw.probs


def sample_token(logits: np.ndarray, state: SamplerState,
                 mask: Optional[np.ndarray] = None) -> int:
    """Next token id for one sequence (`runtime.model.sampling.decide` on this request's inputs).
    `logits`: float [V]; `mask`: bool [V] (shorter: the ids past it are disallowed), a packed
    uint32 bitmask [ceil(V / 32)], or None."""
    vocab = logits.shape[0]
    if mask is not None:
        if mask.dtype == np.bool_:
            allowed = np.zeros(vocab, dtype=bool)
            allowed[:min(mask.shape[0], vocab)] = mask[:vocab]
            mask = pack_mask(allowed)
        if not mask.any():
            raise DeadEndError("the output constraint allows no token")
    token = decide(logits, state.row_sampling(vocab, mask)).token
    if token == DEAD_END:  # the mask allowed some ids (checked above): their logits are bad
        raise DeadEndError(NON_FINITE)
    return state.took(token)


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
