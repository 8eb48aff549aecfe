// opbridge kernel headers: dtypes (names, storage and compute types, typed data).
// A section of opbridge/opbridge.h, which kernels include (it also brings the
// runtime these declare; see opbridge/runtime_impl.h).
#pragma once

#include "opbridge/common.h"

namespace opbridge {

// ---------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------

constexpr DLDataType kFloat32{kDLFloat, 32, 1};
constexpr DLDataType kFloat64{kDLFloat, 64, 1};
constexpr DLDataType kFloat16{kDLFloat, 16, 1};
constexpr DLDataType kBFloat16{kDLBfloat, 16, 1};
constexpr DLDataType kInt32{kDLInt, 32, 1};
constexpr DLDataType kInt64{kDLInt, 64, 1};
constexpr DLDataType kBool{kDLBool, 8, 1};

// DLDataType's operator== / != come from <tvm/ffi/dtype.h> (root namespace, found
// by ADL). Defining them here as well made every comparison ambiguous.

OPB_RT_ std::string dtype_name(DLDataType t);
OPB_RT_ std::string shape_str(const TensorView& t);

inline const char* device_name(int device_type) {
  switch (device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLROCM: return "rocm";
    default: return "unknown device";
  }
}

// 16-bit float storage types. Conversions are branch-free bit manipulation so
// that loops over them vectorise; arithmetic always happens in float32.
struct alignas(2) half {
  uint16_t bits;
};
struct alignas(2) bfloat16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// c ? a : b as bit masks. A plain ?: is not enough: GCC sinks the float
// arithmetic feeding one arm into a conditional block, which under the default
// -ftrapping-math it will then not if-convert, and the loop stays scalar.
inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - uint32_t(c);
  return (a & m) | (b & ~m);
}

inline float to_float(float v) { return v; }
inline float to_float(bfloat16 v) { return bits_to_float(uint32_t(v.bits) << 16); }
inline float to_float(half v) {
  // Giesen's half_to_float_fast: exact for normals, denormals, inf and nan.
  const uint32_t h = v.bits;
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (h & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  const uint32_t inf_nan = o + ((128u - 16u) << 23);
  const uint32_t denorm = float_to_bits(bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23));
  o = select_bits(exp == shifted_exp, inf_nan, select_bits(exp == 0, denorm, o));
  return bits_to_float(o | ((h & 0x8000u) << 16));
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline bfloat16 from_float<bfloat16>(float f) {
  // Round to nearest even; NaN stays a quiet NaN (sign kept). A NaN gets its
  // quiet bit set and its low half cleared first, so the rounding add cannot
  // carry into the exponent and one rounding path serves every input: picking
  // between two 16-bit results instead makes GCC narrow both (twice the lane
  // shuffles), and this store loop ran 1.3x slower (7.5 vs 5.7 us per 32K
  // elements in-cache on AVX-512). f != f is one vector compare.
  const uint32_t u = float_to_bits(f);
  const uint32_t nan = 0u - uint32_t(f != f);
  const uint32_t q = (u | (nan & 0x400000u)) & ~(nan & 0xffffu);
  return bfloat16{uint16_t((q + 0x7fffu + ((q >> 16) & 1u)) >> 16)};
}
template <>
inline half from_float<half>(float f) {
  // Giesen's float_to_half_fast3_rtne, written with mask selects so it vectorises.
  uint32_t u = float_to_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t f32infty = 255u << 23;
  const uint32_t f16max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t overflow = select_bits(u > f32infty, 0x7e00u, 0x7c00u);
  const uint32_t denorm = float_to_bits(bits_to_float(u) + bits_to_float(denorm_magic)) - denorm_magic;
  const uint32_t mant_odd = (u >> 13) & 1u;
  const uint32_t normal = (u + (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
  const uint32_t o = select_bits(u >= f16max, overflow, select_bits(u < (113u << 23), denorm, normal));
  return half{uint16_t(o | (sign >> 16))};
}

// float64 storage is double. from_float<double> exists so that kernels written
// against to_float / from_float (float32 arithmetic) still compile when
// OPB_DISPATCH_FLOATING hands them double; such a kernel computes float64 in
// float32. To compute in double, write the kernel over compute_t<T> with
// to_compute / from_compute (below), as the built-in kernels do.
template <>
inline double from_float<double>(float f) {
  return f;
}

// The type a kernel computes in for storage type T: float for float32 and the
// 16-bit storage structs (their values widen exactly to float; CUDA's __half
// and __nv_bfloat16 too), T itself for double and the integers. to_compute /
// from_compute convert between the two; for float32 and the 16-bit types they
// are to_float / from_float<T>.
template <typename T>
using compute_t = std::conditional_t<std::is_arithmetic_v<T>, T, float>;

template <typename T>
inline compute_t<T> to_compute(T v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return to_float(v);
  }
}

template <typename T>
inline T from_compute(compute_t<T> v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return from_float<T>(v);
  }
}

// f rounded to T's precision and back: to_float(from_float<T>(f)) without a
// T-typed temporary (see fused_add_rms_norm.cc for why that matters).
template <typename T>
inline compute_t<T> round_to(compute_t<T> f) {
  if constexpr (std::is_same_v<T, compute_t<T>>) {
    return f;
  } else {
    return to_float(T{from_float<T>(f).bits});
  }
}

// Typed data pointer; honours DLPack's byte_offset (TensorView::data_ptr() does not).
template <typename T>
inline T* data_ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

}  // namespace opbridge
