// opbridge shared CPU math: vectorisable float32 approximations and the ISA
// dispatch attribute for hot loops (the row/chunk parallel loop, parallel_for,
// is in parallel.h, which this includes; the elementwise maps that run such
// math over whole arrays, with 16-bit block conversions and streaming stores,
// are in cpu_map.h).
//
// Everything here is meant to be called from inside `#pragma omp simd` loops,
// so the functions are branch-free (selects only) and always inlined: a call
// that is not inlined stops the loop from vectorising.
#pragma once

#include <opbridge/opbridge.h>
#include <opbridge/parallel.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Hot loops get one clone per ISA, chosen once at load time through an ifunc,
// so a portable binary still runs AVX-512 / AVX2 code where the CPU has it.
// x86-64-v4 / v3 rather than plain "avx512f" / "avx2": v4 adds AVX512VL/BW
// (mask compares and 32 registers for the 256-bit 16-bit-lane code the
// half/bfloat16 conversions produce) and v3 adds FMA; measured in-cache on a
// Sapphire Rapids core, bf16 / fp16 gelu run 1.7x / 1.9x faster than in the
// "avx512f" clone and fp32 gelu 1.4x faster than in "avx2". Older compilers get
// the plain ISA names. target_clones functions are never inlined: put it on a
// helper that owns a whole loop (a row range or a chunk), not on per-element math.
// A build for this machine only (the JIT build, compiled with -march=native)
// defines OPB_NATIVE_ISA: one code path instead of three, compiled for the CPU
// it runs on, which the clones would pick anyway. It keeps the clones' one
// property that matters for build time: the function is not inlined into its
// caller (GCC would otherwise compile the same loop twice, once inlined into
// the single-threaded call and once for the parallel chunks: rotary_embedding's
// object 114 -> 79 KB).
#if defined(OPB_NATIVE_ISA)
#define OPB_TARGET_CLONES __attribute__((noinline))
#elif defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__)
#define OPB_TARGET_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define OPB_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OPB_TARGET_CLONES
#endif

#if defined(__GNUC__)
#define OPB_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define OPB_ALWAYS_INLINE inline
#endif

