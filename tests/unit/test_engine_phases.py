"""The engine's request phases (`RequestStats`: queue, match, resume, prefill with its steps and
runner time, first decode step) on a fake runner whose prefill chunks take a known time."""

from __future__ import annotations

import time

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.engine_loop import Engine, EngineConfig
from test_engine_fakes import FakeRunner

CHUNK_S = 0.01


class SlowPrefill(FakeRunner):
    """Each prefill chunk takes at least CHUNK_S (a sleep: the GIL is free meanwhile)."""

    def prefill(self, chunk):
        time.sleep(CHUNK_S)
        return super().prefill(chunk)


def final_stats(stream):
    while True:
        output = stream.get(timeout=30)
        if output.finished:
            return output.stats


def request(rid: str, length: int, max_new: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_ids=tuple(k % 50 for k in range(length)),
                         sampling=SamplingParams(greedy=True), max_new_tokens=max_new)


def test_prefill_phases_count_the_chunks_before_the_first_token():
    with Engine(SlowPrefill(), EngineConfig(max_context=512, prefill_chunk=64)) as engine:
        stats = final_stats(engine.submit(request("a", 300, max_new=4)))
    # 300 tokens in 64-token chunks: 64, 64, 64, 64, 44.
    assert stats.prefill_steps == 5
    assert stats.prefill_compute_s >= 5 * CHUNK_S
    assert stats.prefill_s >= stats.prefill_compute_s
    assert stats.match_s == 0.0 and stats.resume_s == 0.0      # no prefix cache
    assert min(stats.queue_s, stats.prefill_s, stats.first_decode_s) > 0
    assert stats.queue_s + stats.match_s + stats.resume_s + stats.prefill_s <= stats.ttft_s
    assert stats.first_decode_s <= stats.decode_s


def test_queue_wait_covers_the_request_ahead_in_the_only_lane():
    with Engine(SlowPrefill(), EngineConfig(max_context=512, prefill_chunk=64,
                                            num_lanes=1, max_waiting=2)) as engine:
        first = engine.submit(request("a", 300, max_new=2))
        second = engine.submit(request("b", 64, max_new=2))
        ahead, behind = final_stats(first), final_stats(second)
    # "b" waits for the lane while "a" prefills (5 chunks), then prefills its one chunk.
    assert behind.queue_s >= ahead.prefill_compute_s >= 5 * CHUNK_S
    assert behind.prefill_steps == 1 and behind.prefill_s < behind.queue_s
