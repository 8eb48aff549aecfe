// What the CUDA launch-policy sweeps (scripts/cuda_*_sweep.cu) share: a checked CUDA call (CK), a
// launch's time inside a CUDA graph (graph_us), deterministic inputs (fill), host views of the
// element types, and the device's copy bandwidth (copy_gbps). Not part of any build or test.
#pragma once

#include <opbridge/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace cu = opbridge::cuda;

#define CK(x)                                                                         \
  do {                                                                                \
    const cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "CUDA error %s at line %d: %s\n", cudaGetErrorString(e_), __LINE__, #x); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

template <typename F>
float graph_us(F launch, cudaStream_t s) {
  constexpr int kLaunches = 100;
  launch();
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunches; ++i) launch();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> us;
  for (int rep = 0; rep < 12; ++rep) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (rep >= 2) us.push_back(ms * 1000.f / kLaunches);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

template <typename T>
__global__ void fill(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = cu::from_compute<T>(float(h & 0xffff) / 32768.f - 1.f);
  }
}

inline float host_float(float v) { return v; }
inline float host_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> const char* dtype_name();
template <> const char* dtype_name<float>() { return "float32"; }
template <> const char* dtype_name<__nv_bfloat16>() { return "bfloat16"; }

double copy_gbps(cudaStream_t s) {  // bytes read + written per second of a device-to-device copy
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  const float us = graph_us([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); }, s);
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * double(bytes) / (us * 1e-6) / 1e9;
}

// A kernel's resources at `threads` per block (and `smem` bytes of dynamic shared memory): its blocks
// per SM (the occupancy API), and as words for a sweep's line, the occupancy its policy asked for (when
// it asked), registers per thread, local memory per thread (spills), blocks per SM and the dynamic
// shared memory (when there is any).
struct KernelFacts {
  int per_sm = 0;
  char words[80] = "";
};
template <typename Kernel>
KernelFacts kernel_facts(Kernel kernel, int threads, int min_blocks, int smem = 0) {
  KernelFacts f;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f.per_sm, kernel, threads, smem));
  cudaFuncAttributes attr{};
  CK(cudaFuncGetAttributes(&attr, kernel));
  char asked[32] = "";
  if (min_blocks > 0) std::snprintf(asked, sizeof asked, " minblocks %d", min_blocks);
  char shared[24] = "";
  if (smem > 0) std::snprintf(shared, sizeof shared, " smem %d", smem);
  std::snprintf(f.words, sizeof f.words, "%s regs %3d local %3zu per_sm %2d%s", asked, attr.numRegs,
                attr.localSizeBytes, f.per_sm, shared);
  return f;
}

// The device's name and copy bandwidth, printed once at the top of a sweep; returns the bandwidth.
inline double sweep_header(cudaStream_t s) {
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  const double copy = copy_gbps(s);
  std::printf("%s: device-to-device copy %.0f GB/s (read + write); times are per launch inside a CUDA graph\n",
              prop.name, copy);
  return copy;
}

