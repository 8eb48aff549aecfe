"""LLM-serving ops with vLLM's semantics: gated activations, fused residual + RMSNorm,
rotary embedding and the multi-step ``advance_step_flashattn``.

The functions below are the NumPy references (they are the declarations); the
CPU kernels live in ``opbridge/csrc/{activation_and_mul,fused_add_rms_norm,
rotary_embedding,advance_step}.cc``. Mutating ops (``Tensor(a!)``) update their
arguments in place in torch, NumPy and Paddle, and return the new values of the
mutated arguments in JAX (whose arrays are immutable). ``rotary_embedding`` and
``advance_step_flashattn`` take int64 tensors, which JAX only has with
``jax_enable_x64`` (otherwise it narrows them to int32 and the kernels reject
them with a TypeError naming the argument); in JAX, errors that depend on
tensor contents (a position out of range, a bad block id) surface from inside
XLA as ``JaxRuntimeError`` carrying the same message.

Each op declares its test cases (``hints=``): ``rotary_embedding_cases`` and
``advance_step_flashattn_cases`` generate valid integer positions and block
tables for the test matrix (``check_op``) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, NONCONTIGUOUS, gated_hint, last_dim_hint
from opbridge.declare import Spec, like
from opbridge.ops._library import LIBRARY

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)

# ---------------------------------------------------------------------------
# gated activations: act(a) * b with x = [a | b] along the last dim
# ---------------------------------------------------------------------------


def _halves(op: str, x: Any) -> int:
    """The half width d of x's last dim (2d); ValueError naming the op and x when odd or 0-d."""
    shape = x.shape
    if not shape or shape[-1] % 2:
        raise ValueError(f"{op}: x's last dim must be even (it holds the halves [a | b]), got shape {tuple(shape)}")
    return shape[-1] // 2  # type: ignore[no-any-return]


def _halve_last(op: str) -> Any:
    def rule(x: Any) -> Spec:
        return Spec((*x.shape[:-1], _halves(op, x)), x.dtype)

    rule.__name__ = f"{op}_shape"
    rule.__doc__ = "x's shape with the last dim halved, in x's dtype."
    return rule


def _sigmoid(a: Any) -> Any:
    with np.errstate(over="ignore"):  # exp(-a) = inf gives sigmoid 0, as it should
        return 1.0 / (1.0 + np.exp(-a))


def _gelu_tanh(a: Any) -> tuple[Any, Any]:
    """gelu_tanh(a) = 0.5 a (1 + tanh(u)), u = sqrt(2/pi) (a + 0.044715 a^3), and its derivative.

    Evaluated as ``a * sigmoid(2u)`` (the same function): ``1 + tanh(u)``
    cancels for a < -5 even in float64, leaving no correct digits by a = -8.
    """
    z = 2.0 * _SQRT_2_OVER_PI * (a + 0.044715 * a**3)
    dz = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a**2)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-z)
        s = 1.0 / (1.0 + e)
        one_minus_s = np.where(np.isinf(e), 1.0, e * s)
    return a * s, s + a * dz * one_minus_s * s


def _silu_and_mul_grad(grad: Any, x: Any) -> tuple[Any]:
    return (silu_and_mul_backward(grad, x),)


def _gelu_and_mul_grad(grad: Any, x: Any) -> tuple[Any]:
    return (gelu_and_mul_backward(grad, x),)


@LIBRARY.op("silu_and_mul(Tensor x) -> Tensor", shape=_halve_last("silu_and_mul"),
            backward=_silu_and_mul_grad, hints=gated_hint(("x",)))
def silu_and_mul(x: Any) -> Any:
    """vLLM's SiluAndMul: ``silu(a) * b`` for ``x = [a | b]`` split along the last dim; shape ``(..., d)``."""
    d = _halves("silu_and_mul", x)
    a, b = x[..., :d], x[..., d:]
    return a * _sigmoid(a) * b


@LIBRARY.op("silu_and_mul_backward(Tensor grad, Tensor x) -> Tensor", shape=like("x"),
            hints=gated_hint(("x",), half=("grad",)))
