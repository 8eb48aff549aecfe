"""The aot shim: a library's ``ops.Custom(func_type="aot")`` entry points, generated, built and bound.

Each graph-capable op gets an entry point ``opb_ms_<op>`` with MindSpore's
aot signature ``int f(int nparam, void** params, int* ndims, int64_t**
shapes, const char** dtypes, void* stream, void* extra)`` (inputs, then
outputs). Its C++ lives in ``templates/aot_module.cc.tmpl`` (the shared
runtime: DLTensor wrapping, scalar readers, error capture) and
``templates/aot_entry.cc.tmpl`` (one per op: a table of argument kinds and
names); Python fills in data only. The module is built with opbridge's build
machinery (:class:`~opbridge.build.compile.BuildSpec`, content-hashed) and
does not link the kernel library: Python hands each entry the address of
its kernel's ``__tvm_ffi_<kernel>`` symbol (``opb_ms_bind``), so the shim's
source depends on the schemas alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import numpy as np

from opbridge import loader
from opbridge._tvm import libinfo, load_library
from opbridge.adapters.mindspore.support import DTYPES, LOCK, SCALARS, ms_dtype, unsupported_reason
from opbridge.build import jit
from opbridge.build.cache import cache_root
from opbridge.build.compile import BuildSpec

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

TEMPLATES = Path(__file__).resolve().parent / "templates"

#: Kernel errors raised again in Python with their own type (others become RuntimeError).
ERRORS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "IndexError": IndexError,
    "KeyError": KeyError,
    "AttributeError": AttributeError,
    "NotImplementedError": NotImplementedError,
    "RuntimeError": RuntimeError,
    "MemoryError": MemoryError,
}


@functools.cache
def _template(name: str) -> Template:
    return Template((TEMPLATES / name).read_text())


def graph_ops(lib: Library) -> list[OpDef]:
    """The ops of *lib* that get an aot entry point (those graph mode supports)."""
    return [op for op in lib.ops.values() if unsupported_reason(op) is None]


def _entry_source(op: OpDef, k: int) -> str:
    """The aot entry point of *op*, calling kernel number *k* (``aot_entry.cc.tmpl``)."""
    args = op.schema.arguments
    kinds = ["kTensorArg" if a.type.is_tensor else SCALARS[a.type.base][1] for a in args]
    names = [a.name for a in args]
    kinds += ["kTensorArg"] * op.n_outputs
    names += [f"output {j}" for j in range(op.n_outputs)]
    return _template("aot_entry.cc.tmpl").substitute(
        schema=str(op.schema), op=op.name, index=k, n_in=len(args), n_out=op.n_outputs,
        kinds=", ".join(kinds), names=", ".join(f'"{n}"' for n in names))


def wrapper_source(lib: Library) -> str:
    """C++ source of *lib*'s MindSpore aot wrapper module, generated from its schemas."""
    ops_ = graph_ops(lib)
    return _template("aot_module.cc.tmpl").substitute(
        namespace=lib.namespace, num_kernels=len(ops_),
        kernel_names=", ".join(f'"{op.kernels["cpu"]}"' for op in ops_) or "nullptr",
        entries="\n".join(_entry_source(op, k) for k, op in enumerate(ops_)))


