// fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()
// on CUDA, vLLM semantics, both updates in place:
//   residual = input + residual              (rounded to the dtype)
//   input    = rms_norm(residual, weight, eps)
// The norm is taken of the *rounded* sum, the value the caller gets back in
// residual. 128-bit accesses when H and the pointers allow; rows that fit in a
// block's registers run cuda_norm.h's cached kernel (one memory round trip per
// row) under the op's policy for these rows (cuda_norm_policy.h), longer ones
// the two-pass form below, one block per row.
#include <opbridge/cuda.h>
#include <opbridge/cuda_norm.h>
#include <opbridge/ops/fused_add_rms_norm.h>

namespace {

using opbridge::TensorView;
namespace cu = opbridge::cuda;

// No __restrict on input / residual: both are read and written. The second
// pass re-reads residual, which this very thread wrote in the first pass.
template <int N, typename T, typename C = opbridge::compute_t<T>>
__global__ void __launch_bounds__(1024)
    fused_add_rms_norm_kernel(T* input, T* residual, const T* __restrict__ w, int64_t rows,
                              int64_t H, C eps) {
  __shared__ C scratch[32];
  const int64_t hv = H / N;
  const C inv_h = cu::inverse_of<C>(H);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* in = input + r * H;
    T* res = residual + r * H;
    C ss = 0;
    for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
      const cu::Vec<T, N> a = cu::load<N>(in + i * N);
      const cu::Vec<T, N> b = cu::load<N>(res + i * N);
      cu::Vec<T, N> z;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        z.v[k] = cu::from_compute<T>(cu::to_compute(a.v[k]) + cu::to_compute(b.v[k]));
        const C f = cu::to_compute(z.v[k]);
        ss += f * f;
      }
      cu::store<N>(res + i * N, z);
    }
    const C rs = cu::rsqrt_of(cu::block_sum(ss, scratch) * inv_h + eps);
    for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
      const cu::Vec<T, N> z = cu::load<N>(res + i * N);
      const cu::Vec<T, N> wv = cu::load<N>(w + i * N);
      cu::Vec<T, N> o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        o.v[k] = cu::from_compute<T>(cu::to_compute(z.v[k]) * rs * cu::to_compute(wv.v[k]));
      }
      cu::store<N>(in + i * N, o);
    }
  }
}

}  // namespace

void fused_add_rms_norm_cuda(TensorView input, TensorView residual, TensorView weight, double eps) {
  const char* op = "fused_add_rms_norm";
  const int64_t H = opbridge::fused_add_rms_norm::check_args(op, kDLCUDA, input, residual, weight, eps);

  const int64_t rows = H == 0 ? 0 : input.numel() / H;
  if (rows == 0) return;
  cu::Context ctx(op, input);
  OPB_DISPATCH_FLOATING(op, input.dtype(), S, [&] {
    using T = cu::device_t<S>;
    using C = opbridge::compute_t<T>;
    constexpr int V = cu::kVec<T>;
    T* in = opbridge::data_ptr<T>(input);
    T* res = opbridge::data_ptr<T>(residual);
    const T* w = opbridge::data_ptr<const T>(weight);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX));
    if (cu::can_vectorize<T>(H, in, res, w)) {
      if (!cu::launch_fused_add_rms_norm_rows<V>(ctx, in, res, w, rows, H, C(eps))) {
        fused_add_rms_norm_kernel<V><<<grid, cu::row_threads(H / V), 0, ctx.stream>>>(in, res, w, rows, H,
                                                                                     C(eps));
      }
    } else {
      fused_add_rms_norm_kernel<1><<<grid, cu::row_threads(H), 0, ctx.stream>>>(in, res, w, rows, H,
                                                                               C(eps));
    }
    ctx.check_launch();
  });
}
OPBRIDGE_EXPORT(fused_add_rms_norm_cuda);
