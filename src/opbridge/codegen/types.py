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


def call_returns_annotation(schema: Schema, tensor: str = TENSOR) -> str:
    """What an op's public callable returns, as annotated in the generated wrappers: the declared returns
    (:func:`returns_annotation`), and for an op that mutates arguments (``Tensor(a!)``) also what it returns
    on JAX arrays, which are immutable: the new values of those arguments in schema order (None for an
    optional one passed as None), then the declared returns, as one tuple (``opbridge.adapters.jax``'s
    ``_JaxOp.pack``). ``fused_add_rms_norm``: ``tuple[Tensor, Tensor] | None``."""
    declared = returns_annotation(schema.returns, tensor)
    mutated = [a for a in schema.arguments if a.is_mutated]
    if not mutated:
        return declared
    parts = [*(annotation(a.type, tensor) for a in mutated), *(annotation(r.type, tensor) for r in schema.returns)]
    immutable = f"tuple[{', '.join(parts)}]"
    return f"{immutable} | None" if not schema.returns else f"{declared} | {immutable}"


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
