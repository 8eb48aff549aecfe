"""Registration with torch's dispatcher: schema, device kernels, fake kernel, autograd.

Each op is defined under ``torch.ops.<ns>.<op>`` with its declared schema, a
CPU and/or CUDA kernel (:func:`make_impl`), a fake kernel from the shape rule,
an autograd formula from the declared backward and a vmap rule (:mod:`.vmap`),
so it works under autograd, ``torch.func.vmap``, ``opcheck``,
``torch.compile(fullgraph=True)`` and ``torch.export``.

Those kernels are Python; where the native shim is built (:mod:`.native`),
C++ kernels take the op's calls instead and hand the Python ones only what
they do not handle (strided tensors, undeclared dtypes, calls that need
grad, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from opbridge._codegen import compile_source
from opbridge.adapters.torch import calls, flags, native, vmap
from opbridge.call import core
from opbridge.call.callable import signature_source

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

_TORCH_LIBS: dict[str, torch.library.Library] = {}
REGISTERED: set[str] = set()
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}
# What an op that is not graph_safe is tagged with (OpDef.graph_safe): torch.compile's CUDA graphs (mode
# "reduce-overhead") then leave it out, as XLA does under jax.jit; torch.cuda.graph still captures it.
_GRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def packet(op: OpDef) -> Any:
    """``torch.ops.<ns>.<op>.default``."""
    return getattr(getattr(torch.ops, op.library.namespace), op.name).default


def make_impl(op: OpDef, device: str) -> Callable[..., Any]:
    """The dispatcher's kernel for *device*: check the dtype, allocate outputs, call the compiled kernel.

    Generated per op (like the fast path, from the same lines) because
    Inductor calls it on every run of a compiled graph. Inputs that are not
    dense run on dense copies (:func:`.calls.strided_call`): kernels, user
    kernels included, only ever see dense tensors. The compiled kernel is resolved on the first
    call, so registering an op never builds its library.
    """
    params, _ = signature_source(op)
    names = [a.name for a in op.schema.arguments]
    outs = [f"_o{i}" for i in range(op.n_outputs)]
    dt = names[op.dtype_arg]
    # torch raises for a write to an inference tensor outside inference mode (from ADInplaceOrView, which a
    # custom op falls through): the device kernel checks it, before anything is written
    written = [a.name for a in op.schema.mutated_args if a.type.is_tensor]
    checks = [f"    if not _t_infmode(): _t_check_inference(({''.join(f'({n!r}, {n}), ' for n in written)}))"]
    lines = [f"def impl({', '.join(params)}):",
             *(checks if written else []),
             f"    if {dt}.dtype not in _t_dts: _t_dtype_error({dt})",
             f"    if not ({calls.dense_test(op, names)}):",
             f"        return _t_strided(({''.join(n + ', ' for n in names)}))",
             *calls.kernel_lines(op, device, names, outs, "    "),
             *core.returns_source(op, names, outs, "    ")]
    ns = calls.namespace(op, {"_t_strided": calls.strided_call(op), "_t_infmode": torch.is_inference_mode_enabled,
                              "_t_check_inference": lambda w: flags.check_inference_writes(op, w)})
    compile_source("\n".join(lines) + "\n", f"<opbridge {op.qualname} {device} kernel>", ns)
    impl: Callable[..., Any] = ns["impl"]
    impl.__name__ = f"{op.name}_{device}_impl"
    return impl


#: The dispatcher's backends for quantized tensors, which DLPack cannot carry: each op's kernel there is
#: :func:`make_quantized`'s error, not torch's "Could not run ... from the 'QuantizedCPU' backend".
_QUANTIZED_KEYS = ("QuantizedCPU", "QuantizedCUDA")


def make_quantized(op: OpDef) -> Callable[..., Any]:
    """*op*'s kernel for the quantized backends: the op's TypeError naming the quantized tensor argument
    (:func:`.flags.check_passable`), as its fast path raises."""
    def quantized(*args: Any, **kwargs: Any) -> Any:
        flags.check_passable(op, calls.ordered(op, args, kwargs))
        raise NotImplementedError(f"{op.name}: no kernel takes quantized tensors")  # one in a Tensor[] argument

    return quantized


def make_fake(op: OpDef) -> Callable[..., Any]:
    """The fake (meta) kernel: outputs from the shape rule after the dtype and device checks."""
    check_dtype = calls.dtype_checker(op)
    dts = calls.torch_dtypes(op)

    def fake(*args: Any, **kwargs: Any) -> Any:
        full = calls.ordered(op, args, kwargs)
        if full[op.dtype_arg].dtype not in dts:
            check_dtype(full[op.dtype_arg])
        calls.check_devices(op, full)
        if not (op.n_outputs or op.schema.returns):
            return None
        return core.pack_results(op, full, core.alloc_outputs(op, full, calls.fake_empty))

    return fake


def make_autograd(op: OpDef) -> Callable[..., Any]:
    """*op*'s autograd kernel (taking the dispatch key set first) from the declared backward.

    The kernel ``torch.library.register_autograd`` would register for
    :func:`opbridge.call.core.run_backward`, made by the same torch function,
    so that the native autograd kernel can hand grad-requiring calls to it.
    """
    saved_idx = sorted(op.backward_reads)  # only what the backward reads is kept alive (and version-checked)
    tensor_idx = core.tensor_indices(op)
    n_args = len(op.schema.arguments)

    n_positional = op.schema.n_positional
    keyword_names = op.schema.keyword_names

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any,
                      keyword_only_inputs: dict[str, Any] | None = None) -> None:
        # torch passes an op's keyword-only arguments apart (and differentiates its positional ones only)
        if keyword_names:
            kw = keyword_only_inputs or {}
            inputs = (*inputs, *(kw[name] for name in keyword_names))
        ctx.opb_scalars = {i: v for i, v in enumerate(inputs) if i not in tensor_idx}
        ctx.save_for_backward(*(inputs[i] for i in saved_idx))
        outs = output if isinstance(output, tuple) else (output,)
        ctx.opb_out_meta = [(o.shape, o.dtype, o.device) for o in outs]

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        full: list[Any] = [None] * n_args
        for i, v in ctx.opb_scalars.items():
            full[i] = v
        for i, t in zip(saved_idx, ctx.saved_tensors):
            full[i] = t
        # Autograd hands out expanded or strided grads (e.g. from sum()); kernels want dense ones.
        dense = [g.contiguous() if g is not None else torch.zeros(s, dtype=d, device=dev)
                 for g, (s, d, dev) in zip(grads, ctx.opb_out_meta)]
        out: list[Any] = [None] * n_args
        for i, g in zip(tensor_idx, core.run_backward(op, dense, full)):
            out[i] = g
        return tuple(out[:n_positional])

    info = torch._library.autograd.Info(backward, setup_context)
    kernel: Callable[..., Any] = torch._library.autograd.make_autograd_impl(packet(op), info)
    return kernel


def make_mutating_autograd(op: OpDef) -> Callable[..., Any]:
    """Autograd kernel of a mutating op: no formula, so refuse to be differentiated."""
    overload = packet(op)
    tensor_names = [(i, op.schema.arguments[i].name) for i in core.tensor_indices(op)]
    mutated = [i for i, a in enumerate(op.schema.arguments) if a.is_mutated]

    def autograd_impl(*args: Any, **kwargs: Any) -> Any:
        full = calls.ordered(op, args, kwargs)
        if torch.is_grad_enabled():
            for i, name in tensor_names:
                if full[i] is not None and full[i].requires_grad:
                    raise RuntimeError(
                        f"{op.name}: argument '{name}' requires grad, but this op mutates its inputs "
                        f"in place and declares no backward; call it under torch.no_grad()"
                    )
        with torch._C._AutoDispatchBelowAutograd():
            result = overload(*args, **kwargs)
        # What ADInplaceOrView does for native in-place ops: later backward
        # passes must notice that saved tensors changed.
        for i in mutated:
            if full[i] is not None:
                torch.autograd.graph.increment_version(full[i])
        return result

    return autograd_impl


def python_kernels(op: OpDef) -> native.PythonKernels:
    """*op*'s Python device and autograd kernels (and what the native ones need from Python)."""
    rule = None
    if core.like_indices(op) is None and op.n_outputs:
        def rule(args: tuple[Any, ...]) -> list[torch.Tensor]:
            return [torch.empty(s.shape, dtype=calls.to_dtype(s.dtype), device="meta") for s in op.output_specs(args)]

    impls = {device: make_impl(op, device) for device in op.kernels if device in _DISPATCH_KEY}
    if op.schema.is_mutating:
        return native.PythonKernels(impls, make_mutating_autograd(op), False, rule, calls.fresh)
    return native.PythonKernels(impls, make_autograd(op), True, rule, calls.fresh)


