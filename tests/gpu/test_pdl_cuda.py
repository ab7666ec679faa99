"""Programmatic dependent launch (PDL) on the GPU: the same numbers bit for bit with it and without.

- A producer/consumer chain in a CUDA graph (GEMV -> RMSNorm -> GEMV, the last two launched with
  the attribute, their inputs poisoned by memset nodes at the graph's start): a consumer that read
  before its wait would see the poison or an earlier replay's values.
- Runners (a 4-layer model of the Qwen3.6-27B shapes with BF16 and with FP8 projections, and the
  tiny MoE model): decode steps replayed from their graphs and a verification step, with
  `KernelChoice.pdl` off on some slots and on on copies of them: every step's logits and the
  verification step's logits and snapshot states equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv, rmsnorm
from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

pytestmark = pytest.mark.gpu

M, REPLAYS = 5, 20
PROMPT_LEN, STEPS, DRAFTS, BATCH = 20, 4, 3, 2


def test_a_pdl_consumer_waits_for_its_producer_in_a_graph(device, library, stream, mem):
    from runtime.cuda.device import capture_graph

    rng = np.random.default_rng(0)
    up = library.kernel("gemv", "a3b_o_proj_n2048_k4096_m8")  # plain: follows the memset nodes
    norm = library.kernel("rmsnorm", "zc_h2048")
    down = library.kernel("gemv", "a3b_attn_qkv_n9216_k2048_m8")
    assert up.entry.pdl and norm.entry.pdl and down.entry.pdl
    x = rng.standard_normal((M, 4096)).astype(np.float32)
    w1 = (rng.standard_normal((2048, 4096)) * 0.02).astype(np.float32)
    wn = (rng.standard_normal(2048) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((9216, 2048)) * 0.02).astype(np.float32)
    xd, w1d, wnd, w2d = mem.bf16(x), mem.bf16(w1), mem.bf16(wn), mem.bf16(w2)
    y, h, z = mem.poisoned(M * 2048), mem.poisoned(M * 2048), mem.poisoned(M * 9216)
    plain = [up.bind({"x": xd, "w": w1d, "out": y}, {"M": M}), norm.bind({"x": y, "w": wnd, "out": h}, {"M": M}),
             down.bind({"x": h, "w": w2d, "out": z}, {"M": M})]
    for launch in plain:
        launch(stream)
    want = [mem.read_bf16(p, (M, n)) for p, n in ((y, 2048), (h, 2048), (z, 9216))]
    # The plain launches agree with the references (so the comparison below is of real numbers).
    xb, w1b, wnb, w2b = (mem.read_bf16(p, a.shape) for p, a in ((xd, x), (w1d, w1), (wnd, wn), (w2d, w2)))
    np.testing.assert_allclose(want[0], gemv.reference(xb, w1b), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(want[1], rmsnorm.reference(want[0], wnb)[0], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(want[2], gemv.reference(want[1], w2b), rtol=2e-2, atol=2e-2)

    chained = [plain[0], plain[1].programmatic(), plain[2].programmatic()]

    def record():
        for ptr, count in ((y, M * 2048), (h, M * 2048), (z, M * 9216)):
            device.memset_d16(ptr, mem.POISON, count, stream)
        for launch in chained:
            launch(stream)

    graph = capture_graph(device, stream, record)
    try:
        for i in range(REPLAYS):
            graph.replay(stream)
            got = [mem.read_bf16(p, (M, n)) for p, n in ((y, 2048), (h, 2048), (z, 9216))]
            for what, g, w in zip(("gemv", "rmsnorm (PDL)", "gemv (PDL)"), got, want):
                np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=f"replay {i}: {what}")
    finally:
        graph.destroy()


def _27b_runner(device, library, weight_format: str):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import fp8_recipe_format

    layers = 4
    shape = {**QWEN36_27B, "num_hidden_layers": layers, "layer_types": QWEN36_27B["layer_types"][:layers]}
    return CudaRunner.synthetic(ModelConfig.from_dict(shape), 7, num_pages=4 * BATCH, num_slots=2 * BATCH * (DRAFTS + 2),
                                max_batch=BATCH, max_context=128, prefill_chunk=512, device=device, library=library,
                                weight_formats=fp8_recipe_format if weight_format == "fp8" else None)


@pytest.fixture(scope="module", params=["27b-bf16", "27b-fp8", "tiny-moe"])
def runner(request, device, library, tiny_moe_path):
    from runtime.model.gpu.runner import CudaRunner

    if request.param == "tiny-moe":
        r = CudaRunner.from_artifact(tiny_moe_path, num_pages=4 * BATCH, num_slots=2 * BATCH * (DRAFTS + 2),
                                     max_batch=BATCH, device=device, library=library, prefill_chunk=128)
    else:
        r = _27b_runner(device, library, request.param.split("-")[1])
    yield r
    r.close()


def _states(r, slot: int) -> list[np.ndarray]:
    return [a for n in range(len(r.config.linear_layers)) for a in r.read_state(n, slot)]


def _run(r, slots: list[int], prompts: list[list[int]], tokens: np.ndarray, snapshots: list[list[int]],
         pdl: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefill each slot, STEPS decode steps of all slots (graph replays), then one verification
    step of 1 + DRAFTS tokens each: (the logits of every step, the snapshot states)."""
    r.steps.destroy_graphs()  # plans and graphs bound again with this PDL setting
    r.kernels.pdl = pdl
    for slot, prompt in zip(slots, prompts):
        r.reset_slot(slot)
        r.prefill(PrefillChunk(slot=slot, token_ids=prompt, start_pos=0, page_table=[slot]))
    logits = []
    for i in range(STEPS):
        logits.append(r.decode([DecodeItem(slot=s, token_id=int(tokens[b, i]), pos=PROMPT_LEN + i, page_table=[s])
                                for b, s in enumerate(slots)]))
    rows = [StepRow(slot=s, token_ids=tokens[b, STEPS:].tolist(), start_pos=PROMPT_LEN + STEPS, page_table=[s],
                    logits="all", snapshots=snapshots[b]) for b, s in enumerate(slots)]
    logits += r.step(rows)
    plan = r.steps.plans.bound[("decode", BATCH)]
    assert any(b.pdl for b in plan) == pdl and (not pdl or not plan[0].pdl)
    return logits, [a for snaps in snapshots for s in snaps for a in _states(r, s)]


