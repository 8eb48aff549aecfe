// NumPy's C entry (entry.cc), its first half: what it keeps per op and what it reads from a call's
// arguments before the kernel. OpState is made once per op by opb_np_entry; View checks an
// argument the way the Python fast path does and views it as a DLTensor (DLType: its element
// type); RuleSpecs asks the op's shape rule for the outputs' shapes and types once per argument
// signature (RuleKey) and keeps the answers; Overlaps is the test that an argument the op writes
// shares no memory with another. entry.cc's Call puts them together and calls the kernel.
//
// Included by entry.cc alone, after Python.h, NumPy's arrayobject.h (whose PY_ARRAY_UNIQUE_SYMBOL
// entry.cc defines) and tvm/ffi/c_api.h; like entry.cc, local to its translation unit. The entry's
// cache key covers this file: the build hashes the headers a source includes with quotes from beside
// itself (opbridge.build.compile.local_headers).
#pragma once

#include <opbridge/byte_rows.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace {

enum Kind : int { kTensor = 0, kFloat = 1, kInt = 2, kBool = 3, kOptionalTensor = 4 };

// One output of a shape rule's answer.
struct OutSpec {
  std::vector<npy_intp> shape;
  int type_num;
};

// One op, made once by opb_np_entry and kept for the life of the process.
struct OpState {
  PyObject* kernel = nullptr;         // the tvm_ffi.Function, kept alive
  TVMFFIObjectHandle handle = nullptr;  // its C handle
  std::vector<int> kinds;             // per schema argument
  std::vector<int> like;              // per output: the argument it is shaped like; empty with a rule
  PyObject* rule = nullptr;           // else: args -> [(shape, NumPy type number)] per output
  std::map<std::vector<int64_t>, std::vector<OutSpec>> rule_cache;  // by RuleKey; the GIL guards it;
                                                                     // insert only: answers stay put
  std::vector<int> returns;           // per return: output k as k, argument i (an alias) as -1 - i
  size_t n_out = 0;                   // new outputs: the returns >= 0
  std::vector<int> mutated;           // the tensor arguments the kernel writes
  std::vector<char> rows;             // per schema argument: the op declares it row_strided
  int dtype_arg = 0;                  // the argument whose dtype must be declared
  std::vector<int> dtypes;            // declared NumPy type numbers
  int64_t max_out_bytes = 0;          // outputs this large go to the Python path (the pool)
  std::atomic<int64_t> calls{0};
};

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

constexpr int kMaxRowsDims = 8;  // a row-strided array with more dims takes the Python path

// *o* as a DLTensor the kernel may read and write: an exact, aligned, writeable, native-byte-order
// ndarray of a type DLPack names, C-contiguous -- or, where *strides* is given (an argument the op
// declares row_strided, of at most kMaxRowsDims dims), rows at a stride (opbridge/byte_rows.h),
// its element strides written to *strides*.
bool View(PyObject* o, DLTensor* d, TVMFFIAny* a, int64_t* strides = nullptr) {
  if (Py_TYPE(o) != &PyArray_Type) return false;
  auto* arr = reinterpret_cast<PyArrayObject*>(o);
  constexpr int kNeed = NPY_ARRAY_ALIGNED | NPY_ARRAY_WRITEABLE;
  const int flags = PyArray_FLAGS(arr);
  if ((flags & kNeed) != kNeed || !PyArray_ISNBO(PyArray_DESCR(arr)->byteorder)) return false;
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
  a->type_index = kTVMFFIDLTensorPtr;
  a->zero_padding = 0;
  a->v_ptr = d;
  return true;
}

constexpr size_t kRuleCacheSize = 256;

// The signature a shape rule's answer depends on: each tensor's shape and type, each scalar's value
// (a float by its bits), -1 for None. Only called on arguments View and the scalar cases accepted.
std::vector<int64_t> RuleKey(const OpState& st, PyObject* const* args, const TVMFFIAny* ffi) {
  std::vector<int64_t> key;
  for (size_t i = 0; i < st.kinds.size(); ++i) {
    const TVMFFIAny& a = ffi[i];
    if (a.type_index == kTVMFFINone) {
      key.push_back(-1);
    } else if (a.type_index == kTVMFFIDLTensorPtr) {
      auto* arr = reinterpret_cast<PyArrayObject*>(args[i]);
      key.push_back(PyArray_NDIM(arr));
      key.insert(key.end(), PyArray_DIMS(arr), PyArray_DIMS(arr) + PyArray_NDIM(arr));
      key.push_back(PyArray_TYPE(arr));
    } else {
      key.push_back(a.type_index);
      key.push_back(a.v_int64);  // the value's bits (v_float64 shares them)
    }
  }
  return key;
}

