// rms_norm's rows staged through shared memory by asynchronous copies: the candidate for many rows
// of 16-bit elements, where the register-cached kernel (cuda_norm.h) leaves the memory system idle.
//
// Why. A block of the cached kernel loads its row into registers, waits for the whole row, sums it
// across the block (a barrier) and writes it; only then does it load its next row. The loads in
// flight per SM are the registers its resident threads can hold: bfloat16 rows of 8192 ran 2 blocks
// of 1024 threads x 16 bytes, 32 KiB per SM, and reached 3.0 TB/s on an H200 (88 us at 8192 x 8192;
// 68 us at 3 blocks of 512 x 32 bytes since 2026-11-28, cuda_norm_policy.h's RmsNormRows)
// where float32, with 64 KiB in flight, reached 4.2 TB/s, and Liger-Kernel's bfloat16 kernel (48 KiB
// per SM) 69 us. Holding more in registers costs occupancy (cuda_norm_policy.h's min_blocks, kPrefetch).
//
// How. A persistent grid (one wave); each block copies its next S - 1 rows into S shared-memory
// stages with cp.async (16 bytes a copy, through L2 only; sm_80 and later) while it reduces and
// writes the current one from its stage, so every SM keeps (S - 1) rows per block in flight in
// shared memory instead of registers. Each thread copies, reads back and writes only its own units
// (unit i of a row is thread i mod blockDim.x's), so a stage needs no barrier between its copy, its
// reads and its next copy: cp.async.wait_group orders a thread's own copies before its reads, and a
// thread's next copy into a stage comes after the stores that consumed what it read there (in-order
// issue; the values stored are those reads). The only barrier is the block sum's.
//
// Not shipped: rms_norm.cu's staged policies below ask for no stages (kStages 0: the kernels are not
// even compiled) until scripts/cuda-sweep.sh norm has timed them on a GPU against the cached kernel
// (its "staged" lines); untried on a GPU as written. To try them in the product itself (its tests,
// opbridge bench gpu), build the CUDA module with them on:
//   OPBRIDGE_CUDA_FLAGS="-DOPB_RMS_NORM_STAGES=3 -DOPB_RMS_NORM_BACKWARD_STAGES=2"
// (a module of its own in the cache: the flags are part of its key), and optionally
// -DOPB_RMS_NORM_STAGED_THREADS=, _STAGED_ROWS=, -DOPB_RMS_NORM_BACKWARD_STAGED_THREADS=, _STAGED_ROWS=.
#pragma once

#include <opbridge/cuda_norm.h>
#include <opbridge/cuda_norm_backward.h>

#ifndef OPB_RMS_NORM_STAGES
#define OPB_RMS_NORM_STAGES 0
#endif
#ifndef OPB_RMS_NORM_STAGED_THREADS
#define OPB_RMS_NORM_STAGED_THREADS 512
#endif
#ifndef OPB_RMS_NORM_STAGED_ROWS
#define OPB_RMS_NORM_STAGED_ROWS 1024
#endif
#ifndef OPB_RMS_NORM_BACKWARD_STAGES
#define OPB_RMS_NORM_BACKWARD_STAGES 0
#endif
#ifndef OPB_RMS_NORM_BACKWARD_STAGED_THREADS
#define OPB_RMS_NORM_BACKWARD_STAGED_THREADS 512
#endif
#ifndef OPB_RMS_NORM_BACKWARD_STAGED_ROWS
#define OPB_RMS_NORM_BACKWARD_STAGED_ROWS 1024
#endif

