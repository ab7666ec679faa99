"""The `ModelRunner` protocol: the one interface between the engine and a model backend.

The engine (pure Python) owns *bookkeeping*: which lane (state slot) a request uses, which KV
pages it holds (its page table), how many tokens are computed. A runner owns *storage*: the
KV page pool arrays, the recurrent-state slots, the weights. Both the NumPy reference runner and
the CUDA runner implement this protocol with the same paging contract, so the engine cannot tell
them apart.

Paging contract: full-attention K/V of token position `p` of a sequence live in page
`page_table[p // PAGE_SIZE]`, row `p % PAGE_SIZE`. The page table passed with a chunk must cover
every position up to the end of that chunk. Pages are shared by all full-attention layers (each
layer has its own K and V arrays indexed by the same page id). A page may appear in several
sequences' tables (a shared prefix, `runtime.engine.kv_blocks`): a runner only ever writes the
rows of the positions a step computes, and the engine never asks it to compute a position that
lies in a page with more than one user.

Step contract (`ModelRunner.step`): a step is a list of `StepRow`s, each one sequence with `n`
new tokens at consecutive positions: a prefill chunk (n = chunk), a decode row (n = 1) or a
verification row (n = k + 1: the last committed token and k draft tokens). Each row says which
logits it wants (`Logits`) and where its recurrent state goes: updated in place in its slot, or,
for verification, the state after each of its positions written to the slots `snapshots[i]`
(the row's own slot is then only read). `commit(slot, snapshot)` makes one of those snapshots
the slot's state. Rows of one step are independent: each row's logits and states are those the
same row gives alone (`prefill` and `decode` are the one-row and all-decode special cases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Protocol, Sequence, Union

import numpy as np

from runtime.model.sampling import RowSampling

PAGE_SIZE = 64
"""Tokens per KV page, everywhere (engine, NumPy runner, CUDA runner, kernels)."""

HostArrays = tuple[np.ndarray, ...]
"""The host arrays of one slot's state or of some KV pages (`HostTransfer.wait`): their layout
is the runner's own; the engine only stores them (files, the disk tier) and gives them back."""


class HostTransfer(Protocol):
    """A host copy a runner started (`ModelRunner.save_slot`, `read_pages`), perhaps still in
    flight. The engine keeps it and gives it back (`load_slot`, `write_pages`) without waiting:
    the runner orders a load after the copy it reads. Only a reader of the bytes themselves
    (the file and disk tiers) calls `wait`.

    nbytes: the size of the host arrays.
    """

    nbytes: int

    def ready(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        ...

    def wait(self) -> HostArrays:
        """Block until the copy has completed; its host arrays (the caller does not write them)."""
        ...


@dataclass(frozen=True)
class HostReady:
    """A `HostTransfer` already complete: the NumPy runner's copies, and arrays read from a
    file (the file and disk tiers)."""

    arrays: HostArrays

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.arrays)

    def ready(self) -> bool:
        return True

    def wait(self) -> HostArrays:
        return self.arrays


@dataclass(frozen=True)
class MediaSpan:
    """One image of a sequence, placed in its prompt (`runtime.model.mrope`).

    offset: position of the block's first pad token; the block is the t*h*w / merge**2
        consecutive pad tokens the merged embeddings replace, in order.
    grid: (t, h, w) in patches before the merge (the vision tower's input grid).
    patches: float32 [t*h*w, patch_dim], the tower's input (`runtime.media.image`).
    digest: content hash of the pixels and grid; the runner caches encoder outputs under it.
    """

    offset: int
    grid: tuple[int, int, int]
    patches: np.ndarray = field(compare=False, repr=False)
    digest: str = ""


Media = tuple[MediaSpan, ...]
"""A sequence's media blocks, all of them, on each of its chunks and rows (empty: text only).
The runner takes the pad embeddings inside a row's positions from them and every position's
MRoPE angles (text after an image is rotated at its KV position plus a delta)."""


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
    media: the sequence's media blocks (`Media`).
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    all_logits: bool = False
    media: Media = ()


@dataclass(frozen=True)
class DecodeItem:
    """One sequence's next token in a batched decode step (position `pos`)."""

    slot: int
    token_id: int
    pos: int
    page_table: Sequence[int]
    media: Media = ()


