// opbridge activation functions for gated MLPs (silu_and_mul, gelu_and_mul):
// value and derivative, float32 (and float64 in act::f64, below), branch-free
// and always inlined so that loops calling them under `#pragma omp simd`
// vectorise (no scalar libm call).
//
// float32: built on math.h's exp_for_logistic (max rel error 8.1e-8 on [-87, 88.3]).
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
// x; their derivatives, evaluated at x clamped to [-80, 80] (silu) or
// [-9.65, 20] (gelu; activation_math.h's kSiluGrad* / kGeluGrad*), to exactly
// 1 and to a value below 1e-32 in magnitude, for every x up to +-inf (the
// clamps keep x dz/dx, which grows like x^3, from meeting the exp's floor of
// e^-87.3 on the positive side and s(-80) on the negative one). At x = +inf
// the value is inf and the derivative 1 (the limit; the formula itself gives
// inf * 0 = NaN there, as torch's silu backward does); at x = -inf the value is
// NaN (-inf / inf, as x / (1 + e^-x) in float64) and the derivative ~ -1e-33.
// NaN propagates.
// The gelu forms use gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
// which equals the tanh form 0.5 x (1 + tanh(u)) exactly but has no 1 + tanh
// cancellation on the negative tail (see gelu.cc for the backward's error).
#pragma once

#include <opbridge/activation_math.h>
#include <opbridge/cpu_map.h>

