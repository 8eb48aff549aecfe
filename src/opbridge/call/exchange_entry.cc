// The tensor entry: an op's public callable on the tensors of other frameworks, read with no framework
// headers. Its first reader (here) serves any tensor type that exports DLPack's C exchange table
// (__dlpack_c_exchange_api__, dlpack.h's DLPackExchangeAPI): Paddle's today; its second
// (method_arrays.h) tensor types read through their methods: MindSpore's. One builtin per (op, tensor
// type) (opb_ex_entry, opb_ex_method_entry), which the adapter puts first in the op's public callable.
//
// It reads each tensor through the table's dltensor_from_py_object_no_sync (the framework fills a
// DLTensor on our stack: no capsule, no Python frame) and makes each new output in memory of its own,
// handed to the framework through managed_tensor_to_py_object_no_sync once the kernel has written it.
// It takes what the adapter's Python fast path takes: tensors of that type on the CPU (the dispatching
// one exactly, the others may be a subclass: a model's parameters),
// contiguous (or rows at a stride where the op declares row_strided), the dispatching tensor's dtype
// among the declared ones, no written argument overlapping another tensor, no gradient to record
// (grad mode off, or no tensor argument that needs one), Python scalars; below the pool's threshold.
// Everything else returns NotImplemented, having written nothing the caller can see: the Python path
// takes the call (autograd, GPUs, strided copies, large outputs from the pool, the named errors).
//
// What it saves on Paddle: _C_ops.empty (about 0.9 us a call: an output here costs about 0.6 us), the
// DLPack conversion in tvm-ffi's Python binding, and the Python frames of the dispatch and the fast
// path. The call itself is the C entries' shared one (py_entry.h, beside it).
//
// It depends on the Python C ABI only (the framework is reached through the table), so it is built
// once per interpreter, never into an op's kernel module.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#include "py_entry.h"  // the shared call

#include "method_arrays.h"  // the second reader: tensor types read through their methods

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

#include <pthread.h>

#define OPB_EX_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

namespace entry = opbridge::entry;

constexpr int kMaxOutDims = 16;
constexpr size_t kAlign = 64;

// One op on one tensor type.
struct ExchangeState : entry::OpState {
  PyTypeObject* type = nullptr;            // the tensor type (the dispatching tensor's exactly)
  const DLPackExchangeAPI* api = nullptr;  // its exchange table
  PyObject* grad_enabled = nullptr;        // () -> bool: whether the framework records gradients now
  PyObject* no_grad_attr = nullptr;        // a tensor attribute, true when it needs no gradient ("stop_gradient")
  PyObject* bump = nullptr;                // a method called on each argument the kernel wrote, or null
};

// The new outputs' memory, recycled: a buffer a framework frees comes back here for the next output
// of its size class. Without it each output was fresh memory from malloc, which in a Paddle process
// faulted in about one page per call (0.55 faults a call at 2 KiB, 1.04 from 16 KiB: 1.6 us a call
// at 8 x 64 float32, against 0.5 us at 8 elements). Classes are powers of two from 64 bytes up to
// the pool's threshold (outputs beyond it take the Python path and opbridge's pool); at most
// kKeepBytes wait here in all. Buffers are freed from any thread: one lock.
class Buffers {
 public:
  static constexpr int kMinLog = 6;
  static constexpr int kClasses = 17;  // 64 B .. 4 MiB
  static constexpr size_t kKeepBytes = size_t(8) << 20;

