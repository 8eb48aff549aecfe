"""Graph mode and gradients under drawn dtypes, cases and values (hypothesis), in every framework.

``test_conformance.py`` compiles each op on three float32 cases and checks
its gradients on one. Here hypothesis draws the dtype (every one the op and
the framework have), the case and its values: the compiled call
(``torch.compile``, ``jax.jit``, ``paddle.jit.to_static``, ``ms.jit``) must
give the eager call's bits, and the gradients of every differentiable op must
match finite differences of the float64 reference in a random direction.
Fewer examples than ``test_fuzz.py`` (compiling costs up to a second per
new signature); ``OPBRIDGE_FUZZ_EXAMPLES=N`` runs N random ones.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import opbridge
from opbridge.testing import make_cases
from opbridge.testing.generate import META_KEYS, held_cases
from opbridge.testing.gradients import directional_check

from ._framework import FRAMEWORK, GRAD_OPS, OPS, H, framework_mark

pytestmark = framework_mark

_EXAMPLES = int(os.environ.get("OPBRIDGE_FUZZ_EXAMPLES", "0") or 0)
FUZZ = settings(max_examples=_EXAMPLES or 4, derandomize=not _EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _dtypes(op: opbridge.OpDef, floats_only: bool = False) -> list[str]:
    return [d for d in op.dtypes if d in H.dtypes and (not floats_only or d.startswith(("float", "bfloat")))]


def _require(op: opbridge.OpDef, dtypes: list[str]) -> None:
    if not dtypes:
        pytest.skip(f"{FRAMEWORK} has none of {op.name}'s dtypes {op.dtypes}")
    why = held_cases(op, make_cases(op, dtypes[0]), H.dtypes)[1]  # int64 in JAX without jax_enable_x64
    if why is not None:
        pytest.skip(f"{FRAMEWORK} has {why}")


def _draw(data: st.DataObject, op: opbridge.OpDef, dtypes: list[str],
          nonempty: bool = False) -> tuple[str, dict[str, Any]]:
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    cases = [c for c in held_cases(op, make_cases(op, dtype, seed), H.dtypes)[0] if not any(k in c for k in META_KEYS)
             and (not nonempty or all(v.size > 0 for v in c.values() if isinstance(v, np.ndarray)))]
    return dtype, data.draw(st.sampled_from(cases), label="case")


def _args(op: opbridge.OpDef, case: dict[str, Any], dtype: str) -> list[Any]:
    return [H.from_numpy(v.copy(), dtype if v.dtype.kind == "f" else None) if isinstance(v, np.ndarray) else v
            for v in (case[a.name] for a in op.schema.arguments)]


def _observed(op: opbridge.OpDef, args: list[Any], out: Any) -> list[np.ndarray | None]:
    """What a call gives: the written arguments' new values (in place, or returned first), then its results."""
    outs = [] if out is None else list(out) if isinstance(out, tuple) else [out]
    if H.mutates_in_place:
        outs = [args[i] for i, a in enumerate(op.schema.arguments) if a.is_mutated] + outs
    return [None if o is None else np.array(H.to_numpy(o), copy=True) for o in outs]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data())
def test_fuzzed_graph_mode_gives_the_eager_bits(op: opbridge.OpDef, data: st.DataObject) -> None:
    dtypes = _dtypes(op)
    _require(op, dtypes)
    compiled = H.compile(op.call)
    if compiled is None:
        pytest.skip(f"{FRAMEWORK} has no graph mode for opbridge ops")
    dtype, case = _draw(data, op, dtypes)
    want = _observed(op, (a := _args(op, case, dtype)), op.call(*a))
    args = _args(op, case, dtype)
    try:
        got = _observed(op, args, compiled(*args))
    except NotImplementedError as e:  # an adapter's documented graph-mode limit, e.g. Paddle's mutating ops
        pytest.skip(f"{FRAMEWORK} graph mode: {e}")
    where = f"{FRAMEWORK} graph mode {op.name} {dtype} {[np.shape(v) for v in case.values()]}"
    assert len(got) == len(want), f"{where}: {len(got)} results, eager gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            assert g is None and w is None, f"{where}: result {k} is None in one mode only"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{where}: result {k} {g.shape} {g.dtype} vs eager " \
                                                          f"{w.shape} {w.dtype}"
        assert np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), f"{where}: result {k} differs from eager"


