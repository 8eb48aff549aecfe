"""The native (C++) dispatcher kernels of ``torch.ops.<ns>.<op>`` (opbridge.adapters.torch.native).

Each test asserts something the Python kernels alone would fail: the native
routine's call counter moves, no Python frame runs, and the results, errors
and gradients equal the Python kernel's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import opbridge
import opbridge.ops as ops
from opbridge.adapters.torch import calls, dispatcher, native
from opbridge.testing.generate import make_cases

BUILTINS = list(ops.LIBRARY.ops.values())


def built_shim() -> native.Shim:
    """The native shim, built now, with every built-in kernel handed to it (skips where it cannot be)."""
    if not native.enabled():
        pytest.skip("OPBRIDGE_TORCH_NATIVE=0")
    sh = native.shim(build_now=True)
    if sh is None:
        pytest.skip("the native shim could not be built here (no compiler?)")
    for op in BUILTINS:  # kernels handed to the native routine (and any pending op registered)
        calls.kernel(op, "cpu")
    return sh


@pytest.fixture(scope="module", autouse=True)
def shim() -> native.Shim:
    return built_shim()


def _tensors(op: opbridge.OpDef, case: dict[str, Any], dtype: str) -> list[Any]:
    out = []
    for a in op.schema.arguments:
        v = case[a.name]
        if isinstance(v, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(v))
            v = t.to(calls.to_dtype(dtype)) if t.is_floating_point() else t.clone()
        out.append(v)
    return out


def _clone(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _same(a: Any, b: Any) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif a is None:
        assert b is None
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("op", BUILTINS, ids=lambda o: o.name)
def test_builtin_op_runs_native_and_matches_python_kernel(op: opbridge.OpDef) -> None:
    overload = dispatcher.packet(op)
    python_impl = dispatcher.make_impl(op, "cpu")
    mutated = [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    for dtype in op.dtypes:
        cases = [c for c in make_cases(op, dtype) if c.get("_noncontiguous") is None][:3]
        assert cases
        for case in cases:
            args = _tensors(op, case, dtype)
            native_args, python_args = _clone(args), _clone(args)
            before = native.native_calls(op)
            got = overload(*native_args)
            assert native.native_calls(op) == before + 1, f"{op.name} {dtype}: not run by the native kernel"
            _same(got, python_impl(*python_args))
            for i in mutated:
                _same(native_args[i], python_args[i])


def _python_frames(fn: Callable[[], Any]) -> list[str]:
    """The Python functions *fn* runs besides itself and torch's ``torch.ops`` call machinery."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [f for f in seen if "torch/_ops.py" not in f and "test_torch_native" not in f]


def test_torch_ops_call_runs_no_python_kernel() -> None:
    x, y = torch.randn(8), torch.randn(8)
    torch.ops.opbridge.add(x, y)
    assert _python_frames(lambda: torch.ops.opbridge.add(x, y)) == []
    assert _python_frames(lambda: torch.ops.opbridge.rms_norm.default(x, y, 1e-6)) == []
    with torch.no_grad():
        w = torch.randn(8, requires_grad=True)
        assert _python_frames(lambda: torch.ops.opbridge.rms_norm(x, w)) == []


def test_new_outputs_are_contiguous_and_rule_shapes_are_remembered_per_signature() -> None:
    for shape in [(3, 8), (5, 2, 6), (3, 8)]:
        x = torch.randn(shape)
        got = torch.ops.opbridge.silu_and_mul(x)
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous()
        _same(got, ops.silu_and_mul(x))


def test_strided_and_undeclared_dtype_calls_fall_back_with_todays_results_and_messages() -> None:
    op = ops.add.opdef
    python_impl = dispatcher.make_impl(op, "cpu")
    a, b = torch.randn(4, 8)[:, ::2], torch.randn(4, 4)
    before = native.native_calls(op)
    _same(torch.ops.opbridge.add(a, b), a + b)
    i16 = torch.ones(3, dtype=torch.int16)
    for args in [(i16, i16), (torch.ones(3), torch.ones(4)), (torch.ones(3), torch.ones(3, dtype=torch.float64))]:
        with pytest.raises((TypeError, ValueError)) as expected:
            python_impl(*args)
        with pytest.raises(expected.type) as got:
            torch.ops.opbridge.add(*args)
        assert str(got.value) == str(expected.value)
    assert native.native_calls(op) == before


def test_mutating_op_bumps_versions_and_keeps_the_alias_error() -> None:
    x, res, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    expect_x, expect_res = x.clone(), res.clone()
    ops.fused_add_rms_norm(expect_x, expect_res, w)
    version = x._version
    assert torch.ops.opbridge.fused_add_rms_norm(x, res, w) is None
    assert x._version > version
    _same(x, expect_x)
    _same(res, expect_res)
    with pytest.raises(ValueError, match="overlaps argument"):
        torch.ops.opbridge.fused_add_rms_norm(x, x, w)
    with pytest.raises(RuntimeError, match="requires grad"):
        torch.ops.opbridge.fused_add_rms_norm(x, res, w.clone().requires_grad_())


