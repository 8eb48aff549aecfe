"""Which tensors share memory, for every adapter: the alias check of mutating ops, ``out=`` buffers
over an input, and the dense copies that strided tensors reach a kernel through.

A quick test of byte spans (or ``numpy.may_share_memory``) finds candidate
pairs; :func:`opbridge.call.layout.shares_memory` decides exactly, strides included, so that
views which interleave without sharing an element (the ``query`` and ``key``
column slices of one ``qkv`` tensor) are apart. The layouts themselves (which bytes
a tensor's elements take) are :mod:`opbridge.call.layout`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opbridge._codegen import compile_source
from opbridge.call.core import pack_results, tensor_indices

if TYPE_CHECKING:
    from opbridge.call.layout import WrittenCheck
    from opbridge.declare import OpDef


def check_no_alias(op: OpDef, args: Sequence[Any], span: Callable[[Any], tuple[int, int]],
                   exact: Callable[[Any, Any], bool] | None = None) -> None:
    """Reject a mutated argument whose memory overlaps another tensor argument.

    *span* maps a tensor to ``(start, end)`` byte addresses (``end == start``
    when empty). Empty tensors overlap nothing; None (an absent optional
    tensor) is skipped. The first offending pair in schema order is named.
    Where *exact* is given (:func:`.layout.shares_memory`), a pair whose spans overlap
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
        for j, (other, t1, (s1, e1), other_mutated) in enumerate(tensors):
            if j < i and other_mutated:
                continue  # this pair was tested from j's side
            if i != j and s1 != e1 and s1 < e0 and s0 < e1 and (exact is None or exact(t0, t1)):
                raise ValueError(f"{op.name}: mutated argument '{name}' overlaps argument "
                                 f"'{other}' in memory; pass separate tensors")


def alias_check_source(op: OpDef, names: Sequence[str], span: str, indent: str, overlap: str | None = None,
                       rows: tuple[str, str] | None = None) -> str:
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
    rows
        For the arguments the op declares ``row_strided``, which a fast path
        may hand over as rows at a stride: a span statement that reaches
        every row (as *span*, strides included), and an exact expression that
        is true when two such tensors ``{a}`` and ``{b}`` share an element
        (:func:`.layout.shares_memory`), tested where their spans overlap: vLLM's
        ``query`` and ``key`` slices of one ``qkv`` interleave without one.
        Without it, a hit on such an argument always calls ``_alias``.
    """
    args = op.schema.arguments
    tensors = [i for i, a in enumerate(args) if a.type.is_tensor]
    both = [(i, j) for n, i in enumerate(tensors) for j in tensors[n + 1:] if args[i].is_mutated or args[j].is_mutated]
    if not both:
        return ""
    strided = set(op.row_strided)

    def exact(i: int, j: int) -> str:
        if rows is None or i not in strided or j not in strided:
            return ""
        return " and " + rows[1].format(a=names[i], b=names[j])

    if overlap is not None:
        def test(i: int, j: int) -> str:
            present = [f"{names[k]} is not None" for k in (i, j) if args[k].type.optional]
            return f"({' and '.join([*present, overlap.format(a=names[i], b=names[j])])}{exact(i, j)})"

        return (f"{indent}if {' or '.join(test(i, j) for i, j in both)}:\n"
                f"{indent}    _alias(({''.join(n + ', ' for n in names)}))\n")
    pairs = [f"(_as{j} < _ae{i} and _as{i} < _ae{j}{exact(i, j)})" for i, j in both]
    lines = []
    for i in tensors:
        if i not in strided:
            assign = span.format(t=names[i], s=f"_as{i}", e=f"_ae{i}")
        elif rows is not None:
            assign = rows[0].format(t=names[i], s=f"_as{i}", e=f"_ae{i}")
        else:  # a span that may not reach its rows: every pair with it goes to _alias
            assign = f"_as{i}, _ae{i} = 0, 1 << 64"
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
    (op schema and row_strided arguments, *span*, *overlap*, *exact*) and kept, so callers may ask for it
    per call (the check depends on the schema only). *overlap*, where given,
    is the quick test of two tensors (else their spans are compared); *span*
    and *exact* decide, on a hit, whether the pair overlaps and name it. For
    an op that mutates no tensor it does nothing.
    """
    key = (op.schema, op.row_strided, span, overlap, exact)
    check = _ALIAS_CHECKS.get(key)
    if check is None:
        check = _ALIAS_CHECKS[key] = _compile_alias_check(op, span, overlap, exact)
    return check


def _compile_alias_check(op: OpDef, span: Callable[[Any], tuple[int, int]],
                         overlap: Callable[[Any, Any], bool] | None,
                         exact: Callable[[Any, Any], bool] | None) -> AliasCheck:
    n = len(op.schema.arguments)
    body = alias_check_source(op, [f"args[{i}]" for i in range(n)], "{s}, {e} = _span({t})", "    ",
                              None if overlap is None else "_overlap({a}, {b})",
                              None if exact is None else ("{s}, {e} = _span({t})", "_exact({a}, {b})"))
    ns: dict[str, Any] = {"_span": span, "_overlap": overlap, "_exact": exact,
                          "_alias": lambda a: check_no_alias(op, a, span, exact)}
    compile_source(f"def check(args):\n{body}    return None\n", f"<opbridge alias check {op.qualname}>", ns)
    check: AliasCheck = ns["check"]
    return check


