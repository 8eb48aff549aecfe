"""What ``opbridge bench kernels`` runs for each op: input shapes, torch formulas, bytes moved.

A :class:`Workload` says, for one op, which shape each Tensor argument gets
for a benchmark size ``(rows, cols)`` and how PyTorch computes the same
thing (:class:`TorchImpl`): a functional formula (eager "new output", and
what ``torch.compile`` compiles) and, where torch can, an eager formula that
writes into caller-provided buffers (or in place, for ops that mutate their
arguments).

Most ops take floating tensors that standard-normal values of the benchmark
dtype stand in for. An op with index or integer arguments
(``rotary_embedding``'s positions, ``advance_step_flashattn``'s sequence
state) supplies its own values (:attr:`Workload.make_args`), may count its
bytes itself (a gather reads a few rows of a table, not all of it), may run
with fixed dtypes instead of each benchmark dtype, and may say how often it
can be called on the same inputs before they must be restored.

Ops are looked up by name in :func:`workloads`; an op without an entry gets
an inferred workload when its test cases (``opbridge.testing.matrix``) show
only arguments shaped like its lead argument or like one row of it (then it
is timed against its reference only); any other op is skipped with the
reason. Nothing here imports torch until a function needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opbridge.bench.torch_formulas import TorchImpl  # defined beside the formulas; re-exported here

if TYPE_CHECKING:
    from opbridge.declare import OpDef

Shape = tuple[int, ...]
#: Named benchmark sizes ``(rows, cols)``; for the gated ops (``*_and_mul``) this is ``x``'s shape.
SIZES: dict[str, tuple[int, int]] = {"small": (8, 4096), "large": (4096, 4096), "odd": (257, 5125)}
_C = 0.7978845608028654  # sqrt(2/pi)


@dataclass(frozen=True)
class Workload:
    """The benchmark workload of one op.

    Attributes
    ----------
    op
        The op's name.
    shapes
        ``shapes((rows, cols))`` -> ``{tensor argument: shape}``.
    torch
        Torch implementations to try in order; the first whose float32
        result matches opbridge's is used for every case of the op (an op
        whose exact semantics vary, e.g. erf or tanh GELU, lists both).
        Empty: no torch competitor.
    note
        Anything a reader of the results needs to know.
    scalars
        Values of non-Tensor arguments that have no schema default.
    make_args
        ``make_args((rows, cols), dtype, generator)`` -> ``{argument: value}``
        for the arguments that standard-normal tensors of ``shapes`` cannot
        stand in for (indices, integer tensors, size-dependent scalars); the
        Tensor arguments it leaves out are standard normal as usual.
        *generator* is a seeded ``torch.Generator``.
    bytes_moved
        ``bytes_moved(args)`` -> ``{"read", "written", "total"}`` for an op
        that touches only part of an argument (rows gathered from a table);
        None: :func:`bytes_moved` (every Tensor argument read once, every
        result written once).
    dtype
        The dtype label (e.g. ``"int64/int32"``) of an op whose tensors have
        fixed dtypes: it runs once per size under this label whatever the
        benchmark dtypes are, and its NumPy reference always runs. Empty: once
        per benchmark dtype.
    max_calls
        For an in-place op that uses up its inputs (``advance_step_flashattn``
        moves every sequence one token on per call, and its block table
        ends): the most calls it may make on one set of inputs. The harness
        then restores the mutated arguments, untimed, before each timed
        sample and makes at most this many calls per sample. 0: no limit.
    """

    op: str
    shapes: Callable[[tuple[int, int]], dict[str, Shape]]
    torch: tuple[TorchImpl, ...] = ()
    note: str = ""
    scalars: Mapping[str, Any] = field(default_factory=dict)
    make_args: Callable[[tuple[int, int], str, Any], Mapping[str, Any]] | None = None
    bytes_moved: Callable[[Sequence[Any]], dict[str, int]] | None = None
    dtype: str = ""
    max_calls: int = 0

    def moved(self, op: OpDef, args: Sequence[Any]) -> dict[str, int]:
        """Bytes a kernel must move for schema-ordered *args* (see :attr:`bytes_moved`)."""
        return self.bytes_moved(args) if self.bytes_moved is not None else bytes_moved(op, args)


# -- shapes ---------------------------------------------------------------------


# A shape rule may name arguments an op does not have (spellings differ:
# ``x`` or ``input``); only the op's own arguments are looked up.


def full(*names: str) -> Callable[[tuple[int, int]], dict[str, Shape]]:
    """Every named tensor has the size's shape (elementwise ops)."""
    return lambda size: dict.fromkeys(names, tuple(size))


