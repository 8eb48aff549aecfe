// opbridge CUDA helpers for kernels in .cu files: device guard, the framework's
// stream, launch checks, 16-bit conversions, 128-bit vector access, block
// reductions and a device-side error flag.
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

#include <opbridge/opbridge.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <type_traits>

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

// Blocks of `threads` threads (a multiple of 32, at most 1024) of `kernel`
// that one multiprocessor runs at once (registers and shared memory
// permitting), read once per block size through the occupancy API and kept in
// `cache`, a static of the caller's template instantiation. A persistent
// kernel launched with num_sms * this many blocks runs in one full wave: a
// fixed blocks-per-SM guess leaves a partly filled second wave whenever the
// kernel's register count allows fewer.
using ResidentCache = std::atomic<int>[33];
template <typename Kernel>
int resident_blocks(const char* op, Kernel kernel, int threads, ResidentCache& cache) {
  std::atomic<int>& slot = cache[std::clamp(threads / 32, 0, 32)];
  int n = slot.load(std::memory_order_relaxed);
  if (n > 0) return n;
  OPB_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  n = std::max(n, 1);
  slot.store(n, std::memory_order_relaxed);
  return n;
}

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
  dim3 rows_grid(int64_t rows, int64_t units, int threads) const {
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

// ---------------------------------------------------------------------------
// element types and conversions (arithmetic in float32; float64 in double)
// ---------------------------------------------------------------------------

template <typename T>
struct device_type {
  using type = T;
};
template <>
struct device_type<::opbridge::half> {
  using type = __half;
};
template <>
struct device_type<::opbridge::bfloat16> {
  using type = __nv_bfloat16;
};
// The CUDA type with the layout of an opbridge storage type.
template <typename T>
using device_t = typename device_type<T>::type;

static_assert(sizeof(__half) == sizeof(::opbridge::half), "half layout");
static_assert(sizeof(__nv_bfloat16) == sizeof(::opbridge::bfloat16), "bfloat16 layout");

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even, as the CPU kernels do.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The math policy of opbridge/activation_math.h on CUDA. float: the hardware's
// approximate exp and division (__expf: ex2.approx after one multiply, within
// 2 + 1.16|x| ulp, about 6e-6 relative at |x| = 80 and under 1e-6 for |x| < 8;
// __fdividef: 2 ulp for divisors up to 2^126, 0 beyond, where every quotient
// here is below 1e-36), as Triton's and Inductor's sigmoid: the IEEE forms
// cost about 25 instructions more per element, which made the 16-bit gated
// activations and gelu compute-bound on an H200 (0.67-0.70 of copy bandwidth).
// double: exp and IEEE division. clamp_below is max(v, lo) that keeps NaN
// (fmaxf would replace it by lo).
struct Math {
  __device__ static float exp(float x) { return __expf(x); }
  __device__ static double exp(double x) { return ::exp(x); }
  __device__ static float div(float a, float b) { return __fdividef(a, b); }
  __device__ static double div(double a, double b) { return a / b; }
  template <typename C>
  __host__ __device__ static C clamp_below(C v, C lo) {
    return v < lo ? lo : v;
  }
};

// The compute type of storage type T is opbridge::compute_t<T>: float for
// float32 and the 16-bit types (__half / __nv_bfloat16 included), double for
// float64, the integer itself for the integers.
template <typename T>
__device__ __forceinline__ compute_t<T> to_compute(T v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return to_float(v);
  }
}
template <typename T>
__device__ __forceinline__ T from_compute(compute_t<T> v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) {
    return v;
  } else {
    return from_float<T>(v);
  }
}

__device__ __forceinline__ float rsqrt_of(float v) { return rsqrtf(v); }
__device__ __forceinline__ double rsqrt_of(double v) { return ::rsqrt(v); }

// Two sums reduced together (rms_norm's backward): float2, or double2 for float64.
template <typename C>
using pair_t = std::conditional_t<std::is_same_v<C, double>, double2, float2>;

