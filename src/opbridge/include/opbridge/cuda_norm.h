// Row-cached RMS normalisation on CUDA, written once for rms_norm.cu and
// fused_add_rms_norm.cu: out[r] = z[r] * rsqrt(mean(z[r]^2) + eps) * w, where
// a source policy produces each row's values z (rms_norm: x itself;
// fused_add_rms_norm: input + residual, rounded, written back to residual).
//
// When a row fits in the block's registers (up to kMaxCached 128-bit units per
// thread, blocks of up to kCachedThreads) each thread loads its units of z and
// of the weight at once, before the reduction, and writes from registers: one
// DRAM round trip per row, every load of the row in flight together. The
// two-pass form (wait for the row, reduce, read the row and the weight again)
// ran rms_norm at 0.67 of copy bandwidth on an H200 at 4096 x 4096 and took
// two memory round trips per row at 1-8 rows.
#pragma once

#include <opbridge/cuda.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

constexpr int kCachedThreads = 256, kMaxCached = 8;

// Src: `__device__ Vec<T, N> load(int64_t row, int unit) const`, called once
// per (row, unit) by the thread that writes out[row] at that unit. `out` may
// be a buffer Src reads (in place): each unit is read before it is written,
// by the same thread.
template <int N, int K, typename T, typename Src, typename C = compute_t<T>>
__global__ void __launch_bounds__(kCachedThreads)
    rms_rows_cached_kernel(T* out, Src src, const T* __restrict__ w, int64_t rows, int64_t H, C eps) {
  __shared__ C scratch[32];
  const int hv = static_cast<int>(H / N);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    Vec<T, N> zv[K], wv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        wv[k] = load<N>(w + i * N);
        zv[k] = src.load(r, i);
      }
    }
    C ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + k * blockDim.x < hv) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const C f = to_compute(zv[k].v[j]);
          ss += f * f;
        }
      }
    }
    const C rs = rsqrt_of(block_sum(ss, scratch) / C(H) + eps);
    T* yr = out + r * H;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        Vec<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(to_compute(zv[k].v[j]) * rs * to_compute(wv[k].v[j]));
        store<N>(yr + i * N, o);
      }
    }
  }
}

// Launches the cached kernel over `rows` rows of H elements (N per unit) with
// the fewest units per thread (1, 2, 4 or 8) that keep blocks at
// kCachedThreads or fewer. Returns false, launching nothing, when a row is
// longer (more than 16384 16-bit or 8192 float32 elements): the caller runs
// its two-pass form.
template <int N, typename T, typename Src, typename C>
bool launch_rms_rows_cached(const Context& ctx, T* out, Src src, const T* w, int64_t rows, int64_t H, C eps) {
  const int64_t hv = H / N;
  if (hv > int64_t(kCachedThreads) * kMaxCached) return false;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX));
  const auto go = [&](auto k_const) {
    constexpr int K = decltype(k_const)::value;
    const int threads = row_threads((hv + K - 1) / K, kCachedThreads);
    rms_rows_cached_kernel<N, K><<<grid, threads, 0, ctx.stream>>>(out, src, w, rows, H, eps);
  };
  if (hv <= kCachedThreads) {
    go(std::integral_constant<int, 1>{});
  } else if (hv <= 2 * kCachedThreads) {
    go(std::integral_constant<int, 2>{});
  } else if (hv <= 4 * kCachedThreads) {
    go(std::integral_constant<int, 4>{});
  } else {
    go(std::integral_constant<int, 8>{});
  }
  return true;
}

}  // namespace cuda
}  // namespace opbridge
