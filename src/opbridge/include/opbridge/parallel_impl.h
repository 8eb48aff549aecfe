// Bodies of what parallel.h declares with OPB_RT_: the caller-runs pool and
// the OpenMP region that run a parallel_for's chunks. Compiled once per module
// (build/templates/runtime.cc) when the module is built by opbridge, else
// included inline by parallel.h; either way a kernel's parallel_for only
// instantiates a small trampoline per loop body, not a pool and an OpenMP
// region per kernel and dtype.
#pragma once

#include <opbridge/parallel.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

#if defined(OPB_SEPARATE_RUNTIME) && !defined(__CUDACC__)
#define OPB_RT_THREAD_LOCAL thread_local
#else
#define OPB_RT_THREAD_LOCAL inline thread_local
#endif

namespace opbridge {
namespace detail {

// A caller-runs thread pool. A job is split into chunks; the calling thread
// claims and runs chunks itself and the workers help if the scheduler lets
// them in time. The caller only ever waits for chunks a running worker has
// already claimed, never for a worker to wake up: beside a busy process a
// parked OpenMP worker costs milliseconds per fork-join, this costs at most
// one chunk. Claims carry the job's generation, so a worker that wakes late
// can never run a chunk of the next job with the previous job's function.
class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // leaked on purpose: no joins at exit
    return *pool;
  }

  int threads() const { return nworkers_ + 1; }

  // Runs thunk(body, chunk) for chunk in [0, nchunks), each exactly once;
  // helpers are limited to the first `helpers` workers.
  void Run(int64_t nchunks, int helpers, void* body, ChunkFn thunk) {
    if (in_pool_ || nworkers_ == 0 || nchunks <= 1) {  // nested or single: stay on this thread
      for (int64_t c = 0; c < nchunks; ++c) thunk(body, c);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = ++generation_;
      body_ = body;
      thunk_ = thunk;
      nchunks_ = nchunks;
      helpers_ = helpers;
      done_.store(0, std::memory_order_relaxed);
      next_.store(gen << kIndexBits, std::memory_order_release);
    }
    cv_.notify_all();
    in_pool_ = true;
    int64_t mine = 0;
    for (int64_t c; (c = Claim(gen, nchunks)) >= 0; ++mine) thunk(body, c);
    in_pool_ = false;
    done_.fetch_add(mine, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < nchunks) std::this_thread::yield();
  }

 private:
  static constexpr int kIndexBits = 40;

  Pool() {
#ifdef _OPENMP
    nworkers_ = std::max(omp_get_max_threads(), 1) - 1;
#else
    nworkers_ = std::max(int(std::thread::hardware_concurrency()), 1) - 1;
#endif
    for (int i = 0; i < nworkers_; ++i) std::thread([this, i] { Work(i + 1); }).detach();
  }

  int64_t Claim(uint64_t gen, int64_t nchunks) {
    uint64_t v = next_.load(std::memory_order_acquire);
    while ((v >> kIndexBits) == gen && int64_t(v & ((uint64_t(1) << kIndexBits) - 1)) < nchunks) {
      if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        return int64_t(v & ((uint64_t(1) << kIndexBits) - 1));
      }
    }
    return -1;
  }

  void Work(int id) {
    in_pool_ = true;
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen;
      void* body;
      ChunkFn thunk;
      int64_t nchunks;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = gen = generation_;
        if (id >= helpers_) continue;
        body = body_;
        thunk = thunk_;
        nchunks = nchunks_;
      }
      int64_t mine = 0;
      for (int64_t c; (c = Claim(gen, nchunks)) >= 0; ++mine) thunk(body, c);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  int nworkers_ = 0;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  void* body_ = nullptr;
  ChunkFn thunk_ = nullptr;
  int64_t nchunks_ = 0;
  int helpers_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  static thread_local bool in_pool_;
};

OPB_RT_THREAD_LOCAL bool Pool::in_pool_ = false;

// GNU OpenMP does not survive fork(): in a child of a process whose OpenMP
// team has run, the next parallel region waits for threads that no longer
// exist (a multiprocessing or DataLoader worker forked after an opbridge call
// hung at its first parallel kernel). A child forked after this module was
// loaded therefore runs OpenMP-policy loops on its one thread; the
// caller-runs pool needs nothing (its caller runs every chunk a dead worker
// cannot claim).
inline std::atomic<bool> forked_child{false};
inline void MarkForkedChild() { forked_child.store(true, std::memory_order_relaxed); }
#if defined(__unix__) || defined(__APPLE__)
inline const bool fork_guard = (pthread_atfork(nullptr, nullptr, &MarkForkedChild), true);
#endif

OPB_RT_ void run_chunks(int64_t nchunks, int nt, void* body, ChunkFn fn) {
#ifdef _OPENMP
  if (threading() == Threading::kOpenMP) {
    if (forked_child.load(std::memory_order_relaxed)) {
      for (int64_t c = 0; c < nchunks; ++c) fn(body, c);
      return;
    }
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(nt)
    {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) fn(body, c);
    }
    return;
  }
#endif
  Pool::Get().Run(nchunks, nt, body, fn);
}

}  // namespace detail
}  // namespace opbridge
