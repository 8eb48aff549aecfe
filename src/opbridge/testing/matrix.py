"""Run a declared op over a generated test matrix: :func:`check_op`, in any of the five frameworks.

For every dtype the op declares (or those asked for), :func:`make_cases` builds a list of *cases*; a case is a dict
mapping argument names to values (NumPy arrays for Tensor arguments, Python
values for the rest) plus optional ``_``-prefixed layout keys. Each case is
then run through the op, on the framework's arrays, and compared against the
op's NumPy reference. One runner and one set of checks serve every framework;
a framework contributes a kit (:mod:`opbridge.testing.kits`), and a check it
cannot run is named, with why, in the report's ``skipped``:

``forward``
    The op's public callable on framework arrays against the reference
    evaluated in float64 on copies of the (dtype-rounded) inputs, rounded to
    the output dtype, within ``op.tolerance(dtype)``. Mutated arguments are
    compared too: written in place, or (JAX) the new values the call returns.
``inputs_unchanged``
    Arguments the schema does not mark as mutated are bit-for-bit unchanged,
    and the NaN padding around sliced inputs is untouched.
``sentinel``
    (frameworks with views: not JAX) The kernel is called directly
    (destination passing) with outputs and inputs that are views into larger
    buffers filled with a sentinel (NaN for floats); the guard regions before
    and after must still hold the sentinel (no out-of-bounds writes), and no
    output element may keep it (no unwritten elements).
``grad``
    (float32, ops with a ``backward``, frameworks with autograd: not NumPy)
    the framework's gradients against central finite differences of the
    float64 reference, as directional derivatives ``<g, J u>`` per
    differentiable input (:mod:`opbridge.testing.gradients`).
``noncontiguous``
    (frameworks with strided views: not JAX) A non-contiguous input is either
    refused with a ``ValueError`` naming the op, or accepted and computed
    right (outputs and in-place updates match the reference, other inputs
    unchanged).
``rows``
    (one small case per dtype, ops that declare ``rows``) the op on a batch of
    two elements, one more leading dim in its row arguments, against each
    element alone (:mod:`opbridge.testing.rows`): what ``jax.vmap`` and
    ``torch.func.vmap`` rely on to run it once per batch; in those two the
    batch goes through the vmap itself.
``compile`` / ``compile_grad``
    (one small case per dtype; not NumPy) the op in the framework's graph
    mode (``torch.compile(fullgraph=True)``, ``jax.jit``,
    ``paddle.jit.to_static(full_graph=True)``, ``mindspore.jit``) against
    eager, and, in float32 with a ``backward``, its gradients
    (:mod:`opbridge.testing.graph`).
``opcheck``
    (torch, one small case per dtype) ``torch.library.opcheck`` on the
    registered overload.
``gradcheck``
    (torch, float64, ops with a ``backward``, one small case)
    ``torch.autograd.gradcheck`` of the registered backward against finite
    differences of the op's own float64 kernel; skipped, with the reason in
    the report, while the op declares no float64.

Any failure raises :class:`AssertionError` naming the op, the check, the
framework, the dtype and the case. Importing this module imports no
framework; a framework is imported only when ``check_op`` runs in it.
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
from opbridge.testing.generate import (
    CASE_HINTS,
    as_opdef,
    case_rng,
    complete_case,
    held_cases,
    make_cases,
    only_none,
    small_case,
)
from opbridge.testing.graph import run_graph
from opbridge.testing.kits import NumpyKit, dtype_str
from opbridge.testing.kits_frameworks import make_kit
from opbridge.testing.rows import run_rows
from opbridge.testing.runner import CheckReport, Runner
from opbridge.testing.torch_checks import run_gradcheck, run_opcheck

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
        framework lacks (NumPy: bfloat16; JAX without ``JAX_ENABLE_X64``:
        float64 and int64) are skipped and noted in the report's ``skipped``,
        as are cases whose integer arrays it cannot hold.
    framework
        Where the checks run: ``"torch"`` (every check), ``"jax"``,
        ``"paddle"``, ``"mindspore"`` (every check but ``opcheck`` and
        ``gradcheck``, which are torch's; JAX arrays have no views, so no
        sliced, non-contiguous or sentinel cases) or ``"numpy"`` (no
        gradients, no graph mode). Only that framework is imported.
    check_grad
        Compare the framework's gradients (float32) with finite differences of
        the reference, for ops that declare a ``backward``.
    check_opcheck
        (torch) Run ``torch.library.opcheck`` on one small case per dtype (with
        ``requires_grad`` inputs for float32 when the op has a backward).
    check_compile
        Compare the framework's graph mode (``torch.compile(fullgraph=True)``,
        ``jax.jit``, ``paddle.jit.to_static``, ``mindspore.jit``) with eager on
        one small case per dtype (and its gradients, for float32 with a
        backward).
    check_gradcheck
        (torch) Run ``torch.autograd.gradcheck`` (fast mode) on one small float64 case
        when float64 is among the dtypes run, for ops with a ``backward``
        (not mutating); skipped, with the reason in ``skipped``, while the op
        declares no float64.
    check_rows
        For an op that declares ``rows``, check on one small case per dtype
        that a batch of two in one call gives each element's results (through
        ``torch.func.vmap`` or ``jax.vmap`` in those frameworks).
    sentinel
        Run the guarded destination-passing kernel call of every case.
    compile_backend
        (torch) Backend for ``torch.compile``; ``"aot_eager"`` (default) compiles in
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
        On an unknown framework (the message lists the five), or when no
        requested dtype can run.
    ModuleNotFoundError
        When the framework is not installed (the message says what to install).
    RuntimeError
        When it is installed but cannot run in this process (MindSpore beside
        NumPy 2, or after Paddle was imported).
    """
    opdef = as_opdef(op)
    kit = make_kit(framework, compile_backend)
    names = [dtype_str(d) for d in (opdef.dtypes if dtypes is None else dtypes)]
    run = [d for d in names if d in kit.dtypes]
    report = CheckReport(op=opdef.qualname, framework=framework, dtypes=tuple(run))
    for d in names:
        if d not in kit.dtypes:
            report.skipped.append(f"dtype {d}: not supported by {framework}{kit.dtype_note(d)}")
    if not run:
        raise ValueError(f"check_op({opdef.qualname}): none of the dtypes {list(names)} can run "
                         f"on {framework} (it supports {', '.join(kit.dtypes)})")
    _note_absent_checks(kit, opdef, report, run, sentinel=sentinel, grad=check_grad, rows=check_rows,
                        torch_only=check_opcheck or check_gradcheck)
    runner = Runner(opdef, kit, report, seed=seed, sentinel=sentinel and kit.views, check_grad=check_grad,
                    grad_rtol=grad_rtol)
    graph_why = kit.graph_unsupported(opdef) if check_compile or (check_opcheck and framework == "torch") else None
    if graph_why is not None:
        report.skipped.append(f"{'opcheck/' if framework == 'torch' else ''}compile: {graph_why}")
    ran: list[Case] = []
    left_out: dict[str, list[str]] = {}  # why -> the dtype of each case left out for it
    for dtype in run:
        runner.dtype = dtype
        if cases is None:
            dcases = make_cases(opdef, dtype, seed)
        elif callable(cases):
            dcases = [complete_case(opdef, c) for c in cases(dtype, case_rng(seed, opdef.qualname, dtype))]
        else:
            dcases = [complete_case(opdef, c) for c in cases]
        ran.extend(dcases)
        runnable = _runnable(kit, opdef, dtype, dcases, left_out)
        for i, case in enumerate(runnable):
            runner.run_case(i, case)
        small = small_case(opdef, runnable)
        if small is None:
            wanted = [name for name, on in (("rows", check_rows and opdef.rows), ("compile", check_compile),
                                            ("opcheck", check_opcheck and framework == "torch")) if on]
            if wanted:
                report.skipped.append(f"{'/'.join(wanted)} ({dtype}): no contiguous non-empty case")
            continue
        if check_rows and opdef.rows:
            run_rows(runner, small)
        if graph_why is None and check_compile:
            run_graph(runner, small)
        if framework != "torch":
            continue
        if check_opcheck and graph_why is None:
            run_opcheck(runner, small, opcheck_test_utils)
        if check_gradcheck and dtype == "float64" and _has_gradient(opdef):
            run_gradcheck(runner, small)
    if framework == "torch" and check_gradcheck and _has_gradient(opdef) and "float64" not in run:
        why = (f"the op declares no float64 (dtypes: {', '.join(opdef.dtypes)})" if "float64" not in opdef.dtypes
               else "float64 is not among the dtypes run")
        report.skipped.append(f"gradcheck: needs float64 kernels, and {why}")
    for why, where in left_out.items():
        report.skipped.append(f"{len(where)} case(s) ({', '.join(dict.fromkeys(where))}): {why}")
    untested = only_none(opdef, ran)
    if untested is not None:
        report.skipped.append(untested)
    return report


