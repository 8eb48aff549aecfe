"""Python annotations for schema types, as written in generated wrappers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opbridge.schema import Return, Schema, Type

#: Name of the type variable standing for "any supported framework's array".
TENSOR = "Tensor"
_SCALARS = {"int": "int", "float": "float", "bool": "bool", "str": "str", "ScalarType": "Any"}


def annotation(t: Type, tensor: str = TENSOR) -> str:
    """``Tensor``, ``Tensor | None``, ``Sequence[int]``, ``float``... for schema type *t*."""
    base = tensor if t.base == "Tensor" else _SCALARS[t.base]
    text = f"Sequence[{base}]" if t.is_list else base
    return f"{text} | None" if t.optional else text


def returns_annotation(returns: tuple[Return, ...], tensor: str = TENSOR) -> str:
    """``None``, one annotation, or ``tuple[...]`` of them."""
    if not returns:
        return "None"
    if len(returns) == 1:
        return annotation(returns[0].type, tensor)
    return f"tuple[{', '.join(annotation(r.type, tensor) for r in returns)}]"


def uses(schema: Schema) -> set[str]:
    """The typing names (``Any``, ``Sequence``) the wrapper of *schema* needs."""
    types = [a.type for a in schema.arguments] + [r.type for r in schema.returns]
    out: set[str] = set()
    for t in types:
        if t.is_list:
            out.add("Sequence")
        if t.base == "ScalarType":
            out.add("Any")
    return out
