// scale_(Tensor(a!) x, float alpha) -> (): x *= alpha, in place.
#include <opbridge/math.h>
#include <opbridge/opbridge.h>

namespace {

using opbridge::TensorView;

template <typename T>
OPB_TARGET_CLONES void scale_chunk(T* x, float alpha, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = opbridge::from_float<T>(opbridge::to_float(x[i]) * alpha);
}

}  // namespace

void scale__cpu(TensorView x, double alpha) {
  const char* op = "scale_";
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_CONTIGUOUS(op, x);
  const int64_t n = x.numel();
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* p = opbridge::data_ptr<T>(x);
    opbridge::parallel_for(n, 1, [&](int64_t lo, int64_t hi) { scale_chunk<T>(p + lo, float(alpha), hi - lo); });
  });
}
OPBRIDGE_EXPORT(scale__cpu);
