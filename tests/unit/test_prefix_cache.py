"""The prefix cache in the scheduler, driven by hand-made steps (no runner): snapshot stops on
the chunk grid, shared pages on resume, the queued copies, and no leak under pressure."""

from __future__ import annotations

import random

import pytest

from runtime.engine.cache_ops import CopySlot, LoadPages, LoadSlot, SavePages, SaveSlot
from runtime.engine.prefix_cache import PrefixCacheConfig
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.session import turn_starts

PAGE_BYTES, SLOT_BYTES = 1000, 5000


def make(num_pages=64, snapshot_slots=(2, 3), host_bytes=100_000, reuse=True, **kw):
    cache = PrefixCacheConfig(reuse=reuse, snapshot_slots=snapshot_slots, host_bytes=host_bytes,
                              slot_nbytes=SLOT_BYTES, page_nbytes=PAGE_BYTES)
    base = dict(num_lanes=2, num_pages=num_pages, max_context=4096, prefill_chunk=128,
                snapshot_interval=256, prefix_cache=cache)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def step(s: Scheduler, ops: list):
    batch = s.schedule()
    ops += s.cache.cache.take_ops()
    new = {rid: [7000 + s.get(rid).num_output] for rid in batch.sampling_requests()}
    s.update(batch, new)
    ops += s.cache.cache.take_ops()
    s.check_invariants()
    return batch


def finish(s: Scheduler, rid: str, ops: list) -> None:
    s.finish(rid)
    ops += s.cache.cache.take_ops()
    s.check_invariants()


def prompt(n, base=0):
    return [base + i % 97 for i in range(n)]


def run_until_decoding(s, rid, ops, steps=20):
    for _ in range(steps):
        step(s, ops)
        if s.get(rid).num_output > 0:
            return


def test_chunks_end_at_hints_and_interval_multiples_with_the_cache_on_or_off():
    cuts = []
    for cache in (True, False):
        s = make() if cache else Scheduler(SchedulerConfig(num_lanes=2, num_pages=64,
                                                           max_context=4096, prefill_chunk=128,
                                                           snapshot_interval=256))
        s.add("x", prompt(600), snapshot_positions=(100, 300))
        chunks = []
        for _ in range(8):
            batch = s.schedule()
            if s.cache is not None:
                s.cache.cache.take_ops()
            chunks += [(p.start_pos, p.num_tokens) for p in batch.prefills]
            s.update(batch, {rid: [1] for rid in batch.sampling_requests()})
        cuts.append(chunks)
    assert cuts[0] == cuts[1] == [(0, 100), (100, 28), (128, 128), (256, 44), (300, 84),
                                  (384, 128), (512, 88)]


def test_snapshots_are_taken_at_stops_and_at_the_end():
    s = make()
    ops = []
    s.add("a", prompt(300), snapshot_positions=(100,))
    run_until_decoding(s, "a", ops)
    positions = sorted(e.position for e in s.cache.cache.entries())
    assert positions == [100, 256, 300]          # hint, interval multiple, prompt end
    for _ in range(3):
        step(s, ops)
    finish(s, "a", ops)
    positions = sorted(e.position for e in s.cache.cache.entries())
    assert positions == [100, 256, 300, 303]     # the end: after its last computed token
    # Each snapshot: the lane copied into a snapshot slot (two of them), or saved to the host
    # once they are full, and its partial page saved to the host.
    assert [type(op) for op in ops].count(SavePages) == 3        # 100, 300, 303 have a tail
    assert {type(op) for op in ops} == {CopySlot, SaveSlot, SavePages}


def test_a_resume_maps_the_published_pages_and_copies_the_tail_privately():
    s = make()
    ops = []
    s.add("a", prompt(200))
    run_until_decoding(s, "a", ops)
    a_table = list(s.get("a").page_table)
    s.add("b", prompt(200) + prompt(50, base=500))
    ops.clear()
    step(s, ops)
    b = s.get("b")
    assert b.resume_path == "prefix" and b.cached_tokens == 200
    # Blocks 0..2 (192 tokens) are a's published pages, shared; block 3 is b's own copy.
    assert b.page_table[:3] == a_table[:3]
    assert all(s.pages.users(p) == {"a", "b"} for p in a_table[:3])
    assert b.page_table[3] != a_table[3] and s.pages.writable(b.page_table[3], "b")
    restores = [op for op in ops if isinstance(op, (LoadPages, CopySlot, LoadSlot))]
    assert isinstance(restores[0], LoadPages) and restores[0].pages == (b.page_table[3],)
    assert restores[1] == CopySlot(2, b.slot) or isinstance(restores[1], LoadSlot)
    assert s.cache.cache.stats["hits"] == 1 and s.cache.cache.stats["hit_tokens"] == 200


