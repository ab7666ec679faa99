"""The scheduler driven by hand-made runner results: admission, chunking, page accounting,
preemption with replay, fairness and limits. No runner, no numpy."""

from __future__ import annotations

import random

import pytest

from runtime.engine.api import FinishReason, RequestRejected
from runtime.engine.kv_pages import pages_for
from runtime.engine.scheduler import Scheduler, SchedulerConfig, SeqStatus
from runtime.model.runner import PAGE_SIZE


def make(num_lanes=2, num_pages=64, max_context=4096, prefill_chunk=128, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_lanes=num_lanes, num_pages=num_pages,
                                     max_context=max_context, prefill_chunk=prefill_chunk, **kw))


def step(scheduler: Scheduler, token_of=lambda rid, n: 1000 + n):
    """One step: schedule, 'run' it, commit one token per sampling request."""
    batch = scheduler.schedule()
    new = {}
    for rid in batch.sampling_requests():
        seq = scheduler.get(rid)
        new[rid] = [token_of(rid, seq.num_output)]
    scheduler.update(batch, new)
    scheduler.check_invariants()
    return batch, new


def prompt(n, base=0):
    return [base + i % 50 for i in range(n)]


# --- admission ---------------------------------------------------------------------------------

def test_admission_fills_lanes_then_waits_fifo():
    s = make(num_lanes=2)
    for name in "abc":
        s.add(name, prompt(10))
    batch, _ = step(s)
    assert batch.admitted == ("a", "b")
    assert s.running_ids() == ["a", "b"] and s.waiting_ids() == ["c"]
    s.finish("a")
    batch, _ = step(s)
    assert batch.admitted == ("c",)
    assert s.running_ids() == ["b", "c"]


def test_blocked_head_is_never_overtaken():
    # 4 pages; a runs and holds 2; the head b needs 3 for its first chunk: c (small) must wait.
    s = make(num_lanes=3, num_pages=4, prefill_chunk=256)
    s.add("a", prompt(100))
    step(s)
    s.add("b", prompt(150))
    s.add("c", prompt(5))
    batch, _ = step(s)
    assert batch.admitted == ()
    assert s.waiting_ids() == ["b", "c"]
    s.finish("a")
    batch, _ = step(s)
    assert batch.admitted == ("b", "c")


def test_bounded_queue_rejects_with_queue_full():
    s = make(num_lanes=1, max_waiting=2)
    s.add("a", prompt(4))      # absorbed by the free lane
    s.add("b", prompt(4))
    s.add("c", prompt(4))
    with pytest.raises(RequestRejected) as info:
        s.add("d", prompt(4))
    assert info.value.code == "queue_full"
    step(s)                    # a takes the lane; b and c still fill the queue
    with pytest.raises(RequestRejected):
        s.add("d", prompt(4))
    s.finish("a")
    step(s)                    # b takes the lane: one place frees up
    s.add("d", prompt(4))


@pytest.mark.parametrize("length, code", [(0, "invalid_request"), (4096, "context_length_exceeded"),
                                          (5000, "context_length_exceeded")])
def test_prompt_limits(length, code):
    s = make(max_context=4096, num_pages=128)
    with pytest.raises(RequestRejected) as info:
        s.add("a", prompt(length))
    assert info.value.code == code


def test_prompt_larger_than_pool_is_rejected():
    s = make(num_pages=2, max_context=4096)
    with pytest.raises(RequestRejected) as info:
        s.add("a", prompt(129))
    assert info.value.code == "kv_capacity_exceeded"
    s.add("b", prompt(128))


def test_duplicate_request_id():
    s = make()
    s.add("a", prompt(3))
    with pytest.raises(RequestRejected) as info:
        s.add("a", prompt(3))
    assert info.value.code == "duplicate_request"


# --- chunking and decode -------------------------------------------------------------------------

def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s = make(num_lanes=1, prefill_chunk=128)
    s.add("a", prompt(300))
    chunks = []
    for _ in range(3):
        batch, new = step(s)
        (work,) = batch.prefills
        chunks.append((work.start_pos, work.num_tokens, work.samples, work.reset_slot,
                       len(work.page_table)))
    assert chunks == [(0, 128, False, True, 2), (128, 128, False, False, 4),
                      (256, 44, True, False, 5)]
    batch, _ = step(s)
    assert not batch.prefills and len(batch.decodes) == 1
    (d,) = batch.decodes
    assert d.pos == 300 and d.token_id == 1000


