// opbridge CUDA device-side error flag (cuda.h's helpers): errors in the *values*
// of device tensors, recorded by the kernel and raised by the host on the next
// call, for kernels such as rotary_embedding.cu and advance_step.cu.
#pragma once

#include <opbridge/cuda.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace opbridge {
namespace cuda {

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
