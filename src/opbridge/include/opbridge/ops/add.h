// Argument checks of add shared by its CPU and CUDA kernels, device checks
// included (device: kDLCPU or kDLCUDA; see check_device_like). Errors name the
// op and the argument.
#pragma once

#include <opbridge/opbridge.h>

namespace opbridge {
namespace add {

// Same dtype and shape, no broadcasting.
inline void check_tensors(const char* op, int device, const TensorView& out, const TensorView& x,
                          const TensorView& y) {
  OPB_CHECK_DEVICE(op, x, device);
  OPB_CHECK_DEVICE_LIKE(op, device, y, x);
  OPB_CHECK_DEVICE_LIKE(op, device, out, x);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, y, x);
  OPB_CHECK_SAME_DTYPE(op, out, x);
  OPB_CHECK_SAME_SHAPE(op, y, x);
  OPB_CHECK_SAME_SHAPE(op, out, x);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, y);
  OPB_CHECK_CONTIGUOUS(op, out);
}

}  // namespace add
}  // namespace opbridge
