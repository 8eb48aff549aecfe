// Argument checks of silu_and_mul / gelu_and_mul and their backward ops shared by
// their CPU and CUDA kernels, device checks included (device: kDLCPU or kDLCUDA;
// see check_device_like). Errors name the op and the argument.
#pragma once

#include <opbridge/opbridge.h>

#include <cstdint>

namespace opbridge {
namespace activation_and_mul {

// x: (..., 2d) floating, contiguous. Returns d.
inline int64_t check_x(const char* op, const TensorView& x) {
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_MIN_NDIM(op, x, 1);
  const int64_t two_d = x.size(x.ndim() - 1);
  OPB_CHECK(two_d % 2 == 0, ValueError)
      << op << ": x's last dim must be even (it holds the halves [a | b]), got shape "
      << opbridge::shape_str(x);
  OPB_CHECK_CONTIGUOUS(op, x);
  return two_d / 2;
}

// t has x's shape with the last dim halved.
inline void check_half_shape(const char* op, const char* arg, const TensorView& t, const TensorView& x) {
  bool ok = t.ndim() == x.ndim();
  for (int i = 0; ok && i + 1 < t.ndim(); ++i) ok = t.size(i) == x.size(i);
  ok = ok && t.size(t.ndim() - 1) * 2 == x.size(x.ndim() - 1);
  OPB_CHECK(ok, ValueError) << op << ": " << arg << " must have x's shape with the last dim halved (x: "
                            << opbridge::shape_str(x) << "), got " << opbridge::shape_str(t);
}

// out: (..., d), x's dtype, contiguous.
inline void check_out(const char* op, const TensorView& out, const TensorView& x) {
  OPB_CHECK_SAME_DTYPE(op, out, x);
  check_half_shape(op, "out", out, x);
  OPB_CHECK_CONTIGUOUS(op, out);
}

// The backward's grad is shaped like out, grad_x like x.
inline void check_grads(const char* op, const TensorView& grad_x, const TensorView& grad,
                        const TensorView& x) {
  OPB_CHECK_SAME_DTYPE(op, grad, x);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  check_half_shape(op, "grad", grad, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_CONTIGUOUS(op, grad);
  OPB_CHECK_CONTIGUOUS(op, grad_x);
}

// The forward, (out, x); returns d.
inline int64_t check_forward(const char* op, int device, const TensorView& out, const TensorView& x) {
  OPB_CHECK_DEVICE(op, x, device);
  const int64_t d = check_x(op, x);
  OPB_CHECK_DEVICE_LIKE(op, device, out, x);
  check_out(op, out, x);
  return d;
}

// The backward, (grad_x, grad, x); returns d.
inline int64_t check_backward(const char* op, int device, const TensorView& grad_x, const TensorView& grad,
                              const TensorView& x) {
  OPB_CHECK_DEVICE(op, x, device);
  const int64_t d = check_x(op, x);
  OPB_CHECK_DEVICE_LIKE(op, device, grad, x);
  OPB_CHECK_DEVICE_LIKE(op, device, grad_x, x);
  check_grads(op, grad_x, grad, x);
  return d;
}

}  // namespace activation_and_mul
}  // namespace opbridge

// Defines and exports the four kernels of one device form, <op>_<suffix>: the
// including file provides act_and_mul<Act>(op, out, x) and
// act_and_mul_backward<Act>(op, grad_x, grad, x) and the activation types Silu
// and GeluTanh. One list for the CPU and CUDA forms, so their names and
// signatures cannot drift apart.
#define OPB_EXPORT_ACTIVATION_AND_MUL(suffix)                                              \
  void silu_and_mul_##suffix(::opbridge::TensorView out, ::opbridge::TensorView x) {       \
    act_and_mul<Silu>("silu_and_mul", out, x);                                             \
  }                                                                                        \
  OPBRIDGE_EXPORT(silu_and_mul_##suffix);                                                  \
  void gelu_and_mul_##suffix(::opbridge::TensorView out, ::opbridge::TensorView x) {       \
    act_and_mul<GeluTanh>("gelu_and_mul", out, x);                                         \
  }                                                                                        \
  OPBRIDGE_EXPORT(gelu_and_mul_##suffix);                                                  \
  void silu_and_mul_backward_##suffix(::opbridge::TensorView grad_x, ::opbridge::TensorView grad, \
                                      ::opbridge::TensorView x) {                          \
    act_and_mul_backward<Silu>("silu_and_mul_backward", grad_x, grad, x);                  \
  }                                                                                        \
  OPBRIDGE_EXPORT(silu_and_mul_backward_##suffix);                                         \
  void gelu_and_mul_backward_##suffix(::opbridge::TensorView grad_x, ::opbridge::TensorView grad, \
                                      ::opbridge::TensorView x) {                          \
    act_and_mul_backward<GeluTanh>("gelu_and_mul_backward", grad_x, grad, x);              \
  }                                                                                        \
  OPBRIDGE_EXPORT(gelu_and_mul_backward_##suffix)
