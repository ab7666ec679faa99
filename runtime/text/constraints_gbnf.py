"""GBNF (llama.cpp grammar dialect) to llguidance Lark.

Why our own translator: llguidance 1.9.1 ships `gbnf_to_lark`, but it writes `\\u00e0` as `\\ue0`
(which the regex engine rejects, so Unicode classes fail) and maps `.` to a regex dot that
excludes newlines. It also leaves adjacent terminal pieces as separate lexemes, and llguidance's
lexer splits them greedily: `root ::= [a-z]* "ing"` then rejects "singing". This translator emits
every non-recursive part of the grammar as one regular terminal, so that the regex engine, not
the lexer, decides where pieces meet.

The GBNF text is parsed by gbnf_parser.py (the supported syntax is listed there).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from runtime.text.gbnf_parser import (Alternatives, AnyChar, CharClass, GbnfError, Literal, Node,
                                      Repeat, Rule, RuleRef, Sequence, TokenRef, children,
                                      parse_gbnf)


# ---------------------------------------------------------------------------------------------
# Lark emission


def _regex_char(code: int) -> str:
    ch = chr(code)
    if ch.isascii() and ch.isalnum():
        return ch
    return "\\x{%x}" % code


class _Emitter:
    def __init__(self, rules: dict[str, Rule],
                 special_token_id: Optional[Callable[[str], Optional[int]]]):
        self.rules = rules
        self.special_token_id = special_token_id
        self.lark_names: dict[str, str] = {}
        self.regular: dict[str, bool] = {}
        self.lines: list[str] = []
        self.emitted: set[str] = set()
        self.aux_count = 0

    # -- analysis --

    def reachable(self) -> list[str]:
        order: list[str] = []
        seen = {"root"}
        stack = ["root"]
        while stack:
            name = stack.pop()
            order.append(name)
            nodes = [self.rules[name].body]
            while nodes:
                node = nodes.pop()
                if isinstance(node, RuleRef):
                    if node.name not in seen:
                        seen.add(node.name)
                        stack.append(node.name)
                nodes.extend(children(node))
        return order

    def compute_regular(self, names: list[str]) -> None:
        """A rule is regular (becomes a Lark terminal) when it has no token references and
        reaches no cycle; everything else stays a context-free rule."""
        state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

        def visit(name: str) -> bool:
            if state.get(name) == 2:
                return self.regular[name]
            if state.get(name) == 1:
                return False  # a cycle: this rule and everything on the path are recursive
            state[name] = 1
            ok = True
            nodes = [self.rules[name].body]
            while nodes:
                node = nodes.pop()
                if isinstance(node, TokenRef):
                    ok = False
                elif isinstance(node, RuleRef):
                    ok = visit(node.name) and ok
                nodes.extend(children(node))
            state[name] = 2
            self.regular[name] = ok
            return ok

        for name in names:
            visit(name)
        # A rule that reaches a cycle was marked irregular on its way back; a rule visited while
        # on the stack of a cycle returned False for the edge only, so recheck to a fixpoint.
        changed = True
        while changed:
            changed = False
            for name in names:
                if self.regular[name] and not self.node_is_regular(self.rules[name].body):
                    self.regular[name] = False
                    changed = True

    def node_is_regular(self, node: Node) -> bool:
        if isinstance(node, TokenRef):
            return False
        if isinstance(node, RuleRef):
            return self.regular[node.name]
        return all(self.node_is_regular(child) for child in children(node))

    # -- naming --

    def assign_names(self, names: list[str]) -> None:
        used: set[str] = set()
        for index, name in enumerate(names):
            base = re.sub(r"[^A-Za-z0-9]", "_", name).lower()
            if name == "root":
                lark = "ROOT" if self.regular[name] else "start"
            elif self.regular[name]:
                lark = f"G{index}_{base.upper()}"
            else:
                lark = f"g{index}_{base}"
            used.add(lark)
            self.lark_names[name] = lark

    # -- terminals (regular parts) --

    def terminal(self, node: Node) -> str:
        """Lark terminal expression for a regular node (no whitespace skipping inside)."""
        if isinstance(node, Literal):
            if not node.text:
                return '""'
            return "/" + "".join(_regex_char(ord(c)) for c in node.text) + "/"
        if isinstance(node, CharClass):
            body = "".join(_regex_char(lo) if lo == hi else f"{_regex_char(lo)}-{_regex_char(hi)}"
                           for lo, hi in node.ranges)
            return f"/[{'^' if node.negated else ''}{body}]/"
        if isinstance(node, AnyChar):
            return "/(?s:.)/"
        if isinstance(node, RuleRef):
            self.emit_rule(node.name)
            return self.lark_names[node.name]
        if isinstance(node, Sequence):
            parts = [self.terminal(item) for item in node.items if item != Literal("")]
            return "(" + " ".join(parts) + ")" if parts else '""'
        if isinstance(node, Alternatives):
            return "(" + " | ".join(self.terminal(option) for option in node.options) + ")"
        if isinstance(node, Repeat):
            return self.repeat(self.terminal(node.item), node)
        raise AssertionError(node)

    @staticmethod
    def repeat(inner: str, node: Repeat) -> str:
        if node.min_count == 0 and node.max_count is None:
            return f"({inner})*"
        if node.min_count == 1 and node.max_count is None:
            return f"({inner})+"
        if node.min_count == 0 and node.max_count == 1:
            return f"({inner})?"
        high = "" if node.max_count is None else str(node.max_count)
        return f"({inner}){{{node.min_count},{high}}}"

    def aux_terminal(self, expr: str) -> str:
        self.aux_count += 1
        name = f"T{self.aux_count}"
        self.lines.append(f"{name}: {expr}")
        return name

    # -- rules (context-free parts) --

    def token(self, node: TokenRef) -> str:
        if node.token_id is not None:
            return f"<[^{node.token_id}]>" if node.negated else f"<[{node.token_id}]>"
        if not node.negated:
            return f"<{node.name}>"
        token_id = self.special_token_id(f"<{node.name}>") if self.special_token_id else None
        if token_id is None:
            raise GbnfError(f"GBNF line {node.line}, column {node.col}: "
                            f"unknown special token <{node.name}>")
        return f"<[^{token_id}]>"

    def rule_expr(self, node: Node) -> str:
        if self.node_is_regular(node):
            if isinstance(node, RuleRef):
                self.emit_rule(node.name)
                return self.lark_names[node.name]
            return self.aux_terminal(self.terminal(node))
        if isinstance(node, RuleRef):
            self.emit_rule(node.name)
            return self.lark_names[node.name]
        if isinstance(node, TokenRef):
            return self.token(node)
        if isinstance(node, Sequence):
            # Merge each run of consecutive regular items into one terminal.
            parts: list[str] = []
            run: list[Node] = []
            for item in node.items + (None,):
                if item is not None and self.node_is_regular(item):
                    run.append(item)
                    continue
                if run:
                    parts.append(self.rule_expr(run[0] if len(run) == 1 else Sequence(tuple(run))))
                    run = []
                if item is not None:
                    parts.append(self.rule_expr(item))
            return "(" + " ".join(parts) + ")"
        if isinstance(node, Alternatives):
            return "(" + " | ".join(self.rule_expr(option) for option in node.options) + ")"
        if isinstance(node, Repeat):
            return self.repeat(self.rule_expr(node.item), node)
        raise AssertionError(node)

    def emit_rule(self, name: str) -> None:
        if name in self.emitted:
            return
        self.emitted.add(name)
        body = self.rules[name].body
        if self.regular[name]:
            self.lines.append(f"{self.lark_names[name]}: {self.terminal(body)}")
        else:
            self.lines.append(f"{self.lark_names[name]}: {self.rule_expr(body)}")

    def run(self) -> str:
        names = self.reachable()
        self.compute_regular(names)
        self.assign_names(names)
        if self.regular["root"]:
            self.lines.append("start: ROOT")
        self.emit_rule("root")
        for name in names:
            self.emit_rule(name)
        return "%llguidance {}\n" + "\n".join(self.lines) + "\n"


def gbnf_to_lark(text: str,
                 special_token_id: Optional[Callable[[str], Optional[int]]] = None) -> str:
    """Translate a GBNF grammar (entry rule `root`) into llguidance Lark.

    special_token_id resolves `!<name>` (any token but that special token) to an id; `<name>`
    and numeric forms need no lookup. Raises GbnfError naming the line and column of a syntax
    error, an undefined rule or a missing `root`.
    """
    rules = parse_gbnf(text)
    return _Emitter(rules, special_token_id).run()