def normed(full_names: Sequence[str], row: Sequence[str]) -> Callable[[tuple[int, int]], dict[str, Shape]]:
    """*full_names* get the size's shape ``(R, H)``, *row* get ``(H,)`` (normalisations)."""
    return lambda size: {**dict.fromkeys(full_names, tuple(size)), **dict.fromkeys(row, (size[1],))}


def gated(size: tuple[int, int]) -> dict[str, Shape]:
    """``x`` of a ``*_and_mul`` op: ``(R, C)``; an odd C gives ``(R, 2C)`` so the half-width stays odd.

    ``grad`` (of the backward ops) is the forward's output, ``(R, C/2)``.
    """
    rows, cols = size
    width = cols if cols % 2 == 0 else 2 * cols
    return {"x": (rows, width), "grad": (rows, width // 2)}


# -- ops with index arguments ----------------------------------------------------------

#: rotary_embedding: Llama-style heads of 128, rotated whole, 4 query heads per key head, a
#: cache of 8192 positions (base 10000).
ROPE_HEAD_SIZE, ROPE_KV_GROUP, ROPE_MAX_POSITION = 128, 4, 8192


def rope_heads(cols: int) -> tuple[int, int, int]:
    """``(head_size, query heads, key heads)`` for a benchmark width *cols* (query's width).

    Heads of :data:`ROPE_HEAD_SIZE`, as many as fit *cols* to the nearest
    (5125 gives 40 heads, 5120 wide); below one head, one head of *cols*
    rounded down to even. Key heads are a quarter of the query heads (grouped
    query attention) when that divides evenly, else as many.
    """
    if cols < ROPE_HEAD_SIZE:
        head, heads = max(2, cols - cols % 2), 1
    else:
        head, heads = ROPE_HEAD_SIZE, max(1, round(cols / ROPE_HEAD_SIZE))
    return head, heads, heads // ROPE_KV_GROUP if heads % ROPE_KV_GROUP == 0 else heads


def rope_shapes(size: tuple[int, int]) -> dict[str, Shape]:
    """``rotary_embedding``: rows tokens, query ``(rows, heads * 128)``, key with a quarter of the heads."""
    rows, cols = size
    head, heads, kv_heads = rope_heads(cols)
    return {"positions": (rows,), "query": (rows, heads * head), "key": (rows, kv_heads * head),
            "cos_sin_cache": (ROPE_MAX_POSITION, head)}


def rope_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> Any:
    """vLLM's cos/sin cache, float64 NumPy ``(max_position, rot_dim)``: row ``p`` holds ``[cos | sin]``."""
    import numpy as np

    inv_freq = 1.0 / base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1)


def rope_args(size: tuple[int, int], dtype: str, gen: Any) -> dict[str, Any]:
    """Positions uniform in ``[0, max_position)``, vLLM's cos/sin cache in *dtype*, NeoX style."""
    import torch

    shapes = rope_shapes(size)
    max_position, rot_dim = shapes["cos_sin_cache"]
    return {
        "positions": torch.randint(0, max_position, shapes["positions"], generator=gen, dtype=torch.int64),
        "head_size": rope_heads(size[1])[0],
        "cos_sin_cache": torch.from_numpy(rope_cache(max_position, rot_dim)).to(getattr(torch, dtype)),
        "is_neox": True,
    }


def rope_bytes(args: Sequence[Any]) -> dict[str, int]:
    """Positions read, query and key read and written, one cos/sin row read per token (not the whole cache)."""
    positions, query, key, _head_size, cache = args[:5]
    qk = nbytes(query) + (0 if key is None else nbytes(key))
    rows = int(math.prod(tuple(positions.shape))) * int(cache.shape[-1]) * itemsize(cache.dtype)
    read = nbytes(positions) + qk + rows
    return {"read": read, "written": qk, "total": read + qk}


#: advance_step_flashattn: KV-cache blocks of 16 tokens; every call moves each sequence one token on,
#: so the block table leaves room for this many calls beyond the longest sequence.
STEP_BLOCK_SIZE, STEP_ROOM = 16, 1024


def step_sizes(size: tuple[int, int]) -> tuple[int, int, int]:
    """``(num_seqs, num_queries, max_blocks)`` of ``advance_step_flashattn`` for ``(rows, cols)``.

    rows sequences, one of them padding when rows > 1 (as a CUDA-graph
    batch pads); cols is the longest context in tokens, and the table is
    wide enough for it plus :data:`STEP_ROOM` more steps.
    """
    rows, cols = size
    return rows, rows - 1 if rows > 1 else rows, -(-(cols + STEP_ROOM) // STEP_BLOCK_SIZE)


def step_shapes(size: tuple[int, int]) -> dict[str, Shape]:
    """``advance_step_flashattn``: ``(num_seqs,)`` state, ``(num_queries, 1)`` samples, the block table."""
    n, q, width = step_sizes(size)
    return {"input_tokens": (n,), "sampled_token_ids": (q, 1), "input_positions": (n,), "seq_lens": (n,),
            "slot_mapping": (n,), "block_tables": (n, width)}


def step_args(size: tuple[int, int], dtype: str, gen: Any) -> dict[str, Any]:
    """Lengths uniform in ``[1, cols]``, token ids below 32000, each block id used once (a permutation).

    The mutated tensors start from values the op never writes, so a kernel
    that leaves an element unwritten fails verification.
    """
    import torch

    n, q, width = step_sizes(size)
    shapes = step_shapes(size)
    i64 = torch.int64
    return {
        "num_seqs": n, "num_queries": q, "block_size": STEP_BLOCK_SIZE,
        "input_tokens": torch.randint(10**6, 2 * 10**6, shapes["input_tokens"], generator=gen, dtype=i64),
        "sampled_token_ids": torch.randint(0, 32000, shapes["sampled_token_ids"], generator=gen, dtype=i64),
        "input_positions": torch.randint(10**6, 2 * 10**6, shapes["input_positions"], generator=gen, dtype=i64),
        "seq_lens": torch.randint(1, size[1] + 1, shapes["seq_lens"], generator=gen, dtype=torch.int32),
        "slot_mapping": torch.randint(10**9, 2 * 10**9, shapes["slot_mapping"], generator=gen, dtype=i64),
        "block_tables": torch.randperm(n * width, generator=gen, dtype=torch.int32).view(n, width),
    }


def step_bytes(args: Sequence[Any]) -> dict[str, int]:
    """Per query: a sampled token, its length and one block-table entry read; tokens, positions, slots
    (every sequence) and the queries' lengths written."""
    _n, q, _bs, tokens, sampled, positions, seq_lens, slots, tables = args
    read = nbytes(sampled) + q * (itemsize(seq_lens.dtype) + itemsize(tables.dtype))
    written = nbytes(tokens) + nbytes(positions) + nbytes(slots) + q * itemsize(seq_lens.dtype)
    return {"read": read, "written": written, "total": read + written}


#: name -> (shape rule, note); the torch formulas are attached by :func:`workloads`.
_SHAPES: dict[str, tuple[Callable[[tuple[int, int]], dict[str, Shape]], str]] = {
    "add": (full("x", "y"), ""),
    "gelu": (full("x"), ""),
    "gelu_backward": (full("grad", "x"), ""),
    "rms_norm": (normed(["x"], ["weight"]), ""),
    "rms_norm_backward": (normed(["grad", "x"], ["weight"]),
                          "torch has no CPU rms_norm backward kernel; its competitor is the float32 formula"),
    "silu_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C) so d = C stays odd"),
    "gelu_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C) so d = C stays odd"),
    "gelu_tanh_and_mul": (gated, "size is x's shape (R, 2d); an odd size uses x = (R, 2C)"),
    "silu_and_mul_backward": (gated, "size is x's shape (R, 2d), grad (R, d); an odd size uses x = (R, 2C)"),
    "gelu_and_mul_backward": (gated, "size is x's shape (R, 2d), grad (R, d); an odd size uses x = (R, 2C)"),
    "fused_add_rms_norm": (normed(["input", "x", "residual"], ["weight"]),
                           "mutates its input and residual in place"),
}


