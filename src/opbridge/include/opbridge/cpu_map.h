// opbridge's CPU elementwise maps: map1 / map2 run a per-element functor over
// whole arrays, in float32 for the 16-bit types (whole-block conversions, an
// AVX2 form where the functor has one), with streaming stores for outputs too
// large to stay in cache. The math they run is in math.h.
#pragma once

#include <opbridge/math.h>

namespace opbridge {

// Whole-block conversions between 16-bit storage and float32, bit-identical
// to to_float / from_float element by element. For bfloat16 on a CPU with
// AVX2 they run a hand-shaped loop (GCC vector extensions): one word unpack
// per 8 loads, and stores that round in the high half of each float and pick
// those halves with one shuffle. The auto-vectorised loop instead widens with
// extract + zero-extend + shift and narrows with shift + mask + pack + permute,
// and on Zen 3 the shift/shuffle ports are the limit: 4096 elements in-cache
// 0.33 -> 0.20 us (load) and 0.63 -> 0.47 us (store). The AVX2 loops are
// chosen at run time (one cached cpuid check), so they also serve the
// target_clones default clone on an AVX2 machine and never run elsewhere.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define OPB_BF16_AVX2 1
namespace detail {

typedef uint16_t u16x16 __attribute__((vector_size(32), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32), may_alias));
typedef float f32x8 __attribute__((vector_size(32), may_alias));

inline bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

__attribute__((target("avx2"))) inline void bf16_to_float_avx2(float* out, const bfloat16* in, int64_t n) {
  const u16x16 zero = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    u16x16 v;
    std::memcpy(&v, in + i, sizeof v);
    const u16x16 lo = __builtin_shufflevector(zero, v, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const u16x16 hi = __builtin_shufflevector(zero, v, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(out + i, &lo, sizeof lo);
    std::memcpy(out + i + 8, &hi, sizeof hi);
  }
  for (; i < n; ++i) out[i] = to_float(in[i]);
}

// from_float<bfloat16> of 8 floats, left in the high half of each lane.
__attribute__((target("avx2"))) inline u32x8 bf16_round_high(const float* p) {
  f32x8 f;
  u32x8 u;
  std::memcpy(&f, p, sizeof f);
  std::memcpy(&u, p, sizeof u);
  const i32x8 nan = f != f;
  const i32x8 rounded = i32x8(u + 0x7fffu + ((u >> 16) & 1u));
  const i32x8 quiet = i32x8(u | 0x400000u);  // NaN: quiet bit set, low half dropped
  return u32x8((rounded & ~nan) | (quiet & nan));
}

__attribute__((target("avx2"))) inline void float_to_bf16_avx2(bfloat16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const u32x8 a = bf16_round_high(in + i), b = bf16_round_high(in + i + 8);
    u16x16 a16, b16;
    std::memcpy(&a16, &a, sizeof a);
    std::memcpy(&b16, &b, sizeof b);
    const u16x16 o = __builtin_shufflevector(a16, b16, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    std::memcpy(out + i, &o, sizeof o);
  }
  for (; i < n; ++i) out[i] = from_float<bfloat16>(in[i]);
}

}  // namespace detail
#endif

template <typename T>
OPB_ALWAYS_INLINE void to_float_block(float* out, const T* in, int64_t n) {
#ifdef OPB_BF16_AVX2
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (detail::cpu_has_avx2()) return detail::bf16_to_float_avx2(out, in, n);
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(in[i]);
}

template <typename T>
OPB_ALWAYS_INLINE void from_float_block(T* out, const float* in, int64_t n) {
#ifdef OPB_BF16_AVX2
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (detail::cpu_has_avx2()) return detail::float_to_bf16_avx2(out, in, n);
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(in[i]);
}

// Streaming (non-temporal) stores for outputs too large to stay in cache.
// A plain store first reads the line it writes (read-for-ownership), so an
// out-of-place elementwise kernel moves one extra byte per byte it writes;
// a non-temporal store writes whole lines without reading them and without
// evicting the inputs from cache. 4096x4096 float32 add on 2 threads
// (Zen 3): 5.2 -> 4.2 ms. Memory-bound float32 maps only (map2 and
// map_stream say why), and only outputs of kStreamMinBytes and more:
// a smaller output may still be in cache when the next op reads it, and
// then writing it to DRAM would cost that op a DRAM read. In-place kernels
// never stream (the lines they write were just read into cache). Streaming
// changes where lines go, not results: a thread reads its own non-temporal
// stores back like any other, so an aliased output is no less correct.
constexpr int64_t kStreamMinBytes = int64_t(16) << 20;

inline bool stream_stores(int64_t out_bytes) { return out_bytes >= kStreamMinBytes; }

// memcpy with non-temporal stores for the 16-byte-aligned middle (SSE2, so
// every x86-64 clone has it); a plain memcpy elsewhere. Callers end their
// streaming loops with stream_fence(): non-temporal stores are weakly
// ordered, and the fence makes them visible before the parallel join.
OPB_ALWAYS_INLINE void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t head = std::min<int64_t>(bytes, int64_t((16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15));
  std::memcpy(d, s, size_t(head));
  d += head;
  s += head;
  bytes -= head;
  for (; bytes >= 16; bytes -= 16, d += 16, s += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  std::memcpy(d, s, size_t(bytes));
#else
  std::memcpy(dst, src, size_t(bytes));
#endif
}

OPB_ALWAYS_INLINE void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// out[i] = from_float<T>(f(to_float(x[i]))) (map1) or f(x[i], y[i]) (map2)
// for i in [0, n): the loop of every elementwise kernel. Always inlined, so it
// runs in the caller's ISA clone; f must be inlinable (a functor or a lambda).
// 16-bit types go through L1-resident float blocks (to_float_block /
// from_float_block), so the math loop is the float32 one: converting inside it
// gives GCC 32 lanes per iteration (a zmm of 16-bit values) whose float
// temporaries spill in expensive math (bfloat16 gelu 1.2x faster in-cache on
// AVX-512 and 2.7x at 4096x4096), and with the block conversions even cheap
// maps gain: 4096 elements in-cache on Zen 3 (x86-64-v3 clone), bfloat16 add
// 1.19 -> 0.95 us, row scale (rms_norm) 1.29 -> 1.13 us, float16 add
// 4.80 -> 4.21 us. Blocks of 256 rather than 512 keep DRAM reads and writes
// better interleaved at large sizes (4096x4096 bfloat16 on 2 threads: add
// 2.99-3.37 -> 2.81 ms, silu_and_mul 3.59-4.16 -> 3.38-3.45 ms) for ~4% more
// per-block overhead in-cache (32K bfloat16 gelu 27.0 -> 28.1 us). out may be
// exactly x or y (in place): each block reads its inputs before it writes.
//
// map2 with stream (see stream_stores): float32 and float64 results go out through
// stream_copy in blocks of kStreamBlock elements computed straight from x / y
// (16-bit outputs ignore stream, see map_stream). Only for cheap f, where
// DRAM sets the pace (add, the rms_norm row scale): an expensive f re-loads
// its constants for every small block, and gelu / silu_and_mul at 4096x4096
// float32 ran 1.25x slower streamed (5.9 -> 7.5 ms, 3.1 -> 3.9 ms).
// Small blocks keep DRAM reads and streaming writes interleaved: 4096x4096
// float32 add on 2 threads, 5.2 ms plain, 4.2 ms in blocks of 64 or 128,
// 4.6 ms in blocks of 512, 5.8 ms when staged through float copies first.
constexpr int64_t kStageBlock = 256;
constexpr int64_t kStreamBlock = 64;

namespace detail {

// float32, float64 and the integers (types that compute in themselves): for
// 16-bit outputs the conversions, not DRAM, set the pace, and streaming them
// measured no faster (4096x4096 bfloat16 add 2.84-3.08 ms either way, blocks
// of 64 to 512).
template <typename T, typename F>
OPB_ALWAYS_INLINE void map_stream(T* out, const T* x, const T* y, int64_t n, F& f) {
  alignas(64) T b[kStreamBlock];
  for (int64_t s = 0; s < n; s += kStreamBlock) {
    const int64_t m = std::min(kStreamBlock, n - s);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) b[i] = f(x[s + i], y[s + i]);
    stream_copy(out + s, b, m * int64_t(sizeof(T)));
  }
  stream_fence();
}

// Functors may carry an AVX2 form of themselves: a static avx2(__m256) (map1)
// or avx2(__m256, __m256) (map2) next to operator(). On a CPU with AVX2 and
// FMA but no AVX-512 the float32 loop then runs that form (apply1_avx2 /
// apply2_avx2, chosen at run time by one cached cpuid check); elsewhere, and
// for functors without one, the loop is the auto-vectorised operator(). Why
// a hand-written form at all: GCC compiles the clamps of the logistic family
// (select) to compare + integer blend, and will not turn a float ?: into
// vminps / vmaxps without -ffinite-math-only; with min / max a standalone
// 32K float32 gelu loop runs 19.8 -> 15.8 us on Zen 3 (activations.h has the
// op figures). On AVX-512 the x86-64-v4 clone's generic loop has mask
// compares and twice the width, so it is kept there.
template <typename F, typename = void>
struct has_avx2 : std::false_type {};
template <typename F>
struct has_avx2<F, std::void_t<decltype(&F::avx2)>> : std::true_type {};

// A map2 functor with an AVX2 form that also sets `static constexpr bool
// kBf16InRegisters = true` gets its bfloat16 maps run in registers
// (map2_bf16_avx2) rather than through float staging blocks. Only for
// cheap f: there the conversions set the pace, and skipping the staging
// stores and reloads pays ((8, 4096) bfloat16 add 11.2 -> 7.4 us); for gelu
// and the gated activations, two 8-lane evaluations per 16 values measured
// 3-6% slower than the staged loop (gelu 25.2 -> 26.7 us), so they stage.
template <typename F, typename = void>
struct bf16_in_registers : std::false_type {};
template <typename F>
struct bf16_in_registers<F, std::void_t<decltype(F::kBf16InRegisters)>>
    : std::integral_constant<bool, has_avx2<F>::value && F::kBf16InRegisters> {};

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define OPB_VEC_AVX2 1
#define OPB_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

inline bool use_avx2_math() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !__builtin_cpu_supports("avx512f");
  return yes;
}

// The last n % 8 elements go through a zero-padded register's worth of stack.
template <typename F>
__attribute__((target("avx2,fma"))) void apply1_avx2(float* out, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, F::avx2(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float t[8] = {};
    std::memcpy(t, x + i, size_t(n - i) * sizeof(float));
    _mm256_store_ps(t, F::avx2(_mm256_load_ps(t)));
    std::memcpy(out + i, t, size_t(n - i) * sizeof(float));
  }
}

template <typename F>
__attribute__((target("avx2,fma"))) void apply2_avx2(float* out, const float* x, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, F::avx2(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  if (i < n) {
    alignas(32) float a[8] = {}, b[8] = {};
    std::memcpy(a, x + i, size_t(n - i) * sizeof(float));
    std::memcpy(b, y + i, size_t(n - i) * sizeof(float));
    _mm256_store_ps(a, F::avx2(_mm256_load_ps(a), _mm256_load_ps(b)));
    std::memcpy(out + i, a, size_t(n - i) * sizeof(float));
  }
}

// bfloat16 map2 for cheap functors with an AVX2 form, in registers: 16 values per
// step widen to two float vectors (word unpacks against zero, so each lane
// holds [0..3, 8..11] and [4..7, 12..15]), f runs on both, and the results
// round as from_float<bfloat16> does (nearest-even; NaN keeps its sign and
// high payload, quiet bit set) and pack back in order (packus per 128-bit
// lane undoes the unpack order). No float staging block in between (see
// bf16_in_registers for which functors). The last n % 16 values go through a
// zero-padded step on the stack.
OPB_AVX2_INLINE __m256 bf16_lo(__m256i v) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v)); }
OPB_AVX2_INLINE __m256 bf16_hi(__m256i v) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v)); }