@pytest.mark.parametrize("op", GRAD_OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data())
def test_fuzzed_gradients_match_finite_differences(op: opbridge.OpDef, data: st.DataObject) -> None:
    if FRAMEWORK == "numpy":
        pytest.skip("numpy has no autograd")
    dtypes = [d for d in ("float64", "float32") if d in _dtypes(op, floats_only=True)]
    _require(op, dtypes)
    dtype, case = _draw(data, op, dtypes, nonempty=True)
    args = _args(op, case, dtype)
    diff = list(op.differentiable)
    out = H.to_numpy(op.call(*args))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**20), label="direction seed"))
    g = rng.standard_normal(out.shape).astype(out.dtype)
    grads = H.vjp(op.call, args, diff, g)
    base = [H.to_numpy(a).astype(np.float64) if isinstance(case[p.name], np.ndarray) else a
            for p, a in zip(op.schema.arguments, args)]
    directional_check(op, base, grads, diff, g, rng, rtol=1e-6 if dtype == "float64" else 1e-3,
                      label=f"{FRAMEWORK} {dtype} {[np.shape(v) for v in case.values()]}")


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@FUZZ
@given(data=st.data(), batch=st.integers(1, 3), rows_only=st.booleans())
def test_fuzzed_vmap_matches_a_loop(op: opbridge.OpDef, data: st.DataObject, batch: int, rows_only: bool) -> None:
    """JAX: ``jax.vmap`` over a leading batch axis of every tensor argument (once per item), or of the
    arguments the op declares ``rows`` only (one call over the batch), gives each item's own call."""
    if FRAMEWORK != "jax":
        pytest.skip("vmap is JAX's")
    import jax
    import jax.numpy as jnp

    dtypes = _dtypes(op)
    _require(op, dtypes)
    dtype, case = _draw(data, op, dtypes, nonempty=True)
    rows = {op.schema.arguments[i].name for i in op.rows} if rows_only and op.rows else None
    names = [a.name for a in op.schema.arguments if a.type.is_tensor and isinstance(case[a.name], np.ndarray)
             and (rows is None or a.name in rows)]
    if not names:
        return
    # Items differ in their float values only (integer arguments, e.g. positions, stay valid).
    items = [{**case, **{n: case[n] * (1 + 0.25 * b) if case[n].dtype.kind == "f" else case[n] for n in names}}
             for b in range(batch)]
    want = [_observed(op, (a := _args(op, item, dtype)), op.call(*a)) for item in items]
    stacked = [jnp.stack([_args(op, item, dtype)[k] for item in items]) if p.name in names else None
               for k, p in enumerate(op.schema.arguments)]
    statics = _args(op, case, dtype)

    def one(*tensors: Any) -> Any:
        it = iter(tensors)
        return op.call(*[next(it) if s is not None else statics[k] for k, s in enumerate(stacked)])

    got = jax.vmap(one)(*[s for s in stacked if s is not None])
    got = [] if got is None else list(got) if isinstance(got, tuple) else [got]
    where = (f"jax.vmap {op.name} {dtype} batch {batch} over {names} "
             f"{[np.shape(v) for v in case.values()]}")
    assert len(got) == len(want[0]), f"{where}: {len(got)} results, a single call gives {len(want[0])}"
    for k, r in enumerate(got):
        if r is None:  # an optional mutated argument that was not given
            assert all(w[k] is None for w in want), f"{where}: result {k} is None under vmap only"
            continue
        g = np.asarray(H.to_numpy(r))
        for b in range(batch):
            w = want[b][k]
            assert w is not None and np.array_equal(g[b], w, equal_nan=g.dtype.kind == "f"), \
                f"{where}: result {k} of item {b} differs from its own call"
