"""Constrained generation through the whole stack on the tiny random-weight model with the real
Qwen3.5/3.6 vocabulary: chat template, engine (8 lanes), sampler with masks, output parser.

The model's weights are random, so what it prefers is arbitrary: every output that comes back
valid shows the mask held, not that the model knew the format. Each mode runs 100 seeded
requests; the grammars are bounded or shallow enough for 96 tokens, so every request must end with `stop` (the
constraint let the model finish) and its answer must match.

The unbounded JSON-object mode needs help to finish: a random model inside a JSON string never
closes it by itself (0 of 100 seeded requests within 96 tokens, measured), so after a soft limit
the test narrows the constraint's real mask to the closing tokens it allows (`_ClosingPressure`).
Narrowing only removes tokens, so what makes every answer valid is still the constraint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from runtime.config import parse_settings
from runtime.engine.api import FinishReason
from runtime.engine.presets import SamplingOverrides
from runtime.text.constraints import ConstraintSpec
from runtime.text.parser import OutputAccumulator, QwenOutputParser

GENERATIONS = 100
MAX_NEW = 96
THINKING_BUDGET = 8

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]},
                   "score": {"type": "integer", "minimum": 0, "maximum": 9},
                   "sure": {"type": "boolean"}},
    "required": ["answer", "score", "sure"],
    "additionalProperties": False,
}
REGEX = r"(BUG|TASK)-[0-9]{4}"
CHOICES = ["positive", "neutral", "negative"]
# Recursive: comma-separated yes/no items, where an item may be a bracketed list again.
GRAMMAR = 'root ::= item | item ", " root\nitem ::= "yes" | "no" | "[" root "]"\n'


def _nested_list(text: str) -> bool:
    """The language of GRAMMAR, checked independently of llguidance."""
    position = 0

    def items() -> bool:
        nonlocal position
        if not item():
            return False
        while text.startswith(", ", position):
            position += 2
            if not item():
                return False
        return True

    def item() -> bool:
        nonlocal position
        for word in ("yes", "no"):
            if text.startswith(word, position):
                position += len(word)
                return True
        if text.startswith("[", position):
            position += 1
            if not items() or not text.startswith("]", position):
                return False
            position += 1
            return True
        return False

    return items() and position == len(text)


MODES = {
    "json_schema": (ConstraintSpec.json_schema(SCHEMA),
                    lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None
                    and text == json.dumps(json.loads(text), separators=(",", ":"))),
    "regex": (ConstraintSpec.regex(REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (ConstraintSpec.choice(CHOICES), lambda text: text in CHOICES),
    "grammar": (ConstraintSpec.grammar(GRAMMAR), _nested_list),
}


@pytest.fixture(scope="module")
def session(tiny_real_vocab_path):
    from runtime.session import ModelSession

    settings = parse_settings("serve", [str(tiny_real_vocab_path), "--device", "cpu",
                                        "--max-concurrency", "8", "--max-context", "256",
                                        "--max-pending-requests", str(GENERATIONS)])
    opened = ModelSession.open(settings)
    yield opened
    opened.close()


class _ClosingPressure:
    """The engine-facing constraint (runtime.engine.api.OutputConstraint) of a real JSON one
    whose mask, from `soft` committed tokens on, is narrowed to the first group of closing
    tokens it allows any of; the way the unit tests' random walks end structures, here under
    the engine's sampler. The order makes every step progress: inside a value string `"}` /
    `"]` close it and its container (at a value position they open a string to close next);
    inside a key `":` ends it; outside strings `}` / `]` close containers; `"` starts the key
    a comma asked for; digits and literals are for the rest (`\\u` escapes)."""

    GROUPS = (('"}', '"]'), ('":',), ("}", "]", "}}", "]}", "}]", "]]"), ('"',),
              ("0", "null", "true"))

    def __init__(self, constraint, groups: list, soft: int):
        self.constraint = constraint
        self.groups = groups
        self.soft = soft

    @classmethod
    def group_bitmasks(cls, session) -> list:
        compiler = session.constraint_compiler
        groups = [[*session.tokenizer.eos_ids]]
        for texts in cls.GROUPS:
            ids = [compiler.tokenizer.tokenize_str(text) for text in texts]
            groups.append([i[0] for i in ids if len(i) == 1])
        bitmasks = []
        for ids in groups:
            bitmask = np.zeros(compiler.vocab.words, dtype=np.uint32)
            for token_id in ids:
                bitmask[token_id // 32] |= np.uint32(1 << (token_id % 32))
            bitmasks.append(bitmask)
        return bitmasks

    def allowed_bitmask_u32(self, vocab_size: int):
        mask = self.constraint.allowed_bitmask_u32(vocab_size)
        if mask is None or self.constraint.num_committed < self.soft:
            return mask
        for group in self.groups:
            narrowed = mask & group
            if narrowed.any():
                return narrowed
        return mask

    def commit(self, token_id: int) -> None:
        self.constraint.commit(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.constraint.rollback(num_tokens)


def _answers(session, spec, thinking: bool, count: int = GENERATIONS, wrap=None):
    prompt = session.render([{"role": "user", "content": "Answer in the required format."}],
                            enable_thinking=thinking)
    streams = []
    for seed in range(count):
        constraint = session.compile_constraint(spec, prompt.thinking)
        if wrap is not None:
            constraint = wrap(constraint)
        sampling = session.sampling(prompt.thinking, SamplingOverrides(seed=seed),
                                    constrained=True)
        # Thinking: a budget closes the think block (the random model rarely would) so the
        # constrained answer always gets its turn.
        streams.append(session.engine.submit(session.build_request(
            prompt, max_new_tokens=MAX_NEW, sampling=sampling, constraint=constraint,
            thinking_budget=THINKING_BUDGET if thinking else None)))
    results = []
    for stream in streams:
        ids, final = [], None
        for output in stream:
            ids.extend(output.token_ids)
            final = output
        parser = QwenOutputParser(session.tokenizer, starts_in_reasoning=prompt.thinking)
        accumulated = OutputAccumulator()
        accumulated.add(parser.feed(ids))
        accumulated.add(parser.finish(truncated=final.finish_reason is not FinishReason.STOP))
        results.append((final.finish_reason, accumulated))
    return results


@pytest.mark.parametrize("mode", list(MODES))
def test_hundred_seeded_generations_all_valid(session, mode):
    spec, valid = MODES[mode]
    results = _answers(session, spec, thinking=False)
    reasons = [reason for reason, _ in results]
    assert reasons == [FinishReason.STOP] * GENERATIONS
    answers = [accumulated.content for _, accumulated in results]
    invalid = [answer for answer in answers if not valid(answer)]
    assert invalid == []
    assert len(set(answers)) > 1  # seeds really vary the output


def test_hundred_seeded_json_objects(session):
    groups = _ClosingPressure.group_bitmasks(session)
    results = _answers(session, ConstraintSpec.json_object(), thinking=False,
                       wrap=lambda constraint: _ClosingPressure(constraint, groups, soft=24))
    assert [reason for reason, _ in results] == [FinishReason.STOP] * GENERATIONS
    answers = [accumulated.content for _, accumulated in results]
    objects = [json.loads(answer) for answer in answers]
    assert all(isinstance(value, dict) for value in objects)
    assert all(answer == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
               for answer, value in zip(answers, objects))  # compact, as llguidance writes it
    assert len(set(answers)) > 1 and sum(bool(value) for value in objects) > GENERATIONS // 2


def test_thinking_then_constrained_answer(session):
    """Thinking first (unconstrained, closed by the budget or the model), then an answer after
    `</think>` that matches the constraint."""
    spec, valid = MODES["regex"]
    results = _answers(session, spec, thinking=True, count=20)
    assert [reason for reason, _ in results] == [FinishReason.STOP] * 20
    assert all(acc.reasoning and valid(acc.content) for _, acc in results)


def test_tool_call_constraint_keeps_calls_out_of_the_think_block(session):
    """A `<tool_call>` while thinking would be parsed as a call the grammar never checked
    (custom tool inputs included), so tool-call constraints do not allow it there."""
    from runtime.text.constraints_tools import tool_call_spec

    spec = tool_call_spec([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    vocab, special = session.runner.vocab_size, session.tokenizer.special
    guarded = session.compile_constraint(spec, True, tool_calls=True)
    mask = guarded.allowed_mask(vocab)
    assert not mask[special.tool_call] and mask[special.think_end] and mask[:1000].all()
    assert session.compile_constraint(spec, True).allowed_mask(vocab) is None
    guarded.commit(special.think_end)  # after </think> the call is what the grammar wants
    assert guarded.allowed_mask(vocab)[special.tool_call]
