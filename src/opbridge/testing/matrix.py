"""Run a declared op over a generated test matrix: :func:`check_op`.

For every dtype, :func:`make_cases` builds a list of *cases*; a case is a dict
mapping argument names to values (NumPy arrays for Tensor arguments, Python
values for the rest) plus optional ``_``-prefixed layout keys. Each case is
then run through the op and compared against the op's NumPy reference:

``forward``
    The op's public callable on framework arrays against the reference
    evaluated in float64 on copies of the (dtype-rounded) inputs, rounded to
    the output dtype, within ``op.tolerance(dtype)``.
``inputs_unchanged``
    Arguments the schema does not mark as mutated are bit-for-bit unchanged,
    and the NaN padding around sliced inputs is untouched.
``sentinel``
    The kernel is called directly (destination passing) with outputs and
    inputs that are views into larger buffers filled with a sentinel (NaN for
    floats); the guard regions before and after must still hold the sentinel
    (no out-of-bounds writes), and no output element may keep it (no
    unwritten elements).
``grad``
    (torch, float32, ops with a ``backward``) autograd gradients against
    central finite differences of the float64 reference, as directional
    derivatives ``<g, J u>`` per differentiable input.
``noncontiguous``
    A non-contiguous input must raise ``ValueError`` naming the op.
``opcheck`` / ``compile``
    (torch, one small case per dtype) ``torch.library.opcheck`` on the
    registered overload, and ``torch.compile(fullgraph=True)`` of a function
    calling the public callable, against eager.

Any failure raises :class:`AssertionError` naming the op, the check, the
framework, the dtype and the case. Importing this module imports no
framework; torch is imported only when ``framework="torch"`` checks run.
"""

from __future__ import annotations

import warnings
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opbridge.cases import (
    ELEMENTWISE_SHAPES,
    LAYOUT,
    META_KEYS,
    NONCONTIGUOUS,
    Case,
    CaseHint,
    elementwise_cases,
    elementwise_hint,
    last_dim_hint,
    shaped_cases,
)
from opbridge.declare import OpDef
from opbridge.testing.compare import assert_close, dtype_name, to_numpy

__all__ = [
    "CASE_HINTS",
    "ELEMENTWISE_SHAPES",
    "LAYOUT",
    "NONCONTIGUOUS",
    "Case",
    "CaseHint",
    "CheckReport",
    "check_op",
    "elementwise_cases",
    "elementwise_hint",
    "last_dim_hint",
    "make_cases",
    "shaped_cases",
]

DEFAULT_DTYPES = ("float32", "float16", "bfloat16")
_GUARD = 64  # sentinel elements before and after each guarded array
_FD_STEP = 1e-6


# ---------------------------------------------------------------------------
# case generation
# ---------------------------------------------------------------------------


class _DeprecatedCaseHints(dict[str, CaseHint]):
    """``CASE_HINTS``: kept for one release; declare ``Library.op(..., hints=...)`` instead.

    Reading an op's qualname gives its declared hint; writing one still works
    (:func:`make_cases` consults it after the op's own ``hints``) but warns.
    """

    def __setitem__(self, key: str, value: CaseHint) -> None:
        warnings.warn(
            "opbridge.testing.CASE_HINTS is deprecated: declare the op's test cases with "
            f"Library.op(..., hints=...) instead of CASE_HINTS[{key!r}] = ...",
            DeprecationWarning, stacklevel=2,
        )
        super().__setitem__(key, value)

    def __missing__(self, key: str) -> CaseHint:
        from opbridge import registry

        namespace, _, name = key.partition("::")
        for lib in registry.libraries():
            op = lib.ops.get(name) if lib.namespace == namespace else None
            if op is not None and op.hints is not None:
                return op.hints
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


#: Deprecated: per-op case generators by qualname (``"namespace::name"``), consulted
#: after the op's declared ``hints``. Declare them with the op instead::
#:
#:     @lib.op("layer_norm(...) -> Tensor", ..., hints=last_dim_hint(("x",), ("weight", "bias")))
CASE_HINTS: dict[str, CaseHint] = _DeprecatedCaseHints()

_GENERIC_SCALARS: dict[str, Any] = {"float": 0.5, "int": 1, "bool": True}


