// The gated activations' CUDA kernels, written once for activation_and_mul.cu and the launch-policy
// sweep (scripts/cuda_gated_sweep.cu): x = [a | b] split in halves along the last dim (2d),
// out = act(a) * b with last dim d, and the backward grad_x = [grad b act'(a) | grad act(a)].
// act is silu or gelu with the tanh approximation, in float32 (double for float64) with the
// formulas and clamps of opbridge/activation_math.h.
//
// Each block takes one chunk of P::kThreads x P::kUnits column units of one row
// (Context::rows_grid: chunks over blockIdx.x, rows over blockIdx.y, grid-stride past 65535 rows),
// so a decode step's 1-8 rows spread over as many SMs as 4096 rows do. A thread's kUnits units are
// kThreads apart (each load instruction of a warp stays coalesced), all loaded before any is
// computed, so a thread keeps kUnits 128-bit loads of each operand in flight.
//
// The policy is what the sweep varies. GatedCurrent is the one the forward ops ship (128 threads, one
// unit each: 1.00-1.05 of the best policy the sweep found on an H200 at every size), GatedBackward
// the backward ops'. Both run units of half the width where few rows leave the device idle
// (gated_width).
#pragma once

#include <opbridge/activation_math.h>
#include <opbridge/cuda.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

// act / grad in C = float, or double for float64.
struct Silu {
  template <typename C> __device__ static C act(C a) { return act_math::silu<Math>(a); }
  template <typename C> __device__ static C grad(C a) { return act_math::silu_grad<Math>(a); }
};
struct GeluTanh {
  template <typename C> __device__ static C act(C a) { return act_math::gelu_tanh<Math>(a); }
  template <typename C> __device__ static C grad(C a) { return act_math::gelu_tanh_grad<Math>(a); }
};

// A launch policy: blocks of kThreads threads (also the kernels' __launch_bounds__), kUnits
// N-element units per thread; kStream: cache-streaming loads and stores (every element is touched once);
// kNarrowFrom: the least elements a 128-bit unit must hold for the policy to run units of half the
// width when its grid is small (gated_width; 0: never).
template <int Threads, int Units, bool Stream = false, int NarrowFrom = 0>
struct GatedPolicy {
  static constexpr int kThreads = Threads, kUnits = Units, kPerBlock = Threads * Units;
  static constexpr bool kStream = Stream;
  static constexpr int kNarrowFrom = NarrowFrom;
};
// The forward's narrows 16-bit units only. H200 sweeps (two runs, scripts/cuda-sweep.sh gated,
// 2026-11-26), 64-bit against 128-bit units at 1 and 8 rows of 14336: bfloat16 1.02-1.05x faster;
// float32 1.01-1.03x faster at 1 row but up to 1.02x slower at 8.
using GatedCurrent = GatedPolicy<128, 1, false, 8>;
// The backward's: cache-streaming loads and stores, on an H200 1.00-1.02 of the best policy at 256 to
// 8192 rows, where the cached form took 1.00-1.25 in float32; it narrows every dtype: 64-bit units at
// 1 and 8 rows ran 1.12-1.20x faster than 128-bit ones in float32 and 1.16-1.20x in bfloat16 (the
// second sweep; the first alike; the backward computes act and its gradient per element, and more
// threads hide more of that).
using GatedBackward = GatedPolicy<128, 1, true, 2>;

// The grid of a gated kernel over `rows` rows of `units` N-element units under policy P.
template <typename P>
dim3 gated_grid(int64_t rows, int64_t units) {
  return Context::rows_grid(rows, units, P::kPerBlock);
}

// The unit width (elements) P launches T's kernels at over `rows` rows of d elements: kVec<T> (128
// bits), or half of it where kVec<T> holds at least P::kNarrowFrom elements and the narrow grid, twice
// the wide one's blocks, still runs in one wave (`wave`: the blocks of the narrow kernel the device
// runs at once). So a decode step's 1-8 rows put twice the threads on the SMs, and larger grids keep
// 128-bit units: rows of 14336 narrow up to 37 rows in float32 and 75 in bfloat16 on an H200 (132
// SMs, 16 blocks of 128 threads each). At 256 rows 64-bit units ran up to 1.50x slower in the sweeps
// (forward, bfloat16; the backward's 1.07x in bfloat16, even in float32). Between 8 and 256 rows the
// boundary is this rule's, not measured.
template <typename P, int V>
inline constexpr bool kMayNarrow = P::kNarrowFrom != 0 && V >= 2 && V >= P::kNarrowFrom;

