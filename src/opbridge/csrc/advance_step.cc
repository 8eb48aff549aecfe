// advance_step_flashattn (vLLM's multi-step runner; argument order of vLLM-MindSpore's
// adv_step_flash): advance num_queries decoding sequences by one token, in place.
//
//   for i < num_queries:
//     input_tokens[i]    = sampled_token_ids[i][0]
//     seq_lens[i]       += 1
//     input_positions[i] = pos = seq_lens[i] - 1          (the old seq_lens[i])
//     slot_mapping[i]    = block_tables[i][pos / block_size] * block_size + pos % block_size
//   for num_queries <= i < num_seqs (CUDA-graph padding):
//     input_tokens[i] = 0, input_positions[i] = 0, slot_mapping[i] = -1; seq_lens[i] untouched
//
// dtypes / shapes: input_tokens, input_positions, slot_mapping int64 (num_seqs,);
// sampled_token_ids int64 (num_queries, 1) (or flat (num_queries,)); seq_lens int32 (num_seqs,);
// those four int64 as vLLM's, or all four int32 (JAX's without x64; slots must then fit int32);
// block_tables int32 (num_seqs, max_blocks). All contiguous, on CPU, pairwise disjoint.
//
// Validated before anything is written, for every i < num_queries:
//   sampled_token_ids[i] >= 0 (a token id),
//   0 <= seq_lens[i] < INT32_MAX (the increment must not overflow int32),
//   seq_lens[i] / block_size < max_blocks (the block index must lie within the table's width),
//   block id b = block_tables[i][seq_lens[i] / block_size] with 0 <= b and
//     (b + 1) * block_size <= INT64_MAX (every slot of the block is a representable int64; INT32_MAX
//     for int32 slots).
// What cannot be checked here: that b is below the KV cache's number of blocks (the cache is
// not an argument), i.e. that slot_mapping[i] indexes the cache. The block manager that filled
// block_tables guarantees it in vLLM; a kernel consuming slot_mapping must bound it itself.
#include <opbridge/math.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/advance_step.h>

#include <cstdint>
#include <limits>

namespace {

using opbridge::TensorView;
using opbridge::advance_step::kOp;

// Sequences [lo, hi): the validated update (see the file comment), with token ids, positions and
// slots of type I.
template <typename I>
void advance_rows(int64_t lo, int64_t hi, int64_t num_queries, int64_t block_size, int64_t max_blocks,
                  I* tokens, const I* sampled, I* positions, int32_t* seq_lens, I* slots, const int32_t* tables) {
  for (int64_t i = lo; i < hi; ++i) {
    if (i < num_queries) {
      const int64_t pos = seq_lens[i];
      tokens[i] = sampled[i];
      seq_lens[i] = int32_t(pos + 1);
      positions[i] = I(pos);
      const int64_t block = tables[i * max_blocks + pos / block_size];
      slots[i] = I(block * block_size + pos % block_size);
    } else {
      tokens[i] = 0;
      positions[i] = 0;
      slots[i] = -1;
    }
  }
}

template <typename I>
void advance(int64_t num_seqs, int64_t num_queries, int64_t block_size, int64_t max_blocks, TensorView input_tokens,
             TensorView sampled_token_ids, TensorView input_positions, TensorView seq_lens, TensorView slot_mapping,
             TensorView block_tables) {
  I* tokens = opbridge::data_ptr<I>(input_tokens);
  const I* sampled = opbridge::data_ptr<const I>(sampled_token_ids);
  I* positions = opbridge::data_ptr<I>(input_positions);
  int32_t* lens = opbridge::data_ptr<int32_t>(seq_lens);
  I* slots = opbridge::data_ptr<I>(slot_mapping);
  const int32_t* tables = opbridge::data_ptr<const int32_t>(block_tables);

  // Validate every query before writing anything (first failure wins, in index order).
  constexpr bool wide = sizeof(I) == 8;
  const int64_t max_block_id = opbridge::advance_step::max_block_id(block_size, wide);
  for (int64_t i = 0; i < num_queries; ++i) {
    OPB_CHECK(sampled[i] >= 0, ValueError)
        << kOp << ": sampled_token_ids must be >= 0 (token ids), got sampled_token_ids[" << i << "] = "
        << int64_t(sampled[i]);
    const int64_t len = lens[i];
    OPB_CHECK(len >= 0, ValueError) << kOp << ": seq_lens must be >= 0, got seq_lens[" << i << "] = " << len;
    OPB_CHECK(len < std::numeric_limits<int32_t>::max(), ValueError)
        << kOp << ": seq_lens[" << i << "] = " << len << " cannot be incremented without overflowing int32";
    const int64_t b = len / block_size;
    OPB_CHECK(b < max_blocks, ValueError)
        << kOp << ": block index beyond the table's width: sequence " << i << " at position " << len
        << " needs block_tables[" << i << "][" << b << "] (block_size " << block_size
        << "), but block_tables has " << max_blocks << " column(s)";
    const int64_t id = tables[i * max_blocks + b];
    OPB_CHECK(id >= 0 && id <= max_block_id, ValueError)
        << kOp << ": block_tables[" << i << "][" << b << "] = " << id << " is not a valid block id (must be in [0, "
        << max_block_id << "] so that its slots id * block_size + [0, block_size) fit in "
        << opbridge::advance_step::ids_name(wide) << ")";
  }

  opbridge::parallel_for(num_seqs, 1, [&](int64_t lo, int64_t hi) {
    advance_rows<I>(lo, hi, num_queries, block_size, max_blocks, tokens, sampled, positions, lens, slots, tables);
  });
}

}  // namespace

OPB_ADVANCE_STEP_KERNEL(advance_step_flashattn_cpu) {
  const int64_t max_blocks = opbridge::advance_step::check_args(
      kDLCPU, num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
      block_tables);
  auto run = opbridge::advance_step::wide_ids(input_tokens) ? advance<int64_t> : advance<int32_t>;
  run(num_seqs, num_queries, block_size, max_blocks, input_tokens, sampled_token_ids, input_positions, seq_lens,
      slot_mapping, block_tables);
}
OPBRIDGE_EXPORT(advance_step_flashattn_cpu);
