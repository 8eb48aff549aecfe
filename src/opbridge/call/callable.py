"""The public callable of an op: the schema's exact Python signature, then a dict lookup.

Generated per op from its schema. The body looks up the dispatching
argument's type in a table that the adapter for that type fills on first use
(:func:`opbridge.call.dispatch.resolve`). Adapters may splice an inline fast
path in front of the lookup (:func:`install_prelude`); the callable object
keeps its identity, so references users already hold get faster too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opbridge._codegen import compile_source
from opbridge.call import dispatch
from opbridge.schema import NO_DEFAULT

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def signature_source(op: OpDef) -> tuple[list[str], bool]:
    """The schema as Python parameters (with defaults and ``*``), and whether ``*`` was emitted."""
    params = []
    kw_started = False
    for a in op.schema.arguments:
        if a.kwarg_only and not kw_started:
            params.append("*")
            kw_started = True
        params.append(a.name if a.default is NO_DEFAULT else f"{a.name}={a.default!r}")
    return params, kw_started


def callable_source(op: OpDef, prelude: str = "", out_prelude: str = "") -> str:
    """Source of the op's public callable: adapters' inline fast paths, then type dispatch."""
    params, kw_started = signature_source(op)
    names = [a.name for a in op.schema.arguments]
    lead = names[op.dispatch_arg]
    out_check = ""
    if op.accepts_out:
        params.append("out=None" if kw_started else "*, out=None")
        out_check = (f"    if out is not None:\n{out_prelude}"
                     f"        return _with_out(({', '.join(names)},), out)\n")
    return (
        f"def {op.name}({', '.join(params)}):\n"
        f"{out_check}"
        f"{prelude}"
        f"    _opb_f = _table.get(type({lead}))\n"
        f"    if _opb_f is None:\n"
        f"        _opb_f = _resolve({lead})\n"
        f"    return _opb_f({', '.join(names)})\n"
        # Never run (after the return; no cost). MindSpore's Rewrite (O1 mixed precision,
        # custom_mixed_precision's white list) re-emits a Python function a Cell calls from its
        # source file, where a generated function's names are not; it keeps a function that
        # holds a nested def whole, as a call.
        "    def _opb_whole_to_mindspore_rewrite():\n"
        "        pass\n"
    )


def make_callable(op: OpDef) -> Callable[..., Any]:
    """Generate the op's public callable with the schema's exact Python signature.

    The body is one dict lookup on the type of the dispatching argument; the
    framework adapter supplies the rest, specialised per op. An adapter may
    later install an inline fast path with :func:`install_prelude`.
    """
    table: dict[type, Callable[..., Any]] = {}
    ns: dict[str, Any] = {
        "_table": table,
        "_resolve": lambda x: dispatch.resolve(op, table, x),
        "_with_out": lambda args, out: dispatch.call_with_out(op, table, args, out),
    }
    compile_source(callable_source(op), f"<opbridge op {op.qualname}>", ns)
    fn: Callable[..., Any] = ns[op.name]
    fn.__doc__ = op.doc or f"{op.qualname}: {op.schema}"
    fn.__qualname__ = op.name
    fn.__module__ = op.library.python_module
    fn.opdef = op  # type: ignore[attr-defined]
    fn.reference = op.reference  # type: ignore[attr-defined]
    fn.schema = op.schema  # type: ignore[attr-defined]
    return fn


def _place(table: dict[str, str], key: str, text: str, first: bool) -> None:
    """Set ``table[key] = text``, moving the entry to the front with *first* (a dict keeps insertion order)."""
    if first:
        rest = {k: v for k, v in table.items() if k != key}
        table.clear()
        table[key] = text
        table.update(rest)
    else:
        table[key] = text


def install_prelude(op: OpDef, key: str, prelude: str, names: Mapping[str, Any], out_prelude: str = "",
                    first: bool = False) -> None:
    """Splice an adapter's inline fast path into *op*'s public callable.

    *prelude* is indented function-body source, guarded by the type of the
    dispatching argument, that either returns or falls through to the generic
    dispatch; *names* are the globals it uses (prefix them with the adapter's
    name: all adapters share one namespace). Each adapter (*key*) has at most
    one prelude; they run in installation order, except that one installed
    *first* runs before every other (a C entry before its adapter's Python
    fast path for the same type). *out_prelude* (8-space indented) runs
    first when ``out=`` is given, and either returns or falls through to the
    generic ``out=`` path.
    """
    fn = op.call
    fn.__globals__.update(names)
    _place(op.preludes, key, prelude, first)
    if out_prelude:
        _place(op.out_preludes, key, out_prelude, first)
    source = callable_source(op, "".join(op.preludes.values()), "".join(op.out_preludes.values()))
    scratch = compile_source(source, f"<opbridge op {op.qualname}>", dict(fn.__globals__))
    fn.__code__ = scratch[op.name].__code__
