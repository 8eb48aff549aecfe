"""The sections of ``opbridge bench frameworks``: what each framework's worker times.

A :class:`Section` is one opbridge-vs-native comparison (two zero-argument
callables, how to read their results as NumPy, for asynchronous frameworks
how to wait for them, and for ops that write their arguments what to
compare); :data:`SECTIONS` builds each framework's list in its worker process
(:mod:`opbridge.bench.fw_worker`), which verifies and times them. The
larger parity table is :mod:`opbridge.bench.parity`.

Every op of :data:`PER_CALL_OPS` gets a section in each framework's eager
mode (PyNative for MindSpore) on :func:`inputs`: ``add`` on 8 float32
elements, the others at the serving size :data:`ROWS`, next to the
framework's own formula or op from :mod:`opbridge.bench.natives`. Graph
modes add ``jax.jit`` sections (``add``, ``gelu``, ``rms_norm`` at (8,) and
(1024, 1024)) and MindSpore's ``ms.jit`` ``add``, each where its op is
selected; ``rms_norm`` also gets a ``vmap`` section in JAX (jitted) and
torch (``torch.func.vmap``) over a batch of :data:`VMAP` (batch, rows,
hidden), the weight left out of the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opbridge.bench.fw_inputs import OUT_SECTIONS, PER_CALL_OPS, SMALL, VIEW_SECTIONS, Cols, called_op, inputs, rand

__all__ = ["OUT_SECTIONS", "PER_CALL_OPS", "SECTIONS", "VIEW_SECTIONS", "Section", "called_op", "inputs",
           "shape_label"]

_LARGE = (1024, 1024)
#: The ``vmap`` sections' input: a batch of 32 (8, 1024) blocks of rows.
VMAP = (32, 8, 1024)
_EPS = 1e-6
_C = 0.7978845608028654  # sqrt(2/pi)

Sections = tuple[list["Section"], dict[str, str], dict[str, Any]]
#: ``make(schema-ordered args) -> zero-argument call`` (as :data:`opbridge.bench.natives.Factory`).
Factory = Callable[[Sequence[Any]], Callable[[], Any]]


def shape_label(shape: tuple[int, ...]) -> str:
    """``(1024, 4096)`` as ``1024x4096``."""
    return "x".join(map(str, shape))


class Section:
    """One opbridge-vs-native comparison, before it is run.

    *result*, for an op that writes its arguments: ``result(name)`` runs
    candidate *name* (``"opbridge"`` or ``"native"``) once on fresh copies of
    the inputs and returns the arguments it wrote, which verification then
    compares; without it, verification compares what the candidates return.
    """

    def __init__(self, op: str, mode: str, shape: tuple[int, ...], opbridge: Callable[[], Any],
                 native: Callable[[], Any], descriptions: dict[str, str],
                 to_numpy: Callable[[Any], Any], sync: Callable[[], Any] | None = None,
                 sync_note: str | None = None, result: Callable[[str], Any] | None = None) -> None:
        self.op, self.mode, self.shape = op, mode, shape
        self.fns = {"opbridge": opbridge, "native": native}
        self.descriptions = descriptions
        self.to_numpy = to_numpy
        self.sync = sync
        self.sync_note = sync_note
        self.result = result

    @property
    def key(self) -> str:
        return f"{self.op}/{self.mode}/{shape_label(self.shape)}"


# -- one eager section per op, in any framework -------------------------------------------


@dataclass(frozen=True)
class _Kit:
    """How one framework's eager sections are made."""

    mode: str
    to: Callable[[Any], Any]  # a NumPy array as a new array of the framework
    to_numpy: Callable[[Any], Any]
    natives: dict[str, Factory]
    what: dict[str, str]
    call: Callable[..., Callable[[], Any]] = functools.partial  # call(opbridge op, *args)
    waits: bool = False  # JAX: each call waits for its result (what the descriptions say)
    in_place: bool = True  # mutating ops write their arguments (not JAX: it returns their new values)
    sync: Callable[[], Any] | None = None
    sync_note: str | None = None

    def args(self, raw: Sequence[Any]) -> list[Any]:
        bases: dict[int, Any] = {}
        out = []
        for a in raw:
            if isinstance(a, Cols):
                base = bases.get(id(a.base))
                if base is None:
                    base = bases[id(a.base)] = self.to(a.base)
                out.append(base[:, a.start:a.stop])
            else:
                out.append(self.to(a) if hasattr(a, "shape") else a)
        return out


