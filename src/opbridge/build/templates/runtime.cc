// Compiled once into every opbridge module: the argument checks, the error
// stream behind OPB_THROW, OPBRIDGE_EXPORT's typed-call helpers and the
// machinery that runs parallel_for's chunks, which the module's other
// translation units (built with OPB_SEPARATE_RUNTIME) only declare. See
// opbridge/runtime_impl.h and opbridge/parallel_impl.h. Also the pool of large
// CPU output buffers (opbridge/host_buffers_impl.h), registered by the first
// module a process loads.
#define OPB_RUNTIME_IMPL
#include <opbridge/opbridge.h>
#include <opbridge/parallel.h>
#include <opbridge/host_buffers_impl.h>

namespace {
const bool opb_host_buffers_registered = (opbridge::host_buffers::RegisterOnce(), true);
}  // namespace
