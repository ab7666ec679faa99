"""Records that cross the engine boundary: what callers submit and what comes back.

Callers (the CLI, the server) submit `EngineRequest`s and receive `EngineOutput` increments
through a thread-safe queue. Only token ids cross this boundary: text, templates and JSON stay
with the caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np


class FinishReason(str, enum.Enum):
    STOP = "stop"            # stop token id, stop string (reported by the caller) or EOS
    LENGTH = "length"        # max_new_tokens reached
    CONTEXT = "context"      # max context reached
    CANCELLED = "cancelled"  # caller cancelled (client disconnect, Ctrl-C)
    ERROR = "error"          # this request failed; others continue


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling settings (presets already applied by the caller).

    greedy: exact argmax; other fields are then ignored.
    top_k: 1..20 after resolution (0 on the command line means the top-20 cap).
    seed: per-request seed; the same seed and prompt reproduce the same output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 20
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    greedy: bool = False


class OutputConstraint(Protocol):
    """A compiled output constraint for one request (runtime/text/constraints_request.py implements it).

    The engine asks for the allowed-token mask before sampling each answer token and commits the
    sampled token afterwards. `allowed_bitmask_u32` returns None while unconstrained (e.g. inside
    the think block) or the packed mask: uint32 [ceil(vocab_size / 32)], bit `id % 32` of word
    `id // 32` set for an allowed id (the form llguidance writes and the device sampler reads).
    """

    def allowed_bitmask_u32(self, vocab_size: int) -> Optional[np.ndarray]: ...

    def commit(self, token_id: int) -> None: ...

    def rollback(self, num_tokens: int) -> None: ...


@dataclass(frozen=True)
class ThinkingControl:
    """Token-level thinking controls the engine applies (ids prepared by the text layer).

    starts_in_thinking: the prompt ended inside an open think block.
    think_end_id: the `</think>` token id.
    budget: most model-origin thinking tokens; None = unlimited.
    close_ids: ids appended without sampling when the budget is hit (guidance + `</think>`).
    loop_guard: "off" | "stop" | "conclude" (the reasoning-loop check).
    word_kinds: int8 [vocab] table for the loop guard (`runtime.engine.thinking.WORD_*`): how
        each token's text relates to word boundaries; None = every token is a word.
    """

    starts_in_thinking: bool = False
    think_end_id: int = -1
    budget: Optional[int] = None
    close_ids: tuple[int, ...] = ()
    loop_guard: str = "off"
    word_kinds: Optional[np.ndarray] = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    thinking: ThinkingControl = field(default_factory=ThinkingControl)
    constraint: Optional[OutputConstraint] = None
    logprobs: int = 0  # number of top logprobs to return per token (0 = none)
    # Prompt positions where the prefix cache should snapshot the state (prefill chunks end
    # there): e.g. the start of the last user turn, where agents' edited histories diverge.
    # The chat layer knows them; the engine treats them as hints.
    snapshot_positions: tuple[int, ...] = ()
    # The prompt's images (`runtime.model.runner.MediaSpan`, placed by the text layer): passed
    # unchanged with every chunk and row of this request. Such a request bypasses the prefix
    # cache (its pad tokens do not name the pixels) and replays after a preemption.
    media: tuple = ()


class RequestRejected(Exception):
    """`Engine.submit` refused a request; nothing was queued. `code` is machine-readable:
    invalid_request, context_length_exceeded, kv_capacity_exceeded, queue_full,
    duplicate_request, thinking_budget_capacity_insufficient, engine_unavailable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RequestStats:
    """Timings and counters of one finished request (on its final `EngineOutput`).

    Times are seconds from `time.perf_counter()`; durations are derived from them. The phases
    to the first token follow each other (their sum is at most `ttft_s`; what is left is the
    admitting step's planning): queue_s, match_s, resume_s, prefill_s.
    queue_s: `Engine.submit` -> the scheduler admits it into a lane (prompt id checks, waiting
        for the engine thread's current step, waiting for a lane or pages); its first admission.
    match_s: looking up its prompt in the prefix cache at that admission (hashing the prompt's
        64-token blocks, finding the deepest snapshot; a disk-tier read included). 0 without a
        cache.
    resume_s: resuming from what matched: mapping the blocks and queuing the copies, then the
        copies themselves (snapshot state into the lane, host blocks promoted), run before the
        step's first chunk. 0 on a cold start.
    prefill_s: the resume's end (admission's, cold) -> first output token: its prefill chunks
        and the sampling of the first token, with everything else those steps run.
    prefill_steps / prefill_compute_s: the steps that computed a chunk of its prompt before its
        first token, and the time of those chunks' runner calls (the rest of prefill_s is the
        steps' host work: scheduling, cache bookkeeping, other requests' rows).
    ttft_s: submit -> first output token committed.
    first_decode_s: first -> second output token committed (its first decode step); 0 with
        fewer than two.
    decode_s: first output token -> finish.
    output_tokens: committed output tokens (inserted ones included).
    inserted_tokens: tokens the engine inserted without sampling.
    preemptions / replayed_tokens: times paused under KV pressure / tokens recomputed on resume.
    thinking_tokens: model-origin tokens while the think block was open.
    thinking_closed_by: "model", "budget", "loop" or "" (still open / no thinking).
    cached_tokens: prompt tokens taken from the prefix cache at its first admission.
    prefilled_tokens: tokens it computed in prefill chunks (the rest of the prompt, replays).
    resume_path: how it last started: "cold", "prefix" (a cached prefix), "snapshot" (its own
        pause point: no recomputation) or "replay" (recomputed after a pause).
    spec_rounds / drafted_tokens / accepted_tokens: speculative decoding: decode steps that
        verified drafts, the drafts they verified, and the drafts accepted (each round also
        commits one token sampled at its last kept position).
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    inserted_tokens: int = 0
    queue_s: float = 0.0
    match_s: float = 0.0
    resume_s: float = 0.0
    prefill_s: float = 0.0
    prefill_steps: int = 0
    prefill_compute_s: float = 0.0
    ttft_s: float = 0.0
    first_decode_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    preemptions: int = 0
    replayed_tokens: int = 0
    thinking_tokens: int = 0
    thinking_closed_by: str = ""
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    resume_path: str = "cold"
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Sampled tokens after the first one over the time after the first one (inserted
        tokens are computed in one chunk and would inflate the rate)."""
        sampled = self.output_tokens - self.inserted_tokens - 1
        return sampled / self.decode_s if self.decode_s > 0 and sampled > 0 else 0.0


@dataclass(frozen=True)
class EngineOutput:
    """An increment for one request. `token_ids` are newly committed ids (sampled or inserted);
    `inserted` marks which of them the engine inserted without sampling (thinking budget).
    The final increment has `finished=True`, the reason, and `stats`. Every increment carries
    `thinking_tokens` (model-origin tokens inside the think block so far) and, once the request
    was admitted, `queue_s` (submit -> first admission): a request cancelled by its client
    never gets `stats`, and its accounting must still be right."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    inserted: tuple[bool, ...] = ()
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: Optional[Sequence[dict]] = None
    stats: Optional[RequestStats] = None
    thinking_tokens: int = 0
    queue_s: Optional[float] = None
