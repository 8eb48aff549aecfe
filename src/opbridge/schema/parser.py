"""Recursive-descent parser for PyTorch function-schema strings (no ``torch`` import).

Parses the syntax accepted by ``torch.library.Library.define``, e.g.
``"rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor"``, into the dataclasses of
:mod:`opbridge.schema.model`, checking each default literal against its argument's type.
"""

from __future__ import annotations

import math
import re
from keyword import iskeyword
from typing import NoReturn

from opbridge.schema.model import NO_DEFAULT, Alias, Argument, Return, Schema, SchemaError, Type

__all__ = ["parse_schema"]

_BASE_TYPES = ("Tensor", "int", "float", "bool", "str", "ScalarType", "SymInt")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_TOKEN = re.compile(r"\w+|\S")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_DIGITS = re.compile(r"\d+")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}
_CONSTANTS: dict[str, object] = {"None": None, "True": True, "False": False}


class _DefaultError(Exception):
    pass


def _coerce_scalar(base: str, value: object) -> object:
    if base == "float" and isinstance(value, (int, float)) and type(value) is not bool:
        return float(value)
    if (base, type(value)) in (("int", int), ("ScalarType", int), ("bool", bool), ("str", str)):
        return value
    raise _DefaultError


def _coerce_default(typ: Type, value: object) -> object:
    """Check a parsed default literal against `typ` and normalise it."""
    if value is None:
        if typ.optional or typ.is_tensor:  # torch accepts `Tensor x=None`
            return None
        raise _DefaultError(f"None requires an optional type ('{typ}?')")
    if typ.base == "Tensor":
        raise _DefaultError("Tensor arguments can only default to None")
    if not typ.is_list:
        return _coerce_scalar(typ.base, value)
    if typ.optional:  # torch restriction
        raise _DefaultError(f"optional lists such as '{typ}' can only default to None")
    if typ.base not in ("int", "float", "bool"):  # torch restriction
        raise _DefaultError(f"'{typ}' arguments cannot have a default")
    if not isinstance(value, list):
        if typ.list_size is not None and typ.base != "bool":  # e.g. `int[2] stride=1`
            return (_coerce_scalar(typ.base, value),) * typ.list_size
        raise _DefaultError
    if typ.list_size is not None and len(value) != typ.list_size:
        raise _DefaultError(f"list of length {len(value)} given for type '{typ}'")
    return tuple(_coerce_scalar(typ.base, v) for v in value)


