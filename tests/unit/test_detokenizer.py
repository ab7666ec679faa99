"""Incremental detokenization: never half a UTF-8 sequence, always the same text as a whole
decode (real vocabulary; byte-level single-byte tokens; a SentencePiece-style byte-fallback
vocabulary)."""

from __future__ import annotations

import json
import random

from runtime.text.detokenizer import Detokenizer, DetokenizerOffsets, detokenize_incremental
from runtime.text.tokenizer import Tokenizer

TEXTS = [
    "日本語のテキストと中文字符，한국어도.",
    "Emoji 😀👍🏽👨‍👩‍👧‍👦🇯🇵 mixed with text",
    "مرحبا بالعالم ok",
    "plain ASCII with code: for i in range(3): print(i)\n",
]


def _stream(table, ids, *, final=True):
    offsets, pieces = DetokenizerOffsets(), []
    for end in range(1, len(ids) + 1):
        text, offsets = detokenize_incremental(table, ids[:end], offsets)
        pieces.append(text)
    text, offsets = detokenize_incremental(table, ids, offsets, final=final)
    pieces.append(text)
    return pieces, offsets


def test_cjk_and_emoji_never_split(qwen_tokenizer):
    table = qwen_tokenizer.token_bytes
    for text in TEXTS:
        ids = qwen_tokenizer.encode(text)
        pieces, offsets = _stream(table, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces)
        assert offsets == DetokenizerOffsets(len(ids), 0)


def test_single_byte_tokens(qwen_tokenizer):
    table = qwen_tokenizer.token_bytes
    byte_id = {table[i]: i for i in range(256)}  # the 256 byte tokens come first
    assert len(byte_id) == 256
    text = "é中😀"
    ids = [byte_id[bytes([b])] for b in text.encode("utf-8")]
    pieces, _ = _stream(table, ids)
    assert "".join(pieces) == text
    assert [p for p in pieces if p] == ["é", "中", "😀"]
    # The emoji's 4 bytes: nothing until the last one arrives.
    detok = Detokenizer(table)
    outs = [detok.push(i) for i in ids]
    assert outs == ["", "é", "", "", "中", "", "", "", "😀"]
    assert not detok.pending and detok.flush() == ""


def test_invalid_and_unfinished_bytes(qwen_tokenizer):
    table = qwen_tokenizer.token_bytes
    byte_id = {table[i]: i for i in range(256)}
    lone_continuation = [byte_id[b"\x80"], byte_id[b"a"]]
    pieces, _ = _stream(table, lone_continuation)
    assert pieces[0] == "\ufffd"  # never valid: replaced at once, not held
    cut = [byte_id[b"a"], byte_id[b"\xe4"], byte_id[b"\xb8"]]
    pieces, offsets = _stream(table, cut, final=False)
    assert "".join(pieces) == "a" and offsets == DetokenizerOffsets(1, 0)
    text, offsets = detokenize_incremental(table, cut, offsets, final=True)
    assert text == "\ufffd" and offsets == DetokenizerOffsets(3, 0)
    detok = Detokenizer(table)
    assert detok.push_many(cut) == "a" and detok.pending and detok.flush() == "\ufffd"


def test_random_sequences_match_whole_decode(qwen_tokenizer):
    table = qwen_tokenizer.token_bytes
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(len(table) + 10) for _ in range(rng.randint(1, 12))]
        ids += [rng.randrange(256) for _ in range(rng.randint(0, 6))]  # raw bytes too
        rng.shuffle(ids)
        pieces, _ = _stream(table, ids)
        whole = b"".join(table[i] for i in ids if i < len(table)).decode("utf-8", "replace")
        assert "".join(pieces) == whole
        detok = Detokenizer(table)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == whole


def test_offsets_skip_inside_a_token(qwen_tokenizer):
    table = qwen_tokenizer.token_bytes
    byte_id = {table[i]: i for i in range(256)}
    # Real tokens: " " + the first two bytes of a 4-byte emoji (F0 9F ...), then its last two.
    token = table.index(b" \xf0\x9f")
    ids = [token]
    text, offsets = detokenize_incremental(table, ids)
    assert text == " " and offsets == DetokenizerOffsets(0, 1)
    ids += [byte_id[b"\x98"]]
    text, offsets = detokenize_incremental(table, ids, offsets)
    assert text == "" and offsets == DetokenizerOffsets(0, 1)
    ids += [byte_id[b"\x80"]]
    text, offsets = detokenize_incremental(table, ids, offsets)
    assert text == "😀" and offsets == DetokenizerOffsets(3, 0)


def _byte_fallback_tokenizer() -> Tokenizer:
    """A tiny SentencePiece-style BPE with byte fallback: <0xNN> tokens and "▁" for spaces."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁hello", "▁world", "h", "e", "l", "o", "w", "r", "d", "▁"):
        vocab[piece] = len(vocab)
    data = {
        "version": "1.0", "added_tokens": [
            {"id": len(vocab), "content": "<|im_end|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": True,
                  "unk_token": "<unk>", "fuse_unk": True, "dropout": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None},
    }
    return Tokenizer.from_json(json.dumps(data).encode())


def test_byte_fallback_vocabulary():
    tk = _byte_fallback_tokenizer()
    assert tk.special.im_end == tk.vocab_size - 1 and tk.eos_ids == {tk.special.im_end}
    ids = tk.encode(" hello 中😀", parse_special=False)
    assert any(1 <= i <= 256 for i in ids)  # byte-fallback pieces were used
    pieces, _ = _stream(tk.token_bytes, ids)
    assert "".join(pieces) == " hello 中😀"
    assert not any("\ufffd" in p for p in pieces)
    assert [p for p in pieces if p][-2:] == ["中", "😀"]
