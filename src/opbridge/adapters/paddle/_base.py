"""What every Paddle call path shares: tensor facts, devices and kernels, allocation.

Devices
    A call runs where its dispatching tensor lives: CPU tensors on the CPU
    kernel, ``gpu:N`` tensors on the CUDA kernel on Paddle's current stream of
    that GPU (a Paddle build with CUDA and an op with a CUDA kernel needed).
    Anything else, or tensors on two devices, raises a clear error naming the
    op, Paddle and the device before any kernel runs, so a CPU kernel never
    receives a device pointer (:func:`target`).
Allocation
    New outputs are contiguous, on the dispatching tensor's place
    (:func:`opbridge.call.core.alloc_outputs`). Paddle maps a large CPU
    buffer anew for each call, and its first write would otherwise fault once
    per 4 KiB page (16,385 faults at (4096, 4096) float32): a new CPU output
    of 4 MiB or more comes from opbridge's pool of recycled, huge-page
    buffers (:func:`large_empty`, :mod:`opbridge.call.memory`), or, without
    it, gets huge-page advice before the kernel writes it (:func:`fresh`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

with warnings.catch_warnings():
    # Paddle warns at import when ccache is missing (it matters only for its own C++ extensions).
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    import paddle
from paddle import _C_ops
from paddle.utils.dlpack import from_dlpack as _from_dlpack

from opbridge import _tvm, loader
from opbridge.call import core, layout, memory, unpassable
from opbridge.errors import BackendUnavailableError, OpbridgeError

if TYPE_CHECKING:
    from opbridge.declare import OpDef

T: Any = paddle.Tensor
VALUE: type = paddle.pir.Value  # type: ignore[attr-defined]
CORE: Any = paddle.base.core
KIND = "a paddle.Tensor"
_CPU = paddle.CPUPlace()


class PaddleStaticError(OpbridgeError, NotImplementedError):
    """An opbridge op cannot be put into this kind of Paddle static graph."""


def dtype(d: Any) -> Any:
    """A Paddle dtype from a dtype name or a Paddle dtype."""
    return getattr(paddle, d) if isinstance(d, str) else d


def name_of(d: Any) -> str:
    """The declared-dtype name of Paddle dtype *d* (``paddle.float32`` -> ``"float32"``)."""
    return str(d).rpartition(".")[2]


def dtype_name(t: Any) -> str:
    """The declared-dtype name of tensor *t*'s dtype (:func:`name_of`)."""
    return name_of(t.dtype)


def op_dtypes(op: OpDef) -> frozenset[Any]:
    """The op's declared dtypes as Paddle dtypes."""
    return core.framework_dtypes(op, lambda name: getattr(paddle, name))


def is_tensor(x: Any) -> bool:
    """Whether *x* is an eager Paddle tensor (a parameter included)."""
    return isinstance(x, T)


def unpassable_tensor(t: Any, lead: Any) -> unpassable.Unpassable | None:
    """A sparse tensor, which DLPack cannot carry (:func:`opbridge.call.unpassable.check`'s probe): Paddle's
    export says "Can't get __dlpack__ from a Tensor from sparse storage", and tvm-ffi's conversion fails on
    its dims ("Invalid dimension to be accessed")."""
    if isinstance(t, T) and t.is_sparse():
        kind = "COO" if t.is_sparse_coo() else "CSR"
        return unpassable.Unpassable(f"a sparse {kind} layout", "DLPack carries dense tensors only", "to_dense()")
    return None


def check_passable(op: OpDef, args: Sequence[Any]) -> None:
    """Raise the op's TypeError naming a tensor argument DLPack cannot carry (:func:`unpassable_tensor`), if any."""
    unpassable.check(op, args, unpassable_tensor)


def is_dense(t: Any) -> bool:
    """Whether the kernel can take *t* as it is."""
    return bool(t.is_contiguous())


def rows(t: Any) -> bool:
    """Whether a kernel takes *t* as rows at a stride, where its op declares it ``row_strided``."""
    return layout.row_strided(t.shape, t.strides)


def rows_of(t: Any) -> layout.ByteRows | None:
    """*t*'s memory as :func:`opbridge.call.layout.accepted_rows` where a kernel takes it as rows at a stride
    (its op declares it ``row_strided``), else None: one read of Paddle's shape, strides and address,
    which cost about 0.5 µs each, for the fast path's guard, span and alias test alike."""
    item = t.element_size()
    return layout.accepted_rows(t.data_ptr(), t.shape, [s * item for s in t.strides], item)


def densify(t: Any) -> Any:
    """One contiguous copy of a strided tensor.

    Not ``t.contiguous()``: Paddle's makes *t* itself contiguous, in place,
    cutting the caller's view off from its base.
    """
    return t.clone()


