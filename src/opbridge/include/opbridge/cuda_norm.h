// Row-cached RMS normalisation on CUDA, written once for rms_norm.cu and
// fused_add_rms_norm.cu: out[r] = z[r] * rsqrt(mean(z[r]^2) + eps) * w, where
// a source policy produces each row's values z (rms_norm: x itself;
// fused_add_rms_norm: input + residual, rounded, written back to residual).
//
// When a row fits in the block's registers, each thread loads its 128-bit
// units of z and of the weight at once, before the reduction, and writes from
// registers: one memory round trip per row, every load of the row in flight
// together. The two-pass form it replaces (wait for the row, reduce, read the
// row and the weight again) ran rms_norm at 0.67 of copy bandwidth on an H200
// at 4096 x 4096; this form at 0.89 (float32) and 0.82 (bfloat16).
//
// How many units per thread and threads per block is a per-op launch policy
// (cuda_norm_policy.h), each the configuration measured fastest for that op on an H200.
#pragma once

#include <opbridge/cuda.h>
#include <opbridge/cuda_norm_policy.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

// A thread's K units of two arrays (unit i of each from load_a(i) and load_b(i), i < hv), loaded at
// once, each unit's two under one branch. Held: they reach the branch's end as raw bytes (cuda_device.h's
// held_t) and become Vecs after it, which fits the registers of a policy that asks for an occupancy
// (min_blocks > 0) with fewer spills: rms_norm's 2 bfloat16 units per thread at 3 blocks of 512 take
// 40 registers and spill none (dense rows), where as Vecs of strided rows they spilled 44 bytes and
// loaded 84 back (nvcc 13, sm_90).
// Not held: the form of the policies that ask no occupancy, as they were measured.
template <bool Held, int N, int K, typename T, typename LoadA, typename LoadB>
__device__ __forceinline__ void load_units(Vec<T, N> (&av)[K], Vec<T, N> (&bv)[K], int hv, const LoadA& load_a,
                                           const LoadB& load_b) {
  if constexpr (Held) {
    held_t<T, N> ah[K], bh[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        ah[k] = hold(load_a(i));
        bh[k] = hold(load_b(i));
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      av[k] = unhold<T, N>(ah[k]);
      bv[k] = unhold<T, N>(bh[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        av[k] = load_a(i);
        bv[k] = load_b(i);
      }
    }
  }
}

// The pieces of one row that both forms of the kernel below share: a thread's K units (those within
// the row, `hv` units) committed to the source, reduced to the row's rsqrt(mean(z^2) + eps), and
// written out scaled by the weight.
template <typename P, int N, int K, typename T, typename Src>
__device__ __forceinline__ void commit_row(const Src& src, int64_t r, const Vec<T, N> (&zv)[K], int hv) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) src.template commit<P::kStream>(r, i, zv[k]);
  }
}

template <typename P, int N, int K, typename T, typename C>
__device__ __forceinline__ C row_rsqrt(const Vec<T, N> (&zv)[K], int hv, C inv_h, C eps, C (*scratch)[32],
                                       int parity) {
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
  if constexpr (P::kFastSum) {
    ss = block_sum_fast(ss, scratch, parity);
  } else {
    ss = block_sum(ss, scratch[0]);
  }
  return rsqrt_of(ss * inv_h + eps);
}

template <typename P, int N, int K, typename T, typename C>
__device__ __forceinline__ void store_scaled(T* yr, const Vec<T, N> (&zv)[K], const Vec<T, N> (&wv)[K], C rs,
                                             int hv) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) {
      Vec<T, N> o;
#pragma unroll
      for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(to_compute(zv[k].v[j]) * rs * to_compute(wv[k].v[j]));
      store_as<P::kStream, N>(yr + i * N, o);
    }
  }
}

// kPrefetch's form of the kernel below: a persistent grid; each block loads the weight once and its
// next row (r + gridDim.x) before it reduces and writes row r.
template <int N, int K, typename P, typename T, typename Src, typename C>
__device__ __forceinline__ void rms_rows_prefetched(T* out, const Src& src, const T* __restrict__ w, int64_t rows,
                                                    int64_t H, C eps, C (*scratch)[32]) {
  const int hv = static_cast<int>(H / N);
  const C inv_h = inverse_of<C>(H);
  Vec<T, N> wv[K], next[K];
  auto load_row = [&](int64_t r) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) next[k] = src.template load<P::kStream>(r, i);
    }
  };
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) wv[k] = load<N>(w + i * N);
  }
  int64_t r = blockIdx.x;
  if (r < rows) load_row(r);
  for (int parity = 0; r < rows; r += gridDim.x, parity ^= 1) {
    Vec<T, N> zv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) zv[k] = next[k];
    commit_row<P>(src, r, zv, hv);
    if (r + gridDim.x < rows) load_row(r + gridDim.x);  // in flight through the sum below
    const C rs = row_rsqrt<P>(zv, hv, inv_h, eps, scratch, parity);
    store_scaled<P>(out + r * H, zv, wv, rs, hv);
  }
}

