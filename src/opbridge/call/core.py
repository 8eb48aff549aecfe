"""The op-call core: what every framework adapter does the same way.

An adapter supplies the few things that differ per framework (how to tell
an array, allocate one, find its memory span and name its dtype); everything
else an op call needs is here, once: argument checks against the schema and
the declared dtypes, output allocation from the shape rule (one rule: new
outputs are contiguous), the alias check of mutating ops, packing outputs
onto the schema's returns, and running the declared backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opbridge._codegen import compile_source
from opbridge.declare import like
from opbridge.schema import check_value

if TYPE_CHECKING:
    from opbridge.declare import OpDef


def check_no_alias(op: OpDef, args: Sequence[Any], span: Callable[[Any], tuple[int, int]],
                   exact: Callable[[Any, Any], bool] | None = None) -> None:
    """Reject a mutated argument whose memory overlaps another tensor argument.

    *span* maps a tensor to ``(start, end)`` byte addresses (``end == start``
    when empty). Empty tensors overlap nothing; None (an absent optional
    tensor) is skipped. The first offending pair in schema order is named.
    Where *exact* is given (:func:`shares_memory`), a pair whose spans overlap
    must also share an element: strided views that interleave without one
    (the ``query`` and ``key`` column slices of one ``qkv`` tensor) are apart.
    This is the definition the adapters' per-op checks
    (:func:`alias_check_source`, :func:`make_alias_check`) defer to for the error.
    """
    tensors = [(a.name, args[i], span(args[i]), a.is_mutated) for i, a in enumerate(op.schema.arguments)
               if a.type.is_tensor and args[i] is not None]
    for i, (name, t0, (s0, e0), mutated) in enumerate(tensors):
        if not mutated or s0 == e0:
            continue
        for j, (other, t1, (s1, e1), _) in enumerate(tensors):
            if i != j and s1 != e1 and s1 < e0 and s0 < e1 and (exact is None or exact(t0, t1)):
                raise ValueError(f"{op.name}: mutated argument '{name}' overlaps argument "
                                 f"'{other}' in memory; pass separate tensors")


class _Interface:
    """An array interface over memory nothing reads: :func:`shares_memory`'s view of a tensor."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": shape, "strides": strides,
                                    "typestr": f"|V{itemsize}", "version": 3}


def shares_memory(describe: Callable[[Any], tuple[int, tuple[int, ...], tuple[int, ...], int]],
                  ) -> Callable[[Any, Any], bool]:
    """An exact test of whether two tensors share an element of memory, strides included.

    *describe* gives a tensor's ``(address, shape, byte strides, itemsize)``;
    ``numpy.shares_memory`` solves the overlap over array interfaces built from
    them (nothing is read or copied, so the address may be a device's). A case
    too hard for it within its work bound counts as overlapping.
    """
    import numpy as np

    too_hard = getattr(np, "exceptions", np).TooHardError

    def test(a: Any, b: Any) -> bool:
        va, vb = (np.asarray(_Interface(*describe(t))) for t in (a, b))
        try:
            # a bound on the candidates it tries (the stubs know only -1 and 0; any count is valid)
            return bool(np.shares_memory(va, vb, max_work=1 << 20))  # type: ignore[arg-type]
        except too_hard:
            return True

    return test