namespace opbridge {
namespace act {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// The logistic function and its complement from one exp: with e = exp(-z),
// s = 1 / (1 + e) and 1 - s = e s (no cancellation on either tail). The
// callers keep z >= -80 through their clamps on x, so that e stays finite
// (e * s would be inf * 0) and s a normal float; the exp's own upper clamp is
// then never reached and left out (exp_for_logistic<true>).
struct Logistic {
  float s;    // sigmoid(z)
  float one_minus_s;  // 1 - sigmoid(z)
};
OPB_ALWAYS_INLINE Logistic logistic(float z) {
  const float e = exp_for_logistic<true>(-z);
  const float s = 1.f / (1.f + e);
  return {s, e * s};
}

// v clamped to [lo, hi]; NaN propagates (both compares are false for it).
OPB_ALWAYS_INLINE float clamp_to(float v, float lo, float hi) {
  return select(v > hi, hi, select(v < lo, lo, v));
}

// silu(x) = x sigmoid(x), as x / (1 + e^-x): one division instead of a
// reciprocal and a multiply. Relative accuracy on both tails; x -> -inf gives
// -inf / inf = NaN, as x / (1 + exp(-x)) does in float64.
OPB_ALWAYS_INLINE float silu(float x) { return x / (1.f + exp_for_logistic(-x)); }

// d/dx silu(x) = s (1 + x (1 - s)). x is clamped to [-80, 80] as a whole
// (activation_math.h's kSiluGrad*), not only inside the logistic: below,
// s(-80) (1 + x) would grow with |x| instead of vanishing (true value below
// 1.5e-33 there); above, 1 - s stops at e^-87.3 ~ 1.2e-38 (exp_for_logistic's
// clamp) and x (1 - s) would grow with x (4.7 at 3e38) instead of vanishing.
// At 80 the value is exactly 1, as it is for every x from ~17.
OPB_ALWAYS_INLINE float silu_grad(float x) {
  const float xc = clamp_to(x, float(act_math::kSiluGradLo), float(act_math::kSiluGradHi));
  const Logistic l = logistic(xc);
  return l.s * (1.f + xc * l.one_minus_s);
}

OPB_ALWAYS_INLINE float gelu_z(float x) { return 2.f * kSqrt2OverPi * x * (1.f + kGeluCoeff * x * x); }

// gelu, tanh approximation: x sigmoid(z), z = 2u, as x / (1 + e^-z) (see silu).
// The same function as 0.5 x (1 + tanh(u)), without the tanh form's
// cancellation near saturation, which the backward would amplify.
OPB_ALWAYS_INLINE float gelu_tanh(float x) { return x / (1.f + exp_for_logistic(-gelu_z(x))); }

// d/dx [x s(z)] = s + x s (1 - s) dz/dx,  dz/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// x is clamped to [-9.65, 20] (activation_math.h's kGeluGrad*): x dz/dx grows
// like x^3 and would amplify s on the negative tail and 1 - s >= 1.2e-38 on
// the positive one (3.6 at x = 1e13, inf beyond). Below -9.65 (z = -79.5, so
// e stays finite and s normal) the true derivative is under 1e-32; from ~6
// up it is exactly 1 in float.
OPB_ALWAYS_INLINE float gelu_tanh_grad(float x) {
  const float xc = clamp_to(x, float(act_math::kGeluGradLoFloat), float(act_math::kGeluGradHi));
  const Logistic l = logistic(gelu_z(xc));
  const float dz = 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * xc * xc);
  return l.s + xc * dz * l.one_minus_s * l.s;
}

#ifdef OPB_VEC_AVX2
// The AVX2 forms of exp_for_logistic, silu and gelu_tanh: the same
// operations in the same order (FMA where GCC contracts the scalar form),
// with the clamps as vminps / vmaxps, which keep NaN as the scalar selects do
// (vminps(hi, x) returns x when either is NaN). The error bounds above were
// measured on this form (the AVX2 path runs on Zen 3), and it gives the same
// bits as the scalar form in the x86-64-v3 clone (tests/test_serving_ops.py
// compares the forward with the backward's d/db = act(a) bit for bit).
// Zen 3, opbridge bench kernels, into a buffer, before -> after (separate
// runs): (8, 4096) float32 gelu 26.9 -> 20.5 us, silu_and_mul 11.4 -> 9.6 us,
// gelu_and_mul 13.9 -> 11.9 us; (4096, 4096) float32 gelu 5.7 -> 5.2 ms,
// gelu_and_mul 3.8 -> 3.4 ms. A standalone loop of 32K float32 gelu: 19.8 ->
// 15.8 us; Estrin instead of Horner for q was slower (the clamps, not the
// polynomial's depth, were the cost).
namespace avx2 {

// 1 + exp_for_logistic(x), the denominator of the logistic family.
OPB_AVX2_INLINE __m256 one_plus_exp_for_logistic(__m256 x) {
  const __m256 magic = _mm256_set1_ps(expc::kMagic);
  __m256 c = _mm256_min_ps(_mm256_set1_ps(expc::kHi), x);
  c = _mm256_max_ps(_mm256_set1_ps(expc::kLogisticLo), c);
  __m256 fn = _mm256_fmadd_ps(c, _mm256_set1_ps(expc::kLog2e), magic);
  const __m256i n = _mm256_sub_epi32(_mm256_castps_si256(fn), _mm256_castps_si256(magic));
  fn = _mm256_sub_ps(fn, magic);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(expc::kLn2Hi), c);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(expc::kLn2Lo), r);
  __m256 q = _mm256_fmadd_ps(r, _mm256_set1_ps(expc::kQ4), _mm256_set1_ps(expc::kQ3));
  q = _mm256_fmadd_ps(r, q, _mm256_set1_ps(expc::kQ2));
  q = _mm256_fmadd_ps(r, q, _mm256_set1_ps(expc::kQ1));
  q = _mm256_fmadd_ps(r, q, _mm256_set1_ps(expc::kQ0));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), one);
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_fmadd_ps(y, p2, one);
}

OPB_AVX2_INLINE __m256 silu(__m256 x) {
  const __m256 neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.f));
  return _mm256_div_ps(x, one_plus_exp_for_logistic(neg));
}

OPB_AVX2_INLINE __m256 gelu_tanh(__m256 x) {
  const __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kGeluCoeff), x), x, _mm256_set1_ps(1.f));
  const __m256 neg_z = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(-2.f * kSqrt2OverPi), x), t);
  return _mm256_div_ps(x, one_plus_exp_for_logistic(neg_z));
}

}  // namespace avx2
#endif