def _runnable(kit: NumpyKit, op: OpDef, dtype: str, cases: list[Case], left_out: dict[str, list[str]]) -> list[Case]:
    """The *cases* the framework can run; each one it cannot is added to *left_out* under why."""
    held, _ = held_cases(op, cases, kit.dtypes)
    runnable = held if kit.views else [c for c in held if c.get(LAYOUT, "contiguous") == "contiguous"
                                       and c.get(NONCONTIGUOUS) is None]
    for why, n in ((f"their integer arrays have dtypes {kit.name} lacks here{kit.dtype_note('int64')}",
                    len(cases) - len(held)),
                   (f"sliced or non-contiguous, and {kit.name} arrays have no views (a slice or a transpose is a "
                    f"new dense array)", len(held) - len(runnable))):
        if n:
            left_out.setdefault(why, []).extend([dtype] * n)
    return runnable


def _note_absent_checks(kit: NumpyKit, op: OpDef, report: CheckReport, run: Sequence[str], *, sentinel: bool,
                        grad: bool, rows: bool, torch_only: bool) -> None:
    """Name in *report* each check asked for that this framework does not have, with why."""
    if sentinel and not kit.views:
        report.skipped.append(f"sentinel: {kit.name} arrays are immutable and have no views, so a kernel writes "
                              f"only buffers the framework allocates")
    if grad and _has_gradient(op):
        if not kit.differentiates:
            report.skipped.append(f"grad: {kit.name} has no autograd")
        elif "float32" not in run:
            report.skipped.append("grad: runs in float32, which is not among the dtypes run")
    if rows and op.rows and not kit.vmap_name:
        report.skipped.append(f"rows (through a vmap): opbridge ops have no vmap rule in {kit.name}; the batch "
                              f"of two ran as one call with one more leading dim")
    if torch_only and kit.name != "torch":
        report.skipped.append("opcheck/gradcheck: torch only (torch.library.opcheck, torch.autograd.gradcheck)")


def _has_gradient(op: OpDef) -> bool:
    return op.backward is not None and not op.schema.is_mutating
