// opbridge kernel header: argument checks, dtype dispatch and the export macro.
//
// A kernel is a C++ function over tvm::ffi::TensorView in destination-passing
// style: the framework adapter allocates the outputs and passes them first,
// followed by the op's schema arguments in schema order. Each kernel validates
// its arguments, takes the framework's stream where it has one, dispatches on
// dtype and computes.
//
// User mistakes are raised with their Python type (TypeError / ValueError) and
// a message of the form "<op>: <arg> must be ..., got ..."; internal invariants
// use TVM_FFI_ICHECK.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include "opbridge/export_list.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// The messages of the argument checks, the error stream behind OPB_THROW and
// OPBRIDGE_EXPORT's typed-call helpers are declared with OPB_RT_ and defined in
// opbridge/runtime_impl.h. A module built by opbridge defines
// OPB_SEPARATE_RUNTIME and compiles them once (build/templates/runtime.cc);
// compiled any other way (a bare tvm_ffi.cpp.build, nvcc) they are inline here.
#if defined(OPB_SEPARATE_RUNTIME) && !defined(__CUDACC__)
#define OPB_RT_
#else
#define OPB_RT_ inline
#endif

// Functions that CPU (.cc) and CUDA (.cu) kernels share, e.g. the per-element
// math in the op headers.
#if defined(__CUDACC__)
#define OPB_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define OPB_HOST_DEVICE inline __attribute__((always_inline))
#else
#define OPB_HOST_DEVICE inline
#endif

namespace opbridge {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

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

// ---------------------------------------------------------------------------
// argument checks: each raises a Python TypeError/ValueError naming op and arg
// ---------------------------------------------------------------------------

namespace detail {
// The stream of an error being raised: its destructor throws tvm::ffi::Error
// (kind, message, backtrace of the raising line), as TVM_FFI_THROW's builder
// does, but compiled once per module instead of once per translation unit.
class ErrorStream {
 public:
  OPB_RT_ ErrorStream(const char* kind, const char* file, int line, const char* func);
  [[noreturn]] OPB_RT_ ~ErrorStream() noexcept(false);
  ErrorStream(const ErrorStream&) = delete;
  ErrorStream& operator=(const ErrorStream&) = delete;
  std::ostringstream& stream() { return stream_; }

