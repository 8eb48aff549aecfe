// The per-op state shared by the native kernels of one op (see shim.cc).
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/accumulate.h>
#include <c10/core/GradMode.h>
#include <dlpack/dlpack.h>
#include <opbridge/host_buffers.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace opbridge_native {

enum class Kind { kTensor, kInt, kFloat, kBool };
enum Device { kCPU = 0, kCUDA = 1, kNumDevices = 2 };

struct OutSpec {
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
};

struct OpState {
  explicit OpState(c10::OperatorHandle handle) : op(std::move(handle)) {}
  c10::OperatorHandle op;
  std::vector<Kind> kinds;           // per schema argument
  std::vector<bool> kwarg_only;      // per schema argument
  std::vector<bool> optional;        // per schema argument: whether it may be None
  std::vector<int> mutated;          // indices of Tensor(a!) arguments
  std::vector<int> returns;          // per return: -1 for a new output, else the aliased argument
  int dispatch_arg = 0;
  int dtype_arg = 0;
  uint64_t dtypes = 0;               // bit per c10::ScalarType
  std::vector<int> like;             // per output: the argument it copies; empty with a shape rule
  int n_outputs = 0;
  int64_t fresh_min = 0;             // new CPU outputs of at least this many bytes get fresh(); 0: none
  std::atomic<TVMFFIObjectHandle> kernel[kNumDevices] = {nullptr, nullptr};  // set once loaded
  py::object impl[kNumDevices];      // the Python device kernels (fallback)
  py::object autograd;               // the Python autograd kernel
  bool autograd_keyset = false;      // whether it takes the DispatchKeySet first
  py::object rule;                   // args -> list of meta tensors (the shape rule)
  py::object fresh;                  // huge-page advice for a new CPU output
  std::mutex rule_mutex;
  std::vector<bool> rows;            // per schema argument: the op declares it row_strided
  std::map<std::vector<int64_t>, std::vector<OutSpec>> rule_cache;
  std::atomic<int64_t> native_calls{0};  // calls the dispatcher's device kernel completed itself
  std::atomic<int64_t> entry_calls{0};   // calls the public callable's C entry completed itself
};

constexpr size_t kRuleCacheSize = 256;

}  // namespace opbridge_native
