"""Output constraints (JSON object, JSON Schema, GBNF, regex, literal choice, Lark) with llguidance.

Flow: the caller (CLI, server) builds a `ConstraintSpec` from its flags or request fields; a
per-model `ConstraintCompiler` turns it into a `RequestConstraint` (grammar compilation is cached
for identical specs); the engine asks the constraint for the allowed-token mask before sampling
each answer token and commits every output token afterwards. Why llguidance, and its measured
costs: ../shared/research/protocols.md section 3; the supported subset: docs/constraints.md.

Thinking: the constraint starts after `</think>`. Inside the think block the mask is None
(unconstrained). Right after `</think>` the separator token `\\n\\n`, which the template writes
and the output parser drops, is allowed once in addition to the grammar's first tokens.

EOS ids (`<|im_end|>` ...) are allowed exactly when the answer is complete; once the grammar
cannot continue they are the only allowed ids. They are never fed to llguidance: committing one
only marks the constraint finished, which keeps rollback exact.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import llguidance
import numpy as np

from runtime.text.constraints_gbnf import GbnfError, gbnf_to_lark

KINDS = ("json_object", "json_schema", "grammar", "regex", "choice", "lark")

# Compact JSON (no whitespace, "," and ":" separators). Applied as overrides, so a schema's own
# "x-guidance" section cannot loosen it. Property order: llguidance emits declared properties in
# schema order (additional ones, where allowed, after them).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


_LINE_SLICE = r"[^\n]+"


class ConstraintError(ValueError):
    """An invalid constraint (bad schema, grammar, regex, choice list) or a token the constraint
    does not allow. The message names the problem; CLI exit 2 / HTTP 400 for the former."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What the answer must match. Frozen and hashable: identical specs share one compilation.

    kind:    "json_object" | "json_schema" | "grammar" (GBNF, entry rule `root`) | "regex" (the
             whole answer; '' allows only empty content) | "choice" (exact texts; '' allowed) |
             "lark" (llguidance Lark; used by the tool-call builders).
    payload: json_object: ""; json_schema: the schema as compact JSON text in declared key
             order; grammar / regex / lark: the source text; choice: tuple of candidate texts.
    strict:  json_schema only. True: a keyword llguidance cannot enforce (uniqueItems, not,
             if/then, ...) is an error. False: it is ignored and reported in `warnings`.
    Build specs with the classmethods; they validate and normalise the payload.
    """

    kind: str
    payload: Union[str, tuple[str, ...]] = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "choice":
            if not isinstance(self.payload, tuple) or not self.payload:
                raise ConstraintError("choice needs at least one candidate text")
            if not all(isinstance(text, str) for text in self.payload):
                raise ConstraintError("choice candidates must be strings")
        elif not isinstance(self.payload, str):
            raise ConstraintError(f"{self.kind} payload must be a string")

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: Union[Mapping[str, Any], str, bool], *,
                    strict: bool = True) -> "ConstraintSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"invalid JSON schema: not valid JSON ({exc})") from None
        if schema is True:
            schema = {}
        if schema is False:
            raise ConstraintError("invalid JSON schema: `false` allows no value at all")
        if not isinstance(schema, Mapping):
            raise ConstraintError(
                f"invalid JSON schema: expected an object, got {type(schema).__name__}")
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", text, strict)

    @classmethod
    def grammar(cls, gbnf: str) -> "ConstraintSpec":
        return cls("grammar", gbnf)

    @classmethod
    def regex(cls, pattern: str) -> "ConstraintSpec":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, texts: Iterable[str]) -> "ConstraintSpec":
        return cls("choice", tuple(texts))

    @classmethod
    def lark(cls, grammar: str) -> "ConstraintSpec":
        return cls("lark", grammar)

    def describe(self) -> str:
        """Short human description for logs and error messages."""
        if self.kind == "choice":
            return f"choice of {len(self.payload)} texts"
        size = len(self.payload)
        return self.kind if size == 0 else f"{self.kind} ({size} chars)"


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text` (every non-alphanumeric character as a \\x{..} escape)."""
    return "".join(c if c.isascii() and c.isalnum() else "\\x{%x}" % ord(c) for c in text)


