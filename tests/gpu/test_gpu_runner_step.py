"""The step contract on `CudaRunner` (runtime/model/gpu/): values on a GPU.

On the tiny dense model (tools/make_tiny.py), bit for bit, because every row runs kernels whose
results do not depend on the batch or on which physical slot a state sits in:
- a verification row of k + 1 tokens (k = 1..7) gives the logits and, in each snapshot, the GDN
  states and conv windows that k + 1 separate decode steps give;
- verification rows of different lengths batched in one step equal each row alone;
- `commit` of any position, then a decode step, equals decoding from that position;
- a step of mixed rows (decode, prefill, verification) equals the same rows alone.
On a 4-layer model of the Qwen3.6-27B shapes (synthetic weights): the logits of all 2,048
positions of one chunk, with prefill pieces of 512 and of 2,048 tokens, agree with the last
position's logits of each prefix prefilled alone within BF16 noise (the head and the pieces run
other kernel shapes there, so not bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from .conftest import rel_err
from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu

PROMPT_LEN = 40


@pytest.fixture(scope="module")
def runner(tiny_path, device, library):  # noqa: F811 - the fixture imported above
    from runtime.model.gpu.runner import CudaRunner

    r = CudaRunner.from_artifact(tiny_path, num_pages=64, num_slots=48, max_batch=8, device=device,
                                 library=library, prefill_chunk=128)
    yield r
    r.close()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _pages(seq: int) -> list[int]:
    return [2 * seq, 2 * seq + 1]  # 128 positions: the prompt, then up to 8 more tokens


def _prefilled(r, slot: int, seq: int, prompt: list[int]) -> None:
    r.reset_slot(slot)
    r.prefill(PrefillChunk(slot=slot, token_ids=prompt, start_pos=0, page_table=_pages(seq)))


def _states(r, slot: int) -> list[np.ndarray]:
    """Every GDN layer's recurrent state and conv window of `slot`."""
    return [a for n in range(len(r.config.linear_layers)) for a in r.read_state(n, slot)]


