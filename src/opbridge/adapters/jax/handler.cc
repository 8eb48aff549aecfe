// The JAX adapter's XLA FFI handler shim (opbridge/adapters/jax/targets.py),
// compiled once into the opbridge cache.
//
// jax-tvm-ffi calls a registered function as f(*rets, *args, *attrs); an
// opbridge kernel takes its outputs first, then the schema's arguments in
// schema order. opbridge_jax_handler(kernel, plan, n_fresh, min_bytes)
// returns the function XLA calls, which
//
//   1. asks for transparent huge pages on each of the first n_fresh buffers
//      (the outputs XLA allocated for this call) of at least min_bytes, on
//      their 2 MiB-aligned interior, before the kernel first writes them.
//      A large XLA output is freshly mapped memory, and the kernel's first
//      write to each 4 KiB page would fault into the OS: 16,385 faults at
//      (4096, 4096) float32, more time than the kernel itself. The Python
//      side passes min_bytes = 0 where opbridge.call.memory's rules say no
//      advice (not Linux, THP not in madvise mode, OPBRIDGE_HUGEPAGES=0);
//   2. calls kernel(*[incoming[p] if p >= 0 else None for p in plan]), the
//      kernel's own argument order (scalars between tensors, None for an
//      absent optional tensor), or kernel(*incoming) when plan is the
//      identity.
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <optional>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {
using tvm::ffi::Any;
using tvm::ffi::AnyView;

constexpr std::uintptr_t kHugePage = std::uintptr_t(2) << 20;

// A refused madvise leaves the buffer on 4 KiB pages, as it was: never an error.
void advise_fresh(const AnyView& v, int64_t min_bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  std::optional<DLTensor*> t = v.try_cast<DLTensor*>();
  if (!t.has_value()) return;
  const DLTensor* d = *t;
  if (d->device.device_type != kDLCPU || d->data == nullptr) return;
  int64_t numel = 1;
  for (int i = 0; i < d->ndim; ++i) numel *= d->shape[i];
  const int64_t bytes = numel * ((d->dtype.bits * d->dtype.lanes + 7) / 8);
  if (bytes < min_bytes) return;
  const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(d->data) + d->byte_offset;
  const std::uintptr_t start = (p + kHugePage - 1) & ~(kHugePage - 1);
  const std::uintptr_t end = (p + static_cast<std::uintptr_t>(bytes)) & ~(kHugePage - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)v;
  (void)min_bytes;
#endif
}

tvm::ffi::Function handler(tvm::ffi::Function kernel, tvm::ffi::Array<int64_t> plan, int64_t n_fresh,
                           int64_t min_bytes) {
  std::vector<int> p(plan.begin(), plan.end());
  bool identity = true;
  for (size_t i = 0; i < p.size(); ++i) identity = identity && p[i] == static_cast<int>(i);
  if (min_bytes <= 0) n_fresh = 0;
  return tvm::ffi::Function::FromPacked(
      [kernel, p, identity, n_fresh, min_bytes](const AnyView* args, int32_t n, Any* rv) {
        for (int64_t i = 0; i < n_fresh && i < n; ++i) advise_fresh(args[i], min_bytes);
        if (identity && static_cast<size_t>(n) == p.size()) {
          kernel.CallPacked(args, n, rv);
          return;
        }
        AnyView small[16];
        std::vector<AnyView> big;
        AnyView* out = small;
        if (p.size() > 16) {
          big.resize(p.size());
          out = big.data();
        }
        for (size_t i = 0; i < p.size(); ++i) {
          if (p[i] >= n) TVM_FFI_THROW(InternalError) << "opbridge jax handler: bad argument plan";
          out[i] = p[i] >= 0 ? args[p[i]] : AnyView();
        }
        kernel.CallPacked(out, static_cast<int32_t>(p.size()), rv);
      });
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(opbridge_jax_handler, handler);