def test_chunk_token_ids_are_the_prompt():
    s = make(num_lanes=1, prefill_chunk=64)
    ids = list(range(100, 230))
    s.add("a", ids)
    seen = []
    for _ in range(3):
        batch, _ = step(s)
        seen.extend(batch.prefills[0].token_ids)
    assert seen == ids


def test_decode_crosses_a_page_boundary_with_one_new_page():
    s = make(num_lanes=1, num_pages=8)
    s.add("a", prompt(63))
    step(s)                                    # prefill 63 tokens: 1 page
    assert len(s.get("a").page_table) == 1
    batch, _ = step(s)                         # decode pos 63: still page 0
    assert batch.decodes[0].pos == 63 and len(s.get("a").page_table) == 1
    batch, _ = step(s)                         # decode pos 64: a second page
    assert batch.decodes[0].pos == 64 and len(batch.decodes[0].page_table) == 2


def test_decoding_continues_while_another_prompt_is_chunked():
    s = make(num_lanes=2, prefill_chunk=64, num_pages=64)
    s.add("short", prompt(8))
    step(s)
    s.add("long", prompt(640))
    for _ in range(10):
        batch, _ = step(s)
        assert [d.request_id for d in batch.decodes] == ["short"]
        assert [p.request_id for p in batch.prefills] == ["long"]
        assert batch.num_tokens <= s.config.token_budget


def test_inserted_tokens_are_computed_as_one_chunk():
    s = make(num_lanes=1)
    s.add("a", prompt(10))
    batch = s.schedule()
    s.update(batch, {"a": [7, 8, 9, 10]})      # sampled 7, then three inserted ids
    batch = s.schedule()
    (work,) = batch.prefills
    assert work.token_ids == (7, 8, 9, 10) and work.start_pos == 10 and work.samples
    assert not work.reset_slot


def test_update_rejects_tokens_for_a_request_that_did_not_sample():
    s = make(num_lanes=1, prefill_chunk=64)
    s.add("a", prompt(100))
    batch = s.schedule()
    with pytest.raises(AssertionError):
        s.update(batch, {"a": [1]})


# --- fairness ---------------------------------------------------------------------------------

def test_prefill_chunks_rotate_between_long_prompts():
    s = make(num_lanes=2, prefill_chunk=64, max_batched_tokens=66, num_pages=64)
    s.add("a", prompt(640))
    s.add("b", prompt(640))
    order = []
    for _ in range(8):
        batch, _ = step(s)
        order.append(tuple(p.request_id for p in batch.prefills))
    # The budget holds one full chunk per step: a and b take turns.
    assert order == [("a",), ("b",), ("a",), ("b",), ("a",), ("b",), ("a",), ("b",)]


def test_new_short_prompt_is_served_before_a_long_one_resumes_its_turn():
    s = make(num_lanes=2, prefill_chunk=64, max_batched_tokens=66, num_pages=64)
    s.add("long", prompt(2000))
    step(s)
    step(s)
    s.add("short", prompt(20))
    batch, _ = step(s)
    assert [p.request_id for p in batch.prefills] == ["short"]
    batch, _ = step(s)
    assert [d.request_id for d in batch.decodes] == ["short"]
    assert [p.request_id for p in batch.prefills] == ["long"]


def _silence(s, names, steps):
    """Run `steps` steps; per request, the longest run of steps without a new token."""
    silent = {n: 0 for n in names}
    longest = {n: 0 for n in names}
    produced = {n: 0 for n in names}
    for _ in range(steps):
        _, new = step(s)
        for n in names:
            if n in new:
                silent[n] = 0
                produced[n] += 1
            else:
                silent[n] += 1
                longest[n] = max(longest[n], silent[n])
    return longest, produced


def test_bounded_service_turns_under_kv_pressure():
    # Two long requests, a pool that holds only one of them: they take turns.
    s = make(num_lanes=2, num_pages=4, prefill_chunk=256, service_turn_tokens=16)
    s.add("a", prompt(100))
    s.add("b", prompt(100))
    longest, produced = _silence(s, ["a", "b"], 200)     # (both stay under the pool size)
    assert produced["a"] > 60 and produced["b"] > 60
    # A turn is 16 tokens of output plus the replay that recovers the other's state.
    assert max(longest.values()) <= 16 + 1


