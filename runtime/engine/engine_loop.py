"""The engine: one thread that owns the model runner and steps the scheduler.

Other threads talk to it only through two thread-safe channels:
- commands in (`submit`, `cancel`, `shutdown`), a `queue.SimpleQueue` the loop drains before
  every step (and blocks on when idle, until the periodic prefix-cache save is due at most);
- outputs out: each request's `EngineOutput` increments go to its sink, by default a
  `RequestStream` (a blocking iterator over a queue); the server passes its own sink that
  hands increments to the asyncio loop with `call_soon_threadsafe`. Sinks run on the engine
  thread and must not block.

A step: `Scheduler.schedule()` -> the prefix cache's queued copies (`EngineCache.apply_ops`) ->
the runner calls (`StepExecutor.run` in `engine_step.py`: `reset_slot` + `prefill` per chunk,
batched `decode` or speculative rounds, device or host sampling) -> per request
`LiveRequest.step(logits)` or `step_sampled(id)` (sampling, thinking controls, finish decision)
-> `Scheduler.update()` -> outputs.

Failure isolation: an exception while sampling, in a constraint, or in a sink ends only that
request (finish reason `error`); a failed runner call ends or rebuilds the rows it computed
(`engine_step.py`). Anything that breaks the loop itself ends every request with `error` and
marks the engine unavailable (`Engine.error`); later submits are rejected.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Callable, Iterator, Optional

from runtime.engine.api import EngineOutput, EngineRequest, FinishReason, RequestRejected
from runtime.engine.engine_cache import EngineCache, prefix_cache_config
from runtime.engine.engine_config import EngineConfig
from runtime.engine.engine_step import StepCompute, StepExecutor
from runtime.engine.request_state import LiveRequest, OutputSink
from runtime.engine.sampler import DeadEndError
from runtime.engine.scheduler import Scheduler
from runtime.engine.scheduler_records import ScheduledBatch, SchedulerConfig
from runtime.engine.sequence_cache import media_cache_keys
from runtime.engine.speculative import SlotLayout, Speculation
from runtime.engine.thinking import budget_room_error
from runtime.model.runner import ModelRunner



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
                                                                 config.speculative),
                                           config.device_sampling)
        self.scheduler = Scheduler(SchedulerConfig(
            num_lanes=config.num_lanes, num_pages=num_pages, max_context=config.max_context,
            prefill_chunk=config.prefill_chunk, max_batched_tokens=config.max_batched_tokens,
            max_waiting=config.max_waiting, service_turn_tokens=config.service_turn_tokens,
            snapshot_interval=config.snapshot_interval,
            prefix_cache=prefix_cache_config(runner, config)))
        # The prefix cache's file tier is read here, before the thread starts.
        self.cache = EngineCache(runner, config, self.scheduler, logger)
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
        self._final_save = threading.Event()             # set when the loop's last save starts
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0,
                         "replayed_tokens": 0, "preemptions": 0, "finished": 0,
                         "errors": 0, "decode_batches": 0,
                         # speculative rounds (decode units with drafts), drafts verified, kept
                         "spec_rounds": 0, "spec_drafted_tokens": 0, "spec_accepted_tokens": 0}
        self.steps = StepExecutor(runner, self.scheduler, self.speculation, self._live,
                                  self.counters, config.device_sampling, self._failed, logger)

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
        """Cancel everything in flight and stop the thread; later submits are rejected.
        `timeout` bounds the stop, not the prefix cache file's last write: once that has begun
        it is waited for (GBs take seconds; cut short, the process would exit under it and
        the runner be closed while it reads pages)."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive() and self._final_save.is_set():
            if self._logger is not None:
                self._logger.info("waiting for the prefix cache file to be written")
            self._thread.join()
        self._thread = None
        self.steps.close()

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
        submitted_at = time.perf_counter()
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
            self._commands.put(("submit", request, sink, submitted_at))
        return stream

    def cancel(self, request_id: str) -> None:
        """End a request (finish reason `cancelled`) at the next step; unknown ids are ignored."""
        self._commands.put(("cancel", request_id))

    def _validate(self, request: EngineRequest) -> None:
        if request.max_new_tokens < 1:
            raise RequestRejected("invalid_request", "max_new_tokens must be at least 1")
        self.scheduler.check_admissible(len(request.prompt_ids))   # reads config only
        vocab = self.runner.vocab_size
        ids = request.prompt_ids        # (not empty: checked above) min / max: C loops
        if min(ids) < 0 or max(ids) >= vocab:
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
                    self.cache.save(periodic=True)
                if not self._drain_commands(block=not self.scheduler.has_work(),
                                            timeout=self.cache.save_due_in()):
                    break
                started = time.perf_counter()    # phase boundaries of the requests it admits
                if self.speculation is not None:
                    batch = self.scheduler.schedule(self.speculation.draft_room(self._live))
                else:
                    batch = self.scheduler.schedule()
                scheduled_at = time.perf_counter()
                self.cache.apply_ops()
                self._after_schedule(batch, started, scheduled_at)
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
        self._final_save.set()
        self.cache.save(periodic=False)
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
                live = LiveRequest(command[1], command[2], self.config.max_context, command[3])
                self._end(live, reason, in_scheduler=False, error=error)

    def _drain_commands(self, block: bool, timeout: Optional[float]) -> bool:
        """Apply queued commands; False when asked to stop. timeout: when blocking, wait no
        longer than this (the loop then runs an empty round: the periodic save is due)."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "submit":
                self._accept(command[1], command[2], command[3])
            elif kind == "cancel":
                live = self._live.get(command[1])
                if live is not None:
                    self._end(live, FinishReason.CANCELLED)

    def _accept(self, request: EngineRequest, sink: OutputSink, submitted_at: float) -> None:
        live = LiveRequest(request, sink, self.config.max_context, submitted_at)
        self._live[request.request_id] = live
        try:
            media_keys = media_cache_keys(request.prompt_ids, request.media)
            self.scheduler.add(request.request_id, request.prompt_ids, request.snapshot_positions,
                               media_keys)
        except (RequestRejected, ValueError) as exc:
            self._end(live, FinishReason.ERROR, error=str(exc))
            return
        if self.speculation is not None:
            self.speculation.add(request.request_id, request.prompt_ids)

    def _after_schedule(self, batch: ScheduledBatch, started: float, scheduled_at: float) -> None:
        """started / scheduled_at: when this step's `schedule()` began / ended (the cache's
        queued copies ran since): the phase boundaries of the requests it admitted."""
        now = time.perf_counter()
        for request_id in batch.admitted:
            live = self._live[request_id]
            record = self.scheduler.get(request_id)
            if live.admitted_at is None and record is not None:
                live.admitted_at = started
                live.prefill_from = now
                live.match_s = record.match_s
                # The copies this step ran are the resume's (the snapshot into the lane, host
                # blocks promoted), beside whatever the admission evicted or demoted.
                live.resume_s = record.resume_s + (
                    now - scheduled_at if record.resume_path != "cold" else 0.0)
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

    def _execute(self, batch: ScheduledBatch) -> None:
        """Run the step's runner calls, then commit what they produced."""
        self._commit(batch, self.steps.run(batch))

    def _commit(self, batch: ScheduledBatch, computed: StepCompute) -> None:
        """Sample the host rows, take the sampled ids and speculative rounds, hand the
        committed tokens to the scheduler, and publish each request's increment."""
        rows, sampled, masks = computed.logits, computed.sampled, computed.masks
        new_tokens: dict[str, tuple[int, ...]] = {}
        endings = []
        for request_id in [*rows, *sampled]:
            live = self._live.get(request_id)
            if live is None:
                continue
            try:
                if request_id in computed.sampling_errors:
                    raise computed.sampling_errors[request_id]
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
        for request_id, outcome in computed.rounds.items():
            live = self._live[request_id]
            if outcome.error is not None:
                self._end(live, FinishReason.ERROR, token_ids=outcome.result.token_ids,
                          inserted=outcome.result.inserted,
                          error=f"sampling failed: {outcome.error}")
                continue
            accepted[request_id] = outcome.accepted
            new_tokens[request_id] = outcome.result.token_ids
            endings.append((live, outcome.result))
        self.scheduler.update(batch, new_tokens, accepted)
        self.cache.apply_ops()
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
            self.cache.apply_ops()
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
            **self.cache.metrics(),
        }

