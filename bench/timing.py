"""Timing helpers shared by the benches: host wall time of a repeated call, and CUDA events on a
runtime.cuda stream."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Sequence


def wall_ms(steps: int, work: Callable[[], Any]) -> float:
    """Mean host wall milliseconds of `work()` over `steps` calls, after two (capture, warm-up)."""
    work()
    work()
    t0 = time.perf_counter()
    for _ in range(steps):
        work()
    return (time.perf_counter() - t0) / steps * 1e3


def median_event_seconds(device: Any, stream: Any, work: Callable[[Any], None],
                         repeats: int = 5) -> float:
    """Median GPU time of `work(stream)` over `repeats` runs, after one warm-up run."""
    start, end = device.create_event(), device.create_event()
    work(stream)
    times = []
    for _ in range(repeats):
        start.record(stream)
        work(stream)
        end.record(stream)
        end.synchronize()
        times.append(end.elapsed_ms(start) / 1e3)
    return sorted(times)[repeats // 2]


def plan_breakdown_us(device: Any, stream: Any, plan: Sequence[Any],
                      rounds: int = 1) -> dict[str, float]:
    """Microseconds per kernel name over one eager run of a bound launch plan (events between
    the launches, so each kernel also carries its launch gap); the last of `rounds` runs is the
    one measured, the earlier ones warm up. Largest first."""
    events = [device.create_event() for _ in range(len(plan) + 1)]
    for _ in range(rounds):
        events[0].record(stream)
        for i, launch in enumerate(plan):
            launch(stream)
            events[i + 1].record(stream)
        events[-1].synchronize()
    totals: dict[str, float] = defaultdict(float)
    for i, launch in enumerate(plan):
        totals[launch.kernel.name] += events[i + 1].elapsed_ms(events[i]) * 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))
