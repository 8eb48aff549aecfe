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
``aliasing``
    A written argument beside another argument of its shape in one buffer
    (``[..., :n]`` and ``[..., n:2n]``: vLLM's ``query`` and ``key`` slices of
    ``qkv``): the reference's result, nothing else written. Overlapping it by
    one element: a ValueError naming the op, nothing written.
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

from opbridge.cases import CaseHint
from opbridge.errors import OpbridgeError
from opbridge.testing import fuzz_errors
from opbridge.testing.fuzz_calls import Fuzzer, Skip
from opbridge.testing.generate import only_none

__all__ = ["CHECKS", "FuzzReport", "Fuzzer", "fuzz_op", "run_check"]

#: The frameworks fuzz_op runs in (each through its harness, :mod:`opbridge.testing.harness`).
FRAMEWORKS = ("numpy", "torch", "jax", "paddle", "mindspore")
CHECKS = ("calls", "out", "out_sharing", "aliasing", "bad_dtype", "bad_shape", "scalars")


@dataclass
class FuzzReport:
    """What :func:`fuzz_op` ran: examples per check, and the checks it could not run, with why."""

    op: str
    framework: str
    examples: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)


def run_check(f: Fuzzer, check: str, data: Any) -> bool:
    """One example of *check* from hypothesis *data*; False where the draw gave nothing to check."""
    from hypothesis import strategies as st

    if check == "out_sharing":
        dtype, case, _, _ = f.draw_call(data)
        return f.check_out_sharing(dtype, case, data.draw(st.sampled_from([0, 1, 3]), label="shift"))
    dtype, case, layouts, out_layouts = f.draw_call(data, with_out=check == "out")
    if check in ("bad_dtype", "bad_shape"):
        return fuzz_errors.check_bad_input(f, dtype, case, layouts, check[4:])
    if check == "scalars":
        return fuzz_errors.check_scalars(f, dtype, case, layouts)
    if check == "aliasing":
        return fuzz_errors.check_aliasing(f, dtype, case)
    for label, call in f.paths() if check == "calls" else f.paths()[:1]:
        f.check_call(dtype, case, layouts, out_layouts, label, call)
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
        Examples run per check, and the checks that could not run here, with why (under
        ``"Tensor?"``: the optional Tensor arguments no drawn case gave a tensor).

    Raises
    ------
    AssertionError
        A check failed; or the first, valid call (made before any check, on every call path) raised.
    opbridge.errors.OpbridgeError
        The op cannot be built, loaded or called here: a :class:`~opbridge.errors.BuildError` (with
        the compiler's output) for a kernel that does not compile, a
        :class:`~opbridge.errors.DeclarationError` for a kernel that does not match its schema.
        Raised by that first call, so in seconds, before hypothesis draws anything; never taken for
        an op's refusal of a bad argument by the error checks.
    """
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ImportError("opbridge.testing.fuzz needs hypothesis: pip install hypothesis") from None
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"fuzz_op: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"fuzz_op: argument 'framework' must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if type(examples) is not int or examples < 1:
        raise ValueError(f"fuzz_op: argument 'examples' must be a positive int, got {examples!r}")
    if device not in ("cpu", "cuda") or (device == "cuda" and framework != "torch"):
        raise ValueError(f"fuzz_op: argument 'device' must be 'cpu', or 'cuda' with torch; got {device!r} "
                         f"with {framework}")
    fuzzer = Fuzzer(op, framework, device, cases)
    report = FuzzReport(fuzzer.op.qualname, framework)
    called = False
    for check in checks:
        reason = fuzzer.check_skip_reason(check)
        if reason is not None:
            report.skipped[check] = reason
            continue
        if not called:  # build and load once, and one valid call: a broken kernel fails here, in seconds
            fuzzer.first_call()
            called = True
        try:
            _run(fuzzer, report, check, examples, derandomize)
        except Skip as e:
            report.skipped[check] = str(e)
        if not report.examples[check] and check not in report.skipped:
            report.skipped[check] = {"scalars": f"{fuzzer.op.name} has no int, float or bool argument",
                                     "aliasing": f"{fuzzer.op.name} writes no float argument another one "
                                                 "matches in shape",
                                     "out_sharing": "no drawn case had a float input shaped like the first output",
                                     }.get(check, "no drawn case had an argument to make inconsistent")
    untested = only_none(fuzzer.op, [dict.fromkeys(fuzzer.given, True)]) if fuzzer.given else None
    if untested is not None:
        report.skipped["Tensor?"] = untested
    return report


class _Fatal(BaseException):
    """Carries an :class:`~opbridge.errors.OpbridgeError` out of hypothesis: not an ``Exception``, so
    hypothesis neither shrinks it nor runs more examples (each of which would raise it again)."""

    def __init__(self, error: OpbridgeError) -> None:
        super().__init__(error)
        self.error = error


def _run(fuzzer: Fuzzer, report: FuzzReport, check: str, examples: int, derandomize: bool) -> None:
    """Run *check*'s hypothesis examples.

    An opbridge error (the op cannot be built, loaded or run here) ends the run at once and is raised
    as it is.
    """
    try:
        _runner(fuzzer, report, check, examples, derandomize)()
        return
    except _Fatal as stop:
        error = stop.error
    raise error  # outside the handler: the error as the op raised it, with its own cause


def _runner(fuzzer: Fuzzer, report: FuzzReport, check: str, examples: int, derandomize: bool) -> Callable[[], None]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(data=st.data())
    def run(data: Any) -> None:
        try:
            ok = run_check(fuzzer, check, data)
        except OpbridgeError as e:
            raise _Fatal(e) from e
        if ok:
            report.examples[check] += 1

    return run  # type: ignore[no-any-return]
