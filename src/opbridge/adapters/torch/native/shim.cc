// Native dispatcher kernels for opbridge ops: one shim per torch version, shared by every op.
//
// For each op the Python side (native/__init__.py) registers, through opb_register:
//   * a device kernel (CPU, and CUDA when built with OPB_WITH_CUDA) on the op's backend keys, and
//   * an autograd kernel, on the Autograd alias key.
// When the op's Python kernels were registered first (before the shim existed), these go over
// them: the dispatcher keeps the earlier kernels listed beneath (so one running now stays alive),
// and its "overriding a previously registered kernel" warning is silenced for these registrations.
//
// The native routine (RunKernel, kernel_call.h) handles what the Python kernel
// (adapters/torch/dispatcher.py, make_impl) does for dense tensors of a declared dtype on one
// device: outputs are new contiguous tensors (at::empty) from the `like` rule or from the op's
// shape rule (asked once per argument signature, then remembered), the compiled tvm-ffi kernel is
// called in destination-passing style on DLTensor views, and outputs and aliased arguments are
// packed onto the schema's returns.
// Anything else (a strided tensor, an undeclared dtype, mixed devices, overlapping mutated
// arguments, a kernel not loaded yet) is handed to the Python kernel, which gives today's results
// and messages. A kernel error is raised as it is, never by a second run of the kernel
// (opbridge/raised_error.h).
//
// The autograd kernel hands a call to the Python autograd kernel only when grad mode is on and a
// tensor argument requires grad; otherwise it redispatches below autograd (to the device kernel, to
// a mode's or subclass's handler, or to a kernel someone registered over ours) and bumps the version
// counter of mutated arguments as ADInplaceOrView would.
//
// The same kernel call (kernel_call.h) also backs the public callable's C entry (python_entry.h),
// which opbridge.ops.<op> calls before its Python fast path.
#include "kernel_call.h"
#include "op_state.h"
#include "python_calls.h"
#include "python_entry.h"

#include <torch/library.h>

namespace {

using namespace opbridge_native;

// Kept for the life of the process: the dispatcher holds raw pointers to registered kernels.
std::vector<std::shared_ptr<OpState>>* states = new std::vector<std::shared_ptr<OpState>>();
std::vector<std::unique_ptr<torch::Library>>* libraries = new std::vector<std::unique_ptr<torch::Library>>();

bool ScalarTypeOf(const std::string& name, c10::ScalarType* out) {
  static const std::pair<const char*, c10::ScalarType> names[] = {
      {"float32", c10::ScalarType::Float}, {"float64", c10::ScalarType::Double},
      {"float16", c10::ScalarType::Half},  {"bfloat16", c10::ScalarType::BFloat16},
      {"int64", c10::ScalarType::Long},    {"int32", c10::ScalarType::Int},
      {"int16", c10::ScalarType::Short},   {"int8", c10::ScalarType::Char},
      {"uint8", c10::ScalarType::Byte},    {"bool", c10::ScalarType::Bool}};
  for (const auto& [n, t] : names) {
    if (name == n) {
      *out = t;
      return true;
    }
  }
  return false;
}

// Raises a kernel's error as the c10 error torch turns into the same Python exception class
// (ValueError, TypeError, IndexError, NotImplementedError; RuntimeError for the rest).
[[noreturn, gnu::cold, gnu::noinline]] void ThrowKernelError(const opbridge::RaisedError& e) {
  if (e.kind == "ValueError") TORCH_CHECK_VALUE(false, e.message);
  if (e.kind == "TypeError") TORCH_CHECK_TYPE(false, e.message);
  if (e.kind == "IndexError") TORCH_CHECK_INDEX(false, e.message);
  if (e.kind == "NotImplementedError") TORCH_CHECK_NOT_IMPLEMENTED(false, e.message);
  TORCH_CHECK(false, e.message);
}

// The op on dense arguments of a declared dtype on one device: true when done (results pushed),
// false when the Python kernel must take the call (the stack is then untouched). A kernel that
// raises has its error thrown here, never a second run (opbridge/raised_error.h).
bool RunNative(OpState& st, torch::jit::Stack* stack) {
  const size_t n = st.kinds.size();
  const c10::IValue* args = &*(stack->end() - n);
  c10::SmallVector<at::Tensor, 4> outs;
  bool raised = false;
  if (!RunKernel(st, args, &outs, true, &raised)) {
    if (raised) ThrowKernelError(opbridge::take_raised_error());
    return false;
  }
  c10::SmallVector<c10::IValue, 4> returned;
  size_t next = 0;
  for (int r : st.returns) returned.push_back(r < 0 ? c10::IValue(std::move(outs[next++])) : args[r]);
  torch::jit::drop(*stack, n);
  for (auto& v : returned) stack->push_back(std::move(v));
  st.native_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

class DeviceKernel : public c10::OperatorKernel {
 public:
  DeviceKernel(std::shared_ptr<OpState> st, int dev) : st_(std::move(st)), dev_(dev) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    if (!st_->mutated.empty()) CheckWritable(*st_, &*(stack->end() - st_->kinds.size()));
    if (!RunNative(*st_, stack)) CallPython(*st_, st_->impl[dev_], nullptr, stack);
  }

 private:
  std::shared_ptr<OpState> st_;
  int dev_;
};

class AutogradKernel : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(std::shared_ptr<OpState> st) : st_(std::move(st)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    OpState& st = *st_;
    const size_t n = st.kinds.size();
    const c10::IValue* args = &*(stack->end() - n);
    if (c10::GradMode::is_enabled()) {
      for (size_t i = 0; i < n; ++i) {
        if (args[i].isTensor() && args[i].toTensor().requires_grad()) {
          CallPython(st, st.autograd, st.autograd_keyset ? &ks : nullptr, stack);
          return;
        }
      }
    }
    std::vector<at::Tensor> mutated;
    for (int m : st.mutated) {
      if (args[m].isTensor()) mutated.push_back(args[m].toTensor());
    }
    {
      at::AutoDispatchBelowAutograd guard;
      op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
    }
    for (const at::Tensor& t : mutated) torch::autograd::impl::bump_version(t);
  }

