"""Device sampling through the engine equals host sampling on the same GPU logits.

The same eight requests (greedy, plain temperature, top-k 1, top-p + min-p + penalties, a
constrained one allowing only even ids, one asking for logprobs) run twice on one `CudaRunner`
of the tiny dense model: once with the engine letting the runner sample decode rows on the GPU
(`decode_sampled`, only ids come back), once with every row sampled on the host from the
downloaded logits. Both see the same bf16 logits and the same counter-based draws, so every
request must produce the same tokens. The only way they may differ is the fp32 (device) vs
fp64 (host) softmax putting a draw on the other side of a cumulative boundary; no such case
occurs for these seeds, so the test asks for identity. A last check: the device path really
ran (the runner's sampling plans were bound). The second test does the same while sequences join
and leave the decode batch, so the runner's look-ahead steps are both used and dropped.
"""

from __future__ import annotations

import numpy as np
import pytest

from .engine_runs import run_engine
from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu


class OnlyEven:
    """Even ids only (packed bitmask, as llguidance writes them)."""

    def __init__(self):
        self.seen = []

    def allowed_bitmask_u32(self, vocab_size):
        from runtime.model.sampling import pack_mask

        return pack_mask(np.arange(vocab_size) % 2 == 0)

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


def _run(runner, device_sampling, requests=None, stagger=0):
    """Tokens of each request (`engine_runs.run_engine`)."""
    return run_engine(runner, requests or _requests(runner.vocab_size), stagger=stagger, num_lanes=8,
                      max_context=512, prefill_chunk=128, device_sampling=device_sampling)[0]


def test_device_sampling_equals_host_sampling(tiny_path, device, library):  # noqa: F811
    from runtime.model.gpu.runner import CudaRunner

    runner = CudaRunner.from_artifact(tiny_path, num_pages=80, num_slots=8, max_batch=8, device=device,
                                      library=library, prefill_chunk=128)
    try:
        if not runner.samples_on_device:
            pytest.skip("the sampling kernels were not built")
        on_device = _run(runner, True)
        assert any(key[0] == "sample" for key in runner.steps.plans.bound), "the device sampler never ran"
        on_host = _run(runner, False)
    finally:
        runner.close()
    assert all(len(t) == 40 for t in on_device)
    assert all(t % 2 == 0 for t in on_device[6])
    assert len(set(on_device[1])) > 5, "sampled output looks degenerate"
    for i, (a, b) in enumerate(zip(on_device, on_host)):
        assert a == b, f"request {i}: device {a} != host {b}"


def test_lookahead_through_joins_and_leaves(tiny_path, device, library):  # noqa: F811
    """Sequences with different lengths, submitted while others decode: the runner computes
    steps ahead while the batch is steady; the tokens must still be those of host sampling."""
    from runtime.engine.api import EngineRequest, SamplingParams
    from runtime.model.gpu.runner import CudaRunner

    runner = CudaRunner.from_artifact(tiny_path, num_pages=80, num_slots=8, max_batch=8, device=device,
                                      library=library, prefill_chunk=128)
    rng = np.random.default_rng(9)
    requests = [EngineRequest(request_id=f"s{i}", prompt_ids=tuple(int(t) for t in rng.integers(0, 512, 9 + 5 * i)),
                              sampling=SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i,
                                                      presence_penalty=0.5 * (i % 2)),
                              max_new_tokens=(20, 50, 35, 70, 12, 60)[i])
                for i in range(6)]
    try:
        if not runner.samples_on_device:
            pytest.skip("the sampling kernels were not built")
        on_device = _run(runner, True, requests, stagger=6)
        used, dropped = runner.lookahead_steps[True], runner.lookahead_steps[False]
        on_host = _run(runner, False, requests, stagger=6)
    finally:
        runner.close()
    assert [len(t) for t in on_device] == [20, 50, 35, 70, 12, 60]
    # The engine asks for look-ahead only while nobody waits for a lane and no row is at its
    # limit, so steps are computed ahead in the steady stretches (the H200 run: 76 used, 0 dropped).
    assert used > 50, (used, dropped)
    for i, (a, b) in enumerate(zip(on_device, on_host)):
        assert a == b, f"request {i}: device {a} != host {b}"


def test_a_step_ahead_used_or_dropped_changes_nothing(tiny_path, device, library):  # noqa: F811
    """Runner level, greedy: two sequences decode two steps without look-ahead (the reference),
    then again with a step computed ahead that the second call uses, and again with one it drops
    (the second call feeds other tokens). Ids and the GDN states after the second step must be
    bit-identical to the reference in both cases."""
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.runner import DecodeItem, PrefillChunk
    from runtime.model.sampling import RowSampling

    runner = CudaRunner.from_artifact(tiny_path, num_pages=16, num_slots=2, max_batch=2, device=device,
                                      library=library, prefill_chunk=128)
    rows = lambda: [RowSampling(greedy=True)] * 2  # noqa: E731
    prompts = ([3, 17, 250, 9, 44], [101, 7, 7, 300])
    tables = ([0], [1])

    def start():
        for slot, prompt in enumerate(prompts):
            runner.reset_slot(slot)
            runner.prefill(PrefillChunk(slot=slot, token_ids=prompt, start_pos=0, page_table=tables[slot]))
        return [DecodeItem(slot=s, token_id=40 + s, pos=len(p), page_table=tables[s]) for s, p in enumerate(prompts)]

    def second(items, ids, shift):
        return [DecodeItem(it.slot, (int(t) + shift) % runner.vocab_size, it.pos + 1, it.page_table)
                for it, t in zip(items, ids)]

    def states():
        return [runner.read_state(n, s)[0] for n in range(len(runner.config.linear_layers)) for s in (0, 1)]

    try:
        if not runner.samples_on_device or not runner.kernels.embedding:
            pytest.skip("the sampling or embedding kernels were not built")
        results = {}
        for case, ahead, shift in (("reference", False, 0), ("used", True, 0), ("reference other", False, 1),
                                   ("dropped", True, 1)):
            items = start()
            first = runner.decode_sampled(items, rows, lookahead=ahead)
            before = dict(runner.lookahead_steps)
            last = runner.decode_sampled(second(items, first, shift), rows)
            outcome = {k: runner.lookahead_steps[k] - before[k] for k in (True, False)}
            results[case] = (first.tolist(), last.tolist(), states(), outcome)
    finally:
        runner.close()
    assert results["used"][3] == {True: 1, False: 0}
    assert results["dropped"][3] == {True: 0, False: 1}
    for case, ref in (("used", "reference"), ("dropped", "reference other")):
        assert results[case][:2] == results[ref][:2], case
        for got, want in zip(results[case][2], results[ref][2]):
            np.testing.assert_array_equal(got, want)
