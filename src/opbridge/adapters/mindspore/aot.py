"""MindSpore graph mode: every op as an ``ops.Custom(func_type="aot")`` primitive.

Inside ``ms.jit`` / ``GRAPH_MODE`` MindSpore compiles Python source; it cannot
run opbridge's eager dispatch (a dict lookup on ``type(x)`` and a tvm-ffi
call). So each op gets, derived from its declaration:

1. **An AOT entry point** ``opb_ms_<op>`` with MindSpore's signature
   ``int f(int nparam, void** params, int* ndims, int64_t** shapes,
   const char** dtypes, void* stream, void* extra)`` (inputs, then outputs).
   It wraps each tensor in a ``DLTensor`` (dtype parsed from MindSpore's
   dtype string), reads each scalar argument and calls the op's compiled
   tvm-ffi kernel ``__tvm_ffi_<kernel>`` through the packed C ABI, in
   destination-passing order ``kernel(*outputs, *schema_args)``. All entry
   points of a library are generated into one C++ file and built with
   opbridge's build machinery (:class:`~opbridge.build.compile.BuildSpec`,
   :func:`opbridge.build.jit.build`, cached by content) into
   ``<namespace>_ms_aot.so``, which is then published under a name derived
   from the generated source (``ops.Custom`` names the file before it is
   built). The wrapper does not link the kernel library:
   Python resolves each ``__tvm_ffi_<kernel>`` symbol in the already-loaded
   kernel module and hands the address to ``opb_ms_bind``, so the wrapper's
   source, and therefore its cache entry, depends on the schemas alone.

   *Scalars.* ``ops.Custom`` hands an AOT kernel only tensors (a Python
   float passed straight to it arrives as a float32 tensor), and attributes
   reach it only through MindSpore's C++ ``AotExtra`` class, whose ABI
   (``std::string`` arguments, old libstdc++ ABI) opbridge does not want to
   depend on. So a ``float`` argument travels as a 0-d float64 tensor
   (``int`` as int64, ``bool`` as bool), made with ``Tensor(value, float64)``;
   the entry point reads it back and passes a tvm-ffi float/int/bool. A
   double handed to a graph as an argument keeps its precision (MindSpore
   itself keeps float literals of graph source in float32), and a scalar
   that varies at run time works too.

   *Errors.* A kernel error (``TypeError`` / ``ValueError`` with the op's and
   the argument's name) never aborts: the entry point catches it through
   ``TVMFFIErrorMoveFromRaised``, records kind and message (readable with
   ``opb_ms_error_kind`` / ``opb_ms_error_message``), prints them to stderr
   and returns 1, which MindSpore turns into a ``RuntimeError``. To raise the
   kernel's own ``TypeError`` / ``ValueError`` instead, the primitive's
   shape inference (run by MindSpore while compiling, in Python) calls the
   entry point once on zero-filled buffers of the inferred shapes, with the
   scalars' values when they are constants ("dry run"; cached per
   signature, skipped above :data:`DRY_RUN_MAX_BYTES`), and raises that
   error from the compile. A call recorded for gradients in PyNative mode
   runs the same check on its real arguments first.

2. **A graph substitute** with the op's exact Python signature, which calls
   the primitive. MindSpore's parser replaces any object found in
   ``mindspore.graph._parse.resources.convert_object_map`` by its value when
   it resolves a name, so ``opbridge.ops.<op>`` (and ``from ... import``
   aliases of it) written inside a graph resolve to the substitute. Its
   source is generated into a file in opbridge's cache (MindSpore parses
   source, and reports errors against it); everything it uses is a closure
   variable, which the parser resolves.

3. **A bprop** generated from the declared backward: ``bprop(*inputs, out,
   dout)`` calls ``op.backward(*douts, *args)`` (scalars converted back with
   ``.item()``), maps ``None`` to zeros and gives the scalar inputs zero
   gradients. The declared backward is written with opbridge ops, which
   resolve to their own substitutes when MindSpore compiles it. A backward
   declared as a ``lambda`` inside the ``Library.op(...)`` call cannot be
   parsed by MindSpore ("Parse Lambda Function Fail"), so its expression is
   re-read from its source file and re-emitted as a ``def`` with the
   lambda's globals and closure as closure variables. An op without a
   backward gets a bprop that raises ``NotImplementedError`` naming the op
   (MindSpore never silently returns zero gradients for it).

Limits (``NotImplementedError`` while compiling): ops that mutate arguments
in place, and ``Tensor?``, ``Tensor[]``, ``str``, list and ``ScalarType``
arguments (they still run eagerly in PyNative mode); dynamic shapes
(MindSpore re-infers an AOT op's shapes at run time only through a C++
infer function, which a Python shape rule cannot provide).
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import inspect
import os
import shutil
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from opbridge import loader
from opbridge.build import jit
from opbridge.build.cache import cache_root
from opbridge.build.compile import BuildSpec

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

__all__ = [
    "DRY_RUN_MAX_BYTES",
    "AotModule",
    "aot_module",
    "check_call",
    "checked",
    "custom_op",
    "graph_function",
    "ms_dtype",
    "parseable",
    "register",
    "unsupported_reason",
    "wrapper_source",
]

#: Inputs plus outputs above this many bytes skip the compile-time dry run
#: (errors then surface as MindSpore's RuntimeError when the graph runs).
DRY_RUN_MAX_BYTES = 64 << 20

#: schema scalar type -> (MindSpore dtype it travels as, reader in the generated C++)
_SCALARS: dict[str, tuple[Any, str]] = {
    "float": (mstype.float64, "read_float"),
    "int": (mstype.int64, "read_int"),
    "bool": (mstype.bool_, "read_bool"),
}

#: MindSpore dtype -> (name in the AOT ABI, bytes per element)
_DTYPES: dict[Any, tuple[str, int]] = {
    mstype.float16: ("float16", 2),
    mstype.bfloat16: ("bfloat16", 2),
    mstype.float32: ("float32", 4),
    mstype.float64: ("float64", 8),
    mstype.int8: ("int8", 1),
    mstype.int16: ("int16", 2),
    mstype.int32: ("int32", 4),
    mstype.int64: ("int64", 8),
    mstype.uint8: ("uint8", 1),
    mstype.uint16: ("uint16", 2),
    mstype.uint32: ("uint32", 4),
    mstype.uint64: ("uint64", 8),
    mstype.bool_: ("bool", 1),
    mstype.complex64: ("complex64", 8),
    mstype.complex128: ("complex128", 16),
}

_ERRORS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "IndexError": IndexError,
    "KeyError": KeyError,
    "AttributeError": AttributeError,
    "NotImplementedError": NotImplementedError,
    "RuntimeError": RuntimeError,
    "MemoryError": MemoryError,
}

_LOCK = threading.RLock()


def ms_dtype(d: Any) -> Any:
    """A MindSpore element dtype from a dtype object or a name like ``"int64"``."""
    if isinstance(d, mstype.TensorType):
        return d.element_type()
    if isinstance(d, str):
        return mstype.bool_ if d == "bool" else getattr(mstype, d)
    return d


# ---------------------------------------------------------------------------
# what graph mode supports
# ---------------------------------------------------------------------------


def unsupported_reason(op: OpDef) -> str | None:
    """Why *op* cannot run inside a MindSpore graph, or None when it can."""
    if "cpu" not in op.kernels:
        return "it declares no cpu kernel"
    if op.schema.is_mutating or any(r.type.alias is not None for r in op.schema.returns):
        return "it mutates its arguments in place, which MindSpore graphs cannot express"
    for a in op.schema.arguments:
        t = a.type
        if t.is_tensor and t.optional:
            return f"argument '{a.name}' is an optional Tensor"
        if t.is_tensor:
            continue
        if t.is_list or t.optional or t.base not in _SCALARS:
            return f"argument '{a.name}' has type {t}; graph mode passes Tensor, float, int and bool"
    return None


# ---------------------------------------------------------------------------
# the C++ wrapper
# ---------------------------------------------------------------------------

_PRELUDE = r"""// Generated by opbridge (opbridge.adapters.mindspore_aot) from the declarations of
// library "@NS@": MindSpore ops.Custom(func_type="aot") entry points, one per op.
// Each wraps MindSpore's buffers in DLTensors and calls the op's tvm-ffi kernel
// through the packed C ABI, outputs first. Do not edit.
#include <tvm/ffi/c_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#define OPB_MS_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kNumKernels = @NK@;
TVMFFISafeCallType g_kernels[kNumKernels > 0 ? kNumKernels : 1] = {};
const char* const g_kernel_names[kNumKernels > 0 ? kNumKernels : 1] = {@KNAMES@};
thread_local std::string g_error_kind;
thread_local std::string g_error_message;
thread_local bool g_quiet = false;

