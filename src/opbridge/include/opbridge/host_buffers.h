// The interface of opbridge's pool of large CPU output buffers, as the libraries that use it see
// it: the pool itself (host_buffers_impl.h, compiled into every opbridge module) and torch's
// native shim (adapters/torch/native/kernel_call.h), which are compiled separately and meet only
// through tvm-ffi's global registry. One definition here keeps the two sides of that ABI equal.
#pragma once

#include <cstddef>
#include <cstdint>

namespace opbridge {
namespace host_buffers {

// The prefix of the pool's tvm-ffi globals, and the one the shim looks up.
#define OPB_HOST_BUFFERS_GLOBAL(name) "opbridge.host_buffers.v1." name
constexpr char kApiGlobal[] = OPB_HOST_BUFFERS_GLOBAL("api");

// Outputs of at least this many bytes come from the pool (opbridge.call.memory.MIN_BYTES).
constexpr int64_t kMinBytes = int64_t{4} << 20;

// What the `api` global returns the address of: the pool without Python or a tvm-ffi object per
// buffer.
struct Api {
  int64_t version;                          // 1
  void* (*alloc)(size_t nbytes);            // nullptr when out of memory
  void (*release)(void* p, size_t nbytes);  // nbytes as given to alloc
};

}  // namespace host_buffers
}  // namespace opbridge
