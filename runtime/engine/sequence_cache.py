"""What the scheduler does with the prefix cache for one sequence, in one place.

The scheduler calls these at four points of a sequence's life:

- admission (`match` + `resume_need`, then `start`): a fresh prompt resumes from the deepest
  cached snapshot of a prefix, a paused sequence from its own pause point; the sequence's page
  table starts with the mapped blocks and `num_computed` at the snapshot's position;
- after each step (`after_step`): every block the sequence has now computed in full is
  published (`publish`): a prompt block under its chain hash, so later prompts can map it, a
  block holding decoded positions under `decoded_hash`, which no prompt matches; and at
  snapshot stops (a `snapshot_positions` hint rounded down to the block, a multiple of
  `snapshot_interval`, the prompt's end when it ends a block) the state after the chunk is
  kept (`capture`);
- at the end (`finish`): its blocks are published; the state after its answer is not kept;
- when preempted (`pause`): its state and partial block are kept as a private resume point,
  so it resumes without recomputation (replay only when there is no room).

Exactness: a request resumes only from a state its own cold run computes bit for bit. Prefill
chunks end on the prompt's grid (multiples of `prefill_chunk`), at multiples of
`snapshot_interval` and at the request's `snapshot_positions` hints, which the scheduler rounds
down to a multiple of the 64-token block; so every chunk inside a prompt starts on a block
boundary, and the runners' state there is the same whichever stops cut the prompt (the GDN
chunked walk keeps 64-token chunks from the piece start and carries its fp32 state across
them; a linear layer's rows do not see each other once a piece has more than 16 rows). Shared
snapshots are taken only there (`PrefixCache.capture` refuses other positions), and only state
and K/V computed by prefill are shared. Decode steps take other kernels (GEMV over the batch,
split-KV attention, the recurrent step) than prefill, so an answer's state and K/V round
differently from a cold prefill of the same tokens (measured on the H200: a 27B-shape
conversation resumed at the end of the previous answer diverged from its cold run at the 19th
token); the next turn prefills the answer again from the last stop before it (the block
holding the generation opener the server hints).
"""

from __future__ import annotations

import time
from typing import Mapping, Optional, Sequence

from runtime.engine.kv_blocks import BlockManager, chain_hash, decoded_hash, media_key_ids, pages_for
from runtime.engine.prefix_cache import PrefixCache, PrefixCacheConfig, Snapshot
from runtime.engine.scheduler_records import ScheduledBatch, SeqStatus, SequenceRecord
from runtime.model.runner import PAGE_SIZE


def media_cache_keys(prompt_ids: Sequence[int], media: Sequence) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """A prompt's images (`MediaSpan`s) as `SequenceRecord.media_keys`: each image's first pad
    position, its run of pad tokens there, and the ids its content digest stands for."""
    keys = []
    for span in media:
        if not span.digest:
            raise ValueError(f"the image at position {span.offset} has no content digest")
        end = span.offset
        while end < len(prompt_ids) and prompt_ids[end] == prompt_ids[span.offset]:
            end += 1
        keys.append((span.offset, end - span.offset, media_key_ids(span.digest)))
    return tuple(keys)