int fail(const char* kind, const std::string& message) {
  g_error_kind = kind;
  g_error_message = message;
  return 1;
}

// Called on every failed entry: the caller (MindSpore) only sees the status.
int report(int status) {
  if (status != 0 && !g_quiet) {
    std::fprintf(stderr, "opbridge: %s: %s\n", g_error_kind.c_str(), g_error_message.c_str());
    std::fflush(stderr);
  }
  return status;
}

bool parse_dtype(const char* s, DLDataType* out) {
  struct Entry {
    const char* name;
    uint8_t code;
    uint8_t bits;
  };
  static const Entry kTable[] = {
      {"float32", kDLFloat, 32},  {"float", kDLFloat, 32},     {"float16", kDLFloat, 16},
      {"float64", kDLFloat, 64},  {"double", kDLFloat, 64},    {"bfloat16", kDLBfloat, 16},
      {"int8", kDLInt, 8},        {"int16", kDLInt, 16},       {"int32", kDLInt, 32},
      {"int", kDLInt, 32},        {"int64", kDLInt, 64},       {"uint8", kDLUInt, 8},
      {"uint16", kDLUInt, 16},    {"uint32", kDLUInt, 32},     {"uint", kDLUInt, 32},
      {"uint64", kDLUInt, 64},    {"bool", kDLBool, 8},        {"complex64", kDLComplex, 64},
      {"complex128", kDLComplex, 128},
  };
  if (s == nullptr) return false;
  for (const Entry& e : kTable) {
    if (std::strcmp(s, e.name) == 0) {
      *out = DLDataType{e.code, e.bits, 1};
      return true;
    }
  }
  return false;
}

int check_count(const char* op, int expected, int got) {
  if (expected == got) return 0;
  return fail("ValueError", std::string(op) + ": MindSpore passed " + std::to_string(got) +
                                " buffers, the schema needs " + std::to_string(expected) +
                                " (inputs, then outputs)");
}

