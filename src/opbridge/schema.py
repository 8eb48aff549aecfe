"""Parser for PyTorch function-schema strings (no ``torch`` import).

Parses the syntax accepted by ``torch.library.Library.define``, e.g.
``"rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor"``, into frozen
dataclasses, renders them back canonically, binds Python calls to them and
type-checks non-tensor argument values.
"""

from __future__ import annotations

import enum
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from keyword import iskeyword
from typing import NoReturn

from opbridge.errors import DeclarationError

__all__ = ["NO_DEFAULT", "Alias", "Argument", "Return", "Schema", "SchemaError", "Type", "check_value"]
__all__ += ["parse_schema"]

_BASE_TYPES = ("Tensor", "int", "float", "bool", "str", "ScalarType", "SymInt")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_TOKEN = re.compile(r"\w+|\S")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}
_CONSTANTS: dict[str, object] = {"None": None, "True": True, "False": False}


class SchemaError(DeclarationError):
    """A malformed schema string.

    The message is the schema, a caret line under the offending position and the reason
    (with what was expected). The parts are also available as the `schema`, `position`
    (zero-based offset) and `reason` attributes.
    """

    def __init__(self, schema: str, position: int, reason: str) -> None:
        self.schema, self.position, self.reason = schema, position, reason
        shown = schema.translate({9: " ", 10: " ", 13: " "})  # keep caret aligned
        super().__init__(f"{shown}\n{' ' * position}^\n{reason}")


class _NoDefault(enum.Enum):
    NO_DEFAULT = "NO_DEFAULT"

    def __repr__(self) -> str:
        return "NO_DEFAULT"


#: Sentinel stored in `Argument.default` when an argument has no default.
NO_DEFAULT = _NoDefault.NO_DEFAULT
_NO_DEFAULT = NO_DEFAULT


@dataclass(frozen=True)
class Alias:
    """Alias annotation of a Tensor type: set name ``a`` and whether it is a write (``a!``)."""

    set: str
    is_write: bool

    def __str__(self) -> str:
        return f"({self.set}{'!' if self.is_write else ''})"


@dataclass(frozen=True)
class Type:
    """A schema type such as ``Tensor(a!)?``, ``int[]`` or ``int[2]``.

    `base` is ``Tensor``, ``int``, ``float``, ``bool``, ``str`` or ``ScalarType`` (``SymInt``
    parses as ``int``); `optional` is a trailing ``?``; `is_list` is ``[]`` or ``[N]`` with
    `list_size` ``N``; `alias` is only allowed on Tensor types.
    """

    base: str
    optional: bool = False
    is_list: bool = False
    list_size: int | None = None
    alias: Alias | None = None

    def __str__(self) -> str:
        text = self.base + ("" if self.alias is None else str(self.alias))
        if self.is_list:
            text += f"[{'' if self.list_size is None else self.list_size}]"
        return text + ("?" if self.optional else "")

    @property
    def is_tensor(self) -> bool:
        """bool: ``Tensor`` or ``Tensor?``, not a list."""
        return self.base == "Tensor" and not self.is_list

    @property
    def is_tensor_list(self) -> bool:
        """bool: ``Tensor[]`` (possibly optional or aliased)."""
        return self.base == "Tensor" and self.is_list


def _render_value(value: object) -> str:
    if isinstance(value, str):
        body = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return '"' + body.replace("\t", "\\t").replace("\r", "\\r") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_render_value(v) for v in value) + "]"
    return repr(value)  # None, True/False, int, float (repr round-trips)


@dataclass(frozen=True)
class Argument:
    """One schema argument.

    `default` is the parsed default value (list defaults become tuples) or `NO_DEFAULT`;
    `kwarg_only` is True for arguments after the ``*`` marker.
    """

    name: str
    type: Type
    default: object = NO_DEFAULT
    kwarg_only: bool = False

    @property
    def has_default(self) -> bool:
        """bool: Whether a default value is present."""
        return self.default is not NO_DEFAULT

    @property
    def is_mutated(self) -> bool:
        """bool: Whether the type has a write alias such as ``(a!)``."""
        return self.type.alias is not None and self.type.alias.is_write

    def __str__(self) -> str:
        text = f"{self.type} {self.name}"
        return text + (f"={_render_value(self.default)}" if self.has_default else "")


@dataclass(frozen=True)
class Return:
    """One schema return value, optionally named."""

    type: Type
    name: str | None = None

    def __str__(self) -> str:
        return str(self.type) if self.name is None else f"{self.type} {self.name}"


