"""Thinking controls: the budget's exact-boundary insertion, its priorities and room check, and
the reasoning-loop guard (unit level and through the engine on fake runners)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, FinishReason, SamplingParams, ThinkingControl
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.thinking import (LOOP_CHECK_EVERY, WORD_CONTINUES, WORD_SEPARATOR,
                                     WORD_STARTS, ThinkingAction, ThinkingTracker,
                                     budget_room_error, looping_share)
from test_engine_fakes import FakeRunner, reference_greedy

PROMPT = [3, 1, 4, 1, 5]
CLOSE = (50, 51, 52, 63)     # "guidance" ids, then </think> = 63


def greedy_ids(n=60):
    return reference_greedy(FakeRunner, PROMPT, n)


def think_end_absent_from(ids):
    return next(t for t in range(64) if t not in ids)


def run(engine, control, max_new=40, rid="a", stop=frozenset(), sampling=None):
    stream = engine.submit(EngineRequest(
        request_id=rid, prompt_ids=tuple(PROMPT),
        sampling=sampling or SamplingParams(greedy=True),
        max_new_tokens=max_new, stop_token_ids=stop, thinking=control))
    tokens, inserted, final = [], [], None
    for out in stream:
        tokens.extend(out.token_ids)
        inserted.extend(out.inserted)
        final = out
    return tokens, inserted, final


@pytest.fixture
def engine():
    engine = Engine(FakeRunner(), EngineConfig(max_context=1024)).start()
    yield engine
    engine.shutdown()


# --- the budget --------------------------------------------------------------------------------

def test_budget_inserts_exactly_the_close_span_at_the_boundary(engine):
    free = greedy_ids()
    end_id = think_end_absent_from(free)
    control = ThinkingControl(starts_in_thinking=True, think_end_id=end_id, budget=7,
                              close_ids=CLOSE[:-1] + (end_id,))
    tokens, inserted, final = run(engine, control, max_new=20)
    assert tokens[:7] == free[:7]                          # model tokens up to the boundary
    assert tuple(tokens[7:11]) == control.close_ids         # then the span, not sampled
    assert inserted == [False] * 7 + [True] * 4 + [False] * 9
    assert final.stats.inserted_tokens == 4 and final.stats.thinking_closed_by == "budget"
    assert final.stats.thinking_tokens == 7 and len(tokens) == 20


def test_no_insertion_when_the_model_closes_first(engine):
    free = greedy_ids()
    end_id = free[3]                                        # the 4th model token closes
    control = ThinkingControl(starts_in_thinking=True, think_end_id=end_id, budget=4,
                              close_ids=(50, end_id))
    tokens, inserted, final = run(engine, control, max_new=15)
    assert not any(inserted)
    assert final.stats.thinking_closed_by == "model" and final.stats.thinking_tokens == 4


def test_stop_at_the_boundary_suppresses_the_insertion(engine):
    free = greedy_ids()
    end_id = think_end_absent_from(free)
    control = ThinkingControl(starts_in_thinking=True, think_end_id=end_id, budget=5,
                              close_ids=(50, end_id))
    tokens, inserted, final = run(engine, control, max_new=20, stop=frozenset({free[4]}))
    assert final.finish_reason is FinishReason.STOP and not any(inserted)


def test_output_limit_at_the_boundary_suppresses_the_insertion(engine):
    free = greedy_ids()
    end_id = think_end_absent_from(free)
    control = ThinkingControl(starts_in_thinking=True, think_end_id=end_id, budget=5,
                              close_ids=(50, end_id))
    tokens, inserted, final = run(engine, control, max_new=5)
    assert final.finish_reason is FinishReason.LENGTH and tokens == free[:5]


def test_budget_only_applies_inside_thinking(engine):
    free = greedy_ids()
    control = ThinkingControl(starts_in_thinking=False, think_end_id=63, budget=2,
                              close_ids=(50, 63))
    tokens, inserted, _ = run(engine, control, max_new=10)
    assert tokens == free[:10] and not any(inserted)


def test_budget_room_check():
    control = ThinkingControl(starts_in_thinking=True, think_end_id=9, budget=10,
                              close_ids=(1, 2, 9))
    assert budget_room_error(control, 10, 5, 1000) is None     # ends at the budget anyway
    assert budget_room_error(control, 14, 5, 1000) is None     # 10 + 3 + 1
    assert "allow at least 14" in budget_room_error(control, 13, 5, 1000)
    # The effective capacity is min(max_new, context room): the context can make it too small.
    assert budget_room_error(control, 100, 985, 1000) is None  # room 15 >= 14
    assert budget_room_error(control, 100, 988, 1000) is not None  # room 12: 10 < 12 < 14
    assert budget_room_error(control, 100, 990, 1000) is None  # room 10: ends at the budget
    assert budget_room_error(ThinkingControl(budget=3, close_ids=(1,)), 4, 1, 100) is None


# --- the loop guard ---------------------------------------------------------------------------

class LoopRunner(FakeRunner):
    """Emits a fixed 12-token cycle forever (a model stuck repeating itself)."""

    CYCLE = list(range(20, 32))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.pos = [0] * self.num_slots

    def _consume(self, slot, token, pos, page_table):
        super()._consume(slot, token, pos, page_table)
        self.pos[slot] = pos + 1

    def logits_for_slot(self, slot):
        row = np.zeros(self.vocab_size, dtype=np.float32)
        row[self.CYCLE[self.pos[slot] % 12]] = 10.0
        return row

    def prefill(self, chunk):
        super().prefill(chunk)
        return self.logits_for_slot(chunk.slot)[None, :]

    def decode(self, items):
        super().decode(items)
        return np.stack([self.logits_for_slot(item.slot) for item in items])


@pytest.mark.parametrize("mode", ["stop", "conclude"])
def test_loop_guard_on_a_repeating_model(mode):
    engine = Engine(LoopRunner(), EngineConfig(max_context=4096)).start()
    try:
        control = ThinkingControl(starts_in_thinking=True, think_end_id=63, loop_guard=mode,
                                  close_ids=(50, 63))
        tokens, inserted, final = run(engine, control, max_new=LOOP_CHECK_EVERY + 30)
    finally:
        engine.shutdown()
    if mode == "stop":
        assert final.finish_reason is FinishReason.STOP
        assert len(tokens) == LOOP_CHECK_EVERY and not any(inserted)
    else:
        assert tokens[LOOP_CHECK_EVERY:LOOP_CHECK_EVERY + 2] == [50, 63]
        assert inserted.count(True) == 2 and final.stats.thinking_closed_by == "loop"
        assert final.finish_reason is FinishReason.LENGTH


def test_loop_guard_off_never_fires():
    engine = Engine(LoopRunner(), EngineConfig(max_context=4096)).start()
    try:
        control = ThinkingControl(starts_in_thinking=True, think_end_id=63, close_ids=(50, 63))
        tokens, inserted, final = run(engine, control, max_new=LOOP_CHECK_EVERY + 10)
    finally:
        engine.shutdown()
    assert final.finish_reason is FinishReason.LENGTH and not any(inserted)


def test_looping_share_counts_words_in_thrice_seen_passages():
    rng = np.random.default_rng(0)
    fresh = list(rng.integers(0, 10**9, size=2000))
    assert looping_share(fresh) == 0.0
    passage = list(range(100, 112))
    looped = fresh[:1400] + passage * 50
    assert looping_share(looped[-2000:]) >= 0.25
    twice = fresh[:1976] + passage * 2                       # seen only twice: not a loop
    assert looping_share(twice) == 0.0


def test_tracker_builds_words_from_the_kind_table():
    kinds = np.full(64, WORD_CONTINUES, dtype=np.int8)
    kinds[1] = WORD_STARTS          # " the"
    kinds[2] = WORD_SEPARATOR       # "\n"
    control = ThinkingControl(starts_in_thinking=True, think_end_id=63, loop_guard="stop",
                              word_kinds=kinds)
    tracker = ThinkingTracker(control)
    for token in [1, 5, 6, 1, 7, 2, 8, 1]:
        assert tracker.on_model_token(token) is ThinkingAction.NONE
    words = tracker._words.window()
    # " the"+5+6 | " the"+7 | 8 ; the last " the" is still being written
    assert words == [hash((1, 5, 6)), hash((1, 7)), hash((8,))]


def test_tracker_counts_the_natural_close():
    control = ThinkingControl(starts_in_thinking=True, think_end_id=9, budget=3)
    tracker = ThinkingTracker(control)
    assert tracker.on_model_token(1) is ThinkingAction.NONE
    assert tracker.on_model_token(9) is ThinkingAction.NONE
    assert not tracker.open and tracker.model_tokens == 2
    assert tracker.on_model_token(1) is ThinkingAction.NONE   # answer tokens: no budget


def test_word_kinds_from_token_bytes():
    from runtime.session import word_kinds_table

    table = [b" the", b"\n\n", b" ", b"ing", b".", b"\xe4\xb8", b"\tx", b""]
    kinds = word_kinds_table(table, 10)                       # 2 padding rows beyond the table
    assert list(kinds) == [WORD_STARTS, WORD_SEPARATOR, WORD_SEPARATOR, WORD_CONTINUES,
                           WORD_CONTINUES, WORD_CONTINUES, WORD_STARTS, WORD_CONTINUES,
                           WORD_CONTINUES, WORD_CONTINUES]