int tensor_arg(const char* op, const char* arg, int i, void** params, int* ndims, int64_t** shapes,
               const char** dtypes, DLTensor* t, TVMFFIAny* a) {
  DLDataType dt;
  if (!parse_dtype(dtypes[i], &dt)) {
    return fail("TypeError", std::string(op) + ": " + arg + " has dtype " +
                                 (dtypes[i] ? dtypes[i] : "(null)") +
                                 ", which opbridge cannot pass to a kernel");
  }
  t->data = params[i];
  t->device = DLDevice{kDLCPU, 0};
  t->ndim = ndims[i];
  t->dtype = dt;
  t->shape = shapes[i];
  t->strides = nullptr;  // MindSpore hands AOT kernels compact row-major buffers
  t->byte_offset = 0;
  a->type_index = kTVMFFIDLTensorPtr;
  a->zero_padding = 0;
  a->v_ptr = t;
  return 0;
}

int64_t numel(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

int scalar_check(const char* op, const char* arg, int i, void** params, int* ndims, int64_t** shapes,
                 const char** dtypes) {
  if (dtypes[i] == nullptr || params[i] == nullptr) {
    return fail("ValueError", std::string(op) + ": scalar argument " + arg + " arrived without data");
  }
  if (numel(ndims[i], shapes[i]) == 1) return 0;
  return fail("ValueError", std::string(op) + ": scalar argument " + arg +
                                " must arrive as a one-element tensor");
}

int read_float(const char* op, const char* arg, int i, void** params, int* ndims, int64_t** shapes,
               const char** dtypes, TVMFFIAny* a) {
  if (scalar_check(op, arg, i, params, ndims, shapes, dtypes)) return 1;
  a->type_index = kTVMFFIFloat;
  a->zero_padding = 0;
  if (std::strcmp(dtypes[i], "float64") == 0) {
    a->v_float64 = *static_cast<const double*>(params[i]);
  } else if (std::strcmp(dtypes[i], "float32") == 0 || std::strcmp(dtypes[i], "float") == 0) {
    a->v_float64 = *static_cast<const float*>(params[i]);
  } else {
    return fail("TypeError", std::string(op) + ": argument '" + arg + "' must be float, got a " +
                                 dtypes[i] + " tensor");
  }
  return 0;
}

int read_int(const char* op, const char* arg, int i, void** params, int* ndims, int64_t** shapes,
             const char** dtypes, TVMFFIAny* a) {
  if (scalar_check(op, arg, i, params, ndims, shapes, dtypes)) return 1;
  a->type_index = kTVMFFIInt;
  a->zero_padding = 0;
  if (std::strcmp(dtypes[i], "int64") == 0) {
    a->v_int64 = *static_cast<const int64_t*>(params[i]);
  } else if (std::strcmp(dtypes[i], "int32") == 0 || std::strcmp(dtypes[i], "int") == 0) {
    a->v_int64 = *static_cast<const int32_t*>(params[i]);
  } else {
    return fail("TypeError", std::string(op) + ": argument '" + arg + "' must be int, got a " +
                                 dtypes[i] + " tensor");
  }
  return 0;
}

int read_bool(const char* op, const char* arg, int i, void** params, int* ndims, int64_t** shapes,
              const char** dtypes, TVMFFIAny* a) {
  if (scalar_check(op, arg, i, params, ndims, shapes, dtypes)) return 1;
  if (std::strcmp(dtypes[i], "bool") != 0) {
    return fail("TypeError", std::string(op) + ": argument '" + arg + "' must be bool, got a " +
                                 dtypes[i] + " tensor");
  }
  a->type_index = kTVMFFIBool;
  a->zero_padding = 0;
  a->v_int64 = *static_cast<const uint8_t*>(params[i]) != 0;
  return 0;
}

int invoke(const char* op, int k, TVMFFIAny* args, int n) {
  TVMFFISafeCallType fn = g_kernels[k];
  if (fn == nullptr) {
    return fail("RuntimeError", std::string(op) + ": kernel " + g_kernel_names[k] +
                                    " is not bound; load this module through opbridge");
  }
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  const int rc = fn(nullptr, args, n, &result);
  if (rc == 0) {
    if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != nullptr) {
      TVMFFIObjectDecRef(result.v_obj);
    }
    return 0;
  }
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) {
    return fail("RuntimeError", std::string(op) + ": kernel failed with status " + std::to_string(rc));
  }
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  std::string kind(cell->kind.data, cell->kind.size);
  std::string message(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return fail(kind.c_str(), message);
}

}  // namespace

OPB_MS_EXPORT int opb_ms_num_kernels() { return kNumKernels; }

OPB_MS_EXPORT const char* opb_ms_kernel_name(int k) {
  return (k >= 0 && k < kNumKernels) ? g_kernel_names[k] : nullptr;
}

OPB_MS_EXPORT int opb_ms_bind(int k, void* fn) {
  if (k < 0 || k >= kNumKernels) return 1;
  g_kernels[k] = reinterpret_cast<TVMFFISafeCallType>(fn);
  return 0;
}