// The outputs' shapes and types from the op's shape rule, asked once per signature; null where the
// rule raises or answers something else (the Python path then takes the call and raises its error).
// Entries are never removed (the rule is Python: another thread may run while it does, and must not
// free an answer this one holds); past kRuleCacheSize signatures the answer goes to *spill* instead.
const std::vector<OutSpec>* RuleSpecs(OpState& st, PyObject* const* args, Py_ssize_t nargs, const TVMFFIAny* ffi,
                                      std::vector<OutSpec>* spill) {
  std::vector<int64_t> key = RuleKey(st, args, ffi);
  auto it = st.rule_cache.find(key);
  if (it != st.rule_cache.end()) return &it->second;
  PyObject* tuple = PyTuple_New(nargs);
  if (tuple == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
  PyObject* answer = PyObject_CallOneArg(st.rule, tuple);
  Py_DECREF(tuple);
  if (answer == nullptr) return nullptr;
  std::vector<OutSpec> specs;
  bool ok = PyList_Check(answer) && PyList_GET_SIZE(answer) == static_cast<Py_ssize_t>(st.n_out);
  for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(answer); ++k) {
    PyObject* item = PyList_GET_ITEM(answer, k);  // (shape tuple, type number)
    ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 && PyTuple_Check(PyTuple_GET_ITEM(item, 0));
    if (!ok) break;
    OutSpec spec;
    PyObject* shape = PyTuple_GET_ITEM(item, 0);
    for (Py_ssize_t d = 0; ok && d < PyTuple_GET_SIZE(shape); ++d) {
      spec.shape.push_back(PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d)));
      ok = !PyErr_Occurred();
    }
    spec.type_num = ok ? static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(item, 1))) : 0;
    ok = ok && !PyErr_Occurred();
    specs.push_back(std::move(spec));
  }
  Py_DECREF(answer);
  if (!ok) return nullptr;
  if (st.rule_cache.size() >= kRuleCacheSize) {  // bounded under changing shapes
    *spill = std::move(specs);
    return spill;
  }
  return &st.rule_cache.emplace(std::move(key), std::move(specs)).first->second;
}

// Whether an argument the op writes shares a byte with another tensor argument (*dl*, *ffi*: the
// arguments' views, contiguous or rows at a stride: exact, so that vLLM's query and key slices of one
// qkv array, which interleave, are apart).
bool Overlaps(const OpState& st, const DLTensor* dl, const TVMFFIAny* ffi, PyObject* const* args) {
  const size_t n = st.kinds.size();
  auto rows_of = [&](size_t i, opbridge::rows::ByteRows* r) {
    const DLTensor& t = dl[i];
    const int64_t item = (t.dtype.bits * t.dtype.lanes + 7) / 8;
    return opbridge::rows::of(t.ndim, t.shape, t.strides, item, reinterpret_cast<int64_t>(t.data), r);
  };
  for (int m : st.mutated) {
    if (ffi[m].type_index != kTVMFFIDLTensorPtr) continue;
    opbridge::rows::ByteRows rm, rj;
    if (!rows_of(m, &rm)) return true;
    const int64_t me = opbridge::rows::end(rm);
    for (size_t j = 0; j < n; ++j) {
      if (static_cast<int>(j) == m || ffi[j].type_index != kTVMFFIDLTensorPtr) continue;
      if (rm.n == 1 && dl[j].strides == nullptr) {  // the common case: two spans
        const auto jb = reinterpret_cast<int64_t>(dl[j].data);
        const int64_t je = jb + PyArray_NBYTES(reinterpret_cast<PyArrayObject*>(args[j]));
        if (rm.bytes != 0 && jb != je && jb < me && rm.begin < je) return true;
        continue;
      }
      if (!rows_of(j, &rj) || opbridge::rows::meet(rm, rj)) return true;
    }
  }
  return false;
}

}  // namespace
