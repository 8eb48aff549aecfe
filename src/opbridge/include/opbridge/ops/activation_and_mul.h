// Argument checks of silu_and_mul / gelu_and_mul and their backward ops shared by
// their CPU and CUDA kernels (device checks stay with each kernel). Errors name
// the op and the argument.
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

}  // namespace activation_and_mul
}  // namespace opbridge
