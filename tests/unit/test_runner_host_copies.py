"""The runner's host copies (prefix cache host/file tiers, pauses): a slot's state and KV pages
read to the host and written back elsewhere continue the sequence bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.random_weights import random_weights, tiny_config_dict
from runtime.model.runner import DecodeItem, HostReady, PrefillChunk

PROMPT = np.random.default_rng(3).integers(0, 512, 100).tolist()


@pytest.fixture(scope="module")
def runner():
    config = ModelConfig.from_dict(tiny_config_dict("dense"))
    return NumpyRunner(config, random_weights(config, seed=5), num_pages=8, num_slots=3)


def test_a_state_and_pages_moved_through_the_host_continue_exactly(runner):
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(0, PROMPT, 0, [0, 1]))
    expected = runner.decode([DecodeItem(0, 17, 100, [0, 1])])
    # Again, then move the state and both pages to the host and back into slot 2, pages 5-6.
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(0, PROMPT, 0, [0, 1]))
    state, pages = runner.save_slot(0), runner.read_pages([0, 1])
    assert state.ready() and pages.ready()                     # host copies, complete at once
    assert state.nbytes == sum(a.nbytes for a in state.wait()) == runner.slot_nbytes
    assert pages.nbytes == sum(a.nbytes for a in pages.wait()) == 2 * runner.page_nbytes
    runner.reset_slot(0)                                       # the originals are gone
    runner.key_pages[:, [0, 1]] = np.nan
    runner.load_slot(2, state)
    runner.write_pages([5, 6], pages)
    moved = runner.decode([DecodeItem(2, 17, 100, [5, 6])])
    assert np.array_equal(moved, expected)


def test_bad_host_copies_are_refused(runner):
    state = runner.save_slot(0).wait()
    with pytest.raises(ValueError, match="state shapes"):
        runner.load_slot(1, HostReady((state[0][:1], state[1])))
    with pytest.raises(ValueError, match="does not fit"):
        runner.write_pages([1, 2], runner.read_pages([0]))
    with pytest.raises(ValueError, match="page ids"):
        runner.read_pages([8])
