// Launch-policy sweep of the row-cached RMS kernels (include/opbridge/cuda_norm.h): rms_norm's and
// fused_add_rms_norm's rows at serving sizes (1, 8, 64, 256, 1024 and 4096 rows of 4096: the best
// policy changes with the rows) and 8192 x 8192, float32 and bfloat16, under every policy that fits
// (units per thread 1-8, the threads that follow, the three-barrier or the one-barrier block sum; the
// current policy with cache-streaming rows; the persistent grid that loads each block's next row
// during the current one's sum, kPrefetch; and policies that ask for 1536 or 2048 threads per SM,
// min_blocks, at 1 and 2 units; and, for rms_norm, its rows staged through 2-4 shared-memory stages by
// cp.async, cuda_norm_staged.h, no policy of the cached kernel but the candidate for many rows; and its
// looped form, cuda_norm_looped.h, one block of 128-1024 threads per row, a looped reduction, its loads
// batched 2 or 4 units at a time under an occupancy or left to the compiler), each
// timed as 100 launches in a CUDA graph (median of 10 replays)
// and checked against the op's current policy. Each line also gives the kernel's registers per
// thread, its bytes of local memory (spills) and its blocks per SM. It launches the product's kernel
// template itself (rms_rows_cached_kernel, with the row source and, for rms_norm, the policy
// launch_rms_norm_rows would pick), so
// what it measures is what a policy change would ship.
// Then rms_norm's backward (cuda_norm_backward.h) at the same sizes, under each units / threads /
// occupancy policy and staged through 2 or 3 stages (cuda_norm_staged.h), timed with the column sum its
// grid needs and checked against the current policy.
// Built and run by scripts/cuda-sweep.sh norm (the binary takes all, cached or staged: which variants run);
// needs a CUDA GPU. Not part of the product; tests/test_cuda.py builds it.
#include <opbridge/cuda_norm.h>
#include <opbridge/cuda_norm_backward.h>
#include <opbridge/cuda_norm_looped.h>
#include <opbridge/cuda_norm_staged.h>

#include <string>

#include "cuda_sweep.h"

// Which variants run (the current policy always runs first: it is every case's reference). `cached`:
// the register-cached kernels' policies; `staged`: the staged kernels only, which a device session runs
// as a process of its own, so that a fault in an untried kernel (a sticky CUDA error ends the process)
// cannot cost the rest of the sweep; `all` (the default): both.
struct Sections {
  bool cached = true, staged = true;
};
Sections g_sections;

// A policy with every knob explicit (the kernel reads kMaxThreads, min_blocks, kFastSum, kStream and
// kPrefetch).
template <int MaxThreads, bool Fast, bool Stream = false, bool Prefetch = false, int MinBlocks = 0>
struct Knobs {
  static constexpr int kMaxThreads = MaxThreads;
  static constexpr bool kFastSum = Fast, kStream = Stream, kPrefetch = Prefetch;
  static constexpr int min_blocks(int) { return MinBlocks; }
};

// Whether a staged kernel's `smem` bytes of stages fit one of its blocks on device 0, as the product
// decides it (cuda_norm_staged.h's staged_smem_fits); if so, its dynamic shared memory limit is raised
// to them.
template <typename Kernel>
bool staged_fits(Kernel kernel, int smem) {
  int optin = 0;
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  cudaFuncAttributes attr{};
  CK(cudaFuncGetAttributes(&attr, kernel));
  if (!cu::staged_smem_fits(smem, attr.sharedSizeBytes, optin)) return false;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return true;
}

