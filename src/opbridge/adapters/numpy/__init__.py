"""NumPy adapter: calls the CPU kernel on ``numpy.ndarray`` arguments (no autograd).

Non-contiguous arrays are accepted: they reach the kernel as one contiguous
copy each, and a mutated one is written back in place after the kernel
(:func:`opbridge.call.overlap.dense_args`). New outputs are contiguous; those
of 4 MiB and more come from opbridge's pool of recycled, huge-page buffers
(:func:`opbridge.call.memory.empty_ndarray`). Such an array does not own its
memory (``flags.owndata`` is False, as for a view; the pool owns it), so the
in-place ``ndarray.resize`` refuses it; ``np.resize`` and copies work.

bfloat16 arrays (``ml_dtypes.bfloat16``, the type JAX uses) are accepted
where the op declares bfloat16. NumPy's DLPack export refuses that dtype, so
such an array reaches the kernel as its ``uint16`` bits, whose exported
DLPack tensor is relabelled bfloat16 before tvm-ffi imports it: no copy. The
fast path leaves these calls to the checked path (the kernel's argument
conversion raises ``BufferError`` before anything runs). The same goes for
read-only inputs, which DLPack cannot describe: they are passed as a writable
alias of their memory, which the kernel only reads; a read-only array that
the op would write raises ValueError, and so does a strided one whose elements
share memory (a broadcast view), before anything is written
(:func:`opbridge.call.layout.written_check`).

Small calls go through a C entry first (:mod:`.native`, ``entry.cc``): for
exact, dense, writeable ndarrays of a declared dtype and outputs below the
pool's threshold it calls the kernel without DLPack or a Python frame
(``ops.add`` on 8 float32 elements: about 170 ns instead of 835), raises a
kernel's error itself (the Python path's class and message, without running
the kernel twice), and leaves everything else to the Python path below, which
gives the same results and messages. It is built in the background on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import loader
from opbridge._tvm import bfloat16_tensor
from opbridge.adapters.numpy import native
from opbridge.call import c_entry, core, layout, memory, overlap, unpassable
from opbridge.call.callable import install_prelude

if TYPE_CHECKING:
    from opbridge.declare import OpDef


_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # NumPy 2 moved it


def _span(a: np.ndarray) -> tuple[int, int]:
    """``(start, end)`` byte addresses of everything *a* reaches, strides included (empty: ``start == end``)."""
    if a.size == 0:
        start = a.__array_interface__["data"][0]
        return start, start
    lo, hi = _byte_bounds(a)
    return lo, hi


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _is_dense(a: np.ndarray) -> bool:
    return bool(a.flags.c_contiguous)


def _copy_back(orig: np.ndarray, copy: np.ndarray) -> None:
    orig[...] = copy


#: dtype -> its name as opbridge spells it: a dict lookup takes 0.04 µs, ``str(dtype)`` 2 µs.
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(a: np.ndarray) -> str:
    dt = a.dtype
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = "bfloat16" if dt.name == "bfloat16" else str(dt)
        if len(_DTYPE_NAMES) < 256:  # structured dtypes are unbounded in number; the usual ones are few
            _DTYPE_NAMES[dt] = name
    return name


def _empty(shape: tuple[int, ...], dtype: Any, lead: Any) -> np.ndarray:
    return memory.empty_ndarray(shape, _np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype))


def _empty_like(x: np.ndarray) -> np.ndarray:
    return memory.empty_ndarray(x.shape, x.dtype)


class _Alias:
    """A writable alias of a read-only array's memory (``__array_interface__``), keeping it alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, a: np.ndarray) -> None:
        self.owner = a
        self.__array_interface__ = {"data": (a.__array_interface__["data"][0], False), "shape": a.shape,
                                    "typestr": a.dtype.str, "descr": a.dtype.descr, "strides": a.strides,
                                    "version": 3}


def _kernel_arg(a: Any) -> Any:
    """*a* as the kernel takes it (see the module docstring): a bfloat16 ndarray as a tvm-ffi bfloat16
    tensor on its memory, a read-only input as a writable alias (DLPack cannot say read-only)."""
    if not isinstance(a, np.ndarray):
        return a
    if not a.flags.writeable:
        a = np.asarray(_Alias(a)).view(a.dtype)
    if a.dtype.name != "bfloat16":
        return a
    lib = native.loaded()
    if lib is not None:  # ml_dtypes came after the entry: from now on, the entry takes its arrays
        lib.take_bfloat16()
    return bfloat16_tensor(a.view(np.uint16))


