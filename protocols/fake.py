"""A scripted backend with no model: plays parser events with chosen timing. Used by the
server tests (every protocol path without a model) and handy for client development.

`Script` says what one generation produces; `FakeBackend(script_for)` picks the script per
job. Lanes are simulated: at most `lanes` scripts play at once, the rest wait in FIFO order,
so queueing, cancellation and lane release can be observed (`active`, `cancelled`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from protocols.errors import ApiError
from protocols.generation import Generation, GenerationResult
from protocols.job import Capabilities, GenerationJob
from runtime.text.events import (ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart)


@dataclass
class Script:
    """events: played one per step; each counts as one output token.
    finish_reason: how it ends when all events were played (stop, length, context, error).
    prefill_s: delay before the first event; step_s: delay between events.
    error: message for finish_reason "error"; prompt_tokens / cached_tokens: accounting.
    stop_sequence: reported with finish_reason "stop"."""

    events: list = field(default_factory=list)
    finish_reason: str = "stop"
    prefill_s: float = 0.0
    step_s: float = 0.0
    error: Optional[str] = None
    prompt_tokens: int = 12
    cached_tokens: int = 0
    stop_sequence: Optional[str] = None


def default_script(job: GenerationJob) -> Script:
    """Reasoning then text; with tools and a user turn last, a call to the first tool."""
    events: list[ParserEvent] = [ReasoningDelta("Let me "), ReasoningDelta("think.")]
    last = job.messages[-1]["role"] if job.messages else "user"
    if job.tools and last == "user":
        name = job.tools[0]["function"]["name"]
        events += [ContentDelta("Calling a tool."), ToolCallStart(0, "call_fake0", name),
                   ToolCallArgsDelta(0, '{"city": '), ToolCallArgsDelta(0, '"Paris"}'),
                   ToolCallEnd(0)]
    elif last == "tool":
        events += [ContentDelta("The tool said: "), ContentDelta(str(job.messages[-1]["content"]))]
    else:
        events += [ContentDelta("Hello"), ContentDelta(" from"), ContentDelta(" the fake.")]
    limit = job.max_tokens
    if limit is not None and limit < len(events):
        return Script(events=events[:limit], finish_reason="length")
    return Script(events=events)


class FakeBackend:
    def __init__(self, script_for: Union[Script, Callable[[GenerationJob], Script]] = default_script,
                 *, model_id: str = "fake-model", max_context: int = 4096, lanes: int = 1,
                 capabilities: Capabilities = Capabilities(constraints=True)):
        self.script_for = script_for
        self.model_id = model_id
        self.max_context = max_context
        self.lanes = lanes
        self.capabilities = capabilities
        self.jobs: list[GenerationJob] = []
        self.active: set[str] = set()      # generations holding a lane
        self.waiting = 0
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self._lane_free: Optional[asyncio.Semaphore] = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._generations: dict[str, Generation] = {}
        self.unhealthy = False

    def healthy(self) -> bool:
        return not self.unhealthy

    def gauges(self) -> dict[str, float]:
        return {"lanes_in_use": len(self.active), "requests_waiting": self.waiting,
                "kv_pages_in_use": 2 * len(self.active), "kv_pages_total": 64}

    async def count_tokens(self, job: GenerationJob) -> int:
        text = "".join(str(m.get("content", "")) for m in job.messages)
        return max(1, len(text) // 4) + 3 * len(job.messages)

    async def start(self, job: GenerationJob, request_id: str,
                    received_at: float) -> Generation:
        script = self.script_for if isinstance(self.script_for, Script) else self.script_for(job)
        if script.prompt_tokens > self.max_context:
            raise ApiError(400, f"prompt is too long: {script.prompt_tokens} tokens > "
                                f"{self.max_context} maximum", param="messages",
                           code="context_length_exceeded")
        self.jobs.append(job)
        if self._lane_free is None:
            self._lane_free = asyncio.Semaphore(self.lanes)
        generation = Generation(request_id, prompt_tokens=script.prompt_tokens,
                                seed=job.sampling.seed if job.sampling.seed is not None else 0,
                                max_tokens=job.max_tokens or 4096,
                                cancel=lambda: self._cancel(request_id),
                                started_at=received_at)
        self._generations[request_id] = generation
        self._tasks[request_id] = asyncio.get_running_loop().create_task(
            self._play(generation, script))
        return generation

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            task.cancel()

    async def _play(self, generation: Generation, script: Script) -> None:
        request_id = generation.request_id
        submitted = time.monotonic()
        queue_wait = None
        tokens = 0
        holding = False
        self.waiting += 1
        try:
            await self._lane_free.acquire()
            holding = True
            self.waiting -= 1
            self.active.add(request_id)
            queue_wait = generation.queue_wait_s = time.monotonic() - submitted
            await asyncio.sleep(script.prefill_s)
            for event in script.events:
                if isinstance(event, ReasoningDelta):
                    generation.reasoning_tokens += 1
                generation.publish([event], new_tokens=1)
                tokens += 1
                await asyncio.sleep(script.step_s)
            reasoning = sum(1 for e in script.events if isinstance(e, ReasoningDelta))
            generation.finish(GenerationResult(
                finish_reason=script.finish_reason, stop_sequence=script.stop_sequence,
                prompt_tokens=script.prompt_tokens, cached_prompt_tokens=script.cached_tokens,
                completion_tokens=tokens, reasoning_tokens=reasoning,
                error=script.error, queue_wait_s=queue_wait))
            self.finished.append(request_id)
        except asyncio.CancelledError:
            if not holding:
                self.waiting -= 1
            self.cancelled.append(request_id)
            generation.finish(GenerationResult(
                finish_reason="cancelled", prompt_tokens=script.prompt_tokens,
                completion_tokens=tokens, queue_wait_s=queue_wait))
        finally:
            if holding:
                self.active.discard(request_id)
                self._lane_free.release()
            self._tasks.pop(request_id, None)
            self._generations.pop(request_id, None)

    def close(self) -> None:
        pass

    def shutdown(self) -> None:
        for request_id, generation in list(self._generations.items()):
            generation.finish(GenerationResult(
                finish_reason="error", error="the server is shutting down", error_status=503,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens))
            self._cancel(request_id)