  static Buffers& Instance() {
    static Buffers* b = [] {
      auto* made = new Buffers();  // never destroyed: tensors may be freed at exit
      // A child forked while another thread held the lock would wait for it forever: it starts unlocked.
      pthread_atfork(nullptr, nullptr, [] { new (&Instance().mu_) std::mutex(); });
      return made;
    }();
    return *b;
  }
  // A buffer of at least *bytes* (64-byte aligned), its class in *cls*; null when out of memory.
  void* Take(size_t bytes, int* cls) {
    int c = 0;
    while (c < kClasses - 1 && (size_t(1) << (c + kMinLog)) < bytes) ++c;
    *cls = c;
    const size_t size = size_t(1) << (c + kMinLog);
    if (size < bytes) return std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_[c].empty()) {
        void* p = free_[c].back();
        free_[c].pop_back();
        kept_ -= size;
        return p;
      }
    }
    return std::aligned_alloc(kAlign, size);
  }
  void Give(void* p, int cls, size_t bytes) {
    const size_t size = size_t(1) << (cls + kMinLog);
    if (size >= bytes) {
      std::lock_guard<std::mutex> lock(mu_);
      if (kept_ + size <= kKeepBytes) {
        free_[cls].push_back(p);
        kept_ += size;
        return;
      }
    }
    std::free(p);
  }

 private:
  std::mutex mu_;
  std::vector<void*> free_[kClasses];
  size_t kept_ = 0;
};

// A new output's memory: ours until managed_tensor_to_py_object_no_sync takes it.
struct Owned {
  DLManagedTensorVersioned managed;
  int64_t shape[kMaxOutDims];
  int cls;
  size_t bytes;
};

std::atomic<int64_t> live{0};  // outputs made and not yet freed by their framework

void Free(DLManagedTensorVersioned* m) {
  auto* o = reinterpret_cast<Owned*>(m);  // managed is Owned's first member
  Buffers::Instance().Give(m->dl_tensor.data, o->cls, o->bytes);
  delete o;
  live.fetch_sub(1, std::memory_order_relaxed);
}

struct ExchangeArrays {
  using State = ExchangeState;
  using Out = Owned*;

  // The dispatching tensor's type, and nothing to record for autograd (out= included).
  static bool Lead(State& st, PyObject* const* args, PyObject* const* outs, size_t n_outs) {
    if (Py_TYPE(args[st.dtype_arg]) != st.type) return false;
    PyObject* on = PyObject_CallNoArgs(st.grad_enabled);
    if (on == nullptr) {
      PyErr_Clear();
      return false;
    }
    const int grad = PyObject_IsTrue(on);
    Py_DECREF(on);
    if (grad < 0) {
      PyErr_Clear();
      return false;
    }
    if (grad == 0) return true;
    for (size_t i = 0; i < st.kinds.size(); ++i) {
      const int kind = st.kinds[i];
      if ((kind == entry::kTensor || kind == entry::kOptionalTensor) && !NoGrad(st, args[i])) return false;
    }
    for (size_t k = 0; k < n_outs; ++k) {
      if (!NoGrad(st, outs[k])) return false;
    }
    return true;
  }

  // Whether *t* (a tensor of the entry's type or a subclass; anything else View refuses) needs no gradient.
  static bool NoGrad(State& st, PyObject* t) {
    if (!PyObject_TypeCheck(t, st.type)) return true;
    PyObject* no_grad = PyObject_GetAttr(t, st.no_grad_attr);
    const int no = no_grad == nullptr ? -1 : PyObject_IsTrue(no_grad);
    Py_XDECREF(no_grad);
    if (no <= 0) {
      PyErr_Clear();
      return false;  // a tensor that needs a gradient: the Python path records it (or refuses out=)
    }
    return true;
  }

  static bool View(State& st, PyObject* o, DLTensor* d, int64_t* strides, int64_t*, bool) {
    // a subclass too (a framework's parameter type) beside the dispatching tensor, which Lead wants exact
    if (!PyObject_TypeCheck(o, st.type) || st.api->dltensor_from_py_object_no_sync(o, d) != 0) {
      PyErr_Clear();
      return false;
    }
    if (d->device.device_type != kDLCPU) return false;
    if (d->byte_offset != 0) {
      d->data = static_cast<char*>(d->data) + d->byte_offset;
      d->byte_offset = 0;
    }
    opbridge::rows::ByteRows r;
    if (!opbridge::rows::of(d->ndim, d->shape, d->strides, 1, 0, &r)) return false;
    if (r.n == 1) {  // contiguous (dims of size one at any stride): the kernel reads it as compact
      d->strides = nullptr;
      return true;
    }
    // rows at a stride, for an argument the op declares row_strided (opbridge/byte_rows.h's one rule)
    if (strides == nullptr || d->ndim > entry::kMaxRowsDims) return false;
    if (!opbridge::rows::accepts(d->ndim, d->shape, d->strides)) return false;
    for (int k = 0; k < d->ndim; ++k) strides[k] = d->strides[k];  // the framework's, valid until we return
    d->strides = strides;
    return true;
  }