 private:
  std::shared_ptr<OpState> st_;
};

class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

template <typename K>
torch::CppFunction Boxed(std::unique_ptr<K> kernel) {
  return torch::CppFunction::makeFromBoxedFunctor(std::move(kernel));
}

template <typename T>
T Item(const py::dict& spec, const char* key) {
  return spec[key].cast<T>();
}

PyObject* Register(PyObject* spec_obj) {
  py::dict spec = py::reinterpret_borrow<py::dict>(spec_obj);
  const auto name = Item<std::string>(spec, "qualname");
  auto st = std::make_shared<OpState>(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), ""));
  const c10::FunctionSchema& schema = st->op.schema();
  std::map<c10::Symbol, int> alias_of;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::Argument& a = schema.arguments()[i];
    c10::TypePtr t = a.type();
    if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
    Kind kind;
    if (t->kind() == c10::TypeKind::TensorType) kind = Kind::kTensor;
    else if (t->kind() == c10::TypeKind::IntType || t->kind() == c10::TypeKind::SymIntType) kind = Kind::kInt;
    else if (t->kind() == c10::TypeKind::FloatType) kind = Kind::kFloat;
    else if (t->kind() == c10::TypeKind::BoolType) kind = Kind::kBool;
    else throw py::type_error(name + ": argument '" + a.name() + "' has a type the native kernel does not take");
    st->kinds.push_back(kind);
    st->kwarg_only.push_back(a.kwarg_only());
    st->optional.push_back(a.type()->kind() == c10::TypeKind::OptionalType);
    if (a.alias_info()) {
      if (a.alias_info()->isWrite()) st->mutated.push_back(static_cast<int>(i));
      for (const auto& set : a.alias_info()->beforeSets()) alias_of[set] = static_cast<int>(i);
    }
  }
  for (const c10::Argument& r : schema.returns()) {
    int aliased = -1;
    if (r.alias_info()) {
      for (const auto& set : r.alias_info()->beforeSets()) aliased = alias_of.at(set);
    }
    st->returns.push_back(aliased);
  }
  st->dispatch_arg = Item<int>(spec, "dispatch_arg");
  st->dtype_arg = Item<int>(spec, "dtype_arg");
  st->rows.assign(st->kinds.size(), false);
  for (int i : Item<std::vector<int>>(spec, "row_strided")) {
    if (i >= 0 && static_cast<size_t>(i) < st->rows.size()) st->rows[i] = true;
  }
  for (const auto& d : Item<std::vector<std::string>>(spec, "dtypes")) {
    c10::ScalarType t;
    if (ScalarTypeOf(d, &t)) st->dtypes |= uint64_t{1} << static_cast<int>(t);
  }
  st->n_outputs = Item<int>(spec, "n_outputs");
  if (!spec["like"].is_none()) st->like = Item<std::vector<int>>(spec, "like");
  st->rule = spec["rule"];
  st->fresh = spec["fresh"];
  st->fresh_min = Item<int64_t>(spec, "fresh_min");
  st->autograd = spec["autograd"];
  st->autograd_keyset = Item<bool>(spec, "autograd_keyset");
  const auto devices = Item<std::vector<std::string>>(spec, "devices");
  py::dict impls = spec["impl"];

  const auto colon = name.find("::");
  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, name.substr(0, colon), std::nullopt,
                                              __FILE__, __LINE__);
  const std::string op_name = name.substr(colon + 2);
  SilentWarnings silent;  // registering over the op's Python kernels is what we mean to do
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  for (const auto& d : devices) {
    const int dev = d == "cuda" ? kCUDA : kCPU;
    st->impl[dev] = impls[py::str(d)];
    const auto key = dev == kCUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
    lib->impl(op_name.c_str(), torch::dispatch(key, Boxed(std::make_unique<DeviceKernel>(st, dev))));
  }
  lib->impl(op_name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, Boxed(std::make_unique<AutogradKernel>(st))));
  libraries->push_back(std::move(lib));
  states->push_back(st);
  return PyLong_FromVoidPtr(st.get());
}

}  // namespace

