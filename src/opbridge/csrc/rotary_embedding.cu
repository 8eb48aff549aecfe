// rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size,
//                  Tensor cos_sin_cache, bool is_neox) -> ()
// on CUDA, with rotary_embedding.cc's (vLLM's) semantics and checks: rotates the
// first rot_dim elements of every head of query (and key) in place by the
// angles of each token's position.
//   positions       int64, (num_tokens,) or (batch, seq)
//   query / key     (*positions.shape, heads * head_size) or (*positions.shape, heads, head_size)
//   cos_sin_cache   (max_position, rot_dim): row p = [cos | sin], query's dtype
//   is_neox         pairs (i, i + rot_dim/2) (GPT-NeoX) or (2i, 2i + 1) (GPT-J)
// All contiguous; math in float32, each result rounded once.
//
// Positions index the cache, and they live on the device: checking them on
// the host would cost a device sync per call. A position outside
// [0, max_position) instead leaves its token unchanged (no out-of-bounds
// read) and is reported through the device-side error flag (opbridge/cuda.h):
// ValueError from the next call, or from this one with OPBRIDGE_CUDA_SYNC_CHECKS=1.
#include <opbridge/cuda.h>

#include <string>

namespace {

using opbridge::Optional;
using opbridge::TensorView;
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
    const float c = cu::to_float(cos[j]), s = cu::to_float(sin[j]);
    const float a = cu::to_float(head[xi]), b = cu::to_float(head[yi]);
    head[xi] = cu::from_float<T>(a * c - b * s);
    head[yi] = cu::from_float<T>(b * c + a * s);
  }
}

// One block per token (grid-stride over tokens).
template <bool kNeox, typename T>
__global__ void __launch_bounds__(kMaxThreads)
    rotary_embedding_kernel(const int64_t* __restrict__ positions, T* __restrict__ query,
                            T* __restrict__ key, const T* __restrict__ cache, int64_t num_tokens,
                            int64_t max_position, int num_heads, int num_kv_heads, int head_size,
                            int half, cu::ErrorSink err) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_position) {
      if (threadIdx.x == 0) cu::report_error(err, kPositionOutOfRange, t, pos, max_position);
      continue;
    }
    const T* cos = cache + pos * 2 * half;
    const T* sin = cos + half;
    rotate<kNeox>(query + t * num_heads * head_size, num_heads, head_size, cos, sin, half);
    if (key != nullptr) rotate<kNeox>(key + t * num_kv_heads * head_size, num_kv_heads, head_size, cos, sin, half);
  }
}

