"""`runtime.model.gpu` on the null device: what reaches the driver for the step contract.

Kernels do not run here, so these tests check launches, copies and metadata, not values
(`tests/gpu/test_gpu_runner_step.py` checks values on a GPU):
- the launch sequence of the scenario in `gpu_trace` equals the one recorded from the runner
  before it became a package (`tests/data/gpu_runner_trace.json`): same kernels, grids and
  parameter bytes, same uploads, in the same order;
- a step of mixed rows sends exactly what the separate `decode` and `prefill` calls send;
- prefill rows compute only the logits they want, read back in blocks;
- verification rows: states read at the row's slot (the last snapshot of the window before, for
  a row longer than a step) and written to a snapshot per row, rows position-major; the GDN conv
  and recurrent step one `verify` launch each per layer with the step's buffers, every other
  kernel launched as often as in one decode step;
- `commit` swaps the slot mapping without copying;
- the lm_head of the Qwen3.6-27B shape has a kernel at every row count of a prefill chunk.
Needs the built kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from gpu_trace import FIXTURE, SCENARIO, trace, traced_runner, tiny_model
from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    path = tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.infernix")
    built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=4, num_slots=1,
                                                   device=NullDevice(total_memory=2 << 30))).close()
    return path


def runner(tiny_path, **shape):
    from runtime.model.gpu.runner import CudaRunner

    return traced_runner(CudaRunner, tiny_path, **shape)


def kernel_lines(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith(("launch", "capture", "replay"))]


def meta_uploads(r) -> list[dict[str, np.ndarray]]:
    """Every metadata block uploaded since the log was emptied, as field -> int32 values."""
    st = r.storage
    blocks = []
    for dst, data in r.device.uploads:
        if dst == st.buf["meta"]:
            arr = np.frombuffer(data, np.int32)
            blocks.append({name: arr[off:off + st.meta_size[name]] for name, off in st.meta_off.items()})
    return blocks


def test_launch_sequence_equals_the_runner_before_the_package(tiny_path):
    from runtime.model.gpu.runner import CudaRunner

    want = json.loads(FIXTURE.read_text())
    got = {"artifact": trace(CudaRunner, tiny_path), "synthetic": trace(CudaRunner, tiny_path, SCENARIO[:2], 3)}
    assert got.keys() == want.keys()
    for source, phases in want.items():
        assert list(got[source]) == list(phases)
        for phase, lines in phases.items():
            mine = got[source][phase]
            first = next((i for i, (a, b) in enumerate(zip(mine, lines)) if a != b), min(len(mine), len(lines)))
            assert mine == lines, (f"{source}/{phase}: {len(mine)} lines vs {len(lines)} recorded; first "
                                   f"difference at {first}: {mine[first:first + 1]} vs {lines[first:first + 1]}")


def test_step_of_mixed_rows_sends_what_the_separate_calls_send(tiny_path):
    together, apart = runner(tiny_path), runner(tiny_path)
    try:
        v = together.vocab_size
        prompt = list(range(1, 150))
        out = together.step([
            StepRow(slot=0, token_ids=[5], start_pos=0, page_table=[0]),
            StepRow(slot=1, token_ids=prompt, start_pos=0, page_table=[1, 2, 3], logits="all"),
            StepRow(slot=2, token_ids=[7], start_pos=0, page_table=[4], logits="none"),
            StepRow(slot=3, token_ids=[3, 4], start_pos=0, page_table=[5]),
        ])
        assert [o.shape for o in out] == [(1, v), (149, v), (0, v), (1, v)]
        assert all(o.dtype == np.float32 for o in out)
        apart.decode([DecodeItem(0, 5, 0, [0]), DecodeItem(2, 7, 0, [4])])
        apart.prefill(PrefillChunk(slot=1, token_ids=prompt, start_pos=0, page_table=[1, 2, 3], all_logits=True))
        apart.prefill(PrefillChunk(slot=3, token_ids=[3, 4], start_pos=0, page_table=[5]))
        assert together.device.log == apart.device.log
    finally:
        together.close()
        apart.close()


def test_decode_rows_beyond_max_batch_run_as_several_batches(tiny_path):
    r = runner(tiny_path, num_slots=6, max_batch=4)
    try:
        rows = [StepRow(slot=s, token_ids=[s + 1], start_pos=0, page_table=[s]) for s in range(6)]
        assert [o.shape[0] for o in r.step(rows)] == [1] * 6
        metas = meta_uploads(r)
        assert [m["ids"][:4].tolist() for m in metas] == [[1, 2, 3, 4], [5, 6, 0, 0]]
    finally:
        r.close()


def test_prefill_rows_compute_only_the_logits_they_want(tiny_path):
    r = runner(tiny_path)
    try:
        prompt = list(range(1, 150))  # pieces of 64: [0, 64), [64, 128), [128, 149)
        out = r.step([StepRow(slot=0, token_ids=prompt, start_pos=0, page_table=[0, 1, 2],
                              logits=(0, 1, 2, 70, 100))])
        assert out[0].shape == (5, r.vocab_size)
        assert [k for k in r.steps.plans.bound if k[0] == "lm_head"] == [("lm_head", 0, 3), ("lm_head", 6, 1),
                                                                        ("lm_head", 36, 1)]
        logits = r.storage.buf["logits"]
        assert sum(line.startswith(f"dtoh {logits:#x}") for line in r.device.log) == 3
    finally:
        r.close()
    r = runner(tiny_path)
    try:
        out = r.step([StepRow(slot=0, token_ids=prompt, start_pos=0, page_table=[0, 1, 2], logits="none")])
        assert out[0].shape == (0, r.vocab_size)
        assert not [k for k in r.steps.plans.bound if k[0] == "lm_head"]
        assert not any(line.startswith("dtoh") for line in r.device.log)
    finally:
        r.close()


def test_all_logits_read_back_in_blocks_of_the_staging_rows(tiny_path):
    r = runner(tiny_path, prefill_chunk=200, max_batch=8)
    try:
        r.storage.logit_rows = 64  # as a large vocabulary would make it (`Storage`)
        out = r.step([StepRow(slot=0, token_ids=list(range(1, 150)), start_pos=0, page_table=[0, 1, 2],
                              logits="all")])
        assert out[0].shape == (149, r.vocab_size)
        assert [k for k in r.steps.plans.bound if k[0] == "lm_head"] == [("lm_head", 0, 64), ("lm_head", 64, 64),
                                                                        ("lm_head", 128, 21)]
    finally:
        r.close()


ROWS = [StepRow(slot=0, token_ids=[5], start_pos=3, page_table=[0]),
        StepRow(slot=1, token_ids=[7, 8, 9], start_pos=10, page_table=[1], logits="all", snapshots=[4, 5, 6]),
        StepRow(slot=2, token_ids=[3, 2], start_pos=63, page_table=[2, 3], logits=(1,), snapshots=[7, 8])]


def test_verification_rows_read_their_slot_and_write_a_snapshot_per_row(tiny_path):
    r = runner(tiny_path, num_slots=12)
    try:
        phys = list(r.slots.phys)
        out = r.step(ROWS)
        assert [o.shape[0] for o in out] == [1, 3, 1]
        metas = meta_uploads(r)
        # The decode row's batch, then one verification step per row length (2, then 3).
        assert len(metas) == 3
        assert metas[0]["slots_in"][0] == metas[0]["slots"][0] == phys[0]
        for meta, row in zip(metas[1:], (ROWS[2], ROWS[1])):
            t = row.num_tokens
            # One sequence, so row p is its position p: read at its own slot, snapshot p written
            # at slots[p], nothing else set.
            assert meta["slots_in"][:2].tolist() == [phys[row.slot], 0]
            assert meta["slots"][:t + 1].tolist() == [phys[s] for s in row.snapshots] + [0]
            assert meta["ids"][:t].tolist() == list(row.token_ids)
            assert meta["pos"][:t].tolist() == [row.start_pos + p for p in range(t)]
            assert meta["qseq"][:t].tolist() == [0] * t
            assert meta["wrow"][:t].tolist() == [row.page_table[(row.start_pos + p) // 64] * 64
                                                 + (row.start_pos + p) % 64 for p in range(t)]
            assert phys[row.slot] not in meta["slots"].tolist()   # the row's own slot is only read
        assert r.slots.phys == phys  # a step maps nothing; commit does
    finally:
        r.close()


def test_verification_rows_of_one_length_are_position_major(tiny_path):
    r = runner(tiny_path, num_slots=12)
    try:
        phys = list(r.slots.phys)
        rows = [StepRow(slot=0, token_ids=[5, 6, 7], start_pos=4, page_table=[0], snapshots=[3, 4, 5]),
                StepRow(slot=1, token_ids=[8, 9, 10], start_pos=9, page_table=[1], snapshots=[6, 7, 8])]
        r.step(rows)
        (meta,) = meta_uploads(r)
        assert meta["slots_in"][:3].tolist() == [phys[0], phys[1], 0]
        # Row p * 2 + b is sequence b's position p, its snapshot slot beside it.
        assert meta["slots"][:7].tolist() == [phys[3], phys[6], phys[4], phys[7], phys[5], phys[8], 0]
        assert meta["ids"][:6].tolist() == [5, 8, 6, 9, 7, 10]
        assert meta["pos"][:6].tolist() == [4, 9, 5, 10, 6, 11]
        assert meta["qseq"][:6].tolist() == [0, 1] * 3
    finally:
        r.close()


def test_a_row_longer_than_a_step_continues_from_its_last_snapshot(tiny_path):
    # prefill_chunk 4 and max_batch 4: a verification step takes 4 rows (`Storage.verify_rows`),
    # so 6 tokens go as positions 0-3, then 4-5 reading the snapshot of position 3.
    r = runner(tiny_path, num_slots=12, prefill_chunk=4, max_batch=4)
    try:
        assert r.storage.verify_rows == 4
        phys = list(r.slots.phys)
        snapshots = [2, 3, 4, 5, 6, 7]
        r.step([StepRow(slot=1, token_ids=[1, 2, 3, 4, 5, 6], start_pos=0, page_table=[1], snapshots=snapshots)])
        first, second = meta_uploads(r)
        assert first["slots_in"][:2].tolist() == [phys[1], 0]
        assert first["slots"].tolist() == [phys[s] for s in snapshots[:4]]  # all 4 rows of the block
        assert second["slots_in"][:2].tolist() == [phys[5], 0]
        assert second["slots"][:3].tolist() == [phys[6], phys[7], 0]
        assert second["pos"][:2].tolist() == [4, 5]
    finally:
        r.close()


def launch_names(log: list[str]) -> "collections.Counter[str]":
    import collections

    return collections.Counter(line.split()[1] for line in log if line.startswith(("launch", "capture")))


def bound_args(launch) -> dict[str, int]:
    """A bound launch's parameters by name: addresses and int32 sizes, as the kernel gets them."""
    values = {}
    for param, raw in zip(launch.kernel.entry.params, launch.param_bytes()):
        values[param.name] = int.from_bytes(raw, "little", signed=param.kind == "i32")
    return values