extern "C" {

// Register native kernels for one op from a dict (see native/__init__.py); returns its handle.
__attribute__((visibility("default"))) PyObject* opb_register(PyObject* spec) {
  try {
    return Register(spec);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// Hand the op's compiled kernel for a device (0: CPU, 1: CUDA) to its native kernels. A kernel it
// replaces (two threads' first calls can each load one) is kept, never released: a call on another
// thread may have read it and still be calling it, since RunKernel holds no reference of its own.
__attribute__((visibility("default"))) void opb_set_kernel(void* handle, int device, void* kernel) {
  auto* st = static_cast<OpState*>(handle);
  if (kernel != nullptr) TVMFFIObjectIncRef(kernel);
  st->kernel[device].exchange(kernel, std::memory_order_acq_rel);  // the old one stays alive (above)
}

// How many calls of the op the native routine completed.
__attribute__((visibility("default"))) int64_t opb_native_calls(void* handle) {
  return static_cast<OpState*>(handle)->native_calls.load(std::memory_order_relaxed);
}

// How many calls of the op the public callable's C entry completed.
__attribute__((visibility("default"))) int64_t opb_entry_calls(void* handle) {
  return static_cast<OpState*>(handle)->entry_calls.load(std::memory_order_relaxed);
}

// The op's C entry for its public callable (see python_entry.h); with *with_out*, the out= one.
__attribute__((visibility("default"))) PyObject* opb_entry(void* handle, int with_out) {
  return MakeEntry(static_cast<OpState*>(handle), with_out != 0);
}

// A new contiguous CPU tensor of *shape* (a tuple) and *dtype* (a torch.dtype) on a buffer of opbridge's
// pool, with a resizable storage; None where the pool is not there.
__attribute__((visibility("default"))) PyObject* opb_pool_empty(PyObject* shape, PyObject* dtype) {
  try {
    const HostApi* api = GetHostApi();
    if (!api) Py_RETURN_NONE;
    const auto sizes = py::cast<std::vector<int64_t>>(py::handle(shape));
    const auto dt = py::cast<at::ScalarType>(py::handle(dtype));
    return py::cast(PoolEmpty(api, sizes, dt)).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// torch.nn.Parameter's type, which the C entries then take beside a plain dispatching tensor
// (python_entry.h's PlainTensor); kept for the life of the process.
__attribute__((visibility("default"))) void opb_set_parameter_type(PyObject* type) {
  if (ParameterType() == nullptr && PyType_Check(type)) {
    Py_INCREF(type);
    ParameterType() = reinterpret_cast<PyTypeObject*>(type);
  }
}

// Whether this shim runs CUDA kernels.
__attribute__((visibility("default"))) int opb_has_cuda() {
#ifdef OPB_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
