"""The scheduler's records: its capacities (`SchedulerConfig`), its view of one sequence
(`SequenceRecord`, mutable, owned by the scheduler) and what one step computes
(`ScheduledBatch` of `PrefillWork` chunks and `DecodeWork` rows, the typed batch the engine
runs). Pure data: the rules that fill them are in `scheduler.py` and `step_plan.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from runtime.engine.api import FinishReason
from runtime.engine.prefix_cache import PrefixCacheConfig
from runtime.model.runner import DecodeItem, PrefillChunk


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacities fixed at startup.

    num_lanes: sequences resident at once (1..8); each holds one state slot.
    num_pages: KV pages in the shared pool (64 tokens each).
    max_context: most tokens (prompt + output) of one sequence.
    prefill_chunk: most tokens of one prefill chunk.
    max_batched_tokens: most tokens computed in one step (decode items count one each);
        None = prefill_chunk + num_lanes (the least allowed: a whole chunk always fits beside
        the other lanes' decode rows).
    max_waiting: bound of the admission queue (requests not yet holding a lane, preempted ones
        excluded: they were admitted once and must come back).
    service_turn_tokens: new output tokens a sequence may produce, under KV contention, before
        it gives way to a sequence blocked by pages (bounded service turns).
    snapshot_interval: prefill chunks also end at multiples of this (0 = not), and there the
        prefix cache snapshots long prompts; the same with the cache on or off, so a request's
        chunks never depend on the cache.
    prefix_cache: the prefix cache's capacities (None: no cache, preemption replays).
    """

    num_lanes: int
    num_pages: int
    max_context: int
    prefill_chunk: int = 1024
    max_batched_tokens: Optional[int] = None
    max_waiting: int = 16
    service_turn_tokens: int = 128
    snapshot_interval: int = 0
    prefix_cache: Optional[PrefixCacheConfig] = None

    def __post_init__(self):
        if not 1 <= self.num_lanes <= 8:
            raise ValueError(f"num_lanes must be in 1..8, got {self.num_lanes}")
        if self.num_pages < 1 or self.max_context < 2 or self.prefill_chunk < 1:
            raise ValueError(f"invalid scheduler capacities: {self}")
        if self.max_batched_tokens is not None \
                and self.max_batched_tokens < self.prefill_chunk + self.num_lanes:
            # Chunks are never cut to the budget (`step_plan.next_chunk`): a whole one must fit
            # beside a decode row of every other lane.
            raise ValueError("max_batched_tokens must be at least prefill_chunk + num_lanes")
        if self.max_waiting < 0 or self.service_turn_tokens < 1:
            raise ValueError("max_waiting must be >= 0 and service_turn_tokens >= 1")

    @property
    def token_budget(self) -> int:
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        return self.prefill_chunk + self.num_lanes


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # queued, never run
    RUNNING = "running"    # holds a lane and pages
    PAUSED = "paused"      # preempted: queued again, will replay its committed tokens


@dataclass
class SequenceRecord:
    """The scheduler's view of one request (mutable; owned by the scheduler)."""

    request_id: str
    ticket: int                       # arrival order; smaller = older
    prompt_len: int
    token_ids: list[int]              # prompt + committed output
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0             # tokens whose KV / state the model holds
    page_table: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    last_prefill_step: int = -1       # for prefill rotation
    high_water: int = 0               # most tokens ever computed (replay accounting)
    preemptions: int = 0
    replayed_tokens: int = 0
    turn_start_output: int = 0        # num_output when its current service turn began
    turn_start_step: int = 0
    snapshot_positions: tuple[int, ...] = ()   # the request's snapshot hints (chunk ends)
    # Its images as the cache keys them: (first pad position, pad count, `media_key_ids`).
    media_keys: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    block_digests: list[bytes] = field(default_factory=list)  # hashes of its full blocks
    cached_tokens: Optional[int] = None   # prompt tokens its first admission resumed past
    resume_path: str = "cold"         # how it last started: cold, prefix, snapshot or replay
    match_s: float = 0.0              # its last admission: prefix-cache lookups (seconds)
    resume_s: float = 0.0             # and the resume's mapping of what matched

    @property
    def turn_output(self) -> int:
        """New tokens produced in the current service turn."""
        return self.num_output - self.turn_start_output

    @property
    def pending(self) -> int:
        """Committed tokens not computed yet (>= 1 for a running sequence)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def key_ids(self, lo: int = 0, hi: Optional[int] = None) -> list[int]:
        """token_ids[lo:hi] as the prefix cache hashes and compares them: each image's pad
        tokens replaced by the ids of its content (`kv_blocks.media_key_ids`)."""
        hi = len(self.token_ids) if hi is None else hi
        ids = self.token_ids[lo:hi]
        for offset, count, values in self.media_keys:
            for p in range(max(lo, offset), min(hi, offset + count)):
                ids[p - lo] = values[p % 4]
        return ids


@dataclass(frozen=True)
class PrefillWork:
    """A chunk of one sequence: tokens `start_pos .. start_pos + len(token_ids) - 1`.

    reset_slot: the sequence starts from position 0 in a (re)acquired lane; the runner must
        `reset_slot(slot)` first.
    samples: the chunk reaches the last committed token, so its last logits give the next token.
    replay: the chunk recomputes tokens computed before a preemption.
    """

    request_id: str
    slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    page_table: tuple[int, ...]
    reset_slot: bool
    samples: bool
    replay: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chunk(self) -> PrefillChunk:
        return PrefillChunk(slot=self.slot, token_ids=self.token_ids, start_pos=self.start_pos,
                            page_table=self.page_table, all_logits=False)


@dataclass(frozen=True)
class DecodeWork:
    """One sequence's last committed token at position `pos`; always samples the next one.

    draft_room: draft tokens this unit may verify beside it (speculative decoding,
        `runtime.engine.speculative`): the page table covers positions pos .. pos + draft_room.
    """

    request_id: str
    slot: int
    token_id: int
    pos: int
    page_table: tuple[int, ...]
    draft_room: int = 0

    def item(self) -> DecodeItem:
        return DecodeItem(slot=self.slot, token_id=self.token_id, pos=self.pos,
                          page_table=self.page_table)


@dataclass(frozen=True)
class ScheduledBatch:
    """What one engine step computes.

    decodes: one-token items, batched in one runner call.
    prefills: chunks, one runner call each, in this order.
    preempted: sequences paused this step (they replay later; their output is kept).
    admitted: sequences that took a lane this step (fresh or resumed).
    failed: (request_id, reason) for sequences ended by the scheduler itself: CONTEXT when a
        sequence cannot get pages even alone. They are already removed.
    """

    step: int
    decodes: tuple[DecodeWork, ...] = ()
    prefills: tuple[PrefillWork, ...] = ()
    preempted: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    failed: tuple[tuple[str, FinishReason], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(p.num_tokens for p in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def sampling_requests(self) -> list[str]:
        """Requests whose next token is sampled from this step's logits."""
        return [d.request_id for d in self.decodes] + [
            p.request_id for p in self.prefills if p.samples]
