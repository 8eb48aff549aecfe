// NumPy's C entry (entry.cc), its arrays: how an ndarray argument is viewed as a DLTensor (View: what
// the Python fast path takes, checked the same way in C; DLType: its element type) and how a new
// output is made (PyArray_NewLikeArray, or PyArray_Empty for a shape rule's answer). entry.cc's
// NumpyArrays hands them to the shared call (py_entry.h).
//
// Included by entry.cc alone, after Python.h, NumPy's arrayobject.h (whose PY_ARRAY_UNIQUE_SYMBOL
// entry.cc defines), tvm/ffi/c_api.h and py_entry.h; like entry.cc, local to its translation
// unit. The entry's cache key covers this file: the build hashes the headers a source includes with
// quotes from beside itself (opbridge.build.compile.local_headers).
#pragma once

#include <cstdint>

namespace {

using opbridge::entry::kMaxRowsDims;

// ml_dtypes' bfloat16 (NumPy has none of its own): its dtype and scalar type, once the Python side has
// met it (opb_np_bfloat16), else null. NumPy names it kind 'V', like any other opaque 2-byte type, so
// it is told by its scalar type.
PyArray_Descr* bfloat16_descr = nullptr;
PyTypeObject* bfloat16_type = nullptr;

// Whether *arr* holds ml_dtypes' bfloat16. Out of line and cold: inline, it made DLType too large to
// inline into View, which cost NumPy's shape-rule calls 0.013-0.017 us.
[[gnu::noinline, gnu::cold]] bool IsBfloat16(PyArrayObject* arr) {
  return bfloat16_type != nullptr && PyArray_DESCR(arr)->typeobj == bfloat16_type;
}

// The DLPack type of *arr*'s elements by kind and size (ml_dtypes' bfloat16 by its scalar type);
// false for what DLPack or the kernels do not name here (complex, long double, objects): the Python
// path takes those.
[[gnu::always_inline]] inline bool DLType(PyArrayObject* arr, DLDataType* t) {
  const int size = static_cast<int>(PyArray_ITEMSIZE(arr));
  t->lanes = 1;
  t->bits = static_cast<uint8_t>(8 * size);
  switch (PyArray_DESCR(arr)->kind) {
    case 'f': t->code = kDLFloat; return size == 2 || size == 4 || size == 8;
    case 'i': t->code = kDLInt; return size <= 8;
    case 'u': t->code = kDLUInt; return size <= 8;
    case 'b': t->code = kDLBool; return size == 1;
    default:
      t->code = kDLBfloat;
      return size == 2 && IsBfloat16(arr);
  }
}


// NumPy's type number for a DLPack element type (opbridge::entry::TypeCode), -1 for none.
int NpyType(int code) {
  const DLDataType t = opbridge::entry::FromTypeCode(code);
  if (t.lanes != 1) return -1;
  switch (t.code) {
    case kDLFloat: return t.bits == 16 ? NPY_HALF : t.bits == 32 ? NPY_FLOAT : t.bits == 64 ? NPY_DOUBLE : -1;
    case kDLInt:
      return t.bits == 8    ? NPY_INT8
             : t.bits == 16 ? NPY_INT16
             : t.bits == 32 ? NPY_INT32
             : t.bits == 64 ? NPY_INT64
                            : -1;
    case kDLUInt:
      return t.bits == 8    ? NPY_UINT8
             : t.bits == 16 ? NPY_UINT16
             : t.bits == 32 ? NPY_UINT32
             : t.bits == 64 ? NPY_UINT64
                            : -1;
    case kDLBool: return t.bits == 8 ? NPY_BOOL : -1;
    default: return -1;
  }
}

// A new reference to the dtype of a new array of DLPack element type *code* (opbridge::entry::TypeCode),
// or null (no Python error) for one NumPy cannot make here.
PyArray_Descr* NewDescr(int code) {
  const DLDataType t = opbridge::entry::FromTypeCode(code);
  if (t.code == kDLBfloat && t.bits == 16 && t.lanes == 1 && bfloat16_descr != nullptr) {
    Py_INCREF(bfloat16_descr);
    return bfloat16_descr;
  }
  const int type = NpyType(code);
  PyArray_Descr* descr = type < 0 ? nullptr : PyArray_DescrFromType(type);
  if (descr == nullptr) PyErr_Clear();
  return descr;
}

// *o* as a DLTensor the kernel may read (and write, where *written*): an exact, aligned (and then
// writeable), native-byte-order ndarray of a type DLPack names, C-contiguous -- or, where *strides*
// is given (an argument the op declares row_strided, of at most kMaxRowsDims dims), rows at a stride
// (opbridge/byte_rows.h), its element strides written to *strides*. A read-only input is taken as
// it is: the kernel only reads it (NumPy arrays of JAX arrays are read-only; DLPack, which cannot
// say so, made the Python path alias them, 15 us a call).
[[gnu::always_inline]] inline bool View(PyObject* o, DLTensor* d, int64_t* strides, bool written) {
  if (Py_TYPE(o) != &PyArray_Type) return false;
  auto* arr = reinterpret_cast<PyArrayObject*>(o);
  const int need = written ? NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE : NPY_ARRAY_ALIGNED;
  const int flags = PyArray_FLAGS(arr);
  if ((flags & need) != need || !PyArray_ISNBO(PyArray_DESCR(arr)->byteorder)) return false;
  if (!DLType(arr, &d->dtype)) return false;
  d->data = PyArray_DATA(arr);
  d->device = DLDevice{kDLCPU, 0};
  d->ndim = PyArray_NDIM(arr);
  static_assert(sizeof(npy_intp) == sizeof(int64_t), "npy_intp is int64_t on the platforms opbridge supports");
  d->shape = reinterpret_cast<int64_t*>(PyArray_DIMS(arr));
  d->strides = nullptr;  // compact row-major
  d->byte_offset = 0;
  if (!(flags & NPY_ARRAY_C_CONTIGUOUS)) {
    if (strides == nullptr || d->ndim > kMaxRowsDims) return false;
    const int64_t item = PyArray_ITEMSIZE(arr);
    for (int k = 0; k < d->ndim; ++k) {
      const int64_t b = PyArray_STRIDE(arr, k);
      if (b % item != 0) return false;
      strides[k] = b / item;
    }
    if (!opbridge::rows::accepts(d->ndim, d->shape, strides)) return false;
    d->strides = strides;
  }
  return true;
}

}  // namespace
