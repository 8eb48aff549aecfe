// Bodies of the functions opbridge.h declares with OPB_RT_: the failing
// halves of the argument checks, the error stream behind OPB_THROW and the typed-call halves of
// OPBRIDGE_EXPORT. Included by opbridge.h itself (inline) unless the module is
// built by opbridge, which defines OPB_SEPARATE_RUNTIME and compiles this once
// per module in build/templates/runtime.cc (OPB_RUNTIME_IMPL): each kernel
// translation unit then no longer generates code for them (about 1.5 s of
// compile per unit, most of it tvm-ffi's typed-call and error machinery).
#pragma once

#include <opbridge/opbridge.h>
#include <tvm/ffi/dtype.h>

#include <iostream>
#include <optional>
#include <sstream>
#include <string>

namespace opbridge {

OPB_RT_ std::string dtype_name(DLDataType t) {
  if (t == kFloat32) return "float32";
  if (t == kFloat64) return "float64";
  if (t == kFloat16) return "float16";
  if (t == kBFloat16) return "bfloat16";
  if (t == kInt32) return "int32";
  if (t == kInt64) return "int64";
  if (t == kBool) return "bool";
  // Never throws: it builds error messages, and an exception thrown while OPB_THROW's stream is
  // being written would unwind through the stream's throwing destructor: std::terminate.
  // tvm-ffi has no name for complex types (DLPack's kDLComplex) and throws for them.
  if (t.code == kDLComplex && t.lanes == 1) return "complex" + std::to_string(int(t.bits));
  try {
    return std::string(tvm::ffi::DLDataTypeToString(t));  // int16, uint8, float8_e4m3fn, ...
  } catch (...) {
    return "dtype(code " + std::to_string(int(t.code)) + ", " + std::to_string(int(t.bits)) + " bits, " +
           std::to_string(int(t.lanes)) + " lanes)";
  }
}

OPB_RT_ std::string shape_str(const TensorView& t) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  if (t.ndim() == 1) os << ",";
  os << ")";
  return os.str();
}

namespace detail {

// The failing halves of the checks in opbridge.h: each builds its message and throws.

OPB_RT_ void fail_dtype(const char* op, const char* arg, const TensorView& t,
                        std::initializer_list<DLDataType> allowed) {
  std::ostringstream os;
  size_t i = 0;
  for (DLDataType d : allowed) {
    os << (i == 0 ? "" : (i + 1 == allowed.size() ? " or " : ", ")) << dtype_name(d);
    ++i;
  }
  OPB_THROW(TypeError) << op << ": " << arg << " must have dtype " << os.str() << ", got "
                       << dtype_name(t.dtype());
}

OPB_RT_ void fail_same_dtype(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                             const TensorView& ref) {
  OPB_THROW(TypeError) << op << ": " << arg << " must have the same dtype as " << ref_arg << " ("
                       << dtype_name(ref.dtype()) << "), got " << dtype_name(t.dtype());
}

OPB_RT_ void fail_device(const char* op, const char* arg, const TensorView& t, int device_type) {
  OPB_THROW(ValueError) << op << ": " << arg << " must be on " << device_name(device_type) << ", got "
                        << device_name(t.device().device_type);
}

OPB_RT_ void fail_same_device(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                              const TensorView& ref) {
  OPB_THROW(ValueError) << op << ": " << arg << " must be on the same device as " << ref_arg << " ("
                        << device_name(ref.device().device_type) << ":" << ref.device().device_id
                        << "), got " << device_name(t.device().device_type) << ":" << t.device().device_id;
}

OPB_RT_ void fail_ndim(const char* op, const char* arg, const TensorView& t, int ndim) {
  OPB_THROW(ValueError) << op << ": " << arg << " must be " << ndim << "-D, got shape " << shape_str(t);
}

OPB_RT_ void fail_min_ndim(const char* op, const char* arg, const TensorView& t, int ndim) {
  OPB_THROW(ValueError) << op << ": " << arg << " must have at least " << ndim << " dimension(s), got shape "
                        << shape_str(t);
}

OPB_RT_ void fail_size(const char* op, const char* arg, const TensorView& t, int dim, int64_t expected,
                       const char* why) {
  OPB_THROW(ValueError) << op << ": " << arg << " must have size " << expected << " in dim " << dim << " ("
                        << why << "), got shape " << shape_str(t);
}

OPB_RT_ void fail_same_shape(const char* op, const char* arg, const TensorView& t, const char* ref_arg,
                             const TensorView& ref) {
  OPB_THROW(ValueError) << op << ": " << arg << " must have the same shape as " << ref_arg << " "
                        << shape_str(ref) << ", got " << shape_str(t);
}

OPB_RT_ void fail_contiguous(const char* op, const char* arg, const TensorView& t) {
  OPB_THROW(ValueError) << op << ": " << arg << " must be contiguous, got shape " << shape_str(t)
                        << " with non-contiguous strides";
}

OPB_RT_ void fail_row_strided(const char* op, const char* arg, const TensorView& t) {
  std::ostringstream strides;
  for (int k = 0; k < t.ndim(); ++k) strides << (k ? ", " : "") << t.stride(k);
  OPB_THROW(ValueError) << op << ": " << arg << " must be contiguous, or rows at a stride (its dims after the "
                        << "first contiguous, rows at least that far apart), got shape " << shape_str(t)
                        << " with strides (" << strides.str() << ")";
}

OPB_RT_ void fail_disjoint(const char* op, const char* arg, const char* other_arg) {
  OPB_THROW(ValueError) << op << ": " << arg << " must not overlap " << other_arg
                        << " in memory; pass separate tensors";
}

}  // namespace detail

