// opbridge kernel headers: argument checks, each raising a Python TypeError/ValueError.
// A section of opbridge/opbridge.h, which kernels include (it also brings the
// runtime these declare; see opbridge/runtime_impl.h).
#pragma once

#include "opbridge/byte_rows.h"
#include "opbridge/dtypes.h"

#include <cstdint>

namespace opbridge {

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
[[noreturn]] OPB_RT_ void fail_row_strided(const char* op, const char* arg, const TensorView& t);
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

// A tensor its op declares `row_strided` (opbridge.Library.op): contiguous, or
// rows at a stride -- at least two dims, those after the first C-contiguous,
// the first dim any stride at least that block apart, as vLLM's query and key,
// column slices of one qkv tensor. Returns that stride in elements (the
// block's size when the tensor is contiguous). The op-call core hands such an
// argument over as it is, where it densifies every other strided tensor
// (call.layout.row_strided).
inline int64_t row_stride(const char* op, const char* arg, const TensorView& t) {
  int64_t block = 1;
  for (int k = 1; k < t.ndim(); ++k) block *= t.size(k);
  if (t.ndim() == 0 || t.IsContiguous()) return block;
  if (!rows::accepts(t.ndim(), t.shape().data(), t.strides().data())) detail::fail_row_strided(op, arg, t);
  return t.size(0) <= 1 ? block : t.stride(0);
}

// A mutated tensor must not share memory with another argument: the result would
// depend on the order of a kernel's reads and writes, and validated inputs could
// change under it. Empty tensors overlap nothing. Exact for contiguous and
// row-strided tensors (vLLM's query and key, column slices of one qkv tensor,
// interleave without sharing an element); other layouts are judged by their spans.
// *t_dense*, *other_dense*: each tensor's IsContiguous(), where the caller has it (a kernel
// checking several pairs tests each tensor once).
inline void check_disjoint(const char* op, const char* arg, const TensorView& t, const char* other_arg,
                           const TensorView& other, bool t_dense, bool other_dense) {
  auto begin_of = [](const TensorView& v) {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data_ptr())) + int64_t(v.byte_offset());
  };
  auto item_of = [](const TensorView& v) { return int64_t((v.dtype().bits * v.dtype().lanes + 7) / 8); };
  const bool c0 = t_dense, c1 = other_dense;
  if (c0 && c1) {  // the common case: two spans (an empty one overlaps nothing)
    const int64_t b0 = begin_of(t), b1 = begin_of(other);
    const int64_t e0 = b0 + t.numel() * item_of(t), e1 = b1 + other.numel() * item_of(other);
    if (b0 == e0 || b1 == e1 || e0 <= b1 || e1 <= b0) return;
    detail::fail_disjoint(op, arg, other_arg);
  }
  if (t.numel() == 0 || other.numel() == 0) return;
  rows::ByteRows r0, r1;
  if (rows::of(t.ndim(), t.shape().data(), c0 ? nullptr : t.strides().data(), item_of(t), begin_of(t), &r0) &&
      rows::of(other.ndim(), other.shape().data(), c1 ? nullptr : other.strides().data(), item_of(other),
               begin_of(other), &r1)) {
    if (!rows::meet(r0, r1)) return;
    detail::fail_disjoint(op, arg, other_arg);
  }
  // Another layout: [begin, end) of every byte each reaches, strides included.
  auto span = [&](const TensorView& v, int64_t& begin, int64_t& end) {
    begin = begin_of(v);
    int64_t lo = 0, hi = 0;
    for (int k = 0; k < v.ndim(); ++k) (v.stride(k) < 0 ? lo : hi) += (v.size(k) - 1) * v.stride(k);
    end = begin + (hi + 1) * item_of(v);
    begin += lo * item_of(v);
  };
  int64_t b0, e0, b1, e1;
  span(t, b0, e0);
  span(other, b1, e1);
  if (e0 <= b1 || e1 <= b0) return;
  detail::fail_disjoint(op, arg, other_arg);
}

inline void check_disjoint(const char* op, const char* arg, const TensorView& t, const char* other_arg,
                           const TensorView& other) {
  check_disjoint(op, arg, t, other_arg, other, t.IsContiguous(), other.IsContiguous());
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

// The kernel's rows of `width` elements in a row_strided tensor: `per` of them
// (contiguous) at each index of its first dim, which is `stride` elements from
// the next. A kernel's rows must lie within the dims after the first (width
// divides their product): rotary_embedding's tokens, rms_norm's last dim.
struct StridedRows {
  int64_t stride, per, width;
  OPB_HOST_DEVICE int64_t offset(int64_t r) const {
    return per == 1 ? r * stride : (r / per) * stride + (r % per) * width;
  }
  // Whether the rows follow each other with no gap: one tensor's contiguous rows.
  OPB_HOST_DEVICE bool contiguous() const { return per == 1 && stride == width; }
};

// *dense*: t.IsContiguous(), where the caller has it.
inline StridedRows strided_rows(const char* op, const char* arg, const TensorView& t, int64_t width, bool dense) {
  if (dense || width <= 0) return StridedRows{width, 1, width};
  const int64_t stride = row_stride(op, arg, t);  // names any other layout (a strided 1-D one included)
  int64_t block = 1;
  for (int k = 1; k < t.ndim(); ++k) block *= t.size(k);
  OPB_CHECK(block % width == 0, RuntimeError)
      << op << ": " << arg << "'s rows of " << width << " elements do not lie within its dims after the first "
      << "(shape " << opbridge::shape_str(t) << "); a kernel may declare row_strided only for such arguments";
  return StridedRows{stride, block / width, width};
}

inline StridedRows strided_rows(const char* op, const char* arg, const TensorView& t, int64_t width) {
  return strided_rows(op, arg, t, width, t.ndim() == 0 || t.IsContiguous());
}

}  // namespace opbridge
