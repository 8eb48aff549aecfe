// rms_norm's looped form on CUDA: each block reduces a row in a loop over its units (blockDim apart),
// then reads the row again, with the weight, to scale and write it; the second read mostly hits the
// cache. rms_norm.cu runs it for rows that do not fit a block's registers (the row-cached kernel of
// cuda_norm.h, every other row); the norm sweep (scripts/cuda_norm_sweep.cu) also times it in place of
// the cached kernel, at several block sizes and with its loads batched: the form of a looped reduction
// (one row per program, a loop of loads, the row read again from the cache), which is how Triton
// kernels such as Inductor's are written for long rows (theirs not inspected here). Inductor ran
// bfloat16 rms_norm at 8192 x 8192 at 0.96 of copy bandwidth on an H200 (2026-11-27) where the cached
// kernel ran 0.72.
#pragma once

#include <opbridge/cuda.h>

namespace opbridge {
namespace cuda {

// Unroll: 0 leaves the loops to the compiler (the form rms_norm.cu ships); U > 1 loads U units of the row
// (blockDim apart) into registers before it uses any of them, so that a thread has U loads in flight.
// MaxThreads, MinBlocks: its __launch_bounds__ (the largest block it is launched with; blocks of that
// size that must fit on an SM at once, which holds its registers to 65536 / (MaxThreads x MinBlocks);
// 0 asks nothing).
template <int N, int Unroll, typename T, int MaxThreads = 1024, int MinBlocks = 0, typename C = compute_t<T>>
__global__ void __launch_bounds__(MaxThreads, MinBlocks) rms_rows_looped_kernel(T* out, const T* __restrict__ x, StridedRows xs,
                                                               const T* __restrict__ w, int64_t rows, int64_t H,
                                                               C eps) {
  __shared__ C scratch[32];
  const int64_t hv = H / N;
  const C inv_h = inverse_of<C>(H);
  constexpr int U = Unroll > 1 ? Unroll : 1;  // units loaded at once
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + xs.offset(r);
    T* yr = out + r * H;
    C ss = 0;
    if constexpr (Unroll > 1) {
      for (int64_t i0 = threadIdx.x; i0 < hv; i0 += int64_t(U) * blockDim.x) {
        held_t<T, N> h[U];  // raw bytes until used (cuda_device.h's held_t: fewer registers)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = i0 + int64_t(u) * blockDim.x;
          if (i < hv) h[u] = hold(load<N>(xr + i * N));
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (i0 + int64_t(u) * blockDim.x < hv) {
            const Vec<T, N> v = unhold<T, N>(h[u]);
#pragma unroll
            for (int k = 0; k < N; ++k) {
              const C f = to_compute(v.v[k]);
              ss += f * f;
            }
          }
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
        const Vec<T, N> v = load<N>(xr + i * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const C f = to_compute(v.v[k]);
          ss += f * f;
        }
      }
    }
    const C rs = rsqrt_of(block_sum(ss, scratch) * inv_h + eps);
    if constexpr (Unroll > 1) {
      for (int64_t i0 = threadIdx.x; i0 < hv; i0 += int64_t(U) * blockDim.x) {
        held_t<T, N> h[U], hw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = i0 + int64_t(u) * blockDim.x;
          if (i < hv) {
            h[u] = hold(load<N>(xr + i * N));
            hw[u] = hold(load<N>(w + i * N));
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = i0 + int64_t(u) * blockDim.x;
          if (i < hv) {
            const Vec<T, N> v = unhold<T, N>(h[u]), wv = unhold<T, N>(hw[u]);
            Vec<T, N> o;
#pragma unroll
            for (int k = 0; k < N; ++k) o.v[k] = from_compute<T>(to_compute(v.v[k]) * rs * to_compute(wv.v[k]));
            store<N>(yr + i * N, o);
          }
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
        const Vec<T, N> v = load<N>(xr + i * N);
        const Vec<T, N> wv = load<N>(w + i * N);
        Vec<T, N> o;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          o.v[k] = from_compute<T>(to_compute(v.v[k]) * rs * to_compute(wv.v[k]));
        }
        store<N>(yr + i * N, o);
      }
    }
  }
}

}  // namespace cuda
}  // namespace opbridge