// query / key layout against positions; returns the number of heads (as rotary_embedding.cc).
int64_t check_heads(const char* op, const char* arg, const TensorView& t, const TensorView& positions,
                    int64_t head_size) {
  const int pn = positions.ndim();
  bool lead = t.ndim() == pn + 1 || t.ndim() == pn + 2;
  for (int i = 0; lead && i < pn; ++i) lead = t.size(i) == positions.size(i);
  OPB_CHECK(lead, ValueError) << op << ": " << arg << " must have shape (*positions.shape, num_heads * "
                              << "head_size) or (*positions.shape, num_heads, head_size) with positions.shape = "
                              << opbridge::shape_str(positions) << ", got " << opbridge::shape_str(t);
  const int64_t last = t.size(t.ndim() - 1);
  int64_t heads;
  if (t.ndim() == pn + 1) {
    OPB_CHECK(last % head_size == 0, ValueError)
        << op << ": " << arg << "'s last dim (" << last << ") must be a multiple of head_size (" << head_size
        << "), got shape " << opbridge::shape_str(t);
    heads = last / head_size;
  } else {
    OPB_CHECK(last == head_size, ValueError)
        << op << ": " << arg << "'s last dim must be head_size (" << head_size << ") in the (..., num_heads, "
        << "head_size) layout, got shape " << opbridge::shape_str(t);
    heads = t.size(t.ndim() - 2);
  }
  OPB_CHECK(heads >= 1, ValueError) << op << ": " << arg << " must hold at least one head, got shape "
                                    << opbridge::shape_str(t);
  // heads * head_size is one token's row; the kernel indexes within it in int.
  OPB_CHECK(heads * head_size <= INT32_MAX, ValueError)
      << op << ": " << arg << " has " << heads * head_size << " elements per token; at most 2^31 - 1 are supported";
  return heads;
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
  const char* op = "rotary_embedding";
  OPB_CHECK_DEVICE(op, positions, kDLCUDA);
  OPB_CHECK_SAME_DEVICE(op, query, positions);
  OPB_CHECK_SAME_DEVICE(op, cos_sin_cache, positions);
  OPB_CHECK_DTYPE(op, positions, opbridge::kInt64);
  OPB_CHECK_FLOATING(op, query);
  OPB_CHECK_SAME_DTYPE(op, cos_sin_cache, query);
  OPB_CHECK(positions.ndim() == 1 || positions.ndim() == 2, ValueError)
      << op << ": positions must have shape (num_tokens,) or (batch, seq), got " << opbridge::shape_str(positions);
  OPB_CHECK(head_size > 0, ValueError) << op << ": head_size must be > 0, got " << head_size;
  const int64_t num_heads = check_heads(op, "query", query, positions, head_size);
  OPB_CHECK_NDIM(op, cos_sin_cache, 2);
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t rot_dim = cos_sin_cache.size(1);
  OPB_CHECK(rot_dim % 2 == 0 && rot_dim >= 2 && rot_dim <= head_size, ValueError)
      << op << ": cos_sin_cache's last dim (rot_dim = [cos | sin] halves) must be even and in [2, head_size = "
      << head_size << "], got shape " << opbridge::shape_str(cos_sin_cache);
  OPB_CHECK_CONTIGUOUS(op, positions);
  OPB_CHECK_CONTIGUOUS(op, query);
  OPB_CHECK_CONTIGUOUS(op, cos_sin_cache);
  int64_t num_kv_heads = 0;
  if (key.has_value()) {
    const TensorView& k = key.value();
    ::opbridge::check_same_device(op, "key", k, "positions", positions);
    ::opbridge::check_same_dtype(op, "key", k, "query", query);
    num_kv_heads = check_heads(op, "key", k, positions, head_size);
    OPB_CHECK(num_heads % num_kv_heads == 0, ValueError)
        << op << ": query's number of heads (" << num_heads << ") must be a multiple of key's (" << num_kv_heads
        << ")";
    ::opbridge::check_contiguous(op, "key", k);
    opbridge::check_disjoint(op, "key", k, "query", query);
    opbridge::check_disjoint(op, "key", k, "positions", positions);
    opbridge::check_disjoint(op, "key", k, "cos_sin_cache", cos_sin_cache);
  }
  opbridge::check_disjoint(op, "query", query, "positions", positions);
  opbridge::check_disjoint(op, "query", query, "cos_sin_cache", cos_sin_cache);

  cu::raise_recorded(op, error_flag(), /*earlier=*/true, describe);
  const int64_t num_tokens = positions.numel();
  if (num_tokens == 0) return;

  cu::Context ctx(op, positions);
  const cu::ErrorSink sink = error_flag().sink(op, ctx.device(), &g_claim);
  const int half = static_cast<int>(rot_dim / 2);
  const int threads = cu::row_threads(std::max(num_heads, num_kv_heads) * half, kMaxThreads);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_tokens, INT32_MAX));
  OPB_DISPATCH_FLOATING(op, query.dtype(), S, [&] {
    using T = cu::device_t<S>;
    const int64_t* pos = opbridge::data_ptr<const int64_t>(positions);
    T* q = opbridge::data_ptr<T>(query);
    T* k = key.has_value() ? opbridge::data_ptr<T>(key.value()) : nullptr;
    const T* cache = opbridge::data_ptr<const T>(cos_sin_cache);
    const int nh = int(num_heads), nkh = int(num_kv_heads), hs = int(head_size);
    if (is_neox) {
      rotary_embedding_kernel<true><<<grid, threads, 0, ctx.stream>>>(pos, q, k, cache, num_tokens, max_position,
                                                                     nh, nkh, hs, half, sink);
    } else {
      rotary_embedding_kernel<false><<<grid, threads, 0, ctx.stream>>>(pos, q, k, cache, num_tokens,
                                                                      max_position, nh, nkh, hs, half, sink);
    }
    ctx.check_launch();
  });
  if (cu::sync_checks()) {
    OPB_CUDA_CHECK(op, cudaStreamSynchronize(ctx.stream));
    cu::raise_recorded(op, error_flag(), /*earlier=*/false, describe);
  }
}
OPBRIDGE_EXPORT(rotary_embedding_cuda);