// ---------------------------------------------------------------------------
// vector access: N elements in one aligned load/store (128 bits when N = kVec<T>)
// ---------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per 128-bit access.
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

inline bool is_aligned(const void* p, std::size_t bytes = 16) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Whether every pointer allows kVec<T>-element vector access at every multiple
// of `row` elements (pass row = 0 for flat arrays).
template <typename T, typename... P>
inline bool can_vectorize(int64_t row, const P*... ptrs) {
  const bool rows_ok = row % kVec<T> == 0;
  return rows_ok && (is_aligned(ptrs) && ...);
}

// ---------------------------------------------------------------------------
// reductions (blockDim.x a multiple of 32, at most 1024)
// ---------------------------------------------------------------------------

template <typename C>  // float or double
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
  return make_float2(warp_sum(v.x), warp_sum(v.y));
}

__device__ __forceinline__ double2 warp_sum(double2 v) {
  return make_double2(warp_sum(v.x), warp_sum(v.y));
}

// Sum over the block, returned to every thread; `scratch` is __shared__ [32].
// Deterministic for a given block size. Safe to call repeatedly.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call may still be reading scratch[0]
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    V w = lane < warps ? scratch[lane] : V{};
    w = warp_sum(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  return scratch[0];
}

// block_sum with one barrier instead of three: every warp reduces the warps'
// partial sums itself (the same values in the same order, so every thread gets
// the same, deterministic total). `scratch` is __shared__ [2][32]; alternate
// `parity` between consecutive calls: a warp can only write a buffer again
// after the next call's barrier, which every warp reaches only once done
// reading it.
template <typename V>
__device__ __forceinline__ V block_sum_fast(V v, V (*scratch)[32], int parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[parity][warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[parity][lane] : V{});
}

// ---------------------------------------------------------------------------
// elementwise maps: out[i] = f(a[i]) or f(a[i], b[i]) over flat arrays
// ---------------------------------------------------------------------------
//
// One N-element vector per thread: each block maps kMapThreads consecutive
// vectors, blocks grid-stride past 2^31 - 1 of them; then block 0 maps the
// n % N tail element by element. Many short blocks, as torch's vectorised
// elementwise kernel: a one-wave grid-stride form with two vectors per thread
// ran add at 0.94-0.95 of copy bandwidth on an H200 where torch reached 1.01,
// and spread small arrays over fewer SMs (add at 8 x 4096: 1.66 us, torch
// 1.23). out may be exactly a or b (in place): each element is read before it
// is written, by the same thread.

constexpr int kMapThreads = 128;

template <int N, typename T, typename F>
__global__ void __launch_bounds__(kMapThreads) map1_kernel(T* out, const T* __restrict__ a, int64_t n, F f) {
  const int64_t nv = n / N;
  for (int64_t i = int64_t(blockIdx.x) * kMapThreads + threadIdx.x; i < nv; i += int64_t(gridDim.x) * kMapThreads) {
    const Vec<T, N> va = load<N>(a + i * N);
    Vec<T, N> vo;
#pragma unroll
    for (int k = 0; k < N; ++k) vo.v[k] = from_compute<T>(f(to_compute(va.v[k])));
    store<N>(out + i * N, vo);
  }
  if (blockIdx.x == 0) {
    for (int64_t i = nv * N + threadIdx.x; i < n; i += kMapThreads) out[i] = from_compute<T>(f(to_compute(a[i])));
  }
}

