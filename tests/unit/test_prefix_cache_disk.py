"""The prefix cache's disk tier (`runtime.engine.disk_tier`) and the idle periodic save, on the
NumPy runner (tiny model): a conversation pushed out of a tiny host tier resumes from disk with
ids equal to the cache off; a corrupt or deleted file is a miss with one warning; the cap, the
write budget (an injected clock) and GDSF on disk; the startup errors of the options."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.cache_file import read_manifest
from runtime.engine.cache_ops import HostCopy, SpillSnapshot
from runtime.engine.disk_tier import DiskTier, DiskTierConfig, WriteBudget
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.kv_blocks import block_hashes
from runtime.engine.prefix_cache import snapshot_key
from test_engine_fakes import RecordingLog

GREEDY = SamplingParams(greedy=True)
BASE = dict(num_lanes=2, max_context=1024, prefill_chunk=128, snapshot_interval=64)
# No device snapshot slots and a 256 KiB host tier (two snapshots with their tail pages): the
# snapshots of one conversation are pushed to disk by the next unrelated prompt.
TINY_HOST = dict(prefix_cache=True, snapshot_slots=0, host_cache_bytes=256 << 10,
                 cache_fingerprint="tiny-dense;v1")


@pytest.fixture(scope="module")
def make_runner(tiny_dense_path):
    from runtime.artifact import open_artifact
    from runtime.model.numpy_runner import NumpyRunner

    artifact = open_artifact(tiny_dense_path)

    def make(num_pages=48):
        return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=6)

    yield make
    artifact.close()


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 440, n)]


def run(engine, rid, prompt, max_new=10, **kw):
    outputs = list(engine.submit(EngineRequest(rid, tuple(prompt), GREEDY, max_new, **kw)))
    return [t for o in outputs for t in o.token_ids], outputs[-1]


def ixc_files(directory) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(directory) if e.name.endswith(".ixc")}


def conversation(make_runner, ssd_dir, before_turn_two=None):
    """Turn one (150 tokens), an unrelated 400-token prompt that pushes turn one's snapshots
    and blocks out of the host tier (8 pages), then turn two, hinting its turn start (turn
    one's prompt end, as the server does) in the cache and the cold run alike.
    before_turn_two(history, turn_start, engine) runs before turn two (given turn one's prompt
    and answer, the hint and the engine): it damages the disk tier or looks at it. Returns
    turn two's final output, the engine's numbers, the warnings and the resume position
    without damage (the hint rounded down to the block, 150 -> 128: turn one's prompt end is
    not a multiple of 64 and is not captured; the answer's state came from decode steps and is
    not kept)."""
    first, other = tokens(1, 150), tokens(2, 400)
    hint = (len(first),)
    log = RecordingLog()
    config = EngineConfig(**BASE, **TINY_HOST, ssd_bytes=4 << 20, ssd_dir=str(ssd_dir))
    with Engine(make_runner(8), config, logger=log) as engine:
        answer, _ = run(engine, "a", first)
        run(engine, "b", other)
        history = first + answer
        if before_turn_two is not None:
            before_turn_two(history, hint[0], engine)
        follow = history + tokens(3, 30)
        ids, final = run(engine, "c", follow, snapshot_positions=hint)
        engine.scheduler.check_invariants()
        engine.cache.disk.check()
        numbers = engine.snapshot()
    with Engine(make_runner(), EngineConfig(**BASE)) as cold:
        expected, _ = run(cold, "c", follow, snapshot_positions=hint)
    assert ids == expected
    return final, numbers, log.warnings, len(first) // 64 * 64


def positions_of(engine, token_ids) -> list[int]:
    """The positions of the shared snapshots of prefixes of `token_ids`, in memory (device or
    host) and on disk."""
    found = [*(e for e in engine.scheduler.cache.cache.entries() if e.owner is None),
             *engine.cache.disk._snapshots.values()]
    return sorted(s.position for s in found
                  if s.chain == tuple(block_hashes(token_ids[:s.position]))
                  and s.tail == tuple(token_ids[s.position // 64 * 64:s.position]))


def test_a_conversation_pushed_to_disk_resumes_from_it(make_runner, tmp_path):
    stale = tmp_path / "snapshot-0123.ixc"
    stale.write_bytes(b"an earlier run's file")
    keep = tmp_path / "notes.txt"
    keep.write_text("not the disk tier's")
    seen = {}

    def look(history, turn_start, engine):
        seen["positions"] = positions_of(engine, history)
        seen["answer_end"] = len(history) - 1      # the last token computed by turn one

    final, numbers, warnings, resume_at = conversation(make_runner, tmp_path, look)
    # Of turn one, its prefill stops are kept (the multiples of 64 below 150), not its prompt
    # end (150 is not a multiple of 64), nor the state after its answer (decode steps
    # computed it).
    assert seen["positions"] == [64, 128]
    assert 150 not in seen["positions"]
    assert seen["answer_end"] == 159 and 159 not in seen["positions"]
    # Turn two resumes at its hinted turn start rounded down (150 -> 128) and prefills the
    # rest of turn one's prompt (22 tokens) and its 10-token answer again with its own 30.
    assert final.cached_prompt_tokens == resume_at == 128
    assert final.stats.resume_path == "prefix" and final.stats.prefilled_tokens == 22 + 10 + 30
    assert warnings == []
    assert numbers["prefix_cache_ssd_hits_total"] == 1
    assert numbers["prefix_cache_hits_total"] == 1
    # Read: the snapshot file (the state; 128 ends a block: no tail page) and the one block
    # evicted from the pool, with their headers.
    assert 58368 + 65536 < numbers["prefix_cache_ssd_bytes_read_total"] < 58368 + 2 * 65536
    assert numbers["prefix_cache_ssd_bytes_written_total"] >= numbers["prefix_cache_ssd_bytes"]
    assert numbers["prefix_cache_ssd_bytes"] == sum(ixc_files(tmp_path).values())
    assert numbers["prefix_cache_ssd_read_failures_total"] == 0
    assert not stale.exists() and keep.read_text() == "not the disk tier's"


@pytest.mark.parametrize("how", ["corrupt", "deleted"])
def test_a_bad_disk_file_is_a_miss_with_one_warning(make_runner, tmp_path, how):
    def damage(history, turn_start, engine):
        # The snapshot turn two would resume from: at its hinted turn start rounded down to
        # the block (150 -> 128; no tail).
        stop = turn_start // 64 * 64
        name = snapshot_key(tuple(block_hashes(history[:stop])), ())
        path = tmp_path / f"snapshot-{name}.ixc"
        if how == "deleted":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))

    final, numbers, warnings, resume_at = conversation(make_runner, tmp_path, damage)
    assert len(warnings) == 1, warnings
    assert ("corrupt (checksum)" if how == "corrupt" else "unreadable") in warnings[0]
    assert numbers["prefix_cache_ssd_read_failures_total"] == 1
    # The next deepest snapshot of turn two's prefix is the block before (64), from disk too.
    assert final.cached_prompt_tokens == resume_at - 64 == 64
    assert numbers["prefix_cache_ssd_hits_total"] == 1


def test_a_deleted_block_file_drops_the_snapshots_that_need_it(make_runner, tmp_path):
    deleted = []

    def damage(history, turn_start, engine):
        # The blocks of the previous turn in neither the pool nor the host tier: disk only.
        cache, pages = engine.scheduler.cache.cache, engine.scheduler.pages
        for digest in block_hashes(history):
            if pages.lookup(digest) is None and cache.host_block(digest) is None:
                (tmp_path / f"block-{digest.hex()}.ixc").unlink()
                deleted.append(digest)

    final, numbers, warnings, resume_at = conversation(make_runner, tmp_path, damage)
    assert len(deleted) == 1                      # the second block (positions 64..127)
    assert len(warnings) == 1 and "unreadable" in warnings[0] and deleted[0].hex() in warnings[0]
    assert numbers["prefix_cache_ssd_read_failures_total"] == 1
    # Every snapshot past that block went with it; the one at 64 (block one only) is read.
    assert final.cached_prompt_tokens == 64 < resume_at
    assert numbers["prefix_cache_ssd_hits_total"] == 1


# --- the disk tier alone: cap, GDSF and write budget, with host copies as sources ----------

SLOT, PAGE = 1024, 2048


def disk_tier(directory, cap_bytes=1 << 20, per_hour=1 << 30, clock=lambda: 0.0):
    config = DiskTierConfig(directory=str(directory), cap_bytes=cap_bytes,
                            write_bytes_per_hour=per_hour, fingerprint="test;v1",
                            slot_nbytes=SLOT, page_nbytes=PAGE)
    return DiskTier(config, warn=lambda message: None, clock=clock)


def spill_record(seed: int, position: int) -> SpillSnapshot:
    """A snapshot of `position` tokens whose state, tail and blocks are host copies."""
    ids = tokens(seed, position)
    chain = tuple(block_hashes(ids))
    tail = tuple(ids[len(chain) * 64:])
    fill = np.full(SLOT // 4, seed, np.float32)
    return SpillSnapshot(
        name=snapshot_key(chain, tail), position=position, chain=chain, tail=tail, hits=0,
        slot=None, state=HostCopy.of((fill,)),
        tail_copy=HostCopy.of((np.zeros(PAGE // 4, np.float32),)) if tail else None,
        blocks=tuple(HostCopy.of((np.full(PAGE // 4, i, np.float32),))
                     for i in range(len(chain))))


def test_the_disk_cap_holds_and_gdsf_evicts_the_least_worth(tmp_path):
    # A snapshot of 100-300 tokens: one state (1 KiB), a tail page and 1-4 blocks (2 KiB
    # each), with their headers: 5-12 KiB. The cap holds two or three.
    disk = disk_tier(tmp_path, cap_bytes=24 << 10)
    for n, position in enumerate((100, 150, 200, 260, 300)):
        disk.spill(None, spill_record(n, position))
        disk.check()
        assert sum(ixc_files(tmp_path).values()) == disk.used <= 24 << 10
    # The fewest tokens per byte go first: 100 and 150 for 260, then 200 for 300.
    assert sorted(item.position for item in disk._snapshots.values()) == [260, 300]
    assert disk.stats["ssd_evictions"] == 3
    # Worth less than everything on disk (few tokens, the clock has risen): not written.
    written = disk.stats["ssd_bytes_written"]
    disk.spill(None, spill_record(9, 10))
    assert disk.stats["ssd_writes_dropped"] == 1 and disk.stats["ssd_bytes_written"] == written
    # Writing the same snapshot again writes nothing (SSD wear).
    disk.spill(None, spill_record(4, 300))
    assert disk.stats["ssd_bytes_written"] == written


def test_the_write_budget_drops_writes_beyond_an_hour_s_bytes():
    now = [0.0]
    budget = WriteBudget(per_hour=1000, clock=lambda: now[0])
    assert budget.allows(600)
    budget.take(600)
    now[0] = 1800.0
    assert budget.allows(400) and not budget.allows(401)
    budget.take(400)
    now[0] = 3599.0
    assert not budget.allows(1)                  # 1000 bytes in the trailing hour
    now[0] = 3600.0
    assert budget.allows(600) and not budget.allows(601)  # the first write left the window
    assert budget.used == 400


def test_the_disk_tier_drops_a_spill_over_its_write_budget(tmp_path):
    now = [0.0]
    record = spill_record(0, 130)                # a state, a tail page, two blocks
    size = 1024 + 3 * 2048
    disk = disk_tier(tmp_path, per_hour=int(2.5 * (size + 600)), clock=lambda: now[0])
    for seed in (0, 1, 2):
        disk.spill(None, spill_record(seed, 130))
    assert disk.stats["ssd_writes_dropped"] == 1 and len(disk._snapshots) == 2
    assert disk.stats["ssd_bytes_written"] == disk.used == sum(ixc_files(tmp_path).values())
    now[0] = 3600.0                               # an hour later the budget is back
    disk.spill(None, spill_record(2, 130))
    assert len(disk._snapshots) == 3 and disk.stats["ssd_writes_dropped"] == 1
    assert record.name in disk._snapshots


# --- options -------------------------------------------------------------------------------

def test_bad_disk_tier_options_are_startup_errors(tmp_path):
    from runtime.config import ConfigError, parse_settings
    from runtime.session import prefix_cache_settings

    def settings(*args):
        return prefix_cache_settings(parse_settings("serve", ["m.infernix", *args]))

    good = settings("--ssd-context-gib", "2", "--ssd-context-dir", str(tmp_path))
    assert (good["ssd_bytes"], good["ssd_dir"], good["ssd_write_bytes_per_hour"]) == (
        2 << 30, str(tmp_path), 8 << 30)
    budget = settings("--ssd-context-gib", "2", "--ssd-context-dir", str(tmp_path),
                      "--ssd-context-gib-per-hour", "1")
    assert budget["ssd_write_bytes_per_hour"] == 1 << 30
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = {("--ssd-context-gib", "2"): "needs --ssd-context-dir",
             ("--ssd-context-dir", str(tmp_path)): "give its size with --ssd-context-gib",
             ("--ssd-context-gib", "2", "--ssd-context-dir", str(tmp_path / "missing")):
                 "is not a directory",
             ("--ssd-context-gib", "2", "--ssd-context-dir", str(a_file)): "is not a directory",
             ("--ssd-context-gib", "2", "--ssd-context-dir", str(tmp_path),
              "--no-prefix-cache"): "--no-prefix-cache turns off"}
    for args, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            settings(*args)


def test_an_unwritable_disk_tier_directory_is_a_startup_error(tmp_path, monkeypatch):
    from runtime.config import ConfigError, parse_settings
    from runtime.session import prefix_cache_settings

    # Root may write anywhere, so the permission answer is what this test controls.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="is not writable"):
        prefix_cache_settings(parse_settings("serve", [
            "m.infernix", "--ssd-context-gib", "1", "--ssd-context-dir", str(tmp_path)]))


# --- the periodic file-tier save of an idle engine ----------------------------------------

def saved_positions(path) -> list[int]:
    """The snapshot positions in a prefix-cache file (none while it does not exist)."""
    if not path.exists():
        return []
    return [record["position"] for record in read_manifest(path)["snapshots"]]


def test_an_idle_engine_writes_the_periodic_save_without_a_new_request(make_runner, tmp_path):
    path = tmp_path / "prefix.cache"
    prompt = tokens(15, 180)
    config = EngineConfig(**BASE, prefix_cache=True, snapshot_slots=4, host_cache_bytes=64 << 20,
                          cache_file=str(path), cache_fingerprint="tiny-dense;v1",
                          cache_save_s=0.2)
    with Engine(make_runner(), config) as engine:
        ids, _ = run(engine, "a", prompt)
        # The next turn hints its turn start (a's prompt end, 180 -> 128), is 256 tokens long
        # (a prompt end that is a multiple of 64 is captured) and samples one token, so its
        # prompt-end snapshot is taken in its last step (the chunk that samples that token);
        # only a save that runs while the engine is idle (before shutdown, which also saves)
        # holds it.
        follow = prompt + ids + tokens(16, 256 - len(prompt) - len(ids))
        assert len(follow) == 256
        last, _ = run(engine, "b", follow, 1, snapshot_positions=(len(prompt),))
        deadline = time.monotonic() + 10
        while len(follow) not in saved_positions(path):
            assert time.monotonic() < deadline, "no periodic save while idle"
            time.sleep(0.02)
        saved = path.read_bytes()
    path.write_bytes(saved)                       # what the idle save wrote, not shutdown's
    # Saved: a's stops (the multiples of 64 below 180; not its prompt end, 180 is not a multiple
    # of 64) and b's past its resume at 128 (192, its prompt end 256); not the state after a's
    # answer (decode steps computed it).
    answer_end = len(prompt) + len(ids) - 1
    assert sorted(saved_positions(path)) == [64, 128, 192, 256]
    assert answer_end not in saved_positions(path) and len(prompt) not in saved_positions(path)
    third = follow + last + tokens(17, 20)
    hints = (len(prompt), len(follow))             # the turn starts: 180 -> 128, 256 stays
    with Engine(make_runner(), config) as engine:
        got, final = run(engine, "c", third, snapshot_positions=hints)
    with Engine(make_runner(), EngineConfig(**BASE)) as cold:
        assert got == run(cold, "c", third, snapshot_positions=hints)[0]
    # It resumes from the snapshot that only the idle save wrote.
    assert final.cached_prompt_tokens == len(follow) == 256
