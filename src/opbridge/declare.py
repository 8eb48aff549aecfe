"""Declare stage: a library of kernels and the ops it provides, as pure data.

An op is declared once, by decorating its reference implementation::

    lib = Library("myops", sources=["csrc/scale.cc"])

    @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=like("x"))
    def scale(x, alpha):              # the reference, on NumPy arrays
        return x * alpha

The decorator returns the op's public callable. Everything else -- framework
registrations, fake kernels, JAX output specs, the AOT build list, the test
matrix, benchmarks and generated wrappers -- is derived from the
:class:`OpDef` it records. This module imports nothing of the later stages
(build, load, call, adapters): :class:`opbridge.Library` (in
:mod:`opbridge.library`) adds the public callables and the build/load
conveniences on top of the :class:`Library` defined here.
"""

from __future__ import annotations

import importlib.util
import inspect
import keyword
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from opbridge import registry
from opbridge.errors import DeclarationError
from opbridge.schema import Schema, parse_schema


class Spec(NamedTuple):
    """Shape and dtype of one output. ``dtype`` is an input's dtype object or a name like ``"int64"``."""

    shape: tuple[int, ...]
    dtype: Any


ShapeRule = Callable[..., "Spec | tuple[Spec, ...]"]


class like:  # noqa: N801 - reads as a phrase: shape=like("x")
    """Shape rule: each output has the shape and dtype of the named argument(s).

    ``like("x")`` for one output, ``like("x", "weight")`` for two.
    """

    def __init__(self, *names: str) -> None:
        if not names:
            raise DeclarationError("like() needs at least one argument name")
        self.names = names

    def __repr__(self) -> str:
        return f"like({', '.join(map(repr, self.names))})"


#: Which kernel sources a library compiles into its module for each device, by file suffix.
SOURCE_SUFFIXES: dict[str, tuple[str, ...]] = {"cpu": (".cc", ".cpp", ".cxx"), "cuda": (".cu",)}

#: The one tolerance table: ``{dtype name: (rtol, atol, reason)}`` used when an op declares none.
#:
#: An element passes when ``|actual - expected| <= atol + rtol * |expected|``.
#: The values assume a kernel that computes in the output dtype's working precision
#: (float32 for the 16-bit types) and rounds its result once, compared with a float64
#: reference rounded to the same dtype. An op that legitimately loses more (long
#: reductions, cancellation) declares ``tolerances=`` in ``Library.op``.
TOLERANCES: dict[str, tuple[float, float, str]] = {
    "float64": (
        1e-7, 1e-7,
        "float64 keeps 53 mantissa bits (2^-53 ~ 1.1e-16 per rounding), but kernels may "
        "accumulate in float32 internally, so allow what a few float32-accumulated steps lose",
    ),
    "float32": (
        1e-5, 1e-5,
        "float32 keeps 24 mantissa bits: one rounding of a value of magnitude 1 is 2^-24 ~ 6e-8; "
        "1e-5 leaves room for float32 accumulation over reductions of ~1e4 terms and for "
        "fast exp/tanh approximations",
    ),
    "float16": (
        1e-3, 1e-3,
        "float16 keeps 11 mantissa bits: one rounding of a value of magnitude 1 is 2^-11 ~ 4.9e-4, "
        "so 1e-3 is about one unit in the last place of the result (the reference is rounded too)",
    ),
    "bfloat16": (
        1.6e-2, 1e-2,
        "bfloat16 keeps 8 mantissa bits: one rounding of a value of magnitude 1 is 2^-8 ~ 3.9e-3; "
        "1.6e-2 (2^-6) allows the result and the rounded reference to sit a unit in the last place "
        "apart plus an input-rounding effect, and atol 1e-2 covers results near zero",
    ),
}

#: ``{dtype: (rtol, atol)}``, read from :data:`TOLERANCES` (kept for code written against it).
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {k: (v[0], v[1]) for k, v in TOLERANCES.items()}

#: The dtypes an op takes when neither it nor its library declares any.
DEFAULT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

#: Every dtype name a declaration may list.
KNOWN_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
                          "int64", "bool"})

#: A test-case generator: ``hint(dtype, rng) -> [ {argument name: value or shape}, ... ]``
#: (helpers in :mod:`opbridge.cases`). Declared per op with ``Library.op(hints=...)``.
CaseHint = Callable[..., Any]

BackwardFn = Callable[..., Sequence[Any]]


