// opbridge CUDA helpers for kernels in .cu files: device guard, the framework's
// stream, launch checks and scratch memory here, on the host side; through
// cuda_device.h, which it includes, the device side: 16-bit conversions, 128-bit
// vector access and block reductions. Beside it: cuda_map.h (elementwise maps),
// cuda_norm.h (row-cached RMS normalisation) and cuda_error_flag.h (errors in
// device tensors' values).
//
// A CUDA kernel takes the same arguments as its CPU twin (outputs first, then
// the schema's arguments) and runs in five steps:
//
//   1. validate with the OPB_CHECK_* macros (kDLCUDA, one device id, dtypes,
//      shapes, contiguity). Nothing before this point calls CUDA, so argument
//      errors are raised as TypeError / ValueError even without a driver;
//   2. `opbridge::cuda::Context ctx(op, x)`: make x's device current (restored
//      on return) and take the stream the framework published through
//      tvm-ffi's environment (`tvm_ffi.use_torch_stream()`), else the legacy
//      default stream;
//   3. dispatch on dtype (OPB_DISPATCH_FLOATING, then `device_t<scalar_t>`
//      maps opbridge::half / bfloat16 to __half / __nv_bfloat16; compute in
//      compute_t<T> with to_compute / from_compute, double for float64);
//   4. launch on ctx.stream;
//   5. `ctx.check_launch()`: a launch error becomes a RuntimeError carrying
//      CUDA's error name and string (plus a hint for a missing driver or a GPU
//      the module was not built for).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <opbridge/cuda_device.h>
#include <opbridge/opbridge.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#define OPB_CUDA_STR_INNER_(...) #__VA_ARGS__
#define OPB_CUDA_STR_(...) OPB_CUDA_STR_INNER_(__VA_ARGS__)

