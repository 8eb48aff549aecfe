"""The inputs of ``opbridge bench frameworks``' per-call sections, and which op each section calls.

Every op of :data:`PER_CALL_OPS` gets a section per framework on
:func:`inputs`: ``add`` on 8 float32 elements, the others at the serving size
:data:`ROWS`. :data:`VIEW_SECTIONS` call an op on views of one ``qkv`` tensor;
:data:`OUT_SECTIONS` call an op with ``out=`` a preallocated array, against the
framework's own op or formula with ``out=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The ops with per-call sections (``--ops``), in report order.
PER_CALL_OPS = ("add", "gelu", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                "gelu_and_mul", "rotary_embedding_qkv", "rms_norm_qkv", "add_out", "silu_and_mul_out")
#: Sections that call an op on views, and the op: ``rotary_embedding_qkv`` rotates ``query`` and
#: ``key`` where vLLM passes them, column slices of one ``qkv`` tensor (``[q | k | v]``);
#: ``rms_norm_qkv`` normalises such a query slice (a q-norm over one head of 64). Not in JAX, whose
#: arrays have no views.
VIEW_SECTIONS = {"rotary_embedding_qkv": "rotary_embedding", "rms_norm_qkv": "rms_norm"}
#: Sections that call an op with ``out=`` (a new array made once, written by every call), and the op. Not in
#: JAX, whose arrays are immutable (its out= donates buffers under jax.jit), or MindSpore, whose ops take no out=.
OUT_SECTIONS = {"add_out": "add", "silu_and_mul_out": "silu_and_mul"}
#: The serving size: 8 tokens, hidden 64 (the gated ops' x; their result is (8, 32)).
ROWS = (8, 64)
SMALL = (8,)
_EPS = 1e-6


def rand(shape: tuple[int, ...], seed: int) -> Any:
    """A float32 standard-normal array of *shape* from *seed*."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def inputs(op: str) -> tuple[tuple[int, ...], list[Any]]:
    """The section's shape and *op*'s schema-ordered arguments (float32 NumPy arrays and scalars)."""
    import numpy as np

    from opbridge.bench.workloads import rope_cache, rope_heads, rope_shapes

    if op in OUT_SECTIONS:
        return inputs(OUT_SECTIONS[op])
    if op == "add":
        return SMALL, [rand(SMALL, 0), rand(SMALL, 1)]
    rng = np.random.default_rng(PER_CALL_OPS.index(op))

    def f32(shape: tuple[int, ...]) -> Any:
        return rng.standard_normal(shape).astype(np.float32)

    hidden = ROWS[1]
    if op in ("gelu", "silu_and_mul", "gelu_and_mul"):
        return ROWS, [f32(ROWS)]
    if op == "rms_norm":
        return ROWS, [f32(ROWS), f32((hidden,)), _EPS]
    if op == "fused_add_rms_norm":
        # Timing calls it over and over on the same buffers. After the first call input = w * residual / r
        # (r = rms(residual)), so each call sets residual *= 1 - |w| / r elementwise for negative weights,
        # which keeps r <= max(r after the first call, max |w| = 1.5) however many calls run; positive
        # weights would grow the residual by about |w| per call.
        return ROWS, [f32(ROWS), f32(ROWS), -(0.5 + rng.random(hidden)).astype(np.float32), _EPS]
    if op == "rotary_embedding":
        # One head of 64 per token (bench kernels' geometry at this width), NeoX style; rotations keep
        # query's and key's norms (up to rounding), so repeated calls on the same buffers stay bounded.
        shapes = rope_shapes(ROWS)
        max_position, rot_dim = shapes["cos_sin_cache"]
        return shapes["query"], [rng.integers(0, max_position, shapes["positions"], dtype=np.int64),
                                 f32(shapes["query"]), f32(shapes["key"]), rope_heads(hidden)[0],
                                 rope_cache(max_position, rot_dim).astype(np.float32), True]
    if op == "rotary_embedding_qkv":  # rotary_embedding's arguments, query and key placed in one qkv
        shape, raw = inputs("rotary_embedding")
        q, k = raw[1], raw[2]
        qkv = np.concatenate([q, k, f32(k.shape)], axis=1)
        n, m = q.shape[1], k.shape[1]
        return shape, [raw[0], Cols(qkv, 0, n), Cols(qkv, n, n + m), *raw[3:]]
    if op == "rms_norm_qkv":  # rms_norm's x, the query columns of one qkv
        shape, raw = inputs("rms_norm")
        x = raw[0]
        qkv = np.concatenate([x, f32(x.shape), f32(x.shape)], axis=1)
        return shape, [Cols(qkv, 0, x.shape[1]), *raw[1:]]
    raise ValueError(f"no per-call inputs for {op!r}; per-call ops: {', '.join(PER_CALL_OPS)}")


@dataclass(frozen=True)
class Cols:
    """A raw argument that is columns ``[start, stop)`` of the 2-D array *base*: a view of the one
    framework tensor made from *base* for a call's arguments (:meth:`_Kit.args`)."""

    base: Any
    start: int
    stop: int


def called_op(section_op: str) -> str:
    """The op a section calls (``rms_norm_qkv`` and ``add_out`` call ``rms_norm`` and ``add``)."""
    return VIEW_SECTIONS.get(section_op, OUT_SECTIONS.get(section_op, section_op))
