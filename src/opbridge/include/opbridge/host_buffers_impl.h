// Large new CPU outputs: 2 MiB-aligned, on transparent huge pages, recycled.
//
// Compiled into every opbridge module (build/templates/runtime.cc); the first
// module loaded in a process registers the tvm-ffi globals below and pins
// itself (RTLD_NODELETE), so one pool serves the whole process: the Python
// op-call core (opbridge.call.memory.host_empty: NumPy, Paddle, MindSpore and
// torch's Python path take the buffer through DLPack) and torch's native shim
// (through the raw `api` table).
//
// Why: a large output from malloc is a fresh mapping whose first write
// faults into the OS once per 4 KiB page, or, with huge-page advice, once
// per 2 MiB of its aligned interior plus 512 times for its unaligned edges.
// Here the buffer is 2 MiB-aligned and a whole number of huge pages (an
// output of (4096, 4096) bfloat16: 530 -> 17 faults per call). A buffer freed
// while the cache has room goes back to the cache instead of to the OS, so
// the next output of the same size is neither mapped nor zeroed again: a
// loop calling an op at (4096, 4096) float32 writes into memory the kernel
// already owns (add: 3.3 -> 1.5 ms per call, measured through torch).
//
// Bounds: the cache holds at most `cache_bytes` (0: no recycling), drops the
// oldest buffer first to make room, and a reaper thread gives every buffer
// unused for `idle_ms` back to the OS, so an idle process holds nothing.
// After fork() the child starts with an empty pool.
//
// Globals (prefix opbridge.host_buffers.v1.):
//   empty(shape, dtype) -> Tensor      a new buffer, freed into the pool
//   api() -> int                       address of the Api table (host_buffers.h)
//   configure(advise, cache_bytes, idle_ms)
//   stats() -> [cached bytes, cached buffers, reused, mapped, released idle, live]
//   trim()                             every cached buffer back to the OS now
#pragma once

#include <opbridge/host_buffers.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <dlfcn.h>
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace opbridge {
namespace host_buffers {

constexpr size_t kHuge = size_t{2} << 20;

inline size_t Rounded(size_t n) { return (n + kHuge - 1) / kHuge * kHuge; }

class Pool {
 public:
  using Clock = std::chrono::steady_clock;

  static Pool*& Instance() {
    static Pool* pool = new Pool();  // leaked on purpose: buffers may outlive static destruction
    return pool;
  }

  void Configure(bool advise, int64_t cache_bytes, int64_t idle_ms) {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      advise_ = advise;
      cap_ = cache_bytes > 0 ? static_cast<size_t>(cache_bytes) : 0;
      idle_ = std::chrono::milliseconds(idle_ms > 0 ? idle_ms : 1);
      while (cached_bytes_ > cap_) PopOldest(&drop);
    }
    cv_.notify_all();
    Free(drop);
  }

  void* Alloc(size_t nbytes) {
    const size_t n = Rounded(nbytes);
    bool advise;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++live_;
      for (size_t i = cached_.size(); i-- > 0;) {  // most recently freed first: warmest in cache
        if (cached_[i].n == n) {
          void* p = cached_[i].p;
          cached_.erase(cached_.begin() + static_cast<std::ptrdiff_t>(i));
          cached_bytes_ -= n;
          ++reused_;
          return p;
        }
      }
      ++mapped_;
      advise = advise_;
    }
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, n) != 0) {
      std::lock_guard<std::mutex> lk(mu_);
      --live_;
      return nullptr;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (advise) madvise(p, n, MADV_HUGEPAGE);  // refused: stays on 4 KiB pages, never an error
#endif
    return p;
  }

  void Release(void* p, size_t nbytes) {
    if (!p) return;
    const size_t n = Rounded(nbytes);
    std::vector<Block> drop;
    bool keep = false, wake = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      --live_;
      if (n <= cap_) {
        while (cached_bytes_ + n > cap_) PopOldest(&drop);
        wake = cached_.empty();
        cached_.push_back(Block{p, n, Clock::now()});
        cached_bytes_ += n;
        keep = true;
        if (!reaper_) {
          reaper_ = true;
          std::thread([this] { Reap(); }).detach();
        }
      }
    }
    if (wake) cv_.notify_all();
    if (!keep) std::free(p);
    Free(drop);
  }

  void Trim() {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (!cached_.empty()) PopOldest(&drop);
    }
    Free(drop);
  }

  std::vector<int64_t> Stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return {static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(cached_.size()), reused_, mapped_,
            released_, live_};
  }

