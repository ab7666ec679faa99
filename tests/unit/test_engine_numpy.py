"""The engine on the real NumPy reference runner (tiny model): batched decode, chunked prefill,
KV pressure with preemption and replay all give the tokens of one sequence decoded alone."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, FinishReason, SamplingParams
from runtime.engine.engine_loop import Engine, EngineConfig


@pytest.fixture(scope="module")
def make_runner(tiny_dense_path):
    from runtime.artifact import open_artifact
    from runtime.model.numpy_runner import NumpyRunner

    artifact = open_artifact(tiny_dense_path)

    def make(num_pages, num_slots):
        return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=num_slots)

    yield make
    artifact.close()


def generate(engine, prompts, max_new, sampling):
    streams = {rid: engine.submit(EngineRequest(rid, tuple(p), sampling, max_new))
               for rid, p in prompts.items()}
    results = {}
    for rid, stream in streams.items():
        outputs = list(stream)
        results[rid] = ([t for o in outputs for t in o.token_ids], outputs[-1])
    return results


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True),
                                      SamplingParams(temperature=0.8, top_p=0.9, seed=5)])
def test_concurrency_and_preemption_do_not_change_the_output(make_runner, sampling):
    rng = np.random.default_rng(0)
    prompts = {"a": list(rng.integers(0, 440, size=100)),
               "b": list(rng.integers(0, 440, size=110)),
               "c": list(rng.integers(0, 440, size=20))}
    with Engine(make_runner(8, 1), EngineConfig(max_context=512)) as solo:
        expected = {rid: generate(solo, {rid: p}, 30, sampling)[rid][0]
                    for rid, p in prompts.items()}
    # Two lanes and 4 pages of 64 tokens for three requests, chunks of 64: chunked prefill,
    # batched decode, preemption with replay and a service-turn rotation all happen.
    config = EngineConfig(num_lanes=2, max_context=256, prefill_chunk=64,
                          service_turn_tokens=16)
    with Engine(make_runner(4, 2), config) as busy:
        results = generate(busy, prompts, 30, sampling)
    preemptions = 0
    for rid, (tokens, final) in results.items():
        assert final.finish_reason is FinishReason.LENGTH, (rid, final.error)
        assert tokens == expected[rid], rid
        preemptions += final.stats.preemptions
    assert preemptions > 0
