// gelu (tanh approximation) and its backward.
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
#include <opbridge/math.h>
#include <opbridge/opbridge.h>

namespace {

using opbridge::TensorView;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoeff = 0.044715f;

// fast_tanh rather than libm tanhf: a scalar libm call per element would stop
// vectorisation and make the kernel compute-bound instead of memory-bound.
template <typename T>
OPB_TARGET_CLONES void gelu_chunk(T* out, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = opbridge::to_float(x[i]);
    const float t = opbridge::fast_tanh(kSqrt2OverPi * (v + kCoeff * v * v * v));
    out[i] = opbridge::from_float<T>(0.5f * v * (1.f + t));
  }
}

// d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx,  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
template <typename T>
OPB_TARGET_CLONES void gelu_backward_chunk(T* grad_x, const T* grad, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = opbridge::to_float(x[i]);
    const float v2 = v * v;
    const float t = opbridge::fast_tanh(kSqrt2OverPi * v * (1.f + kCoeff * v2));
    const float du = kSqrt2OverPi * (1.f + 3.f * kCoeff * v2);
    const float d = 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
    grad_x[i] = opbridge::from_float<T>(opbridge::to_float(grad[i]) * d);
  }
}

}  // namespace

void gelu_cpu(TensorView out, TensorView x) {
  const char* op = "gelu";
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_DEVICE(op, out, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, out, x);
  OPB_CHECK_SAME_SHAPE(op, out, x);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, out);

  const int64_t n = x.numel();
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    opbridge::parallel_for(n, 1, [&](int64_t lo, int64_t hi) { gelu_chunk<T>(o + lo, a + lo, hi - lo); });
  });
}
OPBRIDGE_EXPORT(gelu_cpu);

void gelu_backward_cpu(TensorView grad_x, TensorView grad, TensorView x) {
  const char* op = "gelu_backward";
  OPB_CHECK_DEVICE(op, grad, kDLCPU);
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_DEVICE(op, grad_x, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, grad, x);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  OPB_CHECK_SAME_SHAPE(op, grad, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_CONTIGUOUS(op, grad);
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, grad_x);

  const int64_t n = x.numel();
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* gx = opbridge::data_ptr<T>(grad_x);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    opbridge::parallel_for(n, 1, [&](int64_t lo, int64_t hi) {
      gelu_backward_chunk<T>(gx + lo, g + lo, a + lo, hi - lo);
    });
  });
}
OPBRIDGE_EXPORT(gelu_backward_cpu);