template <typename P, typename T>
int gated_width(int64_t rows, int64_t d, int64_t wave) {
  constexpr int V = kVec<T>;
  if constexpr (kMayNarrow<P, V>) {
    const dim3 grid = gated_grid<P>(rows, d / (V / 2));
    if (int64_t(grid.x) * grid.y <= wave) return V / 2;
  }
  return V;
}

// Launch a gated kernel under policy P over `rows` rows of d elements: kernel_of(std::integral_constant
// <int, N>{}) is its instantiation for N-element units, launched with (args..., rows, d). Units of
// gated_width's elements where `vectorize` (every pointer aligned, d a multiple of kVec<T>), else of
// one. Only the instantiations a policy can launch are made.
template <typename P, typename T, typename KernelOf, typename... Args>
void launch_gated(const Context& ctx, bool vectorize, int64_t rows, int64_t d, KernelOf kernel_of, Args... args) {
  constexpr int V = kVec<T>;
  const auto launch = [&](auto kernel, int n) {
    kernel<<<gated_grid<P>(rows, d / n), P::kThreads, 0, ctx.stream>>>(args..., rows, d);
  };
  if constexpr (kMayNarrow<P, V>) {
    static ResidentCache cache = {};  // one per instantiation: policy, dtype and kernel
    const auto narrow = kernel_of(std::integral_constant<int, V / 2>{});
    if (vectorize) {
      const int64_t wave = int64_t(ctx.num_sms()) * resident_blocks(ctx, narrow, P::kThreads, cache);
      if (gated_width<P, T>(rows, d, wave) == V / 2) return launch(narrow, V / 2);
    }
  }
  if (vectorize) return launch(kernel_of(std::integral_constant<int, V>{}), V);
  launch(kernel_of(std::integral_constant<int, 1>{}), 1);
}

template <typename P, int N, typename T, typename Act>
__global__ void __launch_bounds__(P::kThreads)
    act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t d) {
  constexpr int U = P::kUnits;
  const int64_t dv = d / N;
  const int64_t base = int64_t(blockIdx.x) * P::kPerBlock + threadIdx.x;
  if (base >= dv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    T* o = out + r * d;
    Vec<T, N> av[U], bv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * P::kThreads;
      if (U == 1 || i < dv) {
        av[u] = load_as<P::kStream, N>(xa + i * N);
        bv[u] = load_as<P::kStream, N>(xb + i * N);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * P::kThreads;
      if (U > 1 && i >= dv) break;
      Vec<T, N> ov;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        ov.v[k] = from_compute<T>(Act::act(to_compute(av[u].v[k])) * to_compute(bv[u].v[k]));
      }
      store_as<P::kStream, N>(o + i * N, ov);
    }
  }
}

template <typename P, int N, typename T, typename Act>
__global__ void __launch_bounds__(P::kThreads)
    act_and_mul_backward_kernel(T* __restrict__ grad_x, const T* __restrict__ grad,
                                const T* __restrict__ x, int64_t rows, int64_t d) {
  constexpr int U = P::kUnits;
  const int64_t dv = d / N;
  const int64_t base = int64_t(blockIdx.x) * P::kPerBlock + threadIdx.x;
  if (base >= dv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    const T* g = grad + r * d;
    T* ga = grad_x + r * 2 * d;
    T* gb = ga + d;
    Vec<T, N> av[U], bv[U], gv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * P::kThreads;
      if (U == 1 || i < dv) {
        av[u] = load_as<P::kStream, N>(xa + i * N);
        bv[u] = load_as<P::kStream, N>(xb + i * N);
        gv[u] = load_as<P::kStream, N>(g + i * N);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * P::kThreads;
      if (U > 1 && i >= dv) break;
      Vec<T, N> dav, dbv;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const auto a = to_compute(av[u].v[k]);
        const auto gk = to_compute(gv[u].v[k]);
        dav.v[k] = from_compute<T>(gk * to_compute(bv[u].v[k]) * Act::grad(a));
        dbv.v[k] = from_compute<T>(gk * Act::act(a));
      }
      store_as<P::kStream, N>(ga + i * N, dav);
      store_as<P::kStream, N>(gb + i * N, dbv);
    }
  }
}

}  // namespace cuda
}  // namespace opbridge
