"""`CudaRunner` on the tiny MoE and Qwen3-Next models converted with `--recipe fp8` (every expert,
the shared one included, and the projections e4m3 with 128x128 block scales; the router and
shared-expert gate bf16) against `NumpyRunner` on the same artifact (which dequantises to fp32).

Tolerance as test_cuda_runner_fp8.py: the BF16 torch forward of the dequantised weights
(tests/gpu/torch_forward.py) measures what bf16 activations and weights cost on this model; our
error must stay within 2x of it. Decode runs the experts through `up_fp8` / `down_fp8` (codes
decoded in registers, fp32 partial sums scaled: no weight rounded); a 200-token prefill
dequantises each layer's stacks to bf16 (`dequant_weights`) for the grouped GEMMs, rounding each
weight once as that torch forward does. Plus a decode batch of 8 equal to each row alone, bit for
bit. Written without a GPU at hand: not run yet.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from .test_cuda_runner import _pages, _prompt, _rel
from .test_cuda_runner_moe import test_a_batch_of_eight_equals_each_row_alone  # noqa: F401
from .torch_forward import torch_bf16_logits as _torch_bf16_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["moe", "next"])
def tiny_path(request):
    return request.getfixturevalue(f"tiny_{request.param}_fp8_path")


@pytest.fixture(scope="module")
def runners(tiny_path, device, library):
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import FP8
    from runtime.model.numpy_runner import NumpyRunner

    cuda = CudaRunner.from_artifact(tiny_path, num_pages=80, num_slots=12, device=device, library=library,
                                    prefill_chunk=256)
    ref = NumpyRunner.from_artifact(tiny_path, num_pages=80, num_slots=12)
    assert cuda.layout.expert_format == FP8 and cuda.kernels.moe_up_fp8
    assert cuda.kernels.moe_prefill is not None and cuda.kernels.moe_prefill.dequant_gate_up
    yield cuda, ref
    cuda.close()


def test_fp8_moe_prefill_logits_match_reference(runners, tiny_path):
    cuda, ref = runners
    ids = _prompt(3, 200, cuda.vocab_size)
    chunk = PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=_pages(0, 4), all_logits=True)
    cuda.reset_slot(0)
    ref.reset_slot(0)
    ours, want = cuda.prefill(chunk), ref.prefill(chunk)
    torch_bf16 = _torch_bf16_logits(tiny_path, ids)
    e_ours, e_torch = _rel(ours, want), _rel(torch_bf16, want)
    print(f"fp8 moe logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * e_torch, f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e}"
    agree = float(np.mean(ours.argmax(-1) == want.argmax(-1)))
    agree_torch = float(np.mean(torch_bf16.argmax(-1) == want.argmax(-1)))
    assert agree >= min(0.99, agree_torch - 0.01)


def test_fp8_moe_decode_logits_match_reference(runners, tiny_path):
    """Prefill 60 tokens (the grouped path), then decode 4 teacher-forced tokens of two sequences
    in one batch (the fp8 expert kernels) on both runners."""
    cuda, ref = runners
    prompts = [_prompt(4, 60, cuda.vocab_size), _prompt(5, 60, cuda.vocab_size)]
    forced = [_prompt(6, 4, cuda.vocab_size), _prompt(7, 4, cuda.vocab_size)]
    for runner in (cuda, ref):
        for s, ids in enumerate(prompts):
            runner.reset_slot(s)
            runner.prefill(PrefillChunk(slot=s, token_ids=ids, start_pos=0, page_table=_pages(s, 2)))
    ours, want = [], []
    for i in range(4):
        items = [DecodeItem(slot=s, token_id=forced[s][i], pos=60 + i, page_table=_pages(s, 2)) for s in range(2)]
        ours.append(cuda.decode(items))
        want.append(ref.decode(items))
    ours, want = np.stack(ours, 1), np.stack(want, 1)  # [sequence, step, V]
    torch_bf16 = np.stack([_torch_bf16_logits(tiny_path, prompts[s] + forced[s])[60:] for s in range(2)])
    e_ours, e_torch = _rel(ours, want), _rel(torch_bf16, want)
    print(f"fp8 moe decode logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * e_torch, f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e}"
