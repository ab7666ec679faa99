"""`--draft-tokens auto`: the MTP draft count each round that the request's measured acceptance
and the runner's `round_cost` make fastest (`best_draft_count`), the acceptance bookkeeping, the
option, and output equal to plain decoding on the NumPy runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.config import ConfigError, parse_settings
from runtime.engine.speculative import (MAX_MTP_DRAFTS, SpeculativeConfig, _SequenceState,
                                        best_draft_count)
from runtime.session.engine_settings import speculative_settings
from test_speculative_numpy import GREEDY, OFF, PROMPTS, SEEDED, generate

AUTO = SpeculativeConfig(method="mtp", draft_tokens=MAX_MTP_DRAFTS, adaptive=True)


def rate(p: float, k: int, cost) -> float:
    """Tokens per decode step of k drafts each accepted with chance p (a geometric chain)."""
    return sum(p ** i for i in range(k + 1)) / cost(k)


def gpu_cost(k: int) -> float:      # the CUDA runner's model: 0.05 per verified draft + MTP
    return 1 + 0.05 * k + 0.075 * k


def test_high_acceptance_on_a_cheap_verifier_drafts_the_most():
    # 99 of 100 accepted at every position: chance 100/102 each.
    assert best_draft_count([100] * 5, [99] * 5, 5, gpu_cost) == 5
    p = 100 / 102
    assert max(range(1, 6), key=lambda k: rate(p, k, gpu_cost)) == 5


def test_a_rejected_first_draft_means_one_draft():
    # The first draft never accepted (chance 1 / 102): one draft is all that pays.
    assert best_draft_count([100, 0, 0, 0, 0], [0] * 5, 5, gpu_cost) == 1


def test_untried_positions_count_as_even_odds():
    # Chance 1/2 at every position: 1.5 / 1.139, 1.75 / 1.278, 1.875 / 1.417 ... peaks at 2.
    assert best_draft_count([0] * 5, [0] * 5, 5, gpu_cost) == 2
    assert max(range(1, 6), key=lambda k: rate(0.5, k, gpu_cost)) == 2


def test_a_verifier_costing_a_step_per_token_drafts_one():
    # The NumPy runner: k + 1 steps a round, so (1 + p + ... + p^k) / (k + 1) falls with k.
    assert best_draft_count([100] * 5, [90] * 5, 5, lambda k: 1 + k) == 1


def test_acceptance_is_counted_per_draft_position():
    state = _SequenceState(ngram=None)
    state.record(drafted=3, accepted=1)       # draft 1 accepted, draft 2 tried and rejected
    assert state.tested[:4] == [1, 1, 0, 0] and state.accepted[:4] == [1, 0, 0, 0]
    state.record(drafted=3, accepted=3)       # all three accepted
    assert state.tested[:4] == [2, 2, 1, 0] and state.accepted[:4] == [2, 1, 1, 0]
    state.record(drafted=2, accepted=0)       # the first rejected: nothing after it was tried
    assert state.tested[:4] == [3, 2, 1, 0] and state.accepted[:4] == [2, 1, 1, 0]


def test_the_option_takes_auto_and_still_needs_the_mtp_head():
    mtp = SimpleNamespace(all_component_names=("text", "mtp"))
    settings = parse_settings("cli", ["m.infernix", "--prompt", "x", "--spec", "mtp", "--draft-tokens", "auto"])
    config = speculative_settings(settings, "cpu", mtp)
    assert config.adaptive and config.draft_tokens == MAX_MTP_DRAFTS and config.max_drafts == MAX_MTP_DRAFTS
    without = parse_settings("cli", ["m.infernix", "--prompt", "x", "--draft-tokens", "auto"])
    with pytest.raises(ConfigError, match="needs --spec mtp"):
        speculative_settings(without, "cpu", mtp)
    with pytest.raises(ValueError, match="adaptive draft lengths are for MTP drafts"):
        SpeculativeConfig(ngram_draft_tokens=4, adaptive=True)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_auto_rounds_equal_plain_decoding_and_draft_one_on_the_cpu(tiny_dense_path, sampling):
    from runtime.artifact import open_artifact

    with open_artifact(tiny_dense_path) as artifact:
        plain, _ = generate(artifact, OFF, PROMPTS, 24, sampling)
        got, counters = generate(artifact, AUTO, PROMPTS, 24, sampling, lanes=2)
    for rid in PROMPTS:
        assert got[rid][0] == plain[rid][0], rid
    # The NumPy runner verifies a token per decode step, so one draft a round is fastest.
    assert counters["spec_rounds"] >= 20
    assert counters["spec_drafted_tokens"] == counters["spec_rounds"]
    assert 0 <= counters["spec_accepted_tokens"] <= counters["spec_drafted_tokens"]


def test_a_draft_vocabulary_makes_a_round_cheaper_by_the_head_rows_it_skips():
    from runtime.model.config import ModelConfig
    from runtime.model.runner import speculative_round_cost
    from runtime.model.shapes import shape_config

    c = ModelConfig.from_dict(shape_config("qwen3.6-27b"))
    layer, h = 12 * c.hidden_size ** 2, c.hidden_size
    step = c.num_hidden_layers * layer + c.vocab_size * h
    full = speculative_round_cost(c, 3, True, 0.05)
    small = speculative_round_cost(c, 3, True, 0.05, draft_vocab=32768)
    assert full == pytest.approx(1 + 3 * 0.05 + 3 * (layer + c.vocab_size * h) / step)
    assert full - small == pytest.approx(3 * (c.vocab_size - 32768) * h / step)
    assert speculative_round_cost(c, 3, False, 0.05, draft_vocab=32768) == pytest.approx(1.15)


def test_the_draft_vocabulary_option_needs_the_mtp_head_and_fits_the_model(tiny_dense_path):
    import logging

    from runtime.artifact import open_artifact
    from runtime.session.backend import make_runner

    def settings(*extra: str):
        return parse_settings("cli", ["m.infernix", "--prompt", "x", *extra])

    with open_artifact(tiny_dense_path) as artifact:
        vocab = artifact.component("text").config["vocab_size"]
        ok = settings("--spec", "mtp", "--mtp-draft-vocab", "64")
        assert speculative_settings(ok, "cpu", artifact).mtp
        runner = make_runner("cpu", artifact, 4, 1, 5, 64, ok, logging.getLogger("test"), mtp=True)
        assert runner.mtp_draft_vocab == 64
        with pytest.raises(ConfigError, match="needs --spec mtp"):
            speculative_settings(settings("--mtp-draft-vocab", "64"), "cpu", artifact)
        with pytest.raises(ConfigError, match=f"the model has {vocab} token ids"):
            speculative_settings(settings("--spec", "mtp", "--mtp-draft-vocab", str(vocab + 1)), "cpu", artifact)
        plain = make_runner("cpu", artifact, 4, 1, 5, 64, settings("--spec", "mtp"), logging.getLogger("test"),
                            mtp=True)
        assert plain.mtp_draft_vocab == vocab
