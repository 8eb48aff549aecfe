"""opbridge: write a kernel once, declare it once, use it in every framework.

See :class:`opbridge.Library` to declare ops and ``opbridge.ops`` for the
built-in library. Importing opbridge compiles nothing and imports no
framework; builds happen on first use or on request (``opbridge build``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opbridge import _imports
from opbridge._version import __version__
from opbridge.declare import OpDef, Spec, like
from opbridge.errors import (
    BackendUnavailableError,
    BuildError,
    CacheError,
    CacheSecurityError,
    DeclarationError,
    OpbridgeError,
    UnsupportedFrameworkError,
)
from opbridge.library import Library

if TYPE_CHECKING:
    from opbridge import ops as ops

__all__ = [
    "BackendUnavailableError",
    "BuildError",
    "CacheError",
    "CacheSecurityError",
    "DeclarationError",
    "Library",
    "OpDef",
    "OpbridgeError",
    "Spec",
    "UnsupportedFrameworkError",
    "__version__",
    "like",
    "ops",
]


def _register_builtins_with_torch() -> None:
    """Declare the built-in ops, so that ``torch.ops.opbridge.<op>`` resolves; nothing is compiled.

    Declaring an op while torch is imported registers its schema, kernels
    (which build on their first call), fake kernel and autograd formula.
    """
    import importlib

    importlib.import_module("opbridge.ops")
    from opbridge.call import dispatch

    if not dispatch.initializing("opbridge.adapters.torch"):  # else its import registers them when it ends
        dispatch.adapter("torch")  # registers every op declared before torch was imported too


_imports.after_import("torch", _register_builtins_with_torch)


def _register_with_mindspore() -> None:
    """Once MindSpore is imported, make every library declared so far usable in its graphs.

    MindSpore compiles ``ms.jit`` functions and ``GRAPH_MODE`` cells from
    source; an op's public callable is generated code it cannot compile, so
    the MindSpore adapter maps each one to a graph substitute in MindSpore's
    parser (nothing is compiled). Libraries declared later are registered
    when declared (``dispatch.DECLARE_TIME_ADAPTERS``).
    """
    from opbridge import registry
    from opbridge.call import dispatch

    # `import opbridge.adapters.mindspore` imports MindSpore itself: the adapter registers every library
    # declared so far when its import ends (as torch's does)
    if registry.libraries() and not dispatch.initializing("opbridge.adapters.mindspore"):
        dispatch.adapter("mindspore")


_imports.after_import("mindspore", _register_with_mindspore)


def __getattr__(name: str) -> Any:
    if name == "ops":
        import importlib

        return importlib.import_module("opbridge.ops")
    raise AttributeError(f"module 'opbridge' has no attribute {name!r}")
