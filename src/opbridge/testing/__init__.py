"""Testing kit for opbridge ops: the checks opbridge runs on its own ops, for yours.

``check_op(op, framework=...)`` runs a declared op over a generated matrix of
shapes, dtypes and memory layouts in any of the five frameworks (``"torch"``,
the default, ``"jax"``, ``"paddle"``, ``"mindspore"``, ``"numpy"``) and
compares it with its NumPy reference; where the framework has them, it also
checks sentinel-guarded and non-contiguous calls, the declared gradient
against finite differences, graph mode (``torch.compile``, ``jax.jit``,
``paddle.jit.to_static``, ``mindspore.jit``) against eager and the declared
``rows`` (through ``jax.vmap`` / ``torch.func.vmap``); in torch also
``opcheck`` and ``gradcheck``. What a framework cannot check is named, with
why, in the report's ``skipped``::

    from opbridge.testing import check_op

    def test_scale():
        report = check_op(myops.scale)
        assert report.checks["grad"] > 0

    def test_scale_in_jax():
        assert check_op(myops.scale, framework="jax").checks["grad"] > 0

``assert_close`` is the comparison it uses, with per-dtype defaults from
``TOLERANCES``. :func:`opbridge.testing.fuzz.fuzz_op` (with hypothesis
installed) draws dtypes, values and memory layouts, ``out=`` buffers and
inconsistent arguments instead of a fixed matrix. ``FRAMEWORKS`` names the
five frameworks, and ``unavailable(framework)`` says why one cannot run here
(None when it can), for a test to skip with. Importing this package imports no
framework.
"""

from __future__ import annotations

from opbridge.testing.compare import TOLERANCES, assert_close
from opbridge.testing.kits_frameworks import FRAMEWORKS, unavailable
from opbridge.testing.matrix import (
    CASE_HINTS,
    CheckReport,
    check_op,
    elementwise_hint,
    gated_hint,
    last_dim_hint,
    make_cases,
    shaped_cases,
)

__all__ = [
    "CASE_HINTS",
    "FRAMEWORKS",
    "TOLERANCES",
    "CheckReport",
    "assert_close",
    "check_op",
    "elementwise_hint",
    "gated_hint",
    "last_dim_hint",
    "make_cases",
    "shaped_cases",
    "unavailable",
]
