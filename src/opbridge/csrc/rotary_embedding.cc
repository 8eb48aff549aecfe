// rotary_embedding, in place, with vLLM's signature and semantics:
//   rotary_embedding(positions, query!, key!?, head_size, cos_sin_cache, is_neox)
//
// positions      int64 or int32, (num_tokens,) or (batch, seq)
// query          (*positions.shape, num_heads * head_size) or (*positions.shape, num_heads, head_size)
// key            None, or as query with its own num_kv_heads (num_heads % num_kv_heads == 0)
// cos_sin_cache  (max_position, rot_dim), row p = [cos(p f_0..f_{rot_dim/2-1}) | sin(...)],
//                same dtype as query (vLLM's CUDA kernel reads both as one scalar_t; convert a
//                float32 cache with .to(query.dtype) once, as vLLM's RotaryEmbedding does)
//
// The first rot_dim elements of every head are rotated (rot_dim even, <= head_size); the rest
// are left as they are. With c = cos, s = sin of the token's row and i < rot_dim / 2:
//   NeoX  (is_neox=true):  pairs (x[i], x[i + rot_dim/2])
//   GPT-J (is_neox=false): pairs (x[2i], x[2i + 1])
//   (x, y) <- (x c_i - y s_i, y c_i + x s_i), in float32 (float64 in double), rounded once.
// Every position is checked to lie in [0, max_position) before anything is written.
// positions and cos_sin_cache must be contiguous; query and key may be rows at a stride
// (column slices of one fused qkv tensor, rotated where they are: the op declares them
// row_strided; see opbridge/ops/rotary_embedding.h).
#include <opbridge/math.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/rotary_embedding.h>

#include <sstream>
#include <type_traits>

namespace {

using opbridge::Optional;
using opbridge::TensorView;
using opbridge::rotary_embedding::kOp;
using opbridge::StridedRows;
using opbridge::rotary_embedding::Positions;

template <bool kNeox, typename T>
OPB_ALWAYS_INLINE void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  using C = opbridge::compute_t<T>;
  if constexpr (kNeox) {
    T* y = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const C a = opbridge::to_compute(x[i]), b = opbridge::to_compute(y[i]);
      const C c = opbridge::to_compute(cos[i]), s = opbridge::to_compute(sin[i]);
      x[i] = opbridge::from_compute<T>(a * c - b * s);
      y[i] = opbridge::from_compute<T>(b * c + a * s);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const C a = opbridge::to_compute(x[2 * i]), b = opbridge::to_compute(x[2 * i + 1]);
      const C c = opbridge::to_compute(cos[i]), s = opbridge::to_compute(sin[i]);
      x[2 * i] = opbridge::from_compute<T>(a * c - b * s);
      x[2 * i + 1] = opbridge::from_compute<T>(b * c + a * s);
    }
  }
}

// Tokens [t0, t1): one call per thread (target_clones calls are not inlined).
// The token's cache row stays in L1 across its heads. Token t's query row is
// at q + t * qs, its key row at k + t * ks (strides in elements: a token's
// width when dense, the qkv row for vLLM's slices).
template <bool kNeox, typename T>
OPB_TARGET_CLONES void rotary_tokens(Positions pos, T* q, T* k, const T* cache, int64_t t0, int64_t t1,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                     int64_t rot_dim, int64_t qs, int64_t ks) {
  const int64_t half = rot_dim / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const T* cos = cache + pos[t] * rot_dim;
    const T* sin = cos + half;
    T* qt = q + t * qs;
    for (int64_t h = 0; h < num_heads; ++h) rotate_head<kNeox>(qt + h * head_size, cos, sin, half);
    if (k != nullptr) {
      T* kt = k + t * ks;
      for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head<kNeox>(kt + h * head_size, cos, sin, half);
    }
  }
}

// float64: rotary_tokens, but before rotating a head it prefetches (for writing) the bytes
// kPrefetchAhead further on, and before a token's heads the next token's cos/sin row (for
// reading). For the same vector work a float64 head is twice the bytes of a float32 one, and
// with the hardware prefetcher alone the float64 sweep stayed further below a copy's speed
// than the float32 one (issue 19). The positions are random, so no hardware prefetcher sees
// the next row (1 KiB in float64) coming: each token began with its row's misses. One thread,
// interleaved in one process with an in-place ceiling and a third sweep over other buffers
// (as `bench kernels` interleaves its candidates; mean fraction of the ceiling over 5 runs of
// 30-120 rounds, 257 x 5120 (40 + 10 heads) timed as 3 calls in a row, 4096 x 4096 as one):
// 2 KiB ahead 0.76, 0.79; 2 KiB and the row 0.82, 0.81; 4 KiB and the row (kept) 0.86, 0.87
// (ahead of 2 KiB and the row in all 10 runs; in 9 earlier runs, the odd case timed one call
// at a time, the two were level at 0.88, 0.85); 6 KiB and the row 0.89, 0.84.
// The other types keep rotary_tokens as it was.
constexpr int64_t kPrefetchAhead = 4096;

