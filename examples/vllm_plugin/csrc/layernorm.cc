// fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ():
// vLLM's fused residual add + RMSNorm over the last dim H, in place:
//   residual = x + residual;   x = residual / sqrt(mean(residual^2) + eps) * weight
#include <opbridge/math.h>
#include <opbridge/opbridge.h>

#include <cmath>

namespace {

using opbridge::TensorView;

// The sum is kept in float32 for the norm and the output, so each stored
// value is rounded once; the rows are re-read from cache for the second pass.
template <typename T>
OPB_TARGET_CLONES void fused_add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t H,
                                               float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * H;
    T* rr = residual + r * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) {
      const float z = opbridge::to_float(xr[i]) + opbridge::to_float(rr[i]);
      ss += z * z;
    }
    const float rs = 1.f / std::sqrt(ss / float(H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) {
      const float z = opbridge::to_float(xr[i]) + opbridge::to_float(rr[i]);
      rr[i] = opbridge::from_float<T>(z);
      xr[i] = opbridge::from_float<T>(z * rs * opbridge::to_float(w[i]));
    }
  }
}

}  // namespace

void fused_add_rms_norm_cpu(TensorView x, TensorView residual, TensorView weight, double eps) {
  const char* op = "fused_add_rms_norm";
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_DEVICE(op, residual, kDLCPU);
  OPB_CHECK_DEVICE(op, weight, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_SAME_DTYPE(op, residual, x);
  OPB_CHECK_SAME_DTYPE(op, weight, x);
  OPB_CHECK_MIN_NDIM(op, x, 1);
  OPB_CHECK_SAME_SHAPE(op, residual, x);
  OPB_CHECK_NDIM(op, weight, 1);
  const int64_t H = x.size(x.ndim() - 1);
  OPB_CHECK_SIZE(op, weight, 0, H, "x's last dim");
  OPB_CHECK_CONTIGUOUS(op, x);
  OPB_CHECK_CONTIGUOUS(op, residual);
  OPB_CHECK_CONTIGUOUS(op, weight);
  OPB_CHECK(eps >= 0, ValueError) << op << ": eps must be >= 0, got " << eps;

  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* a = opbridge::data_ptr<T>(x);
    T* r = opbridge::data_ptr<T>(residual);
    const T* w = opbridge::data_ptr<const T>(weight);
    opbridge::parallel_for(rows, H, [&](int64_t lo, int64_t hi) {
      fused_add_rms_norm_rows<T>(a + lo * H, r + lo * H, w, hi - lo, H, float(eps));
    });
  });
}
OPBRIDGE_EXPORT(fused_add_rms_norm_cpu);