def alias_check_source(op: OpDef, names: Sequence[str], span: str, indent: str, overlap: str | None = None) -> str:
    """Straight-line source of :func:`check_no_alias` for *op*, for generated fast paths.

    Each tensor's span is computed once (an absent optional one gets the
    empty span ``(0, 0)``) and only pairs with a mutated tensor are compared,
    each pair once. A hit calls ``_alias((<names>,))``, which the caller binds
    to :func:`check_no_alias`: it names the first offending pair in schema
    order, and returns without raising where an empty tensor made the quick
    test hit. For ``advance_step_flashattn`` (6 tensors, 4 mutated) with torch
    spans this is 1.4 µs per call, against 6.7 µs for :func:`check_no_alias`.

    Parameters
    ----------
    op
        The op; ``""`` is returned when it mutates no tensor.
    names
        The expression holding each schema argument, in schema order.
    span
        A statement setting ``{s}`` and ``{e}`` to the start and end byte
        address of tensor ``{t}``, e.g. ``"{s} = {t}.data_ptr(); {e} = {s} + {t}.nbytes"``.
    indent
        Prefix of every line.
    overlap
        Instead of spans, an expression that is true when tensors ``{a}`` and
        ``{b}`` may overlap (NumPy's ``np.may_share_memory``, 0.18 µs a pair,
        where an ndarray's address costs 0.9 µs to read).
    """
    args = op.schema.arguments
    tensors = [i for i, a in enumerate(args) if a.type.is_tensor]
    both = [(i, j) for n, i in enumerate(tensors) for j in tensors[n + 1:] if args[i].is_mutated or args[j].is_mutated]
    if not both:
        return ""
    if overlap is not None:
        def test(i: int, j: int) -> str:
            present = [f"{names[k]} is not None" for k in (i, j) if args[k].type.optional]
            return f"({' and '.join([*present, overlap.format(a=names[i], b=names[j])])})"

        return (f"{indent}if {' or '.join(test(i, j) for i, j in both)}:\n"
                f"{indent}    _alias(({''.join(n + ', ' for n in names)}))\n")
    pairs = [f"(_as{j} < _ae{i} and _as{i} < _ae{j})" for i, j in both]
    lines = []
    for i in tensors:
        assign = span.format(t=names[i], s=f"_as{i}", e=f"_ae{i}")
        if args[i].type.optional:
            lines += [f"_as{i} = _ae{i} = 0", f"if {names[i]} is not None: {assign}"]
        else:
            lines.append(assign)
    lines += [f"if {' or '.join(pairs)}:", f"    _alias(({''.join(n + ', ' for n in names)}))"]
    return "".join(f"{indent}{line}\n" for line in lines)


AliasCheck = Callable[[Sequence[Any]], None]
_ALIAS_CHECKS: dict[tuple[Any, ...], AliasCheck] = {}


def make_alias_check(op: OpDef, span: Callable[[Any], tuple[int, int]],
                     overlap: Callable[[Any, Any], bool] | None = None,
                     exact: Callable[[Any, Any], bool] | None = None) -> AliasCheck:
    """:func:`check_no_alias` specialised to *op*: a function of the schema-ordered arguments.

    Compiled from :func:`alias_check_source` on the first request for an
    (op schema, *span*, *overlap*, *exact*) and kept, so callers may ask for it
    per call (the check depends on the schema only). *overlap*, where given,
    is the quick test of two tensors (else their spans are compared); *span*
    and *exact* decide, on a hit, whether the pair overlaps and name it. For
    an op that mutates no tensor it does nothing.
    """
    key = (op.schema, span, overlap, exact)
    check = _ALIAS_CHECKS.get(key)
    if check is None:
        check = _ALIAS_CHECKS[key] = _compile_alias_check(op, span, overlap, exact)
    return check


def _compile_alias_check(op: OpDef, span: Callable[[Any], tuple[int, int]],
                         overlap: Callable[[Any, Any], bool] | None,
                         exact: Callable[[Any, Any], bool] | None) -> AliasCheck:
    n = len(op.schema.arguments)
    body = alias_check_source(op, [f"args[{i}]" for i in range(n)], "{s}, {e} = _span({t})", "    ",
                              None if overlap is None else "_overlap({a}, {b})")
    ns: dict[str, Any] = {"_span": span, "_overlap": overlap,
                          "_alias": lambda a: check_no_alias(op, a, span, exact)}
    compile_source(f"def check(args):\n{body}    return None\n", f"<opbridge alias check {op.qualname}>", ns)
    check: AliasCheck = ns["check"]
    return check


def pack_results(op: OpDef, args: Sequence[Any], outs: Sequence[Any]) -> Any:
    """Map allocated outputs (and aliased inputs) onto the schema's returns."""
    if not op.schema.returns:
        return None
    res = []  # a plain loop: a comprehension would make args and outs closure cells on every call
    for k in op.return_sources:
        res.append(outs[k] if k >= 0 else args[-1 - k])
    return res[0] if len(res) == 1 else tuple(res)


