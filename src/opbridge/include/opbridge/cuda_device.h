// opbridge CUDA device-side building blocks, included by opbridge/cuda.h (include that): the
// element types and their conversions (device_t, to_compute / from_compute: arithmetic in float32,
// double for float64), the math policy of the activations (cuda::Math), N-element aligned vector
// access (128 bits at kVec<T>; can_vectorize decides on the host) and warp and block sums.
// cuda.h has the host side: errors, the device and stream of a call, launch checks, scratch memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <opbridge/opbridge.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace opbridge {
namespace cuda {

// ---------------------------------------------------------------------------
// element types and conversions (arithmetic in float32; float64 in double)
// ---------------------------------------------------------------------------

template <typename T>
struct device_type {
  using type = T;
};
template <>
struct device_type<::opbridge::half> {
  using type = __half;
};
template <>
struct device_type<::opbridge::bfloat16> {
  using type = __nv_bfloat16;
};
// The CUDA type with the layout of an opbridge storage type.
template <typename T>
using device_t = typename device_type<T>::type;

static_assert(sizeof(__half) == sizeof(::opbridge::half), "half layout");
static_assert(sizeof(__nv_bfloat16) == sizeof(::opbridge::bfloat16), "bfloat16 layout");

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even, as the CPU kernels do.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The math policy of opbridge/activation_math.h on CUDA. float: the hardware's
// approximate exp and division (__expf: ex2.approx after one multiply, within
// 2 + 1.16|x| ulp, about 6e-6 relative at |x| = 80 and under 1e-6 for |x| < 8;
// __fdividef: 2 ulp for divisors up to 2^126, 0 beyond, where every quotient
// here is below 1e-36), as Triton's and Inductor's sigmoid: the IEEE forms
// cost about 25 instructions more per element, which made the 16-bit gated
// activations and gelu compute-bound on an H200 (0.67-0.70 of copy bandwidth).
// double: exp and IEEE division. clamp_below is max(v, lo) that keeps NaN
// (fmaxf would replace it by lo).
struct Math {
  __device__ static float exp(float x) { return __expf(x); }
  __device__ static double exp(double x) { return ::exp(x); }
  __device__ static float div(float a, float b) { return __fdividef(a, b); }
  __device__ static double div(double a, double b) { return a / b; }
  template <typename C>
  __host__ __device__ static C clamp_below(C v, C lo) {
    return v < lo ? lo : v;
  }
};

// The compute type of storage type T is opbridge::compute_t<T>: float for
// float32 and the 16-bit types (__half / __nv_bfloat16 included), double for
// float64, the integer itself for the integers.
template <typename T>
__device__ __forceinline__ compute_t<T> to_compute(T v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return to_float(v);
  }
}
template <typename T>
__device__ __forceinline__ T from_compute(compute_t<T> v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return from_float<T>(v);
  }
}

__device__ __forceinline__ float rsqrt_of(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_of(double v) { return ::rsqrt(v); }
// 1 / H, which a forward norm kernel computes before its first load and multiplies a row's sum by:
// a division by H after the row's sum sat on each row's critical path (an IEEE division, some 40
// cycles, where a decode step's one row takes 2 us in all). Within an ulp of the quotient.
template <typename C>
__device__ __forceinline__ C inverse_of(int64_t H) {
  return C(1) / C(H);
}

// Two sums reduced together (rms_norm's backward): float2, or double2 for float64.
template <typename C>
using pair_t = std::conditional_t<std::is_same_v<C, double>, double2, float2>;

// ---------------------------------------------------------------------------
// vector access: N elements in one aligned load/store (128 bits when N = kVec<T>)
// ---------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per 128-bit access.
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));

// The integer type of a Vec's bytes (16, 8 or 4), through which load and store move it whole. A store
// goes through the __stwb intrinsic (st.global.wb, the default cache policy): an assignment, of the
// Vec or of its bytes as an int4, left the store's width to the compiler, and nvcc 13 split the
// vectorised gated kernels' 16-bit results into four to seven u16 / v2.u16 stores instead of one
// v4: the gated backward at 4096 x 14336 bfloat16 took 2.1x the time of the same kernel storing 128
// bits (H200, scripts/cuda-sweep.sh gated).
template <int Bytes>
struct RawOf {
  using type = void;
};
template <>
struct RawOf<16> {
  using type = int4;
};
template <>
struct RawOf<8> {
  using type = int2;
};
template <>
struct RawOf<4> {
  using type = int;
};
template <typename T, int N>
using raw_t = typename RawOf<int(sizeof(Vec<T, N>))>::type;

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
  using R = raw_t<T, N>;
  if constexpr (std::is_void_v<R>) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
  } else {
    Vec<T, N> v;
    *reinterpret_cast<R*>(&v) = *reinterpret_cast<const R*>(p);
    return v;
  }
}
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& v) {
  using R = raw_t<T, N>;
  if constexpr (std::is_void_v<R>) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  } else {
    __stwb(reinterpret_cast<R*>(p), *reinterpret_cast<const R*>(&v));  // st.global.wb: the default cache policy
  }
}

