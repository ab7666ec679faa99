"""The `infernix` CLI on the GPU backend (tiny dense model, 512-token vocabulary).

- Greedy on `--device cuda` is deterministic and starts with the token `--device cpu` (the
  float32 NumPy reference) picks. Later tokens may part at a near-tie of the bf16 and fp32
  logits (on the H200 this prompt's first 20 of 24 agreed); test_cuda_runner.py checks that every
  such disagreement is a near-tie within measured BF16 noise.
- Seeded sampling on cuda (device sampler) is reproducible: the same seed twice gives the same
  ids, another seed other ids.
- `--synthetic-weights SEED` runs the artifact's shape with seeded random weights: the same seed
  gives the same ids, and they differ from the real weights' ids.
- `--spec mtp` (the MTP head on the GPU) gives plain decoding's greedy ids.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_cli import finish_reason, run_cli, token_ids

pytestmark = pytest.mark.gpu


def _ids(model, *extra):
    code, _, err = run_cli(model, "--prompt", "Say something.", "--no-thinking", "--max-new", "24",
                           "--print-token-ids", *extra)
    assert code == 0, err
    assert finish_reason(err) in ("length", "stop")
    return token_ids(err)


def test_cuda_greedy_is_deterministic_and_starts_like_cpu(tiny_dense_path):
    cuda = _ids(tiny_dense_path, "--device", "cuda", "--greedy")
    again = _ids(tiny_dense_path, "--device", "cuda", "--greedy")
    cpu = _ids(tiny_dense_path, "--device", "cpu", "--greedy")
    assert len(cuda) == 24 and cuda == again
    assert cuda[0] == cpu[0]


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


def test_spec_mtp_greedy_equals_plain_and_reports_rounds(tiny_dense_path):
    """`--spec mtp` on cuda (the MTP head on the GPU) gives plain decoding's ids, with the real
    weights and with a synthetic model (random head); the report counts its rounds."""
    for extra in ((), ("--synthetic-weights", "3")):
        plain = _ids(tiny_dense_path, "--device", "cuda", "--greedy", *extra)
        code, _, err = run_cli(tiny_dense_path, "--prompt", "Say something.", "--no-thinking", "--max-new", "24",
                               "--print-token-ids", "--device", "cuda", "--greedy", "--spec", "mtp",
                               "--draft-tokens", "3", *extra)
        assert code == 0, err
        assert token_ids(err) == plain and re.search(r"^speculative [1-9]\d* rounds", err, re.M), err
