"""advance_step_flashattn: multi-step decode bookkeeping, in place (kernel: csrc/advance_step.cc)."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_plugin.ops._library import LIBRARY


@LIBRARY.op(
    "advance_step_flashattn(int num_seqs, int num_queries, int block_size, Tensor(a!) input_tokens, "
    "Tensor sampled_token_ids, Tensor(b!) input_positions, Tensor(c!) seq_lens, Tensor(d!) slot_mapping, "
    "Tensor block_tables) -> ()",
    dtypes=("int64",),  # the token and position tensors; the kernel checks the int32 ones itself
)
def advance_step_flashattn(
    num_seqs: int, num_queries: int, block_size: int, input_tokens: Any, sampled_token_ids: Any,
    input_positions: Any, seq_lens: Any, slot_mapping: Any, block_tables: Any,
) -> None:
    """Advance a multi-step decode runner by one step, in place.

    For each of the first ``num_queries`` sequences, the sampled token becomes
    the next input token at position ``seq_lens[i]``, the sequence grows by
    one, and its slot in the paged KV cache is looked up in ``block_tables``.

    Parameters
    ----------
    num_seqs
        Number of sequences in the batch (the length of the per-sequence tensors).
    num_queries
        Number of sequences that decode this step (``<= num_seqs``).
    block_size
        Tokens per KV-cache block.
    input_tokens
        int64 ``(num_seqs,)``; set to the sampled tokens.
    sampled_token_ids
        int64 ``(num_queries, 1)``: the token sampled for each query.
    input_positions
        int64 ``(num_seqs,)``; set to each new token's position.
    seq_lens
        int32 ``(num_seqs,)``; incremented.
    slot_mapping
        int64 ``(num_seqs,)``; set to each new token's KV-cache slot.
    block_tables
        int32 ``(num_seqs, max_blocks)``: the blocks of each sequence.
    """
    q = num_queries
    pos = seq_lens[:q].astype(np.int64)
    input_tokens[:q] = sampled_token_ids[:q, 0]
    seq_lens[:q] = pos + 1
    input_positions[:q] = pos
    blocks = block_tables[np.arange(q), pos // block_size].astype(np.int64)
    slot_mapping[:q] = blocks * block_size + pos % block_size
