"""Decode speed of the real-vocabulary tiny model on the CPU (the CI e2e tests run it).

The model is the shape `tools.make_tiny --vocab real` builds: dense, hidden 256, 4 layers (3
Gated DeltaNet + 1 attention), vocabulary 248,320 with tied embeddings. Its decode step is
dominated by the logits GEMM, which streams the 254 MB float32 embedding once per step
(batched sequences share that pass). The target is < 20 ms per step on 2 cores; the assertion
below is a loose guard against gross regressions (a shared CI machine is noisy), and the
measured numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import time

import numpy as np

from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.random_weights import random_weights, tiny_config_dict
from runtime.model.runner import DecodeItem, PrefillChunk

REAL_VOCAB = 248320


def _config_dict(vocab_size: int = REAL_VOCAB) -> dict:
    return tiny_config_dict(
        "dense", vocab_size=vocab_size, hidden_size=256, intermediate_size=512, head_dim=64,
        linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                         "mrope_interleaved": True})


def real_vocab_tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(_config_dict())


def best_of(repeats: int, step) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return min(times)


def real_vocab_weights(config: ModelConfig) -> dict[str, np.ndarray]:
    """Random weights; the embedding repeats a small random block (drawing 63.5M normals would
    cost seconds and the values do not matter for timing)."""
    weights = random_weights(ModelConfig.from_dict(_config_dict(vocab_size=512)), seed=0)
    weights["embed_tokens.weight"] = np.resize(weights["embed_tokens.weight"],
                                               (config.vocab_size, config.hidden_size))
    return weights


def test_real_vocab_decode_step_time():
    config = real_vocab_tiny_config()
    runner = NumpyRunner(config, real_vocab_weights(config), num_pages=8, num_slots=4)
    prompt = list(range(100, 140))
    tables = [[2 * s, 2 * s + 1] for s in range(4)]
    for slot in range(4):
        runner.prefill(PrefillChunk(slot, prompt, 0, tables[slot]))

    def decode(batch: int):
        def step(i: int) -> None:
            runner.decode([DecodeItem(s, 7 + i, 40 + i, tables[s]) for s in range(batch)])
        return step
    single = best_of(15, decode(1))
    batched = best_of(10, decode(4))
    print(f"\nreal-vocab tiny model decode: {single * 1e3:.1f} ms (1 sequence), "
          f"{batched * 1e3:.1f} ms (4 sequences)")
    assert single < 0.25, f"decode step took {single * 1e3:.0f} ms"
