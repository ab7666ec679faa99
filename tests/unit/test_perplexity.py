"""tools/quality/perplexity.py on the tiny dense model (CPU): the windows, the float64 NLL, the
value against an NLL computed by hand from the NumPy runner's logits, and the error exits."""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest

from runtime.artifact import open_artifact
from runtime.engine.kv_pages import pages_for
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import PrefillChunk
from runtime.session import gpu_present
from runtime.text.tokenizer import Tokenizer
from tools.quality import perplexity as ppl
from tools.quality.perplexity import Window

# Words of the tiny tokenizer's training text, so the text tokenizes into a mix of whole words
# and byte pieces (about 2.7 tokens a word).
WORDS = ("The quick brown fox jumps over the lazy dog. The user asks a question and the "
         "assistant answers. ").split()


def _text(num_words: int) -> str:
    rng = np.random.default_rng(5)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), num_words))


@pytest.fixture(scope="module")
def tokenizer(tiny_dense_path):
    with open_artifact(tiny_dense_path) as artifact:
        return Tokenizer.from_artifact_resources(artifact.component("text").resources)


def _runner(path, context: int) -> NumpyRunner:
    return NumpyRunner.from_artifact(path, num_pages=pages_for(context), num_slots=1,
                                     dtype=np.float32)


def _hand_nll(runner: NumpyRunner, tokens: list[int], targets: range) -> list[float]:
    """One fresh prefill of `tokens` with every position's logits, then -log p(target) by
    log-sum-exp in float64, one target at a time (independent of `ppl.token_nll`)."""
    runner.reset_slot(0)
    logits = runner.prefill(PrefillChunk(0, tokens, 0, list(range(runner.num_pages)),
                                         all_logits=True))
    assert logits.shape == (len(tokens), runner.vocab_size)
    return [float(np.logaddexp.reduce(logits[t - 1].astype(np.float64))
                  - np.float64(logits[t - 1, tokens[t]])) for t in targets]


def _report_values(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w[\w ]*?)\s{2,}(.*)$", stdout, flags=re.MULTILINE))


def test_windows_score_every_token_once_with_at_most_context_minus_one_before_it():
    assert ppl.plan_windows(150, 64, 43) == [Window(0, 64, 1), Window(43, 107, 64),
                                             Window(86, 150, 107)]
    # One window when it holds the text; the first token is never a target.
    assert ppl.plan_windows(10, 16, 8) == [Window(0, 10, 1)]
    # stride == context: disjoint windows, whose first token has nothing before it.
    assert ppl.plan_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    # ... and a last window of one token scores nothing, so it is left out.
    assert ppl.plan_windows(9, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5)]
    for windows, n in ((ppl.plan_windows(1000, 100, 7), 1000), (ppl.plan_windows(77, 8, 1), 77)):
        targets = [t for w in windows for t in range(w.score_from, w.end)]
        assert targets == list(range(1, n))
        assert all(w.score_from > w.begin and w.end - w.begin <= 100 for w in windows)
    with pytest.raises(ValueError, match="stride"):
        ppl.plan_windows(10, 4, 5)


def test_token_nll_is_a_stable_float64_log_softmax():
    # exp(100) and exp(1000) overflow float32 (and exp(1000) float64): the peak is taken out.
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0], [100.0, 100.0, -100.0]],
                      dtype=np.float32)
    nll = ppl.token_nll(logits, np.array([1, 2, 0]))
    np.testing.assert_allclose(nll, [1000.0, math.log(3.0), math.log(2.0)], rtol=1e-12)
    # Rows past one float64 block (SOFTMAX_ROWS) give the same numbers as row by row.
    rng = np.random.default_rng(0)
    many = rng.normal(0, 4, (ppl.SOFTMAX_ROWS * 2 + 3, 50)).astype(np.float32)
    targets = rng.integers(0, 50, len(many))
    expected = [np.logaddexp.reduce(row.astype(np.float64)) - row[t] for row, t in zip(many, targets)]
    np.testing.assert_allclose(ppl.token_nll(many, targets), expected, rtol=1e-12)


