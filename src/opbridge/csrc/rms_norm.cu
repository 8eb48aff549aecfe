// rms_norm over the last dim H and its backward on CUDA.
//   y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)
// One block per row (grid-stride over rows), 128-bit accesses when H and the
// pointers allow, fp32 block reductions (fp64 for float64).
// Forward: rows that fit in a block's registers run cuda_norm.h's cached
// kernel (one memory round trip per row); longer rows the looped form of
// cuda_norm_looped.h, whose second read hits L1/L2.
#include <opbridge/cuda.h>
#include <opbridge/cuda_norm.h>
#include <opbridge/cuda_norm_backward.h>
#include <opbridge/cuda_norm_looped.h>
#include <opbridge/cuda_norm_staged.h>
#include <opbridge/ops/rms_norm.h>

namespace {

using opbridge::TensorView;
namespace cu = opbridge::cuda;

// With gw_i = g_i w_i:  dx = r gw - x r^3 mean(gw x),  dw = sum over rows of g x r.
// Block b accumulates its rows' g x r into partial[b, :] in fp32 (each column
// always by the same thread, so no atomics and a fixed summation order);
// cuda_norm_backward.h's column_sum_kernel then adds the blocks' partials in order.
// Rows that fit in registers run cuda_norm_backward.h's cached kernel instead.
template <int N>
using Backward = cu::RmsNormBackwardRows<N>;
constexpr int kBackwardThreads = Backward<1>::kMaxThreads;

template <int N, typename T, typename C = opbridge::compute_t<T>>
__global__ void __launch_bounds__(kBackwardThreads)
    rms_norm_backward_kernel(T* grad_x, C* __restrict__ partial, const T* __restrict__ grad,
                             const T* __restrict__ x, const T* __restrict__ w, int64_t rows,
                             int64_t H, C eps) {
  using C2 = cu::pair_t<C>;
  __shared__ C2 scratch[32];
  const int64_t hv = H / N;
  C* acc = partial + int64_t(blockIdx.x) * H;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * H;
    const T* gr = grad + r * H;
    T* dxr = grad_x + r * H;
    C2 sums = {C(0), C(0)};  // (sum x^2, sum g w x)
    for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
      const cu::Vec<T, N> xv = cu::load<N>(xr + i * N);
      const cu::Vec<T, N> gv = cu::load<N>(gr + i * N);
      const cu::Vec<T, N> wv = cu::load<N>(w + i * N);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const C v = cu::to_compute(xv.v[k]);
        sums.x += v * v;
        sums.y += cu::to_compute(gv.v[k]) * cu::to_compute(wv.v[k]) * v;
      }
    }
    sums = cu::block_sum(sums, scratch);
    const C rs = cu::rsqrt_of(sums.x / C(H) + eps);
    const C c = rs * rs * rs * sums.y / C(H);
    const bool first = r == blockIdx.x;
    for (int64_t i = threadIdx.x; i < hv; i += blockDim.x) {
      const cu::Vec<T, N> xv = cu::load<N>(xr + i * N);
      const cu::Vec<T, N> gv = cu::load<N>(gr + i * N);
      const cu::Vec<T, N> wv = cu::load<N>(w + i * N);
      cu::Vec<T, N> o;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const C v = cu::to_compute(xv.v[k]);
        const C g = cu::to_compute(gv.v[k]);
        o.v[k] = cu::from_compute<T>(rs * g * cu::to_compute(wv.v[k]) - c * v);
        const C d = g * v * rs;
        acc[i * N + k] = first ? d : acc[i * N + k] + d;
      }
      cu::store<N>(dxr + i * N, o);
    }
  }
}

}  // namespace

void rms_norm_cuda(TensorView out, TensorView x, TensorView weight, double eps) {
  const char* op = "rms_norm";
  const opbridge::StridedRows xs = opbridge::rms_norm::check_forward(op, kDLCUDA, out, x, weight, eps);
  const int64_t H = xs.width;  // x's rows may be at a stride

  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  if (rows == 0) return;
  cu::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    using C = opbridge::compute_t<T>;
    constexpr int V = cu::kVec<T>;
    T* y = opbridge::data_ptr<T>(out);
    const T* a = opbridge::data_ptr<const T>(x);
    const T* w = opbridge::data_ptr<const T>(weight);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX));
    if (cu::can_vectorize<T>(H, y, a, w) && xs.stride % V == 0) {
      if (!cu::launch_rms_rows_staged<cu::RmsNormStaged, V>(ctx, y, a, xs, w, rows, H, C(eps)) &&
          !cu::launch_rms_norm_rows<V>(ctx, y, a, xs, w, rows, H, C(eps))) {
        cu::rms_rows_looped_kernel<V, 0><<<grid, cu::row_threads(H / V), 0, ctx.stream>>>(y, a, xs, w, rows, H, C(eps));
      }
    } else {
      cu::rms_rows_looped_kernel<1, 0><<<grid, cu::row_threads(H), 0, ctx.stream>>>(y, a, xs, w, rows, H, C(eps));
    }
    ctx.check_launch();
  });
}
OPBRIDGE_EXPORT(rms_norm_cuda);

