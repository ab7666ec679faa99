"""The NumPy runner's MTP drafting: the kept hidden states and the protocol's `mtp_draft`.

The protocol's rule (`MtpRow` in `runner.py`): a runner with an MTP head keeps, per slot, the
final-normed hidden states of the slot's latest prefill, decode or step row, and `mtp_draft`
drafts from them. `MtpDrafter` holds those states and runs the drafting loop over the runner's
MTP head calls (`NumpyRunner.mtp_prefill` and `mtp_decode`, which stay on the runner: they are
its forward pass, with its tensor-parallel reduce point).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from runtime.model.runner import MTP_MAX_DRAFTS, DecodeItem, MtpRow, checked_page_table, checked_tokens

if TYPE_CHECKING:       # numpy_runner imports this module; the annotation only names its record
    from runtime.model.numpy_runner import StepOutput

MtpPrefill = Callable[[np.ndarray, Sequence[int], int, Sequence[int]], "StepOutput"]
"""(hidden [T, H], token_ids [T], start_pos, page_table) -> StepOutput of the MTP head."""
MtpDecode = Callable[[Sequence[DecodeItem], np.ndarray], "StepOutput"]
"""(items [B], hidden [B, H]) -> StepOutput of one chained MTP head step."""


class MtpDrafter:
    """Kept hidden states plus the drafting loop of one runner with an MTP head.

    head_prefill / head_decode: the runner's MTP head over a row's catch-up positions, and one
        chained step on the head's own output. vocab_size / num_pages: the checked ranges.
    draft_vocab: drafts are the argmax over ids 0 .. draft_vocab - 1 (`mtp_draft_vocab`).
    """

    def __init__(self, head_prefill: MtpPrefill, head_decode: MtpDecode, *, vocab_size: int,
                 num_pages: int, draft_vocab: int):
        self._head_prefill = head_prefill
        self._head_decode = head_decode
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.draft_vocab = draft_vocab
        # slot -> (first position, final-normed hidden states [n, H]) of its latest row.
        self._kept_hidden: dict[int, tuple[int, np.ndarray]] = {}

    def keep(self, slot: int, start_pos: int, hidden: np.ndarray) -> None:
        self._kept_hidden[int(slot)] = (int(start_pos), hidden)

    def draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        """Per row, the head over the catch-up positions, then chained on its own output for
        drafts 2..k (greedy). Rows are checked (slots kept, positions, draft counts) before any
        KV row is written."""
        kept = []
        for row in rows:
            tokens = checked_tokens(row.token_ids, self.vocab_size)
            if int(row.slot) not in self._kept_hidden:
                raise ValueError(f"slot {row.slot} has no kept hidden states to draft from")
            start, hidden = self._kept_hidden[int(row.slot)]
            if start != row.start_pos or len(tokens) > len(hidden):
                raise ValueError(f"MTP row at {row.start_pos} with {len(tokens)} tokens does not "
                                 f"match slot {row.slot}'s kept positions {start}.."
                                 f"{start + len(hidden) - 1}")
            if not 0 <= row.num_drafts <= MTP_MAX_DRAFTS:
                raise ValueError(f"num_drafts must be in 0..{MTP_MAX_DRAFTS}, got {row.num_drafts}")
            checked_page_table(row.page_table, start + len(tokens) + max(row.num_drafts - 1, 0),
                               self.num_pages)
            kept.append(hidden[:len(tokens)])
        drafts = []
        for row, hidden in zip(rows, kept):
            out = self._head_prefill(hidden, row.token_ids, int(row.start_pos), row.page_table)
            row_drafts: list[int] = []
            position = int(row.start_pos) + len(row.token_ids)
            logits, mtp_hidden = out.logits[-1:], out.hidden[-1:]
            while len(row_drafts) < row.num_drafts:
                if row_drafts:
                    step = self._head_decode([DecodeItem(row.slot, row_drafts[-1], position,
                                                         row.page_table)], mtp_hidden)
                    logits, mtp_hidden = step.logits, step.hidden
                    position += 1
                row_drafts.append(int(np.argmax(logits[0, :self.draft_vocab])))
            drafts.append(row_drafts)
        return drafts
