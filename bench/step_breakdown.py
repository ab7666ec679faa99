"""Where one step's time goes on `CudaRunner`: every launch of the step timed on its own, grouped
by part of the model and kernel family, against the step's captured graph.

    python -m bench.step_breakdown --out results/ [--synthetic-shape qwen3.6-35b-a3b] [--batch 1]
        [--steps decode,verify,mtp,prefill] [--k 3] [--context 1024] [--chunk 2048] [--reps 10]
        [--format bf16|fp8|nvfp4] [--router balanced|skewed] [--pdl on|off|off,on]

Step kinds (synthetic weights of the shape; each step is set up by the runner's own call, which
binds its launch list, captures its graph and uploads its metadata, then timed before the next):
`decode` (a decode step of `batch` rows at `context`), `verify` (a verification step of 1 + k
tokens a row, `runner.step`), `mtp` (the MTP head: the chain of drafts 2..k, `mtp_chain.DraftChain`,
and the catch-up over the 1 + k positions of each row, with its lm_head), `prefill` (one prompt
chunk of `chunk` tokens; its graph is captured here, the runner launches prefill eagerly).

Two timings of each launch, both reported:
- `events`: the step's launch list run eagerly with a CUDA event after every launch, the median of
  `reps` rounds after a warm-up round; each round is queued behind device copies long enough to
  cover the host's issue time (measured in the warm-up round), so the GPU never waits on the host
  and each interval is the launch's GPU time in the step's cache state (plus one event record);
- `alone`: each launch repeated `reps` times in a graph of its own, replayed; the mean. The same
  launch back to back: weights that fit in L2 stay there, so a small launch reads warmer than in
  the step.
The step's graph is replayed `reps` times between two events; gap = graph time - summed launches.
`--pdl off,on` sets each step up and times it twice on one runner, without and then with
programmatic dependent launch (runtime/model/gpu/pdl.py): the graph time is the one PDL can
change (the events between eager launches order every launch after the previous one).
The tables (bench/step_table.py) group launches by part (gdn, attention, moe_mlp, dense_mlp,
norms, lm_head, ...) and family, with bytes and bandwidth (against a device copy measured in the
same run) where the bytes follow from the kernel's key. Writes `step_breakdown_<shape>_b<batch>.json`
and `.md` to `--out`, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.step_table import describe, parts, render, summarize

HEAD_START_BYTES = 256 << 20  # one device copy queued ahead of an `events` round (twice this moved)


class Timer:
    """CUDA-event timing of launches on the runner's stream (module docstring)."""

    def __init__(self, runner: Any, reps: int, copy_bw: float):
        self.runner, self.device, self.stream = runner, runner.device, runner.stream
        self.reps, self.copy_bw = reps, copy_bw
        self.src = self.device.mem_alloc(HEAD_START_BYTES, "step breakdown head-start copy")
        self.dst = self.device.mem_alloc(HEAD_START_BYTES, "step breakdown head-start copy")

    def close(self) -> None:
        self.device.mem_free(self.src)
        self.device.mem_free(self.dst)

    def graph_us(self, graph: Any) -> float:
        """Mean µs of one replay of `graph`, back to back, after one warm-up replay."""
        start, end = self.device.create_event(), self.device.create_event()
        graph.replay(self.stream)
        start.record(self.stream)
        for _ in range(self.reps):
            graph.replay(self.stream)
        end.record(self.stream)
        end.synchronize()
        return end.elapsed_ms(start) * 1e3 / self.reps

    def events_us(self, plan: list) -> list[float]:
        """Per launch, the median µs between the events around it over `reps` eager rounds."""
        events = [self.device.create_event() for _ in range(len(plan) + 1)]
        times: list[list[float]] = [[] for _ in plan]
        copies = 0  # head-start copies per round; the warm-up round measures how many
        for r in range(self.reps + 1):
            for _ in range(copies):
                self.device.memcpy_dtod(self.dst, self.src, HEAD_START_BYTES, self.stream)
            t0 = time.perf_counter()
            events[0].record(self.stream)
            for i, launch in enumerate(plan):
                launch(self.stream)
                events[i + 1].record(self.stream)
            issue = time.perf_counter() - t0
            events[-1].synchronize()
            if r == 0:
                # Copies enough to keep the GPU busy twice as long as the host took to queue the round.
                copies = int(2 * issue * self.copy_bw / (2 * HEAD_START_BYTES)) + 1
                continue
            for i in range(len(plan)):
                times[i].append(events[i + 1].elapsed_ms(events[i]) * 1e3)
        return [statistics.median(t) for t in times]

    def alone_us(self, plan: list) -> list[float]:
        """Per launch, the mean µs of `reps` back-to-back copies of it in one graph."""
        out = []
        for launch in plan:
            graph = self.runner.steps.record([launch] * self.reps)
            try:
                out.append(self.graph_us(graph) / self.reps)
            finally:
                graph.destroy()
        return out


