"""Tests for opbridge.schema: parsing, rendering, errors, bind() and check_value()."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from opbridge.schema import (
    NO_DEFAULT,
    Alias,
    Argument,
    Return,
    Schema,
    SchemaError,
    Type,
    check_value,
    parse_schema,
)

RMS_NORM = "rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor"
FUSED_ADD_RMS_NORM = (
    "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=1e-6) -> ()"
)
ROTARY = (
    "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox) -> ()"
)
ADVANCE_STEP = (
    "advance_step_flashattn(int num_seqs, int num_queries, int block_size, Tensor(a!) input_tokens, "
    "Tensor sampled_token_ids, Tensor(b!) input_positions, Tensor(c!) seq_lens, "
    "Tensor(d!) slot_mapping, Tensor block_tables) -> ()"
)

REPRESENTATIVE = [
    RMS_NORM,
    FUSED_ADD_RMS_NORM,
    ROTARY,
    ADVANCE_STEP,
    "relu(Tensor x) -> Tensor",
    "noop() -> ()",
    "topk.values(Tensor self, SymInt k, int dim=-1, bool largest=True, bool sorted=True) "
    "-> (Tensor values, Tensor indices)",
    "split(Tensor(a) self, int[] split_sizes, int dim=0) -> Tensor(a)[]",
    "add_.Tensor(Tensor(a!) self, Tensor other, *, float alpha=1) -> Tensor(a!)",
    "conv(Tensor x, Tensor w, Tensor? bias=None, int[2] stride=[1, 1], int[2] padding=0, "
    "SymInt[] dilation=[], int groups=1) -> Tensor",
    "gelu(Tensor x, *, str approximate='none') -> Tensor",
    "to(Tensor x, ScalarType? dtype=None, bool non_blocking=False, str? layout=None, "
    "float? scale=None, int? offset=None, bool? flag=None) -> Tensor",
    "cat(Tensor[] tensors, int dim=0, *, Tensor(a!)[] outs, float[] ws=[0.5, -1.5, 2]) -> (Tensor, int)",
    "moments(Tensor x) -> (float mean, float var, str name, bool ok, Tensor[] parts)",
    "ln_backward(Tensor grad, SymInt[] shape, Tensor? w, bool[3] output_mask=[True, True, False], "
    "float[2] scale=0.5, str[]? tags=None, int? n=3) -> (Tensor, Tensor, Tensor)",
    'fmt(Tensor x, str sep="a\\"b\\\\c\\n", str q="it\'s") -> Tensor',
]


def test_parse_rms_norm() -> None:
    s = parse_schema(RMS_NORM)
    assert s.name == "rms_norm"
    assert s.overload == ""
    assert s.source == RMS_NORM
    assert [a.name for a in s.arguments] == ["x", "weight", "eps"]
    assert s.arguments[0] == Argument("x", Type("Tensor"))
    assert s.arguments[2] == Argument("eps", Type("float"), 1e-6)
    assert s.returns == (Return(Type("Tensor")),)
    assert str(s) == "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor"


def test_overload_name() -> None:
    s = parse_schema("add.Tensor(Tensor a, Tensor b) -> Tensor")
    assert (s.name, s.overload) == ("add", "Tensor")
    assert str(s) == "add.Tensor(Tensor a, Tensor b) -> Tensor"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Tensor", Type("Tensor")),
        ("Tensor?", Type("Tensor", optional=True)),
        ("Tensor[]", Type("Tensor", is_list=True)),
        ("int", Type("int")),
        ("float", Type("float")),
        ("bool", Type("bool")),
        ("str", Type("str")),
        ("int[]", Type("int", is_list=True)),
        ("float[]", Type("float", is_list=True)),
        ("ScalarType?", Type("ScalarType", optional=True)),
        ("ScalarType", Type("ScalarType")),
        ("int?", Type("int", optional=True)),
        ("float?", Type("float", optional=True)),
        ("bool?", Type("bool", optional=True)),
        ("str?", Type("str", optional=True)),
        ("SymInt", Type("int")),
        ("SymInt[]", Type("int", is_list=True)),
        ("SymInt?", Type("int", optional=True)),
        ("int[2]", Type("int", is_list=True, list_size=2)),
        ("int[3]?", Type("int", optional=True, is_list=True, list_size=3)),
        ("int[]?", Type("int", optional=True, is_list=True)),
        ("Tensor(a)", Type("Tensor", alias=Alias("a", False))),
        ("Tensor(a!)", Type("Tensor", alias=Alias("a", True))),
        ("Tensor(b!)?", Type("Tensor", optional=True, alias=Alias("b", True))),
        ("Tensor(a!)[]", Type("Tensor", is_list=True, alias=Alias("a", True))),
        ("Tensor(a)[]?", Type("Tensor", optional=True, is_list=True, alias=Alias("a", False))),
    ],
)
def test_types(text: str, expected: Type) -> None:
    s = parse_schema(f"f({text} x) -> ()")
    assert s.arguments[0].type == expected
    # a type also parses as a return
    assert parse_schema(f"f() -> {text}").returns[0].type == expected


@pytest.mark.parametrize(
    ("typ", "rendered"),
    [
        (Type("Tensor", optional=True, alias=Alias("a", True)), "Tensor(a!)?"),
        (Type("int", is_list=True), "int[]"),
        (Type("int", is_list=True, list_size=2), "int[2]"),
        (Type("Tensor", is_list=True, alias=Alias("a", False)), "Tensor(a)[]"),
        (Type("ScalarType", optional=True), "ScalarType?"),
    ],
)
def test_type_str(typ: Type, rendered: str) -> None:
    assert str(typ) == rendered


def test_type_properties() -> None:
    assert Type("Tensor").is_tensor and not Type("Tensor").is_tensor_list
    assert Type("Tensor", optional=True).is_tensor
    assert Type("Tensor", is_list=True).is_tensor_list and not Type("Tensor", is_list=True).is_tensor
    assert not Type("int").is_tensor and not Type("int", is_list=True).is_tensor_list


@pytest.mark.parametrize(
    ("decl", "value"),
    [
        ("int x=3", 3),
        ("int x=-1", -1),
        ("SymInt x=0", 0),
        ("float x=1e-6", 1e-6),
        ("float x=-1.5", -1.5),
        ("float x=2", 2.0),
        ("float x=.5", 0.5),
        ("float x=1E+3", 1000.0),
        ("bool x=True", True),
        ("bool x=False", False),
        ("int? x=None", None),
        ("int? x=4", 4),
        ("float? x=0.5", 0.5),
        ("bool? x=False", False),
        ("str? x='s'", "s"),
        ("str[]? x=None", None),
        ("ScalarType? x=5", 5),
        ("Tensor? x=None", None),
        ("Tensor x=None", None),  # torch accepts this too
        ("Tensor(a!)? x=None", None),
        ("ScalarType? x=None", None),
        ("str x='mean'", "mean"),
        ('str x="mean"', "mean"),
        ("str x=''", ""),
        ('str x="it\'s"', "it's"),
        ("str x='a\\'b'", "a'b"),
        ('str x="tab\\there\\n"', "tab\there\n"),
        ("int[] x=[1, 2]", (1, 2)),
        ("int[] x=[-1]", (-1,)),
        ("int[] x=[]", ()),
        ("int[]? x=None", None),
        ("int[2] x=[3,4]", (3, 4)),
        ("int[2] x=1", (1, 1)),
        ("float[] x=[1, 2.5, -3e2]", (1.0, 2.5, -300.0)),
        ("float[2] x=1.5", (1.5, 1.5)),
        ("float[3] x=1", (1.0, 1.0, 1.0)),
        ("bool[] x=[True, False]", (True, False)),
    ],
)
def test_defaults(decl: str, value: object) -> None:
    arg = parse_schema(f"f({decl}) -> ()").arguments[0]
    assert arg.has_default
    assert arg.default == value
    assert type(arg.default) is type(value)


def test_float_default_is_float() -> None:
    arg = parse_schema("f(float x=2) -> ()").arguments[0]
    assert isinstance(arg.default, float)
    assert str(arg) == "float x=2.0"


def test_no_default() -> None:
    arg = parse_schema("f(int x) -> ()").arguments[0]
    assert arg.default is NO_DEFAULT
    assert not arg.has_default
    assert repr(NO_DEFAULT) == "NO_DEFAULT"
    assert pickle.loads(pickle.dumps(NO_DEFAULT)) is NO_DEFAULT
    assert dataclasses.replace(arg).default is NO_DEFAULT


@pytest.mark.parametrize(
    ("arg", "rendered"),
    [
        (Argument("eps", Type("float"), 1e-6), "float eps=1e-06"),
        (Argument("flag", Type("bool"), True), "bool flag=True"),
        (Argument("b", Type("Tensor", optional=True), None), "Tensor? b=None"),
        (Argument("mode", Type("str"), "mean"), 'str mode="mean"'),
        (Argument("mode", Type("str"), 'a"b\\c'), 'str mode="a\\"b\\\\c"'),
        (Argument("s", Type("int", is_list=True), (1, 2)), "int[] s=[1, 2]"),
        (Argument("s", Type("int", is_list=True), [1, 2]), "int[] s=[1, 2]"),
        (Argument("s", Type("int", is_list=True), ()), "int[] s=[]"),
        (Argument("x", Type("Tensor", alias=Alias("a", True))), "Tensor(a!) x"),
    ],
)
def test_argument_str(arg: Argument, rendered: str) -> None:
    assert str(arg) == rendered


def test_kwarg_only() -> None:
    s = parse_schema("f(Tensor x, *, int a, float b=1.0, int c) -> Tensor")
    assert [a.kwarg_only for a in s.arguments] == [False, True, True, True]
    assert str(s) == "f(Tensor x, *, int a, float b=1.0, int c) -> Tensor"
    s = parse_schema("f(*, int a) -> ()")
    assert s.arguments[0].kwarg_only
    assert str(s) == "f(*, int a) -> ()"


def test_required_kwarg_only_after_default_positional() -> None:
    s = parse_schema("f(int a=1, *, int b, int c=2, int d) -> ()")
    assert [a.has_default for a in s.arguments] == [True, False, True, False]


def test_trailing_star_is_accepted_like_torch() -> None:
    s = parse_schema("f(int x, *) -> ()")
    assert not s.arguments[0].kwarg_only
    assert str(s) == "f(int x) -> ()"


@pytest.mark.parametrize(
    ("returns", "expected", "rendered"),
    [
        ("()", (), "()"),
        ("( )", (), "()"),
        ("Tensor", (Return(Type("Tensor")),), "Tensor"),
        ("(Tensor)", (Return(Type("Tensor")),), "Tensor"),
        ("Tensor(a!)", (Return(Type("Tensor", alias=Alias("a", True))),), "Tensor(a!)"),
        ("(Tensor, Tensor)", (Return(Type("Tensor")), Return(Type("Tensor"))), "(Tensor, Tensor)"),
        (
            "(Tensor values, Tensor indices)",
            (Return(Type("Tensor"), "values"), Return(Type("Tensor"), "indices")),
            "(Tensor values, Tensor indices)",
        ),
        ("(Tensor values)", (Return(Type("Tensor"), "values"),), "(Tensor values)"),
        ("Tensor[]", (Return(Type("Tensor", is_list=True)),), "Tensor[]"),
        ("(int, float?)", (Return(Type("int")), Return(Type("float", optional=True))), "(int, float?)"),
    ],
)
def test_returns(returns: str, expected: tuple[Return, ...], rendered: str) -> None:
    s = parse_schema(f"f(Tensor x) -> {returns}")
    assert s.returns == expected
    assert str(s) == f"f(Tensor x) -> {rendered}"


def test_whitespace() -> None:
    text = (
        "  rms_norm ( Tensor  x ,Tensor(  a !  ) ? w,\n\t* ,  int [ 2 ] s = [ 1 ,2 ] ,"
        " float eps = 1e-6 , str m = 'x' )->( Tensor  out , Tensor ) "
    )
    s = parse_schema(text)
    assert str(s) == (
        'rms_norm(Tensor x, Tensor(a!)? w, *, int[2] s=[1, 2], float eps=1e-06, str m="x") '
        "-> (Tensor out, Tensor)"
    )
    assert s.source == text


def test_schema_equality_ignores_source_and_is_hashable() -> None:
    a = parse_schema("f(int x=1) -> ()")
    b = parse_schema("f( int  x = 1 )  ->  ( )")
    assert a == b
    assert a.source != b.source
    assert hash(a) == hash(b)
    assert len({a, b}) == 1


def test_schema_constructible_directly() -> None:
    s = Schema("f", "", (Argument("x", Type("Tensor")),), ())
    assert str(s) == "f(Tensor x) -> ()"
    assert s.source == ""
    assert parse_schema(str(s)) == s


@pytest.mark.parametrize("text", REPRESENTATIVE)
def test_round_trip(text: str) -> None:
    s = parse_schema(text)
    rendered = str(s)
    again = parse_schema(rendered)
    assert again == s
    assert dataclasses.replace(again, source=s.source) == s
    assert again.source == rendered
    assert str(again) == rendered  # canonical rendering is a fixed point
    for arg, arg2 in zip(s.arguments, again.arguments, strict=True):
        assert type(arg.default) is type(arg2.default)


def test_round_trip_string_escapes() -> None:
    s = parse_schema(REPRESENTATIVE[-1])
    assert [a.default for a in s.arguments[1:]] == ['a"b\\c\n', "it's"]
    assert parse_schema(str(s)) == s


def test_schema_properties() -> None:
    fused = parse_schema(FUSED_ADD_RMS_NORM)
    assert [a.name for a in fused.tensor_args] == ["input", "residual", "weight"]
    assert [a.name for a in fused.mutated_args] == ["input", "residual"]
    assert fused.is_mutating and not fused.is_functional
    assert fused.arguments[0].is_mutated and not fused.arguments[2].is_mutated

    rotary = parse_schema(ROTARY)
    assert [a.name for a in rotary.tensor_args] == ["positions", "query", "key", "cos_sin_cache"]
    assert [a.name for a in rotary.mutated_args] == ["query", "key"]

    rms = parse_schema(RMS_NORM)
    assert rms.is_functional and not rms.is_mutating and rms.mutated_args == ()

    view = parse_schema("view(Tensor(a) x, int[] shape) -> Tensor(a)")
    assert not view.is_mutating and not view.is_functional
    assert not view.arguments[0].is_mutated

    lists = parse_schema("f(Tensor[] xs, Tensor(a!)[] ys, Tensor? z) -> ()")
    assert [a.name for a in lists.tensor_args] == ["z"]
    assert [a.name for a in lists.mutated_args] == ["ys"]


# --------------------------------------------------------------------------- errors


def _error(text: str) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        parse_schema(text)
    return info.value


def test_error_message_format() -> None:
    text = "rms_norm(Tensor x, Tensr weight) -> Tensor"
    err = _error(text)
    assert str(err) == (
        f"{text}\n"
        "                   ^\n"
        "unknown type 'Tensr' at position 19 "
        "(expected one of Tensor, int, float, bool, str, ScalarType, SymInt)"
    )
    assert (err.schema, err.position) == (text, 19)
    assert err.reason == str(err).splitlines()[2]
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    ("text", "position", "fragment"),
    [
        # unknown / malformed types
        ("f(Tensr x) -> ()", 2, "unknown type 'Tensr'"),
        ("f(int64 x) -> ()", 2, "unknown type 'int64'"),
        ("f() -> Tensr", 7, "unknown type 'Tensr'"),
        ("f(int(a) x) -> ()", 5, "alias annotations are only allowed on Tensor"),
        ("f(Tensor(a! x) -> ()", 12, "expected ')'"),
        ("f(Tensor() x) -> ()", 9, "expected alias set name"),
        ("f(int[ x) -> ()", 7, "expected ']'"),
        ("f(int[-1] x) -> ()", 6, "expected ']'"),
        ("f(Tensor?[] x) -> ()", 9, "lists of optional elements are not supported"),
        ("f(1 x) -> ()", 2, "expected one of Tensor"),
        # names
        ("(Tensor x) -> Tensor", 0, "expected operator name"),
        ("   (Tensor x) -> Tensor", 3, "expected operator name"),
        ("1f(Tensor x) -> Tensor", 0, "expected operator name"),
        ("rms-norm(Tensor x) -> Tensor", 3, "expected '('"),
        ("f.(Tensor x) -> Tensor", 2, "expected overload name"),
        ("ns::f(Tensor x) -> Tensor", 2, "namespaces are not allowed"),
        ("f(Tensor 1x) -> ()", 9, "expected argument name"),
        ("f(Tensor) -> ()", 8, "expected argument name"),
        ("f(Tensor x-y) -> ()", 10, "expected ',' or ')'"),
        ("f(Tensor lambda) -> ()", 9, "'lambda' is a Python keyword"),
        ("f(int None=1) -> ()", 6, "'None' is a Python keyword"),
        ("f(Tensor x, int x) -> ()", 16, "duplicate argument name 'x'"),
        ("f(Tensor x, *, int x=1) -> ()", 19, "duplicate argument name 'x'"),
        ("f() -> (Tensor a, Tensor a)", 25, "duplicate return name 'a'"),
        ("f() -> (Tensor class)", 15, "'class' is a Python keyword"),
        # defaults
        ("f(Tensor x=1) -> ()", 11, "Tensor arguments can only default to None"),
        ("f(Tensor? x=0.5) -> ()", 12, "Tensor arguments can only default to None"),
        ("f(Tensor[] x=[]) -> ()", 13, "Tensor arguments can only default to None"),
        ("f(int x=1.5) -> ()", 8, "invalid default 1.5 for argument 'x': does not match type 'int'"),
        ("f(int x=True) -> ()", 8, "does not match type 'int'"),
        ("f(int x='1') -> ()", 8, "does not match type 'int'"),
        ("f(float x=True) -> ()", 10, "does not match type 'float'"),
        ("f(bool x=1) -> ()", 9, "does not match type 'bool'"),
        ("f(str x=1) -> ()", 8, "does not match type 'str'"),
        ("f(int x=None) -> ()", 8, "None requires an optional type ('int?')"),
        ("f(int[] x=1) -> ()", 10, "does not match type 'int[]'"),
        ("f(int[] x=[1, 2.5]) -> ()", 10, "does not match type 'int[]'"),
        ("f(int[2] x=[1]) -> ()", 11, "list of length 1 given for type 'int[2]'"),
        ("f(int x=[1]) -> ()", 8, "does not match type 'int'"),
        ("f(int[] x=[[1]]) -> ()", 11, "nested lists are not supported"),
        ("f(int[]? x=[1]) -> ()", 11, "optional lists such as 'int[]?' can only default to None"),
        ("f(int[2]? x=1) -> ()", 12, "can only default to None"),
        ("f(str[] x=[]) -> ()", 10, "'str[]' arguments cannot have a default"),
        ("f(ScalarType[] x=[]) -> ()", 17, "'ScalarType[]' arguments cannot have a default"),
        ("f(bool[2] x=True) -> ()", 12, "does not match type 'bool[2]'"),
        ("f(int[2] x=1.5) -> ()", 11, "does not match type 'int[2]'"),
        ("f(bool[] x=[1]) -> ()", 11, "does not match type 'bool[]'"),
        ("f(int[] x=[1 2]) -> ()", 13, "expected ',' or ']'"),
        ("f(int[] x=[1, -> ()", 14, "unexpected '-'"),
        ("f(int x=foo) -> ()", 8, "unexpected 'foo'"),
        ("f(int x=) -> ()", 8, "expected a default value"),
        ("f(str s='abc) -> ()", 8, "unterminated string"),
        ("f(float x=1e999) -> ()", 10, "out of range"),
        ("f(int a=1, int b) -> ()", 15, "non-default argument 'b' follows default argument"),
        # structure
        ("f(Tensor x", 10, "unbalanced parentheses"),
        ("f(Tensor x,", 11, "expected one of Tensor"),
        ("f(Tensor x -> Tensor", 11, "expected ',' or ')'"),
        ("f(Tensor x)) -> Tensor", 11, "unbalanced parentheses: unexpected ')'"),
        ("f() -> (Tensor, Tensor", 22, "unbalanced parentheses"),
        ("f() -> (Tensor, Tensor))", 23, "unexpected trailing text ')'"),
        ("f(Tensor x,) -> ()", 11, "unexpected ')' after ','"),
        ("f(, Tensor x) -> ()", 2, "expected one of Tensor"),
        ("f(*, *, int x) -> ()", 5, "duplicate '*' marker"),
        ("f(Tensor x) Tensor", 12, "expected '->'"),
        ("f(Tensor x) - > Tensor", 12, "expected '->'"),
        ("f(Tensor x)", 11, "expected '->'"),
        ("f(Tensor x) ->", 14, "unexpected end of schema"),
        ("f(Tensor x) -> Tensor foo", 22, "unexpected trailing text 'foo'"),
        ("f(Tensor x) -> Tensor out", 22, "expected end of schema"),
        ("f(Tensor x) -> (Tensor a b)", 25, "expected ',' or ')'"),
        ("", 0, "expected operator name"),
    ],
)
def test_errors(text: str, position: int, fragment: str) -> None:
    err = _error(text)
    lines = str(err).split("\n")
    assert lines[0] == text
    assert lines[1] == " " * position + "^"
    assert fragment in lines[2]
    assert f"at position {position}" in lines[2]
    assert err.position == position


def test_error_with_newlines_keeps_caret_aligned() -> None:
    text = "f(Tensor x,\n  Tensr y) -> ()"
    err = _error(text)
    lines = str(err).split("\n")
    assert lines[0] == text.replace("\n", " ")
    assert lines[1] == " " * 14 + "^"
    assert err.schema == text


# ----------------------------------------------------------------------------- bind

RMS = parse_schema("rms_norm(Tensor x, Tensor weight, float eps=1e-6, *, bool inplace=False) -> Tensor")


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("X", "W"), {}, ["X", "W", 1e-6, False]),
        (("X", "W", 0.5), {}, ["X", "W", 0.5, False]),
        (("X",), {"weight": "W"}, ["X", "W", 1e-6, False]),
        ((), {"weight": "W", "x": "X", "inplace": True}, ["X", "W", 1e-6, True]),
        (("X", "W"), {"eps": 0.1}, ["X", "W", 0.1, False]),
        (("X", "W", 0.2), {"inplace": True}, ["X", "W", 0.2, True]),
        (("X", None), {}, ["X", None, 1e-6, False]),  # values are not type-checked here
    ],
)
def test_bind(args: tuple[object, ...], kwargs: dict[str, object], expected: list[object]) -> None:
    assert RMS.bind("rms_norm", args, kwargs) == expected


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("X", "W"), {}), (("X", "W", 0.5), {}), (("X", "W", 0.2), {"inplace": True}), ((), {"x": "X", "weight": "W"})],
)
def test_split_inverts_bind(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """A bound call split again is a call that binds to the same values: keyword-only ones by name."""
    bound = RMS.bind("rms_norm", args, kwargs)
    pos, kw = RMS.split(bound)
    assert (len(pos), list(kw)) == (3, ["inplace"])
    assert RMS.bind("rms_norm", pos, kw) == bound
    assert RMS.split(bound[:2]) == (["X", "W"], {})  # trailing defaults left out


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("X",), {}, "rms_norm() missing required argument 'weight'"),
        ((), {}, "rms_norm() missing required arguments 'x', 'weight'"),
        ((), {"eps": 1.0}, "rms_norm() missing required arguments 'x', 'weight'"),
        (("X", "W"), {"foo": 1}, "rms_norm() got an unexpected keyword argument 'foo'"),
        (("X", "W", 1.0, True), {}, "rms_norm() takes at most 3 positional arguments (4 given)"),
        (("X", "W"), {"x": "X2"}, "rms_norm() got multiple values for argument 'x'"),
        (("X", "W", 1.0), {"eps": 2.0}, "rms_norm() got multiple values for argument 'eps'"),
    ],
)
def test_bind_errors(args: tuple[object, ...], kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TypeError) as info:
        RMS.bind("rms_norm", args, kwargs)
    assert str(info.value) == message


def test_bind_edge_cases() -> None:
    noargs = parse_schema("noop() -> ()")
    assert noargs.bind("noop", (), {}) == []
    with pytest.raises(TypeError, match=r"noop\(\) takes at most 0 positional arguments \(1 given\)"):
        noargs.bind("noop", (1,), {})

    one = parse_schema("neg(Tensor x) -> Tensor")
    with pytest.raises(TypeError, match=r"takes at most 1 positional argument \(2 given\)"):
        one.bind("neg", (1, 2), {})

    kwonly = parse_schema("f(*, int a, int b=2) -> ()")
    assert kwonly.bind("f", (), {"a": 1}) == [1, 2]
    with pytest.raises(TypeError, match=r"f\(\) takes at most 0 positional arguments \(1 given\)"):
        kwonly.bind("f", (1,), {})
    with pytest.raises(TypeError, match=r"f\(\) missing required argument 'a'"):
        kwonly.bind("f", (), {"b": 3})

    lists = parse_schema("f(int[] s=[1, 2], int? o=None) -> ()")
    assert lists.bind("f", (), {}) == [(1, 2), None]
    # the default object is shared, so it must be immutable
    assert isinstance(lists.bind("f", (), {})[0], tuple)

    # bind accepts any sequence / mapping and uses the op name given
    assert one.bind("my_ns::neg", ["T"], {}) == ["T"]
    with pytest.raises(TypeError, match=r"^my_ns::neg\(\) missing required argument 'x'$"):
        one.bind("my_ns::neg", [], {})


# ---------------------------------------------------------------------- check_value


def _arg(decl: str) -> Argument:
    return parse_schema(f"f({decl}) -> ()").arguments[0]


@pytest.mark.parametrize(
    ("decl", "value"),
    [
        ("int x", 3),
        ("int x", -(2**70)),
        ("float x", 1.5),
        ("float x", 2),
        ("bool x", True),
        ("bool x", False),
        ("str x", "s"),
        ("int? x", None),
        ("float? x", None),
        ("bool? x", None),
        ("str? x", None),
        ("int? x", 1),
        ("int[] x", [1, 2]),
        ("int[] x", (1, 2)),
        ("int[] x", []),
        ("SymInt[] x", [1]),
        ("int[2] x", (1, 2)),
        ("int[]? x", None),
        ("float[] x", [1, 2.5]),
        ("bool[] x", [True]),
        ("str[] x", ("a", "b")),
        ("ScalarType x", "anything"),
        ("ScalarType? x", object()),
        ("Tensor x", "not checked"),
        ("Tensor? x", 1),
        ("Tensor[] x", 5),
        ("Tensor(a!) x", None),
    ],
)
def test_check_value_accepts(decl: str, value: object) -> None:
    check_value("op", _arg(decl), value)


@pytest.mark.parametrize(
    ("decl", "value", "message"),
    [
        ("float eps", "1e-6", "rms_norm: argument 'eps' must be float, got str"),
        ("float eps", True, "rms_norm: argument 'eps' must be float, got bool"),
        ("float eps", None, "rms_norm: argument 'eps' must be float, got NoneType"),
        ("int n", 1.0, "rms_norm: argument 'n' must be int, got float"),
        ("int n", True, "rms_norm: argument 'n' must be int, got bool"),
        ("int? n", 1.0, "rms_norm: argument 'n' must be int or None, got float"),
        ("bool b", 1, "rms_norm: argument 'b' must be bool, got int"),
        ("bool b", "True", "rms_norm: argument 'b' must be bool, got str"),
        ("str s", b"x", "rms_norm: argument 's' must be str, got bytes"),
        ("int[] s", 3, "rms_norm: argument 's' must be int[], got int"),
        ("int[] s", "12", "rms_norm: argument 's' must be int[], got str"),
        ("int[] s", [1, 2.0], "rms_norm: argument 's' must be int[], got list with float at index 1"),
        ("int[] s", (1, True), "rms_norm: argument 's' must be int[], got tuple with bool at index 1"),
        ("int[2] s", [1, 2, 3], "rms_norm: argument 's' must be int[2], got list of length 3"),
        (
            "int[]? s",
            [None],
            "rms_norm: argument 's' must be int[] or None, got list with NoneType at index 0",
        ),
        ("float[] s", ["a"], "rms_norm: argument 's' must be float[], got list with str at index 0"),
    ],
)
def test_check_value_rejects(decl: str, value: object, message: str) -> None:
    with pytest.raises(TypeError) as info:
        check_value("rms_norm", _arg(decl), value)
    assert str(info.value) == message


def test_check_value_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    check_value("op", _arg("int x"), np.int64(3))
    check_value("op", _arg("int x"), np.uint8(3))
    check_value("op", _arg("float x"), np.float32(1.5))
    check_value("op", _arg("float x"), np.float64(1.5))
    check_value("op", _arg("float x"), np.int32(2))
    check_value("op", _arg("int[] x"), [np.int64(1), 2])
    check_value("op", _arg("float[2] x"), (np.float16(1), 2.0))
    with pytest.raises(TypeError, match=r"must be int, got numpy\.float32"):
        check_value("op", _arg("int x"), np.float32(1.0))
    with pytest.raises(TypeError, match=r"must be int, got numpy\.bool_?$"):
        check_value("op", _arg("int x"), np.bool_(True))
    with pytest.raises(TypeError, match=r"must be bool, got numpy\.bool_?$"):  # named apart from Python's bool
        check_value("op", _arg("bool x"), np.bool_(True))
    with pytest.raises(TypeError, match=r"must be float, got numpy\.ndarray"):
        check_value("op", _arg("float x"), np.zeros(3))


def test_check_value_does_not_import_numpy_objects_lookalikes() -> None:
    class FakeInt:
        __module__ = "somewhere"

    with pytest.raises(TypeError, match="got FakeInt"):
        check_value("op", _arg("int x"), FakeInt())


# ---------------------------------------------------------------------------- torch


@pytest.mark.parametrize("text", REPRESENTATIVE)
def test_torch_accepts_canonical_rendering(text: str) -> None:
    torch = pytest.importorskip("torch")
    ours = parse_schema(text)
    theirs = torch._C.parse_schema("ns::" + str(ours))
    assert theirs.name == "ns::" + ours.name
    assert theirs.overload_name == ours.overload
    assert [a.name for a in theirs.arguments] == [a.name for a in ours.arguments]
    assert [a.kwarg_only for a in theirs.arguments] == [a.kwarg_only for a in ours.arguments]
    assert len(theirs.returns) == len(ours.returns)
    for mine, ref in zip(ours.arguments, theirs.arguments, strict=True):
        if mine.has_default:
            expected = list(mine.default) if isinstance(mine.default, tuple) else mine.default
            assert ref.default_value == expected
        else:
            assert not ref.has_default_value()
        assert ref.alias_info is None or ref.alias_info.is_write == mine.is_mutated
