"""The host side of reading logits back (no GPU needed): bf16 bits to float32 in one pass
(`formats.bf16_to_f32`, also on the strided per-sequence views of a verification step), and a
verification row's wanted positions gathered from its sequence's block (a view when they are
consecutive rows of one block, else a copy in position order)."""

from __future__ import annotations

import numpy as np

from runtime.model.gpu.verify_rows import _in_order
from runtime.artifact.formats import bf16_to_f32


def test_every_bf16_pattern_converts_to_its_float32_bits():
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = bf16_to_f32(bits)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)
    assert got[0x3F80] == 1.0 and got[0xC000] == -2.0 and np.isinf(got[0x7F80])


def test_a_strided_position_major_block_splits_into_sequences():
    """Rows p * nseq + b of a verification step, read as sequence b's [positions, V]."""
    positions, nseq, vocab = 3, 4, 5
    values = np.arange(positions * nseq * vocab, dtype=np.float32).reshape(positions, nseq, vocab)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)    # exact: small integers are bf16
    for b in range(nseq):
        np.testing.assert_array_equal(bf16_to_f32(bits[:, b]), values[:, b])


def test_wanted_positions_are_a_view_when_consecutive_else_a_copy_in_order():
    block = np.arange(12, dtype=np.float32).reshape(4, 3)
    other = -np.arange(6, dtype=np.float32).reshape(2, 3)
    whole = _in_order({5: (block, 1), 6: (block, 2), 7: (block, 3)}, 3)
    np.testing.assert_array_equal(whole, block[1:4])
    assert np.shares_memory(whole, block)
    # Two windows (a row longer than one step): positions 0..1 from one block, 2 from another.
    split = _in_order({2: (other, 0), 0: (block, 2), 1: (block, 3)}, 3)
    np.testing.assert_array_equal(split, np.stack([block[2], block[3], other[0]]))
    gap = _in_order({0: (block, 0), 2: (block, 2)}, 3)             # not consecutive rows
    np.testing.assert_array_equal(gap, block[[0, 2]])
    assert _in_order({}, 3).shape == (0, 3)
