"""``jax.export`` of programs calling opbridge ops: registering targets up front, disabled checks, symbolic dims."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")

import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from opbridge import ops  # noqa: E402
from opbridge.adapters import jax as jax_adapter  # noqa: E402


def _x() -> Any:
    return jax.random.normal(jax.random.PRNGKey(0), (4, 8))


def test_register_targets_names_every_target_and_registers_it() -> None:
    names = jax_adapter.register_targets()
    assert len(names) == len(set(names))
    for want in ("opbridge.opbridge.rms_norm", "opbridge.opbridge.rms_norm_backward", "opbridge.opbridge.rms_norm.o",
                 "opbridge.opbridge.rotary_embedding.p0", "opbridge.opbridge.rotary_embedding.p1"):
        assert want in names
    assert all(n in jax_adapter.targets.REGISTERED for n in names)
    assert [str(c) for c in jax_adapter.disabled_checks()] == [f"custom_call:{n}" for n in names]


_FRESH = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax import export
x = jax.random.normal(jax.random.PRNGKey(0), (4, 8)); w = 1.0 + jnp.arange(8.0) / 8
fwd = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
grad = export.deserialize(bytearray(open(sys.argv[2], "rb").read()))
try:
    fwd.call(x, w)
    print("UNREGISTERED-CALL-RAN")
except Exception as e:
    print("before:", type(e).__name__, str(e).splitlines()[0][:200])
import opbridge.ops  # declares the built-in library, whose targets register_targets() then registers
from opbridge.adapters.jax import register_targets
register_targets()
np.testing.assert_allclose(np.asarray(fwd.call(x, w)), np.load(sys.argv[3]), rtol=1e-6)
np.testing.assert_allclose(np.asarray(grad.call(x, w)), np.load(sys.argv[4]), rtol=1e-6)
print("FRESH-OK")
"""


def test_a_deserialized_export_runs_in_a_fresh_process_after_register_targets(tmp_path: Path) -> None:
    pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")
    x, w = _x(), 1.0 + jnp.arange(8.0) / 8
    f = jax.jit(lambda a, b: ops.rms_norm(a, b, 0.5) * 2)
    g = jax.jit(jax.grad(lambda a, b: jnp.sum(ops.rms_norm(a, b) ** 2), argnums=1))
    checks = jax_adapter.disabled_checks()
    paths = [tmp_path / n for n in ("f.bin", "g.bin", "f.npy", "g.npy")]
    paths[0].write_bytes(export.export(f, disabled_checks=checks)(x, w).serialize())
    paths[1].write_bytes(export.export(g, disabled_checks=checks)(x, w).serialize())
    np.save(paths[2], np.asarray(f(x, w)))
    np.save(paths[3], np.asarray(g(x, w)))
    got = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH), *map(str, paths)], env=dict(os.environ),
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0 and "FRESH-OK" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]
    assert "UNREGISTERED-CALL-RAN" not in got.stdout  # the test would not notice a missing registration


def test_export_without_disabled_checks_names_the_target() -> None:
    with pytest.raises(ValueError, match=r"opbridge\.opbridge\.gelu"):
        export.export(jax.jit(ops.gelu))(_x())


def test_symbolic_batch_dims_export_and_run() -> None:
    b, = export.symbolic_shape("b")
    checks = jax_adapter.disabled_checks()
    f = jax.jit(lambda a, w: ops.silu_and_mul(jnp.concatenate([ops.rms_norm(a, w), a], axis=-1)))
    g = jax.jit(jax.grad(lambda a, w: jnp.sum(ops.rms_norm(a, w) ** 2)))
    spec = (jax.ShapeDtypeStruct((b, 8), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.float32))
    ef, eg = export.export(f, disabled_checks=checks)(*spec), export.export(g, disabled_checks=checks)(*spec)
    assert str(ef.out_avals[0].shape) == "(b, 8)"
    for n in (1, 5):
        x, w = jax.random.normal(jax.random.PRNGKey(n), (n, 8)), jnp.ones(8)
        np.testing.assert_allclose(np.asarray(ef.call(x, w)), np.asarray(f(x, w)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(eg.call(x, w)), np.asarray(g(x, w)), rtol=1e-6)


def test_a_shape_rule_that_cannot_take_a_symbolic_dim_names_the_op() -> None:
    b, = export.symbolic_shape("b")
    with pytest.raises(NotImplementedError, match=r"silu_and_mul: its shape rule cannot take symbolic dimensions"):
        export.export(jax.jit(ops.silu_and_mul), disabled_checks=jax_adapter.disabled_checks())(
            jax.ShapeDtypeStruct((4, b), jnp.float32))
