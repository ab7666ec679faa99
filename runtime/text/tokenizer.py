"""The tokenizer: an artifact's `tokenizer.json` (HF `tokenizers`), its special-token ids, and the
per-id byte table the incremental detokenizer and the output parser read.

Encoding either parses special-token text (`<|im_end|>` in a rendered template becomes id
248046) or treats it as plain text (user input that merely spells a special token). Decoding of
streamed output goes through `detokenizer.py`, which works on `token_bytes`.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import tokenizers

from runtime.text.piece_cache import PieceCache
from runtime.text.text_pieces import cut, cuttable

# GPT-2 byte-level alphabet, inverted: byte-level text -> the bytes it stands for.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]


def _unicode_to_byte() -> dict[str, int]:
    table = {chr(b): b for b in _PRINTABLE}
    extra = 0
    for b in range(256):
        if b not in _PRINTABLE:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(ValueError):
    """The artifact's tokenizer resources are missing or unusable."""


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the markers the text layer acts on; -1 where the vocabulary lacks the token."""

    endoftext: int
    im_start: int
    im_end: int
    think: int
    think_end: int
    tool_call: int
    tool_call_end: int
    tool_response: int
    tool_response_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


_SPECIAL_NAMES = {
    "endoftext": "<|endoftext|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
    "think": "<think>", "think_end": "</think>",
    "tool_call": "<tool_call>", "tool_call_end": "</tool_call>",
    "tool_response": "<tool_response>", "tool_response_end": "</tool_response>",
    "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>",
}


def _token_ids(value) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """An HF `tokenizers` tokenizer plus what streaming needs.

    vocab_size: number of ids the tokenizer knows (BPE ranks + added tokens); the model's
        embedding may be padded beyond it (ids past it decode to nothing).
    special: ids of the Qwen markers (`SpecialIds`).
    special_ids: every added token flagged special (never produced from plain text).
    eos_ids: ids that end generation: `<|im_end|>`, `<|endoftext|>`, plus any eos listed in the
        artifact's generation_config.json / tokenizer_config.json.
    token_bytes: id -> the bytes that id stands for (special tokens: their UTF-8 text).
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, extra_eos_ids: Iterable[int] = ()):
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = False
        # `encode_special_tokens` is a flag on the shared Rust object: every encode holds this
        # lock, and literal encodes flip the flag inside it.
        self._lock = threading.Lock()
        self._pieces = PieceCache()
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        added = hf_tokenizer.get_added_tokens_decoder()
        # Long texts are cut where their pieces encode to the same ids, and the pieces encoded
        # in parallel (`text_pieces`): only under the pre-tokenizers that allow it.
        normalizer = hf_tokenizer.normalizer
        self.cuts_long_texts = hf_tokenizer.pre_tokenizer is not None and cuttable(
            hf_tokenizer.pre_tokenizer.__getstate__(),
            normalizer.__getstate__() if normalizer is not None else None,
            [token.content for token in added.values()])
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self._id_of = vocab
        self.special = SpecialIds(**{field: vocab.get(text, -1)
                                     for field, text in _SPECIAL_NAMES.items()})
        eos = {self.special.im_end, self.special.endoftext, *extra_eos_ids}
        self.eos_ids = frozenset(i for i in eos if 0 <= i < self.vocab_size)
        self.token_bytes = self._byte_table(vocab, {i for i, t in added.items()})

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: bytes | str, *, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        try:
            hf = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"tokenizer.json could not be loaded: {exc}") from exc
        return cls(hf, extra_eos_ids=extra_eos_ids)

    @classmethod
    def from_artifact_resources(cls, resources: Mapping[str, bytes]) -> "Tokenizer":
        """From a text component's resources: `tokenizer.json` (required) and, when present,
        `generation_config.json` / `tokenizer_config.json` for extra end-of-sequence ids."""
        if "tokenizer.json" not in resources:
            raise TokenizerError("the artifact has no tokenizer.json resource "
                                 f"(resources: {sorted(resources)})")
        tokenizer = cls.from_json(resources["tokenizer.json"])
        extra = set()
        if "generation_config.json" in resources:
            config = _json_object(resources["generation_config.json"], "generation_config.json")
            extra.update(_token_ids(config.get("eos_token_id")))
        if "tokenizer_config.json" in resources:
            config = _json_object(resources["tokenizer_config.json"], "tokenizer_config.json")
            eos = config.get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and eos in tokenizer._id_of:
                extra.add(tokenizer._id_of[eos])
        if extra:
            tokenizer.eos_ids = frozenset(tokenizer.eos_ids | {
                i for i in extra if 0 <= i < tokenizer.vocab_size})
        return tokenizer

    # --- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS is ever added). With parse_special=False, text that spells
        a special token (`<|im_end|>`) is encoded as ordinary text."""
        return self.encode_many([text], parse_special=parse_special)[0]

    def encode_many(self, texts: Sequence[str], *,
                    parse_special: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call: the texts (and the pieces long ones are cut
        into, `text_pieces`) are encoded in parallel by the library's threads."""
        pieces, owners = [], []
        for index, text in enumerate(texts):
            for piece in (cut(text) if self.cuts_long_texts else (text,)):
                pieces.append(piece)
                owners.append(index)
        with self._lock:
            # Long pieces seen before (an agent's history, resent every turn) come from the cache:
            # each piece is encoded on its own, so its ids depend on its text alone.
            found = [self._pieces.get(piece, parse_special) for piece in pieces]
            missing = [piece for piece, hit in zip(pieces, found) if hit is None]
            if not missing:
                encodings = []
            elif parse_special:
                encodings = self._encode_releasing_the_gil(missing)
            else:
                self._hf.encode_special_tokens = True
                try:
                    encodings = self._encode_releasing_the_gil(missing)
                finally:
                    self._hf.encode_special_tokens = False
            fresh = iter(encodings)
            for i, hit in enumerate(found):
                if hit is None:
                    found[i] = next(fresh).ids
                    self._pieces.put(pieces[i], parse_special, found[i])
        ids: list[list[int]] = [[] for _ in texts]
        for owner, piece_ids in zip(owners, found):
            ids[owner].extend(piece_ids)
        return ids

    def _encode_releasing_the_gil(self, texts: list[str]) -> list:
        # `encode_batch_fast` lets go of the GIL while it works, `encode` does not: a long
        # prompt tokenized on a server worker thread would otherwise stall the event loop for
        # seconds. Each input gives the same ids as `encode`; "fast" skips the character
        # offsets we never read (with the batching in `encode_many`, a 105K-token prompt took
        # 56 ms instead of 155 ms on 2 cores: docs/performance.md, Host side).
        return self._hf.encode_batch_fast(texts, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of `ids` (invalid UTF-8 becomes U+FFFD); for whole sequences. Streams use
        `detokenizer.Detokenizer`."""
        table = self.token_bytes
        special = self.special_ids
        data = b"".join(table[i] for i in ids
                        if 0 <= i < len(table) and not (skip_special and i in special))
        return data.decode("utf-8", errors="replace")

    def id_of(self, token: str) -> int | None:
        """The id of a token given by its vocabulary text (e.g. "<think>"), or None."""
        return self._id_of.get(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # --- internals ---------------------------------------------------------------------------

    def _byte_table(self, vocab: Mapping[str, int], added_ids: set[int]) -> list[bytes]:
        table = [b""] * self.vocab_size
        decoder = self._hf.decoder
        decoder = json.loads(decoder.__getstate__()) if decoder is not None else {}
        byte_level = _has_byte_level(decoder)
        to_byte = _unicode_to_byte()
        to_latin1 = str.maketrans({text: chr(b) for text, b in to_byte.items()})
        for text, i in vocab.items():
            if i in added_ids:
                table[i] = text.encode("utf-8")
            elif byte_level:
                try:
                    table[i] = text.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:  # not a byte-level token after all
                    table[i] = text.encode("utf-8")
            else:
                match = _BYTE_FALLBACK.fullmatch(text)
                if match:
                    table[i] = bytes([int(match.group(1), 16)])
                else:  # SentencePiece-style: "▁" marks a space
                    table[i] = text.replace("\u2581", " ").encode("utf-8")
        return table


def _has_byte_level(decoder: dict) -> bool:
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(d) for d in decoder.get("decoders", []) if isinstance(d, dict))


def _json_object(data: bytes, name: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise TokenizerError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{name} must hold a JSON object")
    return value
