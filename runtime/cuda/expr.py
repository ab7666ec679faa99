"""Size formulas shared by the kernel build and the runtime.

A kernel's grid, its int32 size parameters and its TMA descriptor dims are written once, in the
kernel family, as small formulas over named sizes (`"cdiv(M, 128)"`, `"K*2"`). `build_kernels.py`
evaluates them with CuTe DSL integers while tracing (so the launch the DSL compiles and the launch
the runtime performs come from the same text), and the runtime evaluates them with Python ints.

Only a tiny, safe subset of Python is accepted: integer and float literals, size names, unary
minus, `+ - * // %`, one comparison (`<`, `<=`, `>`, `>=`, `==`, `!=`; used by launch
constraints such as `"M <= 16"`), and the calls `cdiv`, `min`, `max`, `roundup`. Anything else is
rejected when the formula is parsed, so a manifest can never run arbitrary code.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["FormulaError", "Formula", "evaluate", "names_in"]


class FormulaError(ValueError):
    """A formula uses syntax outside the allowed subset, or names a size nobody provided."""


def _cdiv(a: Any, b: Any) -> Any:
    return (a + b - 1) // b


def _roundup(a: Any, b: Any) -> Any:
    return (a + b - 1) // b * b


def _min(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return a if a < b else b
    import cutlass  # only reached while tracing a kernel at build time

    return cutlass.min(a, b)


def _max(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return a if a > b else b
    import cutlass

    return cutlass.max(a, b)


_CALLS = {"cdiv": _cdiv, "roundup": _roundup, "min": _min, "max": _max}
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


_COMPARE = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}


class Formula:
    """One parsed formula; `Formula("cdiv(M, 128)")(M=300) == 3`."""

    __slots__ = ("text", "_tree", "names")

    def __init__(self, text: str | int | float):
        self.text = str(text)
        try:
            tree = ast.parse(self.text, mode="eval").body
        except SyntaxError as exc:
            raise FormulaError(f"formula {self.text!r} is not valid: {exc.msg}") from None
        self.names = frozenset(_check(tree, self.text))
        self._tree = tree

    def __call__(self, env: Mapping[str, Any] | None = None, /, **sizes: Any) -> Any:
        values = dict(env or {}, **sizes)
        return _eval(self._tree, values, self.text)

    def __repr__(self) -> str:
        return f"Formula({self.text!r})"


def _check(node: ast.AST, text: str) -> set[str]:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _check(node.operand, text)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _check(node.left, text) | _check(node.right, text)
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and type(node.ops[0]) in _COMPARE
    ):
        return _check(node.left, text) | _check(node.comparators[0], text)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _CALLS
        and len(node.args) == 2
        and not node.keywords
    ):
        return _check(node.args[0], text) | _check(node.args[1], text)
    raise FormulaError(f"formula {text!r} uses {ast.dump(node)[:60]}, which is not allowed")


def _eval(node: ast.AST, env: Mapping[str, Any], text: str) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        try:
            return env[node.id]
        except KeyError:
            raise FormulaError(f"formula {text!r} needs size {node.id!r}; given {sorted(env)}") from None
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, env, text)
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env, text), _eval(node.right, env, text))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        return _COMPARE[type(node.ops[0])](left, _eval(node.comparators[0], env, text))
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return _CALLS[node.func.id](*(_eval(a, env, text) for a in node.args))


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Formula:
    return Formula(text)


def evaluate(formula: str | int | float, env: Mapping[str, Any] | None = None) -> Any:
    """Evaluate a formula (or pass a plain number through) with the given sizes."""
    if isinstance(formula, (int, float)) and not isinstance(formula, bool):
        return formula
    return _parsed(str(formula))(env or {})


def names_in(formula: str | int | float) -> frozenset[str]:
    """The size names a formula reads."""
    if isinstance(formula, (int, float)):
        return frozenset()
    return _parsed(str(formula)).names
