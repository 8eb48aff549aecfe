// The tensor entry's second reader (exchange_entry.cc has the first): tensor types without a DLPack
// exchange table, read through the methods their Python API shares with torch's: data_ptr(), shape,
// dtype, is_contiguous() and stride() (MindSpore's Tensor). A new output is made by the framework's
// own allocator, a Python callable (shape, TypeCode) -> tensor, called from here.
//
// What it takes is what the adapter's Python fast path takes: tensors of the entry's type (the
// dispatching one exactly; the others may be a subclass: a model's Parameter weights) whose host
// attribute names the host ("device" == "CPU"), whose memory is there (the `unready` attribute false:
// MindSpore's has_init), of a dtype the adapter listed, contiguous or rows at a
// stride where the op declares them; nothing to record for autograd (grad_enabled() false). The
// framework's `before` runs once per call before any tensor is read (MindSpore: wait for the queued
// ops, _pynative_executor.sync()). Everything else returns NotImplemented and the Python path runs.
//
// Each tensor costs about six attribute reads and method calls from C (0.1 us or less each on
// MindSpore 2.10) where the Python path made a NumPy view of it (2.3 us on MindSpore: the
// __array_interface__ alone is 1.0).
//
// Included by exchange_entry.cc alone, after Python.h, dlpack.h, tvm/ffi/c_api.h and py_entry.h; local
// to its translation unit. The entry's cache key covers this file (opbridge.build.compile.local_headers).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace {

// One op on one tensor type read through its methods.
struct MethodState : opbridge::entry::OpState {
  PyTypeObject* type = nullptr;  // the tensor type (the dispatching tensor's exactly)
  PyObject* grad_enabled = nullptr;  // () -> bool: whether the framework records gradients now
  PyObject* before = nullptr;        // () -> None, run before a call reads any tensor; or null
  PyObject* new_output = nullptr;    // (shape tuple, TypeCode) -> a new contiguous tensor, or None
  PyObject* host_attr = nullptr;     // the attribute that names a tensor's device ...
  PyObject* host_value = nullptr;    // ... and its value for host memory
  PyObject* unready_attr = nullptr;  // an attribute true while a tensor has no memory yet; or null
  // The framework's dtype objects (compared by identity: the framework keeps one of each) and theirs.
  std::vector<std::pair<PyObject*, DLDataType>> known_dtypes;
  PyObject *s_data_ptr = nullptr, *s_shape = nullptr, *s_dtype = nullptr, *s_is_contiguous = nullptr,
           *s_stride = nullptr;  // interned names
};

// A new output before it is handed to Python: the tensor and the shape its DLTensor points to.
struct MethodOut {
  PyObject* tensor;
  int64_t shape[opbridge::entry::kMaxViewDims];
};

// *o*'s attribute *name*'s truth: 1, 0, or -1 (with no Python error left).
int AttrTruth(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  const int truth = v == nullptr ? -1 : PyObject_IsTrue(v);
  Py_XDECREF(v);
  if (truth < 0) PyErr_Clear();
  return truth;
}

// A tuple or list of ints (a shape or strides) into *to*, at most *room* of them; their number, or -1.
int Ints(PyObject* seq, int64_t* to, int room) {
  if (seq == nullptr || !(PyTuple_Check(seq) || PyList_Check(seq))) return -1;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > room) return -1;
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t k = 0; k < n; ++k) {
    const long long v = PyLong_AsLongLong(items[k]);
    if (v == -1 && PyErr_Occurred()) return -1;
    to[k] = v;
  }
  return static_cast<int>(n);
}

// *o*'s data_ptr() into *data*; false (a Python error may be left) where it has none.
bool DataPtr(const MethodState& st, PyObject* o, void** data) {
  PyObject* ptr = PyObject_CallMethodNoArgs(o, st.s_data_ptr);
  *data = ptr == nullptr ? nullptr : PyLong_AsVoidPtr(ptr);
  Py_XDECREF(ptr);
  return !PyErr_Occurred();
}

struct MethodArrays {
  using State = MethodState;
  using Out = MethodOut;

  static bool Lead(State& st, PyObject* const* args, PyObject* const*, size_t) {
    if (Py_TYPE(args[st.dtype_arg]) != st.type) return false;
    PyObject* on = PyObject_CallNoArgs(st.grad_enabled);
    const int grad = on == nullptr ? -1 : PyObject_IsTrue(on);
    Py_XDECREF(on);
    if (grad != 0) {  // gradients recorded now (the Python path puts the call on the tape), or an error
      PyErr_Clear();
      return false;
    }
    if (st.before != nullptr) {
      PyObject* r = PyObject_CallNoArgs(st.before);
      if (r == nullptr) {
        PyErr_Clear();
        return false;
      }
      Py_DECREF(r);
    }
    return true;
  }

