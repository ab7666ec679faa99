"""`infernix --spec mtp` / `--ngram-draft-tokens` end to end on the tiny dense model (its own MTP
head, CPU): the answer equals plain decoding with a thinking budget and a stop string, and
with a regex constraint and seeded sampling; the report carries the round statistics; option
combinations that cannot work exit 2 with one line."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.cli import main
from runtime.config import ConfigError
from runtime.session import speculative_settings

SPEC = ("--spec", "mtp", "--draft-tokens", "3", "--ngram-draft-tokens", "6",
        "--ngram-min-match", "4")


def run_cli(*args) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], stdout=stdout, stderr=stderr)
    return code, stdout.getvalue(), stderr.getvalue()


def report(stderr: str) -> tuple[int, int, int, float]:
    match = re.search(r"^speculative (\d+) rounds \| accepted (\d+) of (\d+) drafts "
                      r"\([\d.]+ %\) \| ([\d.]+) tokens per round$", stderr, re.M)
    assert match, stderr
    rounds, accepted, drafted, per_round = match.groups()
    return int(rounds), int(accepted), int(drafted), float(per_round)


@pytest.fixture(scope="module")
def model(tiny_dense_path) -> Path:
    return Path(tiny_dense_path)


def test_thinking_budget_and_stop_string_answer_equals_plain(model):
    base = (model, "--device", "cpu", "--prompt", "Say something.", "--greedy",
            "--thinking-budget", "5", "--max-new", "160")     # the close span is 69 tokens
    code, plain, err = run_cli(*base)
    assert code == 0, err
    text = plain.rstrip("\n")
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip()
                and text.find(text[i:i + 2]) == i)
    code, plain_stopped, err = run_cli(*base, "--stop", stop)
    assert code == 0 and plain_stopped.rstrip("\n") == text[:text.index(stop)]
    code, spec, err = run_cli(*base, *SPEC)
    assert code == 0, err
    assert spec == plain and "closed by the thinking budget" in err
    rounds, accepted, drafted, per_round = report(err)
    assert rounds >= 40 and rounds <= drafted <= 6 * rounds
    assert per_round == pytest.approx((accepted + rounds) / rounds, abs=0.005)
    code, spec_stopped, err = run_cli(*base, *SPEC, "--stop", stop)
    assert code == 0, err
    assert spec_stopped == plain_stopped and "| finish stop" in err


def test_seeded_regex_constrained_answer_equals_plain(model):
    base = (model, "--device", "cpu", "--prompt", "Ticket?", "--no-thinking", "--seed", "5",
            "--regex", "(BUG|TASK)-[0-9]{4}", "--max-new", "30", "--print-token-ids")
    code, plain, err_plain = run_cli(*base)
    assert code == 0, err_plain
    code, spec, err = run_cli(*base, *SPEC)
    assert code == 0, err
    assert re.fullmatch(r"(BUG|TASK)-[0-9]{4}", spec.strip()) and spec == plain
    ids = re.search(r"^token ids (.*)$", err, re.M).group(1)
    assert ids == re.search(r"^token ids (.*)$", err_plain, re.M).group(1)


def test_draft_tokens_without_mtp_exits_2(model):
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", "Hi", "--draft-tokens", "2")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("infernix: error:")
    assert "--draft-tokens" in err and "--spec mtp" in err


def test_impossible_combinations_are_config_errors():
    settings = SimpleNamespace(spec="mtp", draft_tokens=None, ngram_draft_tokens=0,
                               ngram_min_match=12, synthetic_weights=None, mtp_draft_vocab=None)
    without_mtp = SimpleNamespace(all_component_names=("text",))
    for device in ("cpu", "cuda"):      # both runners have the MTP head; it must be in the file
        with pytest.raises(ConfigError, match="no MTP component"):
            speculative_settings(settings, device, without_mtp)
        assert speculative_settings(settings, device, SimpleNamespace(all_component_names=("text", "mtp"))).mtp
    # Synthetic weights fill a random head of the config's shape, whatever the file holds.
    synthetic = SimpleNamespace(**{**vars(settings), "synthetic_weights": 3})
    assert speculative_settings(synthetic, "cuda", without_mtp).draft_tokens == 3
    off = SimpleNamespace(spec="off", draft_tokens=None, ngram_draft_tokens=0, ngram_min_match=12,
                          mtp_draft_vocab=None)
    config = speculative_settings(off, "cuda", without_mtp)
    assert not config.enabled and config.max_drafts == 0
    ngram = SimpleNamespace(spec="off", draft_tokens=None, ngram_draft_tokens=9, ngram_min_match=5,
                            mtp_draft_vocab=None)
    for device in ("cpu", "cuda"):      # n-gram drafts verify on either runner
        config = speculative_settings(ngram, device, without_mtp)
        assert (config.mtp, config.max_drafts, config.ngram_min_match) == (False, 9, 5)