namespace opbridge {
namespace cuda {

// rms_norm.cu's staged policies: kStages stages (0: off), blocks of up to kMaxThreads, from kMinRows
// rows on (fewer rows keep the cached kernel, whose one round trip per row is the latency floor).
template <int N>
struct RmsNormStaged {
  static constexpr int kStages = OPB_RMS_NORM_STAGES, kMaxThreads = OPB_RMS_NORM_STAGED_THREADS;
  static constexpr int64_t kMinRows = OPB_RMS_NORM_STAGED_ROWS;
  static constexpr bool kFastSum = true, kStream = false;
};
// The backward's: units per thread as RmsNormBackwardRows spreads them, no occupancy asked.
template <int N>
struct RmsNormBackwardStaged : RmsNormBackwardRows<N> {
  static constexpr int kStages = OPB_RMS_NORM_BACKWARD_STAGES, kMaxThreads = OPB_RMS_NORM_BACKWARD_STAGED_THREADS;
  static constexpr int64_t kMinRows = OPB_RMS_NORM_BACKWARD_STAGED_ROWS;
  static constexpr int min_blocks(int) { return 0; }
};

// 16 bytes from global to shared memory without passing through registers (cp.async.cg: cached in
// L2 only), completed by copy_async_wait. Before sm_80 a plain copy through a register: the same
// result, without the overlap.
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<int4*>(smem) = *static_cast<const int4*>(gmem);
#endif
}
// Closes this thread's copies issued since the last commit into one group.
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most `Pending` of this thread's most recent groups are still in flight.
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

// rms_norm over contiguous rows of H elements (x row r at r * H; H a multiple of N, x, out and w
// 16-byte aligned: the launcher checks), S stages (S >= 1; 1 copies and waits, no overlap), blocks of
// P::kMaxThreads threads at most; launched with one wave of blocks, each taking rows blockIdx.x,
// + gridDim.x, ... Dynamic shared memory: S * (H / N) * 16 bytes. `out` may be x (in place): a thread
// reads each unit it writes, from its stage, before writing it.
template <int N, int S, typename P, typename T, typename C = compute_t<T>>
__global__ void __launch_bounds__(P::kMaxThreads)
    rms_rows_staged_kernel(T* out, const T* __restrict__ x, const T* __restrict__ w, int64_t rows, int64_t H, C eps) {
  static_assert(S >= 1, "at least one stage");
  using U = held_t<T, N>;  // one 16-byte unit as raw bytes
  static_assert(sizeof(U) == 16, "staged units are 16 bytes");
  extern __shared__ int4 staged_rows[];  // S stages of one row's hv units
  __shared__ C scratch[2][32];
  U* stages = reinterpret_cast<U*>(staged_rows);
  const int hv = static_cast<int>(H / N);
  const int64_t step = gridDim.x;
  const C inv_h = inverse_of<C>(H);
  // Row r's copies into `stage` (this thread's units), one commit group even past the last row, so
  // that every thread's group count, and the wait below, stay the same in every iteration.
  auto copy_row = [&](int64_t r, int stage) {
    if (r < rows) {
      const U* src = reinterpret_cast<const U*>(x + r * H);
      U* dst = stages + int64_t(stage) * hv;
      for (int i = threadIdx.x; i < hv; i += blockDim.x) copy_async16(dst + i, src + i);
    }
    copy_async_commit();
  };
  int64_t r = blockIdx.x;
#pragma unroll
  for (int s = 0; s + 1 < S; ++s) copy_row(r + s * step, s);
  int stage = 0, parity = 0;
  for (; r < rows; r += step, parity ^= 1) {
    // Into the stage the previous row was read from (this thread's reads of it are stored below).
    copy_row(r + (S - 1) * step, stage == 0 ? S - 1 : stage - 1);
    copy_async_wait<S - 1>();  // this thread's copies of row r have landed
    const U* row = stages + int64_t(stage) * hv;
    C ss = 0;
    for (int i = threadIdx.x; i < hv; i += blockDim.x) {
      const Vec<T, N> z = unhold<T, N>(row[i]);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const C f = to_compute(z.v[j]);
        ss += f * f;
      }
    }
    if constexpr (P::kFastSum) {
      ss = block_sum_fast(ss, scratch, parity);
    } else {
      ss = block_sum(ss, scratch[0]);
    }
    const C rs = rsqrt_of(ss * inv_h + eps);
    T* yr = out + r * H;
    for (int i = threadIdx.x; i < hv; i += blockDim.x) {
      const Vec<T, N> z = unhold<T, N>(row[i]);
      const Vec<T, N> wv = load<N>(w + int64_t(i) * N);
      Vec<T, N> o;
#pragma unroll
      for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(to_compute(z.v[j]) * rs * to_compute(wv.v[j]));
      store_as<P::kStream, N>(yr + int64_t(i) * N, o);
    }
    stage = stage + 1 == S ? 0 : stage + 1;
  }
  copy_async_wait<0>();  // none of this block's copies outlives it
}

