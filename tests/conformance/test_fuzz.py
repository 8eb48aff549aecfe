"""Differential fuzzing of every built-in op through the framework's call paths (hypothesis).

The matrix (``test_conformance.py``) runs each op's declared cases in a few
fixed layouts. Here hypothesis draws the case, its values (the seed), the
dtype and, where the framework has strided views (NumPy, torch), a memory
layout per tensor: contiguous, at an odd element offset (no vector
alignment), every other element, padded rows, column-major, reversed rows
(NumPy), a broadcast row (stride 0) and read-only (NumPy) for inputs, and
``out=`` buffers in those layouts too. Each call is checked against the
float64 reference with the op's tolerances; inputs the op does not declare
mutated must be unchanged; and the memory around every view (the rest of its
buffer, filled with a sentinel) must be untouched.

torch runs both of its paths: ``ops.<name>`` (the dispatcher-free fast path)
and ``torch.ops.<namespace>.<name>`` (the dispatcher). The examples are
derandomized, so CI sees the same ones every run; ``OPBRIDGE_FUZZ_EXAMPLES=N``
runs N random examples per test instead (for a longer fuzzing session).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opbridge
from opbridge import ops
from opbridge.testing import assert_close, make_cases
from opbridge.testing.generate import META_KEYS
from opbridge.testing.harness import get

FRAMEWORK = os.environ.get("OPBRIDGE_FRAMEWORK", "torch")
H = get(FRAMEWORK)
#: torch only: ``OPBRIDGE_FUZZ_DEVICE=cuda`` runs every test on CUDA tensors (scripts/gpu-check.sh does).
DEVICE = os.environ.get("OPBRIDGE_FUZZ_DEVICE", "cpu")
_REASON = H.skip_reason()
if _REASON is None and DEVICE != "cpu":
    import torch

    if FRAMEWORK != "torch":
        _REASON = f"OPBRIDGE_FUZZ_DEVICE={DEVICE} is for torch"
    elif DEVICE == "cuda" and not torch.cuda.is_available():
        _REASON = "OPBRIDGE_FUZZ_DEVICE=cuda, and torch sees no CUDA GPU"
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"{FRAMEWORK}: {_REASON}")

OPS = list(ops.LIBRARY.ops.values())
_EXAMPLES = int(os.environ.get("OPBRIDGE_FUZZ_EXAMPLES", "0") or 0)
FUZZ = settings(max_examples=_EXAMPLES or 12, derandomize=not _EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

#: Layouts of an argument the op reads; the ones it writes (mutated arguments, ``out=``) take
#: every layout but the read-only and broadcast ones.
READ_LAYOUTS = ("contiguous", "offset", "every_other", "padded_rows", "column_major", "reversed",
                "broadcast", "readonly")
WRITE_LAYOUTS = ("contiguous", "offset", "every_other", "padded_rows", "column_major", "reversed")
#: The layouts each framework's views can take: any strides (NumPy; torch has no negative ones),
#: slices of a wider last dimension (Paddle, MindSpore), none (JAX arrays have no layout).
LAYOUTS = {"numpy": READ_LAYOUTS, "torch": tuple(x for x in READ_LAYOUTS if x != "reversed"),
           "paddle": ("contiguous", "every_other", "padded_rows"),
           "mindspore": ("contiguous", "every_other", "padded_rows")}.get(FRAMEWORK, ("contiguous",))
STRIDED = FRAMEWORK in ("numpy", "torch")
_NAN_FILL = -777.0  # the fill around views of float buffers (NaN would hide a kernel's NaN)


def _fw(a: np.ndarray, dtype: str | None) -> Any:
    """*a* as a contiguous array of the framework (on ``DEVICE``)."""
    x = H.from_numpy(a, dtype)
    return x.to(DEVICE) if FRAMEWORK == "torch" else x


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _dtypes(op: opbridge.OpDef) -> list[str]:
    have = set(H.dtypes)
    if FRAMEWORK == "numpy":
        try:
            import ml_dtypes  # noqa: F401  (NumPy's bfloat16, as JAX spells it)

            have.add("bfloat16")
        except ImportError:
            pass
    return [d for d in op.dtypes if d in have]


def _require(op: opbridge.OpDef) -> None:
    """Skip where the framework cannot hold this op's arguments."""
    dtypes = _dtypes(op)
    if not dtypes:
        pytest.skip(f"{FRAMEWORK} has none of {op.name}'s dtypes {op.dtypes}")
    ints = {str(v.dtype) for c in make_cases(op, dtypes[0]) for v in c.values()
            if isinstance(v, np.ndarray) and v.dtype.kind in "iu"}
    if not ints <= set(H.dtypes):  # int64 in JAX without jax_enable_x64
        pytest.skip(f"{FRAMEWORK} has no {sorted(ints - set(H.dtypes))}, which {op.name}'s cases take")