def _fresh_result(kit: _Kit, raw: Sequence[Any], written: Sequence[int],
                  makes: dict[str, Factory]) -> Callable[[str], Any]:
    def result(name: str) -> tuple[Any, ...]:
        args = kit.args(raw)
        makes[name](args)()
        return tuple(args[i] for i in written)

    return result


def _ours(call: Callable[..., Callable[[], Any]], fn: Any, args: Sequence[Any]) -> Callable[[], Any]:
    return call(fn, *args)


def _eager_sections(kit: _Kit, ops: Sequence[str]) -> list[Section]:
    import numpy as np

    from opbridge import ops as opbridge_ops
    from opbridge.bench.verify import mutated

    sections = []
    for op in ops:
        shape, raw = inputs(op)
        called = called_op(op)
        fn = getattr(opbridge_ops, called)
        makes: dict[str, Factory] = {"opbridge": functools.partial(_ours, kit.call, fn),
                                     "native": kit.natives[op if op in OUT_SECTIONS else called]}
        written = mutated(fn.opdef)
        result = _fresh_result(kit, raw, written, makes) if written and kit.in_place else None
        names = ", ".join(a.name for a in fn.opdef.schema.arguments)
        ours = f"opbridge.ops.{called}({names})"
        what = kit.what[op if op in OUT_SECTIONS else called]
        if op in VIEW_SECTIONS:
            views = ", ".join(f"{a.name} = qkv[:, {v.start}:{v.stop}]"
                              for a, v in zip(fn.opdef.schema.arguments, raw) if isinstance(v, Cols))
            ours, what = f"{ours}; {views}", f"{what}; {views}"
        if kit.waits:
            ours = f"jax.block_until_ready({ours})" if written else f"{ours}.block_until_ready()"
        args = kit.args(raw)
        if op in OUT_SECTIONS:  # each candidate its own out=, made once
            zeros = np.zeros_like(fn.opdef.reference(*raw))
            ours = f"opbridge.ops.{called}({names}, out=o)"
            mine, theirs = kit.to(zeros), kit.to(zeros)
            run_ours: Callable[[], Any] = functools.partial(fn, *args, out=mine)
            run_native = makes["native"]([*args, theirs])
        else:
            run_ours, run_native = makes["opbridge"](args), makes["native"](args)
        sections.append(Section(op, kit.mode, shape, run_ours, run_native,
                                {"opbridge": ours, "native": what}, to_numpy=kit.to_numpy,
                                sync=kit.sync, sync_note=kit.sync_note, result=result))
    return sections


# -- the frameworks -------------------------------------------------------------


def _copy(a: Any) -> Any:
    return a.copy()


def _numpy_sections(ops: Sequence[str]) -> Sections:
    from opbridge.bench import natives

    kit = _Kit("eager", _copy, lambda a: a, natives.natives("numpy"), natives.descriptions("numpy"))
    return _eager_sections(kit, ops), {}, {}


def _torch_sections(ops: Sequence[str]) -> Sections:
    import torch

    from opbridge import ops as opbridge_ops
    from opbridge.bench import natives

    kit = _Kit("eager", lambda a: torch.from_numpy(a.copy()), lambda t: t.numpy(), natives.natives("torch"),
               natives.descriptions("torch"))
    sections = _eager_sections(kit, ops)
    if "rms_norm" in ops:
        x, w = torch.from_numpy(rand(VMAP, 2)), torch.from_numpy(rand(VMAP[-1:], 3))
        ours = torch.func.vmap(lambda a: opbridge_ops.rms_norm(a, w, _EPS))
        theirs = torch.func.vmap(lambda a: torch.nn.functional.rms_norm(a, (VMAP[-1],), w, _EPS))
        sections.append(Section(
            "rms_norm", "vmap", VMAP, functools.partial(ours, x), functools.partial(theirs, x),
            {"opbridge": f"torch.func.vmap(lambda x: ops.rms_norm(x, w, {_EPS}))(x)",
             "native": f"torch.func.vmap(lambda x: F.rms_norm(x, (H,), w, {_EPS}))(x)"},
            to_numpy=lambda t: t.numpy()))
    return sections, {}, {"torch_threads": torch.get_num_threads()}


