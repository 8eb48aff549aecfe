"""The schema parser fuzzed (hypothesis) against itself and against torch's own parser.

Drawn schemas (argument types, optional and list forms, write aliases,
defaults of every type, keyword-only arguments, named and aliased returns)
must survive ``str`` -> :func:`parse_schema` unchanged; where torch is
installed, ``torch._C.parse_schema`` must accept the same text, and our
parser must read torch's canonical rendering of it as the same schema.
"""

from __future__ import annotations

import os
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from opbridge.schema import parse_schema

SETTINGS = settings(max_examples=int(os.environ.get("OPBRIDGE_FUZZ_EXAMPLES", "0") or 0) or 150,
                    derandomize=not os.environ.get("OPBRIDGE_FUZZ_EXAMPLES"), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

_NAMES = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6).map(lambda s: f"a_{s}")
# finite and normal: torch's parser (std::stod) throws on subnormal literals
_FLOATS = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False, width=64).filter(
    lambda f: abs(f) < 1e300)
_STRS = st.text(alphabet=string.ascii_letters + string.digits + " _-.", max_size=8)


def _literal(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return repr(v)


@st.composite
def _argument(draw: st.DrawFn, name: str, alias: str | None) -> str:
    """One argument's text: type (optional, list, alias) and maybe a default."""
    base = draw(st.sampled_from(["Tensor", "int", "float", "bool", "str", "ScalarType"]))
    if base == "Tensor":
        mutated = alias is not None and draw(st.booleans())
        typ = f"Tensor({alias}!)" if mutated else "Tensor"
        if not mutated and draw(st.booleans()):
            typ += draw(st.sampled_from(["?", "[]"]))
        default = " = None" if typ.endswith("?") and draw(st.booleans()) else ""
        return f"{typ} {name}{default}".replace(" = ", "=")
    is_list = base in ("int", "float", "bool") and draw(st.booleans())
    size = draw(st.sampled_from([None, 2, 3])) if is_list and base == "int" else None
    optional = draw(st.booleans())
    typ = base + (f"[{'' if size is None else size}]" if is_list else "") + ("?" if optional else "")
    if not draw(st.booleans()):
        return f"{typ} {name}"
    if optional and (is_list or draw(st.booleans())):  # an optional list defaults to None only (as in torch)
        value: Any = None
    elif is_list:
        item = {"int": st.integers(-100, 100), "float": _FLOATS, "bool": st.booleans()}[base]
        value = draw(st.lists(item, min_size=size or 0, max_size=size or 3))
    else:
        value = draw({"int": st.integers(-2**40, 2**40), "float": _FLOATS, "bool": st.booleans(), "str": _STRS,
                      "ScalarType": st.integers(0, 15)}[base])
    return f"{typ} {name}={_literal(value)}"


@st.composite
def schemas(draw: st.DrawFn) -> str:
    name = draw(_NAMES)
    overload = draw(st.sampled_from(["", ".out", ".Tensor"]))
    names = draw(st.lists(_NAMES, min_size=0, max_size=5, unique=True))
    aliases = iter("abcdefgh")
    args = [draw(_argument(n, next(aliases))) for n in names]
    star = draw(st.integers(0, len(args))) if args and draw(st.booleans()) else len(args)
    # positional arguments with defaults come after those without (torch asserts it); keyword-only ones may mix
    positional = sorted(args[:star], key=lambda a: "=" in a)
    args = positional + (["*", *args[star:]] if star < len(args) else [])
    mutated = [a.split("(")[1][0] for a in args if a.startswith("Tensor(")]
    rets = draw(st.sampled_from(["()", "Tensor", "(Tensor, Tensor)", "(Tensor out, Tensor other)", "Tensor[]"]))
    if mutated and draw(st.booleans()):
        rets = f"Tensor({mutated[0]}!)"
    return f"{name}{overload}({', '.join(args)}) -> {rets}"


@SETTINGS
@given(text=schemas())
def test_render_and_parse_round_trip(text: str) -> None:
    s = parse_schema(text)
    again = parse_schema(str(s))
    assert again == s, f"{text!r} rendered as {str(s)!r}, which parses differently"
    assert str(again) == str(s)


@SETTINGS
@given(text=schemas())
def test_torch_reads_what_we_read(text: str) -> None:
    torch = pytest.importorskip("torch")
    ours = parse_schema(text)
    theirs = torch._C.parse_schema(text)
    try:  # torch renders an int[] default of equal items as one int, which it cannot parse itself
        torch._C.parse_schema(str(theirs))
    except RuntimeError:
        assume(False)
    assert parse_schema(str(theirs)) == ours, (
        f"{text!r}: torch renders it as {str(theirs)!r}, which we parse differently")
    assert [a.name for a in theirs.arguments] == [a.name for a in ours.arguments]
    assert [a.kwarg_only for a in theirs.arguments] == [a.kwarg_only for a in ours.arguments]