class AotModule:
    """*lib*'s wrapper module: where MindSpore loads it from, and (once ready) its bound entry points.

    ``ops.Custom`` primitives name the module's path when they are created,
    before anything is compiled, so the path depends on the generated source
    alone: ``<cache>/mindspore/<namespace>_ms_aot-<source hash>.so``.
    :meth:`ready` builds the source with :func:`opbridge.build.jit.build`
    (whose cache key also covers headers, flags and toolchain), copies the
    artifact to that path, loads the kernel library and binds each entry to
    its kernel. MindSpore infers shapes before it loads an aot kernel, so
    inference calls :meth:`ready` first.
    """

    def __init__(self, lib: Library) -> None:
        self.lib = lib
        self.n_declared = len(lib.ops)
        self.ops = graph_ops(lib)
        self.source = wrapper_source(lib)
        self.name = f"{lib.namespace}_ms_aot"
        digest = hashlib.sha256(self.source.encode()).hexdigest()[:20]
        self.path = cache_root() / "mindspore" / f"{self.name}-{digest}.so"
        self._cdll: ctypes.CDLL | None = None
        self._dry_cache: dict[Any, BaseException | None] = {}

    @functools.cached_property
    def spec(self) -> BuildSpec:
        """How the module is built (made when first needed: it finds tvm-ffi's library)."""
        tvm_lib_dir = Path(libinfo().find_libtvm_ffi()).parent
        return BuildSpec(
            name=self.name,
            sources=(),
            device="cpu",
            ldflags=(f"-Wl,-rpath,{tvm_lib_dir}",),
            generated=((f"{self.name}.cc", self.source),),
        )

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
        with LOCK:
            if self._cdll is not None:
                return self._cdll
            self._publish(jit.build(self.spec))
            # A module of this path already loaded in this process is reused by the loader.
            cdll = load_library(self.path)
            for name in ("opb_ms_error_kind", "opb_ms_error_message"):
                getattr(cdll, name).restype = ctypes.c_char_p
            cdll.opb_ms_bind.argtypes = [ctypes.c_int, ctypes.c_void_p]
            cdll.opb_ms_set_quiet.argtypes = [ctypes.c_int]
            if self.ops:
                for op in self.ops:
                    loader.kernel(op, "cpu")  # builds/loads the kernels; names a missing export
                kernels = load_library(loader.loaded_path(self.lib, "cpu"))
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
        scalars, in schema order; *outputs* are ``(shape, dtype)``. Results
        are kept per signature (at most 512), errors included.
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
        err = self._call_zeroed(op, inputs, outputs)
        if len(self._dry_cache) > 512:
            self._dry_cache.clear()
        self._dry_cache[key] = err
        if err is not None:
            raise err

    def _call_zeroed(self, op: OpDef, inputs: Sequence[Any],
                     outputs: Sequence[tuple[tuple[int, ...], Any]]) -> BaseException | None:
        """Run *op*'s entry point on zero-filled buffers; the kernel's error, or None."""
        bufs: list[np.ndarray] = []
        names: list[bytes] = []
        shapes: list[tuple[int, ...]] = []

        def tensor(shape: Sequence[int], dtype: Any) -> None:
            name, size = DTYPES[ms_dtype(dtype)]
            bufs.append(np.zeros(max(int(np.prod(shape, dtype=np.int64)) * size, 1), np.uint8))
            names.append(name.encode())
            shapes.append(tuple(shape))

        for a, x in zip(op.schema.arguments, inputs, strict=True):
            if a.type.is_tensor:
                tensor(*x)
            else:
                npd = {"float": np.float64, "int": np.int64, "bool": np.bool_}[a.type.base]
                bufs.append(np.array([x], npd))
                names.append(DTYPES[SCALARS[a.type.base][0]][0].encode())
                shapes.append(())
        for shape, dtype in outputs:
            tensor(shape, dtype)
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
        if rc == 0:
            return None
        kind = (cdll.opb_ms_error_kind() or b"RuntimeError").decode()
        message = (cdll.opb_ms_error_message() or b"").decode()
        return ERRORS.get(kind, RuntimeError)(message)


_MODULES: dict[str, AotModule] = {}


def aot_module(lib: Library) -> AotModule:
    """The (not necessarily built) MindSpore wrapper module of *lib*."""
    mod = _MODULES.get(lib.namespace)
    # A library may declare more ops later: its module then has more entry points.
    if mod is None or mod.lib is not lib or mod.n_declared != len(lib.ops):
        with LOCK:
            mod = AotModule(lib)
            _MODULES[lib.namespace] = mod
    return mod
