"""The per-request constraint state: allowed-token masks, commit and rollback.

Thinking: the constraint starts after `</think>`. Inside the think block the mask is None
(unconstrained). Right after `</think>` the separator token `\\n\\n`, which the template writes
and the output parser drops, is allowed once in addition to the grammar's first tokens.

EOS ids (`<|im_end|>` ...) are allowed exactly when the answer is complete; once the grammar
cannot continue they are the only allowed ids. They are never fed to llguidance: committing one
only marks the constraint finished, which keeps rollback exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import llguidance
import numpy as np

from runtime.text.constraints import ConstraintError, ConstraintSpec


@dataclass(frozen=True)
class Vocab:
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

    def __init__(self, spec: ConstraintSpec, matcher: "llguidance.LLMatcher", vocab: Vocab,
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
