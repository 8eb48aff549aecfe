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


class _Fed:
    """A jitted call that donates the mutated tensors and feeds its results back as the next ones."""

    def __init__(self, jitted: Callable[..., Any], tensors: list[Any], fed: Sequence[int],
                 block: bool = True) -> None:
        self.jitted, self.tensors, self.fed, self.block = jitted, tensors, fed, block

    def __call__(self) -> Any:
        import jax

        out = self.jitted(*self.tensors)
        if self.block:
            out = jax.block_until_ready(out)
        for j, i in enumerate(self.fed):  # mutated arguments' new values come first, in schema order
            self.tensors[i] = out[j]
        return out


class Jitted:
    """``jax.jit`` of *fn* over the tensors of schema-ordered *args*, every other argument static.

    With *donate*, the op's mutated tensors are donated and fed back
    (:class:`_Fed`); :meth:`bind` then needs arrays of its own.
    """

    def __init__(self, op: Any, fn: Callable[..., Any], args: Sequence[Any], donate: bool = False) -> None:
        import jax

        from opbridge.bench.verify import mutated

        self.at = [i for i, a in enumerate(args) if hasattr(a, "shape")]
        statics, n, at = {i: a for i, a in enumerate(args) if i not in self.at}, len(args), self.at

        def body(*ts: Any) -> Any:
            full = dict(statics)
            full.update(zip(at, ts))
            return fn(*(full[i] for i in range(n)))

        self.fed = tuple(at.index(i) for i in mutated(op)) if donate else ()
        self.jitted = jax.jit(body, donate_argnums=self.fed)

    def bind(self, args: Sequence[Any], block: bool = True) -> Call:
        """The call on *args*; *block*: each call waits for its result (else it returns at once)."""
        ts = [args[i] for i in self.at]
        if self.fed:
            return _Fed(self.jitted, ts, self.fed, block)
        return functools.partial(_block, self.jitted, *ts) if block else functools.partial(self.jitted, *ts)


def eager(fn: Callable[..., Any]) -> Callable[..., Call]:
    """``bind(args, block=True)`` of *fn* called as it is on *args*."""
    return lambda args, block=True: functools.partial(_block, fn, *args) if block else functools.partial(fn, *args)


#: ``(name, what it calls, bind(schema-ordered JAX args) -> Call)``
Cand = tuple[str, str, Callable[..., Call]]


def candidates(op: Any, formula: Callable[..., Any], args: Sequence[Any], mode: str, peer: str) -> list[Cand]:
    """opbridge's call and the formula's, ``eager`` or ``jit`` (a mutating op's jit donates, see module doc)."""
    from opbridge import ops

    ours = getattr(ops, op.name)
    if mode == "eager":
        return [(OURS, f"opbridge.ops.{op.name}(...)", eager(ours)),
                (peer, "the jnp formula, eagerly (jnp op by op)", eager(formula))]
    donate = op.schema.is_mutating
    fed = ", mutated arguments donated and fed back" if donate else ""
    return [(OURS, f"jax.jit(lambda *t: opbridge.ops.{op.name}(*t)){fed}", Jitted(op, ours, args, donate).bind),
            (peer, f"jax.jit of the jnp formula (XLA fuses it){fed}", Jitted(op, formula, args, donate).bind)]


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
