"""Test cases of the plugin's ops for ``opbridge.testing.check_op``, shared by the framework tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from opbridge.testing import shaped_cases

#: Odd sizes, an empty batch and one case above the kernels' multi-threading grain.
ROWS = ((1,), (7,), (3, 5), (0,), (4, 1, 2), (65,))


def advance_step(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Batches of (num_seqs, num_queries, block_size, blocks per sequence), int tensors as vLLM has them."""
    out: list[dict[str, Any]] = []
    batches = ((1, 1, 16, 1), (7, 5, 4, 9), (33, 33, 16, 5), (4, 0, 8, 2))
    for num_seqs, num_queries, block_size, width in batches:
        out.append({
            "num_seqs": num_seqs, "num_queries": num_queries, "block_size": block_size,
            "input_tokens": rng.integers(0, 32000, num_seqs).astype(np.int64),
            "sampled_token_ids": rng.integers(0, 32000, (num_queries, 1)).astype(np.int64),
            "input_positions": rng.integers(0, 100, num_seqs).astype(np.int64),
            "seq_lens": rng.integers(0, block_size * width, num_seqs).astype(np.int32),
            "slot_mapping": np.full(num_seqs, -1, np.int64),
            "block_tables": rng.integers(0, 1000, (num_seqs, width)).astype(np.int32),
        })
    out.append({**out[1], "_noncontiguous": "block_tables"})
    return out


def norm(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``x``, ``residual`` of shape (*lead, H), ``weight`` of shape (H,)."""
    shapes = [(1, 7), (3, 769), (0, 16), (2, 1, 33), (40, 2049)]
    return shaped_cases([{"x": s, "residual": s, "weight": (s[-1],)} for s in shapes], rng)


def elementwise(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``x`` of assorted shapes."""
    shapes = [(1,), (7,), (3, 769), (0, 16), (4, 1, 33), (33, 2053)]
    return shaped_cases([{"x": s} for s in shapes], rng)


def gated(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``x`` of shape (*lead, 2d) (even last dims)."""
    shapes = [(2,), (3, 8), (0, 16), (4, 1, 34), (17, 770), (40, 4098)]
    return shaped_cases([{"x": s} for s in shapes], rng)


def gated_backward(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
    """``grad`` of shape (*lead, d), ``x`` of shape (*lead, 2d)."""
    shapes = [(2,), (3, 8), (0, 16), (4, 1, 34), (17, 770)]
    return shaped_cases([{"grad": (*s[:-1], s[-1] // 2), "x": s} for s in shapes], rng)


#: op name -> case generator
CASES = {
    "advance_step_flashattn": advance_step,
    "fused_add_rms_norm": norm,
    "scale_": elementwise,
    "silu_and_mul": gated,
    "silu_and_mul_backward": gated_backward,
}