class _Parser:
    """Recursive-descent parser over `text`; whitespace is skipped by `peek`."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, reason: str, expected: str = "", pos: int | None = None) -> NoReturn:
        at = self.pos if pos is None else pos
        extra = f" (expected {expected})" if expected else ""
        raise SchemaError(self.text, at, f"{reason} at position {at}{extra}")

    def skip(self) -> int:
        """Skip whitespace and return the new position."""
        while self.text[self.pos : self.pos + 1].isspace():
            self.pos += 1
        return self.pos

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos : self.pos + 1]

    def found(self) -> str:
        self.peek()
        match = _TOKEN.match(self.text, self.pos)
        return f"unexpected {match.group()!r}" if match else "unexpected end of schema"

    def accept(self, token: str) -> bool:
        self.peek()
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def expect(self, token: str) -> None:
        if not self.accept(token):
            self.fail(self.found(), f"'{token}'")

    def ident(self, what: str) -> str:
        self.peek()
        match = _IDENT.match(self.text, self.pos)
        if match is None:
            self.fail(self.found(), what)
        self.pos = match.end()
        return match.group()

    def name(self, what: str, seen: set[str]) -> str:
        start = self.skip()
        name = self.ident(what)
        if iskeyword(name):
            self.fail(f"{what} {name!r} is a Python keyword", pos=start)
        if name in seen:
            self.fail(f"duplicate {what} {name!r}", pos=start)
        seen.add(name)
        return name

    def separator(self, open_pos: int) -> str:
        """Consume ``,`` or ``)`` inside the parentheses opened at `open_pos`."""
        if not self.peek():
            self.fail(
                "unbalanced parentheses: unexpected end of schema",
                f"')' to close '(' at position {open_pos}",
            )
        for token in (",", ")"):
            if self.accept(token):
                return token
        self.fail(self.found(), "',' or ')'")

    def parse(self) -> Schema:
        name = self.ident("operator name")
        if self.text.startswith("::", self.pos):
            self.fail("namespaces are not allowed in schemas (the library adds one)")
        overload = ""
        if self.text.startswith(".", self.pos):
            self.pos += 1
            overload = self.ident("overload name")
        open_pos = self.skip()
        self.expect("(")
        arguments = self.arguments(open_pos)
        if self.peek() == ")":
            self.fail("unbalanced parentheses: unexpected ')'", "'->'")
        self.expect("->")
        returns = self.returns()
        if self.peek():
            rest = self.text[self.pos :]
            self.fail(f"unexpected trailing text {rest!r}", "end of schema")
        return Schema(name, overload, arguments, returns, self.text)

    def arguments(self, open_pos: int) -> tuple[Argument, ...]:
        args: list[Argument] = []
        seen: set[str] = set()
        kwarg_only = after_default = False
        if self.accept(")"):
            return ()
        while True:
            if self.peek() == ")":
                self.fail("unexpected ')' after ','", "an argument")
            if self.peek() == "*":
                if kwarg_only:
                    self.fail("duplicate '*' marker")
                self.pos += 1
                kwarg_only = True
            else:
                typ = self.parse_type()
                name_pos = self.skip()
                name = self.name("argument name", seen)
                default: object = NO_DEFAULT
                if self.accept("="):
                    default = self.default(typ, name)
                elif after_default and not kwarg_only:
                    reason = f"non-default argument {name!r} follows default argument"
                    self.fail(reason, pos=name_pos)
                after_default = after_default or default is not NO_DEFAULT
                args.append(Argument(name, typ, default, kwarg_only))
            if self.separator(open_pos) == ")":
                return tuple(args)

    def parse_type(self) -> Type:
        start = self.skip()
        expected = "one of " + ", ".join(_BASE_TYPES)
        base = self.ident(expected)
        if base not in _BASE_TYPES:
            self.fail(f"unknown type {base!r}", expected, pos=start)
        base = "int" if base == "SymInt" else base
        alias = None
        if self.peek() == "(":
            if base != "Tensor":
                self.fail("alias annotations are only allowed on Tensor types")
            self.pos += 1
            alias = Alias(self.ident("alias set name"), self.accept("!"))
            self.expect(")")
        is_list, size = self.accept("["), None
        if is_list:
            self.peek()
            digits = _DIGITS.match(self.text, self.pos)
            if digits:
                size, self.pos = int(digits.group()), digits.end()
            self.expect("]")
        optional = self.accept("?")
        if optional and self.peek() == "[":
            self.fail("lists of optional elements are not supported")
        return Type(base, optional, is_list, size, alias)

    def returns(self) -> tuple[Return, ...]:
        open_pos = self.skip()
        if not self.accept("("):
            return (Return(self.parse_type()),)
        if self.accept(")"):
            return ()
        rets: list[Return] = []
        seen: set[str] = set()
        while True:
            typ = self.parse_type()
            self.peek()
            named = _IDENT.match(self.text, self.pos) is not None
            rets.append(Return(typ, self.name("return name", seen) if named else None))
            if self.separator(open_pos) == ")":
                return tuple(rets)

    def default(self, typ: Type, name: str) -> object:
        start = self.skip()
        value = self.literal(allow_list=True)
        try:
            return _coerce_default(typ, value)
        except _DefaultError as err:
            literal = self.text[start : self.pos]
            why = err.args[0] if err.args else f"does not match type '{typ}'"
            self.fail(f"invalid default {literal} for argument {name!r}: {why}", pos=start)

    def literal(self, allow_list: bool) -> object:
        char = self.peek()
        if char in ("'", '"'):
            return self.string(char)
        if char == "[":
            if not allow_list:
                self.fail("nested lists are not supported")
            self.pos += 1
            items: list[object] = []
            if self.accept("]"):
                return items
            while True:
                items.append(self.literal(allow_list=False))
                if self.accept("]"):
                    return items
                if not self.accept(","):
                    self.fail(self.found(), "',' or ']'")
        number = _NUMBER.match(self.text, self.pos)
        if number:
            self.pos = number.end()
            text = number.group()
            if not any(c in text for c in ".eE"):
                return int(text)
            if math.isinf(float(text)):
                self.fail(f"float default {text} is out of range", pos=number.start())
            return float(text)
        word = _IDENT.match(self.text, self.pos)
        if word and word.group() in _CONSTANTS:
            self.pos = word.end()
            return _CONSTANTS[word.group()]
        self.fail(self.found(), "a default value: number, string, list, True, False, None")

    def string(self, quote: str) -> str:
        match = _STRING.match(self.text, self.pos)
        if match is None:
            self.fail("unterminated string", f"closing {quote}")
        self.pos = match.end()
        return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[1]), match.group()[1:-1], flags=re.S)


def parse_schema(text: str) -> Schema:
    """Parse a function-schema string.

    Parameters
    ----------
    text : str
        A schema without namespace, e.g. ``"relu(Tensor x) -> Tensor"``.

    Returns
    -------
    Schema
        The parsed schema; ``parse_schema(str(s)) == s``.

    Raises
    ------
    SchemaError
        If `text` is malformed; the message points at the offending position.
    """
    return _Parser(text).parse()
