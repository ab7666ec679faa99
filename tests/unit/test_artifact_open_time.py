"""Opening a large artifact must not read its payload: a sparse file with the full tensor
directory of Qwen3.6-35B-A3B (experts nvfp4, the rest bf16; ~23 GB) opens in milliseconds.
The number in docs/artifact.md comes from `python -m pytest tests/unit/test_artifact_open_time.py
-s`, which prints it."""

import time

import numpy as np

from runtime.artifact import ArtifactWriter, open_artifact
from tools.convert import Dims, model_tensors

CONFIG_35B_A3B = {
    "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}


def write_sparse_35b(path):
    dims = Dims.from_config(CONFIG_35B_A3B, "moe")
    with ArtifactWriter(path) as writer:
        for component, tensors in model_tensors(dims, tie=False, mtp_layers=1).items():
            writer.add_component(component, dict(CONFIG_35B_A3B))
            for name, shape in tensors.items():
                experts = ".experts." in name
                writer.add_encoded(component, name, "nvfp4" if experts else "bf16", shape, None,
                                   row_groups=2 if name.endswith("gate_up_proj") else 1)
    return path


def test_open_time_of_a_large_sparse_artifact(tmp_path):
    path = write_sparse_35b(tmp_path / "big.infernix")
    size = path.stat().st_size
    assert size > 16e9
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        art = open_artifact(path)
        timings.append(time.perf_counter() - started)
        text = art.component("text")
        count = len(text.tensor_names()) + len(art.component("mtp").tensor_names())
        art.close()
    started = time.perf_counter()
    with open_artifact(path) as art:
        view = art.component("text").raw("layers.0.mlp.experts.gate_up_proj")
        first_view = time.perf_counter() - started
        assert view.shape == (256, 1024, 1024) and not np.any(view[0, 0, :16])
    best, worst = min(timings), max(timings)
    print(f"\nopen {size / 1e9:.1f} GB, {count} tensors: best {best * 1e3:.1f} ms, "
          f"worst {worst * 1e3:.1f} ms; open + first view {first_view * 1e3:.1f} ms")
    assert worst < 1.0
