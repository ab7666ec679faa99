"""Request invariance on the GPU: a request's token ids do not depend on what runs beside it.

Real Qwen3.6-27B shapes (synthetic weights: random weights make near-ties everywhere, so any
place where a row's arithmetic depends on the batch shows up within a few dozen tokens): a
4-layer model of those shapes (three GDN layers, one attention layer) and the whole 64-layer
model. Eight requests (greedy and seeded, prompts of different lengths crossing the prefill chunk
grid) run together through the engine, then each alone on the same runner; the ids must be equal
bit for bit. The same while sequences join and leave a running decode batch. Under KV pressure
(preemption) with a host tier the paused request's lane state is kept and the ids are equal;
without one it replays by prefill: an xfail, not strict (the replay may round alike by chance;
docs/architecture.md, "Request invariance").
"""

from __future__ import annotations

import numpy as np
import pytest

from .engine_runs import run_engine

pytestmark = pytest.mark.gpu

PREFILL_CHUNK = 256


def _runner(device, library, layers, num_pages=160):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    shape = dict(QWEN36_27B)
    if layers is not None:
        shape.update(num_hidden_layers=layers, layer_types=QWEN36_27B["layer_types"][:layers])
    return CudaRunner.synthetic(ModelConfig.from_dict(shape), 11, num_pages=num_pages, num_slots=8,
                                max_batch=8, max_context=2048, prefill_chunk=PREFILL_CHUNK,
                                device=device, library=library)


def _requests(vocab):
    from runtime.engine.api import EngineRequest, SamplingParams

    rng = np.random.default_rng(21)
    out = []
    for i in range(8):
        sampling = SamplingParams(greedy=True) if i % 2 == 0 else \
            SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=500 + i)
        prompt = tuple(int(t) for t in rng.integers(0, vocab, 97 + 131 * i))
        out.append(EngineRequest(request_id=f"r{i}", prompt_ids=prompt, sampling=sampling,
                                 max_new_tokens=48))
    return out


def _run(runner, requests, *, lanes=8, stagger=0, num_pages=None, host_cache_bytes=0):
    return run_engine(runner, requests, stagger=stagger, num_lanes=lanes, max_context=2048,
                      prefill_chunk=PREFILL_CHUNK, num_pages=num_pages, host_cache_bytes=host_cache_bytes)


def _alone(runner, requests):
    return [_run(runner, [request], lanes=1)[0][0] for request in requests]


@pytest.fixture(scope="module", params=[4, None], ids=["27b-4-layers", "27b"])
def runner(request, device, library):
    r = _runner(device, library, request.param)
    yield r
    r.close()


def test_eight_together_equal_each_alone(runner):
    requests = _requests(runner.vocab_size)
    together, _ = _run(runner, requests)
    alone = _alone(runner, requests)
    assert all(len(t) == 48 for t in together)
    assert len(set(together[1])) > 5, "sampled output looks degenerate"
    diverged = [i for i, (a, b) in enumerate(zip(together, alone)) if a != b]
    assert not diverged, {i: (together[i], alone[i]) for i in diverged}


def test_joining_and_leaving_mid_decode_equal_each_alone(runner):
    requests = _requests(runner.vocab_size)
    staggered, _ = _run(runner, requests, stagger=7)
    alone = _alone(runner, requests)
    diverged = [i for i, (a, b) in enumerate(zip(staggered, alone)) if a != b]
    assert not diverged, {i: (staggered[i], alone[i]) for i in diverged}


REPLAY = pytest.mark.xfail(strict=False, reason="without a host tier a preempted request replays its output "
                           "by prefill, which may round differently from the decode steps that first computed it: "
                           "not guaranteed (docs/serving.md); on the H200 the 4-layer model happened to match, the "
                           "64-layer one diverged")


@pytest.mark.parametrize("host_tier", [pytest.param(False, marks=REPLAY), True], ids=["replay", "host-tier"])
def test_kv_pressure_with_preemption_equals_each_alone(runner, host_tier):
    """With a host tier a paused request keeps its lane state and partial page and resumes
    exactly where it stopped (docs/prefix_cache.md, "Preemption without recomputation")."""
    requests = _requests(runner.vocab_size)[:4]
    # Four requests of 145, 276, 407 and 538 tokens need 3 + 5 + 7 + 9 = 24 pages together; 20
    # pages (1,280 tokens) admit them all, then one must pause as they grow (fewer pages make
    # admission run them in turn, with no preemption: checked with the NumPy runner, where 20
    # pages preempt once).
    pressured, counters = _run(runner, requests, lanes=4, num_pages=20,
                               host_cache_bytes=(4 << 30) if host_tier else 0)
    assert counters["preemptions"] > 0
    alone = _alone(runner, requests)
    assert pressured == alone
