"""The CUDA kernels (``opbridge/csrc/*.cu``).

Without a GPU (this machine, CI): the CUDA module of the built-in library
builds with nvcc for sm_80 and sm_90 and exports exactly the declared CUDA
kernels; it loads without a driver; every kernel validates its arguments
before its first CUDA call (checked with tensors that only claim to be on
CUDA); a call without a driver raises a RuntimeError that says so; CPU use
never loads the CUDA module.

With a GPU: every op on CUDA torch tensors against the same op on CPU, for
every dtype over the declared test cases (odd sizes) plus a misaligned copy
of each; the torch dispatcher, autograd and torch.compile paths; a launch on
a non-default stream; the device-side error flag.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opbridge import loader
from opbridge.build import compile as compile_mod
from opbridge.errors import BackendUnavailableError

NVCC = compile_mod.nvcc_path()
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (no CUDA toolkit): the CUDA module cannot be built here")
ARCHS = "80;90"


def _ops() -> Any:
    from opbridge import ops

    return ops


def _cuda_ops() -> list[Any]:
    return [op for op in _ops().LIBRARY.ops.values() if "cuda" in op.kernels]


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def cuda_module() -> Iterator[Any]:
    """The built-in library's CUDA module, built for sm_80 and sm_90, and its path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPBRIDGE_CUDA_ARCHS", ARCHS)
        from opbridge._tvm import tvm_ffi

        path = _ops().LIBRARY.build("cuda")
        yield tvm_ffi().load_module(str(path)), path


# ---------------------------------------------------------------------------
# build and load (nvcc, no GPU)
# ---------------------------------------------------------------------------


@needs_nvcc
def test_cuda_module_builds_for_sm80_and_sm90_and_exports_the_declared_kernels(cuda_module: Any) -> None:
    _, path = cuda_module
    ops = _ops()
    assert ops.LIBRARY.sources_for("cuda"), "no .cu sources in opbridge/csrc"
    missing = [op.name for op in ops.LIBRARY.ops.values() if "cuda" not in op.kernels]
    assert not missing, f"ops without a CUDA kernel declared: {missing}"
    declared = sorted(op.kernels["cuda"] for op in ops.LIBRARY.ops.values())
    assert sorted(loader.exports(path)) == declared
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPBRIDGE_CUDA_ARCHS", ARCHS)
        _, cuda_flags, ld_flags = compile_mod._default_flags(loader.build_spec(ops.LIBRARY, "cuda"))
    flags = " ".join(cuda_flags)
    assert "arch=compute_80,code=sm_80" in flags and "arch=compute_90,code=sm_90" in flags
    assert "arch=compute_90,code=compute_90" in flags  # PTX for GPUs newer than the list
    assert "-lcudart_static" in ld_flags


