"""The candidates of a benchmark case: opbridge's calls, the NumPy reference and torch's peers.

A :class:`Candidate` is one way of computing a case's result. Its ``bind``
takes schema-ordered arguments and returns a zero-argument call on them (with
its own output buffers) and a function that maps the call's return value to
the results to verify: new outputs first, then mutated arguments. Every
benchmark that times ops against their peers (``bench kernels`` on the CPU,
``bench gpu`` on a CUDA device) builds its candidates here, so that "into a
buffer", "new output" and "in place" mean the same everywhere.

Nothing here imports torch at module load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opbridge.bench import BenchError
from opbridge.bench.verify import as_tuple, mutated

OURS_OUT, OURS_NEW, REF = "opbridge_out", "opbridge_new", "numpy_ref"
EAGER_NEW, EAGER_OUT, COMPILE_NEW, COMPILE_OUT = "eager_new", "eager_out", "compile_new", "compile_out"

#: ``(call, results)``: a zero-argument call and ``results(returned value) -> tuple of results``.
Bound = tuple[Callable[[], Any], Callable[[Any], tuple[Any, ...]]]


@dataclass
class Candidate:
    """One way of computing a case's result (see the module docstring)."""

    name: str
    mode: str  # "out", "new" or "inplace"
    what: str
    bind: Callable[[list[Any]], Bound]


# -- arguments --------------------------------------------------------------------------------------


def clone(args: Sequence[Any]) -> list[Any]:
    """Copies of the tensors in *args* (other values as they are)."""
    return [a.clone() if hasattr(a, "clone") else a for a in args]


def torch_dtype(d: Any) -> Any:
    """The torch dtype of a torch dtype, a NumPy dtype or a name such as ``"bfloat16"``."""
    import torch

    return d if isinstance(d, torch.dtype) else getattr(torch, str(d))


def make_args(op: Any, wl: Any, size: tuple[int, int], dtype: str, seed: int = 0,
              device: Any = None) -> list[Any]:
    """Schema-ordered arguments of *op* at *size*: the workload's own values (``wl.make_args``) where
    it gives them, standard-normal tensors of *dtype* for the other Tensor arguments, then scalars.

    Values are drawn on the CPU from a generator seeded with *seed* and then
    moved to *device* (None: stay on the CPU), so a case has the same inputs
    on every device.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    given = wl.make_args(size, dtype, gen) if wl.make_args is not None else {}
    shapes = wl.shapes(size)
    args: list[Any] = []
    for a in op.schema.arguments:
        if a.name in given:
            args.append(given[a.name])
        elif a.type.is_tensor:
            shape = shapes.get(a.name)
            if shape is None:
                if a.type.optional:
                    args.append(None)
                    continue
                raise BenchError(f"{op.name}: the workload gives no shape for Tensor argument {a.name!r}")
            args.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(torch_dtype(dtype)))
        elif a.name in wl.scalars:
            args.append(wl.scalars[a.name])
        elif a.has_default:
            args.append(a.default)
        else:
            raise BenchError(f"{op.name}: no value for argument {a.name!r}; give the workload scalars")
    if device is not None:
        args = [a.to(device) if hasattr(a, "to") and hasattr(a, "device") else a for a in args]
    return args


def nan_outputs(op: Any, args: Sequence[Any]) -> list[Any]:
    """NaN-filled output buffers on the lead argument's device: a result left unwritten shows."""
    import torch

    device = getattr(args[op.dispatch_arg], "device", None)
    return [torch.full(tuple(sp.shape), float("nan"), dtype=torch_dtype(sp.dtype), device=device)
            for sp in op.output_specs(args)]


# -- the candidates ---------------------------------------------------------------------------------


def opbridge_candidates(op: Any) -> list[Candidate]:
    """``opbridge_out`` (into a buffer, or in place) and, for ops with new outputs, ``opbridge_new``."""
    mut = mutated(op)

    def call(args: list[Any], **extra: Any) -> Callable[[], Any]:
        pos, kw = op.schema.split(args)
        return functools.partial(op.call, *pos, **kw, **extra)

    if not op.n_outputs:
        def bind_inplace(args: list[Any]) -> Bound:
            return call(args), lambda _ret: tuple(args[i] for i in mut)

        return [Candidate(OURS_OUT, "inplace", f"ops.{op.name}(...), in place", bind_inplace)]

    def bind_out(args: list[Any]) -> Bound:
        outs = nan_outputs(op, args)
        target = outs[0] if len(outs) == 1 else tuple(outs)
        return call(args, out=target), lambda _ret: (*outs, *(args[i] for i in mut))

    def bind_new(args: list[Any]) -> Bound:
        return call(args), lambda ret: (*as_tuple(ret)[:op.n_outputs], *(args[i] for i in mut))

    return [Candidate(OURS_OUT, "out", f"ops.{op.name}(..., out=buf)", bind_out),
            Candidate(OURS_NEW, "new", f"ops.{op.name}(...), new output", bind_new)]


