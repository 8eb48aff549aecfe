// Argument checks of advance_step_flashattn shared by its CPU and CUDA kernels,
// device checks included (device: kDLCPU or kDLCUDA; see check_device_like).
// Errors name the op and the argument. The per-query values are checked by each
// kernel (on the host before writing on the CPU, on the device on CUDA).
#pragma once

#include <opbridge/opbridge.h>

#include <cstdint>

namespace opbridge {
namespace advance_step {

constexpr char kOp[] = "advance_step_flashattn";

inline void check_scalars(const char* op, int64_t num_seqs, int64_t num_queries, int64_t block_size) {
  OPB_CHECK(num_seqs >= 0, ValueError) << op << ": num_seqs must be >= 0, got " << num_seqs;
  OPB_CHECK(num_queries >= 0, ValueError) << op << ": num_queries must be >= 0, got " << num_queries;
  OPB_CHECK(num_queries <= num_seqs, ValueError)
      << op << ": num_queries (" << num_queries << ") must be <= num_seqs (" << num_seqs << ")";
  OPB_CHECK(block_size > 0, ValueError) << op << ": block_size must be > 0, got " << block_size;
}

// The width of the token ids, positions and slots: int64 (vLLM's) or int32 (JAX's without x64), one
// for all four tensors. A block id b is valid when every slot b * block_size + [0, block_size) fits it.
inline bool wide_ids(const TensorView& input_tokens) { return input_tokens.dtype() == kInt64; }
inline int64_t max_block_id(int64_t block_size, bool wide) {
  return (wide ? INT64_MAX : int64_t(INT32_MAX)) / block_size - 1;
}
inline const char* ids_name(bool wide) { return wide ? "int64" : "int32"; }

// dtypes, shapes, contiguity and disjointness; returns block_tables' width (max_blocks).
inline int64_t check_tensors(const char* op, int64_t num_seqs, int64_t num_queries, const TensorView& input_tokens,
                             const TensorView& sampled_token_ids, const TensorView& input_positions,
                             const TensorView& seq_lens, const TensorView& slot_mapping,
                             const TensorView& block_tables) {
  OPB_CHECK_DTYPE(op, input_tokens, opbridge::kInt64, opbridge::kInt32);  // as wide_ids reads it
  OPB_CHECK_SAME_DTYPE(op, sampled_token_ids, input_tokens);
  OPB_CHECK_SAME_DTYPE(op, input_positions, input_tokens);
  OPB_CHECK_DTYPE(op, seq_lens, opbridge::kInt32);
  OPB_CHECK_SAME_DTYPE(op, slot_mapping, input_tokens);
  OPB_CHECK_DTYPE(op, block_tables, opbridge::kInt32);

  OPB_CHECK_NDIM(op, input_tokens, 1);
  OPB_CHECK_SIZE(op, input_tokens, 0, num_seqs, "num_seqs");
  OPB_CHECK(sampled_token_ids.ndim() == 1 || sampled_token_ids.ndim() == 2, ValueError)
      << op << ": sampled_token_ids must have shape (num_queries, 1) or (num_queries,), got "
      << opbridge::shape_str(sampled_token_ids);
  OPB_CHECK_SIZE(op, sampled_token_ids, 0, num_queries, "num_queries");
  if (sampled_token_ids.ndim() == 2) {
    OPB_CHECK_SIZE(op, sampled_token_ids, 1, 1, "one sampled token per query");
  }
  OPB_CHECK_NDIM(op, input_positions, 1);
  OPB_CHECK_SIZE(op, input_positions, 0, num_seqs, "num_seqs");
  OPB_CHECK_NDIM(op, seq_lens, 1);
  OPB_CHECK_SIZE(op, seq_lens, 0, num_seqs, "num_seqs");
  OPB_CHECK_NDIM(op, slot_mapping, 1);
  OPB_CHECK_SIZE(op, slot_mapping, 0, num_seqs, "num_seqs");
  OPB_CHECK_NDIM(op, block_tables, 2);
  OPB_CHECK_SIZE(op, block_tables, 0, num_seqs, "num_seqs");
  const int64_t max_blocks = block_tables.size(1);

  OPB_CHECK_CONTIGUOUS(op, input_tokens);
  OPB_CHECK_CONTIGUOUS(op, sampled_token_ids);
  OPB_CHECK_CONTIGUOUS(op, input_positions);
  OPB_CHECK_CONTIGUOUS(op, seq_lens);
  OPB_CHECK_CONTIGUOUS(op, slot_mapping);
  OPB_CHECK_CONTIGUOUS(op, block_tables);

  const char* names[] = {"input_tokens", "sampled_token_ids", "input_positions",
                         "seq_lens",     "slot_mapping",      "block_tables"};
  const TensorView* all[] = {&input_tokens, &sampled_token_ids, &input_positions,
                             &seq_lens,     &slot_mapping,      &block_tables};
  // The write loop re-reads seq_lens and block_tables after validation: a mutated
  // tensor overlapping another argument could invalidate what was checked.
  for (int m : {0, 2, 3, 4}) {  // the mutated ones against every other
    for (int o = 0; o < 6; ++o) {
      if (o != m) opbridge::check_disjoint(op, names[m], *all[m], names[o], *all[o], true, true);  // all dense
    }
  }
  return max_blocks;
}

// Scalars, devices, then check_tensors, for the op kOp; returns block_tables' width (max_blocks).
inline int64_t check_args(int device, int64_t num_seqs, int64_t num_queries, int64_t block_size,
                          const TensorView& input_tokens, const TensorView& sampled_token_ids,
                          const TensorView& input_positions, const TensorView& seq_lens,
                          const TensorView& slot_mapping, const TensorView& block_tables) {
  const char* op = kOp;
  check_scalars(op, num_seqs, num_queries, block_size);
  OPB_CHECK_DEVICE(op, input_tokens, device);
  OPB_CHECK_DEVICE_LIKE(op, device, sampled_token_ids, input_tokens);
  OPB_CHECK_DEVICE_LIKE(op, device, input_positions, input_tokens);
  OPB_CHECK_DEVICE_LIKE(op, device, seq_lens, input_tokens);
  OPB_CHECK_DEVICE_LIKE(op, device, slot_mapping, input_tokens);
  OPB_CHECK_DEVICE_LIKE(op, device, block_tables, input_tokens);
  return check_tensors(op, num_seqs, num_queries, input_tokens, sampled_token_ids, input_positions, seq_lens,
                       slot_mapping, block_tables);
}

}  // namespace advance_step
}  // namespace opbridge

// The kernel's signature, written once for its CPU and CUDA forms (the schema's
// arguments in schema order; every tensor is mutated or read in place):
//   OPB_ADVANCE_STEP_KERNEL(advance_step_flashattn_cpu) { ... }
#define OPB_ADVANCE_STEP_KERNEL(name)                                                                     \
  void name(int64_t num_seqs, int64_t num_queries, int64_t block_size, ::opbridge::TensorView input_tokens, \
            ::opbridge::TensorView sampled_token_ids, ::opbridge::TensorView input_positions,              \
            ::opbridge::TensorView seq_lens, ::opbridge::TensorView slot_mapping,                           \
            ::opbridge::TensorView block_tables)
