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
// (below), each the configuration measured fastest for that op on an H200.
#pragma once

#include <opbridge/cuda.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

// A launch policy: blocks of at most kMaxThreads threads (also the kernel's __launch_bounds__); a
// row's units (128-bit vectors) spread first over kPreferredThreads threads with up to
// kPreferredUnits units each, then over more threads up to kMaxThreads, then over more units up to
// kMaxUnits (1, 2, 4 or 8) per thread. kFastSum picks block_sum_fast over block_sum; kStream:
// cache-streaming loads and stores of the rows (the weight row, read by every block, keeps normal
// loads), a knob the sweep tries (scripts/cuda_norm_sweep.cu). kPrefetch: a persistent grid (one wave)
// whose blocks load their next row while they reduce and write the current one, and load the weight
// once: with one or two blocks per SM, the block sum's barriers otherwise leave the memory system idle
// (a candidate for bfloat16 rows of 8192 when no policy came within 25% of Inductor on an H200; the
// occupancy below since did); no shipped policy sets it. min_blocks(units): the kernel's second
// __launch_bounds__ argument for that many units per thread, blocks of kMaxThreads that must fit on an
// SM at once, so that ptxas holds a thread's registers to 65536 / (kMaxThreads x min_blocks):
// Liger-Kernel's bfloat16 rms_norm for rows of 8192 runs 512 threads x 16 elements at 39 registers, 3
// blocks (1536 threads, 48 KiB of loads) per SM, where this kernel's policy before 2026-11-28 ran 2 blocks
// of 1024 (rms_norm's 16-bit policy now runs Liger's). Per
// units, because the registers a unit needs decide what fits: at 3 blocks of 512, 2 bfloat16 units
// fit 40 registers without spilling, 4 spill (340-500 bytes of spill loads). A kernel asked for an
// occupancy also holds its units as raw bytes (load_units), and contiguous rows are read as dense ones
// (launch_rms_rows_of). 0 asks nothing (no .minnctapersm): the shipped policies' code as measured.
//
// The forward policies are the fastest the sweep found on an H200 (2026-11-26, every policy of the
// product's kernel at 1, 8, 256, 4096 rows of 4096 and at 8192 x 8192; times against the best policy
// of each case, the policies before in brackets):
//  - rms_norm, 16-bit: one unit per thread up to 512 threads, then two, then four; one-barrier sum;
//    4 blocks per SM at one unit, 3 at two (min_blocks). The sweep of 2026-11-28 (H200, every policy
//    at 1, 8, 64, 256, 1024, 4096 rows of 4096 and 8192 x 8192, bfloat16), against the policy before
//    (one unit, up to 1024 threads, no occupancy asked): rows of 4096 1.544 / 1.588 / 1.696 / 2.221 /
//    4.498 / 20.650 us against 1.629 / 1.667 / 1.767 / 2.285 / 4.764 / 20.909; 8192 x 8192 68.4 against
//    86.6 us (x1.26; Inductor's was 65.4 on 2026-11-27). Not the best at 4096 rows of 4096: two units of
//    256 threads at 6 blocks ran 18.7 us there and 2-4% slower at 1-256 rows. Rows of 16384 (four
//    units of 512 threads, two of 1024 before) are not measured;
//  - rms_norm, float32 (and float64): 4 units, up to 512 threads, one-barrier sum: 1.00-1.07 (1.00-1.09);
//  - fused_add_rms_norm, 16-bit: rms_norm's policy before 2026-11-28 (one unit, up to 1024 threads,
//    no occupancy asked): 1.00 (1.04-1.13);
//  - fused_add_rms_norm, float32: 2 units, 512 threads then up to 1024, three-barrier sum:
//    1.00-1.05 (1.02-1.25; one row 2.46 -> 1.98 us).
// Earlier, measured through opbridge bench gpu and dropped: splitting each of a few rows over a
// thread-block cluster (partial sums through distributed shared memory; one row 2.07 -> 2.30 us
// float32, 1.77 -> 2.47 bfloat16).
template <int N>
struct RmsNormRows {
  static constexpr bool k16 = N >= 8;  // 16-bit elements (8 per unit)
  static constexpr int kMaxThreads = 512, kPreferredThreads = k16 ? 512 : 256;
  static constexpr int kPreferredUnits = k16 ? 1 : 4, kMaxUnits = 4;
  static constexpr bool kFastSum = true, kStream = false, kPrefetch = false;
  // 16-bit: 4 blocks of 512 per SM at one unit (32 registers), 3 at two (40); four units ask nothing.
  // sm_86/89/120 hold 1536 threads per SM: ptxas ignores the 4 there (a warning), as before this policy
  static constexpr int min_blocks(int units) { return !k16 ? 0 : units == 1 ? 4 : units == 2 ? 3 : 0; }
};
// rms_norm's policy for many contiguous 16-bit rows of 257-512 units (hidden 2056-4096): two units per
// thread in blocks of 256, 6 blocks per SM (40 registers). The sweep of 2026-11-28 (H200, bfloat16 rows
// of 4096): 4096 rows 18.7 us against RmsNormRows' 20.7; 1024 rows 4.53 against 4.50, and 2-4% slower
// at 1-256 rows, hence from kMinRows on (between the two measured sizes).
template <int N>
struct RmsNormManyRows : RmsNormRows<N> {
  static constexpr int kMaxThreads = 256, kPreferredThreads = 256, kPreferredUnits = 2, kMaxUnits = 2;
  static constexpr int64_t kMinRows = 2048;
  static constexpr int min_blocks(int units) { return units == 2 ? 6 : 0; }
  static constexpr bool applies(int64_t rows, int64_t hv, bool contiguous) {
    return N >= 8 && contiguous && rows >= kMinRows && hv > 256 && hv <= 512;
  }
};
template <int N>
struct FusedAddRmsNormRows {
  static constexpr bool k16 = N >= 8;
  static constexpr int kMaxThreads = 1024, kPreferredThreads = k16 ? 1024 : 512;
  static constexpr int kPreferredUnits = k16 ? 1 : 2, kMaxUnits = k16 ? 2 : 4;
  static constexpr bool kFastSum = k16, kStream = false, kPrefetch = false;
  static constexpr int min_blocks(int) { return 0; }
};
// Units per thread under policy P for rows of `hv` units, with blocks of at most `max_threads`
// (P::kMaxThreads unless a caller caps it lower); 0 when the row does not fit. Blocks of
// row_threads(ceil(hv / units), max_threads) then hold every unit of the row: the preferred threads
// count only up to max_threads (a staged backward built with fewer threads than its policy prefers,
// OPB_RMS_NORM_BACKWARD_STAGED_THREADS=128, would otherwise have left units of a row to no thread).
template <typename P>
int cached_units(int64_t hv, int max_threads = P::kMaxThreads) {
  const int preferred = std::min(P::kPreferredThreads, max_threads);
  for (int k = 1; k <= P::kPreferredUnits; k *= 2) {
    if (hv <= int64_t(preferred) * k) return k;
  }
  for (int k = P::kPreferredUnits; k <= P::kMaxUnits; k *= 2) {
    if (hv <= int64_t(max_threads) * k) return k;
  }
  return 0;
}

