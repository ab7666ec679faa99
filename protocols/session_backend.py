"""The backend over a `ModelSession`: submits a prepared job to the engine (preparing it:
`protocols.job_preparation`) and turns the engine's token increments into parser events on the
event loop; health, gauges, token counting, shutdown.

Threads: rendering, tokenizing and constraint compilation run in the default executor (they
can take tens of milliseconds on long prompts), never on the event loop. The engine calls our
sink on its own thread; the sink only hands the increment to the loop with
`call_soon_threadsafe`. Parsing (detokenizer, stop strings, Qwen output parser) then runs on
the loop, per request.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from protocols.errors import ApiError
from protocols.generation import Generation, GenerationResult, LogprobsDelta
from protocols.job import Capabilities, GenerationJob
from protocols.job_preparation import JobPreparation
from runtime.engine.api import EngineOutput, FinishReason, RequestRejected
from runtime.log import get_logger

log = get_logger("serve")

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
           FinishReason.CONTEXT: "context", FinishReason.CANCELLED: "cancelled",
           FinishReason.ERROR: "error"}
_REJECTED_STATUS = {"queue_full": 503, "engine_unavailable": 503}


# A prompt that cannot fit is refused before rendering when its message text alone, at the
# most bytes one token can stand for, needs more tokens than the context has (bytes >= chars).
# Token counting is refused only far beyond the context: clients count to decide to compact.
COUNTABLE_CONTEXTS = 8
# After preparing a prompt this long (characters), freed memory is handed back to the system:
# tokenizing megabytes allocates gigabytes that the C allocator would otherwise keep.
RELEASE_MEMORY_CHARS = 1 << 20


@dataclass
class _Running:
    """Per-request state kept on the event loop."""

    generation: Generation
    parser: Any
    submitted_at: float
    received_at: float
    top_logprobs: Optional[int] = None
    stop_hit: Any = None
    logprobs: list = field(default_factory=list)


def open_backend(settings) -> "SessionBackend":
    """Load the model named by the serve settings. Raises ConfigError for option mistakes;
    loading failures raise the artifact / model / text layers' own errors."""
    from runtime.session import ModelSession

    return SessionBackend(ModelSession.open(settings), settings)