def test_a_verification_step_has_one_launch_per_kernel_and_layer(tiny_path):
    """1 + 2 tokens of two sequences in one step: every projection is one decode-GEMV launch over
    the 6 rows (so each weight is read once, as in a decode step), and the GDN conv and
    recurrent step are one `verify` launch each per layer, over all rows, in place of the decode
    kernels."""
    verify, decode = runner(tiny_path, num_slots=12), runner(tiny_path, num_slots=12)
    try:
        rows = [StepRow(slot=0, token_ids=[5, 6, 7], start_pos=4, page_table=[0], snapshots=[3, 4, 5]),
                StepRow(slot=1, token_ids=[8, 9, 10], start_pos=9, page_table=[1], snapshots=[6, 7, 8])]
        verify.step(rows)
        decode.decode([DecodeItem(row.slot, row.token_ids[0], row.start_pos, row.page_table) for row in rows])
        got, one_step = launch_names(verify.device.log), launch_names(decode.device.log)
        k = verify.kernels
        swapped = {}
        gdn_key, gdn_verify = k.gdn_recurrent(2, False), k.gdn_recurrent(2, True)
        for family, key, verify_key in (("conv1d", k.conv, k.conv_verify), ("gdn", gdn_key, gdn_verify)):
            assert verify_key == key + "_verify"
            entries = verify.library.manifest.kernels
            swapped[entries[(family, key)].entry] = entries[(family, verify_key)].entry
        # Decode attention's tensor-core form serves the 3 tokens of a sequence in one CTA: its
        # variant for up to 8 tokens per sequence in place of the decode one.
        entries = verify.library.manifest.kernels
        swapped[entries[k.decode_split(1)].entry] = entries[k.decode_split(3)].entry
        want = {swapped.get(name, name): count for name, count in one_step.items()}
        assert dict(got) == want

        st, buf = verify.storage, verify.storage.buf
        plan = verify.steps.plans.bound[("verify", 2, 3)]
        mixers = [launch for launch in plan if launch.kernel.entry.family in ("conv1d", "gdn")]
        assert len(mixers) == 2 * len(verify.config.linear_layers)
        slots_in, slots_out = st.meta_ptr("slots_in"), st.meta_ptr("slots")
        for n, (conv, rec) in enumerate(zip(mixers[::2], mixers[1::2])):
            assert (conv.kernel.entry.key, rec.kernel.entry.key) == (k.conv_verify, gdn_verify)
            args = bound_args(conv)
            assert {name: args[name] for name in ("x", "win", "slots_in", "slots_out", "out", "B", "T")} == {
                "x": buf["proj"], "win": st.windows[n], "slots_in": slots_in, "slots_out": slots_out,
                "out": buf["conv_out"], "B": 2, "T": 3}
            args = bound_args(rec)
            assert {name: args[name] for name in ("qkv", "x", "state", "slots", "slots_out", "out", "B", "T")} == {
                "qkv": buf["conv_out"], "x": buf["proj"], "state": st.states[n], "slots": slots_in,
                "slots_out": slots_out, "out": buf["gdn_out"], "B": 2, "T": 3}
    finally:
        verify.close()
        decode.close()