def dense_args(op: OpDef, args: Sequence[Any], is_dense: Callable[[Any], bool],
               densify: Callable[[Any], Any],
               rows: Callable[[Any], bool] | None = None, *,
               written: WrittenCheck | None = None) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Arguments for a kernel that takes dense (contiguous) tensors, and rows at a stride where declared.

    Each Tensor argument that is not dense is replaced by a dense copy
    (``densify``), except one the op declares ``row_strided`` that *rows*
    (the framework's :func:`.layout.row_strided` test of a tensor) accepts: the
    kernel takes that as it is. A mutated argument is copied in and must be
    copied back after the kernel: the pairs ``(original, copy)`` to copy back
    are returned beside the arguments. Dense arguments pass through
    untouched, so the common case costs one ``is_dense`` test per tensor.
    Every other argument the op writes is first checked by *written*
    (:func:`.layout.written_check`: read-only, elements that share memory), all of
    them before the caller runs a kernel, so that nothing is written on an
    error.
    """
    full = list(args)
    back: list[tuple[Any, Any]] = []
    for i, a in enumerate(op.schema.arguments):
        v = full[i]
        if not a.type.is_tensor or v is None or is_dense(v):
            continue
        if written is not None and a.is_mutated:
            written(op, f"argument '{a.name}'", v)
        if rows is not None and i in op.row_strided and rows(v):
            continue
        full[i] = densify(v)
        if a.is_mutated:
            back.append((v, full[i]))
    return full, back


def recall_dense(op: OpDef, check_alias: Callable[[Sequence[Any]], None], is_dense: Callable[[Any], bool],
                 densify: Callable[[Any], Any], rows: Callable[[Any], bool] | None,
                 copy_back: Callable[[Any, Any], object], *,
                 written: WrittenCheck | None = None) -> Callable[[Sequence[Any]], Any]:
    """*op* from an adapter's fast path on arguments some of which a kernel does not take as they are:
    the public callable again on :func:`dense_args`' copies (its C entry or fast path, on dense arrays),
    mutated arguments then copied back (``copy_back(original, copy)``) and the caller's own arrays
    returned where a return aliases one. No kernel error to catch and no slower path: a kernel's
    ValueError for a strided input costs about 100 us a call (a C++ exception and its backtrace). The
    alias check runs on the arguments as given (a copy overlaps nothing), and so does *written*, on every
    mutated one copied (:func:`dense_args`), before the call; the other checks are the call's, with its
    messages.
    """
    split = op.schema.split
    sources = op.return_sources
    aliased = any(k < 0 for k in sources)

    def run(args: Sequence[Any]) -> Any:
        check_alias(args)
        full, back = dense_args(op, args, is_dense, densify, rows, written=written)
        pos, kw = split(full)
        result = op.call(*pos, **kw)
        for orig, copy in back:
            copy_back(orig, copy)
        if not aliased:
            return result
        got = result if isinstance(result, tuple) else (result,)  # the new outputs, then the copies' aliases
        return pack_results(op, args, [r for k, r in zip(sources, got) if k >= 0])

    return run


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


def outputs_overlap(op: OpDef, args: Sequence[Any], outs: Sequence[Any], overlap: Callable[[Any, Any], bool],
                    exact: Callable[[Any, Any], bool] | None = None, *,
                    written: WrittenCheck | None = None, is_dense: Callable[[Any], bool] | None = None) -> bool:
    """Whether an ``out=`` buffer may share memory with a Tensor argument; ValueError where two buffers
    share an element, or one's elements share memory.

    Such a call runs its kernel into fresh buffers, copied into the caller's
    after it ran (:func:`dense_outputs` with ``fresh=True``), as NumPy's ufuncs
    buffer overlapping operands: the inputs are read as they were before the
    call, whatever order a kernel reads and writes in. *overlap* is the
    framework's test of two tensors (``np.may_share_memory``, or
    :func:`span_overlap`).

    Two buffers that share an element would each be written a result for
    it, one copy over the other: that raises ValueError naming both, and so,
    with *written* (:func:`.layout.written_check`), does a buffer that is not dense
    (*is_dense*: else every buffer is checked) and cannot be written
    (elements that share memory; read-only). A pair that *overlap* hits is
    decided by *exact* where given (:func:`.layout.shares_memory`: interleaved
    column slices of one array are apart), else refused.
    """
    for k, o in enumerate(outs):
        if written is not None and (is_dense is None or not is_dense(o)):
            written(op, "out" if len(outs) == 1 else f"out[{k}]", o)
        for p in range(k):
            if overlap(o, outs[p]) and (exact is None or exact(o, outs[p])):
                raise ValueError(f"{op.name}: out[{p}] and out[{k}] overlap in memory; pass separate tensors")
    tensors = [args[i] for i in tensor_indices(op) if args[i] is not None]
    return any(overlap(o, t) for o in outs for t in tensors)


def span_overlap(span: Callable[[Any], tuple[int, int]]) -> Callable[[Any, Any], bool]:
    """A test of whether two tensors' byte ranges (*span*: ``(start, end)``, strides included) overlap."""
    def overlap(a: Any, b: Any) -> bool:
        (s0, e0), (s1, e1) = span(a), span(b)
        return s0 != e0 and s1 != e1 and s1 < e0 and s0 < e1

    return overlap