@needs_nvcc
def test_cuda_module_loads_without_a_driver_and_needs_no_shared_cudart(cuda_module: Any) -> None:
    mod, path = cuda_module
    assert mod["add_cuda"] is not None
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found: cannot list the module's shared-library dependencies")
    out = subprocess.run([readelf, "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[-1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert not [n for n in needed if n.startswith(("libcudart", "libcuda."))], needed


def test_missing_nvcc_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(compile_mod, "nvcc_path", lambda: None)
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    with pytest.raises(BackendUnavailableError, match="nvcc was not found"):
        _ops().LIBRARY.build("cuda")


def test_cpu_use_never_loads_the_cuda_module() -> None:
    code = textwrap.dedent("""
        import numpy as np, opbridge.ops as ops
        from opbridge import loader
        x = np.ones((3, 8), np.float32)
        ops.add(x, x); ops.rms_norm(x, np.ones(8, np.float32)); ops.silu_and_mul(x)
        import torch
        t = torch.ones(3, 8)
        ops.gelu(t); torch.ops.opbridge.add(t, t)
        ops.rms_norm(t.clone().requires_grad_(), torch.ones(8)).sum().backward()
        maps = open("/proc/self/maps").read() if __import__("os").path.exists("/proc/self/maps") else ""
        print(sorted(loader._MODULES), "opbridge_cuda" in maps, torch.cuda.is_initialized())
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[('opbridge', 'cpu')] False False", res.stdout


# ---------------------------------------------------------------------------
# argument checks and the no-driver error, with tensors that claim to be on CUDA
# ---------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DTYPES = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "int64": (0, 64), "int32": (0, 32),
           "int16": (0, 16)}
_KEEP: list[Any] = []  # the memory behind the fake tensors lives as long as the test process


class _ClaimsCuda:
    """A DLPack producer whose tensor says it is on ``cuda:<device_id>``; its data is host memory.

    Only for calls that must fail before a kernel dereferences anything.
    """

    def __init__(self, shape: tuple[int, ...], dtype: str = "float32", device_id: int = 0,
                 strides: tuple[int, ...] | None = None, device_type: int = 2) -> None:
        code, bits = _DTYPES[dtype]
        n = int(np.prod(shape)) if shape else 1
        buf = np.zeros(max(n, 1) * 2 * bits // 8 + 64, np.uint8)
        if strides is None:
            st: list[int] = []
            acc = 1
            for s in reversed(shape):
                st.insert(0, acc)
                acc *= s
            strides = tuple(st)
        c_shape = (ctypes.c_int64 * len(shape))(*shape)
        c_strides = (ctypes.c_int64 * len(shape))(*strides)
        mt = _DLManagedTensor()
        mt.dl_tensor = _DLTensor(buf.ctypes.data, _DLDevice(device_type, device_id), len(shape),
                                 _DLDataType(code, bits, 1), c_shape, c_strides, 0)
        _KEEP.append((buf, c_shape, c_strides, mt))
        self._mt, self._device = mt, (device_type, device_id)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._mt), b"dltensor", None)


def _t(*shape: int, dtype: str = "float32", dev: int = 0, strides: tuple[int, ...] | None = None,
       cpu: bool = False) -> Any:
    from opbridge._tvm import tvm_ffi

    return tvm_ffi().from_dlpack(_ClaimsCuda(tuple(shape), dtype, dev, strides, device_type=1 if cpu else 2))


def _adv(**kw: Any) -> list[Any]:
    """advance_step_flashattn_cuda's arguments for 4 sequences, 3 queries; *kw* replaces some."""
    def get(name: str, *shape: int, dtype: str = "int64") -> Any:
        return kw[name] if name in kw else _t(*shape, dtype=dtype)

    return [kw.get("num_seqs", 4), kw.get("num_queries", 3), 16, get("input_tokens", 4),
            get("sampled", 3, 1), get("input_positions", 4), get("seq_lens", 4, dtype="int32"),
            get("slot_mapping", 4), get("block_tables", 4, 2, dtype="int32")]


def _rot(**kw: Any) -> list[Any]:
    """rotary_embedding_cuda's arguments: 5 tokens, 4 query and 2 key heads of 8; *kw* replaces some."""
    def get(name: str, *shape: int, dtype: str = "float32") -> Any:
        return kw[name] if name in kw else _t(*shape, dtype=dtype)

    return [get("positions", 5, dtype="int64"), get("query", 5, 32), get("key", 5, 16), 8,
            get("cache", 64, 8), True]


def _same_input_and_residual() -> list[Any]:
    both = _t(3, 8)
    return [both, both, _t(8), 1e-6]


def _bad_calls() -> list[tuple[str, Any, type[Exception], str]]:
    """(kernel, () -> args, exception, message pattern): each call is wrong in one way."""
    return [
        ("add_cuda", lambda: [_t(3, 4), _t(3, 4), _t(3, 4, dtype="float16")], TypeError,
         r"add: y must have the same dtype as x \(float32\), got float16"),
        ("add_cuda", lambda: [_t(3, 4), _t(3, 4), _t(3, 5)], ValueError,
         r"add: y must have the same shape as x"),
        ("add_cuda", lambda: [_t(3, 4), _t(3, 4), _t(3, 4, dev=1)], ValueError,
         r"add: y must be on the same device as x \(cuda:0\), got cuda:1"),
        ("add_cuda", lambda: [_t(3, 4), _t(3, 4, cpu=True), _t(3, 4)], ValueError,
         r"add: x must be on cuda, got cpu"),
        ("add_cuda", lambda: [_t(3, 4), _t(3, 4, strides=(1, 3)), _t(3, 4)], ValueError,
         r"add: x must be contiguous"),
        ("gelu_cuda", lambda: [_t(3, dtype="int64"), _t(3, dtype="int64")], TypeError,
         r"gelu: x must have dtype float32, float16, bfloat16 or float64, got int64"),
        ("gelu_backward_cuda", lambda: [_t(3), _t(4), _t(3)], ValueError,
         r"gelu_backward: grad must have the same shape"),
        ("rms_norm_cuda", lambda: [_t(2, 4), _t(2, 4), _t(5), 1e-6], ValueError,
         r"rms_norm: weight must have size 4 in dim 0"),
        ("rms_norm_backward_cuda", lambda: [_t(2, 4), _t(4), _t(2, 4), _t(2, 4), _t(4), float("nan")],
         ValueError, r"rms_norm_backward: eps must be >= 0"),
        ("silu_and_mul_cuda", lambda: [_t(2, 3), _t(2, 7)], ValueError,
         r"silu_and_mul: x's last dim must be even"),
        ("gelu_and_mul_cuda", lambda: [_t(2, 4), _t(2, 6)], ValueError,
         r"gelu_and_mul: out must have x's shape with the last dim halved"),
        ("gelu_and_mul_backward_cuda", lambda: [_t(2, 6), _t(2, 4), _t(2, 6)], ValueError,
         r"gelu_and_mul_backward: grad must have x's shape with the last dim halved"),
        ("silu_and_mul_backward_cuda", lambda: [_t(2, 6), _t(2, 3, dtype="bfloat16"), _t(2, 6)], TypeError,
         r"silu_and_mul_backward: grad must have the same dtype as x"),
        ("fused_add_rms_norm_cuda", lambda: [_t(3, 8), _t(3, 7), _t(8), 1e-6], ValueError,
         r"fused_add_rms_norm: residual must have the same shape as input"),
        ("fused_add_rms_norm_cuda", _same_input_and_residual, ValueError,
         r"fused_add_rms_norm: input must not overlap residual"),
        ("rotary_embedding_cuda", lambda: _rot(positions=_t(5, dtype="int16")), TypeError,
         r"rotary_embedding: positions must have dtype int64 or int32, got int16"),
        ("rotary_embedding_cuda", lambda: _rot(cache=_t(64, 10)), ValueError,
         r"rotary_embedding: cos_sin_cache's last dim .* must be even and in \[2, head_size = 8\]"),
        ("rotary_embedding_cuda", lambda: _rot(key=_t(5, 24)), ValueError,
         r"rotary_embedding: query's number of heads \(4\) must be a multiple of key's \(3\)"),
        ("rotary_embedding_cuda", lambda: _rot(query=_t(6, 32), key=None), ValueError,
         r"rotary_embedding: query must have shape \(\*positions.shape"),
        ("advance_step_flashattn_cuda", lambda: _adv(num_queries=5), ValueError,
         r"advance_step_flashattn: num_queries \(5\) must be <= num_seqs \(4\)"),
        ("advance_step_flashattn_cuda", lambda: _adv(input_tokens=_t(4, dtype="int16")), TypeError,
         r"advance_step_flashattn: input_tokens must have dtype int64 or int32, got int16"),
        ("advance_step_flashattn_cuda", lambda: _adv(input_tokens=_t(4, dtype="int32")), TypeError,
         r"advance_step_flashattn: sampled_token_ids must have the same dtype as input_tokens \(int32\), got int64"),
        ("advance_step_flashattn_cuda", lambda: _adv(seq_lens=_t(4, dtype="int64")), TypeError,
         r"advance_step_flashattn: seq_lens must have dtype int32, got int64"),
        ("advance_step_flashattn_cuda", lambda: _adv(block_tables=_t(8, dtype="int32")), ValueError,
         r"advance_step_flashattn: block_tables must be 2-D"),
        ("advance_step_flashattn_cuda", lambda: _adv(sampled=_t(3, 2, dtype="int64")), ValueError,
         r"advance_step_flashattn: sampled_token_ids must have size 1 in dim 1"),
    ]


@needs_nvcc
@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_cuda_kernels_check_arguments_before_any_cuda_call(cuda_module: Any, index: int) -> None:
    mod, _ = cuda_module
    kernel, make, exc, pattern = _bad_calls()[index]
    with pytest.raises(exc, match=pattern):
        mod[kernel](*make())


@needs_nvcc
def test_every_cuda_kernel_has_an_argument_check_test() -> None:
    tested = {k for k, *_ in _bad_calls()}
    assert tested == {op.kernels["cuda"] for op in _cuda_ops()}


@needs_nvcc
@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is installed (this checks the error without)")
def test_cuda_call_without_a_driver_says_so(cuda_module: Any) -> None:
    mod, _ = cuda_module
    with pytest.raises(RuntimeError, match=r"add: cudaGetDevice failed: cudaErrorInsufficientDriver: .*"
                                           r"no NVIDIA driver was found"):
        mod["add_cuda"](_t(3, 4), _t(3, 4), _t(3, 4))


@needs_nvcc
@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is installed (this checks the error without)")
@pytest.mark.parametrize("kernel", ["advance_step_flashattn_cuda", "rotary_embedding_cuda"])
def test_a_misspelt_sync_checks_setting_raises_before_the_launch(cuda_module: Any, kernel: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place kernels with device-side checks read OPBRIDGE_CUDA_SYNC_CHECKS before they touch the
    device: a misspelt value raises before anything is written (here, before the missing driver does),
    so a call retried with the setting mended does not advance or rotate twice."""
    mod, _ = cuda_module
    monkeypatch.setenv("OPBRIDGE_CUDA_SYNC_CHECKS", "maybe")
    with pytest.raises(ValueError, match=r"OPBRIDGE_CUDA_SYNC_CHECKS must be one of .* got 'maybe'"):
        mod[kernel](*(_adv() if kernel.startswith("advance") else _rot()))


@needs_nvcc
def test_launch_policy_sweeps_build_against_the_shipped_kernel_headers(tmp_path: Path) -> None:
    # The sweeps launch the product's kernel templates (cuda_norm.h, cuda_gated.h); a header change
    # that breaks them fails here, not on the next GPU machine.
    script = Path(__file__).resolve().parents[1] / "scripts" / "cuda-sweep.sh"
    # SWEEP_CHECK=1: unoptimised, PTX alone (a compile check, 2x faster than the binaries a GPU run times)
    env = {**os.environ, "SWEEP_BUILD_ONLY": str(tmp_path), "SWEEP_CHECK": "1", "OPBRIDGE_CUDA_ARCHS": "90",
           "PYTHON": sys.executable}
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("norm", "gated"):
        assert (tmp_path / f"cuda_{name}_sweep").stat().st_size > 0
    # the norm sweep's sections, asked before any CUDA call (no GPU needed)
    norm = str(tmp_path / "cuda_norm_sweep")
    usage = subprocess.run([norm, "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "[all|cached|staged]" in usage.stdout
    wrong = subprocess.run([norm, "bogus"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "usage:" in wrong.stderr
    bad = subprocess.run([str(script), "bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown sweep 'bogus' (norm, gated or all" in bad.stderr


def test_gpu_carry_prepares_the_device_run_at_this_environments_versions(tmp_path: Path) -> None:
    # scripts/gpu-carry.sh's plan (dry run: nothing downloaded or built): the wheels at the versions this
    # environment has, so the carried CUDA modules' cache keys match; both modules; the sweeps
    from importlib.metadata import version

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu-carry.sh"
    env = {**os.environ, "CARRY_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run([str(script), str(tmp_path / "carry")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"apache-tvm-ffi=={version('apache-tvm-ffi')}" in out and "--python-version 3.12" in out
    assert f"OPBRIDGE_CACHE_DIR={tmp_path / 'carry' / 'obc'} " in out
    assert "OPBRIDGE_CUDA_FLAGS=-DOPB_RMS_NORM_STAGES=3 -DOPB_RMS_NORM_BACKWARD_STAGES=2" in out
    assert f"SWEEP_BUILD_ONLY={tmp_path / 'carry' / 'sweep'} scripts/cuda-sweep.sh all" in out
    assert "outside the tree" in done.stderr and not (tmp_path / "carry").exists()
    usage = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0 and "CARRY_DRY_RUN=1" in usage.stdout


def test_gpu_benchmark_says_why_it_skipped() -> None:
    from opbridge.bench import gpu

    reason = gpu.unavailable()
    if reason is None:
        pytest.skip("a CUDA GPU is present: the benchmark would run")
    ns = argparse.Namespace(ops=None, dtypes=["float32"], rows=None, size=None, no_large=False, rounds=None,
                            device=0, no_compile=True, quick=True)
    result = gpu.run(ns)
    assert result == {"skipped": reason} and reason.startswith("no CUDA GPU: ")
    assert gpu.format_text(result) == f"opbridge bench gpu: skipped: {reason}"


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------


def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU: torch.cuda.is_available() is False (CPU-only machine or CPU build of torch)"
    if NVCC is None:
        return "nvcc not found: the CUDA kernels cannot be built"
    return None


@pytest.fixture
def gpu() -> Any:
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch

    return torch


def _torch_args(op: Any, case: dict[str, Any], dtype: str, device: str, offset: int = 0) -> list[Any]:
    """Schema-ordered torch arguments of a matrix case; *offset* > 0 makes every tensor a view that
    starts that many elements into a larger buffer (misaligned for 128-bit access)."""
    import torch

    out = []
    for a in op.schema.arguments:
        v = case.get(a.name, a.default if a.has_default else None)
        if a.type.is_tensor and v is not None:
            arr = np.asarray(v)
            # An independent copy: a mutating op called on the CPU must not advance the case's own
            # arrays (torch.from_numpy shares their memory), or the CUDA call starts from moved state.
            t = torch.from_numpy(np.array(arr, copy=True, order="C"))
            if arr.dtype.kind == "f":
                t = t.to(getattr(torch, dtype))
            if offset:
                buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
                v = buf[offset:].view(t.shape).copy_(t)
            else:
                v = t.to(device)
        out.append(v)
    return out


def _results(op: Any, args: list[Any]) -> list[Any]:
    """Call *op*; its returned tensors, then its mutated arguments."""
    ret = op.call(*args)
    rets = [] if ret is None else list(ret) if isinstance(ret, (tuple, list)) else [ret]
    mutated = [v for a, v in zip(op.schema.arguments, args, strict=True) if a.is_mutated and v is not None]
    return [*rets[:op.n_outputs], *mutated]


def _assert_same(op: Any, dtype: str, got: list[Any], want: list[Any], where: str,
                 summed: tuple[int, ...] = ()) -> None:
    """*summed[j]*: how many terms result j sums over (a weight gradient: the rows); its tolerance
    grows with that, as ``opbridge bench``'s verification does (two float32 sums of 5000 rows in
    different orders differ by ~1e-4 where the terms cancel to ~0.1)."""
    from opbridge.bench.verify import reduction_tolerance
    from opbridge.testing.compare import assert_close

    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        rtol, atol = reduction_tolerance(*op.tolerance(dtype), summed[j] if j < len(summed) else 1)
        g = g.cpu()
        if g.dtype.is_floating_point:
            # CPU and CUDA each approximate the exact value within the op's tolerance.
            assert_close(g.float(), w.float(), rtol=2 * rtol, atol=2 * atol, dtype=dtype,
                         name=f"{where} result {j}")
        else:
            assert (g == w).all(), f"{where} result {j}: {g} != {w}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int64", "int32"])
@pytest.mark.parametrize("name", ["add", "gelu", "gelu_backward", "rms_norm", "rms_norm_backward",
                                  "silu_and_mul", "silu_and_mul_backward", "gelu_and_mul",
                                  "gelu_and_mul_backward", "fused_add_rms_norm", "rotary_embedding",
                                  "advance_step_flashattn"])
def test_cuda_matches_cpu(gpu: Any, name: str, dtype: str) -> None:
    from opbridge.testing.matrix import NONCONTIGUOUS, make_cases

    op = _ops().LIBRARY.ops.get(name)
    if op is None:
        pytest.skip(f"{name} is not declared")
    if dtype not in op.dtypes:
        pytest.skip(f"{name} does not declare {dtype}")
    cases = [c for c in make_cases(op, dtype) if c.get(NONCONTIGUOUS) is None]
    assert cases
    for i, case in enumerate(cases):
        want = _results(op, _torch_args(op, case, dtype, "cpu"))
        for offset in (0, 1):
            got = _results(op, _torch_args(op, case, dtype, "cuda", offset))
            gpu.cuda.synchronize()
            _assert_same(op, dtype, got, want, f"{name} {dtype} case {i} offset {offset}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_misaligned_outs_on_cuda_match_cpu(gpu: Any, dtype: str) -> None:
    """out= buffers that start one element into a larger one (no 128-bit access) are written as the
    CPU writes new outputs, for every op that takes out=: rms_norm_backward's grad_weight, which its
    one-block grid writes directly, once went out with a 128-bit store whatever its alignment."""
    from opbridge.call.core import returns_its_outs
    from opbridge.testing.matrix import NONCONTIGUOUS, make_cases

    torch = gpu
    for op in _ops().LIBRARY.ops.values():
        if not returns_its_outs(op) or dtype not in op.dtypes:
            continue
        cases = [c for c in make_cases(op, dtype) if c.get(NONCONTIGUOUS) is None][:4]
        if op.name == "rms_norm_backward":  # one row of 4096: the one-block grid that writes grad_weight
            x = np.random.default_rng(0).standard_normal((1, 4096))
            cases.append({"grad": x, "x": x[:, ::-1].copy(), "weight": x[0] / 2, "eps": 1e-6})
        for i, case in enumerate(cases):
            want = _results(op, _torch_args(op, case, dtype, "cpu"))[:op.n_outputs]
            outs = []
            for w in want:
                buf = torch.full((w.numel() + 1,), float("nan"), dtype=w.dtype, device="cuda")
                outs.append(buf[1:].view(w.shape))
            args = _torch_args(op, case, dtype, "cuda")
            op.call(*args, out=outs[0] if len(outs) == 1 else tuple(outs))
            torch.cuda.synchronize()
            rows = int(np.prod(want[0].shape[:-1])) if want[0].dim() > 1 else 1
            _assert_same(op, dtype, outs, want, f"{op.name} {dtype} case {i} out= offset 1",
                         summed=(1, rows) if op.name == "rms_norm_backward" else ())


# (rows, H): every launch form of the row kernels. Forward: rows cached in registers with 1 to 8
# 128-bit units per thread (rms_norm, blocks of up to 512 threads, of 256 for many 16-bit rows of 4096) or
# up to 4 units and blocks of up to 1024 threads (fused_add_rms_norm at 9000 and 8192), and the two-pass
# form for longer rows (rms_norm float32 at 9000; both at 20000). Backward: the cached persistent kernel
# with several rows per block (5000 x 256) and 2 or 4 units per thread (4096, 8192), and the global-partial form
# (9000, 20000). With the staged policies on (OPBRIDGE_CUDA_FLAGS="-DOPB_RMS_NORM_STAGES=3
# -DOPB_RMS_NORM_BACKWARD_STAGES=2", cuda_norm_staged.h; from 1024 rows), 5000 x 256 and 2048 x 4096
# take the staged kernels, forward and backward, several rows per block. Gated activations: units of
# half the 128-bit width where the grid is small (6 x 20000, 40 x 8192, 64 x 4096 on an H100 or H200:
# cuda_gated.h's gated_width; float32's forward never narrows), 128-bit ones where it is not
# (2048 x 4096, 5000 x 256, 300 x 9000). Float32 rows of 2052-4096 columns: rms_norm's below 512 rows take
# two units of 512 threads under an occupancy (RmsNormFewRows: 64 x 4096); fused_add_rms_norm's below 2048
# rows run a persistent grid that prefetches each block's next row (FusedAddRmsNormFewRows): one row per
# block at 64 x 4096, several (more rows than the grid's 4 blocks of 384 per SM on any GPU under 250 SMs)
# at 1000 x 3000, whose 750 units per row leave some of the 384 threads one unit of their two, as do
# rms_norm's at 100 x 3000.
ROW_SHAPES = [(300, 9000), (5000, 256), (64, 4096), (40, 8192), (6, 20000), (2048, 4096), (1000, 3000),
              (100, 3000)]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_large_rows_match_cpu(gpu: Any, shape: tuple[int, int]) -> None:
    """Long rows and many rows through every launch form of the norms and the gated activations."""
    torch = gpu
    ops = _ops()
    rows, h = shape
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, h, dtype=dtype)
        w = torch.randn(h, dtype=dtype)
        g = torch.randn_like(x)
        r = torch.randn_like(x)
        name = str(dtype).rpartition(".")[2]
        xc, wc, gc, rc = x.cuda(), w.cuda(), g.cuda(), r.cuda()
        _assert_same(ops.rms_norm.opdef, name, [ops.rms_norm(xc, wc)], [ops.rms_norm(x, w)], "rms_norm")
        _assert_same(ops.rms_norm_backward.opdef, name, list(ops.rms_norm_backward(gc, xc, wc)),
                     list(ops.rms_norm_backward(g, x, w)), "rms_norm_backward", summed=(1, rows))
        xm, rm, xcm, rcm = x.clone(), r.clone(), xc.clone(), rc.clone()
        ops.fused_add_rms_norm(xm, rm, w)
        ops.fused_add_rms_norm(xcm, rcm, wc)
        _assert_same(ops.fused_add_rms_norm.opdef, name, [xcm, rcm], [xm, rm], "fused_add_rms_norm")
        _assert_same(ops.silu_and_mul.opdef, name, [ops.silu_and_mul(xc)], [ops.silu_and_mul(x)], "silu")
        half, half_c = g[:, : h // 2].contiguous(), gc[:, : h // 2].contiguous()
        _assert_same(ops.gelu_and_mul_backward.opdef, name, [ops.gelu_and_mul_backward(half_c, xc)],
                     [ops.gelu_and_mul_backward(half, x)], "gelu_and_mul_backward")
        _assert_same(ops.gelu.opdef, name, [ops.gelu(xc)], [ops.gelu(x)], "gelu")


@pytest.mark.parametrize("head_size", [128, 34])  # 34: rows of 9 x 34 elements, 128-bit access nowhere
def test_qkv_slices_on_cuda_match_cpu(gpu: Any, head_size: int) -> None:
    """vLLM's query and key column slices of one qkv tensor (and per-head views of them) reach the CUDA
    kernels as rows at a stride (rotary_embedding, rms_norm declare them row_strided): the CPU kernels'
    results on the same slices, the value columns untouched."""
    torch = gpu
    ops = _ops()
    from opbridge.ops.rotary import _cos_sin_cache

    tokens, heads, kv_heads, d = 37, 7, 1, head_size
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).rpartition(".")[2]
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
        pos = torch.randint(0, 100, (tokens,))
        cache = torch.from_numpy(_cos_sin_cache(100, d)).to(dtype)
        w = torch.randn(d).to(dtype)
        qkv_c = qkv.cuda()
        for t, p, c in ((qkv, pos, cache), (qkv_c, pos.cuda(), cache.cuda())):
            ops.rotary_embedding(p, t[:, :heads * d], t[:, heads * d:(heads + kv_heads) * d], d, c, True)
        _assert_same(ops.rotary_embedding.opdef, name, [qkv_c], [qkv], "rotary_embedding on qkv slices")
        q_heads = qkv[:, :heads * d].view(tokens, heads, d)
        q_heads_c = qkv_c[:, :heads * d].view(tokens, heads, d)
        _assert_same(ops.rms_norm.opdef, name, [ops.rms_norm(q_heads_c, w.cuda())], [ops.rms_norm(q_heads, w)],
                     "rms_norm on per-head views")


def test_torch_dispatcher_autograd_and_compile_on_cuda(gpu: Any) -> None:
    torch = gpu
    ops = _ops()
    x = torch.randn(7, 769)
    w = torch.randn(769)
    got = torch.ops.opbridge.rms_norm(x.cuda(), w.cuda(), 1e-6)
    _assert_same(ops.rms_norm.opdef, "float32", [got], [ops.rms_norm(x, w)], "torch.ops")

    # autograd: the backward runs rms_norm_backward's CUDA kernel
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    ops.rms_norm(xc, wc).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.rms_norm(xr, wr).square().sum().backward()
    _assert_same(ops.rms_norm_backward.opdef, "float32", [xc.grad, wc.grad], [xr.grad, wr.grad], "grad")

    compiled = torch.compile(lambda a, b: ops.gelu(ops.add(a, b)), fullgraph=True, backend="aot_eager")
    a, b = torch.randn(5, 123), torch.randn(5, 123)
    want = ops.gelu(ops.add(a, b))
    _assert_same(ops.gelu.opdef, "float32", [compiled(a.cuda(), b.cuda())], [want], "compile")

    out = torch.empty(5, 123, device="cuda")
    assert ops.add(a.cuda(), b.cuda(), out=out) is out
    _assert_same(ops.add.opdef, "float32", [out], [a + b], "out=")


def test_kernels_run_on_the_current_torch_stream(gpu: Any) -> None:
    """A kernel on the wrong stream would read x before the fill queued behind the sleep on s."""
    torch = gpu
    ops = _ops()
    x = torch.zeros(1 << 22, device="cuda")
    w = torch.ones(1 << 11, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on s only
        x.fill_(1.0)
        y = ops.gelu(x)
        z = ops.add(x, x)
        r = ops.rms_norm(x.view(-1, 1 << 11), w)
    s.synchronize()
    assert torch.allclose(y, torch.full_like(x, float(ops.gelu(torch.ones(1))[0])))
    assert torch.equal(z, torch.full_like(x, 2.0))
    assert torch.allclose(r, torch.ones_like(r), atol=1e-5)


def test_another_device_than_the_current_one(gpu: Any) -> None:
    torch = gpu
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    ops = _ops()
    x = torch.randn(33, 65)
    with torch.cuda.device(0):
        got = ops.gelu(x.to("cuda:1"))
    assert got.device == torch.device("cuda:1")
    _assert_same(ops.gelu.opdef, "float32", [got], [ops.gelu(x)], "cuda:1")


def _rotary_args(torch: Any, positions: list[int]) -> list[Any]:
    n = len(positions)
    return [torch.tensor(positions, device="cuda"), torch.randn(n, 16, device="cuda"), None, 8,
            torch.randn(10, 8, device="cuda"), True]


def test_device_side_errors_are_reported(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = gpu
    ops = _ops()
    # Asynchronous (default): the token with a bad position is left alone, the next call raises.
    args = _rotary_args(torch, [0, 3, 10, 2])
    before = args[1].clone()
    ops.rotary_embedding(*args)
    torch.cuda.synchronize()
    assert torch.equal(args[1][2], before[2]) and not torch.equal(args[1][1], before[1])
    with pytest.raises(ValueError, match=r"rotary_embedding: positions must be in \[0, max_position\) with "
                                         r"max_position = 10 .*got 10 at flat index 2.*earlier call"):
        ops.rotary_embedding(*_rotary_args(torch, [1]))
    ops.rotary_embedding(*_rotary_args(torch, [1]))  # reported once

    # OPBRIDGE_CUDA_SYNC_CHECKS=1: the offending call raises.
    monkeypatch.setenv("OPBRIDGE_CUDA_SYNC_CHECKS", "1")
    seq_lens = torch.tensor([5, 40, 0], dtype=torch.int32, device="cuda")
    slots = torch.full((3,), 7, device="cuda")
    with pytest.raises(ValueError, match=r"advance_step_flashattn: block index beyond the table's width: "
                                         r"sequence 1 at position 40 needs block_tables\[1\]\[2\]"):
        ops.advance_step_flashattn(3, 3, 16, torch.zeros(3, dtype=torch.int64, device="cuda"),
                                   torch.ones(3, 1, dtype=torch.int64, device="cuda"),
                                   torch.zeros(3, dtype=torch.int64, device="cuda"), seq_lens, slots,
                                   torch.zeros(3, 2, dtype=torch.int32, device="cuda"))
    assert slots.tolist() == [5, -1, 0] and seq_lens.tolist() == [6, 40, 1]

    # Asynchronous, int32 slots: the next call, with another block size and int64 slots, describes the
    # offending call (its block size 16, its int32 bound), not itself.
    monkeypatch.setenv("OPBRIDGE_CUDA_SYNC_CHECKS", "0")

    def step(bs: int, table: Any, ids: Any) -> None:
        ops.advance_step_flashattn(1, 1, bs, torch.zeros(1, dtype=ids, device="cuda"),
                                   torch.ones(1, 1, dtype=ids, device="cuda"), torch.zeros(1, dtype=ids, device="cuda"),
                                   torch.zeros(1, dtype=torch.int32, device="cuda"),
                                   torch.zeros(1, dtype=ids, device="cuda"), table)
    step(16, torch.full((1, 1), 2**30, dtype=torch.int32, device="cuda"), torch.int32)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[0\] = 1073741824 is not a valid block id \(must be in "
                                         r"\[0, 134217726\] .* fit in int32\).*earlier call"):
        step(64, torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.int64)
