// NumPy's C entry: an op's public callable on plain ndarrays without a Python frame or DLPack.
//
// One builtin per op (opb_np_entry), which the NumPy fast path (adapters/numpy/__init__.py) calls
// first with the schema's arguments in order. It takes what that Python fast path takes, checked
// the same way in C: exact numpy.ndarray tensors (or None for an optional one), C-contiguous,
// aligned and writeable, the dispatching array's dtype among the op's declared ones, no argument
// the op writes overlapping another tensor; Python float, int and bool scalars. Ops that write
// their arguments (vLLM's in-place ops) run here too, returning None or the arguments they wrote,
// as their schema says. It allocates each output like its input (PyArray_NewLikeArray: contiguous), below the pool's
// threshold only (larger outputs come from opbridge's pool on the Python path), views every array
// as a DLTensor on the stack and calls the op's tvm-ffi kernel. An error the kernel raises is raised
// here as tvm-ffi's binding raises it (opbridge/raised_error.h: never a second run). Anything else
// returns NotImplemented having written nothing the caller can see, and the Python path takes the
// call with its own results and messages.
//
// What it saves: NumPy's DLPack export and tvm-ffi's conversion of each ndarray (about 107 ns per
// array on this machine's CPython 3.11 / NumPy 2) and the Python frame of the fast path.
//
// It depends on the Python and NumPy C ABIs, so it is built per interpreter and NumPy version (the
// build's defines carry both into the cache key), never into an op's kernel module.
//
// Here: the call (Call) and the C functions the Python side loads. What it keeps per op and how it
// views and checks the arguments before the kernel: entry_state.h, beside it.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL opbridge_numpy_entry_ARRAY_API
#include <numpy/arrayobject.h>
#include <tvm/ffi/c_api.h>

#include <opbridge/raised_error.h>

#include "entry_state.h"  // OpState, View, RuleSpecs, Overlaps

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#define OPB_NP_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxArgs = 16;
constexpr int64_t kReleaseGilBytes = int64_t(1) << 18;

PyObject* NotHandled() { Py_RETURN_NOTIMPLEMENTED; }

PyObject* Call(OpState& st, PyObject* const* args, Py_ssize_t nargs) {
  const size_t n = st.kinds.size(), n_out = st.n_out;
  if (static_cast<size_t>(nargs) != n || n + n_out > kMaxArgs) return NotHandled();
  PyObject* lead = args[st.dtype_arg];
  if (Py_TYPE(lead) != &PyArray_Type) return NotHandled();
  const int lead_type = PyArray_TYPE(reinterpret_cast<PyArrayObject*>(lead));
  bool declared = false;
  for (int t : st.dtypes) declared |= t == lead_type;
  if (!declared) return NotHandled();

  DLTensor dl[kMaxArgs];
  TVMFFIAny ffi[kMaxArgs];
  int64_t strides[kMaxArgs][kMaxRowsDims];  // row-strided arguments' element strides
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = args[i];
    TVMFFIAny& a = ffi[n_out + i];
    a.zero_padding = 0;
    a.v_int64 = 0;
    switch (st.kinds[i]) {
      case kTensor:
        if (!View(o, &dl[n_out + i], &a, st.rows[i] ? strides[i] : nullptr)) return NotHandled();
        break;
      case kOptionalTensor:
        if (o == Py_None) {
          a.type_index = kTVMFFINone;
        } else if (!View(o, &dl[n_out + i], &a, st.rows[i] ? strides[i] : nullptr)) {
          return NotHandled();
        }
        break;
      case kFloat:
        if (PyFloat_CheckExact(o)) {
          a.type_index = kTVMFFIFloat;
          a.v_float64 = PyFloat_AS_DOUBLE(o);
          break;
        }
        [[fallthrough]];  // an int where a float is declared: passed as int, as tvm-ffi's Python side does
      case kInt: {
        if (!PyLong_CheckExact(o)) return NotHandled();
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
          PyErr_Clear();
          return NotHandled();
        }
        a.type_index = kTVMFFIInt;
        a.v_int64 = v;
        break;
      }
      case kBool:
        if (!PyBool_Check(o)) return NotHandled();
        a.type_index = kTVMFFIBool;
        a.v_int64 = o == Py_True;
        break;
      default:
        return NotHandled();
    }
  }
  // A written argument that overlaps another tensor: the Python path names the pair and raises.
  if (!st.mutated.empty() && Overlaps(st, dl + n_out, ffi + n_out, args)) return NotHandled();

  PyObject* outs[kMaxArgs] = {};
  auto release = [&] {
    for (size_t k = 0; k < n_out; ++k) Py_XDECREF(outs[k]);
  };
  const std::vector<OutSpec>* specs = nullptr;
  std::vector<OutSpec> spill;
  if (st.rule != nullptr && (specs = RuleSpecs(st, args, nargs, ffi + n_out, &spill)) == nullptr) {
    PyErr_Clear();
    return NotHandled();
  }
  for (size_t k = 0; k < n_out; ++k) {
    if (specs != nullptr) {  // the shape rule's output: below the pool's threshold only, as like ones
      const OutSpec& spec = (*specs)[k];
      PyArray_Descr* descr = PyArray_DescrFromType(spec.type_num);
      if (descr == nullptr) {
        PyErr_Clear();
        release();
        return NotHandled();
      }
#if NPY_ABI_VERSION >= 0x02000000
      npy_intp bytes = PyDataType_ELSIZE(descr);
#else
      npy_intp bytes = descr->elsize;  // NumPy 1 (MindSpore's environment)
#endif
      for (npy_intp d : spec.shape) bytes *= d;
      if (bytes >= st.max_out_bytes) {
        Py_DECREF(descr);
        release();
        return NotHandled();
      }
      outs[k] = PyArray_Empty(static_cast<int>(spec.shape.size()), const_cast<npy_intp*>(spec.shape.data()),
                              descr, 0);  // steals descr
    } else {
      auto* src = reinterpret_cast<PyArrayObject*>(args[st.like[k]]);
      if (PyArray_NBYTES(src) >= st.max_out_bytes) {
        release();
        return NotHandled();
      }
      outs[k] = PyArray_NewLikeArray(src, NPY_CORDER, nullptr, 0);
    }
    if (outs[k] == nullptr || !View(outs[k], &dl[k], &ffi[k])) {
      PyErr_Clear();
      release();
      return NotHandled();
    }
  }

  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  // The GIL is released around a kernel on 256 KiB or more, as tvm-ffi's Python calls release it:
  // other Python threads run meanwhile. Below that, releasing and taking it back costs more than the
  // kernel's own time.
  int rc;
  if (PyArray_NBYTES(reinterpret_cast<PyArrayObject*>(lead)) >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
    Py_END_ALLOW_THREADS
  } else {
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
  }
  if (rc != 0) {  // raised here, as tvm-ffi's binding raises it: never a second run (raised_error.h)
    const opbridge::RaisedError err = opbridge::take_raised_error();
    release();
    return opbridge::set_python_error(err);
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) TVMFFIObjectDecRef(result.v_obj);
  st.calls.fetch_add(1, std::memory_order_relaxed);
  // The schema's returns: a new output (its reference moves) or an argument the op wrote.
  auto result_of = [&](int r) { return r >= 0 ? outs[r] : Py_NewRef(args[-1 - r]); };
  const size_t n_ret = st.returns.size();
  if (n_ret == 0) {
    release();
    Py_RETURN_NONE;
  }
  if (n_ret == 1) return result_of(st.returns[0]);
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(n_ret));
  if (tuple == nullptr) {
    release();
    return nullptr;
  }
  for (size_t k = 0; k < n_ret; ++k) PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(k), result_of(st.returns[k]));
  return tuple;
}