Logits = Union[Literal["none", "last", "all"], tuple[int, ...]]
"""Which logits a row wants: none, its last position, all its positions, or the given offsets
(0-based within the row, strictly increasing)."""


@dataclass(frozen=True)
class StepRow:
    """One sequence's `len(token_ids)` new tokens at positions start_pos, start_pos + 1, ...

    slot: the state slot holding the sequence's recurrent state and conv window before the row.
    page_table: page ids covering positions 0 .. start_pos + len(token_ids) - 1.
    logits: which positions' logits the row returns (`Logits`).
    snapshots: None (the state after the row is written back to `slot`), or one slot per token:
        the state after the row's i-th token goes to `snapshots[i]` and `slot` is left as it
        was (verification; `ModelRunner.commit` then keeps one of them). The snapshot slots must
        be distinct, differ from `slot` and from every other row's slots.
    media: the sequence's media blocks (`Media`).
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    logits: Logits = "last"
    snapshots: Sequence[int] | None = None
    media: Media = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def logit_offsets(self) -> tuple[int, ...]:
        """The row offsets whose logits this row returns, in order."""
        n = len(self.token_ids)
        if self.logits == "none":
            return ()
        if self.logits == "last":
            return (n - 1,)
        if self.logits == "all":
            return tuple(range(n))
        offsets = tuple(int(i) for i in self.logits)
        increasing = all(a < b for a, b in zip(offsets, offsets[1:]))
        if not increasing or (offsets and not (0 <= offsets[0] and offsets[-1] < n)):
            raise ValueError(f"logit offsets must be strictly increasing in [0, {n}), got {offsets}")
        return offsets


MTP_MAX_DRAFTS = 5
"""Most drafts one `MtpRow` asks for (Qwen3.5/3.6 MTP heads: 1..5 drafts per round, seed 000)."""


def checked_draft_vocab(draft_vocab: int | None, vocab_size: int) -> int:
    """The MTP draft vocabulary of a runner (`ModelRunner.mtp_draft_vocab`): None means every id,
    else 1..vocab_size."""
    if draft_vocab is None:
        return vocab_size
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, (int, np.integer)) \
            or not 1 <= draft_vocab <= vocab_size:
        raise ValueError(f"the MTP draft vocabulary must be 1..{vocab_size} ids, got {draft_vocab!r}")
    return int(draft_vocab)


@dataclass(frozen=True)
class MtpRow:
    """One sequence's MTP work in a `ModelRunner.mtp_draft` call (qwen-arch 2.6).

    The MTP head at position i reads (h_i, x_{i+1}): the main model's final-normed hidden state
    at i and the token after it, and predicts x_{i+2}. Its attention layer has its own KV rows at
    the sequence's positions, in the same pages as the main layers (`page_table`).

    slot: the sequence's lane. The runner kept the hidden states of the positions this slot's
        latest computation produced (a prefill chunk, a decode row, or every position of a
        verification row); they must start at `start_pos`.
    token_ids: x_{start_pos+1} .. x_{start_pos+m}, the committed tokens after the first m kept
        positions (m >= 1): the head runs over positions start_pos .. start_pos+m-1, writing
        its KV rows there ("catch-up": the verified positions replace what drafting wrote).
    num_drafts: 0 (catch-up only), or k in 1..`MTP_MAX_DRAFTS`: the argmax of the last catch-up
        position's logits is draft 1 (for x_{start_pos+m+1}); drafts 2..k chain the head on its
        own output (its hidden after `mtp.norm` and the draft just made) at the following
        positions, which the page table must then cover (up to start_pos + m + k - 2). Every
        argmax is over the runner's draft vocabulary, ids 0 .. `mtp_draft_vocab` - 1.
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    num_drafts: int = 0