def _assert_states_equal(r, slot_a: int, slot_b: int) -> None:
    for a, b in zip(_states(r, slot_a), _states(r, slot_b)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", range(1, 8))
def test_verification_row_equals_separate_decode_steps(runner, k):
    v = runner.vocab_size
    prompt, tokens = _ids(100 + k, PROMPT_LEN, v), _ids(200 + k, k + 1, v)
    _prefilled(runner, 0, 0, prompt)
    _prefilled(runner, 1, 1, prompt)
    own = _states(runner, 0)
    snapshots = list(range(10, 10 + k + 1))
    out = runner.step([StepRow(slot=0, token_ids=tokens, start_pos=PROMPT_LEN, page_table=_pages(0), logits="all",
                               snapshots=snapshots)])[0]
    assert out.shape == (k + 1, v) and np.isfinite(out).all()
    for a, b in zip(_states(runner, 0), own):  # the row's own slot is only read
        np.testing.assert_array_equal(a, b)
    for i, token in enumerate(tokens):
        want = runner.decode([DecodeItem(slot=1, token_id=token, pos=PROMPT_LEN + i, page_table=_pages(1))])
        np.testing.assert_array_equal(out[i], want[0])
        _assert_states_equal(runner, snapshots[i], 1)


def test_verification_rows_batched_equal_each_alone(runner):
    v = runner.vocab_size
    lengths = (2, 4, 8)
    rows, alone_rows = [], []
    next_snapshot = 12
    for i, n in enumerate(lengths):
        prompt, tokens = _ids(300 + i, PROMPT_LEN, v), _ids(400 + i, n, v)
        _prefilled(runner, i, i, prompt)
        _prefilled(runner, 3 + i, 3 + i, prompt)
        for slot, seq, target in ((i, i, rows), (3 + i, 3 + i, alone_rows)):
            snapshots = list(range(next_snapshot, next_snapshot + n))
            next_snapshot += n
            target.append(StepRow(slot=slot, token_ids=tokens, start_pos=PROMPT_LEN, page_table=_pages(seq),
                                  logits="all", snapshots=snapshots))
    together = runner.step(rows)
    for row, alone_row, got in zip(rows, alone_rows, together):
        np.testing.assert_array_equal(got, runner.step([alone_row])[0])
        for a, b in zip(row.snapshots, alone_row.snapshots):
            _assert_states_equal(runner, a, b)


@pytest.mark.parametrize("position", [0, 2, 4])
def test_commit_then_decode_equals_decoding_from_that_position(runner, position):
    v = runner.vocab_size
    prompt, tokens, after = _ids(500 + position, PROMPT_LEN, v), _ids(600 + position, 5, v), 7
    _prefilled(runner, 0, 0, prompt)
    _prefilled(runner, 1, 1, prompt)
    snapshots = list(range(20, 25))
    runner.step([StepRow(slot=0, token_ids=tokens, start_pos=PROMPT_LEN, page_table=_pages(0), logits="none",
                         snapshots=snapshots)])
    runner.commit(0, snapshots[position])
    got = runner.decode([DecodeItem(slot=0, token_id=after, pos=PROMPT_LEN + position + 1, page_table=_pages(0))])
    for i in range(position + 1):
        runner.decode([DecodeItem(slot=1, token_id=tokens[i], pos=PROMPT_LEN + i, page_table=_pages(1))])
    want = runner.decode([DecodeItem(slot=1, token_id=after, pos=PROMPT_LEN + position + 1, page_table=_pages(1))])
    np.testing.assert_array_equal(got, want)
    _assert_states_equal(runner, 0, 1)


def test_mixed_rows_equal_the_same_rows_alone(runner):
    v = runner.vocab_size
    prompts = [_ids(700 + i, PROMPT_LEN, v) for i in range(3)]
    fresh = _ids(710, 70, v)
    draft = _ids(720, 3, v)

    def rows(base: int, snapshots: list[int]) -> list[StepRow]:
        # decode rows (sequences base, base + 1), a fresh prompt (base + 2), a verification row (base + 3)
        for i in (0, 1):
            _prefilled(runner, base + i, base + i, prompts[i])
        runner.reset_slot(base + 2)
        _prefilled(runner, base + 3, base + 3, prompts[2])
        return [StepRow(slot=base, token_ids=[11], start_pos=PROMPT_LEN, page_table=_pages(base)),
                StepRow(slot=base + 1, token_ids=[12], start_pos=PROMPT_LEN, page_table=_pages(base + 1)),
                StepRow(slot=base + 2, token_ids=fresh, start_pos=0, page_table=_pages(base + 2), logits="all"),
                StepRow(slot=base + 3, token_ids=draft, start_pos=PROMPT_LEN, page_table=_pages(base + 3),
                        logits=(0, 2), snapshots=snapshots)]

    mixed_rows, alone_rows = rows(0, [30, 31, 32]), rows(4, [33, 34, 35])
    mixed = runner.step(mixed_rows)
    alone = [runner.step([row])[0] for row in alone_rows]
    assert [m.shape for m in mixed] == [(1, v), (1, v), (70, v), (2, v)]
    for got, want in zip(mixed, alone):
        np.testing.assert_array_equal(got, want)
    for a, b in ((0, 4), (1, 5), (2, 6), (32, 35)):
        _assert_states_equal(runner, a, b)


CHUNK = 2048


@pytest.fixture(scope="module", params=[512, 2048], ids=lambda n: f"pieces{n}")
def runner_27b(request, device, library):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    layers = 4
    shape = {**QWEN36_27B, "num_hidden_layers": layers, "layer_types": QWEN36_27B["layer_types"][:layers]}
    r = CudaRunner.synthetic(ModelConfig.from_dict(shape), 7, num_pages=CHUNK // 64 + 1, num_slots=1, max_batch=1,
                             max_context=CHUNK + 64, prefill_chunk=request.param, device=device, library=library)
    yield r
    r.close()


def test_all_position_logits_of_a_2048_token_chunk_of_the_27b_shape(runner_27b, record_property):
    r = runner_27b
    ids = np.random.default_rng(9).integers(0, r.vocab_size, CHUNK).tolist()
    pages = list(range(CHUNK // 64))
    r.reset_slot(0)
    every = r.step([StepRow(slot=0, token_ids=ids, start_pos=0, page_table=pages, logits="all")])[0]
    assert every.shape == (CHUNK, r.vocab_size) and np.isfinite(every).all()
    errors = {}
    for p in (0, 1, 200, 511, 512, 1500, CHUNK - 1):
        r.reset_slot(0)
        last = r.prefill(PrefillChunk(slot=0, token_ids=ids[:p + 1], start_pos=0, page_table=pages))[0]
        errors[p] = rel_err(every[p], last)
    r.reset_slot(0)
    offsets = (0, 511, 512, CHUNK - 1)
    some = r.step([StepRow(slot=0, token_ids=ids, start_pos=0, page_table=pages, logits=offsets)])[0]
    assert some.shape == (len(offsets), r.vocab_size)
    offset_errors = [rel_err(some[i], every[p]) for i, p in enumerate(offsets)]
    record_property("prefix_rel_errs", errors)
    record_property("offset_rel_errs", offset_errors)
    # The same hidden rows through the head at another row count (GEMV vs GEMM): bf16 rounding of
    # the products only. A prefix alone runs other piece shapes too: the BF16 noise of
    # tests/gpu/test_gdn_chunked_runner.py.
    assert max(offset_errors) < 1e-2, offset_errors
    assert max(errors.values()) < 3e-2, errors


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_step_sampled_ids_equal_decode_sampled_steps(runner, greedy):
    # Every position of a verification row sampled on the device (`step_sampled`) picks what
    # `decode_sampled` picks at that position decoding the same tokens one at a time, with the
    # draw numbered base + position: the ids read back are in row and position order. A decode
    # row beside it picks what it picks alone.
    from runtime.model.sampling import RowSampling

    if not runner.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    v = runner.vocab_size

    def inputs(p: int) -> RowSampling:
        if greedy:
            return RowSampling(greedy=True)
        return RowSampling(greedy=False, temperature=1.3, top_k=20, top_p=0.95, seed=77, draw_index=5 + p)

    prompts = [_ids(500 + i, PROMPT_LEN, v) for i in range(3)]
    tokens = _ids(600, 4, v)
    for i, prompt in enumerate(prompts):
        _prefilled(runner, i, i, prompt)
        _prefilled(runner, 3 + i, 3 + i, prompt)
    rows = [StepRow(0, tokens, PROMPT_LEN, _pages(0), logits="all", snapshots=[12, 13, 14, 15]),
            StepRow(1, tokens[:1], PROMPT_LEN, _pages(1), logits="all"),
            StepRow(2, tokens, PROMPT_LEN, _pages(2), logits="all", snapshots=[16, 17, 18, 19])]
    got = runner.step_sampled(rows, lambda: [[inputs(p) for p in range(row.num_tokens)] for row in rows])
    assert [len(ids) for ids in got] == [4, 1, 4]
    for seq, ids in ((3, got[0]), (5, got[2])):
        alone = [int(runner.decode_sampled([DecodeItem(seq, t, PROMPT_LEN + p, _pages(seq))],
                                           lambda p=p: [inputs(p)])[0]) for p, t in enumerate(tokens)]
        assert ids.tolist() == alone
    assert got[1].tolist() == [int(runner.decode_sampled([DecodeItem(4, tokens[0], PROMPT_LEN, _pages(4))],
                                                         lambda: [inputs(0)])[0])]
    if greedy:  # and they are the argmax of the logits `step` returns (lowest id on ties)
        _prefilled(runner, 3, 3, prompts[0])
        logits = runner.step([StepRow(3, tokens, PROMPT_LEN, _pages(3), logits="all", snapshots=[20, 21, 22, 23])])[0]
        assert got[0].tolist() == np.argmax(logits, axis=1).tolist()
