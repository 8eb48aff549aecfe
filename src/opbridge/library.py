"""``opbridge.Library``: a declared library, with its ops callable and its modules built on demand.

:class:`opbridge.declare.Library` records declarations as pure data. This
facade, the class users import as ``opbridge.Library``, sits above the build,
load and call stages and adds what needs them: each declared op's public
callable (:mod:`opbridge.call.callable`), registration with the frameworks
already in use, and :meth:`Library.build` / :meth:`Library.module`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import declare
from opbridge.call import dispatch
from opbridge.call.callable import make_callable

if TYPE_CHECKING:
    from opbridge.declare import OpDef

__all__ = ["Library"]


class Library(declare.Library):
    __doc__ = declare.Library.__doc__

    def _publish(self, op: OpDef) -> Any:
        op.call = make_callable(op)
        dispatch.on_declared(self)
        return op.call

    def module(self, device: str = "cpu") -> Any:
        """Return the loaded tvm-ffi module for *device*, building it if needed."""
        from opbridge import loader  # the build toolchain is imported when first needed

        return loader.load(self, device)

    def build(self, device: str = "cpu", force: bool = False) -> Path:
        """Compile (or fetch from the cache) the module for *device*; return its path."""
        from opbridge import loader

        return loader.build(self, device, force=force)
