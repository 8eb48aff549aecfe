// tests/test_cuda_host_caches.py: cuda.h's ResidentCache keeps each (device, threads, shared memory) answer
// apart. Host code, compiled by nvcc, run without a GPU: the `ask` callbacks stand in for the occupancy API.
#include <opbridge/cuda.h>
#include <cstdio>
namespace cu = opbridge::cuda;
static int asked = 0, failed = 0;
static cu::ResidentCache cache = {};  // as the launchers hold it: a static, zero-initialised
static void expect(int line, int device, int threads, long long smem, int answer, int want, int want_asked) {
  const int got = cache.get(device, threads, smem, [&] { ++asked; return answer; });
  if (got != want || asked != want_asked) {
    std::printf("line %d: got %d asked %d, want %d asked %d\n", line, got, asked, want, want_asked);
    ++failed;
  }
}
#define EXPECT(...) expect(__LINE__, __VA_ARGS__)
int main() {
  static_assert(sizeof(cu::ResidentCache) == 32, "four words per instantiation");
  EXPECT(0, 256, 0, 8, 8, 1);     // device 0 (say an H100): asked once
  EXPECT(1, 256, 0, 3, 3, 2);     // device 1, another model: its own answer, not device 0's
  EXPECT(0, 256, 0, 99, 8, 2);    // both kept
  EXPECT(1, 256, 0, 99, 3, 2);
  EXPECT(0, 512, 0, 4, 4, 3);     // another block size
  EXPECT(0, 256, 49152, 0, 0, 4); // shared memory is part of the key; 0 (does not fit) is an answer
  EXPECT(0, 256, 49152, 7, 0, 4);
  EXPECT(0, 256, 0, 99, 8, 4);
  EXPECT(2, 1024, 1 << 20, 70, 63, 5);  // a fifth key replaces one slot; answers clamp to 0-63
  EXPECT(2, 1024, 1 << 20, 1, 63, 5);
  int missed = 0;  // of the first four keys, three are still cached (the replaced one is asked again)
  for (const int d : {0, 1}) cache.get(d, 256, 0, [&] { return ++missed; });
  cache.get(0, 512, 0, [&] { return ++missed; });
  cache.get(0, 256, 49152, [&] { return ++missed; });
  if (missed != 1) std::printf("%d of the first four keys asked again, want 1\n", missed), ++failed;
  asked = 0;  // keys it cannot pack are asked every time, never confused with another
  EXPECT(-1, 256, 0, 5, 5, 1);
  EXPECT(-1, 256, 0, 6, 6, 2);
  EXPECT(1 << 25, 256, 0, 9, 9, 3);
  EXPECT(0, 2048, 0, 2, 2, 4);
  EXPECT(0, 256, 1 << 21, 1, 1, 5);
  std::printf(failed ? "failed\n" : "ok\n");
  return failed != 0;
}