  static bool New(State&, PyObject*, const DLTensor* like, const entry::OutSpec* spec, Out* out, DLTensor* d) {
    const int ndim = spec != nullptr ? static_cast<int>(spec->shape.size()) : like->ndim;
    if (ndim > kMaxOutDims) return false;
    auto* o = new (std::nothrow) Owned();
    if (o == nullptr) return false;
    DLTensor& t = o->managed.dl_tensor;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = ndim;
    t.dtype = spec != nullptr ? entry::FromTypeCode(spec->type) : like->dtype;
    for (int k = 0; k < ndim; ++k) o->shape[k] = spec != nullptr ? spec->shape[k] : like->shape[k];
    t.shape = o->shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    o->bytes = static_cast<size_t>(entry::Bytes(t));
    t.data = Buffers::Instance().Take(o->bytes, &o->cls);
    if (t.data == nullptr) {
      delete o;
      return false;
    }
    o->managed.version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
    // Set, though the deleter does not need it: Paddle 3.3 never calls the deleter of a tensor whose
    // manager_ctx is null, and every output would leak (test_exchange_entry checks Live()).
    o->managed.manager_ctx = o;
    o->managed.deleter = Free;
    o->managed.flags = 0;
    live.fetch_add(1, std::memory_order_relaxed);
    *out = o;
    *d = t;
    return true;
  }

  static PyObject* Finish(State& st, Out& out) {
    void* py = nullptr;
    // The table takes the tensor, also when it fails (a Python error is then set).
    if (st.api->managed_tensor_to_py_object_no_sync(&out->managed, &py) != 0) return nullptr;
    return static_cast<PyObject*>(py);
  }

  static void Drop(Out& out) { Free(&out->managed); }

  static void Wrote(State& st, PyObject* arg) {
    if (st.bump == nullptr) return;
    PyObject* r = PyObject_CallMethodNoArgs(arg, st.bump);
    if (r == nullptr) {
      PyErr_Clear();
    } else {
      Py_DECREF(r);
    }
  }
};

}  // namespace

// New builtins for one op on tensors of *type*: *api* the type's exchange table (its capsule's
// pointer), *grad_enabled*, *no_grad_attr* and *bump* as ExchangeState says (*bump* None: nothing to
// call), then the op's facts (opbridge::entry::Init). Returns (builtin, out= builtin, capsule of its
// state) or None with a Python error set.
OPB_EX_EXPORT PyObject* opb_ex_entry(PyObject* type, void* api, PyObject* grad_enabled, PyObject* no_grad_attr,
                                     PyObject* bump, PyObject* kernel, void* handle, PyObject* kinds, PyObject* like,
                                     PyObject* rule, PyObject* returns, PyObject* mutated, PyObject* rows,
                                     int dtype_arg, PyObject* dtypes, int64_t max_out_bytes) {
  const auto* table = static_cast<const DLPackExchangeAPI*>(api);
  if (!PyType_Check(type) || table == nullptr || table->header.version.major != DLPACK_MAJOR_VERSION ||
      table->dltensor_from_py_object_no_sync == nullptr || table->managed_tensor_to_py_object_no_sync == nullptr) {
    PyErr_SetString(PyExc_TypeError, "opb_ex_entry: a tensor type with a DLPack exchange table of this major version");
    return nullptr;
  }
  auto* st = new ExchangeState();
  if (!entry::Init(st, kernel, handle, kinds, like, rule, returns, mutated, rows, dtype_arg, dtypes, max_out_bytes)) {
    delete st;
    return nullptr;
  }
  st->type = reinterpret_cast<PyTypeObject*>(Py_NewRef(type));
  st->api = table;
  st->grad_enabled = Py_NewRef(grad_enabled);
  st->no_grad_attr = Py_NewRef(no_grad_attr);
  st->bump = bump == Py_None ? nullptr : Py_NewRef(bump);
  return entry::Builtins<ExchangeArrays>(st, "opbridge_exchange_entry", "opbridge_exchange_entry_out");
}