def silu_and_mul_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`silu_and_mul` w.r.t. ``x`` (shape of x): ``[grad b silu'(a) | grad silu(a)]``."""
    d = _halves("silu_and_mul_backward", x)
    a, b = x[..., :d], x[..., d:]
    s = _sigmoid(a)
    return np.concatenate([grad * b * s * (1.0 + a * (1.0 - s)), grad * a * s], axis=-1)


@LIBRARY.op("gelu_and_mul(Tensor x) -> Tensor", shape=_halve_last("gelu_and_mul"),
            backward=_gelu_and_mul_grad, hints=gated_hint(("x",)))
def gelu_and_mul(x: Any) -> Any:
    """vLLM's GeluAndMul(approximate="tanh") (gelu_tanh_and_mul): ``gelu_tanh(a) * b`` for ``x = [a | b]``."""
    d = _halves("gelu_and_mul", x)
    a, b = x[..., :d], x[..., d:]
    return _gelu_tanh(a)[0] * b


@LIBRARY.op("gelu_and_mul_backward(Tensor grad, Tensor x) -> Tensor", shape=like("x"),
            hints=gated_hint(("x",), half=("grad",)))
def gelu_and_mul_backward(grad: Any, x: Any) -> Any:
    """Gradient of :func:`gelu_and_mul` w.r.t. ``x`` (shape of x): ``[grad b gelu'(a) | grad gelu(a)]``."""
    d = _halves("gelu_and_mul_backward", x)
    a, b = x[..., :d], x[..., d:]
    g, dg = _gelu_tanh(a)
    return np.concatenate([grad * b * dg, grad * g], axis=-1)


# ---------------------------------------------------------------------------
# fused_add_rms_norm
# ---------------------------------------------------------------------------


@LIBRARY.op("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=1e-6) -> ()",
            hints=last_dim_hint(("input", "residual"), ("weight",)))
def fused_add_rms_norm(input: Any, residual: Any, weight: Any, eps: float = 1e-6) -> None:
    """vLLM's fused_add_rms_norm, in place: ``residual += input``; ``input = rms_norm(residual) * weight``.

    The norm is over the last dim, ``residual / sqrt(mean(residual^2) + eps)``,
    of the new residual as stored (kernels round it to its dtype first, as
    vLLM does). An inference op: no backward.
    """
    residual += input
    r = 1.0 / np.sqrt(np.mean(residual * residual, axis=-1, keepdims=True) + eps)
    input[...] = residual * r * weight


# ---------------------------------------------------------------------------
# rotary_embedding
# ---------------------------------------------------------------------------


def _heads(name: str, t: Any, positions: Any, head_size: int) -> int:
    pshape, shape = tuple(positions.shape), tuple(t.shape)
    if len(shape) not in (len(pshape) + 1, len(pshape) + 2) or shape[:len(pshape)] != pshape:
        raise ValueError(f"rotary_embedding: {name} must have shape (*positions.shape, num_heads * "
                         f"head_size) or (*positions.shape, num_heads, head_size) with positions.shape = "
                         f"{pshape}, got {shape}")
    if len(shape) == len(pshape) + 1:
        if shape[-1] % head_size:
            raise ValueError(f"rotary_embedding: {name}'s last dim ({shape[-1]}) must be a multiple of "
                             f"head_size ({head_size}), got shape {shape}")
        heads = shape[-1] // head_size
    else:
        if shape[-1] != head_size:
            raise ValueError(f"rotary_embedding: {name}'s last dim must be head_size ({head_size}) in the "
                             f"(..., num_heads, head_size) layout, got shape {shape}")
        heads = shape[-2]
    if heads < 1:
        raise ValueError(f"rotary_embedding: {name} must hold at least one head, got shape {shape}")
    return int(heads)


def _cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> np.ndarray:
    inv_freq = 1.0 / base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1)


