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
    """A compiled output constraint for one request (runtime/text/constraints.py implements it).

    The engine asks for the allowed-token mask before sampling each answer token and commits the
    sampled token afterwards. `allowed_mask` returns None while unconstrained (e.g. inside the
    think block) or a bool array [vocab_size] of allowed ids.
    """

    def allowed_mask(self, vocab_size: int) -> Optional[np.ndarray]: ...

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
    """

    starts_in_thinking: bool = False
    think_end_id: int = -1
    budget: Optional[int] = None
    close_ids: tuple[int, ...] = ()
    loop_guard: str = "off"


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


@dataclass(frozen=True)
class EngineOutput:
    """An increment for one request. `token_ids` are newly committed ids (sampled or inserted);
    `inserted` marks which of them the engine inserted without sampling (thinking budget)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    inserted: tuple[bool, ...] = ()
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    logprobs: Optional[Sequence[dict]] = None