def validate_args(op: OpDef, args: Sequence[Any], is_array: Callable[[Any], bool], kind: str) -> None:
    """Check each argument's Python type against the schema, naming the op and argument."""
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor:
            if v is None and a.type.optional:
                continue
            if not is_array(v):
                raise TypeError(f"{op.name}: argument '{a.name}' must be {kind}, got {type(v).__name__}")
        else:
            check_value(op.name, a, v)


def tensor_indices(op: OpDef) -> list[int]:
    """Schema indices of the op's Tensor arguments (optional ones included)."""
    return [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]


def like_indices(op: OpDef) -> list[int] | None:
    """For a ``like(...)`` shape rule, the index of the argument each output copies; else None."""
    if not isinstance(op.shape, like):
        return None
    names = [a.name for a in op.schema.arguments]
    return [names.index(n) for n in op.shape.names]


Empty = Callable[[tuple[int, ...], Any, Any], Any]


def alloc_outputs(op: OpDef, args: Sequence[Any], empty: Empty) -> list[Any]:
    """New outputs for a call of *op*, from its shape rule: always contiguous.

    *empty* ``(shape, dtype, lead)`` allocates one array of the framework on
    the device of *lead* (the dispatching argument); *dtype* is what the shape
    rule gave (an input's dtype object or a dtype name).
    """
    lead = args[op.dispatch_arg]
    idx = like_indices(op)
    if idx is not None:
        return [empty(tuple(args[i].shape), args[i].dtype, lead) for i in idx]
    return [empty(tuple(s.shape), s.dtype, lead) for s in op.output_specs(args)]


#: Distinct argument signatures whose shape-rule answers :func:`rule_plan` keeps per op (then it starts over).
RULE_CACHE_SIZE = 256


def rule_plan(op: OpDef, tensor_sig: str, plan: Callable[[tuple[int, ...], Any], Any],
              label: str) -> Callable[[Sequence[Any]], list[Any]]:
    """*op*'s shape rule as the adapters allocate from it, answered once per argument signature.

    A shape rule is a function of the arguments' shapes, dtypes and scalar
    values only (``torch.compile`` runs it on fake tensors), so its answer is
    kept per such signature: a repeated call costs one dict lookup instead of
    the rule (1.2-1.7 µs for ``silu_and_mul``). The returned function takes the
    argument tuple and gives ``plan(shape, dtype)`` for each output, *plan*
    being the adapter's allocation recipe (its dtype object, whether the
    output comes from the pool), computed on the first call of a signature.
    *tensor_sig* is the framework's hashable signature of tensor ``{t}``
    (``"{t}.shape, {t}.dtype"``); a signature with an unhashable scalar (a
    list) runs the rule each time. *label* names the generated source.
    """
    key = ", ".join(f"({tensor_sig.format(t=f'a[{i}]')})" if a.type.is_tensor and not a.type.optional
                    else f"(None if a[{i}] is None else ({tensor_sig.format(t=f'a[{i}]')}))" if a.type.is_tensor
                    else f"a[{i}]" for i, a in enumerate(op.schema.arguments))
    cache: dict[Any, list[Any]] = {}

    def miss(k: Any, a: Sequence[Any]) -> list[Any]:
        got = [plan(tuple(int(n) for n in s.shape), s.dtype) for s in op.output_specs(a)]
        try:
            if len(cache) >= RULE_CACHE_SIZE:
                cache.clear()
            cache[k] = got
        except TypeError:  # an unhashable scalar
            pass
        return got

    src = (f"def plans(a):\n"
           f"    k = ({key},)\n"
           "    try:\n"
           "        got = _cache.get(k)\n"
           "    except TypeError:\n"
           "        got = None\n"
           "    return _miss(k, a) if got is None else got\n")
    ns: dict[str, Any] = {"_cache": cache, "_miss": miss}
    compile_source(src, f"<opbridge {op.qualname} {label} rule plan>", ns)
    plans: Callable[[Sequence[Any]], list[Any]] = ns["plans"]
    return plans


