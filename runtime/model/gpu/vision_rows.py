"""The CUDA runner's media (`--vision`): the merged image rows that replace a prefill piece's pads,
and the rotary positions of every row of a sequence with media (`runtime.model.mrope`).

The attention prep kernel rotates each row at `rope_pos[row]`, a row of the cos / sin tables
(`storage.Storage` with `media=True`): text rows at their KV position plus the sequence's shift
(`mrope_positions`: text after a media block resumes at the block's start plus its extent), and
the rows of a prefill piece whose (t, h, w) positions differ (a media block's pads) at table rows
past the positions, `rope_positions + row`, which hold that piece's own MRoPE angles. Without
media a row's rotary position is its KV position, as without a tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from runtime.artifact.formats import f32_to_bf16
from runtime.model.mrope import mrope_cos_sin, mrope_positions, span_layout
from runtime.model.vision_reference import MediaEmbedder


@dataclass
class PieceMedia:
    """What a prefill piece needs besides its tokens.

    shift: int32 [t], rotary row minus KV position of each row; tables: bf16 bits (cos, sin)
    [t, rotary_dim / 2] for table rows `rope_positions + row` (None: every row is text and its
    shift points into the position rows); embeddings: (first row, bf16 bits [n, H]) runs of merged
    media rows that replace the token embeddings."""

    shift: np.ndarray
    tables: tuple[np.ndarray, np.ndarray] | None
    embeddings: list[tuple[int, np.ndarray]]


class MediaRows:
    """A runner's tower (with the encoder cache of `MediaEmbedder`) and the text model's MRoPE."""

    def __init__(self, tower: Any, config: Any, rope_positions: int):
        if config.mrope_section is None:
            raise ValueError("a vision tower needs a text config with MRoPE (mrope_section)")
        self.tower = tower                       # the GPU tower (the runner closes it)
        self.embedder = MediaEmbedder(tower)
        self.config = config
        self.merge = tower.config.spatial_merge_size
        self.pads = (tower.config.image_token_id, tower.config.video_token_id)
        self.rope_positions = rope_positions

    def shift(self, pos: int, media: Sequence[Any]) -> int:
        """A decode row's rotary position minus its KV position (it is text: never inside a block)."""
        return int(mrope_positions(np.array([pos]), media, self.merge)[0, 0]) - pos if media else 0

    def piece(self, tokens: np.ndarray, start: int, media: Sequence[Any]) -> PieceMedia | None:
        """The piece of `tokens` at KV positions start.. of a sequence with `media`; None without."""
        if not media:
            return None
        c, t = self.config, len(tokens)
        positions = np.arange(start, start + t)
        rope = mrope_positions(positions, media, self.merge)
        tables = None
        if (rope[0] == rope[1]).all() and (rope[0] == rope[2]).all():
            shift = rope[0] - positions
        else:
            cos, sin = mrope_cos_sin(rope, c.rotary_dim, c.rope_theta, c.mrope_section, np.float32)
            tables = (f32_to_bf16(cos), f32_to_bf16(sin))
            shift = self.rope_positions + np.arange(t) - positions
        embeddings = []
        for span in media:
            count = span_layout(span, self.merge)[0]
            lo, hi = max(span.offset, start), min(span.offset + count, start + t)
            if lo >= hi:
                continue
            if not np.isin(tokens[lo - start:hi - start], self.pads).all():
                raise ValueError(f"the media block at {span.offset} covers tokens that are not image or "
                                 "video pads")
            rows = self.embedder.encode(span)[lo - span.offset:hi - span.offset]
            embeddings.append((lo - start, f32_to_bf16(np.asarray(rows, np.float32))))
        return PieceMedia(shift=shift.astype(np.int32), tables=tables, embeddings=embeddings)
