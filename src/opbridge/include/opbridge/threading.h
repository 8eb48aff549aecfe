// Which threads run the chunks of a parallel CPU kernel; see parallel_for in
// math.h for the two policies and their measured trade-off. Kept free of
// tvm-ffi includes: the generated exports translation unit includes it to
// publish the setter the Python loader calls.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace opbridge {

enum class Threading : int { kPool = 0, kOpenMP = 1 };

namespace detail {

// -1: not chosen yet. One instance per module (inline-function static).
inline std::atomic<int>& threading_state() {
  static std::atomic<int> state{-1};
  return state;
}

// OPBRIDGE_THREADING, if set to a valid value, read once: it beats the setter.
inline int threading_from_env() {
  static const int value = [] {
    const char* e = std::getenv("OPBRIDGE_THREADING");
    if (e == nullptr) return -1;
    if (std::strcmp(e, "omp") == 0) return int(Threading::kOpenMP);
    if (std::strcmp(e, "pool") == 0) return int(Threading::kPool);
    return -1;  // the Python loader rejects other values before loading
  }();
  return value;
}

}  // namespace detail

// Set by the loader when the module is loaded (OpenMP in a process that has
// imported torch, the pool elsewhere); ignored when OPBRIDGE_THREADING is set.
inline void set_threading(Threading t) {
  if (detail::threading_from_env() < 0) detail::threading_state().store(int(t), std::memory_order_relaxed);
}

// The policy in force: OPBRIDGE_THREADING, else what the loader set, else the
// pool (a module loaded without opbridge's loader, e.g. by tvm_ffi directly).
inline Threading threading() {
  const int env = detail::threading_from_env();
  if (env >= 0) return Threading(env);
  const int s = detail::threading_state().load(std::memory_order_relaxed);
  return s < 0 ? Threading::kPool : Threading(s);
}

}  // namespace opbridge