namespace opbridge {
namespace cuda {

// ---------------------------------------------------------------------------
// errors
// ---------------------------------------------------------------------------

// The architectures this translation unit was compiled for, as nvcc lists
// them (e.g. "800,900"); shown when a GPU has no matching kernel image.
inline const char* compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  return OPB_CUDA_STR_(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

// What to do about the errors a user can fix without reading CUDA's manual.
inline std::string error_hint(cudaError_t err) {
  std::ostringstream os;
  int runtime = 0, driver = 0;
  switch (err) {
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInitializationError:
      cudaRuntimeGetVersion(&runtime);
      cudaDriverGetVersion(&driver);
      os << " (opbridge's CUDA module uses CUDA runtime " << runtime / 1000 << "." << runtime % 1000 / 10;
      if (driver == 0) {
        os << "; no NVIDIA driver was found: CUDA kernels need a GPU and its driver, CPU tensors do not)";
      } else {
        os << "; the installed driver supports CUDA up to " << driver / 1000 << "." << driver % 1000 / 10
           << "; check that a GPU is visible, e.g. CUDA_VISIBLE_DEVICES)";
      }
      break;
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion: {
      int dev = 0, major = 0, minor = 0;
      cudaGetDevice(&dev);
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
      os << " (the module was compiled for architectures " << compiled_archs() << ", this GPU is sm_"
         << major << minor << "; add " << major << minor
         << " to OPBRIDGE_CUDA_ARCHS and rebuild)";
      break;
    }
    default:
      break;
  }
  return os.str();
}

// Raises RuntimeError "<op>: <what> failed: <cudaErrorName>: <string> (<hint>)".
inline void throw_cuda_error(const char* op, const char* what, cudaError_t err) {
  TVM_FFI_THROW(RuntimeError) << op << ": " << what << " failed: " << cudaGetErrorName(err) << ": "
                              << cudaGetErrorString(err) << error_hint(err);
}

#define OPB_CUDA_CHECK(op, stmt)                                                  \
  do {                                                                            \
    const cudaError_t _opb_err = (stmt);                                          \
    if (_opb_err != cudaSuccess) ::opbridge::cuda::throw_cuda_error(op, #stmt, _opb_err); \
  } while (0)

// ---------------------------------------------------------------------------
// device, stream, launch checks
// ---------------------------------------------------------------------------

// Threads per block for one row of `units` vector units: a multiple of 32.
inline int row_threads(int64_t units, int max_threads = 1024) {
  const int64_t t = (units + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(t, 32, max_threads));
}

constexpr int kMaxDevices = 64;

inline int multiprocessor_count(const char* op, int device) {
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device >= 0 && device < kMaxDevices) {
    const int n = cache[device].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int n = 0;
  OPB_CUDA_CHECK(op, cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < kMaxDevices) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// A few answers of the occupancy API for one kernel (a static of the caller's template instantiation),
// each for one (device, threads, dynamic shared memory): devices of two models differ, and a model's rows
// have one or two widths. Each slot is one word holding a key and its answer (0-63), so a lookup is a few
// relaxed loads, lock-free, and never pairs a key with another key's answer; 32 bytes.
class ResidentCache {
 public:
  // The answer for the key, from `ask()` (an int) on a miss.
  template <typename Ask>
  int get(int device, int threads, int64_t smem, Ask ask) {
    // Bit 63: a filled slot; device: bits 38-62; smem (< 2 MiB): 17-37; threads (< 2048): 6-16; answer: 0-5.
    if (device < 0 || device >= (1 << 25) || threads < 0 || threads >= 2048 || smem < 0 || smem >= (1 << 21)) {
      return std::clamp(ask(), 0, 63);  // not a key this cache packs: ask every time
    }
    const uint64_t key =
        (uint64_t(1) << 63) | (uint64_t(device) << 38) | (uint64_t(smem) << 17) | (uint64_t(threads) << 6);
    for (const std::atomic<uint64_t>& slot : slots_) {
      const uint64_t word = slot.load(std::memory_order_relaxed);
      if ((word & ~uint64_t(63)) == key) return static_cast<int>(word & 63);
    }
    const int n = std::clamp(ask(), 0, 63);
    // The first empty slot, else the one the key hashes to (racing threads may store a key twice: harmless).
    std::atomic<uint64_t>* at = &slots_[((key >> 6) * 0x9E3779B97F4A7C15ull) >> 62];
    for (std::atomic<uint64_t>& slot : slots_) {
      if (slot.load(std::memory_order_relaxed) == 0) {
        at = &slot;
        break;
      }
    }
    at->store(key | uint64_t(n), std::memory_order_relaxed);
    return n;
  }

 private:
  std::atomic<uint64_t> slots_[4] = {};
};

// The per-call launch context. Constructing it is the first CUDA call a kernel
// makes: it makes `t`'s device current for the call (a framework's "current
// device" need not be the tensor's) and reads the stream the framework set
// for that device in tvm-ffi's environment.
class Context {
 public:
  Context(const char* op, const TensorView& t) : op_(op), device_(t.device().device_id) {
    cudaError_t err = cudaGetDevice(&previous_);
    if (err != cudaSuccess) throw_cuda_error(op, "cudaGetDevice", err);
    if (previous_ != device_ && (err = cudaSetDevice(device_)) != cudaSuccess) {
      throw_cuda_error(op, "cudaSetDevice", err);  // (no destructor runs: nothing to restore)
    }
    stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device_));
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context() {
    if (previous_ != device_) cudaSetDevice(previous_);  // best effort: never throw from here
  }

  int device() const { return device_; }
  int num_sms() const { return multiprocessor_count(op_, device_); }
  const char* op() const { return op_; }

  // Raises RuntimeError if the launch just made failed (bad configuration,
  // no kernel image for this GPU, no driver, a sticky error from before).
  void check_launch() const {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda_error(op_, "kernel launch", err);
  }

  // A launch for a row-wise loop: blockIdx.x over blocks of `threads` work
  // items of a row (`units` per row), blockIdx.y over rows (grid-stride past
  // 65535). Every block gets one chunk of one row, so few long rows (a decode
  // step's 1-8 rows of 14336 columns) spread over as many SMs as many short
  // ones do, and there is no grid-stride tail inside a row.
  static dim3 rows_grid(int64_t rows, int64_t units, int threads) {
    const int64_t chunks = (std::max<int64_t>(units, 1) + threads - 1) / threads;
    return dim3(static_cast<unsigned>(std::min<int64_t>(chunks, INT32_MAX)),
                static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 65535)), 1);
  }

  cudaStream_t stream = nullptr;

 private:
  const char* op_;
  int device_;
  int previous_ = 0;
};

// Blocks of `threads` threads (a multiple of 32, at most 1024) of `kernel`
// that one multiprocessor of ctx's device runs at once (registers and shared
// memory permitting), read once per device and block size through the
// occupancy API and kept in `cache`. A persistent kernel launched with
// num_sms * this many blocks runs in one full wave: a fixed blocks-per-SM
// guess leaves a partly filled second wave whenever the kernel's register
// count allows fewer.
template <typename Kernel>
int resident_blocks(const Context& ctx, Kernel kernel, int threads, ResidentCache& cache) {
  return cache.get(ctx.device(), threads, 0, [&] {
    int n = 0;
    OPB_CUDA_CHECK(ctx.op(), cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    return std::max(n, 1);
  });
}

// Device scratch memory for one call, ordered on the call's stream: allocated
// with cudaMallocAsync (no device sync; capturable in CUDA graphs) and freed
// on the stream when it goes out of scope, also when the call throws. Where
// the device has no stream-ordered allocator, falls back to cudaMalloc and a
// stream sync before cudaFree.
class Scratch {
 public:
  Scratch(const char* op, const Context& ctx, std::size_t bytes) : stream_(ctx.stream) {
    if (bytes == 0) return;
    cudaError_t err = cudaMallocAsync(&ptr_, bytes, stream_);
    if (err == cudaErrorNotSupported) {
      cudaGetLastError();  // clear it
      async_ = false;
      err = cudaMalloc(&ptr_, bytes);
    }
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      throw_cuda_error(op, async_ ? "cudaMallocAsync" : "cudaMalloc", err);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr_ == nullptr) return;
    if (async_) {
      cudaFreeAsync(ptr_, stream_);
    } else {
      cudaStreamSynchronize(stream_);
      cudaFree(ptr_);
    }
  }

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  bool async_ = true;
};

}  // namespace cuda
}  // namespace opbridge