class SessionBackend(JobPreparation):
    """Implements `protocols.generation.Backend` on a model session."""

    def __init__(self, session, settings, *, model_id: Optional[str] = None):
        self.session = session
        self.settings = settings
        self.model_id = model_id or settings.model_id or session.model_name
        self.max_context = session.max_context
        self.capabilities = Capabilities(logprobs=True, constraints=_constraints_available())
        self._running: dict[str, _Running] = {}
        self._closing = False
        self.max_token_chars = max(len(data) for data in session.tokenizer.token_bytes)
        if self.capabilities.constraints:
            # Built now, before serving: the build takes seconds and holds the GIL throughout,
            # so doing it on first use would stall the event loop (every stream) meanwhile.
            started = time.monotonic()
            try:
                session.constraint_compiler
            except Exception as exc:  # noqa: BLE001 - constrained requests will fail with it
                log.warning("constrained output unavailable: %s", exc)
                self.capabilities = Capabilities(logprobs=True, constraints=False)
            else:
                log.info("constraint compiler ready (%.1f s)", time.monotonic() - started)

    # --- Backend interface ------------------------------------------------------------------

    def healthy(self) -> bool:
        return self.session.engine.error is None

    def gauges(self) -> dict[str, float]:
        snapshot = self.session.engine.snapshot()
        return {"requests_waiting": snapshot.get("waiting", 0),
                "engine_requests_running": snapshot.get("running", 0),
                "kv_pages_total": snapshot.get("kv_pages_total", 0),
                "kv_pages_in_use": snapshot.get("kv_pages_total", 0)
                - snapshot.get("kv_pages_free", 0),
                "engine_preemptions_total": snapshot.get("preemptions", 0),
                "engine_spec_rounds_total": snapshot.get("spec_rounds", 0),
                "engine_spec_drafted_tokens_total": snapshot.get("spec_drafted_tokens", 0),
                "engine_spec_accepted_tokens_total": snapshot.get("spec_accepted_tokens", 0),
                # hits, misses, evictions, tier bytes, host<->device traffic (engine names)
                **{name: value for name, value in snapshot.items()
                   if name.startswith("prefix_cache_")}}

    async def count_tokens(self, job: GenerationJob) -> int:
        self._refuse_beyond(job, COUNTABLE_CONTEXTS * self.max_context)
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(None, _releasing_memory, job, self._render, job)
        return len(prompt.ids)

    async def start(self, job: GenerationJob, request_id: str,
                    received_at: float) -> Generation:
        if self._closing:
            raise ApiError(503, "the server is shutting down", retry_after=1)
        handed_at = time.monotonic()
        self._refuse_beyond(job, self.max_context)
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(None, _releasing_memory, job, self._prepare, job,
                                              request_id)
        session = self.session
        parser = prepared.parser
        seed = prepared.request.sampling.seed if prepared.request else 0
        generation = Generation(request_id, prompt_tokens=prepared.prompt_tokens, seed=seed,
                                max_tokens=prepared.request.max_new_tokens if prepared.request
                                else 0, cancel=lambda: session.engine.cancel(request_id),
                                started_at=received_at)
        generation.phases.update(prepare_wait=prepared.started_at - handed_at, **prepared.phases)
        if prepared.request is None:  # max tokens 0: the prompt is checked, nothing generated
            generation.finish(GenerationResult(finish_reason="length",
                                               prompt_tokens=prepared.prompt_tokens))
            return generation
        running = _Running(generation, parser, time.monotonic(), received_at,
                           top_logprobs=job.top_logprobs)
        generation.phases["submit"] = running.submitted_at - prepared.done_at

        def sink(output: EngineOutput) -> None:  # engine thread
            loop.call_soon_threadsafe(self._on_output, running, output)

        try:
            session.engine.submit(prepared.request, sink)
        except RequestRejected as exc:
            raise _rejected(exc) from None
        self._running[request_id] = running
        return generation

    def shutdown(self) -> None:
        """End everything in flight with an in-band error (the server is stopping)."""
        self._closing = True
        for request_id, running in list(self._running.items()):
            generation = running.generation
            generation.finish(GenerationResult(
                finish_reason="error", error="the server is shutting down", error_status=503,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens))
            self.session.engine.cancel(request_id)
        self._running.clear()

    def close(self) -> None:
        self.session.close()

    def _refuse_beyond(self, job: GenerationJob, tokens: int) -> None:
        """400 before rendering when the messages' text alone needs more than `tokens`."""
        at_least = message_chars(job) // self.max_token_chars
        if at_least >= tokens:
            raise ApiError(400, f"prompt is too long: at least {at_least} tokens > "
                                f"{self.max_context - 1} maximum", param="messages",
                           code="context_length_exceeded")

    # --- outputs (event loop) ---------------------------------------------------------------

    def _on_output(self, running: _Running, output: EngineOutput) -> None:
        generation = running.generation
        if output.finished:
            self._running.pop(generation.request_id, None)
        if generation.done:  # ended on our side already (client gone, server stopping)
            return
        parser = running.parser
        events = parser.feed(output.token_ids) if output.token_ids else []
        if output.logprobs and running.top_logprobs is not None:
            events = events + [self._logprobs(output.logprobs, running.top_logprobs)]
        if parser.stopped is not None and running.stop_hit is None:
            running.stop_hit = parser.stopped
            if not output.finished:
                self.session.engine.cancel(generation.request_id)
        generation.reasoning_tokens = output.thinking_tokens
        if output.queue_s is not None:
            generation.queue_wait_s = output.queue_s
        generation.publish(events, new_tokens=len(output.token_ids))
        if output.finished:
            self._finish(running, output)

    def _finish(self, running: _Running, output: EngineOutput) -> None:
        generation = running.generation
        reason = _FINISH.get(output.finish_reason, "error")
        stop_sequence = None
        if running.stop_hit is not None:
            reason = "stop"  # our cancel after a stop string, or the engine's own stop
            if running.stop_hit.kind == "stop_string":
                stop_sequence = str(running.stop_hit.value)
        truncated = reason in ("length", "context", "cancelled", "error")
        tail = running.parser.finish(truncated)
        if tail:
            generation.publish(tail)
        stats = output.stats
        delay = running.submitted_at - running.received_at
        if stats is not None:
            _engine_phases(generation, stats, running.submitted_at)
        generation.finish(GenerationResult(
            finish_reason=reason, stop_sequence=stop_sequence,
            prompt_tokens=output.prompt_tokens or generation.prompt_tokens,
            cached_prompt_tokens=output.cached_prompt_tokens,
            completion_tokens=stats.output_tokens if stats else generation.completion_tokens,
            reasoning_tokens=stats.thinking_tokens if stats else 0,
            error=output.error, error_status=500,
            queue_wait_s=stats.queue_s if stats else None,
            spec_rounds=stats.spec_rounds if stats else 0,
            drafted_tokens=stats.drafted_tokens if stats else 0,
            accepted_tokens=stats.accepted_tokens if stats else 0,
            prefilled_tokens=stats.prefilled_tokens if stats else 0,
            resume_path=stats.resume_path if stats else "cold",
            ttft_s=(stats.ttft_s + delay) if stats and stats.output_tokens else None,
            decode_s=stats.decode_s if stats else None,
            prefill_steps=stats.prefill_steps if stats else 0,
            prefill_compute_s=stats.prefill_compute_s if stats else None,
            first_decode_s=stats.first_decode_s if stats and stats.output_tokens > 1 else None))

    def _logprobs(self, entries, top: int) -> LogprobsDelta:
        token_bytes = self.session.tokenizer.token_bytes
        converted = []
        for entry in entries:
            converted.append(_logprob_entry(token_bytes, entry["token_id"], entry["logprob"],
                                            [(alt["token_id"], alt["logprob"])
                                             for alt in entry.get("top_logprobs", [])[:top]]))
        return LogprobsDelta(tuple(converted))


