"""The step contract (`runtime.model.runner.StepRow`, `ModelRunner.step`, `commit`) on the NumPy
runner, the oracle every other runner is held to: verification rows equal separate decode steps
bit for bit (logits, per-position states, K/V), `commit` of any position then decoding equals
decoding from that position, mixed rows equal the same rows alone, and bad steps are refused
before anything is touched. float32, the CPU backend's dtype, so equality is exact, not close."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.random_weights import random_weights, tiny_config_dict
from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from test_model_runner import kv_rows

PROMPT = np.random.default_rng(11).integers(0, 512, 70).tolist()
DRAFT = np.random.default_rng(12).integers(0, 512, 8).tolist()
TABLE = [0, 1]          # 128 positions: prompt + drafts fit
OTHER_TABLE = [2, 3]


def make(family: str = "dense", num_slots: int = 12) -> NumpyRunner:
    config = ModelConfig.from_dict(tiny_config_dict(family))
    return NumpyRunner(config, random_weights(config, seed=5), num_pages=6, num_slots=num_slots,
                       dtype=np.float32)


def state(runner: NumpyRunner, slot: int) -> tuple[np.ndarray, np.ndarray]:
    return runner.recurrent_states[:, slot].copy(), runner.conv_states[:, slot].copy()


def prefilled(runner: NumpyRunner, slot: int = 0, table=TABLE) -> None:
    runner.reset_slot(slot)
    runner.prefill(PrefillChunk(slot, PROMPT, 0, table))


@pytest.mark.parametrize("family", ("dense", "next"))
@pytest.mark.parametrize("k", range(1, 8))
def test_verification_row_equals_separate_decode_steps(family, k):
    tokens = DRAFT[:k + 1]
    start = len(PROMPT)
    # The reference: k + 1 decode steps, states recorded after each.
    ref = make(family)
    prefilled(ref)
    ref_logits, ref_states = [], []
    for i, token in enumerate(tokens):
        ref_logits.append(ref.decode([DecodeItem(0, token, start + i, TABLE)])[0])
        ref_states.append(state(ref, 0))
    ref_kv = kv_rows(ref, TABLE, start + k + 1)

    run = make(family)
    prefilled(run)
    before = state(run, 0)
    snapshots = list(range(4, 4 + k + 1))
    [logits] = run.step([StepRow(0, tokens, start, TABLE, logits="all", snapshots=snapshots)])
    assert logits.dtype == np.float32 and logits.shape == (k + 1, 512)
    np.testing.assert_array_equal(logits, np.stack(ref_logits))
    for i, snap in enumerate(snapshots):
        for got, want in zip(state(run, snap), ref_states[i]):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(state(run, 0), before):      # the row's own slot is only read
        np.testing.assert_array_equal(got, want)
    for got, want in zip(kv_rows(run, TABLE, start + k + 1), ref_kv):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("accept", range(4))
def test_commit_then_decode_equals_decoding_from_that_position(accept):
    k = 3
    start = len(PROMPT)
    follow = 17
    # Plain: decode the first accept + 1 row tokens, then `follow`.
    plain = make("next")
    prefilled(plain)
    for i, token in enumerate(DRAFT[:accept + 1]):
        plain.decode([DecodeItem(0, token, start + i, TABLE)])
    want = plain.decode([DecodeItem(0, follow, start + accept + 1, TABLE)])

    spec = make("next")
    prefilled(spec)
    snapshots = [6, 7, 8, 9]
    spec.step([StepRow(0, DRAFT[:k + 1], start, TABLE, logits="all", snapshots=snapshots)])
    spec.commit(0, snapshots[accept])
    got = spec.decode([DecodeItem(0, follow, start + accept + 1, TABLE)])
    np.testing.assert_array_equal(got, want)
    for a, b in zip(state(spec, 0), state(plain, 0)):
        np.testing.assert_array_equal(a, b)


def test_mixed_rows_in_one_step_equal_the_same_rows_alone():
    start = len(PROMPT)
    chunk = np.random.default_rng(13).integers(0, 512, 40).tolist()

    def rows():
        return [StepRow(0, [DRAFT[0]], start, TABLE, logits="last"),
                StepRow(1, chunk, 0, OTHER_TABLE, logits=(0, 5, 39)),
                StepRow(2, DRAFT[:4], start, [4, 5], logits="all", snapshots=[8, 9, 10, 11])]

    def setup(runner):
        prefilled(runner, 0, TABLE)
        runner.reset_slot(1)
        prefilled(runner, 2, [4, 5])

    mixed = make()
    setup(mixed)
    together = mixed.step(rows())

    alone_runner = make()
    setup(alone_runner)
    alone = [alone_runner.step([row])[0] for row in rows()]
    assert [x.shape for x in together] == [(1, 512), (3, 512), (4, 512)]
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(a, b)
    for slot in (0, 1, 8, 9, 10, 11):
        for a, b in zip(state(mixed, slot), state(alone_runner, slot)):
            np.testing.assert_array_equal(a, b)
    # The prefill row's chosen offsets are rows of its all-position logits.
    check = make()
    check.reset_slot(1)
    full = check.prefill(PrefillChunk(1, chunk, 0, OTHER_TABLE, all_logits=True))
    np.testing.assert_array_equal(together[1], full[[0, 5, 39]])


def test_decode_rows_of_a_step_equal_one_decode_batch():
    start = len(PROMPT)
    a, b = make(), make()
    for runner in (a, b):
        prefilled(runner, 0, TABLE)
        prefilled(runner, 1, OTHER_TABLE)
    got = a.step([StepRow(0, [5], start, TABLE), StepRow(1, [9], start, OTHER_TABLE, logits="none")])
    want = b.decode([DecodeItem(0, 5, start, TABLE), DecodeItem(1, 9, start, OTHER_TABLE)])
    np.testing.assert_array_equal(got[0], want[:1])
    assert got[1].shape == (0, 512)
    for slot in (0, 1):
        for x, y in zip(state(a, slot), state(b, slot)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("rows, message", [
    ([], "at least one row"),
    ([StepRow(0, [1], 70, TABLE), StepRow(0, [2], 70, OTHER_TABLE)], "slot 0 is used twice"),
    ([StepRow(0, [1, 2], 70, TABLE, snapshots=[3])], "needs as many snapshot slots"),
    ([StepRow(0, [1, 2], 70, TABLE, snapshots=[3, 0])], "slot 0 is used twice"),
    ([StepRow(0, [1, 2], 70, TABLE, snapshots=[3, 12])], "slot 12 out of range"),
    ([StepRow(0, [1, 2, 3], 70, TABLE, logits=(2, 1))], "strictly increasing"),
    ([StepRow(0, [1, 2, 3], 70, TABLE, logits=(0, 3))], "strictly increasing"),
    ([StepRow(0, [1, 2], 127, TABLE)], "page table has 2 pages"),
    ([StepRow(0, [1, 512], 70, TABLE)], "token ids must be in"),
    ([StepRow(0, [1], -1, TABLE)], "start_pos must be"),
])
def test_bad_steps_are_refused_before_anything_is_touched(rows, message):
    runner = make()
    prefilled(runner)
    before = state(runner, 0), runner.key_pages.copy()
    # A valid row first: it must not run either when a later row is bad.
    valid = [StepRow(1, [4], 0, OTHER_TABLE)] if rows else []
    with pytest.raises(ValueError, match=message):
        runner.step(valid + rows)
    for a, b in zip(state(runner, 0), before[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runner.key_pages, before[1])