def test_without_reuse_a_prompt_starts_cold_but_a_pause_keeps_its_state():
    s = make(reuse=False, num_pages=4, service_turn_tokens=4)
    ops = []
    s.add("a", prompt(120))
    s.add("b", prompt(120))
    for _ in range(12):
        step(s, ops)
    s.add("c", prompt(120))
    for _ in range(40):
        step(s, ops)
    assert not any(e.owner is None for e in s.cache.cache.entries())
    assert s.cache.cache.stats["pauses_saved"] > 0
    assert s.cache.cache.stats["hits"] == 0
    paths = {s.get(r).resume_path for r in ("a", "b", "c") if r in s}
    assert "snapshot" in paths


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_a_small_pool_leaks_nothing(seed):
    rng = random.Random(seed)
    s = make(num_pages=12, snapshot_slots=(2,), host_bytes=12 * PAGE_BYTES + SLOT_BYTES,
             service_turn_tokens=8)
    ops = []
    prefixes = [prompt(130, base=b) for b in (0, 200, 400)]
    names = iter(f"r{n}" for n in range(10_000))
    for _ in range(300):
        if rng.random() < 0.3 and s.num_waiting < 3:
            body = rng.choice(prefixes) + prompt(rng.randrange(1, 120), base=rng.randrange(900))
            s.add(next(names), body, snapshot_positions=(130,))
        running = s.running_ids()
        if running and rng.random() < 0.15:
            finish(s, rng.choice(running), ops)
        step(s, ops)
        for rid in list(s.running_ids()):
            if s.get(rid).num_output >= 20:
                finish(s, rid, ops)
    for rid in list(s.running_ids()) + s.waiting_ids():
        finish(s, rid, ops)
    assert s.pages.num_used == 0 and s.pages.num_free == 12
    assert s.cache.cache.stats["hits"] > 0 and s.pages.evictions > 0
    s.cache.check()


def test_turn_starts_are_the_last_message_markers():
    im = 9
    ids = [im, 1, 2, im, 3, im, 4, 5, im, 6, im, 7]
    assert turn_starts(ids, im) == (3, 5, 8, 10)
    assert turn_starts([im, 1, 2], im) == ()


def test_admission_waits_for_room_for_the_whole_prompt_instead_of_thrashing():
    # Six pages hold one 250-token prompt (4 pages) and its output, not two prompts.
    s = Scheduler(SchedulerConfig(num_lanes=2, num_pages=6, max_context=1024, prefill_chunk=128,
                                  service_turn_tokens=1000))
    s.add("a", prompt(250))
    s.add("b", prompt(250, base=1))
    admitted, preempted = [], 0
    for _ in range(8):
        batch = s.schedule()
        admitted += batch.admitted
        preempted += len(batch.preempted)
        s.update(batch, {rid: [1] for rid in batch.sampling_requests()})
        s.check_invariants()
    # b would fit its first chunk beside a's, then one of them would have to pause.
    assert admitted == ["a"] and preempted == 0 and s.waiting_ids() == ["b"]
    s.finish("a")
    batch = s.schedule()
    assert batch.admitted == ("b",)


def test_the_server_has_the_cache_and_the_cli_does_not():
    from runtime.config import parse_settings
    from runtime.session import prefix_cache_settings

    class Log:
        def info(self, *args):
            self.said = args

    serve = prefix_cache_settings(parse_settings("serve", ["m.infernix"]), "cpu", Log())
    assert serve == {"prefix_cache": True, "snapshot_slots": 8, "host_cache_bytes": 1024 << 20,
                     "snapshot_interval": 2048, "cache_file": None, "cache_save_s": 0.0,
                     "ssd_bytes": 0, "ssd_dir": None}
    off = prefix_cache_settings(parse_settings("serve", [
        "m.infernix", "--no-prefix-cache", "--prefix-cache-file", "c.npz",
        "--prefix-cache-save-mins", "5"]), "cpu", Log())
    assert off["prefix_cache"] is False and off["cache_file"] == "c.npz"
    assert off["cache_save_s"] == 300.0
    cli = prefix_cache_settings(parse_settings("cli", ["m.infernix", "--prompt", "hi"]), "cpu",
                                Log())
    assert cli["prefix_cache"] is False and cli["snapshot_slots"] == 0
    assert cli["host_cache_bytes"] == 0 and cli["cache_file"] is None
    log = Log()
    cuda = prefix_cache_settings(parse_settings("serve", ["m.infernix"]), "cuda", log)
    assert cuda["prefix_cache"] is False and "off on --device cuda" in log.said[0]
