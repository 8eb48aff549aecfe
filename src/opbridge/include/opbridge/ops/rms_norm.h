// Argument checks of rms_norm and rms_norm_backward shared by their CPU and CUDA kernels,
// device checks included (device: kDLCPU or kDLCUDA; see check_device_like). Errors name
// the op and the argument.
#pragma once

#include <opbridge/opbridge.h>

#include <cstdint>

namespace opbridge {
namespace rms_norm {

// x (..., H) and weight (H,) of one floating dtype, contiguous, and eps; returns H. With
// *x_rows*, x may be rows at a stride (rms_norm declares it row_strided: vLLM's q-norm reads
// per-head views of a query sliced out of qkv), which the caller checks with strided_rows.
inline int64_t check_x_weight_eps(const char* op, const TensorView& x, const TensorView& weight, double eps,
                                  bool x_rows = false) {
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, weight, x);
  OPB_CHECK_MIN_NDIM(op, x, 1);
  OPB_CHECK_NDIM(op, weight, 1);
  const int64_t H = x.size(x.ndim() - 1);
  OPB_CHECK_SIZE(op, weight, 0, H, "x's last dim");
  if (!x_rows) OPB_CHECK_CONTIGUOUS(op, x);  // else the caller reads x through strided_rows
  OPB_CHECK_CONTIGUOUS(op, weight);
  // !(eps >= 0) also rejects NaN.
  OPB_CHECK(eps >= 0, ValueError) << op << ": eps must be >= 0, got " << eps;
  return H;
}

inline void check_out(const char* op, const TensorView& out, const TensorView& x) {
  OPB_CHECK_SAME_DTYPE(op, out, x);
  OPB_CHECK_SAME_SHAPE(op, out, x);
  OPB_CHECK_CONTIGUOUS(op, out);
}

// rms_norm_backward's grad and grad_x are like x, grad_weight like weight.
inline void check_grads(const char* op, const TensorView& grad_x, const TensorView& grad_weight,
                        const TensorView& grad, const TensorView& x, const TensorView& weight) {
  OPB_CHECK_SAME_DTYPE(op, grad, x);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  OPB_CHECK_SAME_DTYPE(op, grad_weight, weight);
  OPB_CHECK_SAME_SHAPE(op, grad, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_SAME_SHAPE(op, grad_weight, weight);
  OPB_CHECK_CONTIGUOUS(op, grad);
  OPB_CHECK_CONTIGUOUS(op, grad_x);
  OPB_CHECK_CONTIGUOUS(op, grad_weight);
}

// rms_norm(out, x, weight, eps); returns x's rows of H = the result's width (x may be rows at a
// stride: the kernel reads row r at x + offset(r)).
inline StridedRows check_forward(const char* op, int device, const TensorView& out, const TensorView& x,
                                 const TensorView& weight, double eps) {
  OPB_CHECK_DEVICE(op, x, device);
  OPB_CHECK_DEVICE_LIKE(op, device, weight, x);
  const int64_t H = check_x_weight_eps(op, x, weight, eps, /*x_rows=*/true);
  const StridedRows rows = strided_rows(op, "x", x, H);
  OPB_CHECK_DEVICE_LIKE(op, device, out, x);
  check_out(op, out, x);
  return rows;
}

// rms_norm_backward(grad_x, grad_weight, grad, x, weight, eps); returns H.
inline int64_t check_backward(const char* op, int device, const TensorView& grad_x, const TensorView& grad_weight,
                              const TensorView& grad, const TensorView& x, const TensorView& weight, double eps) {
  OPB_CHECK_DEVICE(op, x, device);
  OPB_CHECK_DEVICE_LIKE(op, device, weight, x);
  const int64_t H = check_x_weight_eps(op, x, weight, eps);
  OPB_CHECK_DEVICE_LIKE(op, device, grad, x);
  OPB_CHECK_DEVICE_LIKE(op, device, grad_x, x);
  OPB_CHECK_DEVICE_LIKE(op, device, grad_weight, x);
  check_grads(op, grad_x, grad_weight, grad, x, weight);
  return H;
}

}  // namespace rms_norm
}  // namespace opbridge
