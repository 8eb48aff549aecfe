// The C entry of an op's public callable (opbridge.ops.<op>): the Python fast path's work, without
// a Python frame, the dispatcher or torch's argument parser.
//
// One builtin per op (and one for out=), made by opb_entry; the callable's generated prelude
// (adapters/torch/fast.py) calls it first with the schema's arguments in order (then `out`: one tensor,
// or a tuple of one per output for an op whose returns are its outputs). It
// takes the calls the Python fast path takes: exact torch.Tensor arguments (no subclass, no
// Parameter) that do not require grad, no torch-function or dispatch mode, functorch transform or
// JIT tracer active (the fast path's _NO_MODES probes), no tensor with the negative or conjugate bit (a
// view whose memory holds the values before negation or conjugation: the kernel reads raw memory), no
// inference tensor to write outside inference mode (a mutated argument or out=: torch raises for that
// write, and so does the dispatcher's call the Python path makes), and, through RunKernel, dense tensors of a
// declared dtype on one device and a kernel that accepts the call. It runs the kernel into new
// outputs (or `out`), bumps the version counters of what it mutated and returns the schema's
// returns. A kernel that raises has its error raised here, as tvm-ffi's binding raises it (never a
// second run: opbridge/raised_error.h). Everything else returns NotImplemented having written
// nothing, and the callable goes on to the Python fast path, which gives today's results and messages.
#pragma once

#include "kernel_call.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

// Declared here: ATen/functorch/DynamicLayer.h includes a header torch does not ship (nlohmann/json).
namespace at::functorch {
struct DynamicLayer;
TORCH_API const std::vector<DynamicLayer>& getDynamicLayerStack();
}  // namespace at::functorch

namespace opbridge_native {

// The Python fast path's _NO_MODES probes (adapters/torch/fast.py), read in C++.
inline bool NoModes() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled() &&
         at::functorch::getDynamicLayerStack().empty() && !torch::jit::tracer::isTracing();
}

// torch.nn.Parameter's type, handed over once by the Python side (opb_set_parameter_type); null until then.
inline PyTypeObject*& ParameterType() {
  static PyTypeObject* type = nullptr;
  return type;
}

// *o* as a tensor the kernel may see as it is: a plain torch.Tensor (`type(o) is torch.Tensor`), or,
// but for out=, a torch.nn.Parameter (a model's weight: Parameter disables __torch_function__, so
// every op sees a plain tensor); one that requires grad only while grad mode is off (no_grad,
// inference_mode: nothing to record). Before, a Parameter weight sent an inference call through
// torch.ops: rms_norm at 8 x 64 took 2.2 us against 0.84 with a plain weight.
inline const at::Tensor* PlainTensor(PyObject* o, bool out = false) {
  PyTypeObject* type = Py_TYPE(o);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) && (out || type != ParameterType())) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return nullptr;
  if (t.requires_grad() && (out || c10::GradMode::is_enabled())) return nullptr;
  return &t;
}

// Argument *i* as the IValue the kernel call takes; false where the Python path must take it.
inline bool FromPython(const OpState& st, size_t i, PyObject* o, c10::SmallVectorImpl<c10::IValue>* args) {
  if (o == Py_None) {
    if (!st.optional[i]) return false;
    args->emplace_back();
    return true;
  }
  switch (st.kinds[i]) {
    case Kind::kTensor: {
      const at::Tensor* t = PlainTensor(o);
      if (t == nullptr) return false;
      args->emplace_back(*t);
      return true;
    }
    case Kind::kFloat:
      if (!PyFloat_Check(o)) return false;  // a subclass too (numpy.float64), as the other C entries take it
      args->emplace_back(PyFloat_AS_DOUBLE(o));
      return true;
    case Kind::kInt: {
      if (!PyLong_CheckExact(o)) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0) return false;
      args->emplace_back(static_cast<int64_t>(v));
      return true;
    }
    case Kind::kBool:
      if (!PyBool_Check(o)) return false;
      args->emplace_back(o == Py_True);
      return true;
  }
  return false;
}

// Whether torch lets an op write *t* in place: not an inference tensor, or inside inference mode (outside
// it torch raises "Inplace update to inference tensor outside InferenceMode", which the Python path's
// dispatcher call gives; the Python fast path's _writable guard, adapters/torch/fast.py).
inline bool Writable(const at::Tensor& t) { return !t.is_inference() || c10::InferenceMode::is_enabled(); }

// torch's error for a write to an inference tensor outside inference mode, naming the op and argument (the
// Python kernels' message: adapters/torch/calls.py, check_inference_writes).
[[noreturn, gnu::cold, gnu::noinline]] inline void ThrowInferenceWrite(const OpState& st, int m) {
  const std::string& qualname = st.op.schema().name();
  const size_t colons = qualname.rfind("::");
  TORCH_CHECK(false, colons == std::string::npos ? qualname : qualname.substr(colons + 2), ": argument '",
              st.op.schema().arguments()[m].name(), "': ",
              "Inplace update to inference tensor outside InferenceMode is not allowed."
              "You can make a clone to get a normal tensor before doing inplace update."
              "See https://github.com/pytorch/rfcs/pull/17 for more details.");
}

