"""Device sampling through the engine equals host sampling on the same GPU logits.

The same eight requests (greedy, plain temperature, top-k 1, top-p + min-p + penalties, a
constrained one allowing only even ids, one asking for logprobs) run twice on one `CudaRunner`
of the tiny dense model: once with the engine letting the runner sample decode rows on the GPU
(`decode_sampled`, only ids come back), once with every row sampled on the host from the
downloaded logits. Both see the same bf16 logits and the same counter-based draws, so every
request must produce the same tokens. The only way they may differ is the fp32 (device) vs
fp64 (host) softmax putting a draw on the other side of a cumulative boundary; no such case
occurs for these seeds, so the test asks for identity. A last check: the device path really
ran (the runner's sampling plans were bound).
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu


class OnlyEven:
    """Even ids only (packed bitmask, as llguidance writes them)."""

    def __init__(self):
        self.seen = []

    def allowed_bitmask_u32(self, vocab_size):
        bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
        bits[0:vocab_size:2] = True
        return np.packbits(bits, bitorder="little").view(np.uint32)

    def commit(self, token_id):
        self.seen.append(token_id)

    def rollback(self, num_tokens):
        del self.seen[-num_tokens:]


def _requests(vocab):
    from runtime.engine.api import EngineRequest, SamplingParams

    rng = np.random.default_rng(5)
    settings = [
        dict(greedy=True),
        dict(temperature=1.0, top_k=20, seed=11),
        dict(temperature=0.8, top_k=1, seed=12),
        dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, presence_penalty=1.5,
             frequency_penalty=0.5, seed=2**40 + 3),
        dict(temperature=1.3, top_k=5, seed=14),
        dict(temperature=1.0, top_k=20, top_p=0.95, seed=15),
        dict(temperature=1.0, top_k=20, seed=16),          # constrained below
        dict(temperature=1.0, top_k=20, seed=17),          # logprobs below: host path
    ]
    out = []
    for i, kw in enumerate(settings):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, 20 + 7 * i))
        out.append(EngineRequest(request_id=f"r{i}", prompt_ids=prompt, sampling=SamplingParams(**kw),
                                 max_new_tokens=40, constraint=OnlyEven() if i == 6 else None,
                                 logprobs=2 if i == 7 else 0))
    return out


def _run(runner, device_sampling):
    from runtime.engine.engine_loop import Engine, EngineConfig

    engine = Engine(runner, EngineConfig(num_lanes=8, max_context=512, prefill_chunk=128,
                                         device_sampling=device_sampling),
                    on_thread_start=runner.device.make_current).start()
    try:
        streams = [engine.submit(r) for r in _requests(runner.vocab_size)]
        results = []
        for stream in streams:
            tokens = []
            while not stream.done:
                tokens.extend(stream.get(timeout=60).token_ids)
            results.append(tokens)
        return results
    finally:
        engine.shutdown()


def test_device_sampling_equals_host_sampling(tiny_path, device, library):  # noqa: F811
    from runtime.model.cuda_runner import CudaRunner

    runner = CudaRunner.from_artifact(tiny_path, num_pages=80, num_slots=8, max_batch=8, device=device,
                                      library=library, prefill_chunk=128)
    try:
        if not runner.samples_on_device:
            pytest.skip("the sampling kernels were not built")
        on_device = _run(runner, True)
        assert any(key[0] == "sample" for key in runner._plans), "the device sampler never ran"
        on_host = _run(runner, False)
    finally:
        runner.close()
    assert all(len(t) == 40 for t in on_device)
    assert all(t % 2 == 0 for t in on_device[6])
    assert len(set(on_device[1])) > 5, "sampled output looks degenerate"
    for i, (a, b) in enumerate(zip(on_device, on_host)):
        assert a == b, f"request {i}: device {a} != host {b}"
