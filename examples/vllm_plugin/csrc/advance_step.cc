// advance_step_flashattn: the per-step bookkeeping of a multi-step decode
// runner (vLLM's advance_step_flashattn, on the CPU). For each of the first
// num_queries sequences i, with pos = seq_lens[i] (the new token's position):
//   input_tokens[i]    = sampled_token_ids[i, 0]
//   seq_lens[i]        = pos + 1
//   input_positions[i] = pos
//   slot_mapping[i]    = block_tables[i, pos / block_size] * block_size + pos % block_size
//
// vLLM's kernel checks dtypes and sizes but not the block index against the
// block table's width, nor the block ids; out-of-range values there are a
// recurring source of illegal memory accesses. Here every index is checked
// before anything is written, so a rejected call leaves all tensors as they were.
#include <opbridge/opbridge.h>

#include <cstdint>

namespace {

using opbridge::TensorView;

void check_vector(const char* op, const char* name, const TensorView& t, DLDataType dtype,
                  int64_t size, const char* why) {
  ::opbridge::check_device(op, name, t, kDLCPU);
  ::opbridge::check_dtype(op, name, t, {dtype});
  ::opbridge::check_ndim(op, name, t, 1);
  ::opbridge::check_size(op, name, t, 0, size, why);
  ::opbridge::check_contiguous(op, name, t);
}

}  // namespace

void advance_step_flashattn_cpu(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                                TensorView input_tokens, TensorView sampled_token_ids,
                                TensorView input_positions, TensorView seq_lens,
                                TensorView slot_mapping, TensorView block_tables) {
  const char* op = "advance_step_flashattn";
  OPB_CHECK(num_seqs >= 0, ValueError) << op << ": num_seqs must be >= 0, got " << num_seqs;
  OPB_CHECK(num_queries >= 0 && num_queries <= num_seqs, ValueError)
      << op << ": num_queries must be in [0, num_seqs=" << num_seqs << "], got " << num_queries;
  OPB_CHECK(block_size > 0, ValueError) << op << ": block_size must be > 0, got " << block_size;
  check_vector(op, "input_tokens", input_tokens, opbridge::kInt64, num_seqs, "num_seqs");
  check_vector(op, "input_positions", input_positions, opbridge::kInt64, num_seqs, "num_seqs");
  check_vector(op, "seq_lens", seq_lens, opbridge::kInt32, num_seqs, "num_seqs");
  check_vector(op, "slot_mapping", slot_mapping, opbridge::kInt64, num_seqs, "num_seqs");
  OPB_CHECK_DEVICE(op, sampled_token_ids, kDLCPU);
  OPB_CHECK_DTYPE(op, sampled_token_ids, opbridge::kInt64);
  OPB_CHECK_NDIM(op, sampled_token_ids, 2);
  OPB_CHECK_SIZE(op, sampled_token_ids, 0, num_queries, "num_queries");
  OPB_CHECK_SIZE(op, sampled_token_ids, 1, 1, "one sampled token per query");
  OPB_CHECK_CONTIGUOUS(op, sampled_token_ids);
  OPB_CHECK_DEVICE(op, block_tables, kDLCPU);
  OPB_CHECK_DTYPE(op, block_tables, opbridge::kInt32);
  OPB_CHECK_NDIM(op, block_tables, 2);
  OPB_CHECK_SIZE(op, block_tables, 0, num_seqs, "num_seqs");
  OPB_CHECK_CONTIGUOUS(op, block_tables);

  int64_t* tokens = opbridge::data_ptr<int64_t>(input_tokens);
  const int64_t* sampled = opbridge::data_ptr<const int64_t>(sampled_token_ids);
  int64_t* positions = opbridge::data_ptr<int64_t>(input_positions);
  int32_t* lens = opbridge::data_ptr<int32_t>(seq_lens);
  int64_t* slots = opbridge::data_ptr<int64_t>(slot_mapping);
  const int32_t* table = opbridge::data_ptr<const int32_t>(block_tables);
  const int64_t width = block_tables.size(1);

  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t pos = lens[i];
    OPB_CHECK(pos >= 0, ValueError) << op << ": seq_lens[" << i << "] must be >= 0, got " << pos;
    const int64_t block = pos / block_size;
    OPB_CHECK(block < width, ValueError)
        << op << ": sequence " << i << " needs block " << block << " (position " << pos
        << ", block_size " << block_size << "), but block_tables has " << width
        << " blocks per sequence";
    OPB_CHECK(table[i * width + block] >= 0, ValueError)
        << op << ": block_tables[" << i << ", " << block << "] must be a block id >= 0, got "
        << table[i * width + block];
  }
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t pos = lens[i];
    tokens[i] = sampled[i];
    lens[i] = int32_t(pos + 1);
    positions[i] = pos;
    slots[i] = int64_t(table[i * width + pos / block_size]) * block_size + pos % block_size;
  }
}
OPBRIDGE_EXPORT(advance_step_flashattn_cpu);
