"""Speculative decoding in the engine on a scripted copying runner (`spec_fakes.CopyRunner`):
n-gram and MTP rounds give exactly the plain output (greedy and seeded, with constraints,
thinking budgets, stop tokens, limits, chunked prefill, concurrency and preemption), copies of a
file in the prompt are accepted in long runs, sampled output keeps the target distribution, and
KV pages go back to the pool."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import (EngineRequest, FinishReason, SamplingParams, ThinkingControl)
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.speculative import NgramIndex, SlotLayout, SpeculativeConfig
from spec_fakes import CopyRunner
from test_engine_fakes import OnlyEven

GREEDY = SamplingParams(greedy=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
OFF = SpeculativeConfig()
NGRAM = SpeculativeConfig(ngram_draft_tokens=8, ngram_min_match=3)
MTP = SpeculativeConfig(method="mtp", draft_tokens=3)
BOTH = SpeculativeConfig(method="mtp", draft_tokens=2, ngram_draft_tokens=6, ngram_min_match=3)
FILE = np.random.default_rng(3).integers(0, 48, 300).tolist()


def run(spec, prompts, max_new=60, sampling=GREEDY, lanes=1, num_pages=32, runner_kw=None,
        config_kw=None, sampling_of=None, **request_kw):
    """{rid: (tokens, final output)}, plus the engine counters and the runner, after shutdown.
    sampling_of: per-request sampling (default `sampling`); request_kw: EngineRequest fields,
    a callable value being called per request (a fresh constraint each)."""
    layout = SlotLayout.for_config(lanes, spec)
    runner = CopyRunner(num_pages=num_pages, num_slots=max(layout.reserved, lanes),
                        mtp=spec.mtp, **(runner_kw or {}))
    config = EngineConfig(num_lanes=lanes, max_context=512, speculative=spec,
                          **(config_kw or {}))
    with Engine(runner, config) as engine:
        streams = {rid: engine.submit(EngineRequest(
            rid, tuple(prompt), (sampling_of or {}).get(rid, sampling), max_new,
            **{k: (v() if callable(v) else v) for k, v in request_kw.items()}))
            for rid, prompt in prompts.items()}
        results = {}
        for rid, stream in streams.items():
            outputs = list(stream)
            results[rid] = ([t for o in outputs for t in o.token_ids], outputs[-1])
        pages_free = engine.scheduler.pages.num_free
        engine.scheduler.check_invariants()
        counters = dict(engine.counters)
    assert pages_free == num_pages                                       # every page back
    return results, counters, runner


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex([5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9], min_match=3)
    assert index.propose(4) == []                     # suffix 3 4 9 never occurred before
    index.extend([5, 6, 7])
    assert index.propose(4) == [3, 4, 9, 5]           # the latest 5 6 7 (not the first one)
    assert index.propose(2) == [3, 4]
    index.extend([3, 4, 9, 5, 6, 7])
    assert index.propose(8) == [3, 4, 9, 5, 6, 7]     # the copy ends where the tokens end
    assert NgramIndex([1, 2], min_match=3).propose(4) == []


def test_slot_layout_reserves_k_plus_one_snapshots_per_lane():
    layout = SlotLayout.for_config(2, SpeculativeConfig(method="mtp", draft_tokens=3))
    assert (layout.reserved, layout.first_spare) == (10, 10)
    assert list(layout.snapshot_slots(0)) == [2, 3, 4, 5]
    assert list(layout.snapshot_slots(1)) == [6, 7, 8, 9]
    assert SlotLayout.for_config(3, OFF).reserved == 3


def test_a_file_in_the_prompt_is_copied_in_long_accepted_runs():
    prompt = FILE + [7, 7] + FILE[:6]               # "rewrite the file": its start again
    plain, _, _ = run(OFF, {"a": prompt}, max_new=200)
    spec, counters, runner = run(NGRAM, {"a": prompt}, max_new=200)
    assert spec["a"][0] == plain["a"][0]
    assert plain["a"][0][:100] == FILE[6:106]       # the model does copy
    assert counters["spec_accepted_tokens"] >= 0.9 * counters["spec_drafted_tokens"]
    # 199 tokens after the prefill's first one, in rounds of up to 9.
    assert counters["spec_rounds"] <= 30
    stats = spec["a"][1].stats
    assert (stats.spec_rounds, stats.drafted_tokens, stats.accepted_tokens) == (
        counters["spec_rounds"], counters["spec_drafted_tokens"],
        counters["spec_accepted_tokens"])
    assert max(max(rows) for rows in runner.steps) == 9
    # A step goes to the verifier only with drafts to verify; the others decode as plain rows.
    assert all(max(rows) > 1 for rows in runner.steps)


def test_without_a_match_ngram_speculation_decodes_plain_rows():
    """Nothing to copy (the match needs more tokens than the prompt has): every step is a
    plain decode batch (on a GPU: device sampling), never a verification step, and the
    output is plain decoding's."""
    never = SpeculativeConfig(ngram_draft_tokens=8, ngram_min_match=64)
    prompt = FILE[:40]
    plain, _, _ = run(OFF, {"a": prompt}, max_new=20)
    spec, counters, runner = run(never, {"a": prompt}, max_new=20)
    assert spec["a"][0] == plain["a"][0]
    assert runner.steps == [] and counters["spec_rounds"] == 0
    assert counters["decode_batches"] == 19        # the first token came from the prefill


