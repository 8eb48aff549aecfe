"""The calls ``opbridge bench jax-gpu`` verifies and times (:mod:`opbridge.bench.jax_gpu`).

Its two candidates per case, opbridge's op and the jnp formula, each
``eager`` (called as it is) or ``jit`` (``jax.jit`` over the tensor
arguments, every other argument static; a mutating op's tensors donated and
its results fed back as the next call's: :class:`Jitted`), bound to one
case's arrays as zero-argument calls that wait for their results, or, for
the large cases, :class:`Pipelined` (calls back to back, then one wait).
Also the arrays in and out: torch CPU inputs as JAX arrays on the device
(:func:`to_jax`), a call's results as NumPy arrays in the float64
reference's order (:func:`results`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from opbridge.bench.jax_gpu_report import OURS

__all__ = ["Call", "Cand", "Jitted", "Pipelined", "candidates", "eager", "results", "to_jax"]

#: A zero-argument call whose return value holds the results, blocked until ready.
Call = Callable[[], Any]


def _block(fn: Callable[..., Any], *args: Any) -> Any:
    import jax

    return jax.block_until_ready(fn(*args))


class Pipelined:
    """*n* calls of *fn* back to back, then one wait: the device's time per call once JAX's
    asynchronous dispatch keeps its queue full (divide by *n*), not dispatch plus a host wait."""

    def __init__(self, fn: Callable[[], Any], n: int) -> None:
        self.fn, self.n = fn, n

    def __call__(self) -> Any:
        import jax

        out = None
        for _ in range(self.n):
            out = self.fn()
        return jax.block_until_ready(out)


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(.*\{$")
_LAUNCH = re.compile(r"= [^\n]*?\b(fusion|custom-call)\(")
_CALLS = re.compile(r"\bcalls=%?([\w.-]+)")


def kernels_in(jitted: Callable[..., Any], tensors: Sequence[Any]) -> int:
    """The kernels XLA's optimized program of *jitted* on *tensors* launches: its fusions and custom calls,
    wherever they are (XLA's GPU command buffers hold them in computations of their own), but not those
    nested in a fusion's body (a fusion is one kernel)."""
    return count_kernels(jitted.lower(*tensors).compile().as_text())  # type: ignore[attr-defined]


def count_kernels(hlo: str) -> int:
    """The fusions and custom calls of an optimized HLO module's text outside the bodies of its fusions."""
    bodies: dict[str, list[str]] = {}
    name = ""
    for line in hlo.splitlines():
        m = _HEADER.match(line.strip())
        if m is not None:
            name = m[1]
            bodies[name] = []
        elif name:
            bodies[name].append(line)
    launches = {n: [m for m in map(_LAUNCH.search, lines) if m is not None] for n, lines in bodies.items()}
    fused = {c for found in launches.values() for m in found if m[1] == "fusion" for c in _CALLS.findall(m.string)}
    return sum(len(found) for n, found in launches.items() if n not in fused)


class _Plain:
    """A jitted call on fixed tensors, waiting for its results with *block*."""

    def __init__(self, jitted: Callable[..., Any], tensors: list[Any], block: bool = True,
                 single: Callable[[], int] | None = None) -> None:
        self.jitted, self.tensors, self.block = jitted, tensors, block
        self.single = single  # the kernels of one copy's program (Jitted.bind)

    def __call__(self) -> Any:
        import jax

        out = self.jitted(*self.tensors)
        return jax.block_until_ready(out) if self.block else out

    def kernels(self) -> int:
        return kernels_in(self.jitted, self.tensors)


class _Fed(_Plain):
    """A jitted call that donates the mutated tensors and feeds its results back as the next ones.

    With *copies* > 1 the call returns one result per copy of the tensors (each copy's
    tensors are *tensors*' next ``len(tensors) // copies``), and each copy is fed back
    from its own result.
    """

    def __init__(self, jitted: Callable[..., Any], tensors: list[Any], fed: Sequence[int],
                 block: bool = True, copies: int = 1, single: Callable[[], int] | None = None) -> None:
        super().__init__(jitted, tensors, block, single)
        self.fed, self.copies, self.width = fed, copies, len(tensors) // copies

    def __call__(self) -> Any:
        out = super().__call__()
        for c, got in enumerate(out if self.copies > 1 else (out,)):
            for j, i in enumerate(self.fed):  # mutated arguments' new values come first, in schema order
                self.tensors[c * self.width + i] = got[j]
        return out


class Jitted:
    """``jax.jit`` of *fn* over the tensors of schema-ordered *args*, every other argument static.

    With *donate*, the op's mutated tensors are donated and fed back
    (:class:`_Fed`); :meth:`bind` then needs arrays of its own. With
    *copies* > 1 the jitted program applies *fn* to that many independent
    copies of the tensors (:meth:`bind` makes them on the arrays' device) and
    returns a tuple of their results, one per copy: one dispatch for that
    many kernels, so that a jitted call's dispatch (about 40 µs on an H200)
    does not bound a kernel that takes less. Each copy's result passes
    through an ``optimization_barrier`` of its own: XLA's GPU pipeline fuses
    the loop fusions that feed one consumer (here the results' tuple)
    horizontally, into one kernel, up to 8192 x 8192 elements each, which
    would time XLA on one launch for many copies and opbridge on many. That
    the barriers prevent it on a GPU is not yet checked (on the CPU XLA
    drops them, and has no horizontal fusion): the benchmark compares each
    program's kernels with one copy's (``kernels``, ``single``) and notes a
    case where copies were joined.
    """

    def __init__(self, op: Any, fn: Callable[..., Any], args: Sequence[Any], donate: bool = False,
                 copies: int = 1) -> None:
        import jax

        from opbridge.bench.verify import mutated

        self.at = [i for i, a in enumerate(args) if hasattr(a, "shape")]
        self.copies = copies
        statics, n, at = {i: a for i, a in enumerate(args) if i not in self.at}, len(args), self.at

        def one(ts: Sequence[Any]) -> Any:
            full = dict(statics)
            full.update(zip(at, ts))
            return fn(*(full[i] for i in range(n)))

        def body(*ts: Any) -> Any:
            if copies == 1:
                return one(ts)
            return tuple(jax.lax.optimization_barrier(one(ts[c * len(at):(c + 1) * len(at)]))
                         for c in range(copies))

        self.one = jax.jit(lambda *ts: one(ts))  # one copy's program, whose kernels are compared (bind)

        self.fed = tuple(at.index(i) for i in mutated(op)) if donate else ()
        donated = tuple(c * len(at) + j for c in range(copies) for j in self.fed)
        self.jitted = jax.jit(body, donate_argnums=donated)

    def bind(self, args: Sequence[Any], block: bool = True) -> Call:
        """The call on *args* (and copies of them); *block*: each call waits for its results (else it
        returns at once)."""
        import jax.numpy as jnp

        ts = [args[i] for i in self.at]
        first = list(ts)
        ts += [jnp.array(t, copy=True) for _ in range(self.copies - 1) for t in ts]

        def single() -> int:
            return kernels_in(self.one, first)

        if self.fed:
            return _Fed(self.jitted, ts, self.fed, block, self.copies, single)
        return _Plain(self.jitted, ts, block, single)


def eager(fn: Callable[..., Any]) -> Callable[..., Call]:
    """``bind(args, block=True)`` of *fn* called as it is on *args*."""
    return lambda args, block=True: functools.partial(_block, fn, *args) if block else functools.partial(fn, *args)


#: ``(name, what it calls, bind(schema-ordered JAX args) -> Call)``
Cand = tuple[str, str, Callable[..., Call]]


def candidates(op: Any, formula: Callable[..., Any], args: Sequence[Any], mode: str, peer: str,
               copies: int = 1) -> list[Cand]:
    """opbridge's call and the formula's, ``eager`` or ``jit`` (a mutating op's jit donates, see module doc;
    *copies*: :class:`Jitted`'s)."""
    from opbridge import ops

    ours = getattr(ops, op.name)
    if mode == "eager":
        return [(OURS, f"opbridge.ops.{op.name}(...)", eager(ours)),
                (peer, "the jnp formula, eagerly (jnp op by op)", eager(formula))]
    donate = op.schema.is_mutating
    fed = ", mutated arguments donated and fed back" if donate else ""
    fed += f", {copies} copies of the arguments per jitted call" if copies > 1 else ""
    return [(OURS, f"jax.jit(lambda *t: opbridge.ops.{op.name}(*t)){fed}",
             Jitted(op, ours, args, donate, copies).bind),
            (peer, f"jax.jit of the jnp formula (XLA fuses it){fed}", Jitted(op, formula, args, donate, copies).bind)]


# -- arrays in and out --------------------------------------------------------------------------------


def to_jax(t: Any, device: Any) -> Any:
    """A torch CPU tensor as a JAX array of its dtype on *device* (other values as they are)."""
    import jax

    if not hasattr(t, "is_floating_point"):
        return t
    if not t.is_floating_point():
        return jax.device_put(t.numpy(), device)
    return jax.device_put(t.float().numpy(), device).astype(str(t.dtype).rpartition(".")[2])


def results(op: Any, ret: Any) -> tuple[Any, ...]:
    """A JAX call's results as float32 (or integer) NumPy arrays in the reference's order.

    opbridge's JAX adapter returns a mutating op's new argument values
    before its outputs; :func:`opbridge.bench.verify.reference64` puts the
    outputs first.
    """
    import numpy as np

    from opbridge.bench.verify import as_tuple, mutated

    got, k = as_tuple(ret), len(mutated(op))
    if op.n_outputs and k:
        got = (*got[k:], *got[:k])

    def host(g: Any) -> Any:
        a = np.asarray(g)
        return a if a.dtype.kind in "iub" else a.astype(np.float32)  # bfloat16 (ml_dtypes) is kind "V"

    return tuple(None if g is None else host(g) for g in got)
