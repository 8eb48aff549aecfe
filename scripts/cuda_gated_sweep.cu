// Launch-policy sweep of the gated activations' CUDA kernels (include/opbridge/cuda_gated.h):
// silu_and_mul and gelu_and_mul forward and silu_and_mul's backward at serving sizes (1, 8, 256,
// 4096 rows of intermediate 14336) and at 8192 x 8192 (d = 4096), float32 and bfloat16, under every
// policy (32-512 threads per block, 1, 2 or 4 units per thread, and 8 from 128 threads; units of 128
// bits, and of 64 bits at 1 to 256 rows, where more, narrower units spread a row over more SMs; four
// with cache-streaming loads and stores), each timed as 100 launches in a CUDA graph (median of 10
// replays) and checked against the ops' shipped policy (every policy runs the same arithmetic per
// element, so any difference is a bug); the shipped launch also with a larger footprint (footprint()).
// It launches the product's kernel templates themselves, so what it measures is what a policy change
// would ship.
// Built and run by scripts/cuda-sweep.sh gated; needs a CUDA GPU. Not part of any build or test.
#include <opbridge/cuda_gated.h>

#include <utility>

#include "cuda_sweep.h"

enum class Kind { kSiluForward, kGeluForward, kSiluBackward };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kSiluForward: return "silu_and_mul";
    case Kind::kGeluForward: return "gelu_and_mul";
    default: return "silu_and_mul_backward";
  }
}

// Whether policies P and Q launch alike (threads, units, cache policy; whether they narrow aside).
template <typename P, typename Q>
constexpr bool same_launch = P::kThreads == Q::kThreads && P::kUnits == Q::kUnits && P::kStream == Q::kStream;

// The unit width (elements) the op's shipped policy launches at rows x d on device 0: gated_width,
// with the wave that launch_gated reads (read here with CK: its own checks need tvm-ffi's library).
template <typename T, typename P, typename Kernel>
int shipped_width_of(Kernel narrow_kernel, int64_t rows, int64_t d) {
  int sms = 0, per_sm = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, narrow_kernel, P::kThreads, 0));
  return cu::gated_width<P, T>(rows, d, int64_t(sms) * std::max(per_sm, 1));
}

template <typename T>
int shipped_width(Kind kind, int64_t rows, int64_t d) {
  constexpr int H = cu::kVec<T> / 2;
  using F = cu::GatedCurrent;
  using B = cu::GatedBackward;
  switch (kind) {
    case Kind::kSiluForward: return shipped_width_of<T, F>(cu::act_and_mul_kernel<F, H, T, cu::Silu>, rows, d);
    case Kind::kGeluForward: return shipped_width_of<T, F>(cu::act_and_mul_kernel<F, H, T, cu::GeluTanh>, rows, d);
    default: return shipped_width_of<T, B>(cu::act_and_mul_backward_kernel<B, H, T, cu::Silu>, rows, d);
  }
}

// One launch of policy P's kernel of `kind` on the given buffers.
template <typename P, int N, typename T>
void launch_kind(Kind kind, int64_t rows, int64_t d, T* out, const T* x, const T* g, cudaStream_t s) {
  const dim3 grid = cu::gated_grid<P>(rows, d / N);
  if (kind == Kind::kSiluForward) {
    cu::act_and_mul_kernel<P, N, T, cu::Silu><<<grid, P::kThreads, 0, s>>>(out, x, rows, d);
  } else if (kind == Kind::kGeluForward) {
    cu::act_and_mul_kernel<P, N, T, cu::GeluTanh><<<grid, P::kThreads, 0, s>>>(out, x, rows, d);
  } else {
    cu::act_and_mul_backward_kernel<P, N, T, cu::Silu><<<grid, P::kThreads, 0, s>>>(out, g, x, rows, d);
  }
}