def _cached(runner: Any, key: tuple) -> list:
    """The bound launch list the runner's last call of this shape used (`step.Plans`)."""
    def missing() -> list:
        raise KeyError(f"the runner bound no plan {key}")
    return runner.steps.plans.get(key, missing)


class Steps:
    """Sets up each step kind on `runner` and returns (title, launch list, its graph or None, whether
    the graph is ours to destroy)."""

    def __init__(self, runner: Any, batch: int, k: int, context: int, chunk: int):
        from runtime.model.gpu.storage import BUCKETS

        self.runner, self.batch, self.k, self.context, self.chunk = runner, batch, k, context, chunk
        self.bucket = next(b for b in BUCKETS if b >= batch)
        self.pages_per_row = runner.num_pages // batch

    def table(self, b: int) -> list[int]:
        return list(range(b * self.pages_per_row, (b + 1) * self.pages_per_row))

    def decode(self) -> list[tuple[str, list, Any, bool]]:
        from runtime.model.runner import DecodeItem

        r = self.runner
        r.decode([DecodeItem(slot=b, token_id=(1000 + b) % r.vocab_size, pos=self.context, page_table=self.table(b))
                  for b in range(self.batch)])
        return [(f"decode, batch {self.batch}, context {self.context}", r.steps.decode_plan(self.bucket),
                 r.steps.graphs[self.bucket], False)]

    def _verify_rows(self) -> list:
        from bench.verify_step import rows_for

        r = self.runner
        return rows_for(self.batch, self.k + 1, self.context, self.pages_per_row, r.max_batch, True, r.vocab_size)

    def verify(self) -> list[tuple[str, list, Any, bool]]:
        r, t = self.runner, self.k + 1
        r.step(self._verify_rows())
        key = ("verify", self.batch, t)
        return [(f"verify 1+{self.k}, batch {self.batch}, context {self.context}", _cached(r, key), r.steps.graphs[key],
                 False)]

    def mtp(self) -> list[tuple[str, list, Any, bool]]:
        from runtime.model.runner import MtpRow

        r = self.runner
        rows = self._verify_rows()
        r.step(rows)  # the hidden rows the head drafts from

        def draft(n: int) -> None:
            r.mtp_draft([MtpRow(row.slot, [(t + 1) % r.vocab_size for t in row.token_ids], self.context,
                                row.page_table, n) for row in rows])

        out = []
        if self.k > 1:
            draft(self.k)
            active = (self.batch,) * (self.k - 1)
            chain = r._mtp.chain
            graph = chain.graphs[active] if chain is not None and r.steps.cuda_graphs else None
            if chain is not None:
                out.append((f"MTP chain of drafts 2..{self.k}, batch {self.batch}", chain.plan(active), graph, False))
        draft(1)  # last: its metadata is the catch-up's
        m = self.batch * (self.k + 1)
        plan = _cached(r, ("mtp", m, self.batch, self.batch, r.mtp_draft_vocab))
        out.append((f"MTP catch-up over 1+{self.k} positions, batch {self.batch}", plan, r.steps.record(plan), True))
        return out

    def prefill(self) -> list[tuple[str, list, Any, bool]]:
        from runtime.model.runner import PrefillChunk

        r = self.runner
        r.reset_slot(0)
        r.prefill(PrefillChunk(slot=0, token_ids=[(7 + i) % r.vocab_size for i in range(self.chunk)], start_pos=0,
                               page_table=self.table(0)))
        plan = _cached(r, ("prefill", self.chunk, False))  # a chunk from position 0: no key splits
        return [(f"prefill chunk of {self.chunk} tokens", plan, r.steps.record(plan), True)]


KINDS = ("decode", "verify", "mtp", "prefill")


