// gelu (tanh approximation) and its backward on CUDA; same formulation as gelu.cc:
//   gelu(x) = x s(z),  s = sigmoid,  z = 2 sqrt(2/pi) (x + 0.044715 x^3)
// which equals 0.5 x (1 + tanh(z / 2)) without the tanh form's cancellation
// on the negative tail (see gelu.cc for the measurements).
#include <opbridge/cuda.h>
#include <opbridge/ops/gelu.h>

namespace {

using opbridge::TensorView;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoeff = 0.044715f;

struct Gelu {
  __device__ float operator()(float v) const {
    const float z = 2.f * kSqrt2OverPi * v * (1.f + kCoeff * v * v);
    return v / (1.f + expf(-z));
  }
};

// d/dx [x s(z)] = s + x s (1 - s) dz/dx with 1 - s = e s, e = exp(-z); z is
// clamped at -80 so that e stays finite (the true value there is < 1e-33).
struct GeluBackward {
  __device__ float operator()(float g, float v) const {
    const float v2 = v * v;
    float z = 2.f * kSqrt2OverPi * v * (1.f + kCoeff * v2);
    z = z < -80.f ? -80.f : z;  // not fmaxf: NaN must propagate
    const float e = expf(-z);
    const float s = 1.f / (1.f + e);
    const float dz = 2.f * kSqrt2OverPi * (1.f + 3.f * kCoeff * v2);
    return g * (s + v * dz * (e * s) * s);
  }
};

}  // namespace

void gelu_cuda(TensorView out, TensorView x) {
  const char* op = "gelu";
  OPB_CHECK_DEVICE(op, x, kDLCUDA);
  OPB_CHECK_SAME_DEVICE(op, out, x);
  opbridge::gelu::check_forward(op, out, x);

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
  OPB_CHECK_DEVICE(op, grad, kDLCUDA);
  OPB_CHECK_SAME_DEVICE(op, x, grad);
  OPB_CHECK_SAME_DEVICE(op, grad_x, grad);
  opbridge::gelu::check_backward(op, grad_x, grad, x);

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
