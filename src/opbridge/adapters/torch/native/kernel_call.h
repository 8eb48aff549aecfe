// One call of an op's compiled tvm-ffi kernel on dense tensors: what the dispatcher's device kernel
// (shim.cc) and the public callable's C entry (python_entry.h) both run.
#pragma once

#include "op_state.h"
#include "python_calls.h"

#include <opbridge/byte_rows.h>
#include <opbridge/raised_error.h>

#ifdef OPB_WITH_CUDA
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif

namespace opbridge_native {

inline bool DLType(c10::ScalarType t, DLDataType* out) {
  using S = c10::ScalarType;
  switch (t) {
    case S::Float: *out = {kDLFloat, 32, 1}; return true;
    case S::Double: *out = {kDLFloat, 64, 1}; return true;
    case S::Half: *out = {kDLFloat, 16, 1}; return true;
    case S::BFloat16: *out = {kDLBfloat, 16, 1}; return true;
    case S::Long: *out = {kDLInt, 64, 1}; return true;
    case S::Int: *out = {kDLInt, 32, 1}; return true;
    case S::Short: *out = {kDLInt, 16, 1}; return true;
    case S::Char: *out = {kDLInt, 8, 1}; return true;
    case S::Byte: *out = {kDLUInt, 8, 1}; return true;
    case S::Bool: *out = {kDLBool, 8, 1}; return true;
    default: return false;
  }
}

// *t* (dense, on *device*) as the DLTensor *d*, passed as *a*; false for a dtype DLPack cannot name.
inline bool View(const at::Tensor& t, DLDevice device, DLTensor* d, TVMFFIAny* a) {
  if (!DLType(t.scalar_type(), &d->dtype)) return false;
  d->data = t.data_ptr();
  d->device = device;
  d->ndim = static_cast<int32_t>(t.dim());
  d->shape = const_cast<int64_t*>(t.sizes().data());
  d->strides = const_cast<int64_t*>(t.strides().data());
  d->byte_offset = 0;
  a->type_index = kTVMFFIDLTensorPtr;
  a->zero_padding = 0;
  a->v_ptr = d;
  return true;
}

// opbridge's pool of large CPU output buffers (include/opbridge/host_buffers.h), which the first
// opbridge module loaded registers; nullptr until then, or with modules built before it.
using HostApi = opbridge::host_buffers::Api;

inline const HostApi* GetHostApi() {
  static std::atomic<const HostApi*> api{nullptr};
  const HostApi* got = api.load(std::memory_order_acquire);
  if (got) return got;
  TVMFFIObjectHandle fn = nullptr;
  const TVMFFIByteArray name{opbridge::host_buffers::kApiGlobal, sizeof(opbridge::host_buffers::kApiGlobal) - 1};
  if (TVMFFIFunctionGetGlobal(&name, &fn) != 0 || !fn) return nullptr;
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  const int rc = TVMFFIFunctionCall(fn, nullptr, 0, &result);
  TVMFFIObjectDecRef(fn);
  if (rc != 0 || result.type_index != kTVMFFIInt) return nullptr;
  got = reinterpret_cast<const HostApi*>(result.v_int64);
  if (got->version < 1) return nullptr;
  api.store(got, std::memory_order_release);
  return got;
}

// A c10::Allocator over the pool, so a pool-backed output has an ordinary, resizable storage (a
// resize_ that grows it allocates through here again). Requests below the pool's 4 MiB threshold
// (a resize that shrinks, say) go to torch's own CPU allocator.
class PoolAllocator final : public c10::Allocator {
 public:
  PoolAllocator(const HostApi* api, int64_t min_bytes) : api_(api), min_(min_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (static_cast<int64_t>(n) < min_) return c10::GetCPUAllocator()->allocate(n);
    void* p = api_->alloc(n);
    TORCH_CHECK(p, "opbridge: out of memory allocating ", n, " bytes for an output");
    return {p, new Block{api_, p, n}, &Release, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  struct Block {
    const HostApi* api;
    void* p;
    size_t n;
  };
  static void Release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    b->api->release(b->p, b->n);
    delete b;
  }
  const HostApi* api_;
  int64_t min_;
};

// A new contiguous CPU tensor on a pool buffer (one allocator: one pool per process).
inline at::Tensor PoolEmpty(const HostApi* api, at::IntArrayRef sizes, at::ScalarType dtype) {
  static PoolAllocator allocator(api, opbridge::host_buffers::kMinBytes);
  return at::Tensor(at::detail::empty_generic(sizes, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                              std::nullopt));
}

// The large-output half of NewOutput, out of line so the small-output path stays short.
[[gnu::noinline, gnu::cold]] inline at::Tensor NewLargeOutput(at::IntArrayRef sizes, const at::TensorOptions& options,
                                                               bool* advise) {
  if (const HostApi* api = GetHostApi()) return PoolEmpty(api, sizes, options.dtype().toScalarType());
  *advise = true;
  return at::empty(sizes, options);
}

// A new contiguous output of *nbytes*. On the CPU, one of at least st.fresh_min bytes comes from the
// pool (recycled, 2 MiB-aligned huge pages) when it is there, else from at::empty with huge-page
// advice (*advise* says whether that is still due).
inline at::Tensor NewOutput(const OpState& st, at::IntArrayRef sizes, const at::TensorOptions& options,
                            int64_t nbytes, bool cpu, bool* advise) {
  *advise = false;
  if (cpu && st.fresh_min && nbytes >= st.fresh_min) return NewLargeOutput(sizes, options, advise);
  return at::empty(sizes, options);
}

// *t*'s memory as rows (opbridge/byte_rows.h): true when it is contiguous or rows at a stride.
inline bool Rows(const at::Tensor& t, opbridge::rows::ByteRows* r) {
  return opbridge::rows::of(static_cast<int>(t.dim()), t.sizes().data(), t.strides().data(),
                            static_cast<int64_t>(t.element_size()),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())), r);
}