 private:
  std::string kind_;
  std::string backtrace_;
  std::ostringstream stream_;
};
}  // namespace detail

#if defined(__CUDACC__)
#define OPB_THROW(Kind) TVM_FFI_THROW(Kind)
#else
#define OPB_THROW(Kind) ::opbridge::detail::ErrorStream(#Kind, __FILE__, __LINE__, TVM_FFI_FUNC_SIG).stream()
#endif

// The checks: the test inline (a kernel call runs a dozen of them), the message
// and the throw out of line (detail::fail_*, compiled once per module).
namespace detail {
[[noreturn]] OPB_RT_ void fail_dtype(const char* op, const char* arg, const TensorView& t,
                                     std::initializer_list<DLDataType> allowed);
[[noreturn]] OPB_RT_ void fail_same_dtype(const char* op, const char* arg, const TensorView& t,
                                          const char* ref_arg, const TensorView& ref);
[[noreturn]] OPB_RT_ void fail_device(const char* op, const char* arg, const TensorView& t, int device_type);
[[noreturn]] OPB_RT_ void fail_same_device(const char* op, const char* arg, const TensorView& t,
                                           const char* ref_arg, const TensorView& ref);
[[noreturn]] OPB_RT_ void fail_ndim(const char* op, const char* arg, const TensorView& t, int ndim);
[[noreturn]] OPB_RT_ void fail_min_ndim(const char* op, const char* arg, const TensorView& t, int ndim);
[[noreturn]] OPB_RT_ void fail_size(const char* op, const char* arg, const TensorView& t, int dim,
                                    int64_t expected, const char* why);
[[noreturn]] OPB_RT_ void fail_same_shape(const char* op, const char* arg, const TensorView& t,
                                          const char* ref_arg, const TensorView& ref);
[[noreturn]] OPB_RT_ void fail_contiguous(const char* op, const char* arg, const TensorView& t);
[[noreturn]] OPB_RT_ void fail_disjoint(const char* op, const char* arg, const char* other_arg);
}  // namespace detail

inline void check_dtype(const char* op, const char* arg, const TensorView& t,
                        std::initializer_list<DLDataType> allowed) {
  for (DLDataType d : allowed) {
    if (t.dtype() == d) return;
  }
  detail::fail_dtype(op, arg, t, allowed);
}

inline void check_same_dtype(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                             const TensorView& ref) {
  if (t.dtype() != ref.dtype()) detail::fail_same_dtype(op, arg, t, ref_arg, ref);
}

inline void check_device(const char* op, const char* arg, const TensorView& t, int device_type) {
  if (t.device().device_type != device_type) detail::fail_device(op, arg, t, device_type);
}

inline void check_same_device(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                              const TensorView& ref) {
  if (t.device().device_type != ref.device().device_type || t.device().device_id != ref.device().device_id) {
    detail::fail_same_device(op, arg, t, ref_arg, ref);
  }
}

// Device checks in one form for a kernel's CPU and GPU twins (the headers
// under ops/ run them, so both kernels check in the same order): `anchor` is
// checked with check_device against the kernel's device type first; every
// other tensor must then be on the CPU too (CPU kernels) or on the anchor's
// very device, type and id (GPU kernels).
inline void check_device_like(const char* op, int device_type, const char* arg, const TensorView& t,
                              const char* anchor_arg, const TensorView& anchor) {
  if (device_type == kDLCPU) {
    check_device(op, arg, t, kDLCPU);
  } else {
    check_same_device(op, arg, t, anchor_arg, anchor);
  }
}

inline void check_ndim(const char* op, const char* arg, const TensorView& t, int ndim) {
  if (t.ndim() != ndim) detail::fail_ndim(op, arg, t, ndim);
}

inline void check_min_ndim(const char* op, const char* arg, const TensorView& t, int ndim) {
  if (t.ndim() < ndim) detail::fail_min_ndim(op, arg, t, ndim);
}

inline void check_size(const char* op, const char* arg, const TensorView& t, int dim, int64_t expected,
                       const char* why) {
  const int d = dim < 0 ? dim + t.ndim() : dim;
  if (d < 0 || d >= t.ndim() || t.size(d) != expected) detail::fail_size(op, arg, t, dim, expected, why);
}

inline void check_same_shape(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                             const TensorView& ref) {
  bool same = t.ndim() == ref.ndim();
  for (int i = 0; same && i < t.ndim(); ++i) same = t.size(i) == ref.size(i);
  if (!same) detail::fail_same_shape(op, arg, t, ref_arg, ref);
}

inline void check_contiguous(const char* op, const char* arg, const TensorView& t) {
  if (!t.IsContiguous()) detail::fail_contiguous(op, arg, t);
}

// A mutated tensor must not share memory with another argument: the result would
// depend on the order of a kernel's reads and writes, and validated inputs could
// change under it. Empty tensors overlap nothing.
inline void check_disjoint(const char* op, const char* arg, const TensorView& t, const char* other_arg,
                           const TensorView& other) {
  auto span = [](const TensorView& v, const char*& begin, const char*& end) {
    begin = static_cast<const char*>(v.data_ptr()) + v.byte_offset();
    end = begin + v.numel() * ((v.dtype().bits * v.dtype().lanes + 7) / 8);
  };
  const char *b0, *e0, *b1, *e1;
  span(t, b0, e0);
  span(other, b1, e1);
  if (!(b0 == e0 || b1 == e1 || e0 <= b1 || e1 <= b0)) detail::fail_disjoint(op, arg, other_arg);
}

// The macros stringise the C++ variable name, which by convention is the
// schema's argument name, so messages match what the Python user wrote.
#define OPB_CHECK_DTYPE(op, t, ...) ::opbridge::check_dtype(op, #t, t, {__VA_ARGS__})
// The floating dtypes, as OPB_DISPATCH_FLOATING dispatches them.
#define OPB_CHECK_FLOATING(op, t)                                                                    \
  ::opbridge::check_dtype(op, #t, t,                                                                 \
                          {::opbridge::kFloat32, ::opbridge::kFloat16, ::opbridge::kBFloat16, \
                           ::opbridge::kFloat64})
#define OPB_CHECK_SAME_DTYPE(op, t, ref) ::opbridge::check_same_dtype(op, #t, t, #ref, ref)
#define OPB_CHECK_DEVICE(op, t, device_type) ::opbridge::check_device(op, #t, t, device_type)
#define OPB_CHECK_SAME_DEVICE(op, t, ref) ::opbridge::check_same_device(op, #t, t, #ref, ref)
#define OPB_CHECK_DEVICE_LIKE(op, device_type, t, anchor) \
  ::opbridge::check_device_like(op, device_type, #t, t, #anchor, anchor)
#define OPB_CHECK_NDIM(op, t, n) ::opbridge::check_ndim(op, #t, t, n)
#define OPB_CHECK_MIN_NDIM(op, t, n) ::opbridge::check_min_ndim(op, #t, t, n)
#define OPB_CHECK_SIZE(op, t, dim, expected, why) \
  ::opbridge::check_size(op, #t, t, dim, expected, why)
#define OPB_CHECK_SAME_SHAPE(op, t, ref) ::opbridge::check_same_shape(op, #t, t, #ref, ref)
#define OPB_CHECK_CONTIGUOUS(op, t) ::opbridge::check_contiguous(op, #t, t)
// A user-facing condition with a custom message: OPB_CHECK(cond, ValueError) << "op: ...";
// (if/else form so that a following `else` cannot bind to the macro's `if`.)
#define OPB_CHECK(cond, Kind) \
  if (TVM_FFI_PREDICT_TRUE(cond)) {  \
  } else                             \
    OPB_THROW(Kind)

// ---------------------------------------------------------------------------
// dtype dispatch
// ---------------------------------------------------------------------------
//
// OPB_DISPATCH_FLOATING(op, dtype, scalar_t, [&] { ... }) runs the lambda with
// scalar_t the storage type of `dtype`: float (float32), opbridge::half
// (float16), opbridge::bfloat16, double (float64). The 16-bit types compute in
// float32; compute in compute_t<scalar_t> (float, or double for float64) with
// to_compute / from_compute, and float64 keeps its precision.
// OPB_DISPATCH_FLOATING_AND_INT adds int32_t and int64_t.
//
// For a kernel that takes exactly its declared dtypes (Library.op(dtypes=...)),
// one call covers them, whatever the list:
//   opbridge::dispatch<float, double, int64_t>(op, x.dtype(), [&](auto tag) {
//     using T = typename decltype(tag)::type;
//     ...
//   });
// An other dtype raises TypeError "<op>: unsupported dtype <name> (expected ...)".

// The dtype of a storage type dispatch knows.
template <typename T>
constexpr DLDataType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
                    std::is_same_v<T, bfloat16> || std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t> ||
                    std::is_same_v<T, bool>,
                "dispatch knows float, double, half, bfloat16, int32_t, int64_t and bool");
  if constexpr (std::is_same_v<T, bool>) return kBool;
  else if constexpr (std::is_same_v<T, float>) return kFloat32;
  else if constexpr (std::is_same_v<T, double>) return kFloat64;
  else if constexpr (std::is_same_v<T, half>) return kFloat16;
  else if constexpr (std::is_same_v<T, bfloat16>) return kBFloat16;
  else if constexpr (std::is_same_v<T, int32_t>) return kInt32;
  else return kInt64;
}

template <typename T>
struct type_tag {
  using type = T;
};

namespace detail {
[[noreturn]] OPB_RT_ void throw_unsupported_dtype(const char* op, DLDataType got, const DLDataType* expected,
                                                  size_t n);
template <typename... Ts>
[[noreturn]] inline void throw_unsupported(const char* op, DLDataType got) {
  static constexpr DLDataType expected[] = {dtype_of<Ts>()...};
  throw_unsupported_dtype(op, got, expected, sizeof...(Ts));
}
}  // namespace detail

// f(type_tag<T>{}) for the T in Ts whose dtype is `dtype`; f's result type must not depend on T.
template <typename... Ts, typename F>
inline auto dispatch(const char* op, DLDataType dtype, F&& f) {
  using R = decltype(f(type_tag<std::tuple_element_t<0, std::tuple<Ts...>>>{}));
  if constexpr (std::is_void_v<R>) {
    const bool hit = ((dtype == dtype_of<Ts>() ? (f(type_tag<Ts>{}), true) : false) || ...);
    if (!hit) detail::throw_unsupported<Ts...>(op, dtype);
  } else {
    R r{};
    const bool hit = ((dtype == dtype_of<Ts>() ? (r = f(type_tag<Ts>{}), true) : false) || ...);
    if (!hit) detail::throw_unsupported<Ts...>(op, dtype);
    return r;
  }
}

#define OPB_UNPAREN_(...) __VA_ARGS__
// The lambda comes last, as __VA_ARGS__: its body may hold unparenthesised commas.
#define OPB_DISPATCH_TYPES_(types, op, dtype, scalar_t, ...)                    \
  ::opbridge::dispatch<OPB_UNPAREN_ types>(op, dtype, [&](auto _opb_tag) {     \
    using scalar_t = typename decltype(_opb_tag)::type;                         \
    return __VA_ARGS__();                                                       \
  })

#define OPB_DISPATCH_FLOATING(op, dtype, scalar_t, ...)                                                  \
  OPB_DISPATCH_TYPES_((float, ::opbridge::half, ::opbridge::bfloat16, double), op, dtype, scalar_t, \
                      __VA_ARGS__)

#define OPB_DISPATCH_FLOATING_AND_INT(op, dtype, scalar_t, ...)                                          \
  OPB_DISPATCH_TYPES_((float, ::opbridge::half, ::opbridge::bfloat16, double, int32_t, int64_t), op,    \
                      dtype, scalar_t, __VA_ARGS__)

// ---------------------------------------------------------------------------
// threading policy
// ---------------------------------------------------------------------------

// Below this many elements a kernel runs on the calling thread: waking an
// OpenMP team costs microseconds and, beside a competing process, a parked
// worker can cost milliseconds. Above it the work is split across threads.
constexpr int64_t kParallelGrain = 1 << 16;

// ---------------------------------------------------------------------------
// export: any number of source files export into one module
// ---------------------------------------------------------------------------

namespace detail {

// The argument types OPBRIDGE_EXPORT converts with the out-of-line helpers
// below; a kernel with any other argument type, or a return value, goes
// through tvm-ffi's own typed call (the same conversions and messages, compiled
// in its translation unit).
enum class ArgKind : int { kOther, kTensor, kOptionalTensor, kFloat64, kFloat32, kInt64, kInt32, kBool };

template <typename T>
constexpr ArgKind arg_kind() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_same_v<U, TensorView>) return ArgKind::kTensor;
  else if constexpr (std::is_same_v<U, Optional<TensorView>>) return ArgKind::kOptionalTensor;
  else if constexpr (std::is_same_v<U, double>) return ArgKind::kFloat64;
  else if constexpr (std::is_same_v<U, float>) return ArgKind::kFloat32;
  else if constexpr (std::is_same_v<U, int64_t>) return ArgKind::kInt64;
  else if constexpr (std::is_same_v<U, int32_t>) return ArgKind::kInt32;
  else if constexpr (std::is_same_v<U, bool>) return ArgKind::kBool;
  else return ArgKind::kOther;
}

