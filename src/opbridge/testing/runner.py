"""The per-case checks of the test matrix: :class:`Runner` and its :class:`CheckReport`.

A :class:`Runner` holds one op, one framework kit (:mod:`opbridge.testing.kits`)
and the dtype being run; :meth:`Runner.run_case` materialises a case as
framework arrays (sliced or non-contiguous when the case asks) and runs the
forward, inputs-unchanged, sentinel, non-contiguous and (float32, where the
framework differentiates) gradient checks on it. Every
check runs inside :meth:`Runner.checking`, which counts it in the report and
turns a failure into an :class:`AssertionError` naming the op, the check, the
framework, the dtype and the case.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, NONCONTIGUOUS
from opbridge.declare import OpDef
from opbridge.testing.compare import assert_close, to_numpy
from opbridge.testing.kits import NumpyKit, dtype_str, is_float_np
from opbridge.testing.tolerances import result_tolerance

__all__ = ["CheckReport", "Runner", "as_tuple", "describe", "fmt_index"]

_GUARD = 64  # sentinel elements before and after each guarded array


@dataclass
class CheckReport:
    """What :func:`check_op` checked.

    Attributes
    ----------
    op
        The op's qualname.
    framework
        ``"torch"``, ``"numpy"``, ``"jax"``, ``"paddle"`` or ``"mindspore"``.
    dtypes
        The dtypes that were run.
    cases
        Number of (dtype, case) pairs run.
    checks
        Count per check kind: ``forward``, ``inputs_unchanged``, ``sentinel``,
        ``grad``, ``noncontiguous``, ``rows``, ``compile`` (the framework's graph
        mode), ``compile_grad``, and in torch ``opcheck`` and ``gradcheck``.
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


def describe(op: OpDef, case: Mapping[str, Any]) -> str:
    parts = []
    nc = case.get(NONCONTIGUOUS)
    for a in op.schema.arguments:
        v = case.get(a.name)
        if a.type.is_tensor and v is not None:
            arr = to_numpy(v)
            text = f"{a.name}: shape {tuple(arr.shape)}"
            if not is_float_np(arr):
                text += f" {arr.dtype}"
            if nc == a.name:
                text += " non-contiguous"
            parts.append(text)
        else:
            parts.append(f"{a.name}={v!r}")
    layout = case.get(LAYOUT, "contiguous")
    suffix = " [sliced: tensors are slices at odd offsets of larger buffers]" if layout == "sliced" else ""
    return ", ".join(parts) + suffix


