"""opbridge's pool of large CPU outputs (include/opbridge/host_buffers_impl.h, opbridge.call.memory).

Every framework whose outputs opbridge allocates takes a new CPU output of
4 MiB or more from the pool: 2 MiB-aligned, a whole number of huge pages,
and, once freed, handed to the next output of the same size instead of being
mapped and zeroed again. (Paddle's and MindSpore's are in their adapter
tests, which run in their own processes.) These tests fail if any adapter stops using it, if
recycling stops, or if its bounds (size, idle release, fork) stop holding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.call import memory

HUGE = 2 << 20
SHAPE = (1024, 2048)  # 8 MiB of float32: above memory.MIN_BYTES


def _ptr_numpy(a: Any) -> int:
    return int(a.ctypes.data)


def _frameworks() -> list[tuple[str, Callable[[], tuple[Callable[[], Any], Callable[[Any], int]]]]]:
    """(name, setup) per framework available here; setup returns (a call making a new output, its address)."""

    def numpy_setup() -> tuple[Callable[[], Any], Callable[[Any], int]]:
        x = np.ones(SHAPE, np.float32)
        return (lambda: opbridge.ops.add(x, x)), _ptr_numpy

    def numpy_rule_setup() -> tuple[Callable[[], Any], Callable[[Any], int]]:
        x, w = np.ones(SHAPE, np.float32), np.ones(SHAPE[1], np.float32)
        return (lambda: opbridge.ops.rms_norm(x, w)), _ptr_numpy

    out = [("numpy", numpy_setup), ("numpy shape rule", numpy_rule_setup)]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        def torch_setup(kind: str) -> Callable[[], tuple[Callable[[], Any], Callable[[Any], int]]]:
            def setup() -> tuple[Callable[[], Any], Callable[[Any], int]]:
                x = torch.ones(SHAPE)
                w = torch.ones(SHAPE[1])
                calls = {
                    "public": lambda: opbridge.ops.add(x, x),
                    "dispatcher": lambda: torch.ops.opbridge.add(x, x),
                    "shape rule": lambda: torch.ops.opbridge.rms_norm(x, w, 1e-6),
                    "autograd": lambda: opbridge.ops.gelu(x.detach().requires_grad_()),
                    "strided": lambda: opbridge.ops.add(x.t(), x.t()),
                }
                return calls[kind], lambda t: int(t.data_ptr())
            return setup

        out += [(f"torch {k}", torch_setup(k)) for k in ("public", "dispatcher", "shape rule", "autograd", "strided")]
    return out


@pytest.mark.parametrize("name,setup", _frameworks(), ids=[n for n, _ in _frameworks()])
def test_large_outputs_are_aligned_and_recycled(name: str, setup: Any) -> None:
    call, ptr = setup()
    call()  # loads the module (the first call may allocate before the pool is known)
    first = call()
    p = ptr(first)
    assert p % HUGE == 0, f"{name}: a large output is not 2 MiB-aligned"
    before = memory.host_stats()
    assert before is not None
    del first
    second = call()
    after = memory.host_stats()
    assert after is not None
    if not name.endswith("strided"):  # there the fast path's declined attempt holds a second buffer
        assert ptr(second) == p, f"{name}: the freed output's buffer was not handed to the next one"
    assert after["reused"] > before["reused"], f"{name}: no buffer was reused"


def test_bfloat16_numpy_outputs() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.ones(SHAPE, ml_dtypes.bfloat16)
    y = opbridge.ops.add(x, x)
    assert y.dtype == x.dtype and y.shape == SHAPE and y.flags.writeable and y.flags.c_contiguous
    assert y.ctypes.data % HUGE == 0
    np.testing.assert_array_equal(y.astype(np.float32), 2.0)


def test_outputs_from_many_threads() -> None:
    """Concurrent calls: every output is right and every buffer is back (none live) once they are freed."""
    x = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
    opbridge.ops.add(x, x)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                y = opbridge.ops.add(x, x)
                assert y[-1, -1] == 2 * x[-1, -1] and y[0, 1] == 2.0
                del y
        except BaseException as e:
            errors.append(e)

    live = memory.host_stats()["live"]  # type: ignore[index]
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert memory.host_stats()["live"] == live  # type: ignore[index]


def _run(code: str, **env: str) -> str:
    full = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=full, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


_PRELUDE = """
    import numpy as np, opbridge, time
    from opbridge.call import memory
    x = np.ones((1024, 2048), np.float32)
    opbridge.ops.add(x, x)