def register(lib: Library, on_registered: Callable[[OpDef], None]) -> None:
    """Define and implement every op of *lib* in ``torch.ops.<namespace>`` (idempotent).

    *on_registered* runs once per newly registered op.
    """
    tl = _TORCH_LIBS.get(lib.namespace)
    if tl is None:
        tl = torch.library.Library(lib.namespace, "FRAGMENT")
        _TORCH_LIBS[lib.namespace] = tl
    for op in lib.ops.values():
        if op.qualname in REGISTERED:
            continue
        tl.define(str(op.schema), tags=() if op.graph_safe else _GRAPH_UNSAFE)
        torch.library.register_fake(op.qualname, make_fake(op), lib=tl)
        kernels = python_kernels(op)
        native_devices = native.register(op, kernels)
        for device, impl in kernels.impls.items():
            if device not in (native_devices or ()):
                tl.impl(op.name, impl, _DISPATCH_KEY[device])
        if native_devices is None:
            tl.impl(op.name, kernels.autograd, "Autograd", with_keyset=kernels.autograd_keyset)
        for key in _QUANTIZED_KEYS:
            tl.impl(op.name, make_quantized(op), key)
        vmap.register(op, packet(op), tl)
        on_registered(op)
        REGISTERED.add(op.qualname)


def checked(op: OpDef) -> Callable[..., Any]:
    """The dispatcher call, with torch's argument-parser errors turned into named TypeErrors.

    A bool given for an ``int`` or ``float`` argument, anything else for a ``bool`` one, or None
    for one that is not optional, raises TypeError, as in every framework (:func:`opbridge.call.core.scalar_guards`),
    and an int outside int64 for an ``int`` or ``float`` one ValueError (:func:`opbridge.call.core.check_int64`);
    ``torch.ops.<ns>.<op>`` itself keeps torch's rules.

    A tensor with the negative or conjugate bit given for an argument the op
    writes raises a RuntimeError naming it (:func:`.flags.check_written_bits`)
    before anything is written: torch's fallback for those bits cannot give
    back an op's writes unless the op returns what it wrote, and fails with
    "Expected Tensor but got None" after the kernel ran.
    """
    overload = packet(op)
    kw_only, n_pos = op.schema.keyword_names, op.schema.n_positional
    mutated = [(i, a.name) for i, a in enumerate(op.schema.arguments) if a.is_mutated and a.type.is_tensor]

    # torch's parser takes a bool for an int or float argument, and other values for a bool one;
    # opbridge's declaration does not (core.scalar_guards)
    # (and None for a non-optional one, which it reads as the default; and for a float one an int outside
    # int64, which no other framework's kernel call takes: core.check_int64)
    scalars = core.scalar_rules(op)
    lo, hi = core.INT64_RANGE

    def call(*args: Any, **kwargs: Any) -> Any:
        if any(i < len(args) and (not optional if args[i] is None else (type(args[i]) is bool) != want
                                  or (type(args[i]) is int and not lo <= args[i] <= hi))
               for i, want, optional in scalars):
            core.validate_args(op, calls.ordered(op, args, kwargs), calls.is_tensor, "a torch.Tensor")
        if mutated:
            flags.check_written_bits(op, [(name, args[i] if i < len(args) else kwargs.get(name))
                                          for i, name in mutated])
        if kw_only and len(args) > n_pos:  # opbridge passes everything positionally; torch.ops wants names
            kwargs.update(zip(kw_only, args[n_pos:]))
            args = args[:n_pos]
        try:
            return overload(*args, **kwargs)
        except RuntimeError as e:
            if "Expected a value of type" in str(e):
                core.validate_args(op, calls.ordered(op, args, kwargs), calls.is_tensor, "a torch.Tensor")
            raise

    call.__name__ = op.name
    return call
