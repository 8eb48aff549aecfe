// advance_step_flashattn(int num_seqs, int num_queries, int block_size,
//     Tensor(a!) input_tokens, Tensor sampled_token_ids, Tensor(b!) input_positions,
//     Tensor(c!) seq_lens, Tensor(d!) slot_mapping, Tensor block_tables) -> ()
// on CUDA, with advance_step.cc's (vLLM's) semantics and checks:
//   for i < num_queries:
//     input_tokens[i]    = sampled_token_ids[i][0]
//     seq_lens[i]       += 1
//     input_positions[i] = pos = seq_lens[i] - 1          (the old seq_lens[i])
//     slot_mapping[i]    = block_tables[i][pos / block_size] * block_size + pos % block_size
//   for num_queries <= i < num_seqs (CUDA-graph padding):
//     input_tokens[i] = 0, input_positions[i] = 0, slot_mapping[i] = -1; seq_lens[i] untouched
// dtypes / shapes as advance_step.cc: int64 (num_seqs,), or int32 for all four of input_tokens,
// sampled_token_ids, input_positions and slot_mapping, except seq_lens (int32) and
// block_tables (int32, (num_seqs, max_blocks)); sampled_token_ids (num_queries, 1) or
// (num_queries,); all contiguous, the mutated ones disjoint from every other.
//
// Sizes, dtypes, counts and overlaps are checked on the host. The per-query
// values (a token id >= 0, 0 <= seq_lens[i] < INT32_MAX, the block index
// within the table's width, a block id b with 0 <= b and (b + 1) * block_size
// <= INT64_MAX, or INT32_MAX for int32 slots) live on the device; checking them on the host would cost a
// device sync per decoding step, and vLLM's own kernel checks none of them
// (an out-of-range position reads past block_tables: vllm#10432, #14404).
// Here an offending query is left unchanged except slot_mapping[i] = -1 (the
// padding slot, which KV-cache writes skip), nothing is accessed out of
// bounds, and the first offender is reported through the device-side error
// flag (opbridge/cuda.h): ValueError from the next call, or from this one with
// OPBRIDGE_CUDA_SYNC_CHECKS=1. Unlike the CPU kernel, the valid queries of a
// failing call are still advanced. That b is below the KV cache's block count
// cannot be checked (the cache is not an argument).
#include <opbridge/cuda.h>
#include <opbridge/cuda_error_flag.h>
#include <opbridge/ops/advance_step.h>

#include <limits>
#include <string>

namespace {

using opbridge::TensorView;
using opbridge::advance_step::kOp;
namespace cu = opbridge::cuda;

enum : int {
  kNegativeToken = 1,
  kNegativeSeqLen,
  kSeqLenOverflow,
  kBeyondBlockTable,
  kInvalidBlockId,       // int64 slots
  kInvalidBlockId32,     // int32 slots
};

constexpr int kThreads = 256;

__device__ unsigned long long g_claim;  // this family's error claim word, per device

// I: the type of the token ids, positions and slots (int64_t, or int32_t for all four).
template <typename I>
__global__ void __launch_bounds__(kThreads)
    advance_step_flashattn_kernel(int64_t num_seqs, int64_t num_queries, int64_t block_size,
                                  int64_t max_block_id, I* __restrict__ input_tokens,
                                  const I* __restrict__ sampled_token_ids,
                                  I* __restrict__ input_positions, int32_t* __restrict__ seq_lens,
                                  I* __restrict__ slot_mapping,
                                  const int32_t* __restrict__ block_tables, int64_t max_blocks,
                                  cu::ErrorSink err) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_seqs) return;
  if (i >= num_queries) {
    input_tokens[i] = 0;
    input_positions[i] = 0;
    slot_mapping[i] = -1;
    return;
  }
  const int64_t token = sampled_token_ids[i];
  const int64_t pos = seq_lens[i];
  const int64_t b = pos / block_size;
  // The checks of advance_step.cc, in its order.
  int code = 0;
  int64_t value = 0, bound = 0;
  if (token < 0) {
    code = kNegativeToken, value = token;
  } else if (pos < 0) {
    code = kNegativeSeqLen, value = pos;
  } else if (pos >= std::numeric_limits<int32_t>::max()) {
    code = kSeqLenOverflow, value = pos;
  } else if (b >= max_blocks) {
    code = kBeyondBlockTable, value = pos, bound = max_blocks;
  } else {
    const int64_t id = block_tables[i * max_blocks + b];
    if (id < 0 || id > max_block_id) {
      code = sizeof(I) == 8 ? kInvalidBlockId : kInvalidBlockId32, value = id, bound = b;
    } else {
      input_tokens[i] = I(token);
      seq_lens[i] = static_cast<int32_t>(pos + 1);
      input_positions[i] = I(pos);
      slot_mapping[i] = I(id * block_size + pos % block_size);
      return;
    }
  }
  slot_mapping[i] = -1;
  cu::report_error(err, code, i, value, bound, /*extra=*/block_size);
}