// float64: the formulas of activation_math.h in double with exp_fraction
// (math.h): e^t as scale * plus / minus, so that x / (1 + e^t) =
// x minus / (minus + scale plus) and the logistic pair s, 1 - s each take one
// division and no exp polynomial; the gated backward takes act and act' from
// one of them (Act::fdf). The clamps are where double still has room, not the
// float-sized ones of activation_math.h: x at -700 for silu and at -21 for
// gelu (z = -694), so e^-z stays finite and s, 1 - s and x s need no clamp of
// their own; below them the true act and act' are under 1e-300 in magnitude
// and so are these (evaluated at the clamp: x_c s(x_c), not x s(x_c), which
// would grow with |x|; activation_math.h's z >= -80 gave gelu_backward
// -3.9e-27 at x = -1000 and -inf at x = -1e300).
// In-cache loops of 8192 values on Zen 3 (x86-64-v3 code), ns per value, with
// fast_exp's degree-13 Taylor form and two exps per backward value before ->
// now: gelu 2.58 -> 1.56, silu 2.32 -> 1.27, gelu_backward 3.54 -> 2.30,
// gated backward g act' + act: silu 5.08 -> 1.96, gelu 6.63 -> 2.66 (float32
// gelu, AVX2 form: 0.60).
// Errors against a long double evaluation of the same formula on 2,000,001
// points of [-20, 20]: silu 3.3 ulp; gelu 15 ulp on [-3, 3] and up to 1.6e3
// ulp near x = -20 (|gelu| < 1e-160 there), both from rounding z itself,
// which e^-z amplifies by |z|, not from the exp (exp_fraction: 1.75 ulp).
// Relative 1e-15 or better where the values are not vanishingly small.
namespace f64 {

OPB_ALWAYS_INLINE double clamp_below(double v, double lo) { return select(v < lo, lo, v); }
OPB_ALWAYS_INLINE double clamp_above(double v, double hi) { return select(v > hi, hi, v); }

// x / (1 + e^t); 0 (with x's sign) where e^t overflows, NaN for x = -inf, t = inf.
OPB_ALWAYS_INLINE double x_over_one_plus_exp(double x, double t) {
  const ExpFraction e = exp_fraction(t);
  return x * e.minus / (e.minus + e.scale * e.plus);
}

// sigmoid(z) and 1 - sigmoid(z) from one exp_fraction and one division; the
// callers clamp x so that z >= -709 (e^-z finite).
struct Logistic {
  double s, one_minus_s;
};
OPB_ALWAYS_INLINE Logistic logistic(double z) {
  const ExpFraction e = exp_fraction<true>(-z);
  const double sp = e.scale * e.plus;
  const double d = 1.0 / (e.minus + sp);
  return {e.minus * d, sp * d};
}

OPB_ALWAYS_INLINE double silu(double x) { return x_over_one_plus_exp(x, -x); }

OPB_ALWAYS_INLINE double gelu_tanh(double x) { return x_over_one_plus_exp(x, act_math::gelu_neg_z(x)); }

// dz/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2), as one multiply-add of x^2.
OPB_ALWAYS_INLINE double gelu_dz(double x) {
  constexpr double k = 2.0 * act_math::kSqrt2OverPi;
  return x * x * (k * 3.0 * act_math::kGeluCoeff) + k;
}

// g * d/dx gelu(x) = g (s + x s (1 - s) dz/dx), s = sigmoid(z(x)). The
// second term takes x clamped at 20 (kGeluGradHi) as well: 1 - s stops at
// ~2^-1021 (exp_fraction's clamp) and x dz/dx grows like x^3 (1 + 1e-8 at
// x = 1e100, inf from 1e103); below 20 the term is below 1e-250 and s is 1,
// so the value is exactly 1 there and beyond, as before for x < 1e97.
OPB_ALWAYS_INLINE double gelu_tanh_backward(double g, double x) {
  const double xc = clamp_below(x, act_math::kGeluGradLoDouble);
  const Logistic l = logistic(act_math::gelu_z(xc));
  const double xh = clamp_above(xc, act_math::kGeluGradHi);
  return g * (l.s + xh * gelu_dz(xh) * l.one_minus_s * l.s);
}

// act(x) and act'(x) together, for the gated backward (grad_b = g act(a),
// grad_a = g b act'(a)). act rounds differently from silu / gelu_tanh
// (x_c s instead of x minus / (...)): a few ulp; at x = -inf it is ~ -1e-301
// instead of their NaN. act' takes x clamped from above as well (at 80 for
// silu, 20 for gelu; see gelu_tanh_backward): silu' was 1 + 3e-8 at x = 1e300,
// gelu' inf from 1e103; below the clamps act' is exactly 1 already. act keeps
// the unclamped x (act(x) = x there).
struct ValueAndGrad {
  double f, df;
};
OPB_ALWAYS_INLINE ValueAndGrad silu_and_grad(double x) {
  const double xc = clamp_below(x, -700.0);
  const Logistic l = logistic(xc);
  const double xh = clamp_above(xc, act_math::kSiluGradHi);
  return {xc * l.s, l.s * (1.0 + xh * l.one_minus_s)};
}

OPB_ALWAYS_INLINE ValueAndGrad gelu_tanh_and_grad(double x) {
  const double xc = clamp_below(x, act_math::kGeluGradLoDouble);
  const Logistic l = logistic(act_math::gelu_z(xc));
  const double xh = clamp_above(xc, act_math::kGeluGradHi);
  return {xc * l.s, l.s + xh * gelu_dz(xh) * l.one_minus_s * l.s};
}

}  // namespace f64