// `self` is a capsule holding the op's state.
PyObject* Entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return Call(*static_cast<OpState*>(PyCapsule_GetPointer(self, nullptr)), args, nargs);
}

PyMethodDef entry_def = {
    "opbridge_numpy_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Entry)), METH_FASTCALL,
    "The op on its schema's arguments in order; NotImplemented where the Python path must take the call."};

bool IntList(PyObject* seq, std::vector<int>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out->push_back(static_cast<int>(v));
  }
  Py_DECREF(fast);
  return true;
}

}  // namespace

// Imports NumPy's C API; 0 on success, -1 with a Python error set.
OPB_NP_EXPORT int opb_np_init() {
  import_array1(-1);
  return 0;
}

// A new builtin for one op: *kernel* its tvm_ffi.Function and *handle* that function's C handle,
// *kinds* per schema argument (0 tensor, 1 float, 2 int, 3 bool, 4 optional tensor), *like* per
// output the argument it is shaped like, or else *rule* (None with *like*): the arguments' tuple ->
// [(shape, NumPy type number)] per output; *returns* per schema return the output k (k) or the
// argument i it aliases (-1 - i), *mutated* the tensor arguments the kernel writes, *rows* those it
// takes as rows at a stride (the op's row_strided), *dtype_arg* and
// the declared NumPy *dtypes* (type numbers), *max_out_bytes* the pool's threshold. Returns
// (builtin, capsule of its state) or None with a Python error set.
OPB_NP_EXPORT PyObject* opb_np_entry(PyObject* kernel, void* handle, PyObject* kinds, PyObject* like,
                                     PyObject* rule, PyObject* returns, PyObject* mutated, PyObject* rows,
                                     int dtype_arg, PyObject* dtypes, int64_t max_out_bytes) {
  auto* st = new OpState();
  std::vector<int> row_args;
  if (!IntList(kinds, &st->kinds) || !IntList(like, &st->like) || !IntList(returns, &st->returns) ||
      !IntList(mutated, &st->mutated) || !IntList(rows, &row_args) || !IntList(dtypes, &st->dtypes)) {
    delete st;
    return nullptr;
  }
  st->rows.assign(st->kinds.size(), 0);
  for (int i : row_args) {
    if (i >= 0 && static_cast<size_t>(i) < st->rows.size()) st->rows[i] = 1;
  }
  st->kernel = Py_NewRef(kernel);
  st->rule = rule == Py_None ? nullptr : Py_NewRef(rule);
  for (int r : st->returns) st->n_out += r >= 0;
  st->handle = handle;
  st->dtype_arg = dtype_arg;
  st->max_out_bytes = max_out_bytes;
  PyObject* capsule = PyCapsule_New(st, nullptr, nullptr);  // never freed: builtins may outlive callers
  if (capsule == nullptr) return nullptr;
  PyObject* fn = PyCFunction_NewEx(&entry_def, capsule, nullptr);
  if (fn == nullptr) {
    Py_DECREF(capsule);
    return nullptr;
  }
  PyObject* pair = PyTuple_Pack(2, fn, capsule);
  Py_DECREF(fn);
  Py_DECREF(capsule);
  return pair;
}

// How many calls the entry of *capsule*'s op completed itself.
OPB_NP_EXPORT int64_t opb_np_calls(PyObject* capsule) {
  auto* st = static_cast<OpState*>(PyCapsule_GetPointer(capsule, nullptr));
  return st == nullptr ? -1 : st->calls.load(std::memory_order_relaxed);
}