def test_without_a_match_ngram_speculation_computes_plain_steps_ahead():
    """On a runner that samples on its device, n-gram drafting with nothing to propose keeps
    the plain decode pipeline: every decode step but the last asks for the next one ahead and
    the next uses it (none dropped), as with speculation off."""
    never = SpeculativeConfig(ngram_draft_tokens=8, ngram_min_match=64)
    prompt = FILE[:40]
    plain, _, off_runner = run(OFF, {"a": prompt}, max_new=20, runner_kw=DEVICE)
    spec, counters, runner = run(never, {"a": prompt}, max_new=20, runner_kw=DEVICE)
    assert spec["a"][0] == plain["a"][0]
    assert runner.steps == [] and counters["spec_rounds"] == 0
    # 19 decode steps; the last is at the output limit, so 18 were computed ahead and used.
    assert runner.lookahead_steps == off_runner.lookahead_steps == {True: 18, False: 0}


def test_a_match_after_a_step_computed_ahead_uses_it_then_verifies():
    """The copy starts after a stretch with nothing to match: the steps ahead of that stretch
    are used (a match appearing at a sampled token waits one plain step instead of dropping the
    step ahead), the copy is then verified in rounds, and the output is plain decoding's,
    greedy and seeded."""
    # The model's own rule generates tokens until its last three occurred before: then copies.
    prompt = FILE[:200] + [7, 7]
    for sampling in (GREEDY, SAMPLED):
        plain, _, _ = run(OFF, {"a": prompt}, 120, sampling, runner_kw=DEVICE)
        spec, counters, runner = run(NGRAM, {"a": prompt}, 120, sampling, runner_kw=DEVICE)
        assert spec["a"][0] == plain["a"][0]
        assert counters["spec_rounds"] > 0 and counters["spec_accepted_tokens"] > 0
        assert runner.lookahead_steps[True] > 0 and runner.lookahead_steps[False] == 0, runner.lookahead_steps