namespace opbridge {

// c ? a : b for floats, as a bit-mask blend (see select_bits for why not ?:).
OPB_ALWAYS_INLINE float select(bool c, float a, float b) {
  return bits_to_float(select_bits(c, float_to_bits(a), float_to_bits(b)));
}

// tanh(x) for float32 as Eigen's generic_fast_tanh_float: a 13/6 odd/even
// rational minimax fit on [-7.9053, 7.9053], x itself for |x| < 4e-4 (where
// tanh(x) = x to float precision and the rational loses relative accuracy),
// and exactly +-1 beyond the fit (true tanh is within 2.7e-7 of it there), so
// that 1 - tanh^2 is 0 rather than rounding noise.
// Measured against float64 np.tanh on 2,000,001 points of [-10, 10]
// (tests/kernels_selfcheck.py): max abs error 2.74e-7 in the AVX-512 clone
// (FMA-contracted), 3.95e-7 in the baseline x86-64 clone, both near |x| = 5.5,
// i.e. up to ~7 ulp of 1 where tanh is close to +-1; ~2e-7 for |x| < 3.
// NaN propagates (float compares with NaN are false, so no select replaces it).
OPB_ALWAYS_INLINE float fast_tanh(float x) {
  const float kClamp = 7.90531110763549805f;
  const float ax = bits_to_float(float_to_bits(x) & 0x7fffffffu);
  const float c = select(ax > kClamp, 0.f, x);  // keeps the polynomial in range
  const float x2 = c * c;
  float p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = x2 * p + -8.60467152213735e-11f;
  p = x2 * p + 5.12229709037114e-08f;
  p = x2 * p + 1.48572235717979e-05f;
  p = x2 * p + 6.37261928875436e-04f;
  p = x2 * p + 4.89352455891786e-03f;
  p = c * p;
  float q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = x2 * q + 2.26843463243900e-03f;
  q = x2 * q + 4.89352518554385e-03f;
  const float one = bits_to_float((float_to_bits(x) & 0x80000000u) | 0x3f800000u);  // copysign(1, x)
  return select(ax < 0.0004f, x, select(ax > kClamp, one, p / q));
}

// x = n ln2 + r, |r| <= ln2/2, for x clamped to [lo, 88.8]: returns n and
// sets r. n is rounded with the 1.5 * 2^23 trick (no cvt/floor, which the
// baseline x86-64 clone would leave to libm) and ln2 is split hi/lo so r is
// exact. Shared by fast_exp and exp_for_logistic, which differ in the low
// clamp, the polynomial for e^r and how 2^n is applied.
// The constants are shared with the AVX2 form of exp_for_logistic
// (activations.h, act::avx2::one_plus_exp_for_logistic).
namespace expc {
constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kHi = 88.8f;          // the high clamp
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kLogisticLo = -87.3f;  // exp_for_logistic's low clamp
// exp_for_logistic's q(r), highest degree first.
constexpr float kQ4 = 1.381457201205194e-3f, kQ3 = 8.368730545043945e-3f, kQ2 = 4.166838899254799e-2f,
                kQ1 = 1.666652113199234e-1f, kQ0 = 4.999999403953552e-1f;
}  // namespace expc

// kClampHigh = false: the caller keeps x <= kHi itself (exp_for_logistic<true>).
template <bool kClampHigh = true>
OPB_ALWAYS_INLINE int32_t exp_reduce(float x, float lo, float& r) {
  float c = x;
  if constexpr (kClampHigh) c = select(c > expc::kHi, expc::kHi, c);
  c = select(c < lo, lo, c);
  float fn = c * expc::kLog2e + expc::kMagic;
  const int32_t n = int32_t(float_to_bits(fn) - float_to_bits(expc::kMagic));
  fn -= expc::kMagic;
  r = c - fn * expc::kLn2Hi;
  r = r - fn * expc::kLn2Lo;
  return n;
}

// exp(x) for float32, Cephes expf: x = n ln2 + r (exp_reduce), a
// degree-7 polynomial for e^r, then the exponent bits, 2^n applied as two
// halves so the full range works: overflow to +inf above ln(FLT_MAX), gradual
// underflow to 0 below; all float add/mul and integer bit ops.
// Measured against float64 on 2,000,001 points of [-87, 88]: max rel error
// 8.3e-8 (~1.4 ulp), AVX-512 and baseline clones alike. NaN propagates.
OPB_ALWAYS_INLINE float fast_exp(float x) {
  float r;
  const int32_t n = exp_reduce(x, -104.f, r);
  float p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = r * p + 8.3334519073e-3f;
  p = r * p + 4.1665795894e-2f;
  p = r * p + 1.6666665459e-1f;
  p = r * p + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t n1 = n >> 1, n2 = n - n1;
  return y * bits_to_float(uint32_t(n1 + 127) << 23) * bits_to_float(uint32_t(n2 + 127) << 23);
}

// exp(x) for the logistic function only: what 1 / (1 + e) and e / (1 + e)
// need, in about two thirds of fast_exp's vector instructions. x is clamped
// to [-87.3, 88.8], so n stays in [-126, 128] and 2^n is applied in one step:
// normal down to e^-87.3 ~ 1.2e-38 (exp(-inf) gives that, not 0; 1 + e is 1
// either way), and n = 128 is exactly the bits of +inf, which makes
// 1 / (1 + e) exactly 0 above x ~ 88.4 (true value < 4e-39, subnormal).
// e^r on |r| <= ln2/2 is 1 + r + r^2 q(r) with q a degree-4 minimax fit of
// relative error 3.1e-9 (Cephes' expf uses degree 5 for the same r); in
// float32, max rel error 8.1e-8 on [-87, 88.3], as fast_exp. NaN propagates.
// Measured in-cache on a Zen 3 core (x86-64-v3 clone), 32K floats: this exp
// 12.3 us vs fast_exp 17.0 us; gelu through it 19.3 vs 27.1 us.
// kAtMost88: the caller's own clamps keep x <= 88.8 (the activations'
// derivatives, whose x clamps keep -z <= 80), so the upper clamp is left out
// (two vector instructions; the same bits for every such x, NaN included).
template <bool kAtMost88 = false>
OPB_ALWAYS_INLINE float exp_for_logistic(float x) {
  float r;
  const int32_t n = exp_reduce<!kAtMost88>(x, expc::kLogisticLo, r);
  float q = r * expc::kQ4 + expc::kQ3;
  q = r * q + expc::kQ2;
  q = r * q + expc::kQ1;
  q = r * q + expc::kQ0;
  const float y = q * (r * r) + r + 1.f;
  return y * bits_to_float(uint32_t(n + 127) << 23);
}

// 1 / (1 + e^-x), max rel error 1.44e-7 on [-80, 80] (measured as above);
// exactly 0 below x ~ -88.4, exactly 1 above x ~ 17. Relative accuracy on
// both tails, unlike 0.5 (1 + tanh(x / 2)), whose 1 + tanh cancels to an
// absolute error of a few ulp of 1 once tanh saturates.
OPB_ALWAYS_INLINE float fast_sigmoid(float x) { return 1.f / (1.f + exp_for_logistic(-x)); }

// float64: c ? a : b as a bit-mask blend, and exp(x) without a libm call.
template <typename To, typename From>
OPB_ALWAYS_INLINE To bit_cast(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}
OPB_ALWAYS_INLINE double select(bool c, double a, double b) {
  const uint64_t m = uint64_t(0) - uint64_t(c);
  return bit_cast<double>((bit_cast<uint64_t>(a) & m) | (bit_cast<uint64_t>(b) & ~m));
}

// float64 exp: x = n ln2 + r, |r| <= ln2/2 (n rounded with the 1.5 * 2^52
// trick, ln2 split as Cephes does so that n * kLn2Hi is exact; exp_reduce),
// then e^r and 2^n. Shared by fast_exp (e^r by exp_poly) and exp_fraction
// (e^r as a fraction), which differ in the clamps and how 2^n is applied.
// exp_poly: 1 + r + c2 r^2 + ... + c11 r^11, a minimax fit of relative error
// 3.6e-18 (0.03 ulp; 1.0e-17 with the coefficients rounded to double) on
// |r| <= ln2/2 + 1e-4 (weighted Remez in 60-digit arithmetic), by Horner: the
// Taylor series needs degree 13 for the same error. Estrin's scheme (shorter
// dependency chain) measured no faster in a loop (the throughput of the FMA
// ports, not latency, is the limit) and, with 1 + r summed first, 1.7 ulp.
namespace expc64 {
constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2Hi = 6.93145751953125e-1;
constexpr double kLn2Lo = 1.42860682030941723212e-6;
}  // namespace expc64

// r = c - n ln2 for c, the clamped x, and fn = c log2e + kMagic (n + kMagic).
OPB_ALWAYS_INLINE double exp_reduce(double c, double fn) {
  const double f = fn - expc64::kMagic;
  const double r = c - f * expc64::kLn2Hi;
  return r - f * expc64::kLn2Lo;
}

// e^r for |r| <= ln2/2 (see above).
OPB_ALWAYS_INLINE double exp_poly(double r) {
  double p = 2.5000041445937123e-08;
  p = p * r + 2.76302756537976e-07;
  p = p * r + 2.755758657648011e-06;
  p = p * r + 2.4801493028569148e-05;
  p = p * r + 0.00019841269506199496;
  p = p * r + 0.0013888888943691287;
  p = p * r + 0.008333333333494704;
  p = p * r + 0.041666666666529954;
  p = p * r + 0.16666666666666413;
  p = p * r + 0.5000000000000011;
  p = p * r + 1.0;
  return p * r + 1.0;
}

// exp(x) for float64, branch-free so that `omp simd` loops vectorise (glibc's
// exp is a scalar call there, and would keep float64 gelu several times slower
// than memory). exp_poly for e^r, 2^n applied as two halves so that gradual
// underflow (to 0 below x ~ -745) and overflow (to inf above x ~ 709.8) both
// work; x is clamped to [-746, 710] first.
// Measured against expl (long double) on 2,000,001 points each of [-708, 709],
// [-745, -708] (subnormal results), [-1, 1] and [700, 709.7], x86-64-v3 code
// on Zen 3: max error 0.92, 0.89, 0.89 and 0.90 ulp (the Taylor degree-13
// form it replaced: 0.98, 0.95, 0.95, 0.99). exp(-inf) = 0, exp(inf) = inf,
// NaN propagates.
OPB_ALWAYS_INLINE double fast_exp(double x) {
  double c = select(x > 710.0, 710.0, x);
  c = select(c < -746.0, -746.0, c);
  const double fn = c * expc64::kLog2e + expc64::kMagic;
  const int64_t n = int64_t(bit_cast<uint64_t>(fn) - bit_cast<uint64_t>(expc64::kMagic));
  const double y = exp_poly(exp_reduce(c, fn));
  // n / 2 rounded down without a 64-bit arithmetic shift (AVX2 has none).
  const int64_t n1 = int64_t((uint64_t(n + 2048) >> 1)) - 1024, n2 = n - n1;
  return y * bit_cast<double>(uint64_t(n1 + 1023) << 52) * bit_cast<double>(uint64_t(n2 + 1023) << 52);
}

// exp(x) for float64 as a fraction, e^x = scale * plus / minus, for the
// logistic family, where it saves the polynomial and a division:
// x / (1 + e^x) = x minus / (minus + scale plus), one division as with a
// plain exp. x = n ln2 + r as in fast_exp, then Cephes' exp: e^r =
// (Q + rP) / (Q - rP), P and Q polynomials in r^2 of degrees 2 and 3 (7
// multiply-adds instead of exp_poly's 11). x is clamped to [-708, 710], so
// n stays in [-1021, 1024] and scale = 2^n is one set of exponent bits,
// those of fn itself (kMagic's low 52 bits are 0): normal down to 2^-1021,
// and n = 1024 gives exactly the bits of +inf, so scale is inf from x ~ 709.1
// (where e^x is still below DBL_MAX, up to 709.78) and x / (1 + e^x) is 0
// there instead of below 1.6e-308. scale * plus / minus is within 1.75 ulp
// of expl on 2,000,001 points of [-708, 709], 1.76 ulp on [-1, 1] (x86-64-v3
// code, Zen 3), against 0.92 / 0.89 for fast_exp; in the activations that use
// it the rounding of their own argument dominates (see activations.h). NaN
// propagates (into plus and minus). kAtMost709: the caller's own clamps keep
// x <= 709, so the upper clamp is left out (two vector instructions).
struct ExpFraction {
  double minus, plus, scale;
};
template <bool kAtMost709 = false>
OPB_ALWAYS_INLINE ExpFraction exp_fraction(double x) {
  double c = x;
  if constexpr (!kAtMost709) c = select(c > 710.0, 710.0, c);
  c = select(c < -708.0, -708.0, c);
  const double fn = c * expc64::kLog2e + expc64::kMagic;
  const double scale = bit_cast<double>((bit_cast<uint64_t>(fn) + 1023) << 52);
  const double r = exp_reduce(c, fn), r2 = r * r;
  double p = 1.26177193074810590878e-4;
  p = p * r2 + 3.02994407707441961300e-2;
  p = p * r2 + 9.99999999999999999910e-1;
  const double rp = r * p;
  double q = 3.00198505138664455042e-6;
  q = q * r2 + 2.52448340349684104192e-3;
  q = q * r2 + 2.27265548208155028766e-1;
  q = q * r2 + 2.0;
  return {q - rp, q + rp, scale};
}

}  // namespace opbridge
