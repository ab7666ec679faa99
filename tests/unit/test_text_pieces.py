"""Long texts cut into pieces encoded in parallel (`runtime.text.text_pieces`): where the cuts
fall, that the real Qwen tokenizers give the same ids cut or whole (pieces made tiny so every
text is cut at each of its cut points), and that other tokenizer shapes are never cut."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from runtime.text import text_pieces
from runtime.text.text_pieces import QWEN_SPLIT_PATTERNS, cut, cuttable
from runtime.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
# Texts with newlines before every kind of character: ASCII code and punctuation, spaces and
# tabs (never a cut), CRLF, digits, a quote that starts a contraction, combining marks, CJK,
# and special-token spellings right after a newline.
TEXTS = [
    (REPO / "runtime" / "engine" / "scheduler.py").read_text(),
    (REPO / "docs" / "prefix_cache.md").read_text(),
    "line one\r\nline two\r\n\r\n  indented\n\tTabbed\n'twas\n's\n123\n\u0301mark\n中文\nend",
    "a  \n  \nb\n\n\nc \n d\n<|im_end|>\n<think>\nx</think>\n{\"k\": 1}\n",
    "no newline at all, one long line " * 40,
]


def _random_texts(count: int) -> list[str]:
    rng = random.Random(7)
    alphabet = ["\n", "\n", " ", "  ", "\t", "\r\n", "a", "Z", "'s", "9", "{", "é", "e\u0301",
                "中", "😀", "\u00a0", "<|im_start|>", "word", ".", "\n\n"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(20, 300)))
            for _ in range(count)]


@pytest.fixture
def tiny_pieces(monkeypatch):
    """Pieces of 8 characters: every text above is cut wherever it may be."""
    monkeypatch.setattr(text_pieces, "PIECE_CHARS", 8)


def test_cuts_fall_after_a_newline_before_printable_ascii(tiny_pieces):
    text = "abcdefgh\n ijklmnop\nqrstuvwxyz\n\tabcdefghij\n{xyz}\nend"
    pieces = cut(text)
    assert "".join(pieces) == text
    assert pieces == ["abcdefgh\n ijklmnop\n", "qrstuvwxyz\n\tabcdefghij\n", "{xyz}\nend"]
    assert cut("short\nx") == ["short\nx"]           # under two pieces' length: whole


def test_the_patterns_are_the_ones_the_tokenizers_are_built_with():
    from tools.tokenizer_json import QWEN3_5_PATTERN, QWEN3_PATTERN

    assert QWEN_SPLIT_PATTERNS == {QWEN3_5_PATTERN, QWEN3_PATTERN}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_cut_texts_encode_to_the_whole_texts_ids(family, tiny_pieces, qwen_tokenizer):
    from tools.tokenizer_json import build_qwen_tokenizer_json

    tokenizer = qwen_tokenizer if family == "qwen3_5" else \
        Tokenizer.from_json(build_qwen_tokenizer_json(family))
    assert tokenizer.cuts_long_texts
    hf = tokenizer._hf
    texts = TEXTS + _random_texts(200)
    for parse_special in (True, False):
        hf.encode_special_tokens = not parse_special
        try:
            whole = [hf.encode(text, add_special_tokens=False).ids for text in texts]
        finally:
            hf.encode_special_tokens = False
        assert tokenizer.encode_many(texts, parse_special=parse_special) == whole
        for text, ids in zip(texts[:3], whole):
            assert len(cut(text)) >= 5          # cut many times
            assert tokenizer.encode(text, parse_special=parse_special) == ids


def _state(tokenizer: Tokenizer) -> tuple:
    hf = tokenizer._hf
    return (hf.pre_tokenizer.__getstate__(), hf.normalizer.__getstate__(),
            [token.content for token in hf.get_added_tokens_decoder().values()])


def test_other_tokenizer_shapes_are_never_cut(qwen_tokenizer):
    pre, normalizer, added = _state(qwen_tokenizer)
    assert cuttable(pre, normalizer, added) and cuttable(pre, None, added)
    other_pattern = json.loads(pre)
    other_pattern["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    assert not cuttable(json.dumps(other_pattern).encode(), normalizer, added)
    prefix_space = json.loads(pre)
    prefix_space["pretokenizers"][1]["add_prefix_space"] = True
    assert not cuttable(json.dumps(prefix_space).encode(), normalizer, added)
    assert not cuttable(pre, b'{"type":"NFKC"}', added)
    assert not cuttable(pre, normalizer, added + ["<line>\n</line>"])
    assert not cuttable(b'{"type":"Whitespace"}', None, [])


def test_a_word_level_tokenizer_is_encoded_whole():
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf = HfTokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    tokenizer = Tokenizer(hf)
    assert not tokenizer.cuts_long_texts
    assert tokenizer.encode("a b\nb a") == [0, 1, 1, 0]