@dataclass
class Placed:
    """One tensor argument (or ``out=``) as placed in memory: the view the op gets, inside its buffer."""

    name: str
    layout: str
    view: Any
    buffer: Any  # the whole buffer the view lives in (None: the view is the whole array)
    footprint: np.ndarray | None  # which buffer elements the view covers
    before: np.ndarray | None  # the buffer's contents before the call (float64 or integer copy)


def _layout_spec(shape: tuple[int, ...], layout: str) -> tuple[int, tuple[int, ...], int]:
    """(element offset, element strides, buffer length) of a view of *shape* in *layout*."""
    n = int(np.prod(shape)) if shape else 1
    nd = len(shape)
    c = [1] * nd
    for i in range(nd - 2, -1, -1):
        c[i] = c[i + 1] * max(shape[i + 1], 1)
    if layout in ("contiguous", "readonly"):
        return 0, tuple(c), n
    if layout == "offset":
        return 1, tuple(c), n + 2
    if layout == "every_other":
        return 0, tuple(2 * s for s in c), 2 * n + 1
    if layout == "padded_rows":  # a slice of a wider row-major buffer: contiguous rows, row stride > width
        wide = (*shape[:-1], shape[-1] + 3)
        w = [1] * nd
        for i in range(nd - 2, -1, -1):
            w[i] = w[i + 1] * wide[i + 1]
        return 0, tuple(w), int(np.prod(wide))
    if layout == "column_major":
        f = [1] * nd
        for i in range(1, nd):
            f[i] = f[i - 1] * max(shape[i - 1], 1)
        return 0, tuple(f), n
    if layout == "reversed":  # rows in reverse order: a negative stride on the first axis
        s = list(c)
        s[0] = -c[0]
        return (shape[0] - 1) * c[0], tuple(s), n
    if layout == "broadcast":  # every row is the first one (stride 0 on the first axis)
        s = list(c)
        s[0] = 0
        return 0, tuple(s), max(c[0], 1)
    raise AssertionError(layout)


def _usable(layout: str, shape: tuple[int, ...]) -> bool:
    if layout not in LAYOUTS:
        return False
    if layout in ("contiguous", "offset"):
        return True
    if not shape or 0 in shape:
        return layout == "readonly"
    if layout in ("padded_rows", "every_other", "readonly"):
        return True
    if layout == "column_major":
        return len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1
    return layout in ("reversed", "broadcast") and shape[0] > 1


