"""The drawing and the valid-call checks of :func:`opbridge.testing.fuzz.fuzz_op`: :class:`Fuzzer`.

A :class:`Fuzzer` holds one op, framework (harness) and device: which dtypes
and cases it can draw, the call paths, and the checks of calls that must
succeed (``calls``, ``out``, ``out_sharing``). The checks of calls that must
fail are in :mod:`opbridge.testing.fuzz_errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opbridge.cases import META_KEYS, CaseHint
from opbridge.declare import OpDef
from opbridge.errors import OpbridgeError
from opbridge.testing.compare import assert_close, dtype_name
from opbridge.testing.generate import as_opdef, case_rng, complete_case, held_cases, make_cases
from opbridge.testing.harness import get
from opbridge.testing.layouts import READ_LAYOUTS, WRITE_LAYOUTS, Memory, Placed, rounded
from opbridge.testing.tolerances import result_tolerance

__all__ = ["Fuzzer", "Skip", "add_note", "as_list", "compared_dtype", "same_values", "written_or_results"]


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
        #: The arguments some drawn case gave a value other than None (for ``Tensor?`` ones never given a tensor).
        self.given: set[str] = set()

    # -- what can run ---------------------------------------------------------------------

    def cases(self, dtype: str, seed: int = 0) -> list[dict[str, Any]]:
        """The op's cases for *dtype* (its declared ones, or the generator given) that this framework can
        hold (:func:`~opbridge.testing.generate.held_cases`), without layout keys."""
        return held_cases(self.op, self._cases(dtype, seed), self.h.dtypes)[0]

    def _cases(self, dtype: str, seed: int) -> list[dict[str, Any]]:
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
        why = held_cases(self.op, self._cases(dtypes[0], 0), self.h.dtypes)[1]  # int64 in JAX without x64
        return None if why is None else f"{self.framework} has {why}"

    def invoke(self, call: Callable[..., Any], args: Sequence[Any], **extra: Any) -> Any:
        """*call* on the schema-ordered *args*, keyword-only ones by name."""
        pos, kw = self.op.schema.split(args)
        return call(*pos, **kw, **extra)

    def paths(self) -> list[tuple[str, Callable[..., Any]]]:
        paths: list[tuple[str, Callable[..., Any]]] = [(f"{self.framework} ops.{self.op.name}", self.op.call)]
        if self.framework == "torch":
            import torch

            packet = getattr(getattr(torch.ops, self.op.library.namespace), self.op.name)
            paths.append((f"torch.ops.{self.op.library.namespace}.{self.op.name}", packet))
        return paths

    def first_call(self) -> None:
        """Build and load the op's module, and make one valid call on every path, before hypothesis draws.

        A kernel that does not compile (:class:`~opbridge.errors.BuildError`), one whose signature
        does not match its schema (:class:`~opbridge.errors.DeclarationError`), or an op that cannot
        run here raises that error now, once, rather than in every example and every shrink step of
        every check (a failed build is not cached, so each call would compile again). Any other error
        of this valid call is an AssertionError saying so.
        """
        dtypes = self.dtypes()
        cases = self.cases(dtypes[0], 0) if dtypes else []
        if not cases:
            return
        dtype, case = dtypes[0], cases[0]
        shapes = [tuple(v.shape) for v in case.values() if isinstance(v, np.ndarray)]
        where = f"{self.framework} {self.op.name} {dtype} shapes {shapes}"
        try:
            for label, call in self.paths():
                where = f"{label} {self.op.name} {dtype} shapes {shapes}"
                _, args = self.placed_args(case, self.float_dtypes(case, dtype), {})
                self.invoke(call, args)
        except OpbridgeError as e:  # cannot build, load or run the op: no check can run
            add_note(e, f"fuzz_op: raised by a first, valid call ({where}), before any check ran")
            raise
        except Exception as e:
            raise AssertionError(f"{where}: a valid call (contiguous inputs, the op's first case) raised "
                                 f"{type(e).__name__}: {e}") from e

    # -- drawing ----------------------------------------------------------------------------

    def draw_call(self, data: Any, with_out: bool = False) -> tuple[str, dict[str, Any], dict[str, str],
                                                                    dict[str, str]]:
        """(dtype, case, layout per tensor argument, layout per output) drawn from hypothesis *data*."""
        from hypothesis import strategies as st

        dtype = data.draw(st.sampled_from(self.dtypes()), label="dtype")
        seed = data.draw(st.integers(0, 2**20), label="seed")
        case = data.draw(st.sampled_from(self.cases(dtype, seed)), label="case")
        self.given.update(n for n, v in case.items() if v is not None)
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

    def placed_args(self, case: dict[str, Any], dtypes: dict[str, str | None],
                     layouts: dict[str, str]) -> tuple[list[Placed | None], list[Any]]:
        placed: list[Placed | None] = []
        for a in self.args:
            v = case[a.name]
            placed.append(self.mem.place(a.name, v, dtypes[a.name], layouts.get(a.name, "contiguous"))
                          if a.type.is_tensor and isinstance(v, np.ndarray) else None)
        return placed, [p.view if p is not None else case[a.name] for p, a in zip(placed, self.args)]

    def float_dtypes(self, case: dict[str, Any], dtype: str) -> dict[str, str | None]:
        return {n: dtype if isinstance(v, np.ndarray) and v.dtype.kind == "f" else None for n, v in case.items()}

    # -- the checks -----------------------------------------------------------------------------

    def check_call(self, dtype: str, case: dict[str, Any], layouts: dict[str, str], out_layouts: dict[str, str],
                   label: str, call: Callable[..., Any]) -> None:
        """One call in these layouts against the reference; unchanged inputs; nothing written outside views."""
        op, mem = self.op, self.mem
        placed, args = self.placed_args(case, self.float_dtypes(case, dtype), layouts)
        ref_args = [mem.np64(x) if p is not None else x for p, x in zip(placed, args)]
        ref_copy = [a.copy() if isinstance(a, np.ndarray) else a for a in ref_args]  # the reference writes these
        ref = as_list(self.reference(ref_copy))
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
        outs = as_list(self.invoke(call, args, **kwargs))
        written = [args[i] for i in mutated] if self.h.mutates_in_place else outs[:len(mutated)]
        outs = outs if self.h.mutates_in_place else outs[len(mutated):]
        assert len(outs) == len(ref), f"{where}: {len(outs)} results, the reference gives {len(ref)}"
        rtol, atol = op.tolerance(dtype)
        lead = ref_args[op.dispatch_arg]
        for k, (g, w) in enumerate(zip(outs, ref)):  # a result smaller than the lead sums over it (dw)
            rt, at = result_tolerance(op, dtype, w, lead)
            assert_close(mem.np64(g), rounded(w, dtype), rtol=rt, atol=at, dtype=compared_dtype(g),
                         name=f"{where}: result {k}")
        for i, g in zip(mutated, written):
            if ref_copy[i] is not None:
                assert_close(mem.np64(g), rounded(ref_copy[i], dtype), rtol=rtol, atol=atol,
                             dtype=compared_dtype(g), name=f"{where}: mutated '{self.args[i].name}'")
        for j, p in enumerate(out_placed):
            rt, at = result_tolerance(op, dtype, ref[j], lead)
            assert_close(mem.np64(p.view), rounded(ref[j], dtype), rtol=rt, atol=at, dtype=compared_dtype(p.view),
                         name=f"{where}: out= {j}")
        for i, (q, x) in enumerate(zip(placed, ref_args)):
            if q is None:
                continue
            if i not in mutated:
                assert same_values(mem.np64(q.view), x), f"{where}: input '{q.name}' ({q.layout}) was changed"
            mem.check_around(q, f"{where}: argument")
        for p in out_placed:
            mem.check_around(p, f"{where}: out=")

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
        ref = as_list(self.reference([mem.np64(x) if isinstance(case[a.name], np.ndarray) else x
                                       for a, x in zip(self.args, args)]))
        outs = [out0] + [mem.array(np.zeros(tuple(int(s) for s in sp.shape)), dtype) for sp in specs[1:]]
        self.invoke(op.call, args, out=outs[0] if len(outs) == 1 else tuple(outs))
        where = f"{self.framework} {op.name} {dtype}: out= {'is' if shift == 0 else f'{shift} element(s) past'} " \
                f"'{name}'"
        for k, (o, w) in enumerate(zip(outs, ref)):
            rt, at = result_tolerance(op, dtype, w, args[op.dispatch_arg])
            assert_close(mem.np64(o), rounded(w, dtype), rtol=rt, atol=at, dtype=compared_dtype(o),
                         name=f"{where}: out {k}")
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
                why = f"{self.framework}: no views to place out= in"
                if self.framework == "jax":
                    why += " (JAX's out= returns the result in the donated array's buffer; not fuzzed here)"
                return why
        if reason is None and check == "aliasing" and len(self.mem.layouts) == 1:
            return f"{self.framework}: its arrays are immutable, so nothing written can share a buffer"
        if reason is None and check == "aliasing" and not self.op.schema.is_mutating:
            return f"{self.op.name} writes no argument"
        return reason


def written_or_results(f: Fuzzer, args: Sequence[Any], result: Any) -> list[Any]:
    """What a call gives: the arguments it writes (in place, or returned first), then its results."""
    outs = as_list(result)
    if f.h.mutates_in_place:
        outs = [args[i] for i, a in enumerate(f.args) if a.is_mutated and args[i] is not None] + outs
    return [o for o in outs if o is not None]


def add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` where Python has it (3.11 on): the traceback shows it under the error."""
    add = getattr(e, "add_note", None)
    if add is not None:
        add(note)


def compared_dtype(x: Any) -> str:
    """The dtype of framework array *x* as a plain lower-case name, for a failure message (the values are
    compared widened to float64, which is not the dtype that was compared)."""
    return dtype_name(x).lower()  # Paddle says FLOAT32, MindSpore Float32


def as_list(result: Any) -> list[Any]:
    return [] if result is None else list(result) if isinstance(result, tuple) else [result]


def same_values(now: np.ndarray, was: np.ndarray) -> bool:
    return bool(np.all((now == was) | (np.isnan(now) & np.isnan(was)) if now.dtype.kind == "f" else now == was))
