// Gated activations as in vLLM (silu_and_mul, gelu_tanh_and_mul) and their backward ops.
//   x = [a | b] along the last dim (size 2d):  out = act(a) * b,  shape (..., d)
//   backward:  grad_a = grad * b * act'(a),  grad_b = grad * act(a)
// act is silu (x sigmoid(x)) or gelu with the tanh approximation. Math is
// float32 through opbridge/activations.h (vectorised exp, no libm call in the
// loops; the error bounds are documented there), float64 in double (the backward
// takes act and act' from one exp there, Act::fdf).
#include <opbridge/activations.h>
#include <opbridge/cpu_map.h>
#include <opbridge/opbridge.h>
#include <opbridge/ops/activation_and_mul.h>

#include <algorithm>
#include <type_traits>

namespace {

using opbridge::TensorView;

using opbridge::act::GeluTanh;
using opbridge::act::Silu;

// Output elements [lo, hi) of the flattened (rows, d) output; a chunk may start
// and end mid-row, so the split is even whatever the row count (one long row
// still runs on every thread). One call per thread: target_clones functions
// are not inlined.
template <typename Act, typename T>
OPB_TARGET_CLONES void act_and_mul_chunk(T* out, const T* x, int64_t d, int64_t lo, int64_t hi) {
  int64_t r = lo / d, i0 = lo - r * d;
  while (lo < hi) {
    const int64_t n = std::min(d - i0, hi - lo);
    const T* a = x + r * 2 * d + i0;
    const T* b = a + d;
    T* o = out + r * d + i0;
    opbridge::map2(o, a, b, n, opbridge::act::ApplyAndMul<Act>{});
    lo += n;
    ++r;
    i0 = 0;
  }
}

// Same split over the (rows, d) grad; each element writes grad_x at [a] and [b].
template <typename Act, typename T>
OPB_TARGET_CLONES void act_and_mul_backward_chunk(T* grad_x, const T* grad, const T* x, int64_t d,
                                                  int64_t lo, int64_t hi) {
  using C = opbridge::compute_t<T>;
  int64_t r = lo / d, i0 = lo - r * d;
  while (lo < hi) {
    const int64_t n = std::min(d - i0, hi - lo);
    const T* a = x + r * 2 * d + i0;
    const T* b = a + d;
    const T* g = grad + r * d + i0;
    T* ga = grad_x + r * 2 * d + i0;
    T* gb = ga + d;
    if constexpr (std::is_same_v<C, double>) {  // act and act' from one exp (Act::fdf)
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const opbridge::act::f64::ValueAndGrad v = Act::fdf(a[i]);
        ga[i] = g[i] * b[i] * v.df;
        gb[i] = g[i] * v.f;
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const C av = opbridge::to_compute(a[i]);
        const C gv = opbridge::to_compute(g[i]);
        ga[i] = opbridge::from_compute<T>(gv * opbridge::to_compute(b[i]) * Act::df(av));
        gb[i] = opbridge::from_compute<T>(gv * Act::f(av));
      }
    }
    lo += n;
    ++r;
    i0 = 0;
  }
}

template <typename Act>
void act_and_mul(const char* op, TensorView out, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_forward(op, kDLCPU, out, x);

  const int64_t n = out.numel();
  if (n == 0) return;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    // Threading decided on x's element count (2 per output element), as rms_norm does.
    opbridge::parallel_for(n, 2, [&](int64_t lo, int64_t hi) { act_and_mul_chunk<Act, T>(o, a, d, lo, hi); });
  });
}

template <typename Act>
void act_and_mul_backward(const char* op, TensorView grad_x, TensorView grad, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_backward(op, kDLCPU, grad_x, grad, x);

  const int64_t n = grad.numel();
  if (n == 0) return;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* gx = opbridge::data_ptr<T>(grad_x);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    // Threading decided on x's element count (2 per grad element).
    opbridge::parallel_for(n, 2, [&](int64_t lo, int64_t hi) {
      act_and_mul_backward_chunk<Act, T>(gx, g, a, d, lo, hi);
    });
  });
}

}  // namespace

OPB_EXPORT_ACTIVATION_AND_MUL(cpu);
