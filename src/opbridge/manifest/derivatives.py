"""A manifest's ``derivatives`` entries (the format: :mod:`opbridge.manifest`), compiled into the ops' ``backward``.

Each formula is checked on its AST before it is compiled: calls of the
library's ops with arguments their schemas take, the op's argument names,
``grad`` / ``grads[i]``, numbers and ``+ - * / **``. A :class:`Derivative`
evaluates the compiled formulas with the ops' public callables.
:func:`opbridge.manifest.load` calls :func:`compile_derivative` once per
entry, with the :class:`~opbridge.manifest.reading.Where` that puts
``file:line`` in front of every error.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Mapping, Sequence
from types import CodeType
from typing import Any

from opbridge.library import Library
from opbridge.manifest.reading import Map, Where
from opbridge.schema import Schema

__all__ = ["Derivative", "compile_derivative"]

_EXPR_NODES = (
    ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.Subscript, ast.keyword,
    ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd,
)
# No builtins a formula could name (the AST check allows only its arguments and ops), but the frame's
# __import__: code the formula's arithmetic reaches may import (torch's operators on FakeTensors under
# torch.compile's backward, opcheck's aot_dispatch test), and Python looks it up in the frame's builtins.
_EVAL_GLOBALS: dict[str, Any] = {"__builtins__": {"__import__": builtins.__import__}}


class Derivative:
    """An op's backward, compiled from its ``derivatives`` entry.

    Called as ``backward(*grad_outputs, *args)``; returns one gradient (or
    None) per Tensor argument, computed by the entry's expressions, which
    call the library's ops through their public callables.
    """

    def __init__(self, schema: Schema, rules: Sequence[tuple[tuple[int, ...], CodeType]],
                 calls: Sequence[str], source: str) -> None:
        self.library: Library | None = None  # set when the op is declared
        self.schema = schema
        self.rules = tuple(rules)
        self.calls = tuple(calls)
        self.source = source
        self.n_grads = len(schema.returns)
        self.arg_names = tuple(a.name for a in schema.arguments)
        self.n_tensors = sum(1 for a in schema.arguments if a.type.is_tensor)

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        grads = values[:self.n_grads]
        ops = self.library.ops if self.library is not None else {}
        env: dict[str, Any] = {name: ops[name].call for name in self.calls}
        env.update(zip(self.arg_names, values[self.n_grads:], strict=True))
        env["grads"] = grads
        env["grad"] = grads[0] if grads else None
        out: list[Any] = [None] * self.n_tensors
        for slots, code in self.rules:
            value = eval(code, _EVAL_GLOBALS, env)  # noqa: S307 - AST checked: op calls, names, arithmetic
            if len(slots) == 1:
                out[slots[0]] = value
                continue
            if not isinstance(value, (tuple, list)) or len(value) != len(slots):
                raise RuntimeError(f"{self.schema.name}: derivative {code.co_filename} returned "
                                   f"{type(value).__name__}, expected a tuple of {len(slots)} gradients")
            for s, v in zip(slots, value, strict=True):
                out[s] = v
        return tuple(out)

    def __repr__(self) -> str:
        return f"<opbridge derivative of {self.schema.name} from {self.source}>"


def _check_call(where: Where, entry: Map, call: ast.Call, schemas: Mapping[str, Schema], op: str) -> str:
    if not isinstance(call.func, ast.Name) or call.func.id not in schemas:
        name = call.func.id if isinstance(call.func, ast.Name) else ast.unparse(call.func)
        raise where.error(entry, f"derivatives of {op}: {name}(...) is not an op of this library "
                                 f"(ops: {', '.join(sorted(schemas))})")
    target = schemas[call.func.id]
    if any(kw.arg is None for kw in call.keywords):
        raise where.error(entry, f"derivatives of {op}: {call.func.id}(**...) is not allowed")
    try:  # the call's names against the target's schema, as a Python call of the op would bind them
        target.bind(call.func.id, call.args, {kw.arg: kw.value for kw in call.keywords if kw.arg is not None})
    except TypeError as e:
        raise where.error(entry, f"derivatives of {op}: {e} (schema: {target})") from None
    return call.func.id


def _compile_expr(where: Where, entry: Map, text: str, schema: Schema,
                  schemas: Mapping[str, Schema]) -> tuple[CodeType, set[str]]:
    op = schema.name
    try:
        tree = ast.parse(str(text).strip(), mode="eval")
    except SyntaxError as e:
        raise where.error(entry, f"derivatives of {op}: cannot parse {text!r}: {e.msg}") from None
    names = {a.name for a in schema.arguments} | {"grad", "grads"}
    calls: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _EXPR_NODES):
            raise where.error(entry, f"derivatives of {op}: {type(node).__name__} is not allowed in {text!r} "
                                     f"(use op calls, argument names, grad/grads[i], numbers and + - * / **)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            calls.add(_check_call(where, entry, node, schemas, op))
        elif isinstance(node, ast.Name) and node.id not in names and node.id not in calls:
            if node.id == "result":
                raise where.error(entry, f"derivatives of {op}: 'result' (the forward output) is not saved; "
                                         f"recompute it by calling the op")
            if node.id not in schemas:
                raise where.error(entry, f"derivatives of {op}: unknown name {node.id!r} in {text!r} "
                                         f"(arguments: {', '.join(sorted(names))})")
            calls.add(node.id)  # an op passed as a value
    code = compile(tree, f"{where.path}:{entry.line}", "eval")
    return code, calls


def compile_derivative(where: Where, entry: Map, schema: Schema, schemas: Mapping[str, Schema]) -> Derivative:
    """The backward of the op *schema* from its ``derivatives`` *entry*; *schemas*: the ops it may call."""
    tensor_slot = {a.name: i for i, a in enumerate(a for a in schema.arguments if a.type.is_tensor)}
    mutated = {a.name for a in schema.arguments if a.is_mutated}
    rules: list[tuple[tuple[int, ...], CodeType]] = []
    calls: set[str] = set()
    seen: set[str] = set()
    for key, text in entry.items():
        if key == "name":
            continue
        targets = [t.strip() for t in str(key).split(",")]
        for t in targets:
            if t not in tensor_slot or t in mutated:
                allowed = ", ".join(n for n in tensor_slot if n not in mutated)
                raise where.error(entry, f"derivatives of {schema.name}: {t!r} is not a differentiable "
                                         f"Tensor argument (those are: {allowed})")
            if t in seen:
                raise where.error(entry, f"derivatives of {schema.name}: {t!r} has two formulas")
            seen.add(t)
        code, used = _compile_expr(where, entry, text, schema, schemas)
        rules.append((tuple(tensor_slot[t] for t in targets), code))
        calls |= used
    if not rules:
        raise where.error(entry, f"derivatives of {schema.name}: no formulas "
                                 f"(add '<arg>: <expression>' lines)")
    return Derivative(schema, rules, sorted(calls), f"{where.path}:{entry.line}")
