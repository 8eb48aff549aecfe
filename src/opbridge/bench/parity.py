"""The parity table of ``opbridge bench frameworks --parity``: one kernel, the same speed everywhere.

Each framework's worker (:mod:`opbridge.bench.fw_worker`, one process per
framework) times, for every op of :data:`OPS` at :data:`SHAPES` in float32
and bfloat16, three candidates interleaved (:func:`opbridge.bench.parity_timing.calibrated_each`):

=========  ======================================================================
numpy      ``opbridge.ops.<op>`` on NumPy arrays, a new output per call: the
           reference path (bfloat16: ``ml_dtypes.bfloat16`` arrays; where
           ml_dtypes is missing, the torch-CPU path if torch is installed,
           else none, and the row says which)
framework  ``opbridge.ops.<op>`` on the framework's arrays: torch eager, JAX
           inside ``jax.jit`` (``block_until_ready``) and, as rows of their own
           (``jax eager``), eagerly, Paddle eager, MindSpore PyNative followed
           by ``_pynative_executor.sync()``
           (:func:`opbridge.bench.natives.mindspore_sync`)
native     the framework's own formula (:mod:`opbridge.bench.natives`; under
           JAX, XLA's fusion of it inside ``jax.jit``)
=========  ======================================================================

and reports ``framework / numpy`` and ``framework / native`` (ratios of
medians). A fourth candidate, the NumPy path on NumPy views of the
framework's own input buffers (float32 and where NumPy can view them), tells
the adapter's cost apart from the inputs' memory (``fw/npv``): XLA's and
MindSpore's buffers lie in 4 KiB pages, NumPy's large ones in 2 MiB pages
(``/proc/self/smaps``: 14 of 16 MiB against none), which costs the same
kernel a few per cent (``add`` at (1024, 4096), one kernel thread, its CPU
time: 1-7%); and each candidate's minor page faults per call
(``resource.getrusage``, counted after timing over a few untimed calls).
Jitted JAX rows time two more: the NumPy path into a fresh ``np.empty``
output (``numpy_fresh``: XLA allocates a jitted program's outputs afresh,
where the NumPy path recycles) and the jitted op with ``out=`` a donated
array (``framework_out``: no fresh output; its result is checked too). The
framework path's result must match the NumPy path's within the op's declared
tolerance for the dtype, else the row is an error and is not timed; the
native formula's largest difference from it is reported, not required.

Each row also records the kernels' OpenMP thread count (as they see it:
:func:`opbridge.bench.parity_timing.kernel_threads`) and ``OMP_NUM_THREADS`` (Paddle sets it to 1 in its
process after OpenMP has read it, so it is not what the kernels use), the
usable CPUs and the 1-minute load average before and after it
(:func:`opbridge.bench.parity_timing.load_context`). Where the load exceeded the CPUs the table says so.
There, OpenMP's default wait (active: a thread that reaches the join spins)
decides the medians on every path alike: with one of the 2 cores taken by
another process, the kernel's two threads share the other, the spinning one
can hold it for whole scheduler slices (the likely mechanism: the wait is
quantised), and a 0.8 ms ``add`` at (1024, 4096)
takes 8.00 ms per call, NumPy path included (p10 to p90 7.98-8.01 ms).
``OMP_WAIT_POLICY=passive`` (read when OpenMP loads) gave 0.85 ms,
``OPBRIDGE_THREADING=pool`` 0.78 ms, ``OMP_NUM_THREADS=1`` 0.78 ms.

:data:`TARGET_NUMPY` and, under JAX, ``framework <= native`` are the targets
of issue 21; :func:`opbridge.bench.parity_report.misses` lists the rows that miss them.
This module measures the rows; :mod:`opbridge.bench.parity_report` (``parity_report.py``) reports them
(the table, the CSV rows, the misses).
"""

from __future__ import annotations

import functools
import resource
import sys
from collections.abc import Callable, Sequence
from typing import Any

from opbridge.bench.natives import mindspore_sync, natives
from opbridge.bench.parity_timing import calibrated_each, load_context, row_load
from opbridge.bench.timing import ratio

