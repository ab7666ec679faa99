"""Which tokens of each running sequence one step computes (the scheduler's rule 2).

Every running sequence with one pending token decodes this step. Prefill chunks share the rest
of the step's token budget in rotation: the sequence served longest ago goes first, so chunk
boundaries are turns and a long prompt cannot silence a short one, nor stop other sequences
from decoding. Chunks lie on an absolute grid (each ends at the next multiple of
`prefill_chunk` or at the end of the input) and are never cut to fit the budget: one that does
not fit waits for the next step, so a sequence's chunks never depend on its neighbours.

Pure functions of the sequences' records and the config: the scheduler then takes the pages.
"""

from __future__ import annotations

from typing import Sequence

from runtime.engine.kv_blocks import pages_for
from runtime.engine.scheduler_records import SchedulerConfig, SequenceRecord
from runtime.engine.sequence_cache import next_stop


def plan_tokens(running: Sequence[SequenceRecord], config: SchedulerConfig) -> dict[str, int]:
    """Request id -> tokens it computes this step; a running sequence left out waits."""
    plan: dict[str, int] = {}
    assert all(s.pending > 0 for s in running), "a running sequence has no input"
    decoding = [s for s in running if s.pending == 1 and s.num_computed > 0]
    for seq in decoding:
        plan[seq.request_id] = 1
    budget = config.token_budget - len(decoding)
    prefilling = sorted((s for s in running if s.request_id not in plan),
                        key=lambda s: (s.last_prefill_step, s.ticket))
    for seq in prefilling:
        count = next_chunk(seq, config)
        if count > budget:
            continue                  # the whole chunk next step, never a budget-sized one
        plan[seq.request_id] = count
        budget -= count
    return plan


def next_chunk(seq: SequenceRecord, config: SchedulerConfig) -> int:
    """Tokens of the sequence's next prefill chunk. The chunk grid is absolute: a chunk ends
    at the next multiple of `prefill_chunk` or at the end of the input, so how a sequence is
    cut into chunks depends on its own positions only, never on what else runs this step.
    That keeps its arithmetic request-invariant (the runner's GDN chunk walk and its GEMM /
    GEMV choice see the same pieces alone or batched) and lets a cached prefix resume on the
    same grid a cold run uses (docs/architecture.md, request invariance)."""
    grid = config.prefill_chunk
    count = min(seq.pending, grid - seq.num_computed % grid)
    # Snapshot stops (hints, multiples of snapshot_interval) are chunk ends too.
    stop = next_stop(seq, seq.num_computed, config.snapshot_interval)
    return count if stop is None else min(count, stop - seq.num_computed)


def next_unit_pages(seq: SequenceRecord, config: SchedulerConfig) -> int:
    """Pages the sequence's next unit (its decode row or next chunk) takes beyond its table."""
    count = 1 if seq.pending == 1 and seq.num_computed > 0 else next_chunk(seq, config)
    return max(0, pages_for(seq.num_computed + count) - len(seq.page_table))