def _place(name: str, values: np.ndarray, dtype: Any, layout: str) -> Placed:
    """*values* (cast to *dtype*) as a view in *layout*, inside a buffer filled with a sentinel."""
    shape = tuple(values.shape)
    if layout == "broadcast":
        values = np.broadcast_to(values[:1], shape)
    if layout == "contiguous":
        arr = _fw(np.array(values, copy=True), None if dtype is None else str(dtype))
        return Placed(name, "contiguous", arr, None, None, None)
    if not STRIDED:
        return _sliced(name, values, dtype, layout)
    offset, strides, length = _layout_spec(shape, layout)
    np_dt = _np_dtype(str(dtype)) if dtype is not None else values.dtype
    fill = _NAN_FILL if np_dt.kind in "fV" or str(dtype) == "bfloat16" else (True if np_dt.kind == "b" else -7)
    index = np.lib.stride_tricks.as_strided(np.arange(length)[offset:] if length else np.arange(0),
                                            shape, [s * 8 for s in strides]) if length else None
    footprint = np.zeros(length, bool)
    if index is not None and index.size:
        footprint[index.ravel()] = True
    if FRAMEWORK == "numpy":
        buf = np.full(length, fill, dtype=np_dt)
        view = np.lib.stride_tricks.as_strided(buf[offset:], shape, [s * buf.itemsize for s in strides],
                                               writeable=layout not in ("broadcast", "readonly"))
        if layout not in ("broadcast", "readonly"):
            view[...] = values.astype(np_dt)
        else:
            np.lib.stride_tricks.as_strided(buf[offset:], shape, [s * buf.itemsize for s in strides])[...] = \
                values.astype(np_dt)
        before = buf.astype(np.float64) if np_dt.kind in "fV" else buf.copy()
        return Placed(name, layout, view, buf, footprint, before)
    import torch

    tdt = getattr(torch, str(dtype)) if dtype is not None else torch.from_numpy(values[:0].copy()).dtype
    buf = torch.full((length,), fill, dtype=tdt, device=DEVICE)
    view = torch.as_strided(buf, shape, strides, offset)
    src = torch.from_numpy(np.ascontiguousarray(values)).to(device=DEVICE, dtype=tdt)
    if layout == "broadcast":  # as_strided gives a writable view with overlapping rows: write row 0 once
        view[:1].copy_(src[:1])
    else:
        view.copy_(src)
    return Placed(name, layout, view, buf, footprint, H.to_numpy(buf).astype(np.float64) if tdt.is_floating_point
                  else H.to_numpy(buf).copy())


def _sliced(name: str, values: np.ndarray, dtype: Any, layout: str) -> Placed:
    """*values* as a slice of a wider last dimension of a framework tensor (its own basic indexing)."""
    n = values.shape[-1]
    width = 2 * n if layout == "every_other" else n + 3
    cols = slice(0, 2 * n, 2) if layout == "every_other" else slice(0, n)
    floating = values.dtype.kind == "f"
    wide = np.full((*values.shape[:-1], width), _NAN_FILL if floating else -7, values.dtype)
    wide[..., cols] = values
    buf = _fw(wide, None if dtype is None else str(dtype))
    footprint = np.zeros(wide.shape, bool)
    footprint[..., cols] = True
    view = buf[..., ::2] if layout == "every_other" else buf[..., :n]
    return Placed(name, layout, view, buf, footprint.ravel(), _np64(buf).ravel())


def _np64(x: Any) -> np.ndarray:
    a = H.to_numpy(x)
    return a.astype(np.float64) if a.dtype.kind in "fV" or a.dtype.name == "bfloat16" else np.array(a, copy=True)


def _check_around(p: Placed, what: str) -> None:
    """The buffer elements outside *p*'s view are as they were."""
    if p.buffer is None or p.footprint is None or p.before is None:
        return
    now = _np64(p.buffer).ravel()
    outside = ~p.footprint
    changed = outside & (now != p.before) & ~(np.isnan(now) & np.isnan(p.before))
    if changed.any():
        first = int(np.flatnonzero(changed)[0])
        raise AssertionError(f"{what} '{p.name}' ({p.layout}): {int(changed.sum())} element(s) of its buffer "
                             f"outside the view were written (first at buffer element {first}: "
                             f"{p.before[first]!r} -> {now[first]!r})")


@st.composite
def _calls(draw: st.DrawFn, op: opbridge.OpDef, with_out: bool) -> tuple[str, dict[str, Any], dict[str, str],
                                                                        dict[str, str]]:
    dtypes = _dtypes(op)
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**20))
    cases = [c for c in make_cases(op, dtype, seed) if not any(k in c for k in META_KEYS)]
    case = draw(st.sampled_from(cases))
    layouts: dict[str, str] = {}
    out_layouts: dict[str, str] = {}
    if len(LAYOUTS) > 1:
        for a in op.schema.arguments:
            v = case[a.name]
            if a.type.is_tensor and isinstance(v, np.ndarray):
                choices = [lay for lay in (WRITE_LAYOUTS if a.is_mutated else READ_LAYOUTS)
                           if _usable(lay, tuple(v.shape))]
                layouts[a.name] = draw(st.sampled_from(choices))
        if with_out:
            specs = op.output_specs([case[a.name] for a in op.schema.arguments])
            for j, spec in enumerate(specs):
                shape = tuple(int(s) for s in spec.shape)
                out_layouts[str(j)] = draw(st.sampled_from([lay for lay in WRITE_LAYOUTS if _usable(lay, shape)]))
    return dtype, case, layouts, out_layouts


