"""NumPy-style docstrings for generated wrappers, from the schema and the reference's docstring."""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opbridge.codegen.types import annotation

if TYPE_CHECKING:
    from opbridge.declare import OpDef

_HEADER = re.compile(r"^\s*-{3,}\s*$")


@dataclass
class Parsed:
    """A NumPy-style docstring split into its summary and sections."""

    summary: str = ""
    sections: dict[str, list[str]] = field(default_factory=dict)

    def entries(self, section: str) -> dict[str, list[str]]:
        """``{name: description lines}`` of a Parameters-like section (first word of each entry)."""
        out: dict[str, list[str]] = {}
        current: list[str] | None = None
        for line in self.sections.get(section, []):
            if line and not line[0].isspace():
                name = line.split(":")[0].strip()
                current = out.setdefault(name, [])
            elif current is not None and line.strip():
                current.append(line.strip())
        return out


def parse(doc: str) -> Parsed:
    """Split *doc* (already dedented) into summary and ``{header: lines}`` sections."""
    lines = doc.splitlines()
    out = Parsed()
    summary: list[str] = []
    header: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and _HEADER.match(lines[i + 1]):
            header = line.strip()
            out.sections[header] = []
            i += 2
            continue
        if header is None:
            summary.append(line)
        else:
            out.sections[header].append(line)
        i += 1
    out.summary = "\n".join(summary).strip()
    for key, body in out.sections.items():
        while body and not body[-1].strip():
            body.pop()
        out.sections[key] = body
    return out


def _reference_doc(op: OpDef) -> str:
    raw = op.reference.__doc__ if op.reference is not None else None
    return inspect.cleandoc(raw) if raw else op.doc


def dtypes_line(op: OpDef) -> str:
    """``Dtypes: float32, float16, bfloat16.``: the dtypes *op* is declared to take."""
    return f"Dtypes: {', '.join(op.dtypes)}."


def immutable_returns(op: OpDef) -> str | None:
    """What a mutating op returns on JAX arrays, in words (:func:`opbridge.codegen.types.call_returns_annotation`
    has it as a type); None for an op that mutates nothing."""
    mutated = [f"``{a.name}``" for a in op.schema.mutated_args]
    if not mutated:
        return None
    declared = ", then its returns," if op.schema.returns else ""
    return (f"on JAX arrays, which are immutable, the new values of {', '.join(mutated)}{declared} as a tuple "
            f"(the arrays passed in are unchanged)")


def render_stub(op: OpDef) -> str:
    """The stub's short docstring: the summary's first paragraph, what a mutating op returns on JAX arrays
    and the declared dtypes."""
    first = parse(_reference_doc(op)).summary.split("\n\n")[0].strip()
    jax = immutable_returns(op)
    usual = "its returns" if op.schema.returns else "None"
    returns = ["\n".join(textwrap.wrap(f"Returns {usual}; {jax}.", 96, break_on_hyphens=False))] if jax else []
    return "\n\n".join([first or f"The ``{op.qualname}`` op.", *returns, dtypes_line(op)])


def render(op: OpDef) -> str:
    """The wrapper's docstring: summary, Parameters, Returns, the reference's other sections, Notes."""
    ref = parse(_reference_doc(op))
    params = ref.entries("Parameters")
    lines = [ref.summary or f"The ``{op.qualname}`` op.", ""]
    if op.schema.arguments:
        lines += ["Parameters", "----------"]
        for a in op.schema.arguments:
            kind = annotation(a.type)
            if a.has_default:
                kind += f", default {a.default!r}"
            lines.append(f"{a.name} : {kind}")
            desc = params.get(a.name) or (["Mutated in place."] if a.is_mutated else [])
            lines += [f"    {d}" for d in desc]
        if getattr(op, "accepts_out", False):
            many = op.n_outputs > 1
            lines += [f"out : {'tuple of Tensor' if many else 'Tensor'}, optional",
                      f"    Write the result{'s' if many else ''} into {'these' if many else 'this'} "
                      f"(the output's shape and dtype) and return {'them' if many else 'it'}."]
    returns = [r for r in op.schema.returns]
    jax = immutable_returns(op)
    if returns or jax:
        lines += ["", "Returns", "-------"]
        given = ref.sections.get("Returns")
        if given:
            lines += given
        else:
            for r in returns:
                lines.append(f"{r.name} : {annotation(r.type)}" if r.name else annotation(r.type))
                if r.type.alias is not None:
                    lines.append(f"    The argument annotated {r.type.alias}.")
        if jax and (returns or given):
            lines += ["", *textwrap.wrap(f"{jax[0].upper()}{jax[1:]}.", 88, break_on_hyphens=False)]
        elif jax:
            lines += ["None or tuple of Tensor", *textwrap.wrap(f"None; {jax}.", 88, initial_indent="    ",
                                                                 subsequent_indent="    ", break_on_hyphens=False)]
    for header, body in ref.sections.items():
        if header not in ("Parameters", "Returns", "Notes"):
            lines += ["", header, "-" * len(header), *body]
    mutated = ", ".join(f"``{a.name}``" for a in op.schema.mutated_args)
    kernels = ", ".join(f"``{k}`` ({d})" for d, k in sorted(op.kernels.items()))
    schema = textwrap.wrap(f"{op.qualname}{str(op.schema)[len(op.name):]}", 88, subsequent_indent="    ",
                           break_on_hyphens=False, break_long_words=False)
    lines += ["", "Notes", "-----", "Schema::", "", *(f"    {line}" for line in schema), ""]
    if mutated:
        lines.append(f"Mutates {mutated} in place.")
    backward = "declared" if op.backward is not None else "none"
    lines.append(f"Kernels: {kernels or 'none'}; backward: {backward}.")
    lines.append(dtypes_line(op))
    if ref.sections.get("Notes"):
        lines += ["", *ref.sections["Notes"]]
    return "\n".join(lines)


def quote(text: str, indent: str) -> str:
    """*text* as an indented triple-quoted Python docstring literal."""
    body = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    lines = body.splitlines()
    out = [f'{indent}"""{lines[0]}']
    out += [f"{indent}{line}" if line.strip() else "" for line in lines[1:]]
    if len(lines) > 1:
        out.append(f'{indent}"""')
    else:
        out[0] += '"""'
    return "\n".join(out)
