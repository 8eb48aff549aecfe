"""The parsed form of a PyTorch function schema: frozen dataclasses, rendering and value checks.

:class:`Schema` holds :class:`Argument` and :class:`Return` values whose types are
:class:`Type` (with an optional :class:`Alias`); ``str()`` of each renders the canonical
text accepted by ``torch.library.Library.define``. :meth:`Schema.bind` maps a Python call
onto a schema and :func:`check_value` type-checks a non-tensor argument value. The parser
that builds these is :mod:`opbridge.schema.parser`.
"""

from __future__ import annotations

import enum
import functools
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opbridge.errors import DeclarationError

__all__ = ["NO_DEFAULT", "Alias", "Argument", "Return", "Schema", "SchemaError", "Type", "check_value"]


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

    @functools.cached_property
    def n_positional(self) -> int:
        """int: Arguments before the ``*`` marker (keyword-only ones always follow them)."""
        return sum(1 for a in self.arguments if not a.kwarg_only)

    @functools.cached_property
    def keyword_names(self) -> tuple[str, ...]:
        """tuple of str: Names of the keyword-only arguments, in schema order."""
        return tuple(a.name for a in self.arguments if a.kwarg_only)

    def split(self, values: Sequence[object]) -> tuple[list[object], dict[str, object]]:
        """The inverse of :meth:`bind`: schema-ordered *values* as a call's positional and
        keyword arguments (keyword-only ones by name). *values* may stop early (defaults)."""
        n = self.n_positional
        return list(values[:n]), dict(zip(self.keyword_names, values[n:]))

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


def _scalar_ok(base: str, value: object) -> bool:
    if isinstance(value, bool):
        return base == "bool"
    numpy = type(value).__module__ == "numpy"  # numpy scalars, without importing it
    if base == "int":
        return isinstance(value, int) or (numpy and isinstance(value, numbers.Integral))
    if base == "float":
        return isinstance(value, (int, float)) or (numpy and isinstance(value, numbers.Real))
    return base == "str" and isinstance(value, str)


def _type_name(value: object) -> str:
    """A value's type for messages: ``numpy.bool_`` rather than ``bool``, which reads as a contradiction
    in "must be bool, got bool"."""
    t = type(value)
    return f"numpy.{t.__name__}" if t.__module__ == "numpy" else t.__name__


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
    got: str | None = _type_name(value)
    if not typ.is_list:
        got = None if _scalar_ok(typ.base, value) else got
    elif not isinstance(value, (list, tuple)):
        pass
    elif typ.list_size is not None and len(value) != typ.list_size:
        got = f"{got} of length {len(value)}"
    else:
        bad = [i for i, item in enumerate(value) if not _scalar_ok(typ.base, item)]
        got = f"{got} with {_type_name(value[bad[0]])} at index {bad[0]}" if bad else None
    if got is not None:
        expected = str(Type(typ.base, False, typ.is_list, typ.list_size))
        expected += " or None" if typ.optional else ""
        raise TypeError(f"{op}: argument '{arg.name}' must be {expected}, got {got}")
