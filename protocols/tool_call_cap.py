"""The tool-call cap: a generation ends once it has produced the number of complete tool calls
the request allows (`parallel_tool_calls: false`, `max_tool_calls`); the model's later output
is dropped, and the cancellation that ends it reports as a normal stop."""

from __future__ import annotations

from typing import Optional

from protocols.generation import Generation, GenerationResult
from protocols.job import GenerationJob
from runtime.text.events import ParserEvent, ToolCallEnd


class ToolCallCap:
    """Ends a generation once `limit` tool calls are complete (parallel_tool_calls=false,
    max_tool_calls); later events are dropped and the cancellation counts as a normal stop."""

    def __init__(self, limit: Optional[int]):
        self.limit = limit
        self.finished_calls = 0
        self.reached = False

    def filter(self, events: list[ParserEvent], generation: Generation) -> list[ParserEvent]:
        if self.limit is None:
            return events
        if self.reached:
            return []
        kept = []
        for event in events:
            kept.append(event)
            if isinstance(event, ToolCallEnd):
                self.finished_calls += 1
                if self.finished_calls >= self.limit:
                    self.reached = True
                    generation.cancel()
                    break
        return kept

    def settle(self, result: GenerationResult) -> GenerationResult:
        if self.reached and result.finish_reason == "cancelled":
            result.finish_reason = "stop"
        return result


def call_limit(job: GenerationJob) -> Optional[int]:
    """The number of tool calls after which `job` ends: the smaller of max_tool_calls and 1 for
    parallel_tool_calls=false; None when neither is set."""
    limits = [limit for limit in (job.max_tool_calls, None if job.parallel_tool_calls else 1)
              if limit is not None]
    return min(limits) if limits else None