cu::ErrorFlag& error_flag() {
  static cu::ErrorFlag flag;
  return flag;
}

}  // namespace

OPB_ADVANCE_STEP_KERNEL(advance_step_flashattn_cuda) {
  const int64_t max_blocks = opbridge::advance_step::check_args(
      kDLCUDA, num_seqs, num_queries, block_size, input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
      block_tables);

  const bool wide = opbridge::advance_step::wide_ids(input_tokens);
  const int64_t max_block_id = opbridge::advance_step::max_block_id(block_size, wide);
  // The messages of advance_step.cc, for a record the kernel made, from the record alone (an earlier
  // call's may have had another block size or slot width): extra is that call's block size.
  auto describe = [](const cu::ErrorRecord& r) {
    std::ostringstream os;
    const long long i = r.index, bs = r.extra;
    const bool slots64 = r.code != kInvalidBlockId32;
    switch (r.code) {
      case kNegativeToken:
        os << "sampled_token_ids must be >= 0 (token ids), got sampled_token_ids[" << i << "] = " << r.value;
        break;
      case kNegativeSeqLen:
        os << "seq_lens must be >= 0, got seq_lens[" << i << "] = " << r.value;
        break;
      case kSeqLenOverflow:
        os << "seq_lens[" << i << "] = " << r.value << " cannot be incremented without overflowing int32";
        break;
      case kBeyondBlockTable:
        os << "block index beyond the table's width: sequence " << i << " at position " << r.value
           << " needs block_tables[" << i << "][" << r.value / bs << "] (block_size " << bs
           << "), but block_tables has " << r.bound << " column(s)";
        break;
      default:
        os << "block_tables[" << i << "][" << r.bound << "] = " << r.value
           << " is not a valid block id (must be in [0, " << opbridge::advance_step::max_block_id(bs, slots64)
           << "] so that its slots id * block_size + [0, block_size) fit in "
           << opbridge::advance_step::ids_name(slots64) << ")";
        break;
    }
    os << "; that query was left unchanged and its slot_mapping entry set to -1 (padding)";
    return os.str();
  };
  cu::raise_recorded(kOp, error_flag(), /*earlier=*/true, describe);
  const bool sync = cu::sync_checks();
  if (num_seqs == 0) return;

  cu::Context ctx(kOp, input_tokens);
  const cu::ErrorSink sink = error_flag().sink(kOp, ctx.device(), &g_claim);
  const int64_t blocks = (num_seqs + kThreads - 1) / kThreads;
  OPB_CHECK(blocks <= INT32_MAX, ValueError) << kOp << ": num_seqs = " << num_seqs << " is too large";
  auto launch = [&](auto ids) {
    using I = decltype(ids);
    advance_step_flashattn_kernel<I><<<unsigned(blocks), kThreads, 0, ctx.stream>>>(
        num_seqs, num_queries, block_size, max_block_id, opbridge::data_ptr<I>(input_tokens),
        opbridge::data_ptr<const I>(sampled_token_ids), opbridge::data_ptr<I>(input_positions),
        opbridge::data_ptr<int32_t>(seq_lens), opbridge::data_ptr<I>(slot_mapping),
        opbridge::data_ptr<const int32_t>(block_tables), max_blocks, sink);
  };
  if (wide) {
    launch(int64_t{});
  } else {
    launch(int32_t{});
  }
  ctx.check_launch();
  cu::raise_now_if_asked(kOp, error_flag(), ctx.stream, sync, describe);
}
OPBRIDGE_EXPORT(advance_step_flashattn_cuda);