def json_schema_for_lark(schema: Mapping[str, Any], *, strict: bool) -> str:
    """The schema with our JSON options, as text for llguidance's inline `%json { ... }`."""
    options = dict(schema.get("x-guidance") or {}) if isinstance(schema, Mapping) else {}
    options.update(_JSON_OPTIONS)
    options["lenient"] = not strict
    return json.dumps({**schema, "x-guidance": options}, separators=(",", ":"),
                      ensure_ascii=False)


def llguidance_grammar(spec: ConstraintSpec, special_token_id=None) -> str:
    """The llguidance grammar definition for a spec. Raises ConstraintError for GBNF syntax
    errors; other problems (bad regex, unsupported schema) surface when the grammar is built."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=dict(_JSON_OPTIONS))
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.payload, overrides={**_JSON_OPTIONS, "lenient": not spec.strict})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.payload)
    if spec.kind == "choice":
        alternatives = "|".join(_regex_literal(text) for text in spec.payload)
        return llguidance.LLMatcher.grammar_from_regex(f"(?:{alternatives})")
    if spec.kind == "grammar":
        try:
            lark = gbnf_to_lark(spec.payload, special_token_id)
        except GbnfError as exc:
            raise ConstraintError(f"invalid grammar: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(spec.payload)


def _error_text(spec: ConstraintSpec, detail: str) -> str:
    what = {"json_object": "JSON object constraint", "json_schema": "invalid JSON schema",
            "grammar": "invalid grammar", "regex": "invalid regex", "choice": "invalid choice",
            "lark": "invalid Lark grammar"}[spec.kind]
    # llguidance errors span lines (the Lark source with a caret under the spot); keep the
    # message lines. Positions refer to the Lark we generated, so drop them unless the user
    # wrote the Lark.
    kept = []
    for line in detail.strip().splitlines():
        line = line.strip()
        if not line or set(line) <= {"^", " "} or re.match(r"\d+ \|", line):
            continue
        kept.append(line)
    detail = " ".join(kept)
    if spec.kind != "lark":
        detail = re.sub(r"^at \d+\(\d+\): ", "", detail)
        detail = re.sub(r'^invalid regex ".*?" \(in regex\): ', "", detail)
    if spec.kind == "json_schema" and "Unimplemented keys" in detail:
        detail += " (not enforceable; a non-strict schema ignores them with a warning)"
    return f"{what}: {detail}"


def check_spec(spec: ConstraintSpec) -> list[str]:
    """Validate a spec without a tokenizer (fast, for argument checking before a model loads).
    Returns warnings; raises ConstraintError naming the problem. Special-token names in Lark or
    GBNF are only checked at compile time, against the real tokenizer."""
    grammar = llguidance_grammar(spec, special_token_id=lambda name: 0)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(_error_text(spec, messages[0]))
    return list(messages)


@dataclass(frozen=True)
class _Vocab:
    """Vocabulary facts shared by all constraints of one compiler."""

    vocab_size: int          # padded logits width
    tokenizer_size: int      # ids >= this are padding rows and never allowed
    eos_ids: frozenset[int]
    separator_id: Optional[int]  # the single "\n\n" token after </think>, if the vocab has one

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def clear_padding(self, bitmask: np.ndarray) -> None:
        """Zero the bits of padded ids in a uint32/int32 bitmask row."""
        word, bit = divmod(self.tokenizer_size, 32)
        if word < bitmask.shape[-1]:
            bitmask.view(np.uint32)[..., word] &= np.uint32((1 << bit) - 1)
            bitmask[..., word + 1:] = 0


class RequestConstraint:
    """One request's constraint state; implements runtime.engine.api.OutputConstraint.

    Single-threaded: the engine thread owns it. Commit every output token in order (sampled or
    inserted, thinking included); roll back any suffix (speculative decoding).
    """

    _THINK, _THINK_END, _SEPARATOR, _GRAMMAR, _EOS = range(5)

    def __init__(self, spec: ConstraintSpec, matcher: "llguidance.LLMatcher", vocab: _Vocab,
                 tokenizer: "llguidance.LLTokenizer", *, starts_in_thinking: bool,
                 think_end_id: int, thinking_bitmask: Optional[np.ndarray],
                 warnings: tuple[str, ...]):
        self.spec = spec
        self.warnings = warnings  # ignored schema keywords (non-strict schemas)
        self._matcher = matcher
        self._vocab = vocab
        self._tokenizer = tokenizer
        self._think_end_id = think_end_id
        self._thinking_bitmask = thinking_bitmask
        self._in_thinking_at_start = starts_in_thinking
        self._history: list[int] = []        # one _THINK.._EOS entry per committed token
        self._think_end_index: Optional[int] = None
        self._bitmask: Optional[np.ndarray] = None  # cached answer mask for the current state

    # -- state --

    @property
    def in_thinking(self) -> bool:
        return self._in_thinking_at_start and self._think_end_index is None

    @property
    def num_committed(self) -> int:
        return len(self._history)

    def _separator_allowed(self) -> bool:
        return (self._vocab.separator_id is not None and self._think_end_index is not None
                and len(self._history) == self._think_end_index + 1)

    def is_accepting(self) -> bool:
        """The answer so far is complete and valid: an EOS id is allowed now (or was committed).
        An output cut here by max tokens is still reported as `length`."""
        if self._history and self._history[-1] == self._EOS:
            return True
        return not self.in_thinking and self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """An EOS id was committed, or the grammar is complete and only EOS ids are allowed
        (the engine may then end the request with reason `stop` without sampling)."""
        if self._history and self._history[-1] == self._EOS:
            return True
        if self.in_thinking:
            return False
        if self._matcher.is_stopped():
            return True
        # llguidance flags "stopped" only after a token; at the start (e.g. regex '') the mask
        # tells: accepting with nothing but EOS ids allowed.
        if not self._matcher.is_accepting():
            return False
        bitmask = self.allowed_bitmask_u32().copy()
        for token_id in self._vocab.eos_ids:
            bitmask[token_id // 32] &= np.uint32(~(1 << (token_id % 32)) & 0xFFFFFFFF)
        return not bitmask.any()

    # -- masks --

    def allowed_bitmask_u32(self, vocab_size: Optional[int] = None) -> Optional[np.ndarray]:
        """Packed mask [ceil(vocab_size / 32)] uint32, bit (id % 32) of word (id // 32) set for
        an allowed id; None while unconstrained in the think block. Read-only, cached until the
        next commit/rollback."""
        if vocab_size is not None and vocab_size != self._vocab.vocab_size:
            raise ValueError(f"mask width {vocab_size} != compiled vocab size "
                             f"{self._vocab.vocab_size}")
        if self.in_thinking:
            return self._thinking_bitmask
        if self._bitmask is None:
            bitmask = np.empty(self._vocab.words, dtype=np.uint32)
            self.fill_bitmask(bitmask)
            bitmask.flags.writeable = False
            self._bitmask = bitmask
        return self._bitmask

    def fill_bitmask(self, out: np.ndarray) -> bool:
        """Write the packed mask into `out` (a contiguous uint32/int32 row, e.g. a pinned
        upload buffer). Returns False (out untouched) while unconstrained in the think block."""
        if self.in_thinking:
            if self._thinking_bitmask is None:
                return False
            out[...] = self._thinking_bitmask.view(out.dtype)
            return True
        if out.shape != (self._vocab.words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row must be contiguous with {self._vocab.words} words")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._finish_row(out)
        return True

    def _finish_row(self, row: np.ndarray) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"constraint failed: {self._matcher.get_error().strip()}")
        self._vocab.clear_padding(row)
        if self._separator_allowed():
            word, bit = divmod(self._vocab.separator_id, 32)
            row.view(np.uint32)[word] |= np.uint32(1 << bit)

    def allowed_mask(self, vocab_size: int) -> Optional[np.ndarray]:
        """Bool [vocab_size] of allowed ids; None while unconstrained in the think block."""
        bitmask = self.allowed_bitmask_u32(vocab_size)
        if bitmask is None:
            return None
        bits = np.unpackbits(bitmask.view(np.uint8), count=vocab_size, bitorder="little")
        return bits.view(np.bool_)

    # -- commit / rollback --

    def _describe_token(self, token_id: int) -> str:
        if 0 <= token_id < self._vocab.tokenizer_size:
            return f"{token_id} {self._tokenizer.dbg_tokens([token_id])}"
        return f"{token_id} (padding id)"

    def commit(self, token_id: int) -> None:
        """Advance by one output token. Raises ConstraintError (state unchanged) for a token the
        constraint does not allow."""
        token_id = int(token_id)
        if self._history and self._history[-1] == self._EOS:
            raise ConstraintError("token committed after the constrained answer ended")
        if self.in_thinking:
            if self._thinking_bitmask is not None:
                word, bit = divmod(token_id, 32)
                if not (0 <= token_id < self._vocab.vocab_size
                        and (int(self._thinking_bitmask[word]) >> bit) & 1):
                    raise ConstraintError(
                        f"token {self._describe_token(token_id)} is not allowed while thinking")
            if token_id == self._think_end_id:
                self._think_end_index = len(self._history)
                self._history.append(self._THINK_END)
            else:
                self._history.append(self._THINK)
            return
        if token_id in self._vocab.eos_ids:
            if not self._matcher.is_accepting():
                raise ConstraintError(
                    f"end of answer (token {token_id}) before the constraint is complete")
            kind = self._EOS
        elif token_id == self._vocab.separator_id and self._separator_allowed():
            kind = self._SEPARATOR
        else:
            if not 0 <= token_id < self._vocab.tokenizer_size \
                    or self._matcher.validate_tokens([token_id]) != 1:
                raise ConstraintError(f"token {self._describe_token(token_id)} is not allowed "
                                      f"by the {self.spec.describe()} constraint here")
            if not self._matcher.consume_token(token_id):
                raise ConstraintError(f"constraint failed: {self._matcher.get_error().strip()}")
            kind = self._GRAMMAR
        self._history.append(kind)
        self._bitmask = None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` commits (any phase, EOS included)."""
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        if num_tokens == 0:
            return
        removed = self._history[len(self._history) - num_tokens:]
        del self._history[len(self._history) - num_tokens:]
        grammar_tokens = removed.count(self._GRAMMAR)
        if grammar_tokens and not self._matcher.rollback(grammar_tokens):
            raise ConstraintError(f"rollback failed: {self._matcher.get_error().strip()}")
        if self._think_end_index is not None and self._think_end_index >= len(self._history):
            self._think_end_index = None
        self._bitmask = None

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading ids of a draft the grammar accepts from the current answer state
        (speculative decoding); thinking, separator and EOS handling are not applied here."""
        return self._matcher.validate_tokens([int(t) for t in token_ids])

    def matcher_for_batch(self) -> "llguidance.LLMatcher":
        """The llguidance matcher, for ConstraintCompiler.fill_bitmasks."""
        return self._matcher


class ConstraintCompiler:
    """Compiles specs against one model's tokenizer; one per loaded model, thread-safe.

    tokenizer_json: the HF tokenizer.json bytes (byte-level BPE vocabulary + special tokens).
    vocab_size:     padded logits width (config.json vocab_size), >= the tokenizer's size.
    eos_ids:        ids that end the answer (`<|im_end|>`, `<|endoftext|>`).
    cache_size:     specs whose translation and validation are kept (LRU); every request still
                    builds its own matcher (1-7 ms, measured in bench/constraints.py).
    Building the tokenizer index takes a few seconds; do it once per model.
    """

    def __init__(self, tokenizer_json: bytes, *, vocab_size: int, eos_ids: Iterable[int],
                 cache_size: int = 128, mask_threads: Optional[int] = None):
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) \
            else tokenizer_json
        eos = sorted({int(i) for i in eos_ids})
        if not eos:
            raise ValueError("eos_ids must name at least one token")
        # Built over the padded width so that one mask row covers every logit (the batched fill
        # needs rows of exactly the matcher's mask size). Slices are token classes llguidance
        # allows wholesale when a lexer state admits all of them; to its JSON-string defaults
        # we add "one line of text", which raw tool-call values use (bench/constraints.py).
        self._tokenizer = llguidance.LLTokenizer(
            text, n_vocab=vocab_size, eos_token=eos,
            slices=llguidance.LLTokenizer.general_slices() + [_LINE_SLICE])
        if self._tokenizer.vocab_size != vocab_size:
            raise ValueError(f"vocab_size {vocab_size} < tokenizer size "
                             f"{self._tokenizer.vocab_size}")
        tokenizer_size = self._real_size(vocab_size)
        separator = self._tokenizer.tokenize_str("\n\n")
        self.vocab = _Vocab(vocab_size, tokenizer_size, frozenset(eos),
                            separator[0] if len(separator) == 1 else None)
        self._cache: OrderedDict[ConstraintSpec, tuple[str, tuple[str, ...]]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._thinking_masks: dict[frozenset[int], np.ndarray] = {}
        self._executor = llguidance.LLExecutor(mask_threads)

    def _real_size(self, vocab_size: int) -> int:
        """The tokenizer's own size. llguidance names the padding ids it adds `<[ID]>` (special,
        no text); scanning down from the top finds the last real id without parsing the JSON
        again (seconds for a 250k vocabulary)."""
        size = vocab_size
        while size > 0 and self._tokenizer.is_special_token(size - 1) \
                and self._tokenizer.decode_bytes([size - 1]) == f"<[{size - 1}]>".encode():
            size -= 1
        return size

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        return self._tokenizer

    def special_token_id(self, text: str) -> Optional[int]:
        """The id of the special token spelled `text` (e.g. "<tool_call>"), or None."""
        ids = self._tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self._tokenizer.is_special_token(ids[0]) \
                and ids[0] < self.vocab.tokenizer_size:
            return ids[0]
        return None

    def _compiled(self, spec: ConstraintSpec) -> tuple[str, tuple[str, ...],
                                                       Optional["llguidance.LLMatcher"]]:
        """(llguidance grammar, warnings, a fresh matcher or None). The grammar is validated
        the first time a spec is seen; later calls only look it up."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit[0], hit[1], None
        grammar = llguidance_grammar(spec, self.special_token_id)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # Catches grammars that allow nothing at all (the error shows on the first mask).
            # llguidance words that error as a dump of its parser state; say what it means.
            scratch = np.empty(self.vocab.words, dtype=np.uint32)
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            if matcher.is_error():
                raise ConstraintError(_error_text(spec, "it matches no text"))
        if matcher.is_error():
            raise ConstraintError(_error_text(spec, matcher.get_error()))
        warnings = tuple(matcher.get_grammar_warnings())
        with self._lock:
            self._cache[spec] = (grammar, warnings)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar, warnings, matcher

    def _thinking_mask(self, banned: frozenset[int]) -> Optional[np.ndarray]:
        if not banned:
            return None
        with self._lock:
            mask = self._thinking_masks.get(banned)
            if mask is None:
                mask = np.full(self.vocab.words, 0xFFFFFFFF, dtype=np.uint32)
                self.vocab.clear_padding(mask)
                for token_id in banned:
                    word, bit = divmod(token_id, 32)
                    mask[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)
                mask.flags.writeable = False
                self._thinking_masks[banned] = mask
        return mask

    def compile(self, spec: ConstraintSpec, *, starts_in_thinking: bool = False,
                think_end_id: int = -1,
                thinking_banned_ids: Iterable[int] = ()) -> RequestConstraint:
        """A fresh RequestConstraint for one request. Raises ConstraintError naming the problem.

        starts_in_thinking / think_end_id: the prompt ended inside an open think block; the
        constraint starts after `think_end_id` is committed.
        thinking_banned_ids: ids to forbid inside the think block (e.g. `<tool_call>`, which the
        output parser would take as the end of reasoning). Empty: the mask is None there.
        """
        if starts_in_thinking and think_end_id < 0:
            raise ValueError("starts_in_thinking needs think_end_id")
        grammar, warnings, matcher = self._compiled(spec)
        if matcher is None:
            # A new matcher per request, not a deep copy of a cached one: copies share
            # llguidance's lexer state behind a lock, which serialised batched mask fills
            # (16 requests: 3-6x slower, bench/constraints.py). Building one releases the GIL.
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ConstraintError(_error_text(spec, matcher.get_error()))
        return RequestConstraint(
            spec, matcher, self.vocab, self._tokenizer,
            starts_in_thinking=starts_in_thinking, think_end_id=think_end_id,
            thinking_bitmask=self._thinking_mask(frozenset(int(i) for i in thinking_banned_ids))
            if starts_in_thinking else None,
            warnings=warnings)

    def fill_bitmasks(self, rows: Sequence[tuple[RequestConstraint, int]],
                      out: np.ndarray) -> list[bool]:
        """Fill packed masks for several requests at once into out[row] ([batch, words] uint32
        or int32, C-contiguous), on llguidance's thread pool with the GIL released so the fill
        can overlap the device step. Returns, per entry, whether its row was written (False:
        unconstrained in the think block; leave that row all-ones or skip masking).

        A constraint whose grammar failed (llguidance error state) does not stop the others:
        every row is filled, then ConstraintError is raised with `failed_rows` (indices into
        `rows`) so the caller ends only those requests."""
        if out.ndim != 2 or out.shape[1] != self.vocab.words or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask buffer must be C-contiguous [batch, {self.vocab.words}]")
        written = []
        batch = []
        for index, (constraint, row) in enumerate(rows):
            if constraint.in_thinking:
                written.append(constraint.fill_bitmask(out[row]))
            else:
                batch.append((index, constraint, row))
                written.append(True)
        if not batch:
            return written
        self._executor.unsafe_compute_mask_ptr(
            [(constraint.matcher_for_batch(), row) for _, constraint, row in batch],
            out.ctypes.data, self.vocab.words * 4, out.shape[0])
        words = out.view(np.uint32)
        row_ids = np.array([row for _, _, row in batch])
        word, bit = divmod(self.vocab.tokenizer_size, 32)
        if word < words.shape[1]:
            words[row_ids, word] &= np.uint32((1 << bit) - 1)
            words[row_ids, word + 1:] = 0
        failed = []
        for index, constraint, row in batch:
            if constraint.matcher_for_batch().is_error():
                failed.append(index)
            elif constraint._separator_allowed():
                sep_word, sep_bit = divmod(self.vocab.separator_id, 32)
                words[row, sep_word] |= np.uint32(1 << sep_bit)
        if failed:
            error = ConstraintError(f"constraint failed for {len(failed)} request(s): " + "; ".join(
                rows[i][0].matcher_for_batch().get_error().strip().splitlines()[0]
                for i in failed))
            error.failed_rows = failed
            raise error
        return written
