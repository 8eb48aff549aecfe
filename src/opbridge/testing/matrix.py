"""Run a declared op over a generated test matrix: :func:`check_op`.

For every dtype the op declares (or those asked for), :func:`make_cases` builds a list of *cases*; a case is a dict
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
    A non-contiguous input is either refused with a ``ValueError`` naming
    the op, or accepted and computed right (outputs and in-place updates
    match the reference, other inputs unchanged).
``rows``
    (one small case per dtype, ops that declare ``rows``) the op on a batch of
    two elements, one more leading dim in its row arguments, against each
    element alone (:mod:`opbridge.testing.rows`): what ``jax.vmap`` and
    ``torch.func.vmap`` rely on to run it once per batch.
``opcheck`` / ``compile``
    (torch, one small case per dtype) ``torch.library.opcheck`` on the
    registered overload, and ``torch.compile(fullgraph=True)`` of a function
    calling the public callable, against eager.
``gradcheck``
    (torch, float64, ops with a ``backward``, one small case)
    ``torch.autograd.gradcheck`` of the registered backward against finite
    differences of the op's own float64 kernel; skipped, with the reason in
    the report, while the op declares no float64.

Any failure raises :class:`AssertionError` naming the op, the check, the
framework, the dtype and the case. Importing this module imports no
framework; torch is imported only when ``framework="torch"`` checks run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opbridge.cases import (
    ELEMENTWISE_SHAPES,
    LAYOUT,
    NONCONTIGUOUS,
    Case,
    CaseHint,
    elementwise_cases,
    elementwise_hint,
    gated_hint,
    last_dim_hint,
    shaped_cases,
)
from opbridge.declare import DEFAULT_DTYPES, OpDef  # noqa: F401 - DEFAULT_DTYPES: importable here, as before
from opbridge.testing.generate import CASE_HINTS, as_opdef, case_rng, complete_case, make_cases, only_none
from opbridge.testing.kits import NumpyKit, TorchKit, dtype_str
from opbridge.testing.rows import run_rows
from opbridge.testing.runner import CheckReport, Runner
from opbridge.testing.torch_checks import run_compile, run_gradcheck, run_opcheck, small_case

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
    "gated_hint",
    "last_dim_hint",
    "make_cases",
    "shaped_cases",
]

def check_op(
    op: Any,
    cases: Sequence[Mapping[str, Any]] | CaseHint | None = None,
    *,
    dtypes: Sequence[str] | None = None,
    framework: str = "torch",
    check_grad: bool = True,
    check_opcheck: bool = True,
    check_compile: bool = True,
    check_gradcheck: bool = True,
    check_rows: bool = True,
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
        Dtype names to run; default: the dtypes the op declares
        (``Library.op(..., dtypes=...)``, else its library's). Dtypes the
        framework lacks (NumPy: bfloat16) are skipped and noted in the
        report's ``skipped``.
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
    check_gradcheck
        Run ``torch.autograd.gradcheck`` (fast mode) on one small float64 case
        when float64 is among the dtypes run, for ops with a ``backward``
        (not mutating); skipped, with the reason in ``skipped``, while the op
        declares no float64.
    check_rows
        For an op that declares ``rows``, check on one small case per dtype
        that a batch of two in one call gives each element's results.
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
        Counts per check kind, so tests can assert what was covered; its
        ``skipped`` also names each ``Tensor?`` argument no case gave a tensor.

    Raises
    ------
    AssertionError
        On the first failing check, naming the op, check, framework, dtype
        and case.
    ValueError
        On an unknown framework, or when no requested dtype can run.
    """
    opdef = as_opdef(op)
    kit: NumpyKit
    if framework == "torch":
        try:
            import opbridge.adapters.torch  # noqa: F401 - registers torch.ops.<ns>.<op>
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ModuleNotFoundError("check_op: framework='torch' (the default) needs torch, which is not "
                                      "installed here; pass framework='numpy' (or pip install 'opbridge[torch]')",
                                      name="torch") from None

        kit = TorchKit()
    elif framework == "numpy":
        kit = NumpyKit()
    else:
        raise ValueError(f"check_op: framework must be 'torch' or 'numpy', got {framework!r}")
    names = [dtype_str(d) for d in (opdef.dtypes if dtypes is None else dtypes)]
    run = [d for d in names if d in kit.dtypes]
    report = CheckReport(op=opdef.qualname, framework=framework, dtypes=tuple(run))
    for d in names:
        if d not in kit.dtypes:
            report.skipped.append(f"dtype {d}: not supported by {framework}")
    if not run:
        raise ValueError(f"check_op({opdef.qualname}): none of the dtypes {list(names)} can run "
                         f"on {framework} (it supports {', '.join(kit.dtypes)})")
    runner = Runner(opdef, kit, report, seed=seed, sentinel=sentinel, check_grad=check_grad,
                     grad_rtol=grad_rtol)
    ran: list[Case] = []
    for dtype in run:
        runner.dtype = dtype
        if cases is None:
            dcases = make_cases(opdef, dtype, seed)
        elif callable(cases):
            dcases = [complete_case(opdef, c) for c in cases(dtype, case_rng(seed, opdef.qualname, dtype))]
        else:
            dcases = [complete_case(opdef, c) for c in cases]
        ran.extend(dcases)
        for i, case in enumerate(dcases):
            runner.run_case(i, case)
        small = small_case(opdef, dcases)
        if check_rows and opdef.rows:
            if small is None:
                report.skipped.append(f"rows ({dtype}): no contiguous non-empty case")
            else:
                run_rows(runner, small)
        if framework != "torch":
            continue
        if small is None:
            if check_opcheck or check_compile:
                report.skipped.append(f"opcheck/compile ({dtype}): no contiguous non-empty case")
            continue
        if (check_opcheck or check_compile) and any(k < 0 for k in opdef.return_sources):
            report.skipped.append(f"opcheck/compile ({dtype}): the op returns an argument it writes "
                                  f"(-> Tensor(a!)), which torch.compile and opcheck refuse for custom ops "
                                  f"(they cannot functionalize it); declare -> () as vLLM's in-place ops do")
        else:
            if check_opcheck:
                run_opcheck(runner, small, opcheck_test_utils)
            if check_compile:
                run_compile(runner, small, compile_backend)
        if check_gradcheck and dtype == "float64" and _has_gradient(opdef):
            run_gradcheck(runner, small)
    if framework == "torch" and check_gradcheck and _has_gradient(opdef) and "float64" not in run:
        why = (f"the op declares no float64 (dtypes: {', '.join(opdef.dtypes)})" if "float64" not in opdef.dtypes
               else "float64 is not among the dtypes run")
        report.skipped.append(f"gradcheck: needs float64 kernels, and {why}")
    untested = only_none(opdef, ran)
    if untested is not None:
        report.skipped.append(untested)
    if framework != "torch" and (check_grad or check_opcheck or check_compile or check_gradcheck):
        report.skipped.append("grad/gradcheck/opcheck/compile: torch only")
    return report


def _has_gradient(op: OpDef) -> bool:
    return op.backward is not None and not op.schema.is_mutating
