"""The native entries, built now: torch's dispatcher shim (one per torch version) and the C entries
(NumPy's, per Python and NumPy version; the tensor entry for Paddle and MindSpore, per Python).

A program builds each of them in the background on first use, on CPU it leaves idle
(:mod:`opbridge.build.detached`), and runs its Python paths meanwhile. ``opbridge build`` and the
demo build them up front instead, so that a busy program, or the demo's timings, start native.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opbridge.call.c_entry import CEntry

#: The frameworks each native entry serves.
SERVES = {"torch native kernels": ("torch",), "NumPy C entry": ("numpy",),
          "tensor C entry": ("paddle", "mindspore")}
#: The module whose ``ENTRY`` is each C entry (:mod:`opbridge.call.c_entry`); the torch shim is not one.
_C_ENTRIES = {"NumPy C entry": "opbridge.adapters.numpy.native", "tensor C entry": "opbridge.call.exchange"}


@dataclass(frozen=True)
class Built:
    """One native entry: where it is, or why not (``path`` None), and how long building it took."""

    label: str
    path: Path | None
    seconds: float
    why_not: str = ""


def build_natives(frameworks: tuple[str, ...] | None = None) -> list[Built]:
    """Build (or find in the cache, or wait for the background build of) every native entry that serves
    one of *frameworks* (default: every installed one) and is switched on."""
    want = [label for label, serves in SERVES.items()
            if any(_installed(fw) and (frameworks is None or fw in frameworks) for fw in serves)]
    return [_build(label) for label in want if _enabled(label)]


def summary(frameworks: tuple[str, ...]) -> dict[str, str]:
    """:func:`build_natives` for a benchmark's JSON: each entry's path, or why it is not available."""
    return {b.label: str(b.path) if b.path is not None else f"not available: {b.why_not}"
            for b in build_natives(frameworks)}


def _installed(framework: str) -> bool:
    return importlib.util.find_spec(framework) is not None


def _enabled(label: str) -> bool:
    if label not in _C_ENTRIES:
        from opbridge import config

        return config.torch_native()
    return _entry(label).enabled()


def _entry(label: str) -> CEntry[Any]:
    from opbridge.call import c_entry

    return c_entry.module_entry(_C_ENTRIES[label])


def _build(label: str) -> Built:
    start = time.monotonic()
    if label not in _C_ENTRIES:
        from opbridge.adapters.torch import native

        shim = native.shim(build_now=True)
        path = native.build.path() if shim is not None else None
        why = "torch ops keep their Python dispatcher kernels"
    else:
        entry = _entry(label)
        lib = entry.library(build_now=True)
        path = lib.path if lib is not None else None
        why = entry.fallback
    return Built(label, path, time.monotonic() - start, "" if path is not None else why)
