// rms_norm's backward on CUDA for rows that fit in registers, written once for rms_norm.cu and the
// launch-policy sweep (scripts/cuda_norm_sweep.cu), and the column sum that turns the blocks' partial
// weight gradients into grad_weight (also the two-pass form's, in rms_norm.cu).
//   dx = r g w - x r^3 mean(g w x),  dw = sum over rows of g x r,  r = 1 / sqrt(mean(x^2) + eps)
//
// A persistent grid, one full wave (the launcher sizes it by the occupancy API); each thread loads its
// units of the weight once, keeps its columns' running sums of g x r in registers across the block's
// rows, and writes them to partial[block] once at the end (a grid of one block writes grad_weight
// itself: a decode step's one row is one kernel). The two-pass form in rms_norm.cu adds each row into
// partial in global memory (a read and a write of H floats per row, more bytes than the row itself
// for the 16-bit types: 0.20 of copy bandwidth for bfloat16 at 8192 x 8192 on an H200). Same sums in
// the same order per column.
#pragma once

#include <opbridge/cuda_norm.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

// The backward's launch policy (cuda_norm_policy.h's knobs): blocks of up to 512 threads; threads grow beyond
// 256 once a thread holds 4 units or 16 elements. 16-bit rows ask for 2 blocks of 512 per SM
// (min_blocks, at any units): held as raw bytes they fit 64 registers without spilling, where as Vecs
// the kernel took 96 (2 units of bfloat16), one block per SM, and its grid ran rms_norm_backward at
// 0.65 of copy bandwidth on an H200 at 8192 x 8192 (the form with 2 blocks: not measured on a GPU yet;
// the norm sweep times both).
template <int N>
struct RmsNormBackwardRows {
  static constexpr int kMaxThreads = 512, kPreferredThreads = 256, kMaxUnits = 16 / N < 4 ? 16 / N : 4;
  static constexpr int kPreferredUnits = kMaxUnits;
  static constexpr int min_blocks(int) { return N >= 8 ? 2 : 0; }
};

// The backward's formulas per unit, for the staged kernel (cuda_norm_staged.h); the cached kernel below
// writes them out (its comment says why).
// One unit's terms of a row's two sums: (x^2, g w x).
template <int N, typename T, typename C2>
__device__ __forceinline__ void add_row_sums(C2& sums, const Vec<T, N>& xv, const Vec<T, N>& gv,
                                             const Vec<T, N>& wv) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const auto v = to_compute(xv.v[j]);
    sums.x += v * v;
    sums.y += to_compute(gv.v[j]) * to_compute(wv.v[j]) * v;
  }
}

// A row's r and c = r^3 mean(g w x) from its block-summed (sum x^2, sum g w x).
template <typename C, typename C2>
__device__ __forceinline__ void row_scales(const C2& sums, int64_t H, C eps, C& rs, C& c) {
  rs = rsqrt_of(sums.x / C(H) + eps);  // a division: an inverse held across the rows spilled
  c = rs * rs * rs * sums.y / C(H);
}

// One unit of dx = r g w - c x, its columns' g x r added to `acc`.
template <int N, typename T, typename C>
__device__ __forceinline__ Vec<T, N> unit_grad(const Vec<T, N>& xv, const Vec<T, N>& gv, const Vec<T, N>& wv, C rs,
                                               C c, C (&acc)[N]) {
  Vec<T, N> o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const C v = to_compute(xv.v[j]);
    const C g = to_compute(gv.v[j]);
    o.v[j] = from_compute<T>(rs * g * to_compute(wv.v[j]) - c * v);
    acc[j] += g * v * rs;
  }
  return o;
}

// A block's running sums of g x r, its threads' K units of N columns each, as the weight gradient (a
// grid of one block: a decode step's one row is one kernel) or as the block's row of partial, in
// 128-bit stores: scalar ones touched 32 sectors per warp instruction for the 16-bit types (a thread's
// N floats are 32 bytes apart from its neighbour's) and took half of a one-row call.
template <int N, int K, typename T, typename C>
__device__ __forceinline__ void store_column_sums(const C (&acc)[K][N], T* grad_w, C* partial, int hv, int64_t H) {
  constexpr int PW = 16 / int(sizeof(C));  // partial's floats per 128-bit store
  static_assert(N % PW == 0, "partial store width");
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) {
      if (gridDim.x == 1) {
        Vec<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(acc[k][j]);
        store<N>(grad_w + i * N, o);
      } else {
        C* part = partial + int64_t(blockIdx.x) * H + int64_t(i) * N;
#pragma unroll
        for (int j = 0; j < N; j += PW) {
          Vec<C, PW> v;
#pragma unroll
          for (int q = 0; q < PW; ++q) v.v[q] = acc[k][j + q];
          store<PW>(part + j, v);
        }
      }
    }
  }
}

