// Row-cached RMS normalisation on CUDA, written once for rms_norm.cu and
// fused_add_rms_norm.cu: out[r] = z[r] * rsqrt(mean(z[r]^2) + eps) * w, where
// a source policy produces each row's values z (rms_norm: x itself;
// fused_add_rms_norm: input + residual, rounded, written back to residual).
//
// When a row fits in the block's registers (up to kMaxCachedUnits 128-bit units
// per thread, blocks of up to kCachedThreads) each thread loads its units of z and
// of the weight at once, before the reduction, and writes from registers: one
// DRAM round trip per row, every load of the row in flight together. The
// two-pass form (wait for the row, reduce, read the row and the weight again)
// ran rms_norm at 0.67 of copy bandwidth on an H200 at 4096 x 4096 and took
// two memory round trips per row at 1-8 rows.
#pragma once

#include <cooperative_groups.h>
#include <opbridge/cuda.h>

#include <type_traits>

namespace opbridge {
namespace cuda {

// Units (128-bit vectors) per thread: at most 4 and at most 16 elements, so
// that a thread's values of the row (held as float for the 16-bit types) fit
// in registers beside the rest: more units per thread with fewer threads
// lowered occupancy (bfloat16 rows of 8192 at 4 units: 96 registers, 0.76 of
// copy bandwidth on an H200).
template <int N>
constexpr int kMaxCachedUnits = 16 / N < 4 ? 16 / N : 4;
// Blocks prefer this many threads or fewer; longer rows take up to kMaxCachedUnits
// per thread and more threads, up to the kernel's limit.
constexpr int kCachedPreferredThreads = 256;

// Units per thread for rows of `hv` units with blocks of at most
// `max_threads`: the fewest (1, 2, 4) that keep blocks at
// kCachedPreferredThreads or fewer, else kMaxCachedUnits<N>; 0 when the row
// does not fit.
template <int N>
int cached_units(int64_t hv, int max_threads) {
  for (int k = 1; k <= kMaxCachedUnits<N>; k *= 2) {
    if (hv <= int64_t(kCachedPreferredThreads) * k) return k;
  }
  return hv <= int64_t(max_threads) * kMaxCachedUnits<N> ? kMaxCachedUnits<N> : 0;
}

// Calls go(std::integral_constant<int, K>{}) for K = units (1, 2 or 4, at
// most kMaxCachedUnits<N>; only those are instantiated).
template <int N, typename Go>
void with_units(int units, Go&& go) {
  if (units == 1) {
    go(std::integral_constant<int, 1>{});
  } else if constexpr (kMaxCachedUnits<N> >= 4) {
    if (units == 2) {
      go(std::integral_constant<int, 2>{});
    } else {
      go(std::integral_constant<int, 4>{});
    }
  } else {
    go(std::integral_constant<int, 2>{});
  }
}

constexpr int kCachedThreads = 1024;

// Src: `__device__ Vec<T, N> load(int64_t row, int unit) const`, called once
// per (row, unit) by the thread that writes out[row] at that unit. `out` may
// be a buffer Src reads (in place): each unit is read before it is written,
// by the same thread.
template <int N, int K, typename T, typename Src, typename C = compute_t<T>>
__global__ void __launch_bounds__(kCachedThreads)
    rms_rows_cached_kernel(T* out, Src src, const T* __restrict__ w, int64_t rows, int64_t H, C eps) {
  __shared__ C scratch[2][32];
  const int hv = static_cast<int>(H / N);
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, parity ^= 1) {
    Vec<T, N> zv[K], wv[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        wv[k] = load<N>(w + i * N);
        zv[k] = src.load(r, i);
      }
    }
    C ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (threadIdx.x + k * blockDim.x < hv) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const C f = to_compute(zv[k].v[j]);
          ss += f * f;
        }
      }
    }
    const C rs = rsqrt_of(block_sum_fast(ss, scratch, parity) / C(H) + eps);
    T* yr = out + r * H;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < hv) {
        Vec<T, N> o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(to_compute(zv[k].v[j]) * rs * to_compute(wv[k].v[j]));
        store<N>(yr + i * N, o);
      }
    }
  }
}

// Few rows (a decode step's 1-8): one block per row leaves all but a few SMs
// idle and pulls the whole row through one SM (rms_norm, 1 row of 4096
// float32: 2.07 us against Liger-Kernel's 1.87 on an H200). On Hopper a row
// is split over a thread-block cluster of 2-8 blocks instead, one 128-bit
// unit per thread: each block reduces its part, the cluster adds the blocks'
// partial sums from distributed shared memory in rank order (every block gets
// the same total), and each block writes its part.
constexpr int kClusterThreads = 1024, kMaxCluster = 8, kClusterUnitsPerBlock = 128;