@dataclass(frozen=True)
class Schema:
    """A parsed function schema.

    `name` has no namespace; `overload` is ``""`` when absent; `source` is the original
    string and is excluded from equality and hashing. ``str()`` renders the canonical form
    accepted by ``torch.library.Library.define``.
    """

    name: str
    overload: str
    arguments: tuple[Argument, ...]
    returns: tuple[Return, ...]
    source: str = field(default="", compare=False)

    def __str__(self) -> str:
        parts: list[str] = []
        for arg in self.arguments:
            if arg.kwarg_only and "*" not in parts:
                parts.append("*")
            parts.append(str(arg))
        if len(self.returns) == 1 and self.returns[0].name is None:
            rets = str(self.returns[0])
        else:
            rets = "(" + ", ".join(str(r) for r in self.returns) + ")"
        name = f"{self.name}.{self.overload}" if self.overload else self.name
        return f"{name}({', '.join(parts)}) -> {rets}"

    @property
    def tensor_args(self) -> tuple[Argument, ...]:
        """tuple of Argument: Arguments of type ``Tensor``/``Tensor?``."""
        return tuple(a for a in self.arguments if a.type.is_tensor)

    @property
    def mutated_args(self) -> tuple[Argument, ...]:
        """tuple of Argument: Arguments with a write alias."""
        return tuple(a for a in self.arguments if a.is_mutated)

    @property
    def is_mutating(self) -> bool:
        """bool: Whether any argument is mutated."""
        return bool(self.mutated_args)

    @property
    def is_functional(self) -> bool:
        """bool: No mutated arguments and no aliasing returns."""
        return not self.is_mutating and all(r.type.alias is None for r in self.returns)

    def bind(self, op: str, args: Sequence[object], kwargs: Mapping[str, object]) -> list[object]:
        """Map a Python call onto the schema, without checking value types.

        Parameters
        ----------
        op : str
            Operator name for error messages.
        args, kwargs : sequence of object, mapping of str to object
            The call's positional and keyword arguments.

        Returns
        -------
        list of object
            One value per schema argument, in schema order, defaults filled.

        Raises
        ------
        TypeError
            Too many positional arguments, unknown or repeated keywords, missing arguments.
        """
        positional = [a for a in self.arguments if not a.kwarg_only]
        if len(args) > len(positional):
            noun = "argument" if len(positional) == 1 else "arguments"
            raise TypeError(f"{op}() takes at most {len(positional)} positional {noun} ({len(args)} given)")
        bound: dict[str, object] = {a.name: v for a, v in zip(positional, args, strict=False)}
        known = {a.name for a in self.arguments}
        for key, value in kwargs.items():
            if key not in known:
                raise TypeError(f"{op}() got an unexpected keyword argument '{key}'")
            if key in bound:
                raise TypeError(f"{op}() got multiple values for argument '{key}'")
            bound[key] = value
        missing = [f"'{a.name}'" for a in self.arguments if a.name not in bound and not a.has_default]
        if missing:
            noun = "argument" if len(missing) == 1 else "arguments"
            raise TypeError(f"{op}() missing required {noun} {', '.join(missing)}")
        return [bound.get(a.name, a.default) for a in self.arguments]


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
            digits = re.compile(r"\d+").match(self.text, self.pos)
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


def _scalar_ok(base: str, value: object) -> bool:
    if isinstance(value, bool):
        return base == "bool"
    numpy = type(value).__module__ == "numpy"  # numpy scalars, without importing it
    if base == "int":
        return isinstance(value, int) or (numpy and isinstance(value, numbers.Integral))
    if base == "float":
        return isinstance(value, (int, float)) or (numpy and isinstance(value, numbers.Real))
    return base == "str" and isinstance(value, str)


def check_value(op: str, arg: Argument, value: object) -> None:
    """Type-check a non-tensor value against an argument's type.

    Tensor, Tensor-list and ScalarType arguments are not checked.

    Parameters
    ----------
    op : str
        Operator name for error messages.
    arg : Argument
        The schema argument `value` is passed for.
    value : object
        The value to check.

    Raises
    ------
    TypeError
        On a mismatch, e.g. ``"rms_norm: argument 'eps' must be float, got str"``.
    """
    typ = arg.type
    if typ.base in ("Tensor", "ScalarType") or (value is None and typ.optional):
        return
    got: str | None = type(value).__name__
    if not typ.is_list:
        got = None if _scalar_ok(typ.base, value) else got
    elif not isinstance(value, (list, tuple)):
        pass
    elif typ.list_size is not None and len(value) != typ.list_size:
        got = f"{got} of length {len(value)}"
    else:
        bad = [i for i, item in enumerate(value) if not _scalar_ok(typ.base, item)]
        got = f"{got} with {type(value[bad[0]]).__name__} at index {bad[0]}" if bad else None
    if got is not None:
        expected = str(Type(typ.base, False, typ.is_list, typ.list_size))
        expected += " or None" if typ.optional else ""
        raise TypeError(f"{op}: argument '{arg.name}' must be {expected}, got {got}")
