"""The sections of ``opbridge bench frameworks``: what each framework's worker times.

A :class:`Section` is one opbridge-vs-native comparison (two zero-argument
callables, how to read their results as NumPy, and for asynchronous
frameworks how to wait for them); :data:`SECTIONS` builds each framework's
list in its worker process (:mod:`opbridge.bench.fw_worker`), which verifies
and times them. The larger parity table is :mod:`opbridge.bench.parity`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_SMALL = (8,)
_LARGE = (1024, 1024)
_EPS = 1e-6
_C = 0.7978845608028654  # sqrt(2/pi)


def shape_label(shape: tuple[int, ...]) -> str:
    """``(1024, 4096)`` as ``1024x4096``."""
    return "x".join(map(str, shape))


class Section:
    """One opbridge-vs-native comparison, before it is run."""

    def __init__(self, op: str, mode: str, shape: tuple[int, ...], opbridge: Callable[[], Any],
                 native: Callable[[], Any], descriptions: dict[str, str],
                 to_numpy: Callable[[Any], Any], sync: Callable[[], Any] | None = None,
                 sync_note: str | None = None) -> None:
        self.op, self.mode, self.shape = op, mode, shape
        self.fns = {"opbridge": opbridge, "native": native}
        self.descriptions = descriptions
        self.to_numpy = to_numpy
        self.sync = sync
        self.sync_note = sync_note

    @property
    def key(self) -> str:
        return f"{self.op}/{self.mode}/{shape_label(self.shape)}"


# -- the frameworks -------------------------------------------------------------


def _rand(shape: tuple[int, ...], seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _numpy_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import numpy as np

    from opbridge import ops

    x, y = _rand(_SMALL, 0), _rand(_SMALL, 1)
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(np.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "np.add(x, y)"}, to_numpy=lambda a: a)
    return [s], {}, {}


def _torch_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import torch

    from opbridge import ops

    x, y = torch.from_numpy(_rand(_SMALL, 0)), torch.from_numpy(_rand(_SMALL, 1))
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(torch.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "torch.add(x, y)"},
                to_numpy=lambda t: t.numpy())
    return [s], {}, {"torch_threads": torch.get_num_threads()}


def _block(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args).block_until_ready()


def _jax_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from opbridge import ops

    def arr(shape: tuple[int, ...], seed: int) -> Any:
        return jnp.asarray(_rand(shape, seed))

    def to_np(a: Any) -> Any:
        return np.asarray(a)

    x, y = arr(_SMALL, 0), arr(_SMALL, 1)
    native_add = jax.jit(jnp.add)
    sections = [Section(
        "add", "eager", _SMALL, functools.partial(_block, ops.add, x, y),
        functools.partial(_block, native_add, x, y),
        {"opbridge": "opbridge.ops.add(x, y).block_until_ready()",
         "native": "jax.jit(jnp.add)(x, y).block_until_ready(), called eagerly"}, to_numpy=to_np)]
    jit_pairs: list[tuple[str, Callable[..., Any], Callable[..., Any], str, str, int]] = [
        ("add", lambda a, b: ops.add(a, b), lambda a, b: a + b,
         "jax.jit(lambda x, y: ops.add(x, y))", "jax.jit(lambda x, y: x + y)", 2),
        ("gelu", lambda a: ops.gelu(a), lambda a: 0.5 * a * (1.0 + jnp.tanh(_C * (a + 0.044715 * a * a * a))),
         "jax.jit(lambda x: ops.gelu(x))",
         "jax.jit(lambda x: 0.5*x*(1 + jnp.tanh(sqrt(2/pi)*(x + 0.044715*x**3))))",
         1),
        ("rms_norm", lambda a, w: ops.rms_norm(a, w, _EPS),
         lambda a, w: a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + _EPS) * w,
         f"jax.jit(lambda x, w: ops.rms_norm(x, w, {_EPS}))",
         f"jax.jit(lambda x, w: x * lax.rsqrt(jnp.mean(x*x, -1, keepdims=True) + {_EPS}) * w)", 2),
    ]
    for op, ours, theirs, d_ours, d_theirs, nargs in jit_pairs:
        for shape in (_SMALL, _LARGE):
            if op == "rms_norm":
                args = (arr(shape, 2), arr(shape[-1:], 3))
            else:
                args = tuple(arr(shape, 4 + i) for i in range(nargs))
            sections.append(Section(
                op, "jit", shape, functools.partial(_block, jax.jit(ours), *args),
                functools.partial(_block, jax.jit(theirs), *args),
                {"opbridge": f"{d_ours}(...).block_until_ready()",
                 "native": f"{d_theirs}(...).block_until_ready()"},
                to_numpy=to_np))
    info = {"jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()]}
    return sections, {}, info


def _paddle_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    import paddle

    from opbridge import ops

    paddle.device.set_device("cpu")
    x, y = paddle.to_tensor(_rand(_SMALL, 0)), paddle.to_tensor(_rand(_SMALL, 1))
    s = Section("add", "eager", _SMALL, functools.partial(ops.add, x, y), functools.partial(paddle.add, x, y),
                {"opbridge": "opbridge.ops.add(x, y)", "native": "paddle.add(x, y)"},
                to_numpy=lambda t: t.numpy())
    return [s], {}, {"paddle_device": paddle.device.get_device()}


# MindSpore compiles these from source inside ms.jit, so they are module-level
# functions; the globals they name are set by _mindspore_sections().
_OPB: Any = None
_MSOPS: Any = None


def _ms_graph_opbridge(x: Any, y: Any) -> Any:
    return _OPB.add(x, y)


def _ms_graph_native(x: Any, y: Any) -> Any:
    return _MSOPS.add(x, y)


def _mindspore_sections() -> tuple[list[Section], dict[str, str], dict[str, Any]]:
    global _OPB, _MSOPS
    import mindspore as ms
    from mindspore import ops as msops

    from opbridge import ops

    _OPB, _MSOPS = ops, msops
    ms.set_device("CPU")
    x, y = ms.Tensor(_rand(_SMALL, 0)), ms.Tensor(_rand(_SMALL, 1))
    sync: Callable[[], Any]
    try:
        from mindspore.graph.api import _pynative_executor

        sync, note = _pynative_executor.sync, "sample = N calls + one _pynative_executor.sync()"
    except ImportError:  # pragma: no cover - other MindSpore layouts
        sync, note = (lambda: msops.add(x, y).asnumpy()), "sample = N calls + one ops.add(...).asnumpy()"
    note = ("MindSpore PyNative runs ops asynchronously (ops.add returns before its kernel ran); " + note
            + ", divided by N")

    def to_np(t: Any) -> Any:
        return t.asnumpy()

    sections = [Section(
        "add", "pynative", _SMALL, functools.partial(ops.add, x, y), functools.partial(msops.add, x, y),
        {"opbridge": "opbridge.ops.add(x, y)", "native": "mindspore.ops.add(x, y)"},
        to_numpy=to_np, sync=sync, sync_note=note)]
    skipped: dict[str, str] = {}
    extra: dict[str, Any] = {}
    key = f"add/ms.jit/{shape_label(_SMALL)}"
    try:
        from opbridge.adapters import mindspore as adapter

        if not hasattr(adapter, "register"):
            raise NotImplementedError("opbridge.adapters.mindspore has no graph-mode support (no register())")
        ours, theirs = ms.jit(_ms_graph_opbridge), ms.jit(_ms_graph_native)
        ours(x, y).asnumpy()  # compiles; raises if graph mode is not supported
        theirs(x, y).asnumpy()
        sections.append(Section(
            "add", "ms.jit", _SMALL, functools.partial(ours, x, y), functools.partial(theirs, x, y),
            {"opbridge": "ms.jit(def f(x, y): return opbridge.ops.add(x, y))",
             "native": "ms.jit(def f(x, y): return mindspore.ops.add(x, y))"},
            to_numpy=to_np, sync=sync, sync_note=note))
        try:
            from opbridge.adapters.mindspore import aot as mindspore_aot

            extra["graph_wrapper_path"] = str(mindspore_aot.aot_module(ops.LIBRARY).path)
            extra["graph_wrapper_note"] = ("ms.jit runs the ops.Custom(func_type='aot') wrapper, which calls "
                                           "the kernels of the loaded module (module.loaded_path)")
        except Exception as e:  # informational only
            extra["graph_wrapper_path"] = f"unknown ({type(e).__name__}: {e})"
    except Exception as e:
        skipped[key] = f"MindSpore graph mode not available: {type(e).__name__}: {str(e).strip()[:500]}"
    return sections, skipped, extra


SECTIONS: dict[str, Callable[[], tuple[list[Section], dict[str, str], dict[str, Any]]]] = {
    "numpy": _numpy_sections,
    "torch": _torch_sections,
    "jax": _jax_sections,
    "paddle": _paddle_sections,
    "mindspore": _mindspore_sections,
}