// Activations as types: f / df (float32), f / fdf (float64, f64::), and
// (where present) the AVX2 form f8 that map1 / map2 pick up through Apply /
// ApplyAndMul.
struct Silu {
  static OPB_ALWAYS_INLINE float f(float x) { return silu(x); }
  static OPB_ALWAYS_INLINE float df(float x) { return silu_grad(x); }
  static OPB_ALWAYS_INLINE double f(double x) { return f64::silu(x); }
  static OPB_ALWAYS_INLINE f64::ValueAndGrad fdf(double x) { return f64::silu_and_grad(x); }
#ifdef OPB_VEC_AVX2
  static OPB_AVX2_INLINE __m256 f8(__m256 x) { return avx2::silu(x); }
#endif
};
struct GeluTanh {
  static OPB_ALWAYS_INLINE float f(float x) { return gelu_tanh(x); }
  static OPB_ALWAYS_INLINE float df(float x) { return gelu_tanh_grad(x); }
  static OPB_ALWAYS_INLINE double f(double x) { return f64::gelu_tanh(x); }
  static OPB_ALWAYS_INLINE f64::ValueAndGrad fdf(double x) { return f64::gelu_tanh_and_grad(x); }
#ifdef OPB_VEC_AVX2
  static OPB_AVX2_INLINE __m256 f8(__m256 x) { return avx2::gelu_tanh(x); }
#endif
};

// map1 functor: act(x).
template <typename Act>
struct Apply {
  OPB_ALWAYS_INLINE float operator()(float x) const { return Act::f(x); }
  OPB_ALWAYS_INLINE double operator()(double x) const { return Act::f(x); }
#ifdef OPB_VEC_AVX2
  static OPB_AVX2_INLINE __m256 avx2(__m256 x) { return Act::f8(x); }
#endif
};

// map2 functor: act(a) * b (the gated MLP forward).
template <typename Act>
struct ApplyAndMul {
  OPB_ALWAYS_INLINE float operator()(float a, float b) const { return Act::f(a) * b; }
  OPB_ALWAYS_INLINE double operator()(double a, double b) const { return Act::f(a) * b; }
#ifdef OPB_VEC_AVX2
  static OPB_AVX2_INLINE __m256 avx2(__m256 a, __m256 b) { return _mm256_mul_ps(Act::f8(a), b); }
#endif
};

}  // namespace act
}  // namespace opbridge
