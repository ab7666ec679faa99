"""Server metrics in the Prometheus text format 0.0.4 (`GET /metrics`).

Counters reset when the process restarts; labels are bounded (API name, outcome), never request
ids. Gauges about the engine (KV pages, lanes) come from the backend at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional

from protocols.generation import PHASES

PREFIX = "infernix"
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
# Request phases run from microseconds (a cache lookup) to minutes (a cold long prefill).
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0, 120.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, lines: list[str], labels: str = "") -> None:
        """labels: `name="value",` pairs of a histogram family's member (its header is the
        family's)."""
        full = f"{PREFIX}_{self.name}"
        if not labels:
            lines.append(f"# HELP {full} {self.help}")
            lines.append(f"# TYPE {full} histogram")
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{full}_bucket{{{labels}le="{_num(bound)}"}} {cumulative}')
        lines.append(f'{full}_bucket{{{labels}le="+Inf"}} {self.count}')
        suffix = f"{{{labels[:-1]}}}" if labels else ""
        lines.append(f"{full}_sum{suffix} {_num(self.total)}")
        lines.append(f"{full}_count{suffix} {self.count}")


@dataclass
class PhaseHistograms:
    """One histogram per request phase (`protocols.generation.PHASES`), exported as one
    family with a `phase` label."""

    name: str
    help: str
    members: dict[str, Histogram] = field(default_factory=dict)

    def observe(self, phase: str, value: float) -> None:
        if phase not in self.members:
            self.members[phase] = Histogram(self.name, self.help, PHASE_BUCKETS)
        self.members[phase].observe(value)

    def render(self, lines: list[str]) -> None:
        full = f"{PREFIX}_{self.name}"
        lines.append(f"# HELP {full} {self.help}")
        lines.append(f"# TYPE {full} histogram")
        for phase in PHASES:
            if phase in self.members:
                self.members[phase].render(lines, f'phase="{phase}",')


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    """All counters and histograms of one server process (event-loop thread only)."""

    def __init__(self, model_id: str = ""):
        self.model_id = model_id
        self.requests: dict[tuple[str, str], int] = {}  # (api, outcome) -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.reasoning_tokens = 0
        self.running = 0        # generations submitted and not finished
        self.connections = 0
        self.ttft = Histogram("time_to_first_token_seconds",
                              "Time from request received to the first output token.",
                              TTFT_BUCKETS)
        self.duration = Histogram("request_duration_seconds",
                                  "Time from request received to the last output token.",
                                  DURATION_BUCKETS)
        self.decode_rate = Histogram("decode_tokens_per_second",
                                     "Per-request decode speed after the first token.",
                                     RATE_BUCKETS)
        self.queue_wait = Histogram("queue_wait_seconds",
                                    "Time from submission to admission into a lane.",
                                    TTFT_BUCKETS)
        self.phases = PhaseHistograms("request_phase_seconds",
                                      "Where time to first token goes, per request phase.")
        self.prefill_steps = 0

    def count_request(self, api: str, outcome: str) -> None:
        key = (api, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe_generation(self, result, total_s: Optional[float]) -> None:
        self.prompt_tokens += result.prompt_tokens
        self.cached_prompt_tokens += result.cached_prompt_tokens
        self.generation_tokens += result.completion_tokens
        self.reasoning_tokens += result.reasoning_tokens
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        if total_s is not None:
            self.duration.observe(total_s)
        rate = result.decode_tokens_per_s
        if rate is not None:
            self.decode_rate.observe(rate)
        if result.queue_wait_s is not None:
            self.queue_wait.observe(result.queue_wait_s)

    def observe_phases(self, phases: dict[str, float], prefill_steps: int) -> None:
        """A finished request's phases (`Generation.ordered_phases`) and its prefill steps."""
        for phase, seconds in phases.items():
            self.phases.observe(phase, seconds)
        self.prefill_steps += prefill_steps

    def render(self, gauges: Callable[[], dict[str, float]], max_concurrency: int,
               max_context: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            full = f"{PREFIX}_{name}"
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                lines.append(f"{full}{labels} {_num(value)}")

        metric("model_info", "gauge", "The served model.",
               [(f'{{model="{_escape(self.model_id)}"}}', 1)])
        metric("max_concurrency", "gauge", "Lanes decoded together.", [("", max_concurrency)])
        metric("max_context_tokens", "gauge", "Context window per sequence.", [("", max_context)])
        metric("requests_total", "counter", "Finished requests by API and outcome.",
               [(f'{{api="{api}",outcome="{outcome}"}}', count)
                for (api, outcome), count in sorted(self.requests.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations "
               "(cached included).", [("", self.prompt_tokens)])
        metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix "
               "cache.", [("", self.cached_prompt_tokens)])
        metric("generation_tokens_total", "counter", "Output tokens (reasoning included).",
               [("", self.generation_tokens)])
        metric("reasoning_tokens_total", "counter", "Output tokens inside thinking.",
               [("", self.reasoning_tokens)])
        metric("prefill_steps_total", "counter", "Engine steps that computed a prompt chunk "
               "before the request's first token.", [("", self.prefill_steps)])
        metric("requests_running", "gauge", "Generations submitted and not finished.",
               [("", self.running)])
        metric("http_connections", "gauge", "Open client connections.",
               [("", self.connections)])
        engine = gauges()
        queue_depth = engine.get("requests_waiting", max(0, self.running - max_concurrency))
        metric("queue_depth", "gauge", "Requests waiting for a lane.", [("", queue_depth)])
        for name, value in sorted(engine.items()):
            if name == "requests_waiting":
                continue
            # Prometheus naming: a `_total` number only grows (preemptions): a counter.
            kind = "counter" if name.endswith("_total") else "gauge"
            metric(name, kind, f"Engine {kind} {name.replace('_', ' ')}.", [("", value)])
        for histogram in (self.ttft, self.duration, self.decode_rate, self.queue_wait):
            histogram.render(lines)
        self.phases.render(lines)
        return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
