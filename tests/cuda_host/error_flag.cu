// tests/test_cuda_host_caches.py: cuda_error_flag.h's ErrorFlag keeps one record per device, so two devices'
// kernels reporting in one epoch leave two whole records, each taken once. Host code, compiled by nvcc, run
// without a GPU: the three CUDA calls ErrorFlag makes get host stand-ins, and report() does on the host what
// the device's report_error does.
#include <opbridge/cuda.h>
#include <cstdio>
#include <cstdlib>
// host stand-ins for the CUDA calls ErrorFlag makes (no GPU here): a claim word per (symbol, device)
static int g_dev = 0;
static unsigned long long g_claims[128];
static cudaError_t fake_sym(void** p, const void*) { *p = &g_claims[g_dev]; return cudaSuccess; }
static cudaError_t fake_alloc(void** p, size_t n, unsigned) { *p = std::malloc(n); return cudaSuccess; }
static cudaError_t fake_mapped(void** m, void* p, unsigned) { *m = p; return cudaSuccess; }
#define cudaGetSymbolAddress fake_sym
#define cudaHostAlloc fake_alloc
#define cudaHostGetDevicePointer fake_mapped
#include <opbridge/cuda_error_flag.h>
namespace cu = opbridge::cuda;
static int failed = 0;
#define CHECK(c) do { if (!(c)) { std::printf("line %d: %s\n", __LINE__, #c); ++failed; } } while (0)
// what report_error does, on the host
static void report(const cu::ErrorSink& s, int code, long long index) {
  const unsigned long long epoch = s.record->epoch;
  if (*s.claim < epoch) { *s.claim = epoch; s.record->index = index; s.record->code = code; }
}
int main() {
  cu::ErrorFlag flag;
  cu::ErrorRecord r{};
  CHECK(!flag.take(&r));
  g_dev = 0; const cu::ErrorSink s0 = flag.sink("op", 0, nullptr);
  g_dev = 1; const cu::ErrorSink s1 = flag.sink("op", 1, nullptr);
  g_dev = 70; const cu::ErrorSink s70 = flag.sink("op", 70, nullptr);  // beyond kMaxDevices
  CHECK(s0.record != s1.record && s0.claim != s1.claim && s70.record != s0.record && s70.record != s1.record);
  g_dev = 0; CHECK(flag.sink("op", 0, nullptr).record == s0.record);
  g_dev = 70; CHECK(flag.sink("op", 70, nullptr).record == s70.record);
  CHECK(!flag.take(&r));
  report(s0, 3, 10); report(s1, 4, 20); report(s0, 5, 11);  // both devices in one epoch: two whole records
  cu::ErrorRecord a{}, b{};
  CHECK(flag.take(&a) && flag.take(&b) && !flag.take(&r));
  CHECK((a.code == 3 && a.index == 10 && b.code == 4 && b.index == 20) ||
        (b.code == 3 && b.index == 10 && a.code == 4 && a.index == 20));
  CHECK(s0.record->epoch == 2 && s1.record->epoch == 2 && s70.record->epoch == 1);
  report(s0, 6, 12); report(s70, 7, 70);
  CHECK(!flag.take(&r, 1));                         // device 1 recorded nothing
  CHECK(flag.take(&r, 70) && r.code == 7 && r.index == 70);
  CHECK(flag.take(&r, 0) && r.code == 6 && r.index == 12 && !flag.take(&r));
  std::printf(failed ? "failed\n" : "ok\n");
  return failed != 0;
}
