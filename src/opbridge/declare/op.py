"""The declaration of one op: :class:`OpDef`, its shape rules (:class:`like`, :class:`Spec`),
and the facts every op shares (source suffixes per device, tolerances, dtypes)."""

from __future__ import annotations

import dis
import functools
import inspect
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from opbridge.errors import DeclarationError
from opbridge.schema import Schema

if TYPE_CHECKING:
    from opbridge.declare.library import Library


#: The most elements an output a shape rule gives may have: 2^59, so that its bytes (at most 16 per element)
#: fit an int64.
MAX_ELEMENTS = 2**59


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
#: Every header spelling C++ and CUDA code uses: a library may list headers among its sources (they are not
#: compiled), and a build's cache key hashes the files of these suffixes under its include directories.
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".cuh", ".inc", ".inl", ".ipp", ".tpp", ".tcc", ".def")

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
    row_strided
        Indices of the Tensor arguments every kernel of the op takes as rows
        at a stride: dims after the first contiguous, the first any stride at
        least a row apart (``opbridge::row_stride`` in the kernel), as vLLM's
        ``query`` and ``key``, column slices of one ``qkv`` tensor. The
        op-call core hands such an argument to the kernel as it is, where it
        gives every other strided tensor a dense copy (copied back when the
        op writes it): :func:`opbridge.call.overlap.dense_args`.
    rows
        Indices of the Tensor arguments whose leading dims are independent
        rows (``Library.op(rows=...)``): row ``r`` of every output and mutated
        argument comes from row ``r`` of these arguments and the whole of the
        others (a weight, a cache), and every kernel takes any number of
        leading dims in them. A batch over these arguments alone (``jax.vmap``,
        ``torch.func.vmap``) runs as one kernel call with the batch as one more
        leading dim (:mod:`opbridge.call.batching`); a batch over any other
        argument, or an op that declares none (a weight gradient sums over
        rows), runs the kernel once per batch element. Every mutated argument
        of an op that declares rows is one of them.
    graph_safe
        Whether a captured CUDA graph (``torch.cuda.graph``, XLA's command
        buffers under ``jax.jit``) may replay the op's device kernels without
        running their host code. False for kernels whose host code does
        per-call work beyond launching, such as raising a bad value that an
        earlier call's kernel found on the device (``rotary_embedding``'s
        positions, ``advance_step_flashattn``'s block tables:
        ``include/opbridge/cuda_error_flag.h``): JAX then registers the op's GPU
        handler as not command-buffer compatible, so XLA runs it outside its
        graphs, and torch tags it ``cudagraph_unsafe`` (torch.compile's CUDA
        graphs leave it out); ``torch.cuda.graph`` can still capture it, and such
        errors then surface at the op's next call outside the graph.
    origin
        Where the op was declared, ``file:line`` (the ``Library.op`` call, or
        the manifest's op entry), for messages; ``""`` if unknown.
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
    row_strided: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    graph_safe: bool = True
    origin: str = field(default="", repr=False, compare=False)
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
        specs = (out,) if isinstance(out, Spec) else tuple(out) if isinstance(out, (tuple, list)) else None
        n = self.n_outputs
        if specs is None or len(specs) != n or not all(isinstance(s, Spec) for s in specs):
            raise self._rule_error(out, n)
        for k, s in enumerate(specs):
            if not isinstance(s.shape, (tuple, list)):
                raise TypeError(f"{self.name}: its shape rule gave output {k} the shape {s.shape!r}; a shape is a "
                                f"tuple of ints, e.g. (x.shape[0], 4)")
            self._check_size(k, s.shape)
            if type(s.dtype) is str and s.dtype not in KNOWN_DTYPES:
                raise ValueError(f"{self.name}: its shape rule gave output {k} the dtype {s.dtype!r}; name one of "
                                 f"{', '.join(sorted(KNOWN_DTYPES))}, or give an input's dtype (x.dtype)")
        return specs

    def _rule_error(self, out: Any, n: int) -> Exception:
        """The error for a shape rule that gave *out* where *n* :class:`Spec` were due."""
        where = f" (declared at {self.origin})" if self.origin else ""
        want = ("opbridge.Spec(shape, dtype)" if n == 1 else f"a tuple of {n} opbridge.Spec(shape, dtype), one per "
                f"output")
        if isinstance(out, (tuple, list)) and all(isinstance(s, Spec) for s in out):
            return ValueError(f"{self.name}: its shape rule gave {len(out)} Spec(s), but the schema returns {n} new "
                              f"tensor(s){where}: return {want}")
        got = type(out).__name__
        if isinstance(out, (tuple, list)):
            got += " of " + ", ".join(type(s).__name__ for s in out) if out else " (empty)"
        return TypeError(f"{self.name}: its shape rule must return {want}{where}, got {got}")

    def _check_size(self, k: int, shape: Sequence[Any]) -> None:
        """Output *k*'s *shape* from the shape rule: no dimension below 0, at most :data:`MAX_ELEMENTS`
        elements (a framework may make more, of a byte count wrapped past 2^64). Symbolic dimensions
        (``jax.export``) pass. Checked paths call the rule per call, so plain ints take no ABC test."""
        n = 1
        for d in shape:
            if type(d) is not int:
                if not isinstance(d, numbers.Integral):
                    if isinstance(d, numbers.Real):  # a float; symbolic dims (jax.export) pass
                        raise TypeError(f"{self.name}: its shape rule gave output {k} the shape {tuple(shape)}; "
                                        f"dimensions must be ints, got {type(d).__name__} {d!r}")
                    continue
                d = int(d)
            if d < 0:
                raise ValueError(f"{self.name}: its shape rule gave output {k} the shape {tuple(shape)}; "
                                 f"dimensions must be >= 0")
            n *= d
        if n > MAX_ELEMENTS:
            raise ValueError(f"{self.name}: its shape rule gave output {k} the shape {tuple(shape)}, {n} elements: "
                             f"more than any buffer holds (2^59, whose bytes at 16 per element fit an int64)")

    @property
    def n_outputs(self) -> int:
        """How many outputs the adapter allocates (returns that are not aliases of inputs)."""
        return sum(1 for r in self.schema.returns if r.type.alias is None)

    @functools.cached_property
    def return_sources(self) -> tuple[int, ...]:
        """Where each return comes from: new output ``k`` as ``k``, argument ``i`` (its alias) as ``-1 - i``."""
        alias_of = {a.type.alias.set: i for i, a in enumerate(self.schema.arguments) if a.type.alias}
        new = iter(range(self.n_outputs))
        return tuple(next(new) if r.type.alias is None else -1 - alias_of[r.type.alias.set]
                     for r in self.schema.returns)

    @property
    def accepts_out(self) -> bool:
        """Whether the public callable takes ``out=``: the op returns new tensors."""
        return self.n_outputs > 0 and "out" not in {a.name for a in self.schema.arguments}

    @functools.cached_property
    def backward_reads(self) -> frozenset[int]:
        """Indices of the Tensor arguments the declared backward reads: the ones autograd must keep.

        Read from the backward's code: a parameter it never loads (``add``'s ``lambda grad, x, y:
        (grad, grad)``) is not kept alive for it, and a framework's in-place update of that argument
        after the call does not invalidate the backward. Every Tensor argument where the code cannot
        say (a callable without Python code, ``*args``, a nested function using the name).
        """
        tensors = frozenset(i for i, a in enumerate(self.schema.arguments) if a.type.is_tensor)
        code = getattr(self.backward, "__code__", None)
        if code is None or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
            return tensors
        params = code.co_varnames[:code.co_argcount]
        n_grads = len(self.schema.returns)
        if len(params) != n_grads + len(self.schema.arguments) or code.co_kwonlyargcount:
            return tensors
        loaded: set[str] = set(code.co_cellvars)  # captured by a nested function: read there
        for ins in dis.get_instructions(code):
            if ins.opname.startswith("LOAD_"):
                loaded.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
        return frozenset(i for i in tensors if params[n_grads + i] in loaded)

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


def validate_backward(schema: Schema, fn: Callable[..., Any]) -> None:
    """Refuse a backward that cannot take its call: one gradient per return, then every argument of the
    schema in order (:func:`opbridge.call.core.run_backward`), checked when the op is declared rather than
    inside a framework's autograd."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a Python signature: its call will say
        return
    n_grads, names = len(schema.returns), [a.name for a in schema.arguments]
    try:
        signature.bind(*([None] * (n_grads + len(names))))
    except TypeError as e:
        grads = "grad" if n_grads == 1 else f"{n_grads} gradients (one per return)"
        raise DeclarationError(
            f"{schema.name}: the backward{signature} cannot take its call ({e}): it is called with {grads}, "
            f"then the schema's arguments {', '.join(names)}; e.g. backward=lambda "
            f"{', '.join(['grad'] if n_grads == 1 else [f'grad{i}' for i in range(n_grads)])}, "
            f"{', '.join(names)}: ..."
        ) from None

