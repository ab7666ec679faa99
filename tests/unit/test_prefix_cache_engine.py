"""The hybrid prefix cache in the engine on the NumPy runner (tiny model): multi-turn reuse,
edited histories, shared prefixes, retries, aborts, the file tier, eviction and preemption from
the host tier. Every test compares token ids with the same requests run with no cache."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, FinishReason, SamplingParams
from runtime.engine.cache_file import read_manifest
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.kv_blocks import block_hashes
from test_engine_fakes import RecordingLog
from tests.engine_checks import resumed_without_recomputation

GREEDY = SamplingParams(greedy=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
CACHE = dict(prefix_cache=True, snapshot_slots=4, host_cache_bytes=64 << 20,
             snapshot_interval=64)


@pytest.fixture(scope="module")
def make_runner(tiny_dense_path):
    from runtime.artifact import open_artifact
    from runtime.model.numpy_runner import NumpyRunner

    artifact = open_artifact(tiny_dense_path)

    def make(num_pages=48, num_slots=6):
        return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=num_slots)

    yield make
    artifact.close()


def config(**kw) -> EngineConfig:
    base = dict(num_lanes=2, max_context=1024, prefill_chunk=128, snapshot_interval=64)
    base.update(kw)
    return EngineConfig(**base)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 440, n)]


def run(engine, rid, prompt, max_new=10, sampling=GREEDY, **kw):
    outputs = list(engine.submit(EngineRequest(rid, tuple(prompt), sampling, max_new, **kw)))
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def shared_positions(engine) -> list[int]:
    """The positions of the shared snapshots the engine's cache holds (device or host)."""
    return sorted(e.position for e in engine.scheduler.cache.cache.entries() if e.owner is None)


