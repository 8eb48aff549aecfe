// opbridge kernel headers: dtype dispatch (OPB_DISPATCH_FLOATING and friends).
// A section of opbridge/opbridge.h, which kernels include (it also brings the
// runtime these declare; see opbridge/runtime_impl.h).
#pragma once

#include "opbridge/checks.h"

namespace opbridge {

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

}  // namespace opbridge
