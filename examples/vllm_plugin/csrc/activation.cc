// silu_and_mul(Tensor x) -> Tensor and its backward (declared in vllm_plugin/ops/activation.yaml).
// x = [a, b] split along the last dim (2d -> d + d):  out = silu(a) * b,  silu(a) = a s(a).
#include <opbridge/math.h>
#include <opbridge/opbridge.h>

namespace {

using opbridge::TensorView;

template <typename T>
OPB_TARGET_CLONES void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = x + r * 2 * d;
    const T* b = a + d;
    T* o = out + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const float v = opbridge::to_float(a[i]);
      o[i] = opbridge::from_float<T>(v * opbridge::fast_sigmoid(v) * opbridge::to_float(b[i]));
    }
  }
}

// d out / d a = b s (1 + a (1 - s)),  d out / d b = a s.
template <typename T>
OPB_TARGET_CLONES void silu_and_mul_backward_rows(T* grad_x, const T* grad, const T* x, int64_t rows,
                                                  int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = x + r * 2 * d;
    const T* b = a + d;
    const T* g = grad + r * d;
    T* ga = grad_x + r * 2 * d;
    T* gb = ga + d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const float v = opbridge::to_float(a[i]);
      const float s = opbridge::fast_sigmoid(v);
      const float gi = opbridge::to_float(g[i]);
      ga[i] = opbridge::from_float<T>(gi * opbridge::to_float(b[i]) * s * (1.f + v * (1.f - s)));
      gb[i] = opbridge::from_float<T>(gi * v * s);
    }
  }
}

// Returns d, half of x's last dim.
int64_t check_x(const char* op, const TensorView& x) {
  OPB_CHECK_DEVICE(op, x, kDLCPU);
  OPB_CHECK_FLOATING(op, x);
  OPB_CHECK_MIN_NDIM(op, x, 1);
  OPB_CHECK_CONTIGUOUS(op, x);
  const int64_t last = x.size(x.ndim() - 1);
  OPB_CHECK(last % 2 == 0, ValueError)
      << op << ": x's last dim must be even (it holds [a, b]), got shape " << opbridge::shape_str(x);
  return last / 2;
}

void check_half(const char* op, const char* name, const TensorView& t, const TensorView& x, int64_t d) {
  ::opbridge::check_device(op, name, t, kDLCPU);
  ::opbridge::check_same_dtype(op, name, t, "x", x);
  ::opbridge::check_ndim(op, name, t, int(x.ndim()));
  for (int i = 0; i + 1 < x.ndim(); ++i) ::opbridge::check_size(op, name, t, i, x.size(i), "x's leading dims");
  ::opbridge::check_size(op, name, t, -1, d, "half of x's last dim");
  ::opbridge::check_contiguous(op, name, t);
}

}  // namespace

void silu_and_mul_cpu(TensorView out, TensorView x) {
  const char* op = "silu_and_mul";
  const int64_t d = check_x(op, x);
  check_half(op, "out", out, x, d);
  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    opbridge::parallel_for(rows, 2 * d, [&](int64_t lo, int64_t hi) {
      silu_and_mul_rows<T>(o + lo * d, a + lo * 2 * d, hi - lo, d);
    });
  });
}
OPBRIDGE_EXPORT(silu_and_mul_cpu);

void silu_and_mul_backward_cpu(TensorView grad_x, TensorView grad, TensorView x) {
  const char* op = "silu_and_mul_backward";
  const int64_t d = check_x(op, x);
  check_half(op, "grad", grad, x, d);
  OPB_CHECK_DEVICE(op, grad_x, kDLCPU);
  OPB_CHECK_SAME_DTYPE(op, grad_x, x);
  OPB_CHECK_SAME_SHAPE(op, grad_x, x);
  OPB_CHECK_CONTIGUOUS(op, grad_x);
  const int64_t rows = d == 0 ? 0 : grad.numel() / d;
  OPB_DISPATCH_FLOATING(op, x.dtype(), T, [&] {
    T* gx = opbridge::data_ptr<T>(grad_x);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    opbridge::parallel_for(rows, 2 * d, [&](int64_t lo, int64_t hi) {
      silu_and_mul_backward_rows<T>(gx + lo * 2 * d, g + lo * d, a + lo * 2 * d, hi - lo, d);
    });
  });
}
OPBRIDGE_EXPORT(silu_and_mul_backward_cpu);
