"""The checks of :func:`opbridge.testing.fuzz.fuzz_op` whose calls must fail: ``bad_dtype``,
``bad_shape``, ``scalars`` and ``aliasing`` (and their near misses, which must succeed: equivalent
scalars, and written arguments beside another argument in one buffer).

Each takes the op's :class:`~opbridge.testing.fuzz_calls.Fuzzer`; a wrong call
must raise an error naming the op (and, for a scalar, the argument) on every
path, with nothing written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opbridge.errors import OpbridgeError
from opbridge.testing.compare import assert_close
from opbridge.testing.fuzz_calls import Fuzzer, Skip, add_note, compared_dtype, same_values, written_or_results
from opbridge.testing.layouts import Placed, rounded

__all__ = ["check_aliasing", "check_bad_input", "check_scalars", "corrupt"]


def corrupt(f: Fuzzer, case: dict[str, Any], dtype: str, how: str) -> tuple[dict[str, Any], str, str] | None:
    """*case* with one tensor argument made inconsistent with the dispatching one, or None.

    ``dtype``: a float argument gets another float dtype; ``shape``: an
    argument whose last dim is the lead's gets one more column. Returns the
    case, the argument's name and the dtype it takes.
    """
    lead = case[f.args[f.op.dtype_arg].name]
    floats = [d for d in ("float32", "float64", "float16") if d != dtype and d in f.h.dtypes]
    for i, a in enumerate(f.args):
        v = case[a.name]
        if i == f.op.dtype_arg or not a.type.is_tensor or not isinstance(v, np.ndarray) or not v.size:
            continue
        if how == "dtype" and v.dtype.kind == "f" and floats:
            return case, a.name, floats[0]
        if how == "shape" and v.ndim and lead.ndim and v.shape[-1] == lead.shape[-1] and v.dtype.kind == "f":
            return {**case, a.name: np.concatenate([v, v[..., :1]], axis=-1)}, a.name, dtype
    return None


def check_bad_input(f: Fuzzer, dtype: str, case: dict[str, Any], layouts: dict[str, str], how: str) -> bool:
    """A named TypeError or ValueError on every path, nothing written; False where *case* cannot be corrupted."""
    bad = corrupt(f, case, dtype, how)
    if bad is None:
        return False
    case, name, bad_dtype = bad
    layouts = {k: v for k, v in layouts.items() if k != name or f.mem.usable(v, tuple(case[name].shape))}
    dtypes = {**f.float_dtypes(case, dtype), name: bad_dtype}
    lead = f.args[f.op.dtype_arg].name
    macro = "OPB_CHECK_SAME_DTYPE" if how == "dtype" else "OPB_CHECK_SAME_SHAPE"
    hint = f"does the kernel check '{name}' against '{lead}'? e.g. {macro}(\"{f.op.name}\", {name}, {lead});"
    for label, call in f.paths():
        placed, args = f.placed_args(case, dtypes, layouts)
        where = f"{label} {f.op.name} {dtype}, '{name}' given {how} {bad_dtype} {case[name].shape}, " \
                f"layouts {layouts}"
        _raises_writing_nothing(f, call, placed, args, (TypeError, ValueError), [f.op.name], where, hint)
    return True


def check_scalars(f: Fuzzer, dtype: str, case: dict[str, Any], layouts: dict[str, str]) -> bool:
    """NumPy scalars give the plain value's bits; wrong types raise a named TypeError, nothing written.

    False where the op has no int, float or bool argument.
    """
    scalars = [a for a in f.args if not a.type.is_tensor and not a.type.is_list
               and a.type.base in ("int", "float", "bool") and case[a.name] is not None]
    if not scalars:
        return False
    dtypes = f.float_dtypes(case, dtype)
    for n, (label, call) in enumerate(f.paths()):
        _, args = f.placed_args(case, dtypes, layouts)
        want = [f.mem.np64(x) for x in written_or_results(f, args, f.invoke(call, args))]
        for a in scalars:
            v = case[a.name]
            same = {"int": np.int64, "float": np.float64, "bool": None}[a.type.base]
            if same is not None:
                _, args = f.placed_args({**case, a.name: same(v)}, dtypes, layouts)
                got = [f.mem.np64(x) for x in written_or_results(f, args, f.invoke(call, args))]
                assert all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, want)), \
                    f"{label} {f.op.name}: '{a.name}' = {type(same(v)).__name__}({v!r}) gives other results " \
                    f"than {v!r}"
            if n:  # torch.ops.<ns>.<op> parses its arguments by torch's own rules
                continue
            wrong: list[Any] = ["4"] + ([] if a.type.optional else [None])
            by_type: dict[str, list[Any]] = {"int": [True, float(v) + 0.5], "float": [True], "bool": [1]}
            wrong += by_type[a.type.base]
            for w in wrong:
                placed, args = f.placed_args({**case, a.name: w}, dtypes, layouts)
                where = f"{label} {f.op.name} {dtype}: '{a.name}' = {w!r} ({a.type})"
                _raises_writing_nothing(f, call, placed, args, (TypeError,), [f.op.name, a.name], where)
    return True


def check_aliasing(f: Fuzzer, dtype: str, case: dict[str, Any]) -> bool:
    """A written argument in one buffer with another argument of its shape.

    Side by side (``[..., :n]`` and ``[..., n:2n]``, byte spans interleaved,
    no element shared, as vLLM passes ``query`` and ``key``): the call runs and
    matches the reference, nothing else in the buffer written. Overlapping by
    one element: a ValueError naming the op, nothing written. False where the
    op writes no float argument that another argument matches in shape.
    """
    pairs = [(i, j) for i, a in enumerate(f.args) if a.is_mutated and _float_array(case[a.name])
             for j, b in enumerate(f.args) if j != i and b.type.is_tensor and _float_array(case[b.name])
             and case[b.name].shape == case[a.name].shape]
    if not pairs:
        return False
    i, j = pairs[0]
    name_i, name_j = f.args[i].name, f.args[j].name
    dtypes = f.float_dtypes(case, dtype)
    _, args = f.placed_args(case, dtypes, {})
    args[i], args[j], whole = f.mem.side_by_side(case[name_i], case[name_j], dtype)
    ref_args = [f.mem.np64(x) if isinstance(case[a.name], np.ndarray) else x for a, x in zip(f.args, args)]
    ref = f.reference(ref_args)  # writes the mutated ones of ref_args, which are copies
    want = [ref_args[k] for k, a in enumerate(f.args) if a.is_mutated and ref_args[k] is not None]
    want += [] if ref is None else list(ref) if isinstance(ref, tuple) else [ref]
    where = f"{f.framework} {f.op.name} {dtype}: '{name_i}' and '{name_j}'"
    got = written_or_results(f, args, f.invoke(f.op.call, args))
    rtol, atol = f.op.tolerance(dtype)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(f.mem.np64(g), rounded(w, dtype), rtol=rtol, atol=atol, dtype=compared_dtype(g),
                     name=f"{where} side by side in one buffer: result {k}")
    f.mem.check_around(whole, f"{where} side by side:")
    if case[name_i].size < 2:  # one element shifted by one overlaps nothing
        return True
    views = f.mem.shared([case[name_i], case[name_j]], dtype, 1)
    if views is None:
        raise Skip(f"{f.framework}: a reshape of a slice copies, so views cannot overlap")
    _, args = f.placed_args(case, dtypes, {})
    args[i], args[j] = views
    before = [f.mem.np64(v) for v in views]
    try:
        f.invoke(f.op.call, args)
    except ValueError as e:
        _not_a_refusal(e, f"{where} overlapping by one element")
        assert f.op.name in str(e), f"{where} overlapping: the error does not name the op: {e}"
    else:
        raise AssertionError(f"{where} overlapping by one element: no error: expected a ValueError naming "
                             f"'{f.op.name}', and the call returned")
    for v, was in zip(views, before):
        assert same_values(f.mem.np64(v), was), f"{where} overlapping: written by a call that raised"
    return True


def _raises_writing_nothing(f: Fuzzer, call: Any, placed: list[Placed | None], args: list[Any],
                            errors: tuple[type[Exception], ...], names: list[str], where: str,
                            hint: str = "") -> None:
    """*call* on *args* raises one of *errors* naming each of *names*, and leaves every placed view (and the
    memory around it) as it was. An opbridge error (the op cannot be built, loaded or called) is no such
    refusal: it propagates. *hint*: what to check when nothing raised."""
    before = [None if p is None else f.mem.np64(p.view) for p in placed]
    try:
        f.invoke(call, args)
    except errors as e:
        _not_a_refusal(e, where)
        missing = [n for n in names if n not in str(e)]
        assert not missing, f"{where}: the error does not name {', '.join(repr(n) for n in missing)}: {e}"
    else:
        kinds = " or ".join(k.__name__ for k in errors)
        raise AssertionError(f"{where}: no error: expected a {kinds} naming "
                             f"{' and '.join(repr(n) for n in names)}, and the call returned"
                             + (f"; {hint}" if hint else ""))
    for p, was in zip(placed, before):
        if p is not None and was is not None:
            assert same_values(f.mem.np64(p.view), was), f"{where}: '{p.name}' ({p.layout}) was written by a " \
                                                      f"call that raised"
            f.mem.check_around(p, f"{where}: argument")


def _not_a_refusal(e: Exception, where: str) -> None:
    """Re-raise *e* if it is an opbridge error (a DeclarationError is a ValueError, but it says the op's
    kernel cannot be loaded or called at all, not that this argument was refused)."""
    if isinstance(e, OpbridgeError):
        add_note(e, f"fuzz_op: {where}: raised {type(e).__name__}, which is not the op's own refusal of the "
                   "bad argument (a TypeError or ValueError from its checks): the op cannot be called at all")
        raise e


def _float_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.ndim >= 1 and v.size > 0

