// Argument checks of fused_add_rms_norm shared by its CPU and CUDA kernels, device
// checks included (device: kDLCPU or kDLCUDA; see check_device_like). Errors name
// the op and the argument.
#pragma once

#include <opbridge/opbridge.h>

#include <cstdint>

namespace opbridge {
namespace fused_add_rms_norm {

// input and residual (..., H), weight (H,), eps; returns H.
inline int64_t check_args(const char* op, int device, const TensorView& input, const TensorView& residual,
                          const TensorView& weight, double eps) {
  OPB_CHECK_DEVICE(op, input, device);
  OPB_CHECK_DEVICE_LIKE(op, device, residual, input);
  OPB_CHECK_DEVICE_LIKE(op, device, weight, input);
  OPB_CHECK_FLOATING(op, input);
  OPB_CHECK_SAME_DTYPE(op, residual, input);
  OPB_CHECK_SAME_DTYPE(op, weight, input);
  OPB_CHECK_MIN_NDIM(op, input, 1);
  OPB_CHECK_SAME_SHAPE(op, residual, input);
  OPB_CHECK_NDIM(op, weight, 1);
  const int64_t H = input.size(input.ndim() - 1);
  OPB_CHECK_SIZE(op, weight, 0, H, "input's last dim");
  OPB_CHECK_CONTIGUOUS(op, input);
  OPB_CHECK_CONTIGUOUS(op, residual);
  OPB_CHECK_CONTIGUOUS(op, weight);
  // !(eps >= 0) also rejects NaN.
  OPB_CHECK(eps >= 0, ValueError) << op << ": eps must be >= 0, got " << eps;
  // Both are written in place, so neither may alias another argument.
  // all three are contiguous (checked above): their spans decide
  opbridge::check_disjoint(op, "input", input, "residual", residual, true, true);
  opbridge::check_disjoint(op, "input", input, "weight", weight, true, true);
  opbridge::check_disjoint(op, "residual", residual, "weight", weight, true, true);
  return H;
}

}  // namespace fused_add_rms_norm
}  // namespace opbridge
