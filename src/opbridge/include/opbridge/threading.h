// Which threads run the chunks of a parallel CPU kernel; see parallel_for in
// parallel.h for the two policies and their measured trade-off. Kept free of
// tvm-ffi includes: the generated exports translation unit includes it to
// publish the policy to the Python loader.
#pragma once

#include <cstdlib>
#include <cstring>

namespace opbridge {

enum class Threading : int { kPool = 0, kOpenMP = 1 };

// OPBRIDGE_THREADING, read once per module: "pool" selects the caller-runs
// pool, anything else the OpenMP team (the Python loader rejects values other
// than "omp" and "pool" before it loads a module).
inline Threading threading() {
  static const Threading mode = [] {
    const char* e = std::getenv("OPBRIDGE_THREADING");
    return (e != nullptr && std::strcmp(e, "pool") == 0) ? Threading::kPool : Threading::kOpenMP;
  }();
  return mode;
}

}  // namespace opbridge