def _run(op: OpDef, kern: Any, outs: list[Any], full: list[Any]) -> None:
    """``kern(*outs, *full)``; arrays NumPy cannot export through DLPack go through :func:`_kernel_arg`."""
    try:
        kern(*outs, *full)
        return
    except BufferError:
        pass
    for o in outs:
        if isinstance(o, np.ndarray) and not o.flags.writeable:
            raise ValueError(f"{op.name}: out= holds a read-only array")
    for a, v in zip(op.schema.arguments, full):
        if a.is_mutated and isinstance(v, np.ndarray) and not v.flags.writeable:
            raise ValueError(f"{op.name}: argument '{a.name}' is read-only, and {op.name} writes it")
    try:
        kern(*map(_kernel_arg, outs), *map(_kernel_arg, full))
    except BufferError:  # an array DLPack cannot carry: the op's TypeError naming it, as in every framework
        unpassable.check(op, full, _unpassable)
        raise


def _unpassable(a: Any, lead: Any) -> unpassable.Unpassable | None:
    """What keeps NumPy from exporting *a* through DLPack, as the kernel would get it (another byte order,
    long double, object, ...), for :func:`opbridge.call.unpassable.check`; None where nothing does."""
    k = _kernel_arg(a)  # bfloat16 and read-only arrays pass as _kernel_arg makes them
    if not isinstance(k, np.ndarray):
        return None
    try:
        k.__dlpack__()
    except BufferError as e:
        native = a.dtype.newbyteorder("=")  # another byte order: the same type in this machine's, else the lead's
        to = native.name if native.kind in "biuf" and _exports(native) else _dtype_name(lead)
        return unpassable.Unpassable(f"dtype {a.dtype.str} ({a.dtype})", str(e), f'astype("{to}")')
    return None


def _exports(dt: np.dtype[Any]) -> bool:
    """Whether NumPy exports an array of *dt* through DLPack (not long double, say)."""
    try:
        np.empty(0, dt).__dlpack__()
    except BufferError:
        return False
    return True


def _fast_prelude(op: OpDef, entry: bool = False) -> str | None:
    """Inline fast path for plain ndarrays: allocate like the input, call the kernel.

    Only for functional ops whose outputs are shaped ``like`` inputs. The
    dispatching array's dtype must be declared (one frozenset lookup) and
    every input contiguous. A TypeError, ValueError or BufferError (a bfloat16 or read-only array) from the kernel falls
    back to the checked path, which names the offending argument.

    With *entry*, the C entry (:mod:`.native`, bound as ``_np_c``) runs first, under the one
    test of the dispatching array's type, and the Python fast path only where it returns
    ``NotImplemented``: a call on another framework's arrays tests one type, as without it.
    """
    args = op.schema.arguments
    names = [a.name for a in args]
    lead = f"type({names[op.dispatch_arg]}) is _np_nd"
    entry_block = [f"if {lead}:", f"    _np_r = _np_c({', '.join(names)})", "    if _np_r is not NotImplemented:",
                   "        return _np_r"]
    if op.schema.is_mutating or core.like_indices(op) is None or any(
            (a.type.is_tensor and a.type.optional) or a.type.is_tensor_list for a in args):
        # No Python fast path; the C entry alone where it takes the op (then the checked path).
        return "".join(f"    {line}\n" for line in entry_block) if entry and native.takes(op) else None
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    conds = [f"type({a.name}) is _np_nd" for a in args if a.type.is_tensor]
    # Layouts the kernels take only (a kernel, a user's too, may read raw memory: C-contiguous, or rows at
    # a stride where declared); other arrays run on dense copies (_np_copies: this callable again on
    # them), never through a kernel's ValueError, whose C++ exception and backtrace cost about 100 us.
    takes = core.layout_source(op, names, "{t}.flags.c_contiguous", "_np_rows({t})")
    if not op.library.kernels_check_inputs:  # else the kernel's TypeError falls back to the checked path
        conds.append(f"{names[op.dtype_arg]}.dtype in _np_dts")
    conds += core.scalar_guards(op, names)
    slow = f"_np_slow({', '.join(names)})"
    if entry:
        conds.remove(lead)
    body = ["try:"]
    body += [f"    {s}" for s in core.alloc_source(
        op, names, outs, "(_np_empty_like({x}) if {x}.nbytes < _np_hmin else _np_large_like({x}))", "")]
    body += [f"    _np_k({', '.join([*outs, *names])})", "except (TypeError, ValueError, BufferError):",
             f"    return {slow}"]
    body += core.returns_source(op, names, outs, "")
    body = [f"if not ({takes}):", f"    return _np_copies(({''.join(n + ', ' for n in names)}))", *body]
    if conds:
        body = [f"if {' and '.join(conds)}:", *(f"    {line}" for line in body)]
    if entry:
        body = [*entry_block, *(f"    {line}" for line in body)]
    return "".join(f"    {line}\n" for line in body)


