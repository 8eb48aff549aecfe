// The C entries' call: an op's public callable on one framework's tensors, with no Python frame, no
// DLPack capsule and no trip through tvm-ffi's Python binding.
//
// Two entries use it: NumPy's (adapters/numpy/entry.cc: ndarrays, read through NumPy's C API) and the
// DLPack exchange entry (call/exchange_entry.cc: any tensor type that exports
// __dlpack_c_exchange_api__, Paddle's). What differs between them is how an argument is viewed as a
// DLTensor and how a new output is made; this header holds the rest, once:
//   - the op's state (OpState);
//   - the scalar arguments;
//   - the shape rule's answers, kept per argument signature (RuleSpecs);
//   - the test that an argument the op writes shares no memory with another (Overlaps);
//   - the kernel call, the error it raises (opbridge/raised_error.h: never a second run), the returns.
//
// Call<Arrays> is the whole call. Its Arrays policy supplies:
//   using State = ...;    // OpState, or a struct derived from it with the framework's own facts
//   using Out = ...;      // a new output before it is handed to Python
//   static bool Lead(State&, PyObject* const* args, PyObject* out);  // the dispatching argument's type;
//       // any gate (*out*: the caller's out=, or null)
//   static bool View(State&, PyObject* o, DLTensor* d, int64_t* strides);
//       // o as a DLTensor the kernel may read and write: contiguous, or, where *strides* is given (an
//       // argument the op declares row_strided, at most kMaxRowsDims dims), rows at a stride
//   static bool New(State&, PyObject* like, const DLTensor* like_dl, const OutSpec* spec, Out*, DLTensor*);
//       // a new contiguous output shaped like *like* or by *spec*; false: none (no Python error left)
//   static PyObject* Finish(State&, Out&);   // the output as a Python object (its reference moves)
//   static void Drop(Out&);                  // an output never handed out
//   static void Wrote(State&, PyObject* arg);  // after the kernel wrote argument (or out=) *arg*
// Anything an entry does not take returns NotImplemented having written nothing the caller can see;
// the Python path then takes the call with its own results and messages.
//
// Needs Python.h and tvm/ffi/c_api.h included first; local to the including translation unit.
#pragma once

#include <opbridge/byte_rows.h>
#include <opbridge/raised_error.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace opbridge {
namespace entry {
namespace {  // internal linkage: each entry's translation unit inlines and optimises its own copy

enum Kind : int { kTensor = 0, kFloat = 1, kInt = 2, kBool = 3, kOptionalTensor = 4 };

constexpr int kMaxArgs = 16;      // arguments and new outputs together (call.c_entry.takes)
constexpr int kMaxRowsDims = 8;   // a row-strided argument with more dims takes the Python path
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
  std::map<std::vector<int64_t>, std::vector<OutSpec>> rule_cache;  // by RuleKey; the GIL guards it;
                                                                     // insert only: answers stay put
  std::vector<int> returns;             // per return: output k as k, argument i (an alias) as -1 - i
  size_t n_out = 0;                     // new outputs: the returns >= 0
  std::vector<int> mutated;             // the tensor arguments the kernel writes
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
      if (PyFloat_CheckExact(o)) {
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

// The outputs' shapes and types from the op's shape rule, asked once per signature; null where the
// rule raises or answers something else (the Python path then takes the call and raises its error).
// Entries are never removed (the rule is Python: another thread may run while it does, and must not
// free an answer this one holds); past kRuleCacheSize signatures the answer goes to *spill* instead.
inline const std::vector<OutSpec>* RuleSpecs(OpState& st, PyObject* const* args, Py_ssize_t nargs,
                                             const DLTensor* dl, const TVMFFIAny* ffi,
                                             std::vector<OutSpec>* spill) {
  std::vector<int64_t> key = RuleKey(st, dl, ffi);
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
  if (st.rule_cache.size() >= kRuleCacheSize) {  // bounded under changing shapes
    *spill = std::move(specs);
    return spill;
  }
  return &st.rule_cache.emplace(std::move(key), std::move(specs)).first->second;
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

// The kernel on the arguments already viewed in *dl* and *ffi* (from index 1) and the caller's *out*:
// Call's out= half. *out* is viewed dense into slot 0 and must share no byte with an argument (the
// Python path then writes a fresh buffer and copies). Out of line: inlined into Call, it cost NumPy's
// shape-rule calls 0.02-0.035 us.
template <class Arrays>
[[gnu::noinline]] PyObject* CallInto(typename Arrays::State& st, PyObject* const* args, PyObject* out, DLTensor* dl,
                                     TVMFFIAny* ffi) {
  const size_t n = st.kinds.size();
  if (!Arrays::View(st, out, &dl[0], nullptr)) return NotHandled();
  rows::ByteRows ro, ra;
  if (!RowsOf(dl[0], &ro)) return NotHandled();
  for (size_t i = 0; i < n; ++i) {
    if (ffi[1 + i].type_index == kTVMFFIDLTensorPtr && (!RowsOf(dl[1 + i], &ra) || rows::meet(ro, ra))) {
      return NotHandled();
    }
  }
  ffi[0].type_index = kTVMFFIDLTensorPtr;
  ffi[0].zero_padding = 0;
  ffi[0].v_ptr = &dl[0];
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc;
  if (Bytes(dl[0]) >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + 1), &result);
    Py_END_ALLOW_THREADS
  } else {
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + 1), &result);
  }
  if (rc != 0) return set_python_error(take_raised_error());  // never a second run (raised_error.h)
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) TVMFFIObjectDecRef(result.v_obj);
  Arrays::Wrote(st, out);
  for (int m : st.mutated) {
    if (ffi[1 + m].type_index == kTVMFFIDLTensorPtr) Arrays::Wrote(st, args[m]);
  }
  st.calls.fetch_add(1, std::memory_order_relaxed);
  return Py_NewRef(out);
}

