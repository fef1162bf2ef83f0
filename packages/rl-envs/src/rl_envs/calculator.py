"""A calculator for tool-using models: arithmetic by walking the AST, never `eval`.

Numbers, ``+ - * / // % **``, unary signs, parentheses, the constants ``pi``/``e`` and a few
`math` functions. Exponents, operand sizes and the expression length are bounded so a single
call cannot stall the environment (no ``9**9**9**9``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "factorial": math.factorial,
    "gcd": math.gcd,
    "min": min,
    "max": max,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


class CalculatorError(ValueError):
    pass


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result exceeds {MAX_INT_BITS} bits")
    if isinstance(value, complex):
        raise CalculatorError("complex results are not supported")
    return value


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        args = [_evaluate(a) for a in node.args]
        if node.func.id == "factorial" and args and abs(args[0]) > MAX_EXPONENT:
            raise CalculatorError(f"factorial argument larger than {MAX_EXPONENT}")
        return _check_size(_FUNCTIONS[node.func.id](*args))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        raise CalculatorError(f"unknown function {node.func.id!r}; known: {sorted(_FUNCTIONS)}")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}; known: {sorted([*_CONSTANTS, *_FUNCTIONS])}")
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:80]}")


def calculate(expression: str) -> int | float:
    """Value of an arithmetic ``expression``; raises `CalculatorError` with the reason."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error: {exc.msg}") from None
    try:
        value = _evaluate(tree)
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError, TypeError, OverflowError) as exc:
        raise CalculatorError(f"{type(exc).__name__}: {exc}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value
