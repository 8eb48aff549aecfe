// STREAM kernels for `opbridge bench kernels` (built by opbridge/bench/stream.py).
// Static schedule everywhere but the *_chunked ceilings (split as the kernels
// split their work, see below), so every STREAM kernel touches the pages its
// thread first touched in stream_fill_cpu.
#include <opbridge/opbridge.h>
#include <opbridge/parallel.h>

#include <omp.h>

namespace {

using opbridge::TensorView;

float* f32(const char* op, const TensorView& t, int64_t n) {
  OPB_CHECK_DEVICE(op, t, kDLCPU);
  ::opbridge::check_dtype(op, "array", t, {::opbridge::kFloat32});
  OPB_CHECK_CONTIGUOUS(op, t);
  OPB_CHECK(t.numel() == n, ValueError) << op << ": arrays must have " << n << " elements, got "
                                        << t.numel();
  return opbridge::data_ptr<float>(t);
}

int team(int64_t threads) { return threads > 0 ? int(threads) : omp_get_max_threads(); }

}  // namespace

void stream_fill_cpu(TensorView a, double value, int64_t threads) {
  const int64_t n = a.numel();
  float* x = f32("stream_fill", a, n);
  const float v = float(value);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) x[i] = v;
}
OPBRIDGE_EXPORT(stream_fill_cpu);

void stream_copy_cpu(TensorView c, TensorView a, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict z = f32("stream_copy", c, n);
  const float* __restrict x = f32("stream_copy", a, n);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) z[i] = x[i];
}
OPBRIDGE_EXPORT(stream_copy_cpu);

// The copy as opbridge's kernels split their work (parallel_for: threads x
// kChunksPerThread chunks claimed as threads arrive, OPBRIDGE_THREADING's
// team or pool), not McCalpin's static halves: the ceiling that `bench
// kernels` times beside each case. On a busy machine a static half waits
// for its descheduled thread, so the STREAM copy would fall behind kernels
// that merely moved the same bytes.
void stream_copy_chunked_cpu(TensorView c, TensorView a, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict z = f32("stream_copy_chunked", c, n);
  const float* __restrict x = f32("stream_copy_chunked", a, n);
  opbridge::parallel_chunks(n, team(threads), [&](int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) z[i] = x[i];
  });
}
OPBRIDGE_EXPORT(stream_copy_chunked_cpu);

// a[i] = s * a[i], split as stream_copy_chunked: the ceiling of an op that
// updates its arguments in place (fused_add_rms_norm, rotary_embedding). It
// moves what a copy of half as many elements per array would (each value
// read and written once), over half the copy's footprint and without the
// copy's write-allocate traffic, as such an op does; beside a copy, a case
// whose footprint fits in L3 while the copy's does not would look faster
// than its ceiling. Call it with s = 1 to leave the values as they are.
void stream_update_chunked_cpu(TensorView a, double s, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict x = f32("stream_update_chunked", a, n);
  const float k = float(s);
  opbridge::parallel_chunks(n, team(threads), [&](int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) x[i] = k * x[i];
  });
}
OPBRIDGE_EXPORT(stream_update_chunked_cpu);

void stream_scale_cpu(TensorView b, TensorView c, double s, int64_t threads) {
  const int64_t n = c.numel();
  float* __restrict y = f32("stream_scale", b, n);
  const float* __restrict z = f32("stream_scale", c, n);
  const float k = float(s);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) y[i] = k * z[i];
}
OPBRIDGE_EXPORT(stream_scale_cpu);

void stream_add_cpu(TensorView c, TensorView a, TensorView b, int64_t threads) {
  const int64_t n = a.numel();
  float* __restrict z = f32("stream_add", c, n);
  const float* __restrict x = f32("stream_add", a, n);
  const float* __restrict y = f32("stream_add", b, n);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
}
OPBRIDGE_EXPORT(stream_add_cpu);

void stream_triad_cpu(TensorView a, TensorView b, TensorView c, double s, int64_t threads) {
  const int64_t n = b.numel();
  float* __restrict x = f32("stream_triad", a, n);
  const float* __restrict y = f32("stream_triad", b, n);
  const float* __restrict z = f32("stream_triad", c, n);
  const float k = float(s);
#pragma omp parallel for simd schedule(static) num_threads(team(threads))
  for (int64_t i = 0; i < n; ++i) x[i] = y[i] + k * z[i];
}
OPBRIDGE_EXPORT(stream_triad_cpu);

double stream_sum_cpu(TensorView a, int64_t threads) {
  const int64_t n = a.numel();
  const float* __restrict x = f32("stream_sum", a, n);
  double total = 0.0;
#pragma omp parallel for simd schedule(static) num_threads(team(threads)) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += x[i];
  return total;
}
OPBRIDGE_EXPORT(stream_sum_cpu);