def reference_candidate(op: Any) -> Candidate:
    """The op's NumPy reference on NumPy views of the same tensors."""
    mut = mutated(op)

    def bind(args: list[Any]) -> Bound:
        np_args = [a.numpy() if hasattr(a, "numpy") else a for a in args]
        pos, kw = op.schema.split(np_args)
        return (functools.partial(op.reference, *pos, **kw),
                lambda ret: (*as_tuple(ret)[:op.n_outputs], *(np_args[i] for i in mut)))

    mode = "new" if op.n_outputs else "inplace"
    return Candidate(REF, mode, f"{op.reference.__module__}.{op.reference.__qualname__} (NumPy)", bind)


def formula_candidates(op: Any, new: Callable[..., Any], into: Callable[..., Any] | None, *,
                       names: tuple[str, str], what: str, into_what: str,
                       spread: bool = False) -> list[Candidate]:
    """Candidates around a peer's functional form *new* and, where it has one, its into-buffer form.

    ``into(*args, outs)`` (``into(*args, *outs)`` with *spread*) writes an
    op's results into the buffers *outs*; for a mutating op ``into(*args)``
    updates the arguments in place. *names* are the two candidates' names
    (new, into).
    """
    mut = mutated(op)

    def bind_new(args: list[Any]) -> Bound:
        return functools.partial(new, *args), as_tuple

    cands = [Candidate(names[0], "new", what, bind_new)]
    if into is None:
        return cands
    if op.n_outputs:
        def bind_into(args: list[Any]) -> Bound:
            outs = nan_outputs(op, args)
            call = functools.partial(into, *args, *outs) if spread else functools.partial(into, *args, outs)
            return call, lambda _ret: (*outs, *(args[i] for i in mut))

        mode = "out"
    else:
        def bind_into(args: list[Any]) -> Bound:
            return functools.partial(into, *args), lambda _ret: tuple(args[i] for i in mut)

        mode = "inplace"
    cands.append(Candidate(names[1], mode, into_what, bind_into))
    return cands


def eager_candidates(op: Any, impl: Any) -> list[Candidate]:
    """``eager_new`` (the workload's torch formula) and ``eager_out`` where torch has an into-buffer form."""
    return formula_candidates(op, impl.new, impl.out, names=(EAGER_NEW, EAGER_OUT),
                              what=impl.what or "torch formula",
                              into_what=impl.out_note or "torch, into a buffer")


def expected_of(op: Any, pristine: list[Any]) -> tuple[Any, ...]:
    """opbridge's result on a fresh copy of the inputs (the new-output call, or the in-place call)."""
    fn, get = opbridge_candidates(op)[-1].bind(clone(pristine))
    return tuple(t.clone() for t in get(fn()))


def choose_torch(op: Any, wl: Any, device: Any = None) -> Any:
    """The first torch variant of *wl* that matches the float64 reference on a small case, or None.

    Chosen once per op (and device) on a (4, 256) case in float32 (or the
    op's fixed dtype), where a wrong variant cannot hide in the tolerance
    (erf and tanh GELU agree to bfloat16 precision). The reference, not
    opbridge's own result, is the judge, so a variant is never rejected for
    rounding differently from opbridge's kernel (``bench kernels`` and
    ``bench gpu`` share this choice).

    Raises
    ------
    BenchError
        If no variant matches.
    """
    from opbridge.bench.verify import mismatch, reference64, reference_tolerances

    if not wl.torch:
        return None
    dtype = wl.dtype or "float32"
    pristine = make_args(op, wl, (4, 256), dtype, seed=1, device=device)
    expected = reference64(op, pristine)
    tols = reference_tolerances(op, dtype, expected, pristine)
    errors = []
    for impl in wl.torch:
        why = mismatch(as_tuple(impl.new(*clone(pristine))), expected, tols, dtype)
        if why is None:
            return impl
        errors.append(f"{op.name} (4, 256) {dtype}: torch variant {impl.label or impl.what!r} disagrees with "
                      f"the float64 reference:\n{why}")
    raise BenchError(errors[0] + ("" if len(errors) == 1 else
                                  f"\n(and {len(errors) - 1} other torch variant(s) disagree too)"))