def rotary_embedding_cases(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Valid ``rotary_embedding`` cases: both styles, key None and present, flat and split head
    layouts, 1-D and 2-D positions, partial rotation (rot_dim < head_size), an odd head size, zero
    tokens, a case above the threading grain, one sliced and one non-contiguous case per tensor."""
    # (positions shape, query trailing dims, key trailing dims or None, head_size, rot_dim, is_neox)
    specs: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None, int, int, bool]] = [
        ((1,), (4,), None, 4, 4, True),
        ((7,), (2, 8), (1, 8), 8, 8, False),
        ((3,), (24,), (12,), 6, 4, True),
        ((2, 5), (48,), (48,), 16, 16, False),
        ((2, 3), (2, 10), None, 10, 6, True),
        ((0,), (16,), (8,), 8, 8, False),
        ((4,), (15,), (5,), 5, 4, False),
        ((5,), (3, 12), (3, 12), 12, 12, True),
        ((600,), (256,), (64,), 32, 32, True),  # (8 + 2) heads * 32 * 600 tokens > 2^16: threaded
        ((2, 300), (8, 16), (4, 16), 16, 12, False),
    ]

    def case(spec: tuple[Any, ...]) -> dict[str, Any]:
        pshape, qdims, kdims, head_size, rot_dim, is_neox = spec
        max_position = 64 if int(np.prod(pshape)) < 100 else 2048
        return {
            "positions": rng.integers(0, max_position, size=pshape, dtype=np.int64),
            "query": rng.standard_normal((*pshape, *qdims)) * 2.0,
            "key": None if kdims is None else rng.standard_normal((*pshape, *kdims)) * 2.0,
            "head_size": head_size,
            "cos_sin_cache": _cos_sin_cache(max_position, rot_dim),
            "is_neox": is_neox,
        }

    cases = [case(s) for s in specs]
    cases.append({**case(specs[1]), LAYOUT: "sliced"})
    cases.append({**case(specs[2]), LAYOUT: "sliced"})
    for name in ("positions", "query", "key", "cos_sin_cache"):
        cases.append({**case(specs[2]), NONCONTIGUOUS: name})
    return cases


@LIBRARY.op(
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox) -> ()",
    hints=rotary_embedding_cases,
    dtype_arg="query",
)
def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any,
                     is_neox: bool) -> None:
    """vLLM's rotary_embedding, in place on ``query`` and ``key`` (which may be None).

    ``positions``: int64, ``(num_tokens,)`` or ``(batch, seq)``. ``query``:
    ``(*positions.shape, num_heads * head_size)`` or ``(*positions.shape,
    num_heads, head_size)``; ``key`` likewise with its own number of heads
    (dividing num_heads). ``cos_sin_cache``: ``(max_position, rot_dim)``, row
    ``p`` holding ``[cos | sin]`` halves, in query's dtype; ``rot_dim`` even and
    at most ``head_size``. The first ``rot_dim`` elements of each head are
    rotated by the angles of the token's position: NeoX style
    (``is_neox=True``) pairs element ``i`` with ``i + rot_dim/2``, GPT-J style
    pairs ``2i`` with ``2i + 1``; ``(x, y) <- (x cos - y sin, y cos + x sin)``.
    Positions outside ``[0, max_position)`` raise ValueError before anything
    is written.
    """
    positions = np.asarray(positions)
    if positions.dtype != np.int64:
        raise TypeError(f"rotary_embedding: positions must have dtype int64, got {positions.dtype}")
    if positions.ndim not in (1, 2):
        raise ValueError(f"rotary_embedding: positions must have shape (num_tokens,) or (batch, seq), "
                         f"got {positions.shape}")
    if head_size <= 0:
        raise ValueError(f"rotary_embedding: head_size must be > 0, got {head_size}")
    num_heads = _heads("query", query, positions, head_size)
    if cos_sin_cache.ndim != 2:
        raise ValueError(f"rotary_embedding: cos_sin_cache must be 2-D, got shape {cos_sin_cache.shape}")
    max_position, rot_dim = cos_sin_cache.shape
    if rot_dim % 2 or not 2 <= rot_dim <= head_size:
        raise ValueError(f"rotary_embedding: cos_sin_cache's last dim (rot_dim) must be even and in "
                         f"[2, head_size = {head_size}], got shape {cos_sin_cache.shape}")
    num_kv_heads = 0 if key is None else _heads("key", key, positions, head_size)
    if key is not None:
        if num_heads % num_kv_heads:
            raise ValueError(f"rotary_embedding: query's number of heads ({num_heads}) must be a multiple "
                             f"of key's ({num_kv_heads})")
    bad = np.flatnonzero((positions < 0) | (positions >= max_position))
    if bad.size:
        idx = np.unravel_index(bad[0], positions.shape)
        where = ", ".join(str(int(i)) for i in idx)
        raise ValueError(f"rotary_embedding: positions must be in [0, max_position) with max_position = "
                         f"{max_position} (cos_sin_cache's first dim), got positions[{where}] = "
                         f"{int(positions[idx])}")
    half = rot_dim // 2
    flat = positions.reshape(-1)
    cos = cos_sin_cache[flat, :half][:, None, :]  # (tokens, 1, half)
    sin = cos_sin_cache[flat, half:][:, None, :]
    for t, heads in ((query, num_heads), (key, num_kv_heads)):
        if t is None:
            continue
        v = np.array(t).reshape(flat.size, heads, head_size)  # a copy: written back below
        rot = v[..., :rot_dim]
        x, y = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
        x[...], y[...] = x * cos - y * sin, y * cos + x * sin
        t[...] = v.reshape(t.shape)


# ---------------------------------------------------------------------------
# advance_step_flashattn
# ---------------------------------------------------------------------------


def _check_int(name: str, t: Any, dtype: Any, shape: tuple[int, ...] | tuple[tuple[int, ...], ...]) -> None:
    if np.asarray(t).dtype != np.dtype(dtype):
        raise TypeError(f"advance_step_flashattn: {name} must have dtype {np.dtype(dtype).name}, "
                        f"got {np.asarray(t).dtype}")
    shapes = shape if shape and isinstance(shape[0], tuple) else (shape,)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"advance_step_flashattn: {name} must have shape "
                         f"{' or '.join(map(str, shapes))}, got {tuple(t.shape)}")


def advance_step_flashattn_cases(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Valid ``advance_step_flashattn`` cases (integer tensors only, so identical for every dtype).

    Initial values of the mutated tensors never equal what the op writes
    (tokens in [1000, 2000), positions in [10^6, 2 10^6), slots >= 10^9), so an
    element the kernel leaves unwritten fails the forward comparison: an
    int-only op has no NaN to detect unwritten memory with. Padded rows hold
    negative seq_lens and block ids, which the op must ignore. Covers no
    queries, no sequences, block_size 1, a block id one below int64 overflow,
    seq_lens one below int32 overflow, a run above the threading grain, a
    sliced case and one non-contiguous case per tensor.
    """
    def case(num_seqs: int, num_queries: int, block_size: int, max_blocks: int, *,
             flat: bool = False, huge: bool = False) -> dict[str, Any]:
        # leave room for a few more steps: opcheck and compile run the op repeatedly
        top = max(min(block_size * max_blocks, _INT32_MAX) - 8, 1)
        seq_lens = rng.integers(0, top, size=num_seqs).astype(np.int32)
        tables = rng.integers(0, 1000, size=(num_seqs, max_blocks)).astype(np.int32)
        seq_lens[num_queries:] = -5  # padded rows: never read
        tables[num_queries:] = -1
        if huge and num_queries:
            seq_lens[0] = _INT32_MAX - 8
            tables[0, 0] = _INT64_MAX // block_size - 1
        sampled = rng.integers(0, 1000, size=(num_queries,) if flat else (num_queries, 1))
        return {
            "num_seqs": num_seqs,
            "num_queries": num_queries,
            "block_size": block_size,
            "input_tokens": rng.integers(1000, 2000, size=num_seqs),
            "sampled_token_ids": sampled.astype(np.int64),
            "input_positions": rng.integers(10**6, 2 * 10**6, size=num_seqs),
            "seq_lens": seq_lens,
            "slot_mapping": rng.integers(10**9, 2 * 10**9, size=num_seqs),
            "block_tables": tables,
        }

    cases = [
        case(1, 1, 16, 4),
        case(7, 5, 4, 8),
        case(3, 0, 8, 2),
        case(0, 0, 16, 1),
        case(5, 5, 1, 64, flat=True),
        case(33, 20, 16, 16),
        case(2, 2, 2**32, 1, huge=True),
        case(70001, 69990, 16, 4),  # > 2^16 sequences: threaded
        {**case(9, 6, 8, 4), LAYOUT: "sliced"},
    ]
    for name in ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens", "slot_mapping",
                 "block_tables"):
        cases.append({**case(6, 4, 4, 4, flat=True), NONCONTIGUOUS: name})
    return cases


