"""The engine: one thread that owns the model runner and steps the scheduler.

Other threads talk to it only through two thread-safe channels:
- commands in (`submit`, `cancel`, `shutdown`), a `queue.SimpleQueue` the loop drains before
  every step (and blocks on when idle);
- outputs out: each request's `EngineOutput` increments go to its sink, by default a
  `RequestStream` (a blocking iterator over a queue); the server passes its own sink that
  hands increments to the asyncio loop with `call_soon_threadsafe`. Sinks run on the engine
  thread and must not block.

A step: `Scheduler.schedule()` -> runner calls (`reset_slot` + `prefill` per chunk, one batched
`decode`) -> per request `LiveRequest.step(logits)` (sampling, thinking controls, finish
decision) -> `Scheduler.update()` -> outputs. A runner with `samples_on_device` (the CUDA
runner, when its sampling kernels were built) samples decode rows itself (`decode_sampled`)
from `RowSampling` inputs the engine builds, the same decision the host sampler makes, and only
ids come back (`LiveRequest.step_sampled`); so does the token after a prompt chunk
(`prefill_sampled`). Rows asking for logprobs keep the logits path.
Output-constraint masks of the step's sampled rows depend only on tokens already committed, so
a worker thread computes them while the runner works (llguidance and the runners release the
GIL) instead of after the logits arrive; the device path asks for them once the forward pass
is queued.

Failure isolation: an exception while sampling, in a constraint, or in a sink ends only that
request (finish reason `error`). A failed prefill chunk ends its one request. A failed batched
decode says nothing about which row is at fault, so every member is paused, rebuilt by replaying
its committed tokens, and decoded alone until a step succeeds: a row that fails alone ends with
`error`, the others continue. Anything that breaks the loop itself ends every request with
`error` and marks the engine unavailable (`Engine.error`); later submits are rejected.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from runtime.engine.api import EngineOutput, EngineRequest, FinishReason, RequestRejected
from runtime.engine.cache_file import load_cache_file, save_cache_file
from runtime.engine.cache_ops import Traffic, apply_ops
from runtime.engine.prefix_cache import PrefixCacheConfig
from runtime.engine.request_state import LiveRequest, OutputSink
from runtime.engine.sampler import DeadEndError
from runtime.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from runtime.engine.speculative import SlotLayout, Speculation, SpeculativeConfig
from runtime.engine.thinking import budget_room_error
from runtime.model.runner import ModelRunner
from runtime.model.sampling import RowSampling

@dataclass(frozen=True)
class EngineConfig:
    """Engine capacities (fixed at startup).

    num_lanes: sequences resident at once, 1..8 (`--max-concurrency`; the CLI uses 1).
    max_context: most tokens (prompt + output) of one sequence.
    prefill_chunk: most prompt tokens computed per chunk.
    max_waiting: requests that may wait for a lane; with the running ones this bounds the
        requests in flight (`submit` rejects more with `queue_full`).
    max_batched_tokens: step token budget (None: prefill_chunk + num_lanes).
    num_pages: KV pages to use (None: all the runner has).
    service_turn_tokens: under KV contention, new tokens a sequence produces before it gives
        way to one blocked by pages (bounded service turns, see the scheduler).
    device_sampling: let a runner that can (`samples_on_device`) sample decode rows on its device
        (False: always return logits and sample on the host; benches compare the two).
    speculative: draft proposals verified per round (`runtime.engine.speculative`); decode rows
        then go through `ModelRunner.step` with host sampling, and the runner needs the state
        slots of `SlotLayout.for_config(num_lanes, speculative)`.
    prefix_cache: match prompts against cached prefixes (`runtime.engine.prefix_cache`).
    snapshot_slots: runner slots after those (its spare slots) the cache keeps snapshots in.
    host_cache_bytes: host memory for demoted snapshots and blocks and for paused requests.
        With any of these three, preemption keeps a paused request's state instead of
        replaying it (where there is room); with none, there is no cache at all (the CLI).
    snapshot_interval: long prompts are snapshotted (and chunks end) at multiples of it.
    cache_file / cache_fingerprint: the file tier (`runtime.engine.cache_file`), read at
        construction and written at shutdown; cache_save_s: also written this often (0: not).
    """

    num_lanes: int = 1
    max_context: int = 2048
    prefill_chunk: int = 1024
    max_waiting: int = 16
    max_batched_tokens: Optional[int] = None
    num_pages: Optional[int] = None
    service_turn_tokens: int = 128
    device_sampling: bool = True
    speculative: SpeculativeConfig = SpeculativeConfig()
    prefix_cache: bool = False
    snapshot_slots: int = 0
    host_cache_bytes: int = 0
    snapshot_interval: int = 0
    cache_file: Optional[str] = None
    cache_fingerprint: str = ""
    cache_save_s: float = 0.0


class RequestStream:
    """The outputs of one request, in order, as a blocking iterator (the default sink)."""

    def __init__(self, engine: "Engine", request_id: str):
        self._engine = engine
        self.request_id = request_id
        self._queue: "queue.SimpleQueue[EngineOutput]" = queue.SimpleQueue()
        self.done = False

    def put(self, output: EngineOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: Optional[float] = None) -> EngineOutput:
        """Next increment; raises `queue.Empty` after `timeout` seconds."""
        output = self._queue.get(timeout=timeout)
        if output.finished:
            self.done = True
        return output

    def __iter__(self) -> Iterator[EngineOutput]:
        while not self.done:
            yield self.get()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)


class Engine:
    """Owns a `ModelRunner` on its own thread; thread-safe `submit` / `cancel`."""

    def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig(), *,
                 logger=None, on_thread_start: Optional[Callable[[], None]] = None):
        """on_thread_start: called first on the engine thread (e.g. to make the runner's CUDA
        context current there)."""
        if runner.num_slots < config.num_lanes:
            raise ValueError(f"the runner has {runner.num_slots} state slots, "
                             f"{config.num_lanes} lanes were asked for")
        num_pages = runner.num_pages if config.num_pages is None else config.num_pages
        if num_pages > runner.num_pages:
            raise ValueError(f"the runner has {runner.num_pages} KV pages, {num_pages} asked")
        self.runner = runner
        self.config = config
        self.speculation: Optional[Speculation] = None
        if config.speculative.enabled:
            self.speculation = Speculation(config.speculative, runner,
                                           SlotLayout.for_config(config.num_lanes,
                                                                 config.speculative))
        self.scheduler = Scheduler(SchedulerConfig(
            num_lanes=config.num_lanes, num_pages=num_pages, max_context=config.max_context,
            prefill_chunk=config.prefill_chunk, max_batched_tokens=config.max_batched_tokens,
            max_waiting=config.max_waiting, service_turn_tokens=config.service_turn_tokens,
            snapshot_interval=config.snapshot_interval,
            prefix_cache=prefix_cache_config(runner, config)))
        self.cache_traffic = Traffic()
        self._saved_at = time.monotonic()
        if config.cache_file is not None and self.scheduler.cache is not None:
            warn = logger.warning if logger is not None else (lambda message: None)
            restored = load_cache_file(config.cache_file, config.cache_fingerprint,
                                       self.scheduler.cache.cache, warn)
            if logger is not None and restored:
                logger.info("prefix cache: %d snapshots restored from %s", restored,
                            config.cache_file)
        self._logger = logger
        self._on_thread_start = on_thread_start
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._live: dict[str, LiveRequest] = {}          # engine thread only
        self._lock = threading.Lock()                    # guards the three fields below
        self._in_flight: set[str] = set()
        self._error: Optional[str] = None
        self._accepting = False
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        # One worker: masks of one step are computed in order, and never while the engine
        # thread commits a token to the same constraint (it waits for the mask first).
        self._mask_worker = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="infernix-masks")
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                         "replayed_tokens": 0, "preemptions": 0, "finished": 0,
                         "errors": 0, "decode_batches": 0,
                         # speculative rounds (decode units with drafts), drafts verified, kept
                         "spec_rounds": 0, "spec_drafted_tokens": 0, "spec_accepted_tokens": 0}

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is None:
            with self._lock:
                self._accepting = True
            self._thread = threading.Thread(target=self._run, name="infernix-engine",
                                            daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: Optional[float] = 10.0) -> None:
        """Cancel everything in flight and stop the thread; later submits are rejected."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._thread = None
        self._mask_worker.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def error(self) -> Optional[str]:
        """None while healthy; the reason once the loop itself failed."""
        with self._lock:
            return self._error

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # --- caller side ------------------------------------------------------------------------

    def submit(self, request: EngineRequest,
               on_output: Optional[OutputSink] = None) -> RequestStream:
        """Queue a request. Raises `RequestRejected` (nothing queued) when it can never run,
        the queue is full, or the engine is unavailable. Outputs go to `on_output` (called on
        the engine thread) or, by default, to the returned stream."""
        self._validate(request)
        stream = RequestStream(self, request.request_id)
        sink = on_output if on_output is not None else stream.put
        with self._lock:
            if self._error is not None:
                raise RequestRejected("engine_unavailable", f"the engine failed: {self._error}")
            if not self._accepting:
                raise RequestRejected("engine_unavailable", "the engine is not running")
            if request.request_id in self._in_flight:
                raise RequestRejected("duplicate_request",
                                      f"request id {request.request_id!r} is in use")
            limit = self.config.num_lanes + self.config.max_waiting
            if len(self._in_flight) >= limit:
                raise RequestRejected("queue_full", f"{len(self._in_flight)} requests are in "
                                      f"flight (limit {limit})")
            self._in_flight.add(request.request_id)
            # Under the lock: once the loop stops accepting, no submit can slip in behind it.
            self._commands.put(("submit", request, sink))
        return stream

    def cancel(self, request_id: str) -> None:
        """End a request (finish reason `cancelled`) at the next step; unknown ids are ignored."""
        self._commands.put(("cancel", request_id))

    def _validate(self, request: EngineRequest) -> None:
        if request.max_new_tokens < 1:
            raise RequestRejected("invalid_request", "max_new_tokens must be at least 1")
        self.scheduler.check_admissible(len(request.prompt_ids))   # reads config only
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_ids):
            raise RequestRejected("invalid_request", f"a prompt token id is outside the "
                                  f"vocabulary (0..{vocab - 1})")
        message = budget_room_error(request.thinking, request.max_new_tokens,
                                    len(request.prompt_ids), self.config.max_context)
        if message is not None:
            raise RequestRejected("thinking_budget_capacity_insufficient", message)

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            while True:
                if self.config.cache_save_s:
                    self._save_cache(periodic=True)
                if not self._drain_commands(block=not self.scheduler.has_work()):
                    break
                if self.speculation is not None:
                    batch = self.scheduler.schedule(self.speculation.draft_room(self._live))
                else:
                    batch = self.scheduler.schedule()
                self._apply_cache_ops()
                self._after_schedule(batch)
                if not batch.is_empty:
                    self._execute(batch)
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            message = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._error = message
            if self._logger is not None:
                self._logger.error("engine loop failed: %s", message, exc_info=True)
            for live in list(self._live.values()):
                self._end(live, FinishReason.ERROR, error=f"engine failure: {message}")
            self._close_commands(FinishReason.ERROR, f"engine failure: {message}")
            return
        for live in list(self._live.values()):
            self._end(live, FinishReason.CANCELLED)
        self._save_cache(periodic=False)
        self._close_commands(FinishReason.CANCELLED, None)

    def _close_commands(self, reason: FinishReason, error: Optional[str]) -> None:
        """End requests submitted while the loop was stopping, so no stream waits forever."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "submit":
                live = LiveRequest(command[1], command[2], self.config.max_context)
                self._end(live, reason, in_scheduler=False, error=error)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "submit":
                self._accept(command[1], command[2])
            elif kind == "cancel":
                live = self._live.get(command[1])
                if live is not None:
                    self._end(live, FinishReason.CANCELLED)

    def _accept(self, request: EngineRequest, sink: OutputSink) -> None:
        live = LiveRequest(request, sink, self.config.max_context)
        self._live[request.request_id] = live
        try:
            self.scheduler.add(request.request_id, request.prompt_ids,
                               request.snapshot_positions, cacheable=not request.media)
        except RequestRejected as exc:
            self._end(live, FinishReason.ERROR, error=str(exc))
            return
        if self.speculation is not None:
            self.speculation.add(request.request_id, request.prompt_ids)

    @staticmethod
    def _with_media(unit, live: LiveRequest):
        """A chunk or decode item with its request's media (the runner needs all of them)."""
        return dataclasses.replace(unit, media=live.request.media) if live.request.media else unit

    def _after_schedule(self, batch: ScheduledBatch) -> None:
        now = time.perf_counter()
        for request_id in batch.admitted:
            live = self._live[request_id]
            if live.admitted_at is None:
                live.admitted_at = now
            record = self.scheduler.get(request_id)
            if record is not None:            # (None: the scheduler also failed it this step)
                live.cached_tokens = record.cached_tokens or 0
                live.resume_path = record.resume_path
        for request_id in batch.preempted:
            self._live[request_id].preemptions += 1
            self.counters["preemptions"] += 1
            if self._logger is not None:
                self._logger.debug("preempted %s under KV pressure (replays later)", request_id)
        for request_id, reason in batch.failed:
            live = self._live.get(request_id)
            if live is not None:
                self._end(live, reason, in_scheduler=False)

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

    def _execute(self, batch: ScheduledBatch) -> None:
        runner = self.runner
        masks = self._start_masks(batch)
        rows: dict[str, np.ndarray] = {}
        sampled: dict[str, int] = {}
        sampling_errors: dict[str, Exception] = {}
        for work in batch.prefills:
            live = self._live[work.request_id]
            try:
                if self.speculation is not None:
                    self.speculation.catch_up(work.request_id, work.slot, work.start_pos,
                                              work.page_table)
                if work.reset_slot:
                    runner.reset_slot(work.slot)
                if work.samples and self._samples_on_device([work]):
                    sampled[work.request_id] = int(runner.prefill_sampled(
                        self._with_media(work.chunk(), live), lambda work=work: self._row_sampling([work], masks, sampling_errors))[0])
                else:
                    logits = runner.prefill(self._with_media(work.chunk(), live))
                    if work.samples:
                        rows[work.request_id] = logits[-1]
            except Exception as exc:  # noqa: BLE001 - isolate this request
                self._failed(live, "prefill", exc)
                continue
            self.counters["prefill_tokens"] += work.num_tokens
            live.prefilled_tokens += work.num_tokens
            if work.replay:
                self.counters["replayed_tokens"] += work.num_tokens
        # Rows under suspicion (their batch failed before) decode alone until one step works.
        # Rows that need their logits on the host (logprobs) decode apart from the rest when the
        # runner samples on its device: a row's forward pass does not depend on its batch, but
        # its sampling would (host float64 vs device fp32 decide alike except within rounding
        # of a threshold), so a request's draws never depend on whether a neighbour asks for
        # logprobs (request invariance).
        steady = [w for w in batch.decodes if not self._live[w.request_id].suspect]
        device_capable = self.config.device_sampling and self.runner.samples_on_device
        host = [w for w in steady if self._live[w.request_id].request.logprobs] if device_capable else []
        groups = [[w for w in steady if w not in host], host]
        groups += [[w] for w in batch.decodes if self._live[w.request_id].suspect]
        rounds: dict = {}
        for group in groups:
            if not group:
                continue
            if self.speculation is not None:
                try:
                    rounds.update(self.speculation.run(group, self._live, masks))
                except Exception as exc:  # noqa: BLE001 - isolate by rebuilding the rows
                    self._decode_failed(group, exc)
                    continue
                for work in group:
                    self._live[work.request_id].suspect = False
                self.counters["decode_tokens"] += len(group)
                self.counters["decode_batches"] += 1
                continue
            items = [self._with_media(work.item(), self._live[work.request_id]) for work in group]
            on_device = self._samples_on_device(group)
            try:
                if on_device:
                    ids = runner.decode_sampled(
                        items, lambda group=group: self._row_sampling(group, masks, sampling_errors),
                        lookahead=self._same_decode_next(batch, groups))
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
            self.counters["decode_tokens"] += len(group)
            self.counters["decode_batches"] += 1
        self.counters["steps"] += 1

        new_tokens: dict[str, tuple[int, ...]] = {}
        endings = []
        for request_id in [*rows, *sampled]:
            live = self._live.get(request_id)
            if live is None:
                continue
            try:
                if request_id in sampling_errors:
                    raise sampling_errors[request_id]
                if request_id in sampled:
                    result = live.step_sampled(sampled[request_id])
                else:
                    result = live.step(rows[request_id], masks.get(request_id))
            except Exception as exc:  # noqa: BLE001 - sampling / constraint failure
                self._failed(live, "sampling", exc)
                continue
            new_tokens[request_id] = result.token_ids
            endings.append((live, result))
        accepted = {}
        for request_id, outcome in rounds.items():
            live = self._live[request_id]
            self._count_round(live, outcome)
            if outcome.error is not None:
                self._end(live, FinishReason.ERROR, token_ids=outcome.result.token_ids,
                          inserted=outcome.result.inserted,
                          error=f"sampling failed: {outcome.error}")
                continue
            accepted[request_id] = outcome.accepted
            new_tokens[request_id] = outcome.result.token_ids
            endings.append((live, outcome.result))
        self.scheduler.update(batch, new_tokens, accepted)
        self._apply_cache_ops()
        if self.speculation is not None:
            self.speculation.after_update(batch, new_tokens, accepted)
        for record_id in list(self._live):
            record = self.scheduler.get(record_id)
            if record is not None:
                self._live[record_id].replayed_tokens = record.replayed_tokens
        for live, result in endings:
            if result.finish_reason is not None:
                self._end(live, result.finish_reason, token_ids=result.token_ids,
                          inserted=result.inserted, logprobs=result.logprobs)
            else:
                self._publish(live, live.progress_output(result))

    def _save_cache(self, periodic: bool) -> None:
        """Write the file tier: at shutdown, or when `cache_save_s` has passed since the last
        write. A failed write is logged; the cache keeps serving."""
        cache = self.scheduler.cache
        if self.config.cache_file is None or cache is None:
            return
        if periodic and not (self.config.cache_save_s
                             and time.monotonic() - self._saved_at >= self.config.cache_save_s):
            return
        self._saved_at = time.monotonic()
        try:
            size = save_cache_file(self.config.cache_file, self.config.cache_fingerprint,
                                   cache.cache, self.runner)
        except OSError as exc:
            if self._logger is not None:
                self._logger.warning("prefix cache file %s not written: %s",
                                     self.config.cache_file, exc)
            return
        if self._logger is not None:
            self._logger.info("prefix cache written to %s (%.1f MiB)", self.config.cache_file,
                              size / (1 << 20))

    def _apply_cache_ops(self) -> None:
        """Run the prefix cache's queued copies (`runtime.engine.cache_ops`), in order."""
        if self.scheduler.cache is not None:
            apply_ops(self.runner, self.scheduler.cache.cache.take_ops(), self.cache_traffic)

    def _count_round(self, live: LiveRequest, outcome) -> None:
        if outcome.drafted:
            live.spec_rounds += 1
            live.drafted_tokens += outcome.drafted
            live.accepted_tokens += outcome.accepted
            self.counters["spec_rounds"] += 1
            self.counters["spec_drafted_tokens"] += outcome.drafted
            self.counters["spec_accepted_tokens"] += outcome.accepted

    def _samples_on_device(self, group: list) -> bool:
        """Whether the runner samples these rows itself (only ids come back): it can, the engine
        allows it, and no row asks for logprobs (those need the logits on the host)."""
        return (self.config.device_sampling and self.runner.samples_on_device
                and not any(self._live[w.request_id].request.logprobs for w in group))

    def _same_decode_next(self, batch: ScheduledBatch, groups: list) -> bool:
        """Whether the next step will most likely decode exactly this step's rows again (then the
        runner may compute it ahead): a pure decode step of one group, nobody waiting for a lane,
        and no row at its output or context limit after this token."""
        if batch.prefills or len([g for g in groups if g]) != 1 or self.scheduler.num_waiting:
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
            self._failed(live, "decode", exc)
            return
        if self._logger is not None:
            self._logger.warning("batched decode of %d rows failed (%s); replaying them",
                                 len(group), exc)
        for work in group:
            live = self._live[work.request_id]
            live.suspect = True
            self.scheduler.preempt(work.request_id)
            live.preemptions += 1

    # --- outputs ----------------------------------------------------------------------------

    def _publish(self, live: LiveRequest, output: EngineOutput) -> None:
        try:
            live.publish(output)
        except Exception as exc:  # noqa: BLE001 - a broken sink cancels its request only
            if not output.finished:
                if self._logger is not None:
                    self._logger.warning("output sink of %s failed (%s); cancelling it",
                                         live.request_id, exc)
                self._end(live, FinishReason.CANCELLED)

    def _failed(self, live: LiveRequest, stage: str, exc: Exception) -> None:
        """End a request on an exception. A dead end (the constraint allows nothing, or the
        logits are not finite) is this request's condition and its message explains it. Any
        other exception is a bug: its traceback is logged once, at error level, with the request
        id, and the request's error names the stage and the id, not library internals."""
        if isinstance(exc, DeadEndError):
            self._end(live, FinishReason.ERROR, error=f"{stage} failed: {exc}")
            return
        if self._logger is not None:
            self._logger.error("request %s: %s failed", live.request_id, stage, exc_info=exc)
        self._end(live, FinishReason.ERROR, error=f"{stage} failed (request id "
                                                  f"{live.request_id}; cause in the server log)")

    def _end(self, live: LiveRequest, reason: FinishReason, *, in_scheduler: bool = True,
             token_ids: tuple[int, ...] = (), inserted: tuple[bool, ...] = (),
             error: Optional[str] = None, logprobs=None) -> None:
        """Finish a request: free its lane and pages, publish the final increment."""
        if live.finished:
            return
        if in_scheduler:
            # A failed call may have left its lane half-written: no snapshot of it.
            self.scheduler.finish(live.request_id, keep_state=reason is not FinishReason.ERROR)
            self._apply_cache_ops()
        if self.speculation is not None:
            self.speculation.remove(live.request_id)
        self._live.pop(live.request_id, None)
        with self._lock:
            self._in_flight.discard(live.request_id)
        self.counters["finished"] += 1
        if reason is FinishReason.ERROR:
            self.counters["errors"] += 1
            if self._logger is not None:
                self._logger.warning("request %s failed: %s", live.request_id, error)
        self._publish(live, live.final_output(reason, token_ids=token_ids, inserted=inserted,
                                              error=error, logprobs=logprobs))

    # --- introspection (any thread; values may be one step old) ------------------------------

    def snapshot(self) -> dict:
        """Gauges and counters for logs and /metrics."""
        scheduler = self.scheduler
        return {
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "kv_pages_total": scheduler.config.num_pages,
            "kv_pages_free": scheduler.pages.num_free,
            "lanes": scheduler.config.num_lanes,
            **dict(self.counters),
            **self._cache_snapshot(),
        }

    def _cache_snapshot(self) -> dict:
        cache = self.scheduler.cache
        if cache is None:
            return {}
        traffic = self.cache_traffic
        # Counters end in _total (they only grow), the rest are gauges (/metrics names).
        return {**{f"prefix_cache_{k}_total": v for k, v in cache.cache.stats.items()},
                "prefix_cache_block_evictions_total": self.scheduler.pages.evictions,
                "prefix_cache_host_to_device_bytes_total": traffic.host_to_device_bytes,
                "prefix_cache_device_to_host_bytes_total": traffic.device_to_host_bytes,
                "prefix_cache_slot_copies_total": traffic.device_copies,
                "prefix_cache_cached_pages": self.scheduler.pages.num_cached,
                "prefix_cache_device_snapshots": cache.cache.device_snapshots,
                "prefix_cache_host_bytes": cache.cache.host_used}


def prefix_cache_config(runner: ModelRunner, config: EngineConfig) -> Optional[PrefixCacheConfig]:
    """The prefix cache's capacities, or None when the config asks for no cache at all."""
    if not (config.prefix_cache or config.snapshot_slots or config.host_cache_bytes):
        return None
    first = SlotLayout.for_config(config.num_lanes, config.speculative).first_spare
    if first + config.snapshot_slots > runner.num_slots:
        raise ValueError(f"the runner has {runner.num_slots} state slots; lanes and speculative "
                         f"snapshots take {first}, {config.snapshot_slots} snapshot slots asked")
    return PrefixCacheConfig(reuse=config.prefix_cache,
                             snapshot_slots=tuple(range(first, first + config.snapshot_slots)),
                             host_bytes=config.host_cache_bytes, slot_nbytes=runner.slot_nbytes,
                             page_nbytes=runner.page_nbytes)