template <int N, typename T, typename F>
__global__ void __launch_bounds__(kMapThreads)
    map2_kernel(T* out, const T* __restrict__ a, const T* __restrict__ b, int64_t n, F f) {
  const int64_t nv = n / N;
  for (int64_t i = int64_t(blockIdx.x) * kMapThreads + threadIdx.x; i < nv; i += int64_t(gridDim.x) * kMapThreads) {
    const Vec<T, N> va = load<N>(a + i * N);
    const Vec<T, N> vb = load<N>(b + i * N);
    Vec<T, N> vo;
#pragma unroll
    for (int k = 0; k < N; ++k) vo.v[k] = from_compute<T>(f(to_compute(va.v[k]), to_compute(vb.v[k])));
    store<N>(out + i * N, vo);
  }
  if (blockIdx.x == 0) {
    for (int64_t i = nv * N + threadIdx.x; i < n; i += kMapThreads) {
      out[i] = from_compute<T>(f(to_compute(a[i]), to_compute(b[i])));
    }
  }
}

// Blocks for a map over `units` vectors: one per kMapThreads of them (at
// least one, for the tail), at most 2^31 - 1.
inline unsigned map_grid(int64_t units) {
  return static_cast<unsigned>(std::clamp<int64_t>((units + kMapThreads - 1) / kMapThreads, 1, INT32_MAX));
}

// out = f(a), 128-bit accesses when every pointer is 16-byte aligned.
template <typename T, typename F>
void map(const Context& ctx, T* out, const T* a, int64_t n, F f) {
  if (n == 0) return;
  constexpr int V = kVec<T>;
  if (can_vectorize<T>(0, out, a)) {
    map1_kernel<V><<<map_grid(n / V), kMapThreads, 0, ctx.stream>>>(out, a, n, f);
  } else {
    map1_kernel<1><<<map_grid(n), kMapThreads, 0, ctx.stream>>>(out, a, n, f);
  }
  ctx.check_launch();
}

// out = f(a, b), 128-bit accesses when every pointer is 16-byte aligned.
template <typename T, typename F>
void map(const Context& ctx, T* out, const T* a, const T* b, int64_t n, F f) {
  if (n == 0) return;
  constexpr int V = kVec<T>;
  if (can_vectorize<T>(0, out, a, b)) {
    map2_kernel<V><<<map_grid(n / V), kMapThreads, 0, ctx.stream>>>(out, a, b, n, f);
  } else {
    map2_kernel<1><<<map_grid(n), kMapThreads, 0, ctx.stream>>>(out, a, b, n, f);
  }
  ctx.check_launch();
}

// ---------------------------------------------------------------------------
// device-side error flag
// ---------------------------------------------------------------------------
//
// Some errors are in the *values* of device tensors (a position beyond the
// cos/sin cache, a block index beyond the block table). Checking them on the
// host would need a device sync on every call. Instead the kernel skips the
// offending item without touching memory out of bounds, and its first
// offender records itself in pinned, device-mapped host memory. The host
// reads that record (a plain load, no sync) at the start of the next call of
// the same kernel family and raises ValueError naming the item; with
// OPBRIDGE_CUDA_SYNC_CHECKS=1 the call synchronises its stream after the
// launch and raises from the offending call itself.

struct ErrorRecord {
  int code;  // 0: no error; otherwise a kernel-family specific kind, written last
  int pad;
  long long index, value, bound;
};

// Passed by value to kernels.
struct ErrorSink {
  ErrorRecord* record;      // device-mapped host memory
  unsigned long long* claim;  // this family's per-device claim word
  unsigned long long epoch;   // increases each time the host consumes a record
};

// Records the first error of this epoch; later ones in the epoch are dropped.
__device__ __forceinline__ void report_error(const ErrorSink& sink, int code, long long index,
                                             long long value, long long bound) {
  if (atomicMax(sink.claim, sink.epoch) < sink.epoch) {
    volatile ErrorRecord* r = sink.record;
    r->index = index;
    r->value = value;
    r->bound = bound;
    __threadfence_system();
    r->code = code;
  }
}

