"""Every built-in op called from several threads at once, in the framework's eager mode.

The op-call paths keep per-op state that threads share: the shape-rule
answers per argument signature (``call.core.rule_plan``, and NumPy's C entry's
own), the dtype-name caches, the lazily loaded kernels, the C entries'
counters, the output pool. Here four threads call a shuffled mix of every op
over more distinct shapes than those caches keep (so they start over while
other threads read them), all released at once, and every result must equal
the same call made alone beforehand: the same bits, since each call runs the
same kernel on the same inputs.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

import numpy as np

from opbridge import ops
from opbridge.call import core
from opbridge.testing import make_cases
from opbridge.testing.generate import META_KEYS

from ._framework import FRAMEWORK, H, framework_mark

pytestmark = framework_mark

THREADS = 4


def _usable(op: Any, dtype: str) -> bool:
    if dtype not in H.dtypes:
        return False
    ints = {str(v.dtype) for c in make_cases(op, dtype) for v in c.values()
            if isinstance(v, np.ndarray) and v.dtype.kind in "iu"}
    return ints <= set(H.dtypes)


def _calls() -> list[tuple[Any, str, dict[str, Any]]]:
    """(op, dtype, case) for every op, dtype and declared case, plus the gated ops over 300 widths."""
    calls = []
    for op in ops.LIBRARY.ops.values():
        for dtype in op.dtypes:
            if not _usable(op, dtype):
                continue
            for seed in (0, 1):
                calls += [(op, dtype, c) for c in make_cases(op, dtype, seed) if not any(k in c for k in META_KEYS)]
    rng = np.random.default_rng(0)
    gated = ops.silu_and_mul.opdef
    for rows in range(1, 16):
        for half in range(1, 21):  # 300 signatures: more than core.RULE_CACHE_SIZE
            calls.append((gated, "float32", {"x": rng.standard_normal((rows, 2 * half))}))
    assert sum(1 for c in calls if c[0] is gated) > core.RULE_CACHE_SIZE
    return calls


def _run(op: Any, dtype: str, case: dict[str, Any]) -> list[np.ndarray]:
    """The call on fresh framework arrays: its results and the new values of the arguments it writes."""
    # a copy of each value: NumPy's and torch's from_numpy share it, and a mutating op would write the case
    args = [H.from_numpy(v.copy(), dtype if v.dtype.kind == "f" else None) if isinstance(v, np.ndarray) else v
            for v in (case[a.name] for a in op.schema.arguments)]
    got = op.call(*args)
    outs = [] if got is None else list(got) if isinstance(got, tuple) else [got]
    if H.mutates_in_place:
        outs += [args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated and args[i] is not None]
    return [np.array(H.to_numpy(o), copy=True) for o in outs if o is not None]


def test_threads_get_what_a_lone_call_gets() -> None:
    calls = _calls()
    expected = [_run(*c) for c in calls]  # alone, first: also loads every kernel and fills the caches once
    order = list(range(len(calls))) * 2
    random.Random(0).shuffle(order)
    shares = [order[t::THREADS] for t in range(THREADS)]
    start = threading.Barrier(THREADS)
    failures: list[str] = []

    def work(share: list[int]) -> None:
        start.wait()
        for i in share:
            op, dtype, case = calls[i]
            try:
                got = _run(op, dtype, case)
            except Exception as e:  # reported with the call that raised it
                failures.append(f"{op.name} {dtype} {[np.shape(v) for v in case.values()]}: raised {e!r}")
                continue
            same = len(got) == len(expected[i]) and all(
                g.shape == w.shape and np.array_equal(g, w, equal_nan=g.dtype.kind == "f")
                for g, w in zip(got, expected[i]))
            if not same:
                failures.append(f"{op.name} {dtype} {[np.shape(v) for v in case.values()]}: differs from the "
                                f"same call made alone")

    threads = [threading.Thread(target=work, args=(s,)) for s in shares]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the GIL changes hands between (and inside) calls of a few µs, not every 5 ms
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, f"{FRAMEWORK}: {len(failures)} of {len(order)} concurrent calls went wrong:\n" + \
        "\n".join(failures[:10])
