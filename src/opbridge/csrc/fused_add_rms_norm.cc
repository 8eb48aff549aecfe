// fused_add_rms_norm, in place (vLLM semantics), over the last dim H:
//   residual <- input + residual
//   input    <- residual * r * weight,  r = 1 / sqrt(mean(residual^2) + eps)
// The norm is taken of the residual as stored (rounded to its dtype), as vLLM
// does, so `input` equals rms_norm(residual_new, weight, eps) of the tensor the
// caller gets back. Sum and norm are computed in float32 (float64 in double),
// each rounded once.
#include <opbridge/cpu_map.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/fused_add_rms_norm.h>

#include <cmath>

namespace {

using opbridge::TensorView;

// One call per thread's row range (target_clones calls are not inlined).
// Per row: the first loop reads input and residual once and writes the new
// residual; the second re-reads that residual row from L1/L2 (any realistic H
// fits) and writes input. DRAM traffic is one read and one write of each
// tensor, with no temporary beyond a float accumulator.
template <typename T>
OPB_TARGET_CLONES void fused_add_rms_norm_rows(T* input, T* residual, const T* w, int64_t rows, int64_t H,
                                               opbridge::compute_t<T> eps) {
  using C = opbridge::compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    T* in = input + r * H;
    T* res = residual + r * H;
    C ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) {
      // No T-typed local: `omp simd` privatises an addressable struct local
      // into a per-lane array, which keeps the 16-bit loops scalar (0.4-0.8x
      // Inductor in bfloat16 before). round_to<T> is the value as stored.
      const C s = opbridge::to_compute(in[i]) + opbridge::to_compute(res[i]);
      res[i] = opbridge::from_compute<T>(s);
      const C v = opbridge::round_to<T>(s);
      ss += v * v;
    }
    const C rs = C(1) / std::sqrt(ss / C(H) + eps);
    opbridge::map2(in, res, w, H, [rs](C v, C wv) { return v * rs * wv; });
  }
}

}  // namespace

void fused_add_rms_norm_cpu(TensorView input, TensorView residual, TensorView weight, double eps) {
  const char* op = "fused_add_rms_norm";
  const int64_t H = opbridge::fused_add_rms_norm::check_args(op, kDLCPU, input, residual, weight, eps);

  const int64_t rows = H == 0 ? 0 : input.numel() / H;
  OPB_DISPATCH_FLOATING(op, input.dtype(), T, [&] {
    T* in = opbridge::data_ptr<T>(input);
    T* res = opbridge::data_ptr<T>(residual);
    const T* w = opbridge::data_ptr<const T>(weight);
    opbridge::parallel_for(rows, H, [&](int64_t lo, int64_t hi) {
      fused_add_rms_norm_rows<T>(in + lo * H, res + lo * H, w, hi - lo, H, opbridge::compute_t<T>(eps));
    });
  });
}
OPBRIDGE_EXPORT(fused_add_rms_norm_cpu);
