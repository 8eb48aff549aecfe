"""A namespace of ops compiled into one module per device: :class:`Library`, which declares them."""

from __future__ import annotations

import importlib.util
import keyword
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opbridge import registry
from opbridge.declare.op import (
    DEFAULT_DTYPES,
    HEADER_SUFFIXES,
    KNOWN_DTYPES,
    SOURCE_SUFFIXES,
    BackwardFn,
    CaseHint,
    OpDef,
    ShapeRule,
    _validate_reference,
    like,
    validate_backward,
)
from opbridge.errors import DeclarationError
from opbridge.schema import Schema, parse_schema


def _paths(given: str | Path | Sequence[str | Path]) -> tuple[str | Path, ...]:
    """*given* as paths: one path alone (``sources="k.cc"``) is that path, not its characters."""
    return (given,) if isinstance(given, (str, Path)) else tuple(given)


def _check_suffixes(namespace: str, sources: Sequence[Path]) -> None:
    """Refuse a source of a suffix no device compiles and no header has: it would be left out of every build
    without a word (a ``.c`` file, a misspelt ``.cxx``), alone or beside sources that do compile."""
    compiled = {suffix for suffixes in SOURCE_SUFFIXES.values() for suffix in suffixes}
    unknown = [s for s in sources if s.suffix not in compiled and s.suffix not in HEADER_SUFFIXES]
    if not unknown:
        return
    accepted = " and ".join(f"{', '.join(suffixes)} for {device}" for device, suffixes in SOURCE_SUFFIXES.items())
    c_files = " (a C file compiles as C++ renamed .cc)" if any(s.suffix == ".c" for s in unknown) else ""
    one = len(unknown) == 1
    raise DeclarationError(
        f"library {namespace!r}: source{'' if one else 's'} "
        f"{', '.join(map(str, unknown))} {'has a suffix' if one else 'have suffixes'} opbridge does not compile "
        f"({', '.join(dict.fromkeys(s.suffix or 'none' for s in unknown))}): it compiles {accepted}{c_files}, "
        f"and takes headers ({', '.join(HEADER_SUFFIXES)}) among the sources without compiling them. Rename the "
        f"file, or leave it out of sources=")


def _flags(name: str, given: Sequence[str]) -> tuple[str, ...]:
    """*given* as flags; one string is refused (``cflags="-O2 -DX"`` is one flag or two?)."""
    if isinstance(given, str):
        raise DeclarationError(f"Library({name}=...) takes a list of flags, one per item, got the string "
                               f"{given!r}: write {name}={given.split()!r}")
    return tuple(given)