def _complete(op: OpDef, case: Mapping[str, Any]) -> Case:
    """Validate *case* against the schema and fill in the arguments it leaves out."""
    names = [a.name for a in op.schema.arguments]
    unknown = [k for k in case if k not in names and k not in META_KEYS]
    if unknown:
        raise ValueError(f"{op.qualname}: case names unknown argument(s) {unknown}; the schema has {names}")
    out: Case = {}
    for a in op.schema.arguments:
        if a.name in case:
            out[a.name] = case[a.name]
        elif a.type.is_tensor and a.type.optional:
            out[a.name] = None
        elif a.type.is_tensor:
            raise ValueError(f"{op.qualname}: case gives no value for Tensor argument '{a.name}'")
        elif a.has_default:
            out[a.name] = a.default
        elif not a.type.is_list and a.type.base in _GENERIC_SCALARS and not a.type.optional:
            out[a.name] = _GENERIC_SCALARS[a.type.base]
        elif a.type.optional:
            out[a.name] = None
        else:
            raise ValueError(
                f"{op.qualname}: no value for argument '{a.name}' ({a.type}) and no generic one; "
                "declare a case generator with Library.op(..., hints=...)"
            )
    for k in META_KEYS:
        if k in case:
            out[k] = case[k]
    layout = out.get(LAYOUT, "contiguous")
    if layout not in ("contiguous", "sliced"):
        raise ValueError(f"{op.qualname}: case {LAYOUT}={layout!r}; expected 'contiguous' or 'sliced'")
    nc = out.get(NONCONTIGUOUS)
    if nc is not None and (nc not in names or not op.schema.arguments[names.index(nc)].type.is_tensor):
        raise ValueError(f"{op.qualname}: case {NONCONTIGUOUS}={nc!r} names no Tensor argument")
    return out


def make_cases(op: Any, dtype: str = "float32", seed: int = 0) -> list[Case]:
    """The test cases of *op* for *dtype*.

    Uses the op's declared ``hints`` (``Library.op(..., hints=...)``), else a
    generator registered in the deprecated :data:`CASE_HINTS`, else
    :func:`elementwise_cases`; arguments a case leaves out get their schema
    default (or a generic value for ``float``/``int``/``bool``).

    Parameters
    ----------
    op
        The op's public callable or its :class:`~opbridge.OpDef`.
    dtype
        Dtype name the cases are for (hints may vary values with it).
    seed
        Seed; the same ``(op, dtype, seed)`` always gives the same cases.

    Returns
    -------
    list of Case
        Tensor values are float64 NumPy arrays (cast to *dtype* when run);
        integer or boolean arrays keep their dtype.
    """
    opdef = _opdef(op)
    rng = _rng(seed, opdef.qualname, dtype)
    hint = opdef.hints or dict.get(CASE_HINTS, opdef.qualname)
    raw = hint(dtype, rng) if hint is not None else elementwise_cases(opdef, dtype, rng)
    return [_complete(opdef, c) for c in raw]


def _rng(seed: int, *keys: object) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(str(k).encode()) for k in keys)])


def _opdef(op: Any) -> OpDef:
    opdef = op if isinstance(op, OpDef) else getattr(op, "opdef", None)
    if not isinstance(opdef, OpDef):
        raise TypeError(f"expected an opbridge op (its public callable or OpDef), got {op!r}")
    return opdef


# ---------------------------------------------------------------------------
# framework kits: how to make, copy and inspect arrays of one framework
# ---------------------------------------------------------------------------


def _is_float_np(v: np.ndarray) -> bool:
    return v.dtype.kind in "fc"


