"""`CudaRunner`'s MTP head on the null device: layout, upload, kept hidden rows, the draft's plan.

Kernels do not run here, but the null device's memory is real and its copies happen, so the
weights uploaded, the hidden rows kept per slot (written into `buf["h"]` by the test, where the
forward pass would leave them) and the rows the head reads are checked by value; the launches are
checked by what they bind (the MTP layer's own KV pool). `tests/gpu/test_mtp_cuda.py` checks the
drafts themselves against `NumpyRunner` on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, MtpRow, PrefillChunk, StepRow
from runtime.model.sampling import RowSampling

from null_cuda import built_or_skip

SHAPE = dict(num_pages=16, num_slots=8, prefill_chunk=64)


@pytest.fixture
def runner(tiny_dense_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_dense_path, device=NullDevice(total_memory=2 << 30),
                                                       mtp=True, **SHAPE))
    yield r
    r.close()


def _read(r, address: int, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, np.uint16)
    r.device.memcpy_dtoh(out, address)
    return out


def _fill_h(r, rows: int, seed: int) -> np.ndarray:
    """Distinct bf16 bit patterns in hidden rows 0..rows-1, where a step would leave its output."""
    data = np.random.default_rng(seed).integers(0, 1 << 15, (rows, r.config.hidden_size)).astype(np.uint16)
    r.device.memcpy_htod(r.storage.buf["h"], data)
    return data


def _kept(r, slot: int) -> tuple[int, np.ndarray]:
    start, count, address = r._mtp.kept.find(slot)
    return start, _read(r, address, (count, r.config.hidden_size))


def test_layout_places_and_uploads_the_mtp_head(tiny_dense_path, runner):
    from runtime.artifact import open_artifact

    c, lay, st = runner.config, runner.layout, runner.storage
    h = c.hidden_size
    assert runner.mtp_layers == 1 and len(lay.mtp_layers) == 1
    assert lay.mtp["fc"].shape == (h, 2 * h) and lay.mtp["fc"].parts == (("mtp.fc.weight", h),)
    assert {lay.mtp[n].kind for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")} == {"norm"}
    assert set(lay.mtp_layers[0]) == {"input_norm", "post_norm", "w_qkv", "o_proj", "q_norm", "k_norm",
                                      "w_gate_up", "down"}
    # Its own K and V pool after the main attention layers' pools.
    assert len(st.k_pages) == len(st.v_pages) == len(c.attention_layers) + 1
    with open_artifact(tiny_dense_path) as artifact:
        mtp = artifact.component("mtp")
        for slot, name in ((lay.mtp["fc"], "fc.weight"), (lay.mtp["norm"], "norm.weight"),
                           (lay.mtp_layers[0]["down"], "layers.0.mlp.down_proj.weight")):
            stored = np.asarray(mtp.raw(name)).view(np.uint16).reshape(slot.shape)
            assert np.array_equal(_read(runner, st.weights_base + slot.offset, slot.shape), stored), name


def test_without_mtp_nothing_is_placed_and_drafting_is_refused(tiny_dense_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_dense_path, device=NullDevice(total_memory=2 << 30),
                                                       **SHAPE))
    try:
        assert r.mtp_layers == 0 and not r.layout.mtp and len(r.storage.k_pages) == len(r.config.attention_layers)
        assert "mtp_kept" not in r.storage.buf
        with pytest.raises(ValueError, match="without an MTP head"):
            r.mtp_draft([MtpRow(0, [1], 0, [0], 1)])
    finally:
        r.close()


def test_plan_refuses_a_config_without_an_mtp_head(tiny_dense_path):
    from dataclasses import replace

    from runtime.artifact import open_artifact
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import WeightLayout

    with open_artifact(tiny_dense_path) as artifact:
        config = ModelConfig.from_dict(artifact.component("text").config)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers = 0"):
        WeightLayout.plan(replace(config, mtp_num_hidden_layers=0), mtp=True)


def test_synthetic_weights_fill_the_mtp_head(tiny_dense_path):
    from runtime.artifact import open_artifact
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    with open_artifact(tiny_dense_path) as artifact:
        config = ModelConfig.from_dict(artifact.component("text").config)
    r = built_or_skip(lambda: CudaRunner.synthetic(config, 5, device=NullDevice(total_memory=2 << 30), mtp=True,
                                                   **SHAPE))
    try:
        lay = r.layout
        fc = (_read(r, r.storage.weights_base + lay.mtp["fc"].offset, lay.mtp["fc"].shape).astype(np.uint32)
              << 16).view(np.float32)
        # Uniform weights of std 1/sqrt(fan_in = 2H): bound sqrt(3 / 2H), and not all zero.
        bound = np.sqrt(3.0 / (2 * config.hidden_size))
        assert np.abs(fc).max() <= bound * 1.01 and np.abs(fc).std() > bound / 4
        norm = (_read(r, r.storage.weights_base + lay.mtp["norm"].offset, (config.hidden_size,)).astype(np.uint32)
                << 16).view(np.float32)
        assert 0 < np.abs(norm).max() < 0.5  # zero-centred norm weights: small values around 0
    finally:
        r.close()


def test_prefill_pieces_and_verification_rows_keep_their_hidden_rows(runner):
    r = runner
    h = _fill_h(r, 64, seed=1)
    r.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 41)), start_pos=0, page_table=[0]))
    start, kept = _kept(r, 0)
    assert start == 0 and np.array_equal(kept, h[:40])
    # Two verification rows of 3 tokens: step rows are position-major (row p * 2 + b).
    h = _fill_h(r, 6, seed=2)
    r.prefill(PrefillChunk(slot=1, token_ids=[3, 4], start_pos=0, page_table=[1]))
    r.step([StepRow(0, [5, 6, 7], 40, [0], logits="all", snapshots=[2, 3, 4]),
            StepRow(1, [8, 9, 10], 2, [1], logits="all", snapshots=[5, 6, 7])])
    for slot, b, first in ((0, 0, 40), (1, 1, 2)):
        start, kept = _kept(r, slot)
        assert start == first and np.array_equal(kept, h[[b, 2 + b, 4 + b]])
    # `commit` swaps physical state slots; the kept rows belong to the engine slot and stay.
    r.commit(0, 3)
    assert _kept(r, 0)[0] == 40


def test_a_decode_step_computed_ahead_keeps_its_rows_once_used(runner):
    r = runner
    if not r.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    rows = lambda: [RowSampling(greedy=True)] * 2  # noqa: E731
    items = [DecodeItem(slot=2, token_id=5, pos=10, page_table=[5]),
             DecodeItem(slot=3, token_id=7, pos=20, page_table=[6])]
    h = _fill_h(r, 2, seed=3)
    ids = r.decode_sampled(items, rows, lookahead=True)
    start, kept = _kept(r, 2)
    assert start == 10 and np.array_equal(kept, h[:1])
    # What the step ahead left: stand-in rows, to tell them from the current step's.
    ahead_rows = np.arange(2 * r.config.hidden_size, dtype=np.uint16).reshape(2, -1)
    r.device.memcpy_htod(r.storage.buf["mtp_ahead"], ahead_rows)
    nxt = [DecodeItem(it.slot, int(t), it.pos + 1, it.page_table) for it, t in zip(items, ids)]
    r.decode_sampled(nxt, rows)
    assert r.lookahead_steps[True] == 1
    for b, (slot, pos) in enumerate(((2, 11), (3, 21))):
        start, kept = _kept(r, slot)
        assert start == pos and np.array_equal(kept, ahead_rows[b:b + 1])


def test_draft_reads_the_kept_rows_and_writes_the_mtp_kv_pool(runner):
    r = runner
    dev, st, hsize = r.device, r.storage, r.config.hidden_size
    h = _fill_h(r, 6, seed=4)
    r.prefill(PrefillChunk(slot=0, token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, page_table=[0]))
    r.prefill(PrefillChunk(slot=1, token_ids=[7, 8, 9], start_pos=0, page_table=[1]))
    # Every greedy pick returns 11 here (the sampler's output buffer, as kernels do not run).
    greedy = 11
    if r.samples_on_device:
        dev.memcpy_htod(st.buf["sample_ids"], np.full(st.max_batch, greedy, np.int32))
    n = len(dev.launches)
    drafts = r.mtp_draft([MtpRow(1, [8, 9], 0, [1], 1), MtpRow(0, [2, 3, 4, 5], 0, [0], 3)])
    if r.samples_on_device:
        assert drafts == [[greedy], [greedy] * 3]
    else:
        assert [len(d) for d in drafts] == [1, 3]
    # The catch-up step's rows: the last positions first, in draft-count order (slot 0 then 1),
    # then slot 0's other positions, then slot 1's.
    staged = _read(r, st.buf["mtp_in"], (6, hsize))
    assert np.array_equal(staged, h[[3, 1, 0, 1, 2, 0]])
    prep = [launch for launch in dev.launches[n:] if "attention_prep" in launch.function]
    mtp_pool = st.k_pages[-1].to_bytes(8, "little")
    assert prep and all(mtp_pool in b"".join(launch.params) for launch in prep)
    assert not any(st.k_pages[0].to_bytes(8, "little") in b"".join(launch.params) for launch in prep)
    # Drafts 2 and 3 of slot 0: two chained steps of one row, one graph on the device.
    assert set(r._mtp.chain.graphs) == {(1, 1)} and not r._mtp.graphs
    meta = np.empty(st.meta_count, np.int32)
    dev.memcpy_dtoh(meta, st.buf["meta"])
    off = st.meta_off
    assert meta[off["ids"]] == greedy  # the draft before, copied on the device
    # The last chained step reads the head's output at position start + m + 1 = 5.
    assert meta[off["pos"]] == 5 and meta[off["qseq"]:off["qseq"] + 1].tolist() == [0]


def test_the_chain_stages_every_step_and_feeds_each_draft_to_the_next(runner):
    """Three rows drafting 4, 2 and 1: chained step s holds the rows still drafting at their
    position + s (a prefix of the draft-count order), each step's ids are the draft the step
    before picked, copied on the device, all in one graph, read back once."""
    r = runner
    dev, st = r.device, r.storage
    for slot, (n, page) in enumerate(((6, 0), (9, 1), (3, 2))):
        r.prefill(PrefillChunk(slot=slot, token_ids=list(range(1, n + 1)), start_pos=0, page_table=[page]))
    dev.memcpy_htod(st.buf["sample_ids"], np.arange(20, 20 + st.max_batch, dtype=np.int32))
    rows = [MtpRow(1, [2, 3, 4, 5, 6, 7, 8, 9], 0, [1], 2), MtpRow(0, [2, 3, 4, 5, 6], 0, [0], 4),
            MtpRow(2, [2, 3], 0, [2], 1)]
    drafts = r.mtp_draft(rows)
    # Kernels do not run: every pick leaves `sample_ids` as it was (20, 21, 22, ...), so draft j of
    # the row in drafting place q is 20 + q.
    assert drafts == [[21, 21], [20] * 4, [22]]
    assert set(r._mtp.chain.graphs) == {(2, 1, 1)}
    staged = np.empty(3 * st.meta_count, np.int32)
    dev.memcpy_dtoh(staged, st.buf["mtp_meta"])
    off = st.meta_off

    def field(s: int, name: str, n: int) -> list[int]:
        return staged[s * st.meta_count + off[name]:][:n].tolist()

    # Step 0: slot 0 at 5 + 0 (page 0), slot 1 at 8 + 0 (page 1); steps 1, 2: slot 0 alone.
    assert field(0, "pos", 2) == [5, 8] and field(0, "wrow", 2) == [5, 64 + 8] and field(0, "qseq", 2) == [0, 1]
    assert field(1, "pos", 1) == [6] and field(1, "wrow", 1) == [6] and field(2, "pos", 1) == [7]
    for s in range(3):
        assert field(s, "ids", 2) == [0, 0]  # the ids come from the draft before, on the device
    table = staged[off["table"]:off["table"] + 2 * st.maxp].reshape(2, st.maxp)
    assert table[:, 0].tolist() == [0, 1]
    ids = np.empty((5, st.max_batch), np.int32)
    dev.memcpy_dtoh(ids, st.buf["mtp_drafts"])
    assert ids[:4, 0].tolist() == [20] * 4 and ids[:2, 1].tolist() == [21, 21] and ids[0, 2] == 22


def _draft_launches(r) -> list[str]:
    r.prefill(PrefillChunk(slot=0, token_ids=[1, 2, 3, 4], start_pos=0, page_table=[0]))
    n = len(r.device.launches)
    r.mtp_draft([MtpRow(0, [2, 3, 4, 5], 0, [0], 2)])
    return [launch.function for launch in r.device.launches[n:]]


def test_a_draft_vocabulary_binds_the_lm_head_rows_it_reads(tiny_dense_path, runner):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_dense_path, device=NullDevice(total_memory=2 << 30),
                                                       mtp=True, mtp_draft_vocab=256, **SHAPE))
    try:
        assert r.mtp_draft_vocab == 256 and r._mtp.head.shape == (256, r.config.hidden_size)
        assert r._mtp.head.offset == r.layout.globals.get("lm_head", r.layout.globals["embed"]).offset
        # The tiny head is 512 x 256; its first 256 rows take the 256 x 256 GEMM (o_proj's shape).
        full = _draft_launches(runner)
        draft = _draft_launches(r)
        heads = sum("n512_k256" in name for name in full)
        assert heads == 2 and not any("n512_k256" in name for name in draft)  # catch-up + one chained step
        assert sum("n256_k256" in name for name in draft) == sum("n256_k256" in name for name in full) + heads
        with pytest.raises(ValueError, match="draft vocabulary"):
            CudaRunner.from_artifact(tiny_dense_path, device=NullDevice(total_memory=2 << 30), mtp=True,
                                     mtp_draft_vocab=513, **SHAPE)
    finally:
        r.close()


@pytest.mark.parametrize("row, message", [
    (MtpRow(4, [1], 0, [0], 1), "no kept hidden states"),
    (MtpRow(0, [1, 2], 1, [0], 1), "does not match"),
    (MtpRow(0, list(range(1, 9)), 0, [0], 1), "does not match"),
    (MtpRow(0, [1], 0, [0], -1), "num_drafts"),
    (MtpRow(0, [1], 0, [0], 6), "num_drafts"),
    (MtpRow(0, [1] * 6, 0, [], 2), "page table"),
    (MtpRow(0, [-1], 0, [0], 1), "token ids"),
])
def test_bad_rows_are_refused_before_anything_runs(runner, row, message):
    r = runner
    r.prefill(PrefillChunk(slot=0, token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, page_table=[0]))
    n = len(r.device.launches)
    with pytest.raises(ValueError, match=message):
        r.mtp_draft([MtpRow(0, [2], 0, [0], 1), row])
    assert len(r.device.launches) == n


def test_catch_up_rows_pair_each_position_with_the_token_after_it(runner):
    r = runner
    st = r.storage
    r.prefill(PrefillChunk(slot=0, token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, page_table=[0]))
    r.prefill(PrefillChunk(slot=1, token_ids=[7, 8, 9], start_pos=0, page_table=[1]))
    # Token i of a row is x_{start + i + 1}, read at position start + i (`MtpRow`); one draft
    # each, so no chained step follows and the metadata is the catch-up step's.
    drafts = r.mtp_draft([MtpRow(1, [8, 9], 0, [1], 1), MtpRow(0, [2, 3, 4, 5], 0, [0], 1)])
    assert [len(d) for d in drafts] == [1, 1]
    meta = np.empty(st.meta_count, np.int32)
    r.device.memcpy_dtoh(meta, st.buf["meta"])

    def field(name: str) -> list[int]:
        return meta[st.meta_off[name]:st.meta_off[name] + 6].tolist()

    # Rows: each row's last position first (slot 1, then slot 0), then slot 1's, then slot 0's others.
    assert field("ids") == [9, 5, 8, 2, 3, 4]
    assert field("pos") == [1, 3, 0, 0, 1, 2]
    assert field("qseq") == [0, 1, 0, 1, 1, 1]
    assert field("wrow") == [64 + 1, 3, 64, 0, 1, 2]  # page 1 for slot 1, page 0 for slot 0
    table = meta[st.meta_off["table"]:].reshape(-1)[:2 * st.maxp].reshape(2, st.maxp)
    assert table[:, 0].tolist() == [1, 0]
    # Catch-up only (no drafts): the rows are written, nothing is drafted.
    assert r.mtp_draft([MtpRow(0, [2, 3], 0, [0], 0)]) == [[]]


def test_a_long_catch_up_runs_each_projection_once_over_all_rows(runner):
    r = runner
    r.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 41)), start_pos=0, page_table=[0]))
    n = len(r.device.launches)
    r.mtp_draft([MtpRow(0, list(range(2, 42)), 0, [0], 0)])
    # The tiny model's fc (256 x 512) and MLP down projection share a shape: one launch each over
    # the 40 rows (a GEMM), not five decode blocks of 8 rows each.
    launches = [launch.function for launch in r.device.launches[n:]]
    assert sum("n256_k512" in name for name in launches) == 2, launches
