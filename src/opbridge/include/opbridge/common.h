// opbridge kernel headers, common part: tvm-ffi's types, where the runtime
// is compiled (OPB_RT_), host/device function qualifiers, the threading grain.
// A section of opbridge/opbridge.h, which kernels include.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include "opbridge/export_list.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// The messages of the argument checks, the error stream behind OPB_THROW and
// OPBRIDGE_EXPORT's typed-call helpers are declared with OPB_RT_ and defined in
// opbridge/runtime_impl.h. A module built by opbridge defines
// OPB_SEPARATE_RUNTIME and compiles them once (build/templates/runtime.cc);
// compiled any other way (a bare tvm_ffi.cpp.build, nvcc) they are inline here.
#if defined(OPB_SEPARATE_RUNTIME) && !defined(__CUDACC__)
#define OPB_RT_
#else
#define OPB_RT_ inline
#endif

// Functions that CPU (.cc) and CUDA (.cu) kernels share, e.g. the per-element
// math in the op headers.
#if defined(__CUDACC__)
#define OPB_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define OPB_HOST_DEVICE inline __attribute__((always_inline))
#else
#define OPB_HOST_DEVICE inline
#endif

namespace opbridge {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

// ---------------------------------------------------------------------------
// threading policy
// ---------------------------------------------------------------------------

// Below this many elements a kernel runs on the calling thread: waking an
// OpenMP team costs microseconds and, beside a competing process, a parked
// worker can cost milliseconds. Above it the work is split across threads.
constexpr int64_t kParallelGrain = 1 << 16;

}  // namespace opbridge
