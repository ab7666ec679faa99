"""The per-model constraint compiler: ConstraintSpec -> RequestConstraint, with the tokenizer
index, the compilation cache and batched mask fills (constraints.py describes the flow)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

import llguidance
import numpy as np

from runtime.text.constraints import (ConstraintError, ConstraintSpec, error_text,
                                      llguidance_grammar)
from runtime.text.constraints_request import RequestConstraint, Vocab

_LINE_SLICE = r"[^\n]+"


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
        self.vocab = Vocab(vocab_size, tokenizer_size, frozenset(eos),
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
                raise ConstraintError(error_text(spec, "it matches no text"))
        if matcher.is_error():
            raise ConstraintError(error_text(spec, matcher.get_error()))
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
                raise ConstraintError(error_text(spec, matcher.get_error()))
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