def test_gradients_still_come_from_the_declared_backward() -> None:
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out = torch.ops.opbridge.rms_norm(x, w)
    assert "GeneratedBackwardFor_opbridge_rms_norm" in type(out.grad_fn).__name__
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.opbridge.rms_norm(a, b, 1e-6), (x, w))
    g = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.opbridge.silu_and_mul, (g,))


KERNELS_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
static void times(TensorView out, TensorView x, float k) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = k * a[i];
}
void twice_cpu(TensorView out, TensorView x) { times(out, x, 2); }
void thrice_cpu(TensorView out, TensorView x) { times(out, x, 3); }
OPBRIDGE_EXPORT(twice_cpu);
OPBRIDGE_EXPORT(thrice_cpu);
"""


class _FoundJob:
    """Stands in for the shim's compile: "builds" the one this session built."""

    joined = False

    def __init__(self, background: bool = False) -> None:
        self.out = native.build.path()

    def wait(self) -> Any:
        return self.out

    def cancel(self) -> None:
        pass


@pytest.fixture
def no_shim_yet(shim: native.Shim, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops registered inside are registered as if no shim was built yet (the first process)."""
    monkeypatch.setattr(native, "_SHIM", None)
    monkeypatch.setattr(native, "_LOOKED", True)
    monkeypatch.setattr(native, "_BUILDER", None)
    monkeypatch.setattr(native.build, "Job", _FoundJob)


def test_ops_registered_before_the_shim_existed_turn_native_once_it_is_built(
        no_shim_yet: None, make_library: Callable[..., opbridge.Library], recwarn: Any) -> None:
    lib = make_library({"k.cc": KERNELS_CC})

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def twice(x: Any) -> Any:
        return 2 * x

    @lib.op("thrice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def thrice(x: Any) -> Any:
        return 3 * x

    op = lib.ops["twice"]
    ns = getattr(torch.ops, lib.namespace)
    assert op.qualname in native._PENDING and native.native_calls(op) is None  # Python kernels only
    x = torch.randn(5)
    _same(op.call(x), 2 * x)  # installs the Python fast path; its C entry must wait for the shim
    assert "_t_native" not in op.call.__globals__
    _same(ns.twice(x), 2 * x)  # the first kernel load starts building the shim beside the program
    assert native._BUILDER is not None and op.qualname in native._PENDING
    native._BUILDER.thread.join()
    _same(ns.thrice(x), 3 * x)  # the next kernel load finds it built: both ops turn native
    assert not native._PENDING and native.native_calls(op) == 0
    _same(op.call(x), 2 * x)  # the public callable now enters the shim first
    assert native.entry_calls(op) == 1 and native.native_calls(op) == 0
    _same(ns.twice(x), 2 * x)
    _same(ns.thrice(x), 3 * x)
    assert native.native_calls(op) == 1 and native.native_calls(lib.ops["thrice"]) == 1
    assert _python_frames(lambda: ns.twice(x)) == []
    _same(ns.twice(x[::2]), 2 * x[::2])  # strided: the Python kernel, as before
    assert native.native_calls(op) == 2
    with torch.inference_mode():  # skips autograd: the native device kernel, registered over the Python one
        _same(ns.twice(x), 2 * x)
    assert native.native_calls(op) == 3
    assert not [w for w in recwarn if "verrid" in str(w.message)]


def test_building_the_shim_now_turns_the_ops_registered_before_native_at_once(
        no_shim_yet: None, make_library: Callable[..., opbridge.Library]) -> None:
    """`opbridge build`, the demo and the benchmarks build the shim now (aot.natives): the ops this process
    registered on Python kernels before turn native then, not at the next kernel load (which may never come:
    a benchmark that built every native entry first then timed Python kernels)."""
    lib = make_library({"k.cc": KERNELS_CC})

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def twice(x: Any) -> Any:
        return 2 * x

    op, x = lib.ops["twice"], torch.randn(5)
    ns = getattr(torch.ops, lib.namespace)
    _same(ns.twice(x), 2 * x)  # loads the kernel; the shim would be built beside the program
    assert op.qualname in native._PENDING and native.native_calls(op) is None
    assert native.shim(build_now=True) is not None
    assert not native._PENDING and native.native_calls(op) == 0
    _same(ns.twice(x), 2 * x)
    assert native.native_calls(op) == 1


_PROBE = """
import torch, opbridge, opbridge.ops as ops
from opbridge.adapters.torch import native
x = torch.ones(4)
for _ in range(3):
    assert torch.equal(torch.ops.opbridge.add(x, x), 2 * x)
for _ in range(3):
    assert torch.equal(ops.add(x, x), 2 * x)
print(native.native_calls(ops.add.opdef), native.entry_calls(ops.add.opdef), "_t_native" in ops.add.__globals__)
"""


@pytest.mark.parametrize(("setting", "expected"), [("0", ["None", "None", "False"]), ("1", ["3", "2", "True"])])
def test_setting_turns_native_kernels_and_the_c_entry_off(setting: str, expected: list[str]) -> None:
    env = {**os.environ, "OPBRIDGE_TORCH_NATIVE": setting}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          check=True, timeout=300)
    assert done.stdout.split()[-3:] == expected  # ops.add's first call resolves through torch.ops


def test_importing_builds_nothing(tmp_path: Any) -> None:
    probe = ("import torch, opbridge\n"
             "from opbridge.adapters.torch import native\n"
             "print(native._SHIM is None, len(native._PENDING))\n")
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path), "OPBRIDGE_TORCH_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                          timeout=300)
    assert done.stdout.split() == ["True", str(len(BUILTINS))]  # found none, so registered to follow later
    assert not (tmp_path / "torch-native").exists()



def test_row_strided_slices_run_natively() -> None:
    """rotary_embedding declares query and key row_strided: torch.ops takes vLLM's column slices of one
    qkv tensor in the native kernel, in place; a key that meets query goes to Python, which names it."""
    from opbridge.ops.rotary import _cos_sin_cache

    op = ops.rotary_embedding.opdef
    pos, cache = torch.randint(0, 16, (6,)), torch.from_numpy(_cos_sin_cache(16, 8)).float()
    qkv = torch.randn(6, 40)
    want_q, want_k, v = qkv[:, :16].clone(), qkv[:, 16:24].clone(), qkv[:, 24:].clone()
    torch.ops.opbridge.rotary_embedding(pos, want_q, want_k, 8, cache, True)  # dense; loads the kernel
    before = native.native_calls(op)
    assert before is not None
    torch.ops.opbridge.rotary_embedding(pos, qkv[:, :16], qkv[:, 16:24], 8, cache, True)
    assert native.native_calls(op) == before + 1, "the slices left the native kernel"
    assert torch.equal(qkv[:, :16], want_q) and torch.equal(qkv[:, 16:24], want_k) and torch.equal(qkv[:, 24:], v)
    with pytest.raises(ValueError, match="rotary_embedding: mutated argument 'query' overlaps argument 'key'"):
        torch.ops.opbridge.rotary_embedding(pos, qkv[:, :16], qkv[:, 8:16], 8, cache, True)
    torch.ops.opbridge.rotary_embedding(pos, torch.randn(6, 32)[:, ::2], None, 8, cache, True)  # a dense copy
    assert native.native_calls(op) == before + 1


def test_shim_key_names_the_environment_it_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim's RUNPATH names torch's and tvm-ffi's library directories: two environments sharing a
    cache (the default ~/.cache/opbridge) must not load each other's shim, which would load the other
    environment's libraries too."""
    from opbridge.adapters.torch.native import build

    here = build.cache_key()
    monkeypatch.setattr(build.torch, "__file__", "/another/env/site-packages/torch/__init__.py")
    assert build.cache_key() != here


def test_first_calls_from_many_threads_load_one_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that all make an op's first call get one kernel object, and the native kernels are handed it
    once: a second one would replace the first while another thread may still be calling it."""
    import threading
    import time

    from opbridge import loader

    op = ops.gelu.opdef
    real = loader.kernel
    loads: list[str] = []
    handed: list[Any] = []

    def slow_kernel(o: opbridge.OpDef, device: str) -> Any:
        loads.append(o.name)
        time.sleep(0.05)  # wide enough for every thread to arrive while the first loads
        return real(o, device)

    monkeypatch.setattr(loader, "kernel", slow_kernel)
    monkeypatch.setattr(native, "kernel_loaded", lambda o, d, k: handed.append(k))
    monkeypatch.delitem(calls._KERNELS, (op.qualname, "cpu"), raising=False)
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(calls.kernel(op, "cpu"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == ["gelu"] and len(handed) == 1
    assert len(got) == 8 and all(k is got[0] for k in got)


def test_cuda_branch_needs_no_cuda_toolkit(tmp_path: Any) -> None:
    """The shim's CUDA branch compiles with torch's headers alone: a CUDA torch from PyPI on a machine
    without a CUDA toolkit (its usual home) gets the native kernels, CPU and CUDA. It used to include
    c10/cuda/CUDAStream.h, which needs the toolkit's cuda_runtime_api.h: there the whole shim failed
    to build and every torch.ops call stayed on the Python kernels. Checked here against this CPU
    torch's headers, which hold no CUDA runtime headers either."""
    from opbridge.adapters.torch.native import build

    cmd = build.command(tmp_path / "shim.so")
    if "-DOPB_WITH_CUDA" not in cmd:
        cmd.insert(1, "-DOPB_WITH_CUDA")
    assert not any(a.startswith("-lc10_cuda") for a in cmd)
    cmd = [a for a in cmd if not a.startswith(("-l", "-L", "-Wl,"))] + ["-fsyntax-only"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
