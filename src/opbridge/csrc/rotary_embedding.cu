// rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size,
//                  Tensor cos_sin_cache, bool is_neox) -> ()
// on CUDA, with rotary_embedding.cc's (vLLM's) semantics and checks: rotates the
// first rot_dim elements of every head of query (and key) in place by the
// angles of each token's position.
//   positions       int64 or int32, (num_tokens,) or (batch, seq)
//   query / key     (*positions.shape, heads * head_size) or (*positions.shape, heads, head_size)
//   cos_sin_cache   (max_position, rot_dim): row p = [cos | sin], query's dtype
//   is_neox         pairs (i, i + rot_dim/2) (GPT-NeoX) or (2i, 2i + 1) (GPT-J)
// positions and the cache contiguous; query and key may be rows at a stride (column
// slices of one qkv tensor: opbridge/checks.h's StridedRows); math in
// float32 (float64 in double), each result rounded once.
//
// Positions index the cache, and they live on the device: checking them on
// the host would cost a device sync per call. A position outside
// [0, max_position) instead leaves its token unchanged (no out-of-bounds
// read) and is reported through the device-side error flag (opbridge/cuda.h):
// ValueError from the next call, or from this one with OPBRIDGE_CUDA_SYNC_CHECKS=1.
#include <opbridge/cuda.h>
#include <opbridge/cuda_error_flag.h>
#include <opbridge/ops/rotary_embedding.h>

#include <string>

namespace {

using opbridge::Optional;
using opbridge::TensorView;
using opbridge::rotary_embedding::kOp;
using opbridge::StridedRows;
using opbridge::rotary_embedding::Positions;
namespace cu = opbridge::cuda;

constexpr int kPositionOutOfRange = 1;
constexpr int kMaxThreads = 512;

__device__ unsigned long long g_claim;  // this family's error claim word, per device

// Threads stride over (head, pair) of one token's heads.
template <bool kNeox, typename T>
__device__ __forceinline__ void rotate(T* x, int heads, int head_size, const T* cos, const T* sin,
                                       int half) {
  const int n = heads * half;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / half, j = i - h * half;
    T* head = x + int64_t(h) * head_size;
    const int xi = kNeox ? j : 2 * j;
    const int yi = kNeox ? j + half : 2 * j + 1;
    const auto c = cu::to_compute(cos[j]), s = cu::to_compute(sin[j]);
    const auto a = cu::to_compute(head[xi]), b = cu::to_compute(head[yi]);
    head[xi] = cu::from_compute<T>(a * c - b * s);
    head[yi] = cu::from_compute<T>(b * c + a * s);
  }
}

// One block per token (grid-stride over tokens).
template <bool kNeox, typename T>
__global__ void __launch_bounds__(kMaxThreads)
    rotary_embedding_kernel(Positions positions, T* __restrict__ query,
                            T* __restrict__ key, const T* __restrict__ cache, int64_t num_tokens,
                            int64_t max_position, int num_heads, int num_kv_heads, int head_size,
                            int half, StridedRows q_rows, StridedRows k_rows, cu::ErrorSink err) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_position) {
      if (threadIdx.x == 0) cu::report_error(err, kPositionOutOfRange, t, pos, max_position);
      continue;
    }
    const T* cos = cache + pos * 2 * half;
    const T* sin = cos + half;
    rotate<kNeox>(query + q_rows.offset(t), num_heads, head_size, cos, sin, half);
    if (key != nullptr) rotate<kNeox>(key + k_rows.offset(t), num_kv_heads, head_size, cos, sin, half);
  }
}

cu::ErrorFlag& error_flag() {
  static cu::ErrorFlag flag;
  return flag;
}

std::string describe(const cu::ErrorRecord& r) {
  std::ostringstream os;
  os << "positions must be in [0, max_position) with max_position = " << r.bound
     << " (cos_sin_cache's first dim), got " << r.value << " at flat index " << r.index
     << " of positions; that token's query and key were left unchanged";
  return os.str();
}

}  // namespace

void rotary_embedding_cuda(TensorView positions, TensorView query, Optional<TensorView> key,
                           int64_t head_size, TensorView cos_sin_cache, bool is_neox) {
  const opbridge::rotary_embedding::Dims dims =
      opbridge::rotary_embedding::check_args(kDLCUDA, positions, query, key, head_size, cos_sin_cache, true);
  const int64_t num_heads = dims.num_heads, num_kv_heads = dims.num_kv_heads, rot_dim = dims.rot_dim;

  cu::raise_recorded(kOp, error_flag(), /*earlier=*/true, describe);
  const bool sync = cu::sync_checks();
  const int64_t num_tokens = positions.numel();
  if (num_tokens == 0) return;

  cu::Context ctx(kOp, positions);
  const cu::ErrorSink sink = error_flag().sink(kOp, ctx.device(), &g_claim);
  const int half = static_cast<int>(rot_dim / 2);
  const int threads = cu::row_threads(std::max(num_heads, num_kv_heads) * half, kMaxThreads);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_tokens, INT32_MAX));
  const Positions pos = opbridge::rotary_embedding::positions_of(positions);
  OPB_DISPATCH_FLOATING(kOp, query.dtype(), S, [&] {
    using T = cu::device_t<S>;
    T* q = opbridge::data_ptr<T>(query);
    T* k = key.has_value() ? opbridge::data_ptr<T>(key.value()) : nullptr;
    const T* cache = opbridge::data_ptr<const T>(cos_sin_cache);
    const int nh = int(num_heads), nkh = int(num_kv_heads), hs = int(head_size);
    const StridedRows qr = dims.q_rows, kr = dims.k_rows;
    if (is_neox) {
      rotary_embedding_kernel<true><<<grid, threads, 0, ctx.stream>>>(pos, q, k, cache, num_tokens,
                                                                     dims.max_position, nh, nkh, hs, half, qr, kr,
                                                                     sink);
    } else {
      rotary_embedding_kernel<false><<<grid, threads, 0, ctx.stream>>>(pos, q, k, cache, num_tokens,
                                                                      dims.max_position, nh, nkh, hs, half, qr, kr,
                                                                      sink);
    }
    ctx.check_launch();
  });
  cu::raise_now_if_asked(kOp, error_flag(), ctx.stream, sync, describe);
}
OPBRIDGE_EXPORT(rotary_embedding_cuda);
