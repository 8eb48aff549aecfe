"""Differential fuzzing of an op through a framework's call paths: :func:`fuzz_op` (needs hypothesis).

Where :func:`~opbridge.testing.check_op` runs an op's declared cases in a few
fixed layouts, :func:`fuzz_op` lets hypothesis draw the dtype, the case, its
values (the seed of the op's case generator) and, where the framework has
views, a memory layout per tensor (:mod:`opbridge.testing.layouts`). Its
checks, each run on its own draws:

``calls``
    Every call path (``ops.<op>``; in torch also ``torch.ops.<ns>.<op>``)
    against the float64 reference with the op's tolerances; inputs the op
    does not declare mutated unchanged; nothing outside any view written.
``out``
    ``out=`` buffers in those layouts too (frameworks with views).
``out_sharing``
    ``out=`` the very input, or a view overlapping it by 1 or 3 elements: the
    op of the inputs as they were before the call.
``scalars``
    Each ``int``, ``float`` or ``bool`` argument given as NumPy's scalar of
    the same value (same result bits), and given a wrong type (a bool for a
    number, a number for a bool, a float for an int, a string, None): a
    TypeError naming the op and the argument, nothing written (through
    ``ops.<op>``; ``torch.ops`` parses its arguments by torch's rules).
``bad_dtype``, ``bad_shape``
    One argument given another float dtype, or one more column, than the
    dispatching one: a TypeError or ValueError naming the op on every path,
    with nothing written. (An op whose float arguments may differ in dtype, or
    whose arguments' last dims may differ, leaves these checks out.)

::

    from opbridge.testing.fuzz import fuzz_op

    def test_scale_fuzzed():
        report = fuzz_op(myops.scale, "torch", examples=50)
        assert report.examples["calls"] == 50
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opbridge.cases import META_KEYS, CaseHint
from opbridge.declare import OpDef
from opbridge.testing.compare import assert_close
from opbridge.testing.generate import as_opdef, case_rng, complete_case, make_cases
from opbridge.testing.harness import get
from opbridge.testing.layouts import READ_LAYOUTS, WRITE_LAYOUTS, Memory, Placed, rounded

__all__ = ["CHECKS", "FuzzReport", "Fuzzer", "fuzz_op"]

CHECKS = ("calls", "out", "out_sharing", "bad_dtype", "bad_shape", "scalars")


@dataclass
class FuzzReport:
    """What :func:`fuzz_op` ran: examples per check, and the checks it could not run, with why."""

    op: str
    framework: str
    examples: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)


class Skip(Exception):  # noqa: N818 - a signal, not an error
    """This check cannot run here (the reason is the message)."""


class Fuzzer:
    """The checks of :func:`fuzz_op` for one op, framework (harness name) and device."""

    def __init__(self, op: Any, framework: str = "numpy", device: str = "cpu", cases: CaseHint | None = None) -> None:
        self.op: OpDef = as_opdef(op)
        self.hint = cases
        self.h = get(framework)
        self.framework = framework
        self.mem = Memory(self.h, device)
        self.args = self.op.schema.arguments

    # -- what can run ---------------------------------------------------------------------

    def cases(self, dtype: str, seed: int = 0) -> list[dict[str, Any]]:
        """The op's cases for *dtype* (its declared ones, or the generator given), without layout keys."""
        if self.hint is None:
            raw = make_cases(self.op, dtype, seed)
        else:
            raw = [complete_case(self.op, c) for c in self.hint(dtype, case_rng(seed, self.op.qualname, dtype))]
        return [c for c in raw if not any(k in c for k in META_KEYS)]

    def dtypes(self) -> list[str]:
        have = set(self.h.dtypes)
        if self.framework == "numpy":
            try:
                import ml_dtypes  # noqa: F401  (NumPy's bfloat16, as JAX spells it)

                have.add("bfloat16")
            except ImportError:
                pass
        return [d for d in self.op.dtypes if d in have]

    def skip_reason(self) -> str | None:
        """Why this framework cannot hold the op's arguments at all, or None."""
        reason = self.h.skip_reason()
        if reason is not None:
            return reason
        dtypes = self.dtypes()
        if not dtypes:
            return f"{self.framework} has none of {self.op.name}'s dtypes {self.op.dtypes}"
        ints = {str(v.dtype) for c in self.cases(dtypes[0]) for v in c.values()
                if isinstance(v, np.ndarray) and v.dtype.kind in "iu"}
        if not ints <= set(self.h.dtypes):  # int64 in JAX without jax_enable_x64
            return f"{self.framework} has no {sorted(ints - set(self.h.dtypes))}, which {self.op.name}'s cases take"
        return None

    def invoke(self, call: Callable[..., Any], args: Sequence[Any], **extra: Any) -> Any:
        """*call* on the schema-ordered *args*, keyword-only ones by name."""
        pos = [v for a, v in zip(self.args, args) if not a.kwarg_only]
        kw = {a.name: v for a, v in zip(self.args, args) if a.kwarg_only}
        return call(*pos, **kw, **extra)

    def paths(self) -> list[tuple[str, Callable[..., Any]]]:
        paths: list[tuple[str, Callable[..., Any]]] = [(f"{self.framework} ops.{self.op.name}", self.op.call)]
        if self.framework == "torch":
            import torch

            packet = getattr(getattr(torch.ops, self.op.library.namespace), self.op.name)
            paths.append((f"torch.ops.{self.op.library.namespace}.{self.op.name}", packet))
        return paths

    # -- drawing ----------------------------------------------------------------------------

    def draw_call(self, data: Any, with_out: bool = False) -> tuple[str, dict[str, Any], dict[str, str],
                                                                    dict[str, str]]:
        """(dtype, case, layout per tensor argument, layout per output) drawn from hypothesis *data*."""
        from hypothesis import strategies as st

        dtype = data.draw(st.sampled_from(self.dtypes()), label="dtype")
        seed = data.draw(st.integers(0, 2**20), label="seed")
        case = data.draw(st.sampled_from(self.cases(dtype, seed)), label="case")
        layouts: dict[str, str] = {}
        out_layouts: dict[str, str] = {}
        if len(self.mem.layouts) > 1:
            for a in self.args:
                v = case[a.name]
                if a.type.is_tensor and isinstance(v, np.ndarray):
                    choices = [lay for lay in (WRITE_LAYOUTS if a.is_mutated else READ_LAYOUTS)
                               if self.mem.usable(lay, tuple(v.shape))]
                    layouts[a.name] = data.draw(st.sampled_from(choices), label=f"layout of {a.name}")
            if with_out:
                for j, spec in enumerate(self.op.output_specs([case[a.name] for a in self.args])):
                    shape = tuple(int(s) for s in spec.shape)
                    choices = [lay for lay in WRITE_LAYOUTS if self.mem.usable(lay, shape)]
                    out_layouts[str(j)] = data.draw(st.sampled_from(choices), label=f"layout of out[{j}]")
        return dtype, case, layouts, out_layouts

    def _placed_args(self, case: dict[str, Any], dtypes: dict[str, str | None],
                     layouts: dict[str, str]) -> tuple[list[Placed | None], list[Any]]:
        placed: list[Placed | None] = []
        for a in self.args:
            v = case[a.name]
            placed.append(self.mem.place(a.name, v, dtypes[a.name], layouts.get(a.name, "contiguous"))
                          if a.type.is_tensor and isinstance(v, np.ndarray) else None)
        return placed, [p.view if p is not None else case[a.name] for p, a in zip(placed, self.args)]

    def _float_dtypes(self, case: dict[str, Any], dtype: str) -> dict[str, str | None]:
        return {n: dtype if isinstance(v, np.ndarray) and v.dtype.kind == "f" else None for n, v in case.items()}

    # -- the checks -----------------------------------------------------------------------------

    def check_call(self, dtype: str, case: dict[str, Any], layouts: dict[str, str], out_layouts: dict[str, str],
                   label: str, call: Callable[..., Any]) -> None:
        """One call in these layouts against the reference; unchanged inputs; nothing written outside views."""
        op, mem = self.op, self.mem
        placed, args = self._placed_args(case, self._float_dtypes(case, dtype), layouts)
        ref_args = [mem.np64(x) if p is not None else x for p, x in zip(placed, args)]
        ref_copy = [a.copy() if isinstance(a, np.ndarray) else a for a in ref_args]  # the reference writes these
        ref = _as_list(self.reference(ref_copy))
        mutated = [i for i, a in enumerate(self.args) if a.is_mutated]
        out_placed: list[Placed] = []
        kwargs: dict[str, Any] = {}
        if out_layouts:
            for j, spec in enumerate(op.output_specs(args)):
                name = str(spec.dtype).split(".")[-1].lower()  # the framework's dtype: torch.float32, Float32
                floating = name.startswith(("float", "bfloat"))
                zeros = np.zeros(tuple(int(s) for s in spec.shape), np.float64 if floating else name)
                out_placed.append(mem.place(f"out[{j}]", zeros, name, out_layouts[str(j)]))
            kwargs["out"] = out_placed[0].view if len(out_placed) == 1 else tuple(p.view for p in out_placed)
        where = (f"{label} {op.name} {dtype} layouts {layouts or 'contiguous'}"
                 + (f" out= {out_layouts}" if out_layouts else "")
                 + f" shapes {[tuple(v.shape) for v in case.values() if isinstance(v, np.ndarray)]}")
        outs = _as_list(self.invoke(call, args, **kwargs))
        written = [args[i] for i in mutated] if self.h.mutates_in_place else outs[:len(mutated)]
        outs = outs if self.h.mutates_in_place else outs[len(mutated):]
        assert len(outs) == len(ref), f"{where}: {len(outs)} results, the reference gives {len(ref)}"
        rtol, atol = op.tolerance(dtype)
        for k, (g, w) in enumerate(zip(outs, ref)):
            assert_close(mem.np64(g), rounded(w, dtype), rtol=rtol, atol=atol, name=f"{where}: result {k}")
        for i, g in zip(mutated, written):
            if ref_copy[i] is not None:
                assert_close(mem.np64(g), rounded(ref_copy[i], dtype), rtol=rtol, atol=atol,
                             name=f"{where}: mutated '{self.args[i].name}'")
        for j, p in enumerate(out_placed):
            assert_close(mem.np64(p.view), rounded(ref[j], dtype), rtol=rtol, atol=atol, name=f"{where}: out= {j}")
        for i, (q, x) in enumerate(zip(placed, ref_args)):
            if q is None:
                continue
            if i not in mutated:
                assert _same(mem.np64(q.view), x), f"{where}: input '{q.name}' ({q.layout}) was changed"
            mem.check_around(q, f"{where}: argument")
        for p in out_placed:
            mem.check_around(p, f"{where}: out=")

    def corrupt(self, case: dict[str, Any], dtype: str, how: str) -> tuple[dict[str, Any], str, str] | None:
        """*case* with one tensor argument made inconsistent with the dispatching one, or None.

        ``dtype``: a float argument gets another float dtype; ``shape``: an
        argument whose last dim is the lead's gets one more column. Returns the
        case, the argument's name and the dtype it takes.
        """
        lead = case[self.args[self.op.dtype_arg].name]
        floats = [d for d in ("float32", "float64", "float16") if d != dtype and d in self.h.dtypes]
        for i, a in enumerate(self.args):
            v = case[a.name]
            if i == self.op.dtype_arg or not a.type.is_tensor or not isinstance(v, np.ndarray) or not v.size:
                continue
            if how == "dtype" and v.dtype.kind == "f" and floats:
                return case, a.name, floats[0]
            if how == "shape" and v.ndim and lead.ndim and v.shape[-1] == lead.shape[-1] and v.dtype.kind == "f":
                return {**case, a.name: np.concatenate([v, v[..., :1]], axis=-1)}, a.name, dtype
        return None

    def check_bad_input(self, dtype: str, case: dict[str, Any], layouts: dict[str, str], how: str) -> bool:
        """A named TypeError or ValueError on every path, nothing written; False where *case* cannot be corrupted."""
        bad = self.corrupt(case, dtype, how)
        if bad is None:
            return False
        case, name, bad_dtype = bad
        layouts = {k: v for k, v in layouts.items() if k != name or self.mem.usable(v, tuple(case[name].shape))}
        dtypes = {**self._float_dtypes(case, dtype), name: bad_dtype}
        for label, call in self.paths():
            placed, args = self._placed_args(case, dtypes, layouts)
            before = [None if p is None else self.mem.np64(p.view) for p in placed]
            where = f"{label} {self.op.name} {dtype}, '{name}' given {how} {bad_dtype} {case[name].shape}, " \
                    f"layouts {layouts}"
            try:
                self.invoke(call, args)
            except (TypeError, ValueError) as e:
                assert self.op.name in str(e), f"{where}: the error does not name the op: {e}"
            else:
                raise AssertionError(f"{where}: no error")
            for p, was in zip(placed, before):
                if p is not None and was is not None:
                    assert _same(self.mem.np64(p.view), was), f"{where}: '{p.name}' ({p.layout}) was written " \
                                                              f"by a call that raised"
                    self.mem.check_around(p, f"{where}: argument")
        return True

    def check_scalars(self, dtype: str, case: dict[str, Any], layouts: dict[str, str]) -> bool:
        """NumPy scalars give the plain value's bits; wrong types raise a named TypeError, nothing written.

        False where the op has no int, float or bool argument.
        """
        scalars = [a for a in self.args if not a.type.is_tensor and not a.type.is_list
                   and a.type.base in ("int", "float", "bool") and case[a.name] is not None]
        if not scalars:
            return False
        dtypes = self._float_dtypes(case, dtype)
        for n, (label, call) in enumerate(self.paths()):
            _, args = self._placed_args(case, dtypes, layouts)
            want = [self.mem.np64(x) for x in _written_or_results(self, args, self.invoke(call, args))]
            for a in scalars:
                v = case[a.name]
                same = {"int": np.int64, "float": np.float64, "bool": None}[a.type.base]
                if same is not None:
                    _, args = self._placed_args({**case, a.name: same(v)}, dtypes, layouts)
                    got = [self.mem.np64(x) for x in _written_or_results(self, args, self.invoke(call, args))]
                    assert all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want)), \
                        f"{label} {self.op.name}: '{a.name}' = {type(same(v)).__name__}({v!r}) gives other results " \
                        f"than {v!r}"
                if n:  # torch.ops.<ns>.<op> parses its arguments by torch's own rules
                    continue
                wrong: list[Any] = ["4"] + ([] if a.type.optional else [None])
                by_type: dict[str, list[Any]] = {"int": [True, float(v) + 0.5], "float": [True], "bool": [1]}
                wrong += by_type[a.type.base]
                for w in wrong:
                    placed, args = self._placed_args({**case, a.name: w}, dtypes, layouts)
                    before = [None if p is None else self.mem.np64(p.view) for p in placed]
                    where = f"{label} {self.op.name} {dtype}: '{a.name}' = {w!r} ({a.type})"
                    try:
                        self.invoke(call, args)
                    except TypeError as e:
                        assert self.op.name in str(e) and a.name in str(e), \
                            f"{where}: the TypeError does not name the op and the argument: {e}"
                    else:
                        raise AssertionError(f"{where}: no TypeError")
                    for p, was in zip(placed, before):
                        if p is not None and was is not None:
                            assert _same(self.mem.np64(p.view), was), f"{where}: '{p.name}' was written by a call " \
                                                                      f"that raised"
        return True

    def check_out_sharing(self, dtype: str, case: dict[str, Any], shift: int) -> bool:
        """``out=`` overlapping an input by *shift* elements gives the op of the inputs as they were.

        False where no input has the first output's shape and a float dtype.
        """
        op, mem = self.op, self.mem
        args = [mem.array(v.copy(), dtype if v.dtype.kind == "f" else None) if isinstance(v, np.ndarray) else v
                for v in (case[a.name] for a in self.args)]
        specs = op.output_specs(args)
        shape = tuple(int(s) for s in specs[0].shape)
        shared = next((i for i, a in enumerate(self.args) if isinstance(case[a.name], np.ndarray)
                       and case[a.name].shape == shape and case[a.name].dtype.kind == "f" and case[a.name].size),
                      None)
        if shared is None:
            return False
        name = self.args[shared].name
        views = mem.shared([case[name], np.zeros(shape)], dtype, shift)
        if views is None:
            raise Skip(f"{self.framework}: a reshape of a slice copies, so views cannot overlap")
        args[shared], out0 = views
        ref = _as_list(self.reference([mem.np64(x) if isinstance(case[a.name], np.ndarray) else x
                                       for a, x in zip(self.args, args)]))
        outs = [out0] + [mem.array(np.zeros(tuple(int(s) for s in sp.shape)), dtype) for sp in specs[1:]]
        self.invoke(op.call, args, out=outs[0] if len(outs) == 1 else tuple(outs))
        rtol, atol = op.tolerance(dtype)
        where = f"{self.framework} {op.name} {dtype}: out= {'is' if shift == 0 else f'{shift} element(s) past'} " \
                f"'{name}'"
        for k, (o, w) in enumerate(zip(outs, ref)):
            assert_close(mem.np64(o), rounded(w, dtype), rtol=rtol, atol=atol, name=f"{where}: out {k}")
        return True

    def reference(self, args: Sequence[Any]) -> Any:
        if self.op.reference is None:
            raise Skip(f"{self.op.qualname} declares no reference implementation")
        return self.op.reference(*args)

    def check_skip_reason(self, check: str) -> str | None:
        """Why *check* cannot run for this op and framework at all, or None."""
        reason = self.skip_reason()
        if reason is None and check in ("out", "out_sharing"):
            if not self.op.accepts_out:
                return f"{self.op.name} takes no out="
            if len(self.mem.layouts) == 1:
                return f"{self.framework}: no views to place out= in" + (" (and no out=)" if self.framework == "jax"
                                                                          else "")
        return reason

    def run_check(self, check: str, data: Any) -> bool:
        """One example of *check* from hypothesis *data*; False where the draw gave nothing to check."""
        from hypothesis import strategies as st

        if check == "out_sharing":
            dtype, case, _, _ = self.draw_call(data)
            return self.check_out_sharing(dtype, case, data.draw(st.sampled_from([0, 1, 3]), label="shift"))
        dtype, case, layouts, out_layouts = self.draw_call(data, with_out=check == "out")
        if check in ("bad_dtype", "bad_shape"):
            return self.check_bad_input(dtype, case, layouts, check[4:])
        if check == "scalars":
            return self.check_scalars(dtype, case, layouts)
        for label, call in self.paths() if check == "calls" else self.paths()[:1]:
            self.check_call(dtype, case, layouts, out_layouts, label, call)
        return True