OPB_ALWAYS_INLINE void prefetch_ahead(const double* head, int64_t head_size) {
  const char* p = reinterpret_cast<const char*>(head) + kPrefetchAhead;
  for (int64_t b = 0; b < head_size * int64_t(sizeof(double)); b += 64) __builtin_prefetch(p + b, 1);
}

OPB_ALWAYS_INLINE void prefetch_row(const double* row, int64_t rot_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < rot_dim * int64_t(sizeof(double)); b += 64) __builtin_prefetch(p + b, 0);
}

template <bool kNeox>
OPB_TARGET_CLONES void rotary_tokens_f64(Positions pos, double* q, double* k, const double* cache, int64_t t0,
                                         int64_t t1, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                                         int64_t rot_dim, int64_t qs, int64_t ks) {
  const int64_t half = rot_dim / 2;
  for (int64_t t = t0; t < t1; ++t) {
    if (t + 1 < t1) prefetch_row(cache + pos[t + 1] * rot_dim, rot_dim);
    const double* cos = cache + pos[t] * rot_dim;
    const double* sin = cos + half;
    double* qt = q + t * qs;
    for (int64_t h = 0; h < num_heads; ++h) {
      prefetch_ahead(qt + h * head_size, head_size);
      rotate_head<kNeox>(qt + h * head_size, cos, sin, half);
    }
    if (k != nullptr) {
      double* kt = k + t * ks;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        prefetch_ahead(kt + h * head_size, head_size);
        rotate_head<kNeox>(kt + h * head_size, cos, sin, half);
      }
    }
  }
}

}  // namespace

void rotary_embedding_cpu(TensorView positions, TensorView query, Optional<TensorView> key, int64_t head_size,
                          TensorView cos_sin_cache, bool is_neox) {
  const opbridge::rotary_embedding::Dims dims =
      opbridge::rotary_embedding::check_args(kDLCPU, positions, query, key, head_size, cos_sin_cache, false);
  const int64_t num_heads = dims.num_heads, num_kv_heads = dims.num_kv_heads, rot_dim = dims.rot_dim;

  // Positions index the cache: check them all before writing anything.
  const int64_t num_tokens = positions.numel();
  const Positions pos = opbridge::rotary_embedding::positions_of(positions);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t p = pos[t];
    if (TVM_FFI_PREDICT_FALSE(p < 0 || p >= dims.max_position)) {
      std::ostringstream where;
      if (positions.ndim() == 2) {
        where << t / positions.size(1) << ", " << t % positions.size(1);
      } else {
        where << t;
      }
      OPB_THROW(ValueError) << kOp << ": positions must be in [0, max_position) with max_position = "
                            << dims.max_position << " (cos_sin_cache's first dim), got positions[" << where.str()
                            << "] = " << p;
    }
  }
  if (num_tokens == 0) return;

  OPB_DISPATCH_FLOATING(kOp, query.dtype(), T, [&] {
    T* q = opbridge::data_ptr<T>(query);
    T* k = key.has_value() ? opbridge::data_ptr<T>(key.value()) : nullptr;
    const T* cache = opbridge::data_ptr<const T>(cos_sin_cache);
    const StridedRows qr = dims.q_rows, kr = dims.k_rows;
    // Tokens [a, b) of one stride each: query rows from qb, key rows from kb, positions from p.
    auto run = [&](Positions p, T* qb, T* kb, int64_t a, int64_t b, int64_t qs, int64_t ks) {
      if constexpr (std::is_same_v<T, double>) {
        if (is_neox) {
          rotary_tokens_f64<true>(p, qb, kb, cache, a, b, num_heads, num_kv_heads, head_size, rot_dim, qs, ks);
        } else {
          rotary_tokens_f64<false>(p, qb, kb, cache, a, b, num_heads, num_kv_heads, head_size, rot_dim, qs, ks);
        }
      } else if (is_neox) {
        rotary_tokens<true, T>(p, qb, kb, cache, a, b, num_heads, num_kv_heads, head_size, rot_dim, qs, ks);
      } else {
        rotary_tokens<false, T>(p, qb, kb, cache, a, b, num_heads, num_kv_heads, head_size, rot_dim, qs, ks);
      }
    };
    // With 2-D positions a strided query or key holds seq dense token rows per batch index
    // (StridedRows::per): each batch's tokens are one run at the token width.
    const int64_t seq = std::max(qr.per, kr.per);
    opbridge::parallel_for(num_tokens, (num_heads + num_kv_heads) * rot_dim, [&](int64_t lo, int64_t hi) {
      if (seq == 1) return run(pos, q, k, lo, hi, qr.stride, kr.stride);
      const int64_t qb = qr.per == 1 ? seq * qr.width : qr.stride, kb = kr.per == 1 ? seq * kr.width : kr.stride;
      for (int64_t t = lo; t < hi;) {
        const int64_t b = t / seq, end = std::min(hi, (b + 1) * seq);
        run(pos + b * seq, q + b * qb, k == nullptr ? nullptr : k + b * kb, t - b * seq, end - b * seq, qr.width,
            kr.width);
        t = end;
      }
    });
  });
}
OPBRIDGE_EXPORT(rotary_embedding_cpu);
