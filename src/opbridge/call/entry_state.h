// The C entries' state and what their call reads before the kernel (py_entry.h, beside it, is the call):
// the op's state (OpState, made once by Init), DLPack element types as one int (TypeCode), the scalar
// arguments (Scalar), the shape rule's answers kept per argument signature (RuleKey, RuleSpecs) and
// the exact test that an argument the op writes shares no byte with another (RowsOf, Overlaps).
//
// Included by py_entry.h alone, after Python.h and tvm/ffi/c_api.h; local to the including
// translation unit (an anonymous namespace), as py_entry.h is.
#pragma once

#include <opbridge/byte_rows.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace opbridge {
namespace entry {
namespace {  // internal linkage: each entry's translation unit inlines and optimises its own copy

enum Kind : int { kTensor = 0, kFloat = 1, kInt = 2, kBool = 3, kOptionalTensor = 4 };

constexpr int kMaxArgs = 16;      // arguments and new outputs together (call.c_entry.takes)
constexpr int kMaxRowsDims = 8;   // a row-strided argument with more dims takes the Python path
constexpr int kMaxViewDims = 16;  // a tensor read through its methods with more dims takes the Python path
constexpr int64_t kReleaseGilBytes = int64_t(1) << 18;
constexpr size_t kRuleCacheSize = 256;

// A DLPack element type as one int, code | bits << 8 | lanes << 16: how the declared dtypes and the
// shape rule's answers reach an entry (call.c_entry.dl_code says the same in Python).
inline int TypeCode(DLDataType t) { return t.code | t.bits << 8 | t.lanes << 16; }
inline DLDataType FromTypeCode(int c) {
  return DLDataType{static_cast<uint8_t>(c & 0xff), static_cast<uint8_t>((c >> 8) & 0xff),
                    static_cast<uint16_t>((c >> 16) & 0xffff)};
}
inline int64_t ItemBytes(DLDataType t) { return (int64_t(t.bits) * t.lanes + 7) / 8; }

inline int64_t Numel(const DLTensor& t) {
  int64_t n = 1;
  for (int k = 0; k < t.ndim; ++k) n *= t.shape[k];
  return n;
}

// The bytes of a contiguous tensor's elements.
inline int64_t Bytes(const DLTensor& t) { return Numel(t) * ItemBytes(t.dtype); }

// One output of a shape rule's answer.
struct OutSpec {
  std::vector<int64_t> shape;
  int type;  // TypeCode
};

// One op, made once by the entry's constructor (Init) and kept for the life of the process.
struct OpState {
  PyObject* kernel = nullptr;           // the tvm_ffi.Function, kept alive
  TVMFFIObjectHandle handle = nullptr;  // its C handle
  std::vector<int> kinds;               // per schema argument
  std::vector<int> like;                // per output: the argument it is shaped like; empty with a rule
  PyObject* rule = nullptr;             // else: args -> [(shape, TypeCode)] per output
  std::map<std::vector<int64_t>, std::vector<OutSpec>> rule_cache;  // by RuleKey; insert only: answers
                                                                     // stay put (std::map nodes do not move)
#ifdef Py_GIL_DISABLED
  std::mutex rule_mutex;  // guards rule_cache where no GIL does (free-threaded Python; the entries are loaded
                          // through ctypes, so loading them does not turn the GIL back on)
#endif
  std::vector<int> returns;             // per return: output k as k, argument i (an alias) as -1 - i
  size_t n_out = 0;                     // new outputs: the returns >= 0
  std::vector<int> mutated;             // the tensor arguments the kernel writes
  std::vector<char> written;            // per schema argument: in mutated
  std::vector<char> rows;               // per schema argument: the op declares it row_strided
  int dtype_arg = 0;                    // the argument whose dtype must be declared
  std::vector<int> dtypes;              // declared TypeCodes
  int64_t max_out_bytes = 0;            // outputs this large go to the Python path (the pool)
  std::atomic<int64_t> calls{0};
};

inline PyObject* NotHandled() { Py_RETURN_NOTIMPLEMENTED; }

// A Python float, int or bool where the schema has one; false for anything else (the Python path names it).
inline bool Scalar(int kind, PyObject* o, TVMFFIAny* a) {
  switch (kind) {
    case kFloat:
      if (PyFloat_Check(o)) {  // a subclass too: numpy.float64 (an eps from NumPy arithmetic) took 1.1 us
                               // on the Python path, which passes it on as a float
        a->type_index = kTVMFFIFloat;
        a->v_float64 = PyFloat_AS_DOUBLE(o);
        return true;
      }
      [[fallthrough]];  // an int where a float is declared: passed as int, as tvm-ffi's Python side does
    case kInt: {
      if (!PyLong_CheckExact(o)) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      a->type_index = kTVMFFIInt;
      a->v_int64 = v;
      return true;
    }
    case kBool:
      if (!PyBool_Check(o)) return false;
      a->type_index = kTVMFFIBool;
      a->v_int64 = o == Py_True;
      return true;
    default:
      return false;
  }
}

// The signature a shape rule's answer depends on: each tensor's shape and type, each scalar's value
// (a float by its bits), -1 for None. Only called on arguments the entry accepted.
inline std::vector<int64_t> RuleKey(const OpState& st, const DLTensor* dl, const TVMFFIAny* ffi) {
  std::vector<int64_t> key;
  key.reserve(4 * st.kinds.size());  // one allocation for the usual shapes (ndim, 2 dims, type)
  for (size_t i = 0; i < st.kinds.size(); ++i) {
    const TVMFFIAny& a = ffi[i];
    if (a.type_index == kTVMFFINone) {
      key.push_back(-1);
    } else if (a.type_index == kTVMFFIDLTensorPtr) {
      key.push_back(dl[i].ndim);
      key.insert(key.end(), dl[i].shape, dl[i].shape + dl[i].ndim);
      key.push_back(TypeCode(dl[i].dtype));
    } else {
      key.push_back(a.type_index);
      key.push_back(a.v_int64);  // the value's bits (v_float64 shares them)
    }
  }
  return key;
}

// Holds an op's rule_cache where the interpreter has no GIL; nothing to do where the GIL guards it.
struct RuleCacheLock {
#ifdef Py_GIL_DISABLED
  explicit RuleCacheLock(OpState& st) : lock_(st.rule_mutex) {}
  std::lock_guard<std::mutex> lock_;
#else
  explicit RuleCacheLock(OpState&) {}
#endif
};

// The outputs' shapes and types from the op's shape rule, asked once per signature; null where the
// rule raises or answers something else (the Python path then takes the call and raises its error).
// Entries are never removed (the rule is Python: another thread may run while it does, and must not
// free an answer this one holds); past kRuleCacheSize signatures the answer goes to *spill* instead.
inline const std::vector<OutSpec>* RuleSpecs(OpState& st, PyObject* const* args, Py_ssize_t nargs,
                                             const DLTensor* dl, const TVMFFIAny* ffi,
                                             std::vector<OutSpec>* spill) {
  std::vector<int64_t> key = RuleKey(st, dl, ffi);
  {
    RuleCacheLock lock(st);
    auto it = st.rule_cache.find(key);
    if (it != st.rule_cache.end()) return &it->second;
  }
  PyObject* tuple = PyTuple_New(nargs);
  if (tuple == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
  PyObject* answer = PyObject_CallOneArg(st.rule, tuple);
  Py_DECREF(tuple);
  if (answer == nullptr) return nullptr;
  std::vector<OutSpec> specs;
  bool ok = PyList_Check(answer) && PyList_GET_SIZE(answer) == static_cast<Py_ssize_t>(st.n_out);
  for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(answer); ++k) {
    PyObject* item = PyList_GET_ITEM(answer, k);  // (shape tuple, TypeCode)
    ok = PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2 && PyTuple_Check(PyTuple_GET_ITEM(item, 0));
    if (!ok) break;
    OutSpec spec;
    PyObject* shape = PyTuple_GET_ITEM(item, 0);
    for (Py_ssize_t d = 0; ok && d < PyTuple_GET_SIZE(shape); ++d) {
      spec.shape.push_back(PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d)));
      ok = !PyErr_Occurred();
    }
    spec.type = ok ? static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(item, 1))) : 0;
    ok = ok && !PyErr_Occurred();
    specs.push_back(std::move(spec));
  }
  Py_DECREF(answer);
  if (!ok) return nullptr;
  RuleCacheLock lock(st);  // not held while the rule runs: it is Python, and may call this op again
  if (st.rule_cache.size() >= kRuleCacheSize) {  // bounded under changing shapes
    *spill = std::move(specs);
    return spill;
  }
  return &st.rule_cache.emplace(std::move(key), std::move(specs)).first->second;  // another thread's answer
                                                                                  // to the same key stays
}