def test_one_window_over_the_whole_text_equals_one_prefill_scored_by_hand(
        tiny_dense_path, tokenizer, tmp_path):
    text = _text(24)
    tokens = tokenizer.encode(text, parse_special=False)
    assert 2 <= len(tokens) <= 128
    nll = _hand_nll(_runner(tiny_dense_path, 128), tokens, range(1, len(tokens)))
    expected = math.exp(sum(nll) / len(nll))
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    stdout, stderr = io.StringIO(), io.StringIO()
    rc = ppl.main([str(tiny_dense_path), str(path), "--context", "128", "--stride", "128",
                   "--prefill-chunk", "128"], stdout=stdout, stderr=stderr)
    assert rc == 0, stderr.getvalue()
    values = _report_values(stdout.getvalue())
    assert values["tokens scored"] == str(len(tokens) - 1)
    assert values["windows"] == "1 (context 128, stride 128)"
    assert values["text"] == f"{path} ({len(tokens)} tokens)"
    assert float(values["perplexity"]) == pytest.approx(expected, rel=1e-9)
    assert float(values["mean NLL"].split()[0]) == pytest.approx(sum(nll) / len(nll), rel=1e-9)
    assert re.fullmatch(r"[\d.]+ s scoring \([\d.]+ tokens/s\), [\d.]+ s loading",
                        values["wall time"])
    assert "note" not in values                  # the BF16 note is for cuda only
    assert f"scoring: 100% ({len(tokens) - 1}/{len(tokens) - 1} tokens)" in stderr.getvalue()


def test_three_sliding_windows_equal_the_hand_computation(tiny_dense_path, tokenizer):
    tokens = tokenizer.encode(_text(64), parse_special=False)[:150]
    assert len(tokens) == 150
    runner = _runner(tiny_dense_path, 64)
    # Windows [0, 64), [43, 107), [86, 150): each scores the targets the one before did not.
    nll = (_hand_nll(runner, tokens[0:64], range(1, 64))
           + _hand_nll(runner, tokens[43:107], range(64 - 43, 107 - 43))
           + _hand_nll(runner, tokens[86:150], range(107 - 86, 150 - 86)))
    assert len(nll) == 149
    result = ppl.score(runner, tokens, context=64, stride=43, prefill_chunk=64)
    assert (result.windows, result.tokens_scored) == (3, 149)
    assert result.total_nll == pytest.approx(sum(nll), rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(sum(nll) / 149), rel=1e-12)


def test_prefill_chunks_smaller_than_the_window_give_the_same_value(tiny_dense_path, tokenizer):
    tokens = tokenizer.encode(_text(64), parse_special=False)[:150]
    runner = _runner(tiny_dense_path, 192)
    whole = ppl.score(runner, tokens, context=192, stride=192, prefill_chunk=192)
    chunked = ppl.score(runner, tokens, context=192, stride=192, prefill_chunk=64)
    assert whole.tokens_scored == chunked.tokens_scored == 149
    # Three chunks instead of one: float32 rounding of the chunked forward pass only (measured
    # 1.6e-8 relative).
    assert chunked.total_nll == pytest.approx(whole.total_nll, rel=1e-6)


def _run(args: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    rc = ppl.main(args, stdout=stdout, stderr=stderr)
    return rc, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("content, options, message", [
    (b"", [], "{path}: the file is empty"),
    (b"caf\xc3\xa9 \xff!", [], "{path}: not UTF-8 text (byte 0xff at offset 6)"),
    (b"x", [], "{path}: 1 token after tokenizing; perplexity needs at least 2"),
    (b"The quick brown fox", ["--context", "64", "--stride", "65"],
     "--stride 65 exceeds --context 64"),
    (b"The quick brown fox", ["--stride", "3000"], "--stride 3000 exceeds --context 2048"),
    (b"The quick brown fox", ["--context", "40000"],
     "--context 40000 exceeds the model's maximum context of 32768 tokens"),
    (b"The quick brown fox", ["--context", "1"], "--context 1: a window needs at least 2 tokens"),
    (b"The quick brown fox", ["--prefill-chunk", "100"],
     "--prefill-chunk 100: must be a positive multiple of 64"),
    (b"The quick brown fox", ["--synthetic-weights", "1"], "--synthetic-weights fills weights"),
])
def test_bad_input_exits_2_with_one_line_naming_the_problem(tiny_dense_path, tmp_path, content,
                                                            options, message):
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    rc, stdout, stderr = _run([str(tiny_dense_path), str(path), *options])
    assert rc == 2
    assert stdout == ""
    assert stderr.startswith(f"perplexity: error: {message.format(path=path)}")
    assert stderr.count("\n") == 1


def test_missing_files_exit_2(tiny_dense_path, tmp_path):
    missing = tmp_path / "missing.txt"
    assert _run([str(tiny_dense_path), str(missing)]) == (
        2, "", f"perplexity: error: {missing}: no such file\n")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox")
    assert _run([str(tmp_path / "none.infernix"), str(text)]) == (
        2, "", f"perplexity: error: {tmp_path / 'none.infernix'}: no such model file\n")


@pytest.mark.skipif(gpu_present(), reason="checks the message given where no GPU is visible")
def test_cuda_without_a_gpu_says_so(tiny_dense_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox")
    rc, stdout, stderr = _run([str(tiny_dense_path), str(text), "--device", "cuda"])
    assert (rc, stdout) == (2, "")
    assert stderr.startswith("perplexity: error: --device cuda: no CUDA GPU is visible here")
