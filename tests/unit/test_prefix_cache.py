"""The prefix cache in the scheduler, driven by hand-made steps (no runner): snapshot stops on
the chunk grid, shared pages on resume, the queued copies, and no leak under pressure."""

from __future__ import annotations

import random

import pytest

from runtime.engine.cache_ops import CopySlot, LoadPages, LoadSlot, SavePages, SaveSlot
from runtime.engine.kv_blocks import block_hashes, decoded_hash
from runtime.engine.prefix_cache import PrefixCacheConfig
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence_cache import block_stops
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


def chunk_cuts(s: Scheduler, steps=8) -> list[tuple[int, int]]:
    """The prefill chunks (start, tokens) `steps` schedules of `s` run, each sampling token 1."""
    chunks = []
    for _ in range(steps):
        batch = s.schedule()
        if s.cache is not None:
            s.cache.cache.take_ops()
        chunks += [(p.start_pos, p.num_tokens) for p in batch.prefills]
        s.update(batch, {rid: [1] for rid in batch.sampling_requests()})
    return chunks


def test_block_stops_round_hints_down_to_the_block():
    # 150 -> 128, 300 -> 256, 130 and 128 -> 128 (once), 64 stays, 63 and 0 are dropped
    # (below one block), sorted.
    assert block_stops((300, 150, 63, 0, 64, 130, 128)) == (64, 128, 256)
    assert block_stops((10, 63)) == () and block_stops(()) == ()
    assert block_stops((4096, 4095)) == (4032, 4096)          # 4095 -> 4032
    # The scheduler keeps the rounded stops on the record.
    s = make()
    assert s.add("x", prompt(300), snapshot_positions=(150, 20, 140)).snapshot_positions == (128,)


def test_a_hinted_chunk_stop_lands_on_the_rounded_position():
    # No interval and one chunk of the grid (512) for the whole prompt: the only cut inside the
    # 300 tokens is the hint, 150 -> 128; then the prompt's end.
    s = make(prefill_chunk=512, snapshot_interval=0)
    s.add("x", prompt(300), snapshot_positions=(150,))
    assert chunk_cuts(s) == [(0, 128), (128, 172)]
    # Snapshot at the stop 128; not at the prompt end (300 is not a multiple of 64).
    assert sorted(e.position for e in s.cache.cache.entries()) == [128]


def test_chunks_end_at_hints_and_interval_multiples_with_the_cache_on_or_off():
    cuts = []
    for cache in (True, False):
        s = make() if cache else Scheduler(SchedulerConfig(num_lanes=2, num_pages=64,
                                                           max_context=4096, prefill_chunk=128,
                                                           snapshot_interval=256))
        s.add("x", prompt(600), snapshot_positions=(100, 300))
        cuts.append(chunk_cuts(s))
    # Hints 100 -> 64 and 300 -> 256; interval multiples 256 and 512; the 128-token grid;
    # the prompt end 600.
    assert cuts[0] == cuts[1] == [(0, 64), (64, 64), (128, 128), (256, 128), (384, 128),
                                  (512, 88)]


def test_snapshots_are_taken_at_stops_and_not_at_the_end():
    s = make()
    ops = []
    s.add("a", prompt(300), snapshot_positions=(100, 200))
    run_until_decoding(s, "a", ops)
    positions = sorted(e.position for e in s.cache.cache.entries())
    # Hints 100 -> 64 and 200 -> 192, the interval multiple 256; not the prompt end (300 is
    # not a multiple of 64).
    assert positions == [64, 192, 256]
    for _ in range(3):
        step(s, ops)
    computed = s.get("a").num_computed
    assert computed == 300 + 3                   # three decode steps past the prompt
    finish(s, "a", ops)
    # The state after the answer came from decode steps, not prefill: it is not kept.
    positions = sorted(e.position for e in s.cache.cache.entries())
    assert positions == [64, 192, 256] and computed not in positions
    # Each snapshot: the lane copied into a snapshot slot (two of them); once they are full,
    # the deepest (256, worth most) takes the slot of the least worth (64), whose state is
    # saved to the host first. Every snapshot ends a block: no partial page to save.
    assert [type(op) for op in ops] == [CopySlot, CopySlot, SaveSlot, CopySlot]
    assert SavePages not in map(type, ops)
    assert all(e.tail == () and e.tail_copy is None for e in s.cache.cache.entries())
    assert ops[2].slot == ops[0].dst and ops[3] == ops[0]
    on_host = [e.position for e in s.cache.cache.entries() if e.slot is None]
    assert on_host == [64]


