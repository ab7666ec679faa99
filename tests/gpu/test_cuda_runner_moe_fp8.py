"""`CudaRunner` on the tiny MoE and Qwen3-Next models converted with `--recipe fp8` (every expert,
the shared one included, and the projections e4m3 with 128x128 block scales; the router and
shared-expert gate bf16) against `NumpyRunner` on the same artifact (which dequantises to fp32).

The checks are test_cuda_runner_fp8.py's, run here with this module's `tiny_fp8_path` and
`runners` (pytest resolves a test's fixtures in the module that collects it), plus a decode batch
of 8 equal to each row alone, bit for bit. Decode runs the experts through `up_fp8` / `down_fp8`
(codes decoded in registers, fp32 partial sums scaled: no weight rounded); a prefill piece of more
than 16 rows dequantises each layer's stacks to bf16 (`dequant_weights`) for the grouped GEMMs and
runs the attention / GDN projections as W8A8. So the bound is the dense FP8 model's: 2x (bf16
torch + the W8A8 NumpyRunner). Measured on the H200 without that second baseline: ours 0.40
(prefill) and 0.47 (decode) against bf16 torch's 0.08 and 0.05, while the W8A8 NumpyRunner alone
is 0.41 from the reference on this random tiny model (its argmax agrees on 58 % of positions).
The tiny Next model is the tiny MoE model's weights in Qwen3-Next's on-disk layout (fused,
regrouped GDN projections), so both give the same numbers: the Next run checks the layout's
import, not different numerics.
"""

from __future__ import annotations

import pytest

from .test_cuda_runner_fp8 import (test_fp8_decode_logits_match_reference,  # noqa: F401
                                   test_fp8_prefill_is_the_same_however_the_prompt_is_chunked,
                                   test_fp8_prefill_logits_match_reference)
from .test_cuda_runner_moe import test_a_batch_of_eight_equals_each_row_alone  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["moe", "next"])
def tiny_fp8_path(request):
    return request.getfixturevalue(f"tiny_{request.param}_fp8_path")


@pytest.fixture(scope="module")
def runners(tiny_fp8_path, device, library):
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import FP8
    from runtime.model.numpy_runner import NumpyRunner

    cuda = CudaRunner.from_artifact(tiny_fp8_path, num_pages=80, num_slots=12, device=device, library=library,
                                    prefill_chunk=128)
    ref = NumpyRunner.from_artifact(tiny_fp8_path, num_pages=80, num_slots=12)
    assert cuda.layout.expert_format == FP8 and cuda.kernels.moe_up_fp8
    assert cuda.kernels.moe_prefill is not None and cuda.kernels.moe_prefill.dequant_gate_up
    yield cuda, ref
    cuda.close()