OPB_MS_EXPORT void opb_ms_set_quiet(int quiet) { g_quiet = quiet != 0; }
OPB_MS_EXPORT const char* opb_ms_error_kind() { return g_error_kind.c_str(); }
OPB_MS_EXPORT const char* opb_ms_error_message() { return g_error_message.c_str(); }
"""


def _entry_source(op: OpDef, k: int) -> str:
    """The AOT entry point of *op*, calling kernel number *k*."""
    args = op.schema.arguments
    n_in, n_out = len(args), op.n_outputs
    n_params = n_in + n_out
    n_tensors = n_out + sum(1 for a in args if a.type.is_tensor)
    lines = [
        f"// {op.schema}",
        f"// params: {', '.join(f'[{i}] {a.name}' for i, a in enumerate(args))}"
        + "".join(f", [{n_in + j}] output {j}" for j in range(n_out)),
        f"OPB_MS_EXPORT int opb_ms_{op.name}(int nparam, void** params, int* ndims, int64_t** shapes,",
        "                                 const char** dtypes, void* stream, void* extra) {",
        "  (void)stream;",
        "  (void)extra;",
        f'  static const char* const kOp = "{op.name}";',
        f"  if (check_count(kOp, {n_params}, nparam)) return report(1);",
        f"  DLTensor t[{max(n_tensors, 1)}];",
        f"  TVMFFIAny a[{n_out + n_in}];",
        "  const int ok =",
    ]
    calls = []
    ti = 0
    for j in range(n_out):
        calls.append(f'tensor_arg(kOp, "output {j}", {n_in + j}, params, ndims, shapes, dtypes, '
                     f'&t[{ti}], &a[{j}])')
        ti += 1
    for i, a in enumerate(args):
        slot = n_out + i
        if a.type.is_tensor:
            calls.append(f'tensor_arg(kOp, "{a.name}", {i}, params, ndims, shapes, dtypes, '
                         f'&t[{ti}], &a[{slot}])')
            ti += 1
        else:
            reader = _SCALARS[a.type.base][1]
            calls.append(f'{reader}(kOp, "{a.name}", {i}, params, ndims, shapes, dtypes, &a[{slot}])')
    lines.append("      " + " ||\n      ".join(f"{c} != 0" for c in calls) + ";")
    lines += [
        "  if (ok) return report(1);",
        f"  return report(invoke(kOp, {k}, a, {n_out + n_in}));",
        "}",
        "",
    ]
    return "\n".join(lines)


def graph_ops(lib: Library) -> list[OpDef]:
    """The ops of *lib* that get an AOT entry point (those graph mode supports)."""
    return [op for op in lib.ops.values() if unsupported_reason(op) is None]


def wrapper_source(lib: Library) -> str:
    """C++ source of *lib*'s MindSpore AOT wrapper module, generated from its schemas."""
    ops_ = graph_ops(lib)
    knames = ", ".join(f'"{op.kernels["cpu"]}"' for op in ops_) or "nullptr"
    text = (_PRELUDE.replace("@NS@", lib.namespace).replace("@NK@", str(len(ops_)))
            .replace("@KNAMES@", knames))
    return text + "\n" + "\n".join(_entry_source(op, k) for k, op in enumerate(ops_))


# ---------------------------------------------------------------------------
# the built module
# ---------------------------------------------------------------------------