// What the shipped launch's time owes to the cache, which the sweep's other lines share (each launch reads
// what the last one read; at 256 rows of 14336 that is 21-42 MiB of an H200's 50 MiB L2 in bfloat16, 42-70
// in float32): its time with the outputs alternating between two buffers, as a caller that keeps each
// result alive until the next call makes them; and with the inputs rotating over 4 copies (DRAM-bound
// where 4 copies exceed the L2: from 256 rows; at 1 and 8 rows they still fit). Timed only: each launch
// runs the shipped kernel that the policy lines checked, on copies of the same inputs.
// bench gpu's peers differ here: Liger-Kernel's backward writes its gradients over its inputs, so its
// footprint is the inputs' alone. Lines start "footprint:", outside sweep_summary.py's policy table.
template <typename P, int N, typename T>
void footprint(Kind kind, int64_t rows, int64_t d, const T* x, const T* g, cudaStream_t s, double copy,
               double bytes) {
  const bool backward = kind == Kind::kSiluBackward;
  const int64_t n_x = rows * 2 * d, n_g = rows * d, n_out = rows * d * (backward ? 2 : 1);
  constexpr int kCopies = 4;
  T *outs[2], *xs[kCopies], *gs[kCopies];
  for (T*& o : outs) CK(cudaMalloc(&o, n_out * sizeof(T)));
  for (int c = 0; c < kCopies; ++c) {
    CK(cudaMalloc(&xs[c], n_x * sizeof(T)));
    CK(cudaMalloc(&gs[c], n_g * sizeof(T)));
    CK(cudaMemcpyAsync(xs[c], x, n_x * sizeof(T), cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpyAsync(gs[c], g, n_g * sizeof(T), cudaMemcpyDeviceToDevice, s));
  }
  int turn = 0;  // graph_us captures its launches in order: each captured launch takes the next buffers
  const float two_outs = graph_us([&] { launch_kind<P, N>(kind, rows, d, outs[turn++ % 2], x, g, s); }, s);
  const float rotated = graph_us([&] {
    const int c = turn++ % kCopies;
    launch_kind<P, N>(kind, rows, d, outs[c % 2], xs[c], gs[c], s);
  }, s);
  std::printf("footprint: %s %s %lld x %lld current policy: outputs alternating over 2 buffers %.3f us (%.3f copy); "
              "inputs rotating over %d copies %.3f us (%.3f copy)\n", kind_name(kind), dtype_name<T>(),
              (long long)rows, (long long)d, two_outs, bytes / (two_outs * 1e-6) / 1e9 / copy, kCopies, rotated,
              bytes / (rotated * 1e-6) / 1e9 / copy);
  for (T* p : outs) CK(cudaFree(p));
  for (int c = 0; c < kCopies; ++c) {
    CK(cudaFree(xs[c]));
    CK(cudaFree(gs[c]));
  }
}

// Every policy for one op, dtype and size, the current one first in its width's pass.
template <typename T, int N>
void sweep(Kind kind, int64_t rows, int64_t d, cudaStream_t s, double copy, std::vector<T>& want) {
  const bool backward = kind == Kind::kSiluBackward;
  const int64_t n_out = rows * d * (backward ? 2 : 1), units = d / N;
  T *x, *g, *out;
  CK(cudaMalloc(&x, rows * 2 * d * sizeof(T)));
  CK(cudaMalloc(&g, rows * d * sizeof(T)));
  CK(cudaMalloc(&out, n_out * sizeof(T)));
  fill<<<256, 256, 0, s>>>(x, rows * 2 * d, 1);
  fill<<<256, 256, 0, s>>>(g, rows * d, 2);
  CK(cudaGetLastError());
  // Bytes moved per launch: x (2d per row) and, backward, grad (d) read; out (d) or grad_x (2d) written.
  const double bytes = double(rows) * d * sizeof(T) * (backward ? 5 : 3);
  std::vector<T> got(n_out);
  // The policy the op ships (GatedCurrent forward, GatedBackward backward) at the unit width it
  // launches at this size (cuda_gated.h's launch_gated).
  const int shipped_n = shipped_width<T>(kind, rows, d);
  auto is_shipped = [&](auto policy) {
    using P = decltype(policy);
    return backward ? same_launch<P, cu::GatedBackward> : same_launch<P, cu::GatedCurrent>;
  };
  auto is_current = [&](auto policy) { return N == shipped_n && is_shipped(policy); };
  // the shipped policy runs first in the 128-bit pass (the reference) and in the pass of its width
  const bool shipped_first = N == cu::kVec<T> || N == shipped_n;
  auto one = [&](auto policy) {
    using P = decltype(policy);
    const dim3 grid = cu::gated_grid<P>(rows, units);
    const auto launch = [&] { launch_kind<P, N>(kind, rows, d, out, x, g, s); };
    CK(cudaMemsetAsync(out, 0, n_out * sizeof(T), s));
    launch();
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(got.data(), out, n_out * sizeof(T), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    const bool current = is_current(P{});
    if (want.empty()) want = got;
    double diff = 0;
    for (int64_t i = 0; i < n_out; i += 7) {
      diff = std::max(diff, double(std::fabs(host_float(got[i]) - host_float(want[i]))));
    }
    const float us = graph_us(launch, s);
    std::printf("%-21s %-8s %5lld x %-5lld %3d-bit threads %3d units %d %-6s blocks %6u x %-5u %9.3f us %6.3f "
                "copy  max|diff| %.2g%s\n", kind_name(kind), dtype_name<T>(), (long long)rows, (long long)d,
                int(8 * sizeof(T) * N), P::kThreads, P::kUnits, P::kStream ? "stream" : "cached", grid.x, grid.y, us,
                bytes / (us * 1e-6) / 1e9 / copy, diff,
                current ? "  <- current policy" : (diff != 0 ? "  MISMATCH" : ""));
  };
  if (shipped_first) {
    if (backward) one(cu::GatedBackward{});
    else one(cu::GatedCurrent{});
  }
  if (N == shipped_n) {
    if (backward) footprint<cu::GatedBackward, N>(kind, rows, d, x, g, s, copy, bytes);
    else footprint<cu::GatedCurrent, N>(kind, rows, d, x, g, s, copy, bytes);
  }
  auto other = [&](auto policy) {
    if (!(shipped_first && is_shipped(policy))) one(policy);
  };
  auto per_threads = [&](auto threads_c) {
    constexpr int Threads = decltype(threads_c)::value;
    auto units = [&](auto units_c) {
      using P = cu::GatedPolicy<Threads, decltype(units_c)::value>;
      other(P{});
    };
    units(std::integral_constant<int, 1>{});
    units(std::integral_constant<int, 2>{});
    units(std::integral_constant<int, 4>{});
    // 8: Liger-Kernel's swiglu keeps 8 128-bit loads of each operand in flight per thread (512 threads,
    // float32 rows of 14336: 61 registers, 2 blocks per SM; scripts/liger_registers.py's method)
    if constexpr (Threads >= 128) units(std::integral_constant<int, 8>{});
  };
  per_threads(std::integral_constant<int, 32>{});
  per_threads(std::integral_constant<int, 64>{});
  per_threads(std::integral_constant<int, 128>{});
  per_threads(std::integral_constant<int, 256>{});
  per_threads(std::integral_constant<int, 512>{});
  // cache-streaming loads and stores, under the current policy and its neighbours
  other(cu::GatedPolicy<128, 1, true>{});
  other(cu::GatedPolicy<128, 2, true>{});
  other(cu::GatedPolicy<256, 1, true>{});
  other(cu::GatedPolicy<64, 1, true>{});
  for (T* p : {x, g, out}) CK(cudaFree(p));
}

// 128-bit units first: the first launch's result is the reference of every launch of both widths (the
// inputs are the same deterministic values, the arithmetic per element the same).
template <typename T>
void sweep_widths(Kind kind, int64_t rows, int64_t d, cudaStream_t s, double copy) {
  std::vector<T> want;
  sweep<T, cu::kVec<T>>(kind, rows, d, s, copy, want);
  if (rows <= 256 || shipped_width<T>(kind, rows, d) != cu::kVec<T>) sweep<T, cu::kVec<T> / 2>(kind, rows, d, s, copy, want);
}

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = sweep_header(s);
  const int64_t shapes[][2] = {{1, 14336}, {8, 14336}, {256, 14336}, {4096, 14336}, {8192, 4096}};
  for (Kind kind : {Kind::kSiluForward, Kind::kGeluForward, Kind::kSiluBackward}) {
    for (const auto& sh : shapes) {
      sweep_widths<float>(kind, sh[0], sh[1], s, copy);
      sweep_widths<__nv_bfloat16>(kind, sh[0], sh[1], s, copy);
    }
  }
  CK(cudaStreamDestroy(s));
  return 0;
}
