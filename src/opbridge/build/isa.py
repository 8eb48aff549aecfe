"""Compiling a JIT build for the CPU it runs on: ``-march=native``, and what that means here.

A JIT build only ever runs on the machine that built it, so it compiles with
``-march=native -DOPB_NATIVE_ISA`` (one code path per hot loop, for this CPU;
``math.h`` then drops ``OPB_TARGET_CLONES``' three ISA clones). Since the flag
itself names no CPU, every cache key of such a build includes
:func:`native_isa_id`, and a cache directory shared between machines never
hands one CPU's code to another.
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import subprocess
from typing import TYPE_CHECKING

from opbridge import config

if TYPE_CHECKING:
    from opbridge.build.compile import BuildSpec

#: Added to the C++ flags of a :attr:`BuildSpec.native_isa` build. ``-pipe``: no temporary
#: assembler files (output unchanged).
NATIVE_FLAGS = ("-march=native", "-DOPB_NATIVE_ISA", "-pipe")


@functools.cache
def _native_isa_id(compiler: str) -> str:
    """What ``-march=native`` means to *compiler* on this CPU, or ``""`` if it cannot say.

    gcc prints the expanded ``-march=<cpu> -m<feature>...`` of its ``cc1plus``
    command line under ``-v``; clang the ``-target-cpu``/``-target-feature`` of
    its ``-cc1`` line under ``-###``. Only those lines are kept: they name the
    CPU and every instruction-set extension the code may use, nothing else.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    for probe in (["-march=native", "-E", "-v", "-x", "c++", os.devnull, "-o", os.devnull],
                  ["-march=native", "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull]):
        try:
            out = subprocess.run([compiler, *probe], capture_output=True, text=True, check=False,
                                 timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        if out.returncode != 0:
            continue
        for line in (out.stdout + out.stderr).splitlines():
            words = line.split()
            if "cc1plus" in line and any(w.startswith("-march=") for w in words):
                return " ".join(w for w in words if w.startswith(("-march=", "-m", "--param=l")))
            if '"-cc1"' in words and '"-target-cpu"' in words:
                pairs = itertools.pairwise(words)
                return " ".join(f"{k}={v}" for k, v in pairs if k in ('"-target-cpu"', '"-target-feature"'))
    return ""


def native_isa_id() -> str:
    """The CPU and instruction-set extensions ``-march=native`` selects here (``""``: unsupported).

    Part of every cache key of a :attr:`BuildSpec.native_isa` build, so a cache
    directory shared between machines never hands one CPU's code to another.
    """
    return _native_isa_id(config.cxx())


def uses_native_isa(spec: BuildSpec) -> bool:
    """Whether *spec*'s C++ compiles with :data:`NATIVE_FLAGS` (asked for, and supported here)."""
    return spec.native_isa and bool(native_isa_id())
