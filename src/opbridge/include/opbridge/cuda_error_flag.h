// opbridge CUDA device-side error flag (cuda.h's helpers): errors in the *values*
// of device tensors, recorded by the kernel and raised by the host on the next
// call, for kernels such as rotary_embedding.cu and advance_step.cu.
#pragma once

#include <opbridge/cuda.h>
#include <opbridge/settings.h>

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
// offender records itself in pinned, device-mapped host memory (a record per
// device). The host reads the records (plain loads, no sync) at the start of
// the next call of the same kernel family, on whichever device, and raises
// ValueError naming the item; with OPBRIDGE_CUDA_SYNC_CHECKS=1 the call
// synchronises its stream after the launch and raises from the offending call
// itself.
//
// Under CUDA graph capture (torch.cuda.graph; XLA runs such ops outside its
// graphs, their declarations being graph_safe=False) a replay runs the kernel
// without its host code: the kernel reads the epoch from the mapped record when
// it reports, not from its launch parameters frozen at capture, so every replay
// can still report, and the op's next call outside the graph raises it. The
// first call's allocations are allowed during a capture (RelaxedCapture), and
// OPBRIDGE_CUDA_SYNC_CHECKS does not synchronise a stream that is capturing.

// Everything a family's message needs is in its record, not taken from the call that raises it, which
// may be a later call with other arguments (advance_step records its block size in `extra`).
struct ErrorRecord {
  int code;  // 0: no error; otherwise a kernel-family specific kind, written last
  int pad;
  long long index, value, bound, extra;
  unsigned long long epoch;  // increases each time the host consumes a record; read by a reporting kernel
};

// Passed by value to kernels.
struct ErrorSink {
  ErrorRecord* record;      // the launch device's record, in device-mapped host memory
  unsigned long long* claim;  // this family's claim word on that device
};

// Records the first error of the record's current epoch; later ones in the epoch are dropped (the
// claim admits one winner per epoch on its device, the only device that writes the record).
__device__ __forceinline__ void report_error(const ErrorSink& sink, int code, long long index,
                                             long long value, long long bound, long long extra = 0) {
  volatile ErrorRecord* r = sink.record;
  const unsigned long long epoch = r->epoch;
  if (atomicMax(sink.claim, epoch) < epoch) {
    r->index = index;
    r->value = value;
    r->bound = bound;
    r->extra = extra;
    __threadfence_system();
    r->code = code;
  }
}

// While alive, the calling thread may make CUDA calls that a stream capture in its default (global or
// thread-local) mode forbids, such as cudaHostAlloc: what an op's first call allocates, made inside a
// torch.cuda.graph capture, would otherwise fail and invalidate the capture.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Whether `stream` is being captured into a CUDA graph (false if that cannot be asked).
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();  // not sticky; leave no error behind
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Host side of one kernel family's flag, paired with the family's claim word:
// a `__device__ unsigned long long` (zero-initialised, one per device). The
// claim elects one writer per epoch on its device only, so each device has a
// record of its own: a record shared by two devices could be written by a
// winner on each, its fields from one error and its code from the other.
class ErrorFlag {
 public:
  // The sink for a launch on the current device `device`; allocates its
  // record on first use. `claim_symbol` is `&claim_word` as seen from host code.
  ErrorSink sink(const char* op, int device, const void* claim_symbol) {
    const Slot* s = find(device);
    if (s == nullptr) s = add(op, device, claim_symbol);
    return ErrorSink{s->mapped, s->claim};
  }

