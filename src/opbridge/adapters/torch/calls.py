"""What every torch call of an op shares: dtypes, devices, allocation and the kernel call.

The dispatcher's kernels (:mod:`.dispatcher`) and the dispatcher-free fast
path (:mod:`.fast`) are generated per op from the same lines
(:func:`kernel_lines`): the alias check of mutating ops, the outputs
(:func:`opbridge.call.core.alloc_source`; large new CPU ones from
opbridge's pool, :func:`large_empty`), and the kernel call, which on CUDA
publishes torch's current stream of the tensor's device to tvm-ffi around
the call. Both assume dense inputs and let the kernel's ``ValueError`` ("x
must be contiguous") send strided calls to :func:`strided_call`, which runs
the kernel on dense copies and copies mutated arguments back, so dense
calls pay nothing for it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opbridge import _tvm, loader
from opbridge.adapters.torch import flags, native
from opbridge.call import core, layout, memory, overlap

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: DLPack's device type for CUDA (``kDLCUDA``), as tvm-ffi's stream environment takes it.
KDL_CUDA = 2
#: Devices with a torch fast path and a dispatcher kernel.
DEVICES = ("cpu", "cuda")


def to_dtype(d: Any) -> torch.dtype:
    """A torch dtype from a torch dtype or a dtype name."""
    return d if isinstance(d, torch.dtype) else getattr(torch, str(d))


def dtype_name(t: torch.Tensor) -> str:
    """The dtype name opbridge declares (``"float32"`` for ``torch.float32``)."""
    return str(t.dtype).removeprefix("torch.")


def torch_dtypes(op: OpDef) -> frozenset[torch.dtype]:
    """*op*'s declared dtypes as torch dtypes: the fast paths' one-lookup guard."""
    return core.framework_dtypes(op, lambda name: to_dtype(name))


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def span(t: torch.Tensor) -> tuple[int, int]:
    """Byte addresses ``(start, end)`` of everything *t* can reach, strided views included."""
    if t.numel() == 0:
        p = t.data_ptr()
        return p, p
    start = t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (reach + 1) * t.element_size()


#: Whether two tensors' byte spans (strides included) overlap: the out= checks' quick test.
OVERLAP = overlap.span_overlap(span)


def _describe(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    size = t.element_size()
    return t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.stride()), size


#: Whether two tensors share an element (strided views that interleave do not): the alias check's verdict.
EXACT = layout.shares_memory(_describe)

#: The check of a strided tensor an op writes through a dense copy (:func:`opbridge.call.layout.written_check`):
#: elements that share memory (an expanded tensor); torch's copy back would refuse it only after the kernel ran.
WRITTEN = layout.written_check(_describe)


def rows(t: torch.Tensor) -> bool:
    """Whether a kernel takes *t* as rows at a stride, where its op declares it ``row_strided``."""
    return layout.row_strided(t.shape, t.stride())


def out_overlaps(out: torch.Tensor, tensors: Sequence[Any]) -> bool:
    """Whether *out* may share memory with one of *tensors* (None skipped): the ``out=`` fast path
    leaves such a call to the checked one (:func:`opbridge.call.overlap.outputs_overlap`)."""
    return any(t is not None and OVERLAP(out, t) for t in tensors)


#: :func:`span` inline for dense tensors (the generated calls run on dense ones only).
SPAN_SOURCE = "{s} = {t}.data_ptr(); {e} = {s} + {t}.nbytes"
#: For arguments the op declares ``row_strided``, which the fast path hands over as rows at a stride:
#: their full reach, and the exact test of a pair (:func:`opbridge.call.overlap.alias_check_source`).
ROWS_SOURCE = ("{s}, {e} = (_sp := {t}.data_ptr(), _sp + {t}.nbytes) if {t}.is_contiguous() else _t_span({t})",
               "_t_exact({a}, {b})")


def ordered(op: OpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Schema-ordered arguments; the dispatcher drops trailing defaults and passes kwarg-only ones by name."""
    rest = op.schema.arguments[len(args):]
    return [*args, *(kwargs[a.name] if a.name in kwargs else a.default for a in rest)]


def fake_empty(shape: tuple[int, ...], dtype: Any, lead: torch.Tensor) -> torch.Tensor:
    """:func:`new_empty` for fake and meta tensors: ``torch.empty`` only (no pool, no address to advise)."""
    return torch.empty(shape, dtype=to_dtype(dtype), device=lead.device)