OPS = ("add", "gelu", "rms_norm")
SHAPES: tuple[tuple[int, int], ...] = ((1024, 4096), (4096, 4096))
DTYPES = ("float32", "bfloat16")
#: Issue 21's target: the framework path at most this many times the NumPy path.
TARGET_NUMPY = 1.15
_EPS = 1e-6
#: Untimed calls whose page faults are counted, per candidate.
FAULT_CALLS = 3

FRAMEWORK_PATH = {
    "numpy": None,
    "torch": "opbridge.ops.{op}(*torch tensors)",
    "jax": "jax.jit(lambda *a: opbridge.ops.{op}(*a))(...).block_until_ready()",
    "jax eager": "opbridge.ops.{op}(*jax arrays).block_until_ready(), not under jax.jit",
    "paddle": "opbridge.ops.{op}(*paddle tensors), eager",
    "mindspore": "opbridge.ops.{op}(*mindspore tensors), PyNative; _pynative_executor.sync()",
}


def _progress(framework: str, msg: str) -> None:
    print(f"bench frameworks [{framework}]: {msg}", file=sys.stderr, flush=True)


def faults_per_call(fn: Callable[[], Any], calls: int = FAULT_CALLS) -> float:
    """Minor page faults per call of *fn* (after one untimed call), from ``resource.getrusage``."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


# -- arrays of each framework ---------------------------------------------------


def _bf16_numpy() -> Any | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


class Arrays:
    """Converts float32 NumPy inputs into one framework's arrays of a dtype, and results back."""

    def __init__(self, framework: str) -> None:
        self.framework = framework.split()[0]  # "jax eager": JAX's arrays

    def to(self, a: Any, dtype: str) -> Any:
        """The float32 array *a* as *dtype* in this framework (rounded to nearest even for bfloat16)."""
        import numpy as np

        fw = self.framework
        if fw == "numpy":
            return a if dtype == "float32" else a.astype(_bf16_numpy())
        if fw == "torch":
            import torch

            return torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))
        if fw == "jax":
            import jax
            import jax.numpy as jnp

            return jax.device_put(jnp.asarray(a).astype(dtype), jax.devices("cpu")[0])
        if fw == "paddle":
            import paddle

            return paddle.to_tensor(a, place=paddle.CPUPlace()).astype(dtype)  # type: ignore[arg-type]  # a name
        import mindspore as ms

        return ms.Tensor(a).astype(getattr(ms, dtype))

    def view(self, t: Any) -> Any | None:
        """A NumPy array on *t*'s own memory (no copy), or None where NumPy cannot view it."""
        import numpy as np

        fw = self.framework
        if fw == "torch":
            import torch

            if t.dtype == torch.bfloat16:
                bf16 = _bf16_numpy()
                return None if bf16 is None else t.view(torch.int16).numpy().view(bf16)
            return t.numpy()
        if fw == "jax":
            return np.asarray(t)  # read-only, on XLA's buffer
        if fw == "paddle":
            return None if "bfloat16" in str(t.dtype) else np.from_dlpack(t)
        if fw == "mindspore":
            import mindspore as ms

            return None if t.dtype == ms.bfloat16 else t.asnumpy()  # shares the tensor's storage
        return None

    @staticmethod
    def numpy(x: Any) -> Any:
        """A result of any framework as a float32 NumPy array."""
        import numpy as np

        if hasattr(x, "asnumpy"):  # MindSpore
            import mindspore as ms

            return x.astype(ms.float32).asnumpy()
        if type(x).__module__.startswith("torch"):
            import torch

            return x.to(torch.float32).numpy()
        if type(x).__module__.startswith("paddle"):
            return x.astype("float32").numpy()
        return np.asarray(x).astype(np.float32)


def _sync(framework: str) -> Callable[[], Any] | None:
    return mindspore_sync() if framework == "mindspore" else None


def _synced(fn: Callable[[], Any], sync: Callable[[], Any]) -> Any:
    out = fn()
    sync()
    return out


def _block(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args).block_until_ready()


def framework_call(framework: str, op: str, args: Sequence[Any]) -> Callable[[], Any]:
    """``opbridge.ops.<op>`` on *args* (this framework's arrays) as a zero-argument callable."""
    from opbridge import ops

    fn = getattr(ops, op)
    if framework == "jax":
        import jax

        tensors = [a for a in args if not isinstance(a, float)]
        scalars = [a for a in args if isinstance(a, float)]
        jitted = jax.jit(lambda *t: fn(*t, *scalars))
        return functools.partial(_block, jitted, *tensors)
    if framework == "jax eager":
        return functools.partial(_block, fn, *args)
    call = functools.partial(fn, *args)
    sync = _sync(framework)
    return call if sync is None else functools.partial(_synced, call, sync)