def no_backward_error(op: OpDef) -> NotImplementedError:
    """The error for differentiating an op that cannot be differentiated."""
    if op.schema.is_mutating:
        return NotImplementedError(f"{op.name}: cannot be differentiated: it mutates its arguments")
    return NotImplementedError(f"{op.name}: no backward is declared, so it cannot be differentiated "
                               f"(declare backward= in its Library.op)")


def run_backward(op: OpDef, grads: Sequence[Any], full: Sequence[Any]) -> list[Any]:
    """Run the declared backward: one gradient (or None) per Tensor argument, in schema order.

    *grads* are the output gradients (already materialised: no None where the
    backward needs a value), *full* the forward's arguments in schema order.
    """
    if op.backward is None or op.schema.is_mutating:
        raise no_backward_error(op)
    res = op.backward(*grads, *full)
    res = list(res) if isinstance(res, (tuple, list)) else [res]
    n = len(tensor_indices(op))
    if len(res) != n:
        raise RuntimeError(f"{op.name}: backward returned {len(res)} gradient(s), expected one "
                           f"per Tensor argument ({n})")
    return res


def dtype_error(op: OpDef, arg: str, got: str) -> TypeError:
    """The error every adapter raises for a dtype the op does not declare."""
    names = list(op.dtypes)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    if op.dtypes_defaulted:
        return TypeError(f"{op.name}: {arg} must have dtype {listed}, got {got} (opbridge's default dtypes: "
                         f"{op.name} declares none; name its kernels' dtypes with Library.op(..., dtypes=...))")
    return TypeError(f"{op.name}: {arg} must have dtype {listed}, got {got} (the dtypes {op.name} declares)")


def scalar_guards(op: OpDef, names: Sequence[str]) -> list[str]:
    """Conditions a generated fast path adds so that it passes the kernel only the scalars
    :func:`opbridge.schema.check_value` accepts where tvm-ffi would convert others silently: a bool
    given for an ``int`` or ``float`` argument (tvm-ffi takes it as 0 or 1), anything but a bool for a
    ``bool`` one. The checked path then raises TypeError naming the argument, as every framework does.
    Other wrong types make tvm-ffi raise TypeError, which sends the call to the checked path anyway."""
    guards = []
    for i, a in enumerate(op.schema.arguments):
        if a.type.is_tensor or a.type.is_list:
            continue
        if a.type.base in ("int", "float"):
            guards.append(f"type({names[i]}) is not bool")
        elif a.type.base == "bool":
            guards.append(f"({names[i]} is None or type({names[i]}) is bool)" if a.type.optional
                          else f"type({names[i]}) is bool")
    return guards


def check_lead_dtype(op: OpDef, args: Sequence[Any], dtype_name: Callable[[Any], str]) -> None:
    """Raise :func:`dtype_error` unless ``op.dtype_arg``'s dtype is one *op* declares.

    The kernel dispatches on that argument's dtype and checks the others
    against it.
    """
    got = dtype_name(args[op.dtype_arg])
    if got not in op.dtypes:
        raise dtype_error(op, op.schema.arguments[op.dtype_arg].name, got)


def framework_dtypes(op: OpDef, convert: Callable[[str], Any]) -> frozenset[Any]:
    """The op's declared dtypes as one framework's dtype objects (names it lacks are left out)."""
    out = set()
    for name in op.dtypes:
        try:
            out.add(convert(name))
        except (AttributeError, TypeError, ValueError):
            continue
    return frozenset(out)


# -- generated source shared by the adapters' specialised calls -----------------------------


def alloc_source(op: OpDef, names: Sequence[str], outs: Sequence[str], new_like: str,
                 from_rule: str) -> list[str]:
    """Statements allocating *outs* for a call of *op*, under the one layout rule (contiguous).

    *new_like* is the adapter's expression for a new contiguous array shaped
    and typed like ``{x}``; *from_rule* an expression (over ``{args}``, the
    argument tuple) returning every output from the shape rule.
    """
    idx = like_indices(op)
    if idx is not None:
        return [f"{o} = {new_like.format(x=names[i])}" for o, i in zip(outs, idx)]
    if outs:
        return [f"{', '.join(outs)}, = {from_rule.format(args='(' + ''.join(n + ', ' for n in names) + ')')}"]
    return []


