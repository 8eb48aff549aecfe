"""vLLM's ``rotary_embedding``, in place on ``query`` and ``key``: its NumPy reference (the
declaration) and test cases; the kernels are ``opbridge/csrc/rotary_embedding.{cc,cu}``.

Its ``positions`` are int64, as torch and vLLM make them, or int32, as JAX makes
them without ``jax_enable_x64``; in JAX, a position out of range surfaces from
inside XLA as ``JaxRuntimeError`` carrying the same message.
``rotary_embedding_cases`` generates valid positions for the test matrix
(``check_op``) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, NONCONTIGUOUS
from opbridge.ops._library import LIBRARY

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
    tokens, a case above the threading grain, one sliced and one non-contiguous case per tensor,
    and int32 positions (JAX's without x64) in three of them."""
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
    for spec, extra in ((specs[3], {}), (specs[8], {}), (specs[1], {LAYOUT: "sliced"})):
        c = case(spec)
        cases.append({**c, "positions": c["positions"].astype(np.int32), **extra})
    return cases


@LIBRARY.op(
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox) -> ()",
    hints=rotary_embedding_cases,
    dtype_arg="query",
    row_strided=("query", "key"),  # vLLM's column slices of one qkv tensor, rotated where they are
    graph_safe=False,  # its CUDA kernel's host code raises a bad position found by the previous call
)
def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any,
                     is_neox: bool) -> None:
    """vLLM's rotary_embedding, in place on ``query`` and ``key`` (which may be None).

    ``positions``: int64 or int32, ``(num_tokens,)`` or ``(batch, seq)``. ``query``:
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
    if positions.dtype not in (np.int64, np.int32):
        raise TypeError(f"rotary_embedding: positions must have dtype int64 or int32, got {positions.dtype}")
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
