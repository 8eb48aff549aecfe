"""Each framework's own implementation of the built-in ops, to time ours against.

Only what a framework ships counts as native (``torch.add``, ``jnp`` under
``jit``, ``paddle.add``, MindSpore ``ops.add``, ``np.add``); an entry is a
factory ``make(args) -> zero-argument callable`` so that set-up (e.g. jitting)
happens before timing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Factory = Callable[[Sequence[Any]], Callable[[], Any]]
_C = 0.7978845608028654  # sqrt(2/pi)


def _torch() -> dict[str, Factory]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    return {
        "add": lambda a: lambda: torch.add(a[0], a[1]),
        "gelu": lambda a: lambda: F.gelu(a[0], approximate="tanh"),
        "rms_norm": lambda a: lambda: F.rms_norm(a[0], (a[0].shape[-1],), a[1], a[2]),
    }


def _numpy() -> dict[str, Factory]:
    import numpy as np

    def gelu(x: Any) -> Any:
        return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x * x * x)))

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    return {
        "add": lambda a: lambda: np.add(a[0], a[1]),
        "gelu": lambda a: lambda: gelu(a[0]),
        "rms_norm": lambda a: lambda: rms(a[0], a[1], a[2]),
    }


def jax_formulas() -> dict[str, Callable[..., Any]]:
    """``{op name: jnp formula}``, un-jitted, on schema-ordered arguments (scalars as Python values).

    Each computes in its inputs' dtype, as the ops' NumPy references do
    (:mod:`opbridge.ops`): GELU is the tanh approximation, the gated ops
    split ``x = [a | b]`` along the last dim and activate ``a``, and a
    mutating op (``fused_add_rms_norm``) returns the new values of its
    mutated arguments in schema order, as opbridge's JAX adapter does.
    Called eagerly they run jnp op by op; under ``jax.jit`` XLA fuses them.
    Keep scalars (``eps``) static: a traced float32 scalar would promote
    bfloat16 inputs to a float32 result.
    """
    import jax
    import jax.numpy as jnp

    def gelu(x: Any) -> Any:
        return jax.nn.gelu(x, approximate=True)

    def rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    def halves(x: Any) -> tuple[Any, Any]:
        d = x.shape[-1] // 2
        return x[..., :d], x[..., d:]

    def silu_and_mul(x: Any) -> Any:
        a, b = halves(x)
        return jax.nn.silu(a) * b

    def gelu_and_mul(x: Any) -> Any:
        a, b = halves(x)
        return gelu(a) * b

    def fused_add_rms_norm(x: Any, residual: Any, w: Any, eps: float = 1e-6) -> tuple[Any, Any]:
        s = x + residual
        return rms(s, w, eps), s

    return {"add": jnp.add, "gelu": gelu, "rms_norm": rms, "silu_and_mul": silu_and_mul,
            "gelu_and_mul": gelu_and_mul, "fused_add_rms_norm": fused_add_rms_norm}


def _jax() -> dict[str, Factory]:
    import jax

    f = jax_formulas()
    add = jax.jit(f["add"])
    gelu = jax.jit(f["gelu"])
    rms = jax.jit(f["rms_norm"], static_argnums=2)  # eps static (see jax_formulas)
    return {
        "add": lambda a: lambda: add(a[0], a[1]).block_until_ready(),
        "gelu": lambda a: lambda: gelu(a[0]).block_until_ready(),
        "rms_norm": lambda a: lambda: rms(a[0], a[1], a[2]).block_until_ready(),
    }


def _paddle() -> dict[str, Factory]:
    import paddle
    import paddle.nn.functional as F  # noqa: N812

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + eps) * w

    return {
        "add": lambda a: lambda: paddle.add(a[0], a[1]),
        "gelu": lambda a: lambda: F.gelu(a[0], approximate=True),
        "rms_norm": lambda a: lambda: rms(a[0], a[1], a[2]),
    }


def mindspore_sync() -> Callable[[], Any]:
    """Wait for MindSpore PyNative's queued kernels.

    ``_pynative_executor.sync``, what the MindSpore adapter waits with: on a
    CPU-only build ``mindspore.runtime.synchronize()`` logs "[ERROR] ... CPU
    device is not supported" and returns without waiting.
    """
    from mindspore.graph.api import _pynative_executor

    sync: Callable[[], Any] = _pynative_executor.sync
    return sync


def _mindspore() -> dict[str, Factory]:
    from mindspore import ops

    def rms(x: Any, w: Any, eps: float) -> Any:
        return x * ops.rsqrt(ops.mean(x * x, -1, True) + eps) * w

    sync = mindspore_sync()

    def synced(fn: Callable[[], Any]) -> Callable[[], Any]:
        # PyNative queues kernels and returns at once; wait for the result, as opbridge's call does.
        def run() -> Any:
            out = fn()
            sync()
            return out

        return run

    return {
        "add": lambda a: synced(lambda: ops.add(a[0], a[1])),
        "gelu": lambda a: synced(lambda: ops.gelu(a[0], approximate="tanh")),
        "rms_norm": lambda a: synced(lambda: rms(a[0], a[1], a[2])),
    }


_TABLES = {"torch": _torch, "numpy": _numpy, "jax": _jax, "paddle": _paddle, "mindspore": _mindspore}


def natives(framework: str) -> dict[str, Factory]:
    """``{op name: factory}`` of *framework*'s own implementations."""
    return _TABLES[framework]()