"""


def test_output_cache_mb_0_turns_recycling_off() -> None:
    out = _run(_PRELUDE + """
    y = opbridge.ops.add(x, x); p = y.ctypes.data; del y
    s = memory.host_stats()
    print(p % (2 << 20), s["cached_bytes"], s["reused"])
    """, OPBRIDGE_OUTPUT_CACHE_MB="0")
    assert out.split() == ["0", "0", "0"]  # still aligned; nothing kept, nothing reused


def test_a_misspelt_setting_is_an_error_at_the_first_large_output() -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELUDE + """
    opbridge.ops.add(x, x)
    """)], capture_output=True, text=True, env={**os.environ, "OPBRIDGE_OUTPUT_CACHE_MB": "256MB"}, timeout=300)
    assert r.returncode != 0
    assert "OPBRIDGE_OUTPUT_CACHE_MB must be a whole number (of MiB; 0 turns recycling off), got '256MB'" in r.stderr


def test_cache_is_bounded_and_drops_the_oldest() -> None:
    out = _run(_PRELUDE + """
    ys = [opbridge.ops.add(x, x) for _ in range(4)]  # 4 x 8 MiB
    del ys
    s = memory.host_stats()
    print(s["cached_bytes"], s["cached"])
    """, OPBRIDGE_OUTPUT_CACHE_MB="16")
    assert out.split() == [str(16 << 20), "2"]


def test_idle_buffers_go_back_to_the_os() -> None:
    out = _run(_PRELUDE + """
    y = opbridge.ops.add(x, x); del y
    assert memory.host_stats()["cached"] == 1
    deadline = time.time() + 10
    while memory.host_stats()["cached"] and time.time() < deadline:
        time.sleep(0.02)
    s = memory.host_stats()
    print(s["cached"], s["released_idle"] >= 1)
    """, OPBRIDGE_OUTPUT_CACHE_IDLE_MS="50")
    assert out.split() == ["0", "True"]


def test_keep_idle_buffers_holds_them_within_its_block() -> None:
    """bench kernels' setting: idle buffers kept past OPBRIDGE_OUTPUT_CACHE_IDLE_MS inside the block only."""
    out = _run(_PRELUDE + """
    with memory.keep_idle_buffers(60_000):
        y = opbridge.ops.add(x, x); del y
        time.sleep(0.5)
        held, inner = memory.host_stats()["cached"], memory.idle_ms()
    deadline = time.time() + 10
    while memory.host_stats()["cached"] and time.time() < deadline:
        time.sleep(0.02)
    print(held, inner, memory.idle_ms(), memory.host_stats()["cached"])
    """, OPBRIDGE_OUTPUT_CACHE_IDLE_MS="50")
    assert out.split() == ["1", "60000", "50", "0"]


