// Argument checks of add shared by its CPU and CUDA kernels, device checks
// included (device: kDLCPU or kDLCUDA; see check_device_like). Errors name the
// op and the argument.
#pragma once

#include <opbridge/opbridge.h>

#include <type_traits>

namespace opbridge {
namespace add {

// One element: integers wrap around (as NumPy and torch), through unsigned
// arithmetic since signed overflow is undefined; floats add as they are.
template <typename C>
OPB_HOST_DEVICE C sum(C a, C b) {
  if constexpr (std::is_integral_v<C>) {
    using U = std::make_unsigned_t<C>;
    return C(U(a) + U(b));
  } else {
    return a + b;
  }
}

// sum as a functor for the elementwise maps of math.h (CPU) and cuda.h.
struct Sum {
  template <typename C>
  OPB_HOST_DEVICE C operator()(C a, C b) const {
    return sum(a, b);
  }
};

// Same dtype and shape, no broadcasting.
inline void check_tensors(const char* op, int device, const TensorView& out, const TensorView& x,
                          const TensorView& y) {
  OPB_CHECK_DEVICE(op, x, device);
  OPB_CHECK_DEVICE_LIKE(op, device, y, x);
  OPB_CHECK_DEVICE_LIKE(op, device, out, x);
  OPB_CHECK_DTYPE(op, x, opbridge::kFloat32, opbridge::kFloat16, opbridge::kBFloat16, opbridge::kFloat64,
                  opbridge::kInt32, opbridge::kInt64);
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
