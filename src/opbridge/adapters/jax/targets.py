"""The JAX adapter's XLA FFI targets: one handler per op variant, on the CPU and the GPU.

Each variant of an op (its argument plan) is the custom-call target
``opbridge.<namespace>.<op>[.<variant>]``, registered once per process with
``jax_tvm_ffi.register_ffi_target`` under the same name on every platform:

- ``"cpu"``, always, with the op's CPU kernel;
- ``"gpu"``, beside it, with the op's CUDA kernel, when the op declares one
  and jaxlib has a CUDA backend with a device (:func:`cuda_available`).
  CUDA graphs (XLA command buffers) are allowed where the op is
  ``graph_safe`` (:attr:`opbridge.declare.OpDef.graph_safe`): the kernels
  launch on the stream XLA hands over (jax-tvm-ffi publishes it through
  tvm-ffi's environment) and never synchronise it; an op whose CUDA host code
  must run on every call (it raises a bad value the previous call's kernel
  found) runs outside XLA's graphs. The CUDA module is built with nvcc
  the first time; where it cannot be built or loaded a RuntimeWarning says
  why, once per library, and the op keeps its CPU handler only.

The handler is the kernel itself when the kernel takes XLA's arguments in the
order they come (outputs, tensors, then scalars) and no huge-page advice is
due. Otherwise it is the compiled shim of ``handler.cc`` (the copy every AOT
CPU module carries, for an op of an installed wheel, so that it compiles
nothing; else built once into the opbridge cache with the C++ compiler the
kernels need), which reorders the
arguments into kernel order and, on the CPU, asks for transparent huge pages
on the outputs XLA allocated before the kernel writes them, under the rules
of :mod:`opbridge.call.memory` (Linux, THP in ``madvise`` mode, outputs of
4 MiB and more, ``OPBRIDGE_HUGEPAGES=0`` turns it off). Without a compiler
an op whose kernel takes XLA's order keeps working, without the advice.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from opbridge import loader
from opbridge._tvm import tvm_ffi as _import_tvm_ffi
from opbridge.call import core, memory
from opbridge.errors import OpbridgeError

_import_tvm_ffi()  # before jax_tvm_ffi, which imports tvm_ffi (and with it torch, unless hidden)
import jax_tvm_ffi  # noqa: E402

if TYPE_CHECKING:
    from opbridge.declare import OpDef

LOCK = threading.RLock()
#: target name -> (op, {platform: handler capsule}); the capsules are kept alive here.
REGISTERED: dict[str, tuple[OpDef, dict[str, Any]]] = {}
_SOURCE = Path(__file__).with_name("handler.cc")
_SHIM: list[Any] = []
_SHIM_WARNED: list[bool] = []
_GPU_WARNED: set[str] = set()


def target_name(op: OpDef, variant: str = "") -> str:
    """The XLA custom-call target of *op* (``opbridge.<ns>.<op>[.<variant>]``)."""
    base = f"opbridge.{op.library.namespace}.{op.name}"
    return f"{base}.{variant}" if variant else base


@functools.cache
def cuda_available() -> bool:
    """Whether jaxlib has a CUDA backend with a device here, so ops need GPU handlers."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU plugin, or it found no device
        return False


@functools.cache
def advice_min_bytes() -> int:
    """The smallest output the handlers advise (:data:`opbridge.call.memory.MIN_BYTES`), 0 for none.

    0 where :mod:`opbridge.call.memory` gives no advice in this process (not
    Linux, THP not in ``madvise`` mode, ``OPBRIDGE_HUGEPAGES=0``). Read once
    per process, like the advice on the outputs opbridge allocates itself.
    """
    return memory.MIN_BYTES if memory._load() is not None else 0


def _shim(op: OpDef) -> Any:
    """``opbridge_jax_handler`` from ``handler.cc``: the copy in *op*'s installed AOT module (every AOT CPU
    module carries one: :data:`opbridge.aot.build.ADAPTER_SOURCES`), else one built into the opbridge cache
    once."""
    if loader.loaded_prebuilt(op.library, "cpu"):
        try:
            return loader.load(op.library, "cpu")["opbridge_jax_handler"]
        except AttributeError:  # a module built before AOT modules carried it
            pass
    with LOCK:
        if not _SHIM:
            from opbridge._tvm import tvm_ffi
            from opbridge.build import jit
            from opbridge.build.compile import BuildSpec

            spec = BuildSpec(name="opbridge_jax_handler", sources=(_SOURCE,))
            _SHIM.append(tvm_ffi().load_module(str(jit.build(spec)))["opbridge_jax_handler"])
    return _SHIM[0]


