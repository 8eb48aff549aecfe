// add(Tensor x, Tensor y) -> Tensor: elementwise, same shape, no broadcasting.
#include <opbridge/cpu_map.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/add.h>

namespace {

using opbridge::TensorView;

// The AVX2 form lets bfloat16 add run in registers (math.h, bf16_in_registers).
struct Add : opbridge::add::Sum {
#ifdef OPB_VEC_AVX2
  static constexpr bool kBf16InRegisters = true;
  static OPB_AVX2_INLINE __m256 avx2(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
#endif
};

// No __restrict: out may be exactly x or y (in-place), which omp simd's
// per-iteration independence still allows.
template <typename T>
OPB_TARGET_CLONES void add_chunk(T* out, const T* x, const T* y, int64_t n, bool stream) {
  opbridge::map2(out, x, y, n, Add{}, stream);
}

}  // namespace

void add_cpu(TensorView out, TensorView x, TensorView y) {
  const char* op = "add";
  opbridge::add::check_tensors(op, kDLCPU, out, x, y);

  const int64_t n = x.numel();
  OPB_DISPATCH_FLOATING_AND_INT(op, x.dtype(), T, [&] {
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    const T* b = opbridge::data_ptr<const T>(y);
    const bool stream = o != a && o != b && opbridge::stream_stores(n * int64_t(sizeof(T)));
    opbridge::parallel_for(n, 1, [&](int64_t lo, int64_t hi) {
      add_chunk<T>(o + lo, a + lo, b + lo, hi - lo, stream);
    });
  });
}
OPBRIDGE_EXPORT(add_cpu);