def checked_rows(rows: Sequence[StepRow], num_slots: int) -> None:
    """Refuse a step whose rows share a slot (a row's own or a snapshot), an empty step, or a
    snapshot list whose length is not the row's token count."""
    if not rows:
        raise ValueError("a step needs at least one row")
    used: set[int] = set()
    for row in rows:
        slots = [int(row.slot)]
        if row.snapshots is not None:
            if len(row.snapshots) != len(row.token_ids):
                raise ValueError(f"a verification row of {len(row.token_ids)} tokens needs as many "
                                 f"snapshot slots, got {len(row.snapshots)}")
            slots += [int(s) for s in row.snapshots]
        for s in slots:
            if not 0 <= s < num_slots:
                raise ValueError(f"slot {s} out of range (num_slots = {num_slots})")
            if s in used:
                raise ValueError(f"slot {s} is used twice in one step")
            used.add(s)
        row.logit_offsets()


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


def checked_pages(pages: Sequence[int], num_pages: int) -> np.ndarray:
    """Page ids as int64 for a host copy (`read_pages`, `write_pages`), refusing bad ids."""
    ids = np.asarray(pages, dtype=np.int64).reshape(-1)
    if np.any(ids < 0) or np.any(ids >= num_pages):
        raise ValueError(f"page ids must be in [0, {num_pages}), got {ids.tolist()}")
    return ids