template <int N, typename T, typename Src, typename C = compute_t<T>>
__global__ void __launch_bounds__(kClusterThreads)
    rms_rows_cluster_kernel(T* out, Src src, const T* __restrict__ w, int64_t H, C eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ C scratch[2][32];
  __shared__ C part;
  const int csize = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t r = blockIdx.x / csize;
  const int hv = static_cast<int>(H / N);
  const int i = rank * blockDim.x + threadIdx.x;
  Vec<T, N> zv, wv;
  C ss = 0;
  if (i < hv) {
    wv = load<N>(w + i * N);
    zv = src.load(r, i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const C f = to_compute(zv.v[j]);
      ss += f * f;
    }
  }
  ss = block_sum_fast(ss, scratch, 0);
  if (threadIdx.x == 0) part = ss;
  cluster.sync();
  C total = 0;
  for (int q = 0; q < csize; ++q) total += *cluster.map_shared_rank(&part, q);
  cluster.sync();  // no block exits (and frees `part`) while another still reads it
  const C rs = rsqrt_of(total / C(H) + eps);
  if (i < hv) {
    Vec<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = from_compute<T>(to_compute(zv.v[j]) * rs * to_compute(wv.v[j]));
    store<N>(out + r * H + int64_t(i) * N, o);
  }
#endif
}

// Whether `kernel` runs Hopper code on `device` (compute capability 9.0 or
// newer, and the module holds sm_90+ code for it rather than older code the
// cluster kernel is compiled out of); read once per device.
template <typename Kernel>
bool has_clusters(const char* op, int device, Kernel kernel, std::atomic<int> (&cache)[kMaxDevices]) {
  std::atomic<int>* slot = device >= 0 && device < kMaxDevices ? &cache[device] : nullptr;
  int v = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
  if (v != 0) return v > 0;
  int major = 0;
  OPB_CUDA_CHECK(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attr{};
  OPB_CUDA_CHECK(op, cudaFuncGetAttributes(&attr, kernel));
  v = major >= 9 && attr.binaryVersion >= 90 ? 1 : -1;
  if (slot != nullptr) slot->store(v, std::memory_order_relaxed);
  return v > 0;
}

// Launches the cluster kernel when rows are few enough to give each row 2 or
// more SMs and the device has clusters; false otherwise (nothing launched).
template <int N, typename T, typename Src, typename C>
bool launch_rms_rows_cluster(const Context& ctx, T* out, Src src, const T* w, int64_t rows, int64_t H, C eps) {
  const int64_t hv = H / N;
  const int64_t per_row = std::min<int64_t>(ctx.num_sms() / std::max<int64_t>(rows, 1), kMaxCluster);
  const int csize = static_cast<int>(std::min<int64_t>(per_row, (hv + kClusterUnitsPerBlock - 1) / kClusterUnitsPerBlock));
  if (csize < 2 || hv > int64_t(kClusterThreads) * csize) return false;
  const auto kernel = rms_rows_cluster_kernel<N, T, Src, C>;
  static std::atomic<int> clusters[kMaxDevices] = {};
  if (!has_clusters(ctx.op(), ctx.device(), kernel, clusters)) return false;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(rows * csize), 1, 1);
  cfg.blockDim = dim3(row_threads((hv + csize - 1) / csize, kClusterThreads), 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = ctx.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  OPB_CUDA_CHECK(ctx.op(), cudaLaunchKernelEx(&cfg, kernel, out, src, w, H, eps));
  return true;
}

// Launches the cached kernel over `rows` rows of H elements (N per unit), one
// block per row (or a cluster per row when rows are few, above). Returns false, launching nothing, when a row is longer than
// kCachedThreads * kMaxCachedUnits<N> units (16384 16-bit or float32
// elements, 8192 float64): the caller runs its two-pass form.
template <int N, typename T, typename Src, typename C>
bool launch_rms_rows_cached(const Context& ctx, T* out, Src src, const T* w, int64_t rows, int64_t H, C eps) {
  const int64_t hv = H / N;
  const int units = cached_units<N>(hv, kCachedThreads);
  if (units == 0) return false;
  if (launch_rms_rows_cluster<N>(ctx, out, src, w, rows, H, eps)) return true;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, INT32_MAX));
  const int threads = row_threads((hv + units - 1) / units, kCachedThreads);
  with_units<N>(units, [&](auto k_const) {
    constexpr int K = decltype(k_const)::value;
    rms_rows_cached_kernel<N, K><<<grid, threads, 0, ctx.stream>>>(out, src, w, rows, H, eps);
  });
  return true;
}

}  // namespace cuda
}  // namespace opbridge
