// rms_norm over the last dim H and its backward.
//   y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)
#include <opbridge/cpu_map.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/rms_norm.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using opbridge::TensorView;

// float64 rows: the sum of squares in blocks of kBlock values, each block first prefetching the
// values kAhead further on (the next row's start at the end of a row). With the hardware prefetcher
// alone the float64 rows stayed further below a copy's speed than the float32 ones (issue 19);
// the other types keep the one-loop sum.
constexpr int64_t kBlock = 256, kAhead = 256;

OPB_ALWAYS_INLINE double sum_squares_f64(const double* x, int64_t H) {
  double ss = 0;
  for (int64_t i0 = 0; i0 < H; i0 += kBlock) {
    const int64_t i1 = std::min(H, i0 + kBlock);
    for (int64_t j = i0 + kAhead; j < i1 + kAhead; j += 8) __builtin_prefetch(x + j);
#pragma omp simd reduction(+ : ss)
    for (int64_t i = i0; i < i1; ++i) ss += x[i] * x[i];
  }
  return ss;
}

// One call per thread's row range, not per row: target_clones calls go
// through an ifunc and cannot be inlined. Each row is read twice; the second
// read hits L1/L2 for any realistic H, so DRAM traffic stays one read + one write.
template <typename T>
OPB_TARGET_CLONES void rms_norm_rows(T* out, const T* x, opbridge::StridedRows xs, const T* w, int64_t r0,
                                     int64_t r1, int64_t H, opbridge::compute_t<T> eps, bool stream) {
  using C = opbridge::compute_t<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + xs.offset(r);
    T* yr = out + r * H;
    C ss = 0;
    if constexpr (std::is_same_v<T, double>) {
      ss = sum_squares_f64(xr, H);
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const C v = opbridge::to_compute(xr[i]);
        ss += v * v;
      }
    }
    const C rs = C(1) / std::sqrt(ss / C(H) + eps);
    opbridge::map2(yr, xr, w, H, [rs](C v, C wv) { return v * rs * wv; }, stream);
  }
}

// With gw_i = g_i w_i:  dx = r gw - x r^3 mean(gw x),  dw += g x r.
// gw_acc is this thread's partial of grad_weight (fp32, fp64 for float64).
template <typename T>
OPB_TARGET_CLONES void rms_norm_backward_rows(T* grad_x, opbridge::compute_t<T>* gw_acc, const T* grad, const T* x,
                                              const T* w, int64_t rows, int64_t H, opbridge::compute_t<T> eps) {
  using C = opbridge::compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * H;
    const T* gr = grad + r * H;
    T* dxr = grad_x + r * H;
    C ss = 0, dot = 0;
#pragma omp simd reduction(+ : ss, dot)
    for (int64_t i = 0; i < H; ++i) {
      const C v = opbridge::to_compute(xr[i]);
      ss += v * v;
      dot += opbridge::to_compute(gr[i]) * opbridge::to_compute(w[i]) * v;
    }
    const C rs = C(1) / std::sqrt(ss / C(H) + eps);
    const C c = rs * rs * rs * dot / C(H);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) {
      const C v = opbridge::to_compute(xr[i]);
      const C g = opbridge::to_compute(gr[i]);
      dxr[i] = opbridge::from_compute<T>(rs * g * opbridge::to_compute(w[i]) - c * v);
      gw_acc[i] += g * v * rs;
    }
  }
}

// Reduces the per-thread partials into the first one, then casts; O(threads * H).
template <typename T>
void sum_partials(T* out, opbridge::compute_t<T>* partial, int nt, int64_t H) {
  for (int t = 1; t < nt; ++t) {
    const opbridge::compute_t<T>* p = partial + t * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) partial[i] += p[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = opbridge::from_compute<T>(partial[i]);
}

}  // namespace

void rms_norm_cpu(TensorView out, TensorView x, TensorView weight, double eps) {
  const char* op = "rms_norm";
  const opbridge::StridedRows xs = opbridge::rms_norm::check_forward(op, kDLCPU, out, x, weight, eps);
  const int64_t H = xs.width;

  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* y = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    const T* w = opbridge::data_ptr<const T>(weight);
    const bool stream = y != a && opbridge::stream_stores(x.numel() * int64_t(sizeof(T)));
    opbridge::parallel_for(rows, H, [&](int64_t lo, int64_t hi) {
      rms_norm_rows<T>(y, a, xs, w, lo, hi, H, opbridge::compute_t<T>(eps), stream);
    });
  });
}
OPBRIDGE_EXPORT(rms_norm_cpu);

void rms_norm_backward_cpu(TensorView grad_x, TensorView grad_weight, TensorView grad, TensorView x,
                           TensorView weight, double eps) {
  const char* op = "rms_norm_backward";
  const int64_t H = opbridge::rms_norm::check_backward(op, kDLCPU, grad_x, grad_weight, grad, x, weight, eps);

  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* dx = opbridge::data_ptr<T>(grad_x);
    T* dw = opbridge::data_ptr<T>(grad_weight);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    const T* w = opbridge::data_ptr<const T>(weight);
    // Per-thread partials in the compute type (fp32, fp64 for float64): summing
    // into a 16-bit grad_weight row by row would lose the small per-row terms,
    // and sharing one buffer would race. Zero rows still yields grad_weight = 0.
    using C = opbridge::compute_t<T>;
    const int nt = opbridge::parallel_threads(rows, H);
    std::vector<C> partial(size_t(nt) * size_t(H), C(0));
    opbridge::parallel_for(rows, H, [&](int64_t lo, int64_t hi, int tid) {
      rms_norm_backward_rows<T>(dx + lo * H, partial.data() + tid * H, g + lo * H, a + lo * H, w,
                                hi - lo, H, C(eps));
    });
    sum_partials<T>(dw, partial.data(), nt, H);
  });
}
OPBRIDGE_EXPORT(rms_norm_backward_cpu);