// from_float<bfloat16> of 8 floats, in the low half of each 32-bit lane: the
// rounding of bf16_round_high, shifted down for packus (bf16_round_high leaves
// it in the high half, where float_to_bf16_avx2's shuffle picks it up).
OPB_AVX2_INLINE __m256i bf16_round(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan);
  return _mm256_srli_epi32(_mm256_castps_si256(r), 16);
}

OPB_AVX2_INLINE __m256i bf16_pack(__m256 lo, __m256 hi) { return _mm256_packus_epi32(bf16_round(lo), bf16_round(hi)); }

template <typename F>
OPB_AVX2_INLINE void bf16_step(bfloat16* out, const bfloat16* x, const bfloat16* y) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      bf16_pack(F::avx2(bf16_lo(a), bf16_lo(b)), F::avx2(bf16_hi(a), bf16_hi(b))));
}

template <typename F>
__attribute__((target("avx2,fma"))) void map2_bf16_avx2(bfloat16* out, const bfloat16* x, const bfloat16* y,
                                                        int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) bf16_step<F>(out + i, x + i, y + i);
  if (i < n) {
    bfloat16 a[16] = {}, b[16] = {};
    std::memcpy(a, x + i, size_t(n - i) * sizeof(bfloat16));
    std::memcpy(b, y + i, size_t(n - i) * sizeof(bfloat16));
    bf16_step<F>(a, a, b);
    std::memcpy(out + i, a, size_t(n - i) * sizeof(bfloat16));
  }
}
#endif