def _pool_sized(shape: tuple[int, ...], dt: torch.dtype) -> bool:
    """Whether a new CPU output of *shape* and *dt* is large enough for opbridge's pool (:func:`large_empty`)."""
    return math.prod(shape) * dt.itemsize >= memory.MIN_BYTES


def new_empty(shape: tuple[int, ...], dtype: Any, lead: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor on *lead*'s device (the ``empty`` of :func:`opbridge.call.core.alloc_outputs`)."""
    dt = to_dtype(dtype)
    if lead.device.type == "cpu" and _pool_sized(shape, dt):
        return large_empty(shape, dt)
    return torch.empty(shape, dtype=dt, device=lead.device)


def fresh(t: torch.Tensor) -> None:
    """Huge-page advice for a new CPU output before the kernel first writes it (:mod:`opbridge.call.memory`)."""
    memory.advise_fresh(t.data_ptr(), t.nbytes)


def large_empty(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of 4 MiB or more from opbridge's pool (:func:`opbridge.call.memory.host_empty`).

    Recycled, 2 MiB-aligned huge pages. Through the native shim where it is
    loaded (an ordinary storage that ``resize_`` can grow), else shared
    through DLPack (a storage of fixed size); where the pool is not there
    (modules built before it), ``torch.empty`` with huge-page advice.
    """
    sh = native.loaded()
    if sh is not None:
        out = sh.pool_empty(shape, dt)
        if out is not None:
            return out  # type: ignore[no-any-return]
    t = memory.host_empty(shape, str(dt)[6:], math.prod(shape) * dt.itemsize)
    if t is not None:
        return torch.utils.dlpack.from_dlpack(t)
    out = torch.empty(shape, dtype=dt)
    fresh(out)
    return out


def large_like(x: torch.Tensor) -> torch.Tensor:
    """:func:`large_empty` shaped and typed like *x*."""
    return large_empty(tuple(x.shape), x.dtype)


def check_devices(op: OpDef, args: Sequence[Any], outs: Sequence[Any] = ()) -> None:
    """Raise ValueError unless every tensor argument (and ``out=`` tensor) is on the dispatching one's device."""
    lead = args[op.dispatch_arg]
    lead_name = op.schema.arguments[op.dispatch_arg].name
    named = [(op.schema.arguments[i].name, args[i]) for i in core.tensor_indices(op) if args[i] is not None]
    named += [("out" if len(outs) == 1 else f"out[{i}]", o) for i, o in enumerate(outs)]
    for name, t in named:
        if t.device != lead.device:
            raise ValueError(f"{op.name}: {name} is on {t.device}, but {lead_name} is on {lead.device}; "
                             f"all tensors of one call (out= included) must be on one device")


#: How a torch tensor changes dtype, for :func:`opbridge.call.core.dtype_error`'s hint.
CONVERT = "to(torch.{})"


def dtype_checker(op: OpDef) -> Callable[[torch.Tensor], None]:
    """A function raising :func:`opbridge.call.core.dtype_error` for the dtype argument *t*."""
    name = op.schema.arguments[op.dtype_arg].name

    def fail(t: torch.Tensor) -> None:
        raise core.dtype_error(op, name, dtype_name(t), CONVERT)

    return fail


def dense_test(op: OpDef, names: Sequence[str], rows: bool = False) -> str:
    """An expression: every Tensor argument among *names* is contiguous; with *rows*, or rows at a
    stride where the op declares it ``row_strided`` (``_t_rows``): the layouts its kernels take."""
    return core.layout_source(op, names, "{t}.is_contiguous()", "_t_rows({t})" if rows else None)


# -- the kernel call, as generated lines -----------------------------------------------------


def rule_alloc(op: OpDef, on_device: bool) -> Callable[..., list[torch.Tensor]]:
    """New outputs from *op*'s shape rule, its answers kept per argument signature (:func:`core.rule_plan`).

    A repeated call costs one dict lookup instead of the rule, and allocating
    costs ``torch.empty`` (CPU outputs of 4 MiB and more come from the pool,
    :func:`large_empty`). The function takes the argument tuple, and with
    *on_device* also the device to allocate on (CPU otherwise).
    """
    def plan(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], torch.dtype, bool]:
        dt = to_dtype(dtype)
        return shape, dt, not on_device and _pool_sized(shape, dt)

    plans = core.rule_plan(op, "{t}.shape, {t}.dtype", plan, "torch" + (" device" if on_device else ""))
    empty = torch.empty
    if on_device:
        def alloc_on(a: Sequence[Any], device: Any) -> list[torch.Tensor]:
            return [empty(shape, dtype=dt, device=device) for shape, dt, _ in plans(a)]

        return alloc_on

    def alloc(a: Sequence[Any]) -> list[torch.Tensor]:
        return [large_empty(shape, dt) if big else empty(shape, dtype=dt) for shape, dt, big in plans(a)]

    return alloc


def kernel_lines(op: OpDef, device: str, names: Sequence[str], outs: Sequence[str], indent: str,
                 allocate: bool = True) -> list[str]:
    """Lines running *op*'s *device* kernel on dense arguments held in *names*, into *outs*.

    The alias check (mutating ops); with *allocate*, the new outputs
    (``like`` ones as ``empty_like`` of the dense input they copy, so
    contiguous; others from the shape rule; on the CPU those of 4 MiB and
    more from opbridge's pool, :func:`large_empty`); then the call of
    ``_t_k_<device>``. On CUDA the call runs with
    torch's current stream of the dispatching tensor's device published to
    tvm-ffi, read from torch's raw handle: no Python stream object, no host
    synchronisation, so it is safe under CUDA graph capture.
    """
    lead = names[op.dispatch_arg]
    alias = overlap.alias_check_source(op, names, SPAN_SOURCE, "", rows=ROWS_SOURCE)
    # Our own name for the core's alias-check hook: adapters share the callable's globals.
    lines = alias.replace("_alias((", "_t_alias((").splitlines()
    if allocate:
        rule = "_t_alloc({args})" if device == "cpu" else f"_t_alloc_dev({{args}}, {lead}.device)"
        new_like = ("(_t_empty_like({x}) if {x}.nbytes < _t_hmin else _t_large_like({x}))" if device == "cpu"
                    else "_t_empty_like({x})")
        lines += core.alloc_source(op, names, outs, new_like, rule)
    call = f"_t_k_{device}({', '.join([*outs, *names])})"
    if device == "cpu":
        lines.append(call)
    else:
        lines += [f"_t_dev = {lead}.get_device()",
                  f"_t_prev = _t_set_stream({KDL_CUDA}, _t_dev, _t_raw_stream(_t_dev))",
                  "try:", f"    {call}", "finally:", f"    _t_set_stream({KDL_CUDA}, _t_dev, _t_prev)"]
    return [indent + line for line in lines]


def _no_cuda(index: int) -> int:
    raise RuntimeError("this torch build has no CUDA")


def _set_stream(device_type: int, device_id: int, stream: int) -> int:
    """Set tvm-ffi's environment stream of a device (what kernels launch on); return the previous one."""
    prev: int = _tvm.tvm_ffi().core._env_set_current_stream(device_type, device_id, stream)
    return prev


def lazy_kernel(op: OpDef, device: str, ns: dict[str, Any]) -> Callable[..., Any]:
    """A stand-in for ``ns["_t_k_<device>"]`` that resolves the kernel on its first call and replaces itself.

    Registering an op or installing its fast path never builds a kernel that
    no call has needed (a CUDA kernel on a machine without a GPU). The first
    CUDA call also binds tvm-ffi's stream setter itself in place of
    :func:`_set_stream`, which looks it up on each call.
    """
    name = f"_t_k_{device}"

    def first_call(*args: Any) -> Any:
        ns[name] = kernel(op, device)
        if device == "cuda":
            ns["_t_set_stream"] = _tvm.tvm_ffi().core._env_set_current_stream
        return ns[name](*args)

    return first_call


_KERNELS: dict[tuple[str, str], Any] = {}


_KERNEL_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def kernel(op: OpDef, device: str) -> Any:
    """*op*'s compiled kernel for *device*, loaded (or built) on the first request, once whichever threads
    ask: the native kernels get one kernel object per op and device (:func:`native.kernel_loaded`)."""
    key = (op.qualname, device)
    k = _KERNELS.get(key)
    if k is None:
        with _LOCKS_LOCK:
            lock = _KERNEL_LOCKS.setdefault(key, threading.Lock())
        with lock:  # per op and device: another op's first call never waits for this one's build
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = loader.kernel(op, device)
                native.kernel_loaded(op, device, k)
    return k


def namespace(op: OpDef, ns: dict[str, Any]) -> dict[str, Any]:
    """The globals :func:`kernel_lines` uses, for *op*, bound into *ns* (which holds the generated code)."""
    ns.update(_NAMES)
    ns.update({
        "_t_alias": lambda a: overlap.check_no_alias(op, a, span, EXACT),
        "_t_span": span,
        "_t_exact": EXACT,
        "_pack": lambda a, o: core.pack_results(op, a, o),
        "_t_dts": torch_dtypes(op),
        "_t_dtype_error": dtype_checker(op),
        "_t_check_devices": lambda a, o=(): check_devices(op, a, o),
        "_t_passable": lambda a: flags.check_passable(op, a),
        "_t_rows": rows,
    })
    if core.like_indices(op) is None and op.n_outputs:
        ns["_t_alloc"] = rule_alloc(op, False)
        # the fast out= path's guard (core.out_fits_source)
        ns["_t_out_plan"] = core.rule_plan(op, "{t}.shape, {t}.dtype", lambda s, dt: (s, to_dtype(dt)), "torch out=")
        if "cuda" in op.kernels:
            ns["_t_alloc_dev"] = rule_alloc(op, True)
    for device in DEVICES:
        if device in op.kernels:
            ns[f"_t_k_{device}"] = lazy_kernel(op, device, ns)
    return ns


_NAMES: dict[str, Any] = {
    "_T": torch.Tensor,
    "_t_empty_like": torch.empty_like,
    "_t_hmin": memory.MIN_BYTES,
    "_t_large_like": large_like,
    "_t_set_stream": _set_stream,
    "_t_ovl": out_overlaps,
    "_t_raw_stream": getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda),
}


