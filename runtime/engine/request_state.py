"""One request's generation policy on the engine thread: sample, commit, decide the finish.

`LiveRequest.step(logits)` turns the logits row of a sampling step into committed token ids
(`step_sampled(token)` does the same for a token the runner sampled on its device): the sampled
token, plus the thinking close span when the budget or the loop guard asks for it.
It also decides whether the request ends there. Priorities at one boundary, highest first:
stop token, output limit (`length`), context limit (`context`), then the thinking controls.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from runtime.engine.api import EngineOutput, EngineRequest, FinishReason, RequestStats
from runtime.engine.sampler import SamplerState, sample_token, token_logprobs
from runtime.engine.thinking import ThinkingAction, ThinkingTracker

OutputSink = Callable[[EngineOutput], None]


@dataclass
class StepResult:
    """What one sampling step committed for one request."""

    token_ids: tuple[int, ...]
    inserted: tuple[bool, ...]
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[list[dict]] = None


class LiveRequest:
    """Engine-thread state of one submitted request (never touched by other threads)."""

    def __init__(self, request: EngineRequest, sink: OutputSink, max_context: int,
                 submitted_at: Optional[float] = None):
        """submitted_at: `time.perf_counter()` when `Engine.submit` took it (now if None)."""
        self.request = request
        self.sink = sink
        self.max_context = max_context
        self.sampler = SamplerState(request.sampling)
        self.thinking = ThinkingTracker(request.thinking)
        self.output_ids: list[int] = []
        self.inserted_count = 0
        self.finished = False
        self.suspect = False              # its decode batch failed: decode it alone (isolation)
        # Phase boundaries (perf_counter; `RequestStats` documents the phases): submitted, the
        # admitting step began, its match and resume done (prefill begins), first and second
        # output tokens committed.
        self.submitted_at = time.perf_counter() if submitted_at is None else submitted_at
        self.admitted_at: Optional[float] = None
        self.prefill_from: Optional[float] = None
        self.first_token_at: Optional[float] = None
        self.second_token_at: Optional[float] = None
        self.match_s = 0.0
        self.resume_s = 0.0
        self.prefill_steps = 0            # steps with a chunk of its prompt before its first token
        self.prefill_compute_s = 0.0      # their chunks' runner calls
        self.preemptions = 0
        self.replayed_tokens = 0
        self.cached_tokens = 0            # prompt tokens its first admission took from the cache
        self.resume_path = "cold"         # how it last started (`SequenceRecord.resume_path`)
        self.prefilled_tokens = 0         # tokens it computed in prefill chunks (replays included)
        self.spec_rounds = 0              # speculative rounds: decode steps that verified drafts
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def total_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    # --- commit -----------------------------------------------------------------------------

    def _commit(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.sampler.observe(token_id)
        if self.request.constraint is not None:
            self.request.constraint.commit(token_id)

    def limit_reason(self, extra: int = 0) -> Optional[FinishReason]:
        """The limit the request has reached, or will have reached after `extra` more tokens."""
        if len(self.output_ids) + extra >= self.request.max_new_tokens:
            return FinishReason.LENGTH
        if self.total_len + extra >= self.max_context:
            return FinishReason.CONTEXT
        return None

    def step(self, logits: np.ndarray, mask_future: Optional[Future] = None) -> StepResult:
        """Sample the next token from `logits` [V] and commit what follows from it.

        mask_future: the constraint's packed mask for this token, already being computed
        elsewhere (the engine overlaps it with the runner); computed here when not given."""
        request = self.request
        mask = None
        if mask_future is not None:
            mask = mask_future.result()
        elif request.constraint is not None:
            mask = request.constraint.allowed_bitmask_u32(logits.shape[0])
        token = sample_token(logits, self.sampler, mask)
        logprobs = None
        if request.logprobs:
            lp = token_logprobs(logits, token, request.logprobs)
            logprobs = [{"token_id": lp.token_id, "logprob": lp.logprob,
                         "top_logprobs": [{"token_id": i, "logprob": v} for i, v in lp.top]}]
        return self._after_sample(token, logprobs)

    def step_sampled(self, token_id: int) -> StepResult:
        """Commit a token a runner sampled on its device from `sampler.row_sampling()`'s inputs
        (`DEAD_END`: the constraint allowed nothing, raised as `DeadEndError`)."""
        return self._after_sample(self.sampler.took(token_id), None)

    def _after_sample(self, token: int, logprobs: Optional[list[dict]]) -> StepResult:
        request = self.request
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        elif self.second_token_at is None:
            self.second_token_at = time.perf_counter()
        self._commit(token)
        tokens, inserted = [token], [False]
        action = self.thinking.on_model_token(token)

        if token in request.stop_token_ids:
            return StepResult(tuple(tokens), tuple(inserted), FinishReason.STOP, logprobs)
        reason = self.limit_reason()
        if reason is not None:
            return StepResult(tuple(tokens), tuple(inserted), reason, logprobs)
        if action is ThinkingAction.STOP:
            return StepResult(tuple(tokens), tuple(inserted), FinishReason.STOP, logprobs)
        if action is ThinkingAction.INSERT_CLOSE:
            close = request.thinking.close_ids
            if len(self.output_ids) + len(close) > request.max_new_tokens:
                # Only the loop guard can get here (the budget was checked at submit): never
                # truncate the span, end at the output limit instead.
                return StepResult(tuple(tokens), tuple(inserted), FinishReason.LENGTH, logprobs)
            if self.total_len + len(close) >= self.max_context:
                return StepResult(tuple(tokens), tuple(inserted), FinishReason.CONTEXT, logprobs)
            for close_id in close:
                self._commit(close_id)
                tokens.append(close_id)
                inserted.append(True)
            self.inserted_count += len(close)
            self.thinking.on_inserted_close()
            if logprobs is not None:
                # Forced, not sampled: probability 1 under the engine's policy.
                logprobs.extend({"token_id": t, "logprob": 0.0, "top_logprobs": []}
                                for t in close)
            reason = self.limit_reason()
        return StepResult(tuple(tokens), tuple(inserted), reason, logprobs)

    # --- publishing -------------------------------------------------------------------------

    def stats(self) -> RequestStats:
        now = time.perf_counter()
        admitted = self.admitted_at if self.admitted_at is not None else now
        prefill_from = self.prefill_from if self.prefill_from is not None else admitted
        first = self.first_token_at
        second = self.second_token_at
        closed_by = ""
        if self.thinking.inserted_close:
            closed_by = "loop" if self.thinking.loop_detected else "budget"
        elif self.request.thinking.starts_in_thinking and not self.thinking.open:
            closed_by = "model"
        return RequestStats(
            prompt_tokens=len(self.request.prompt_ids),
            output_tokens=len(self.output_ids),
            inserted_tokens=self.inserted_count,
            queue_s=admitted - self.submitted_at,
            match_s=self.match_s,
            resume_s=self.resume_s,
            prefill_s=(first - prefill_from) if first is not None else 0.0,
            prefill_steps=self.prefill_steps,
            prefill_compute_s=self.prefill_compute_s,
            ttft_s=(first - self.submitted_at) if first is not None else 0.0,
            first_decode_s=(second - first) if second is not None else 0.0,
            decode_s=(now - first) if first is not None else 0.0,
            total_s=now - self.submitted_at,
            preemptions=self.preemptions,
            replayed_tokens=self.replayed_tokens,
            thinking_tokens=self.thinking.model_tokens,
            thinking_closed_by=closed_by,
            cached_tokens=self.cached_tokens,
            prefilled_tokens=self.prefilled_tokens,
            resume_path=self.resume_path,
            spec_rounds=self.spec_rounds,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
        )

    @property
    def queue_s(self) -> Optional[float]:
        """Submit -> first admission; None while still waiting."""
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at

    def progress_output(self, step: StepResult) -> EngineOutput:
        """The increment of a step that did not end the request."""
        return EngineOutput(request_id=self.request_id, token_ids=step.token_ids,
                            inserted=step.inserted, prompt_tokens=len(self.request.prompt_ids),
                            cached_prompt_tokens=self.cached_tokens,
                            logprobs=step.logprobs, thinking_tokens=self.thinking.model_tokens,
                            queue_s=self.queue_s)

    def publish(self, output: EngineOutput) -> None:
        self.sink(output)

    def final_output(self, reason: FinishReason, *, token_ids: tuple[int, ...] = (),
                     inserted: tuple[bool, ...] = (), error: Optional[str] = None,
                     logprobs: Optional[list[dict]] = None) -> EngineOutput:
        self.finished = True
        return EngineOutput(request_id=self.request_id, token_ids=token_ids, inserted=inserted,
                            finished=True, finish_reason=reason, error=error,
                            prompt_tokens=len(self.request.prompt_ids), logprobs=logprobs,
                            cached_prompt_tokens=self.cached_tokens, stats=self.stats(), thinking_tokens=self.thinking.model_tokens,
                            queue_s=self.queue_s)