def prefix_positions(engine, token_ids) -> list[int]:
    """The positions of the shared snapshots of prefixes of `token_ids` (device or host)."""
    return sorted(e.position for e in engine.scheduler.cache.cache.entries()
                  if e.owner is None and e.chain == tuple(block_hashes(token_ids[:e.position]))
                  and e.tail == tuple(token_ids[e.position // 64 * 64:e.position]))


@pytest.mark.parametrize("hinted", [True, False], ids=["turn-starts", "no-hints"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED])
def test_a_conversation_resumes_each_turn_at_its_deepest_stop_before_the_answer(
        make_runner, sampling, hinted):
    """Each turn resumes at the deepest snapshot at or before the previous prompt's end (the
    answer's state came from decode steps and is prefilled again): the last multiple of 64
    before it, hinted or not (hints are rounded down to the block: a turn start at 150 is the
    stop 128, which the interval (64) gives anyway)."""
    history = tokens(1, 150)
    turns = [tokens(2, 40), tokens(3, 70), tokens(4, 20)]
    prompts, outputs, finals, hints, kept = [], [], [], [], []
    with Engine(make_runner(), config(**CACHE)) as engine:
        for n, user in enumerate(turns):
            prompt = history + user if n else history
            hint = tuple(len(p) for p in prompts) if hinted else ()
            ids, final = run(engine, f"t{n}", prompt, sampling=sampling, snapshot_positions=hint)
            prompts.append(prompt)
            outputs.append(ids)
            finals.append(final)
            hints.append(hint)
            kept.append(shared_positions(engine))
            history = prompt + ids
        engine.scheduler.check_invariants()
    with Engine(make_runner(), config()) as cold:
        expected = [run(cold, f"t{n}", p, sampling=sampling, snapshot_positions=hints[n])[0]
                    for n, p in enumerate(prompts)]
    assert outputs == expected
    assert finals[0].cached_prompt_tokens == 0 and finals[0].stats.resume_path == "cold"
    for n in (1, 2):
        previous = len(prompts[n - 1])
        resume = previous // 64 * 64           # 150 -> 128, 200 -> 192
        assert finals[n].cached_prompt_tokens == resume
        assert finals[n].stats.cached_tokens == resume
        assert finals[n].stats.resume_path == "prefix"
        assert finals[n].stats.prefilled_tokens == len(prompts[n]) - resume
    for n in range(3):
        # Kept after each turn: the multiples of 64 up to its prompt (prompts of 150, 200 and
        # 280 tokens: none ends a block, so no prompt end is captured), no snapshot after a
        # turn's answer (the last computed token is one before its end).
        assert kept[n] == list(range(64, len(prompts[n]) + 1, 64)), (n, kept[n])
        assert len(prompts[n]) % 64 and len(prompts[n]) not in kept[n]
        answer_end = len(prompts[n]) + len(outputs[n]) - 1
        assert answer_end not in kept[n], (n, kept[n])


def test_an_edited_history_reuses_up_to_the_edit(make_runner):
    original = tokens(5, 300)
    edited = list(original)
    edited[200] = (edited[200] + 1) % 440
    with Engine(make_runner(), config(**CACHE)) as engine:
        run(engine, "a", original)
        ids, final = run(engine, "b", edited)
    with Engine(make_runner(), config()) as cold:
        assert ids == run(cold, "b", edited)[0]
    assert final.cached_prompt_tokens == 192          # the last snapshot stop before 200


def test_subagents_share_the_system_prefix_blocks(make_runner):
    system = tokens(6, 200)
    prompts = {name: system + tokens(seed, 30) for seed, name in ((7, "a"), (8, "b"), (9, "c"))}
    with Engine(make_runner(), config(**CACHE)) as engine:
        first, _ = run(engine, "a", prompts["a"])
        scheduler = engine.scheduler
        # a kept the multiples of 64 below its 230 tokens; its prompt end (230, not a
        # multiple of 64) is never captured.
        assert shared_positions(engine) == [64, 128, 192]
        # 192 (= 200 // 64 * 64) is the deepest snapshot inside the shared system prompt, and
        # b (no hints) may resume from it.
        entry = scheduler.cache.cache.match(prompts["b"], "b")
        assert entry.position == 192 == len(system) // 64 * 64 and entry.owner is None
        shared = [scheduler.pages.lookup(d) for d in entry.chain]
        results = {name: run(engine, name, prompts[name]) for name in ("b", "c")}
        cached_pages = scheduler.pages.num_cached
    with Engine(make_runner(), config()) as cold:
        for name in ("b", "c"):
            assert results[name][0] == run(cold, name, prompts[name])[0]
    assert all(page is not None for page in shared) and len(shared) == 3
    for name in ("b", "c"):
        assert results[name][1].cached_prompt_tokens == 192
    assert cached_pages >= 3


def test_a_retry_resumes_before_the_last_prompt_token(make_runner):
    prompt = tokens(10, 140)
    with Engine(make_runner(), config(**CACHE)) as engine:
        ids, first = run(engine, "a", prompt, sampling=SEEDED)
        again, retry = run(engine, "a", prompt, sampling=SEEDED)   # same id: a client retry
    assert again == ids and first.cached_prompt_tokens == 0
    assert retry.cached_prompt_tokens == 128   # the prompt's end (140) leaves nothing to compute


def test_an_aborted_request_leaves_its_prompt_state_for_the_next_one(make_runner):
    """A cancelled request keeps what its prefill computed (its stops on the block grid), not
    the state after its partial answer (decode steps computed that): the follow-up, hinting the
    turn start (the aborted prompt's end, as the server does), resumes at the last block
    boundary of the aborted prompt."""
    prompt = tokens(11, 100)
    with Engine(make_runner(), config(**CACHE)) as engine:
        stream = engine.submit(EngineRequest("a", tuple(prompt), GREEDY, 200))
        partial = []
        for output in stream:
            partial += output.token_ids
            if len(partial) >= 5:
                stream.cancel()
        final = output
        # The first 5 answer tokens, however many landed before the cancel: b's prompt length
        # (and so where its own stops fall) must not depend on timing.
        follow = prompt + partial[:5] + tokens(12, 20)
        hint = (len(prompt),)
        ids, resumed = run(engine, "b", follow, snapshot_positions=hint)
        kept = shared_positions(engine)
    with Engine(make_runner(), config()) as cold:
        assert ids == run(cold, "b", follow, snapshot_positions=hint)[0]
    assert final.finish_reason is FinishReason.CANCELLED
    # hint 100 -> stop 64; block 1 (64..127) holds a's decoded positions: no prompt maps it.
    assert resumed.cached_prompt_tokens == 64 == len(prompt) // 64 * 64
    assert resumed.stats.prefilled_tokens == len(follow) - 64
    # Kept: a's stop 64 (its prompt end 100 is not a multiple of 64) and b's stops past its
    # resume (the multiples of 64 up to its prompt), nothing else: no state after a's answer.
    assert kept == [64, *range(128, len(follow) + 1, 64)]


def test_a_resume_on_the_cold_chunk_grid_is_bit_identical(make_runner):
    """The continuation hints where the earlier prompt ended (`snapshot_positions`, 150 -> the
    stop 128), so its cold run has a chunk end there too: the warm run resumes there and
    computes exactly the same chunks, and even the log-probabilities are equal bit for bit."""
    first = tokens(13, 150)
    second = first + tokens(14, 60)
    hints = (len(first),)
    with Engine(make_runner(), config(**CACHE)) as engine:
        run(engine, "a", first)
        warm, warm_final = run(engine, "b", second, logprobs=2, snapshot_positions=hints)
    with Engine(make_runner(), config()) as cold:
        expected, cold_final = run(cold, "b", second, logprobs=2, snapshot_positions=hints)
    # a kept 64 and 128; its prompt end (150) is not a multiple of 64: hint 150 -> stop 128.
    assert warm == expected and warm_final.cached_prompt_tokens == 128 == len(first) // 64 * 64
    # logprobs of the final increment: the same floats, not just the same argmax.
    assert warm_final.logprobs == cold_final.logprobs


def test_the_file_tier_survives_a_restart_and_ignores_bad_files(make_runner, tmp_path):
    path = tmp_path / "prefix.cache"
    prompt = tokens(15, 180)
    file_config = config(**CACHE, cache_file=str(path), cache_fingerprint="tiny-dense;v1")
    with Engine(make_runner(), file_config) as engine:
        ids, _ = run(engine, "a", prompt)
    assert path.exists()
    # The file holds a's prefill stops (the multiples of 64 below 180), not its prompt end
    # (180 is not a multiple of 64), nor the state after its answer (180 + 10 - 1: decode
    # steps computed it).
    assert sorted(r["position"] for r in read_manifest(path)["snapshots"]) == [64, 128]
    follow = prompt + ids + tokens(16, 30)
    hint = (len(prompt),)                 # the turn start, as the server hints it: 180 -> 128
    good = path.read_bytes()
    with Engine(make_runner(), config()) as cold:
        expected = run(cold, "b", follow, snapshot_positions=hint)[0]

    log = RecordingLog()
    with Engine(make_runner(), file_config, logger=log) as engine:
        got, final = run(engine, "b", follow, snapshot_positions=hint)
    assert got == expected and final.cached_prompt_tokens == 128
    assert log.warnings == []

    bad_files = {"corrupt": good[:100] + bytes(len(good) - 200) + good[-100:],
                 "truncated": good[:len(good) // 2], "garbage": b"not a cache file"}
    for why, data in bad_files.items():
        path.write_bytes(data)
        log = RecordingLog()
        with Engine(make_runner(), file_config, logger=log) as engine:
            got, final = run(engine, "b", follow, snapshot_positions=hint)
            engine.shutdown()
        assert got == expected and final.cached_prompt_tokens == 0, why
        assert len([w for w in log.warnings if "ignored" in w]) == 1, (why, log.warnings)
        assert "unreadable" in log.warnings[0], why
    other = config(**CACHE, cache_file=str(path), cache_fingerprint="another-model")
    log = RecordingLog()
    with Engine(make_runner(), other, logger=log) as engine:
        got, final = run(engine, "b", follow, snapshot_positions=hint)
    assert final.cached_prompt_tokens == 0
    assert len(log.warnings) == 1 and "written for 'tiny-dense;v1'" in log.warnings[0]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED])
def test_preemption_resumes_from_the_host_tier_without_recomputation(make_runner, sampling):
    rng = np.random.default_rng(0)
    prompts = {"a": list(rng.integers(0, 440, size=100)),
               "b": list(rng.integers(0, 440, size=110)),
               "c": list(rng.integers(0, 440, size=20))}
    with Engine(make_runner(8, 1), EngineConfig(max_context=512)) as solo:
        expected = {rid: run(solo, rid, p, 30, sampling)[0] for rid, p in prompts.items()}
    # Two lanes and 4 pages for three requests: preemption and service-turn rotation happen;
    # a paused request's state and partial block wait in the host tier.
    pressured = EngineConfig(num_lanes=2, max_context=256, prefill_chunk=64,
                             service_turn_tokens=16, host_cache_bytes=64 << 20)
    with Engine(make_runner(4, 2), pressured) as busy:
        streams = {rid: busy.submit(EngineRequest(rid, tuple(p), sampling, 30))
                   for rid, p in prompts.items()}
        results = {rid: list(s) for rid, s in streams.items()}
        saved = busy.scheduler.cache.cache.stats["pauses_saved"]
    preemptions = resumed_without_recomputation(results, expected)
    assert preemptions > 0 and saved == preemptions


def test_eviction_under_a_small_pool_keeps_outputs_and_pages_in_use(make_runner):
    prompts = {f"r{n}": tokens(20 + n % 3, 90) + tokens(30 + n, 40) for n in range(6)}
    small = config(num_lanes=2, **{**CACHE, "snapshot_slots": 1, "host_cache_bytes": 1 << 20})
    with Engine(make_runner(10, 3), small) as engine:
        streams = {rid: engine.submit(EngineRequest(rid, tuple(p), GREEDY, 12))
                   for rid, p in prompts.items()}
        results = {rid: [t for o in s for t in o.token_ids] for rid, s in streams.items()}
        engine.scheduler.check_invariants()
        stats = dict(engine.scheduler.cache.cache.stats)
        evictions = engine.scheduler.pages.evictions
    with Engine(make_runner(), config()) as cold:
        for rid, prompt in prompts.items():
            assert results[rid] == run(cold, rid, prompt, 12)[0], rid
    assert evictions > 0 and stats["hits"] > 0


def test_blocks_evicted_to_the_host_tier_come_back_for_a_resume(make_runner):
    first = tokens(40, 300)
    other = tokens(41, 400)
    follow = first + tokens(42, 30)
    hint = (len(first),)        # the turn start: 300 -> the stop 256 of the follow-up
    # Eight pages: the unrelated prompt needs all of them, so `first`'s cached pages are
    # evicted; its snapshots need them, so they go to the host tier and come back.
    with Engine(make_runner(8, 6), config(**CACHE)) as engine:
        run(engine, "a", first, 4)
        run(engine, "b", other, 4)
        ids, final = run(engine, "c", follow, 4, snapshot_positions=hint)
        stats = dict(engine.scheduler.cache.cache.stats)
        traffic = engine.cache.traffic
        # a's prompt end (300, not a multiple of 64) was never captured; the multiples of 64
        # below it were.
        kept = prefix_positions(engine, first)
        assert kept == [64, 128, 192, 256] and len(first) not in kept
        # Another continuation of `first`, without the hint and too short to reach c's stop
        # at 320: the aligned snapshot at 256 is usable by it too.
        unhinted = first + tokens(43, 15)
        plain, plain_final = run(engine, "d", unhinted, 4)
    with Engine(make_runner(), config()) as cold:
        assert ids == run(cold, "c", follow, 4, snapshot_positions=hint)[0]
        assert plain == run(cold, "d", unhinted, 4)[0]
    assert final.cached_prompt_tokens == 256 and final.stats.resume_path == "prefix"
    assert plain_final.cached_prompt_tokens == 256 and plain_final.stats.resume_path == "prefix"
    # Of the prompt's four full blocks, those evicted came back from the host (one was still
    # cached on the device when the unrelated prompt finished).
    assert stats["block_demotions"] >= 4 and stats["block_promotions"] >= 3
    assert traffic.host_to_device_bytes > 0 and traffic.device_to_host_bytes > 0