def test_a_resume_maps_the_published_pages_and_computes_its_partial_block_itself():
    s = make()
    ops = []
    # a hints its 200 (a turn start, as the server gives): 200 -> stop 192.
    s.add("a", prompt(200), snapshot_positions=(200,))
    run_until_decoding(s, "a", ops)
    a_table = list(s.get("a").page_table)
    # Kept: 192; a's prompt end (200, not a multiple of 64) is never captured.
    assert [e.position for e in s.cache.cache.entries()] == [192]
    # b shares a's 200 tokens and hints nothing (its own stops: none below its 250 tokens,
    # the interval is 256): the aligned snapshot at 192 is usable by any prompt sharing it.
    s.add("b", prompt(200) + prompt(50, base=500))
    ops.clear()
    step(s, ops)
    b = s.get("b")
    assert b.resume_path == "prefix" and b.cached_tokens == 192
    # Blocks 0..2 (192 tokens) are a's published pages, shared; block 3 is b's own page, with
    # nothing loaded into it (b computes 192..249 itself).
    assert b.page_table[:3] == a_table[:3]
    assert all(s.pages.users(p) == {"a", "b"} for p in a_table[:3])
    assert b.page_table[3] != a_table[3] and s.pages.writable(b.page_table[3], "b")
    restores = [op for op in ops if isinstance(op, (LoadPages, CopySlot, LoadSlot))]
    assert len(restores) == 1 and not any(isinstance(op, LoadPages) for op in ops)
    assert restores[0] == CopySlot(2, b.slot) or isinstance(restores[0], LoadSlot)
    assert s.cache.cache.stats["hits"] == 1 and s.cache.cache.stats["hit_tokens"] == 192
    assert s.cache.cache.stats["misses"] == 1                    # a


def test_a_block_holding_decoded_positions_is_published_where_no_prompt_finds_it():
    s = make()
    ops = []
    s.add("a", prompt(100))
    run_until_decoding(s, "a", ops)
    while s.get("a").num_computed < 128:       # decode until block 1 (64..127) is full
        step(s, ops)
    a = s.get("a")
    ids = list(a.token_ids)
    as_prompt = block_hashes(ids[:128])        # what a prompt of these tokens would look up
    # Block 0 is all prompt: its chain hash. Block 1 holds decoded positions (100..127):
    # published under decoded_hash, which no prompt's chain hash equals.
    assert a.block_digests[0] == as_prompt[0]
    assert a.block_digests[1] == decoded_hash(as_prompt[0], ids[64:128]) != as_prompt[1]
    assert s.pages.lookup(a.block_digests[1]) == a.page_table[1]
    finish(s, "a", ops)
    assert s.pages.lookup(as_prompt[0]) is not None and s.pages.lookup(as_prompt[1]) is None


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

    serve = prefix_cache_settings(parse_settings("serve", ["m.infernix"]))
    assert serve == {"prefix_cache": True, "snapshot_slots": 8, "host_cache_bytes": 8192 << 20,
                     "snapshot_interval": 8192, "cache_file": None, "cache_save_s": 0.0,
                     "ssd_bytes": 0, "ssd_dir": None}
    off = prefix_cache_settings(parse_settings("serve", [
        "m.infernix", "--no-prefix-cache", "--prefix-cache-file", "c.npz",
        "--prefix-cache-save-mins", "5"]))
    assert off["prefix_cache"] is False and off["cache_file"] == "c.npz"
    assert off["cache_save_s"] == 300.0
    cli = prefix_cache_settings(parse_settings("cli", ["m.infernix", "--prompt", "hi"]))
    assert cli["prefix_cache"] is False and cli["snapshot_slots"] == 0
    assert cli["host_cache_bytes"] == 0 and cli["cache_file"] is None
