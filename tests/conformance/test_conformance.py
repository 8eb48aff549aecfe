"""One matrix, every framework: each built-in op's forward, gradients, graph mode,
zero-copy mutation and bad input, driven through the framework's harness.

The framework comes from ``OPBRIDGE_FRAMEWORK`` (default ``torch``); the test
runner starts one process per framework (paddle and mindspore cannot share a
process, and MindSpore needs its own NumPy-1 environment).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.testing import assert_close, make_cases
from opbridge.testing.generate import held_cases
from opbridge.testing.gradients import directional_check
from opbridge.testing.matrix import NONCONTIGUOUS

from ._framework import FRAMEWORK, GRAD_OPS, OPS, H, framework_mark

pytestmark = framework_mark

#: (op, dtype) for every dtype each op declares (issue 19: the matrix runs every declared dtype)
OP_DTYPES = [pytest.param(op, d, id=f"{op.name}-{d}") for op in OPS for d in op.dtypes]


def _args(op: opbridge.OpDef, case: dict[str, Any], dtype: str) -> list[Any]:
    return [H.from_numpy(case[a.name], dtype if case[a.name].dtype.kind == "f" else None)
            if isinstance(case[a.name], np.ndarray) else case[a.name] for a in op.schema.arguments]


def _cases(op: opbridge.OpDef, dtype: str) -> list[dict[str, Any]]:
    """*op*'s cases that this framework can hold (JAX without x64: none of int64); skips the test if none."""
    held, why = held_cases(op, make_cases(op, dtype, seed=7), H.dtypes)
    if why is not None:
        pytest.skip(f"{FRAMEWORK} has {why}")
    return [c for c in held if not c.get(NONCONTIGUOUS)]


def _held_dtype(op: opbridge.OpDef) -> str:
    """float32 where *op* declares it, else its first declared dtype this framework holds (JAX without x64:
    ``advance_step_flashattn``'s int32, not int64)."""
    if "float32" in op.dtypes:
        return "float32"
    return next((d for d in op.dtypes if d in H.dtypes), op.dtypes[0])


def _reference(op: opbridge.OpDef, args: list[Any]) -> list[np.ndarray]:
    ref_args = [H.to_numpy(a).astype(np.float64) if _is_array(a) and H.to_numpy(a).dtype.kind == "f"
                else (H.to_numpy(a).copy() if _is_array(a) else a) for a in args]
    out = op.reference(*ref_args)
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    return [ref_args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated] + outs


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (int, float))


def _observed(op: opbridge.OpDef, args: list[Any], out: Any) -> list[Any]:
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    if H.mutates_in_place:
        return [args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated] + outs
    return outs


def _ids(op: opbridge.OpDef) -> str:
    return op.name


