"""The scheduler: which sequences run, which of their tokens are computed this step, with which
KV pages. Pure Python bookkeeping: no device arrays, no tokenizer, no runner calls.

Token-budget model. Every sequence is a list of token ids (prompt, then committed output) and a
count of how many of them the model has computed. A step computes, per running sequence, the
next run of uncomputed tokens: one token is a decode item (batched across sequences), more are a
prefill chunk. A fresh prompt, a chunk of a long prompt, the replay of a preempted sequence and
the inserted thinking-close span all take the same path; only the count differs.

Rules, in the order `schedule()` applies them:

1. Admission is strict FIFO over a bounded queue: the head is admitted when a lane (state slot)
   is free and the pool has the pages of its whole prompt and a first output token on top of
   what the running sequences need to finish theirs (a pool that cannot hold a request for a
   useful turn does not take it in, so nobody pauses for it at once); a blocked head is never
   overtaken. A preempted sequence goes back to the front of the queue (ahead of fresh
   requests) and resumes only when its whole replay fits.
   Bounded service turns under KV pressure: when the head is blocked by pages (not by lanes),
   running sequences that have produced `service_turn_tokens` new tokens since they were last
   admitted give way: enough of them are paused (longest-served first) for the head's whole
   sequence to fit, and they queue behind the other paused sequences. Sequences in contention
   therefore take turns (each turn: the replay that recovers its state, then a bounded amount of
   new output) instead of the oldest holding the pool until it finishes.
2. Every running sequence with one pending token decodes this step; prefill chunks share the
   rest of the step's token budget in rotation, on an absolute grid, never cut to fit
   (`step_plan.py`, which holds the rule in full).
3. Pages are taken per unit in arrival order (oldest first). When the pool runs dry the
   youngest running sequence is preempted: its pages and lane are freed and it will replay its
   committed tokens (no token is resampled or republished; the engine keeps its sampler state).
   If the short sequence is itself the youngest it pauses; if it is alone and still cannot fit,
   it ends with finish reason `context` instead of waiting forever.

`update()` takes the runner's result as committed token ids per sampled sequence; the engine
calls `finish()` for sequences that end (stop, length, cancel, error).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterable, Mapping, Optional, Sequence

from runtime.engine.api import FinishReason, RequestRejected
from runtime.engine.kv_blocks import BlockManager, pages_for
from runtime.engine.kv_pages import StateSlots
from runtime.engine.scheduler_records import (DecodeWork, PrefillWork, ScheduledBatch,
                                              SchedulerConfig, SeqStatus, SequenceRecord)
from runtime.engine.sequence_cache import SequenceCache, block_stops
from runtime.engine.step_plan import next_unit_pages, plan_tokens
from runtime.model.runner import PAGE_SIZE


class Scheduler:
    """Lanes, the admission queue, the KV page pool and per-sequence page tables."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pages = BlockManager(config.num_pages)
        self.cache = (None if config.prefix_cache is None else
                      SequenceCache(config.prefix_cache, self.pages, config.snapshot_interval))
        self.slots = StateSlots(config.num_lanes)
        self._seqs: dict[str, SequenceRecord] = {}
        self._waiting: collections.deque[SequenceRecord] = collections.deque()
        self._running: list[SequenceRecord] = []     # kept in ticket order
        self._next_ticket = 0
        self._step = 0
        self._rotated: list[str] = []
        self.total_preemptions = 0

    # --- queries ----------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def get(self, request_id: str) -> Optional[SequenceRecord]:
        return self._seqs.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_fresh_waiting(self) -> int:
        return sum(1 for seq in self._waiting if seq.status is SeqStatus.WAITING)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def running_ids(self) -> list[str]:
        return [seq.request_id for seq in self._running]

    def waiting_ids(self) -> list[str]:
        return [seq.request_id for seq in self._waiting]

    # --- requests in and out ----------------------------------------------------------------

    def check_admissible(self, prompt_len: int) -> None:
        """Raise RequestRejected if a prompt of this length can never run."""
        if prompt_len < 1:
            raise RequestRejected("invalid_request", "the prompt is empty")
        if prompt_len >= self.config.max_context:
            raise RequestRejected(
                "context_length_exceeded",
                f"the prompt has {prompt_len} tokens; max context is {self.config.max_context} "
                f"(it must leave room for at least one output token)")
        if pages_for(prompt_len) > self.config.num_pages:
            raise RequestRejected(
                "kv_capacity_exceeded",
                f"the prompt has {prompt_len} tokens; the KV pool holds "
                f"{self.config.num_pages * PAGE_SIZE}")

    def add(self, request_id: str, prompt_ids: Sequence[int],
            snapshot_positions: Sequence[int] = (),
            media_keys: tuple = ()) -> SequenceRecord:
        if request_id in self._seqs:
            raise RequestRejected("duplicate_request", f"request id {request_id!r} is in use")
        self.check_admissible(len(prompt_ids))
        if self.num_fresh_waiting >= self.config.max_waiting + self.slots.num_free:
            raise RequestRejected("queue_full", f"{self.num_fresh_waiting} requests are already "
                                 f"waiting (limit {self.config.max_waiting})")
        seq = SequenceRecord(request_id=request_id, ticket=self._next_ticket,
                             prompt_len=len(prompt_ids), token_ids=list(prompt_ids),
                             snapshot_positions=block_stops(snapshot_positions),
                             media_keys=media_keys)
        self._next_ticket += 1
        self._seqs[request_id] = seq
        self._waiting.append(seq)
        return seq

    def finish(self, request_id: str, keep_state: bool = True) -> bool:
        """Remove a sequence (any state) and free its lane and pages. False if unknown.
        keep_state: its lane state is sound (not after a failed call), so the prefix cache may
        keep it as the snapshot where a next turn resumes."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
            if self.cache is not None:
                self.cache.finish(seq, keep_state)
            self._release(seq)
        else:
            self._waiting.remove(seq)
            if self.cache is not None:
                self.cache.cache.drop_private(request_id)
        return True

    def preempt(self, request_id: str) -> bool:
        """Pause a running sequence now (its state is discarded and replayed later). The engine
        uses it to rebuild the state of sequences whose batched runner call failed."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            return False
        self._preempt(seq, keep_state=False)
        return True

    # --- one step ---------------------------------------------------------------------------

    def schedule(self, draft_room: Optional[Mapping[str, int]] = None) -> ScheduledBatch:
        """draft_room: request id -> most draft tokens its decode unit may carry this step
        (speculative decoding). Drafts get pages only when the pool has them to spare: they
        never preempt a sequence, and they do not count against the token budget (which keeps
        a whole chunk beside one decode row per lane)."""
        self._step += 1
        draft_room = draft_room or {}
        failed: list[tuple[str, FinishReason]] = []
        self._rotated: list[str] = []
        admitted = self._admit(failed)
        preempted: list[str] = list(self._rotated)

        # Plan: every one-pending sequence decodes; chunks share the rest of the budget.
        plan = plan_tokens(self._running, self.config)

        # Allocate pages oldest first, preempting the youngest on shortage.
        decodes: list[DecodeWork] = []
        prefills: list[PrefillWork] = []
        for seq in list(self._running):
            count = plan.get(seq.request_id)
            if count is None or seq.status is not SeqStatus.RUNNING:
                continue
            end = seq.num_computed + count
            if end > self.config.max_context:
                # The engine ends sequences at the context limit; this is a safety net.
                self._fail(seq, failed)
                continue
            need = pages_for(end) - len(seq.page_table)
            while need > self.pages.num_free:
                victim = self._youngest_running_after(seq)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
            if need > self.pages.num_free:
                if len(self._running) > 1:
                    self._preempt(seq)           # older sequences keep going; retry later
                    preempted.append(seq.request_id)
                else:
                    self._fail(seq, failed)      # alone and still too big: a capacity limit
                continue
            seq.page_table.extend(self.pages.allocate(need, seq.request_id))
            if count == 1 and seq.num_computed > 0:
                decodes.append(DecodeWork(seq.request_id, seq.slot, seq.token_ids[seq.num_computed],
                                          seq.num_computed, tuple(seq.page_table)))
            else:
                start = seq.num_computed
                prefills.append(PrefillWork(
                    request_id=seq.request_id, slot=seq.slot,
                    token_ids=tuple(seq.token_ids[start:end]), start_pos=start,
                    page_table=tuple(seq.page_table), reset_slot=start == 0,
                    samples=end == len(seq.token_ids), replay=start < seq.high_water))
                seq.last_prefill_step = self._step
        # Victims are always younger than the sequence being served and we walk oldest first,
        # so no preempted sequence has work in the lists above.
        decodes = [self._with_drafts(work, draft_room.get(work.request_id, 0))
                   for work in decodes]
        return ScheduledBatch(step=self._step, decodes=tuple(decodes), prefills=tuple(prefills),
                              preempted=tuple(preempted), admitted=tuple(admitted),
                              failed=tuple(failed))

    def update(self, batch: ScheduledBatch, new_tokens: Mapping[str, Sequence[int]],
               accepted: Optional[Mapping[str, int]] = None) -> None:
        """Advance computed counts for the batch's work and append committed tokens.

        new_tokens: request id -> ids committed after this step (the sampled token, plus any
        inserted ones); only sequences that sampled may appear. Sequences finished since
        `schedule()` are skipped.
        accepted: request id -> draft tokens of its decode unit whose positions are kept (the
        unit then computed 1 + accepted positions); the pages taken only for the other draft
        positions go back to the pool.
        """
        accepted = accepted or {}
        sampled = set()
        for work in batch.decodes:
            seq = self._seqs.get(work.request_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                kept = accepted.get(work.request_id, 0)
                if not 0 <= kept <= work.draft_room:
                    raise AssertionError(f"{work.request_id}: {kept} drafts accepted, room "
                                         f"{work.draft_room}")
                self._advance(seq, 1 + kept)
                excess = seq.page_table[pages_for(seq.num_computed):]
                if work.draft_room and excess:
                    del seq.page_table[pages_for(seq.num_computed):]
                    self.pages.release(excess, seq.request_id)
                sampled.add(work.request_id)
        for work in batch.prefills:
            seq = self._seqs.get(work.request_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                self._advance(seq, work.num_tokens)
                if work.samples:
                    sampled.add(work.request_id)
        for request_id, tokens in new_tokens.items():
            seq = self._seqs.get(request_id)
            if seq is None:
                continue
            if request_id not in sampled:
                raise AssertionError(f"{request_id} got tokens but did not sample this step")
            seq.token_ids.extend(tokens)
        if self.cache is not None:
            self.cache.after_step(batch, self._seqs)

    # --- internals --------------------------------------------------------------------------

    def _advance(self, seq: SequenceRecord, count: int) -> None:
        replayed = max(0, min(seq.num_computed + count, seq.high_water) - seq.num_computed)
        seq.replayed_tokens += replayed
        seq.num_computed += count
        seq.high_water = max(seq.high_water, seq.num_computed)

    def _with_drafts(self, work: DecodeWork, room: int) -> DecodeWork:
        """The unit with pages for `room` draft positions after it, when the pool still has
        them once every unit of the step got its own (drafts are worth less than any unit)."""
        seq = self._seqs[work.request_id]
        room = min(room, self.config.max_context - work.pos - 1)
        need = pages_for(work.pos + 1 + room) - len(seq.page_table)
        if room < 1 or need > self.pages.num_free:
            return work
        seq.page_table.extend(self.pages.allocate(need, seq.request_id))
        return dataclasses.replace(work, page_table=tuple(seq.page_table), draft_room=room)

    def _prompt_room(self, seq: SequenceRecord) -> int:
        """Pages a running sequence still needs to finish what it holds (its prompt or replay)
        and one more token: admission keeps them free, so an admitted sequence is never
        paused for a newcomer before its first turn."""
        return max(next_unit_pages(seq, self.config),
                   pages_for(len(seq.token_ids) + 1) - len(seq.page_table))

    def _admit(self, failed: list[tuple[str, FinishReason]]) -> list[str]:
        admitted = []
        while self._waiting and self.slots.num_free > 0:
            head = self._waiting[0]
            entry = None
            head.match_s = head.resume_s = 0.0     # (the admitting try's times stay)
            if self.cache is not None:
                matching = time.perf_counter()
                entry = self.cache.match(head)
                head.match_s = time.perf_counter() - matching
            if entry is not None:
                need = self.cache.resume_need(head, entry)
            elif head.status is SeqStatus.PAUSED:
                need = pages_for(len(head.token_ids))          # its whole replay must fit
            else:
                # Its whole prompt and a first output token: admitting a prompt the pool
                # cannot finish only makes it (or a neighbour) pause again (thrashing).
                need = pages_for(len(head.token_ids) + 1)
            if need > self.config.num_pages:
                # A paused sequence that outgrew the whole pool can never resume.
                self._waiting.popleft()
                del self._seqs[head.request_id]
                if self.cache is not None:
                    self.cache.cache.drop_private(head.request_id)
                failed.append((head.request_id, FinishReason.CONTEXT))
                continue
            reserve = sum(self._prompt_room(seq) for seq in self._running)
            if need + reserve > self.pages.num_free and not self._rotate_for(head):
                break                                          # never overtake a blocked head
            self._waiting.remove(head)       # (a fresh head may now follow paused victims)
            was_paused = head.status is SeqStatus.PAUSED
            head.status = SeqStatus.RUNNING
            head.slot = self.slots.acquire(head.request_id)
            head.num_computed = 0
            head.block_digests = []
            self._start(head, was_paused)
            head.turn_start_output = head.num_output
            head.turn_start_step = self._step
            self._running.append(head)
            self._running.sort(key=lambda s: s.ticket)
            admitted.append(head.request_id)
        return admitted

    def _start(self, seq: SequenceRecord, was_paused: bool) -> None:
        """Where an admitted sequence starts: the deepest snapshot the cache has for it (the
        match is redone: pausing turn-expired sequences may have moved cache entries), else
        position 0 (cold, or a replay of a paused sequence)."""
        if self.cache is not None and self.cache.start(seq, was_paused, self.pages.num_free):
            return
        seq.resume_path = "replay" if was_paused else "cold"
        if seq.cached_tokens is None:
            seq.cached_tokens = 0

    def _freed_by(self, seq: SequenceRecord) -> int:
        """Pages that releasing `seq` would make available (shared ones stay in use)."""
        return sum(1 for page in seq.page_table if self.pages.users(page) == {seq.request_id})

    def _rotate_for(self, head: SequenceRecord) -> bool:
        """Bounded service turns: pause running sequences whose turn is used up so that the
        KV-blocked head fits with its whole sequence. True if it now fits."""
        expired = sorted((s for s in self._running
                          if s.turn_output >= self.config.service_turn_tokens),
                         key=lambda s: (s.turn_start_step, -s.ticket))
        if not expired:
            return False
        need = pages_for(len(head.token_ids) + 1)
        victims: list[SequenceRecord] = []
        free = self.pages.num_free
        for seq in expired:
            staying = [s for s in self._running if s not in victims]
            if need + sum(next_unit_pages(s, self.config) for s in staying) <= free:
                break
            victims.append(seq)
            free += self._freed_by(seq)
        staying = [s for s in self._running if s not in victims]
        if need + sum(next_unit_pages(s, self.config) for s in staying) > free:
            return False                     # even all expired turns would not make room
        for seq in victims:
            self._preempt(seq, rotation=True)
            self._rotated.append(seq.request_id)
        return True

    def _youngest_running_after(self, seq: SequenceRecord) -> Optional[SequenceRecord]:
        for candidate in reversed(self._running):
            if candidate.ticket <= seq.ticket:
                return None
            return candidate
        return None

    def _release(self, seq: SequenceRecord) -> None:
        self.pages.release(seq.page_table, seq.request_id)
        seq.page_table = []
        if seq.slot is not None:
            self.slots.release(seq.slot, seq.request_id)
            seq.slot = None

    def _preempt(self, seq: SequenceRecord, rotation: bool = False,
                 keep_state: bool = True) -> None:
        """Pause a running sequence. With the prefix cache (and a sound state) it keeps its
        state and partial block as a private resume point; otherwise it replays later."""
        self._running.remove(seq)
        if self.cache is not None and keep_state:
            self.cache.pause(seq)
        self._release(seq)
        seq.status = SeqStatus.PAUSED
        seq.num_computed = 0
        seq.preemptions += 1
        self.total_preemptions += 1
        # Back to the queue ahead of everything that never ran: in arrival order among the
        # paused, or (a turn that ended) behind every paused sequence, so turns rotate.
        index = 0
        while (index < len(self._waiting) and self._waiting[index].status is SeqStatus.PAUSED
               and (rotation or self._waiting[index].ticket < seq.ticket)):
            index += 1
        self._waiting.insert(index, seq)

    def _fail(self, seq: SequenceRecord, failed: list[tuple[str, FinishReason]]) -> None:
        self._running.remove(seq)
        self._release(seq)
        del self._seqs[seq.request_id]
        failed.append((seq.request_id, FinishReason.CONTEXT))

    # --- invariants (tests and debug builds) --------------------------------------------------

    def check_invariants(self) -> None:
        """Every page in use is in the tables of exactly its users (running sequences), every
        other page is free or cached; a sequence may write only where it is the sole user; every
        lane is held by one running sequence or is free."""
        owners = self.pages.owners()
        held: dict[int, set[str]] = {}
        for seq in self._running:
            assert seq.status is SeqStatus.RUNNING, seq
            assert seq.slot is not None
            assert len(seq.page_table) >= pages_for(seq.num_computed), seq
            assert len(set(seq.page_table)) == len(seq.page_table), f"{seq.request_id} maps a page twice"
            for page in seq.page_table:
                held.setdefault(page, set()).add(seq.request_id)
            for page in seq.page_table[seq.num_computed // PAGE_SIZE:]:
                assert self.pages.writable(page, seq.request_id), (seq.request_id, page)
        assert held == {page: set(users) for page, users in owners.items()}, (held, owners)
        assert self.pages.num_free + len(owners) == self.config.num_pages
        if self.cache is not None:
            self.cache.check()
        slot_owners = self.slots.owners()
        assert slot_owners == {s.slot: s.request_id for s in self._running}
        for seq in self._waiting:
            assert seq.status in (SeqStatus.WAITING, SeqStatus.PAUSED)
            assert not seq.page_table and seq.slot is None and seq.num_computed == 0
        assert set(self._seqs) == {s.request_id for s in self._running} | {
            s.request_id for s in self._waiting}

    def iter_records(self) -> Iterable[SequenceRecord]:
        return iter(self._seqs.values())