class AotModule:
    """*lib*'s wrapper module: where MindSpore loads it from, and (once ready) its bound entry points.

    ``ops.Custom`` primitives name the module's path when they are created,
    before anything is compiled, so the path depends on the generated source
    alone: ``<cache>/mindspore/<namespace>_ms_aot-<source hash>.so``.
    :meth:`ready` builds the source with :func:`opbridge.build.jit.build`
    (whose cache key also covers headers, flags and toolchain), copies the
    artifact to that path, loads the kernel library and binds each entry to
    its kernel. MindSpore infers shapes (:meth:`_OpCustom.__infer__`) before
    it loads an AOT kernel, so inference calls :meth:`ready` first.
    """

    def __init__(self, lib: Library) -> None:
        from tvm_ffi import libinfo

        self.lib = lib
        self.n_declared = len(lib.ops)
        self.ops = graph_ops(lib)
        text = wrapper_source(lib)
        tvm_lib_dir = Path(libinfo.find_libtvm_ffi()).parent
        self.spec = BuildSpec(
            name=f"{lib.namespace}_ms_aot",
            sources=(),
            device="cpu",
            ldflags=(f"-Wl,-rpath,{tvm_lib_dir}",),
            generated=((f"{lib.namespace}_ms_aot.cc", text),),
        )
        digest = hashlib.sha256(text.encode()).hexdigest()[:20]
        self.path = cache_root() / "mindspore" / f"{self.spec.name}-{digest}.so"
        self._cdll: ctypes.CDLL | None = None
        self._dry_cache: dict[Any, BaseException | None] = {}

    def _publish(self, built: Path) -> None:
        """Make :attr:`path` a copy of the build artifact *built* (atomically; no-op when it is)."""
        marker = self.path.with_name(self.path.name + ".from")
        if self.path.is_file() and marker.is_file() and marker.read_text() == str(built):
            return
        self.path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        shutil.copyfile(built, tmp)
        os.replace(tmp, self.path)
        tmp_marker = marker.with_name(f".{marker.name}.tmp{os.getpid()}")
        tmp_marker.write_text(str(built))
        os.replace(tmp_marker, marker)

    def ready(self) -> ctypes.CDLL:
        """Build (or reuse) and load the module and bind its kernels; return it."""
        if self._cdll is not None:
            return self._cdll
        with _LOCK:
            if self._cdll is not None:
                return self._cdll
            self._publish(jit.build(self.spec))
            # A module of this path already loaded in this process is reused by the loader.
            cdll = ctypes.CDLL(str(self.path))
            for name, restype in (("opb_ms_error_kind", ctypes.c_char_p),
                                  ("opb_ms_error_message", ctypes.c_char_p)):
                getattr(cdll, name).restype = restype
            cdll.opb_ms_bind.argtypes = [ctypes.c_int, ctypes.c_void_p]
            cdll.opb_ms_set_quiet.argtypes = [ctypes.c_int]
            if self.ops:
                for op in self.ops:
                    loader.kernel(op, "cpu")  # builds/loads the kernels; names a missing export
                kernels = ctypes.CDLL(str(loader.loaded_path(self.lib, "cpu")))
                for k, op in enumerate(self.ops):
                    sym = getattr(kernels, f"__tvm_ffi_{op.kernels['cpu']}")
                    if cdll.opb_ms_bind(k, ctypes.cast(sym, ctypes.c_void_p).value) != 0:
                        raise RuntimeError(f"opbridge: binding {op.name} in {self.path} failed")
            self._cdll = cdll
            return cdll

    def dry_run(self, op: OpDef, inputs: Sequence[Any],
                outputs: Sequence[tuple[tuple[int, ...], Any]]) -> None:
        """Call *op*'s entry point on zero-filled buffers; raise the kernel's error, if any.

        *inputs* are ``(shape, dtype)`` for tensors and Python values for
        scalars, in schema order; *outputs* are ``(shape, dtype)``.
        """
        args = op.schema.arguments
        key = (op.name, tuple((tuple(x[0]), str(x[1])) if a.type.is_tensor else (a.type.base, x)
                              for a, x in zip(args, inputs, strict=True)),
               tuple((tuple(s), str(d)) for s, d in outputs))
        if key in self._dry_cache:
            cached = self._dry_cache[key]
            if cached is not None:
                raise cached
            return
        bufs: list[np.ndarray] = []
        names: list[bytes] = []
        shapes: list[tuple[int, ...]] = []
        for a, x in zip(args, inputs, strict=True):
            if a.type.is_tensor:
                shape, dtype = x
                name, size = _DTYPES[ms_dtype(dtype)]
                bufs.append(np.zeros(max(int(np.prod(shape, dtype=np.int64)) * size, 1), np.uint8))
                names.append(name.encode())
                shapes.append(tuple(shape))
            else:
                ms_t = _SCALARS[a.type.base][0]
                npd = {"float": np.float64, "int": np.int64, "bool": np.bool_}[a.type.base]
                bufs.append(np.array([x], npd))
                names.append(_DTYPES[ms_t][0].encode())
                shapes.append(())
        for shape, dtype in outputs:
            name, size = _DTYPES[ms_dtype(dtype)]
            bufs.append(np.zeros(max(int(np.prod(shape, dtype=np.int64)) * size, 1), np.uint8))
            names.append(name.encode())
            shapes.append(tuple(shape))
        n = len(bufs)
        c_shapes = [(ctypes.c_int64 * max(len(s), 1))(*s) for s in shapes]
        params = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
        ndims = (ctypes.c_int * n)(*[len(s) for s in shapes])
        shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * n)(
            *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in c_shapes])
        dtypes = (ctypes.c_char_p * n)(*names)
        cdll = self.ready()
        entry = getattr(cdll, f"opb_ms_{op.name}")
        cdll.opb_ms_set_quiet(1)
        try:
            rc = entry(n, params, ndims, shape_ptrs, dtypes, None, None)
        finally:
            cdll.opb_ms_set_quiet(0)
        err: BaseException | None = None
        if rc != 0:
            kind = (cdll.opb_ms_error_kind() or b"RuntimeError").decode()
            message = (cdll.opb_ms_error_message() or b"").decode()
            err = _ERRORS.get(kind, RuntimeError)(message)
        if len(self._dry_cache) > 512:
            self._dry_cache.clear()
        self._dry_cache[key] = err
        if err is not None:
            raise err


_MODULES: dict[str, AotModule] = {}


def aot_module(lib: Library) -> AotModule:
    """The (not necessarily built) MindSpore wrapper module of *lib*."""
    mod = _MODULES.get(lib.namespace)
    # A library may declare more ops later: its module then has more entry points.
    if mod is None or mod.lib is not lib or mod.n_declared != len(lib.ops):
        with _LOCK:
            mod = AotModule(lib)
            _MODULES[lib.namespace] = mod
    return mod


# ---------------------------------------------------------------------------
# the primitive
# ---------------------------------------------------------------------------