def run(runner: Any, kinds: list[str], batch: int, k: int, context: int, chunk: int, reps: int,
        copy_bw: float) -> dict[str, Any]:
    """{title: {"events": summary, "alone": summary, "launches": [...]}} for each step kind."""
    steps = Steps(runner, batch, k, context, chunk)
    timer = Timer(runner, reps, copy_bw)
    norm_keys = (runner.kernels.norm, runner.kernels.add_norm)
    out: dict[str, Any] = {}
    try:
        for kind in kinds:
            setup: Callable[[], list] = {"decode": steps.decode, "verify": steps.verify, "mtp": steps.mtp,
                                         "prefill": steps.prefill}[kind]
            for title, plan, graph, own in setup():
                try:
                    graph_us = timer.graph_us(graph) if graph is not None else None
                finally:
                    if own and graph is not None:
                        graph.destroy()
                infos = [describe(launch) for launch in plan]
                names = parts(infos, norm_keys)
                events, alone = timer.events_us(plan), timer.alone_us(plan)
                out[title] = {
                    "events": summarize(infos, names, events, graph_us, copy_bw),
                    "alone": summarize(infos, names, alone, graph_us, copy_bw),
                    "launches": [{"family": i.family, "key": i.key, "rows": i.rows, "part": n, "us_events": e,
                                  "us_alone": a} for i, n, e, a in zip(infos, names, events, alone)]}
                print(render(f"{title} (events)", out[title]["events"]), flush=True)
    finally:
        timer.close()
    return out


def render_all(data: dict[str, Any]) -> str:
    lines = [f"Step breakdown: {data['shape']}, batch {data['batch']}, context {data['context']}, k {data['k']}, "
             f"{data['reps']} repetitions; copy bandwidth {data['copy_bandwidth_gb_s']:.0f} GB/s (read + write).", ""]
    for title, step in data["steps"].items():
        lines += [render(f"{title}: launches between events in the step", step["events"]), "",
                  render(f"{title}: each launch alone, back to back", step["alone"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--synthetic-shape", default="qwen3.6-35b-a3b",
                    help="model shape: a name of runtime/model/shapes.py or a JSON text config")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", default="decode", help=f"step kinds, comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--k", type=int, default=3, help="drafts per row (verify: 1 + k tokens; mtp: k drafts)")
    ap.add_argument("--context", type=int, default=1024, help="position of the decode / verify / MTP rows")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--format", choices=("bf16", "fp8", "nvfp4"), default="bf16")
    ap.add_argument("--router", choices=("balanced", "skewed"), default="balanced")
    ap.add_argument("--pdl", default="default", help="programmatic dependent launch in the decode and "
                    "verification plans: on, off, or off,on (both, one after the other); "
                    "runtime/model/gpu/kernels.py's PDL if omitted")
    args = ap.parse_args(argv)
    pdl_modes = args.pdl.split(",")
    if not pdl_modes or any(m not in ("on", "off", "default") for m in pdl_modes) or len(set(pdl_modes)) < len(pdl_modes):
        ap.error(f"--pdl {args.pdl!r}: on, off or off,on")
    kinds = [s for s in args.steps.split(",") if s]
    bad = [s for s in kinds if s not in KINDS]
    if bad or not kinds:
        ap.error(f"--steps {args.steps!r}: name one or more of {', '.join(KINDS)}")
    if not 1 <= args.batch <= 8 or args.k < 1 or args.reps < 1 or args.chunk < 1 or args.context < 0:
        ap.error("--batch must be 1..8, --k, --reps and --chunk at least 1, --context at least 0")

    from bench.decode import copy_bandwidth, make_runner

    runner = make_runner(args.batch, max(args.context + 2 * args.k + 16, args.chunk), prefill_chunk=args.chunk,
                         weight_format=args.format, spare_slots=args.batch * (args.k + 1), mtp="mtp" in kinds,
                         shape=args.synthetic_shape, router=args.router)
    try:
        bw = copy_bandwidth(runner.device, runner.stream)
        steps = {}
        for mode in pdl_modes:
            if mode != "default":
                runner.steps.destroy_graphs()  # every plan and graph bound again, with or without PDL
                runner.kernels.pdl = mode == "on"
            tag = "" if len(pdl_modes) == 1 else f", PDL {mode}"
            steps.update({title + tag: step for title, step in
                          run(runner, kinds, args.batch, args.k, args.context, args.chunk, args.reps, bw).items()})
        data = {"pdl": args.pdl,"shape": args.synthetic_shape, "batch": args.batch, "context": args.context, "k": args.k,
                "chunk": args.chunk, "reps": args.reps, "format": args.format, "copy_bandwidth_gb_s": bw / 1e9,
                "device": runner.device.describe(), "steps": steps}
    finally:
        runner.close()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"step_breakdown_{Path(args.synthetic_shape).stem}_b{args.batch}"
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    text = render_all(data)
    (args.out / f"{stem}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
