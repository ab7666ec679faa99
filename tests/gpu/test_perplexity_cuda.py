"""`python -m tools.quality.perplexity` on cuda against cpu (issue 14): the same text, the tiny
dense model, one window of 256 tokens, so the same-precision torch BF16 forward of
tests/gpu/test_cuda_runner.py scores exactly the same positions. The tolerance is what BF16
itself costs: the CUDA runner's mean NLL may sit at most twice as far from the float32 NumPy
reference's as torch's BF16 forward does (the bound the runner's logits are held to there)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from tools.quality import perplexity as ppl

from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture
from .torch_forward import torch_bf16_logits as _torch_bf16_logits

pytestmark = pytest.mark.gpu

WORDS = ("The quick brown fox jumps over the lazy dog. The user asks a question and the "
         "assistant answers. ").split()


def _mean_nll(model, text_file, device: str) -> tuple[float, int]:
    out, err = io.StringIO(), io.StringIO()
    rc = ppl.main([str(model), str(text_file), "--device", device, "--context", "256", "--stride", "256"],
                  stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    report = out.getvalue()
    return (float(re.search(r"^mean NLL\s+(\S+)", report, re.M).group(1)),
            int(re.search(r"^tokens scored\s+(\d+)", report, re.M).group(1)))


def test_perplexity_on_cuda_equals_cpu_within_bf16_noise(tiny_path, tmp_path):  # noqa: F811
    from runtime.artifact import open_artifact
    from runtime.text.tokenizer import Tokenizer

    rng = np.random.default_rng(5)
    words = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 400))
    with open_artifact(tiny_path) as artifact:
        tokenizer = Tokenizer.from_artifact_resources(artifact.component("text").resources)
    ids = tokenizer.encode(words, parse_special=False)[:256]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, parse_special=False) == ids     # the tool sees these tokens
    text_file = tmp_path / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    cpu, scored = _mean_nll(tiny_path, text_file, "cpu")
    cuda, scored_cuda = _mean_nll(tiny_path, text_file, "cuda")
    assert scored == scored_cuda == len(ids) - 1
    logits = _torch_bf16_logits(tiny_path, ids).astype(np.float64)
    torch_nll = float(ppl.token_nll(logits[:-1], np.asarray(ids[1:])).mean())
    print(f"mean NLL cpu {cpu:.6f}, cuda {cuda:.6f}, torch bf16 {torch_nll:.6f}")
    assert abs(cuda - cpu) <= 2.0 * abs(torch_nll - cpu) + 1e-6
