// The C entries' call: an op's public callable on one framework's tensors, with no Python frame, no
// DLPack capsule and no trip through tvm-ffi's Python binding.
//
// Three readers use it: NumPy's (adapters/numpy/entry.cc: ndarrays, read through NumPy's C API), and
// the tensor entry's two (call/exchange_entry.cc): any tensor type that exports
// __dlpack_c_exchange_api__ (Paddle's), read through that table, and tensor types read through their
// methods (method_arrays.h: MindSpore's). What differs between them is how an argument is viewed as a
// DLTensor and how a new output is made; the rest is held once, here and in entry_state.h beside it:
//   - the op's state (OpState), the scalar arguments, the shape rule's answers kept per argument
//     signature (RuleSpecs), the test that an argument the op writes shares no memory with another
//     (Overlaps): entry_state.h;
//   - the kernel call, the error it raises (opbridge/raised_error.h: never a second run), the returns,
//     out=, and the builtins that run it (Builtins, Calls): here.
//
// Call<Arrays> is the whole call. Its Arrays policy supplies:
//   using State = ...;    // OpState, or a struct derived from it with the framework's own facts
//   using Out = ...;      // a new output before it is handed to Python
//   static bool Lead(State&, PyObject* const* args, PyObject* const* outs, size_t n_outs);  // the
//       // dispatching argument's type; any gate (*outs*: the caller's out=, one per output; none: 0)
//   static bool View(State&, PyObject* o, DLTensor* d, int64_t* strides, int64_t* dims, bool written);
//       // o as a DLTensor the kernel may read (and write, where *written*: an argument the op writes,
//       // or out=): contiguous, or, where *strides* is given (an argument the op declares
//       // row_strided, at most kMaxRowsDims dims), rows at a stride; *dims* is room for kMaxViewDims
//       // dims, valid for the call, for a reader whose tensors hold no shape array of their own
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

#include <opbridge/raised_error.h>

#include <algorithm>

#include "entry_state.h"  // OpState, OutSpec, TypeCode, Scalar, RuleSpecs, Overlaps, IntList