  static bool View(State& st, PyObject* o, DLTensor* d, int64_t* strides, int64_t* dims, bool) {
    // a subclass too (MindSpore's Parameter) beside the dispatching tensor, which Lead wants exact
    if (!PyObject_TypeCheck(o, st.type)) return false;
    if (st.unready_attr != nullptr && AttrTruth(o, st.unready_attr) != 0) return false;
    bool ok = ReadView(st, o, d, strides, dims);
    if (!ok) PyErr_Clear();
    return ok;
  }

  // View's reads; false may leave a Python error (View clears it).
  static bool ReadView(State& st, PyObject* o, DLTensor* d, int64_t* strides, int64_t* dims) {
    PyObject* device = PyObject_GetAttr(o, st.host_attr);
    const int host = device == nullptr ? -1 : PyObject_RichCompareBool(device, st.host_value, Py_EQ);
    Py_XDECREF(device);
    if (host != 1) return false;
    PyObject* dtype = PyObject_GetAttr(o, st.s_dtype);
    if (dtype == nullptr) return false;
    bool known = false;
    for (const auto& [obj, type] : st.known_dtypes) {
      if (obj == dtype) {
        d->dtype = type;
        known = true;
        break;
      }
    }
    Py_DECREF(dtype);
    if (!known) return false;
    PyObject* shape = PyObject_GetAttr(o, st.s_shape);
    const int ndim = Ints(shape, dims, opbridge::entry::kMaxViewDims);
    Py_XDECREF(shape);
    if (ndim < 0) return false;
    void* data = nullptr;
    if (!DataPtr(st, o, &data)) return false;
    d->data = data;
    d->device = DLDevice{kDLCPU, 0};
    d->ndim = ndim;
    d->shape = dims;
    d->strides = nullptr;  // compact row-major
    d->byte_offset = 0;
    PyObject* contiguous = PyObject_CallMethodNoArgs(o, st.s_is_contiguous);
    const int dense = contiguous == nullptr ? -1 : PyObject_IsTrue(contiguous);
    Py_XDECREF(contiguous);
    if (dense == 1) return true;
    // rows at a stride, for an argument the op declares row_strided (opbridge/byte_rows.h's one rule)
    if (dense < 0 || strides == nullptr || ndim > opbridge::entry::kMaxRowsDims) return false;
    PyObject* stride = PyObject_CallMethodNoArgs(o, st.s_stride);
    const int n = Ints(stride, strides, ndim);
    Py_XDECREF(stride);
    if (n != ndim || !opbridge::rows::accepts(ndim, dims, strides)) return false;
    d->strides = strides;
    return true;
  }

  static bool New(State& st, PyObject*, const DLTensor* like, const opbridge::entry::OutSpec* spec, Out* out,
                  DLTensor* d) {
    const int ndim = spec != nullptr ? static_cast<int>(spec->shape.size()) : like->ndim;
    if (ndim > opbridge::entry::kMaxViewDims) return false;
    const DLDataType type = spec != nullptr ? opbridge::entry::FromTypeCode(spec->type) : like->dtype;
    PyObject* shape = PyTuple_New(ndim);
    if (shape == nullptr) {
      PyErr_Clear();
      return false;
    }
    bool filled = true;
    for (int k = 0; k < ndim; ++k) {
      out->shape[k] = spec != nullptr ? spec->shape[k] : like->shape[k];
      PyObject* dim = PyLong_FromLongLong(out->shape[k]);
      filled &= dim != nullptr;
      PyTuple_SET_ITEM(shape, k, dim != nullptr ? dim : Py_NewRef(Py_None));
    }
    PyObject* code = filled ? PyLong_FromLong(opbridge::entry::TypeCode(type)) : nullptr;
    PyObject* t = code == nullptr ? nullptr : PyObject_CallFunctionObjArgs(st.new_output, shape, code, nullptr);
    Py_DECREF(shape);
    Py_XDECREF(code);
    if (t == nullptr || t == Py_None) {  // no allocation here for that dtype: the Python path
      PyErr_Clear();
      Py_XDECREF(t);
      return false;
    }
    void* data = nullptr;
    if (!DataPtr(st, t, &data)) {
      PyErr_Clear();
      Py_DECREF(t);
      return false;
    }
    out->tensor = t;
    d->data = data;
    d->device = DLDevice{kDLCPU, 0};
    d->ndim = ndim;
    d->dtype = type;
    d->shape = out->shape;
    d->strides = nullptr;
    d->byte_offset = 0;
    return true;
  }

  static PyObject* Finish(State&, Out& out) { return out.tensor; }
  static void Drop(Out& out) { Py_DECREF(out.tensor); }
  static void Wrote(State&, PyObject*) {}
};

}  // namespace