def write_back(orig: Any, copy: Any) -> None:
    """Write a mutated dense copy back through the caller's strided view (its base sees it)."""
    paddle.assign(copy, output=orig)


def span(t: Any) -> tuple[int, int]:
    """``(start, end)`` byte addresses of *t*'s memory."""
    p = t.data_ptr()
    return p, p + math.prod(t.shape) * t.element_size()  # t.size is the same number, 30x slower (6.8 µs)


def strided_span(t: Any) -> tuple[int, int]:
    """``(start, end)`` byte addresses of everything *t* can reach, strided views included."""
    p = t.data_ptr()
    if math.prod(t.shape) == 0:
        return p, p
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.strides))  # strides in elements
    return p, p + (reach + 1) * t.element_size()


def _describe(t: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    size = t.element_size()
    return t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.strides), size


#: Whether two tensors share an element (strided views that interleave do not): the alias check's verdict.
EXACT = layout.shares_memory(_describe)

def _strides_only(t: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """:func:`_describe` without the address (0.5 µs to read), which :func:`opbridge.call.layout.self_overlaps`
    does not need."""
    size = t.element_size()
    return 0, tuple(t.shape), tuple(s * size for s in t.strides), size


#: The check of a strided tensor the op writes (a mutated argument, an ``out=`` buffer) before the kernel:
#: elements that share memory (``paddle.as_strided`` with a stride 0, rows that overlap) are refused.
WRITTEN = layout.written_check(_strides_only)


#: :func:`span` inline, for :func:`opbridge.call.overlap.alias_check_source` (``_prod`` is ``math.prod``).
SPAN_SOURCE = "{s} = {t}.data_ptr(); {e} = {s} + _prod({t}.shape) * {t}.element_size()"


def fresh(t: Any) -> None:
    """Huge-page advice for a new CPU output before the kernel first writes it."""
    memory.advise_fresh(t.data_ptr(), math.prod(t.shape) * t.element_size())


#: Byte size of each Paddle dtype an output may have.
_ITEMSIZE = {paddle.float32: 4, paddle.float64: 8, paddle.float16: 2, paddle.bfloat16: 2, paddle.int64: 8,
             paddle.int32: 4, paddle.int16: 2, paddle.int8: 1, paddle.uint8: 1, paddle.bool: 1}


def large_empty(shape: Sequence[int], d: Any) -> Any | None:
    """A new CPU tensor of 4 MiB or more from opbridge's pool; None for any other output, or without it.

    Paddle maps a large CPU buffer anew for each call and unmaps it when it
    is freed, so each call's output would be fresh memory whose first write
    faults into the OS (at (1024, 4096) float32, 520 faults per call even on
    huge pages; ``ops.gelu`` was 2.1x the NumPy path in ``bench frameworks
    --parity``). The pool's buffer (:func:`opbridge.call.memory.host_empty`:
    recycled, 2 MiB-aligned huge pages) is shared with Paddle through DLPack,
    no copy; it goes back to the pool when the tensor dies.
    """
    size = _ITEMSIZE.get(d)
    if size is None:
        return None
    shape = tuple(shape)
    t = memory.host_empty(shape, name_of(d), math.prod(shape) * size)
    return None if t is None else _from_dlpack(t)


def large_like(x: Any) -> Any:
    """A new CPU output shaped like CPU tensor *x* of 4 MiB or more (:func:`large_empty`, else advised)."""
    t = large_empty(x.shape, x.dtype)
    if t is None:
        t = _C_ops.empty_like(x, x.dtype, _CPU)
        fresh(t)
    return t


def alloc(op: OpDef, args: Sequence[Any], place: Any) -> list[Any]:
    """New outputs of a call of *op* on *place* (the dispatching tensor's); large CPU ones as :func:`large_like`."""
    cpu = place.is_cpu_place()

    def new(shape: tuple[int, ...], dt: Any, lead: Any) -> Any:
        return _new(list(shape), dtype(dt), cpu and _pool_sized(shape, dtype(dt)), place)

    return core.alloc_outputs(op, args, new)


def rule_alloc(op: OpDef) -> Callable[[Sequence[Any], Any], list[Any]]:
    """:func:`alloc` for an op whose outputs a shape rule makes, the rule's answers kept per argument
    signature (:func:`opbridge.call.core.rule_plan`): ``silu_and_mul`` at 8 x 64, 4.5 -> 3 µs a call."""
    def plan(shape: tuple[int, ...], dt: Any) -> tuple[list[int], Any, bool]:
        d = dtype(dt)
        return list(shape), d, _pool_sized(shape, d)

    # id(dtype): Paddle's dtypes are singletons whose hash costs about 1 µs; their id costs nothing
    plans = core.rule_plan(op, "tuple({t}.shape), id({t}.dtype)", plan, "paddle")

    def alloc_rule(args: Sequence[Any], place: Any) -> list[Any]:
        cpu = place.is_cpu_place()
        return [_new(shape, d, cpu and big, place) for shape, d, big in plans(args)]

    return alloc_rule


def _pool_sized(shape: Sequence[int], d: Any) -> bool:
    """Whether a new output is worth the pool and huge-page advice (4 MiB+), sized in 0.1 µs (the dtype name
    :func:`large_empty` needs costs 0.75 µs)."""
    return math.prod(shape) * _ITEMSIZE.get(d, 1) >= memory.MIN_BYTES


def _new(shape: list[int], d: Any, large: bool, place: Any) -> Any:
    t = large_empty(shape, d) if large else None
    if t is None:
        t = _C_ops.empty(shape, d, place)
        if large:
            fresh(t)
    return t


def host_only() -> bool:
    """True where this Paddle can hold host tensors only (no CUDA, ROCm, XPU or custom-device build).

    Then every tensor is CPU memory, and the eager fast path checks no place.
    """
    compiled = [getattr(paddle, f"is_compiled_with_{d}", lambda: False)() for d in ("cuda", "rocm", "xpu")]
    return not any(compiled) and not paddle.device.get_all_custom_device_type()


def device_name(place: Any) -> str:
    """Paddle's name of a place: ``cpu``, ``gpu:0``, or the place as printed."""
    if place.is_cpu_place():
        return "cpu"
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    text = str(place)
    return text[text.find("(") + 1:text.rfind(")")] if "(" in text else text


def _check_one_device(op: OpDef, args: Sequence[Any], outs: Sequence[Any], lead_device: str) -> None:
    lead_name = op.schema.arguments[op.dispatch_arg].name
    named = [(a.name, args[i]) for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]
    named += [(f"out[{j}]", o) for j, o in enumerate(outs)]
    for name, t in named:
        if t is None or name == lead_name:
            continue
        got = device_name(t.place)
        if got != lead_device:
            raise ValueError(f"{op.name}: argument '{name}' is a paddle tensor on {got}, but '{lead_name}' is "
                             f"on {lead_device}; put every tensor of the call on one device")


Launch = Callable[[], AbstractContextManager[Any]]


def target(op: OpDef, args: Sequence[Any], outs: Sequence[Any] = ()) -> tuple[Any, Launch, Any]:
    """The kernel for the device of *args* (and *outs*), how to launch it, and the dispatching tensor's place.

    Raises
    ------
    ValueError
        Tensors on two devices.
    BackendUnavailableError
        A device opbridge has no kernel for: a GPU with a Paddle build
        without CUDA, an op without a CUDA kernel, or another device type.
    """
    place = args[op.dispatch_arg].place
    where = device_name(place)
    _check_one_device(op, args, outs, where)
    if place.is_cpu_place():
        return loader.kernel(op, "cpu"), nullcontext, place
    if not place.is_gpu_place():
        raise BackendUnavailableError(f"{op.name}: cannot run on paddle tensors on {where}: opbridge runs "
                                      f"paddle tensors on the CPU and on CUDA GPUs only")
    if not paddle.is_compiled_with_cuda():  # type: ignore[attr-defined]
        raise BackendUnavailableError(f"{op.name}: cannot run on paddle tensors on {where}: this Paddle build "
                                      f"({paddle.version.full_version}) has no CUDA")
    if "cuda" not in op.kernels:
        raise BackendUnavailableError(f"{op.name}: cannot run on paddle tensors on {where}: {op.name} has no "
                                      f"CUDA kernel (kernels: {', '.join(op.kernels) or 'none'})"
                                      f"{op.library.missing_module_note('cuda')}")
    index = place.gpu_device_id()
    return loader.kernel(op, "cuda"), lambda: cuda_stream(index), place


def cuda_stream(index: int) -> AbstractContextManager[Any]:
    """Publish Paddle's current stream of GPU *index* to tvm-ffi for one kernel call (no synchronisation)."""
    tvm = _tvm.tvm_ffi()
    handle = CORE._get_current_stream(index).cuda_stream
    ctx: AbstractContextManager[Any] = tvm.use_raw_stream(tvm.device("cuda", index), handle)
    return ctx


def materialise(grads: Sequence[Any], meta: Sequence[tuple[Any, Any]]) -> list[Any]:
    """Output gradients for :func:`opbridge.call.core.run_backward`: zeros where Paddle gave None."""
    return [paddle.zeros(m[0], m[1]) if g is None else g for g, m in zip(grads, meta, strict=True)]
