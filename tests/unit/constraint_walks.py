"""Seeded random walks through a constraint's masks on the real Qwen3.5/3.6 vocabulary, shared by
the constraint tests (test_constraints*.py), with the vocabulary's ids and the specs several of
those files walk.

The core check is the random walk: sample a random allowed token from the mask, commit it, repeat
until EOS or a cap; every finished walk must parse / match. Random tokens are the worst case for
a mask (a model's outputs are at least plausible), so a wrong bit shows up quickly. To make walks
end, they prefer short tokens and, after a soft limit, token sequences that close structures
(quotes, brackets, tags) whenever the constraint accepts them.
"""

from __future__ import annotations

import re

import numpy as np

from runtime.text.constraints_compiler import ConstraintCompiler

VOCAB = 248320
IM_END, ENDOFTEXT, THINK_END, TOOL_CALL = 248046, 248044, 248069, 248058
WALKS = 100

_CLOSERS = ['"', "}", "]", '"}', "0", "1", "true", "null", ")", ".", "Z", "\n</parameter>\n",
            "</function>\n", "</tool_call>"]


class Walker:
    """Seeded random walks through a constraint's masks."""

    def __init__(self, compiler: ConstraintCompiler):
        tok = compiler.tokenizer
        self.tok = tok
        n = compiler.vocab.tokenizer_size
        lengths = np.array([99 if tok.is_special_token(i) else len(tok.decode_bytes([i]))
                            for i in range(n)])
        self.short_ids = np.flatnonzero(lengths <= 2)
        self.closers = [tok.tokenize_str(text, parse_special=True) for text in _CLOSERS]

    def walk(self, constraint, rng, *, cap: int = 160, soft: int = 30) -> tuple[list[int], bool]:
        """Returns (committed ids, ended with EOS)."""
        ids: list[int] = []
        while len(ids) < cap:
            mask = constraint.allowed_mask(VOCAB)
            assert mask is not None and mask.shape == (VOCAB,) and mask.dtype == np.bool_
            assert not mask[248077:].any(), "padding id allowed"
            if constraint.is_finished():
                assert np.flatnonzero(mask).tolist() == [IM_END]
            if mask[IM_END] and (len(ids) >= soft or rng.random() < 0.3):
                assert constraint.is_accepting()
                constraint.commit(IM_END)
                return ids, True
            assert constraint.is_accepting() == bool(mask[IM_END])
            if len(ids) >= soft:
                # validate_tokens accepts any tokenization; the mask keeps forced text canonical,
                # so it is stricter: follow a closer only while the mask allows it.
                fitting = [seq for seq in self.closers
                           if mask[seq[0]] and constraint.validate_tokens(seq) == len(seq)]
                if fitting:
                    for token in fitting[rng.integers(len(fitting))]:
                        if not constraint.allowed_mask(VOCAB)[token]:
                            break
                        constraint.commit(token)
                        ids.append(token)
                    continue
            short = self.short_ids[mask[self.short_ids]]
            pool = short if len(short) and rng.random() < 0.7 else np.flatnonzero(mask)
            assert len(pool), "dead end: the mask allows nothing"
            token = int(pool[rng.integers(len(pool))])
            constraint.commit(token)
            if token == IM_END:
                return ids, True
            ids.append(token)
        return ids, False

    def text(self, ids: list[int]) -> str:
        return self.tok.decode_bytes([i for i in ids if i != IM_END]).decode("utf-8")




def run_walks(compiler, walker, spec, check, *, seed: int, walks: int = WALKS, **kw) -> int:
    """`walks` seeded walks; every finished one must pass `check(text)`. Returns how many
    finished (most must: a walk that hits the cap is the engine's `length` case)."""
    rng = np.random.default_rng(seed)
    finished = 0
    for _ in range(walks):
        constraint = compiler.compile(spec)
        ids, ended = walker.walk(constraint, rng, **kw)
        if ended:
            finished += 1
            text = walker.text(ids)
            try:
                check(text)
            except Exception as exc:
                raise AssertionError(f"invalid output {text!r}: {exc}") from exc
    assert finished >= walks * 0.9, f"only {finished}/{walks} walks finished"
    return finished


def _assert_compact(text: str) -> None:
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), "whitespace outside strings"


# ---------------------------------------------------------------------------------------------
# specs that several test files walk

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y"]},
        "score": {"type": ["number", "null"]},
        "when": {"type": "string", "format": "date"},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}

ARITH = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*      # left-associative sums
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""