// A Vec kept in registers between its load and its use, as its raw bytes (held_t: int4, int2 or int;
// the Vec itself where it has no such width). A kernel that loads a row's units under `if (i < hv)`
// and uses them after a block sum can hold them this way: held as Vecs, the 16-bit elements reached
// the join of the branch as separate 16-bit values, and ptxas kept each unit of 8 in 8 registers
// instead of 4 (SASS of rms_norm's row-cached kernel, nvcc 13, sm_90). Under the occupancy a policy
// asks for (its min_blocks) that decides spills: rms_norm_backward's 2 bfloat16 units at 2 blocks of
// 512 per SM fit 64 registers held so, where as Vecs the kernel took 96 (cuda_norm_backward.h).
template <typename T, int N>
using held_t = std::conditional_t<std::is_void_v<raw_t<T, N>>, Vec<T, N>, raw_t<T, N>>;

template <typename T, int N>
__device__ __forceinline__ held_t<T, N> hold(const Vec<T, N>& v) {
  return *reinterpret_cast<const held_t<T, N>*>(&v);
}
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> unhold(const held_t<T, N>& h) {
  Vec<T, N> v;
  *reinterpret_cast<held_t<T, N>*>(&v) = h;
  return v;
}

// The same with the cache-streaming hint (ld.global.cs / st.global.cs: the line is evicted first),
// for data a kernel touches once, so that what it reuses (a norm's weight row) stays in cache. A
// launch-policy knob (kStream) the sweeps try.
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_stream(const T* p) {
  using R = raw_t<T, N>;
  if constexpr (std::is_void_v<R>) {
    return load<N>(p);
  } else {
    Vec<T, N> v;
    *reinterpret_cast<R*>(&v) = __ldcs(reinterpret_cast<const R*>(p));
    return v;
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_stream(T* p, const Vec<T, N>& v) {
  using R = raw_t<T, N>;
  if constexpr (std::is_void_v<R>) {
    store<N>(p, v);
  } else {
    __stcs(reinterpret_cast<R*>(p), *reinterpret_cast<const R*>(&v));
  }
}
// load / store, or their streaming forms where Stream.
template <bool Stream, int N, typename T>
__device__ __forceinline__ Vec<T, N> load_as(const T* p) {
  if constexpr (Stream) return load_stream<N>(p);
  else return load<N>(p);
}
template <bool Stream, int N, typename T>
__device__ __forceinline__ void store_as(T* p, const Vec<T, N>& v) {
  if constexpr (Stream) store_stream<N>(p, v);
  else store<N>(p, v);
}

inline bool is_aligned(const void* p, std::size_t bytes = 16) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Whether every pointer allows kVec<T>-element vector access at every multiple
// of `row` elements (pass row = 0 for flat arrays).
template <typename T, typename... P>
inline bool can_vectorize(int64_t row, const P*... ptrs) {
  const bool rows_ok = row % kVec<T> == 0;
  return rows_ok && (is_aligned(ptrs) && ...);
}

// ---------------------------------------------------------------------------
// reductions (blockDim.x a multiple of 32, at most 1024)
// ---------------------------------------------------------------------------

template <typename C>  // float or double
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
  return make_float2(warp_sum(v.x), warp_sum(v.y));
}

__device__ __forceinline__ double2 warp_sum(double2 v) {
  return make_double2(warp_sum(v.x), warp_sum(v.y));
}

// Sum over the block, returned to every thread; `scratch` is __shared__ [32].
// Deterministic for a given block size. Safe to call repeatedly.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call may still be reading scratch[0]
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    V w = lane < warps ? scratch[lane] : V{};
    w = warp_sum(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// block_sum with one barrier instead of three: every warp reduces the warps'
// partial sums itself (the same values in the same order, so every thread gets
// the same, deterministic total). `scratch` is __shared__ [2][32]; alternate
// `parity` between consecutive calls: a warp can only write a buffer again
// after the next call's barrier, which every warp reaches only once done
// reading it.
template <typename V>
__device__ __forceinline__ V block_sum_fast(V v, V (*scratch)[32], int parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[parity][warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[parity][lane] : V{});
}

}  // namespace cuda
}  // namespace opbridge
