"""`CudaRunner`'s host side on the null device: layout, binding, validation, graphs per bucket.

Kernels do not run here (the null device records launches), so this checks what reaches the
driver, not values; `tests/gpu/test_cuda_runner.py` checks values on a GPU. Needs the built
kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, HostReady, PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from tools.make_tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny") / "tiny.infernix"
    make_tiny(path, family="dense", seed=0, vocab="small")
    device = NullDevice(total_memory=2 << 30)
    r = built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=16, num_slots=4, device=device,
                                                       prefill_chunk=64))
    yield r
    r.close()


def test_shapes_and_pieces(runner):
    out = runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 150)), start_pos=0, page_table=[0, 1, 2],
                                      all_logits=True))
    assert out.shape == (149, runner.vocab_size) and out.dtype == np.float32
    last = runner.prefill(PrefillChunk(slot=1, token_ids=[5, 6], start_pos=0, page_table=[3]))
    assert last.shape == (1, runner.vocab_size)


def test_decode_graph_per_bucket(runner):
    dev = runner.device
    items = [DecodeItem(slot=0, token_id=5, pos=149, page_table=[0, 1, 2]),
             DecodeItem(slot=1, token_id=7, pos=2, page_table=[3])]
    before = len(runner.steps.graphs)
    assert runner.decode(items).shape == (2, runner.vocab_size)
    assert runner.decode(items[:1]).shape == (1, runner.vocab_size)
    assert len(runner.steps.graphs) == before + 2  # buckets 2 and 1
    n = len(dev.launches)
    runner.decode(items)
    replayed = dev.launches[n:]
    assert replayed and all(launch.graph_replay for launch in replayed)


def test_rejects_bad_requests(runner):
    with pytest.raises(ValueError, match="slot"):
        runner.decode([DecodeItem(slot=9, token_id=1, pos=0, page_table=[0])])
    with pytest.raises(ValueError, match="distinct"):
        runner.decode([DecodeItem(slot=0, token_id=1, pos=0, page_table=[0])] * 2)
    with pytest.raises(ValueError, match="page table"):
        runner.prefill(PrefillChunk(slot=0, token_ids=[1] * 70, start_pos=0, page_table=[0]))
    with pytest.raises(ValueError, match="token ids"):
        runner.prefill(PrefillChunk(slot=0, token_ids=[runner.vocab_size], start_pos=0, page_table=[0]))
    with pytest.raises(ValueError, match="max_batch"):
        runner.decode([DecodeItem(slot=i % 4, token_id=1, pos=0, page_table=[0]) for i in range(9)])


def test_lookahead_step_is_used_when_asked_for_and_dropped_otherwise(runner):
    from runtime.model.sampling import RowSampling

    if not runner.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    dev = runner.device
    rows = lambda: [RowSampling(greedy=True)] * 2  # noqa: E731
    items = [DecodeItem(slot=2, token_id=5, pos=10, page_table=[5]),
             DecodeItem(slot=3, token_id=7, pos=20, page_table=[6])]
    ids = runner.decode_sampled(items, rows, lookahead=True)
    ahead = runner._ahead
    assert ahead is not None and ahead.positions == [11, 21] and ahead.tokens.tolist() == ids.tolist()
    # The step ahead reads the sequences' slots and writes two spares; its ids come from the
    # sampler's output on the device, not from the host.
    st, slots = runner.storage, runner.slots
    meta = np.empty(st.meta_count, np.int32)
    dev.memcpy_dtoh(meta, st.buf["meta"])
    off = st.meta_off
    assert meta[off["slots_in"]:off["slots_in"] + 2].tolist() == [slots.phys[2], slots.phys[3]]
    assert meta[off["slots"]:off["slots"] + 2].tolist() == ahead.spares
    assert meta[off["pos"]:off["pos"] + 2].tolist() == [11, 21]

    # Asked for exactly that step: no forward pass is launched again, the spares become the slots.
    n = len(dev.launches)
    nxt = [DecodeItem(slot=it.slot, token_id=int(t), pos=it.pos + 1, page_table=it.page_table)
           for it, t in zip(items, ids)]
    runner.decode_sampled(nxt, rows)
    names = {launch.function for launch in dev.launches[n:]}
    assert all("sampling" in name for name in names), names
    assert [slots.phys[2], slots.phys[3]] == ahead.spares
    assert sorted(slots.phys + slots.spares) == list(range(slots.phys_slots - 1))
    assert runner._ahead is None

    # A different next step (another token): the step ahead is dropped, the slots stay.
    runner.decode_sampled(nxt, rows, lookahead=True)
    phys = list(slots.phys)
    n = len(dev.launches)
    other = [DecodeItem(slot=it.slot, token_id=it.token_id + 1, pos=it.pos + 1, page_table=it.page_table)
             for it in nxt]
    runner.decode_sampled(other, rows)
    assert any("sampling" not in launch.function for launch in dev.launches[n:])  # the forward ran
    assert slots.phys == phys
    # A page boundary ahead (position 64 needs a page the table does not hold): nothing ahead.
    runner.decode_sampled([DecodeItem(slot=2, token_id=1, pos=63, page_table=[5])],
                          lambda: [RowSampling(greedy=True)], lookahead=True)
    assert runner._ahead is None


def test_prefill_sampled_samples_the_last_position_on_the_device(runner):
    from runtime.model.sampling import RowSampling

    if not runner.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    dev = runner.device
    n = len(dev.launches)
    chunk = PrefillChunk(slot=1, token_ids=list(range(1, 100)), start_pos=0, page_table=[7, 8])
    ids = runner.prefill_sampled(chunk, lambda: [RowSampling(greedy=True)])
    assert ids.shape == (1,) and ids.dtype == np.int32
    names = [launch.function for launch in dev.launches[n:]]
    assert any("sampling_candidates" in name for name in names) and "sampling_pick" in names[-1]
    with pytest.raises(ValueError, match="all_logits"):
        runner.prefill_sampled(PrefillChunk(slot=1, token_ids=[1], start_pos=0, page_table=[7], all_logits=True),
                               lambda: [RowSampling(greedy=True)])


def test_host_copies_of_slots_and_pages_round_trip(runner):
    """save_slot / load_slot and read_pages / write_pages (the prefix cache's host tier): the
    bytes that go out come back into another slot and other pages exactly, runs of consecutive
    pages included, and the sizes the runner reports are those of the copies."""
    st = runner.storage
    rng = np.random.default_rng(4)
    # Distinct bytes in slot 2's state and in pages 5, 6, 7 and 9 of every attention layer.
    phys = runner.slots.phys[2]
    for n, (state, window) in enumerate(zip(st.states, st.windows)):
        runner.device.memcpy_htod(state + phys * st.state_slot_bytes,
                                  rng.integers(0, 256, st.state_slot_bytes, dtype=np.uint8))
        runner.device.memcpy_htod(window + phys * st.win_slot_bytes,
                                  rng.integers(0, 256, st.win_slot_bytes, dtype=np.uint8))
    saved = runner.save_slot(2)
    assert saved.nbytes == sum(a.nbytes for a in saved.wait()) == runner.slot_nbytes
    runner.load_slot(3, saved)
    for n in range(len(st.states)):
        for a, b in zip(runner.read_state(n, 3), runner.read_state(n, 2)):
            np.testing.assert_array_equal(a, b)
    pages = [5, 6, 7, 9]
    data = tuple(rng.integers(0, 256, (len(st.k_pages), len(pages), st.page_bytes), dtype=np.uint8)
                 for _ in range(2))
    runner.write_pages(pages, HostReady(data))
    back = runner.read_pages(pages)
    assert back.nbytes == sum(a.nbytes for a in back.wait()) == len(pages) * runner.page_nbytes
    for a, b in zip(back.wait(), data):
        np.testing.assert_array_equal(a, b)
    # Moved to other pages in another order, the rows follow their pages.
    runner.write_pages([12, 11, 10, 13], back)
    again = runner.read_pages([10, 11, 12, 13])
    for a, b in zip(again.wait(), data):
        np.testing.assert_array_equal(a, b[:, [2, 1, 0, 3]])


@pytest.mark.parametrize("call, message", [
    (lambda r: r.read_pages([0, 16]), "page ids must be in"),
    (lambda r: r.write_pages([1], r.read_pages([1, 2])), "does not fit 1 pages"),
    (lambda r: r.load_slot(0, HostReady((np.zeros((1, 3), np.uint8), np.zeros((1, 3), np.uint8)))),
     "does not match"),
    (lambda r: r.save_slot(4), "out of range"),
])
def test_bad_host_copies_are_refused(runner, call, message):
    with pytest.raises(ValueError, match=message):
        call(runner)


def test_device_bytes_are_the_reserved_arenas(runner):
    arenas = runner.storage.arenas.arenas
    assert set(arenas) == {"weights", "kv_pages", "state_slots", "workspace"}
    assert runner.device_bytes == sum(a.capacity for a in arenas.values())
    assert runner.device_bytes > runner.layout.total  # the weights and more


def test_step_sampled_samples_every_verification_position_on_the_device(runner):
    import struct

    from runtime.model.runner import StepRow
    from runtime.model.sampling import RowSampling

    if not runner.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    dev = runner.device
    calls = []

    def sampling():
        calls.append(1)
        return [[RowSampling(greedy=True)] * 3]

    for slot in range(4):
        runner.reset_slot(slot)
    n = len(dev.launches)
    row = StepRow(0, (5, 6, 7), 0, [3], logits="all", snapshots=(1, 2, 3))
    (ids,) = runner.step_sampled([row], sampling)
    assert ids.shape == (3,) and ids.dtype == np.int32
    assert calls == [1]                                   # the inputs asked for once
    sampled = [rec for rec in dev.launches[n:] if "sampling" in rec.function]
    assert [rec.function.split("_kernel")[0] for rec in sampled] == ["infx_sampling_candidates", "infx_sampling_pick"]
    logits_ptr = struct.unpack("<Q", sampled[0].params[0])[0]
    rows = struct.unpack("<i", sampled[0].params[-2])[0]
    assert logits_ptr == runner.storage.buf["logits"] and rows == 3   # the 3 positions' rows
    runner.commit(0, 3)
    with pytest.raises(ValueError, match="prefill rows"):
        runner.step_sampled([StepRow(0, (5, 6), 3, [3], logits="all")], sampling)
    with pytest.raises(ValueError, match="one RowSampling per position"):
        runner.step_sampled([StepRow(0, (8,), 3, [3], logits="all")], lambda: [[]])
