// Gated activations on CUDA, as activation_and_mul.cc (vLLM's silu_and_mul and
// gelu_tanh_and_mul): x = [a | b] split in halves along the last dim (2d),
// out = act(a) * b with last dim d; and their backward ops
//   *_and_mul_backward(grad, x) -> grad_x = [grad b act'(a) | grad act(a)].
// act is silu (a sigmoid(a)) or gelu with the tanh approximation, in float32
// with the formulas and clamps of opbridge/activations.h (expf for its
// fast_exp), so CPU and CUDA results agree to rounding. vLLM rounds act(a) to
// the input dtype before the multiply; this keeps it in float32.
// One block per row (grid-stride over rows); 128-bit accesses when d and the
// pointers allow.
#include <opbridge/cuda.h>
#include <opbridge/ops/activation_and_mul.h>

namespace {

using opbridge::TensorView;
namespace cu = opbridge::cuda;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;

// max(v, lo) that keeps NaN (fmaxf would replace it by lo).
__device__ __forceinline__ float clamp_below(float v, float lo) { return v < lo ? lo : v; }

// s = sigmoid(z) and 1 - s = e s with e = exp(-z): no cancellation on either
// tail; z clamped at -80 so that e stays finite.
struct Logistic {
  float s, one_minus_s;
};
__device__ __forceinline__ Logistic logistic(float z) {
  const float e = expf(-clamp_below(z, -80.f));
  const float s = 1.f / (1.f + e);
  return {s, e * s};
}

__device__ __forceinline__ float gelu_z(float x) { return 2.f * kSqrt2OverPi * x * (1.f + kGeluCoeff * x * x); }

struct Silu {
  __device__ static float act(float a) { return a / (1.f + expf(-a)); }
  // s (1 + a (1 - s)), a clamped at -80 as a whole (true value < 1.5e-33 there).
  __device__ static float grad(float a) {
    const float ac = clamp_below(a, -80.f);
    const Logistic l = logistic(ac);
    return l.s * (1.f + ac * l.one_minus_s);
  }
};

struct GeluTanh {
  // a sigmoid(z) = 0.5 a (1 + tanh(z / 2)), without 1 + tanh's cancellation.
  __device__ static float act(float a) { return a / (1.f + expf(-gelu_z(a))); }
  // s + a s (1 - s) dz/da, a clamped at -10 (z = -87.3; true value < 1e-32 below).
  __device__ static float grad(float a) {
    const float ac = clamp_below(a, -10.f);
    const Logistic l = logistic(gelu_z(ac));
    const float dz = 2.f * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * ac * ac);
    return l.s + ac * dz * l.one_minus_s * l.s;
  }
};

template <int N, typename T, typename Act>
__global__ void __launch_bounds__(1024)
    act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t d) {
  const int64_t dv = d / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    T* o = out + r * d;
    for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) {
      const cu::Vec<T, N> av = cu::load<N>(xa + i * N);
      const cu::Vec<T, N> bv = cu::load<N>(xb + i * N);
      cu::Vec<T, N> ov;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        ov.v[k] = cu::from_float<T>(Act::act(cu::to_float(av.v[k])) * cu::to_float(bv.v[k]));
      }
      cu::store<N>(o + i * N, ov);
    }
  }
}

template <int N, typename T, typename Act>
__global__ void __launch_bounds__(1024)
    act_and_mul_backward_kernel(T* __restrict__ grad_x, const T* __restrict__ grad,
                                const T* __restrict__ x, int64_t rows, int64_t d) {
  const int64_t dv = d / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    const T* g = grad + r * d;
    T* ga = grad_x + r * 2 * d;
    T* gb = ga + d;
    for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) {
      const cu::Vec<T, N> av = cu::load<N>(xa + i * N);
      const cu::Vec<T, N> bv = cu::load<N>(xb + i * N);
      const cu::Vec<T, N> gv = cu::load<N>(g + i * N);
      cu::Vec<T, N> dav, dbv;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float a = cu::to_float(av.v[k]);
        const float gk = cu::to_float(gv.v[k]);
        dav.v[k] = cu::from_float<T>(gk * cu::to_float(bv.v[k]) * Act::grad(a));
        dbv.v[k] = cu::from_float<T>(gk * Act::act(a));
      }
      cu::store<N>(ga + i * N, dav);
      cu::store<N>(gb + i * N, dbv);
    }
  }
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX)); }

template <typename Act>
void act_and_mul(const char* op, TensorView out, TensorView x) {
  OPB_CHECK_DEVICE(op, x, kDLCUDA);
  const int64_t d = opbridge::activation_and_mul::check_x(op, x);
  OPB_CHECK_SAME_DEVICE(op, out, x);
  opbridge::activation_and_mul::check_out(op, out, x);

  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    constexpr int V = cu::kVec<T>;
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    if (cu::can_vectorize<T>(d, o, a)) {
      act_and_mul_kernel<V, T, Act><<<row_grid(rows), cu::row_threads(d / V), 0, ctx.stream>>>(o, a, rows, d);
    } else {
      act_and_mul_kernel<1, T, Act><<<row_grid(rows), cu::row_threads(d), 0, ctx.stream>>>(o, a, rows, d);
    }
    ctx.check_launch();
  });
}

template <typename Act>
void act_and_mul_backward(const char* op, TensorView grad_x, TensorView grad, TensorView x) {
  OPB_CHECK_DEVICE(op, grad, kDLCUDA);
  OPB_CHECK_DEVICE(op, x, kDLCUDA);
  const int64_t d = opbridge::activation_and_mul::check_x(op, x);
  OPB_CHECK_SAME_DEVICE(op, x, grad);
  OPB_CHECK_SAME_DEVICE(op, grad_x, grad);
  opbridge::activation_and_mul::check_grads(op, grad_x, grad, x);

  const int64_t rows = d == 0 ? 0 : grad.numel() / d;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    constexpr int V = cu::kVec<T>;
    T* gx = opbridge::data_ptr<T>(grad_x);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    if (cu::can_vectorize<T>(d, gx, g, a)) {
      act_and_mul_backward_kernel<V, T, Act>
          <<<row_grid(rows), cu::row_threads(d / V), 0, ctx.stream>>>(gx, g, a, rows, d);
    } else {
      act_and_mul_backward_kernel<1, T, Act>
          <<<row_grid(rows), cu::row_threads(d), 0, ctx.stream>>>(gx, g, a, rows, d);
    }
    ctx.check_launch();
  });
}

}  // namespace

void silu_and_mul_cuda(TensorView out, TensorView x) { act_and_mul<Silu>("silu_and_mul", out, x); }
OPBRIDGE_EXPORT(silu_and_mul_cuda);

void gelu_and_mul_cuda(TensorView out, TensorView x) { act_and_mul<GeluTanh>("gelu_and_mul", out, x); }
OPBRIDGE_EXPORT(gelu_and_mul_cuda);

void silu_and_mul_backward_cuda(TensorView grad_x, TensorView grad, TensorView x) {
  act_and_mul_backward<Silu>("silu_and_mul_backward", grad_x, grad, x);
}
OPBRIDGE_EXPORT(silu_and_mul_backward_cuda);

void gelu_and_mul_backward_cuda(TensorView grad_x, TensorView grad, TensorView x) {
  act_and_mul_backward<GeluTanh>("gelu_and_mul_backward", grad_x, grad, x);
}
OPBRIDGE_EXPORT(gelu_and_mul_backward_cuda);
