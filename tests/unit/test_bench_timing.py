"""The GPU bench timing helpers, on a scripted clock (the benches themselves need an H200)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.timing import median_event_seconds, plan_breakdown_us


class ScriptedDevice:
    """Events read a clock that `work` advances by scripted milliseconds."""

    def __init__(self):
        self.now_ms = 0.0

    def create_event(self):
        device = self

        class Event:
            at = None

            def record(self, stream):
                self.at = device.now_ms

            def synchronize(self):
                pass

            def elapsed_ms(self, start):
                return self.at - start.at

        return Event()


def test_median_skips_the_warm_up_and_takes_the_middle_run():
    device = ScriptedDevice()
    durations = iter([100.0, 5.0, 1.0, 3.0, 2.0, 4.0])  # warm-up first, then five runs
    calls = []

    def work(stream):
        calls.append(stream)
        device.now_ms += next(durations)

    assert median_event_seconds(device, "s", work) == 3.0 / 1e3
    assert calls == ["s"] * 6


class Launch:
    """A bound launch whose run costs `first_ms` the first time and `ms` afterwards."""

    def __init__(self, device, name, first_ms, ms):
        self.device, self.kernel = device, SimpleNamespace(name=name)
        self.costs = iter([first_ms])
        self.ms = ms

    def __call__(self, stream):
        self.device.now_ms += next(self.costs, self.ms)


def test_breakdown_sums_per_kernel_name_from_the_last_round():
    device = ScriptedDevice()
    plan = [Launch(device, "norm", 50.0, 0.5), Launch(device, "gemm", 90.0, 2.0),
            Launch(device, "norm", 50.0, 0.25)]
    totals = plan_breakdown_us(device, "s", plan, rounds=2)
    assert list(totals) == ["gemm", "norm"]  # largest first
    assert totals == {"gemm": 2000.0, "norm": 750.0}
