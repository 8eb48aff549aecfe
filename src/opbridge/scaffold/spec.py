"""What ``opbridge new`` generates an op from: a schema plus the dtypes its kernel accepts."""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

from opbridge.errors import DeclarationError
from opbridge.schema import Argument, Schema, Type, parse_schema

#: dtype name -> (opbridge.h constant, C++ storage type)
DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("opbridge::kFloat32", "float"),
    "float16": ("opbridge::kFloat16", "opbridge::half"),
    "bfloat16": ("opbridge::kBFloat16", "opbridge::bfloat16"),
    "float64": ("opbridge::kFloat64", "double"),
    "int32": ("opbridge::kInt32", "int32_t"),
    "int64": ("opbridge::kInt64", "int64_t"),
    "bool": ("opbridge::kBool", "bool"),
}
FLOATING = ("float32", "float16", "bfloat16")
_FLOAT_NAMES = ("float32", "float16", "bfloat16", "float64")
_RESERVED_NAMESPACES = ("opbridge", "aten", "prim", "prims", "torch", "_")


class ScaffoldError(DeclarationError):
    """``opbridge new`` cannot generate what was asked (an unsupported type, a bad name...)."""


@dataclass(frozen=True)
class OpSpec:
    """One op to scaffold.

    Attributes
    ----------
    schema
        The op's schema (its name is the op's name).
    dtypes
        Dtypes the kernel accepts; every Tensor shares the lead Tensor's dtype and shape.
    namespace
        The library namespace (``torch.ops.<namespace>.<op>``).
    origin
        Where the spec came from, for the generated files' comments.
    cuda
        Also generate a CUDA kernel (``<op>.cu``), its argument checks in
        ``<op>.h`` shared with the CPU kernel.
    """

    schema: Schema
    dtypes: tuple[str, ...] = FLOATING
    namespace: str = ""
    origin: str = ""
    cuda: bool = False

    @property
    def name(self) -> str:
        return self.schema.name

    @property
    def kernel(self) -> str:
        """The exported kernel's name, ``<op>_cpu``."""
        return f"{self.name}_cpu"

    @property
    def sources(self) -> tuple[str, ...]:
        """Its kernel files in ``csrc/``: ``<op>.cc``, and ``<op>.cu`` with :attr:`cuda`."""
        return (f"{self.name}.cc", f"{self.name}.cu") if self.cuda else (f"{self.name}.cc",)

    @property
    def lead(self) -> Argument:
        """The first non-optional Tensor argument: it sets the dtype and shape of the others."""
        return next(a for a in self.schema.arguments if a.type.is_tensor and not a.type.optional)

    @property
    def float_dtypes(self) -> tuple[str, ...]:
        return tuple(d for d in self.dtypes if d in _FLOAT_NAMES)

    @property
    def int_dtypes(self) -> tuple[str, ...]:
        return tuple(d for d in self.dtypes if d not in _FLOAT_NAMES)

    @property
    def outputs(self) -> list[str]:
        """C++ names of the destination-passed outputs (one per new returned Tensor)."""
        taken = {a.name for a in self.schema.arguments}
        new = [r for r in self.schema.returns if r.type.alias is None]
        names: list[str] = []
        for i, r in enumerate(new):
            name = r.name or ("out" if len(new) == 1 else f"out{i}")
            while name in taken:
                name = f"{name}_"
            taken.add(name)
            names.append(name)
        return names


def _check_type(schema: Schema, arg: str, t: Type) -> None:
    if t.base == "ScalarType" or t.is_tensor_list:
        raise ScaffoldError(f"{schema.name}: argument '{arg}' has type {t}, which `opbridge new` cannot "
                            f"scaffold; generate without it and add it by hand")


def validate(schema: Schema) -> None:
    """Reject schemas the scaffold cannot generate a working kernel and test for."""
    if schema.overload:
        raise ScaffoldError(f"{schema.name}: overload names are not supported")
    for a in schema.arguments:
        _check_type(schema, a.name, a.type)
    if not any(a.type.is_tensor and not a.type.optional for a in schema.arguments):
        raise ScaffoldError(f"{schema.name}: an op needs at least one non-optional Tensor argument")
    for r in schema.returns:
        if not r.type.is_tensor or r.type.optional:
            raise ScaffoldError(f"{schema.name}: only Tensor returns are supported, got {r.type}")
        if r.type.alias is not None:
            raise ScaffoldError(f"{schema.name}: the return {r.type} aliases an input, which torch.compile "
                                f"cannot functionalize; return nothing (-> ()), as vLLM's in-place ops do: "
                                f"the caller sees the mutation through the argument")


def parse_dtypes(text: str | None) -> tuple[str, ...]:
    """``"float32,float16"`` -> ``("float32", "float16")``; None -> the floating dtypes."""
    if not text:
        return FLOATING
    out = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in out if d not in DTYPES]
    if bad or not out:
        raise ScaffoldError(f"unknown dtype(s) {bad or [text]}; choose from {', '.join(DTYPES)}")
    return out


def check_op_name(name: str) -> str:
    """*name* if usable as an op's name: a Python identifier, not a keyword (``def class(...)``)."""
    if not name.isidentifier() or keyword.iskeyword(name):
        why = " (it is a Python keyword)" if keyword.iskeyword(name) else ""
        raise ScaffoldError(f"op name {name!r} must be a Python identifier{why}")
    return name


def check_namespace(namespace: str) -> str:
    """*namespace* if usable as a library namespace."""
    if not namespace.isidentifier() or keyword.iskeyword(namespace) or namespace in _RESERVED_NAMESPACES:
        raise ScaffoldError(f"namespace {namespace!r} must be a Python identifier other than "
                            f"{', '.join(_RESERVED_NAMESPACES)}")
    return namespace


def from_schema(name: str, schema: str | None, *, dtypes: tuple[str, ...] = FLOATING,
                namespace: str | None = None, cuda: bool = False) -> OpSpec:
    """The spec of op *name* from its schema.

    *schema* is ``"name(Tensor x) -> Tensor"`` or just ``"(Tensor x) -> Tensor"``;
    without one, ``<name>(Tensor x) -> Tensor``. *cuda* adds a CUDA kernel.
    """
    check_op_name(name)
    text = (schema or "(Tensor x) -> Tensor").strip()
    if text.startswith("("):
        text = name + text
    parsed = parse_schema(text)
    if parsed.name != name:
        raise ScaffoldError(f"the schema names the op {parsed.name!r}, the command {name!r}")
    validate(parsed)
    return OpSpec(parsed, dtypes, check_namespace(namespace or name), origin="opbridge new --schema", cuda=cuda)


def snake_case(name: str) -> str:
    """``GELUCustom`` -> ``gelu_custom``, ``AddCustom`` -> ``add_custom``."""
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    s = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s)
    return s.replace("-", "_").lower()
