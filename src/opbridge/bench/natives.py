"""Each framework's own implementation of the built-in ops, to time ours against.

Only what a framework ships counts as native (``torch.add``, ``jnp`` under
``jit``, ``paddle.add``, MindSpore ``ops.add``, ``np.add``); an entry is a
factory ``make(args) -> zero-argument callable`` over schema-ordered
arguments, so that set-up (e.g. jitting) happens before timing.

An op that mutates its arguments (``fused_add_rms_norm``,
``rotary_embedding``: ``Tensor(a!)``) is computed in place on the same
arguments, as opbridge's call does, and its callable returns None; JAX's
arrays are immutable, so its formula returns the new values of the mutated
arguments in schema order, as opbridge's JAX adapter does. :func:`descriptions`
says what each entry calls (its tables, in words, are :mod:`opbridge.bench.natives_what`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from opbridge.bench.natives_what import descriptions

__all__ = ["Factory", "bind", "descriptions", "jax_call", "jax_formulas", "jax_ready", "mindspore_formulas",
           "mindspore_sync", "natives"]

Factory = Callable[[Sequence[Any]], Callable[[], Any]]
_C = 0.7978845608028654  # sqrt(2/pi)


def bind(fn: Callable[..., Any]) -> Factory:
    """The factory calling *fn* on the arguments (a partial: no frame of ours around the call)."""
    return lambda a: functools.partial(fn, *a)


def _halves(x: Any) -> tuple[Any, Any]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _rope(xp: Any, positions: Any, query: Any, key: Any, head_size: int, cache: Any,
          is_neox: bool) -> tuple[Any, Any]:
    """The new query and key of ``rotary_embedding``, out of place (vLLM's ``forward_native``).

    *xp* names the framework's ``cat(list, axis)``, ``stack(list, axis)`` and
    ``take(cache, positions)`` (the cache rows); the rest is indexing and
    ``reshape``, which JAX, Paddle and MindSpore spell alike.
    """
    flat = positions.reshape([-1])
    n, half = flat.shape[0], cache.shape[-1] // 2
    rows = xp.take(cache, flat).reshape([n, 1, 2 * half])
    cos, sin = rows[..., :half], rows[..., half:]

    def apply(t: Any) -> Any:
        if t is None:
            return None
        v = t.reshape([n, -1, head_size])
        r = v[..., :2 * half]
        x1, x2 = (r[..., :half], r[..., half:]) if is_neox else (r[..., 0::2], r[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = xp.cat([o1, o2], -1) if is_neox else xp.stack([o1, o2], -1).reshape(list(r.shape))
        return xp.cat([rot, v[..., 2 * half:]], -1).reshape(list(t.shape))

    return apply(query), apply(key)


class _Xp:
    """The three calls :func:`_rope` needs from a framework."""

    def __init__(self, cat: Callable[..., Any], stack: Callable[..., Any], take: Callable[..., Any]) -> None:
        self.cat, self.stack, self.take = cat, stack, take


# -- numpy ------------------------------------------------------------------------


def _numpy() -> dict[str, Factory]:
    import numpy as np

    def gelu(x: Any) -> Any:
        return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x * x * x)))

    def rms(x: Any, w: Any, eps: float, out: Any = None) -> Any:
        out = np.divide(x, np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps), out=out)
        return np.multiply(out, w, out=out)

    def silu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return a / (1.0 + np.exp(-a)) * b

    def gelu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return gelu(a) * b

    def fused_add_rms_norm(x: Any, residual: Any, w: Any, eps: float) -> None:
        np.add(x, residual, out=residual)
        rms(residual, w, eps, out=x)

    def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cache: Any,
                         is_neox: bool) -> None:
        # In place on views of (contiguous) query and key, as torch's in-place formula does.
        flat = positions.reshape(-1)
        half = cache.shape[-1] // 2
        rows = cache[flat][:, None, :]
        cos, sin = rows[..., :half], rows[..., half:]
        for t in (query, key):
            if t is None:
                continue
            r = t.reshape(flat.size, -1, head_size)[..., :2 * half]
            x1, x2 = (r[..., :half], r[..., half:]) if is_neox else (r[..., 0::2], r[..., 1::2])
            o1 = x1 * cos - x2 * sin
            x2 *= cos
            x2 += x1 * sin
            x1[...] = o1

    def silu_and_mul_out(x: Any, out: Any) -> Any:
        a, b = _halves(x)
        np.divide(a, 1.0 + np.exp(-a), out=out)
        return np.multiply(out, b, out=out)

    return {"add": bind(np.add), "gelu": bind(gelu), "rms_norm": bind(rms),
            "silu_and_mul": bind(silu_and_mul), "gelu_and_mul": bind(gelu_and_mul),
            "fused_add_rms_norm": bind(fused_add_rms_norm), "rotary_embedding": bind(rotary_embedding),
            # out= by keyword, as the opbridge candidate passes it (a partial's keywords cost it ~30 ns)
            "add_out": lambda a: functools.partial(np.add, a[0], a[1], out=a[2]),
            "silu_and_mul_out": lambda a: functools.partial(silu_and_mul_out, a[0], out=a[1])}


# -- torch ------------------------------------------------------------------------


def _torch() -> dict[str, Factory]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    from opbridge.bench.torch_formulas import torch_impls

    impls = torch_impls()

    def silu_and_mul_out(x: Any, out: Any) -> Any:
        a, b = _halves(x)
        return torch.mul(F.silu(a), b, out=out)

    def first(new: Callable[..., tuple[Any, ...]]) -> Factory:
        return lambda a: lambda: new(*a)[0]

    def in_place(op: str) -> Factory:
        out = impls[op][0].out
        if out is None:  # an internal invariant: torch_formulas gives both mutating ops an in-place form
            raise RuntimeError(f"opbridge.bench.torch_formulas has no in-place formula for {op}")
        return bind(out)

    return {
        "add": bind(torch.add),
        "gelu": lambda a: functools.partial(F.gelu, a[0], approximate="tanh"),
        "rms_norm": lambda a: functools.partial(F.rms_norm, a[0], (a[0].shape[-1],), a[1], a[2]),
        # The formulas bench kernels times (opbridge.bench.torch_formulas); in place where the op mutates.
        "silu_and_mul": first(impls["silu_and_mul"][0].new),
        "gelu_and_mul": first(impls["gelu_tanh_and_mul"][0].new),
        "fused_add_rms_norm": in_place("fused_add_rms_norm"),
        "rotary_embedding": in_place("rotary_embedding"),
        "add_out": lambda a: functools.partial(torch.add, a[0], a[1], out=a[2]),
        "silu_and_mul_out": bind(silu_and_mul_out),
    }


# -- jax --------------------------------------------------------------------------


def jax_formulas() -> dict[str, Callable[..., Any]]:
    """``{op name: jnp formula}``, un-jitted, on schema-ordered arguments (scalars as Python values).

    Each computes in its inputs' dtype, as the ops' NumPy references do
    (:mod:`opbridge.ops`): GELU is the tanh approximation, the gated ops
    split ``x = [a | b]`` along the last dim and activate ``a``, and a
    mutating op (``fused_add_rms_norm``, ``rotary_embedding``) returns the
    new values of its mutated arguments in schema order, as opbridge's JAX
    adapter does. Called eagerly they run jnp op by op; under ``jax.jit``
    XLA fuses them. Keep scalars (``eps``, ``head_size``, ``is_neox``)
    static: a traced float32 scalar would promote bfloat16 inputs to a
    float32 result.
    """
    import jax
    import jax.numpy as jnp

    def gelu(x: Any) -> Any:
        return jax.nn.gelu(x, approximate=True)

    def rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    def silu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return jax.nn.silu(a) * b

    def gelu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return gelu(a) * b

    def fused_add_rms_norm(x: Any, residual: Any, w: Any, eps: float = 1e-6) -> tuple[Any, Any]:
        s = x + residual
        return rms(s, w, eps), s

    xp = _Xp(lambda ts, axis: jnp.concatenate(ts, axis=axis), lambda ts, axis: jnp.stack(ts, axis=axis),
             lambda c, p: jnp.take(c, p, axis=0))

    return {"add": jnp.add, "gelu": gelu, "rms_norm": rms, "silu_and_mul": silu_and_mul,
            "gelu_and_mul": gelu_and_mul, "fused_add_rms_norm": fused_add_rms_norm,
            "rotary_embedding": functools.partial(_rope, xp)}


def jax_ready(out: Any) -> Any:
    """Wait for *out* (an array, or a tuple of the new values of a mutating op's arguments)."""
    import jax

    return out.block_until_ready() if hasattr(out, "block_until_ready") else jax.block_until_ready(out)


def jax_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, waited for (:func:`jax_ready`)."""
    return jax_ready(fn(*args))


#: The arguments each jitted JAX formula keeps static (Python scalars; see :func:`jax_formulas`).
_JAX_STATIC = {"rms_norm": (2,), "fused_add_rms_norm": (3,), "rotary_embedding": (3, 5)}


def _jax() -> dict[str, Factory]:
    import jax

    return {op: bind(functools.partial(jax_call, jax.jit(f, static_argnums=_JAX_STATIC.get(op, ()))))
            for op, f in jax_formulas().items()}


# -- paddle -----------------------------------------------------------------------


def _paddle() -> dict[str, Factory]:
    import paddle
    import paddle.nn.functional as F  # noqa: N812

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + eps) * w

    def silu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return F.silu(a) * b

    def gelu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return F.gelu(a, approximate=True) * b

    def fused_add_rms_norm(x: Any, residual: Any, w: Any, eps: float) -> None:
        residual.add_(x)
        paddle.assign(rms(residual, w, eps), output=x)

    def silu_and_mul_out(x: Any, out: Any) -> Any:
        return paddle.assign(F.swiglu(x) if hasattr(F, "swiglu") else silu_and_mul(x), output=out)

    xp = _Xp(lambda ts, axis: paddle.concat(ts, axis=axis), lambda ts, axis: paddle.stack(ts, axis=axis),
             paddle.index_select)

    def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cache: Any, is_neox: bool) -> None:
        q, k = _rope(xp, positions, query, key, head_size, cache, is_neox)
        paddle.assign(q, output=query)
        if key is not None:
            paddle.assign(k, output=key)

    return {
        "add": bind(paddle.add),
        "gelu": lambda a: functools.partial(F.gelu, a[0], approximate=True),
        "rms_norm": bind(rms),
        # F.swiglu(x) (Paddle 3) is silu(x[..., :d]) * x[..., d:]: SiluAndMul itself.
        "silu_and_mul": bind(F.swiglu if hasattr(F, "swiglu") else silu_and_mul),
        "gelu_and_mul": bind(gelu_and_mul),
        "fused_add_rms_norm": bind(fused_add_rms_norm),
        "rotary_embedding": bind(rotary_embedding),
        "add_out": lambda a: functools.partial(paddle.add, a[0], a[1], out=a[2]),
        "silu_and_mul_out": bind(silu_and_mul_out),
    }


# -- mindspore --------------------------------------------------------------------


def mindspore_sync() -> Callable[[], Any]:
    """Wait for MindSpore PyNative's queued kernels.

    ``_pynative_executor.sync``, what the MindSpore adapter waits with: on a
    CPU-only build ``mindspore.runtime.synchronize()`` logs "[ERROR] ... CPU
    device is not supported" and returns without waiting.
    """
    from mindspore.graph.api import _pynative_executor

    sync: Callable[[], Any] = _pynative_executor.sync
    return sync


def mindspore_formulas() -> dict[str, Callable[..., Any]]:
    """``{op name: MindSpore formula}`` on schema-ordered arguments, queued as PyNative runs them (no wait).

    MindSpore 2.10 on CPU updates nothing in place with ``Tensor.add_`` or
    ``mul_`` (they return a new tensor), nor through a view; ``copy_``
    does, so a mutating op computes the new values and copies them into
    its arguments.
    """
    from mindspore import ops

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x * ops.rsqrt(ops.mean(x * x, -1, True) + eps) * w

    def silu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return ops.silu(a) * b

    def gelu_and_mul(x: Any) -> Any:
        a, b = _halves(x)
        return ops.gelu(a, approximate="tanh") * b

    def fused_add_rms_norm(x: Any, residual: Any, w: Any, eps: float) -> None:
        s = ops.add(x, residual)
        residual.copy_(s)
        x.copy_(rms(s, w, eps))

    xp = _Xp(lambda ts, axis: ops.cat(ts, axis), lambda ts, axis: ops.stack(ts, axis),
             lambda c, p: ops.gather(c, p, 0))

    def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cache: Any, is_neox: bool) -> None:
        q, k = _rope(xp, positions, query, key, head_size, cache, is_neox)
        query.copy_(q)
        if key is not None:
            key.copy_(k)

    return {"add": ops.add, "gelu": functools.partial(ops.gelu, approximate="tanh"), "rms_norm": rms,
            "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
            "fused_add_rms_norm": fused_add_rms_norm, "rotary_embedding": rotary_embedding}


def _synced(fn: Callable[[], Any], sync: Callable[[], Any]) -> Any:
    # PyNative queues kernels and returns at once; wait for the result, as opbridge's call does.
    out = fn()
    sync()
    return out


def _mindspore() -> dict[str, Factory]:
    sync = mindspore_sync()
    def synced(f: Callable[..., Any]) -> Factory:
        return lambda a: functools.partial(_synced, functools.partial(f, *a), sync)

    return {op: synced(f) for op, f in mindspore_formulas().items()}


_TABLES = {"torch": _torch, "numpy": _numpy, "jax": _jax, "paddle": _paddle, "mindspore": _mindspore}


def natives(framework: str) -> dict[str, Factory]:
    """``{op name: factory}`` of *framework*'s own implementations."""
    return _TABLES[framework]()
