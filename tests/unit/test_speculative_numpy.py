"""Speculative decoding on the NumPy reference runner with the tiny models' own MTP heads
(dense, MoE, Next): greedy and seeded output equal plain decoding token for token, with a real
llguidance constraint, a thinking budget and a stop token active; the MTP call follows the
protocol (catch-up over prompt chunks and verified rounds); pages all come back."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.artifact import open_artifact
from runtime.engine.api import EngineRequest, FinishReason, SamplingParams, ThinkingControl
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.speculative import SlotLayout, SpeculativeConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import MTP_MAX_DRAFTS, DecodeItem, MtpRow, PrefillChunk

OFF = SpeculativeConfig()
MTP3 = SpeculativeConfig(method="mtp", draft_tokens=3)
MTP_NGRAM = SpeculativeConfig(method="mtp", draft_tokens=2, ngram_draft_tokens=6,
                              ngram_min_match=2)
GREEDY = SamplingParams(greedy=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def generate(artifact, spec, prompts, max_new, sampling, lanes=1, make_request=None,
             draft_vocab=None):
    layout = SlotLayout.for_config(lanes, spec)
    runner = NumpyRunner.from_artifact(artifact, num_pages=24, num_slots=layout.reserved,
                                       mtp=spec.mtp, mtp_draft_vocab=draft_vocab)
    config = EngineConfig(num_lanes=lanes, max_context=512, prefill_chunk=64, speculative=spec)
    with Engine(runner, config) as engine:
        streams = {}
        for rid, prompt in prompts.items():
            extra = make_request(rid) if make_request else {}
            streams[rid] = engine.submit(EngineRequest(rid, tuple(prompt), sampling, max_new,
                                                       **extra))
        results = {rid: list(stream) for rid, stream in streams.items()}
        assert engine.scheduler.pages.num_free == 24
        counters = dict(engine.counters)
    return {rid: ([t for o in outs for t in o.token_ids], outs[-1])
            for rid, outs in results.items()}, counters


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def artifact(request):
    path = request.getfixturevalue(f"tiny_{request.param}_path")
    opened = open_artifact(path)
    yield opened
    opened.close()


PROMPTS = {"a": np.random.default_rng(1).integers(0, 440, 90).tolist(),
           "b": np.random.default_rng(2).integers(0, 440, 30).tolist()}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_rounds_equal_plain_decoding(artifact, sampling):
    plain, _ = generate(artifact, OFF, PROMPTS, 24, sampling)
    for spec in (MTP3, MTP_NGRAM):
        got, counters = generate(artifact, spec, PROMPTS, 24, sampling, lanes=2)
        for rid in PROMPTS:
            assert got[rid][0] == plain[rid][0], (spec, rid)
            assert got[rid][1].finish_reason is FinishReason.LENGTH
        assert counters["spec_rounds"] >= 20
        assert counters["spec_drafted_tokens"] > 1.5 * counters["spec_rounds"]


def test_constraint_thinking_budget_and_stop_token_with_mtp(artifact):
    from runtime.text.constraints import ConstraintSpec
    from runtime.text.constraints_compiler import ConstraintCompiler
    from runtime.text.tokenizer import Tokenizer

    text = artifact.component("text")
    tokenizer = Tokenizer.from_artifact_resources(text.resources)
    compiler = ConstraintCompiler(text.resources["tokenizer.json"],
                                  vocab_size=text.config["vocab_size"], eos_ids=tokenizer.eos_ids)
    think_end = tokenizer.special.think_end

    def constrained(rid):
        return {"constraint": compiler.compile(ConstraintSpec.regex("(ab|cd)+[0-9]{3}"))}

    def thinking(rid):
        return {"thinking": ThinkingControl(starts_in_thinking=True, think_end_id=think_end,
                                            budget=6, close_ids=(401, 402, think_end))}

    prompt = {"a": PROMPTS["a"]}
    free, _ = generate(artifact, OFF, prompt, 20, SEEDED)
    stop_id = free["a"][0][9]

    def stopping(rid):
        return {"stop_token_ids": frozenset({stop_id})}

    for make_request in (constrained, thinking, stopping):
        plain, _ = generate(artifact, OFF, prompt, 20, SEEDED, make_request=make_request)
        got, _ = generate(artifact, MTP3, prompt, 20, SEEDED, make_request=make_request)
        assert got["a"][0] == plain["a"][0], make_request.__name__
        assert got["a"][1].finish_reason is plain["a"][1].finish_reason
    assert plain["a"][1].finish_reason is FinishReason.STOP
    assert len(plain["a"][0]) == free["a"][0].index(stop_id) + 1


def test_mtp_catch_up_in_pieces_equals_the_head_over_the_whole_sequence(tiny_dense_path):
    """The head caught up over two chunks gives the logits of one pass over all positions."""
    tokens = np.random.default_rng(4).integers(0, 440, 100).tolist()
    whole = NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True)
    out = whole.prefill_with_hidden(PrefillChunk(0, tokens[:99], 0, [0, 1], all_logits=True))
    expected = whole.mtp_prefill(out.hidden, tokens[1:100], 0, [0, 1])
    pieces = NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True)
    pieces.prefill(PrefillChunk(0, tokens[:64], 0, [0, 1]))
    assert pieces.mtp_draft([MtpRow(0, tokens[1:65], 0, [0, 1])]) == [[]]
    pieces.prefill(PrefillChunk(0, tokens[64:99], 64, [0, 1]))
    drafts = pieces.mtp_draft([MtpRow(0, tokens[65:100], 64, [0, 1], num_drafts=3)])
    assert drafts[0][0] == int(np.argmax(expected.logits[-1]))
    assert len(drafts[0]) == 3
    with pytest.raises(ValueError, match="kept positions"):
        pieces.mtp_draft([MtpRow(0, tokens[1:10], 0, [0, 1])])


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_rounds_with_the_prefix_cache_pausing_and_resuming(tiny_dense_path, sampling):
    """Paused requests resume from the host tier on another or the same lane (the runner's
    kept hidden states are then someone else's: the head drafts again once caught up), and a
    second turn resumes from the cache; the tokens stay those of plain decoding."""
    rng = np.random.default_rng(0)
    # c's prompt is one block (64 tokens): with no snapshot interval, a prompt end that is a
    # multiple of 64 is the only state captured, and c's second turn resumes from it.
    prompts = {"a": rng.integers(0, 440, 100).tolist(), "b": rng.integers(0, 440, 110).tolist(),
               "c": rng.integers(0, 440, 64).tolist()}
    with open_artifact(tiny_dense_path) as artifact:
        expected, _ = generate(artifact, OFF, prompts, 30, sampling)
        layout = SlotLayout.for_config(2, MTP3)
        runner = NumpyRunner.from_artifact(artifact, num_pages=4, num_slots=layout.reserved + 2,
                                           mtp=True)
        config = EngineConfig(num_lanes=2, max_context=256, prefill_chunk=64,
                              service_turn_tokens=16, host_cache_bytes=64 << 20,
                              prefix_cache=True, snapshot_slots=2, speculative=MTP3)
        with Engine(runner, config) as engine:
            streams = {rid: engine.submit(EngineRequest(rid, tuple(p), sampling, 30))
                       for rid, p in prompts.items()}
            results = {rid: list(stream) for rid, stream in streams.items()}
            second = prompts["c"] + [t for o in results["c"] for t in o.token_ids] + [5, 6, 7]
            # The second turn hints its turn start (turn one's prompt end, 64: a block
            # boundary, it stays 64), as the server does.
            turn_start = {"snapshot_positions": (len(prompts["c"]),)}
            kept = sorted(e.position for e in engine.scheduler.cache.cache.entries()
                          if e.owner is None)
            again = list(engine.submit(EngineRequest("c2", tuple(second), sampling, 20,
                                                     **turn_start)))
            counters = dict(engine.counters)
        plain_again, _ = generate(artifact, OFF, {"c2": second}, 20, sampling,
                                  make_request=lambda rid: turn_start)
    preemptions = 0
    for rid, outputs in results.items():
        assert [t for o in outputs for t in o.token_ids] == expected[rid][0], rid
        preemptions += outputs[-1].stats.preemptions
    assert [t for o in again for t in o.token_ids] == plain_again["c2"][0]
    # Kept: the prompt ends that are multiples of 64 (no snapshot interval here): c's 64, not
    # a's 100 or b's 110; not turn one's end-of-answer state (64 + 30 - 1 tokens, computed by
    # decode and verification rounds).
    assert kept == [64] and 64 + 30 - 1 not in kept
    assert again[-1].cached_prompt_tokens == len(prompts["c"]) == 64   # at its turn start
    assert again[-1].stats.resume_path == "prefix"
    assert preemptions > 0 and counters["spec_rounds"] > 50


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_smaller_draft_vocabulary_keeps_the_output_of_plain_decoding(tiny_dense_path, sampling):
    """Drafts over the first 64 ids only (`--mtp-draft-vocab 64`): every draft is verified, so
    greedy and seeded output still equal plain decoding token for token."""
    with open_artifact(tiny_dense_path) as artifact:
        plain, _ = generate(artifact, OFF, PROMPTS, 24, sampling)
        got, counters = generate(artifact, MTP3, PROMPTS, 24, sampling, lanes=2, draft_vocab=64)
    for rid in PROMPTS:
        assert got[rid][0] == plain[rid][0], rid
    assert counters["spec_drafted_tokens"] > 1.5 * counters["spec_rounds"] >= 30


def _head_chain(runner, hidden, tokens, pages, k, vocab):
    """The head's catch-up over every position, then k drafts chained by hand from the head's
    own calls, each the argmax over ids 0..vocab-1."""
    out = runner.mtp_prefill(hidden, tokens, 0, pages)
    logits, h = out.logits[-1:], out.hidden[-1:]
    drafts = []
    for j in range(k):
        if j:
            step = runner.mtp_decode([DecodeItem(0, drafts[-1], len(tokens) + j - 1, pages)], h)
            logits, h = step.logits, step.hidden
        drafts.append(int(np.argmax(logits[0, :vocab])))
    return drafts


def test_drafts_are_the_argmax_over_the_draft_vocabulary(tiny_dense_path):
    tokens = np.random.default_rng(9).integers(0, 440, 41).tolist()
    pages = [0, 1]
    ref = NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True)
    hidden = ref.prefill_with_hidden(PrefillChunk(0, tokens[:40], 0, pages, all_logits=True)).hidden
    chains = {}
    for vocab in (None, 64):
        runner = NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True,
                                           mtp_draft_vocab=vocab)
        runner.prefill(PrefillChunk(0, tokens[:40], 0, pages))
        drafts = runner.mtp_draft([MtpRow(0, tokens[1:41], 0, pages, num_drafts=5)])[0]
        assert runner.mtp_draft_vocab == (vocab or runner.vocab_size)
        assert drafts == _head_chain(ref, hidden, tokens[1:41], pages, 5, runner.mtp_draft_vocab)
        chains[vocab] = drafts
    assert all(t < 64 for t in chains[64])
    # Not vacuous: the whole vocabulary's chain leaves the first 64 ids somewhere.
    assert any(t >= 64 for t in chains[None]), chains


@pytest.mark.parametrize("vocab", [0, 513, True, 2.5])
def test_a_draft_vocabulary_outside_the_model_is_refused(tiny_dense_path, vocab):
    with pytest.raises(ValueError, match="draft vocabulary"):
        NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True,
                                  mtp_draft_vocab=vocab)


def test_more_drafts_than_the_head_chains_are_refused(tiny_dense_path):
    runner = NumpyRunner.from_artifact(tiny_dense_path, num_pages=4, num_slots=1, mtp=True)
    runner.prefill(PrefillChunk(0, [1, 2, 3], 0, [0]))
    with pytest.raises(ValueError, match="num_drafts"):
        runner.mtp_draft([MtpRow(0, [2, 3], 0, [0], num_drafts=MTP_MAX_DRAFTS + 1)])