// Whether *a* and *b* (each contiguous or rows at a stride, as RunKernel admits them) share a byte:
// exact, so that vLLM's query and key slices of one qkv tensor, which interleave, are apart.
// *dense*: the caller knows both are contiguous (two spans decide).
inline bool Overlap(const at::Tensor& a, const at::Tensor& b, bool dense = false) {
  if (dense || (a.is_contiguous() && b.is_contiguous())) {  // the common case: two spans
    auto s0 = reinterpret_cast<uintptr_t>(a.data_ptr()), s1 = reinterpret_cast<uintptr_t>(b.data_ptr());
    auto e0 = s0 + a.nbytes(), e1 = s1 + b.nbytes();
    return s0 != e0 && s1 != e1 && s1 < e0 && s0 < e1;
  }
  opbridge::rows::ByteRows ra, rb;
  if (!Rows(a, &ra) || !Rows(b, &rb)) return true;
  return opbridge::rows::meet(ra, rb);
}

// Whether *t*, not contiguous, is rows at a stride (an argument its op declares row_strided may be).
inline bool RowStrided(const at::Tensor& t) {
  return opbridge::rows::accepts(static_cast<int>(t.dim()), t.sizes().data(), t.strides().data());
}

// The op's kernel on *args* (schema order) when they are dense (or rows at a stride, where the op
// declares them row_strided), of a declared dtype and on one
// device: true when it ran. With *allocate*, the outputs are new and appended to *outs* (the `like`
// rule or the shape rule); else *outs* holds the caller's (out=), which must be dense, on that
// device too and apart from the arguments and each other in memory. False with `*raised` false leaves every tensor unwritten: nothing was handled (a
// kernel not loaded yet, overlapping mutated arguments, arguments it does not take) and the
// caller's slower path takes the call. False with `*raised` true: the kernel ran and raised, its
// error left in tvm-ffi's raised slot; the caller takes it at once (opbridge::take_raised_error),
// raises it and never runs the kernel again. (A flag, not the error: nothing to build per call.)
inline bool RunKernel(OpState& st, const c10::IValue* args, c10::SmallVectorImpl<at::Tensor>* outs, bool allocate,
                      bool* raised) {
  const size_t n = st.kinds.size();
  const c10::IValue& lead_v = args[st.dispatch_arg];
  if (!lead_v.isTensor() || !args[st.dtype_arg].isTensor()) return false;
  const at::Tensor& lead = lead_v.toTensor();
  const int dtype = static_cast<int>(args[st.dtype_arg].toTensor().scalar_type());
  if (dtype >= 64 || !(st.dtypes >> dtype & 1)) return false;
  const c10::Device device = lead.device();
  int dev;
  DLDevice dl_device;
  if (device.is_cpu()) {
    dev = kCPU;
    dl_device = {kDLCPU, 0};
#ifdef OPB_WITH_CUDA
  } else if (device.is_cuda()) {
    dev = kCUDA;
    dl_device = {kDLCUDA, device.index()};
#endif
  } else {
    return false;
  }
  TVMFFIObjectHandle kernel = st.kernel[dev].load(std::memory_order_acquire);
  if (kernel == nullptr) return false;

  const size_t n_out = st.n_outputs;
  if (!allocate && outs->size() != n_out) return false;
  c10::SmallVector<TVMFFIAny, 16> ffi(n_out + n);
  c10::SmallVector<DLTensor, 16> dl(n_out + n);
  bool any_rows = false;  // an argument is rows at a stride (else every tensor argument is contiguous)
  for (size_t i = 0; i < n; ++i) {
    TVMFFIAny& a = ffi[n_out + i];
    a.zero_padding = 0;
    a.v_int64 = 0;
    const c10::IValue& v = args[i];
    if (v.isNone()) {
      a.type_index = kTVMFFINone;
    } else if (st.kinds[i] == Kind::kTensor) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || t.device() != device) return false;
      if (!t.is_contiguous()) {
        if (!st.rows[i] || !RowStrided(t)) return false;
        any_rows = true;
      }
      if (!View(t, dl_device, &dl[n_out + i], &a)) return false;
    } else if (st.kinds[i] == Kind::kFloat) {
      if (!v.isDouble() && !v.isInt()) return false;
      a.type_index = kTVMFFIFloat;
      a.v_float64 = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
    } else if (st.kinds[i] == Kind::kInt) {
      if (!v.isInt()) return false;  // a symbolic int
      a.type_index = kTVMFFIInt;
      a.v_int64 = v.toInt();
    } else {
      if (!v.isBool()) return false;
      a.type_index = kTVMFFIBool;
      a.v_int64 = v.toBool();
    }
  }
  for (int m : st.mutated) {  // the slower path names the overlapping pair
    if (args[m].isNone()) continue;
    for (size_t j = 0; j < n; ++j) {
      if (static_cast<int>(j) != m && args[j].isTensor() && Overlap(args[m].toTensor(), args[j].toTensor(), !any_rows))
        return false;
    }
  }

  uint32_t advise = 0;  // bit per output: a large CPU one from at::empty, to advise before writing
  if (allocate) {
    const auto options = at::TensorOptions().device(device);
    const bool cpu = dev == kCPU;
    bool a = false;
    if (!st.like.empty()) {
      for (int i : st.like) {
        const at::Tensor& src = args[i].toTensor();
        outs->push_back(NewOutput(st, src.sizes(), options.dtype(src.scalar_type()), src.nbytes(), cpu, &a));
        advise |= static_cast<uint32_t>(a) << (outs->size() - 1);
      }
    } else if (n_out) {
      for (const OutSpec& s : RuleSpecs(st, args)) {
        outs->push_back(NewOutput(st, s.shape, options.dtype(s.dtype),
                                  c10::multiply_integers(s.shape) * int64_t(c10::elementSize(s.dtype)), cpu, &a));
        advise |= static_cast<uint32_t>(a) << (outs->size() - 1);
      }
      if (outs->size() != n_out) return false;
    }
  }
  // out=: each must have its output's shape and dtype (the `like` argument's, or the shape rule's);
  // else the checked path raises the ValueError naming both (call.core.check_outs).
  if (!allocate && st.like.empty() && n_out && !RuleOutsMatch(st, args, *outs)) return false;
  for (size_t k = 0; k < n_out; ++k) {
    const at::Tensor& t = (*outs)[k];
    if (!allocate && (!t.defined() || t.device() != device || !t.is_contiguous())) return false;
    if (!allocate) {
      if (!st.like.empty()) {
        const at::Tensor& like = args[st.like[k]].toTensor();
        if (t.scalar_type() != like.scalar_type() || t.sizes() != like.sizes()) return false;
      }
      // an out= sharing memory with an input: the checked path writes a fresh buffer
      for (size_t j = 0; j < n; ++j) {
        if (args[j].isTensor() && Overlap(t, args[j].toTensor())) return false;
      }
      for (size_t p = 0; p < k; ++p) {
        if (Overlap(t, (*outs)[p])) return false;
      }
    }
    if (k < 32 && (advise >> k & 1u)) {
      py::gil_scoped_acquire gil;
      st.fresh(py::cast(t));
    }
    if (!View(t, dl_device, &dl[k], &ffi[k])) return false;
  }

  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc;
#ifdef OPB_WITH_CUDA
  if (dev == kCUDA) {
    TVMFFIStreamHandle prev = nullptr;
    // torch's current stream of the device through c10's device-generic interface (what
    // c10::cuda::getCurrentCUDAStream(i).stream() gives), so the shim needs no CUDA headers: a
    // torch from PyPI on a machine without a CUDA toolkit builds it too.
    void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
    TVMFFIEnvSetStream(kDLCUDA, device.index(), stream, &prev);
    rc = TVMFFIFunctionCall(kernel, ffi.data(), static_cast<int32_t>(ffi.size()), &result);
    TVMFFIEnvSetStream(kDLCUDA, device.index(), prev, nullptr);
  } else {
    rc = TVMFFIFunctionCall(kernel, ffi.data(), static_cast<int32_t>(ffi.size()), &result);
  }
#else
  rc = TVMFFIFunctionCall(kernel, ffi.data(), static_cast<int32_t>(ffi.size()), &result);
#endif
  if (rc != 0) {  // the caller raises it: a second run would not raise a taken device-side record
    *raised = true;
    return false;
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) TVMFFIObjectDecRef(result.v_obj);
  return true;
}

}  // namespace opbridge_native