def _jax_sections(ops: Sequence[str]) -> Sections:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from opbridge import ops as opbridge_ops
    from opbridge.bench import natives

    info: dict[str, Any] = {}

    def arr(shape: tuple[int, ...], seed: int) -> Any:
        return jnp.asarray(rand(shape, seed))

    def to_np(a: Any) -> Any:
        return np.asarray(a)

    kit = _Kit("eager", jnp.asarray, to_np, natives.natives("jax"), natives.descriptions("jax"),
               call=functools.partial(functools.partial, natives.jax_call),  # call(op, *a): waits too
               waits=True, in_place=False)
    sections = _eager_sections(kit, [op for op in ops if op not in VIEW_SECTIONS and op not in OUT_SECTIONS])
    jit_pairs: list[tuple[str, Callable[..., Any], Callable[..., Any], str, str, int]] = [
        ("add", lambda a, b: opbridge_ops.add(a, b), lambda a, b: a + b,
         "jax.jit(lambda x, y: ops.add(x, y))", "jax.jit(lambda x, y: x + y)", 2),
        ("gelu", lambda a: opbridge_ops.gelu(a),
         lambda a: 0.5 * a * (1.0 + jnp.tanh(_C * (a + 0.044715 * a * a * a))),
         "jax.jit(lambda x: ops.gelu(x))",
         "jax.jit(lambda x: 0.5*x*(1 + jnp.tanh(sqrt(2/pi)*(x + 0.044715*x**3))))",
         1),
        ("rms_norm", lambda a, w: opbridge_ops.rms_norm(a, w, _EPS),
         lambda a, w: a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + _EPS) * w,
         f"jax.jit(lambda x, w: ops.rms_norm(x, w, {_EPS}))",
         f"jax.jit(lambda x, w: x * lax.rsqrt(jnp.mean(x*x, -1, keepdims=True) + {_EPS}) * w)", 2),
    ]
    for op, ours, theirs, d_ours, d_theirs, nargs in jit_pairs:
        if op not in ops:
            continue
        for shape in (SMALL, _LARGE):
            if op == "rms_norm":
                args = (arr(shape, 2), arr(shape[-1:], 3))
            else:
                args = tuple(arr(shape, 4 + i) for i in range(nargs))
            sections.append(Section(
                op, "jit", shape, functools.partial(natives.jax_call, jax.jit(ours), *args),
                functools.partial(natives.jax_call, jax.jit(theirs), *args),
                {"opbridge": f"{d_ours}(...).block_until_ready()",
                 "native": f"{d_theirs}(...).block_until_ready()"},
                to_numpy=to_np))
    if "rms_norm" in ops:
        x, w = arr(VMAP, 2), arr(VMAP[-1:], 3)
        ours, theirs = next(p[1:3] for p in jit_pairs if p[0] == "rms_norm")  # the jit section's formula
        sections.append(Section(
            "rms_norm", "vmap", VMAP,
            functools.partial(natives.jax_call, jax.jit(jax.vmap(ours, in_axes=(0, None))), x, w),
            functools.partial(natives.jax_call, jax.jit(jax.vmap(theirs, in_axes=(0, None))), x, w),
            {"opbridge": f"jax.jit(jax.vmap(lambda x, w: ops.rms_norm(x, w, {_EPS}), in_axes=(0, None)))",
             "native": "jax.jit(jax.vmap(<the jit rms_norm formula>, in_axes=(0, None)))"},
            to_numpy=to_np))
    info.update({"jax_backend": jax.default_backend(), "jax_devices": [str(d) for d in jax.devices()]})
    skipped = {f"{op}/eager/{shape_label(inputs(op)[0])}": "JAX arrays have no views"
               for op in ops if op in VIEW_SECTIONS}
    skipped.update({f"{op}/eager/{shape_label(inputs(op)[0])}": (
        "JAX arrays are immutable: out= computes into a buffer jax.jit donates (docs/performance.md, 'Large outputs')")
        for op in ops if op in OUT_SECTIONS})
    return sections, skipped, info


def _paddle_sections(ops: Sequence[str]) -> Sections:
    import paddle

    from opbridge.bench import natives

    paddle.device.set_device("cpu")
    kit = _Kit("eager", paddle.to_tensor, lambda t: t.numpy(), natives.natives("paddle"),
               natives.descriptions("paddle"))
    return _eager_sections(kit, ops), {}, {"paddle_device": paddle.device.get_device()}