#: Workloads of ops with index arguments: their own inputs and byte counts (see :class:`Workload`).
_INDEXED: dict[str, dict[str, Any]] = {
    "rotary_embedding": dict(
        shapes=rope_shapes, make_args=rope_args, bytes_moved=rope_bytes,
        note="rows tokens at random positions below 8192, NeoX style; query rows x (heads of 128: cols "
             "rounded to the nearest multiple, so the odd size 257x5125 runs 257x5120, 40 heads), key a "
             "quarter of query's heads (GQA); cos_sin_cache (8192, 128) in query's dtype; bytes count the "
             "cos/sin rows gathered, not the whole cache"),
    "advance_step_flashattn": dict(
        shapes=step_shapes, make_args=step_args, bytes_moved=step_bytes, dtype="int64/int32",
        max_calls=STEP_ROOM // 2,
        note="rows sequences (one of them padding), block_size 16, lengths up to cols tokens; int64/int32 "
             "tensors, so one case per size; every call moves each sequence one token on: the mutated "
             f"tensors are restored before each timed sample (at most {STEP_ROOM // 2} calls); bytes count "
             "one block-table entry per query, not the whole table"),
}


def workloads() -> dict[str, Workload]:
    """Every known workload by op name (imports torch)."""
    from opbridge.bench.torch_formulas import torch_impls

    impls = torch_impls()
    out = {name: Workload(name, shapes, impls.get(name, ()), note) for name, (shapes, note) in _SHAPES.items()}
    for name, spec in _INDEXED.items():
        out[name] = Workload(name, torch=impls.get(name, ()), **spec)
    return out