// An exported kernel, for the messages of a wrong call.
struct ExportSite {
  const char* name;
  const ArgKind* kinds;
  int32_t num_args;
};

OPB_RT_ TensorView arg_tensor(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ Optional<TensorView> arg_optional_tensor(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ double arg_float64(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ float arg_float32(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ int64_t arg_int64(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ int32_t arg_int32(const TVMFFIAny* args, int32_t i, const ExportSite& site);
OPB_RT_ bool arg_bool(const TVMFFIAny* args, int32_t i, const ExportSite& site);
[[noreturn]] OPB_RT_ void throw_num_args(const ExportSite& site, int32_t num_args);
// In a catch block: records the exception being handled as the call's error
// (tvm-ffi's TVM_FFI_SAFE_CALL_END) and returns -1.
OPB_RT_ int raise_current();

// Argument i as T: the everyday cases inline (a tensor, a Python float or int),
// every other conversion, and the mismatch error, out of line with tvm-ffi's rules.
template <typename T>
inline T arg(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  constexpr ArgKind kind = arg_kind<T>();
  const TVMFFIAny& a = args[i];
  if constexpr (kind == ArgKind::kTensor) {
    if (a.type_index == kTVMFFIDLTensorPtr) return TensorView(static_cast<DLTensor*>(a.v_ptr));
    if (a.type_index == kTVMFFITensor) return TensorView(TVMFFITensorGetDLTensorPtr(a.v_obj));
    return arg_tensor(args, i, site);
  } else if constexpr (kind == ArgKind::kOptionalTensor) {
    return arg_optional_tensor(args, i, site);
  } else if constexpr (kind == ArgKind::kFloat64) {
    return a.type_index == kTVMFFIFloat ? a.v_float64 : arg_float64(args, i, site);
  } else if constexpr (kind == ArgKind::kFloat32) {
    return arg_float32(args, i, site);
  } else if constexpr (kind == ArgKind::kInt64) {
    return a.type_index == kTVMFFIInt ? a.v_int64 : arg_int64(args, i, site);
  } else if constexpr (kind == ArgKind::kInt32) {
    return arg_int32(args, i, site);
  } else {
    return a.type_index == kTVMFFIBool ? a.v_int64 != 0 : arg_bool(args, i, site);
  }
}

template <typename... Args, size_t... Is>
inline void call_unpacked(void (*f)(Args...), const TVMFFIAny* args, const ExportSite& site,
                          std::index_sequence<Is...>) {
  f(arg<Args>(args, int32_t(Is), site)...);
}

// The body of OPBRIDGE_EXPORT's `__tvm_ffi_<name>` (tvm-ffi's safe-call ABI).
template <typename R, typename... Args>
inline int call_export(const char* name, R (*f)(Args...), const TVMFFIAny* args, int32_t num_args,
                       TVMFFIAny* result) {
  if constexpr (std::is_void_v<R> && ((arg_kind<Args>() != ArgKind::kOther) && ...)) {
    static constexpr ArgKind kinds[] = {arg_kind<Args>()..., ArgKind::kOther};
    const ExportSite site{name, kinds, int32_t(sizeof...(Args))};
    try {
      if (num_args != int32_t(sizeof...(Args))) throw_num_args(site, num_args);
      call_unpacked(f, args, site, std::index_sequence_for<Args...>{});
      return 0;
    } catch (...) {
      return raise_current();
    }
  } else {
    TVM_FFI_SAFE_CALL_BEGIN();
    static const std::string fn_name = name;
    ::tvm::ffi::detail::unpack_call<R>(std::index_sequence_for<Args...>{}, &fn_name, f,
                                       reinterpret_cast<const ::tvm::ffi::AnyView*>(args), num_args,
                                       reinterpret_cast<::tvm::ffi::Any*>(result));
    TVM_FFI_SAFE_CALL_END();
  }
}

}  // namespace detail

#define OPB_CONCAT_INNER_(a, b) a##b
#define OPB_CONCAT_(a, b) OPB_CONCAT_INNER_(a, b)

// OPBRIDGE_EXPORT(fn) exports `fn` under its own name into the module being
// built (the symbol `__tvm_ffi_<fn>` that tvm-ffi's loader looks up) and
// records it in the module's export list (see `__opbridge_exports`, defined by
// the build in a generated translation unit).
#if defined(__CUDACC__)
#define OPB_EXPORT_SYMBOL_(fn) TVM_FFI_DLL_EXPORT_TYPED_FUNC(fn, fn)
#else
#define OPB_EXPORT_SYMBOL_(fn)                                                                  \
  extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_##fn(void*, const TVMFFIAny* args, int32_t num_args, \
                                                   TVMFFIAny* result) {                          \
    return ::opbridge::detail::call_export(#fn, fn, args, num_args, result);                    \
  }
#endif
#define OPBRIDGE_EXPORT(fn)                                                                 \
  OPB_EXPORT_SYMBOL_(fn);                                                                   \
  [[maybe_unused]] static const int OPB_CONCAT_(_opb_export_, fn) =                         \
      ::opbridge::detail::ExportList::Global().add(#fn)

}  // namespace opbridge

#if !defined(OPB_SEPARATE_RUNTIME) || defined(OPB_RUNTIME_IMPL) || defined(__CUDACC__)
#include "opbridge/runtime_impl.h"
#endif
