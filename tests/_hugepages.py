"""What the huge-page tests of the framework adapters share: when THP advice is observable, faults per call."""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_skip_reason() -> str | None:
    """Why huge-page advice cannot be observed here (None if it can: THP in ``[madvise]`` mode)."""
    try:
        mode = THP.read_text().strip()
    except OSError:
        return f"no {THP} (not Linux, or no transparent huge pages)"
    if "[madvise]" not in mode:
        return f"transparent huge pages are '{mode}', not [madvise]: the advice changes nothing here"
    return None


def faults_per_call(fn: Callable[..., Any], *args: Any, calls: int = 3) -> float:
    """Minor page faults per call of ``fn(*args)`` after a warm-up call, each output freed at once."""
    fn(*args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        out = fn(*args)
        del out  # freed at once: the next call's output is mapped anew
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