def block_stops(hints: Sequence[int]) -> tuple[int, ...]:
    """`snapshot_positions` hints as chunk stops: each rounded down to a multiple of the block
    size (module docstring: exactness), those below one block dropped, sorted, once each."""
    return tuple(sorted({p // PAGE_SIZE * PAGE_SIZE for p in hints if p >= PAGE_SIZE}))


def next_stop(seq: SequenceRecord, position: int, interval: int) -> Optional[int]:
    """The first snapshot stop after `position` inside the prompt (hints and multiples of
    `interval`, 0 = none), or None. The prompt's end is a chunk end anyway."""
    stops = [p for p in seq.snapshot_positions if position < p < seq.prompt_len]
    if interval > 0:
        step = (position // interval + 1) * interval
        if step < seq.prompt_len:
            stops.append(step)
    return min(stops) if stops else None


def is_stop(seq: SequenceRecord, position: int, interval: int) -> bool:
    """Whether the state after `position` prompt tokens is worth a snapshot."""
    return position == seq.prompt_len or position in seq.snapshot_positions or (
        interval > 0 and position % interval == 0 and position < seq.prompt_len)


class SequenceCache:
    """The scheduler's prefix-cache hooks (see module docstring)."""

    def __init__(self, config: PrefixCacheConfig, blocks: BlockManager, interval: int):
        self.cache = PrefixCache(config, blocks)
        self.blocks = blocks
        self.interval = interval

    def match(self, seq: SequenceRecord) -> Optional[Snapshot]:
        return self.cache.match(seq.key_ids(), seq.request_id)

    def resume_need(self, seq: SequenceRecord, entry: Snapshot) -> int:
        """Pages a resume takes from the pool, room for its pending tokens and one more
        included (admission must not take in a sequence it would have to pause at once)."""
        return self.cache.resume_cost(entry) + max(
            0, pages_for(len(seq.token_ids) + 1) - pages_for(entry.position))

    def resume(self, seq: SequenceRecord, entry: Snapshot) -> None:
        """Start `seq` (holding a lane, no pages) at `entry`."""
        first = seq.cached_tokens is None
        seq.resume_path = "snapshot" if entry.owner is not None else "prefix"
        seq.page_table = self.cache.resume(entry, seq.request_id, seq.slot)
        seq.num_computed = entry.position
        seq.block_digests = list(entry.chain)
        if first:
            seq.cached_tokens = entry.position

    def start(self, seq: SequenceRecord, was_paused: bool, free_pages: int) -> bool:
        """Resume an admitted `seq` at the deepest snapshot the cache has for it when its
        pages fit in `free_pages` (the match is redone: pausing turn-expired sequences may
        have moved cache entries). False when it starts at position 0 instead: its private
        resume point is dropped, and a fresh prompt counts as a miss. Adds the time of the match
        to `seq.match_s` and sets `seq.resume_s` to the resume's."""
        started = time.perf_counter()
        entry = self.match(seq)
        matched = time.perf_counter()
        seq.match_s += matched - started
        if entry is not None and self.cache.resume_cost(entry) <= free_pages:
            self.resume(seq, entry)
            seq.resume_s = time.perf_counter() - matched
            return True
        self.cache.drop_private(seq.request_id)
        if not was_paused and self.cache.config.reuse:
            self.cache.stats["misses"] += 1
        return False

    def after_step(self, batch: ScheduledBatch, seqs: Mapping[str, SequenceRecord]) -> None:
        """Publish what the step completed; snapshot prompt chunks that end at a stop.
        seqs: the scheduler's records (sequences finished since the schedule are gone)."""
        for work in (*batch.decodes, *batch.prefills):
            seq = seqs.get(work.request_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:
                self.publish(seq)
        for work in batch.prefills:
            seq = seqs.get(work.request_id)
            end = work.start_pos + work.num_tokens
            if seq is not None and seq.status is SeqStatus.RUNNING and not work.replay \
                    and is_stop(seq, end, self.interval):
                self.capture(seq, end)

    def publish(self, seq: SequenceRecord) -> None:
        """Publish the blocks `seq` has computed in full since the last call."""
        done = min(seq.num_computed, len(seq.token_ids)) // PAGE_SIZE
        while len(seq.block_digests) < done:
            index = len(seq.block_digests)
            parent = seq.block_digests[-1] if seq.block_digests else None
            decoded = (index + 1) * PAGE_SIZE > seq.prompt_len
            digest = (decoded_hash if decoded else chain_hash)(
                parent, seq.key_ids(index * PAGE_SIZE, (index + 1) * PAGE_SIZE))
            seq.block_digests.append(digest)
            # A page with the same content computed by another sequence stays canonical; this
            # one stays private to `seq` (its KV is its own computation: request invariance).
            self.blocks.publish(seq.page_table[index], digest)

    def capture(self, seq: SequenceRecord, position: int) -> None:
        if self.cache.config.reuse:
            self._republish(seq, position)
            self.cache.capture(seq.key_ids(), position, seq.block_digests, seq.page_table,
                               seq.slot)

    def _republish(self, seq: SequenceRecord, position: int) -> None:
        """Make every block a snapshot at `position` needs findable again: a block whose
        canonical page was evicted while `seq` kept its own copy is published from that copy
        (a snapshot never depends on content that no page or host copy holds)."""
        for index, digest in enumerate(seq.block_digests[:position // PAGE_SIZE]):
            if self.blocks.lookup(digest) is None:
                self.blocks.publish(seq.page_table[index], digest)

    def finish(self, seq: SequenceRecord, keep_state: bool) -> None:
        """A running sequence ends: publish its blocks (when its state is sound). Its endpoint
        state is not kept: decode steps computed it (module docstring, exactness)."""
        if keep_state and seq.num_computed > 0:
            self.publish(seq)

    def pause(self, seq: SequenceRecord) -> bool:
        """Keep a preempted sequence's state; False when it must replay instead."""
        if seq.num_computed == 0:
            return False
        self.publish(seq)
        self._republish(seq, seq.num_computed)
        return self.cache.pause(seq.request_id, seq.key_ids(), seq.num_computed,
                                seq.block_digests, seq.page_table, seq.slot)

    def check(self) -> None:
        self.blocks.check()
        self.cache.check()
