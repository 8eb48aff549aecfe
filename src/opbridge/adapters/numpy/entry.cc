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
// The call itself is the C entries' shared one (call/py_entry.h: the op's state, scalars, the shape
// rule's answers, the overlap test, the kernel call and its error). Here: NumPy's arrays for it
// (NumpyArrays) and the C functions the Python side loads; how an ndarray is viewed and checked:
// arrays.h, beside it.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL opbridge_numpy_entry_ARRAY_API
#include <numpy/arrayobject.h>
#include <tvm/ffi/c_api.h>

#include <py_entry.h>  // the C entries' shared call (opbridge/call/, an include directory of this build)

#include "arrays.h"  // View, DLType, NewDescr

#include <cstdint>

#define OPB_NP_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

namespace entry = opbridge::entry;

// NumPy's arrays for the shared call (call/py_entry.h).
struct NumpyArrays {
  using State = entry::OpState;
  using Out = PyObject*;
  static bool Lead(State& st, PyObject* const* args, PyObject* const*, size_t) {
    return Py_TYPE(args[st.dtype_arg]) == &PyArray_Type;
  }
  static bool View(State&, PyObject* o, DLTensor* d, int64_t* strides, int64_t*, bool written) {
    return ::View(o, d, strides, written);
  }
  static bool New(State&, PyObject* like, const DLTensor*, const entry::OutSpec* spec, Out* out, DLTensor* d) {
    if (spec != nullptr) {  // the shape rule's output
      PyArray_Descr* descr = NewDescr(spec->type);
      if (descr == nullptr) return false;
      *out = PyArray_Empty(static_cast<int>(spec->shape.size()), const_cast<npy_intp*>(spec->shape.data()), descr,
                           0);  // steals descr
    } else {
      *out = PyArray_NewLikeArray(reinterpret_cast<PyArrayObject*>(like), NPY_CORDER, nullptr, 0);
    }
    if (*out != nullptr && ::View(*out, d, nullptr, true)) return true;
    PyErr_Clear();
    Py_XDECREF(*out);
    return false;
  }
  static PyObject* Finish(State&, Out& out) { return out; }
  static void Drop(Out& out) { Py_DECREF(out); }
  static void Wrote(State&, PyObject*) {}
};

}  // namespace

// Imports NumPy's C API; 0 on success, -1 with a Python error set.
OPB_NP_EXPORT int opb_np_init() {
  import_array1(-1);
  return 0;
}

// ml_dtypes' bfloat16 dtype *dtype* (native.Library.take_bfloat16 checks it is one), which the entry
// then takes and makes (kept for the life of the process); 0, or -1 with a Python error set for
// anything but a NumPy dtype.
OPB_NP_EXPORT int opb_np_bfloat16(PyObject* dtype) {
  if (!PyArray_DescrCheck(dtype)) {
    PyErr_SetString(PyExc_TypeError, "opb_np_bfloat16: a numpy dtype");
    return -1;
  }
  if (bfloat16_descr == nullptr) {
    bfloat16_descr = reinterpret_cast<PyArray_Descr*>(Py_NewRef(dtype));
    bfloat16_type = bfloat16_descr->typeobj;
  }
  return 0;
}

// New builtins for one op, from the op's facts (opbridge::entry::Init says which). Returns (builtin,
// out= builtin, capsule of its state) or None with a Python error set.
OPB_NP_EXPORT PyObject* opb_np_entry(PyObject* kernel, void* handle, PyObject* kinds, PyObject* like,
                                     PyObject* rule, PyObject* returns, PyObject* mutated, PyObject* rows,
                                     int dtype_arg, PyObject* dtypes, int64_t max_out_bytes) {
  auto* st = new entry::OpState();
  if (!entry::Init(st, kernel, handle, kinds, like, rule, returns, mutated, rows, dtype_arg, dtypes, max_out_bytes)) {
    delete st;
    return nullptr;
  }
  return entry::Builtins<NumpyArrays>(st, "opbridge_numpy_entry", "opbridge_numpy_entry_out");
}

// How many calls the entry of *capsule*'s op completed itself.
OPB_NP_EXPORT int64_t opb_np_calls(PyObject* capsule) { return entry::Calls(capsule); }
