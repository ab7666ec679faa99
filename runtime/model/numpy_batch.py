"""The NumPy runner's batch layout: where each sequence of a call reads and writes state.

`BatchLayout` turns a prefill chunk (one sequence, T new tokens) or a list of decode items
(B sequences, one token each) into a `Batch`: the state slots, the token positions, the flat
KV rows each new token writes and each query reads (through the sequence's page table, the
paging contract in `runner.py`), the causal mask and the RoPE (or, for rows with media, MRoPE)
angles. Every index is checked here, so a bad call is refused before the forward pass touches
any state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.model import mrope
from runtime.model import reference_layers as ref
from runtime.model.config import ModelConfig
from runtime.model.runner import PAGE_SIZE, DecodeItem, Media, checked_page_table


@dataclass(frozen=True)
class Batch:
    """Where B sequences of T new tokens each read and write state (T = 1 for decode)."""

    slots: np.ndarray        # [B] state slots
    positions: np.ndarray    # [B, T] token positions
    write_rows: np.ndarray   # [B, T] flat KV row (page * PAGE_SIZE + offset) of each new token
    read_rows: np.ndarray    # [B, S] flat KV rows of positions 0..S-1 (padding rows are masked)
    visible: np.ndarray      # [B, T, S] causal mask
    cos: np.ndarray          # [B, T, rotary_dim/2]
    sin: np.ndarray
    media: tuple[Media, ...] = ()   # [B] each row's sequence media (empty tuples: text only)


def check_slot(slot: int, num_slots: int) -> None:
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) \
            or not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot!r} out of range (num_slots = {num_slots})")


def check_start_pos(start_pos: int) -> None:
    if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)) \
            or start_pos < 0:
        raise ValueError(f"start_pos must be a non-negative integer, got {start_pos!r}")


class BatchLayout:
    """Batches for one runner's storage.

    num_pages / num_slots: the runner's KV pages and state slots (the checked ranges).
    dtype: the runner's compute dtype (of the RoPE tables).
    spatial_merge_size: the vision tower's merge size, for MRoPE positions of rows with media;
        None without a tower (rows with media are then refused).
    """

    def __init__(self, config: ModelConfig, *, num_pages: int, num_slots: int, dtype: Any,
                 spatial_merge_size: int | None):
        self.config = config
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.dtype = dtype
        self.spatial_merge_size = spatial_merge_size

    def prefill(self, slot: int | None, steps: int, start_pos: int, page_table: Sequence[int],
                media: Media = ()) -> Batch:
        """One sequence's `steps` tokens from start_pos; slot None: no state slot is read or
        written (the MTP head, which has attention layers only)."""
        check_start_pos(start_pos)
        end = int(start_pos) + steps
        pages = checked_page_table(page_table, end, self.num_pages)
        key_positions = np.arange(end)
        positions = start_pos + np.arange(steps)
        rows = pages[key_positions // PAGE_SIZE] * PAGE_SIZE + key_positions % PAGE_SIZE
        return self._batch(np.array([0 if slot is None else slot]), positions[None],
                           rows[None], rows[None, start_pos:],
                           key_positions[None, None, :] <= positions[None, :, None], (media,))

    def decode(self, items: Sequence[DecodeItem], check_slots: bool = True) -> Batch:
        """One token per item; check_slots False for the MTP head (its items name no state
        slot of their own, so they need be neither in range nor distinct)."""
        if len(items) == 0:
            raise ValueError("decode needs at least one item")
        slots = np.array([item.slot for item in items], dtype=np.int64)
        if check_slots:
            for slot in slots:
                check_slot(int(slot), self.num_slots)
            if len(set(slots.tolist())) != len(slots):
                raise ValueError(f"decode items must use distinct slots, got {slots.tolist()}")
        positions = []
        for item in items:
            if isinstance(item.pos, bool) or not isinstance(item.pos, (int, np.integer)) \
                    or item.pos < 0:
                raise ValueError(f"decode position must be a non-negative integer, "
                                 f"got {item.pos!r}")
            positions.append(int(item.pos))
        positions = np.array(positions, dtype=np.int64)
        length = int(positions.max()) + 1
        key_positions = np.arange(length)
        rows = np.zeros((len(items), length), dtype=np.int64)
        for b, item in enumerate(items):
            pages = checked_page_table(item.page_table, positions[b] + 1, self.num_pages)
            visible_positions = key_positions[:positions[b] + 1]
            rows[b, :positions[b] + 1] = (pages[visible_positions // PAGE_SIZE] * PAGE_SIZE
                                          + visible_positions % PAGE_SIZE)
        write_rows = rows[np.arange(len(items)), positions][:, None]
        visible = (key_positions[None, :] <= positions[:, None])[:, None, :]
        return self._batch(slots, positions[:, None], rows, write_rows, visible,
                           tuple(item.media for item in items))

    def _batch(self, slots, positions, read_rows, write_rows, visible,
               media: tuple[Media, ...] = ()) -> Batch:
        c = self.config
        if any(media):
            if self.spatial_merge_size is None:
                raise ValueError("media given but this runner has no vision tower (--vision)")
            positions3 = np.stack([mrope.mrope_positions(positions[b], media[b],
                                                         self.spatial_merge_size)
                                   for b in range(len(positions))], axis=1)      # [3, B, T]
            cos, sin = mrope.mrope_cos_sin(positions3, c.rotary_dim, c.rope_theta,
                                           c.mrope_section, self.dtype)
        else:
            cos, sin = ref.rope_cos_sin(positions, c.rotary_dim, c.rope_theta, self.dtype)
        return Batch(slots=slots, positions=positions, write_rows=write_rows,
                     read_rows=read_rows, visible=visible, cos=cos, sin=sin, media=media)
