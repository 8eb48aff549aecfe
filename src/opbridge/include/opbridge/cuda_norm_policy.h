// The launch policies of the row-cached RMS kernels of rms_norm and fused_add_rms_norm (cuda_norm.h): how
// many 128-bit units per thread, threads per block and blocks per SM each op's rows take, each measured on
// an H200 by the norm sweep (scripts/cuda_norm_sweep.cu), which launches the kernels under these very
// policies. A new row kernel picks or adds a policy here. The backward's policies live beside its kernels
// (cuda_norm_backward.h, cuda_norm_staged.h).
#pragma once

#include <opbridge/cuda.h>

#include <cstdint>
#include <type_traits>

namespace opbridge {
namespace cuda {

// A launch policy: blocks of at most kMaxThreads threads (also the kernel's __launch_bounds__); a
// row's units (128-bit vectors) spread first over kPreferredThreads threads with up to
// kPreferredUnits units each, then over more threads up to kMaxThreads, then over more units up to
// kMaxUnits (1, 2, 4 or 8) per thread. kFastSum picks block_sum_fast over block_sum; kStream:
// cache-streaming loads and stores of the rows (the weight row, read by every block, keeps normal
// loads), a knob the sweep tries (scripts/cuda_norm_sweep.cu). kPrefetch: a persistent grid (one wave)
// whose blocks load their next row while they reduce and write the current one, and load the weight
// once: with one or two blocks per SM, the block sum's barriers otherwise leave the memory system idle
// (a candidate for bfloat16 rows of 8192 when no policy came within 25% of Inductor on an H200; the
// occupancy below since did); fused_add_rms_norm's float32 rows of 2052-4096 columns take it below 2048
// rows (FusedAddRmsNormFewRows). min_blocks(units): the kernel's second __launch_bounds__ argument for
// that many units per thread, blocks of kMaxThreads that must fit on an SM at once, so that ptxas holds
// a thread's registers to 65536 / (kMaxThreads x min_blocks):
// Liger-Kernel's bfloat16 rms_norm for rows of 8192 runs 512 threads x 16 elements at 39 registers, 3
// blocks (1536 threads, 48 KiB of loads) per SM, where this kernel's policy before 2026-11-28 ran 2 blocks
// of 1024 (rms_norm's 16-bit policy now runs Liger's). Per
// units, because the registers a unit needs decide what fits: at 3 blocks of 512, 2 bfloat16 units
// fit 40 registers without spilling, 4 spill (340-500 bytes of spill loads). A kernel asked for an
// occupancy also holds its units as raw bytes (load_units), and contiguous rows are read as dense ones
// (launch_rms_rows_of). 0 asks nothing (no .minnctapersm): the shipped policies' code as measured.
//
// The forward policies are the fastest the sweep found on an H200 (2026-11-26, every policy of the
// product's kernel at 1, 8, 256, 4096 rows of 4096 and at 8192 x 8192; times against the best policy
// of each case, the policies before in brackets):
//  - rms_norm, 16-bit: one unit per thread up to 512 threads, then two, then four; one-barrier sum;
//    4 blocks per SM at one unit, 3 at two (min_blocks). The sweep of 2026-11-28 (H200, every policy
//    at 1, 8, 64, 256, 1024, 4096 rows of 4096 and 8192 x 8192, bfloat16), against the policy before
//    (one unit, up to 1024 threads, no occupancy asked): rows of 4096 1.544 / 1.588 / 1.696 / 2.221 /
//    4.498 / 20.650 us against 1.629 / 1.667 / 1.767 / 2.285 / 4.764 / 20.909; 8192 x 8192 68.4 against
//    86.6 us (x1.26; Inductor's was 65.4 on 2026-11-27). Not the best at 4096 rows of 4096: two units of
//    256 threads at 6 blocks ran 18.7 us there and 2-4% slower at 1-256 rows. Rows of 16384 (four
//    units of 512 threads, two of 1024 before) are not measured;
//  - rms_norm, float32 (and float64): 4 units, up to 512 threads, one-barrier sum: 1.00-1.07 (1.00-1.09);
//    below 512 rows of 2052-4096 float32 columns RmsNormFewRows (the sweep of 2026-11-28);
//  - fused_add_rms_norm, 16-bit: rms_norm's policy before 2026-11-28 (one unit, up to 1024 threads,
//    no occupancy asked): 1.00 (1.04-1.13);
//  - fused_add_rms_norm, float32: 2 units, 512 threads then up to 1024, three-barrier sum:
//    1.00-1.05 (1.02-1.25; one row 2.46 -> 1.98 us); below 2048 rows of 2052-4096 columns
//    FusedAddRmsNormFewRows (the sweep of 2026-11-28).
// Earlier, measured through opbridge bench gpu and dropped: splitting each of a few rows over a
// thread-block cluster (partial sums through distributed shared memory; one row 2.07 -> 2.30 us
// float32, 1.77 -> 2.47 bfloat16).
template <int N>
struct RmsNormRows {
  static constexpr bool k16 = N >= 8;  // 16-bit elements (8 per unit)
  static constexpr int kMaxThreads = 512, kPreferredThreads = k16 ? 512 : 256;
  static constexpr int kPreferredUnits = k16 ? 1 : 4, kMaxUnits = 4;
  static constexpr bool kFastSum = true, kStream = false, kPrefetch = false;
  // 16-bit: 4 blocks of 512 per SM at one unit (32 registers), 3 at two (40); four units ask nothing.
  // sm_86/89/120 hold 1536 threads per SM: ptxas ignores the 4 there (a warning), as before this policy
  static constexpr int min_blocks(int units) { return !k16 ? 0 : units == 1 ? 4 : units == 2 ? 3 : 0; }
};
// The form of rms_norm's policies for some rows (below): two units per thread in blocks of Threads,
// MinBlocks blocks per SM, RmsNormRows' sums.
template <int N, int Threads, int MinBlocks>
struct RmsNormTwoUnits : RmsNormRows<N> {
  static constexpr int kMaxThreads = Threads, kPreferredThreads = Threads, kPreferredUnits = 2, kMaxUnits = 2;
  static constexpr int kMinUnits = 2;  // where it applies, rows of more units than Threads
  static constexpr int min_blocks(int units) { return units == 2 ? MinBlocks : 0; }
};
// rms_norm's policy for many contiguous 16-bit rows of 257-512 units (hidden 2056-4096): two units per
// thread in blocks of 256, 6 blocks per SM (40 registers). The sweep of 2026-11-28 (H200, bfloat16 rows
// of 4096): 4096 rows 18.7 us against RmsNormRows' 20.7; 1024 rows 4.53 against 4.50, and 2-4% slower
// at 1-256 rows, hence from kMinRows on (between the two measured sizes).
template <int N>
struct RmsNormManyRows : RmsNormTwoUnits<N, 256, 6> {
  static constexpr int64_t kMinRows = 2048;
  static constexpr bool applies(int64_t rows, int64_t hv, bool contiguous) {
    return N >= 8 && contiguous && rows >= kMinRows && hv > 256 && hv <= 512;
  }
};
// rms_norm's policy for fewer than kMaxRows contiguous float32 rows of 513-1024 units (hidden 2052-4096):
// two units per thread in blocks of 512, 4 blocks per SM (32 registers), where RmsNormRows runs four units
// in blocks of 256. The sweep of 2026-11-28 (H200, float32 rows of 4096): 1 / 8 / 64 / 256 rows 1.698 /
// 1.799 / 1.936 / 2.773 us against 1.730 / 1.814 / 1.983 / 3.012 (x1.02 / 1.01 / 1.02 / 1.09), results
// within an ulp (max|diff| 2.4e-07: another order of summation); 1024 rows 6.520 against 6.456, 4096
// rows 34.0 against 33.9, hence below kMaxRows (between 256 and 1024).
template <int N>
struct RmsNormFewRows : RmsNormTwoUnits<N, 512, 4> {
  static constexpr int64_t kMaxRows = 512;
  static constexpr bool applies(int64_t rows, int64_t hv, bool contiguous) {
    return N == 4 && contiguous && rows < kMaxRows && hv > 512 && hv <= 1024;
  }
};
template <int N>
struct FusedAddRmsNormRows {
  static constexpr bool k16 = N >= 8;
  static constexpr int kMaxThreads = 1024, kPreferredThreads = k16 ? 1024 : 512;
  static constexpr int kPreferredUnits = k16 ? 1 : 2, kMaxUnits = k16 ? 2 : 4;
  static constexpr bool kFastSum = k16, kStream = false, kPrefetch = false;
  static constexpr int min_blocks(int) { return 0; }
};
// fused_add_rms_norm's policy for fewer than kMaxRows float32 rows of 513-1024 units (hidden 2052-4096):
// two units per thread in blocks of 512, one-barrier sum, a persistent grid that loads each block's next
// row during the current one's sum (kPrefetch; 3 blocks per SM at 40 registers). The sweep of 2026-11-28
// (H200, float32 rows of 4096, against FusedAddRmsNormRows): 1 / 8 / 64 / 256 / 1024 rows 1.885 / 2.050 /
// 2.272 / 3.506 / 11.262 us against 2.127 / 2.216 / 2.357 / 3.684 / 11.923 (x1.13 / 1.08 / 1.04 / 1.05 /
// 1.06), results equal; 4096 rows 70.4 against 67.7 (one wave of blocks each looping over rows loses to a
// block per row there), hence below kMaxRows, between the two measured sizes. Not the best at every size:
// at 8 rows four units of 256 threads (prefetching) ran 2.022 us, at 64 rows this policy without prefetch
// at 3 blocks per SM 2.211, at 256 and 1024 rows one unit of 1024 threads (prefetching) 3.389 and 10.514;
// one policy, within 1-7% of each, rather than four rules timed at one width. Its rows are SumRows, always
// contiguous, hence no `contiguous` in applies.
template <int N>
struct FusedAddRmsNormFewRows {
  static constexpr int kMaxThreads = 512, kPreferredThreads = 512, kPreferredUnits = 2, kMaxUnits = 2;
  static constexpr int kMinUnits = 2;  // where it applies, rows of more than 512 units
  static constexpr bool kFastSum = true, kStream = false, kPrefetch = true;
  static constexpr int64_t kMaxRows = 2048;
  static constexpr int min_blocks(int) { return 0; }
  static constexpr bool applies(int64_t rows, int64_t hv) {
    return N == 4 && rows < kMaxRows && hv > 512 && hv <= 1024;
  }
};
// Units per thread under policy P for rows of `hv` units, with blocks of at most `max_threads`
// (P::kMaxThreads unless a caller caps it lower); 0 when the row does not fit. Blocks of
// row_threads(ceil(hv / units), max_threads) then hold every unit of the row: the preferred threads
// count only up to max_threads (a staged backward built with fewer threads than its policy prefers,
// OPB_RMS_NORM_BACKWARD_STAGED_THREADS=128, would otherwise have left units of a row to no thread).
template <typename P>
int cached_units(int64_t hv, int max_threads = P::kMaxThreads) {
  const int preferred = std::min(P::kPreferredThreads, max_threads);
  for (int k = 1; k <= P::kPreferredUnits; k *= 2) {
    if (hv <= int64_t(preferred) * k) return k;
  }
  for (int k = P::kPreferredUnits; k <= P::kMaxUnits; k *= 2) {
    if (hv <= int64_t(max_threads) * k) return k;
  }
  return 0;
}

// The fewest units per thread policy P launches: P::kMinUnits where it says (a policy whose rows
// always take more than one unit, so that no kernel it never launches is compiled), else 1.
template <typename P, typename = void>
struct MinUnitsOf {
  static constexpr int value = 1;
};
template <typename P>
struct MinUnitsOf<P, std::void_t<decltype(P::kMinUnits)>> {
  static constexpr int value = P::kMinUnits;
};

// Calls go(std::integral_constant<int, K>{}) for K = units; instantiates only
// the K in {1, 2, 4, 8} from MinUnits up to MaxUnits (units below MinUnits call nothing:
// a caller refuses them first).
template <int MaxUnits, int MinUnits = 1, typename Go>
void with_units(int units, Go&& go) {
  if (units <= 1) {
    if constexpr (MinUnits <= 1) go(std::integral_constant<int, 1>{});
  } else if (units == 2 || MaxUnits < 4) {
    if constexpr (MaxUnits >= 2 && MinUnits <= 2) go(std::integral_constant<int, 2>{});
  } else if (units == 4 || MaxUnits < 8) {
    if constexpr (MaxUnits >= 4 && MinUnits <= 4) go(std::integral_constant<int, 4>{});
  } else {
    if constexpr (MaxUnits >= 8) go(std::integral_constant<int, 8>{});
  }
}

// Whether policy P asks for an occupancy at any units per thread.
template <typename P>
constexpr bool asks_occupancy() {
  return P::min_blocks(1) > 0 || P::min_blocks(2) > 0 || P::min_blocks(4) > 0 || P::min_blocks(8) > 0;
}

// Policy without its occupancy (min_blocks 0, units not held): strided rows' form. Their row offsets
// (StridedRows::offset's 64-bit division) take registers the occupancy's cap was not measured with, and
// the sweep times contiguous rows only: strided rows run as they did before any policy asked one.
template <template <int> class Policy>
struct Unoccupied {
  template <int N>
  struct Of : Policy<N> {
    static constexpr int min_blocks(int) { return 0; }
  };
};

}  // namespace cuda
}  // namespace opbridge