#if defined(__linux__)
  // fork(): the child gets a fresh pool (the parent's lock is held across the
  // fork so its state is consistent; the child has no reaper thread). The
  // cached buffers are the child's own copies: freed.
  static void BeforeFork() { Instance()->mu_.lock(); }
  static void AfterForkParent() { Instance()->mu_.unlock(); }
  static void AfterForkChild() {
    Pool* old = Instance();
    Pool* fresh = new Pool();
    fresh->advise_ = old->advise_;
    fresh->cap_ = old->cap_;
    fresh->idle_ = old->idle_;
    fresh->live_ = old->live_;
    for (const Block& b : old->cached_) std::free(b.p);
    Instance() = fresh;  // the old one (its mutex locked, its reaper gone) is leaked
  }
#endif

 private:
  struct Block {
    void* p;
    size_t n;
    Clock::time_point freed;
  };

  void PopOldest(std::vector<Block>* drop) {
    drop->push_back(cached_.front());
    cached_bytes_ -= cached_.front().n;
    cached_.erase(cached_.begin());
  }

  void Free(const std::vector<Block>& drop) {
    for (const Block& b : drop) std::free(b.p);
  }

  // Gives back every buffer unused for idle_; sleeps while the cache is empty.
  void Reap() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (cached_.empty()) {
        cv_.wait(lk);
        continue;
      }
      const auto due = cached_.front().freed + idle_;
      if (Clock::now() < due) {
        cv_.wait_until(lk, due);
        continue;
      }
      std::vector<Block> drop;
      while (!cached_.empty() && cached_.front().freed + idle_ <= Clock::now()) PopOldest(&drop);
      released_ += static_cast<int64_t>(drop.size());
      lk.unlock();
      Free(drop);
      lk.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Block> cached_;  // oldest first
  size_t cached_bytes_ = 0;
  bool advise_ = false;
  size_t cap_ = 0;  // recycling is off until configure() turns it on
  std::chrono::milliseconds idle_{1000};
  bool reaper_ = false;
  int64_t reused_ = 0, mapped_ = 0, released_ = 0, live_ = 0;
};

inline void* ApiAlloc(size_t nbytes) { return Pool::Instance()->Alloc(nbytes); }
inline void ApiRelease(void* p, size_t nbytes) { Pool::Instance()->Release(p, nbytes); }

struct NDAlloc {
  void AllocData(DLTensor* t) {
    t->data = Pool::Instance()->Alloc(tvm::ffi::GetDataSize(*t));
    if (!t->data) TVM_FFI_THROW(RuntimeError) << "out of memory allocating " << tvm::ffi::GetDataSize(*t) << " bytes";
  }
  void FreeData(DLTensor* t) { Pool::Instance()->Release(t->data, tvm::ffi::GetDataSize(*t)); }
};

inline const Api* GetApi() {
  static const Api api{1, &ApiAlloc, &ApiRelease};
  return &api;
}

// Registers the globals unless a module loaded earlier did; the registering
// module is never unloaded (its code frees every buffer it handed out).
inline void RegisterOnce() {
  if (tvm::ffi::Function::GetGlobal(kApiGlobal).has_value()) return;
#if defined(__linux__)
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&ApiAlloc), &info) && info.dli_fname) {
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  }
  pthread_atfork(&Pool::BeforeFork, &Pool::AfterForkParent, &Pool::AfterForkChild);
#endif
  using tvm::ffi::Function;
  Function::SetGlobal(OPB_HOST_BUFFERS_GLOBAL("empty"),
                      Function::FromTyped([](tvm::ffi::Shape shape, DLDataType dtype) {
                        return tvm::ffi::Tensor::FromNDAlloc(NDAlloc(), shape, dtype, DLDevice{kDLCPU, 0});
                      }));
  Function::SetGlobal(OPB_HOST_BUFFERS_GLOBAL("configure"),
                      Function::FromTyped([](bool advise, int64_t cache_bytes, int64_t idle_ms) {
                        Pool::Instance()->Configure(advise, cache_bytes, idle_ms);
                      }));
  Function::SetGlobal(OPB_HOST_BUFFERS_GLOBAL("stats"), Function::FromTyped([]() {
                        tvm::ffi::Array<int64_t> out;
                        for (int64_t v : Pool::Instance()->Stats()) out.push_back(v);
                        return out;
                      }));
  Function::SetGlobal(OPB_HOST_BUFFERS_GLOBAL("trim"), Function::FromTyped([]() { Pool::Instance()->Trim(); }));
  Function::SetGlobal(kApiGlobal, Function::FromTyped([]() { return reinterpret_cast<int64_t>(GetApi()); }));
}

}  // namespace host_buffers
}  // namespace opbridge
