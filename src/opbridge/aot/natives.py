"""The native entries, built now: torch's dispatcher shim (one per torch version) and the C entries
(NumPy's, per Python and NumPy version; the tensor entry for Paddle and MindSpore, per Python).

A program builds each of them in the background on first use, on CPU it leaves idle
(:mod:`opbridge.build.detached`), and runs its Python paths meanwhile. ``opbridge build`` and the
demo build them up front instead, so that a busy program, or the demo's timings, start native.
"""

from __future__ import annotations

import importlib.util
import threading
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


class Building:
    """Native entries being built (:func:`start`): torch's shim on a thread of this process from the start,
    the C entries in :meth:`results`, which then waits for the shim.

    The shim is one long compile (28 s here), run by a detached child (:mod:`opbridge.build.detached`): the
    caller's own build, between :func:`start` and :meth:`results`, has the other cores meanwhile (on this
    project's 2-core machine ``opbridge build`` into an empty cache took 63 s with everything in sequence).
    The thread is a daemon, and only waits for that child: Ctrl-C ends the program at once, and the shim
    still lands in the cache. The C entries build in the caller's thread, one after the other (the second
    then takes the runtime unit they share from the object store: :attr:`BuildSpec.flags_for_sources_only`),
    so that Ctrl-C stops their compilers too; on a thread of their own, the exit of an interrupted program
    waited for their builds (:mod:`concurrent.futures`' compile threads are not daemons).
    """

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        shim = [label for label in labels if label not in _C_ENTRIES]
        if labels:
            from opbridge import _tvm

            _tvm.tvm_ffi()  # imported here, once: its import keeps torch out while it runs (_tvm.tvm_ffi)
        self._shim = _Job(shim) if shim else None

    def results(self) -> list[Built]:
        """Build the C entries, then wait for the shim; every entry's outcome, in :data:`SERVES`' order."""
        done = {label: _build(label) for label in self.labels if label in _C_ENTRIES}
        if self._shim is not None:
            while self._shim.is_alive():  # polled: a Ctrl-C the kernel hands to another thread is seen
                self._shim.join(0.2)
            if self._shim.error is not None:
                raise self._shim.error
            done.update((b.label, b) for b in self._shim.built)
        return [done[label] for label in self.labels]


class _Job(threading.Thread):
    """Builds *labels* one after the other, on a daemon thread."""

    def __init__(self, labels: list[str]) -> None:
        super().__init__(name="opbridge-natives", daemon=True)
        self.labels = labels
        self.built: list[Built] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.built = [_build(label) for label in self.labels]
        except BaseException as e:  # handed to results()
            self.error = e


def start(frameworks: tuple[str, ...] | None = None) -> Building:
    """Start building (or finding in the cache, or waiting for the background build of) every native
    entry that serves one of *frameworks* (default: every installed one) and is switched on."""
    want = [label for label, serves in SERVES.items()
            if any(_installed(fw) and (frameworks is None or fw in frameworks) for fw in serves)]
    return Building([label for label in want if _enabled(label)])


def build_natives(frameworks: tuple[str, ...] | None = None) -> list[Built]:
    """:func:`start`, then wait for every entry."""
    return start(frameworks).results()


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