def _handler(op: OpDef, kernel: Any, plan: Sequence[int], direct: bool, n_fresh: int) -> Any:
    """The function XLA calls: *op*'s *kernel*, or the shim around it (reorder, advise fresh outputs)."""
    min_bytes = advice_min_bytes() if n_fresh else 0
    if direct and not min_bytes:
        return kernel
    try:
        shim = _shim(op)
    except OpbridgeError as e:
        if not direct:
            raise
        if not _SHIM_WARNED:  # no compiler (a prebuilt library): the kernel as it is, without the advice
            _SHIM_WARNED.append(True)
            warnings.warn(f"opbridge: large JAX outputs get no huge-page advice: the handler shim "
                          f"could not be built ({e})", RuntimeWarning, stacklevel=2)
        return kernel
    return shim(kernel, list(plan), n_fresh, min_bytes)


def _gpu_kernel(op: OpDef) -> Any | None:
    """*op*'s CUDA kernel, or None (warned once per library) where it cannot be built or loaded."""
    try:
        return loader.kernel(op, "cuda")
    except (OpbridgeError, OSError, RuntimeError) as e:
        if op.library.namespace not in _GPU_WARNED:
            _GPU_WARNED.add(op.library.namespace)
            warnings.warn(f"{op.qualname}: no GPU handler for JAX, CUDA arrays will not reach "
                          f"{op.library.namespace}'s ops ({type(e).__name__}: {e})", RuntimeWarning,
                          stacklevel=2)
        return None


def register(op: OpDef, name: str, plan: Sequence[int], direct: bool, arg_spec: list[str],
             fresh_outputs: bool = True) -> str:
    """Register *op*'s handlers as target *name* once per process; return the name used.

    With *fresh_outputs* false (results aliased to caller buffers, ``out=``)
    the handler gives no huge-page advice: the buffers are not new.

    *plan* maps the kernel's arguments to XLA's (``-1``: None), *direct* says
    it is the identity. A name taken by another OpDef (a library declared
    again under the same namespace) gets a numbered suffix rather than
    silently reusing its kernel.
    """
    with LOCK:
        base, n = name, 1
        while name in REGISTERED and REGISTERED[name][0] is not op:
            n += 1
            name = f"{base}.{n}"
        if name not in REGISTERED:
            cpu = _handler(op, loader.kernel(op, "cpu"), plan, direct, op.n_outputs if fresh_outputs else 0)
            capsules = {"cpu": jax_tvm_ffi.register_ffi_target(name, cpu, arg_spec, platform="cpu")}
            if "cuda" in op.kernels and cuda_available():
                kernel = _gpu_kernel(op)
                if kernel is not None:
                    capsules["gpu"] = jax_tvm_ffi.register_ffi_target(  # XLA may capture only graph-safe ops
                        name, _handler(op, kernel, plan, direct, 0), arg_spec, platform="gpu",
                        allow_cuda_graph=op.graph_safe)
            REGISTERED[name] = (op, capsules)
    return name


def register_call(op: OpDef, absent: Collection[int], out: bool = False) -> str:
    """Register the target of a call of *op* whose arguments at schema indices *absent* are None; return its name.

    The target depends on that None pattern only, not on the values of the
    static arguments: ``opbridge.<ns>.<op>`` when the kernel takes XLA's order
    (outputs, tensors, then scalars), else ``.p<mask>`` (reordered by the shim;
    *mask* has a 1 for each optional argument given, in schema order), and
    ``.o<mask>`` for ``out=`` (*out*: results aliased to the caller's buffers).
    """
    args = op.schema.arguments
    present = [i for i in core.tensor_indices(op) if i not in absent]
    attr_idx = [i for i, a in enumerate(args) if not a.type.is_tensor and i not in absent]
    mask = "".join("0" if i in absent else "1" for i, a in enumerate(args) if a.type.optional)
    arg_spec = ["rets", "args", *(f"attrs.{args[i].name}" for i in attr_idx)]
    n_out = op.n_outputs
    # where each kernel argument comes from on the handler side: rets, args, attrs
    where: dict[int, int] = {}
    if out:  # rets (outputs), args (the present tensors, then the out buffers), attrs
        where = {i: n_out + j for j, i in enumerate(present)}
        for j, i in enumerate(attr_idx):
            where[i] = n_out + len(present) + n_out + j
        plan = list(range(n_out)) + [where.get(i, -1) for i in range(len(args))]
        return register(op, target_name(op, f"o{mask}"), plan, False, arg_spec, fresh_outputs=False)
    mutated = [i for i, a in enumerate(args) if a.is_mutated and i not in absent]
    n_rets = n_out + len(mutated)  # rets: the outputs, then the mutated arguments' aliases
    for j, i in enumerate(mutated):
        where[i] = n_out + j
    for j, i in enumerate(present):
        where.setdefault(i, n_rets + j)
    for j, i in enumerate(attr_idx):
        where[i] = n_rets + len(present) + j
    plan = list(range(n_out)) + [where.get(i, -1) for i in range(len(args))]
    direct = plan == list(range(n_rets + len(present) + len(attr_idx)))
    return register(op, target_name(op, "" if direct else f"p{mask}"), plan, direct, arg_spec)