namespace opbridge {
namespace entry {
namespace {  // internal linkage: each entry's translation unit inlines and optimises its own copy

// Whether the caller's out=, viewed in *dl[0..n_out)*, has the shapes and types of the op's outputs: their
// `like` arguments', or the shape rule's answer. A kernel writes each output as the rule says it is, so
// any other buffer would be written past its end or given another type's bits; the Python path then
// raises the ValueError that names both (call.core.check_outs).
template <class Arrays>
bool OutsMatch(typename Arrays::State& st, PyObject* const* args, Py_ssize_t nargs, const DLTensor* dl,
               const TVMFFIAny* ffi) {
  const size_t n_out = st.n_out;
  const std::vector<OutSpec>* specs = nullptr;
  std::vector<OutSpec> spill;
  if (st.rule != nullptr && (specs = RuleSpecs(st, args, nargs, dl + n_out, ffi + n_out, &spill)) == nullptr) {
    PyErr_Clear();
    return false;
  }
  for (size_t k = 0; k < n_out; ++k) {
    const DLTensor& o = dl[k];
    if (specs == nullptr) {
      if (ffi[n_out + st.like[k]].type_index != kTVMFFIDLTensorPtr) return false;  // as Call declines it
      const DLTensor& like = dl[n_out + st.like[k]];
      if (TypeCode(o.dtype) != TypeCode(like.dtype) || o.ndim != like.ndim ||
          !std::equal(o.shape, o.shape + o.ndim, like.shape)) {
        return false;
      }
    } else {
      const OutSpec& s = (*specs)[k];
      if (TypeCode(o.dtype) != s.type || static_cast<size_t>(o.ndim) != s.shape.size() ||
          !std::equal(o.shape, o.shape + o.ndim, s.shape.begin())) {
        return false;
      }
    }
  }
  return true;
}

// The kernel on the arguments already viewed in *dl* and *ffi* (from index n_out) and the caller's
// out= (*outs*: one array per output, *out* the object to return: that array, or the tuple holding
// them): Call's out= half. Each is viewed dense into its slot and must share no byte with an argument
// or another output (the Python path then writes fresh buffers and copies). Out of line: inlined into
// Call, it cost NumPy's shape-rule calls 0.02-0.035 us.
template <class Arrays>
[[gnu::noinline]] PyObject* CallInto(typename Arrays::State& st, PyObject* const* args, Py_ssize_t nargs,
                                     PyObject* out, PyObject* const* outs, DLTensor* dl, TVMFFIAny* ffi) {
  const size_t n = st.kinds.size(), n_out = st.n_out;
  int64_t dims[kMaxArgs][kMaxViewDims];
  rows::ByteRows ro[kMaxArgs], ra;
  int64_t bytes = 0;
  for (size_t k = 0; k < n_out; ++k) {
    if (!Arrays::View(st, outs[k], &dl[k], nullptr, dims[k], true) || !RowsOf(dl[k], &ro[k])) return NotHandled();
    for (size_t p = 0; p < k; ++p) {
      if (rows::meet(ro[k], ro[p])) return NotHandled();
    }
    bytes += Bytes(dl[k]);
  }
  if (!OutsMatch<Arrays>(st, args, nargs, dl, ffi)) return NotHandled();
  for (size_t i = 0; i < n; ++i) {
    if (ffi[n_out + i].type_index != kTVMFFIDLTensorPtr) continue;
    if (!RowsOf(dl[n_out + i], &ra)) return NotHandled();
    for (size_t k = 0; k < n_out; ++k) {
      if (rows::meet(ro[k], ra)) return NotHandled();
    }
  }
  for (size_t k = 0; k < n_out; ++k) {
    ffi[k].type_index = kTVMFFIDLTensorPtr;
    ffi[k].zero_padding = 0;
    ffi[k].v_ptr = &dl[k];
  }
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc;
  if (bytes >= kReleaseGilBytes) {
    Py_BEGIN_ALLOW_THREADS
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
    Py_END_ALLOW_THREADS
  } else {
    rc = TVMFFIFunctionCall(st.handle, ffi, static_cast<int32_t>(n + n_out), &result);
  }
  if (rc != 0) return set_python_error(take_raised_error());  // never a second run (raised_error.h)
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) TVMFFIObjectDecRef(result.v_obj);
  for (size_t k = 0; k < n_out; ++k) Arrays::Wrote(st, outs[k]);
  for (int m : st.mutated) {
    if (ffi[n_out + m].type_index == kTVMFFIDLTensorPtr) Arrays::Wrote(st, args[m]);
  }
  st.calls.fetch_add(1, std::memory_order_relaxed);
  return Py_NewRef(out);
}

// Whether the op's returns are its new outputs, in order, and nothing else: the ops whose out= the entry
// takes (call.core.returns_its_outs), which return it.
inline bool ReturnsItsOuts(const OpState& st) {
  if (st.n_out == 0 || st.returns.size() != st.n_out) return false;
  for (size_t k = 0; k < st.n_out; ++k) {
    if (st.returns[k] != static_cast<int>(k)) return false;
  }
  return true;
}

// The call of the op on *args* (the schema's arguments in order): new outputs, or, with *out* (the
// caller's out= of an op whose returns are its new outputs: one array, or a tuple of one per output),
// the kernel writes *out*, which it returns: dense, of the entry's type and apart from every argument.
template <class Arrays>
PyObject* Call(typename Arrays::State& st, PyObject* const* args, Py_ssize_t nargs, PyObject* out = nullptr) {
  using Out = typename Arrays::Out;
  const size_t n = st.kinds.size(), n_out = st.n_out;
  if (static_cast<size_t>(nargs) != n || n + n_out > kMaxArgs) return NotHandled();
  PyObject* const* given = nullptr;  // the caller's out=, one per output
  if (out != nullptr) {
    if (!ReturnsItsOuts(st)) return NotHandled();
    if (n_out == 1) {
      given = &out;
    } else if (PyTuple_CheckExact(out) && static_cast<size_t>(PyTuple_GET_SIZE(out)) == n_out) {
      given = reinterpret_cast<PyTupleObject*>(out)->ob_item;
    } else {
      return NotHandled();
    }
  }
  if (!Arrays::Lead(st, args, given, out == nullptr ? 0 : n_out)) return NotHandled();

  DLTensor dl[kMaxArgs];
  TVMFFIAny ffi[kMaxArgs];
  int64_t strides[kMaxArgs][kMaxRowsDims];  // row-strided arguments' element strides
  int64_t dims[kMaxArgs][kMaxViewDims];     // room for the arguments' shapes (a reader that needs it)
  for (size_t i = 0; i < n; ++i) {
    PyObject* o = args[i];
    TVMFFIAny& a = ffi[n_out + i];
    a.zero_padding = 0;
    a.v_int64 = 0;
    const int kind = st.kinds[i];
    if (kind == kOptionalTensor && o == Py_None) {
      a.type_index = kTVMFFINone;
    } else if (kind == kTensor || kind == kOptionalTensor) {
      if (!Arrays::View(st, o, &dl[n_out + i], st.rows[i] ? strides[i] : nullptr, dims[i], st.written[i])) {
        return NotHandled();
      }
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
  if (out != nullptr) return CallInto<Arrays>(st, args, nargs, out, given, dl, ffi);

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
    // like() names a Tensor argument (the declaration checks it); a slot that holds none is declined.
    if (spec == nullptr && ffi[n_out + st.like[k]].type_index != kTVMFFIDLTensorPtr) {
      drop(0);
      return NotHandled();
    }
    const DLTensor* like = spec == nullptr ? &dl[n_out + st.like[k]] : nullptr;
    int64_t bytes = spec == nullptr ? Bytes(*like) : ItemBytes(FromTypeCode(spec->type));
    bool sized = true;  // a shape rule's dims >= 0, their byte count within int64 (else the checked path)
    if (spec != nullptr) {
      for (int64_t d : spec->shape) sized = sized && d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes);
    }
    if (!sized || bytes >= st.max_out_bytes ||
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
  st->written.assign(st->kinds.size(), 0);
  for (int i : st->mutated) {
    if (i >= 0 && static_cast<size_t>(i) < st->written.size()) st->written[i] = 1;
  }
  st->kernel = Py_NewRef(kernel);
  st->rule = rule == Py_None ? nullptr : Py_NewRef(rule);
  for (int r : st->returns) st->n_out += r >= 0;
  st->handle = handle;
  st->dtype_arg = dtype_arg;
  st->max_out_bytes = max_out_bytes;
  return true;
}

// The state an entry's builtin holds (its `self`, a capsule made by Builtins, which holds it as its
// OpState, so that one Calls reads every reader's counter).
template <class Arrays>
typename Arrays::State& StateOf(PyObject* capsule) {
  return static_cast<typename Arrays::State&>(*static_cast<OpState*>(PyCapsule_GetPointer(capsule, nullptr)));
}

// The builtins' C functions: the call, and the call with out= as its last argument.
template <class Arrays>
PyObject* CallFn(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return Call<Arrays>(StateOf<Arrays>(self), args, nargs);
}

template <class Arrays>
PyObject* CallOutFn(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) return NotHandled();
  return Call<Arrays>(StateOf<Arrays>(self), args, nargs - 1, args[nargs - 1]);
}

// One op's builtins on *st* (kept for the life of the process: builtins may outlive their callers),
// named *name* and *name_out*, as (builtin, out= builtin, capsule of the state); None with a Python
// error set. Each entry names its builtins once (the method tables are made on the first call).
template <class Arrays>
PyObject* Builtins(typename Arrays::State* st, const char* name, const char* name_out) {
  static PyMethodDef def = {
      name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CallFn<Arrays>)), METH_FASTCALL,
      "The op on its schema's arguments in order; NotImplemented where the Python path must take the call."};
  static PyMethodDef def_out = {
      name_out, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CallOutFn<Arrays>)), METH_FASTCALL,
      "The op on its schema's arguments in order, then out=; NotImplemented where the Python path must take "
      "the call."};
  PyObject* capsule = PyCapsule_New(static_cast<OpState*>(st), nullptr, nullptr);
  if (capsule == nullptr) return nullptr;
  PyObject* fn = PyCFunction_NewEx(&def, capsule, nullptr);
  PyObject* fn_out = fn == nullptr ? nullptr : PyCFunction_NewEx(&def_out, capsule, nullptr);
  PyObject* triple = fn_out == nullptr ? nullptr : PyTuple_Pack(3, fn, fn_out, capsule);
  Py_XDECREF(fn);
  Py_XDECREF(fn_out);
  Py_DECREF(capsule);
  return triple;
}

// How many calls the entry whose state *capsule* holds (any reader's: Builtins) completed itself; -1
// (a Python error set) for another object.
inline int64_t Calls(PyObject* capsule) {
  auto* st = static_cast<OpState*>(PyCapsule_GetPointer(capsule, nullptr));
  return st == nullptr ? -1 : st->calls.load(std::memory_order_relaxed);
}

}  // namespace
}  // namespace entry
}  // namespace opbridge
