"""The test matrix's graph-mode checks: the op in its framework's graph mode against eager.

``compile``
    The public callable compiled by the kit (``torch.compile(fullgraph=True)``,
    ``jax.jit``, ``paddle.jit.to_static(full_graph=True)``, ``mindspore.jit``)
    on one small case: its outputs and written arguments equal eager's, bit
    for bit (torch.compile with a code-generating backend: within the op's
    tolerance).
``compile_grad``
    (float32, ops with a ``backward``) the gradients through the compiled call
    against those through the eager one, for one random cotangent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opbridge._codegen import compile_source
from opbridge.cases import Case
from opbridge.declare import OpDef
from opbridge.testing.compare import assert_close
from opbridge.testing.generate import case_rng
from opbridge.testing.kits import dtype_str
from opbridge.testing.runner import Runner, describe

__all__ = ["run_graph"]


def run_graph(r: Runner, case: Case) -> None:
    """Check *r*'s op compiled in graph mode against eager on *case* (contiguous, non-empty)."""
    op, kit = r.op, r.kit
    r.where = describe(op, case) + f" ({kit.graph_name} against eager)"
    with kit.graph_scope():
        with r.checking("setup"):
            compiled = kit.compile(positional(op))
        if compiled is None:
            r.report.skipped.append(f"compile ({r.dtype}): {kit.graph_name} cannot compile {op.name}")
            return
        _check_graph(r, case, compiled)


def _check_graph(r: Runner, case: Case, compiled: Callable[..., Any]) -> None:
    op, kit = r.op, r.kit

    def same(got: Sequence[np.ndarray], want: Sequence[np.ndarray], dtypes: Sequence[str], what: str) -> None:
        for j, (g, w, d) in enumerate(zip(got, want, dtypes, strict=True)):
            name = f"{what} {j}" if len(want) > 1 else what
            if kit.graph_exact:
                assert_close(g, w, rtol=0.0, atol=0.0, dtype=d, name=f"{name} (compiled vs eager, must be identical)")
            else:
                rtol, atol = op.tolerance(d)
                assert_close(g, w, rtol=rtol, atol=atol, dtype=d, name=f"{name} (compiled vs eager)")

    def values(arrays: Sequence[Any]) -> tuple[list[np.ndarray], list[str]]:
        return [kit.to_np64(x) for x in arrays], [dtype_str(x.dtype) for x in arrays]

    with r.checking("compile"):
        full_c, _ = r.materialize(case)  # each run gets its own inputs: mutating ops write them
        full_e, _ = r.materialize(case)
        got, got_written = r.results(compiled(*full_c), full_c)
        want, want_written = r.call(full_e)
        want64, dtypes = values(want)
        same(values(got)[0], want64, dtypes, "output")
        for i, w in want_written.items():
            name = f"mutated argument '{op.schema.arguments[i].name}'"
            if i not in got_written:
                raise AssertionError(f"{name}: the compiled call gave no new value")
            same(values([got_written[i]])[0], *values([w]), name)
    if r.dtype == "float32" and op.backward is not None and not op.schema.is_mutating and kit.differentiates:
        with r.checking("compile_grad"):
            diff = [i for i in op.differentiable if full_e[i] is not None and kit.is_float(full_e[i])]
            rng = case_rng(r.seed, op.qualname, "compile_grad")
            gs = [kit.from_np(rng.standard_normal(kit.shape(w)), dtype_str(w.dtype)) if kit.is_float(w)
                  else None for w in want]
            through_graph = kit.vjp(lambda *a: r.results(compiled(*a), a)[0], full_e, diff, gs)
            eager = kit.vjp(lambda *a: r.call(a)[0], full_e, diff, gs)
            same([np.asarray(g, np.float64) for g in through_graph], [np.asarray(g, np.float64) for g in eager],
                 [r.dtype] * len(diff), "gradient")


def positional(op: OpDef) -> Callable[..., Any]:
    """*op*'s public callable, or where it has keyword-only arguments a ``def`` taking every argument in schema
    order positionally (graph-mode harnesses call positionally; Paddle's reads the source, hence a ``def``)."""
    if not op.schema.keyword_names:
        return op.call
    names = [a.name for a in op.schema.arguments]
    call = ", ".join(f"{n}={n}" if n in op.schema.keyword_names else n for n in names)
    src = f"def {op.name}({', '.join(names)}):\n    return _op({call})\n"
    fn: Callable[..., Any] = compile_source(src, f"<opbridge positional {op.qualname}>", {"_op": op.call})[op.name]
    fn.opdef = op  # type: ignore[attr-defined]
    return fn
