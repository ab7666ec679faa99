"""GBNF (llama.cpp grammar dialect) text to a syntax tree: rules of Literal, CharClass, AnyChar,
RuleRef, TokenRef, Sequence, Alternatives and Repeat nodes (constraints_gbnf.py translates it).

Supported: rules `name ::= ...` (entry rule `root`), alternation `|`, grouping `( )`, string
literals, character classes with ranges, negation and `\\x`/`\\u`/`\\U` escapes, `.` (any
character, newline included), repetition `*` `+` `?` `{m}` `{m,}` `{m,n}` `{,n}`, recursion (left
or right), `#` comments, rules spanning lines, and llama.cpp's token syntax `<name>`, `<[id]>`,
`!<name>`, `!<[id]>` (a single special token, or any single token but that one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union


class GbnfError(ValueError):
    """A GBNF syntax or reference error; the message names the line and column."""


# ---------------------------------------------------------------------------------------------
# AST


@dataclass(frozen=True)
class Literal:
    text: str


@dataclass(frozen=True)
class CharClass:
    ranges: tuple[tuple[int, int], ...]  # inclusive code point ranges
    negated: bool


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class RuleRef:
    name: str
    line: int
    col: int


@dataclass(frozen=True)
class TokenRef:
    """A special-token reference: by `name` (e.g. "think") or by numeric `token_id`."""

    name: Optional[str]
    token_id: Optional[int]
    negated: bool
    line: int
    col: int


@dataclass(frozen=True)
class Sequence:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Alternatives:
    options: tuple["Node", ...]


@dataclass(frozen=True)
class Repeat:
    item: "Node"
    min_count: int
    max_count: Optional[int]  # None = unbounded


Node = Union[Literal, CharClass, AnyChar, RuleRef, TokenRef, Sequence, Alternatives, Repeat]


@dataclass(frozen=True)
class Rule:
    name: str
    body: Node
    line: int


def children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Sequence):
        return node.items
    if isinstance(node, Alternatives):
        return node.options
    if isinstance(node, Repeat):
        return (node.item,)
    return ()


# ---------------------------------------------------------------------------------------------
# Parser

_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START_RE = re.compile(r"[A-Za-z0-9_-]+[ \t]*::=")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0"}


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    # -- positions and errors --

    def _line_col(self, pos: int) -> tuple[int, int]:
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return line, col

    def error(self, message: str, pos: Optional[int] = None) -> GbnfError:
        line, col = self._line_col(self.pos if pos is None else pos)
        return GbnfError(f"GBNF line {line}, column {col}: {message}")

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos:self.pos + n]

    def skip_space(self) -> None:
        """Spaces, tabs, newlines and `#` comments separate items anywhere."""
        text = self.text
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in " \t\r\n":
                self.pos += 1
            elif ch == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end + 1
            else:
                break

    def at_rule_start(self) -> bool:
        return _RULE_START_RE.match(self.text, self.pos) is not None

    # -- grammar --

    def parse(self) -> list[Rule]:
        rules: list[Rule] = []
        self.skip_space()
        while self.pos < len(self.text):
            rules.append(self.parse_rule())
            self.skip_space()
        return rules

    def parse_rule(self) -> Rule:
        start = self.pos
        match = _NAME_RE.match(self.text, self.pos)
        if match is None:
            raise self.error(f"expected a rule name, found {self.peek()!r}")
        name = match.group()
        self.pos = match.end()
        while self.peek() in (" ", "\t"):
            self.pos += 1
        if self.peek(3) != "::=":
            raise self.error(f"expected '::=' after rule name {name!r}")
        self.pos += 3
        body = self.parse_alternatives(nested=False)
        return Rule(name, body, self._line_col(start)[0])

    def parse_alternatives(self, nested: bool) -> Node:
        options = [self.parse_sequence(nested)]
        while True:
            self.skip_space()
            if self.peek() != "|":
                break
            self.pos += 1
            options.append(self.parse_sequence(nested))
        return options[0] if len(options) == 1 else Alternatives(tuple(options))

    def parse_sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            self.skip_space()
            ch = self.peek()
            if ch == "" or ch == "|" or ch == ")":
                break
            if not nested and self.at_rule_start():
                break
            item = self.parse_primary()
            items.append(self.parse_repetitions(item))
        if ch == ")" and not nested:
            raise self.error("unmatched ')'")
        return items[0] if len(items) == 1 else Sequence(tuple(items))

    def parse_primary(self) -> Node:
        ch = self.peek()
        start = self.pos
        if ch == '"':
            return self.parse_literal()
        if ch == "[":
            return self.parse_class()
        if ch == ".":
            self.pos += 1
            return AnyChar()
        if ch == "(":
            self.pos += 1
            inner = self.parse_alternatives(nested=True)
            self.skip_space()
            if self.peek() != ")":
                raise self.error("expected ')' to close the group opened here", start)
            self.pos += 1
            return inner
        if ch == "<" or self.peek(2) == "!<":
            return self.parse_token()
        match = _NAME_RE.match(self.text, self.pos)
        if match is not None:
            self.pos = match.end()
            line, col = self._line_col(start)
            return RuleRef(match.group(), line, col)
        raise self.error(f"unexpected character {ch!r}")

    def parse_repetitions(self, item: Node) -> Node:
        while True:
            ch = self.peek()
            if ch == "*":
                item, self.pos = Repeat(item, 0, None), self.pos + 1
            elif ch == "+":
                item, self.pos = Repeat(item, 1, None), self.pos + 1
            elif ch == "?":
                item, self.pos = Repeat(item, 0, 1), self.pos + 1
            elif ch == "{":
                item = self.parse_braces(item)
            else:
                return item

    def parse_braces(self, item: Node) -> Node:
        start = self.pos
        match = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}").match(self.text, self.pos)
        if match is None or (match.group(1) == "" and match.group(2) == ""):
            raise self.error("malformed repetition; expected {m}, {m,}, {m,n} or {,n}", start)
        self.pos = match.end()
        low = int(match.group(1)) if match.group(1) else 0
        if not match.group(2):
            return Repeat(item, low, low)
        high = int(match.group(3)) if match.group(3) else None
        if high is not None and high < low:
            raise self.error(f"repetition {{{low},{high}}} has max below min", start)
        return Repeat(item, low, high)

    def parse_char(self, closing: str) -> str:
        """One (possibly escaped) character inside a literal or class."""
        if self.pos >= len(self.text):
            raise self.error("unterminated string or character class")
        ch = self.text[self.pos]
        if ch != "\\":
            self.pos += 1
            return ch
        esc_pos = self.pos
        esc = self.text[self.pos + 1:self.pos + 2]
        if esc == "":
            raise self.error("dangling backslash")
        if esc in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[esc]
            digits = self.text[self.pos + 2:self.pos + 2 + width]
            if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.error(f"\\{esc} needs exactly {width} hex digits", esc_pos)
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.error(f"\\{esc}{digits} is not a Unicode scalar value", esc_pos)
            self.pos += 2 + width
            return chr(code)
        self.pos += 2
        if esc in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[esc]
        if esc.isalnum():
            raise self.error(f"unknown escape \\{esc}", esc_pos)
        return esc  # \" \\ \[ \] \- \^ and any other escaped punctuation stand for themselves

    def parse_literal(self) -> Literal:
        start = self.pos
        self.pos += 1
        chars = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("unterminated string literal", start)
            if self.text[self.pos] == '"':
                self.pos += 1
                return Literal("".join(chars))
            if self.text[self.pos] == "\n":
                raise self.error("newline inside a string literal (write \\n)", self.pos)
            chars.append(self.parse_char('"'))

    def parse_class(self) -> CharClass:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("unterminated character class", start)
            if self.text[self.pos] == "]":
                self.pos += 1
                break
            low = self.parse_char("]")
            high = low
            if self.peek() == "-" and self.text[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                high = self.parse_char("]")
            if ord(high) < ord(low):
                raise self.error(f"character range {low!r}-{high!r} is reversed", start)
            ranges.append((ord(low), ord(high)))
        if not ranges:
            raise self.error("empty character class", start)
        return CharClass(tuple(ranges), negated)

    def parse_token(self) -> TokenRef:
        start = self.pos
        negated = self.peek() == "!"
        if negated:
            self.pos += 1
        end = self.text.find(">", self.pos)
        if end < 0 or "\n" in self.text[self.pos:end]:
            raise self.error("unterminated token reference '<...>'", start)
        inner = self.text[self.pos + 1:end]
        self.pos = end + 1
        line, col = self._line_col(start)
        id_match = re.fullmatch(r"\[(\d+)\]", inner)
        if id_match:
            return TokenRef(None, int(id_match.group(1)), negated, line, col)
        if not inner or any(c.isspace() for c in inner):
            raise self.error(f"bad token reference <{inner}>", start)
        return TokenRef(inner, None, negated, line, col)


def parse_gbnf(text: str) -> dict[str, Rule]:
    """Parse GBNF text into rules by name. Raises GbnfError naming the line and column."""
    parser = _Parser(text)
    rules: dict[str, Rule] = {}
    for rule in parser.parse():
        if rule.name in rules:
            raise GbnfError(f"GBNF line {rule.line}: rule {rule.name!r} is defined twice "
                            f"(first on line {rules[rule.name].line})")
        rules[rule.name] = rule
    if "root" not in rules:
        raise GbnfError("GBNF grammar has no 'root' rule (the entry rule must be named root)")
    for rule in rules.values():
        nodes = [rule.body]
        while nodes:
            node = nodes.pop()
            if isinstance(node, RuleRef) and node.name not in rules:
                raise GbnfError(f"GBNF line {node.line}, column {node.col}: "
                                f"rule {node.name!r} is used but never defined")
            nodes.extend(children(node))
    return rules