// The device kernel's check, before anything is written: torch's own in-place ops raise the same error
// (theirs from ADInplaceOrView, after the write), which a custom op's fallthrough there never raises,
// and an inference tensor has no Autograd key to reach the autograd kernel's version bump.
inline void CheckWritable(const OpState& st, const c10::IValue* args) {
  for (int m : st.mutated) {
    if (args[m].isTensor() && !Writable(args[m].toTensor())) ThrowInferenceWrite(st, m);
  }
}

// torch.autograd.graph.increment_version (the Python fast path's): inference tensors have no counter.
inline void Bump(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

inline PyObject* NotHandled() { Py_RETURN_NOTIMPLEMENTED; }

inline PyObject* Call(OpState& st, PyObject* const* pyargs, Py_ssize_t nargs, bool with_out) {
  const size_t n = st.kinds.size();
  if (static_cast<size_t>(nargs) != n + (with_out ? 1 : 0) || !NoModes()) return NotHandled();
  c10::SmallVector<c10::IValue, 8> args;
  for (size_t i = 0; i < n; ++i) {
    if (!FromPython(st, i, pyargs[i], &args)) return NotHandled();
  }
  for (int m : st.mutated) {
    if (args[m].isTensor() && !Writable(args[m].toTensor())) return NotHandled();
  }
  c10::SmallVector<at::Tensor, 4> outs;
  if (with_out) {  // one tensor, or a tuple of one per output (an op whose returns are its outputs)
    PyObject* given = pyargs[n];
    const bool many = st.n_outputs > 1;
    if (many && !(PyTuple_CheckExact(given) && PyTuple_GET_SIZE(given) == st.n_outputs)) return NotHandled();
    for (int k = 0; k < st.n_outputs; ++k) {
      const at::Tensor* out = PlainTensor(many ? PyTuple_GET_ITEM(given, k) : given, /*out=*/true);
      if (out == nullptr || !Writable(*out)) return NotHandled();
      outs.push_back(*out);
    }
  }
  try {
    bool raised = false;
    if (!RunKernel(st, args.data(), &outs, !with_out, &raised)) {
      return raised ? opbridge::set_python_error(opbridge::take_raised_error()) : NotHandled();
    }
  } catch (py::error_already_set& e) {  // the shape rule's error: raised as the Python fast path raises it
    if (e.matches(PyExc_TypeError)) return NotHandled();  // which sends a TypeError to the dispatcher
    e.restore();
    return nullptr;
  } catch (const std::exception&) {  // e.g. the allocator's: the Python path raises its own
    return NotHandled();
  }
  for (int m : st.mutated) {  // what the dispatcher's ADInplaceOrView kernel would do
    if (args[m].isTensor()) Bump(args[m].toTensor());
  }
  st.entry_calls.fetch_add(1, std::memory_order_relaxed);
  if (with_out) {
    for (const at::Tensor& o : outs) Bump(o);
    return Py_NewRef(pyargs[n]);
  }
  size_t next = 0;
  auto result = [&](int r) { return r < 0 ? THPVariable_Wrap(std::move(outs[next++])) : Py_NewRef(pyargs[r]); };
  const size_t n_returns = st.returns.size();
  if (n_returns == 0) Py_RETURN_NONE;
  if (n_returns == 1) return result(st.returns[0]);
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(n_returns));
  if (tuple == nullptr) return nullptr;
  for (size_t k = 0; k < n_returns; ++k) {
    PyObject* v = result(st.returns[k]);
    if (v == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(k), v);
  }
  return tuple;
}

// `self` is a capsule holding the op's state (kept for the life of the process by shim.cc).
inline PyObject* Entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return Call(*static_cast<OpState*>(PyCapsule_GetPointer(self, nullptr)), args, nargs, false);
}

inline PyObject* EntryOut(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return Call(*static_cast<OpState*>(PyCapsule_GetPointer(self, nullptr)), args, nargs, true);
}

inline PyMethodDef entry_def = {
    "opbridge_native_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Entry)), METH_FASTCALL,
    "The op on its schema's arguments in order; NotImplemented where the Python path must take the call."};
inline PyMethodDef entry_out_def = {
    "opbridge_native_entry_out", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(EntryOut)),
    METH_FASTCALL, "The op on its schema's arguments in order, then out=; NotImplemented as for the entry."};

// A new builtin calling the op of *st* (with *with_out*, the out= one).
inline PyObject* MakeEntry(OpState* st, bool with_out) {
  PyObject* capsule = PyCapsule_New(st, nullptr, nullptr);
  if (capsule == nullptr) return nullptr;
  PyObject* fn = PyCFunction_NewEx(with_out ? &entry_out_def : &entry_def, capsule, nullptr);
  Py_DECREF(capsule);
  return fn;
}

}  // namespace opbridge_native