def run_kernel(op: OpDef, outs: Sequence[Any], args: Sequence[Any]) -> None:
    """Call *op*'s kernel for the dispatching tensor's device (the slow paths' one kernel call)."""
    lead = args[op.dispatch_arg]
    device = lead.device.type
    if device not in op.kernels or device not in DEVICES:
        raise ValueError(f"{op.name}: no kernel for {device} tensors (kernels: {', '.join(op.kernels)})")
    k = kernel(op, device)
    if device == "cpu":
        k(*outs, *args)
        return
    index = lead.get_device()
    prev = _set_stream(KDL_CUDA, index, _NAMES["_t_raw_stream"](index))
    try:
        k(*outs, *args)
    finally:
        _set_stream(KDL_CUDA, index, prev)


def strided_fast(op: OpDef) -> Callable[[Sequence[Any], Callable[..., Any]], Any]:
    """*op* from its fast path on tensors some of which are not in a layout its kernels take:
    :func:`opbridge.call.overlap.recall_dense` (the public callable again on dense copies; no
    dispatcher, no kernel error), after the dtype check with the dispatcher's kernel's message.
    Versions are bumped as by the dispatcher: a mutated argument copied back by ``copy_``, one passed
    as it is by the call on it. A tensor of another layout than strided (sparse) goes to *slow*, the
    dispatcher call, with *args*.
    """
    recall = overlap.recall_dense(op, overlap.make_alias_check(op, span, exact=EXACT), torch.Tensor.is_contiguous,
                                  torch.Tensor.contiguous, rows, torch.Tensor.copy_, written=WRITTEN)
    dts, dtype_error, dt = torch_dtypes(op), dtype_checker(op), op.dtype_arg
    split, strided = op.schema.split, torch.strided

    def run(args: Sequence[Any], slow: Callable[..., Any]) -> Any:
        if any(type(a) is torch.Tensor and a.layout is not strided for a in args):
            pos, kw = split(args)
            return slow(*pos, **kw)
        if args[dt].dtype not in dts:
            dtype_error(args[dt])
        return recall(args)

    return run


def strided_call(op: OpDef) -> Callable[[Sequence[Any]], Any]:
    """*op* on arguments some of which are not dense: dense copies in, mutated ones copied back.

    New outputs are contiguous; the alias check uses each view's full reach.
    Returns the op's results like the dispatcher's kernel.
    """
    check_alias = overlap.make_alias_check(op, span, exact=EXACT)

    def call(args: Sequence[Any]) -> Any:
        check_devices(op, args)
        check_alias(args)
        full, back = overlap.dense_args(op, args, torch.Tensor.is_contiguous, torch.Tensor.contiguous, rows,
                                        written=WRITTEN)
        outs = core.alloc_outputs(op, full, new_empty)
        run_kernel(op, outs, full)
        for orig, copy in back:
            orig.copy_(copy)
        return core.pack_results(op, args, outs)

    return call