class Runner:
    def __init__(self, op: OpDef, kit: NumpyKit, report: CheckReport, *, seed: int, sentinel: bool,
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

    def call(self, full: Sequence[Any]) -> tuple[tuple[Any, ...], dict[int, Any]]:
        """The op's public callable on *full*: (its outputs, the arguments it wrote by index)."""
        pos, kw = self.op.schema.split(full)
        return self.results(self.op.call(*pos, **kw), full)

    def results(self, result: Any, full: Sequence[Any]) -> tuple[tuple[Any, ...], dict[int, Any]]:
        """A call's *result* on *full* as (outputs, written arguments by index): the arguments themselves
        where the framework writes in place, else the new values it returns first (JAX)."""
        n = len(self.op.schema.returns)
        mutated = [i for i, a in enumerate(self.args) if a.is_mutated]
        if self.kit.writes_in_place or not mutated:
            return as_tuple(result, n, self.op.name), {i: full[i] for i in mutated if full[i] is not None}
        values = tuple(result) if isinstance(result, (tuple, list)) else (result,)  # (new values..., returns...)
        if len(values) != len(mutated) + n:
            raise AssertionError(f"{self.op.name} returned {len(values)} values, expected the new values of its "
                                 f"{len(mutated)} mutated argument(s), then its {n} return(s)")
        return values[len(mutated):], {i: v for i, v in zip(mutated, values, strict=False) if v is not None}

    def reference(self, ref_args: Sequence[Any]) -> tuple[tuple[Any, ...], dict[int, np.ndarray]]:
        if self.op.reference is None:
            raise ValueError(f"{self.op.qualname} declares no reference implementation")
        args = [a.copy() if isinstance(a, np.ndarray) else a for a in ref_args]
        res = as_tuple(self.op.reference(*args), len(self.op.schema.returns), f"{self.op.name} reference")
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
                x = kit.every_other(x)
            elif sliced:
                n = kit.numel(x)
                lo = 1 + 2 * k  # odd element offsets: the data is not aligned to its dtype's vector width
                buf, x = kit.guarded(x, lo, lo + n + 3)
                padded.append((a.name, buf, lo, lo + n))
            full.append(x)
            k += 1
        return full, padded

    def ref_inputs(self, full: Sequence[Any]) -> list[Any]:
        return [self.kit.to_np64(v) if a.type.is_tensor and v is not None else v
                for a, v in zip(self.args, full, strict=True)]

    def snapshot(self, full: Sequence[Any]) -> list[np.ndarray | None]:
        """The values of the tensors the op must not write (None for the others), to compare after a call."""
        return [self.kit.to_np64(v) if a.type.is_tensor and v is not None and not a.is_mutated else None
                for a, v in zip(self.args, full, strict=True)]

    # -- checks -----------------------------------------------------------------

    def run_case(self, index: int, case: Mapping[str, Any]) -> None:
        self.where = describe(self.op, case)
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
            before = self.snapshot(full)
            outs, written = self.call(full)
            self.compare_results(full, outs, written, expected, expected_mut)
        with self.checking("inputs_unchanged"):
            self.check_unchanged(full, before, padded)
        if (self.check_grad and self.kit.differentiates and self.dtype == "float32"
                and self.op.backward is not None and not self.op.schema.is_mutating
                and all(self.kit.numel(v) > 0 for a, v in zip(self.args, full, strict=True)
                        if a.type.is_tensor and v is not None)):
            with self.checking("grad"):
                self.check_gradients(index, full, ref_in)

    def compare_results(self, full: Sequence[Any], outs: Sequence[Any], written: Mapping[int, Any],
                        expected: Sequence[np.ndarray], expected_mut: Mapping[int, np.ndarray]) -> None:
        lead = full[self.op.dispatch_arg]
        for j, (act, exp) in enumerate(zip(outs, expected, strict=True)):  # smaller than the lead: a sum over it
            self.compare(act, exp, self._return_name(j), against="the float64 reference", lead=lead)
        for i, exp in expected_mut.items():
            if i not in written:
                raise AssertionError(f"mutated argument '{self.args[i].name}': the call gave no new value")
            self.compare(written[i], exp, f"mutated argument '{self.args[i].name}'",
                         against="the float64 reference")

    def _return_name(self, j: int) -> str:
        r = self.op.schema.returns[j]
        if len(self.op.schema.returns) == 1:
            return "output"
        return f"output {j}" + (f" ({r.name})" if r.name else "")

    def compare(self, actual: Any, expected64: np.ndarray, what: str, against: str, lead: Any = None) -> None:
        exp = self.kit.round_to(expected64, actual) if self.kit.is_float(actual) else expected64
        dname = dtype_str(actual.dtype)
        rtol, atol = self.op.tolerance(dname) if lead is None else result_tolerance(self.op, dname, expected64, lead)
        assert_close(self.kit.to_np64(actual), exp, rtol=rtol, atol=atol, dtype=dname, name=f"{what} vs {against}")

    def check_unchanged(self, full: Sequence[Any], before: Sequence[np.ndarray | None],
                        padded: Sequence[tuple[str, Any, int, int]]) -> None:
        for a, now, was in zip(self.args, full, before, strict=True):
            if was is None:
                continue
            x, y = self.kit.to_np64(now), was
            same = (x == y) | (np.isnan(x) & np.isnan(y)) if is_float_np(x) else (x == y)
            if not np.all(same):
                bad = np.argwhere(~same)
                raise AssertionError(
                    f"input '{a.name}' was modified by an op that does not declare it mutated "
                    f"({len(bad)} of {x.size} elements changed, first at {fmt_index(bad[0])}: "
                    f"{y[tuple(bad[0])].item()!r} -> {x[tuple(bad[0])].item()!r}); write to outputs only, "
                    f"or declare it Tensor(a!)"
                )
        for name, buf, lo, hi in padded:
            self.check_guards(buf, lo, hi, f"input '{name}'")

    def check_guards(self, buf: Any, lo: int, hi: int, what: str) -> None:
        whole = self.kit.to_np64(buf)
        fill = self.kit.to_np64(self.kit.empty_filled(1, self.kit.dtype_of(buf)))[0]
        for region, part, base in (("before", whole[:lo], 0), ("after", whole[hi:], hi)):
            intact = np.isnan(part) if is_float_np(whole) and np.isnan(fill) else part == fill
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
            buf, view = kit.guarded(v, _GUARD, _GUARD + n + _GUARD)
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
        tensors = {i for i, a in enumerate(self.args) if a.type.is_tensor and gargs[i] is not None}
        kern(*map(kit.kernel_arg, outs), *(kit.kernel_arg(v) if i in tensors else v for i, v in enumerate(gargs)))
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
                    f"(still hold the NaN sentinel; first at {fmt_index(bad[0])}, expected "
                    f"{exp[tuple(bad[0])].item()!r}); the kernel must write every output element"
                )

    def check_noncontiguous(self, case: Mapping[str, Any]) -> None:
        """A non-contiguous argument is either refused clearly or computed right.

        Refused: a ``ValueError`` naming the op. Accepted (issue 11: ops take
        any strides): outputs, and mutated arguments updated in place, match
        the reference, and the other inputs are unchanged.
        """
        name = case[NONCONTIGUOUS]
        with self.checking("setup"):
            full, _ = self.materialize(case)
        with self.checking("reference"):
            expected, expected_mut = self.reference(self.ref_inputs(full))
        with self.checking("noncontiguous"):
            before = self.snapshot(full)
            try:
                outs, written = self.call(full)
            except ValueError as exc:
                if self.op.name not in str(exc):
                    raise AssertionError(
                        f"non-contiguous '{name}' raised ValueError, but its message does not name "
                        f"the op {self.op.name!r}: {exc}"
                    ) from None
                return
            try:
                self.compare_results(full, outs, written, expected, expected_mut)
                self.check_unchanged(full, before, ())
            except AssertionError as exc:
                raise AssertionError(
                    f"non-contiguous '{name}' was accepted, but the results are wrong; a kernel that "
                    f"indexes raw memory must read the strides or reject the input with ValueError "
                    f"naming the op (OPB_CHECK_CONTIGUOUS(op, {name})):\n{_indent(str(exc))}"
                ) from None

    def check_gradients(self, index: int, full: Sequence[Any], ref_in: Sequence[Any]) -> None:
        from opbridge.testing.gradients import check_directional

        check_directional(self, index, full, ref_in)


def fmt_index(idx: Any) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def as_tuple(result: Any, n: int, what: str) -> tuple[Any, ...]:
    if n == 0:
        return ()
    if n == 1:
        return (result,)
    if not isinstance(result, (tuple, list)) or len(result) != n:
        raise AssertionError(f"{what} returned {type(result).__name__}, expected a tuple of {n} results")
    return tuple(result)
