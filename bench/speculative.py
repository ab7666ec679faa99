"""Acceptance of speculative decoding on the CPU tiny model, with its own MTP head.

    python -m bench.decode --spec mtp|ngram --draft-tokens K [--model M.infernix] [--requests N]

Runs N greedy requests (random prompts, each with a copy of its first half at the end, so an
n-gram copy has something to find) through the engine on the NumPy runner, once plainly and
once with the drafts, checks that both give the same tokens, and reports per mode: rounds,
drafts verified and accepted, acceptance, tokens per round (the sampled token of the round
included) and the wall time against plain decoding. The tiny models' weights are random, so
their MTP head's acceptance is what a random head achieves, not what a trained one does; on the
CPU a verification row costs k + 1 decode steps, so the times say nothing about the GPU, where
the cost of a round against a plain step is measured in a later session.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np


def _tiny_model(directory: Path) -> Path:
    from tools.make_tiny import make_tiny

    return make_tiny(directory / "tiny-dense.infernix", family="dense", vocab="small", seed=0)


def _generate(artifact: Any, spec: Any, prompts: list[list[int]], max_new: int):
    from runtime.engine.api import EngineRequest, SamplingParams
    from runtime.engine.engine_loop import Engine, EngineConfig
    from runtime.engine.speculative import SlotLayout
    from runtime.model.numpy_runner import NumpyRunner

    layout = SlotLayout.for_config(1, spec)
    pages = -(-(max(len(p) for p in prompts) + max_new) // 64)
    runner = NumpyRunner.from_artifact(artifact, num_pages=pages, num_slots=layout.reserved,
                                       mtp=spec.mtp)
    started = time.perf_counter()
    outputs = []
    with Engine(runner, EngineConfig(max_context=pages * 64, speculative=spec)) as engine:
        for index, prompt in enumerate(prompts):
            stream = engine.submit(EngineRequest(f"r{index}", tuple(prompt),
                                                 SamplingParams(greedy=True), max_new))
            outputs.append([t for out in stream for t in out.token_ids])
        counters = dict(engine.counters)
    return outputs, counters, time.perf_counter() - started


def run(mode: str, draft_tokens: int, model: Optional[Path], requests: int, max_new: int,
        ngram_min_match: int = 4) -> dict[str, Any]:
    from runtime.artifact import open_artifact
    from runtime.engine.speculative import SpeculativeConfig

    if mode == "mtp":
        spec = SpeculativeConfig(method="mtp", draft_tokens=draft_tokens)
    else:
        spec = SpeculativeConfig(ngram_draft_tokens=draft_tokens, ngram_min_match=ngram_min_match)
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(requests):
        head = rng.integers(0, 440, 48).tolist()
        prompts.append(head + rng.integers(0, 440, 16).tolist() + head[:24])
    with tempfile.TemporaryDirectory() as directory:
        path = model if model is not None else _tiny_model(Path(directory))
        with open_artifact(path) as artifact:
            plain, _, plain_s = _generate(artifact, SpeculativeConfig(), prompts, max_new)
            drafted, counters, spec_s = _generate(artifact, spec, prompts, max_new)
    if drafted != plain:
        raise AssertionError("speculative output differs from plain decoding")
    rounds = counters["spec_rounds"]
    accepted = counters["spec_accepted_tokens"]
    return {"mode": mode, "draft_tokens": draft_tokens, "requests": requests,
            "max_new": max_new, "model": str(model) if model else "tiny dense (make_tiny seed 0)",
            "rounds": rounds, "drafted": counters["spec_drafted_tokens"], "accepted": accepted,
            "acceptance": accepted / max(counters["spec_drafted_tokens"], 1),
            "tokens_per_round": (accepted + rounds) / max(rounds, 1),
            "plain_s": plain_s, "spec_s": spec_s, "same_tokens": True}


def render(data: dict[str, Any]) -> str:
    return "\n".join([
        "| mode | k | rounds | drafted | accepted | acceptance | tokens / round | "
        "plain s | spec s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {data['mode']} | {data['draft_tokens']} | {data['rounds']} | {data['drafted']} | "
        f"{data['accepted']} | {100 * data['acceptance']:.1f} % | "
        f"{data['tokens_per_round']:.2f} | {data['plain_s']:.2f} | {data['spec_s']:.2f} |",
        f"(CPU NumPy runner, {data['model']}, {data['requests']} greedy requests of "
        f"{data['max_new']} tokens; output identical to plain decoding)"])