def test_decode_and_verification_equal_with_and_without_pdl(runner):
    r = runner
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, r.vocab_size, PROMPT_LEN).tolist() for _ in range(BATCH)]
    tokens = rng.integers(0, r.vocab_size, (BATCH, STEPS + DRAFTS + 1))
    off_slots, on_slots = list(range(BATCH)), list(range(BATCH, 2 * BATCH))
    spare = 2 * BATCH

    def snaps(first: int) -> list[list[int]]:
        return [list(range(first + b * (DRAFTS + 1), first + (b + 1) * (DRAFTS + 1))) for b in range(BATCH)]

    off_logits, off_states = _run(r, off_slots, prompts, tokens, snaps(spare), pdl=False)
    on_logits, on_states = _run(r, on_slots, prompts, tokens, snaps(spare + BATCH * (DRAFTS + 1)), pdl=True)
    r.steps.destroy_graphs()
    r.kernels.pdl = False
    assert len(off_logits) == STEPS + BATCH
    for i, (a, b) in enumerate(zip(off_logits, on_logits)):
        assert np.isfinite(a).all(), f"step {i}: non-finite logits without PDL"
        np.testing.assert_array_equal(b, a, err_msg=f"logits of step {i} (the last {BATCH}: verification rows)")
    for n, (a, b) in enumerate(zip(off_states, on_states)):
        np.testing.assert_array_equal(b, a, err_msg=f"snapshot state {n}")