class _Meta:
    """Shape and dtype of a tensor, for the declared shape rule."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: Sequence[int], dtype: Any) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype


class _OpCustom(ops.Custom):  # type: ignore[misc]
    """``ops.Custom`` for one op: inference from the declaration, validation by a dry run."""

    def __init__(self, op: OpDef, module: AotModule, bprop: Callable[..., Any]) -> None:
        self.opdef = op
        self.aot = module
        super().__init__(f"{module.path}:opb_ms_{op.name}", out_shape=self._unused, out_dtype=self._unused,
                         func_type="aot", bprop=bprop)
        self.add_prim_attr("opbridge_op", op.qualname)

    @staticmethod
    def _unused(*_: Any) -> None:  # pragma: no cover - __infer__ is overridden
        return None

    def __infer__(self, *args: Any) -> dict[str, Any]:
        op = self.opdef
        schema_args = op.schema.arguments
        if len(args) != len(schema_args):
            raise TypeError(f"{op.name}: the graph primitive takes {len(schema_args)} inputs, "
                            f"got {len(args)}")
        metas: list[Any] = []
        for a, info in zip(schema_args, args, strict=True):
            if a.type.is_tensor:
                if not isinstance(info["dtype"], mstype.TensorType):
                    raise TypeError(f"{op.name}: argument '{a.name}' must be a mindspore.Tensor, "
                                    f"got {info['dtype']}")
                if any(d < 0 for d in info["shape"]):
                    # MindSpore re-infers AOT ops of dynamic shape only through a C++ infer function.
                    raise NotImplementedError(
                        f"{op.name}: argument '{a.name}' has a dynamic shape {list(info['shape'])} in this "
                        f"graph; opbridge ops in MindSpore graphs need static shapes")
                metas.append(_Meta(info["shape"], ms_dtype(info["dtype"])))
            else:
                # A constant's value is known while compiling; otherwise check with the default.
                value = info.get("value")
                if isinstance(value, Tensor):
                    value = value.asnumpy().reshape(()).item()
                elif value is None:
                    value = a.default if a.has_default else (False if a.type.base == "bool" else 0)
                metas.append(value)
        specs = check_call(op, metas, dry_run=not getattr(_STATE, "checked", False), module=self.aot)
        shapes = [list(s.shape) for s in specs]
        out_dtypes = [mstype.TensorType(ms_dtype(s.dtype)) for s in specs]
        if len(specs) == 1:
            return {"shape": shapes[0], "dtype": out_dtypes[0], "value": None}
        return {"shape": tuple(shapes), "dtype": tuple(out_dtypes), "value": None}


_STATE = threading.local()


def check_call(op: OpDef, args: Sequence[Any], dry_run: bool = True,
               module: AotModule | None = None) -> tuple[Any, ...]:
    """Output specs of *op* for *args*, after running its kernel's checks on them.

    *args* are, in schema order, anything with ``.shape``/``.dtype`` for
    tensors and Python values for scalars. Unless *dry_run* is false, the
    shapes are static and inputs plus outputs fit in
    :data:`DRY_RUN_MAX_BYTES`, the op's entry point runs on zero-filled
    buffers of these shapes and dtypes and its error (``TypeError`` /
    ``ValueError`` naming op and argument) is raised here. Builds the
    wrapper module (*module*, default: the library's current one) if needed.
    """
    module = module or aot_module(op.library)
    specs = op.output_specs(args)
    tensors = [(a, tuple(int(d) for d in x.shape), ms_dtype(x.dtype))
               for a, x in zip(op.schema.arguments, args, strict=True) if a.type.is_tensor]
    outputs = [(tuple(int(d) for d in s.shape), ms_dtype(s.dtype)) for s in specs]
    for a, _, dtype in tensors:
        if dtype not in _DTYPES:
            raise TypeError(f"{op.name}: {a.name} has dtype {dtype}, which opbridge cannot pass to a kernel")
    for _, dtype in outputs:
        if dtype not in _DTYPES:
            raise TypeError(f"{op.name}: output dtype {dtype} cannot be passed to a kernel")
    shapes = [s for _, s, _ in tensors] + [s for s, _ in outputs]
    dynamic = any(d < 0 for s in shapes for d in s)
    total = sum(int(np.prod(s, dtype=np.int64)) * _DTYPES[d][1] for _, s, d in tensors)
    total += sum(int(np.prod(s, dtype=np.int64)) * _DTYPES[d][1] for s, d in outputs)
    if dry_run and not dynamic and total <= DRY_RUN_MAX_BYTES:
        inputs = [(tuple(x.shape), ms_dtype(x.dtype)) if a.type.is_tensor else x
                  for a, x in zip(op.schema.arguments, args, strict=True)]
        module.dry_run(op, inputs, outputs)
    else:
        module.ready()
    return specs


class checked:  # noqa: N801 - used as ``with checked():``
    """Within the block primitives skip their dry run: the caller ran :func:`check_call` on real values."""

    def __enter__(self) -> None:
        self.prev = getattr(_STATE, "checked", False)
        _STATE.checked = True

    def __exit__(self, *exc: object) -> None:
        _STATE.checked = self.prev


# ---------------------------------------------------------------------------
# generated graph code: substitute + bprop
# ---------------------------------------------------------------------------
# The helpers below are parsed by MindSpore's graph compiler (their source is
# this file), so they stay within its Python subset.


def _scalar_tensor(value: Any, dtype: Any) -> Any:
    """A scalar argument as the 0-d tensor the AOT entry point reads.

    ``Tensor(value, float64)`` keeps a double that a graph receives as an
    argument (``ops.scalar_to_tensor`` rounds it to float32 there; MindSpore
    keeps float literals written in graph source in float32 either way).
    """
    if isinstance(value, Tensor):
        return value.astype(dtype)
    return Tensor(value, dtype)


def _item(t: Any) -> Any:
    """A scalar argument back as a Python scalar, for the declared backward."""
    return t.item()


def _zeros(t: Any) -> Any:
    return ops.zeros_like(t)


def _checked(grads: Any, count: int, message: str) -> Any:
    """The declared backward's result, after checking it has one entry per Tensor argument."""
    n = len(grads) if isinstance(grads, (tuple, list)) else 1
    if n != count:
        raise RuntimeError(message + str(n))
    return grads


def _grad_at(grads: Any, k: int, like_: Any) -> Any:
    """Gradient *k* of the declared backward, zeros where it returned None."""
    if isinstance(grads, (tuple, list)):
        g = grads[k]
    else:
        g = grads
    if g is None:
        return ops.zeros_like(like_)
    return g


def _lambda_expression(fn: types.FunctionType) -> tuple[str, str] | None:
    """``(arguments, body)`` source of lambda *fn*, located in its file; None if not found."""
    try:
        filename = inspect.getsourcefile(fn)
        if filename is None:
            return None
        tree = ast.parse(Path(filename).read_text())
    except (OSError, TypeError, SyntaxError):
        return None
    code = fn.__code__
    argnames = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda) and node.lineno == code.co_firstlineno:
            names = tuple(a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs))
            if names == argnames:
                found.append(node)
    for node in found:
        expr = ast.unparse(node)
        try:
            compiled = compile(expr, filename or "<lambda>", "eval")
        except SyntaxError:
            continue
        lam = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
        if len(found) == 1 or lam.co_code == code.co_code:
            return ast.unparse(node.args), ast.unparse(node.body)
    return None


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _redefine_lambda(fn: Any, name: str) -> tuple[str, dict[str, Any]] | None:
    """``def <name>`` source (indented one level) equivalent to lambda *fn*, and its free values.

    The lambda's globals and closure cells become the free values, which the
    caller binds as closure variables (what MindSpore's parser resolves).
    None when *fn* is not a lambda or its source cannot be located.
    """
    if not (isinstance(fn, types.FunctionType) and fn.__name__ == "<lambda>"):
        return None
    found = _lambda_expression(fn)
    if found is None:
        return None
    params, body = found
    code = fn.__code__
    free: dict[str, Any] = {n: fn.__globals__[n] for n in _global_names(code) if n in fn.__globals__}
    for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        free[var] = cell.cell_contents
    return f"    def {name}({params}):\n        return {body}\n", free