// *t* (contiguous or rows at a stride, as View admits it) as ByteRows.
inline bool RowsOf(const DLTensor& t, rows::ByteRows* r) {
  return rows::of(t.ndim, t.shape, t.strides, ItemBytes(t.dtype), reinterpret_cast<int64_t>(t.data), r);
}

// Whether an argument the op writes shares a byte with another tensor argument (*dl*, *ffi*: the
// arguments' views, contiguous or rows at a stride: exact, so that vLLM's query and key slices of one
// qkv tensor, which interleave, are apart).
inline bool Overlaps(const OpState& st, const DLTensor* dl, const TVMFFIAny* ffi) {
  const size_t n = st.kinds.size();
  for (int m : st.mutated) {
    if (ffi[m].type_index != kTVMFFIDLTensorPtr) continue;
    rows::ByteRows rm, rj;
    if (!RowsOf(dl[m], &rm)) return true;
    const int64_t me = rows::end(rm);
    for (size_t j = 0; j < n; ++j) {
      if (static_cast<int>(j) == m || ffi[j].type_index != kTVMFFIDLTensorPtr) continue;
      if (rm.n == 1 && dl[j].strides == nullptr) {  // the common case: two spans
        const auto jb = reinterpret_cast<int64_t>(dl[j].data);
        const int64_t je = jb + Bytes(dl[j]);
        if (rm.bytes != 0 && jb != je && jb < me && rm.begin < je) return true;
        continue;
      }
      if (!RowsOf(dl[j], &rj) || rows::meet(rm, rj)) return true;
    }
  }
  return false;
}

inline bool IntList(PyObject* seq, std::vector<int>* out) {
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
}  // namespace entry
}  // namespace opbridge
