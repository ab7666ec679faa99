"""Vision towers of released shapes with random weights (benchmarks and GPU tests; the real
weights come from the artifact's `vision` component).

`QWEN35_27B_VISION` is Qwen3.5-27B's `vision_config` (qwen-arch section 4: 27 blocks of width 1152,
16 heads of 72, MLP 4304, merger 4 x 1152 -> 5120) with the prompt's media token ids.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from runtime.model.vision_reference import VisionConfig, vision_tensor_shapes

QWEN35_27B_VISION: Mapping[str, Any] = {
    "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
    "out_hidden_size": 5120, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
    "rope_parameters": {"rope_theta": 10000.0}, "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054}


def synthetic_weights(config: VisionConfig, seed: int) -> dict[str, np.ndarray]:
    """float32 weights by role: norm weights near 1 and biases near 0 (a missing affine shows),
    projections uniform with std 1/sqrt(fan_in) (activations keep their scale through the
    blocks), the position table uniform in +-0.5."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in vision_tensor_shapes(config).items():
        if "norm" in name and name.endswith("weight"):
            value = rng.uniform(0.8, 1.2, shape)
        elif name.endswith("bias"):
            value = rng.uniform(-0.1, 0.1, shape)
        elif name == "pos_embed.weight":
            value = rng.uniform(-0.5, 0.5, shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            value = rng.uniform(-1.0, 1.0, shape) * np.sqrt(3.0 / fan_in)
        out[name] = value.astype(np.float32)
    return out
