"""A second run of the same build gives the same tokens on the GPU (issue 15; docs/serving.md,
"Reproducibility": by design, no atomics and fixed reduction orders): the CLI in two separate
processes on a 4-layer model of the Qwen3.6-27B shapes (`--synthetic-shape`, random weights:
near-ties everywhere, so a nondeterministic reduction would show within a few dozen tokens),
greedy and seeded, up to 48 tokens each."""

from __future__ import annotations

import json

import pytest

from runtime.model.shapes import QWEN36_27B
from tests.e2e.test_cli_cross_process import ids_of_a_fresh_process

pytestmark = pytest.mark.gpu


def test_two_processes_give_the_same_tokens_on_cuda(tiny_real_vocab_path, tmp_path):
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(dict(QWEN36_27B, num_hidden_layers=4, layer_types=QWEN36_27B["layer_types"][:4])))
    common = ("--device", "cuda", "--synthetic-weights", "3", "--synthetic-shape", str(shape))
    for options in (("--greedy",), ("--seed", "7", "--temperature", "0.9")):
        first = ids_of_a_fresh_process(tiny_real_vocab_path, *common, *options, max_new=48)
        again = ids_of_a_fresh_process(tiny_real_vocab_path, *common, *options, max_new=48)
        assert first == again and len(first) >= 8, options