void rms_norm_backward_cuda(TensorView grad_x, TensorView grad_weight, TensorView grad,
                            TensorView x, TensorView weight, double eps) {
  const char* op = "rms_norm_backward";
  const int64_t H = opbridge::rms_norm::check_backward(op, kDLCUDA, grad_x, grad_weight, grad, x, weight, eps);

  if (H == 0) return;
  const int64_t rows = x.numel() / H;
  cu::Context ctx(op, x);
  OPB_DISPATCH_FLOATING(op, x.dtype(), S, [&] {
    using T = cu::device_t<S>;
    using C = opbridge::compute_t<T>;
    constexpr int V = cu::kVec<T>;
    T* dx = opbridge::data_ptr<T>(grad_x);
    T* dw = opbridge::data_ptr<T>(grad_weight);
    const T* g = opbridge::data_ptr<const T>(grad);
    const T* a = opbridge::data_ptr<const T>(x);
    const T* w = opbridge::data_ptr<const T>(weight);
    // dw too: a one-block grid (`direct`) stores it in 128-bit units (an out= view one element into a
    // buffer would otherwise fault, misaligned, and lose the CUDA context).
    const bool vec = cu::can_vectorize<T>(H, dx, dw, g, a, w);
    if (vec && cu::launch_rms_backward_staged<cu::RmsNormBackwardStaged, V>(ctx, dx, dw, g, a, w, rows, H, C(eps))) {
      return;
    }
    const int units = vec ? cu::cached_units<Backward<V>>(H / V) : 0;
    // Blocks of the main kernel, each owning one row of partial dw (fp32, fp64 for float64):
    // one full wave of the cached kernel where rows fit, else enough two-pass blocks to fill the GPU.
    int threads = 0;
    int64_t grid = 0;
    if (units > 0) {
      threads = cu::row_threads((H / V + units - 1) / units, kBackwardThreads);
      cu::with_units<Backward<V>::kMaxUnits>(units, [&](auto k_const) {
        constexpr int K = decltype(k_const)::value;
        static cu::ResidentCache resident = {};
        const auto kernel = cu::rms_norm_backward_cached_kernel<Backward<V>, V, K, T>;
        grid = std::min<int64_t>(rows, int64_t(ctx.num_sms()) * cu::resident_blocks(ctx, kernel, threads, resident));
      });
    } else {
      threads = cu::row_threads(vec ? H / V : H, kBackwardThreads);
      grid = std::min<int64_t>(rows, int64_t(ctx.num_sms()) * (2048 / threads));
    }
    // A cached grid of one block (one row) writes grad_weight itself: no scratch, no column sum.
    const bool direct = units > 0 && grid == 1;
    cu::Scratch partial(op, ctx, direct ? 0 : size_t(grid) * size_t(H) * sizeof(C));
    if (grid > 0) {
      C* part = partial.as<C>();
      if (units > 0) {
        cu::with_units<Backward<V>::kMaxUnits>(units, [&](auto k_const) {
          constexpr int K = decltype(k_const)::value;
          cu::rms_norm_backward_cached_kernel<Backward<V>, V, K><<<unsigned(grid), threads, 0, ctx.stream>>>(
              dx, dw, part, g, a, w, rows, H, C(eps));
        });
      } else if (vec) {
        rms_norm_backward_kernel<V><<<unsigned(grid), threads, 0, ctx.stream>>>(dx, part, g, a, w, rows, H, C(eps));
      } else {
        rms_norm_backward_kernel<1><<<unsigned(grid), threads, 0, ctx.stream>>>(dx, part, g, a, w, rows, H, C(eps));
      }
      ctx.check_launch();
    }
    if (direct) return;
    // With zero rows (parts = 0) this writes grad_weight = 0.
    cu::launch_column_sum(ctx.stream, dw, partial.as<const C>(), grid, H);
    ctx.check_launch();
  });
}
OPBRIDGE_EXPORT(rms_norm_backward_cuda);
