// Parallel loops for CPU kernels: parallel_for(n, work_per_item, f) runs
// f(begin, end) (or f(begin, end, partition)) over [0, n) on the calling thread
// alone below kParallelGrain units of work, else on several threads.
//
// Only the loop body is a template here: the machinery that runs the chunks
// (detail::run_chunks, parallel_impl.h) takes it as a pointer and a trampoline
// and is compiled once per module, not once per kernel and dtype.
#pragma once

#include <opbridge/opbridge.h>
#include <opbridge/threading.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace opbridge {

// How many threads parallel_for uses for n items of work_per_item units each:
// one below kParallelGrain units of work (waking a helper costs more than it
// saves), else OpenMP's thread count (OMP_NUM_THREADS is honoured).
inline int parallel_threads(int64_t n, int64_t work_per_item) {
#ifdef _OPENMP
  if (n > 1 && n * std::max<int64_t>(work_per_item, 1) >= kParallelGrain) {
    return std::max(omp_get_max_threads(), 1);
  }
#endif
  (void)n;
  (void)work_per_item;
  return 1;
}

// Chunks per thread for f(begin, end): enough that a thread the scheduler
// parks only delays a small share of the work.
constexpr int kChunksPerThread = 4;

// Which threads run the chunks of a parallel job (opbridge::threading(),
// threading.h; OPBRIDGE_THREADING=omp|pool, default omp). Measured on this
// 2-core box, 1024x1024 float32 into a buffer, interleaved with torch.add:
//  - OpenMP team (default). In a PyTorch process it is torch's own team:
//    torch ships libgomp.so.1 and loads it globally, so our libgomp.so.1
//    dependency binds to it, and its workers, spinning after every torch op,
//    pick our chunks up at once. Quiet machine: add / gelu / rms_norm p50
//    0.24 / 0.29 / 0.16 ms, p99 0.35 / 0.44 / 0.27 ms. 4096x4096 rms_norm
//    right after a torch op: 5.8 ms, vs 8.4 ms on the pool, which has to fight
//    torch's spinning workers for the cores. Under jax.jit (quiet) it ran at
//    0.33-0.73x XLA's own time, the pool at 0.61-0.90x. Dynamic claiming means
//    a late thread delays the job by the join only, not by a share of the
//    work; but beside a busy process the join waits for a descheduled team
//    thread: p99 8-12 ms -- as for torch's own add (12 ms) under that load.
//  - Caller-runs pool (detail::Pool, parallel_impl.h). The caller never
//    waits for a thread to be scheduled: beside a busy process p99 1.7-4 ms,
//    but p50 is 1.3-1.7x the team's (the helper rarely gets a core in
//    time), and in a torch process torch's own ops suffer (torch.add p50
//    0.22 -> 3.2 ms beside the busy process). For latency-critical work
//    beside busy neighbours.

namespace detail {

using ChunkFn = void (*)(void* body, int64_t chunk);

// Runs fn(body, c) for every chunk c in [0, nchunks), each exactly once, on at
// most nt threads (the calling thread included) under the policy above.
OPB_RT_ void run_chunks(int64_t nchunks, int nt, void* body, ChunkFn fn);

template <typename Body>
inline void run_chunks(int64_t nchunks, int nt, Body& body) {
  run_chunks(nchunks, nt, &body, [](void* b, int64_t c) { (*static_cast<Body*>(b))(c); });
}

}  // namespace detail

// f(begin, end) over [0, n) on nt threads: the calling thread alone for nt == 1, else
// nt * kChunksPerThread chunks claimed as threads arrive (parallel_for's split, for a caller
// that chose the thread count itself).
template <typename F>
inline void parallel_chunks(int64_t n, int nt, F&& f) {
  if (n <= 0) return;
  if (nt == 1) return f(int64_t(0), n);
  const int64_t chunks = std::min<int64_t>(n, int64_t(nt) * kChunksPerThread);
  auto body = [&](int64_t c) {
    const int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    if (begin < end) f(begin, end);
  };
  detail::run_chunks(chunks, nt, body);
}

template <typename F>
inline void parallel_for(int64_t n, int64_t work_per_item, F&& f) {
  if (n <= 0) return;
  const int nt = parallel_threads(n, work_per_item);
  if constexpr (std::is_invocable_v<F&, int64_t, int64_t, int>) {
    // f takes a partition index (per-partition partial sums): exactly nt fixed
    // partitions, each run by whichever thread claims it, so the reduction
    // order -- and the result -- does not depend on scheduling.
    auto body = [&](int64_t t) {
      const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
      if (begin < end) f(begin, end, int(t));
    };
    if (nt == 1) return body(0);
    detail::run_chunks(nt, nt, body);
  } else {
    parallel_chunks(n, nt, f);
  }
}

}  // namespace opbridge

#if !defined(OPB_SEPARATE_RUNTIME) || defined(OPB_RUNTIME_IMPL) || defined(__CUDACC__)
#include "opbridge/parallel_impl.h"
#endif
