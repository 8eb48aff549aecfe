// The activation math of gelu, silu_and_mul and gelu_and_mul (values and
// derivatives) written once for the CUDA kernels (float32 and float64). C is
// the compute type (float or double); M supplies M::exp, M::div(a, b) and
// M::clamp_below(v, lo) (max(v, lo) that keeps NaN), so each form picks its
// own exp, division and clamp (cuda.h's Math: the approximate float forms,
// exact double ones).
//
// The CPU kernels use activations.h: the same formulas, in float32 with the
// cheaper exp_for_logistic and hand-written AVX2 forms (its header comment
// has the measured error bounds and why the forms are chosen: x sigmoid(z)
// instead of 0.5 x (1 + tanh(u)), the clamps), and in float64 (act::f64)
// with math.h's exp_fraction, which gives x / (1 + e^t) and the logistic pair
// one division and no exp polynomial, act and act' from one exp in the
// backward, and clamps where double has room. gelu_z / gelu_neg_z and the
// constants below are shared with it.
#pragma once

#include <opbridge/opbridge.h>

namespace opbridge {
namespace act_math {

// Rounded to float for C = float, these are exactly the float literals of
// activations.h (checked: no double rounding).
constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCoeff = 0.044715;

// sigmoid(z) and 1 - sigmoid(z) = e s, e = exp(-z), from one exp: no
// cancellation on either tail. z is clamped at -80 so that e stays finite.
template <typename C>
struct Logistic {
  C s, one_minus_s;
};
template <typename M, typename C>
OPB_HOST_DEVICE Logistic<C> logistic(C z) {
  const C e = M::exp(-M::clamp_below(z, C(-80)));
  const C s = M::div(C(1), C(1) + e);
  return {s, e * s};
}

// z = 2u of gelu's tanh approximation, u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename C>
OPB_HOST_DEVICE C gelu_z(C x) {
  return C(2) * C(kSqrt2OverPi) * x * (C(1) + C(kGeluCoeff) * x * x);
}

// -z, as -gelu_z(x) bit for bit (negation is exact) but with the sign in the
// constant: one vector instruction fewer than negating z.
template <typename C>
OPB_HOST_DEVICE C gelu_neg_z(C x) {
  return C(-2) * C(kSqrt2OverPi) * x * (C(1) + C(kGeluCoeff) * x * x);
}

// silu(x) = x / (1 + e^-x).
template <typename M, typename C>
OPB_HOST_DEVICE C silu(C x) {
  return M::div(x, C(1) + M::exp(-x));
}

// s (1 + x (1 - s)), x clamped at -80 as a whole (true value < 1.5e-33 there).
template <typename M, typename C>
OPB_HOST_DEVICE C silu_grad(C x) {
  const C xc = M::clamp_below(x, C(-80));
  const Logistic<C> l = logistic<M>(xc);
  return l.s * (C(1) + xc * l.one_minus_s);
}

// gelu, tanh approximation, as x sigmoid(z) = x / (1 + e^-z).
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh(C x) {
  return M::div(x, C(1) + M::exp(gelu_neg_z(x)));
}

// d/dx [x s(z)] = s + x s (1 - s) dz/dx, x clamped at -10 (z = -87.3; true
// value < 1e-32 below): the gated activations' form.
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh_grad(C x) {
  const C xc = M::clamp_below(x, C(-10));
  const Logistic<C> l = logistic<M>(gelu_z(xc));
  const C dz = C(2) * C(kSqrt2OverPi) * (C(1) + C(3) * C(kGeluCoeff) * xc * xc);
  return l.s + xc * dz * l.one_minus_s * l.s;
}

// g * d/dx gelu(x) with z clamped at -80 (gelu_backward's form, see gelu.cc).
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh_backward(C g, C x) {
  const C x2 = x * x;
  const C z = M::clamp_below(C(2) * C(kSqrt2OverPi) * x * (C(1) + C(kGeluCoeff) * x2), C(-80));
  const C e = M::exp(-z);
  const C s = M::div(C(1), C(1) + e);
  const C dz = C(2) * C(kSqrt2OverPi) * (C(1) + C(3) * C(kGeluCoeff) * x2);
  return g * (s + x * dz * (e * s) * s);
}

}  // namespace act_math
}  // namespace opbridge