@pytest.mark.parametrize("spec", [NGRAM, MTP, BOTH], ids=["ngram", "mtp", "both"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_rounds_equal_plain_decoding_with_chunks_lanes_and_preemption(spec, sampling):
    rng = np.random.default_rng(5)
    prompts = {"a": FILE[:150] + FILE[:4], "b": rng.integers(0, 48, 90).tolist(),
               "c": FILE[40:110] + FILE[40:44]}
    model = {"winner": 9.0, "mtp_wrong_every": 3}     # copies mostly, even when sampled
    expected = {rid: run(OFF, {rid: p}, 80, sampling, runner_kw=model)[0][rid][0]
                for rid, p in prompts.items()}
    # Three lanes, 64-token chunks, and 7 pages for three sequences of up to 234 tokens:
    # chunked prefill, batched rounds and preemption with replay all happen.
    results, counters, runner = run(spec, prompts, 80, sampling, lanes=3, num_pages=7,
                                    runner_kw=model, config_kw={"prefill_chunk": 64})
    for rid in prompts:
        assert results[rid][0] == expected[rid], rid
        assert results[rid][1].finish_reason is FinishReason.LENGTH
    assert counters["preemptions"] > 0
    assert counters["spec_accepted_tokens"] > 0
    assert any(len(rows) > 1 and max(rows) > 1 for rows in runner.steps)   # batched rounds


def test_seeded_sampling_equals_plain_for_many_seeds():
    prompt = FILE[:60] + FILE[:5]
    for seed in range(12):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        plain = run(OFF, {"a": prompt}, 30, sampling, runner_kw={"winner": 2.0})[0]
        spec = run(BOTH, {"a": prompt}, 30, sampling, runner_kw={"winner": 2.0,
                                                                 "mtp_wrong_every": 2})[0]
        assert spec["a"][0] == plain["a"][0], seed


def test_sampled_rounds_keep_the_target_distribution():
    # 5 tokens, a flat model (winner 1.0): the n-gram drafts (min match 1) are often wrong.
    # The joint law of the 2nd and 3rd output tokens (both verified in rounds) is computed
    # exactly from the model and compared with 1,500 seeded runs (chi-square, p = 0.001).
    runner_kw = {"vocab_size": 5, "winner": 1.0, "match": 1}
    spec = SpeculativeConfig(ngram_draft_tokens=3, ngram_min_match=1)
    prompt = [0, 1, 2, 3, 4, 0, 2, 4, 1]
    prompts = {f"s{seed}": prompt for seed in range(1500)}
    sampling_of = {rid: SamplingParams(temperature=1.0, top_k=20, seed=seed)
                   for seed, rid in enumerate(prompts)}
    results, counters, _ = run(spec, prompts, 3, lanes=8, num_pages=16, runner_kw=runner_kw,
                               config_kw={"max_waiting": len(prompts)}, sampling_of=sampling_of)
    model = CopyRunner(**runner_kw)

    def probs(history):
        z = model.logits_for(history).astype(np.float64)
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = probs(prompt)
    observed = np.zeros((5, 5))
    expected = np.zeros((5, 5, 5))
    for t1 in range(5):
        p2 = probs(prompt + [t1])
        for t2 in range(5):
            expected[t1, t2] = p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    joint = expected.sum(axis=0)                        # law of (t2, t3)
    for tokens, _ in results.values():
        observed[tokens[1], tokens[2]] += 1
    assert counters["spec_drafted_tokens"] > 1000
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_drafted_tokens"]
    expected_counts = joint * len(results)
    statistic = float(((observed - expected_counts) ** 2 / expected_counts).sum())
    # 51.18: the 0.999 quantile of chi-square with 24 degrees of freedom (scipy is not a dependency).
    assert statistic < 51.18, (statistic, observed, expected_counts)


@pytest.mark.parametrize("spec", [NGRAM, BOTH], ids=["ngram", "both"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_constraint_thinking_budget_stop_and_limits_cut_rounds_exactly(spec, sampling):
    prompt = FILE[:120] + FILE[:5]
    free = run(OFF, {"a": prompt}, 60, sampling)[0]["a"][0]
    stop_id = free[17]                          # a token the output reaches mid-way
    cases = {
        "constraint": {"constraint": lambda: OnlyEven(40, 1),
                       "stop_token_ids": frozenset({1})},
        "budget": {"thinking": ThinkingControl(starts_in_thinking=True, think_end_id=47,
                                               budget=13, close_ids=(44, 45, 47))},
        "stop": {"stop_token_ids": frozenset({stop_id})},
    }
    for name, request_kw in cases.items():
        plain = run(OFF, {"a": prompt}, 60, sampling, **request_kw)[0]["a"]
        got = run(spec, {"a": prompt}, 60, sampling, runner_kw={"mtp_wrong_every": 4},
                  **request_kw)[0]["a"]
        assert got[0] == plain[0], name
        assert got[1].finish_reason is plain[1].finish_reason, name
        assert got[1].stats.inserted_tokens == plain[1].stats.inserted_tokens, name
    assert plain[1].finish_reason is FinishReason.STOP        # the stop case really stops
    assert len(plain[0]) == free.index(stop_id) + 1
    for max_new in (1, 2, 7, 10):                             # output limits inside a round
        plain = run(OFF, {"a": prompt}, max_new)[0]["a"]
        got = run(spec, {"a": prompt}, max_new)[0]["a"]
        assert got[0] == plain[0] and len(got[0]) == max_new
    # The context limit: 125 prompt tokens, 512 context -> cut at 387 tokens of output.
    plain = run(OFF, {"a": prompt}, 500)[0]["a"]
    got = run(spec, {"a": prompt}, 500)[0]["a"]
    assert got[0] == plain[0] and got[1].finish_reason is FinishReason.CONTEXT


def test_budget_insertion_inside_a_round_matches_plain():
    control = ThinkingControl(starts_in_thinking=True, think_end_id=47, budget=9,
                              close_ids=(44, 45, 47))
    prompt = FILE[:80] + FILE[:5]
    plain = run(OFF, {"a": prompt}, 40, thinking=control)[0]["a"]
    got, counters, _ = run(NGRAM, {"a": prompt}, 40, thinking=control)
    assert got["a"][0] == plain[0]
    assert got["a"][0][9:12] == [44, 45, 47]                 # inserted right at the budget
    assert got["a"][1].stats.thinking_closed_by == "budget"
    # Tokens 2..9 are copies accepted in the round that the budget cuts (the close span then
    # breaks the copy, so the model stops copying).
    assert counters["spec_accepted_tokens"] >= 7


def test_draft_pages_are_taken_for_the_round_and_the_rejected_ones_given_back():
    from runtime.engine.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(num_lanes=2, num_pages=4, max_context=256,
                                          prefill_chunk=64))
    scheduler.add("a", list(range(62)))
    batch = scheduler.schedule()
    scheduler.update(batch, {"a": [1]})                   # 62 computed, token 62 pending
    assert scheduler.pages.num_free == 3
    batch = scheduler.schedule({"a": 5})                  # positions 62..67 cross a page
    (work,) = batch.decodes
    assert (work.pos, work.draft_room, len(work.page_table)) == (62, 5, 2)
    assert scheduler.pages.num_free == 2
    scheduler.update(batch, {"a": [7]}, {"a": 0})         # every draft rejected
    assert scheduler.get("a").num_computed == 63
    assert scheduler.pages.num_free == 3                  # the page of 64..67 went back
    batch = scheduler.schedule({"a": 5})
    scheduler.update(batch, {"a": [1, 2, 3, 4]}, {"a": 3})
    assert scheduler.get("a").num_computed == 67 and scheduler.pages.num_free == 2
    scheduler.check_invariants()
    # Drafts take only pages no unit of the step needs: b's chunk gets the third page, and the
    # two more that 125 drafts need are not there, so a decodes alone.
    scheduler.add("b", list(range(120)))
    batch = scheduler.schedule({"a": 125})
    assert [w.request_id for w in batch.prefills] == ["b"]
    assert [w.draft_room for w in batch.decodes] == [0] and scheduler.pages.num_free == 1
    scheduler.finish("a")
    scheduler.finish("b")
    assert scheduler.pages.num_free == 4


DEVICE = {"device_sampling": True}


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_rounds_sampled_on_the_device_equal_plain_device_decoding(spec, sampling):
    # A runner that samples on its device: plain decoding samples each row there
    # (`decode_sampled`), and verification rows are sampled there too (`step_sampled`, one id per
    # position, a later position's draw numbered as plain decoding would number it), so greedy and
    # seeded output equal plain decoding token for token.
    prompts = {"a": FILE[:150] + FILE[:4], "c": FILE[40:110] + FILE[40:44]}
    model = {"winner": 9.0, "mtp_wrong_every": 3, **DEVICE}
    expected = {rid: run(OFF, {rid: p}, 80, sampling, runner_kw=model)[0][rid][0]
                for rid, p in prompts.items()}
    results, counters, runner = run(spec, prompts, 80, sampling, lanes=2, runner_kw=model,
                                    config_kw={"prefill_chunk": 64})
    for rid in prompts:
        assert results[rid][0] == expected[rid], rid
    assert counters["spec_accepted_tokens"] > 20
    assert runner.sampled_calls["step"] == counters["decode_batches"]   # every round on the device


def test_device_sampled_rounds_keep_the_target_distribution():
    # The chi-square test of `test_sampled_rounds_keep_the_target_distribution`, every round
    # sampled on the device: position p of a round draws with draw number (draws so far) + p.
    runner_kw = {"vocab_size": 5, "winner": 1.0, "match": 1, **DEVICE}
    spec = SpeculativeConfig(ngram_draft_tokens=3, ngram_min_match=1)
    prompt = [0, 1, 2, 3, 4, 0, 2, 4, 1]
    prompts = {f"s{seed}": prompt for seed in range(1500)}
    sampling_of = {rid: SamplingParams(temperature=1.0, top_k=20, seed=seed)
                   for seed, rid in enumerate(prompts)}
    results, counters, runner = run(spec, prompts, 3, lanes=8, num_pages=16, runner_kw=runner_kw,
                                    config_kw={"max_waiting": len(prompts)}, sampling_of=sampling_of)
    assert runner.sampled_calls["step"] > 100
    model = CopyRunner(vocab_size=5, winner=1.0, match=1)

    def probs(history):
        z = model.logits_for(history).astype(np.float64)
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = probs(prompt)
    expected = np.zeros((5, 5))
    for t1 in range(5):
        p2 = probs(prompt + [t1])
        for t2 in range(5):
            expected[t2] += p1[t1] * p2[t2] * probs(prompt + [t1, t2])
    observed = np.zeros((5, 5))
    for tokens, _ in results.values():
        observed[tokens[1], tokens[2]] += 1
    assert 0 < counters["spec_accepted_tokens"] < counters["spec_drafted_tokens"]
    expected_counts = expected * len(results)
    statistic = float(((observed - expected_counts) ** 2 / expected_counts).sum())
    assert statistic < 51.18, (statistic, observed, expected_counts)   # chi-square(24), p = 0.001


def test_constrained_penalised_or_logprobs_rounds_take_the_logits_to_the_host():
    # A constraint's mask at a later position, a penalty's deltas and logprobs all depend on
    # what the host sees per position: such rounds read the logits (`step`), and still equal
    # plain decoding on the same device-sampling runner.
    prompt = FILE[:120] + FILE[:5]
    penalised = SamplingParams(temperature=0.9, top_p=0.95, seed=11, presence_penalty=0.2)
    cases = {"constraint": ({"constraint": lambda: OnlyEven(40, 1)}, SAMPLED),
             "penalty": ({}, penalised),
             "logprobs": ({"logprobs": 1}, GREEDY)}
    for name, (request_kw, sampling) in cases.items():
        plain = run(OFF, {"a": prompt}, 40, sampling, runner_kw=DEVICE, **request_kw)[0]["a"]
        got, counters, runner = run(NGRAM, {"a": prompt}, 40, sampling, runner_kw=DEVICE, **request_kw)
        assert runner.sampled_calls["step"] == 0, name
        assert counters["spec_drafted_tokens"] > 0, name
        # Equal here: this fake's device sampler is the host's float64 reference (on a GPU, a
        # constrained round's host sampling may differ within rounding of a threshold).
        assert got["a"][0] == plain[0], name
