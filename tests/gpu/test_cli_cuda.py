"""The `infernix` CLI on the GPU backend (tiny dense model, 512-token vocabulary).

- Greedy on `--device cuda` emits the ids `--device cpu` (the float32 NumPy reference) emits for
  the first 24 tokens (the tiny model's greedy path has no near-ties there; see
  test_cuda_runner.py for the tie-aware comparison of longer continuations).
- Seeded sampling on cuda (device sampler) is reproducible: the same seed twice gives the same
  ids, another seed other ids.
- `--synthetic-weights SEED` runs the artifact's shape with seeded random weights: the same seed
  gives the same ids, and they differ from the real weights' ids.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_cli import finish_reason, run_cli, token_ids

pytestmark = pytest.mark.gpu


def _ids(model, *extra):
    code, _, err = run_cli(model, "--prompt", "Say something.", "--no-thinking", "--max-new", "24",
                           "--print-token-ids", *extra)
    assert code == 0, err
    assert finish_reason(err) in ("length", "stop")
    return token_ids(err)


def test_cuda_greedy_matches_cpu(tiny_dense_path):
    cuda = _ids(tiny_dense_path, "--device", "cuda", "--greedy")
    cpu = _ids(tiny_dense_path, "--device", "cpu", "--greedy")
    assert len(cuda) == 24 and cuda == cpu


def test_cuda_seeded_sampling_is_reproducible(tiny_dense_path):
    first = _ids(tiny_dense_path, "--device", "cuda", "--seed", "7", "--temperature", "1.0")
    again = _ids(tiny_dense_path, "--device", "cuda", "--seed", "7", "--temperature", "1.0")
    other = _ids(tiny_dense_path, "--device", "cuda", "--seed", "8", "--temperature", "1.0")
    assert first == again and first != other


def test_synthetic_weights(tiny_dense_path):
    real = _ids(tiny_dense_path, "--device", "cuda", "--greedy")
    synthetic = _ids(tiny_dense_path, "--device", "cuda", "--greedy", "--synthetic-weights", "3")
    again = _ids(tiny_dense_path, "--device", "cuda", "--greedy", "--synthetic-weights", "3")
    assert synthetic == again and synthetic != real
