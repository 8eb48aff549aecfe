"""Declare ops in YAML, in the style of PyTorch's ``native_functions.yaml`` + ``derivatives.yaml``.

An ``ops.yaml`` loads into the same declarations as :meth:`Library.op`::

    library:                        # omit it to load into an existing Library (load(path, LIB))
      namespace: myops
      sources: [csrc/*.cc]          # relative to this file; globs allowed
      prebuilt: my_plugin._C_ops
    ops:
      - func: silu_and_mul(Tensor x) -> Tensor
        kernels: {cpu: silu_and_mul_cpu}            # default {cpu: <name>_cpu}
        shape: my_plugin.ops.shapes.silu_and_mul    # or {like: x}, {like: [x, weight]}
        reference: my_plugin.ops.refs.silu_and_mul  # the NumPy reference (required)
        tolerances: {float32: [1.0e-5, 1.0e-6]}
        dtypes: [float32, bfloat16]   # also dtype_arg, row_strided, rows, graph_safe, hints (dotted): see Library.op
      - func: silu_and_mul_backward(Tensor grad, Tensor x) -> Tensor
        shape: {like: x}
        reference: my_plugin.ops.refs.silu_and_mul_backward
    derivatives:
      - name: silu_and_mul(Tensor x) -> Tensor
        x: silu_and_mul_backward(grad, x)

Each ``derivatives`` entry names an op of the file by its schema; every other
key is a Tensor argument (or ``a, b`` for an expression returning a tuple),
its value an expression over ``grad`` (``grads[i]`` for ops with several
outputs), the op's arguments, numbers, arithmetic, and calls of the library's
ops. The entries compile into the op's ``backward``, which calls the ops'
public callables, so it runs in every framework. Tensor arguments without an
entry get no gradient. Mistakes are :class:`~opbridge.DeclarationError`\\ s
naming ``file:line``.

Here: :func:`load` and the ``library`` and ``ops`` entries;
:mod:`opbridge.manifest.derivatives` compiles the ``derivatives`` entries;
both read the YAML through :mod:`opbridge.manifest.reading`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from opbridge.declare import like
from opbridge.errors import DeclarationError
from opbridge.library import Library
from opbridge.manifest.derivatives import Derivative, compile_derivative
from opbridge.manifest.reading import Loader, Map, Where, kind, line_of
from opbridge.schema import Schema, parse_schema

__all__ = ["Derivative", "load"]

_OP_KEYS = ("func", "kernels", "shape", "reference", "tolerances", "dtypes", "dtype_arg", "row_strided", "rows",
            "hints", "graph_safe")
_LIBRARY_KEYS = ("namespace", "sources", "include_dirs", "cflags", "ldflags", "prebuilt", "python_module")
_TOP_KEYS = ("library", "ops", "derivatives")


def _resolve(dotted: str) -> Any:
    """Import ``pkg.module.attr`` (the attribute may be nested: ``pkg.module.Class.method``)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is not None and ".".join(parts[:cut]).startswith(e.name):
                continue
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {dotted!r}")