class Library:
    """A namespace of ops whose kernels are compiled into one module per device.

    Parameters
    ----------
    namespace
        Framework namespace, e.g. ``"myops"`` gives ``torch.ops.myops.<op>``.
    sources
        Kernel source files (:data:`SOURCE_SUFFIXES`: ``.cc``, ``.cpp``, ``.cxx`` for CPU, ``.cu`` for
        CUDA), or one; headers (:data:`HEADER_SUFFIXES`) may be listed too and are not compiled, and
        any other suffix is a :class:`DeclarationError`. Relative paths are resolved against *root*.
    include_dirs, cflags, ldflags
        Extra build inputs.
    root
        Base directory for relative paths (default: the caller's directory).
    prebuilt
        Importable name of an AOT-built module (e.g. ``"mypkg._C_ops"``) to
        prefer over a JIT build when present and current; the CUDA module is
        the same name with ``_cuda`` appended (:meth:`prebuilt_module`). An
        installed CUDA module gives the ops CUDA kernels even where the
        sources are not installed.
    dtypes
        The dtypes its ops take unless an op declares its own (default:
        :data:`DEFAULT_DTYPES`, float32, float16 and bfloat16).
    kernels_check_inputs
        Every kernel, before writing anything, raises ``ValueError`` for a
        non-contiguous tensor (``OPB_CHECK_CONTIGUOUS``) and ``TypeError`` for
        a dtype its op does not declare. The adapters hand kernels dense
        tensors of declared dtypes either way; with this promise their fast
        paths leave both tests to the kernel (nanoseconds in C++) and fall back
        on its error to the checked path, which raises the shared message,
        instead of testing every call in Python first. The built-in library
        makes this promise, and a test holds its kernels to it.
    """

    def __init__(
        self,
        namespace: str,
        sources: str | Path | Sequence[str | Path] = (),
        *,
        include_dirs: str | Path | Sequence[str | Path] = (),
        cflags: Sequence[str] = (),
        ldflags: Sequence[str] = (),
        root: str | Path | None = None,
        prebuilt: str | None = None,
        python_module: str | None = None,
        dtypes: Sequence[str] | None = None,
        kernels_check_inputs: bool = False,
    ) -> None:
        if not namespace.isidentifier() or keyword.iskeyword(namespace):
            raise DeclarationError(f"library namespace must be a Python identifier, got {namespace!r}")
        frame = sys._getframe(1)  # inspect.stack() reads every caller's source: ~60 ms
        base = Path(root) if root is not None else Path(frame.f_code.co_filename).resolve().parent
        self.namespace = namespace
        self.root = base
        self.sources = tuple((base / s).resolve() for s in _paths(sources))
        _check_suffixes(namespace, self.sources)
        self.include_dirs = tuple((base / d).resolve() for d in _paths(include_dirs))
        self.cflags = _flags("cflags", cflags)
        self.ldflags = _flags("ldflags", ldflags)
        self.prebuilt = prebuilt
        self.dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES
        #: Whether the library names its ops' dtypes (else they are :data:`DEFAULT_DTYPES`).
        self.dtypes_declared = dtypes is not None
        self.kernels_check_inputs = kernels_check_inputs
        self.python_module = python_module or frame.f_globals.get("__name__", "__main__")
        self.ops: dict[str, OpDef] = {}
        self._installed_devices: dict[str, bool] = {}
        registry.add_library(self)

    def op(
        self,
        schema: str,
        *,
        kernels: Mapping[str, str] | None = None,
        shape: like | ShapeRule | None = None,
        backward: BackwardFn | None = None,
        tolerances: Mapping[str, tuple[float, float]] | None = None,
        hints: CaseHint | None = None,
        dtypes: Sequence[str] | None = None,
        dtype_arg: str | None = None,
        row_strided: Sequence[str] = (),
        graph_safe: bool = True,
        rows: Sequence[str] = (),
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Declare an op by decorating its NumPy reference implementation.

        Parameters
        ----------
        schema
            PyTorch function-schema string, e.g.
            ``"rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor"``.
        kernels
            Exported kernel name per device; default ``{"cpu": "<name>_cpu"}``.
        shape
            Output rule (required when the op returns new tensors).
        backward
            Gradient function; see :class:`OpDef`.
        tolerances
            Per-dtype ``(rtol, atol)`` overrides.
        hints
            Test-case generator ``hints(dtype, rng)``; see :class:`OpDef`.
        dtypes
            Dtype names the kernels take; default: the library's ``dtypes``.
        dtype_arg
            The Tensor argument whose dtype ``dtypes`` constrains; default: the
            first non-optional Tensor argument.
        row_strided
            Tensor arguments the kernels take as rows at a stride (their dims
            after the first contiguous; the kernel reads the stride with
            ``opbridge::row_stride``), which then reach them without a dense
            copy: e.g. ``("query", "key")``, column slices of one ``qkv``.
        graph_safe
            Whether a CUDA graph may replay the op's device kernels without their
            host code (default True); see :attr:`OpDef.graph_safe`.
        rows
            Tensor arguments whose leading dims are independent rows: each row of
            every output (and mutated argument) comes from the same row of these
            and the whole of the other arguments, and the kernels take any number
            of leading dims. A batch (``jax.vmap``, ``torch.func.vmap``) over them
            then runs as one kernel call; see :attr:`OpDef.rows`.

        Returns
        -------
        Callable
            A decorator returning the op's public callable.
        """
        parsed = parse_schema(schema)  # SchemaError is a DeclarationError
        caller = sys._getframe(1)  # where the op is declared, for messages (a manifest puts its own)
        origin = f"{caller.f_code.co_filename}:{caller.f_lineno}"

        def decorate(reference: Callable[..., Any]) -> Callable[..., Any]:
            return self._add(parsed, reference, kernels, shape, backward, tolerances, hints, dtypes, dtype_arg,
                             row_strided, origin, graph_safe, rows)

        return decorate

    def _add(
        self,
        schema: Schema,
        reference: Callable[..., Any] | None,
        kernels: Mapping[str, str] | None,
        shape: like | ShapeRule | None,
        backward: BackwardFn | None,
        tolerances: Mapping[str, tuple[float, float]] | None,
        hints: CaseHint | None = None,
        dtypes: Sequence[str] | None = None,
        dtype_arg: str | None = None,
        row_strided: Sequence[str] = (),
        origin: str = "",
        graph_safe: bool = True,
        rows: Sequence[str] = (),
    ) -> Callable[..., Any]:
        name = schema.name
        defaulted = dtypes is None and not self.dtypes_declared
        dtypes = tuple(dtypes) if dtypes is not None else self.dtypes
        unknown = [d for d in dtypes if d not in KNOWN_DTYPES]
        if unknown or not dtypes:
            raise DeclarationError(f"{name}: dtypes must name some of {sorted(KNOWN_DTYPES)}, got {list(dtypes)}")
        if schema.overload:
            raise DeclarationError(f"{name}: overload names are not supported ({schema.source!r})")
        if not isinstance(graph_safe, bool):
            raise DeclarationError(f"{name}: graph_safe must be true or false, got {graph_safe!r}")
        if name in self.ops:
            raise DeclarationError(f"{self.namespace}::{name} is declared twice")
        if reference is not None:
            _validate_reference(schema, reference)
        tensors = [i for i, a in enumerate(schema.arguments) if a.type.is_tensor and not a.type.optional]
        if not tensors:
            raise DeclarationError(f"{name}: an op needs at least one non-optional Tensor argument")
        n_new = sum(1 for r in schema.returns if r.type.alias is None)
        for r in schema.returns:
            if not r.type.is_tensor:
                raise DeclarationError(f"{name}: only Tensor returns are supported, got {r.type}")
        if n_new and shape is None:
            raise DeclarationError(f"{name}: returns {n_new} new tensor(s) but declares no shape rule")
        if backward is not None and schema.is_mutating:
            raise DeclarationError(f"{name}: mutates {', '.join(repr(a.name) for a in schema.mutated_args)} in "
                                   f"place, so it cannot be differentiated and takes no backward (its inputs are "
                                   f"overwritten); declare the backward on an op that returns new tensors")
        if backward is not None:
            validate_backward(schema, backward)
        if isinstance(shape, like):
            arg_names = [a.name for a in schema.arguments]
            for n in shape.names:
                if n not in arg_names:
                    raise DeclarationError(f"{name}: like({n!r}) names no argument of {arg_names}")
                t = schema.arguments[arg_names.index(n)].type
                if not t.is_tensor or t.optional:
                    raise DeclarationError(
                        f"{name}: like({n!r}) names a {'Tensor?' if t.is_tensor else 'non-Tensor'} argument, which "
                        f"{'may be None' if t.is_tensor else 'has no shape'}; name a Tensor one, or give a shape "
                        f"rule (shape=lambda ...: opbridge.Spec(shape, dtype))")
            if len(shape.names) != n_new:
                raise DeclarationError(f"{name}: {shape!r} describes {len(shape.names)} output(s), "
                                       f"the schema returns {n_new}")
        op = OpDef(
            library=self,
            schema=schema,
            kernels=dict(kernels) if kernels is not None else self._default_kernels(name),
            shape=shape,
            reference=reference,
            backward=backward,
            tolerances=dict(tolerances or {}),
            hints=hints,
            dtypes=dtypes,
            dtypes_defaulted=defaulted,
            doc=(reference.__doc__ or "").strip() if reference is not None else "",
            dispatch_arg=tensors[0],
            dtype_arg=self._dtype_arg(schema, dtype_arg, tensors[0]),
            row_strided=self._tensor_names(schema, "row_strided", row_strided),
            rows=self._rows(schema, rows),
            graph_safe=graph_safe,
            origin=origin,
        )
        self.ops[name] = op
        published: Callable[..., Any] = self._publish(op)
        return published

    def _publish(self, op: OpDef) -> Any:
        """What ``Library.op`` returns for a declared op.

        Here, the :class:`OpDef` itself (pure data). :class:`opbridge.Library`
        (:mod:`opbridge.library`) returns the op's public callable instead and
        registers it with the frameworks in use.
        """
        return op

    @staticmethod
    def _dtype_arg(schema: Schema, name: str | None, default: int) -> int:
        if name is None:
            return default
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if not a.type.is_tensor or a.type.optional:
                    raise DeclarationError(f"{schema.name}: dtype_arg {name!r} must be a non-optional Tensor")
                return i
        raise DeclarationError(f"{schema.name}: dtype_arg {name!r} names no argument")

    @staticmethod
    def _tensor_names(schema: Schema, key: str, names: Sequence[str]) -> tuple[int, ...]:
        """The schema indices of the Tensor arguments *names* that option *key* lists, sorted."""
        if isinstance(names, str):
            raise DeclarationError(f"{schema.name}: {key} takes argument names, e.g. ({names!r},), "
                                   f"not the string {names!r}")
        index = {a.name: i for i, a in enumerate(schema.arguments)}
        out = []
        for n in names:
            i = index.get(n)
            if i is None or not schema.arguments[i].type.is_tensor:
                tensors = [a.name for a in schema.arguments if a.type.is_tensor]
                raise DeclarationError(f"{schema.name}: {key} names {n!r}, which is not one of its Tensor "
                                       f"arguments {tensors}")
            out.append(i)
        return tuple(sorted(set(out)))

    @classmethod
    def _rows(cls, schema: Schema, names: Sequence[str]) -> tuple[int, ...]:
        rows = cls._tensor_names(schema, "rows", names)
        if rows:
            shared = [a.name for i, a in enumerate(schema.arguments) if a.is_mutated and i not in rows]
            if shared:
                raise DeclarationError(
                    f"{schema.name}: rows names the arguments batched row by row, and an argument the op "
                    f"writes ({', '.join(map(repr, shared))}) must be one of them: a batch writes its own rows "
                    f"of it")
        return rows

    def _default_kernels(self, name: str) -> dict[str, str]:
        """``<name>_cpu``, plus ``<name>_cuda`` when the library has CUDA sources, or no sources (an
        installed wheel) and an installed CUDA module: in a source tree the sources say what exists."""
        kernels = {"cpu": f"{name}_cpu"}
        if self.sources_for("cuda") or (not self.sources and self._installed("cuda")):
            kernels["cuda"] = f"{name}_cuda"
        return kernels

    def prebuilt_module(self, device: str = "cpu") -> str | None:
        """The dotted name of the AOT module for *device*, or None without ``prebuilt``.

        ``prebuilt`` names the CPU module (``"pkg._C_ops"``); another device's
        module carries the device as a suffix (``"pkg._C_ops_cuda"``), as
        ``pip install .`` builds it (:func:`opbridge.aot.setuptools.opbridge_extensions`).
        """
        if not self.prebuilt:
            return None
        return self.prebuilt if device == "cpu" else f"{self.prebuilt}_{device}"

    def missing_module_note(self, device: str) -> str:
        """Why an installed package's ops lack *device* kernels: ``""``, or a sentence starting with ``"; "``."""
        name = self.prebuilt_module(device)
        if name is None or device == "cpu" or self.sources_for(device):
            return ""
        return (f"; {self.namespace} was installed without its {device} module {name} (`pip install` builds it "
                f"where nvcc is found; OPBRIDGE_AOT_DEVICES=cpu,{device} makes building without it an error)")

    def _installed(self, device: str) -> bool:
        """Whether an AOT module for *device* is installed (a wheel has no sources to say so); cached."""
        found = self._installed_devices.get(device)
        if found is None:
            name = self.prebuilt_module(device)
            try:
                found = name is not None and importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            self._installed_devices[device] = found
        return found

    def sources_for(self, device: str) -> tuple[Path, ...]:
        """The sources compiled into the module for *device*."""
        suffixes = SOURCE_SUFFIXES.get(device, ())
        return tuple(s for s in self.sources if s.suffix in suffixes)

    def __repr__(self) -> str:
        return f"<opbridge Library {self.namespace!r}: {len(self.ops)} ops>"