namespace detail {

OPB_RT_ ErrorStream::ErrorStream(const char* kind, const char* file, int line, const char* func)
    : kind_(kind) {
  const TVMFFIByteArray* bt = TVMFFIBacktrace(file, line, func, 0);
  backtrace_.assign(bt->data, bt->size);
}

OPB_RT_ ErrorStream::~ErrorStream() noexcept(false) {
  ::tvm::ffi::Error error(std::move(kind_), stream_.str(), std::move(backtrace_));
  if (TVM_FFI_ALWAYS_LOG_BEFORE_THROW) {
    std::cerr << error.FullMessage();
  }
  throw error;
}

OPB_RT_ void throw_unsupported_dtype(const char* op, DLDataType got, const DLDataType* expected, size_t n) {
  std::ostringstream os;
  for (size_t i = 0; i < n; ++i) os << (i == 0 ? "" : (i + 1 == n ? " or " : ", ")) << dtype_name(expected[i]);
  OPB_THROW(TypeError) << op << ": unsupported dtype " << dtype_name(got) << " (expected " << os.str() << ")";
  TVM_FFI_UNREACHABLE();
}

// tvm-ffi's name of an argument kind, as its own typed call prints it in errors.
inline std::string arg_kind_name(ArgKind kind) {
  using ::tvm::ffi::detail::Type2Str;
  switch (kind) {
    case ArgKind::kTensor: return Type2Str<TensorView>::v();
    case ArgKind::kOptionalTensor: return Type2Str<Optional<TensorView>>::v();
    case ArgKind::kFloat64: return Type2Str<double>::v();
    case ArgKind::kFloat32: return Type2Str<float>::v();
    case ArgKind::kInt64: return Type2Str<int64_t>::v();
    case ArgKind::kInt32: return Type2Str<int32_t>::v();
    case ArgKind::kBool: return Type2Str<bool>::v();
    default: return "?";
  }
}

// "name(0: T0, 1: T1) -> void", tvm-ffi's FunctionInfo::Sig() for the same function.
inline std::string export_signature(const ExportSite& site) {
  std::ostringstream os;
  os << site.name << "(";
  for (int32_t i = 0; i < site.num_args; ++i) os << (i ? ", " : "") << i << ": " << arg_kind_name(site.kinds[i]);
  os << ") -> void";
  return os.str();
}

OPB_RT_ void throw_num_args(const ExportSite& site, int32_t num_args) {
  TVM_FFI_THROW(TypeError) << "Mismatched number of arguments when calling: `" << export_signature(site)
                           << "`. Expected " << site.num_args << " but got " << num_args << " arguments";
}

template <typename T>
inline T convert_arg(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  const ::tvm::ffi::AnyView& view = reinterpret_cast<const ::tvm::ffi::AnyView*>(args)[i];
  std::optional<T> value = view.template try_cast<T>();
  if (!value.has_value()) {
    TVMFFIAny any_data = view.CopyToTVMFFIAny();
    TVM_FFI_THROW(TypeError) << "Mismatched type on argument #" << i << " when calling: `"
                             << export_signature(site) << "`. Expected `" << ::tvm::ffi::detail::Type2Str<T>::v()
                             << "` but got `" << ::tvm::ffi::TypeTraits<T>::GetMismatchTypeInfo(&any_data) << '`';
  }
  return *std::move(value);
}

OPB_RT_ TensorView arg_tensor(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<TensorView>(args, i, site);
}
OPB_RT_ Optional<TensorView> arg_optional_tensor(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<Optional<TensorView>>(args, i, site);
}
OPB_RT_ double arg_float64(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<double>(args, i, site);
}
OPB_RT_ float arg_float32(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<float>(args, i, site);
}
OPB_RT_ int64_t arg_int64(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<int64_t>(args, i, site);
}
OPB_RT_ int32_t arg_int32(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<int32_t>(args, i, site);
}
OPB_RT_ bool arg_bool(const TVMFFIAny* args, int32_t i, const ExportSite& site) {
  return convert_arg<bool>(args, i, site);
}

OPB_RT_ int raise_current() {
  try {
    throw;
  } catch (const ::tvm::ffi::Error& err) {
    ::tvm::ffi::detail::SetSafeCallRaised(err);
    return -1;
  } catch (const std::exception& ex) {
    ::tvm::ffi::detail::SetSafeCallRaised(::tvm::ffi::Error("InternalError", ex.what(), ""));
    return -1;
  }
}

}  // namespace detail
}  // namespace opbridge