  // If a kernel recorded an error (on `device`; -1: on any device, as the next call of the family, which
  // may run on another device, asks), clears it, opens that record's next epoch and returns true with its
  // fields (one caller takes each record). Without a recorded error, a few plain loads per device used.
  bool take(ErrorRecord* out, int device = -1) {
    // The record's code and epoch through GCC's __atomic builtins (plain memory that a kernel writes over
    // the bus, so no std::atomic): the code's acquire load orders the fields the kernel wrote before it
    // (__threadfence_system), and the epoch's release store orders the cleared code before it, on a weakly
    // ordered host (aarch64) too.
    for (const Slot* s = head_.load(std::memory_order_acquire); s != nullptr; s = s->next) {
      ErrorRecord* r = s->host;
      if ((device >= 0 && s->device != device) || __atomic_load_n(&r->code, __ATOMIC_ACQUIRE) == 0) continue;
      std::lock_guard<std::mutex> lock(mutex_);
      const int code = __atomic_load_n(&r->code, __ATOMIC_ACQUIRE);
      if (code == 0) continue;  // another thread took it
      const volatile ErrorRecord* fields = r;
      out->code = code;
      out->index = fields->index;
      out->value = fields->value;
      out->bound = fields->bound;
      out->extra = fields->extra;
      __atomic_store_n(&r->code, 0, __ATOMIC_RELAXED);
      // what the next reporting kernel reads (a graph replay too), after the cleared code
      __atomic_store_n(&r->epoch, __atomic_load_n(&r->epoch, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      return true;
    }
    return false;
  }

 private:
  // One device's record and claim word; never freed (a kernel may still write to the record at exit).
  struct Slot {
    int device;
    ErrorRecord* host;          // the record, as the host reads it
    ErrorRecord* mapped;        // the same, as kernels write it
    unsigned long long* claim;  // the device's claim word
    const Slot* next;           // the slot allocated before
  };

  // Ids from kMaxDevices on (more GPUs than any machine has) are found by walking the list.
  const Slot* find(int device) const {
    if (device >= 0 && device < kMaxDevices) return by_device_[device].load(std::memory_order_acquire);
    for (const Slot* s = head_.load(std::memory_order_acquire); s != nullptr; s = s->next) {
      if (s->device == device) return s;
    }
    return nullptr;
  }

  const Slot* add(const char* op, int device, const void* claim_symbol) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Slot* s = head_.load(std::memory_order_relaxed); s != nullptr; s = s->next) {
      if (s->device == device) return s;  // another thread added it
    }
    RelaxedCapture relaxed;
    void* claim = nullptr;
    OPB_CUDA_CHECK(op, cudaGetSymbolAddress(&claim, claim_symbol));
    void* p = nullptr;
    OPB_CUDA_CHECK(op, cudaHostAlloc(&p, sizeof(ErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(ErrorRecord));
    static_cast<ErrorRecord*>(p)->epoch = 1;  // above the claim word's initial 0
    // With unified addressing (every 64-bit platform CUDA supports) the
    // mapped pointer is the same on every device.
    void* mapped = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&mapped, p, 0);
    if (err != cudaSuccess) {
      cudaFreeHost(p);
      throw_cuda_error(op, "cudaHostGetDevicePointer", err);
    }
    const Slot* s = new Slot{device, static_cast<ErrorRecord*>(p), static_cast<ErrorRecord*>(mapped),
                             static_cast<unsigned long long*>(claim), head_.load(std::memory_order_relaxed)};
    head_.store(s, std::memory_order_release);
    if (device >= 0 && device < kMaxDevices) by_device_[device].store(s, std::memory_order_release);
    return s;
  }

  std::atomic<const Slot*> head_{nullptr};  // every slot, the newest first
  std::atomic<const Slot*> by_device_[kMaxDevices] = {};
  std::mutex mutex_;
};

// If a kernel of `flag`'s family recorded an error (on `device`; -1: on any),
// raises it as ValueError "<op>: <describe(record)>". `earlier`: the record
// comes from a previous call (the kernel ran asynchronously), which the
// message says.
template <typename Describe>
void raise_recorded(const char* op, ErrorFlag& flag, bool earlier, Describe describe, int device = -1) {
  ErrorRecord rec{};
  if (!flag.take(&rec, device)) return;
  OPB_THROW(ValueError) << op << ": " << describe(rec)
                        << (earlier ? " (found on the GPU by an earlier call: CUDA kernels check these "
                                      "values asynchronously and report on the next call; set "
                                      "OPBRIDGE_CUDA_SYNC_CHECKS=1 to raise from the offending call)"
                                    : "");
}

// Whether OPBRIDGE_CUDA_SYNC_CHECKS asks kernels with device-side checks to
// synchronise and raise from the offending call (read on every call, as yes/no
// settings are read everywhere: opbridge/settings.h; a misspelt value raises).
inline bool sync_checks() {
  const char* v = std::getenv("OPBRIDGE_CUDA_SYNC_CHECKS");
  const int on = yes_no(v, 0);
  if (on < 0) {
    TVM_FFI_THROW(ValueError) << "OPBRIDGE_CUDA_SYNC_CHECKS must be one of 1, true, yes, on, 0, false, no, off "
                              << "(any case), got '" << v << "'";
  }
  return on == 1;
}

// After a launch of `flag`'s family on `stream`: where `asked` (sync_checks(), read before the launch, so
// that a misspelt setting raises before an in-place kernel has written anything), waits for it and raises
// what it recorded, from this call: the record of the stream's device (the current one), not another
// device's, whose kernels may still be running for another thread. Not while the stream is being captured
// into a CUDA graph, which cannot wait: a capture records the launch only, and its replays report to the
// next call.
template <typename Describe>
void raise_now_if_asked(const char* op, ErrorFlag& flag, cudaStream_t stream, bool asked, Describe describe) {
  if (!asked || capturing(stream)) return;
  OPB_CUDA_CHECK(op, cudaStreamSynchronize(stream));
  int device = 0;
  OPB_CUDA_CHECK(op, cudaGetDevice(&device));
  raise_recorded(op, flag, /*earlier=*/false, describe, device);
}

}  // namespace cuda
}  // namespace opbridge