# MindSpore compiles these from source inside ms.jit, so they are module-level
# functions; the globals they name are set by _mindspore_sections().
_OPB: Any = None
_MSOPS: Any = None


def _ms_graph_opbridge(x: Any, y: Any) -> Any:
    return _OPB.add(x, y)


def _ms_graph_native(x: Any, y: Any) -> Any:
    return _MSOPS.add(x, y)


def _mindspore_sections(ops: Sequence[str]) -> Sections:
    global _OPB, _MSOPS
    import mindspore as ms
    from mindspore import ops as msops

    from opbridge import ops as opbridge_ops
    from opbridge.bench import natives

    _OPB, _MSOPS = opbridge_ops, msops
    ms.set_device("CPU")
    sync = natives.mindspore_sync()
    note = ("MindSpore PyNative runs ops asynchronously (ops.add returns before its kernel ran); sample = N "
            "calls + one _pynative_executor.sync(), divided by N, each candidate its own N (calls: "
            "opbridge/native where they differ)")

    def to_np(t: Any) -> Any:
        return t.asnumpy()

    queued = {op: natives.bind(f) for op, f in natives.mindspore_formulas().items()}
    kit = _Kit("pynative", lambda a: ms.Tensor(a.copy()), to_np, queued, natives.descriptions("mindspore"),
               sync=sync, sync_note=note)
    # opbridge rotates MindSpore's qkv slices in place (tests/conformance/test_row_strided.py); the native
    # formula cannot write them, so there is nothing to time it against.
    writes = [op for op in ops if op == "rotary_embedding_qkv"]
    sections = _eager_sections(kit, [op for op in ops if op not in writes and op not in OUT_SECTIONS])
    skipped: dict[str, str] = {
        f"{op}/pynative/{shape_label(inputs(op)[0])}": (
            "no native in-place formula: MindSpore's Tensor.copy_ does not write a non-contiguous CPU view "
            "(it warns 'cannot use CPU inplace copy normally' and the qkv tensor keeps its old values)")
        for op in writes}
    skipped.update({f"{op}/pynative/{shape_label(inputs(op)[0])}": "MindSpore's own ops take no out= to time against"
                    for op in ops if op in OUT_SECTIONS})
    extra: dict[str, Any] = {}
    if "add" not in ops:
        return sections, skipped, extra
    x, y = ms.Tensor(rand(SMALL, 0)), ms.Tensor(rand(SMALL, 1))
    key = f"add/ms.jit/{shape_label(SMALL)}"
    try:
        from opbridge.adapters import mindspore as adapter

        if not hasattr(adapter, "register"):
            raise NotImplementedError("opbridge.adapters.mindspore has no graph-mode support (no register())")
        ours, theirs = ms.jit(_ms_graph_opbridge), ms.jit(_ms_graph_native)
        ours(x, y).asnumpy()  # compiles; raises if graph mode is not supported
        theirs(x, y).asnumpy()
        sections.append(Section(
            "add", "ms.jit", SMALL, functools.partial(ours, x, y), functools.partial(theirs, x, y),
            {"opbridge": "ms.jit(def f(x, y): return opbridge.ops.add(x, y))",
             "native": "ms.jit(def f(x, y): return mindspore.ops.add(x, y))"},
            to_numpy=to_np, sync=sync, sync_note=note))
        try:
            from opbridge.adapters.mindspore import aot as mindspore_aot

            extra["graph_wrapper_path"] = str(mindspore_aot.aot_module(opbridge_ops.LIBRARY).path)
            extra["graph_wrapper_note"] = ("ms.jit runs the ops.Custom(func_type='aot') wrapper, which calls "
                                           "the kernels of the loaded module (module.loaded_path)")
        except Exception as e:  # informational only
            extra["graph_wrapper_path"] = f"unknown ({type(e).__name__}: {e})"
    except Exception as e:
        skipped[key] = f"MindSpore graph mode not available: {type(e).__name__}: {str(e).strip()[:500]}"
    return sections, skipped, extra


#: ``SECTIONS[framework](ops)``: that framework's sections of the per-call ops *ops*, the sections it
#: skipped (key -> why) and what else its document reports.
SECTIONS: dict[str, Callable[[Sequence[str]], Sections]] = {
    "numpy": _numpy_sections,
    "torch": _torch_sections,
    "jax": _jax_sections,
    "paddle": _paddle_sections,
    "mindspore": _mindspore_sections,
}