// The call of the op on *args* (the schema's arguments in order): new outputs, or, with *out* (the
// caller's out= of an op with one new output, which it returns), the kernel writes *out*, which must
// be dense, of the entry's type and apart from every argument.
template <class Arrays>
PyObject* Call(typename Arrays::State& st, PyObject* const* args, Py_ssize_t nargs, PyObject* out = nullptr) {
  using Out = typename Arrays::Out;
  const size_t n = st.kinds.size(), n_out = st.n_out;
  if (static_cast<size_t>(nargs) != n || n + n_out > kMaxArgs) return NotHandled();
  if (out != nullptr && (n_out != 1 || st.returns.size() != 1 || st.returns[0] != 0)) return NotHandled();
  if (!Arrays::Lead(st, args, out)) return NotHandled();

  DLTensor dl[kMaxArgs];
  TVMFFIAny ffi[kMaxArgs];
  int64_t strides[kMaxArgs][kMaxRowsDims];  // row-strided arguments' element strides
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = args[i];
    TVMFFIAny& a = ffi[n_out + i];
    a.zero_padding = 0;
    a.v_int64 = 0;
    const int kind = st.kinds[i];
    if (kind == kOptionalTensor && o == Py_None) {
      a.type_index = kTVMFFINone;
    } else if (kind == kTensor || kind == kOptionalTensor) {
      if (!Arrays::View(st, o, &dl[n_out + i], st.rows[i] ? strides[i] : nullptr)) return NotHandled();
      a.type_index = kTVMFFIDLTensorPtr;
      a.v_ptr = &dl[n_out + i];
    } else if (!Scalar(kind, o, &a)) {
      return NotHandled();
    }
  }
  const TVMFFIAny& lead = ffi[n_out + st.dtype_arg];
  if (lead.type_index != kTVMFFIDLTensorPtr) return NotHandled();
  const DLTensor& lead_dl = dl[n_out + st.dtype_arg];
  const int lead_type = TypeCode(lead_dl.dtype);
  bool declared = false;
  for (int t : st.dtypes) declared |= t == lead_type;
  if (!declared) return NotHandled();
  // A written argument that overlaps another tensor: the Python path names the pair and raises.
  if (!st.mutated.empty() && Overlaps(st, dl + n_out, ffi + n_out)) return NotHandled();
  if (out != nullptr) return CallInto<Arrays>(st, args, out, dl, ffi);

  const std::vector<OutSpec>* specs = nullptr;
  std::vector<OutSpec> spill;
  if (st.rule != nullptr && (specs = RuleSpecs(st, args, nargs, dl + n_out, ffi + n_out, &spill)) == nullptr) {
    PyErr_Clear();
    return NotHandled();
  }
  Out outs[kMaxArgs];
  size_t made = 0;
  auto drop = [&](size_t from) {
    for (size_t k = from; k < made; ++k) Arrays::Drop(outs[k]);
  };
  for (size_t k = 0; k < n_out; ++k) {
    // below the pool's threshold only: larger outputs come from opbridge's pool on the Python path
    const OutSpec* spec = specs != nullptr ? &(*specs)[k] : nullptr;
    const DLTensor* like = spec == nullptr ? &dl[n_out + st.like[k]] : nullptr;
    int64_t bytes = spec == nullptr ? Bytes(*like) : ItemBytes(FromTypeCode(spec->type));
    if (spec != nullptr) {
      for (int64_t d : spec->shape) bytes *= d;
    }
    if (bytes >= st.max_out_bytes ||
        !Arrays::New(st, spec == nullptr ? args[st.like[k]] : nullptr, like, spec, &outs[k], &dl[k])) {
      drop(0);
      return NotHandled();
    }
    ++made;
    ffi[k].type_index = kTVMFFIDLTensorPtr;
    ffi[k].zero_padding = 0;
    ffi[k].v_ptr = &dl[k];
  }

  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  // The GIL is released around a kernel on 256 KiB or more, as tvm-ffi's Python calls release it:
  // other Python threads run meanwhile. Below that, releasing and taking it back costs more than the
  // kernel's own time.
  int rc;
  if (Bytes(lead_dl) >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
    Py_END_ALLOW_THREADS
  } else {
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
  }
  if (rc != 0) {  // raised here, as tvm-ffi's binding raises it: never a second run (raised_error.h)
    const RaisedError err = take_raised_error();
    drop(0);
    return set_python_error(err);
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) TVMFFIObjectDecRef(result.v_obj);
  PyObject* done[kMaxArgs];
  for (size_t k = 0; k < n_out; ++k) {
    done[k] = Arrays::Finish(st, outs[k]);
    if (done[k] == nullptr) {  // the kernel ran: raise (a Python error is set), never hand the call on
      for (size_t p = 0; p < k; ++p) Py_DECREF(done[p]);
      drop(k + 1);
      return nullptr;
    }
  }
  for (int m : st.mutated) {
    if (ffi[n_out + m].type_index == kTVMFFIDLTensorPtr) Arrays::Wrote(st, args[m]);
  }
  st.calls.fetch_add(1, std::memory_order_relaxed);
  // The schema's returns: a new output (its reference moves) or an argument the op wrote.
  auto result_of = [&](int r) { return r >= 0 ? done[r] : Py_NewRef(args[-1 - r]); };
  const size_t n_ret = st.returns.size();
  if (n_ret == 1) return result_of(st.returns[0]);
  PyObject* tuple = n_ret == 0 ? nullptr : PyTuple_New(static_cast<Py_ssize_t>(n_ret));
  if (tuple == nullptr) {
    for (size_t k = 0; k < n_out; ++k) Py_DECREF(done[k]);
    if (n_ret == 0) Py_RETURN_NONE;
    return nullptr;
  }
  for (size_t k = 0; k < n_ret; ++k) PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(k), result_of(st.returns[k]));
  return tuple;
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