def test_without_turns_the_oldest_would_hold_the_pool():
    s = make(num_lanes=2, num_pages=4, prefill_chunk=256, service_turn_tokens=10_000)
    s.add("a", prompt(100))
    s.add("b", prompt(100))
    longest, produced = _silence(s, ["a", "b"], 150)
    assert produced["b"] < 40 and longest["b"] > 100


def test_turns_rotate_round_robin_among_paused_sequences():
    s = make(num_lanes=3, num_pages=3, prefill_chunk=256, service_turn_tokens=8)
    for name in "abc":
        s.add(name, prompt(120))
    _, produced = _silence(s, list("abc"), 400)
    assert min(produced.values()) > 40, produced


def test_no_rotation_when_only_lanes_are_short():
    # One lane, plenty of pages: strict FIFO, b waits for a whatever a's length.
    s = make(num_lanes=1, num_pages=64, service_turn_tokens=4)
    s.add("a", prompt(10))
    s.add("b", prompt(10))
    longest, produced = _silence(s, ["a", "b"], 50)
    assert produced["b"] == 0 and s.total_preemptions == 0


# --- preemption -------------------------------------------------------------------------------

def _fill(s, rid, target_len):
    while len(s.get(rid).token_ids) < target_len:
        step(s)


def test_preemption_pauses_the_youngest_and_replays_without_loss():
    # 4 pages = 256 tokens. a (old) and b (young) both grow; b is paused when a needs a page.
    s = make(num_lanes=2, num_pages=4, prefill_chunk=256)
    s.add("a", prompt(120))
    s.add("b", prompt(120))
    step(s)
    assert s.pages.num_free == 0
    # a and b each hold 2 pages and decode until position 128 needs a third page.
    preempted = []
    for _ in range(12):
        batch, _ = step(s)
        preempted.extend(batch.preempted)
        if preempted:
            break
    assert preempted == ["b"]
    b = s.get("b")
    assert b.status is SeqStatus.PAUSED and b.page_table == [] and b.slot is None
    committed_b = list(b.token_ids)
    assert b.num_output > 0
    # a runs alone until it finishes; then b resumes by replaying every committed token.
    s.finish("a")
    batch, _ = step(s)
    assert batch.admitted == ("b",)
    replayed = []
    while True:
        replayed.extend(t for p in batch.prefills for t in p.token_ids)
        if batch.decodes:
            break
        batch, _ = step(s)
    assert replayed == committed_b                   # the whole sequence, exactly once
    assert s.get("b").token_ids[:len(committed_b)] == committed_b
    # Every token but the last sampled one had been computed before the pause.
    assert s.get("b").replayed_tokens == len(committed_b) - 1
    assert s.get("b").preemptions == 1


def test_replay_samples_exactly_one_new_token():
    s = make(num_lanes=1, num_pages=8)
    s.add("a", prompt(30))
    for _ in range(5):
        step(s)
    before = list(s.get("a").token_ids)
    assert s.preempt("a")
    batch, new = step(s)
    (work,) = batch.prefills
    assert work.reset_slot and work.replay and work.samples
    assert list(work.token_ids) == before
    assert s.get("a").token_ids == before + new["a"]


def test_lone_sequence_that_outgrows_the_pool_fails_with_context():
    s = make(num_lanes=1, num_pages=2, max_context=4096)
    s.add("a", prompt(120))
    failed = []
    for _ in range(20):
        batch, _ = step(s)
        failed.extend(batch.failed)
        if failed:
            break
    assert failed == [("a", FinishReason.CONTEXT)]
    assert "a" not in s and s.pages.num_free == 2 and s.slots.num_free == 1


def test_young_sequence_pauses_itself_when_only_older_ones_remain():
    s = make(num_lanes=2, num_pages=3, prefill_chunk=256)
    s.add("a", prompt(60))
    s.add("b", prompt(100))
    batch, _ = step(s)
    assert len(batch.prefills) == 2 and s.pages.num_free == 0
    # a needs a page at position 64 after 4 decodes: b (younger) is preempted for it.
    for _ in range(6):
        batch, _ = step(s)
        if batch.preempted:
            break
    assert batch.preempted == ("b",)
    assert [d.request_id for d in batch.decodes] == ["a"]