def left_out(names: Sequence[str], ops: Mapping[str, OpDef], wls: Mapping[str, Any], *,
             device: str | None = None, peers: Mapping[str, Any] | None = None,
             no_peer: str = "") -> dict[str, str]:
    """``{op: why a benchmark leaves it out}`` of *names*: not declared in *ops*; no entry in *peers*
    (the benchmark's own formulas; *no_peer* says so); no workload in *wls*; no kernel for *device*."""
    why: dict[str, str] = {}
    for n in names:
        if n not in ops:
            why[n] = "not declared"
        elif peers is not None and n not in peers:
            why[n] = no_peer
        elif n not in wls:
            why[n] = "no workload in opbridge.bench.workloads"
        elif device is not None and device not in ops[n].kernels:
            why[n] = f"no {device.upper()} kernel declared"
    return why


def infer(op: OpDef) -> tuple[Workload | None, str]:
    """A workload for an op without an entry, from its test cases; or None and why not.

    Uses the first 2-D contiguous case of ``opbridge.testing.matrix.make_cases``:
    every floating Tensor argument must have the lead argument's shape or
    ``(cols,)``. The result has no torch competitor.
    """
    from opbridge.testing.matrix import LAYOUT, NONCONTIGUOUS, make_cases

    try:
        cases = make_cases(op, "float32")
    except (ValueError, TypeError) as e:
        return None, f"no workload and no test cases to infer one from ({e})"
    lead = op.schema.arguments[op.dispatch_arg].name
    for case in cases:
        if case.get(LAYOUT, "contiguous") != "contiguous" or case.get(NONCONTIGUOUS):
            continue
        ref: tuple[int, ...] = tuple(getattr(case.get(lead), "shape", ()))
        if len(ref) != 2 or 0 in ref:
            continue
        roles: dict[str, str] = {}
        scalars: dict[str, Any] = {}
        for a in op.schema.arguments:
            v = case.get(a.name)
            if not a.type.is_tensor:
                scalars[a.name] = v
                continue
            if v is None:
                continue
            if getattr(v, "dtype", None) is None or v.dtype.kind != "f":
                return None, f"argument {a.name!r} is not floating; add a workload to opbridge.bench.workloads"
            if tuple(v.shape) == tuple(ref):
                roles[a.name] = "full"
            elif tuple(v.shape) == (ref[-1],):
                roles[a.name] = "row"
            else:
                return None, (f"cannot infer shapes (argument {a.name!r} has shape {tuple(v.shape)} beside "
                              f"{lead} {tuple(ref)}); add a workload to opbridge.bench.workloads")
        fulls = [n for n, r in roles.items() if r == "full"]
        rows = [n for n, r in roles.items() if r == "row"]
        note = "inferred from its test cases; no torch formula"
        return Workload(op.name, normed(fulls, rows), note=note, scalars=scalars), ""
    return None, "no 2-D test case to infer shapes from; add a workload to opbridge.bench.workloads"


# -- bytes moved -------------------------------------------------------------------------


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch or NumPy dtype, or of a dtype name such as ``"bfloat16"``."""
    n = getattr(dtype, "itemsize", None)
    if isinstance(n, int):
        return n
    name = str(dtype).rpartition(".")[2]
    if name == "bfloat16":
        return 2
    import numpy as np

    return int(np.dtype(name).itemsize)


def nbytes(t: Any) -> int:
    """Bytes of tensor or array *t* (anything with ``.shape`` and ``.dtype``)."""
    return int(math.prod(tuple(t.shape))) * itemsize(t.dtype)


def bytes_moved(op: OpDef, args: Sequence[Any]) -> dict[str, int]:
    """Bytes a kernel must move for *args*: every Tensor argument read once, every result written once.

    Results are the op's new outputs (from its shape rule) plus its mutated
    arguments. *args* are schema-ordered values; tensors need ``.shape`` and
    ``.dtype``.

    Returns
    -------
    dict
        ``{"read": bytes, "written": bytes, "total": bytes}``.
    """
    read = written = 0
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor and v is not None:
            read += nbytes(v)
            if a.is_mutated:
                written += nbytes(v)
    for spec in op.output_specs(args):
        written += math.prod(tuple(spec.shape)) * itemsize(spec.dtype)
    return {"read": read, "written": written, "total": read + written}