@pytest.mark.parametrize(("op", "dtype"), OP_DTYPES)
def test_forward_matches_reference(op: opbridge.OpDef, dtype: str) -> None:
    if dtype not in H.dtypes:
        x64 = " (JAX needs JAX_ENABLE_X64=1 for 64-bit types)" if FRAMEWORK == "jax" else ""
        pytest.skip(f"{FRAMEWORK} has no {dtype}{x64}; {op.name} declares it")
    rtol, atol = op.tolerance(dtype)
    for case in _cases(op, dtype):
        args = _args(op, case, dtype)
        want = _reference(op, args)
        got = _observed(op, args, op.call(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if g is None and w is None:  # an optional mutated argument that was not given
                continue
            assert_close(H.to_numpy(g), w, rtol=rtol, atol=atol, name=f"{FRAMEWORK} {op.name} {dtype}")


def _directional_check(op: opbridge.OpDef, fn: Callable[..., Any], label: str) -> None:
    rng = np.random.default_rng(3)
    case = next(c for c in _cases(op, "float32") if all(
        v.size > 0 for v in c.values() if isinstance(v, np.ndarray)))
    args = _args(op, case, "float32")
    diff = list(op.differentiable)
    out_np = H.to_numpy(fn(*args))
    g = rng.standard_normal(out_np.shape).astype(np.float32)
    grads = H.vjp(fn, args, diff, g)
    base = [H.to_numpy(a).astype(np.float64) if _is_array(a) else a for a in args]
    directional_check(op, base, grads, diff, g, rng, rtol=1e-3, label=f"{FRAMEWORK} {label}")


@pytest.mark.parametrize("op", GRAD_OPS, ids=_ids)
def test_gradients_match_reference(op: opbridge.OpDef) -> None:
    if FRAMEWORK == "numpy":
        pytest.skip("numpy has no autograd")
    _directional_check(op, op.call, "eager")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_graph_mode_matches_eager(op: opbridge.OpDef) -> None:
    compiled = H.compile(op.call)
    if compiled is None:
        pytest.skip(f"{FRAMEWORK} has no graph mode for opbridge ops")
    dtype = _held_dtype(op)
    for case in _cases(op, dtype)[:3]:
        args = _args(op, case, dtype)
        want = [None if w is None else H.to_numpy(w) for w in _observed(op, args, op.call(*args))]
        args = _args(op, case, dtype)
        try:
            observed = _observed(op, args, compiled(*args))
        except NotImplementedError as e:  # an adapter's documented graph-mode limit, e.g. Paddle's mutating ops
            pytest.skip(f"{FRAMEWORK} graph mode: {e}")
        got = [None if g is None else H.to_numpy(g) for g in observed]
        for g, w in zip(got, want):
            if g is None and w is None:  # an optional mutated argument that was not given
                continue
            assert_close(g, w, rtol=0, atol=0, name=f"{FRAMEWORK} graph-mode {op.name}")


@pytest.mark.parametrize("op", GRAD_OPS, ids=_ids)
def test_graph_mode_gradients(op: opbridge.OpDef) -> None:
    if FRAMEWORK == "numpy":
        pytest.skip("numpy has no autograd")
    compiled = H.compile(op.call)
    if compiled is None:
        pytest.skip(f"{FRAMEWORK} has no graph mode for opbridge ops")
    _directional_check(op, compiled, "graph-mode")


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_wrong_dtype_names_op_and_argument(op: opbridge.OpDef) -> None:
    dtype = _held_dtype(op)
    case = _cases(op, dtype)[0]
    lead = op.schema.arguments[op.dtype_arg].name  # the tensor whose dtype the kernel dispatches on
    args = _args(op, case, dtype)
    undeclared = next(d for d in ("int32", "int16", "int8") if d not in op.dtypes)
    args[op.dtype_arg] = H.from_numpy(np.ones(case[lead].shape, undeclared), None)
    with pytest.raises(TypeError, match=rf"{op.name}: {lead} must have (the same )?dtype"):
        op.call(*args)


INPLACE_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void axpy__cpu(TensorView y, TensorView x, double alpha) {
  OPB_CHECK_DTYPE("axpy_", y, opbridge::kFloat32);
  OPB_CHECK_SAME_DTYPE("axpy_", x, y);
  OPB_CHECK_SAME_SHAPE("axpy_", x, y);
  OPB_CHECK_CONTIGUOUS("axpy_", y);
  OPB_CHECK_CONTIGUOUS("axpy_", x);
  float* py = static_cast<float*>(y.data_ptr());
  const float* px = static_cast<const float*>(x.data_ptr());
  for (int64_t i = 0; i < y.numel(); ++i) py[i] += float(alpha) * px[i];
}
OPBRIDGE_EXPORT(axpy__cpu);
"""


@pytest.fixture(scope="module")
def axpy_(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    root: Path = tmp_path_factory.mktemp("axpy")
    (root / "axpy.cc").write_text(INPLACE_CC)
    lib = opbridge.Library(f"conformance_{FRAMEWORK}", sources=["axpy.cc"], root=root)

    @lib.op("axpy_(Tensor(a!) y, Tensor x, float alpha) -> ()")
    def axpy_(y: Any, x: Any, alpha: float) -> None:
        y += alpha * x

    return axpy_


def test_mutation_is_zero_copy(axpy_: Callable[..., Any]) -> None:
    y = H.from_numpy(np.arange(6, dtype=np.float32), "float32")
    x = H.from_numpy(np.ones(6, np.float32), "float32")
    ptr = H.data_ptr(y)
    out = axpy_(y, x, 2.0)
    if H.mutates_in_place:
        assert out is None
        assert H.data_ptr(y) == ptr, "the mutated argument must keep its memory"
        np.testing.assert_array_equal(H.to_numpy(y), np.arange(6) + 2.0)
    else:
        (new_y,) = out if isinstance(out, tuple) else (out,)
        np.testing.assert_array_equal(H.to_numpy(new_y), np.arange(6) + 2.0)


def test_mutated_argument_may_not_alias_an_input(axpy_: Callable[..., Any]) -> None:
    if not H.mutates_in_place:
        pytest.skip(f"{FRAMEWORK} arrays are immutable: nothing can alias a mutated argument")
    y = H.from_numpy(np.ones(4, np.float32), "float32")
    with pytest.raises(ValueError, match="axpy_: mutated argument 'y' overlaps argument 'x'"):
        axpy_(y, y, 1.0)