def _callable(where: Where, node: Map, key: str, op: str) -> Callable[..., Any]:
    dotted = node[key]
    parts = dotted.split(".") if isinstance(dotted, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise where.error(node, f"{op}: {key} must be a dotted Python path like pkg.module.function, "
                                f"got {dotted!r}")
    try:
        fn = _resolve(dotted)
    except (ImportError, AttributeError) as e:
        raise where.error(node, f"{op}: {key} {dotted!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise where.error(node, f"{op}: {key} {dotted!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _shape(where: Where, node: Map, op: str) -> Any:
    rule = node.get("shape")
    if rule is None:
        return None
    if isinstance(rule, dict):
        where.mapping(rule, f"{op}: shape", ("like",))
        names = rule["like"]
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise where.error(node, f"{op}: shape: like must name one argument or a list of them, "
                                    f"got {names!r}")
        return like(*names)
    return _callable(where, node, "shape", op)


def _tolerances(where: Where, node: Map, op: str) -> dict[str, tuple[float, float]]:
    raw = node.get("tolerances") or {}
    where.mapping(raw, f"{op}: tolerances")
    out: dict[str, tuple[float, float]] = {}
    for dtype, pair in raw.items():
        try:
            rtol, atol = (float(v) for v in pair)  # YAML reads 1e-5 (no dot) as a string
        except (TypeError, ValueError):
            raise where.error(node, f"{op}: tolerances: {dtype} must be [rtol, atol], got {pair!r}") from None
        out[str(dtype)] = (rtol, atol)
    return out


# -- loading ---------------------------------------------------------------------


def _new_library(where: Where, node: Any, caller: str, line: int) -> Library:
    spec = where.mapping(node, "library", _LIBRARY_KEYS, line)
    if "namespace" not in spec:
        raise where.error(spec, "library: namespace is required")
    root = where.path.parent

    def paths(key: str) -> list[str]:
        items = spec.get(key) or []
        if isinstance(items, str):
            items = [items]
        out: list[str] = []
        for item in items:
            found = sorted(str(p) for p in root.glob(item)) if any(c in item for c in "*?[") else [item]
            out.extend(found)
        return out

    try:
        return Library(
            str(spec["namespace"]), sources=paths("sources"), include_dirs=paths("include_dirs"),
            cflags=[str(f) for f in spec.get("cflags") or []],
            ldflags=[str(f) for f in spec.get("ldflags") or []],
            root=root, prebuilt=spec.get("prebuilt"), python_module=spec.get("python_module") or caller,
        )
    except DeclarationError as e:  # a source of no suffix opbridge compiles, flags given as one string: where
        raise where.error(spec, str(e), line) from None


def load(path: str | Path, library: Library | None = None) -> Library:
    """Declare the ops of the YAML manifest at *path*.

    Parameters
    ----------
    path
        The ``ops.yaml`` file.
    library
        Declare the ops into this library; then the file must not have a
        ``library:`` section. Without it the file's ``library:`` section
        creates the library (its ``python_module`` defaults to the caller's module).

    Returns
    -------
    Library
        The library the ops were declared into.

    Raises
    ------
    DeclarationError
        On any mistake in the file, naming ``file:line``; nothing is declared then.
    """
    where = Where(Path(path).resolve())
    try:
        doc = yaml.load(where.path.read_text(), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise DeclarationError(f"{where.path}: not valid YAML: {e}") from None
    doc = where.mapping(doc if doc is not None else Map(), "the manifest", _TOP_KEYS)
    ops = doc.get("ops") or []
    entries = doc.get("derivatives") or []
    for key, value in (("ops", ops), ("derivatives", entries)):
        if not isinstance(value, list):
            raise where.error(value, f"{key} must be a list of mappings, got {kind(value)}",
                              line_of(doc, key))

    parsed: list[tuple[Map, Schema]] = []
    for i, node in enumerate(ops):
        node = where.mapping(node, "an ops entry", _OP_KEYS, line_of(ops, i))
        for key in ("func", "reference"):
            if key not in node:
                raise where.error(node, f"ops entry {node.get('func', '')!r}: {key} is required")
        try:
            parsed.append((node, parse_schema(str(node["func"]))))
        except DeclarationError as e:
            raise where.error(node, f"func: {e}") from None

    if library is not None and "library" in doc:
        raise where.error(doc["library"], "this file has a library: section, but load() was given a library")
    if library is None and "library" not in doc:
        raise where.error(doc, "no library: section; add one, or pass the Library to load() "
                               "(opbridge.manifest.load(path, LIBRARY))")
    existing = library.ops if library is not None else {}
    schemas: dict[str, Schema] = {name: op.schema for name, op in existing.items()}
    for node, schema in parsed:
        if schema.name in schemas:
            raise where.error(node, f"{schema.name} is already declared in this library")
        schemas[schema.name] = schema

    declarations = []
    for node, schema in parsed:
        op = schema.name
        kernels = node.get("kernels")
        if kernels is not None:
            kernels = where.mapping(kernels, f"{op}: kernels", line=line_of(node, "kernels"))
            kernels = {str(k): str(v) for k, v in kernels.items()}
        options: dict[str, Any] = {"kernels": kernels, "shape": _shape(where, node, op),
                                   "tolerances": _tolerances(where, node, op)}
        for key in ("dtypes", "row_strided", "rows"):  # lists of names, checked by Library.op
            if key in node:
                if not isinstance(node[key], list):
                    raise where.error(node, f"{op}: {key} must be a list of names, got {node[key]!r}")
                options[key] = [str(v) for v in node[key]]
        if "dtype_arg" in node:
            options["dtype_arg"] = str(node["dtype_arg"])
        if "graph_safe" in node:  # checked by Library.op
            options["graph_safe"] = node["graph_safe"]
        if "hints" in node:
            options["hints"] = _callable(where, node, "hints", op)
        declarations.append((node, schema, _callable(where, node, "reference", op), options))

    backward: dict[str, Derivative] = {}
    own = {schema.name: schema for _, schema in parsed}
    for i, entry in enumerate(entries):
        entry = where.mapping(entry, "a derivatives entry", line=line_of(entries, i))
        if "name" not in entry:
            raise where.error(entry, "derivatives entry without name: <schema>")
        try:
            schema = parse_schema(str(entry["name"]))
        except DeclarationError as e:
            raise where.error(entry, f"derivatives name: {e}") from None
        declared = own.get(schema.name)
        if declared is None:
            raise where.error(entry, f"derivatives: {schema.name} is not declared in this file's ops")
        if declared != schema:
            raise where.error(entry, f"derivatives: the schema {schema} differs from the op's {declared}")
        if schema.name in backward:
            raise where.error(entry, f"derivatives: {schema.name} has two entries")
        if declared.is_mutating:
            raise where.error(entry, f"derivatives: {schema.name} mutates its arguments in place, so it cannot be "
                                     f"differentiated and takes no derivatives entry")
        backward[schema.name] = compile_derivative(where, entry, declared, schemas)

    if library is None:
        caller = sys._getframe(1).f_globals.get("__name__", "__main__")  # inspect.stack() reads sources: slow
        library = _new_library(where, doc["library"], caller, line_of(doc, "library"))
    for derivative in backward.values():
        derivative.library = library
    for node, schema, reference, options in declarations:
        try:
            library.op(str(schema), backward=backward.get(schema.name), **options)(reference)
        except DeclarationError as e:
            raise where.error(node, str(e)) from None
        library.ops[schema.name].origin = f"{where.path}:{node.line}"  # messages name the entry, not this call
    return library
