"""The `ModelRunner` protocol: the one interface between the engine and a model backend.

The engine (pure Python) owns *bookkeeping*: which lane (state slot) a request uses, which KV
pages it holds (its page table), how many tokens are computed. A runner owns *storage*: the
KV page pool arrays, the recurrent-state slots, the weights. Both the NumPy reference runner and
the CUDA runner implement this protocol with the same paging contract, so the engine cannot tell
them apart.

Paging contract: full-attention K/V of token position `p` of a sequence live in page
`page_table[p // PAGE_SIZE]`, row `p % PAGE_SIZE`. The page table passed with a chunk must cover
every position up to the end of that chunk. Pages are shared by all full-attention layers (each
layer has its own K and V arrays indexed by the same page id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

PAGE_SIZE = 64
"""Tokens per KV page, everywhere (engine, NumPy runner, CUDA runner, kernels)."""


@dataclass(frozen=True)
class PrefillChunk:
    """A run of prompt (or replayed) tokens of one sequence, computed in one call.

    slot: the state slot holding this sequence's recurrent state and conv window; the runner
        reads them as the initial state and writes the state after the chunk back.
    token_ids: the chunk's tokens, positions `start_pos .. start_pos + len(token_ids) - 1`.
    start_pos: number of tokens of this sequence already computed (0 for a fresh sequence;
        the slot must then have been `reset_slot`-ed).
    page_table: page ids covering positions 0 .. start_pos + len(token_ids) - 1.
    all_logits: return logits for every position of the chunk (True) or only the last (False).
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    all_logits: bool = False


@dataclass(frozen=True)
class DecodeItem:
    """One sequence's next token in a batched decode step (position `pos`)."""

    slot: int
    token_id: int
    pos: int
    page_table: Sequence[int]


def checked_tokens(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Token ids as int64, refusing an empty list and ids outside [0, vocab_size)."""
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if tokens.size == 0:
        raise ValueError("no tokens given")
    if np.any(tokens < 0) or np.any(tokens >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    return tokens


def checked_page_table(page_table: Sequence[int], end: int, num_pages: int) -> np.ndarray:
    """The pages covering positions 0..end-1 as int64, refusing short tables and bad ids."""
    pages = np.asarray(page_table, dtype=np.int64).reshape(-1)
    needed = -(-end // PAGE_SIZE)
    if len(pages) < needed:
        raise ValueError(f"page table has {len(pages)} pages; positions up to {end - 1} "
                         f"need {needed}")
    pages = pages[:needed]
    if np.any(pages < 0) or np.any(pages >= num_pages):
        raise ValueError(f"page ids must be in [0, {num_pages}), got {pages.tolist()}")
    return pages


class ModelRunner(Protocol):
    """What the engine needs from a model backend.

    vocab_size: width of returned logits (the padded vocabulary of the checkpoint).
    num_pages / num_slots: capacities fixed at construction (the engine sizes its pools from them).
    """

    vocab_size: int
    num_pages: int
    num_slots: int

    def reset_slot(self, slot: int) -> None:
        """Zero the recurrent state and conv window of `slot` for a new sequence."""
        ...

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy recurrent state and conv window (snapshots for prefix reuse / preemption)."""
        ...

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        """Compute a chunk; float32 logits [len(token_ids), V] if all_logits else [1, V]."""
        ...

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        """One token for each item (distinct slots); float32 logits [len(items), V]."""
        ...