// How many calls the entry of *capsule*'s op completed itself (either reader's).
OPB_EX_EXPORT int64_t opb_ex_calls(PyObject* capsule) { return entry::Calls(capsule); }

// How many outputs the entry made that their framework has not freed yet (a leak test's count).
OPB_EX_EXPORT int64_t opb_ex_live() { return live.load(std::memory_order_relaxed); }

// New builtins for one op on tensors of *type* read through their methods (method_arrays.h):
// *grad_enabled*, *before* (None: nothing), *new_output*, *host_attr* and *host_value*, *unready_attr*
// (None: none) as MethodState says, *dtypes* a list of (framework dtype, TypeCode), then the op's facts
// (opbridge::entry::Init). Returns (builtin, out= builtin, capsule of its state) or None with a Python
// error set.
OPB_EX_EXPORT PyObject* opb_ex_method_entry(PyObject* type, PyObject* grad_enabled, PyObject* before,
                                            PyObject* new_output, PyObject* host_attr, PyObject* host_value,
                                            PyObject* unready_attr, PyObject* dtypes, PyObject* kernel, void* handle,
                                            PyObject* kinds, PyObject* like, PyObject* rule, PyObject* returns,
                                            PyObject* mutated, PyObject* rows, int dtype_arg, PyObject* op_dtypes,
                                            int64_t max_out_bytes) {
  if (!PyType_Check(type) || !PyList_Check(dtypes) || !PyUnicode_Check(host_attr) ||
      (unready_attr != Py_None && !PyUnicode_Check(unready_attr))) {
    PyErr_SetString(PyExc_TypeError, "opb_ex_method_entry: a tensor type, attribute names and a list of dtypes");
    return nullptr;
  }
  auto* st = new MethodState();
  auto fail = [st]() -> PyObject* {  // the references taken so far go with the state
    for (auto& known : st->known_dtypes) Py_DECREF(known.first);
    for (PyObject* s : {st->s_data_ptr, st->s_shape, st->s_dtype, st->s_is_contiguous, st->s_stride}) Py_XDECREF(s);
    delete st;
    return nullptr;
  };
  st->s_data_ptr = PyUnicode_InternFromString("data_ptr");
  st->s_shape = PyUnicode_InternFromString("shape");
  st->s_dtype = PyUnicode_InternFromString("dtype");
  st->s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
  st->s_stride = PyUnicode_InternFromString("stride");
  if (!st->s_data_ptr || !st->s_shape || !st->s_dtype || !st->s_is_contiguous || !st->s_stride) return fail();
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(dtypes); ++k) {
    PyObject* pair = PyList_GET_ITEM(dtypes, k);
    const long code = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 ? PyLong_AsLong(PyTuple_GET_ITEM(pair, 1)) : -1;
    if (code < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "opb_ex_method_entry: dtypes are (dtype, TypeCode)");
      return fail();
    }
    st->known_dtypes.emplace_back(Py_NewRef(PyTuple_GET_ITEM(pair, 0)), entry::FromTypeCode(static_cast<int>(code)));
  }
  if (!entry::Init(st, kernel, handle, kinds, like, rule, returns, mutated, rows, dtype_arg, op_dtypes,
                   max_out_bytes)) {
    return fail();
  }
  st->type = reinterpret_cast<PyTypeObject*>(Py_NewRef(type));
  st->grad_enabled = Py_NewRef(grad_enabled);
  st->before = before == Py_None ? nullptr : Py_NewRef(before);
  st->new_output = Py_NewRef(new_output);
  st->host_attr = Py_NewRef(host_attr);
  st->host_value = Py_NewRef(host_value);
  st->unready_attr = unready_attr == Py_None ? nullptr : Py_NewRef(unready_attr);
  return entry::Builtins<MethodArrays>(st, "opbridge_method_entry", "opbridge_method_entry_out");
}