// Every policy for one op, dtype and size. Fused: input and residual are restored before each
// launch's check (the kernel mutates both), not before timed launches (the values do not matter).
template <bool Fused, typename T>
void sweep(int64_t rows, int64_t H, cudaStream_t s, double copy) {
  constexpr int N = cu::kVec<T>;
  using Src = std::conditional_t<Fused, cu::SumRows<N, T>, cu::RowsOf<N, T>>;
  const int64_t n = rows * H, hv = H / N;
  T *x, *res, *x0, *res0, *w, *y;
  for (T** p : {&x, &res, &x0, &res0, &y}) CK(cudaMalloc(p, n * sizeof(T)));
  CK(cudaMalloc(&w, H * sizeof(T)));
  fill<<<256, 256, 0, s>>>(x0, n, 1);
  fill<<<256, 256, 0, s>>>(res0, n, 2);
  fill<<<64, 256, 0, s>>>(w, H, 3);
  CK(cudaGetLastError());
  const float eps = 1e-6f;
  const double bytes = double(n) * sizeof(T) * (Fused ? 4 : 2) + double(H) * sizeof(T);
  T* out = Fused ? x : y;
  Src src = [&] {
    if constexpr (Fused) return Src{x, res, H};
    else return Src{x, opbridge::StridedRows{H, 1, H}};
  }();
  using Current = std::conditional_t<Fused, cu::FusedAddRmsNormRows<N>, cu::RmsNormRows<N>>;  // the ops' policies
  // the op's policy for these rows as launch_rms_norm_rows and launch_fused_add_rms_norm_rows pick it:
  // RmsNormManyRows, RmsNormFewRows and FusedAddRmsNormFewRows where they apply
  const bool many = !Fused && cu::RmsNormManyRows<N>::applies(rows, hv, true);
  const bool few = !Fused && cu::RmsNormFewRows<N>::applies(rows, hv, true);
  const bool fused_few = Fused && cu::FusedAddRmsNormFewRows<N>::applies(rows, hv);
  struct Knobset {
    int units, bound, min_blocks;
    bool fast, stream, prefetch;
  };
  auto knobs_of = [&](auto policy) {
    using P = decltype(policy);
    const int units = cu::cached_units<P>(hv);
    return Knobset{units, P::kMaxThreads, P::min_blocks(units), P::kFastSum, P::kStream, P::kPrefetch};
  };
  const Knobset cur = many        ? knobs_of(cu::RmsNormManyRows<N>{})
                     : few       ? knobs_of(cu::RmsNormFewRows<N>{})
                     : fused_few ? knobs_of(cu::FusedAddRmsNormFewRows<N>{})
                                 : knobs_of(Current{});
  const int current_units = cur.units;
  std::vector<T> want, got(n);
  auto reset = [&] {
    CK(cudaMemcpyAsync(x, x0, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
    CK(cudaMemcpyAsync(res, res0, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
  };
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // One policy's launch: checked against the reference (the first launch's, the current policy's),
  // timed, printed. `form`: what sets it apart beyond the common knobs ("", " prefetch", " staged S").
  auto run = [&](const auto& launch, const KernelFacts& facts, int units, int threads, int bound, bool fast,
                 bool stream, const char* form, bool current) {
    reset();
    launch();
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(got.data(), out, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    if (want.empty()) want = got;  // the first launch is the current policy's: every variant against it
    double diff = 0;
    for (int64_t i = 0; i < n; i += 7) {
      diff = std::max(diff, double(std::fabs(host_float(got[i]) - host_float(want[i]))));
    }
    const float us = graph_us(launch, s);
    std::printf("%-18s %-8s %5lld x %-5lld units %d threads %4d bound %4d %-4s %-6s%s%s %9.3f us %6.3f copy  "
                "max|diff| %.2g%s\n", Fused ? "fused_add_rms_norm" : "rms_norm", dtype_name<T>(), (long long)rows,
                (long long)H, units, threads, bound, fast ? "fast" : "3bar", stream ? "stream" : "cached", form,
                facts.words, us, bytes / (us * 1e-6) / 1e9 / copy, diff, current ? "  <- current policy" : "");
  };
  auto one = [&](auto kernel, const auto& rows_src, int units, int threads, int bound, int min_blocks, bool fast,
                 bool stream, bool prefetch) {
    const KernelFacts facts = kernel_facts(kernel, threads, min_blocks);
    int64_t blocks = rows;
    if (prefetch) blocks = std::min<int64_t>(rows, int64_t(sms) * std::max(facts.per_sm, 1));  // one wave
    const auto launch = [&] { kernel<<<unsigned(blocks), threads, 0, s>>>(out, rows_src, w, rows, H, eps); };
    const bool current = units == cur.units && bound == cur.bound && fast == cur.fast && stream == cur.stream &&
                         prefetch == cur.prefetch && min_blocks == cur.min_blocks;
    run(launch, facts, units, threads, bound, fast, stream, prefetch ? " prefetch" : "", current);
  };
  // rms_norm's rows through S shared-memory stages (cuda_norm_staged.h): a persistent grid of blocks of
  // up to MaxT threads, each thread looping over its units; launched as launch_rms_rows_staged would.
  auto staged = [&](auto stages_c, auto threads_c) {
    if constexpr (!Fused) {
      constexpr int S = decltype(stages_c)::value, MaxT = decltype(threads_c)::value;
      using P = Knobs<MaxT, true>;
      auto* kernel = cu::rms_rows_staged_kernel<N, S, P, T>;
      const int threads = cu::row_threads(hv, MaxT);
      const int smem = int(S * hv * 16);
      if (!staged_fits(kernel, smem)) return;
      const KernelFacts facts = kernel_facts(kernel, threads, 0, smem);
      const int64_t blocks = std::min<int64_t>(rows, int64_t(sms) * std::max(facts.per_sm, 1));  // one wave
      const auto launch = [&] { kernel<<<unsigned(blocks), threads, smem, s>>>(out, x, w, rows, H, eps); };
      char form[16];
      std::snprintf(form, sizeof form, " staged %d", S);
      run(launch, facts, int((hv + threads - 1) / threads), threads, MaxT, true, false, form, false);
    }
  };
  // The current policy first (its result is the reference), then every other that fits.
  auto variant_at = [&](auto units_c, auto threads_c, auto fast_c, auto stream_c, auto prefetch_c,
                        auto min_blocks_c) {
    constexpr int K = decltype(units_c)::value, MaxT = decltype(threads_c)::value;
    constexpr bool Fast = decltype(fast_c)::value, Stream = decltype(stream_c)::value;
    constexpr bool Prefetch = decltype(prefetch_c)::value;
    constexpr int MinB = decltype(min_blocks_c)::value;
    const int64_t per_thread = (hv + K - 1) / K;  // threads the row needs at K units each
    if (per_thread > MaxT || per_thread < 32) return;  // a block of at most MaxT threads holds the row
    const int threads = cu::row_threads(per_thread, MaxT);
    // rms_norm's source as launch_rms_rows_of picks it for contiguous rows: dense under an occupancy
    using RowsSrc = std::conditional_t<Fused, Src, cu::RowsOf<N, T, (MinB > 0)>>;
    const RowsSrc rows_src = [&] {
      if constexpr (Fused) return src;
      else return RowsSrc{x, opbridge::StridedRows{H, 1, H}};
    }();
    one(cu::rms_rows_cached_kernel<N, K, Knobs<MaxT, Fast, Stream, Prefetch, MinB>, T, RowsSrc>, rows_src, K, threads,
        MaxT, MinB, Fast, Stream, Prefetch);
  };
  auto variant = [&](auto units_c, auto threads_c, auto fast_c, auto stream_c, auto prefetch_c) {
    variant_at(units_c, threads_c, fast_c, stream_c, prefetch_c, std::integral_constant<int, 0>{});
  };
  using std::integral_constant;
  auto per_units = [&](auto k) {
    variant(k, integral_constant<int, 256>{}, std::false_type{}, std::false_type{}, std::false_type{});
    variant(k, integral_constant<int, 256>{}, std::true_type{}, std::false_type{}, std::false_type{});
    variant(k, integral_constant<int, 512>{}, std::false_type{}, std::false_type{}, std::false_type{});
    variant(k, integral_constant<int, 512>{}, std::true_type{}, std::false_type{}, std::false_type{});
    variant(k, integral_constant<int, 1024>{}, std::false_type{}, std::false_type{}, std::false_type{});
    variant(k, integral_constant<int, 1024>{}, std::true_type{}, std::false_type{}, std::false_type{});
  };
  if (current_units == 0) {
    std::printf("%s %s %lld x %lld: rows do not fit the cached kernel (the two-pass form runs)\n",
                Fused ? "fused_add_rms_norm" : "rms_norm", dtype_name<T>(), (long long)rows, (long long)H);
  } else {  // the current policy first: its result is the reference; then it with streaming rows
    auto first = [&](auto policy) {
      using P = decltype(policy);
      cu::with_units<P::kMaxUnits>(current_units, [&](auto k) {
        variant_at(k, integral_constant<int, P::kMaxThreads>{}, integral_constant<bool, P::kFastSum>{},
                   integral_constant<bool, P::kStream>{}, integral_constant<bool, P::kPrefetch>{},
                   integral_constant<int, P::min_blocks(decltype(k)::value)>{});
        variant_at(k, integral_constant<int, P::kMaxThreads>{}, integral_constant<bool, P::kFastSum>{},
                   integral_constant<bool, !P::kStream>{}, integral_constant<bool, P::kPrefetch>{},
                   integral_constant<int, P::min_blocks(decltype(k)::value)>{});
      });
    };
    if constexpr (!Fused) {
      if (many) first(cu::RmsNormManyRows<N>{});
      else if (few) first(cu::RmsNormFewRows<N>{});
      else first(Current{});
    } else {
      if (fused_few) first(cu::FusedAddRmsNormFewRows<N>{});
      else first(Current{});
    }
  }
  if (g_sections.cached) {
    per_units(integral_constant<int, 1>{});
    per_units(integral_constant<int, 2>{});
    per_units(integral_constant<int, 4>{});
    per_units(integral_constant<int, 8>{});
  }
  // The persistent grid whose blocks load their next row during the current one's sum (kPrefetch).
  auto prefetched = [&](auto k) {
    variant(k, integral_constant<int, 512>{}, std::true_type{}, std::false_type{}, std::true_type{});
    variant(k, integral_constant<int, 1024>{}, std::true_type{}, std::false_type{}, std::true_type{});
  };
  if (g_sections.cached) {
    prefetched(integral_constant<int, 1>{});
    prefetched(integral_constant<int, 2>{});
    prefetched(integral_constant<int, 4>{});
  }
  // Policies that ask for 1536 or 2048 threads per SM (min_blocks), with the one-barrier sum.
  auto occupied = [&](auto k) {
    const auto go = [&](auto threads_c, auto min_blocks_c) {
      variant_at(k, threads_c, std::true_type{}, std::false_type{}, std::false_type{}, min_blocks_c);
    };
    go(integral_constant<int, 1024>{}, integral_constant<int, 2>{});
    go(integral_constant<int, 512>{}, integral_constant<int, 3>{});
    go(integral_constant<int, 512>{}, integral_constant<int, 4>{});
    go(integral_constant<int, 256>{}, integral_constant<int, 6>{});
    go(integral_constant<int, 256>{}, integral_constant<int, 8>{});
  };
  if (g_sections.cached) {
    occupied(integral_constant<int, 1>{});  // 4 units spill 72-500 bytes at these occupancies
    occupied(integral_constant<int, 2>{});
  }
  // rms_norm's rows staged through 2, 3 or 4 shared-memory stages (cp.async), not a policy of the cached kernel.
  auto staged_at = [&](auto stages_c) {
    staged(stages_c, integral_constant<int, 256>{});
    staged(stages_c, integral_constant<int, 512>{});
    staged(stages_c, integral_constant<int, 1024>{});
  };
  if (g_sections.staged) {
    staged_at(integral_constant<int, 2>{});
    staged_at(integral_constant<int, 3>{});
    staged_at(integral_constant<int, 4>{});
  }
  // rms_norm's looped form (cuda_norm_looped.h) in place of the cached kernel: one block of up to MaxT
  // threads per row, the row read again for the scale, its loops as
  // compiled (unroll 0) or U units loaded at once, asking for MinB blocks per SM (0: nothing).
  auto looped = [&](auto threads_c, auto unroll_c, auto min_blocks_c) {
    if constexpr (!Fused) {
      constexpr int MaxT = decltype(threads_c)::value, U = decltype(unroll_c)::value;
      constexpr int MinB = decltype(min_blocks_c)::value;
      auto* kernel = cu::rms_rows_looped_kernel<N, U, T, MaxT, MinB>;
      const int threads = cu::row_threads(hv, MaxT);
      const KernelFacts facts = kernel_facts(kernel, threads, MinB);
      const opbridge::StridedRows xs{H, 1, H};
      const auto launch = [&] { kernel<<<unsigned(rows), threads, 0, s>>>(out, x, xs, w, rows, H, eps); };
      char form[24];
      std::snprintf(form, sizeof form, " looped %d min %d", U, MinB);
      run(launch, facts, int((hv + threads - 1) / threads), threads, MaxT, false, false, form, false);
    }
  };
  if (g_sections.cached) {
    using std::integral_constant;
    looped(integral_constant<int, 256>{}, integral_constant<int, 0>{}, integral_constant<int, 0>{});
    looped(integral_constant<int, 512>{}, integral_constant<int, 0>{}, integral_constant<int, 0>{});
    looped(integral_constant<int, 1024>{}, integral_constant<int, 0>{}, integral_constant<int, 0>{});
    looped(integral_constant<int, 256>{}, integral_constant<int, 2>{}, integral_constant<int, 6>{});
    looped(integral_constant<int, 512>{}, integral_constant<int, 2>{}, integral_constant<int, 3>{});
    looped(integral_constant<int, 128>{}, integral_constant<int, 4>{}, integral_constant<int, 8>{});
    looped(integral_constant<int, 256>{}, integral_constant<int, 4>{}, integral_constant<int, 3>{});
  }
  for (T* p : {x, res, x0, res0, w, y}) CK(cudaFree(p));
}

// A backward policy with its knobs explicit (the kernel reads kMaxThreads and min_blocks).
template <int MaxThreads, int MinBlocks>
struct BackwardKnobs {
  static constexpr int kMaxThreads = MaxThreads;
  static constexpr int min_blocks(int) { return MinBlocks; }
};

// rms_norm's backward under every policy that fits: 1, 2 or 4 units (up to 16 elements) per thread,
// blocks of up to 256, 512 or 1024 threads, with no occupancy asked or 1024, 1536 or 2048 threads per SM;
// the launcher's grid (one wave, by the occupancy API) and, past one block, the column sum. A
// difference is relative to max(1, |value|) for grad_x and to max(1, max |grad_weight|) for
// grad_weight, whose sums run over the rows in the order of each policy's grid.
template <typename T>
void sweep_backward(int64_t rows, int64_t H, cudaStream_t s, double copy) {
  constexpr int N = cu::kVec<T>;
  using C = opbridge::compute_t<T>;
  using Current = cu::RmsNormBackwardRows<N>;
  const int64_t n = rows * H, hv = H / N;
  const int current_units = cu::cached_units<Current>(hv);
  if (current_units == 0) {
    std::printf("rms_norm_backward %s %lld x %lld: rows do not fit the cached kernel\n", dtype_name<T>(),
                (long long)rows, (long long)H);
    return;
  }
  T *x, *g, *w, *dx, *dw;
  for (T** p : {&x, &g, &dx}) CK(cudaMalloc(p, n * sizeof(T)));
  for (T** p : {&w, &dw}) CK(cudaMalloc(p, H * sizeof(T)));
  fill<<<256, 256, 0, s>>>(x, n, 1);
  fill<<<256, 256, 0, s>>>(g, n, 4);
  fill<<<64, 256, 0, s>>>(w, H, 3);
  CK(cudaGetLastError());
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  C* partial = nullptr;
  int64_t partial_rows = 0;
  std::vector<T> want_dx, want_dw, got_dx(n), got_dw(H);
  const double bytes = 3.0 * double(n) * sizeof(T) + 2.0 * double(H) * sizeof(T);
  // `smem`, `stages`: the staged kernel's dynamic shared memory and stages (cuda_norm_staged.h); 0 for
  // the cached kernel.
  auto one = [&](auto kernel, int units, int threads, int bound, int min_blocks, int smem = 0, int stages = 0) {
    if (smem > 0 && !staged_fits(kernel, smem)) return;
    const KernelFacts facts = kernel_facts(kernel, threads, min_blocks, smem);
    const int64_t grid = std::min<int64_t>(rows, int64_t(sms) * std::max(facts.per_sm, 1));
    if (grid > partial_rows) {
      if (partial != nullptr) CK(cudaFree(partial));
      CK(cudaMalloc(&partial, grid * H * sizeof(C)));
      partial_rows = grid;
    }
    const auto launch = [&] {
      kernel<<<unsigned(grid), threads, smem, s>>>(dx, dw, partial, g, x, w, rows, H, C(1e-6));
      if (grid > 1) cu::launch_column_sum(s, dw, static_cast<const C*>(partial), grid, H);
    };
    launch();
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(got_dx.data(), dx, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(got_dw.data(), dw, H * sizeof(T), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    const bool current = stages == 0 && units == current_units && bound == Current::kMaxThreads &&
                         min_blocks == Current::min_blocks(units);
    if (want_dx.empty()) want_dx = got_dx, want_dw = got_dw;  // the current policy's: every variant against it
    double diff = 0, dw_scale = 1;
    for (int64_t i = 0; i < H; ++i) dw_scale = std::max(dw_scale, double(std::fabs(host_float(want_dw[i]))));
    for (int64_t i = 0; i < n; i += 7) {
      const double want = host_float(want_dx[i]);
      diff = std::max(diff, std::fabs(host_float(got_dx[i]) - want) / std::max(1.0, std::fabs(want)));
    }
    for (int64_t i = 0; i < H; ++i) {
      diff = std::max(diff, std::fabs(host_float(got_dw[i]) - host_float(want_dw[i])) / dw_scale);
    }
    const float us = graph_us(launch, s);
    char form[16] = "";
    if (stages > 0) std::snprintf(form, sizeof form, " staged %d", stages);
    std::printf("%-18s %-8s %5lld x %-5lld units %d threads %4d bound %4d%s%s grid %5lld %9.3f us %6.3f copy  "
                "max|diff| %.2g%s\n", "rms_norm_backward", dtype_name<T>(), (long long)rows, (long long)H, units,
                threads, bound, form, facts.words, (long long)grid, us, bytes / (us * 1e-6) / 1e9 / copy, diff,
                current ? "  <- current policy" : "");
  };
  auto variant = [&](auto units_c, auto threads_c, auto min_blocks_c) {
    constexpr int K = decltype(units_c)::value, MaxT = decltype(threads_c)::value;
    constexpr int MinB = decltype(min_blocks_c)::value;
    if constexpr (K * N <= 16) {
      const int64_t per_thread = (hv + K - 1) / K;
      if (per_thread > MaxT || per_thread < 32) return;
      one(cu::rms_norm_backward_cached_kernel<BackwardKnobs<MaxT, MinB>, N, K, T>, K,
          cu::row_threads(per_thread, MaxT), MaxT, MinB);
    }
  };
  using std::integral_constant;
  cu::with_units<Current::kMaxUnits>(current_units, [&](auto k) {  // the current policy first: the reference
    variant(k, integral_constant<int, Current::kMaxThreads>{},
            integral_constant<int, Current::min_blocks(decltype(k)::value)>{});
  });
  auto per_units = [&](auto k) {
    variant(k, integral_constant<int, 256>{}, integral_constant<int, 0>{});
    variant(k, integral_constant<int, 256>{}, integral_constant<int, 4>{});
    variant(k, integral_constant<int, 256>{}, integral_constant<int, 6>{});
    variant(k, integral_constant<int, 256>{}, integral_constant<int, 8>{});
    variant(k, integral_constant<int, 512>{}, integral_constant<int, 0>{});
    if constexpr (Current::min_blocks(decltype(k)::value) != 2) {
      variant(k, integral_constant<int, 512>{}, integral_constant<int, 2>{});
    }
    variant(k, integral_constant<int, 512>{}, integral_constant<int, 3>{});
    variant(k, integral_constant<int, 512>{}, integral_constant<int, 4>{});
    variant(k, integral_constant<int, 1024>{}, integral_constant<int, 0>{});
    variant(k, integral_constant<int, 1024>{}, integral_constant<int, 2>{});
  };
  if (g_sections.cached) {
    per_units(integral_constant<int, 1>{});
    per_units(integral_constant<int, 2>{});
    per_units(integral_constant<int, 4>{});
  }
  // x's and grad's rows staged through S shared-memory stages (cuda_norm_staged.h).
  auto staged = [&](auto units_c, auto threads_c, auto stages_c) {
    constexpr int K = decltype(units_c)::value, MaxT = decltype(threads_c)::value, S = decltype(stages_c)::value;
    if constexpr (K * N <= 16) {
      const int64_t per_thread = (hv + K - 1) / K;
      if (per_thread > MaxT || per_thread < 32) return;
      one(cu::rms_norm_backward_staged_kernel<BackwardKnobs<MaxT, 0>, N, K, S, T>, K, cu::row_threads(per_thread, MaxT),
          MaxT, 0, int(S * 2 * hv * 16), S);
    }
  };
  auto staged_at = [&](auto units_c) {
    staged(units_c, integral_constant<int, 512>{}, integral_constant<int, 2>{});
    staged(units_c, integral_constant<int, 512>{}, integral_constant<int, 3>{});
    staged(units_c, integral_constant<int, 1024>{}, integral_constant<int, 2>{});
    staged(units_c, integral_constant<int, 1024>{}, integral_constant<int, 3>{});
  };
  if (g_sections.staged) {
    staged_at(integral_constant<int, 1>{});
    staged_at(integral_constant<int, 2>{});
  }
  for (T* p : {x, g, w, dx, dw}) CK(cudaFree(p));
  if (partial != nullptr) CK(cudaFree(partial));
}

int main(int argc, char** argv) {
  const std::string section = argc > 1 ? argv[1] : "all";
  if (section == "-h" || section == "--help" || (section != "all" && section != "cached" && section != "staged")) {
    std::fprintf(section == "-h" || section == "--help" ? stdout : stderr,
                 "usage: %s [all|cached|staged]: the norm sweep, all variants (default), the register-cached "
                 "kernels' policies only, or the staged kernels only (each beside the current policy)\n", argv[0]);
    return section == "-h" || section == "--help" ? 0 : 2;
  }
  g_sections = {section != "staged", section != "cached"};
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy = sweep_header(s);
  const int64_t shapes[][2] = {{1, 4096}, {8, 4096}, {64, 4096}, {256, 4096}, {1024, 4096}, {4096, 4096}, {8192, 8192}};
  for (const auto& sh : shapes) {
    sweep<false, float>(sh[0], sh[1], s, copy);
    sweep<false, __nv_bfloat16>(sh[0], sh[1], s, copy);
    sweep<true, float>(sh[0], sh[1], s, copy);
    sweep<true, __nv_bfloat16>(sh[0], sh[1], s, copy);
  }
  for (const auto& sh : shapes) {
    sweep_backward<float>(sh[0], sh[1], s, copy);
    sweep_backward<__nv_bfloat16>(sh[0], sh[1], s, copy);
  }
  CK(cudaStreamDestroy(s));
  return 0;
}
