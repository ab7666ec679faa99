"""`CudaRunner` on the tiny dense model converted with `--recipe fp8` against `NumpyRunner` on the
same artifact (which dequantises the FP8 weights to float32).

Decode runs the FP8 GEMV (W8A16): it decodes the codes exactly and applies each block scale to an
fp32 partial sum, so it rounds no more than the BF16 torch forward of the dequantised weights
(`_torch_bf16_logits`, whose error against the fp32 reference measures what bf16 activations
cost on this model), and its error must stay within 2x of that forward's, as in
`test_cuda_runner.py`. Prefill pieces of more than 16 rows run W8A8 (`layers.Forward.fp8_gemm`):
activations rounded to e4m3 per (row, 128 columns), which costs far more than bf16 on this
random tiny model (it amplifies small perturbations: measured on the CPU, a NumpyRunner whose FP8
projections quantise their inputs differs from the plain one by ~28% in the logits of a
200-token prompt, and by ~26% from itself with bf16-rounded inputs before the quantisation). So
prefill is held to 2x the sum of the two baselines (bf16 torch, and that W8A8 NumpyRunner,
`act_quant_reference`), and its exactness rule is checked bit for bit: a prompt chunked two ways
gives the same logits. The FP8 GEMM's own accuracy is `test_kernels_gemm_fp8.py`'s.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from .act_quant_reference import w8a8_numpy_runner
from .test_cuda_runner import _pages, _prompt, _rel
from .torch_forward import torch_bf16_logits as _torch_bf16_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runners(tiny_fp8_path, device, library):
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.numpy_runner import NumpyRunner

    cuda = CudaRunner.from_artifact(tiny_fp8_path, num_pages=40, num_slots=2, device=device, library=library,
                                    prefill_chunk=128)
    ref = NumpyRunner.from_artifact(tiny_fp8_path, num_pages=40, num_slots=2)
    assert cuda.layout.fp8_shapes(), "the artifact has fp8 projections"
    yield cuda, ref
    cuda.close()


def test_fp8_prefill_logits_match_reference(runners, tiny_fp8_path):
    cuda, ref = runners
    ids = _prompt(3, 200, cuda.vocab_size)
    chunk = PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=_pages(0, 4), all_logits=True)
    cuda.reset_slot(0)
    ref.reset_slot(0)
    ours, want = cuda.prefill(chunk), ref.prefill(chunk)  # pieces of 128 and 72 rows: the FP8 GEMM
    w8a8 = w8a8_numpy_runner(tiny_fp8_path, num_pages=40, num_slots=2).prefill(chunk)
    torch_bf16 = _torch_bf16_logits(tiny_fp8_path, ids)
    e_ours, e_torch, e_w8a8 = _rel(ours, want), _rel(torch_bf16, want), _rel(w8a8, want)
    print(f"fp8 prefill logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}, "
          f"numpy W8A8 {e_w8a8:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * (e_torch + e_w8a8), f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e} + W8A8 {e_w8a8:.3e}"
    agree = float(np.mean(ours.argmax(-1) == want.argmax(-1)))
    agree_w8a8 = float(np.mean(w8a8.argmax(-1) == want.argmax(-1)))
    assert agree >= agree_w8a8 - 0.15, f"argmax agreement {agree:.2f} vs W8A8 NumpyRunner {agree_w8a8:.2f}"


def test_fp8_prefill_is_the_same_however_the_prompt_is_chunked(runners):
    """200 tokens as pieces of 128 + 72 rows and as 64 + 64 + 72 (pieces start on 64-token
    blocks, as the scheduler cuts them): every piece takes the FP8 GEMM, whose rows do not see
    each other, so the last piece's logits are equal bit for bit."""
    cuda, _ = runners
    ids = _prompt(8, 200, cuda.vocab_size)
    results = []
    for cuts in ((0, 128, 200), (0, 64, 128, 200)):
        cuda.reset_slot(0)
        for start, stop in pairwise(cuts):
            logits = cuda.prefill(PrefillChunk(slot=0, token_ids=ids[start:stop], start_pos=start,
                                               page_table=_pages(0, 4), all_logits=True))
        results.append(logits)
    np.testing.assert_array_equal(results[1], results[0])


def test_fp8_decode_logits_match_reference(runners, tiny_fp8_path):
    """Prefill 60 tokens, then decode 4 teacher-forced tokens on both runners (two sequences in
    one batch, so the M = 2 launch is checked too). The prompts' KV and states come from the W8A8
    prefill, so the bound is prefill's: 2x (bf16 torch + the W8A8 NumpyRunner run the same way)."""
    cuda, ref = runners
    w8a8 = w8a8_numpy_runner(tiny_fp8_path, num_pages=40, num_slots=2)
    prompts = [_prompt(4, 60, cuda.vocab_size), _prompt(5, 60, cuda.vocab_size)]
    forced = [_prompt(6, 4, cuda.vocab_size), _prompt(7, 4, cuda.vocab_size)]
    for runner in (cuda, ref, w8a8):
        for s, ids in enumerate(prompts):
            runner.reset_slot(s)
            runner.prefill(PrefillChunk(slot=s, token_ids=ids, start_pos=0, page_table=_pages(s, 2)))
    ours, want, quantised = [], [], []
    for i in range(4):
        items = [DecodeItem(slot=s, token_id=forced[s][i], pos=60 + i, page_table=_pages(s, 2)) for s in range(2)]
        ours.append(cuda.decode(items))
        want.append(ref.decode(items))
        quantised.append(w8a8.decode(items))
    ours, want, quantised = np.stack(ours, 1), np.stack(want, 1), np.stack(quantised, 1)  # [sequence, step, V]
    torch_bf16 = np.stack([_torch_bf16_logits(tiny_fp8_path, prompts[s] + forced[s])[60:] for s in range(2)])
    e_ours, e_torch, e_w8a8 = _rel(ours, want), _rel(torch_bf16, want), _rel(quantised, want)
    print(f"fp8 decode logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}, "
          f"numpy W8A8 {e_w8a8:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * (e_torch + e_w8a8), f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e} + W8A8 {e_w8a8:.3e}"
