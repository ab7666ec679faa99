"""Checks on engine outputs shared by the CPU and GPU test files (no tests here)."""

from __future__ import annotations

from runtime.engine.api import FinishReason


def resumed_without_recomputation(results: dict, expected: dict) -> int:
    """Every request of `results` (request id -> its outputs) ran to its length limit with the
    tokens of `expected` and no replayed token (a pause kept its state); returns how many
    preemptions they took in all."""
    preemptions = 0
    for rid, outputs in results.items():
        final = outputs[-1]
        assert final.finish_reason is FinishReason.LENGTH, (rid, final.error)
        assert final.stats.replayed_tokens == 0, rid
        assert [t for o in outputs for t in o.token_ids] == expected[rid], rid
        preemptions += final.stats.preemptions
    return preemptions