def _run(op: opbridge.OpDef, call: Callable[..., Any], dtype: str, case: dict[str, Any], layouts: dict[str, str],
         out_layouts: dict[str, str], label: str) -> None:
    placed: list[Placed | None] = []
    args: list[Any] = []
    for a in op.schema.arguments:
        v = case[a.name]
        if a.type.is_tensor and isinstance(v, np.ndarray):
            p = _place(a.name, v, dtype if v.dtype.kind == "f" else None, layouts.get(a.name, "contiguous"))
            placed.append(p)
            args.append(p.view)
        else:
            placed.append(None)
            args.append(v)
    ref_args = [_np64(x) if p is not None else x for p, x in zip(placed, args)]
    ref_copy = [a.copy() if isinstance(a, np.ndarray) else a for a in ref_args]  # the reference writes these
    ref = op.reference(*ref_copy)
    mutated_ref = [ref_copy[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    outs_ref = [] if ref is None else list(ref) if isinstance(ref, tuple) else [ref]
    kwargs: dict[str, Any] = {}
    out_placed: list[Placed] = []
    if out_layouts:
        for j, spec in enumerate(op.output_specs(args)):
            shape = tuple(int(s) for s in spec.shape)
            name = str(spec.dtype).split(".")[-1].lower()  # the framework's dtype: torch.float32, Float32
            floating = name == "bfloat16" or _np_dtype(name).kind == "f"
            zeros = np.zeros(shape, np.float64 if floating else name)
            out_placed.append(_place(f"out[{j}]", zeros, name, out_layouts[str(j)]))
        kwargs["out"] = out_placed[0].view if len(out_placed) == 1 else tuple(p.view for p in out_placed)
    where = (f"{label} {op.name} {dtype} layouts {layouts or 'contiguous'}"
             + (f" out= {out_layouts}" if out_layouts else "")
             + f" shapes {[tuple(v.shape) for v in case.values() if isinstance(v, np.ndarray)]}")
    got = call(*args, **kwargs)
    rtol, atol = op.tolerance(dtype)
    outs = [] if got is None else list(got) if isinstance(got, tuple) else [got]
    if H.mutates_in_place:
        mutated_got = [args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated]
    else:
        mutated_got, outs = outs[:len(mutated_ref)], outs[len(mutated_ref):]
    assert len(outs) == len(outs_ref), f"{where}: {len(outs)} results, the reference gives {len(outs_ref)}"
    for k, (g, w) in enumerate(zip(outs, outs_ref)):
        assert_close(_np64(g), _rounded(w, dtype), rtol=rtol, atol=atol, name=f"{where}: result {k}")
    for g, w, a in zip(mutated_got, mutated_ref, [a for a in op.schema.arguments if a.is_mutated]):
        if w is None:
            continue
        assert_close(_np64(g), _rounded(w, dtype), rtol=rtol, atol=atol, name=f"{where}: mutated '{a.name}'")
    for j, p in enumerate(out_placed):
        assert_close(_np64(p.view), _rounded(outs_ref[j], dtype), rtol=rtol, atol=atol,
                     name=f"{where}: out= {j}")
    mutated = {a.name for a in op.schema.arguments if a.is_mutated}
    for p, x in zip(placed, ref_args):
        if p is None:
            continue
        if p.name not in mutated:
            now = _np64(p.view)
            same = (now == x) | (np.isnan(now) & np.isnan(x)) if now.dtype.kind == "f" else now == x
            assert np.all(same), f"{where}: input '{p.name}' ({p.layout}) was changed"
        _check_around(p, f"{where}: argument")
    for p in out_placed:
        _check_around(p, f"{where}: out=")


def _rounded(w: Any, dtype: str) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype.kind != "f":
        return w
    with np.errstate(over="ignore", invalid="ignore"):
        return w.astype(_np_dtype(dtype)).astype(np.float64)


def _paths(op: opbridge.OpDef) -> list[tuple[str, Callable[..., Any]]]:
    paths: list[tuple[str, Callable[..., Any]]] = [(f"{FRAMEWORK} ops.{op.name}", op.call)]
    if FRAMEWORK == "torch":
        import torch

        packet = getattr(getattr(torch.ops, op.library.namespace), op.name)
        paths.append((f"torch.ops.{op.library.namespace}.{op.name}", packet))
    return paths


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data())
def test_fuzzed_calls_match_the_reference(op: opbridge.OpDef, data: st.DataObject) -> None:
    _require(op)
    dtype, case, layouts, _ = data.draw(_calls(op, with_out=False))
    for label, call in _paths(op):
        _run(op, call, dtype, case, layouts, {}, label)


OUT_OPS = [op for op in OPS if op.accepts_out]


@pytest.mark.parametrize("op", OUT_OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data())
def test_fuzzed_out_buffers(op: opbridge.OpDef, data: st.DataObject) -> None:
    if len(LAYOUTS) == 1:
        pytest.skip(f"{FRAMEWORK}: its arrays have no layout (and no out= for JAX)")
    _require(op)
    dtype, case, layouts, out_layouts = data.draw(_calls(op, with_out=True))
    _run(op, op.call, dtype, case, layouts, out_layouts, f"{FRAMEWORK} ops.{op.name}")


def _corrupt(op: opbridge.OpDef, case: dict[str, Any], dtype: str, how: str) -> tuple[dict[str, Any], str, str] | None:
    """*case* with one tensor argument made inconsistent with the lead one, or None where it cannot be.

    ``dtype``: a float argument other than the dispatching one gets another float dtype;
    ``shape``: an argument whose last dim is the lead's gets one more column.
    Returns the case, the argument's name and the dtype that argument takes.
    """
    lead = op.schema.arguments[op.dtype_arg].name
    lead_v = case[lead]
    floats = [d for d in ("float32", "float64", "float16") if d != dtype and d in _dtypes(op)]
    for a in op.schema.arguments:
        v = case[a.name]
        if a.name == lead or not a.type.is_tensor or not isinstance(v, np.ndarray) or not v.size:
            continue
        if how == "dtype" and v.dtype.kind == "f" and floats:
            return case, a.name, floats[0]
        if (how == "shape" and v.ndim and lead_v.ndim and v.shape[-1] == lead_v.shape[-1]
                and v.dtype.kind == "f"):
            wider = np.concatenate([v, v[..., :1]], axis=-1)
            return {**case, a.name: wider}, a.name, dtype
    return None


@pytest.mark.parametrize("how", ["dtype", "shape"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data())
def test_fuzzed_bad_inputs_raise_named_errors_and_write_nothing(op: opbridge.OpDef, how: str,
                                                               data: st.DataObject) -> None:
    """An argument inconsistent with the others raises TypeError or ValueError naming the op, on every
    path and in every layout, before anything is written: every buffer is as it was."""
    _require(op)
    dtype, case, layouts, _ = data.draw(_calls(op, with_out=False))
    bad = _corrupt(op, case, dtype, how)
    if bad is None:
        return  # this op's case has no argument to make inconsistent this way
    case, name, bad_dtype = bad
    layouts = {k: v for k, v in layouts.items() if k != name or _usable(v, tuple(case[name].shape))}
    for label, call in _paths(op):
        placed = [
            _place(a.name, case[a.name], (bad_dtype if a.name == name else dtype)
                   if case[a.name].dtype.kind == "f" else None, layouts.get(a.name, "contiguous"))
            if a.type.is_tensor and isinstance(case[a.name], np.ndarray) else None
            for a in op.schema.arguments]
        args = [p.view if p is not None else case[a.name] for p, a in zip(placed, op.schema.arguments)]
        before = [None if p is None else _np64(p.view) for p in placed]
        where = f"{label} {op.name} {dtype}, '{name}' given {how} {bad_dtype} {case[name].shape}, layouts {layouts}"
        with pytest.raises((TypeError, ValueError)) as info:
            call(*args)
        assert op.name in str(info.value), f"{where}: the error does not name the op: {info.value}"
        for p, was in zip(placed, before):
            if p is None:
                continue
            now = _np64(p.view)
            same = (now == was) | (np.isnan(now) & np.isnan(was)) if now.dtype.kind == "f" else now == was
            assert np.all(same), f"{where}: '{p.name}' ({p.layout}) was written by a call that raised"
            _check_around(p, f"{where}: argument")


def _shared(values: list[np.ndarray], dtype: str, shift: int) -> list[Any]:
    """Views of one framework buffer: ``values[0]`` at element 0, every later one *shift* elements on."""
    n = values[0].size
    flat = np.zeros(n + shift * (len(values) - 1), np.float64)
    flat[:n] = values[0].ravel()
    buf = _place("shared", flat, dtype, "offset" if STRIDED else "contiguous").view
    views = [buf[k * shift:k * shift + n].reshape(values[0].shape) for k in range(len(values))]
    apart = H.data_ptr(views[-1]) - H.data_ptr(views[0])
    if apart != shift * (len(values) - 1) * _np_dtype(dtype).itemsize:  # a reshape that copied
        pytest.skip(f"{FRAMEWORK}: the views are {apart} bytes apart, not {shift} element(s)")
    return views


@pytest.mark.parametrize("op", OUT_OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data(), shift=st.sampled_from([0, 1, 3]))
def test_fuzzed_out_sharing_memory_with_an_input(op: opbridge.OpDef, data: st.DataObject, shift: int) -> None:
    """``out=`` the very input (shift 0) or a view overlapping it: the result is the op of the inputs as
    they were before the call (NumPy's own ufuncs buffer such calls; torch's own refuse them)."""
    if len(LAYOUTS) == 1:
        pytest.skip(f"{FRAMEWORK}: its arrays have no views (and no out= for JAX)")
    _require(op)
    dtype, case, _, _ = data.draw(_calls(op, with_out=False))
    args = [_fw(v.copy(), dtype if v.dtype.kind == "f" else None) if isinstance(v, np.ndarray) else v
            for v in (case[a.name] for a in op.schema.arguments)]
    specs = op.output_specs(args)
    first = specs[0]
    shared = next((i for i in core_tensors(op) if isinstance(case[op.schema.arguments[i].name], np.ndarray)
                   and tuple(case[op.schema.arguments[i].name].shape) == tuple(int(s) for s in first.shape)
                   and case[op.schema.arguments[i].name].dtype.kind == "f"
                   and case[op.schema.arguments[i].name].size > 0), None)
    if shared is None:
        return  # no input the first output could share memory with
    name = op.schema.arguments[shared].name
    x, out0 = _shared([case[name], np.zeros(case[name].shape)], dtype, shift)
    args[shared] = x
    ref_args = [_np64(a) if k in core_tensors(op) and a is not None else a for k, a in enumerate(args)]
    ref = op.reference(*ref_args)
    refs = list(ref) if isinstance(ref, tuple) else [ref]
    outs = [out0] + [_fw(np.zeros(tuple(int(s) for s in sp.shape)), dtype) for sp in specs[1:]]
    op.call(*args, out=outs[0] if len(outs) == 1 else tuple(outs))
    rtol, atol = op.tolerance(dtype)
    where = f"{FRAMEWORK} {op.name} {dtype}: out= {'is' if shift == 0 else f'{shift} element(s) past'} '{name}'"
    for k, (o, w) in enumerate(zip(outs, refs)):
        assert_close(_np64(o), _rounded(w, dtype), rtol=rtol, atol=atol, name=f"{where}: out {k}")


def core_tensors(op: opbridge.OpDef) -> list[int]:
    return [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]