def fuzz_op(op: Any, framework: str = "numpy", *, examples: int = 25, checks: Sequence[str] = CHECKS,
            cases: CaseHint | None = None, device: str = "cpu", derandomize: bool = True) -> FuzzReport:
    """Fuzz *op* in *framework* (see the module docstring); raises AssertionError on the first failure.

    Parameters
    ----------
    op
        The op's public callable or its :class:`~opbridge.OpDef`.
    framework
        ``numpy``, ``torch``, ``jax``, ``paddle`` or ``mindspore``.
    examples
        Examples per check.
    checks
        A subset of :data:`CHECKS`.
    cases
        A case generator ``(dtype, rng) -> list of cases`` instead of the op's
        declared one (as :func:`~opbridge.testing.check_op` takes); hypothesis
        draws the generator's seed and one of its cases.
    device
        torch only: ``cuda`` places every tensor on the GPU.
    derandomize
        The same examples every run (for CI); False draws new ones.

    Returns
    -------
    FuzzReport
        Examples run per check, and the checks that could not run here, with why.
    """
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ImportError("opbridge.testing.fuzz needs hypothesis: pip install hypothesis") from None
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"fuzz_op: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    fuzzer = Fuzzer(op, framework, device, cases)
    report = FuzzReport(fuzzer.op.qualname, framework)
    for check in checks:
        reason = fuzzer.check_skip_reason(check)
        if reason is not None:
            report.skipped[check] = reason
            continue

        try:
            _runner(fuzzer, report, check, examples, derandomize)()
        except Skip as e:
            report.skipped[check] = str(e)
        if not report.examples[check] and check not in report.skipped:
            report.skipped[check] = {"scalars": f"{fuzzer.op.name} has no int, float or bool argument",
                                     "out_sharing": "no drawn case had a float input shaped like the first output",
                                     }.get(check, "no drawn case had an argument to make inconsistent")
    return report


def _runner(fuzzer: Fuzzer, report: FuzzReport, check: str, examples: int, derandomize: bool) -> Callable[[], None]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data())
    def run(data: Any) -> None:
        if fuzzer.run_check(check, data):
            report.examples[check] += 1

    return run  # type: ignore[no-any-return]


def _written_or_results(f: Fuzzer, args: Sequence[Any], result: Any) -> list[Any]:
    """What a call gives: the arguments it writes (in place, or returned first), then its results."""
    outs = _as_list(result)
    if f.h.mutates_in_place:
        outs = [args[i] for i, a in enumerate(f.args) if a.is_mutated and args[i] is not None] + outs
    return [o for o in outs if o is not None]


def _as_list(result: Any) -> list[Any]:
    return [] if result is None else list(result) if isinstance(result, tuple) else [result]


def _same(now: np.ndarray, was: np.ndarray) -> bool:
    return bool(np.all((now == was) | (np.isnan(now) & np.isnan(was)) if now.dtype.kind == "f" else now == was))
