"""The generated C++ kernel: checks, dtype dispatch, a placeholder computation, OPBRIDGE_EXPORT."""

from __future__ import annotations

from opbridge.scaffold.spec import DTYPES, OpSpec, ScaffoldError
from opbridge.scaffold.templates import render
from opbridge.schema import Type

_CXX_KEYWORDS = frozenset("""
alignas alignof and asm auto bitand bitor bool break case catch char char16_t char32_t char8_t class
compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
decltype default delete do double dynamic_cast else enum explicit export extern false float for
friend goto if inline int long mutable namespace new noexcept not nullptr operator or private
protected public register reinterpret_cast requires return short signed sizeof static static_assert
static_cast struct switch template this thread_local throw true try typedef typeid typename union
unsigned using virtual void volatile wchar_t while xor
""".split())
_SCALARS = {"int": "int64_t", "float": "double", "bool": "bool", "str": "tvm::ffi::String"}


def cxx_type(t: Type) -> str:
    """The kernel parameter type for schema type *t*."""
    if t.is_tensor:
        return "Optional<TensorView>" if t.optional else "TensorView"
    base = _SCALARS[t.base]
    if t.is_list:
        base = f"tvm::ffi::Array<{base}>"
    return f"Optional<{base}>" if t.optional else base


def _locals(spec: OpSpec) -> dict[str, str]:
    """Names of the kernel's own locals, renamed away from argument names."""
    taken = {a.name for a in spec.schema.arguments} | set(spec.outputs)
    bad = sorted(n for n in taken if n in _CXX_KEYWORDS)
    if bad:
        raise ScaffoldError(f"{spec.name}: argument name(s) {', '.join(bad)} are C++ keywords; rename them")
    out: dict[str, str] = {}
    for want in ("op", "numel", "run"):
        name = want
        while name in taken:
            name += "_"
        out[want] = name
    return out


def _checks(spec: OpSpec, op: str) -> str:
    lead = spec.lead.name
    allowed = ", ".join(DTYPES[d][0] for d in spec.dtypes)
    parts = [render("op/check_lead.cc.tmpl", op=op, lead=lead, allowed=allowed)]
    for name in [a.name for a in spec.schema.arguments if a.type.is_tensor and not a.type.optional
                 and a.name != lead] + spec.outputs:
        parts.append(render("op/check_tensor.cc.tmpl", op=op, name=name, lead=lead))
    parts += [render("op/check_optional.cc.tmpl", op=op, name=a.name, lead=lead)
              for a in spec.schema.arguments if a.type.is_tensor and a.type.optional]
    return "".join(parts).rstrip("\n")


def _dispatch(spec: OpSpec, op: str, run: str) -> str:
    return render("op/dispatch.cc.tmpl", dtypes=", ".join(spec.dtypes), op=op, lead=spec.lead.name, run=run,
                  ctypes=", ".join(DTYPES[d][1] for d in spec.dtypes)).rstrip("\n")


def _wrap_params(kernel: str, params: list[str]) -> str:
    """Parameters packed greedily onto lines of at most 100 characters, aligned after the ``(``."""
    pad = " " * (len(kernel) + 6)
    lines = [""]
    for i, p in enumerate(params):
        piece = p + ("," if i < len(params) - 1 else "")
        if lines[-1] and len(pad) + len(lines[-1]) + 1 + len(piece) > 100:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return ("\n" + pad).join(lines)


def render_kernel(spec: OpSpec, declaration: str) -> str:
    """Source of ``csrc/<op>.cc`` for *spec*; *declaration* names the file with its reference."""
    names = _locals(spec)
    outs = spec.outputs
    lead = spec.lead.name
    params = [f"TensorView {o}" for o in outs]
    params += [f"{cxx_type(a.type)} {a.name}" for a in spec.schema.arguments]
    has_list = any(a.type.is_list for a in spec.schema.arguments)
    includes = render("op/include_list.cc.tmpl") if has_list else ""
    if outs:
        chunk = render("op/chunk.cc.tmpl", name=spec.name,
                       chunk_params=", ".join([*(f"T* {o}" for o in outs), f"const T* {lead}"]),
                       chunk_body="\n".join(f"    {o}[i] = {lead}[i];" for o in outs))
        ptrs = [f"    T* {o}_data = opbridge::data_ptr<T>({o});" for o in outs]
        ptrs.append(f"    const T* {lead}_data = opbridge::data_ptr<const T>({lead});")
        args = ", ".join([*(f"{o}_data + lo" for o in outs), f"{lead}_data + lo", "hi - lo"])
        compute = render("op/compute_outputs.cc.tmpl", ptrs="\n".join(ptrs), numel=names["numel"],
                         name=spec.name, args=args).rstrip("\n")
        placeholder = f"each output is a copy of {lead}"
    else:
        chunk = ""
        compute = render("op/compute_mutating.cc.tmpl", lead=lead, numel=names["numel"]).rstrip("\n")
        placeholder = "the mutated arguments are left as they are"
    return render(
        "op/kernel.cc.tmpl", name=spec.name, schema=str(spec.schema), origin=spec.origin,
        declaration=declaration, placeholder=placeholder, includes=includes, chunk=chunk,
        kernel=spec.kernel, params=_wrap_params(spec.kernel, params), op=names["op"],
        checks=_checks(spec, names["op"]), numel=names["numel"], lead=lead, run=names["run"],
        compute=compute, dispatch=_dispatch(spec, names["op"], names["run"]),
    )
