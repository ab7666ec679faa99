"""Registered sampling presets (seed 000) and the precedence of the sampling layers."""

from __future__ import annotations

import pytest

from runtime.config import parse_settings
from runtime.engine.presets import (GENERAL, SamplingOverrides, model_presets, preset_for,
                                    resolve_sampling)


@pytest.mark.parametrize("name, thinking, expected", [
    ("Qwen3.6-27B", True, (1.0, 0.95, 20, 0.0, 0.0)),
    ("Qwen3.6-27B", False, (0.7, 0.80, 20, 0.0, 1.5)),
    ("qwen3_8_27b_nvfp4", True, (1.0, 0.95, 20, 0.0, 0.0)),
    ("Qwen3.8-27B", False, (0.7, 0.80, 20, 0.0, 1.5)),
    ("Qwen3.6-35B-A3B", True, (1.0, 0.95, 20, 0.0, 1.5)),
    ("qwen3_6_35b_a3b", False, (0.7, 0.80, 20, 0.0, 1.5)),
    ("Qwen3.8-Flash-Next", True, (1.0, 0.95, 20, 0.0, 0.0)),
    ("Qwen3.8-Flash-Next", False, (0.7, 0.80, 20, 0.0, 1.5)),
    ("tiny-random", True, (1.0, 0.95, 20, 0.0, 0.0)),
    (None, False, (0.7, 0.80, 20, 0.0, 1.5)),
])
def test_registered_presets(name, thinking, expected):
    p = preset_for(name, thinking)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty) == expected
    assert p.frequency_penalty == 0.0


def test_unknown_models_get_the_general_preset():
    assert model_presets("my-finetune") is GENERAL
    assert model_presets("Qwen3.6-35B-A3B").name == "Qwen3.6-35B-A3B"


def test_precedence_preset_then_flag_then_request_then_greedy():
    preset = preset_for("Qwen3.6-27B", thinking=False)
    params = resolve_sampling(preset)
    assert (params.temperature, params.top_p, params.presence_penalty) == (0.7, 0.8, 1.5)
    flags = SamplingOverrides(temperature=0.3, top_k=5)
    params = resolve_sampling(preset, flags)
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 5, 0.8)
    params = resolve_sampling(preset, flags, SamplingOverrides(temperature=0.9, seed=11))
    assert (params.temperature, params.top_k, params.seed) == (0.9, 5, 11)
    assert not params.greedy
    params = resolve_sampling(preset, SamplingOverrides(greedy=True),
                              SamplingOverrides(temperature=0.9))
    assert params.greedy


def test_top_k_zero_is_the_twenty_cap():
    params = resolve_sampling(GENERAL.thinking, SamplingOverrides(top_k=0))
    assert params.top_k == 20


def test_a_constraint_zeroes_the_default_presence_penalty_only():
    preset = preset_for("Qwen3.6-35B-A3B", thinking=True)
    assert resolve_sampling(preset, constrained=True).presence_penalty == 0.0
    explicit = SamplingOverrides(presence_penalty=0.5)
    assert resolve_sampling(preset, explicit, constrained=True).presence_penalty == 0.5


def test_seed_layers():
    assert resolve_sampling(GENERAL.thinking, default_seed=9).seed == 9
    assert resolve_sampling(GENERAL.thinking, SamplingOverrides(seed=4), default_seed=9).seed == 4


def test_overrides_from_cli_settings():
    settings = parse_settings("cli", ["m.infernix", "--prompt", "x", "--top-p", "0.5",
                                      "--greedy", "--seed", "3"])
    flags = SamplingOverrides.from_settings(settings)
    assert flags.top_p == 0.5 and flags.greedy and flags.seed == 3 and flags.temperature is None