def test_commit_swaps_the_slot_mapping(tiny_path):
    from runtime.model.sampling import RowSampling

    r = runner(tiny_path, num_slots=12)
    try:
        st, dev = r.storage, r.device
        for slot, value in ((1, 1.0), (5, 2.0)):  # tell the two physical states apart
            dev.memcpy_htod(st.states[0] + r.slots.phys[slot] * st.state_slot_bytes,
                            np.full(st.state_slot_bytes // 4, value, np.float32))
        before = list(r.slots.phys)
        dev.log = []
        r.commit(1, 5)
        assert r.slots.phys[1] == before[5] and r.slots.phys[5] == before[1]
        assert dev.log == []  # nothing copied
        assert (r.read_state(0, 1)[0] == 2.0).all() and (r.read_state(0, 5)[0] == 1.0).all()
        dev.uploads = []
        r.decode([DecodeItem(slot=1, token_id=5, pos=13, page_table=[1])])
        meta = meta_uploads(r)[0]
        assert meta["slots_in"][0] == meta["slots"][0] == before[5]
        with pytest.raises(ValueError, match="other than"):
            r.commit(1, 1)
        with pytest.raises(ValueError, match="out of range"):
            r.commit(1, 12)
        if r.samples_on_device:  # a pending step computed ahead is dropped by commit and step
            for drop in (lambda: r.commit(2, 6),
                         lambda: r.step([StepRow(slot=3, token_ids=[1], start_pos=0, page_table=[3])])):
                r.decode_sampled([DecodeItem(slot=2, token_id=5, pos=3, page_table=[2])],
                                 lambda: [RowSampling(greedy=True)], lookahead=True)
                assert r._ahead is not None
                drop()
                assert r._ahead is None
    finally:
        r.close()


def test_a_bad_row_refuses_the_step_before_anything_runs(tiny_path):
    r = runner(tiny_path, num_slots=12)
    try:
        good = StepRow(slot=0, token_ids=[1, 2, 3], start_pos=0, page_table=[0])
        for bad, match in ((StepRow(slot=1, token_ids=[r.vocab_size], start_pos=0, page_table=[1]), "token ids"),
                           (StepRow(slot=1, token_ids=[1] * 70, start_pos=0, page_table=[1]), "page table"),
                           (StepRow(slot=1, token_ids=[1], start_pos=-1, page_table=[1]), "start_pos"),
                           (StepRow(slot=1, token_ids=[1, 2], start_pos=0, page_table=[1], snapshots=[0, 2]), "twice"),
                           (StepRow(slot=1, token_ids=[1], start_pos=r.max_context, page_table=[1] * 20), "context")):
            with pytest.raises(ValueError, match=match):
                r.step([good, bad])
        assert r.device.log == []
    finally:
        r.close()


def test_kernel_choice_has_the_27b_lm_head_at_every_chunk_row_count():
    from bench.decode import QWEN36_27B
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.layers import Forward
    from runtime.model.gpu.storage import Storage
    from runtime.model.gpu.weights import WeightLayout

    device = NullDevice(total_memory=200 << 30)
    try:
        library = KernelLibrary.open(device, required=[])
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    if ("gemm_sm90", "lm_head_n248320_k5120") not in library.manifest.kernels:
        pytest.skip("the 27B lm_head GEMM was not built")
    config = ModelConfig.from_dict(QWEN36_27B)
    kernels = KernelChoice(library, config)
    v, h = config.vocab_size, config.hidden_size
    assert kernels.linear(v, h, 8)[0] == "gemv" and kernels.linear(v, h, 16)[0] == "gemv"
    for m in (17, 128, 512, 2048):
        assert kernels.linear(v, h, m) == ("gemm_sm90", "lm_head_n248320_k5120")
    # A 2,048-row chunk stages its logits in blocks of 512 rows (the 256 MiB budget) and the head
    # binds at that row count.
    layout = WeightLayout.plan(config)
    storage = Storage(config, device, kernels, weight_bytes=layout.total, num_pages=33, phys_slots=2, max_batch=1,
                      prefill_chunk=2048, max_context=2048)
    try:
        assert storage.logit_rows == 512
        head = Forward(config, kernels, library, storage, layout, phys_slots=2).lm_head(0, storage.logit_rows)
        assert [launch.kernel.entry.key for launch in head] == ["lm_head_n248320_k5120"]
    finally:
        storage.release()