class _DonatedOut:
    """A jitted ``opbridge.ops.<op>(..., out=o)`` that donates ``o`` and feeds each result back as the next ``o``."""

    def __init__(self, op: str, args: Sequence[Any]) -> None:
        import jax
        import jax.numpy as jnp

        from opbridge import ops

        fn = getattr(ops, op)
        self.tensors = [a for a in args if not isinstance(a, float)]
        scalars = [a for a in args if isinstance(a, float)]
        n = len(self.tensors)
        self.jitted = jax.jit(lambda *t: fn(*t[:n], *scalars, out=t[n]), donate_argnums=n)
        self.out = jnp.zeros_like(self.tensors[0])

    def __call__(self) -> Any:
        self.out = self.jitted(*self.tensors, self.out).block_until_ready()
        return self.out


def _fresh_call(op: str, args: Sequence[Any]) -> Any:
    """``opbridge.ops.<op>`` on NumPy *args* into a new ``np.empty`` output with huge-page advice.

    How the NumPy path allocated before opbridge's pool, and how XLA allocates
    a jitted program's outputs: fresh memory the kernel's first write faults in.
    """
    from opbridge import ops
    from opbridge.bench.outputs import advised_empty_like

    return getattr(ops, op)(*args, out=advised_empty_like(args[0]))


def _inputs(op: str, shape: tuple[int, int]) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    if op == "add":
        return [x, rng.standard_normal(shape).astype(np.float32)]
    if op == "rms_norm":
        return [x, rng.standard_normal(shape[-1:]).astype(np.float32), _EPS]
    return [x]


# -- one row ------------------------------------------------------------------------


def _baseline(framework: str, dtype: str) -> tuple[str | None, str | None]:
    """(framework whose arrays make the reference path, its label) for *dtype*; (None, why) where none."""
    if dtype == "float32" or _bf16_numpy() is not None:
        return "numpy", "numpy" if dtype == "float32" else "numpy (ml_dtypes bfloat16)"
    if framework != "mindspore":
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            return "torch", "torch CPU path (NumPy has no bfloat16 without ml_dtypes)"
    if framework == "mindspore":  # its rows never use torch as the reference path
        return None, "none: NumPy has no bfloat16 without ml_dtypes (pip install ml_dtypes)"
    return None, "none: NumPy has no bfloat16 without ml_dtypes, and no torch in this environment"


def _check(op: str, dtype: str, got: Any, want: Any) -> str:
    import numpy as np

    from opbridge import ops

    if got.shape != want.shape:
        raise AssertionError(f"shape {got.shape} against {want.shape}")
    rtol, atol = getattr(ops, op).opdef.tolerance(dtype)
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        raise AssertionError(f"differs beyond rtol={rtol}, atol={atol}: max |diff| "
                             f"{float(np.max(np.abs(got - want)))}")
    return f"framework path = NumPy path within rtol={rtol}, atol={atol}"


