// opbridge shared CPU math: vectorisable float32 approximations, the ISA
// dispatch attribute for hot loops, and the row/chunk parallel loop.
//
// Everything here is meant to be called from inside `#pragma omp simd` loops,
// so the functions are branch-free (selects only) and always inlined: a call
// that is not inlined stops the loop from vectorising.
#pragma once

#include <opbridge/opbridge.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

// Hot loops get one clone per ISA, chosen once at load time through an ifunc,
// so a portable binary still runs AVX-512 / AVX2 code where the CPU has it.
// target_clones functions are never inlined: put it on a helper that owns a
// whole loop (a row range or a chunk), not on per-element math.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__INTEL_COMPILER)
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
// rational minimax fit on [-7.9053, 7.9053] (beyond it float32 tanh is +-1 to
// within a few ulp), and x itself for |x| < 4e-4 where tanh(x) = x to float
// precision and the rational form loses relative accuracy near 0.
// Measured against float64 np.tanh on 2M+1 points of [-10, 10]
// (tests/kernels_selfcheck.py): max abs error TBD, max rel error TBD.
// NaN propagates: both clamps compare false for NaN and keep it.
OPB_ALWAYS_INLINE float fast_tanh(float x) {
  const float kClamp = 7.90531110763549805f;
  float c = select(x > kClamp, kClamp, x);
  c = select(c < -kClamp, -kClamp, c);
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
  const bool tiny = (float_to_bits(x) & 0x7fffffffu) < float_to_bits(0.0004f);
  return select(tiny, x, p / q);
}

// Runs f(begin, end) -- or f(begin, end, tid) if f takes a thread index -- over
// [0, n) split into one contiguous range per thread, tid in
// [0, parallel_threads(n, work_per_item)). Serial below kParallelGrain units of
// work (n * work_per_item), where waking the team costs more than it saves.
// Static split: fixed partitions, so per-thread partial sums (a weight
// gradient) reduce in a deterministic order.
inline int parallel_threads(int64_t n, int64_t work_per_item) {
#ifdef _OPENMP
  if (n > 1 && n * std::max<int64_t>(work_per_item, 1) >= kParallelGrain) {
    return std::max(omp_get_max_threads(), 1);
  }
#endif
  (void)n;
  (void)work_per_item;
  return 1;
}

template <typename F>
inline void parallel_for(int64_t n, int64_t work_per_item, F&& f) {
  auto call = [&f](int64_t begin, int64_t end, int tid) {
    if constexpr (std::is_invocable_v<F&, int64_t, int64_t, int>) {
      f(begin, end, tid);
    } else {
      (void)tid;
      f(begin, end);
    }
  };
  if (n <= 0) return;
  const int nt = parallel_threads(n, work_per_item);
  if (nt == 1) {
    call(0, n, 0);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = n * t / team, end = n * (t + 1) / team;
    if (begin < end) call(begin, end, int(t));
  }
#endif
}

}  // namespace opbridge
