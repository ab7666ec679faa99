"""`--synthetic-shape NAME|FILE` (with `--synthetic-weights`): the shape a speed run uses
instead of the model's, and the clear errors for what cannot work."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from runtime.config import ConfigError
from runtime.model.shapes import QWEN36_27B
from runtime.session.backend import make_runner, synthetic_shape

REAL_VOCAB = {"vocab_size": 248320}


def test_the_named_shape_is_the_27b_text_config():
    config = synthetic_shape("qwen3.6-27b", REAL_VOCAB)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (5120, 64, 248320)
    assert len(config.attention_layers) == 16 and len(config.linear_layers) == 48


def test_the_35b_a3b_shape_is_its_text_config():
    """qwen-arch.md 1.2: 40 layers of 2048 (30 GDN : 10 attention), 256 experts of width 512, top 8,
    a shared expert of width 512, renormalised routing."""
    c = synthetic_shape("qwen3.6-35b-a3b", REAL_VOCAB)
    assert (c.family, c.hidden_size, c.num_hidden_layers) == ("moe", 2048, 40)
    assert len(c.attention_layers) == 10 and len(c.linear_layers) == 30
    assert (c.num_attention_heads, c.num_key_value_heads, c.linear_num_value_heads) == (16, 2, 32)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size,
            c.norm_topk_prob) == (256, 8, 512, 512, True)
    assert set(c.mlp_types) == {"moe"}


def test_a_json_file_gives_its_config(tmp_path):
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(dict(QWEN36_27B, num_hidden_layers=4,
                                    layer_types=QWEN36_27B["layer_types"][:4])))
    assert synthetic_shape(str(path), REAL_VOCAB).num_hidden_layers == 4


@pytest.mark.parametrize("name, artifact, message", [
    ("qwen3.6-27b", {"vocab_size": 512}, "vocabulary of 248320 tokens, the model's tokenizer has 512"),
    ("no-such-shape", REAL_VOCAB, "'no-such-shape' is neither a known shape (qwen3.6-27b, qwen3.6-35b-a3b, qwen3-next-80b) nor "
     "a file"),
])
def test_what_cannot_run_is_a_config_error(name, artifact, message):
    with pytest.raises(ConfigError, match="--synthetic-shape") as err:
        synthetic_shape(name, artifact)
    assert message in str(err.value)


def test_a_file_that_is_not_a_json_config_is_named(tmp_path):
    path = tmp_path / "shape.json"
    path.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ConfigError, match=f"{path}: not a JSON text config"):
        synthetic_shape(str(path), REAL_VOCAB)


def test_a_shape_without_synthetic_weights_is_refused_before_anything_loads():
    settings = SimpleNamespace(synthetic_weights=None, synthetic_shape="qwen3.6-27b")
    with pytest.raises(ConfigError, match="give --synthetic-weights SEED too"):
        make_runner("cuda", None, 4, 1, 1, 64, settings, None)