class ModelRunner(Protocol):
    """What the engine needs from a model backend.

    vocab_size: width of returned logits (the padded vocabulary of the checkpoint).
    num_pages / num_slots: capacities fixed at construction (the engine sizes its pools from them).
    samples_on_device: the runner can sample rows itself (`prefill_sampled`, `decode_sampled`,
        `step_sampled`: only ids come back); False means the engine samples the logits on the host and must not
        call those two.
    device_bytes: device memory the runner reserved at construction (0 on the CPU backend).
    mtp_layers: MTP layers loaded (0: none; then `mtp_draft` must not be called). With MTP
        loaded, every `prefill`, `decode` and `step` keeps each row's final-normed hidden states
        per lane slot until the slot's next computation (`MtpRow`).
    mtp_draft_vocab: MTP drafts are the argmax over ids 0 .. mtp_draft_vocab - 1 only (the
        lm_head's first rows, `--mtp-draft-vocab`; vocab_size: all of them). Output is exact
        either way: the target verifies every draft.
    round_cost(drafts, mtp): what a speculative round of one row costs, in plain decode steps
        (`--draft-tokens auto` picks the draft length by it): verifying 1 + drafts tokens, plus
        chaining `drafts` MTP drafts when mtp.
    """

    vocab_size: int
    num_pages: int
    num_slots: int
    samples_on_device: bool
    slot_nbytes: int
    page_nbytes: int
    device_bytes: int
    mtp_layers: int
    mtp_draft_vocab: int

    def reset_slot(self, slot: int) -> None:
        """Zero the recurrent state and conv window of `slot` for a new sequence."""
        ...

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy recurrent state and conv window (snapshots for prefix reuse / preemption)."""
        ...

    # Host copies (the prefix cache's host and file tiers, preemption without recomputation),
    # as `HostTransfer`s. `slot_nbytes` / `page_nbytes` are their sizes for one slot and for
    # one page (every attention layer's K and V rows of it). A copy out returns at once: it
    # holds the state after every call made before it (queued compute included), and later
    # calls may change the source at once (the runner orders its own writes after the copy).
    # A copy in may read a transfer not complete yet; what it writes is there for every later
    # call. Neither makes the host wait for the device, except where pinned memory runs out
    # (`reserve_host_copies`).

    def reserve_host_copies(self, nbytes: int) -> int:
        """Set aside host memory for `nbytes` of copies that need no host wait (the CUDA runner
        pins it: `--host-context-mib`); the bytes it could set aside. Copies beyond it still
        work, waiting for the device. A later call keeps what the first set aside."""
        ...

    def host_buffer(self, nbytes: int) -> Optional[np.ndarray]:
        """A uint8 array of `nbytes` in the memory `reserve_host_copies` set aside, or None when
        none is free (or none was set aside): the file tier reads a cache file into it, so the
        copies in from it need no host wait either. It is free again once no array views it."""
        ...

    def save_slot(self, slot: int) -> HostTransfer:
        """A host copy of `slot`'s recurrent state and conv window."""
        ...

    def load_slot(self, slot: int, state: HostTransfer) -> None:
        """Make `slot`'s state the one `save_slot` copied (of any slot of this runner), or one
        `HostReady` holds (arrays that `wait` gave)."""
        ...

    def read_pages(self, pages: Sequence[int]) -> HostTransfer:
        """A host copy of the K/V rows of `pages` (every attention layer), in the given order.
        Axis 1 of each array is the page, so `arrays[:, i:j]` of every part is the copy of
        pages[i:j] (`write_pages` takes it; the file tier stores many pages as one array)."""
        ...

    def write_pages(self, pages: Sequence[int], data: HostTransfer) -> None:
        """Write K/V rows that `read_pages` copied into `pages` (same count, in order)."""
        ...

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        """Compute a chunk; float32 logits [len(token_ids), V] if all_logits else [1, V]."""
        ...

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        """One token for each item (distinct slots); float32 logits [len(items), V]."""
        ...

    def prefill_sampled(self, chunk: PrefillChunk,
                        sampling: Callable[[], Sequence[RowSampling]]) -> np.ndarray:
        """`prefill` of a chunk (not all_logits), then the token after its last position sampled
        on the device with the one row `sampling()` gives: int32 ids [1]. Needs
        `samples_on_device`."""
        ...

    def decode_sampled(self, items: Sequence[DecodeItem],
                       sampling: Callable[[], Sequence[RowSampling]],
                       lookahead: bool = False) -> np.ndarray:
        """`decode` of the items with each row's next token sampled on the device: int32 ids
        [len(items)] (`runtime.model.sampling.DEAD_END` where a row's mask allows nothing).
        `sampling()` gives one row per item; the runner calls it once the forward pass is
        queued. lookahead: the caller expects to decode the same sequences next, each with the
        id sampled here one position on; the runner may queue that step before returning and
        use it if the next call matches exactly (any other call drops it). Needs
        `samples_on_device`."""
        ...

    def step(self, rows: Sequence[StepRow]) -> list[np.ndarray]:
        """Compute every row (the step contract above); float32 logits [len(offsets), V] per
        row, in row order ([0, V] for a row that wants none). Checked whole before any state
        or KV row is touched."""
        ...

    def step_sampled(self, rows: Sequence[StepRow],
                     sampling: Callable[[], Sequence[Sequence[RowSampling]]]) -> list[np.ndarray]:
        """`step` of decode rows (one token, no snapshots) and verification rows, each wanting
        every position's logits, with every position's next token sampled on the device from
        the inputs `sampling()` gives (one `RowSampling` per position of each row; the runner
        calls it once the first forward pass is queued): int32 ids [num_tokens] per row, each
        the token the device sampler picks from the logits `step` would return for that
        position. Needs `samples_on_device`."""
        ...

    def commit(self, slot: int, snapshot: int) -> None:
        """Make the state in `snapshot` (written by a verification row) the state of `slot`.
        The snapshot slot's content is unspecified afterwards (a runner may swap storage)."""
        ...

    def round_cost(self, drafts: int, mtp: bool) -> float:
        ...

    def mtp_draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        """Run the MTP head for every row (`MtpRow`: catch-up, then chained drafts); returns each
        row's greedy drafts (argmax over the draft vocabulary, lowest id on ties), `num_drafts`
        ids ([] for none)."""
        ...


def speculative_round_cost(config: Any, drafts: int, mtp: bool, verified_token_cost: float,
                           draft_vocab: int | None = None) -> float:
    """`ModelRunner.round_cost` from a runner's cost of each verified token beyond the first (in
    decode steps) and, when mtp, the chained drafts. One MTP draft is counted by the weights a
    decode step reads: the MTP head is one transformer layer plus the vocabulary head's first
    `draft_vocab` rows (default all), against the main model's layers plus the whole head (a
    layer taken as ~12 hidden^2 weights: attention or GDN projections and the MLP)."""
    layer = 12 * config.hidden_size ** 2
    head = config.vocab_size * config.hidden_size
    draft_head = (draft_vocab or config.vocab_size) * config.hidden_size
    draft = (layer + draft_head) / (config.num_hidden_layers * layer + head)
    return 1 + drafts * verified_token_cost + (drafts * draft if mtp else 0.0)