// Src: `__device__ Vec<T, N> load(int64_t row, int unit) const`, called once
// per (row, unit) by the thread that writes out[row] at that unit, and
// `__device__ void commit(int64_t row, int unit, const Vec<T, N>& z) const`,
// called with what load returned once every unit of the thread is loaded:
// where a source writes z back (fused_add_rms_norm's residual), a store inside
// load would order each later unit's loads behind it (they may alias), one
// memory latency per unit. `out` may be a buffer Src reads (in place): each
// unit is read before it is written, by the same thread.
template <int N, int K, typename P, typename T, typename Src, typename C = compute_t<T>>
__global__ void __launch_bounds__(P::kMaxThreads, P::min_blocks(K))
    rms_rows_cached_kernel(T* out, Src src, const T* __restrict__ w, int64_t rows, int64_t H, C eps) {
  __shared__ C scratch[2][32];
  if constexpr (P::kPrefetch) {
    rms_rows_prefetched<N, K, P>(out, src, w, rows, H, eps, scratch);
    return;
  }
  const int hv = static_cast<int>(H / N);
  const C inv_h = inverse_of<C>(H);
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
    Vec<T, N> zv[K], wv[K];
    load_units<(P::min_blocks(K) > 0)>(wv, zv, hv, [&](int i) { return load<N>(w + i * N); },
                                    [&](int i) { return src.template load<P::kStream>(r, i); });
    commit_row<P>(src, r, zv, hv);
    const C rs = row_rsqrt<P>(zv, hv, inv_h, eps, scratch, parity);
    store_scaled<P>(out + r * H, zv, wv, rs, hv);
  }
}

// The row sources of rms_norm.cu and fused_add_rms_norm.cu (and of a tuning
// harness that launches rms_rows_cached_kernel under other policies).
// RowsOf: rms_norm's rows, x itself, contiguous or rows at a stride (its StridedRows; the
// launcher vectorises only where every row start is 16-byte aligned). Dense: rows known contiguous
// (r * width), without StridedRows' division, whose registers spilled under a policy that asks for
// an occupancy (launch_rms_rows_of uses it for such a policy only).
template <int N, typename T, bool Dense = false>
struct RowsOf {
  const T* __restrict__ x;
  StridedRows rows;
  template <bool Stream = false>
  __device__ Vec<T, N> load(int64_t r, int i) const {
    const int64_t at = Dense ? r * rows.width : rows.offset(r);
    return cuda::load_as<Stream, N>(x + at + int64_t(i) * N);
  }
  template <bool Stream = false>
  __device__ void commit(int64_t, int, const Vec<T, N>&) const {}
};

// SumRows: fused_add_rms_norm's rows, input + residual rounded to the dtype,
// written back to residual (input is then overwritten with the norm by the
// same thread, after this read).
template <int N, typename T>
struct SumRows {
  const T* input;
  T* residual;
  int64_t H;
  template <bool Stream = false>
  __device__ Vec<T, N> load(int64_t r, int i) const {
    const int64_t at = r * H + int64_t(i) * N;
    const Vec<T, N> a = cuda::load_as<Stream, N>(input + at);
    const Vec<T, N> b = cuda::load_as<Stream, N>(residual + at);
    Vec<T, N> z;
#pragma unroll
    for (int k = 0; k < N; ++k) z.v[k] = from_compute<T>(to_compute(a.v[k]) + to_compute(b.v[k]));
    return z;
  }
  template <bool Stream = false>
  __device__ void commit(int64_t r, int i, const Vec<T, N>& z) const {
    cuda::store_as<Stream, N>(residual + r * H + int64_t(i) * N, z);
  }
};

