// Gated activations on CUDA, as activation_and_mul.cc (vLLM's silu_and_mul and
// gelu_tanh_and_mul): x = [a | b] split in halves along the last dim (2d),
// out = act(a) * b with last dim d; and their backward ops
//   *_and_mul_backward(grad, x) -> grad_x = [grad b act'(a) | grad act(a)].
// act is silu (a sigmoid(a)) or gelu with the tanh approximation, in float32
// (float64 in double) with the formulas and clamps of opbridge/activation_math.h (those of the CPU
// kernels' activations.h, with expf), so CPU and CUDA results agree to rounding. vLLM rounds act(a) to
// the input dtype before the multiply; this keeps it in float32.
// The kernels and their launch policy are opbridge/cuda_gated.h's.
#include <opbridge/cuda.h>
#include <opbridge/cuda_gated.h>
#include <opbridge/ops/activation_and_mul.h>

namespace {

using opbridge::TensorView;
namespace cu = opbridge::cuda;
using cu::GeluTanh;
using cu::Silu;

template <typename Act>
void act_and_mul(const char* op, TensorView out, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_forward(op, kDLCUDA, out, x);

  const int64_t rows = d == 0 ? 0 : out.numel() / d;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  using P = cu::GatedCurrent;
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    T* o = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    const auto kernel_of = [](auto n) { return cu::act_and_mul_kernel<P, decltype(n)::value, T, Act>; };
    cu::launch_gated<P, T>(ctx, cu::can_vectorize<T>(d, o, a), rows, d, kernel_of, o, a);
    ctx.check_launch();
  });
}

template <typename Act>
void act_and_mul_backward(const char* op, TensorView grad_x, TensorView grad, TensorView x) {
  const int64_t d = opbridge::activation_and_mul::check_backward(op, kDLCUDA, grad_x, grad, x);

  const int64_t rows = d == 0 ? 0 : grad.numel() / d;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  using P = cu::GatedBackward;
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    T* gx = opbridge::data_ptr<T>(grad_x);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    const auto kernel_of = [](auto n) { return cu::act_and_mul_backward_kernel<P, decltype(n)::value, T, Act>; };
    cu::launch_gated<P, T>(ctx, cu::can_vectorize<T>(d, gx, g, a), rows, d, kernel_of, gx, g, a);
    ctx.check_launch();
  });
}

}  // namespace

OPB_EXPORT_ACTIVATION_AND_MUL(cuda);
