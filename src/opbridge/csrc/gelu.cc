// gelu (tanh approximation) and its backward.
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
#include <opbridge/activations.h>
#include <opbridge/cpu_map.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/gelu.h>

namespace {

using opbridge::TensorView;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCoeff = 0.044715f;

// Evaluated as x * s(z), s = sigmoid, z = 2u: the same function, since
// 0.5 (1 + tanh(u)) = s(2u), but without the tanh form's cancellation: near
// saturation 1 + tanh and 1 - tanh^2 carry an absolute error of a few ulp of
// 1, which the backward multiplies by x du/dx (~10 at x = -5). Measured on
// x in [-20, 20], worst absolute gradient error: 4.2e-6 with fast_tanh,
// 2.2e-7 this way (torch's tanhf kernel: 1.0e-6). With e = exp(-z),
// 1 - s = e s stays relatively accurate on both tails.
// The forward is act::gelu_tanh (activations.h), shared with gelu_and_mul.

template <typename T>
OPB_TARGET_CLONES void gelu_chunk(T* out, const T* x, int64_t n) {
  opbridge::map1(out, x, n, opbridge::act::Apply<opbridge::act::GeluTanh>{});
}

// d/dx [x s(z)] = s + x s (1 - s) dz/dx,  dz/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// x is clamped to [-9.65, 20] (activation_math.h's kGeluGrad*, as
// act::gelu_tanh_grad): z >= -79.5, so e stays finite (e * s would be
// inf * 0) and s a normal float, and x dz/dx, which grows like x^3, no longer
// meets e's floor of e^-87.3 (exp_for_logistic's clamp) on the positive side
// (the derivative was 3.6 at x = 1e13, inf from ~1e13, and -3.9e3 at x = -1e13
// with z clamped at -80 instead). Below -9.65 the true derivative is under
// 1e-32 and this returns its value at the clamp, ~ -6e-33; from x ~ 6 up it is
// exactly 1 in float, as at 20 and at +inf.
// -z is formed with the sign in the constant (one vector instruction fewer,
// the same bits), and -z <= 79.5 lets exp_for_logistic leave out its upper
// clamp: the two x clamps cost no more than the z clamp they replace.
// float64: the same formula in double, x clamped to [-21, 20] (act::f64::gelu_tanh_backward).
struct GeluBackward {
  OPB_ALWAYS_INLINE float operator()(float g, float x) const {
    namespace am = opbridge::act_math;
    const float v = opbridge::act::clamp_to(x, float(am::kGeluGradLoFloat), float(am::kGeluGradHi));
    const float v2 = v * v;
    const float neg_z = -2.f * kSqrt2OverPi * v * (1.f + kCoeff * v2);
    const float e = opbridge::exp_for_logistic<true>(neg_z);
    const float s = 1.f / (1.f + e);
    const float dz = 2.f * kSqrt2OverPi * (1.f + 3.f * kCoeff * v2);
    return g * (s + v * dz * (e * s) * s);
  }
  OPB_ALWAYS_INLINE double operator()(double g, double v) const {
    return opbridge::act::f64::gelu_tanh_backward(g, v);
  }
};

template <typename T>
OPB_TARGET_CLONES void gelu_backward_chunk(T* grad_x, const T* grad, const T* x, int64_t n) {
  opbridge::map2(grad_x, grad, x, n, GeluBackward{});
}

}  // namespace

void gelu_cpu(TensorView out, TensorView x) {
  const char* op = "gelu";
  opbridge::gelu::check_forward(op, kDLCPU, out, x);

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
  opbridge::gelu::check_backward(op, kDLCPU, grad_x, grad, x);

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