// rms_norm's backward (cuda_norm_backward.h's formulas and column sums) with x's and grad's rows staged
// the same way: the kernel whose 16-bit form ran at 0.65 of copy bandwidth on an H200 held both rows,
// the weight and K x N running sums in registers (96 registers, one block of 512 per SM). Here a
// thread holds its weight units (raw bytes) and its sums; the rows wait in shared memory, S - 1 rows
// ahead. K units per thread (unit i = threadIdx.x + k * blockDim.x: a thread's columns stay its own
// across rows, as its sums need). Dynamic shared memory: S * 2 * (H / N) * 16 bytes. A persistent
// grid: with more than one block each writes its row of `partial` and column_sum_kernel adds them.
template <typename P, int N, int K, int S, typename T, typename C = compute_t<T>>
__global__ void __launch_bounds__(P::kMaxThreads)
    rms_norm_backward_staged_kernel(T* grad_x, T* grad_w, C* __restrict__ partial, const T* __restrict__ grad,
                                    const T* __restrict__ x, const T* __restrict__ w, int64_t rows, int64_t H,
                                    C eps) {
  static_assert(S >= 1, "at least one stage");
  using U = held_t<T, N>;
  static_assert(sizeof(U) == 16, "staged units are 16 bytes");
  using C2 = pair_t<C>;
  extern __shared__ int4 staged_rows[];  // S stages of (x's row, grad's row), hv units each
  __shared__ C2 scratch[2][32];
  U* stages = reinterpret_cast<U*>(staged_rows);
  const int hv = static_cast<int>(H / N);
  const int64_t step = gridDim.x;
  auto copy_rows = [&](int64_t r, int stage) {
    if (r < rows) {
      const U* xs = reinterpret_cast<const U*>(x + r * H);
      const U* gs = reinterpret_cast<const U*>(grad + r * H);
      U* dst = stages + int64_t(stage) * 2 * hv;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < hv) {
          copy_async16(dst + i, xs + i);
          copy_async16(dst + hv + i, gs + i);
        }
      }
    }
    copy_async_commit();
  };
  int64_t r = blockIdx.x;
#pragma unroll
  for (int s = 0; s + 1 < S; ++s) copy_rows(r + s * step, s);
  U wh[K];
  C acc[K][N];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < hv) wh[k] = hold(load<N>(w + i * N));
#pragma unroll
    for (int j = 0; j < N; ++j) acc[k][j] = C(0);
  }
  int stage = 0, parity = 0;
  for (; r < rows; r += step, parity ^= 1) {
    copy_rows(r + (S - 1) * step, stage == 0 ? S - 1 : stage - 1);
    copy_async_wait<S - 1>();
    const U* xrow = stages + int64_t(stage) * 2 * hv;
    const U* grow = xrow + hv;
    C2 sums = {C(0), C(0)};  // (sum x^2, sum g w x)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) add_row_sums(sums, unhold<T, N>(xrow[i]), unhold<T, N>(grow[i]), unhold<T, N>(wh[k]));
    }
    C rs, c;
    row_scales(block_sum_fast(sums, scratch, parity), H, eps, rs, c);
    T* dxr = grad_x + r * H;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        const Vec<T, N> o = unit_grad(unhold<T, N>(xrow[i]), unhold<T, N>(grow[i]), unhold<T, N>(wh[k]), rs, c, acc[k]);
        store<N>(dxr + i * N, o);
      }
    }
    stage = stage + 1 == S ? 0 : stage + 1;
  }
  copy_async_wait<0>();
  store_column_sums<N, K>(acc, grad_w, partial, hv, H);
}

// Whether `smem` bytes of stages fit a block beside the kernel's static shared memory (the block sum's
// scratch: 512 bytes forward, 1024 for the float64 backward's pairs; cudaFuncGetAttributes) on a
// device whose blocks may opt in to `optin` bytes.
inline bool staged_smem_fits(int64_t smem, size_t static_smem, int optin) {
  return smem + int64_t(static_smem) <= optin;
}

