"""The JAX adapter on several devices: shard_map's per-device types, explicit-sharding meshes, device placement.

The tests need 4 devices. XLA fixes the number of CPU devices when JAX
starts, so a process with one device (the usual pytest run) runs this file
again in a child process with ``--xla_force_host_platform_device_count=4``
(``test_in_a_four_device_process``), where the others run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax_tvm_ffi")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from opbridge import ops  # noqa: E402

N_DEVICES = 4
four = pytest.mark.skipif(jax.device_count() < N_DEVICES,
                          reason="needs 4 devices: runs in test_in_a_four_device_process's child")


def test_in_a_four_device_process() -> None:
    if jax.device_count() >= N_DEVICES:
        pytest.skip("this process has the devices: the tests ran here")
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEVICES}".strip()
    got = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-3000:]
    assert " passed" in got.stdout and " failed" not in got.stdout


def _rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _mesh() -> Any:
    return jax.sharding.Mesh(np.array(jax.devices()[:N_DEVICES]), ("d",))


def _x() -> Any:
    return jax.random.normal(jax.random.PRNGKey(0), (8, 16))


def _w() -> Any:
    return 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(1), (16,))


# -- shard_map: results vary per device as their inputs do ------------------------------------------


@four
def test_shard_map_results_vary_like_jnp_results() -> None:
    mesh, x, w = _mesh(), _x(), _w()
    seen = {}

    def body(a: Any, b: Any) -> Any:
        seen["op"], seen["jnp"] = jax.typeof(ops.rms_norm(a, b)), jax.typeof(_rms(a, b))
        return ops.rms_norm(a, b)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d", None), P()), out_specs=P("d", None)))
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(_rms(x, w)), rtol=1e-5, atol=1e-6)
    assert seen["op"] == seen["jnp"] and "d" in seen["op"].str_short()  # float32[2,16]{V:d}


@four
def test_shard_map_refuses_to_replicate_a_varying_result() -> None:
    """out_specs=P() on a per-device result: JAX's replication error, not one shard returned silently."""
    mesh = _mesh()
    for fn in (_rms, ops.rms_norm):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("d", None), P()), out_specs=P()))
        with pytest.raises(ValueError, match="out_specs"):
            f(_x(), _w())


@four
def test_grad_inside_shard_map_matches_jnp() -> None:
    mesh, x, w = _mesh(), _x(), _w()

    def loss(fn: Any) -> Any:
        body = jax.shard_map(lambda a, b: jax.lax.psum(jnp.sum(fn(a, b) ** 2), "d"), mesh=mesh,
                             in_specs=(P("d", None), P()), out_specs=P())
        return jax.jit(jax.grad(body, argnums=(0, 1)))

    got, want = loss(ops.rms_norm)(x, w), loss(_rms)(x, w)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


@four
def test_shard_map_out_and_a_shape_rule_op() -> None:
    mesh, x = _mesh(), _x()
    f = jax.jit(jax.shard_map(lambda a: ops.silu_and_mul(a, out=jnp.zeros((a.shape[0], 8), a.dtype)),
                              mesh=mesh, in_specs=P("d", None), out_specs=P("d", None)))
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(ops.silu_and_mul(x)), rtol=1e-6)


# -- meshes of explicit axes --------------------------------------------------------------------------


@four
def test_explicit_mesh_like_outputs_keep_the_input_sharding_and_grad_works() -> None:
    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x, w = _x(), _w()
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("d", None))
        for y in (jax.jit(ops.gelu)(xs), ops.gelu(xs), jax.jit(lambda a: ops.rms_norm(a, w))(xs)):
            assert jax.typeof(y).sharding.spec == P("d", None)
        np.testing.assert_allclose(np.asarray(jax.jit(ops.gelu)(xs)), np.asarray(jax.nn.gelu(x)),
                                   rtol=1e-5, atol=1e-6)
        gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(ops.rms_norm(a, b) ** 2), argnums=(0, 1)))(xs, w)
        assert jax.typeof(gx).sharding.spec == P("d", None)
        # a shape rule's output is replicated; its backward's cotangent gets the input's sharding back
        gs = jax.jit(jax.grad(lambda a: jnp.sum(ops.silu_and_mul(a))))(xs)
        assert jax.typeof(gs).sharding.spec == P("d", None)
    ex, ew = jax.grad(lambda a, b: jnp.sum(_rms(a, b) ** 2), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ex), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ew), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(jax.grad(lambda a: jnp.sum(ops.silu_and_mul(a)))(x)),
                               rtol=1e-5, atol=1e-6)


# -- placement --------------------------------------------------------------------------------------


@four
@pytest.mark.parametrize("n", [8, 1024])  # 1024 x 1024 float32 = 4 MiB: the pool path
def test_eager_outputs_stay_on_the_input_device(n: int) -> None:
    dev = jax.devices()[3]
    x = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    y = ops.gelu(x)
    assert y.devices() == {dev}
    np.testing.assert_allclose(np.asarray(y + x), np.asarray(jax.nn.gelu(x) + x), rtol=1e-6)


@four
def test_sharded_operands_are_gathered_and_the_result_replicated() -> None:
    """What the README says: no partitioning rule yet, so XLA gathers a sharded operand."""
    xs = jax.device_put(jnp.ones((8, 16)), NamedSharding(_mesh(), P("d", None)))
    f = jax.jit(ops.gelu)
    assert "all-gather" in f.lower(xs).compile().as_text()
    np.testing.assert_allclose(np.asarray(f(xs)), np.asarray(jax.nn.gelu(jnp.ones((8, 16)))), rtol=1e-6)
