// gelu (tanh approximation) and its backward on CUDA; same formulation as gelu.cc:
//   gelu(x) = x s(z),  s = sigmoid,  z = 2 sqrt(2/pi) (x + 0.044715 x^3)
// which equals 0.5 x (1 + tanh(z / 2)) without the tanh form's cancellation
// on the negative tail (see gelu.cc for the measurements).
#include <opbridge/activation_math.h>
#include <opbridge/cuda.h>
#include <opbridge/cuda_map.h>
#include <opbridge/ops/gelu.h>

namespace {

using opbridge::TensorView;
namespace am = opbridge::act_math;
using Math = opbridge::cuda::Math;

struct Gelu {
  template <typename C>  // float, or double for float64
  __device__ C operator()(C v) const {
    return am::gelu_tanh<Math>(v);
  }
};

// x clamped to [-9.65, 20] (float; [-21, 20] in double) so that e = exp(-z)
// stays finite and x dz/dx (~x^3) does not overflow (activation_math.h's kGeluGrad*).
struct GeluBackward {
  template <typename C>
  __device__ C operator()(C g, C v) const {
    return am::gelu_tanh_backward<Math>(g, v);
  }
};

}  // namespace

void gelu_cuda(TensorView out, TensorView x) {
  const char* op = "gelu";
  opbridge::gelu::check_forward(op, kDLCUDA, out, x);

  const int64_t n = x.numel();
  if (n == 0) return;
  opbridge::cuda::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = opbridge::cuda::device_t<S>;
    opbridge::cuda::map(ctx, opbridge::data_ptr<T>(out), opbridge::data_ptr<const T>(x), n, Gelu{});
  });
}
OPBRIDGE_EXPORT(gelu_cuda);

void gelu_backward_cuda(TensorView grad_x, TensorView grad, TensorView x) {
  const char* op = "gelu_backward";
  opbridge::gelu::check_backward(op, kDLCUDA, grad_x, grad, x);

  const int64_t n = x.numel();
  if (n == 0) return;
  opbridge::cuda::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = opbridge::cuda::device_t<S>;
    opbridge::cuda::map(ctx, opbridge::data_ptr<T>(grad_x), opbridge::data_ptr<const T>(grad),
                        opbridge::data_ptr<const T>(x), n, GeluBackward{});
  });
}
OPBRIDGE_EXPORT(gelu_backward_cuda);