# --- random mixes: no page or lane is ever leaked --------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_random_mix_of_finish_cancel_preempt_leaks_nothing(seed):
    rng = random.Random(seed)
    s = make(num_lanes=rng.randint(1, 8), num_pages=rng.randint(6, 24),
             prefill_chunk=rng.choice([64, 128]), max_context=2048,
             max_waiting=rng.randint(0, 6))
    lengths = {}
    names = iter(f"r{i}" for i in range(10_000))
    outputs = {}
    for _ in range(400):
        action = rng.random()
        if action < 0.25:
            name = next(names)
            try:
                s.add(name, prompt(rng.randint(1, 200)))
                lengths[name] = rng.randint(1, 80)
                outputs[name] = []
            except RequestRejected as exc:
                assert exc.code in ("queue_full", "kv_capacity_exceeded")
        elif action < 0.30 and s.running_ids():
            s.finish(rng.choice(s.running_ids()))        # cancel while running
        elif action < 0.33 and s.waiting_ids():
            s.finish(rng.choice(s.waiting_ids()))        # cancel while queued
        elif action < 0.36 and s.running_ids():
            s.preempt(rng.choice(s.running_ids()))
        batch = s.schedule()
        new = {}
        for rid in batch.sampling_requests():
            token = rng.randint(0, 999)
            new[rid] = [token]
            outputs[rid].append(token)
        s.update(batch, new)
        for rid, _ in batch.failed:
            assert rid not in s
        for rid in list(new):
            seq = s.get(rid)
            # Committed output equals what was sampled: nothing lost, nothing duplicated.
            assert seq.token_ids[seq.prompt_len:] == outputs[rid]
            if seq.num_output >= lengths[rid]:
                s.finish(rid)
        s.check_invariants()
    for rid in list(s.running_ids()) + list(s.waiting_ids()):
        s.finish(rid)
    s.check_invariants()
    assert s.pages.num_free == s.config.num_pages
    assert s.slots.num_free == s.config.num_lanes


def test_everything_finishes_under_pressure():
    """Eight requests on a tight pool all complete (preempted ones resume and finish)."""
    s = make(num_lanes=4, num_pages=6, prefill_chunk=64, max_context=1024)
    targets = {}
    for i in range(8):
        s.add(f"r{i}", prompt(40 + 10 * i))
        targets[f"r{i}"] = 60
    done = set()
    for _ in range(5000):
        if not s.has_work():
            break
        batch, new = step(s)
        for rid, _ in batch.failed:
            done.add(rid)
        for rid in new:
            if s.get(rid).num_output >= targets[rid]:
                s.finish(rid)
                done.add(rid)
    assert done == set(targets)
    assert s.total_preemptions > 0
    assert s.pages.num_free == 6


def test_pages_for():
    assert [pages_for(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]
    assert PAGE_SIZE == 64


# --- request invariance --------------------------------------------------------------------------

def _chunks_of(s: Scheduler, name: str, steps: int) -> list[tuple[int, int]]:
    """(start, length) of every prefill chunk of `name` over `steps` steps."""
    chunks = []
    for _ in range(steps):
        batch, _ = step(s)
        chunks += [(p.start_pos, len(p.token_ids)) for p in batch.prefills if p.request_id == name]
    return chunks


def test_prefill_chunks_lie_on_an_absolute_grid_whatever_runs_beside():
    alone = make(num_lanes=4, prefill_chunk=128, num_pages=128)
    alone.add("x", prompt(700))
    want = _chunks_of(alone, "x", 12)
    assert want == [(0, 128), (128, 128), (256, 128), (384, 128), (512, 128), (640, 60)]

    # Beside two decoding sequences and another long prompt taking turns, with a budget that
    # holds one whole chunk: x waits for turns but is cut exactly as alone.
    busy = make(num_lanes=4, prefill_chunk=128, num_pages=128, max_batched_tokens=132)
    busy.add("d1", prompt(30))
    busy.add("d2", prompt(90))
    step(busy)
    busy.add("other", prompt(500, base=7))
    busy.add("x", prompt(700))
    assert _chunks_of(busy, "x", 40) == want


def test_a_budget_below_one_chunk_beside_every_lane_is_refused():
    with pytest.raises(ValueError, match="at least prefill_chunk \\+ num_lanes"):
        make(num_lanes=2, prefill_chunk=64, max_batched_tokens=65)
