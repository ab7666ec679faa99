"""Prefill attention over key splits (`attention_wgmma` `*_kvsplit` + the combine) in the runner:
chunks at or past `Storage.prefill_kv_split` take it, rows before it the fused kernel, and a
prefix-cache resume past it is still bit-identical to the cold run.

A 4-layer model of the Qwen3.6-27B shapes (synthetic weights; its one attention layer is layer 3)
with a 20,480-token context and 1,024-token chunks: the first key split is at 16,384 keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.model.runner import PrefillChunk

pytestmark = pytest.mark.gpu

CHUNK = 1024
CONTEXT = 20480


@pytest.fixture(scope="module")
def runner(device, library):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    shape = dict(QWEN36_27B, num_hidden_layers=4, layer_types=QWEN36_27B["layer_types"][:4])
    r = CudaRunner.synthetic(ModelConfig.from_dict(shape), 5, num_pages=2 * CONTEXT // 64 + 8, num_slots=8,
                             max_batch=8, max_context=CONTEXT, prefill_chunk=CHUNK, device=device, library=library)
    if r.kernels.prefill_attn_split is None:
        r.close()
        pytest.skip("no attention_wgmma kv-split kernel built for the 27B shape")
    yield r
    r.close()


def tokens(runner, seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, runner.vocab_size, n)]


def _last_logits(runner, prompt: list[int]) -> np.ndarray:
    runner.reset_slot(0)
    pages = list(range(-(-len(prompt) // 64)))
    out = None
    for lo in range(0, len(prompt), CHUNK):
        out = runner.prefill(PrefillChunk(slot=0, token_ids=prompt[lo:lo + CHUNK], start_pos=lo, page_table=pages))
    return out[-1]


def test_chunks_past_the_first_split_use_it_and_agree_with_the_fused_kernel(runner):
    """The split form changes only the merge order and one bf16 rounding of each attention row
    (the partials are fp32): the last row's logits stay within 2 % (relative, Frobenius) of the
    fused kernel's through the three layers after it, and the greedy pick is the same unless the
    fused top-2 margin is below that error."""
    assert runner.storage.prefill_kv_split == 16384 and runner.storage.prefill_kv_splits == 2
    prompt = tokens(runner, 3, 17000)
    split = _last_logits(runner, prompt)
    assert any(key[:1] == ("prefill",) and key[-1] is True for key in runner.steps.plans.bound), \
        "no prefill plan over key splits was bound"
    kernel = runner.kernels.prefill_attn_split
    runner.kernels.prefill_attn_split = None      # every chunk through the fused kernel
    try:
        fused = _last_logits(runner, prompt)
    finally:
        runner.kernels.prefill_attn_split = kernel
    err = float(np.linalg.norm(split - fused) / np.linalg.norm(fused))
    assert 0 < err <= 0.02, f"split vs fused last-row logits: relative error {err:.2e}"
    top2 = np.sort(fused)[-2:]
    if top2[1] - top2[0] > err * np.abs(fused).max():
        assert int(np.argmax(split)) == int(np.argmax(fused))


def test_a_resume_past_the_first_split_is_bit_identical_to_the_cold_run(runner):
    """The hint (17,100) becomes a stop at its block start (17,088); the resumed chunk
    [17088, 17408) and the unhinted cold run's [16384, 17408) cut the same rows' keys at the same
    absolute split (16,384), so the ids and log-probabilities are the cold run's."""
    from runtime.engine.engine_loop import Engine, EngineConfig

    first = tokens(runner, 13, 17100)
    second = first + tokens(runner, 14, 500)
    hints = (len(first),)
    base = dict(num_lanes=2, max_context=CONTEXT, prefill_chunk=CHUNK, snapshot_interval=CONTEXT)

    def run(eng, rid, prompt, hints=()):
        request = EngineRequest(rid, tuple(prompt), SamplingParams(greedy=True), 24, logprobs=2,
                                snapshot_positions=hints)
        outputs = list(eng.submit(request))
        return [t for o in outputs for t in o.token_ids], outputs[-1]

    cache = dict(prefix_cache=True, snapshot_slots=4, host_cache_bytes=256 << 20)
    with Engine(runner, EngineConfig(**base, **cache), on_thread_start=runner.device.make_current) as eng:
        run(eng, "a", first, hints)
        warm, warm_final = run(eng, "b", second, hints)
    with Engine(runner, EngineConfig(**base), on_thread_start=runner.device.make_current) as cold:
        expected, cold_final = run(cold, "b", second)
    assert warm_final.cached_prompt_tokens == 17088
    assert warm == expected
    assert warm_final.logprobs == cold_final.logprobs
