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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL opbridge_numpy_entry_ARRAY_API
#include <numpy/arrayobject.h>
#include <tvm/ffi/c_api.h>

#include <opbridge/raised_error.h>

#include <atomic>
#include <cstdint>
#include <vector>

#define OPB_NP_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

enum Kind : int { kTensor = 0, kFloat = 1, kInt = 2, kBool = 3, kOptionalTensor = 4 };

// One op, made once by opb_np_entry and kept for the life of the process.
struct OpState {
  PyObject* kernel = nullptr;         // the tvm_ffi.Function, kept alive
  TVMFFIObjectHandle handle = nullptr;  // its C handle
  std::vector<int> kinds;             // per schema argument
  std::vector<int> like;              // per output: the argument it is shaped like
  std::vector<int> returns;           // per return: output k as k, argument i (an alias) as -1 - i
  std::vector<int> mutated;           // the tensor arguments the kernel writes
  int dtype_arg = 0;                  // the argument whose dtype must be declared
  std::vector<int> dtypes;            // declared NumPy type numbers
  int64_t max_out_bytes = 0;          // outputs this large go to the Python path (the pool)
  std::atomic<int64_t> calls{0};
};

constexpr int kMaxArgs = 16;
constexpr int64_t kReleaseGilBytes = int64_t(1) << 18;

// The DLPack type of *arr*'s elements by kind and size; false for what DLPack or the kernels do not
// name here (bfloat16 from ml_dtypes, complex, long double, objects): the Python path takes those.
bool DLType(PyArrayObject* arr, DLDataType* t) {
  const int size = static_cast<int>(PyArray_ITEMSIZE(arr));
  t->lanes = 1;
  t->bits = static_cast<uint8_t>(8 * size);
  switch (PyArray_DESCR(arr)->kind) {
    case 'f': t->code = kDLFloat; return size == 2 || size == 4 || size == 8;
    case 'i': t->code = kDLInt; return size <= 8;
    case 'u': t->code = kDLUInt; return size <= 8;
    case 'b': t->code = kDLBool; return size == 1;
    default: return false;
  }
}

// *o* as a DLTensor the kernel may read and write: an exact, C-contiguous, aligned, writeable,
// native-byte-order ndarray of a type DLPack names.
bool View(PyObject* o, DLTensor* d, TVMFFIAny* a) {
  if (Py_TYPE(o) != &PyArray_Type) return false;
  auto* arr = reinterpret_cast<PyArrayObject*>(o);
  constexpr int kNeed = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE;
  if ((PyArray_FLAGS(arr) & kNeed) != kNeed || !PyArray_ISNBO(PyArray_DESCR(arr)->byteorder)) return false;
  if (!DLType(arr, &d->dtype)) return false;
  d->data = PyArray_DATA(arr);
  d->device = DLDevice{kDLCPU, 0};
  d->ndim = PyArray_NDIM(arr);
  static_assert(sizeof(npy_intp) == sizeof(int64_t), "npy_intp is int64_t on the platforms opbridge supports");
  d->shape = reinterpret_cast<int64_t*>(PyArray_DIMS(arr));
  d->strides = nullptr;  // compact row-major
  d->byte_offset = 0;
  a->type_index = kTVMFFIDLTensorPtr;
  a->zero_padding = 0;
  a->v_ptr = d;
  return true;
}

PyObject* NotHandled() { Py_RETURN_NOTIMPLEMENTED; }

// Whether an argument the op writes overlaps another tensor argument (*dl*, *ffi*: the arguments' views).
bool Overlaps(const OpState& st, const DLTensor* dl, const TVMFFIAny* ffi, PyObject* const* args) {
  const size_t n = st.kinds.size();
  auto bytes = [&](size_t i) { return PyArray_NBYTES(reinterpret_cast<PyArrayObject*>(args[i])); };
  for (int m : st.mutated) {
    if (ffi[m].type_index != kTVMFFIDLTensorPtr) continue;
    const auto* mb = static_cast<const char*>(dl[m].data);
    const auto* me = mb + bytes(m);
    for (size_t j = 0; j < n; ++j) {
      if (static_cast<int>(j) == m || ffi[j].type_index != kTVMFFIDLTensorPtr) continue;
      const auto* jb = static_cast<const char*>(dl[j].data);
      if (mb < jb + bytes(j) && jb < me) return true;
    }
  }
  return false;
}

PyObject* Call(OpState& st, PyObject* const* args, Py_ssize_t nargs) {
  const size_t n = st.kinds.size(), n_out = st.like.size();
  if (static_cast<size_t>(nargs) != n || n + n_out > kMaxArgs) return NotHandled();
  PyObject* lead = args[st.dtype_arg];
  if (Py_TYPE(lead) != &PyArray_Type) return NotHandled();
  const int lead_type = PyArray_TYPE(reinterpret_cast<PyArrayObject*>(lead));
  bool declared = false;
  for (int t : st.dtypes) declared |= t == lead_type;
  if (!declared) return NotHandled();

  DLTensor dl[kMaxArgs];
  TVMFFIAny ffi[kMaxArgs];
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = args[i];
    TVMFFIAny& a = ffi[n_out + i];
    a.zero_padding = 0;
    a.v_int64 = 0;
    switch (st.kinds[i]) {
      case kTensor:
        if (!View(o, &dl[n_out + i], &a)) return NotHandled();
        break;
      case kOptionalTensor:
        if (o == Py_None) {
          a.type_index = kTVMFFINone;
        } else if (!View(o, &dl[n_out + i], &a)) {
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
  for (size_t k = 0; k < n_out; ++k) {
    auto* src = reinterpret_cast<PyArrayObject*>(args[st.like[k]]);
    if (PyArray_NBYTES(src) >= st.max_out_bytes) {
      release();
      return NotHandled();
    }
    outs[k] = PyArray_NewLikeArray(src, NPY_CORDER, nullptr, 0);
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
// output the argument it is shaped like, *returns* per schema return the output k (k) or the
// argument i it aliases (-1 - i), *mutated* the tensor arguments the kernel writes, *dtype_arg* and
// the declared NumPy *dtypes* (type numbers), *max_out_bytes* the pool's threshold. Returns
// (builtin, capsule of its state) or None with a Python error set.
OPB_NP_EXPORT PyObject* opb_np_entry(PyObject* kernel, void* handle, PyObject* kinds, PyObject* like,
                                     PyObject* returns, PyObject* mutated, int dtype_arg, PyObject* dtypes,
                                     int64_t max_out_bytes) {
  auto* st = new OpState();
  if (!IntList(kinds, &st->kinds) || !IntList(like, &st->like) || !IntList(returns, &st->returns) ||
      !IntList(mutated, &st->mutated) || !IntList(dtypes, &st->dtypes)) {
    delete st;
    return nullptr;
  }
  st->kernel = Py_NewRef(kernel);
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
