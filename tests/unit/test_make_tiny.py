"""tools/make_tiny.py: the tiny models other tests run on (configs, tensors, tokenizers)."""

import json
import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer

from runtime.artifact import open_artifact
from tools import convert, make_tiny

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<tool_response>", "</tool_response>", "<|vision_start|>",
            "<|image_pad|>"]
MULTILINGUAL = [
    "Hello, world! It's a test; we'll see.",
    "def f(x):\n    return x * 2  # double\n",
    "一二三，这是一个中文句子。日本語のテキスト。한국어 문장입니다.",
    "Emoji 😀👍🏽 👨‍👩‍👧 and accents e\u0301 é ñ; Русский текст; مرحبا بالعالم",
    "   spaces\t\ttabs\r\n\n  and <|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
]
FAMILY_OF = {"tiny_dense_path": "dense", "tiny_moe_path": "moe", "tiny_next_path": "next"}


@pytest.mark.parametrize("fixture", list(FAMILY_OF))
def test_tiny_model_shape_and_components(fixture, request):
    path, family = request.getfixturevalue(fixture), FAMILY_OF[fixture]
    with open_artifact(path) as art:
        assert art.component_names == ("text", "mtp")
        text, mtp = art.component("text"), art.component("mtp")
        cfg = text.config
        assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                cfg["head_dim"]) == (256, 4, 2, 64)
        assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]) == (2, 4)
        assert cfg["vocab_size"] == 512 and cfg["tie_word_embeddings"] is False
        assert cfg["model_type"] == convert.TEXT_MODEL_TYPES[family]
        if family == "next":
            assert cfg["partial_rotary_factor"] == 0.25 and "rope_parameters" not in cfg
        else:
            assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
            assert cfg["image_token_id"] == text.entry("embed_tokens.weight").shape[0] - 52
        assert mtp.config["num_hidden_layers"] == 1
        assert mtp.config["layer_types"] == ["full_attention"]
        dims = convert.Dims.from_config(cfg, family)
        expected = convert.model_tensors(dims, tie=False, mtp_layers=1)
        assert set(text.tensor_names()) == set(expected["text"])
        assert set(mtp.tensor_names()) == set(expected["mtp"])
        for name in ("layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.gate_proj.weight"):
            assert (name in text) == (("experts" in name) == (family != "dense"))


def test_norms_and_gdn_parameters_are_perturbed(tiny_dense_path):
    """Identity initialisation would hide `w` vs `1 + w` and A_log/dt_bias mistakes."""
    with open_artifact(tiny_dense_path) as art:
        text = art.component("text")
        zero_centred = text.f32("layers.3.self_attn.q_norm.weight")
        assert 0.05 < zero_centred.std() < 0.2 and abs(zero_centred.mean()) < 0.05
        gated = text.f32("layers.0.linear_attn.norm.weight")
        assert abs(gated.mean() - 1) < 0.1 and gated.std() > 0.05
        assert np.ptp(text.f32("layers.0.linear_attn.A_log")) > 0.1
        assert np.ptp(text.f32("layers.0.linear_attn.dt_bias")) > 0.1
        assert np.ptp(art.component("mtp").f32("pre_fc_norm_hidden.weight")) > 0.1


def test_same_seed_same_model_other_seed_other_model(tmp_path):
    a = make_tiny.make_tiny(tmp_path / "a.infernix", seed=5)
    b = make_tiny.make_tiny(tmp_path / "b.infernix", seed=5)
    c = make_tiny.make_tiny(tmp_path / "c.infernix", seed=6)
    with open_artifact(a) as x, open_artifact(b) as y, open_artifact(c) as z:
        name = "layers.1.linear_attn.in_proj_qkv.weight"
        first = x.component("text").raw(name)
        assert np.array_equal(first, y.component("text").raw(name))
        assert not np.array_equal(first, z.component("text").raw(name))
        assert x.component("text").resources == y.component("text").resources


def test_small_tokenizer_round_trips_and_keeps_specials_whole(tiny_dense_path):
    with open_artifact(tiny_dense_path) as art:
        text = art.component("text")
        tokenizer = Tokenizer.from_str(text.resources["tokenizer.json"].decode())
        generation = json.loads(text.resources["generation_config.json"])
        config = text.config
    assert tokenizer.get_vocab_size() <= 512
    for special in SPECIALS:
        ids = tokenizer.encode(special).ids
        assert len(ids) == 1 and tokenizer.id_to_token(ids[0]) == special
    for sample in MULTILINGUAL:
        ids = tokenizer.encode(sample).ids
        assert max(ids) < config["vocab_size"]
        # NFC normalisation is part of the tokenizer, as in the real one.
        assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize(
            "NFC", sample)
    im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert generation["eos_token_id"] == [im_end, eot] and config["eos_token_id"] == eot
    assert len(tokenizer.encode("the assistant answers the question").ids) < 12  # merges exist


def test_chat_template_is_embedded_when_maintained(tiny_dense_path, tiny_next_path):
    for path, family in ((tiny_dense_path, "dense"), (tiny_next_path, "next")):
        with open_artifact(path) as art:
            resources = art.component("text").resources
        template = make_tiny.chat_template(family)
        assert resources.get("chat_template.jinja") == template
        assert "tokenizer_config.json" in resources


def test_real_vocabulary_model(tiny_real_vocab_path, qwen_tokenizer_json, qwen_tokenizer,
                               qwen_reference):
    """The real Qwen3.5 tokenizer (tools/tokenizer_json.py) with tied embeddings. The embedded
    bytes are the builder's, so the session's tokenizer on those bytes (`qwen_tokenizer`, shared
    with test_tokenizer.py, which checks a much larger corpus) must match the qwen-tokenizer
    package on a multilingual corpus."""
    with open_artifact(tiny_real_vocab_path) as art:
        text = art.component("text")
        assert text.config["vocab_size"] == 248320 and text.config["tie_word_embeddings"]
        assert "lm_head.weight" not in text
        assert text.entry("embed_tokens.weight").shape == (248320, 256)
        assert text.config["eos_token_id"] == 248044 and text.config["image_token_id"] == 248056
        tokenizer_json = text.resources["tokenizer.json"]
        generation = json.loads(text.resources["generation_config.json"])
    assert tokenizer_json == qwen_tokenizer_json
    assert generation["eos_token_id"] == [248046, 248044]
    for sample in MULTILINGUAL:
        ids = qwen_tokenizer.encode(sample)
        assert ids == qwen_reference.encode(sample), sample
        assert qwen_tokenizer.decode(ids) == qwen_reference.decode(ids)


def test_cli_writes_hf_dir_and_artifact(tmp_path, capsys):
    out = tmp_path / "m.infernix"
    assert make_tiny.main([str(out), "--next", "--seed", "3", "--hf-dir",
                           str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    with open_artifact(out) as art:
        assert art.metadata["name"] == "tiny-next-small-seed3"
    with pytest.raises(SystemExit):
        make_tiny.main([str(out), "--moe", "--next"])