class _NumpyKit:
    name = "numpy"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16")

    def dtype(self, d: Any) -> Any:
        return np.dtype(d if isinstance(d, np.dtype) else str(d))

    def is_float(self, x: Any) -> bool:
        return bool(x.dtype.kind in "fc")

    def numel(self, x: Any) -> int:
        return int(x.size)

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        return np.full(n, _sentinel_value(dt.kind, dt), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        target = self.dtype(dtype) if _is_float_np(v) else v.dtype
        return np.array(v, dtype=target, copy=True, order="C")

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        return buf[lo:hi].reshape(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def widen_last(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return np.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)

    def to_np64(self, x: Any) -> np.ndarray:
        a = np.asarray(x)
        return a.astype(np.float64) if self.is_float(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, as in the kernel
            return np.asarray(v).astype(np.asarray(like).dtype).astype(np.float64)

    def clone(self, x: Any) -> Any:
        return np.array(x, copy=True)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def dtype_of(self, x: Any) -> Any:
        return x.dtype


class _TorchKit(_NumpyKit):
    name = "torch"
    dtypes = ("float64", "float32", "float16", "bfloat16")

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def dtype(self, d: Any) -> Any:
        return d if isinstance(d, self.torch.dtype) else getattr(self.torch, str(d))

    def is_float(self, x: Any) -> bool:
        return bool(x.dtype.is_floating_point or x.dtype.is_complex)

    def numel(self, x: Any) -> int:
        return int(x.numel())

    def empty_filled(self, n: int, dtype: Any) -> Any:
        dt = self.dtype(dtype)
        kind = "f" if dt.is_floating_point else ("b" if dt == self.torch.bool else "i")
        return self.torch.full((n,), _sentinel_value(kind, dt), dtype=dt)

    def from_np(self, v: np.ndarray, dtype: str) -> Any:
        t = self.torch.from_numpy(np.ascontiguousarray(v))
        return t.to(self.dtype(dtype) if _is_float_np(v) else t.dtype, copy=True)

    def flat(self, buf: Any, lo: int, hi: int, shape: tuple[int, ...]) -> Any:
        return buf[lo:hi].view(shape)

    def write(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def widen_last(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)

    def to_np64(self, x: Any) -> np.ndarray:
        a = to_numpy(x)
        return a.astype(np.float64) if _is_float_np(a) else a.copy()

    def round_to(self, v: np.ndarray, like: Any) -> np.ndarray:
        t = self.torch.from_numpy(np.ascontiguousarray(np.asarray(v, dtype=np.float64)))
        return to_numpy(t.to(like.dtype)).astype(np.float64)

    def clone(self, x: Any) -> Any:
        return x.detach().clone()


def _sentinel_value(kind: str, dt: Any) -> Any:
    if kind in "fc":
        return float("nan")
    if kind == "b":
        return True
    if kind == "u":
        return 0xA5
    return -7919  # a prime that no index or count computed here is likely to equal


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


@dataclass
class CheckReport:
    """What :func:`check_op` checked.

    Attributes
    ----------
    op
        The op's qualname.
    framework
        ``"torch"`` or ``"numpy"``.
    dtypes
        The dtypes that were run.
    cases
        Number of (dtype, case) pairs run.
    checks
        Count per check kind: ``forward``, ``inputs_unchanged``, ``sentinel``,
        ``grad``, ``noncontiguous``, ``opcheck``, ``compile``, ``compile_grad``.
    skipped
        Why a requested dtype or check did not run.
    """

    op: str
    framework: str
    dtypes: tuple[str, ...] = ()
    cases: int = 0
    checks: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.checks.items()))
        text = f"{self.op} [{self.framework}; {', '.join(self.dtypes)}]: {self.cases} cases; {counts}"
        return text + (f"; skipped: {'; '.join(self.skipped)}" if self.skipped else "")


# ---------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------


def _describe(op: OpDef, case: Mapping[str, Any]) -> str:
    parts = []
    nc = case.get(NONCONTIGUOUS)
    for a in op.schema.arguments:
        v = case.get(a.name)
        if a.type.is_tensor and v is not None:
            arr = to_numpy(v)
            text = f"{a.name}: shape {tuple(arr.shape)}"
            if not _is_float_np(arr):
                text += f" {arr.dtype}"
            if nc == a.name:
                text += " non-contiguous"
            parts.append(text)
        else:
            parts.append(f"{a.name}={v!r}")
    layout = case.get(LAYOUT, "contiguous")
    suffix = " [sliced: tensors are slices at odd offsets of larger buffers]" if layout == "sliced" else ""
    return ", ".join(parts) + suffix


class _Runner:
    def __init__(self, op: OpDef, kit: _NumpyKit, report: CheckReport, *, seed: int, sentinel: bool,
                 check_grad: bool, grad_rtol: float) -> None:
        self.op = op
        self.kit = kit
        self.report = report
        self.seed = seed
        self.sentinel = sentinel
        self.check_grad = check_grad
        self.grad_rtol = grad_rtol
        self.args = op.schema.arguments
        self.dtype = ""
        self.where = ""

    # -- failure reporting ----------------------------------------------------

    @contextmanager
    def checking(self, kind: str) -> Iterator[None]:
        try:
            yield
        except AssertionError as exc:
            raise AssertionError(self._header(kind) + _indent(str(exc))) from exc
        except Exception as exc:
            raise AssertionError(
                self._header(kind) + _indent(f"raised {type(exc).__name__}: {exc}")
            ) from exc
        if kind not in ("setup", "reference"):
            self.report.checks[kind] += 1

    def _header(self, kind: str) -> str:
        return (f"check_op({self.op.qualname}): {kind} check failed\n"
                f"  framework: {self.kit.name}, dtype: {self.dtype}\n"
                f"  case: {self.where}\n")

    # -- calling ----------------------------------------------------------------

    def split(self, full: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        pos = [v for a, v in zip(self.args, full, strict=True) if not a.kwarg_only]
        kw = {a.name: v for a, v in zip(self.args, full, strict=True) if a.kwarg_only}
        return pos, kw

    def call(self, full: Sequence[Any]) -> tuple[Any, ...]:
        pos, kw = self.split(full)
        return _as_tuple(self.op.call(*pos, **kw), len(self.op.schema.returns), self.op.name)

    def reference(self, ref_args: Sequence[Any]) -> tuple[tuple[Any, ...], dict[int, np.ndarray]]:
        if self.op.reference is None:
            raise ValueError(f"{self.op.qualname} declares no reference implementation")
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in ref_args]
        res = _as_tuple(self.op.reference(*args), len(self.op.schema.returns), f"{self.op.name} reference")
        mutated = {i: args[i] for i, a in enumerate(self.args) if a.is_mutated and args[i] is not None}
        return tuple(np.asarray(r) for r in res), mutated

    # -- materialising cases ----------------------------------------------------

    def materialize(self, case: Mapping[str, Any]) -> tuple[list[Any], list[tuple[str, Any, int, int]]]:
        """Framework arguments in schema order, and (name, buffer, lo, hi) of padded ones."""
        kit = self.kit
        sliced = case.get(LAYOUT) == "sliced"
        nc = case.get(NONCONTIGUOUS)
        full: list[Any] = []
        padded: list[tuple[str, Any, int, int]] = []
        k = 0
        for a in self.args:
            v = case[a.name]
            if not a.type.is_tensor or v is None:
                full.append(v)
                continue
            arr = np.asarray(to_numpy(v))
            x = kit.from_np(arr, self.dtype)
            if a.name == nc:
                shape = tuple(arr.shape)
                if not shape or shape[-1] < 2:
                    raise ValueError(f"cannot make '{a.name}' of shape {shape} non-contiguous "
                                     f"(needs a last dimension > 1)")
                wide = kit.widen_last(shape, kit.dtype_of(x))
                view = wide[..., ::2]
                kit.write(view, x)
                x = view
            elif sliced:
                n = kit.numel(x)
                lo = 1 + 2 * k  # odd element offsets: the data is not aligned to its dtype's vector width
                buf = kit.empty_filled(lo + n + 3, kit.dtype_of(x))
                view = kit.flat(buf, lo, lo + n, kit.shape(x))
                kit.write(view, x)
                padded.append((a.name, buf, lo, lo + n))
                x = view
            full.append(x)
            k += 1
        return full, padded

    def ref_inputs(self, full: Sequence[Any]) -> list[Any]:
        return [self.kit.to_np64(v) if a.type.is_tensor and v is not None else v
                for a, v in zip(self.args, full, strict=True)]

    # -- checks -----------------------------------------------------------------

    def run_case(self, index: int, case: Mapping[str, Any]) -> None:
        self.where = _describe(self.op, case)
        self.report.cases += 1
        if case.get(NONCONTIGUOUS) is not None:
            self.check_noncontiguous(case)
            return
        with self.checking("setup"):
            full, padded = self.materialize(case)
        with self.checking("reference"):
            ref_in = self.ref_inputs(full)
            expected, expected_mut = self.reference(ref_in)
        if self.sentinel:
            with self.checking("sentinel"):
                self.check_sentinel(full, expected)
        with self.checking("forward"):
            before = [self.kit.clone(v) if a.type.is_tensor and v is not None and not a.is_mutated else None
                      for a, v in zip(self.args, full, strict=True)]
            outs = self.call(full)
            self.compare_results(full, outs, expected, expected_mut)
        with self.checking("inputs_unchanged"):
            self.check_unchanged(full, before, padded)
        if (self.check_grad and self.kit.name == "torch" and self.dtype == "float32"
                and self.op.backward is not None and not self.op.schema.is_mutating
                and all(self.kit.numel(v) > 0 for a, v in zip(self.args, full, strict=True)
                        if a.type.is_tensor and v is not None)):
            with self.checking("grad"):
                self.check_gradients(index, full, ref_in)

    def compare_results(self, full: Sequence[Any], outs: Sequence[Any], expected: Sequence[np.ndarray],
                        expected_mut: Mapping[int, np.ndarray]) -> None:
        for j, (act, exp) in enumerate(zip(outs, expected, strict=True)):
            self.compare(act, exp, self._return_name(j), against="the float64 reference")
        for i, exp in expected_mut.items():
            self.compare(full[i], exp, f"mutated argument '{self.args[i].name}'",
                         against="the float64 reference")

    def _return_name(self, j: int) -> str:
        r = self.op.schema.returns[j]
        if len(self.op.schema.returns) == 1:
            return "output"
        return f"output {j}" + (f" ({r.name})" if r.name else "")

    def compare(self, actual: Any, expected64: np.ndarray, what: str, against: str) -> None:
        exp = self.kit.round_to(expected64, actual) if self.kit.is_float(actual) else expected64
        dname = dtype_name(actual)
        rtol, atol = self.op.tolerance(dname)
        assert_close(actual, exp, rtol=rtol, atol=atol, dtype=dname, name=f"{what} vs {against}")

    def check_unchanged(self, full: Sequence[Any], before: Sequence[Any],
                        padded: Sequence[tuple[str, Any, int, int]]) -> None:
        for a, now, was in zip(self.args, full, before, strict=True):
            if was is None:
                continue
            x, y = self.kit.to_np64(now), self.kit.to_np64(was)
            same = (x == y) | (np.isnan(x) & np.isnan(y)) if _is_float_np(x) else (x == y)
            if not np.all(same):
                bad = np.argwhere(~same)
                raise AssertionError(
                    f"input '{a.name}' was modified by an op that does not declare it mutated "
                    f"({len(bad)} of {x.size} elements changed, first at {_fmt(bad[0])}: "
                    f"{y[tuple(bad[0])].item()!r} -> {x[tuple(bad[0])].item()!r}); write to outputs only, "
                    f"or declare it Tensor(a!)"
                )
        for name, buf, lo, hi in padded:
            self.check_guards(buf, lo, hi, f"input '{name}'")

    def check_guards(self, buf: Any, lo: int, hi: int, what: str) -> None:
        whole = self.kit.to_np64(buf)
        fill = self.kit.to_np64(self.kit.empty_filled(1, self.kit.dtype_of(buf)))[0]
        for region, part, base in (("before", whole[:lo], 0), ("after", whole[hi:], hi)):
            intact = np.isnan(part) if _is_float_np(whole) and np.isnan(fill) else part == fill
            if not np.all(intact):
                bad = np.flatnonzero(~intact)
                first = int(bad[0]) + base
                offset = first - lo if region == "before" else first - hi
                raise AssertionError(
                    f"out-of-bounds write: {len(bad)} element(s) of the sentinel guard {region} "
                    f"{what} were overwritten (first at element offset {offset:+d} "
                    f"{'from its start' if region == 'before' else 'past its end'}, "
                    f"now {whole[first].item()!r}); "
                    f"the kernel writes outside the {what}"
                )

    def check_sentinel(self, full: Sequence[Any], expected: Sequence[np.ndarray]) -> None:
        from opbridge import loader

        kit = self.kit
        kern = loader.kernel(self.op, "cpu")
        gargs: list[Any] = []
        guarded: list[tuple[str, Any, int, int]] = []
        for a, v in zip(self.args, full, strict=True):
            if not a.type.is_tensor or v is None:
                gargs.append(v)
                continue
            n = kit.numel(v)
            buf = kit.empty_filled(_GUARD + n + _GUARD, kit.dtype_of(v))
            view = kit.flat(buf, _GUARD, _GUARD + n, kit.shape(v))
            kit.write(view, v)
            gargs.append(view)
            guarded.append((f"input '{a.name}'", buf, _GUARD, _GUARD + n))
        outs: list[Any] = []
        out_bufs: list[tuple[str, Any, int, int]] = []
        new_returns = [j for j, r in enumerate(self.op.schema.returns) if r.type.alias is None]
        for j, spec in zip(new_returns, self.op.output_specs(gargs), strict=True):
            shape = tuple(int(s) for s in spec.shape)
            n = int(np.prod(shape)) if shape else 1
            buf = kit.empty_filled(_GUARD + n + _GUARD, spec.dtype)
            outs.append(kit.flat(buf, _GUARD, _GUARD + n, shape))
            out_bufs.append((self._return_name(j), buf, _GUARD, _GUARD + n))
        kern(*outs, *gargs)
        for what, buf, lo, hi in out_bufs + guarded:
            self.check_guards(buf, lo, hi, what)
        for j, out in zip(new_returns, outs, strict=True):
            if not kit.is_float(out):
                continue
            got = kit.to_np64(out)
            exp = np.asarray(expected[j], dtype=np.float64)
            if got.shape != exp.shape:
                continue  # the forward check reports shape mismatches
            unwritten = np.isnan(got) & ~np.isnan(exp)
            if unwritten.any():
                bad = np.argwhere(unwritten)
                raise AssertionError(
                    f"{self._return_name(j)}: {len(bad)} of {got.size} elements were left unwritten "
                    f"(still hold the NaN sentinel; first at {_fmt(bad[0])}, expected "
                    f"{exp[tuple(bad[0])].item()!r}); the kernel must write every output element"
                )

    def check_noncontiguous(self, case: Mapping[str, Any]) -> None:
        name = case[NONCONTIGUOUS]
        with self.checking("setup"):
            full, _ = self.materialize(case)
        with self.checking("noncontiguous"):
            try:
                self.call(full)
            except ValueError as exc:
                if self.op.name not in str(exc):
                    raise AssertionError(
                        f"non-contiguous '{name}' raised ValueError, but its message does not name "
                        f"the op {self.op.name!r}: {exc}"
                    ) from None
                return
            raise AssertionError(
                f"non-contiguous '{name}' was accepted; kernels index raw memory, so they must "
                f"reject it with ValueError naming the op (OPB_CHECK_CONTIGUOUS(op, {name}))"
            )

    def check_gradients(self, index: int, full: Sequence[Any], ref_in: Sequence[Any]) -> None:
        torch = self.kit.torch  # type: ignore[attr-defined]
        rng = _rng(self.seed, self.op.qualname, "grad", index)
        diff = [i for i in self.op.differentiable
                if full[i] is not None and self.kit.is_float(full[i])]
        if not diff:
            self.report.skipped.append(f"grad: {self.where}: no floating differentiable input")
            return
        leaves = {i: full[i].detach().requires_grad_() for i in diff}
        call_args = [leaves.get(i, v) for i, v in enumerate(full)]
        outs = self.call(call_args)
        float_outs = [(j, o) for j, o in enumerate(outs) if o.dtype.is_floating_point]
        gs = {j: torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.dtype) for j, o in float_outs}
        grads = torch.autograd.grad([o for _, o in float_outs], [leaves[i] for i in diff],
                                    grad_outputs=[gs[j] for j, _ in float_outs], allow_unused=True)
        g64 = {j: g.double().numpy() for j, g in gs.items()}
        _, atol = self.op.tolerance("float32")
        for i, grad in zip(diff, grads, strict=True):
            name = self.args[i].name
            base = np.asarray(ref_in[i], dtype=np.float64)
            u = rng.standard_normal(base.shape)
            plus = list(ref_in)
            minus = list(ref_in)
            plus[i] = base + _FD_STEP * u
            minus[i] = base - _FD_STEP * u
            f_plus, _ = self.reference(plus)
            f_minus, _ = self.reference(minus)
            fd = 0.0
            fd_norm = 0.0
            for j in g64:
                ju = (np.asarray(f_plus[j], np.float64) - np.asarray(f_minus[j], np.float64)) / (2 * _FD_STEP)
                fd += float(np.sum(g64[j] * ju))
                fd_norm += float(np.sum((g64[j] * ju) ** 2))
            got = np.zeros(base.shape) if grad is None else grad.detach().double().numpy()
            if got.shape != base.shape:
                raise AssertionError(f"gradient of '{name}' has shape {got.shape}, the input {base.shape}")
            ad = float(np.sum(got * u))
            scale = abs(fd) + float(np.sqrt(fd_norm)) + float(np.linalg.norm(got * u))
            tol = self.grad_rtol * scale + atol * float(np.linalg.norm(u))
            if not abs(ad - fd) <= tol:
                raise AssertionError(
                    f"gradient of '{name}' disagrees with finite differences: for a random direction u "
                    f"and cotangent g, <g, J u> by central differences (h={_FD_STEP:g}) of the float64 "
                    f"reference = {fd:.8g}, autograd <grad_{name}, u> = {ad:.8g}; |diff| = "
                    f"{abs(ad - fd):.3g} > tolerance {tol:.3g} (rtol={self.grad_rtol:g}, atol={atol:g})"
                    + (" [autograd returned no gradient]" if grad is None else "")
                )


def _dtype_str(d: Any) -> str:
    """``"float32"`` for ``"float32"``, ``numpy.float32``, ``numpy.dtype("float32")`` or ``torch.float32``."""
    if isinstance(d, str):
        return d
    if type(d).__module__.partition(".")[0] == "torch":
        return str(d).rpartition(".")[2]
    return str(np.dtype(d).name)


def _fmt(idx: Any) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _as_tuple(result: Any, n: int, what: str) -> tuple[Any, ...]:
    if n == 0:
        return ()
    if n == 1:
        return (result,)
    if not isinstance(result, (tuple, list)) or len(result) != n:
        raise AssertionError(f"{what} returned {type(result).__name__}, expected a tuple of {n} results")
    return tuple(result)


def _small_case(op: OpDef, cases: Sequence[Case]) -> Case | None:
    """The smallest contiguous non-empty case, preferring ones whose tensors are at least 2-D."""
    def tensors(c: Case) -> list[np.ndarray]:
        return [to_numpy(c[a.name]) for a in op.schema.arguments
                if a.type.is_tensor and c[a.name] is not None]

    ok = [c for c in cases if c.get(NONCONTIGUOUS) is None and c.get(LAYOUT, "contiguous") == "contiguous"
          and all(t.size > 0 for t in tensors(c))]
    if not ok:
        return None
    wide = [c for c in ok if any(t.ndim >= 2 for t in tensors(c))]
    return min(wide or ok, key=lambda c: sum(t.size for t in tensors(c)))


def _run_opcheck(r: _Runner, case: Case, test_utils: Sequence[str] | None) -> None:
    import torch

    op = r.op
    r.where = _describe(op, case) + " (opcheck)"
    with r.checking("setup"):
        full, _ = r.materialize(case)
    grad = r.dtype == "float32" and op.backward is not None and not op.schema.is_mutating
    if grad:
        full = [v.detach().requires_grad_()
                if i in op.differentiable and v is not None and v.is_floating_point() else v
                for i, v in enumerate(full)]
    overload = getattr(getattr(torch.ops, op.library.namespace), op.name).default
    pos, kw = r.split(full)
    extra: dict[str, Any] = {} if test_utils is None else {"test_utils": tuple(test_utils)}
    with r.checking("opcheck"):
        torch.library.opcheck(overload, tuple(pos), kw or None, **extra)


def _run_compile(r: _Runner, case: Case, backend: str) -> None:
    import torch

    op = r.op
    r.where = _describe(op, case) + f" (torch.compile, backend={backend!r}, fullgraph=True)"
    exact = backend in ("eager", "aot_eager")
    with r.checking("setup"):
        full, _ = r.materialize(case)
    fn = op.call

    def run_op(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def same(got: Sequence[Any], want: Sequence[Any], what: str) -> None:
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            name = f"{what} {j}" if len(want) > 1 else what
            if exact:
                assert_close(g, w, rtol=0.0, atol=0.0, name=f"{name} (compiled vs eager, must be identical)")
            else:
                rtol, atol = op.tolerance(dtype_name(w))
                assert_close(g, w, rtol=rtol, atol=atol, name=f"{name} (compiled vs eager)")

    def copies() -> list[Any]:  # each run gets its own inputs: mutating ops change them
        return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in full]

    torch._dynamo.reset()
    try:
        with r.checking("compile"):
            compiled = torch.compile(run_op, fullgraph=True, backend=backend)
            full_c, full_e = copies(), copies()
            pos, kw = r.split(full_c)
            got = _as_tuple(compiled(*pos, **kw), len(op.schema.returns), op.name)
            want = r.call(full_e)
            same(got, want, "output")
            for i, a in enumerate(op.schema.arguments):
                if a.is_mutated and full_c[i] is not None:
                    same([full_c[i]], [full_e[i]], f"mutated argument '{a.name}'")
        if r.dtype == "float32" and op.backward is not None and not op.schema.is_mutating:
            with r.checking("compile_grad"):
                diff = [i for i in op.differentiable if full[i] is not None and full[i].is_floating_point()]
                rng = _rng(r.seed, op.qualname, "compile_grad")
                gs = [torch.from_numpy(rng.standard_normal(tuple(w.shape))).to(w.dtype)
                      for w in want if w.dtype.is_floating_point]
                results = []
                for runner in (compiled, run_op):
                    leaves = {i: full[i].detach().clone().requires_grad_() for i in diff}
                    args = [leaves.get(i, v) for i, v in enumerate(full)]
                    p, k = r.split(args)
                    outs = [o for o in _as_tuple(runner(*p, **k), len(op.schema.returns), op.name)
                            if o.dtype.is_floating_point]
                    gr = torch.autograd.grad(outs, [leaves[i] for i in diff], gs, allow_unused=True)
                    results.append([torch.zeros_like(leaves[i]) if g is None else g
                                    for i, g in zip(diff, gr, strict=True)])
                same(results[0], results[1], "gradient")
    finally:
        torch._dynamo.reset()


def check_op(
    op: Any,
    cases: Sequence[Mapping[str, Any]] | CaseHint | None = None,
    *,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    framework: str = "torch",
    check_grad: bool = True,
    check_opcheck: bool = True,
    check_compile: bool = True,
    sentinel: bool = True,
    compile_backend: str = "aot_eager",
    opcheck_test_utils: Sequence[str] | None = None,
    grad_rtol: float = 1e-3,
    seed: int = 0,
) -> CheckReport:
    """Run a declared op over a test matrix and check it against its reference.

    Parameters
    ----------
    op
        The op's public callable (e.g. ``opbridge.ops.rms_norm``) or its
        :class:`~opbridge.OpDef`.
    cases
        ``None`` for :func:`make_cases`; a list of case dicts (completed with
        schema defaults and used for every dtype); or a case generator
        ``(dtype, rng) -> list of cases``.
    dtypes
        Dtype names to run. ``framework="numpy"`` skips the ones NumPy lacks
        (bfloat16), noting them in the report's ``skipped``.
    framework
        ``"torch"`` (all checks) or ``"numpy"`` (forward, inputs_unchanged,
        sentinel and noncontiguous checks; imports no torch).
    check_grad
        Compare autograd gradients (float32) with finite differences of the
        reference, for ops that declare a ``backward``.
    check_opcheck
        Run ``torch.library.opcheck`` on one small case per dtype (with
        ``requires_grad`` inputs for float32 when the op has a backward).
    check_compile
        Compare ``torch.compile(fullgraph=True)`` with eager on one small case
        per dtype (and its gradients, for float32 with a backward).
    sentinel
        Run the guarded destination-passing kernel call of every case.
    compile_backend
        Backend for ``torch.compile``; ``"aot_eager"`` (default) compiles in
        seconds, ``"inductor"`` also exercises code generation around the op.
        With ``"eager"``/``"aot_eager"`` results must be bit-identical to eager.
    opcheck_test_utils
        ``test_utils`` for ``opcheck``; ``None`` for opcheck's default set.
    grad_rtol
        Relative tolerance of the directional-derivative comparison.
    seed
        Seed for generated values, directions and cotangents.

    Returns
    -------
    CheckReport
        Counts per check kind, so tests can assert what was covered.

    Raises
    ------
    AssertionError
        On the first failing check, naming the op, check, framework, dtype
        and case.
    ValueError
        On an unknown framework, or when no requested dtype can run.
    """
    opdef = _opdef(op)
    kit: _NumpyKit
    if framework == "torch":
        import opbridge.adapters.torch  # noqa: F401 - registers torch.ops.<ns>.<op>

        kit = _TorchKit()
    elif framework == "numpy":
        kit = _NumpyKit()
    else:
        raise ValueError(f"check_op: framework must be 'torch' or 'numpy', got {framework!r}")
    names = [_dtype_str(d) for d in dtypes]
    run = [d for d in names if d in kit.dtypes]
    report = CheckReport(op=opdef.qualname, framework=framework, dtypes=tuple(run))
    for d in names:
        if d not in kit.dtypes:
            report.skipped.append(f"dtype {d}: not supported by {framework}")
    if not run:
        raise ValueError(f"check_op({opdef.qualname}): none of the dtypes {list(names)} can run "
                         f"on {framework} (it supports {', '.join(kit.dtypes)})")
    runner = _Runner(opdef, kit, report, seed=seed, sentinel=sentinel, check_grad=check_grad,
                     grad_rtol=grad_rtol)
    for dtype in run:
        runner.dtype = dtype
        if cases is None:
            dcases = make_cases(opdef, dtype, seed)
        elif callable(cases):
            dcases = [_complete(opdef, c) for c in cases(dtype, _rng(seed, opdef.qualname, dtype))]
        else:
            dcases = [_complete(opdef, c) for c in cases]
        for i, case in enumerate(dcases):
            runner.run_case(i, case)
        if framework != "torch":
            continue
        small = _small_case(opdef, dcases)
        if small is None:
            if check_opcheck or check_compile:
                report.skipped.append(f"opcheck/compile ({dtype}): no contiguous non-empty case")
            continue
        if check_opcheck:
            _run_opcheck(runner, small, opcheck_test_utils)
        if check_compile:
            _run_compile(runner, small, compile_backend)
    if framework != "torch" and (check_grad or check_opcheck or check_compile):
        report.skipped.append("grad/opcheck/compile: torch only")
    return report
