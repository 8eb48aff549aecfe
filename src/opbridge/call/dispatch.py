"""Route an op call to the adapter of the framework whose arrays it was given.

Adapters are found by framework name (``opbridge.adapters.<name>``, imported on
first use), so this stage never imports one: a new framework plugs in by adding
its module and a line to :data:`FRAMEWORK_OF_MODULE`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from opbridge.errors import UnsupportedFrameworkError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef


class Adapter(Protocol):
    """A framework adapter (the module ``opbridge.adapters.<name>`` exposes one as ``ADAPTER``).

    ``make_call(op, array_type)`` returns a function taking the op's arguments
    positionally, in schema order, and returning the op's results as that
    framework's arrays. It is called once per (op, array type) and cached, so
    it should front-load all lookups. Optional: ``call_with_out(op, args,
    outs)`` for ``out=``, and ``register(library)`` for frameworks whose graph
    tracers must know an op before its first call.
    """

    name: str

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]: ...

#: top-level module of an array type -> adapter name
FRAMEWORK_OF_MODULE = {
    "torch": "torch",
    "numpy": "numpy",
    "jax": "jax",
    "jaxlib": "jax",
    "paddle": "paddle",
    "mindspore": "mindspore",
}
ADAPTERS = ("torch", "numpy", "jax", "paddle", "mindspore")
#: Frameworks whose adapters register an op as soon as it is declared, once the framework is imported.
DECLARE_TIME_ADAPTERS = ("torch", "paddle", "mindspore")
_LOADED: dict[str, Adapter] = {}


def framework_of(x: Any) -> str | None:
    """The adapter name for array *x*, or None: by the module of its type, else of a base class (MindSpore
    makes each ``Parameter``'s class at run time, in module ``abc``)."""
    for cls in type(x).__mro__:
        name = FRAMEWORK_OF_MODULE.get(cls.__module__.partition(".")[0])
        if name is not None:
            return name
    return None


def initializing(module_name: str) -> bool:
    """Whether module *module_name* is being imported right now (in ``sys.modules``, not yet executed)."""
    module = sys.modules.get(module_name)
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def adapter(name: str) -> Adapter:
    """Import (once) and return the adapter called *name*."""
    ad = _LOADED.get(name)
    if ad is None:
        module = importlib.import_module(f"opbridge.adapters.{name}")
        ad = module.ADAPTER
        _LOADED[name] = ad
    return ad


def resolve(op: OpDef, table: dict[type, Callable[..., Any]], x: Any) -> Callable[..., Any]:
    """Find the adapter for ``type(x)``, build its call for *op* and cache it in *table*."""
    name = framework_of(x)
    if name is None:
        arg = op.schema.arguments[op.dispatch_arg].name
        raise UnsupportedFrameworkError(
            f"{op.name}: argument '{arg}' must be an array of one of {', '.join(ADAPTERS)}, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    fn = adapter(name).make_call(op, type(x))
    table[type(x)] = fn
    return fn


def call_with_out(op: OpDef, table: dict[type, Callable[..., Any]], args: tuple[Any, ...], out: Any) -> Any:
    """Run *op* writing into caller-provided output(s) *out* (a tensor or a tuple of them).

    The first call for an array type also resolves the op's call for it (as a
    call without ``out=`` would), so the adapter's inline ``out=`` fast path is
    installed even when every call passes ``out=``.
    """
    if isinstance(out, list):  # as one tensor it would be "got 1"
        raise TypeError(f"{op.name}: out= takes a tensor or a tuple of them, got a list of {len(out)}")
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    if len(outs) != op.n_outputs:
        raise TypeError(f"{op.name}: out= needs {op.n_outputs} tensor(s), got {len(outs)}")
    x = args[op.dispatch_arg]
    name = framework_of(x)
    ad = adapter(name) if name is not None else None
    if ad is None or not hasattr(ad, "call_with_out"):
        raise TypeError(f"{op.name}: out= is not supported for {type(x).__module__}.{type(x).__qualname__} "
                        f"arguments" + (" (their arrays are immutable)" if name == "jax" else ""))
    for i, o in enumerate(outs):
        if framework_of(o) != name:
            raise TypeError(f"{op.name}: out[{i}] must be an array of the same framework as the inputs "
                            f"({name}), got {type(o).__module__}.{type(o).__qualname__}")
    if type(x) not in table:
        resolve(op, table, x)
    return ad.call_with_out(op, args, outs)


def on_declared(lib: Library) -> None:
    """Register *lib*'s ops with every declare-time framework already in use.

    Their graph tracers (Dynamo, Paddle's SOT) must know an op even if its
    first call is inside a trace. Importing an adapter registers every op
    declared so far; an adapter already imported registers *lib* again
    (idempotent).
    """
    for framework in DECLARE_TIME_ADAPTERS:
        if sys.modules.get(framework) is None or initializing(framework) or initializing(
                f"opbridge.adapters.{framework}"):
            # Not imported, or still being imported (Paddle imports torch part-way through its
            # own import, which runs torch's hooks; `import opbridge.adapters.torch` before torch
            # runs them inside the adapter's import): the adapter registers everything declared
            # when its import finishes or when it is first used.
            continue
        already = f"opbridge.adapters.{framework}" in sys.modules
        ad = adapter(framework)
        register = getattr(ad, "register", None)
        if already and register is not None:
            register(lib)
