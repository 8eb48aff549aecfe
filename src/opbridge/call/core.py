"""The op-call core: what every framework adapter does the same way.

An adapter supplies the few things that differ per framework (how to tell
an array, allocate one, find its memory span and name its dtype); everything
else an op call needs is here, once: argument checks against the schema and
the declared dtypes, output allocation from the shape rule (one rule: new
outputs are contiguous), packing outputs onto the schema's returns, and
running the declared backward. Which tensors share memory (the alias check
of mutating ops, ``out=`` over an input, dense copies of strided tensors) is
:mod:`opbridge.call.overlap`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opbridge._codegen import compile_source
from opbridge.declare import like
from opbridge.schema import check_value

if TYPE_CHECKING:
    from opbridge.declare import OpDef
    from opbridge.schema import Argument


def pack_results(op: OpDef, args: Sequence[Any], outs: Sequence[Any]) -> Any:
    """Map allocated outputs (and aliased inputs) onto the schema's returns."""
    if not op.schema.returns:
        return None
    res = []  # a plain loop: a comprehension would make args and outs closure cells on every call
    for k in op.return_sources:
        res.append(outs[k] if k >= 0 else args[-1 - k])
    return res[0] if len(res) == 1 else tuple(res)


def validate_args(op: OpDef, args: Sequence[Any], is_array: Callable[[Any], bool], kind: str) -> None:
    """Check each argument's Python type against the schema, naming the op and argument; an int scalar
    must also fit in int64 (:func:`check_int64`)."""
    for a, v in zip(op.schema.arguments, args):
        if a.type.is_tensor:
            if v is None and a.type.optional:
                continue
            if not is_array(v):
                raise TypeError(f"{op.name}: argument '{a.name}' must be {kind}, got {type(v).__name__}")
        else:
            check_value(op.name, a, v)
            if v is not None and a.type.base in ("int", "float"):
                check_int64(op, a, v)


#: The values a kernel takes an int in: tvm-ffi passes every Python int as an ``int64_t`` (for a ``float``
#: argument too, which the kernel converts), and one outside it as ``ffi.BigInt``, which no kernel takes.
INT64_RANGE = (-(1 << 63), (1 << 63) - 1)