@LIBRARY.op(
    "advance_step_flashattn(int num_seqs, int num_queries, int block_size, Tensor(a!) input_tokens, "
    "Tensor sampled_token_ids, Tensor(b!) input_positions, Tensor(c!) seq_lens, Tensor(d!) slot_mapping, "
    "Tensor block_tables) -> ()",
    hints=advance_step_flashattn_cases,
    dtypes=("int64",),  # input_tokens; the kernel checks the int32 and int64 tensors beside it
)
def advance_step_flashattn(num_seqs: int, num_queries: int, block_size: int, input_tokens: Any,
                           sampled_token_ids: Any, input_positions: Any, seq_lens: Any, slot_mapping: Any,
                           block_tables: Any) -> None:
    """vLLM's advance_step_flashattn (multi-step decoding), in place.

    For ``i < num_queries``: ``input_tokens[i] = sampled_token_ids[i][0]``,
    ``seq_lens[i] += 1``, ``input_positions[i] = pos = seq_lens[i] - 1`` and
    ``slot_mapping[i] = block_tables[i][pos // block_size] * block_size + pos %
    block_size``. For padded entries ``num_queries <= i < num_seqs``:
    ``input_tokens[i] = 0``, ``input_positions[i] = 0``, ``slot_mapping[i] =
    -1`` (``seq_lens`` untouched).

    dtypes: ``input_tokens``, ``input_positions``, ``slot_mapping`` int64
    ``(num_seqs,)``; ``sampled_token_ids`` int64 ``(num_queries, 1)`` (or
    ``(num_queries,)``); ``seq_lens`` int32 ``(num_seqs,)``; ``block_tables``
    int32 ``(num_seqs, max_blocks)``. Everything is validated before anything
    is written: sizes and dtypes, ``0 <= num_queries <= num_seqs``,
    ``block_size > 0``, and per query a token id ``>= 0``, ``0 <= seq_lens[i]
    < 2**31 - 1``, a block index within the table's width and a block id ``b``
    with ``0 <= b`` and ``(b + 1) * block_size <= 2**63 - 1``. Whether ``b`` is
    below the KV cache's block count cannot be checked (the cache is not an
    argument).
    """
    op = "advance_step_flashattn"
    if num_seqs < 0:
        raise ValueError(f"{op}: num_seqs must be >= 0, got {num_seqs}")
    if num_queries < 0:
        raise ValueError(f"{op}: num_queries must be >= 0, got {num_queries}")
    if num_queries > num_seqs:
        raise ValueError(f"{op}: num_queries ({num_queries}) must be <= num_seqs ({num_seqs})")
    if block_size <= 0:
        raise ValueError(f"{op}: block_size must be > 0, got {block_size}")
    _check_int("input_tokens", input_tokens, np.int64, (num_seqs,))
    _check_int("sampled_token_ids", sampled_token_ids, np.int64, ((num_queries, 1), (num_queries,)))
    _check_int("input_positions", input_positions, np.int64, (num_seqs,))
    _check_int("seq_lens", seq_lens, np.int32, (num_seqs,))
    _check_int("slot_mapping", slot_mapping, np.int64, (num_seqs,))
    if np.asarray(block_tables).dtype != np.int32:
        raise TypeError(f"{op}: block_tables must have dtype int32, got {np.asarray(block_tables).dtype}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"{op}: block_tables must have shape (num_seqs = {num_seqs}, max_blocks), "
                         f"got {tuple(block_tables.shape)}")
    max_blocks = block_tables.shape[1]
    q = num_queries
    sampled = sampled_token_ids.reshape(q)
    pos = seq_lens[:q].astype(np.int64)
    bidx = pos // block_size
    in_table = (pos >= 0) & (bidx < max_blocks)
    block = np.zeros(q, np.int64)
    if max_blocks:
        block[in_table] = block_tables[np.flatnonzero(in_table), bidx[in_table]]
    max_block_id = _INT64_MAX // block_size - 1
    bad = (sampled < 0) | ~in_table | (pos >= _INT32_MAX) | (block < 0) | (block > max_block_id)
    if bad.any():  # the first failing query, and its first failing check, as the kernel reports it
        i = int(np.flatnonzero(bad)[0])
        p, b = int(pos[i]), int(bidx[i])
        if sampled[i] < 0:
            raise ValueError(f"{op}: sampled_token_ids must be >= 0 (token ids), got "
                             f"sampled_token_ids[{i}] = {int(sampled[i])}")
        if p < 0:
            raise ValueError(f"{op}: seq_lens must be >= 0, got seq_lens[{i}] = {p}")
        if p >= _INT32_MAX:
            raise ValueError(f"{op}: seq_lens[{i}] = {p} cannot be incremented without overflowing int32")
        if b >= max_blocks:
            raise ValueError(f"{op}: block index beyond the table's width: sequence {i} at position {p} "
                             f"needs block_tables[{i}][{b}] (block_size {block_size}), but block_tables "
                             f"has {max_blocks} column(s)")
        raise ValueError(f"{op}: block_tables[{i}][{b}] = {int(block[i])} is not a valid block id (must be "
                         f"in [0, {max_block_id}] so that its slots id * block_size + [0, block_size) fit "
                         f"in int64)")
    input_tokens[:q] = sampled
    seq_lens[:q] += 1
    input_positions[:q] = pos
    slot_mapping[:q] = block.astype(np.int64) * block_size + pos % block_size
    input_tokens[q:num_seqs] = 0
    input_positions[q:num_seqs] = 0
    slot_mapping[q:num_seqs] = -1
