"""What n-gram speculation costs a decode step when nothing matches (issue 21: < 3 %), end to end
on the GPU: the engine over one `CudaRunner` of a released shape with synthetic weights, the same
requests decoded with `--ngram-draft-tokens 0` and with n-gram drafting on.

    python -m bench.ngram_cost --out DIR [--batches 1,8] [--new 128] [--prompt 512]

Each request is a random prompt with seeded sampling (temperature 1, top-k 20): noise weights
give noise text, in which the last `--min-match` tokens almost never occurred before, so the
index proposes (next to) nothing and every step is a plain decode step; what n-gram drafting
adds is the index's lookup and update per token and the decode step computed ahead that
speculation gives up. Reports the mean decode time per output token (each request's `decode_s`
over its tokens after the first) per mode and the ratio, with the drafts proposed (they should
be ~0: else the comparison measures rounds). Writes `ngram_cost.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np


def _decode(runner: Any, spec: Any, batch: int, prompt_len: int, new: int, seed: int) -> dict[str, Any]:
    from runtime.engine.api import EngineRequest, SamplingParams
    from runtime.engine.engine_loop import Engine, EngineConfig

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, runner.vocab_size, prompt_len).tolist() for _ in range(batch)]
    config = EngineConfig(num_lanes=batch, max_context=prompt_len + new + 64, speculative=spec)
    # The engine's thread takes the runner's CUDA context (as the server's does); the logger
    # prints a failed request's cause.
    with Engine(runner, config, logger=logging.getLogger("bench.ngram_cost"),
                on_thread_start=runner.device.make_current) as engine:
        streams = [engine.submit(EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=1.0, top_k=20,
                                                                                 seed=seed + i), new))
                   for i, p in enumerate(prompts)]
        finals = [list(stream)[-1] for stream in streams]
        counters = dict(engine.counters)
    for f in finals:  # a failed request would time nothing (its decode_s is 0): say why instead
        if f.error or f.stats is None or f.stats.output_tokens < 2:
            raise RuntimeError(f"request {f.request_id} ended with {f.stats.output_tokens if f.stats else 0} "
                               f"tokens ({f.finish_reason}): {f.error or 'no error given'}")
    per_token = [f.stats.decode_s / (f.stats.output_tokens - 1) for f in finals]
    return {"ms_per_token": 1e3 * float(np.mean(per_token)), "drafted": counters.get("spec_drafted_tokens", 0),
            "rounds": counters.get("spec_rounds", 0), "tokens": sum(f.stats.output_tokens for f in finals)}


def run(batches: list[int], new: int, prompt_len: int, draft_tokens: int, min_match: int,
        shape: str) -> list[dict[str, Any]]:
    from bench.decode import make_runner
    from runtime.engine.speculative import SlotLayout, SpeculativeConfig

    off = SpeculativeConfig()
    ngram = SpeculativeConfig(ngram_draft_tokens=draft_tokens, ngram_min_match=min_match)
    most = max(batches)
    layout = SlotLayout.for_config(most, ngram)
    runner = make_runner(most, prompt_len + new + 64, spare_slots=layout.reserved - most, shape=shape)
    out = []
    try:
        _decode(runner, off, 1, prompt_len, 8, 99)  # graphs captured, kernels warm
        for batch in batches:
            plain = _decode(runner, off, batch, prompt_len, new, 1000 * batch)
            spec = _decode(runner, ngram, batch, prompt_len, new, 1000 * batch)
            row = {"batch": batch, "new_tokens": new, "plain_ms_per_token": plain["ms_per_token"],
                   "ngram_ms_per_token": spec["ms_per_token"], "ratio": spec["ms_per_token"] / plain["ms_per_token"],
                   "drafted": spec["drafted"], "rounds": spec["rounds"]}
            print(row, flush=True)
            out.append(row)
    finally:
        runner.close()
    return out


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| batch | new tokens | plain ms/token | n-gram on ms/token | n-gram / plain | drafts proposed |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {r['plain_ms_per_token']:.2f} | "
                     f"{r['ngram_ms_per_token']:.2f} | {r['ratio']:.3f}x | {r['drafted']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--min-match", type=int, default=3)
    parser.add_argument("--synthetic-shape", default="qwen3.6-27b")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = run([int(b) for b in args.batches.split(",")], args.new, args.prompt, args.draft_tokens, args.min_match,
               args.synthetic_shape)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ngram_cost.json").write_text(json.dumps(rows, indent=1))
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
