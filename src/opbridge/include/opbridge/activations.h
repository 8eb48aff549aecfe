// opbridge activation functions for gated MLPs (silu_and_mul, gelu_and_mul):
// value and derivative, float32, branch-free and always inlined so that loops
// calling them under `#pragma omp simd` vectorise (no scalar libm call).
//
// Built on math.h's exp_for_logistic (max rel error 8.1e-8 on [-87, 88.3]).
// Errors measured through the ops (activation_and_mul.cc; AVX2 clone on Zen 3)
// against float64 on 2,000,001 points of [-20, 20]; re-checked by
// tests/test_serving_ops.py::test_activation_error_bounds:
//   silu             max rel error 1.7e-7 (where |silu| > 1e-30)
//   silu_grad        max abs error 2.3e-7 (|silu'| <= 1.1)
//   gelu_tanh        max rel error 3e-7 for x > -1, 1e-6 for x > -3, 2.2e-6 where
//                    |gelu| > 1e-6 (x > -4.8), up to 1.1e-5 on the far negative tail
//                    (|gelu| < 1e-15), all from rounding z to float32: e^z
//                    amplifies z's relative error by |z| (80 at x = -9.6)
//   gelu_tanh_grad   max abs error 2.2e-7 (|gelu'| <= 1.13)
// Beyond [-20, 20] both saturate, to x for large x and to -0 for very negative
// x; their derivatives to 1 and to a value below 5e-33 in magnitude. At x = +inf
// the value is inf and the derivative NaN (inf * 0, as in torch's silu
// backward); at x = -inf the value is NaN (-inf / inf, as x / (1 + e^-x) in
// float64) and the derivative ~ -1e-33. NaN propagates.
// The gelu forms use gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
// which equals the tanh form 0.5 x (1 + tanh(u)) exactly but has no 1 + tanh
// cancellation on the negative tail (see gelu.cc for the backward's error).
#pragma once

#include <opbridge/math.h>

namespace opbridge {
namespace act {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// The logistic function and its complement from one exp: with e = exp(-z),
// s = 1 / (1 + e) and 1 - s = e s (no cancellation on either tail). z is
// clamped at -80 so that e stays finite (e * s would be inf * 0); the true s
// there is below 1.9e-35, and callers multiply it by something bounded.
struct Logistic {
  float s;    // sigmoid(z)
  float one_minus_s;  // 1 - sigmoid(z)
};
OPB_ALWAYS_INLINE Logistic logistic(float z) {
  const float zc = select(z < -80.f, -80.f, z);
  const float e = exp_for_logistic(-zc);
  const float s = 1.f / (1.f + e);
  return {s, e * s};
}

// silu(x) = x sigmoid(x), as x / (1 + e^-x): one division instead of a
// reciprocal and a multiply. Relative accuracy on both tails; x -> -inf gives
// -inf / inf = NaN, as x / (1 + exp(-x)) does in float64.
OPB_ALWAYS_INLINE float silu(float x) { return x / (1.f + exp_for_logistic(-x)); }

// d/dx silu(x) = s (1 + x (1 - s)). x is clamped at -80 as a whole, not only
// inside the logistic: otherwise s(-80) (1 + x) would grow with |x| instead of
// vanishing (true value below 1.5e-33 there).
OPB_ALWAYS_INLINE float silu_grad(float x) {
  const float xc = select(x < -80.f, -80.f, x);
  const Logistic l = logistic(xc);
  return l.s * (1.f + xc * l.one_minus_s);
}

OPB_ALWAYS_INLINE float gelu_z(float x) { return 2.f * kSqrt2OverPi * x * (1.f + kGeluCoeff * x * x); }

// gelu, tanh approximation: x sigmoid(z), z = 2u, as x / (1 + e^-z) (see silu).
// The same function as 0.5 x (1 + tanh(u)), without the tanh form's
// cancellation near saturation, which the backward would amplify.
OPB_ALWAYS_INLINE float gelu_tanh(float x) { return x / (1.f + exp_for_logistic(-gelu_z(x))); }

// d/dx [x s(z)] = s + x s (1 - s) dz/dx,  dz/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// x is clamped at -10 (z = -87.3): below it the true derivative is under 1e-32,
// while x dz/dx grows like x^3 and would amplify the clamped s(-80).
OPB_ALWAYS_INLINE float gelu_tanh_grad(float x) {
  const float xc = select(x < -10.f, -10.f, x);
  const Logistic l = logistic(gelu_z(xc));
  const float dz = 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * xc * xc);
  return l.s + xc * dz * l.one_minus_s * l.s;
}

}  // namespace act
}  // namespace opbridge
