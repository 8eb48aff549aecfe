"""msopgen-style op prototypes (JSON or YAML) mapped to an opbridge schema.

A prototype, as Ascend's ``msopgen gen -i op.json`` reads it::

    [{"op": "AddCustom",
      "input_desc": [{"name": "x", "param_type": "required", "format": ["ND"], "type": ["fp16", "float"]},
                     {"name": "y", "param_type": "required", "format": ["ND"], "type": ["fp16", "float"]}],
      "output_desc": [{"name": "z", "param_type": "required", "format": ["ND"], "type": ["fp16", "float"]}],
      "attr": [{"name": "alpha", "param_type": "optional", "type": "float", "default_value": "1.0"}]}]

maps to ``add_custom(Tensor x, Tensor y, float alpha=1.0) -> Tensor`` with
dtypes float16 and float32 (``kernel_name``, when given, names the op).
Inputs become Tensors (``Tensor?`` when optional), attributes scalars or
lists, outputs the returns (named when there are several).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opbridge.scaffold.spec import DTYPES, OpSpec, ScaffoldError, check_namespace, check_op_name, snake_case, validate
from opbridge.schema import parse_schema

_DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp64": "float64", "double": "float64", "float64": "float64",
    "int32": "int32", "int": "int32", "int64": "int64", "bool": "bool",
}
_ATTR_TYPES = {
    "int": "int", "int32": "int", "int64": "int", "float": "float", "float32": "float", "bool": "bool",
    "str": "str", "string": "str",
    "list_int": "int[]", "listint": "int[]", "list_float": "float[]", "listfloat": "float[]",
    "list_bool": "bool[]", "listbool": "bool[]",
}
_PLAIN_FORMATS = ("ND", "NCHW", "NHWC", "NCL", "NCDHW", "NDHWC")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _dtypes(op: str, desc: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for raw in _as_list(desc.get("type")):
        name = _DTYPE_ALIASES.get(str(raw).strip().lower())
        if name is None:
            raise ScaffoldError(f"{op}: {desc.get('name')}: dtype {raw!r} has no CPU kernel type here "
                                f"(supported: {', '.join(DTYPES)})")
        out.add(name)
    for fmt in _as_list(desc.get("format")):
        if str(fmt).upper() not in _PLAIN_FORMATS:
            raise ScaffoldError(f"{op}: {desc.get('name')}: format {fmt!r} is a device-specific layout; "
                                f"opbridge kernels take plain row-major (ND) tensors")
    return out


def _default(op: str, attr: dict[str, Any], typ: str) -> str | None:
    raw = attr.get("default_value")
    if raw is None:
        return "None" if attr.get("param_type") == "optional" else None
    text = str(raw).strip()
    if typ == "bool":
        return "True" if text.lower() in ("true", "1") else "False"
    if typ == "str":
        return json.dumps(text)
    if typ.endswith("[]"):
        items = raw if isinstance(raw, list) else [v for v in text.strip("[]").split(",") if v.strip()]
        base = typ[:-2]
        return "[" + ", ".join(str(float(v) if base == "float" else int(float(v))) for v in items) + "]"
    try:
        return str(float(text)) if typ == "float" else str(int(float(text)))
    except ValueError:
        raise ScaffoldError(f"{op}: attr {attr.get('name')}: default {raw!r} is not a {typ}") from None


def _arg(op: str, attr: dict[str, Any]) -> str:
    kind = str(attr.get("type", "")).strip().lower()
    typ = _ATTR_TYPES.get(kind)
    if typ is None:
        raise ScaffoldError(f"{op}: attr {attr.get('name')}: type {attr.get('type')!r} is not supported "
                            f"(supported: {', '.join(sorted(_ATTR_TYPES))})")
    default = _default(op, attr, typ)
    if default == "None":
        typ += "?"
    return f"{typ} {attr['name']}" + (f"={default}" if default is not None else "")


def load_prototype(path: str | Path) -> list[dict[str, Any]]:
    """The op entries of a prototype file (``.json``, ``.yaml`` or ``.yml``; one op or a list)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ScaffoldError(f"{p}: cannot read the prototype file ({e.strerror or e})") from e
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ScaffoldError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from e
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScaffoldError(f"{p}: not valid JSON ({e}); a .yaml or .yml file is read as YAML") from e
    ops = doc if isinstance(doc, list) else [doc]
    if not ops or not all(isinstance(o, dict) and "op" in o for o in ops):
        raise ScaffoldError(f"{p}: expected an op prototype (a mapping with op, input_desc, output_desc "
                            f"and attr) or a list of them")
    return ops


def to_spec(proto: dict[str, Any], *, namespace: str | None = None, origin: str = "") -> OpSpec:
    """Map one prototype entry to an :class:`OpSpec`.

    Raises
    ------
    ScaffoldError
        For dynamic (list) inputs, device-specific formats, dtypes without a
        CPU type, inputs sharing no dtype, or unsupported attribute types.
    """
    op_name = check_op_name(str(proto.get("kernel_name") or snake_case(str(proto["op"]))))
    args: list[str] = []
    common: set[str] | None = None
    for desc in _as_list(proto.get("input_desc")):
        kind = str(desc.get("param_type", "required")).lower()
        if kind == "dynamic":
            raise ScaffoldError(f"{op_name}: input {desc.get('name')} is dynamic (a list of tensors), "
                                f"which the scaffold does not generate")
        types = _dtypes(op_name, desc)
        if types:
            common = types if common is None else common & types
        args.append(f"Tensor{'?' if kind == 'optional' else ''} {desc['name']}")
    defaults_started = False
    for attr in _as_list(proto.get("attr")):
        text = _arg(op_name, attr)
        if "=" not in text and defaults_started:
            raise ScaffoldError(f"{op_name}: attr {attr.get('name')} has no default but follows one that has")
        defaults_started |= "=" in text
        args.append(text)
    outputs = _as_list(proto.get("output_desc"))
    for desc in outputs:
        out_types = _dtypes(op_name, desc)  # also validates their names and formats
        if common is None and out_types:
            common = out_types
    if not outputs:
        rets = "()"
    elif len(outputs) == 1:
        rets = "Tensor"
    else:
        rets = "(" + ", ".join(f"Tensor {d['name']}" for d in outputs) + ")"
    if common is not None and not common:
        raise ScaffoldError(f"{op_name}: the inputs share no dtype; the scaffold generates kernels whose "
                            f"tensors share one dtype (generate from a schema and adapt it)")
    order = list(DTYPES)
    dtypes = tuple(sorted(common, key=order.index)) if common else ("float32", "float16", "bfloat16")
    schema = parse_schema(f"{op_name}({', '.join(args)}) -> {rets}")
    validate(schema)
    return OpSpec(schema, dtypes, check_namespace(namespace or op_name),
                  origin=origin or f"prototype {proto['op']}")