def returns_source(op: OpDef, names: Sequence[str], outs: Sequence[str], indent: str) -> list[str]:
    """The ``return`` statement mapping *outs* (and aliased inputs) onto the schema's returns.

    ``_pack`` must be bound to ``lambda args, outs: pack_results(op, args, outs)``
    where more than one value is returned.
    """
    returns = op.schema.returns
    if not returns:
        return [f"{indent}return None"]
    if len(returns) == 1 and len(outs) == 1:
        return [f"{indent}return {outs[0]}"]
    return [f"{indent}return _pack(({''.join(n + ', ' for n in names)}), ({''.join(o + ', ' for o in outs)}))"]


# -- strided inputs ------------------------------------------------------------------------


def dense_args(op: OpDef, args: Sequence[Any], is_dense: Callable[[Any], bool],
               densify: Callable[[Any], Any]) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Arguments for a kernel that takes dense (contiguous) tensors only.

    Each Tensor argument that is not dense is replaced by a dense copy
    (``densify``). A mutated argument is copied in and must be copied back
    after the kernel: the pairs ``(original, copy)`` to copy back are
    returned beside the arguments. Dense arguments pass through untouched,
    so the common case costs one ``is_dense`` test per tensor.
    """
    full = list(args)
    back: list[tuple[Any, Any]] = []
    for i, a in enumerate(op.schema.arguments):
        v = full[i]
        if not a.type.is_tensor or v is None or is_dense(v):
            continue
        full[i] = densify(v)
        if a.is_mutated:
            back.append((v, full[i]))
    return full, back


def dense_outputs(outs: Sequence[Any], is_dense: Callable[[Any], bool],
                  new_dense: Callable[[Any], Any], *, fresh: bool = False) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """The caller's ``out=`` buffers as a kernel that takes dense tensors gets them.

    Each buffer that is not dense (every buffer, with *fresh*: see
    :func:`outputs_overlap`) is replaced by a new dense one of its shape and
    dtype (``new_dense``), which the kernel writes and the caller copies back
    into the buffer afterwards: the pairs ``(buffer, dense)`` are returned
    beside the list, as :func:`dense_args` returns mutated ones.
    """
    dense = list(outs)
    back: list[tuple[Any, Any]] = []
    for i, o in enumerate(outs):
        if fresh or not is_dense(o):
            dense[i] = new_dense(o)
            back.append((o, dense[i]))
    return dense, back


def outputs_overlap(op: OpDef, args: Sequence[Any], outs: Sequence[Any], overlap: Callable[[Any, Any], bool]) -> bool:
    """Whether an ``out=`` buffer may share memory with a Tensor argument or another ``out=`` buffer.

    Such a call runs its kernel into fresh buffers, copied into the caller's
    after it ran (:func:`dense_outputs` with ``fresh=True``), as NumPy's ufuncs
    buffer overlapping operands: the inputs are read as they were before the
    call, whatever order a kernel reads and writes in. *overlap* is the
    framework's test of two tensors (``np.may_share_memory``, or
    :func:`span_overlap`).
    """
    tensors = [args[i] for i in tensor_indices(op) if args[i] is not None]
    for k, o in enumerate(outs):
        if any(overlap(o, t) for t in tensors) or any(overlap(o, p) for p in outs[:k]):
            return True
    return False


def span_overlap(span: Callable[[Any], tuple[int, int]]) -> Callable[[Any, Any], bool]:
    """A test of whether two tensors' byte ranges (*span*: ``(start, end)``, strides included) overlap."""
    def overlap(a: Any, b: Any) -> bool:
        (s0, e0), (s1, e1) = span(a), span(b)
        return s0 != e0 and s1 != e1 and s1 < e0 and s0 < e1

    return overlap