def measure_row(framework: str, op: str, shape: tuple[int, int], dtype: str, *, rounds: int,
                number: int, target_s: float, budget_s: float) -> dict[str, Any]:
    """Verify and time one parity row in this process (see the module docstring)."""
    import numpy as np

    row: dict[str, Any] = {"framework": framework, "op": op, "shape": list(shape), "dtype": dtype,
                           **load_context()}
    raw = _inputs(op, shape)
    base_fw, row["baseline"] = _baseline(framework, dtype)
    fw_arrays = Arrays(framework)
    fw_args = [a if isinstance(a, float) else fw_arrays.to(a, dtype) for a in raw]
    fns: dict[str, Callable[[], Any]] = {}
    desc: dict[str, str] = {}
    if base_fw is not None:
        base = Arrays(base_fw)
        b_args = [a if isinstance(a, float) else base.to(a, dtype) for a in raw]
        fns["numpy"] = framework_call(base_fw, op, b_args)
        desc["numpy"] = f"opbridge.ops.{op}(*{base_fw} arrays)"
    path = FRAMEWORK_PATH[framework]
    if path is not None:
        fns["framework"] = framework_call(framework, op, fw_args)
        desc["framework"] = path.format(op=op)
        views = [a if isinstance(a, float) else fw_arrays.view(a) for a in fw_args]
        if base_fw == "numpy" and all(v is not None for v in views):
            fns["numpy_fw_memory"] = framework_call("numpy", op, views)
            desc["numpy_fw_memory"] = (f"opbridge.ops.{op}(*NumPy views of the {framework} inputs' own memory): "
                                       f"the NumPy path without the difference in input memory")
        if framework == "jax" and base_fw == "numpy":  # XLA allocates: the NumPy path on fresh memory too
            fns["numpy_fresh"] = functools.partial(_fresh_call, op, b_args)
            desc["numpy_fresh"] = (f"opbridge.ops.{op}(*NumPy arrays, out=np.empty + huge-page advice): the "
                                   f"NumPy path with a fresh output, as XLA gives a jitted program")
            fns["framework_out"] = _DonatedOut(op, fw_args)
            desc["framework_out"] = (f"jax.jit(lambda *a, o: opbridge.ops.{op}(*a, out=o), donate_argnums=o): the "
                                     f"jitted path writing into a donated buffer, no fresh output")
    row["candidates"] = desc
    try:
        ref = Arrays.numpy(fns["numpy"]()) if "numpy" in fns else None
        mine = Arrays.numpy(fns["framework"]()) if "framework" in fns else ref
        row["verified"] = "no NumPy path to check against" if ref is None or mine is ref else (
            _check(op, dtype, mine, ref))
        if "framework_out" in fns and ref is not None:  # the donated-out= path computes the same result
            _check(op, dtype, Arrays.numpy(fns["framework_out"]()), ref)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    try:  # the framework's own formula may not exist for this dtype (Paddle's CPU kernels and bfloat16)
        native = natives(fw_arrays.framework)[op](fw_args)
        theirs = Arrays.numpy(native())
        if mine is not None:
            row["native_max_abs_diff"] = float(np.max(np.abs(theirs - mine)))
        fns["native"] = native
        desc["native"] = f"{framework}'s own {op} (opbridge.bench.natives)"
    except Exception as e:
        row["native_unavailable"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    stats, n_rounds, n = calibrated_each(fns, target_s=target_s, rounds=rounds, min_rounds=min(rounds, 5),
                                         budget_s=budget_s, max_calls=number)
    row.update({"stats_us": stats, "rounds": n_rounds, "number": n})
    mine_key = "framework" if "framework" in fns else "numpy"
    if "native" in fns and mine_key in fns:
        row[f"{mine_key}_over_native"] = ratio(stats, mine_key, "native")
    if "numpy_fw_memory" in fns:
        row["framework_over_numpy_fw_memory"] = ratio(stats, "framework", "numpy_fw_memory")
    if "numpy_fresh" in fns:
        row["framework_over_numpy_fresh"] = ratio(stats, "framework", "numpy_fresh")
    if "framework_out" in fns:
        row["framework_out_over_numpy"] = ratio(stats, "framework_out", "numpy")
    if "framework" in fns and "numpy" in fns:
        row["framework_over_numpy"] = ratio(stats, "framework", "numpy")
        # the fastest fifth of the samples: less disturbed by other load (a stalled helper thread)
        row["framework_over_numpy_p20"] = ratio(stats, "framework", "numpy", "p20")
    row["faults_per_call"] = {k: round(faults_per_call(f), 1) for k, f in fns.items()}
    row["loadavg_after"] = row_load()
    return row


def measure(framework: str, *, rounds: int, number: int, target_s: float, budget_s: float,
            ops: Sequence[str] = OPS, shapes: Sequence[tuple[int, int]] = SHAPES,
            dtypes: Sequence[str] = DTYPES) -> list[dict[str, Any]]:
    """Every parity row of *framework*, in this process (JAX: under ``jax.jit``, then eager)."""
    rows = []
    for label in (framework, "jax eager") if framework == "jax" else (framework,):
        for shape in shapes:
            for dtype in dtypes:
                for op in ops:
                    _progress(framework, f"parity {label} {op} {shape[0]}x{shape[1]} {dtype}")
                    rows.append(measure_row(label, op, shape, dtype, rounds=rounds, number=number,
                                            target_s=target_s, budget_s=budget_s))
    return rows