// Calls go(std::integral_constant<int, K>{}) for K = units; instantiates only
// the K in {1, 2, 4, 8} up to MaxUnits.
template <int MaxUnits, typename Go>
void with_units(int units, Go&& go) {
  if (units <= 1) {
    go(std::integral_constant<int, 1>{});
  } else if (units == 2 || MaxUnits < 4) {
    if constexpr (MaxUnits >= 2) go(std::integral_constant<int, 2>{});
  } else if (units == 4 || MaxUnits < 8) {
    if constexpr (MaxUnits >= 4) go(std::integral_constant<int, 4>{});
  } else {
    if constexpr (MaxUnits >= 8) go(std::integral_constant<int, 8>{});
  }
}

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
// per unit), one block per row. Returns false, launching nothing, when a row
// does not fit (cached_units is 0): the caller runs its two-pass form.
template <template <int> class Policy, int N, typename T, typename Src, typename C>
bool launch_rms_rows_cached(const Context& ctx, T* out, Src src, const T* w, int64_t rows, int64_t H, C eps) {
  using P = Policy<N>;
  const int64_t hv = H / N;
  const int units = cached_units<P>(hv);
  if (units == 0) return false;
  const int threads = row_threads((hv + units - 1) / units, P::kMaxThreads);
  with_units<P::kMaxUnits>(units, [&](auto k_const) {
    constexpr int K = decltype(k_const)::value;
    auto* kernel = rms_rows_cached_kernel<N, K, P, T, Src, C>;
    int64_t blocks = rows;
    if constexpr (P::kPrefetch) {  // one wave: each block runs rows r, r + grid, ...
      static ResidentCache resident = {};
      blocks = std::min<int64_t>(rows, int64_t(ctx.num_sms()) * resident_blocks(ctx.op(), kernel, threads, resident));
    }
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, INT32_MAX));
    kernel<<<grid, threads, 0, ctx.stream>>>(out, src, w, rows, H, eps);
  });
  return true;
}

// Whether policy P asks for an occupancy at any units per thread.
template <typename P>
constexpr bool asks_occupancy() {
  return P::min_blocks(1) > 0 || P::min_blocks(2) > 0 || P::min_blocks(4) > 0 || P::min_blocks(8) > 0;
}

// Policy without its occupancy (min_blocks 0, units not held): strided rows' form. Their row offsets
// (StridedRows::offset's 64-bit division) take registers the occupancy's cap was not measured with, and
// the sweep times contiguous rows only: strided rows run as they did before any policy asked one.
template <template <int> class Policy>
struct Unoccupied {
  template <int N>
  struct Of : Policy<N> {
    static constexpr int min_blocks(int) { return 0; }
  };
};

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

// rms_norm's rows of x under RmsNormManyRows where it applies, else RmsNormRows; false when the rows fit
// neither (the caller runs the looped form).
template <int N, typename T, typename C>
bool launch_rms_norm_rows(const Context& ctx, T* out, const T* x, const StridedRows& xs, const T* w, int64_t rows,
                          int64_t H, C eps) {
  if constexpr (N >= 8) {  // contiguous rows only: read as dense ones (the strided form is not compiled)
    if (RmsNormManyRows<N>::applies(rows, H / N, xs.contiguous()) &&
        launch_rms_rows_cached<RmsNormManyRows, N>(ctx, out, RowsOf<N, T, true>{x, xs}, w, rows, H, eps)) {
      return true;
    }
  }
  return launch_rms_rows_of<RmsNormRows, N>(ctx, out, x, xs, w, rows, H, eps);
}

}  // namespace cuda
}  // namespace opbridge
