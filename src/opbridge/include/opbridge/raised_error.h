// The error a tvm-ffi kernel call raised, for the host-side C entries that call kernels without
// tvm-ffi's Python binding (the torch shim's entry and dispatcher kernels, NumPy's entry).
//
// A C entry raises the kernel's own error; it never hands the call to a slower path that would run
// the kernel again. A second run is not a harmless repeat: a device-side error record is taken by
// the first run (CUDA kernels report bad values on the next call: rotary_embedding's positions,
// advance_step's block indices), so the second raises nothing, and with
// OPBRIDGE_CUDA_SYNC_CHECKS=1 a mutating kernel has already written when it raises, so a second
// run applies it twice.
#pragma once

#include <tvm/ffi/c_api.h>

#include <string>

namespace opbridge {

struct RaisedError {
  std::string kind = "RuntimeError";  // tvm-ffi's error kind: "ValueError", "TypeError", ...
  std::string message;
};

// Takes the error the last tvm-ffi call raised on this thread off its slot. Out of line and cold:
// the error path of a call, kept out of the code of the calls that succeed.
[[gnu::cold, gnu::noinline]] inline RaisedError take_raised_error() {
  RaisedError out;
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) {
    out.message = "a tvm-ffi call failed without an error object";
    return out;
  }
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  out.kind.assign(cell->kind.data, cell->kind.size);
  out.message.assign(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return out;
}

#ifdef Py_PYTHON_H
// Sets the Python exception tvm-ffi's binding raises for `e`: the class registered for its kind
// (tvm_ffi.core.ERROR_NAME_TO_TYPE), else RuntimeError, with its message. Returns nullptr, for a
// C function to return. Needs the GIL.
[[gnu::cold, gnu::noinline]] inline PyObject* set_python_error(const RaisedError& e) {
  PyObject* cls = PyExc_RuntimeError;
  PyObject* table = nullptr;
  if (PyObject* core = PyImport_ImportModule("tvm_ffi.core")) {  // in sys.modules: a dict lookup
    table = PyObject_GetAttrString(core, "ERROR_NAME_TO_TYPE");
    Py_DECREF(core);
  }
  if (table != nullptr && PyDict_Check(table)) {
    PyObject* found = PyDict_GetItemString(table, e.kind.c_str());  // borrowed
    if (found != nullptr && PyExceptionClass_Check(found)) cls = found;
  }
  Py_INCREF(cls);
  Py_XDECREF(table);
  PyErr_Clear();  // a failed lookup leaves RuntimeError
  PyErr_SetString(cls, e.message.c_str());
  Py_DECREF(cls);
  return nullptr;
}
#endif

}  // namespace opbridge
