// Gated activations as in vLLM (silu_and_mul, gelu_tanh_and_mul) and their backward ops.
//   x = [a | b] along the last dim (size 2d):  out = act(a) * b,  shape (..., d)
//   backward:  grad_a = grad * b * act'(a),  grad_b = grad * act(a)
// act is silu (x sigmoid(x)) or gelu with the tanh approximation. Math is
// float32 through opbridge/activations.h (vectorised exp, no libm call in the
// loops); the error bounds are documented there.
#include <opbridge/activations.h>
#include <opbridge/math.h>
#include <opbridge/opbridge.h>

#include <algorithm>

namespace {

using opbridge::TensorView;

struct Silu {
  static OPB_ALWAYS_INLINE float f(float x) { return opbridge::act::silu(x); }
  static OPB_ALWAYS_INLINE float df(float x) { return opbridge::act::silu_grad(x); }
};
struct GeluTanh {
  static OPB_ALWAYS_INLINE float f(float x) { return opbridge::act::gelu_tanh(x); }
  static OPB_ALWAYS_INLINE float df(float x) { return opbridge::act::gelu_tanh_grad(x); }
};

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
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      o[i] = opbridge::from_float<T>(Act::f(opbridge::to_float(a[i])) * opbridge::to_float(b[i]));
    }
    lo += n;
    ++r;
    i0 = 0;
  }
}

// Same split over the (rows, d) grad; each element writes grad_x at [a] and [b].
template <typename Act, typename T>
OPB_TARGET_CLONES void act_and_mul_backward_chunk(T* grad_x, const T* grad, const T* x, int64_t d,
                                                  int64_t lo, int64_t hi) {
  int64_t r = lo / d, i0 = lo - r * d;
  while (lo < hi) {
    const int64_t n = std::min(d - i0, hi - lo);
    const T* a = x + r * 2 * d + i0;
    const T* b = a + d;
    const T* g = grad + r * d + i0;
    T* ga = grad_x + r * 2 * d + i0;
    T* gb = ga + d;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float av = opbridge::to_float(a[i]);
      const float gv = opbridge::to_float(g[i]);
      ga[i] = opbridge::from_float<T>(gv * opbridge::to_float(b[i]) * Act::df(av));
      gb[i] = opbridge::from_float<T>(gv * Act::f(av));
    }
    lo += n;
    ++r;
    i0 = 0;
  }
}

// x: (..., 2d) floating, contiguous, on CPU. Returns d.
int64_t check_x(const char* op, const TensorView& x) {
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_MIN_NDIM(op, x, 1);
  const int64_t two_d = x.size(x.ndim() - 1);
  OPB_CHECK(two_d % 2 == 0, ValueError)
      << op << ": x's last dim must be even (it holds the halves [a | b]), got shape "
      << opbridge::shape_str(x);
  OPB_CHECK_CONTIGUOUS(op, x);
  return two_d / 2;
}

// t has x's shape with the last dim halved.
void check_half_shape(const char* op, const char* arg, const TensorView& t, const TensorView& x) {
  bool ok = t.ndim() == x.ndim();
  for (int i = 0; ok && i + 1 < t.ndim(); ++i) ok = t.size(i) == x.size(i);
  ok = ok && t.size(t.ndim() - 1) * 2 == x.size(x.ndim() - 1);
  OPB_CHECK(ok, ValueError) << op << ": " << arg << " must have x's shape with the last dim halved (x: "
                            << opbridge::shape_str(x) << "), got " << opbridge::shape_str(t);
}

template <typename Act>
void act_and_mul(const char* op, TensorView out, TensorView x) {
  const int64_t d = check_x(op, x);
  OPB_CHECK_DEVICE(op, out, kDLCPU);
  OPB_CHECK_SAME_DTYPE(op, out, x);
  check_half_shape(op, "out", out, x);
  OPB_CHECK_CONTIGUOUS(op, out);

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
  const int64_t d = check_x(op, x);
  OPB_CHECK_DEVICE(op, grad, kDLCPU);
  OPB_CHECK_DEVICE(op, grad_x, kDLCPU);
  OPB_CHECK_SAME_DTYPE(op, grad, x);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  check_half_shape(op, "grad", grad, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_CONTIGUOUS(op, grad);
  OPB_CHECK_CONTIGUOUS(op, grad_x);

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

void silu_and_mul_cpu(TensorView out, TensorView x) { act_and_mul<Silu>("silu_and_mul", out, x); }
OPBRIDGE_EXPORT(silu_and_mul_cpu);

void gelu_and_mul_cpu(TensorView out, TensorView x) { act_and_mul<GeluTanh>("gelu_and_mul", out, x); }
OPBRIDGE_EXPORT(gelu_and_mul_cpu);

void silu_and_mul_backward_cpu(TensorView grad_x, TensorView grad, TensorView x) {
  act_and_mul_backward<Silu>("silu_and_mul_backward", grad_x, grad, x);
}
OPBRIDGE_EXPORT(silu_and_mul_backward_cpu);

void gelu_and_mul_backward_cpu(TensorView grad_x, TensorView grad, TensorView x) {
  act_and_mul_backward<GeluTanh>("gelu_and_mul_backward", grad_x, grad, x);
}
OPBRIDGE_EXPORT(gelu_and_mul_backward_cpu);
