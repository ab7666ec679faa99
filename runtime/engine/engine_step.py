"""One step's runner calls: a `ScheduledBatch` computed on the model runner (engine thread only).

Prefill chunks run one call each (`reset_slot` first for a sequence that starts at position 0);
decode rows run batched in groups. A runner with `samples_on_device` (the CUDA runner, when its
sampling kernels were built) samples decode rows itself (`decode_sampled`) from `RowSampling`
inputs built here, the same decision the host sampler makes, and only ids come back; so does the
token after a prompt chunk (`prefill_sampled`). Rows asking for logprobs keep the logits path.
With speculative decoding on, a decode group with drafts to verify (or MTP, which drafts every
step) is one verification round (`Speculation.run`), accepted and committed on the runner before
the engine commits its tokens; a group with nothing to verify decodes as plain rows, and so does
a group whose step the runner computed ahead (n-gram drafting computes plain steps ahead while
nothing matches: a match appearing at the sampled token starts its rounds one step later rather
than drop a whole forward pass).
Output-constraint masks of the step's sampled rows depend only on tokens already committed, so
a worker thread computes them while the runner works (llguidance and the runners release the
GIL) instead of after the logits arrive; the device path asks for them once the forward pass
is queued.

Failure isolation of the runner calls: a failed prefill chunk ends its one request. A failed
batched decode says nothing about which row is at fault, so every member is paused, rebuilt by
replaying its committed tokens, and decoded alone until a step succeeds: a row that fails alone
ends with `error`, the others continue.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from runtime.engine.request_state import LiveRequest
from runtime.engine.scheduler import Scheduler
from runtime.engine.scheduler_records import ScheduledBatch
from runtime.engine.speculative import RoundOutcome, Speculation
from runtime.model.runner import ModelRunner
from runtime.model.sampling import RowSampling

# How the engine ends a request on an exception (`Engine._failed`): the request, the stage that
# failed ("prefill", "decode") and the exception.
FailRequest = Callable[[LiveRequest, str, Exception], None]


@dataclass
class StepCompute:
    """What one step's runner calls produced, per request id, for the engine to commit.

    logits: rows sampled on the host: the last logits row of their unit.
    sampled: ids the runner sampled on its device.
    sampling_errors: rows whose device-sampling inputs failed (their constraint's mask); the
        request ends with the error.
    rounds: speculative decode units (already accepted and committed on the runner).
    masks: constraint mask futures of the step's sampled rows.
    """

    logits: dict[str, np.ndarray]
    sampled: dict[str, int]
    sampling_errors: dict[str, Exception]
    rounds: dict[str, RoundOutcome]
    masks: dict[str, Future]


class StepExecutor:
    """Runs the runner calls of a step and counts them; the engine commits what they produced.

    live: the engine's table of requests, shared (requests ended during the step leave it).
    counters: the engine's counters, shared (`Engine.snapshot`).
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler,
                 speculation: Optional[Speculation], live: dict[str, LiveRequest],
                 counters: dict[str, int], device_sampling: bool, fail: FailRequest,
                 logger=None):
        self.runner = runner
        self.scheduler = scheduler
        self.speculation = speculation
        self._live = live
        self._counters = counters
        self._device_sampling = device_sampling
        self._fail = fail
        self._logger = logger
        # One worker: masks of one step are computed in order, and never while the engine
        # thread commits a token to the same constraint (it waits for the mask first).
        self._mask_worker = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="infernix-masks")
        # The decode rows the last step asked the runner to compute ahead: (request id,
        # position) in row order, or None.
        self._ahead: Optional[tuple[tuple[str, int], ...]] = None

    def close(self) -> None:
        self._mask_worker.shutdown(wait=False, cancel_futures=True)

    def run(self, batch: ScheduledBatch) -> StepCompute:
        runner = self.runner
        masks = self._start_masks(batch)
        rows: dict[str, np.ndarray] = {}
        sampled: dict[str, int] = {}
        sampling_errors: dict[str, Exception] = {}
        for work in batch.prefills:
            live = self._live[work.request_id]
            started = time.perf_counter()
            try:
                if self.speculation is not None:
                    self.speculation.catch_up(work.request_id, work.slot, work.start_pos,
                                              work.page_table)
                if work.reset_slot:
                    runner.reset_slot(work.slot)
                if work.samples and self._samples_on_device([work]):
                    sampled[work.request_id] = int(runner.prefill_sampled(
                        _with_media(work.chunk(), live), lambda work=work: self._row_sampling([work], masks, sampling_errors))[0])
                else:
                    logits = runner.prefill(_with_media(work.chunk(), live))
                    if work.samples:
                        rows[work.request_id] = logits[-1]
            except Exception as exc:  # noqa: BLE001 - isolate this request
                self._fail(live, "prefill", exc)
                continue
            if live.first_token_at is None:     # a chunk on the way to its first token
                live.prefill_steps += 1
                live.prefill_compute_s += time.perf_counter() - started
            self._counters["prefill_tokens"] += work.num_tokens
            live.prefilled_tokens += work.num_tokens
            if work.replay:
                self._counters["replayed_tokens"] += work.num_tokens
        # Rows under suspicion (their batch failed before) decode alone until one step works.
        # Rows that need their logits on the host (logprobs) decode apart from the rest when the
        # runner samples on its device: a row's forward pass does not depend on its batch, but
        # its sampling would (host float64 vs device fp32 decide alike except within rounding
        # of a threshold), so a request's draws never depend on whether a neighbour asks for
        # logprobs (request invariance).
        device_capable = self._device_sampling and self.runner.samples_on_device
        together: list = []
        apart: list = []
        suspects: list = []
        for work in batch.decodes:
            live = self._live[work.request_id]
            if live.suspect:
                suspects.append([work])
            else:
                (apart if device_capable and live.request.logprobs else together).append(work)
        groups = [together, apart, *suspects]
        rounds: dict[str, RoundOutcome] = {}
        ahead, self._ahead = self._ahead, None
        for group in groups:
            if not group:
                continue
            computed_ahead = ahead == tuple((work.request_id, work.pos) for work in group)
            if self.speculation is not None and self.speculation.verifies(group) and not computed_ahead:
                try:
                    outcomes = self.speculation.run(group, self._live, masks)
                except Exception as exc:  # noqa: BLE001 - isolate by rebuilding the rows
                    self._decode_failed(group, exc)
                    continue
                for request_id, outcome in outcomes.items():
                    self._count_round(self._live[request_id], outcome)
                rounds.update(outcomes)
                for work in group:
                    self._live[work.request_id].suspect = False
                self._counters["decode_tokens"] += len(group)
                self._counters["decode_batches"] += 1
                continue
            items = [_with_media(work.item(), self._live[work.request_id]) for work in group]
            on_device = self._samples_on_device(group)
            try:
                if on_device:
                    lookahead = self._same_decode_next(batch, groups)
                    ids = runner.decode_sampled(
                        items, lambda group=group: self._row_sampling(group, masks, sampling_errors),
                        lookahead=lookahead)
                    if lookahead:
                        self._ahead = tuple((work.request_id, work.pos + 1) for work in group)
                else:
                    logits = runner.decode(items)
            except Exception as exc:  # noqa: BLE001 - isolate by rebuilding the rows
                self._decode_failed(group, exc)
                continue
            for index, work in enumerate(group):
                if on_device:
                    sampled[work.request_id] = int(ids[index])
                else:
                    rows[work.request_id] = logits[index]
                self._live[work.request_id].suspect = False
            self._counters["decode_tokens"] += len(group)
            self._counters["decode_batches"] += 1
        self._counters["steps"] += 1
        return StepCompute(rows, sampled, sampling_errors, rounds, masks)

    def _start_masks(self, batch: ScheduledBatch) -> dict[str, Future]:
        """Submit the constraint masks of every row this step samples to the mask worker."""
        sampled = [w.request_id for w in batch.prefills if w.samples]
        sampled += [w.request_id for w in batch.decodes]
        futures = {}
        for request_id in sampled:
            constraint = self._live[request_id].request.constraint
            if constraint is not None:
                futures[request_id] = self._mask_worker.submit(constraint.allowed_bitmask_u32,
                                                               self.runner.vocab_size)
        return futures

    def _count_round(self, live: LiveRequest, outcome: RoundOutcome) -> None:
        if outcome.drafted:
            live.spec_rounds += 1
            live.drafted_tokens += outcome.drafted
            live.accepted_tokens += outcome.accepted
            self._counters["spec_rounds"] += 1
            self._counters["spec_drafted_tokens"] += outcome.drafted
            self._counters["spec_accepted_tokens"] += outcome.accepted

    def _samples_on_device(self, group: list) -> bool:
        """Whether the runner samples these rows itself (only ids come back): it can, the engine
        allows it, and no row asks for logprobs (those need the logits on the host)."""
        return (self._device_sampling and self.runner.samples_on_device
                and not any(self._live[w.request_id].request.logprobs for w in group))

    def _same_decode_next(self, batch: ScheduledBatch, groups: list) -> bool:
        """Whether the next step will most likely decode exactly this step's rows again (then the
        runner may compute it ahead): a pure decode step of one group, nobody waiting for a lane,
        no row at its output or context limit after this token, and speculative decoding, if on,
        not about to verify drafts (`Speculation.allows_step_ahead`)."""
        if batch.prefills or len([g for g in groups if g]) != 1 or self.scheduler.num_waiting:
            return False
        if self.speculation is not None and not self.speculation.allows_step_ahead(batch.decodes):
            return False
        return all(self._live[work.request_id].limit_reason(extra=1) is None for work in batch.decodes)

    def _row_sampling(self, group: list, masks: dict[str, Future],
                      errors: dict[str, Exception]) -> list[RowSampling]:
        """The group's device-sampling inputs. The runner calls this once the forward pass is
        queued, so waiting for the constraint masks here overlaps the GPU. A row whose mask
        failed samples unconstrained and greedy; its request then ends with the error."""
        vocab = self.runner.vocab_size
        out = []
        for work in group:
            live = self._live[work.request_id]
            try:
                future = masks.get(work.request_id)
                out.append(live.sampler.row_sampling(vocab, future.result() if future else None))
            except Exception as exc:  # noqa: BLE001 - this request's constraint failed
                errors[work.request_id] = exc
                out.append(RowSampling(greedy=True))
        return out

    def _decode_failed(self, group: list, exc: Exception) -> None:
        """A decode call failed. Alone, its row is the culprit: end it. In a batch, nobody knows
        which row broke it, and any row's state may be half-written: pause every member so it
        is rebuilt by replaying its committed tokens, and decode it alone next time."""
        if len(group) == 1:
            live = self._live[group[0].request_id]
            self._fail(live, "decode", exc)
            return
        if self._logger is not None:
            self._logger.warning("batched decode of %d rows failed (%s); replaying them",
                                 len(group), exc)
        for work in group:
            live = self._live[work.request_id]
            live.suspect = True
            self.scheduler.preempt(work.request_id)
            live.preemptions += 1


def _with_media(unit, live: LiveRequest):
    """A chunk or decode item with its request's media (the runner needs all of them)."""
    return dataclasses.replace(unit, media=live.request.media) if live.request.media else unit
