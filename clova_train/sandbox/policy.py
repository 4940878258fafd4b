"""The restriction layer: which Python generated code may use, and the guards its compiled form calls.

Two allowlists, applied in order, each enough on its own for the escapes the tests try:

1. **Statement and expression kinds** (:data:`ALLOWED_NODES`): the plain imperative subset that ViperGPT/HYDRA
   programs use (assignments, ``if``/``for``/``while``, functions and lambdas, comprehensions, ``try``). Anything
   else is refused before compiling, by name: imports, classes, ``match`` (its class patterns read attributes
   by name), ``with``, ``global``/``nonlocal``, generators and ``yield``, ``async``, f-string format specs that
   nest expressions, walrus. New node kinds of future Python versions are refused until added here.
2. **RestrictedPython** compiles what passes: no name or attribute that starts with ``_``, and every attribute
   read, item read, iteration, sequence unpacking, attribute write, augmented assignment and ``print`` goes
   through a guard defined below. :func:`guarded_getattr` refuses ``_`` names, frame/code/generator attributes
   and ``str.format`` (it reads attributes by name); :data:`write_guard` refuses attribute writes on anything
   but the program's own dicts and lists (``ImagePatch.find = ...`` fails).

The builtins are an allowlist too (:data:`SAFE_BUILTIN_NAMES`): no ``open``, ``getattr``, ``type``, ``vars``...
"""

from __future__ import annotations

import ast
import builtins
import operator
from collections.abc import Callable
from typing import Any

from RestrictedPython import compile_restricted_exec
from RestrictedPython.Guards import full_write_guard, guarded_iter_unpack_sequence, guarded_unpack_sequence

MAX_NESTING = 60
ALLOWED_NODES: frozenset[type] = frozenset({
    ast.Module, ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.If, ast.For, ast.While, ast.Break,
    ast.Continue, ast.Pass, ast.Return, ast.FunctionDef, ast.Lambda, ast.arguments, ast.arg, ast.Try,
    ast.ExceptHandler, ast.Raise, ast.Assert, ast.Delete,
    ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Call, ast.keyword, ast.Attribute, ast.Subscript,
    ast.Slice, ast.Starred, ast.Name, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp,
    ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension, ast.JoinedStr, ast.FormattedValue,
    ast.Load, ast.Store, ast.Del,
    ast.And, ast.Or, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift,
    ast.BitOr, ast.BitXor, ast.BitAnd, ast.MatMult, ast.UAdd, ast.USub, ast.Not, ast.Invert, ast.Eq, ast.NotEq,
    ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
})
DENIED_ATTRIBUTES = frozenset({
    "format", "format_map", "mro", "gi_frame", "gi_code", "gi_yieldfrom", "gi_running", "cr_frame", "cr_code",
    "cr_await", "ag_frame", "ag_code", "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame",
    "tb_next", "co_code", "func_globals", "func_code", "im_func", "im_self", "maketrans", "translate",
})
SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "int", "isinstance", "len",
    "list", "map", "max", "min", "pow", "range", "reversed", "round", "set", "sorted", "str", "sum", "tuple",
    "zip", "True", "False", "None", "ArithmeticError", "AssertionError", "AttributeError", "Exception",
    "IndexError", "KeyError", "LookupError", "NameError", "RuntimeError", "TypeError", "ValueError",
    "ZeroDivisionError",
)


class PolicyViolation(Exception):
    """The code uses something the restriction layer does not allow (it is never run)."""


def _check_nodes(tree: ast.AST) -> None:
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:  # iterative: a deeply nested program must not exhaust this walk's own stack
        node, depth = stack.pop()
        if type(node) not in ALLOWED_NODES:
            line = getattr(node, "lineno", "?")
            raise PolicyViolation(f"line {line}: {type(node).__name__} is not allowed")
        if depth > MAX_NESTING:
            raise PolicyViolation(f"line {getattr(node, 'lineno', '?')}: the code nests deeper than {MAX_NESTING}")
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            raise PolicyViolation(f"line {node.lineno}: format specs in f-strings are not allowed")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def restricted_compile(source: str, filename: str = "<generated>") -> Any:
    """Check ``source`` against both allowlists and compile it; :class:`PolicyViolation` or SyntaxError."""
    tree = ast.parse(source, filename=filename, mode="exec")
    _check_nodes(tree)
    result = compile_restricted_exec(tree, filename=filename)
    if result.errors:
        raise PolicyViolation("; ".join(result.errors))
    if result.code is None:
        raise PolicyViolation("the code did not compile")
    return result.code


def guarded_getattr(obj: Any, name: str) -> Any:
    """Attribute reads of generated code: no ``_`` names, no frame/code/generator internals, no ``format``."""
    if type(name) is not str:
        raise TypeError("attribute names must be strings")
    if name.startswith("_") or name in DENIED_ATTRIBUTES:
        raise AttributeError(f"attribute {name!r} is not allowed in the sandbox")
    return getattr(obj, name)


def guarded_getitem(obj: Any, key: Any) -> Any:
    return obj[key]


_INPLACE: dict[str, Callable[[Any, Any], Any]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "//=": operator.ifloordiv, "%=": operator.imod, "**=": operator.ipow, "<<=": operator.ilshift,
    ">>=": operator.irshift, "|=": operator.ior, "^=": operator.ixor, "&=": operator.iand, "@=": operator.imatmul,
}


def inplace(op: str, target: Any, value: Any) -> Any:
    """``x += y`` and friends (RestrictedPython routes them through ``_inplacevar_``)."""
    return _INPLACE[op](target, value)


def safe_builtins() -> dict[str, Any]:
    return {name: getattr(builtins, name) for name in SAFE_BUILTIN_NAMES}


def guards() -> dict[str, Any]:
    """The names RestrictedPython's compiled code calls."""
    return {
        "_getattr_": guarded_getattr,
        "_getitem_": guarded_getitem,
        "_getiter_": iter,
        "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
        "_unpack_sequence_": guarded_unpack_sequence,
        "_write_": full_write_guard,
        "_inplacevar_": inplace,
    }
