"""`NumpyRunner` with the FP8 prefill GEMM's activation quantisation: the W8A8 baseline.

`CudaRunner` prefills FP8 projections as W8A8 (`layers.Forward.fp8_gemm`): each input row is
rounded to e4m3 with a scale per 128 columns (`quantize_act`) before the block-scaled product.
That rounding (3 mantissa bits) costs more than the bf16 activations the BF16 torch baseline
measures, so the runner tests measure it too: this NumpyRunner (float32, weights dequantised)
quantises the input of every FP8 projection the same way (`quantize_act.reference`) and keeps
everything else, so its error against the plain NumpyRunner is what the activation quantisation
alone costs on the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cute_kernels import quantize_act
from runtime.artifact.formats import e4m3_to_f32

# The projections Qwen's FP8 recipe (`weights.fp8_recipe_format`) quantises, by their field in
# runtime.model.weights: all but the GDN in_proj_a / in_proj_b and the lm_head.
FP8_FIELDS = {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
              "up_proj", "down_proj"}


def quantised(x: np.ndarray) -> np.ndarray:
    """x [..., K] through e4m3 with a scale per (row, 128 columns), back to float32."""
    flat = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    codes, scale = quantize_act.reference(flat)
    back = e4m3_to_f32(codes) * np.repeat(scale, quantize_act.GROUP, axis=1)[:, :flat.shape[1]]
    return back.reshape(x.shape)


class _ActQuantisedWeight(np.ndarray):
    """A weight whose products `x @ w.T` quantise x first (numpy's matmul ufunc, intercepted);
    any other operation sees a plain array."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = [np.asarray(a).view(np.ndarray) if isinstance(a, _ActQuantisedWeight) else a for a in inputs]
        if ufunc is np.matmul and method == "__call__" and len(inputs) == 2 \
                and isinstance(inputs[1], _ActQuantisedWeight) and not isinstance(inputs[0], _ActQuantisedWeight):
            plain[0] = quantised(plain[0])
        return getattr(ufunc, method)(*plain, **kwargs)


def _marked(weights: Any) -> Any:
    changes = {f.name: getattr(weights, f.name).view(_ActQuantisedWeight)
               for f in dataclasses.fields(weights) if f.name in FP8_FIELDS}
    return dataclasses.replace(weights, **changes)


def w8a8_numpy_runner(path: Any, **kwargs: Any) -> Any:
    """NumpyRunner.from_artifact(path, **kwargs) with every FP8 projection's input quantised."""
    from runtime.model.numpy_runner import NumpyRunner

    runner = NumpyRunner.from_artifact(path, **kwargs)
    layers = tuple(dataclasses.replace(layer, mixer=_marked(layer.mixer), mlp=_marked(layer.mlp))
                   for layer in runner.text.layers)
    runner.text = dataclasses.replace(runner.text, layers=layers)
    return runner