#: qualname -> (the C entry's library, its op state): :func:`entry_calls` reads the counter.
ENTRIES: dict[str, tuple[Any, Any]] = {}


def entry_calls(op: OpDef) -> int | None:
    """How many calls of *op* the C entry completed itself (None: it has none in this process)."""
    got = ENTRIES.get(op.qualname)
    return None if got is None else got[0].calls(got[1])


class NumpyAdapter:
    """Adapter for NumPy arrays."""

    name = "numpy"

    def make_call(self, op: OpDef, array_type: type) -> Callable[..., Any]:
        kern = loader.kernel(op, "cpu")
        check_alias = overlap.make_alias_check(op, _span, np.may_share_memory, layout.NDARRAY_SHARES)

        def call(*args: Any) -> Any:
            core.validate_args(op, args, _is_array, "a numpy.ndarray")
            core.check_lead_dtype(op, args, _dtype_name)
            full, back = overlap.dense_args(op, args, _is_dense, np.ascontiguousarray, layout.ndarray_rows,
                                            written=layout.NDARRAY_WRITTEN)
            outs = core.alloc_outputs(op, full, _empty)
            check_alias(args)
            _run(op, kern, outs, full)
            for orig, copy in back:
                orig[...] = copy
            return core.pack_results(op, args, outs)

        prelude, entry_prelude = _fast_prelude(op), _fast_prelude(op, entry=True)
        if entry_prelude is not None:  # a Python fast path only beside an entry prelude
            dtypes = core.framework_dtypes(op, _np_dtype)
            if prelude is not None:
                install_prelude(op, "numpy", prelude, {
                    "_np_nd": np.ndarray, "_np_empty_like": np.empty_like, "_np_k": kern,
                    "_np_hmin": memory.MIN_BYTES, "_np_large_like": _empty_like, "_np_slow": call,
                    "_np_dts": dtypes, "_pack": lambda a, o: core.pack_results(op, a, o),
                    "_np_rows": layout.ndarray_rows,
                    "_np_copies": overlap.recall_dense(op, check_alias, _is_dense, np.ascontiguousarray,
                                                       layout.ndarray_rows, _copy_back,
                                                       written=layout.NDARRAY_WRITTEN),
                })

            def with_entry(lib: native.Library) -> None:
                lib.take_bfloat16()
                entry, entry_out, state = lib.entry(op, kern, memory.MIN_BYTES)
                ENTRIES[op.qualname] = (lib, state)
                install_prelude(op, "numpy", entry_prelude, {"_np_c": entry, "_np_co": entry_out, "_np_nd": np.ndarray},
                                out_prelude=c_entry.out_prelude_source(op, "_np_nd", "_np_co"))

            native.when_ready(op, with_entry)
        return call

    def call_with_out(self, op: OpDef, args: tuple[Any, ...], outs: tuple[Any, ...]) -> Any:
        """Run *op* into the caller's arrays *outs*, each of its output's shape and dtype (else ValueError).

        A strided array in *outs* is written through a dense copy, as a
        strided mutated argument is, and so is every array in *outs* where one
        shares memory with an argument (the arguments are read as they were);
        a read-only one, one whose elements share memory, and two that share
        an element raise ValueError, before anything is written.
        """
        core.validate_args(op, args, _is_array, "a numpy.ndarray")
        if not all(o.flags.writeable for o in outs):
            raise ValueError(f"{op.name}: out= holds a read-only array")
        core.check_lead_dtype(op, args, _dtype_name)
        core.check_outs(op, args, outs, _dtype_name)
        overlap.make_alias_check(op, _span, np.may_share_memory, layout.NDARRAY_SHARES)(args)
        full, back = overlap.dense_args(op, args, _is_dense, np.ascontiguousarray, layout.ndarray_rows,
                                        written=layout.NDARRAY_WRITTEN)
        fresh = overlap.outputs_overlap(op, args, outs, np.may_share_memory, layout.NDARRAY_SHARES,
                                        written=layout.NDARRAY_WRITTEN, is_dense=_is_dense)
        dense, out_back = overlap.dense_outputs(outs, _is_dense, layout.dense_ndarray, fresh=fresh)
        _run(op, loader.kernel(op, "cpu"), dense, full)
        for orig, copy in back + out_back:
            orig[...] = copy
        return core.pack_results(op, args, outs)


def _np_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":  # NumPy has no bfloat16 of its own; ml_dtypes (JAX's) adds one
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("no bfloat16 without ml_dtypes") from None
        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    return np.dtype(name)


ADAPTER = NumpyAdapter()