template <typename P, int N, int K, typename T, typename C = compute_t<T>>
__global__ void __launch_bounds__(P::kMaxThreads, P::min_blocks(K))
    rms_norm_backward_cached_kernel(T* grad_x, T* grad_w, C* __restrict__ partial, const T* __restrict__ grad,
                                    const T* __restrict__ x, const T* __restrict__ w, int64_t rows,
                                    int64_t H, C eps) {
  using C2 = pair_t<C>;
  __shared__ C2 scratch[2][32];
  const int hv = static_cast<int>(H / N);
  // Under an occupancy (min_blocks) the weight and the rows are held as raw bytes (cuda_norm.h's
  // load_units).
  constexpr bool kHeld = P::min_blocks(K) > 0;
  std::conditional_t<kHeld, held_t<T, N>, Vec<T, N>> wv[K];
  const auto w_unit = [&](int k) -> decltype(auto) {
    if constexpr (kHeld) {
      return unhold<T, N>(wv[k]);
    } else {
      return (wv[k]);
    }
  };
  C acc[K][N];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) {
      if constexpr (kHeld) {
        wv[k] = hold(load<N>(w + i * N));
      } else {
        wv[k] = load<N>(w + i * N);
      }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) acc[k][j] = C(0);
  }
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
    const T* xr = x + r * H;
    const T* gr = grad + r * H;
    Vec<T, N> xv[K], gv[K];
    if constexpr (kHeld) {  // as cuda_norm.h's load_units, which here spilled 136 bytes (nvcc 13)
      held_t<T, N> xh[K], gh[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < hv) {
          xh[k] = hold(load<N>(xr + i * N));
          gh[k] = hold(load<N>(gr + i * N));
        }
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        xv[k] = unhold<T, N>(xh[k]);
        gv[k] = unhold<T, N>(gh[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < hv) {
          xv[k] = load<N>(xr + i * N);
          gv[k] = load<N>(gr + i * N);
        }
      }
    }
    // add_row_sums, row_scales and unit_grad written out: called here, they made the 16-bit 2-unit kernel
    // spill 36 bytes at its 64 registers (nvcc 13, sm_90; tests/test_cuda_registers.py).
    C2 sums = {C(0), C(0)};  // (sum x^2, sum g w x)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + k * blockDim.x < hv) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const C v = to_compute(xv[k].v[j]);
          sums.x += v * v;
          sums.y += to_compute(gv[k].v[j]) * to_compute(w_unit(k).v[j]) * v;
        }
      }
    }
    sums = block_sum_fast(sums, scratch, parity);
    const C rs = rsqrt_of(sums.x / C(H) + eps);  // a division: an inverse held across the rows spilled
    const C c = rs * rs * rs * sums.y / C(H);
    T* dxr = grad_x + r * H;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        Vec<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const C v = to_compute(xv[k].v[j]);
          const C g = to_compute(gv[k].v[j]);
          o.v[j] = from_compute<T>(rs * g * to_compute(w_unit(k).v[j]) - c * v);
          acc[k][j] += g * v * rs;
        }
        store<N>(dxr + i * N, o);
      }
    }
  }
  store_column_sums<N, K>(acc, grad_w, partial, hv, H);
}

constexpr int kColumns = 32, kColumnGroups = 8;

// dw[i] = sum over p of partial[p, i], p in order within each of the
// kColumnGroups strided groups, then the groups in order: deterministic.
template <typename T, typename C = compute_t<T>>
__global__ void __launch_bounds__(kColumns* kColumnGroups)
    column_sum_kernel(T* dw, const C* __restrict__ partial, int64_t parts, int64_t H) {
  __shared__ C sums[kColumnGroups][kColumns];
  const int64_t i = int64_t(blockIdx.x) * kColumns + threadIdx.x;
  C s = 0;
  if (i < H) {
    for (int64_t p = threadIdx.y; p < parts; p += kColumnGroups) s += partial[p * H + i];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && i < H) {
    C total = 0;
#pragma unroll
    for (int gidx = 0; gidx < kColumnGroups; ++gidx) total += sums[gidx][threadIdx.x];
    dw[i] = from_compute<T>(total);
  }
}

// Launches column_sum_kernel on `stream`: dw = the sum of `parts` rows of partial (H floats each); zero
// rows give dw = 0. The caller checks the launch.
template <typename T, typename C>
void launch_column_sum(cudaStream_t stream, T* dw, const C* partial, int64_t parts, int64_t H) {
  const unsigned blocks = static_cast<unsigned>((H + kColumns - 1) / kColumns);
  column_sum_kernel<T><<<blocks, dim3(kColumns, kColumnGroups), 0, stream>>>(dw, partial, parts, H);
}

}  // namespace cuda
}  // namespace opbridge
