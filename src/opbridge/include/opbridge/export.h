// opbridge kernel headers: OPBRIDGE_EXPORT, any number of source files into one module.
// A section of opbridge/opbridge.h, which kernels include (it also brings the
// runtime these declare; see opbridge/runtime_impl.h).
#pragma once

#include "opbridge/checks.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/list.h>

#include <optional>
#include <string>
#include <vector>

namespace opbridge {

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

// The code of one argument type, for the module's signature list (export_list.h):
// a letter, after '?' for an optional value (Optional<T>, std::optional<T>) and
// '[' for a list (Array<T>, List<T>, std::vector<T>, Shape = "[l"), e.g. "?[l"
// for Optional<Array<int64_t>>. Letters: T tensor (TensorView or DLTensor*),
// O optional tensor, X / Y tvm-ffi's owning Tensor / Optional<Tensor> (which the
// C entries cannot pass: they hold views), d double, f float, l a 64-bit signed
// integer (int64_t, long long), i a 32-bit one (int32_t), n any other integer
// (unsigned, 16-bit, ...), b bool, s a string (String, std::string, const
// char*), a Any / AnyView, o anything else.
template <typename T>
constexpr char kind_letter() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  constexpr ArgKind kind = arg_kind<T>();
  if constexpr (std::is_same_v<U, ::tvm::ffi::Tensor>) return 'X';
  else if constexpr (std::is_same_v<U, Optional<::tvm::ffi::Tensor>>) return 'Y';
  else if constexpr (std::is_same_v<U, DLTensor*>) return 'T';
  else if constexpr (kind == ArgKind::kTensor) return 'T';
  else if constexpr (kind == ArgKind::kOptionalTensor) return 'O';
  else if constexpr (kind == ArgKind::kFloat64) return 'd';
  else if constexpr (kind == ArgKind::kFloat32) return 'f';
  else if constexpr (kind == ArgKind::kBool) return 'b';
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 8) return 'l';
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 4) return 'i';
  else if constexpr (std::is_integral_v<U>) return 'n';
  else if constexpr (std::is_same_v<U, ::tvm::ffi::String> || std::is_same_v<U, std::string> ||
                     std::is_same_v<U, const char*>) return 's';
  else if constexpr (std::is_same_v<U, ::tvm::ffi::Any> || std::is_same_v<U, ::tvm::ffi::AnyView>) return 'a';
  else return 'o';
}

template <typename T>
struct OptionalOf : std::false_type {};
template <typename E>
struct OptionalOf<Optional<E>> : std::true_type { using type = E; };
template <typename E>
struct OptionalOf<std::optional<E>> : std::true_type { using type = E; };

template <typename T>
struct ListOf : std::false_type {};
template <typename E>
struct ListOf<::tvm::ffi::Array<E>> : std::true_type { using type = E; };
template <typename E>
struct ListOf<::tvm::ffi::List<E>> : std::true_type { using type = E; };
template <typename E, typename A>
struct ListOf<std::vector<E, A>> : std::true_type { using type = E; };
template <>
struct ListOf<::tvm::ffi::Shape> : std::true_type { using type = int64_t; };

template <typename T>
std::string kind_code() {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (kind_letter<U>() != 'o') return std::string(1, kind_letter<U>());
  else if constexpr (OptionalOf<U>::value) return "?" + kind_code<typename OptionalOf<U>::type>();
  else if constexpr (ListOf<U>::value) return "[" + kind_code<typename ListOf<U>::type>();
  else return "o";
}

// "v:TTd" for void f(TensorView, TensorView, double): what the loader checks
// an exported kernel against before its first call.
template <typename R, typename... Args>
const char* signature_of(R (*)(Args...)) {
  static const std::string sig = (std::string(std::is_void_v<R> ? "v:" : "r:") + ... + kind_code<Args>());
  return sig.c_str();
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
      ::opbridge::detail::ExportList::Global().add(#fn, ::opbridge::detail::signature_of(&fn))

}  // namespace opbridge