def check_int64(op: OpDef, arg: Argument, value: Any) -> None:
    """Raise ValueError naming *op* and *arg* where the int *value* (or an int in the list *value*) of an
    ``int`` or ``float`` argument is outside :data:`INT64_RANGE`, as the kernels' own checks of a scalar's
    value do: tvm-ffi's error for it ("Expected `int` but got `ffi.BigInt`") names neither. Every
    framework's checked call runs it (:func:`validate_args`); the fast paths and C entries hand such a
    call there (the kernel's TypeError, or the entry's ``NotImplemented``)."""
    lo, hi = INT64_RANGE
    for k, v in enumerate(value if arg.type.is_list else (value,)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or lo <= int(v) <= hi:
            continue
        where = f"argument '{arg.name}'" + (f" at index {k}" if arg.type.is_list else "")
        n = int(v)
        got = f"the int {n}" if n.bit_length() <= 128 else f"an int of {n.bit_length()} bits"  # str() has a limit
        if arg.type.base == "int":
            raise ValueError(f"{op.name}: {where} must be in int64's range [-2**63, 2**63 - 1] (a kernel's "
                             f"int64_t), got {got}")
        raise ValueError(f"{op.name}: {where} is {got}, outside int64's range [-2**63, 2**63 - 1], in which a "
                         f"kernel takes an int for a float; pass it as a float, e.g. float({arg.name})")


def tensor_indices(op: OpDef) -> list[int]:
    """Schema indices of the op's Tensor arguments (optional ones included)."""
    return [i for i, a in enumerate(op.schema.arguments) if a.type.is_tensor]


def returns_its_out(op: OpDef) -> bool:
    """Whether a call of *op* with ``out=`` one tensor returns that tensor: the op takes ``out=`` and its one
    return is its one new output (the adapters' generated fast ``out=`` calls take only such ops)."""
    return op.accepts_out and list(op.return_sources) == [0]


def returns_its_outs(op: OpDef) -> bool:
    """Whether a call of *op* with ``out=`` returns it: the op's returns are its new outputs, in order, and
    nothing else (``out=`` one tensor, or a tuple of one per output). The C entries' ``out=`` calls take
    such ops: ``rms_norm_backward(..., out=(dx, dw))`` as well as :func:`returns_its_out`'s."""
    return op.accepts_out and list(op.return_sources) == list(range(op.n_outputs))


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


#: Largest total size in bytes (inputs plus outputs) of a trace-time dry run: the kernel run once on zero-filled
#: buffers of a call's shapes while a framework traces or compiles it, so that its own argument errors are
#: raised there and then instead of when the graph runs (JAX when it traces, Paddle's ``to_static``,
#: MindSpore's graph compile and recorded calls). Above it the run is skipped and such an error surfaces
#: from the running graph. One bound for all three: each run costs the same (fresh host buffers, zeroed
#: and touched by one CPU kernel call: about 0.1 s and 256 MiB of transient memory at the bound, once per
#: traced signature, never per call), whatever the framework. Read at each run: a test may lower it here.
DRY_RUN_MAX_BYTES = 256 << 20


def dry_run_fits(nbytes: int) -> bool:
    """Whether a trace-time dry run on zero-filled buffers of *nbytes* in all runs (:data:`DRY_RUN_MAX_BYTES`)."""
    return nbytes <= DRY_RUN_MAX_BYTES


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


#: How NumPy, JAX, Paddle and MindSpore arrays change dtype, for :func:`dtype_error`'s hint.
ASTYPE = 'astype("{}")'
#: What :func:`dtype_error`'s conversion hint starts with (an adapter with a better hint drops it).
CONVERT_HINT = "; convert it first, e.g. "


def dtype_error(op: OpDef, arg: str, got: str, convert: str = ASTYPE) -> TypeError:
    """The error every adapter raises for a dtype the op does not declare.

    *convert* is the framework's conversion, a method call with ``{}`` for the dtype's name: NumPy,
    JAX, Paddle and MindSpore take ``x.astype("float32")``, torch ``x.to(torch.float32)``.
    """
    names = list(op.dtypes)
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    hint = f"{CONVERT_HINT}{arg}.{convert.format(names[0])}"
    if op.dtypes_defaulted:
        return TypeError(f"{op.name}: {arg} must have dtype {listed}, got {got} (opbridge's default dtypes: "
                         f"{op.name} declares none; name its kernels' dtypes with Library.op(..., dtypes=...))"
                         + hint)
    return TypeError(f"{op.name}: {arg} must have dtype {listed}, got {got} (the dtypes {op.name} declares)"
                     + hint)


def scalar_guards(op: OpDef, names: Sequence[str]) -> list[str]:
    """Conditions a generated fast path adds so that it passes the kernel only the scalars
    :func:`opbridge.schema.check_value` accepts where tvm-ffi would convert others silently: a bool
    given for an ``int`` or ``float`` argument (tvm-ffi takes it as 0 or 1), anything but a bool for a
    ``bool`` one. The checked path then raises TypeError naming the argument, as every framework does.
    Other wrong types make tvm-ffi raise TypeError, which sends the call to the checked path anyway."""
    guards = []
    for i, takes_bool, optional in scalar_rules(op):
        if not takes_bool:
            guards.append(f"type({names[i]}) is not bool")
        else:
            guards.append(f"({names[i]} is None or type({names[i]}) is bool)" if optional
                          else f"type({names[i]}) is bool")
    return guards


def layout_source(op: OpDef, names: Sequence[str], dense: str, rows: str | None,
                  capture: tuple[str, str] | None = None) -> str:
    """An expression a generated fast path tests: every Tensor argument among *names* is in a layout the
    op's kernels take, *dense* (``{t}`` the argument's name), or, where the op declares the argument
    ``row_strided`` and *rows* is given, *rows* (rows at a stride). An optional argument may be None.

    *capture* ``(dense_name, rows_name)``, names over ``{t}`` such as ``("_c{t}", "_r{t}")``, keeps what
    the test read of each ``row_strided`` argument for code after it (a mutating op's alias test,
    :func:`opbridge.call.overlap.alias_check_source`'s *rows*): *dense*'s answer is bound to dense_name,
    and where it is false, *rows*' value to rows_name. *rows* is then a value that is None where the
    argument is not rows at a stride (the test is ``is not None``), not a truth value. After the test has
    passed, dense_name is bound for every present ``row_strided`` argument and rows_name for those of them
    that are not dense. It needs *rows*."""
    if capture is not None and rows is None:
        raise ValueError("layout_source: capture needs rows")
    tests = []
    for i in tensor_indices(op):
        t = dense.format(t=names[i])
        if rows is not None and i in op.row_strided:
            r = rows.format(t=names[i])
            if capture is not None:
                t = f"({capture[0].format(t=names[i])} := {t})"
                r = f"({capture[1].format(t=names[i])} := {r}) is not None"
            t = f"({t} or {r})"
        tests.append(f"({names[i]} is None or {t})" if op.schema.arguments[i].type.optional else t)
    return " and ".join(tests) or "True"


def scalar_rules(op: OpDef) -> list[tuple[int, bool, bool]]:
    """``(index, takes a bool, optional)`` of each ``int``, ``float`` and ``bool`` argument: the scalars
    whose type :func:`scalar_guards` tests (and torch's checked path, where the dispatcher's parser
    converts them)."""
    return [(i, a.type.base == "bool", a.type.optional) for i, a in enumerate(op.schema.arguments)
            if not a.type.is_tensor and not a.type.is_list and a.type.base in ("int", "float", "bool")]


def check_lead_dtype(op: OpDef, args: Sequence[Any], dtype_name: Callable[[Any], str],
                     convert: str = ASTYPE) -> None:
    """Raise :func:`dtype_error` (with *convert*) unless ``op.dtype_arg``'s dtype is one *op* declares.

    The kernel dispatches on that argument's dtype and checks the others
    against it.
    """
    got = dtype_name(args[op.dtype_arg])
    if got not in op.dtypes:
        raise dtype_error(op, op.schema.arguments[op.dtype_arg].name, got, convert)


def check_outs(op: OpDef, args: Sequence[Any], outs: Sequence[Any], dtype_name: Callable[[Any], str]) -> None:
    """Raise ValueError unless each ``out=`` array has the shape and dtype *op*'s shape rule gives that output.

    A kernel writes an output as the rule says it is: handed any other buffer, it would write past its
    end or store its bits in another type. (*dtype_name* names an array's dtype, as for
    :func:`check_lead_dtype`.) Every adapter's ``out=`` path checks this before the kernel runs; the
    fast paths and C entries hand a mismatch to that path.
    """
    for k, (o, s) in enumerate(zip(outs, op.output_specs(args), strict=True)):
        same = dtype_name(o) == s.dtype if isinstance(s.dtype, str) else o.dtype == s.dtype  # a name, or an input's
        if not same or tuple(o.shape) != tuple(s.shape):
            got = dtype_name(o)
            want = s.dtype if isinstance(s.dtype, str) else next(  # named by an input that has it
                (dtype_name(a) for a in args if hasattr(a, "dtype") and a.dtype == s.dtype), str(s.dtype))
            name = "out" if len(outs) == 1 else f"out[{k}]"
            raise ValueError(f"{op.name}: {name} has shape {tuple(o.shape)} and dtype {got}, but the output has "
                             f"shape {tuple(s.shape)} and dtype {want}")


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


def out_fits_source(op: OpDef, names: Sequence[str], out: str, plan: str) -> str:
    """A condition true where the one array *out* has the shape and dtype of *op*'s one output: a generated
    ``out=`` fast path's guard (anything else goes to the checked path, :func:`check_outs`).

    For a ``like`` rule it compares with that argument; else *plan* names the adapter's
    :func:`rule_plan` over ``{t}.shape, {t}.dtype`` whose answer per output is ``(shape, dtype)`` as the
    framework gives them.
    """
    idx = like_indices(op)
    if idx is not None:
        return f"{out}.shape == {names[idx[0]]}.shape and {out}.dtype == {names[idx[0]]}.dtype"
    return f"{plan}(({''.join(n + ', ' for n in names)})) == [(tuple({out}.shape), {out}.dtype)]"


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