// Blocks of `kernel` (blocks of `threads`, `smem` bytes of dynamic shared memory each) that one SM
// runs at once, through the occupancy API, kept per (device, threads, smem) in `cache` (a static of the
// caller's instantiation; a model's rows have one or two widths). Also raises the kernel's dynamic
// shared memory limit on ctx's device to `smem` where it is below. 0: it does not fit (more shared
// memory than a block may have).
template <typename Kernel>
int staged_blocks_per_sm(const Context& ctx, Kernel kernel, int threads, int smem, ResidentCache& cache) {
  return cache.get(ctx.device(), threads, smem, [&] {
    int optin = 0;
    OPB_CUDA_CHECK(ctx.op(), cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx.device()));
    int n = 0;
    cudaFuncAttributes attr{};
    OPB_CUDA_CHECK(ctx.op(), cudaFuncGetAttributes(&attr, kernel));
    if (staged_smem_fits(smem, attr.sharedSizeBytes, optin)) {
      // Until raised, static and dynamic shared memory together stay within 48 KiB: 3 stages of a
      // bfloat16 row of 8192 (exactly 48 KiB of dynamic) need it raised too ("> 48 KiB" missed them).
      if (smem > attr.maxDynamicSharedSizeBytes) {
        OPB_CUDA_CHECK(ctx.op(), cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      }
      OPB_CUDA_CHECK(ctx.op(), cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    }
    return n;
  });
}

// The persistent grid of a staged kernel over `rows` rows: one wave of the blocks staged_blocks_per_sm
// finds (0: a block does not fit).
template <typename Kernel>
int64_t staged_grid(const Context& ctx, Kernel kernel, int threads, int64_t smem, int64_t rows,
                    ResidentCache& cache) {
  const int per_sm = staged_blocks_per_sm(ctx, kernel, threads, static_cast<int>(smem), cache);
  return std::min<int64_t>(rows, int64_t(ctx.num_sms()) * per_sm);
}

// Launches the staged kernel under policy P (its kStages stages, blocks of up to kMaxThreads) over
// contiguous rows of x. Returns false, launching nothing, where it does not apply: fewer than
// P::kMinRows rows, rows at a stride, rows too wide for the stages' shared memory. The caller checked
// 16-byte alignment (can_vectorize).
template <template <int> class Policy, int N, typename T, typename C>
bool launch_rms_rows_staged(const Context& ctx, T* out, const T* x, const StridedRows& xs, const T* w, int64_t rows,
                            int64_t H, C eps) {
  using P = Policy<N>;
  constexpr int S = P::kStages;
  if constexpr (S < 1) {
    return false;
  } else {
    if (rows < std::max<int64_t>(P::kMinRows, 1) || !xs.contiguous() || H % N != 0) return false;
    const int64_t hv = H / N;
    const int64_t smem = int64_t(S) * hv * 16;
    if (smem > (int64_t(1) << 20)) return false;
    const int threads = row_threads(hv, P::kMaxThreads);
    auto* kernel = rms_rows_staged_kernel<N, S, P, T, C>;
    static ResidentCache cache = {};
    const int64_t blocks = staged_grid(ctx, kernel, threads, smem, rows, cache);
    if (blocks == 0) return false;
    kernel<<<static_cast<unsigned>(blocks), threads, static_cast<size_t>(smem), ctx.stream>>>(out, x, w, rows, H, eps);
    return true;
  }
}

// The staged backward under policy P over contiguous rows (the caller checked can_vectorize), with its
// column sum where the grid has more than one block (its partial sums in stream-ordered scratch).
// Returns false, launching nothing, where it does not apply: no stages, fewer than P::kMinRows rows,
// rows whose units do not fit a block or whose stages do not fit its shared memory.
template <template <int> class Policy, int N, typename T, typename C>
bool launch_rms_backward_staged(const Context& ctx, T* dx, T* dw, const T* g, const T* x, const T* w, int64_t rows,
                                int64_t H, C eps) {
  using P = Policy<N>;
  constexpr int S = P::kStages;
  if constexpr (S < 1) {
    return false;
  } else {
    if (rows < std::max<int64_t>(P::kMinRows, 1) || H % N != 0) return false;
    const int64_t hv = H / N;
    const int units = cached_units<P>(hv);
    const int64_t smem = int64_t(S) * 2 * hv * 16;
    if (units == 0 || smem > (int64_t(1) << 20)) return false;
    const int threads = row_threads((hv + units - 1) / units, P::kMaxThreads);
    bool launched = false;
    with_units<P::kMaxUnits>(units, [&](auto k_const) {
      constexpr int K = decltype(k_const)::value;
      auto* kernel = rms_norm_backward_staged_kernel<P, N, K, S, T, C>;
      static ResidentCache cache = {};
      const int64_t grid = staged_grid(ctx, kernel, threads, smem, rows, cache);
      if (grid == 0) return;
      Scratch partial(ctx.op(), ctx, grid == 1 ? 0 : size_t(grid) * size_t(H) * sizeof(C));
      kernel<<<static_cast<unsigned>(grid), threads, static_cast<size_t>(smem), ctx.stream>>>(
          dx, dw, partial.as<C>(), g, x, w, rows, H, eps);
      ctx.check_launch();
      if (grid > 1) {
        launch_column_sum(ctx.stream, dw, partial.as<const C>(), grid, H);
        ctx.check_launch();
      }
      launched = true;
    });
    return launched;
  }
}

}  // namespace cuda
}  // namespace opbridge