def _engine_phases(generation: Generation, stats, submitted_at: float) -> None:
    """The engine's phases (`RequestStats`) and the hop of its first token to the event loop:
    the engine's clock starts at its `submit`, just after `submitted_at` (so `deliver` may
    include a few microseconds of it, never less than the hop)."""
    if not stats.output_tokens:             # it never got to a first token: no phase ended
        return
    generation.phases.update(queue=stats.queue_s, match=stats.match_s, resume=stats.resume_s,
                             prefill=stats.prefill_s)
    if generation.first_token_at is not None:
        generation.phases["deliver"] = max(
            0.0, generation.first_token_at - submitted_at - stats.ttft_s)


def _logprob_entry(token_bytes, token_id: int, logprob: float, top: list) -> dict:
    def one(tid: int, value: float) -> dict:
        data = token_bytes[tid] if 0 <= tid < len(token_bytes) else b""
        return {"token": data.decode("utf-8", "replace"), "logprob": value,
                "bytes": list(data)}

    entry = one(token_id, logprob)
    entry["top_logprobs"] = [one(tid, value) for tid, value in top]
    return entry


def message_chars(job: GenerationJob) -> int:
    """Characters of the messages' text (string contents and text parts): text every chat
    template renders, so a lower bound of the rendered prompt's length."""
    total = 0
    for message in job.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def _releasing_memory(job: GenerationJob, work, *args):
    """`work(*args)`; after a long prompt, hand freed memory back to the system."""
    try:
        return work(*args)
    finally:
        if message_chars(job) >= RELEASE_MEMORY_CHARS:
            _trim_heap()


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _constraints_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _rejected(exc: RequestRejected) -> ApiError:
    code = exc.code
    status = _REJECTED_STATUS.get(code, 400)
    if code == "queue_full":
        return ApiError(503, f"the server is busy: {exc}; retry later", code="server_overloaded",
                        retry_after=1)
    if code == "engine_unavailable":
        return ApiError(503, str(exc), code="engine_unavailable")
    if code in ("context_length_exceeded", "kv_capacity_exceeded"):
        return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
    if code == "thinking_budget_capacity_insufficient":
        return ApiError(400, str(exc), param="max_tokens", code=code)
    return ApiError(status, str(exc), code=code)
