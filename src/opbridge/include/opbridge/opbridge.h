// opbridge kernel header: argument checks, dtype dispatch and the export macro.
//
// A kernel is a C++ function over tvm::ffi::TensorView in destination-passing
// style: the framework adapter allocates the outputs and passes them first,
// followed by the op's schema arguments in schema order. Each kernel validates
// its arguments, takes the framework's stream where it has one, dispatches on
// dtype and computes.
//
// User mistakes are raised with their Python type (TypeError / ValueError) and
// a message of the form "<op>: <arg> must be ..., got ..."; internal invariants
// use TVM_FFI_ICHECK.
//
// Its sections: common.h (tvm-ffi types, OPB_RT_, OPB_HOST_DEVICE, the
// threading grain), dtypes.h, checks.h, dispatch.h and export.h. Include this
// header, not a section: it also brings the runtime they declare.
#pragma once

#include "opbridge/common.h"
#include "opbridge/dtypes.h"
#include "opbridge/checks.h"
#include "opbridge/dispatch.h"
#include "opbridge/export.h"

#if !defined(OPB_SEPARATE_RUNTIME) || defined(OPB_RUNTIME_IMPL) || defined(__CUDACC__)
#include "opbridge/runtime_impl.h"
#endif
