// Gated activations on CUDA, as activation_and_mul.cc (vLLM's silu_and_mul and
// gelu_tanh_and_mul): x = [a | b] split in halves along the last dim (2d),
// out = act(a) * b with last dim d; and their backward ops
//   *_and_mul_backward(grad, x) -> grad_x = [grad b act'(a) | grad act(a)].
// act is silu (a sigmoid(a)) or gelu with the tanh approximation, in float32
// (float64 in double) with the formulas and clamps of opbridge/activation_math.h (those of the CPU
// kernels' activations.h, with expf), so CPU and CUDA results agree to rounding. vLLM rounds act(a) to
// the input dtype before the multiply; this keeps it in float32.
// One chunk of kGatedThreads column units of one row per block
// (cu::Context::rows_grid: chunks over blockIdx.x, rows over blockIdx.y,
// grid-stride past 65535 rows), so a decode step's 1-8 rows spread over as
// many SMs as 4096 rows do; 128-bit accesses when d and the pointers allow.
// Small blocks keep occupancy high whatever the register count.
#include <opbridge/activation_math.h>
#include <opbridge/cuda.h>
#include <opbridge/ops/activation_and_mul.h>

namespace {

using opbridge::TensorView;
namespace cu = opbridge::cuda;

namespace am = opbridge::act_math;
using Math = cu::Math;

// act / grad in C = float, or double for float64.
struct Silu {
  template <typename C> __device__ static C act(C a) { return am::silu<Math>(a); }
  template <typename C> __device__ static C grad(C a) { return am::silu_grad<Math>(a); }
};
struct GeluTanh {
  template <typename C> __device__ static C act(C a) { return am::gelu_tanh<Math>(a); }
  template <typename C> __device__ static C grad(C a) { return am::gelu_tanh_grad<Math>(a); }
};

constexpr int kGatedThreads = 128;

template <int N, typename T, typename Act>
__global__ void __launch_bounds__(kGatedThreads)
    act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t d) {
  const int64_t dv = d / N;
  const int64_t i = int64_t(blockIdx.x) * kGatedThreads + threadIdx.x;
  if (i >= dv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    T* o = out + r * d;
    const cu::Vec<T, N> av = cu::load<N>(xa + i * N);
    const cu::Vec<T, N> bv = cu::load<N>(xb + i * N);
    cu::Vec<T, N> ov;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      ov.v[k] = cu::from_compute<T>(Act::act(cu::to_compute(av.v[k])) * cu::to_compute(bv.v[k]));
    }
    cu::store<N>(o + i * N, ov);
  }
}

template <int N, typename T, typename Act>
__global__ void __launch_bounds__(kGatedThreads)
    act_and_mul_backward_kernel(T* __restrict__ grad_x, const T* __restrict__ grad,
                                const T* __restrict__ x, int64_t rows, int64_t d) {
  const int64_t dv = d / N;
  const int64_t i = int64_t(blockIdx.x) * kGatedThreads + threadIdx.x;
  if (i >= dv) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* xa = x + r * 2 * d;
    const T* xb = xa + d;
    const T* g = grad + r * d;
    T* ga = grad_x + r * 2 * d;
    T* gb = ga + d;
    const cu::Vec<T, N> av = cu::load<N>(xa + i * N);
    const cu::Vec<T, N> bv = cu::load<N>(xb + i * N);
    const cu::Vec<T, N> gv = cu::load<N>(g + i * N);
    cu::Vec<T, N> dav, dbv;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const auto a = cu::to_compute(av.v[k]);
      const auto gk = cu::to_compute(gv.v[k]);
      dav.v[k] = cu::from_compute<T>(gk * cu::to_compute(bv.v[k]) * Act::grad(a));
      dbv.v[k] = cu::from_compute<T>(gk * Act::act(a));
    }
    cu::store<N>(ga + i * N, dav);
    cu::store<N>(gb + i * N, dbv);
  }
}

template <typename Act>
void act_and_mul(const char* op, TensorView out, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_forward(op, kDLCUDA, out, x);

  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    constexpr int V = cu::kVec<T>;
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    if (cu::can_vectorize<T>(d, o, a)) {
      act_and_mul_kernel<V, T, Act><<<ctx.rows_grid(rows, d / V, kGatedThreads), kGatedThreads, 0, ctx.stream>>>(
          o, a, rows, d);
    } else {
      act_and_mul_kernel<1, T, Act><<<ctx.rows_grid(rows, d, kGatedThreads), kGatedThreads, 0, ctx.stream>>>(
          o, a, rows, d);
    }
    ctx.check_launch();
  });
}

template <typename Act>
void act_and_mul_backward(const char* op, TensorView grad_x, TensorView grad, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_backward(op, kDLCUDA, grad_x, grad, x);

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
          <<<ctx.rows_grid(rows, d / V, kGatedThreads), kGatedThreads, 0, ctx.stream>>>(gx, g, a, rows, d);
    } else {
      act_and_mul_backward_kernel<1, T, Act>
          <<<ctx.rows_grid(rows, d, kGatedThreads), kGatedThreads, 0, ctx.stream>>>(gx, g, a, rows, d);
    }
    ctx.check_launch();
  });
}

}  // namespace

OPB_EXPORT_ACTIVATION_AND_MUL(cuda);
