"""A running generation as the API layer sees it, and the backend interface behind it.

The backend (the model session bridge, or a scripted fake in tests) starts a `Generation` for a
`GenerationJob` and publishes parser events into it from the event-loop thread; the API handler
consumes them with `updates()`, which yields batches of events, or an empty batch when nothing
arrived for `heartbeat_s` (the encoders turn that into a protocol heartbeat). Publishing never
blocks: a slow client only makes batches larger (adjacent deltas are merged), so the engine is
never held up by a socket.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Protocol

from protocols.job import GenerationJob
from runtime.text.events import ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta

FINISH_REASONS = ("stop", "length", "context", "cancelled", "error")

PHASES = ("receive", "parse", "prepare_wait", "render", "tokenize", "setup", "submit", "queue", "match",
          "resume", "prefill", "deliver", "first_write")
"""Where a request's time to its first output goes, in order (`Generation.phases`: seconds per
phase, each measured once with `time.perf_counter()` / `monotonic()` at its boundaries; they
follow each other, so they sum to at most the time from the request's head parsed to its first
output written):

receive: the body, from the head parsed to its last byte (the client sending it, the server
    reading it).
parse: the JSON body and the API's validation into a job.
prepare_wait: the context pre-check and waiting for an executor thread.
render: the chat template rendered to text (images decoded).
tokenize: that text tokenized.
setup: the output constraint compiled, the output parser, sampling and the engine request.
submit: back to the event loop, up to `Engine.submit`.
queue, match, resume, prefill: the engine's (`runtime.engine.api.RequestStats`): waiting for a
    lane, the prefix-cache lookup, resuming from what matched, the prefill to the first token.
deliver: the first token from the engine thread to the event loop, through the output parser.
first_write: from there to the first output bytes handed to the socket (streams only; a first
    token that makes no text yet, such as `<think>`, waits for the next).

A phase a request did not reach (cancelled, an error, a backend without an engine) is absent."""


@dataclass(frozen=True)
class LogprobsDelta:
    """Log probabilities of newly generated tokens (only when the request asked for them), in
    the OpenAI shape: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]} per token. Travels with the parser events; encoders without logprobs skip it."""

    entries: tuple


@dataclass
class GenerationResult:
    """How a generation ended, with its accounting.

    finish_reason: stop (EOS, stop token or stop string), length (max tokens), context (context
        window full), cancelled, error.
    stop_sequence: the stop string that ended it, if any.
    prompt_tokens includes cached_prompt_tokens (OpenAI convention; the Anthropic encoder
        subtracts). completion_tokens includes reasoning_tokens.
    error / error_status: for finish_reason "error" (sent in-band once streaming has begun).
    Times in seconds: queue_wait (submit to admission, when the engine reports it), ttft
        (request received to first output token), decode (first to last token).
    """

    finish_reason: str = "stop"
    stop_sequence: Optional[str] = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    error: Optional[str] = None
    error_status: int = 500
    queue_wait_s: Optional[float] = None
    ttft_s: Optional[float] = None
    decode_s: Optional[float] = None
    spec_rounds: int = 0              # speculative decoding: rounds, drafts verified, accepted
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefilled_tokens: int = 0         # prompt tokens computed (the rest came from the cache)
    resume_path: str = "cold"         # cold, prefix, snapshot or replay (RequestStats)
    prefill_steps: int = 0            # engine steps and runner time of its prefill, and its
    prefill_compute_s: Optional[float] = None   # first decode step (RequestStats)
    first_decode_s: Optional[float] = None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        if not self.decode_s or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


class Generation:
    """One request in flight. Producer methods (`publish`, `finish`) and consumer methods
    (`updates`, `cancel`) all run on the event-loop thread."""

    def __init__(self, request_id: str, *, prompt_tokens: int, seed: int, max_tokens: int,
                 cancel: Callable[[], None] = lambda: None,
                 started_at: Optional[float] = None):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.seed = seed
        self.max_tokens = max_tokens
        self.started_at = started_at if started_at is not None else time.monotonic()
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.completion_tokens = 0
        # Kept current by the backend while tokens arrive, so that a generation cut short by
        # its client (no final result from the engine) is still accounted for.
        self.reasoning_tokens = 0
        self.queue_wait_s: Optional[float] = None
        self.phases: dict[str, float] = {}      # `PHASES` reached so far: name -> seconds
        self.result: Optional[GenerationResult] = None
        self._cancel = cancel
        self._pending: list[ParserEvent] = []
        self._wakeup = asyncio.Event()

    # --- producer ---------------------------------------------------------------------------

    def publish(self, events: list[ParserEvent], new_tokens: int = 0) -> None:
        if self.result is not None:
            return
        if new_tokens:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.completion_tokens += new_tokens
        if events:
            self._pending.extend(events)
            self._wakeup.set()

    def finish(self, result: GenerationResult) -> None:
        if self.result is not None:
            return
        if result.ttft_s is None and self.first_token_at is not None:
            result.ttft_s = self.first_token_at - self.started_at
        if result.decode_s is None and self.first_token_at is not None:
            result.decode_s = (self.last_token_at or self.first_token_at) - self.first_token_at
        self.result = result
        self._wakeup.set()

    def ordered_phases(self) -> dict[str, float]:
        """`phases` in `PHASES` order (they are recorded out of order: first_write before the
        engine's, which come with its final output)."""
        return {name: self.phases[name] for name in PHASES if name in self.phases}

    # --- consumer ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.result is not None

    def cancel(self) -> None:
        """Stop generating (client gone, or enough output); idempotent."""
        if self.result is None:
            self._cancel()

    async def updates(self, heartbeat_s: float = 5.0) -> AsyncIterator[list[ParserEvent]]:
        """Batches of events until the generation finishes; [] after `heartbeat_s` of silence."""
        while True:
            if self._pending:
                batch, self._pending = coalesce(self._pending), []
                yield batch
                continue
            if self.result is not None:
                return
            self._wakeup.clear()
            try:
                async with asyncio.timeout(heartbeat_s):
                    await self._wakeup.wait()
            except TimeoutError:
                yield []


def coalesce(events: list[ParserEvent]) -> list[ParserEvent]:
    """Merge adjacent text deltas of the same kind (and argument pieces of the same call)."""
    merged: list[ParserEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, LogprobsDelta) and isinstance(last, LogprobsDelta):
            merged[-1] = LogprobsDelta(last.entries + event.entries)
        elif (isinstance(event, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta)
              and last.index == event.index):
            merged[-1] = ToolCallArgsDelta(event.index, last.json_fragment + event.json_fragment)
        else:
            merged.append(event)
    return merged


class Backend(Protocol):
    """What the API layer needs from the model side.

    model_id: the public model name. max_context: the context window in tokens.
    start(): validate against the model (template, context room), submit, return the running
        generation; raises ApiError (400 context_length_exceeded, 503 overloaded, ...).
    count_tokens(): prompt tokens the job would use (Anthropic count_tokens, Responses
        input_tokens); the same rendering as start().
    healthy(): False after an engine-wide failure (/health answers 503).
    gauges(): point-in-time numbers for /metrics, e.g. {"kv_pages_in_use": 12, ...}; a name
        ending in `_total` is a count since start (exported as a counter).
    shutdown(): cancel everything in flight (server stopping).
    close(): release the model (after the server stopped).
    """

    model_id: str
    max_context: int

    async def start(self, job: GenerationJob, request_id: str,
                    received_at: float) -> Generation: ...

    async def count_tokens(self, job: GenerationJob) -> int: ...

    def healthy(self) -> bool: ...

    def gauges(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...

    def close(self) -> None: ...
