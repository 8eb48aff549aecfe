// Argument checks of gelu and gelu_backward shared by their CPU and CUDA kernels,
// device checks included (device: kDLCPU or kDLCUDA; see check_device_like).
// Errors name the op and the argument.
#pragma once

#include <opbridge/opbridge.h>

namespace opbridge {
namespace gelu {

inline void check_forward(const char* op, int device, const TensorView& out, const TensorView& x) {
  OPB_CHECK_DEVICE(op, x, device);
  OPB_CHECK_DEVICE_LIKE(op, device, out, x);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, out, x);
  OPB_CHECK_SAME_SHAPE(op, out, x);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, out);
}

inline void check_backward(const char* op, int device, const TensorView& grad_x, const TensorView& grad,
                           const TensorView& x) {
  OPB_CHECK_DEVICE(op, grad, device);
  OPB_CHECK_DEVICE_LIKE(op, device, x, grad);
  OPB_CHECK_DEVICE_LIKE(op, device, grad_x, grad);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, grad, x);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  OPB_CHECK_SAME_SHAPE(op, grad, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_CONTIGUOUS(op, grad);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, grad_x);
}

}  // namespace gelu
}  // namespace opbridge