// out[i] = f(x[i]) / f(x[i], y[i]) over float32; out may be exactly x or y.
template <typename F>
OPB_ALWAYS_INLINE void apply1(float* out, const float* x, int64_t n, F& f) {
#ifdef OPB_VEC_AVX2
  if constexpr (has_avx2<std::decay_t<F>>::value) {
    if (use_avx2_math()) return apply1_avx2<std::decay_t<F>>(out, x, n);
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = f(x[i]);
}

template <typename F>
OPB_ALWAYS_INLINE void apply2(float* out, const float* x, const float* y, int64_t n, F& f) {
#ifdef OPB_VEC_AVX2
  if constexpr (has_avx2<std::decay_t<F>>::value) {
    if (use_avx2_math()) return apply2_avx2<std::decay_t<F>>(out, x, y, n);
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = f(x[i], y[i]);
}

}  // namespace detail

template <typename T, typename F>
OPB_ALWAYS_INLINE void map1(T* out, const T* x, int64_t n, F&& f) {
  if constexpr (sizeof(T) == 2) {
    alignas(64) float bx[kStageBlock];
    for (int64_t s = 0; s < n; s += kStageBlock) {
      const int64_t m = std::min(kStageBlock, n - s);
      to_float_block(bx, x + s, m);
      detail::apply1(bx, bx, m, f);
      from_float_block(out + s, bx, m);
    }
  } else if constexpr (std::is_same_v<T, float>) {
    detail::apply1(out, x, n, f);
  } else {  // double and the integers: f in compute_t<T> = T
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = from_compute<T>(f(to_compute(x[i])));
  }
}

template <typename T, typename F>
OPB_ALWAYS_INLINE void map2(T* out, const T* x, const T* y, int64_t n, F&& f, bool stream = false) {
  if constexpr (sizeof(T) >= 4) {
    if (stream) return detail::map_stream(out, x, y, n, f);
  }
#ifdef OPB_VEC_AVX2
  if constexpr (std::is_same_v<T, bfloat16> && detail::bf16_in_registers<std::decay_t<F>>::value) {
    if (detail::use_avx2_math()) return detail::map2_bf16_avx2<std::decay_t<F>>(out, x, y, n);
  }
#endif
  if constexpr (sizeof(T) == 2) {
    alignas(64) float bx[kStageBlock], by[kStageBlock];
    for (int64_t s = 0; s < n; s += kStageBlock) {
      const int64_t m = std::min(kStageBlock, n - s);
      to_float_block(bx, x + s, m);
      to_float_block(by, y + s, m);
      detail::apply2(bx, bx, by, m, f);
      from_float_block(out + s, bx, m);
    }
  } else if constexpr (std::is_same_v<T, float>) {
    detail::apply2(out, x, y, n, f);
  } else {  // double and the integers: f in compute_t<T> = T
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = from_compute<T>(f(to_compute(x[i]), to_compute(y[i])));
  }
}

}  // namespace opbridge