// Host side of one kernel family's flag, paired with the family's claim word:
// a `__device__ unsigned long long` (zero-initialised, one per device).
class ErrorFlag {
 public:
  // The sink for a launch on the current device `device`; allocates the
  // record on first use. `claim_symbol` is `&claim_word` as seen from host code.
  ErrorSink sink(const char* op, int device, const void* claim_symbol) {
    ErrorRecord* dev = device_record(op);
    unsigned long long* claim = nullptr;
    std::atomic<void*>* cached = device >= 0 && device < kMaxDevices ? &claims_[device] : nullptr;
    if (cached != nullptr) claim = static_cast<unsigned long long*>(cached->load(std::memory_order_acquire));
    if (claim == nullptr) {
      void* p = nullptr;
      OPB_CUDA_CHECK(op, cudaGetSymbolAddress(&p, claim_symbol));
      claim = static_cast<unsigned long long*>(p);
      if (cached != nullptr) cached->store(p, std::memory_order_release);
    }
    return ErrorSink{dev, claim, epoch_.load(std::memory_order_acquire)};
  }

  // If a kernel recorded an error, clears it and returns true with its fields.
  bool take(ErrorRecord* out) {
    ErrorRecord* rec = host_.load(std::memory_order_acquire);
    if (rec == nullptr) return false;
    volatile ErrorRecord* r = rec;
    if (r->code == 0) return false;
    std::atomic_thread_fence(std::memory_order_acquire);
    out->code = r->code;
    out->index = r->index;
    out->value = r->value;
    out->bound = r->bound;
    r->code = 0;
    epoch_.fetch_add(1, std::memory_order_acq_rel);
    return true;
  }

 private:
  ErrorRecord* device_record(const char* op) {
    ErrorRecord* d = device_.load(std::memory_order_acquire);
    if (d != nullptr) return d;
    std::lock_guard<std::mutex> lock(mutex_);
    d = device_.load(std::memory_order_relaxed);
    if (d != nullptr) return d;
    void* p = nullptr;
    OPB_CUDA_CHECK(op, cudaHostAlloc(&p, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(ErrorRecord));
    // With unified addressing (every 64-bit platform CUDA supports) the
    // mapped pointer is the same on every device.
    void* mapped = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&mapped, p, 0);
    if (err != cudaSuccess) {
      cudaFreeHost(p);
      throw_cuda_error(op, "cudaHostGetDevicePointer", err);
    }
    host_.store(static_cast<ErrorRecord*>(p), std::memory_order_release);
    device_.store(static_cast<ErrorRecord*>(mapped), std::memory_order_release);
    return static_cast<ErrorRecord*>(mapped);
  }

  // Never freed: a kernel may still write to it at exit.
  std::atomic<ErrorRecord*> host_{nullptr};
  std::atomic<ErrorRecord*> device_{nullptr};
  std::atomic<unsigned long long> epoch_{1};
  std::atomic<void*> claims_[kMaxDevices] = {};
  std::mutex mutex_;
};

// If a kernel of `flag`'s family recorded an error, raises it as ValueError
// "<op>: <describe(record)>". `earlier`: the record comes from a previous
// call (the kernel ran asynchronously), which the message says.
template <typename Describe>
void raise_recorded(const char* op, ErrorFlag& flag, bool earlier, Describe describe) {
  ErrorRecord rec{};
  if (!flag.take(&rec)) return;
  OPB_THROW(ValueError) << op << ": " << describe(rec)
                        << (earlier ? " (found on the GPU by an earlier call: CUDA kernels check these "
                                      "values asynchronously and report on the next call; set "
                                      "OPBRIDGE_CUDA_SYNC_CHECKS=1 to raise from the offending call)"
                                    : "");
}

// Whether OPBRIDGE_CUDA_SYNC_CHECKS asks kernels with device-side checks to
// synchronise and raise from the offending call (read on every call).
inline bool sync_checks() {
  const char* v = std::getenv("OPBRIDGE_CUDA_SYNC_CHECKS");
  return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
}

}  // namespace cuda
}  // namespace opbridge