@dataclass
class OpDef:
    """Everything declared about one op.

    Attributes
    ----------
    library
        The owning :class:`Library`.
    schema
        The parsed function schema.
    kernels
        Exported kernel function name per device (``{"cpu": "scale_cpu"}``).
    shape
        Output shape/dtype rule: a :class:`like` or a callable taking the op's
        arguments and returning a :class:`Spec` or a tuple of them.
    reference
        Reference implementation on NumPy arrays (same argument order).
    backward
        ``backward(*grad_outputs, *args)`` returning one gradient (or None) per
        Tensor argument, written with opbridge ops so it runs in every framework.
    tolerances
        ``{dtype name: (rtol, atol)}`` overriding :data:`TOLERANCES`.
    hints
        Test-case generator ``hints(dtype, rng)`` for the test matrix and
        benchmarks; ops without one get elementwise cases.
    dtypes
        The dtypes the op's kernels take for the Tensor argument they
        dispatch on (``dtype_arg``), by name; every adapter checks them
        before the kernel, and the test matrix runs each.
    dtypes_defaulted
        Whether neither the op nor its library named them (``dtypes`` is then
        :data:`DEFAULT_DTYPES`); the dtype error says so.
    dispatch_arg
        Index of the first non-optional Tensor argument: its array type picks
        the framework adapter.
    dtype_arg
        Index of the Tensor argument whose dtype the kernel dispatches on
        (default: ``dispatch_arg``; e.g. ``rotary_embedding`` dispatches on
        ``query``, not on its integer ``positions``).
    """

    library: Library
    schema: Schema
    kernels: dict[str, str]
    shape: like | ShapeRule | None
    reference: Callable[..., Any] | None
    backward: BackwardFn | None = None
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    hints: CaseHint | None = None
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    dtypes_defaulted: bool = False
    doc: str = ""
    dispatch_arg: int = 0
    dtype_arg: int = 0
    call: Callable[..., Any] = field(init=False, repr=False)
    preludes: dict[str, str] = field(default_factory=dict, repr=False)
    out_preludes: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.schema.name

    @property
    def qualname(self) -> str:
        """``namespace::name`` as frameworks register it."""
        return f"{self.library.namespace}::{self.name}"

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(rtol, atol)`` for comparing this op's outputs of *dtype* with the reference."""
        got = self.tolerances.get(dtype)
        if got is not None:
            return got
        rtol, atol, _ = TOLERANCES.get(dtype, (0.0, 0.0, ""))
        return rtol, atol

    def output_specs(self, args: Sequence[Any]) -> tuple[Spec, ...]:
        """Apply the shape rule to *args* (anything with ``.shape``/``.dtype``)."""
        rule = self.shape
        if rule is None:
            return ()
        if isinstance(rule, like):
            names = [a.name for a in self.schema.arguments]
            return tuple(Spec(tuple(args[names.index(n)].shape), args[names.index(n)].dtype)
                         for n in rule.names)
        out = rule(*args)
        if isinstance(out, Spec):
            return (out,)
        return tuple(out)

    @property
    def n_outputs(self) -> int:
        """How many outputs the adapter allocates (returns that are not aliases of inputs)."""
        return sum(1 for r in self.schema.returns if r.type.alias is None)

    @property
    def accepts_out(self) -> bool:
        """Whether the public callable takes ``out=``: the op returns new tensors."""
        return self.n_outputs > 0 and "out" not in {a.name for a in self.schema.arguments}

    @property
    def differentiable(self) -> tuple[int, ...]:
        """Indices of Tensor arguments that may receive gradients (not mutated)."""
        return tuple(i for i, a in enumerate(self.schema.arguments)
                     if a.type.is_tensor and not a.is_mutated)

    def __repr__(self) -> str:
        return f"<opbridge op {self.qualname}: {self.schema}>"


def _validate_reference(schema: Schema, fn: Callable[..., Any]) -> None:
    params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    expected = [a.name for a in schema.arguments]
    if names != expected:
        raise DeclarationError(
            f"{schema.name}: the reference's parameters {names} differ from the schema's "
            f"arguments {expected}; declare them in the same order with the same names"
        )


class Library:
    """A namespace of ops whose kernels are compiled into one module per device.

    Parameters
    ----------
    namespace
        Framework namespace, e.g. ``"myops"`` gives ``torch.ops.myops.<op>``.
    sources
        Kernel source files (``.cc`` for CPU, ``.cu`` for CUDA). Relative paths
        are resolved against *root*.
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
        sources: Sequence[str | Path] = (),
        *,
        include_dirs: Sequence[str | Path] = (),
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
        self.sources = tuple((base / s).resolve() for s in sources)
        self.include_dirs = tuple((base / d).resolve() for d in include_dirs)
        self.cflags = tuple(cflags)
        self.ldflags = tuple(ldflags)
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

        Returns
        -------
        Callable
            A decorator returning the op's public callable.
        """
        parsed = parse_schema(schema)  # SchemaError is a DeclarationError

        def decorate(reference: Callable[..., Any]) -> Callable[..., Any]:
            return self._add(parsed, reference, kernels, shape, backward, tolerances, hints, dtypes, dtype_arg)

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
    ) -> Callable[..., Any]:
        name = schema.name
        defaulted = dtypes is None and not self.dtypes_declared
        dtypes = tuple(dtypes) if dtypes is not None else self.dtypes
        unknown = [d for d in dtypes if d not in KNOWN_DTYPES]
        if unknown or not dtypes:
            raise DeclarationError(f"{name}: dtypes must name some of {sorted(KNOWN_DTYPES)}, got {list(dtypes)}")
        if schema.overload:
            raise DeclarationError(f"{name}: overload names are not supported ({schema.source!r})")
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
        if isinstance(shape, like):
            arg_names = [a.name for a in schema.arguments]
            for n in shape.names:
                if n not in arg_names:
                    raise DeclarationError(f"{name}: like({n!r}) names no argument of {arg_names}")
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
        )
        self.ops[name] = op
        return self._publish(op)

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

    def _default_kernels(self, name: str) -> dict[str, str]:
        """``<name>_cpu``, plus ``<name>_cuda`` when the library has CUDA sources or an installed CUDA module."""
        kernels = {"cpu": f"{name}_cpu"}
        if self.sources_for("cuda") or self._installed("cuda"):
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
