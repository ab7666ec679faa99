"""The hybrid prefix cache on `CudaRunner`: cache-on token ids against cache-off, on a GPU.

The CPU tests (tests/unit/test_prefix_cache_engine.py) hold the cache's logic; these check what
only the GPU can: that the CUDA runner's snapshot copies (`copy_slot`, `save_slot` /
`load_slot`, `read_pages` / `write_pages`) bring back exactly what was computed, and which resume
points give the cold run's token ids bit for bit, at the tiny model and at a 4-layer model of the
Qwen3.6-27B shapes (synthetic weights: near-ties everywhere, so a rounding difference shows up as
a different token within a few dozen). The engine's cache is on at the `Engine` level here; the
server keeps it off on cuda until these pass (runtime/session/engine_settings.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from tests.engine_checks import resumed_without_recomputation

from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(greedy=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
CHUNK = 128
CACHE = dict(prefix_cache=True, snapshot_slots=4, host_cache_bytes=256 << 20, snapshot_interval=64)


@pytest.fixture(scope="module", params=["tiny", "27b-4-layers"])
def runner(request, tiny_path, device, library):  # noqa: F811 - the fixture imported above
    from runtime.model.gpu.runner import CudaRunner

    if request.param == "tiny":
        r = CudaRunner.from_artifact(tiny_path, num_pages=96, num_slots=8, max_batch=8, device=device,
                                     library=library, prefill_chunk=CHUNK, max_context=1024)
    else:
        from bench.decode import QWEN36_27B
        from runtime.model.config import ModelConfig

        shape = dict(QWEN36_27B, num_hidden_layers=4, layer_types=QWEN36_27B["layer_types"][:4])
        r = CudaRunner.synthetic(ModelConfig.from_dict(shape), 5, num_pages=96, num_slots=8, max_batch=8,
                                 max_context=1024, prefill_chunk=CHUNK, device=device, library=library)
    yield r
    r.close()


def engine(runner, **kw):
    from runtime.engine.engine_loop import Engine, EngineConfig

    base = dict(num_lanes=2, max_context=1024, prefill_chunk=CHUNK, snapshot_interval=64)
    base.update(kw)
    return Engine(runner, EngineConfig(**base), on_thread_start=runner.device.make_current)


def tokens(runner, seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, runner.vocab_size, n)]


def run(eng, rid, prompt, max_new=16, sampling=GREEDY, **kw):
    outputs = list(eng.submit(EngineRequest(rid, tuple(prompt), sampling, max_new, **kw)))
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def test_snapshot_copies_bring_back_the_same_bytes(runner):
    from runtime.model.runner import PrefillChunk

    prompt = tokens(runner, 1, 150)
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=prompt, start_pos=0, page_table=[0, 1, 2]))
    state = runner.save_slot(0)
    pages = runner.read_pages([0, 1, 2])
    runner.copy_slot(0, 3)
    runner.reset_slot(1)
    runner.load_slot(1, state)
    runner.write_pages([10, 11, 12], pages)
    state, pages = state.wait(), pages.wait()
    for slot in (1, 3):
        for a, b in zip(runner.save_slot(slot).wait(), state):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(runner.read_pages([10, 11, 12]).wait(), pages):
        np.testing.assert_array_equal(a, b)
    assert np.count_nonzero(state[0]) > 0 and np.count_nonzero(pages[0]) > 0


def raw_slot(runner, slot: int) -> bytes:
    """A slot's state and window bytes read on the compute stream after everything queued (not
    through the host copies under test)."""
    st, phys = runner.storage, runner.slots.phys[slot]
    parts = [np.empty(st.state_slot_bytes, np.uint8) for _ in st.states] + \
            [np.empty(st.win_slot_bytes, np.uint8) for _ in st.windows]
    addresses = [s + phys * st.state_slot_bytes for s in st.states] + [w + phys * st.win_slot_bytes for w in st.windows]
    runner.stream.synchronize()
    for part, address in zip(parts, addresses):
        runner.device.memcpy_dtoh(part, address, runner.stream)
    runner.stream.synchronize()
    return b"".join(p.tobytes() for p in parts)


def raw_pages(runner, pages: list[int]) -> bytes:
    st = runner.storage
    runner.stream.synchronize()
    out = b""
    for pool in (*st.k_pages, *st.v_pages):
        for page in pages:
            row = np.empty(st.page_bytes, np.uint8)
            runner.device.memcpy_dtoh(row, pool + page * st.page_bytes, runner.stream)
            runner.stream.synchronize()
            out += row.tobytes()
    return out


def test_async_copies_hold_the_state_of_their_call_while_compute_overwrites_it(runner):
    """Through the pinned pool, the copy stream and the staging slot: the state and pages copied
    out are the ones at the call, though the very next calls compute over them at once (the
    copy is still in flight); loaded back without waiting, they land exactly."""
    from runtime.model.runner import PrefillChunk

    assert runner.reserve_host_copies(256 << 20) > 0 and runner.copies.staging is not None
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=tokens(runner, 30, 150), start_pos=0, page_table=[0, 1, 2]))
    expected_state, expected_pages = raw_slot(runner, 0), raw_pages(runner, [0, 1, 2])
    state, pages = runner.save_slot(0), runner.read_pages([0, 1, 2])
    assert runner.copies.pool.contains(state.arrays[0]) and runner.copies.pool.contains(pages.arrays[0])
    runner.reset_slot(0)                 # queued right behind the copies: they must not see this
    runner.prefill(PrefillChunk(slot=0, token_ids=tokens(runner, 31, 150), start_pos=0, page_table=[0, 1, 2]))
    runner.load_slot(1, state)           # no host wait: ordered after the copy out
    runner.write_pages([10, 11, 12], pages)
    got_state = b"".join(a.tobytes() for a in state.wait())
    assert got_state == expected_state, f"{sum(a != b for a, b in zip(got_state, expected_state))} bytes differ"
    assert b"".join(a.tobytes() for a in pages.wait()) == expected_pages
    assert raw_slot(runner, 1) == expected_state and raw_pages(runner, [10, 11, 12]) == expected_pages
    assert raw_slot(runner, 0) != expected_state        # the overwrite did happen


@pytest.mark.parametrize("hinted", [False, True], ids=["cold-unhinted", "cold-hinted"])
def test_a_resume_at_a_hinted_turn_start_is_bit_identical(runner, hinted):
    """The hint (300) becomes a stop at its block start (256); the cold run is the same with or
    without the hint, since the state at a block boundary does not depend on the stops."""
    first = tokens(runner, 13, 300)
    second = first + tokens(runner, 14, 90)
    hints = (len(first),)
    sparse = dict(CACHE, snapshot_interval=1024)     # no interval stop below 1024: the hint's
    with engine(runner, **sparse) as eng:
        run(eng, "a", first, snapshot_positions=hints)
        warm, warm_final = run(eng, "b", second, 24, logprobs=2, snapshot_positions=hints)
    with engine(runner, snapshot_interval=1024) as cold:
        expected, cold_final = run(cold, "b", second, 24, logprobs=2,
                                   snapshot_positions=hints if hinted else ())
    assert warm_final.cached_prompt_tokens == 256
    assert warm == expected
    assert warm_final.logprobs == cold_final.logprobs


def test_subagents_share_the_system_prefix_blocks(runner):
    system = tokens(runner, 6, 200)
    prompts = {name: system + tokens(runner, seed, 30) for seed, name in ((7, "a"), (8, "b"), (9, "c"))}
    with engine(runner, **CACHE) as eng:
        run(eng, "a", prompts["a"])
        results = {name: run(eng, name, prompts[name], 24) for name in ("b", "c")}
    with engine(runner) as cold:
        for name in ("b", "c"):
            assert results[name][0] == run(cold, name, prompts[name], 24)[0], name
    for name in ("b", "c"):
        assert results[name][1].cached_prompt_tokens == 192


def test_an_edited_history_reuses_up_to_the_edit(runner):
    original = tokens(runner, 5, 300)
    edited = list(original)
    edited[200] = (edited[200] + 1) % runner.vocab_size
    with engine(runner, **CACHE) as eng:
        run(eng, "a", original)
        ids, final = run(eng, "b", edited, 24)
    with engine(runner) as cold:
        assert ids == run(cold, "b", edited, 24)[0]
    assert final.cached_prompt_tokens == 192


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stops", ["interval", "hint"])
def test_a_conversation_resumes_each_turn_before_the_last_answer(runner, sampling, stops):
    """The state after an answer was computed by decode steps, which round differently from
    the cold run's prefill of the same tokens (the 27B shape diverged at the 19th token when
    the cache resumed there), so the next turn resumes at the last block boundary the previous
    prompt stopped at (150 tokens: 128), from an interval multiple or from the hint at the
    previous prompt's end (the server hints turn starts). The cold run has no hints at all."""
    history = tokens(runner, 1, 150)
    turns = [tokens(runner, 2, 40), tokens(runner, 3, 70)]
    config = CACHE if stops == "interval" else dict(CACHE, snapshot_interval=1024)
    prompts, outputs, finals = [], [], []
    with engine(runner, **config) as eng:
        for n, user in enumerate(turns):
            prompt = history + user if n else history
            hints = (len(prompt),) if stops == "hint" else ()
            ids, final = run(eng, f"t{n}", prompt, 24, sampling, snapshot_positions=hints)
            prompts.append(prompt)
            outputs.append(ids)
            finals.append(final)
            history = prompt + ids
    with engine(runner, snapshot_interval=config["snapshot_interval"]) as cold:
        expected = [run(cold, f"t{n}", p, 24, sampling)[0] for n, p in enumerate(prompts)]
    assert finals[1].cached_prompt_tokens == 128
    assert outputs == expected


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_resumes_from_the_host_tier_without_recomputation(runner, sampling):
    prompts = {"a": tokens(runner, 20, 100), "b": tokens(runner, 21, 110), "c": tokens(runner, 22, 20)}
    with engine(runner, num_lanes=1, max_context=512) as solo:
        expected = {rid: run(solo, rid, p, 30, sampling)[0] for rid, p in prompts.items()}
    pressured = dict(num_lanes=2, max_context=256, num_pages=4,
                     service_turn_tokens=16, host_cache_bytes=256 << 20)
    with engine(runner, **pressured) as busy:
        streams = {rid: busy.submit(EngineRequest(rid, tuple(p), sampling, 30)) for rid, p in prompts.items()}
        results = {rid: list(s) for rid, s in streams.items()}
        saved = busy.scheduler.cache.cache.stats["pauses_saved"]
    preemptions = resumed_without_recomputation(results, expected)
    assert preemptions > 0 and saved == preemptions


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resume_from_a_demoted_snapshot_equals_the_cold_run(runner, sampling):
    """No device snapshot slots: every snapshot goes to the host tier through the async path
    while the prompt goes on computing, and the next request resumes from the host copy."""
    first = tokens(runner, 40, 300)
    second = first + tokens(runner, 41, 90)
    with engine(runner, **dict(CACHE, snapshot_slots=0)) as eng:
        run(eng, "a", first, 8, sampling)
        warm, final = run(eng, "b", second, 24, sampling, logprobs=2)
        traffic = eng.cache.traffic
        assert traffic.device_to_host_bytes >= 4 * runner.slot_nbytes     # 64 .. 256, all demoted
        assert traffic.host_to_device_bytes >= runner.slot_nbytes         # the resume's promotion
    with engine(runner) as cold:
        expected, cold_final = run(cold, "b", second, 24, sampling, logprobs=2)
    assert final.cached_prompt_tokens == 256
    assert warm == expected
    assert final.logprobs == cold_final.logprobs


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_file_tier_brings_a_conversation_back_after_a_restart(runner, sampling, tmp_path):
    """Saved at shutdown from the device (snapshot slots, blocks read in runs of pages) and
    read into the host tier of a new engine, on a pool and slots wiped in between (the same
    runner: without the wipe a broken load could pass on the old bytes). The next turn resumes
    from the file at the hinted turn start (300 -> 256) and equals the cold run."""
    from runtime.model.runner import HostReady

    first = tokens(runner, 50, 300)
    path = tmp_path / "prefix.cache"
    config = dict(CACHE, cache_file=str(path), cache_fingerprint="gpu-file-test")
    with engine(runner, **config) as eng:
        ids, _ = run(eng, "a", first, 8, sampling)
    assert path.exists()
    every = list(range(runner.num_pages))
    pages = runner.read_pages(every).wait()
    runner.write_pages(every, HostReady(tuple(np.zeros_like(part) for part in pages)))
    for slot in range(runner.num_slots):
        runner.reset_slot(slot)
    second = first + ids + tokens(runner, 51, 40)
    hints = (len(first),)
    with engine(runner, **config) as eng:
        warm, final = run(eng, "b", second, 24, sampling, logprobs=2, snapshot_positions=hints)
        # The resume loaded the state and the 4 blocks below 256 from the file's host copies.
        assert eng.cache.traffic.host_to_device_bytes >= runner.slot_nbytes + 4 * runner.page_nbytes
    with engine(runner) as cold:
        expected, cold_final = run(cold, "b", second, 24, sampling, logprobs=2,
                                   snapshot_positions=hints)
    assert final.cached_prompt_tokens == 256
    assert warm == expected
    assert final.logprobs == cold_final.logprobs