def _graph_backward(op: OpDef, fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """Source of a function the graph compiler can parse that computes *fn*, and its closure values.

    A ``def`` is used as is (closure variable ``_backward``); a lambda is
    re-emitted as ``def _backward(...)`` (see :func:`_redefine_lambda`). A
    lambda whose source cannot be found is passed on, and MindSpore reports it.
    """
    found = _redefine_lambda(fn, "_backward")
    if found is None:
        return "", {"_backward": fn}
    return found


def parseable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """*fn*, or, for a lambda, an equivalent ``def`` that MindSpore's graph compiler can parse.

    MindSpore parses a lambda only when it stands alone on its line
    ("Parse Lambda Function Fail" otherwise, e.g. for ``ms.jit(lambda x: ...)``).
    """
    found = _redefine_lambda(fn, "_opb_lambda")
    if found is None:
        return fn
    src, free = found
    names = sorted(free)
    text = (f"# Generated by opbridge.adapters.mindspore_aot: a lambda MindSpore can parse. Do not edit.\n"
            f"def _make({', '.join(names)}):\n{src}    return _opb_lambda\n")
    path = _write_source("lambda", text)
    ns: dict[str, Any] = {"__name__": __name__}
    exec(compile(text, str(path), "exec"), ns)  # noqa: S102 - the lambda's own source
    out: Callable[..., Any] = ns["_make"](*(free[n] for n in names))
    return out


def _factory_source(op: OpDef, backward_src: str, closure: Sequence[str]) -> str:
    """Source of ``_make_<op>(<closure>)``, which returns ``(substitute, bprop)`` for *op*."""
    from opbridge.schema import NO_DEFAULT

    args = op.schema.arguments
    params: list[str] = []
    kw = False
    for a in args:
        if a.kwarg_only and not kw:
            params.append("*")
            kw = True
        params.append(a.name if a.default is NO_DEFAULT else f"{a.name}={a.default!r}")
    out_check = ""
    if getattr(op, "accepts_out", False):
        # The public callable's out= (writing into existing tensors) has no graph equivalent.
        params.append("out=None" if kw else "*, out=None")
        msg = f"{op.name}: out= cannot be used inside a MindSpore graph; use the returned tensor(s)"
        out_check = f"        if out is not None:\n            raise NotImplementedError({msg!r})\n"
    sig = ", ".join(params)
    names = [a.name for a in args]
    # Prefixed, so that it cannot shadow a name the (re-emitted) backward uses, e.g. the op itself.
    sub = f"_opb_graph_{op.name}"
    lines = [f"def _make_{op.name}({', '.join(closure)}):"]
    reason = unsupported_reason(op)
    if reason is not None:
        msg = (f"{op.name}: cannot be used inside a MindSpore graph (ms.jit / GRAPH_MODE): {reason}; "
               f"call it in PyNative mode")
        lines += [f"    def {sub}({sig}):", f"        raise NotImplementedError({msg!r})",
                  f"    return {sub}, None", ""]
        return "\n".join(lines)
    conv = [a.name if a.type.is_tensor else f"_opb_scalar_tensor({a.name}, _opb_{a.type.base}_dtype)"
            for a in args]
    lines += [f"    def {sub}({sig}):", out_check + f"        return _opb_prim({', '.join(conv)})"]
    if backward_src:
        lines.append(backward_src.rstrip("\n"))
    douts = ["dout"] if op.n_outputs == 1 else [f"dout[{j}]" for j in range(op.n_outputs)]
    lines.append(f"    def bprop({', '.join(names)}, out, dout):")
    if op.backward is None:
        msg = (f"{op.name}: no backward is declared, so it cannot be differentiated "
               f"(declare backward= in its Library.op)")
        lines.append(f"        raise NotImplementedError({msg!r})")
    else:
        bargs = [a.name if a.type.is_tensor else f"_opb_item({a.name})" for a in args]
        n_tensor = sum(1 for a in args if a.type.is_tensor)
        msg = f"{op.name}: backward must return one gradient per Tensor argument ({n_tensor}), got "
        call = f"_backward({', '.join([*douts, *bargs])})"
        lines.append(f"        _g = _opb_checked({call}, {n_tensor}, {msg!r})")
        grads = []
        k = 0
        for a in args:
            if a.type.is_tensor:
                grads.append(f"_opb_grad_at(_g, {k}, {a.name})")
                k += 1
            else:
                grads.append(f"_opb_zeros({a.name})")
        lines.append(f"        return ({', '.join(grads)},)")
    lines += [f"    return {sub}, bprop", ""]
    return "\n".join(lines)


_HELPERS: dict[str, Any] = {
    "_opb_scalar_tensor": _scalar_tensor,
    "_opb_item": _item,
    "_opb_zeros": _zeros,
    "_opb_checked": _checked,
    "_opb_grad_at": _grad_at,
    "_opb_float_dtype": mstype.float64,
    "_opb_int_dtype": mstype.int64,
    "_opb_bool_dtype": mstype.bool_,
}

_GRAPH: dict[str, tuple[Callable[..., Any], _OpCustom | None]] = {}


def _write_source(stem: str, text: str) -> Path:
    """Write generated graph source into the cache (MindSpore parses it from there)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cache_root() / "mindspore" / f"{stem}-{digest}.py"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def _build_graph(op: OpDef) -> tuple[Callable[..., Any], _OpCustom | None]:
    """Generate, load and wire *op*'s substitute, bprop and primitive."""
    supported = unsupported_reason(op) is None
    backward_src = ""
    values: dict[str, Any] = dict(_HELPERS)
    if supported and op.backward is not None:
        backward_src, free = _graph_backward(op, op.backward)
        values.update(free)
    closure = [*sorted(values), "_opb_prim"]
    text = (f"# Generated by opbridge.adapters.mindspore_aot for {op.qualname}: {op.schema}\n"
            f"# MindSpore's graph compiler parses this file. Do not edit.\n\n"
            + _factory_source(op, backward_src, closure))
    path = _write_source(f"{op.library.namespace}_graph", text)
    ns: dict[str, Any] = {"__name__": __name__}
    exec(compile(text, str(path), "exec"), ns)  # noqa: S102 - generated from a parsed schema
    factory = ns[f"_make_{op.name}"]
    prim: _OpCustom | None = None
    if supported:
        # The primitive keeps its bprop, and only the substitute uses the primitive.
        _, bprop = factory(*(values[n] for n in closure[:-1]), None)
        prim = _OpCustom(op, aot_module(op.library), bprop)
    fn, _ = factory(*(values[n] for n in closure[:-1]), prim)
    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = f"{op.qualname} inside MindSpore graphs (ops.Custom aot): {op.schema}"
    fn.opdef = op
    fn.primitive = prim
    return fn, prim


def graph_function(op: OpDef) -> Callable[..., Any]:
    """The graph substitute of *op*: its Python signature, calling its ``ops.Custom`` primitive."""
    key = op.qualname
    entry = _GRAPH.get(key)
    # Rebuilt when the library declared more ops since: the primitive names the module's path.
    if (entry is None or entry[0].opdef is not op  # type: ignore[attr-defined]
            or (entry[1] is not None and entry[1].aot is not aot_module(op.library))):
        with _LOCK:
            entry = _build_graph(op)
            _GRAPH[key] = entry
    return entry[0]


def _opdef(op: OpDef | Callable[..., Any]) -> OpDef:
    """The OpDef of a public op callable (or *op* itself)."""
    found: OpDef = getattr(op, "opdef", None) or op  # type: ignore[assignment]
    return found


def custom_op(op: OpDef | Callable[..., Any]) -> _OpCustom:
    """The ``ops.Custom`` (func_type ``"aot"``) primitive of *op* (an OpDef or a public op callable).

    It takes the op's arguments positionally in schema order, scalars as 0-d
    tensors (float64 / int64 / bool), and carries the bprop derived from the
    declared backward. Usable in PyNative and graph mode.
    """
    opdef = _opdef(op)
    reason = unsupported_reason(opdef)
    if reason is not None:
        raise NotImplementedError(f"{opdef.name}: has no MindSpore graph primitive: {reason}")
    graph_function(opdef)
    prim = _GRAPH[opdef.qualname][1]
    assert prim is not None
    return prim


def register(lib: Library) -> None:
    """Make every op of *lib* usable inside MindSpore graphs (idempotent, compiles nothing).

    Adds ``op.call -> graph substitute`` to MindSpore's parser conversion
    map. The wrapper module is built the first time MindSpore infers a shape
    with one of the primitives.
    """
    from mindspore.graph._parse.resources import convert_object_map

    for op in lib.ops.values():
        fn = graph_function(op)
        convert_object_map[op.call] = fn