// Fills *st* from what the entry's constructor was given (call.c_entry.op_facts): *kernel* the op's
// tvm_ffi.Function and *handle* its C handle, *kinds* per schema argument (Kind), *like* per output
// the argument it is shaped like, or else *rule* (None with *like*), *returns* per schema return the
// output k (k) or the argument i it aliases (-1 - i), *mutated* the tensor arguments the kernel
// writes, *rows* those it takes as rows at a stride, *dtype_arg*, the declared *dtypes* (TypeCodes)
// and *max_out_bytes*, the pool's threshold. False with a Python error set.
inline bool Init(OpState* st, PyObject* kernel, void* handle, PyObject* kinds, PyObject* like, PyObject* rule,
                 PyObject* returns, PyObject* mutated, PyObject* rows, int dtype_arg, PyObject* dtypes,
                 int64_t max_out_bytes) {
  std::vector<int> row_args;
  if (!IntList(kinds, &st->kinds) || !IntList(like, &st->like) || !IntList(returns, &st->returns) ||
      !IntList(mutated, &st->mutated) || !IntList(rows, &row_args) || !IntList(dtypes, &st->dtypes)) {
    return false;
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
  return true;
}

// The builtins *def* (the call) and *def_out* (the call with out= last) on the state in *capsule*
// (which they keep), as (builtin, out= builtin, capsule); None with a Python error set.
inline PyObject* Builtins(PyMethodDef* def, PyMethodDef* def_out, PyObject* capsule) {
  if (capsule == nullptr) return nullptr;
  PyObject* fn = PyCFunction_NewEx(def, capsule, nullptr);
  PyObject* fn_out = fn == nullptr ? nullptr : PyCFunction_NewEx(def_out, capsule, nullptr);
  PyObject* triple = fn_out == nullptr ? nullptr : PyTuple_Pack(3, fn, fn_out, capsule);
  Py_XDECREF(fn);
  Py_XDECREF(fn_out);
  Py_DECREF(capsule);
  return triple;
}

// The call with out= (its last argument), for a builtin's METH_FASTCALL function.
template <class Arrays>
PyObject* CallWithOut(typename Arrays::State& st, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) return NotHandled();
  return Call<Arrays>(st, args, nargs - 1, args[nargs - 1]);
}

}  // namespace
}  // namespace entry
}  // namespace opbridge
