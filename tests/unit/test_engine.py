"""The engine loop on a fake runner: streams, batching, preemption with replay, limits,
cancellation and per-request failure isolation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.engine.api import (EngineRequest, FinishReason, RequestRejected, SamplingParams,
                                ThinkingControl)
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.model.sampling import pack_mask
from test_engine_fakes import FakeRunner, OnlyEven, reference_greedy

GREEDY = SamplingParams(greedy=True)


def request(rid, prompt, max_new=20, sampling=GREEDY, **kw) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_ids=tuple(prompt), sampling=sampling,
                         max_new_tokens=max_new, **kw)


def collect(stream, timeout=20.0):
    tokens, outputs = [], []
    while not stream.done:
        out = stream.get(timeout=timeout)
        outputs.append(out)
        tokens.extend(out.token_ids)
    return tokens, outputs[-1]


def run_one(engine, req):
    return collect(engine.submit(req))


@pytest.fixture
def engine_factory():
    engines = []

    def make(runner=None, **config):
        runner = runner or FakeRunner()
        config.setdefault("max_context", 512)
        engine = Engine(runner, EngineConfig(**config)).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def test_greedy_equals_a_direct_loop(engine_factory):
    engine = engine_factory()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens, final = run_one(engine, request("a", prompt, max_new=30))
    assert tokens == reference_greedy(FakeRunner, prompt, 30)
    assert final.finish_reason is FinishReason.LENGTH
    assert final.stats.output_tokens == 30 and final.stats.prompt_tokens == 8


def test_concurrent_requests_match_their_solo_runs(engine_factory):
    engine = engine_factory(num_lanes=4, prefill_chunk=64)
    prompts = {f"r{i}": [(i * 13 + k) % 60 for k in range(5 + 40 * i)] for i in range(6)}
    streams = {rid: engine.submit(request(rid, p, max_new=25)) for rid, p in prompts.items()}
    for rid, stream in streams.items():
        tokens, final = collect(stream)
        assert tokens == reference_greedy(FakeRunner, prompts[rid], 25), rid
    assert engine.snapshot()["kv_pages_free"] == engine.snapshot()["kv_pages_total"]


def test_preemption_under_kv_pressure_loses_and_duplicates_nothing(engine_factory):
    # 6 pages of 64 tokens for 4 lanes of growing sequences: preemption must happen.
    runner = FakeRunner(num_pages=6)
    engine = engine_factory(runner, num_lanes=4, prefill_chunk=64, max_context=512)
    prompts = {f"r{i}": [(i * 7 + k) % 50 for k in range(30 + 20 * i)] for i in range(5)}
    streams = {rid: engine.submit(request(rid, p, max_new=70)) for rid, p in prompts.items()}
    preemptions = 0
    for rid, stream in streams.items():
        tokens, final = collect(stream)
        if final.finish_reason is FinishReason.CONTEXT:
            continue
        assert tokens == reference_greedy(FakeRunner, prompts[rid], 70), rid
        preemptions += final.stats.preemptions
    assert preemptions > 0
    assert engine.snapshot()["preemptions"] == preemptions
    assert engine.snapshot()["kv_pages_free"] == 6


def test_service_turns_keep_outputs_exact(engine_factory):
    # Short turns force many rotations: every replay must reproduce the same stream.
    runner = FakeRunner(num_pages=4)
    engine = engine_factory(runner, num_lanes=3, prefill_chunk=64, max_context=256,
                            service_turn_tokens=8)
    prompts = {f"r{i}": [(i * 5 + k) % 40 for k in range(60 + i)] for i in range(3)}
    streams = {rid: engine.submit(request(rid, p, max_new=60)) for rid, p in prompts.items()}
    rotations = 0
    for rid, stream in streams.items():
        tokens, final = collect(stream)
        assert final.finish_reason is FinishReason.LENGTH, rid
        assert tokens == reference_greedy(FakeRunner, prompts[rid], 60), rid
        rotations += final.stats.preemptions
    assert rotations >= 6


def test_seeded_sampling_survives_preemption_unchanged(engine_factory):
    params = {f"r{i}": SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5,
                                      seed=40 + i) for i in range(3)}
    prompts = {f"r{i}": [(i * 3 + k) % 40 for k in range(60)] for i in range(3)}
    solo = engine_factory(FakeRunner(num_pages=64), max_context=256)
    expected = {rid: run_one(solo, request(rid, prompts[rid], 50, params[rid]))[0]
                for rid in prompts}
    tight = engine_factory(FakeRunner(num_pages=4), num_lanes=3, prefill_chunk=64,
                           max_context=256, service_turn_tokens=8)
    streams = {rid: tight.submit(request(rid, prompts[rid], 50, params[rid]))
               for rid in prompts}
    preemptions = 0
    for rid, stream in streams.items():
        tokens, final = collect(stream)
        assert tokens == expected[rid], rid
        preemptions += final.stats.preemptions
    assert preemptions > 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine_factory):
    engine = engine_factory()
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=1234)
    first, _ = run_one(engine, request("a", [1, 2, 3], 40, params))
    again, _ = run_one(engine, request("b", [1, 2, 3], 40, params))
    other, _ = run_one(engine, request("c", [1, 2, 3], 40,
                                       SamplingParams(temperature=1.0, top_k=20, seed=99)))
    assert first == again
    assert first != other


def test_stop_token_ends_with_stop(engine_factory):
    engine = engine_factory()
    prompt = [5, 6, 7]
    expected = reference_greedy(FakeRunner, prompt, 30)
    stop = expected[4]
    tokens, final = run_one(engine, request("a", prompt, 30, stop_token_ids=frozenset({stop})))
    assert final.finish_reason is FinishReason.STOP
    assert tokens == expected[:expected.index(stop) + 1]


def test_context_limit_ends_with_context(engine_factory):
    engine = engine_factory(max_context=70)
    tokens, final = run_one(engine, request("a", list(range(60)), max_new=50))
    assert final.finish_reason is FinishReason.CONTEXT
    assert len(tokens) == 10


def test_cancel_mid_stream_frees_everything(engine_factory):
    # Decode waits until the cancel has been sent: a fast fake runner could otherwise finish all
    # 400 tokens before the engine sees the cancel (it did on a loaded CI machine).
    cancelled = threading.Event()

    class GatedRunner(FakeRunner):
        def decode(self, items):
            cancelled.wait(timeout=10)
            return super().decode(items)

    engine = engine_factory(GatedRunner())
    stream = engine.submit(request("a", [1, 2], max_new=400))
    first = stream.get(timeout=10)
    assert first.token_ids
    stream.cancel()
    cancelled.set()
    tokens, final = collect(stream)
    assert final.finish_reason is FinishReason.CANCELLED and len(tokens) < 400
    assert engine.num_in_flight == 0
    snapshot = engine.snapshot()
    assert snapshot["kv_pages_free"] == snapshot["kv_pages_total"] and snapshot["running"] == 0
    _, final = run_one(engine, request("b", [1], max_new=1))     # the engine keeps working
    assert final.finish_reason is FinishReason.LENGTH


def test_cancel_of_a_queued_request(engine_factory):
    gate = threading.Event()
    runner = FakeRunner()
    original = runner.prefill

    def slow_prefill(chunk):
        gate.wait(10)
        return original(chunk)

    runner.prefill = slow_prefill
    engine = engine_factory(runner, num_lanes=1)
    first = engine.submit(request("a", [1, 2], max_new=3))
    queued = engine.submit(request("b", [1, 2], max_new=3))
    queued.cancel()
    gate.set()
    _, final_b = collect(queued)
    _, final_a = collect(first)
    assert final_b.finish_reason is FinishReason.CANCELLED and final_b.stats.output_tokens == 0
    assert final_a.finish_reason is FinishReason.LENGTH


def test_prefill_failure_ends_only_that_request(engine_factory):
    runner = FakeRunner()
    runner.fail_prefill = lambda chunk: 13 in chunk.token_ids
    engine = engine_factory(runner, num_lanes=2)
    bad = engine.submit(request("bad", [1, 13, 2], max_new=5))
    good = engine.submit(request("good", [1, 2, 3], max_new=5))
    tokens, final = collect(bad)
    assert final.finish_reason is FinishReason.ERROR and "prefill failed" in final.error
    tokens, final = collect(good)
    assert final.finish_reason is FinishReason.LENGTH
    assert tokens == reference_greedy(FakeRunner, [1, 2, 3], 5)
    assert engine.error is None


def test_batched_decode_failure_is_rebuilt_by_replay(engine_factory):
    runner = FakeRunner()
    failures = {"left": 1}

    def fail_once(items):
        if len(items) == 2 and failures["left"]:
            failures["left"] -= 1
            return True
        return False

    runner.fail_decode = fail_once
    engine = engine_factory(runner, num_lanes=2)
    a = engine.submit(request("a", [4, 5, 6], max_new=12))
    b = engine.submit(request("b", [7, 8], max_new=12))
    assert collect(a)[0] == reference_greedy(FakeRunner, [4, 5, 6], 12)
    assert collect(b)[0] == reference_greedy(FakeRunner, [7, 8], 12)
    assert failures["left"] == 0


def test_a_row_that_always_fails_decode_ends_alone(engine_factory):
    runner = FakeRunner()
    engine = engine_factory(runner, num_lanes=2)
    # Every decode that includes request a's slot fails; b must not suffer for it.
    holder = {}
    original = runner.reset_slot

    def track(slot):
        original(slot)
        holder.setdefault("a", slot)

    runner.reset_slot = track
    runner.fail_decode = lambda items: any(item.slot == holder.get("a") for item in items)
    a = engine.submit(request("a", [4, 5, 6], max_new=40))
    b = engine.submit(request("b", [7, 8], max_new=40))
    tokens_a, final_a = collect(a)
    tokens_b, final_b = collect(b)
    assert final_a.finish_reason is FinishReason.ERROR and "decode failed" in final_a.error
    assert final_b.finish_reason is FinishReason.LENGTH
    assert tokens_b == reference_greedy(FakeRunner, [7, 8], 40)
    assert engine.error is None


def test_sink_failure_cancels_only_its_request(engine_factory):
    engine = engine_factory(num_lanes=2)

    def broken(output):
        raise OSError("client went away")

    engine.submit(request("broken", [1, 2], max_new=50), on_output=broken)
    tokens, final = run_one(engine, request("ok", [3, 4], max_new=10))
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 10


def test_constraint_masks_every_sampled_token(engine_factory):
    engine = engine_factory()
    constraint = OnlyEven(limit=6, end=1)
    tokens, final = run_one(engine, request(
        "a", [1, 2, 3], 20, SamplingParams(temperature=1.0, seed=3), constraint=constraint,
        stop_token_ids=frozenset({1})))
    assert all(t % 2 == 0 for t in tokens[:6]) and tokens[6] == 1
    assert final.finish_reason is FinishReason.STOP and constraint.seen == tokens


def test_constraint_that_cannot_finish_in_time_ends_with_length(engine_factory):
    engine = engine_factory()
    tokens, final = run_one(engine, request("a", [1, 2, 3], 4, constraint=OnlyEven(10, 1),
                                            stop_token_ids=frozenset({1})))
    assert final.finish_reason is FinishReason.LENGTH and len(tokens) == 4


def test_constraint_dead_end_is_an_error_for_that_request(engine_factory):
    class DeadEnd(OnlyEven):
        def allowed_bitmask_u32(self, vocab_size):
            return pack_mask(np.zeros(vocab_size, dtype=bool))

    engine = engine_factory()
    tokens, final = run_one(engine, request("a", [1, 2], 4, constraint=DeadEnd(1, 1)))
    assert final.finish_reason is FinishReason.ERROR and "constraint" in final.error
    assert run_one(engine, request("b", [1, 2], 2))[1].finish_reason is FinishReason.LENGTH


def test_constraint_masks_are_computed_while_the_runner_works(engine_factory):
    """Each decode call waits (bounded) until the mask for the row it computes has started on
    the mask worker; an engine that computes masks only after the logits would make every wait
    time out."""
    mask_started = threading.Event()
    waits = []

    class WaitingRunner(FakeRunner):
        def decode(self, items):
            waits.append(mask_started.wait(timeout=5.0))
            return super().decode(items)

    class Signalling(OnlyEven):
        def allowed_bitmask_u32(self, vocab_size):
            mask_started.set()
            return super().allowed_bitmask_u32(vocab_size)

        def commit(self, token_id):
            mask_started.clear()  # the next mask belongs to the next step
            super().commit(token_id)

    engine = engine_factory(WaitingRunner())
    constraint = Signalling(limit=100, end=1)
    tokens, final = run_one(engine, request("a", [1, 2, 3], 6, constraint=constraint))
    assert final.finish_reason is FinishReason.LENGTH and all(t % 2 == 0 for t in tokens)
    assert waits == [True] * 5


def test_submit_rejections(engine_factory):
    engine = engine_factory(max_context=64, num_lanes=1, max_waiting=0)
    cases = [
        (request("a", [], 5), "context_length_exceeded"),
        (request("a", list(range(64)), 5), "context_length_exceeded"),
        (request("a", [1, 2], 0), "invalid_request"),
        (request("a", [1, 9999], 5), "invalid_request"),
    ]
    for req, code in cases[1:]:
        with pytest.raises(RequestRejected) as info:
            engine.submit(req)
        assert info.value.code == code, req
    with pytest.raises(RequestRejected):
        engine.submit(cases[0][0])


def test_queue_full_and_duplicate_ids(engine_factory):
    gate = threading.Event()
    runner = FakeRunner()
    original = runner.prefill
    runner.prefill = lambda chunk: (gate.wait(10), original(chunk))[1]
    engine = engine_factory(runner, num_lanes=1, max_waiting=1)
    a = engine.submit(request("a", [1], 2))
    with pytest.raises(RequestRejected) as info:
        engine.submit(request("a", [1], 2))
    assert info.value.code == "duplicate_request"
    b = engine.submit(request("b", [1], 2))
    with pytest.raises(RequestRejected) as info:
        engine.submit(request("c", [1], 2))
    assert info.value.code == "queue_full"
    gate.set()
    collect(a), collect(b)
    run_one(engine, request("c", [1], 2))


def test_engine_wide_failure_fails_everything_and_rejects_later(engine_factory):
    engine = engine_factory()
    engine.scheduler.schedule = lambda: (_ for _ in ()).throw(RuntimeError("broken invariant"))
    stream = engine.submit(request("a", [1, 2], 5))
    tokens, final = collect(stream)
    assert final.finish_reason is FinishReason.ERROR and "broken invariant" in final.error
    assert "broken invariant" in engine.error
    with pytest.raises(RequestRejected) as info:
        engine.submit(request("b", [1, 2], 5))
    assert info.value.code == "engine_unavailable"


def test_shutdown_cancels_in_flight_requests_and_rejects_later_ones():
    engine = Engine(FakeRunner(), EngineConfig(max_context=1000)).start()
    stream = engine.submit(request("a", [1, 2], 900))
    stream.get(timeout=10)
    engine.shutdown()
    _, final = collect(stream)
    assert final.finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH)
    with pytest.raises(RequestRejected) as info:
        engine.submit(request("b", [1, 2], 5))
    assert info.value.code == "engine_unavailable" and engine.error is None


def test_requests_racing_a_shutdown_never_hang():
    for _ in range(20):
        engine = Engine(FakeRunner(), EngineConfig(max_context=1000)).start()
        streams = []
        stopper = threading.Thread(target=engine.shutdown)
        stopper.start()
        for i in range(5):
            try:
                streams.append(engine.submit(request(f"r{i}", [1, 2], 50)))
            except RequestRejected:
                pass
        stopper.join()
        for stream in streams:
            _, final = collect(stream, timeout=5)
            assert final.finished


def test_thinking_budget_is_rejected_without_room(engine_factory):
    engine = engine_factory()
    control = ThinkingControl(starts_in_thinking=True, think_end_id=63, budget=5,
                              close_ids=(10, 11, 63))
    with pytest.raises(RequestRejected) as info:
        engine.submit(request("a", [1, 2], 8, thinking=control))
    assert info.value.code == "thinking_budget_capacity_insufficient"
    # Room for the span plus one answer token, or an output limit inside the budget: accepted.
    collect(engine.submit(request("b", [1, 2], 9, thinking=control)))
    collect(engine.submit(request("c", [1, 2], 5, thinking=control)))


def test_logprobs_are_reported(engine_factory):
    engine = engine_factory()
    stream = engine.submit(request("a", [1, 2], 3, logprobs=2))
    outputs = list(stream)
    entries = [entry for out in outputs if out.logprobs for entry in out.logprobs]
    assert len(entries) == 3
    for entry in entries:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]   # greedy = top-1


class _DeviceSampling(FakeRunner):
    """Samples on its 'device' (greedy argmax of the same logits) and records which calls did."""

    samples_on_device = True

    def decode_sampled(self, items, sampling, lookahead=False):
        rows = self.decode(items)
        assert len(list(sampling())) == len(items)
        self.calls.append(("decode_sampled", tuple(item.slot for item in items)))
        return np.argmax(rows, axis=1).astype(np.int32)

    def prefill_sampled(self, chunk, sampling):
        rows = self.prefill(chunk)
        list(sampling())
        return np.argmax(rows[-1:], axis=1).astype(np.int32)


def test_a_neighbour_asking_for_logprobs_does_not_move_a_row_to_host_sampling(engine_factory):
    # Request invariance: host (float64) and device (fp32) sampling decide alike except within
    # rounding of a threshold, so a row must be sampled where it would be alone.
    runner = _DeviceSampling()
    engine = engine_factory(runner, num_lanes=2)
    plain = engine.submit(request("plain", [3, 1, 4], 12))
    probed = engine.submit(request("probed", [2, 7], 12, logprobs=1))
    plain_tokens, _ = collect(plain)
    probed_tokens, _ = collect(probed)
    assert plain_tokens == reference_greedy(FakeRunner, [3, 1, 4], 12)
    assert probed_tokens == reference_greedy(FakeRunner, [2, 7], 12)
    sampled_slots = [slots for call, *slots in runner.calls if call == "decode_sampled" for slots in slots]
    # Every device-sampled decode call held only the plain request's lane (slot 0): 11 decode
    # steps after its prefill, none of them shared with the logprobs request.
    assert sampled_slots and all(slots == (0,) for slots in sampled_slots)
    assert len(sampled_slots) == 11