// Launches the cached kernel under policy P over `rows` rows of H elements (N
// per unit), one block per row (kPrefetch: one wave of blocks, each looping over
// rows r, r + grid, ...). Returns false, launching nothing, when a row
// does not fit (cached_units is 0): the caller runs its two-pass form.
template <template <int> class Policy, int N, typename T, typename Src, typename C>
bool launch_rms_rows_cached(const Context& ctx, T* out, Src src, const T* w, int64_t rows, int64_t H, C eps) {
  using P = Policy<N>;
  const int64_t hv = H / N;
  const int units = cached_units<P>(hv);
  if (units == 0 || units < MinUnitsOf<P>::value) return false;
  const int threads = row_threads((hv + units - 1) / units, P::kMaxThreads);
  with_units<P::kMaxUnits, MinUnitsOf<P>::value>(units, [&](auto k_const) {
    constexpr int K = decltype(k_const)::value;
    auto* kernel = rms_rows_cached_kernel<N, K, P, T, Src, C>;
    int64_t blocks = rows;
    if constexpr (P::kPrefetch) {  // one wave: each block runs rows r, r + grid, ...
      static ResidentCache resident = {};
      blocks = std::min<int64_t>(rows, int64_t(ctx.num_sms()) * resident_blocks(ctx, kernel, threads, resident));
    }
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX));
    kernel<<<grid, threads, 0, ctx.stream>>>(out, src, w, rows, H, eps);
  });
  return true;
}

// rms_norm's rows of x (at xs) under policy P: launch_rms_rows_cached with RowsOf, dense (and under
// P's occupancy) where the rows are contiguous and the policy asks for an occupancy at the units the rows
// take; otherwise as strided rows without it.
template <template <int> class Policy, int N, typename T, typename C>
bool launch_rms_rows_of(const Context& ctx, T* out, const T* x, const StridedRows& xs, const T* w, int64_t rows,
                        int64_t H, C eps) {
  using P = Policy<N>;
  if constexpr (asks_occupancy<P>()) {
    if (xs.contiguous() && P::min_blocks(cached_units<P>(H / N)) > 0) {
      return launch_rms_rows_cached<Policy, N>(ctx, out, RowsOf<N, T, true>{x, xs}, w, rows, H, eps);
    }
    return launch_rms_rows_cached<Unoccupied<Policy>::template Of, N>(ctx, out, RowsOf<N, T>{x, xs}, w, rows, H, eps);
  }
  return launch_rms_rows_cached<Policy, N>(ctx, out, RowsOf<N, T>{x, xs}, w, rows, H, eps);
}

// rms_norm's rows of x under RmsNormManyRows or RmsNormFewRows where they apply, else RmsNormRows; false
// when the rows fit none (the caller runs the looped form).
template <int N, typename T, typename C>
bool launch_rms_norm_rows(const Context& ctx, T* out, const T* x, const StridedRows& xs, const T* w, int64_t rows,
                          int64_t H, C eps) {
  // contiguous rows only: read as dense ones (the strided form is not compiled)
  if constexpr (N >= 8) {
    if (RmsNormManyRows<N>::applies(rows, H / N, xs.contiguous()) &&
        launch_rms_rows_cached<RmsNormManyRows, N>(ctx, out, RowsOf<N, T, true>{x, xs}, w, rows, H, eps)) {
      return true;
    }
  } else if constexpr (N == 4) {
    if (RmsNormFewRows<N>::applies(rows, H / N, xs.contiguous()) &&
        launch_rms_rows_cached<RmsNormFewRows, N>(ctx, out, RowsOf<N, T, true>{x, xs}, w, rows, H, eps)) {
      return true;
    }
  }
  return launch_rms_rows_of<RmsNormRows, N>(ctx, out, x, xs, w, rows, H, eps);
}

// fused_add_rms_norm's rows (SumRows: contiguous) under FusedAddRmsNormFewRows where it applies, else
// FusedAddRmsNormRows; false when the rows fit neither (the caller runs the two-pass form).
template <int N, typename T, typename C>
bool launch_fused_add_rms_norm_rows(const Context& ctx, T* input, T* residual, const T* w, int64_t rows, int64_t H,
                                    C eps) {
  const SumRows<N, T> src{input, residual, H};
  if constexpr (N == 4) {
    if (FusedAddRmsNormFewRows<N>::applies(rows, H / N) &&
        launch_rms_rows_cached<FusedAddRmsNormFewRows, N>(ctx, input, src, w, rows, H, eps)) {
      return true;
    }
  }
  return launch_rms_rows_cached<FusedAddRmsNormRows, N>(ctx, input, src, w, rows, H, eps);
}

}  // namespace cuda
}  // namespace opbridge
