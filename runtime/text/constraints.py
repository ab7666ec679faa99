"""Output constraints (JSON object, JSON Schema, GBNF, regex, literal choice, Lark) with llguidance.

Flow: the caller (CLI, server) builds a `ConstraintSpec` from its flags or request fields; a
per-model `ConstraintCompiler` turns it into a `RequestConstraint` (grammar compilation is cached
for identical specs); the engine asks the constraint for the allowed-token mask before sampling
each answer token and commits every output token afterwards. Why llguidance, and its measured
costs: ../shared/research/protocols.md section 3; the supported subset: docs/constraints.md.

Here: the spec, its llguidance grammar, and checking it without a tokenizer. The compiler is in
constraints_compiler.py, the per-request state (thinking and EOS handling) in
constraints_request.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

import llguidance

from runtime.text.constraints_gbnf import gbnf_to_lark
from runtime.text.gbnf_parser import GbnfError

KINDS = ("json_object", "json_schema", "grammar", "regex", "choice", "lark")

# Compact JSON (no whitespace, "," and ":" separators). Applied as overrides, so a schema's own
# "x-guidance" section cannot loosen it. Property order: llguidance emits declared properties in
# schema order (additional ones, where allowed, after them).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ConstraintError(ValueError):
    """An invalid constraint (bad schema, grammar, regex, choice list) or a token the constraint
    does not allow. The message names the problem; CLI exit 2 / HTTP 400 for the former."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What the answer must match. Frozen and hashable: identical specs share one compilation.

    kind:    "json_object" | "json_schema" | "grammar" (GBNF, entry rule `root`) | "regex" (the
             whole answer; '' allows only empty content) | "choice" (exact texts; '' allowed) |
             "lark" (llguidance Lark; used by the tool-call builders).
    payload: json_object: ""; json_schema: the schema as compact JSON text in declared key
             order; grammar / regex / lark: the source text; choice: tuple of candidate texts.
    strict:  json_schema only. True: a keyword llguidance cannot enforce (uniqueItems, not,
             if/then, ...) is an error. False: it is ignored and reported in `warnings`.
    Build specs with the classmethods; they validate and normalise the payload.
    """

    kind: str
    payload: Union[str, tuple[str, ...]] = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "choice":
            if not isinstance(self.payload, tuple) or not self.payload:
                raise ConstraintError("choice needs at least one candidate text")
            if not all(isinstance(text, str) for text in self.payload):
                raise ConstraintError("choice candidates must be strings")
        elif not isinstance(self.payload, str):
            raise ConstraintError(f"{self.kind} payload must be a string")

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: Union[Mapping[str, Any], str, bool], *,
                    strict: bool = True) -> "ConstraintSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"invalid JSON schema: not valid JSON ({exc})") from None
        if schema is True:
            schema = {}
        if schema is False:
            raise ConstraintError("invalid JSON schema: `false` allows no value at all")
        if not isinstance(schema, Mapping):
            raise ConstraintError(
                f"invalid JSON schema: expected an object, got {type(schema).__name__}")
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", text, strict)

    @classmethod
    def grammar(cls, gbnf: str) -> "ConstraintSpec":
        return cls("grammar", gbnf)

    @classmethod
    def regex(cls, pattern: str) -> "ConstraintSpec":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, texts: Iterable[str]) -> "ConstraintSpec":
        return cls("choice", tuple(texts))

    @classmethod
    def lark(cls, grammar: str) -> "ConstraintSpec":
        return cls("lark", grammar)

    def describe(self) -> str:
        """Short human description for logs and error messages."""
        if self.kind == "choice":
            return f"choice of {len(self.payload)} texts"
        size = len(self.payload)
        return self.kind if size == 0 else f"{self.kind} ({size} chars)"


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text` (every non-alphanumeric character as a \\x{..} escape)."""
    return "".join(c if c.isascii() and c.isalnum() else "\\x{%x}" % ord(c) for c in text)


def json_schema_for_lark(schema: Mapping[str, Any], *, strict: bool) -> str:
    """The schema with our JSON options, as text for llguidance's inline `%json { ... }`."""
    options = dict(schema.get("x-guidance") or {}) if isinstance(schema, Mapping) else {}
    options.update(_JSON_OPTIONS)
    options["lenient"] = not strict
    return json.dumps({**schema, "x-guidance": options}, separators=(",", ":"),
                      ensure_ascii=False)


def llguidance_grammar(spec: ConstraintSpec, special_token_id=None) -> str:
    """The llguidance grammar definition for a spec. Raises ConstraintError for GBNF syntax
    errors; other problems (bad regex, unsupported schema) surface when the grammar is built."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=dict(_JSON_OPTIONS))
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.payload, overrides={**_JSON_OPTIONS, "lenient": not spec.strict})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.payload)
    if spec.kind == "choice":
        alternatives = "|".join(_regex_literal(text) for text in spec.payload)
        return llguidance.LLMatcher.grammar_from_regex(f"(?:{alternatives})")
    if spec.kind == "grammar":
        try:
            lark = gbnf_to_lark(spec.payload, special_token_id)
        except GbnfError as exc:
            raise ConstraintError(f"invalid grammar: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(spec.payload)


def error_text(spec: ConstraintSpec, detail: str) -> str:
    """The ConstraintError message for an llguidance error `detail` about `spec`."""
    what = {"json_object": "JSON object constraint", "json_schema": "invalid JSON schema",
            "grammar": "invalid grammar", "regex": "invalid regex", "choice": "invalid choice",
            "lark": "invalid Lark grammar"}[spec.kind]
    # llguidance errors span lines (the Lark source with a caret under the spot); keep the
    # message lines. Positions refer to the Lark we generated, so drop them unless the user
    # wrote the Lark.
    kept = []
    for line in detail.strip().splitlines():
        line = line.strip()
        if not line or set(line) <= {"^", " "} or re.match(r"\d+ \|", line):
            continue
        kept.append(line)
    detail = " ".join(kept)
    if spec.kind != "lark":
        detail = re.sub(r"^at \d+\(\d+\): ", "", detail)
        detail = re.sub(r'^invalid regex ".*?" \(in regex\): ', "", detail)
    if spec.kind == "json_schema" and "Unimplemented keys" in detail:
        detail += " (not enforceable; a non-strict schema ignores them with a warning)"
    return f"{what}: {detail}"


def check_spec(spec: ConstraintSpec) -> list[str]:
    """Validate a spec without a tokenizer (fast, for argument checking before a model loads).
    Returns warnings; raises ConstraintError naming the problem. Special-token names in Lark or
    GBNF are only checked at compile time, against the real tokenizer."""
    grammar = llguidance_grammar(spec, special_token_id=lambda name: 0)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(error_text(spec, messages[0]))
    return list(messages)
