"""`CudaRunner` on the tiny dense model converted with `--recipe nvfp4` against `NumpyRunner` on
the same artifact (which dequantises the NVFP4 weights to float32).

Tolerance from a same-precision computation of the same model, as in `test_cuda_runner_fp8.py`:
the BF16 torch forward of the dequantised weights (`_torch_bf16_logits`), whose error against the
fp32 reference measures what bf16 activations cost on this model. Our NVFP4 path decodes each
weight times its block scale exactly in bf16, sums in fp32 and applies the global scale to the
fp32 sum, so it rounds no more than that forward (whose dequantised weights are themselves
rounded to bf16): its error must stay within 2x. Decode runs the NVFP4 GEMV. Prefill pieces of
more than 16 rows decode each weight to bf16 (code x block scale x global, rounded once: the
torch forward's weights are rounded the same way) and run the BF16 GEMM, so the same bound holds;
and a prompt chunked two ways gives the same logits bit for bit.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from .test_cuda_runner import _pages, _prompt, _rel
from .torch_forward import torch_bf16_logits as _torch_bf16_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runners(tiny_nvfp4_path, device, library):
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.numpy_runner import NumpyRunner

    cuda = CudaRunner.from_artifact(tiny_nvfp4_path, num_pages=40, num_slots=2, device=device, library=library,
                                    prefill_chunk=128)
    ref = NumpyRunner.from_artifact(tiny_nvfp4_path, num_pages=40, num_slots=2)
    assert len(cuda.layout.nvfp4_shapes()) == 6, "the artifact has nvfp4 projections"
    yield cuda, ref
    cuda.close()


def test_nvfp4_prefill_logits_match_reference(runners, tiny_nvfp4_path):
    cuda, ref = runners
    ids = _prompt(3, 200, cuda.vocab_size)
    chunk = PrefillChunk(slot=0, token_ids=ids, start_pos=0, page_table=_pages(0, 4), all_logits=True)
    cuda.reset_slot(0)
    ref.reset_slot(0)
    ours, want = cuda.prefill(chunk), ref.prefill(chunk)
    torch_bf16 = _torch_bf16_logits(tiny_nvfp4_path, ids)
    e_ours, e_torch = _rel(ours, want), _rel(torch_bf16, want)
    print(f"nvfp4 logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * e_torch, f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e}"
    agree = float(np.mean(ours.argmax(-1) == want.argmax(-1)))
    agree_torch = float(np.mean(torch_bf16.argmax(-1) == want.argmax(-1)))
    assert agree >= min(0.99, agree_torch - 0.01)


def test_nvfp4_prefill_is_the_same_however_the_prompt_is_chunked(runners):
    """200 tokens as pieces of 128 + 72 rows and as 64 + 64 + 72 (pieces start on 64-token
    blocks, as the scheduler cuts them): every piece takes the decoded-weight GEMM, whose rows do
    not see each other, so the last piece's logits are equal bit for bit."""
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


def test_nvfp4_decode_logits_match_reference(runners, tiny_nvfp4_path):
    """Prefill 60 tokens, then decode 4 teacher-forced tokens on both runners (two sequences in
    one batch, so the M = 2 launch is checked too)."""
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
    torch_bf16 = np.stack([_torch_bf16_logits(tiny_nvfp4_path, prompts[s] + forced[s])[60:] for s in range(2)])
    e_ours, e_torch = _rel(ours, want), _rel(torch_bf16, want)
    print(f"nvfp4 decode logits rel err vs NumpyRunner: ours {e_ours:.3e}, torch bf16 {e_torch:.3e}")
    assert np.isfinite(ours).all()
    assert e_ours <= 2.0 * e_torch, f"error {e_ours:.3e} vs bf16 torch {e_torch:.3e}"
