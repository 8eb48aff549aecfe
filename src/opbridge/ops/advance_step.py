"""vLLM's multi-step ``advance_step_flashattn``: its NumPy reference (the declaration) and test
cases; the kernels are ``opbridge/csrc/advance_step.{cc,cu}``.

Its token ids, positions and slots are int64 (as vLLM's kernel takes them) or
all int32 (as JAX makes them without ``jax_enable_x64``). A bad block id
surfaces from inside XLA as ``JaxRuntimeError`` carrying the kernel's message.
``advance_step_flashattn_cases`` generates valid block tables for the test
matrix (``check_op``) and the benchmarks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.cases import LAYOUT, NONCONTIGUOUS
from opbridge.ops._library import LIBRARY

_INT32_MAX = int(np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------
# advance_step_flashattn
# ---------------------------------------------------------------------------


def _check_int(name: str, t: Any, dtype: Any, shape: tuple[int, ...] | tuple[tuple[int, ...], ...],
               like: str | None = None) -> None:
    if np.asarray(t).dtype != np.dtype(dtype):
        want = f"the same dtype as {like} ({np.dtype(dtype).name})" if like else f"dtype {np.dtype(dtype).name}"
        raise TypeError(f"advance_step_flashattn: {name} must have {want}, got {np.asarray(t).dtype}")
    shapes = shape if shape and isinstance(shape[0], tuple) else (shape,)
    if tuple(t.shape) not in shapes:
        raise ValueError(f"advance_step_flashattn: {name} must have shape "
                         f"{' or '.join(map(str, shapes))}, got {tuple(t.shape)}")


def advance_step_flashattn_cases(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Valid ``advance_step_flashattn`` cases; *dtype* int32 makes the token ids, positions and slots
    int32, any other int64 (``seq_lens`` and ``block_tables`` are int32 either way).

    Initial values of the mutated tensors never equal what the op writes
    (tokens in [1000, 2000), positions in [10^6, 2 10^6), slots >= 10^9), so an
    element the kernel leaves unwritten fails the forward comparison: an
    int-only op has no NaN to detect unwritten memory with. Padded rows hold
    negative seq_lens and block ids, which the op must ignore. Covers no
    queries, no sequences, block_size 1, the largest block id whose slots fit
    the slots' dtype (int64: at block_size 2^32; int32: at 2^20),
    seq_lens one below int32 overflow, a run above the threading grain, a
    sliced case and one non-contiguous case per tensor.
    """
    wide = np.dtype(dtype) != np.int32
    dtype = "int64" if wide else "int32"
    ids_max = int(np.iinfo(dtype).max)  # as the reference bounds block ids

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
            tables[0, int(seq_lens[0]) // block_size] = ids_max // block_size - 1
        sampled = rng.integers(0, 1000, size=(num_queries,) if flat else (num_queries, 1))
        return {
            "num_seqs": num_seqs,
            "num_queries": num_queries,
            "block_size": block_size,
            "input_tokens": rng.integers(1000, 2000, size=num_seqs).astype(dtype),
            "sampled_token_ids": sampled.astype(dtype),
            "input_positions": rng.integers(10**6, 2 * 10**6, size=num_seqs).astype(dtype),
            "seq_lens": seq_lens,
            "slot_mapping": rng.integers(10**9, 2 * 10**9, size=num_seqs).astype(dtype),
            "block_tables": tables,
        }

    cases = [
        case(1, 1, 16, 4),
        case(7, 5, 4, 8),
        case(3, 0, 8, 2),
        case(0, 0, 16, 1),
        case(5, 5, 1, 64, flat=True),
        case(33, 20, 16, 16),
        case(2, 2, 2**32, 1, huge=True) if wide else case(2, 2, 2**20, 2**11, huge=True),
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
    dtypes=("int64", "int32"),  # input_tokens's; the kernels check the tensors beside it
    graph_safe=False,  # its CUDA kernel's host code raises a bad block id found by the previous call
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
    int32 ``(num_seqs, max_blocks)``. The first four may instead all be int32
    (what JAX makes of them without ``jax_enable_x64``). Everything is
    validated before anything is written: sizes and dtypes, ``0 <= num_queries
    <= num_seqs``, ``block_size > 0``, and per query a token id ``>= 0``, ``0
    <= seq_lens[i] < 2**31 - 1``, a block index within the table's width and a
    block id ``b`` with ``0 <= b`` and ``(b + 1) * block_size <= 2**63 - 1``
    (``2**31 - 1`` for int32 slots). Whether ``b`` is
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
    ids = np.asarray(input_tokens).dtype
    if ids not in (np.int64, np.int32):
        raise TypeError(f"{op}: input_tokens must have dtype int64 or int32, got {ids}")
    _check_int("input_tokens", input_tokens, ids, (num_seqs,))
    _check_int("sampled_token_ids", sampled_token_ids, ids, ((num_queries, 1), (num_queries,)), "input_tokens")
    _check_int("input_positions", input_positions, ids, (num_seqs,), "input_tokens")
    _check_int("seq_lens", seq_lens, np.int32, (num_seqs,))
    _check_int("slot_mapping", slot_mapping, ids, (num_seqs,), "input_tokens")
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
    max_block_id = int(np.iinfo(ids).max) // block_size - 1
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
                         f"in {ids})")
    input_tokens[:q] = sampled
    seq_lens[:q] += 1
    input_positions[:q] = pos
    slot_mapping[:q] = block.astype(np.int64) * block_size + pos % block_size
    input_tokens[q:num_seqs] = 0
    input_positions[q:num_seqs] = 0
    slot_mapping[q:num_seqs] = -1
