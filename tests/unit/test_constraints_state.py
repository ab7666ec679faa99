"""The per-request constraint state and the compiler around it, on the real Qwen3.5/3.6
vocabulary: thinking before the constrained answer, rollback, packed and batched masks, the
compilation cache, and tokens the constraint does not allow.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from constraint_walks import ARITH, IM_END, SCHEMA, THINK_END, TOOL_CALL, VOCAB
from runtime.text.constraints import ConstraintError, ConstraintSpec



# ---------------------------------------------------------------------------------------------
# thinking, rollback, masks, cache


def test_thinking_then_constrained_answer(compiler, walker):
    pattern = r"(BUG|TASK)-[0-9]{4}"
    spec = ConstraintSpec.regex(pattern)
    rng = np.random.default_rng(10)
    separators = 0
    for _ in range(20):
        constraint = compiler.compile(spec, starts_in_thinking=True, think_end_id=THINK_END)
        for _ in range(int(rng.integers(0, 5))):
            assert constraint.allowed_mask(VOCAB) is None and constraint.in_thinking
            assert not constraint.is_accepting() and not constraint.is_finished()
            constraint.commit(int(rng.integers(0, 248000)))  # anything goes while thinking
        constraint.commit(THINK_END)
        mask = constraint.allowed_mask(VOCAB)
        separator = compiler.vocab.separator_id
        assert mask[separator] and not mask[IM_END]
        if rng.random() < 0.5:
            constraint.commit(separator)  # the "\n\n" the parser drops, once
            separators += 1
            assert not constraint.allowed_mask(VOCAB)[separator]
        ids, ended = walker.walk(constraint, rng)
        assert ended and re.fullmatch(pattern, walker.text(ids))
    assert 0 < separators < 20


def test_thinking_banned_ids_mask(compiler):
    constraint = compiler.compile(ConstraintSpec.json_object(), starts_in_thinking=True,
                                  think_end_id=THINK_END, thinking_banned_ids=[TOOL_CALL])
    mask = constraint.allowed_mask(VOCAB)
    assert not mask[TOOL_CALL] and not mask[248077:].any() and mask[:248077].sum() == 248076
    with pytest.raises(ConstraintError, match="not allowed while thinking"):
        constraint.commit(TOOL_CALL)
    constraint.commit(THINK_END)
    assert constraint.allowed_mask(VOCAB)[compiler.tokenizer.tokenize_str("{")[0]]


def _mask_copy(constraint):
    mask = constraint.allowed_bitmask_u32(VOCAB)
    return None if mask is None else mask.copy()


def _masks_along(constraint, ids):
    masks = []
    for token in ids:
        masks.append(_mask_copy(constraint))
        constraint.commit(token)
    masks.append(_mask_copy(constraint))
    return masks


def test_rollback_restores_every_state(compiler):
    tok = compiler.tokenizer
    text = '{"name":"Ada","age":36,"kind":"y","nested":{"ok":true}}'
    ids = [THINK_END, compiler.vocab.separator_id] + tok.tokenize_str(text) + [IM_END]
    constraint = compiler.compile(ConstraintSpec.json_schema(SCHEMA), starts_in_thinking=True,
                                  think_end_id=THINK_END)
    constraint.commit(5)  # a thinking token
    masks = _masks_along(constraint, ids)
    assert constraint.is_finished()
    rng = np.random.default_rng(11)
    position = len(ids)
    while position > 0:
        back = int(rng.integers(1, min(position, 6) + 1))
        constraint.rollback(back)
        position -= back
        if masks[position] is None:
            assert constraint.allowed_bitmask_u32(VOCAB) is None
        else:
            np.testing.assert_array_equal(constraint.allowed_bitmask_u32(VOCAB), masks[position])
    assert constraint.in_thinking and constraint.num_committed == 1
    assert _masks_along(constraint, ids)[-1].tolist() == masks[-1].tolist()  # replay matches
    with pytest.raises(ValueError):
        constraint.rollback(constraint.num_committed + 1)


def test_bitmask_matches_bool_mask_and_batch_fill(compiler):
    tok = compiler.tokenizer
    specs = [ConstraintSpec.json_object(), ConstraintSpec.regex("[a-z]+!"),
             ConstraintSpec.choice(["yes", "no"]), ConstraintSpec.grammar(ARITH)]
    constraints = [compiler.compile(spec) for spec in specs]
    constraints[0].commit(tok.tokenize_str("{")[0])
    constraints[1].commit(tok.tokenize_str("abc")[0])
    constraints.append(compiler.compile(specs[0], starts_in_thinking=True, think_end_id=THINK_END))
    words = (VOCAB + 31) // 32
    out = np.full((len(constraints) + 1, words), 0x5A5A5A5A, dtype=np.uint32)  # poisoned
    rows = [(constraint, index + 1) for index, constraint in enumerate(constraints)]
    written = compiler.fill_bitmasks(rows, out)
    assert written == [True, True, True, True, False]
    assert (out[0] == 0x5A5A5A5A).all() and (out[-1] == 0x5A5A5A5A).all()
    for index, constraint in enumerate(constraints[:-1]):
        packed = constraint.allowed_bitmask_u32(VOCAB)
        np.testing.assert_array_equal(out[index + 1], packed)
        bools = constraint.allowed_mask(VOCAB)
        unpacked = np.array([(int(packed[i // 32]) >> (i % 32)) & 1 for i in range(VOCAB)],
                            dtype=bool)
        np.testing.assert_array_equal(bools, unpacked)
        assert bools.any() and not bools[248077:].any()
    row = np.empty(words, dtype=np.int32)
    assert constraints[0].fill_bitmask(row)
    np.testing.assert_array_equal(row.view(np.uint32), constraints[0].allowed_bitmask_u32())


def test_cache_shares_compilation_not_state(compiler):
    spec = ConstraintSpec.json_schema(SCHEMA)
    first = compiler.compile(spec)
    second = compiler.compile(ConstraintSpec.json_schema(json.dumps(SCHEMA)))
    assert second.spec == spec and hash(second.spec) == hash(spec)  # same cache entry
    assert compiler._compiled(spec)[2] is None  # a hit: no new validation
    first.commit(compiler.tokenizer.tokenize_str("{")[0])
    assert second.num_committed == 0 and not np.array_equal(
        first.allowed_bitmask_u32(), second.allowed_bitmask_u32())


def test_cannot_finish_within_limit_reports_not_accepting(compiler, walker):
    constraint = compiler.compile(ConstraintSpec.regex("[0-9]{40}"))
    ids, ended = walker.walk(constraint, np.random.default_rng(12), cap=5)
    assert not ended and len(ids) == 5
    assert not constraint.is_accepting() and not constraint.is_finished()
    assert not constraint.allowed_mask(VOCAB)[IM_END]  # the engine ends with `length`
    with pytest.raises(ConstraintError, match="before the constraint is complete"):
        constraint.commit(IM_END)


def test_disallowed_token_raises_and_keeps_state(compiler):
    constraint = compiler.compile(ConstraintSpec.choice(["yes", "no"]))
    before = constraint.allowed_bitmask_u32().copy()
    with pytest.raises(ConstraintError, match="not allowed by the choice"):
        constraint.commit(compiler.tokenizer.tokenize_str("maybe")[0])
    with pytest.raises(ConstraintError):
        constraint.commit(248100)  # a padding id
    np.testing.assert_array_equal(constraint.allowed_bitmask_u32(), before)
    constraint.commit(compiler.tokenizer.tokenize_str("yes")[0])
    assert constraint.is_accepting()
