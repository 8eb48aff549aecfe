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
// the backward ops'.
#pragma once

#include <opbridge/activation_math.h>
#include <opbridge/cuda.h>

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
// N-element units per thread; kStream: cache-streaming loads and stores (every element is touched once).
template <int Threads, int Units, bool Stream = false>
struct GatedPolicy {
  static constexpr int kThreads = Threads, kUnits = Units, kPerBlock = Threads * Units;
  static constexpr bool kStream = Stream;
};
using GatedCurrent = GatedPolicy<128, 1>;
// The backward's: the same with cache-streaming loads and stores, on an H200 (scripts/cuda-sweep.sh
// gated, 2026-11-26) 1.00-1.02 of the best policy at 256 to 8192 rows and 1.13-1.21 at 1 and 8 rows
// (64-bit units win there), where the cached form took 1.00-1.25 in float32.
using GatedBackward = GatedPolicy<128, 1, true>;

// The grid of a gated kernel over `rows` rows of `units` N-element units under policy P.
template <typename P>
dim3 gated_grid(int64_t rows, int64_t units) {
  return Context::rows_grid(rows, units, P::kPerBlock);
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
