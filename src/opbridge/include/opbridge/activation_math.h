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

// The derivatives' clamps on x, both sides. From above: x dz/dx grows like
// x^3 (x^2 and x^3 overflow from |x| ~ 1.8e19 in float, 1.3e154 in double)
// and 1 - s never quite reaches 0 (the CPU float exp bottoms out at e^-87.3 ~
// 1.2e-38, exp_fraction at ~2^-1021), so x dz (1 - s) s, or x (1 - s) for
// silu, became visible (gelu' from x ~ 1e11 in float: 3.6 at 1e13, inf from
// ~1e13; silu' 4.7 at 3e38) and inf * 0 = NaN where the exp flushes to 0.
// At the clamp the derivative is already exactly 1 in float and double (s
// rounds to 1 and the other term is below 1e-30), as it is for every larger
// x, so clamping changes no value there; x = +inf gives 1 as well (the limit;
// the formula's own value there is inf * 0). From below, the derivative is
// evaluated at the clamp (as the CPU kernels' float64 forms do): gelu's lower
// clamp keeps z >= -79.6 in float (e = e^-z finite, s a normal float, no clamp
// on z needed), and at -21 in double (z = -694); silu's at -80 (float, and the
// CUDA double form) keeps e finite. Below them the true derivative is under
// 1e-32 (float) / 1e-298 (gelu, double) in magnitude, and so is the value at
// the clamp; x = -inf gives it too. NaN propagates (the clamps keep NaN).
constexpr double kGeluGradHi = 20.0;           // z = 603: s = 1 in float and double
constexpr double kGeluGradLoFloat = -9.65;     // z = -79.5
constexpr double kGeluGradLoDouble = -21.0;    // z = -694
constexpr double kSiluGradHi = 80.0;           // x (1 - s) = 80 e^-80 = 1.4e-33
constexpr double kSiluGradLo = -80.0;

// sigmoid(z) and 1 - sigmoid(z) = e s, e = exp(-z), from one exp: no
// cancellation on either tail. The callers keep e finite (z >= -80 in
// float) through their clamps on x.
template <typename C>
struct Logistic {
  C s, one_minus_s;
};
template <typename M, typename C>
OPB_HOST_DEVICE Logistic<C> logistic(C z) {
  const C e = M::exp(-z);
  const C s = M::div(C(1), C(1) + e);
  return {s, e * s};
}

// v clamped to [lo, hi], NaN kept: M::clamp_below twice, the upper clamp as
// -max(-v, -hi) (negation is exact).
template <typename M, typename C>
OPB_HOST_DEVICE C clamp_to(C v, C lo, C hi) {
  return -M::clamp_below(-M::clamp_below(v, lo), -hi);
}

// gelu's lower clamp on x for the derivative: kGeluGradLoFloat or kGeluGradLoDouble.
template <typename C>
OPB_HOST_DEVICE constexpr C gelu_grad_lo() {
  return sizeof(C) == sizeof(float) ? C(kGeluGradLoFloat) : C(kGeluGradLoDouble);
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

// s (1 + x (1 - s)), x clamped to [-80, 80] as a whole (kSiluGrad*: true
// value < 1.5e-33 below, exactly 1 above).
template <typename M, typename C>
OPB_HOST_DEVICE C silu_grad(C x) {
  const C xc = clamp_to<M>(x, C(kSiluGradLo), C(kSiluGradHi));
  const Logistic<C> l = logistic<M>(xc);
  return l.s * (C(1) + xc * l.one_minus_s);
}

// gelu, tanh approximation, as x sigmoid(z) = x / (1 + e^-z).
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh(C x) {
  return M::div(x, C(1) + M::exp(gelu_neg_z(x)));
}

// d/dx [x s(z)] = s + x s (1 - s) dz/dx, x clamped to [gelu_grad_lo, 20]
// (see kGeluGradHi): the gated activations' form.
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh_grad(C x) {
  const C xc = clamp_to<M>(x, gelu_grad_lo<C>(), C(kGeluGradHi));
  const Logistic<C> l = logistic<M>(gelu_z(xc));
  const C dz = C(2) * C(kSqrt2OverPi) * (C(1) + C(3) * C(kGeluCoeff) * xc * xc);
  return l.s + xc * dz * l.one_minus_s * l.s;
}

// g * d/dx gelu(x), x clamped as in gelu_tanh_grad (gelu_backward's form, see gelu.cc).
template <typename M, typename C>
OPB_HOST_DEVICE C gelu_tanh_backward(C g, C x) {
  const C xc = clamp_to<M>(x, gelu_grad_lo<C>(), C(kGeluGradHi));
  const C x2 = xc * xc;
  const C z = C(2) * C(kSqrt2OverPi) * xc * (C(1) + C(kGeluCoeff) * x2);
  const C e = M::exp(-z);
  const C s = M::div(C(1), C(1) + e);
  const C dz = C(2) * C(kSqrt2OverPi) * (C(1) + C(3) * C(kGeluCoeff) * x2);
  return g * (s + xc * dz * (e * s) * s);
}

}  // namespace act_math
}  // namespace opbridge