def test_trim_empties_the_cache() -> None:
    out = _run(_PRELUDE + """
    y = opbridge.ops.add(x, x); del y
    memory.host_trim()
    print(memory.host_stats()["cached_bytes"])
    """)
    assert out.split() == ["0"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_forked_child_starts_with_its_own_pool() -> None:
    out = _run(_PRELUDE + """
    import os
    y = opbridge.ops.add(x, x); del y  # the parent caches one buffer
    pid = os.fork()
    if pid == 0:
        s = memory.host_stats()
        ok = s["cached"] == 0
        for _ in range(3):
            z = opbridge.ops.add(x, x)
            ok = ok and z[0, 0] == 2.0
            del z
        ok = ok and memory.host_stats()["reused"] == 2
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), memory.host_stats()["cached"])
    """)
    assert out.split() == ["0", "1"]


@pytest.mark.parametrize("path", ["entry", "strided"])
def test_torch_pool_outputs_have_ordinary_storage(path: str) -> None:
    """A pool-backed torch output behaves as torch.empty's: its storage can grow (resize_) and shrink."""
    torch = pytest.importorskip("torch")
    from opbridge.adapters.torch import native

    x = torch.ones(SHAPE)
    opbridge.ops.add(x, x)
    if native.shim(build_now=True) is None:
        pytest.skip("no torch native shim here (no compiler): outputs are DLPack-shared, of fixed size")
    y = opbridge.ops.add(x, x) if path == "entry" else opbridge.ops.add(x.t(), x.t())
    assert y.data_ptr() % HUGE == 0
    y.resize_(2 * y.numel())  # grows: a new allocation through the pool's allocator
    y[-1] = 7.0
    assert y.numel() == 2 * SHAPE[0] * SHAPE[1] and float(y[0]) == 2.0 and float(y[-1]) == 7.0
    y.resize_(8)
    assert float(y[0]) == 2.0


def test_fuzzed_allocations_never_overlap_and_keep_their_contents() -> None:
    """Random interleavings of allocations and frees, with a cache smaller than the live set.

    Live buffers never overlap, each keeps the bytes written to it until it is
    freed, a reused buffer is one that was freed, and every buffer is back once
    all are freed. A fresh process, so the pool's bounds can be set freely.
    """
    pytest.importorskip("hypothesis")
    _run("""
    import numpy as np
    from hypothesis import given, settings, strategies as st, HealthCheck
    from opbridge.call import memory
    import opbridge
    x = np.ones(8, np.float32); opbridge.ops.add(x, x)  # load the module that registers the pool
    MiB = 1 << 20

    ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.sampled_from([4, 5, 6, 8, 12]),
                             st.integers(0, 1 << 30)), min_size=1, max_size=40)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def check(steps):
        live = {}  # id -> (array, start, end, stamp)
        freed = set()
        for n, (kind, mib, pick) in enumerate(steps):
            if kind == "alloc" or not live:
                a = memory.empty_ndarray((mib * MiB // 4,), np.dtype(np.float32))
                start = a.ctypes.data
                end = start + a.nbytes
                assert start % (2 * MiB) == 0
                for b, s, e, _ in live.values():
                    assert end <= s or e <= start, "two live buffers overlap"
                b = None
                a[:1024] = n; a[-1024:] = n
                live[n] = (a, start, end, n)
            else:
                key = sorted(live)[pick % len(live)]
                a, s, e, stamp = live.pop(key)
                assert (a[:1024] == stamp).all() and (a[-1024:] == stamp).all(), "a live buffer was overwritten"
                freed.add(s)
                del a
        live.clear()
        a = b = None  # the loop's own names held the last arrays
        s = memory.host_stats()
        assert s["live"] == 0 and s["cached_bytes"] <= 24 * MiB, s

    check()
    print("ok")
    """, OPBRIDGE_OUTPUT_CACHE_MB="24", OPBRIDGE_OUTPUT_CACHE_IDLE_MS="60000")


def test_torch_compile_and_meta_tensors_with_large_outputs() -> None:
    """Fake and meta outputs never come from the pool (a fake tensor has no address to advise)."""
    torch = pytest.importorskip("torch")
    x, w = torch.randn(SHAPE), torch.ones(SHAPE[1])
    f = torch.compile(lambda a, b: opbridge.ops.rms_norm(opbridge.ops.gelu(a), b) + 1, fullgraph=True)
    torch.testing.assert_close(f(x, w), opbridge.ops.rms_norm(opbridge.ops.gelu(x), w) + 1)
    m = opbridge.ops.add(x.to("meta"), x.to("meta"))
    assert m.device.type == "meta" and m.shape == x.shape
