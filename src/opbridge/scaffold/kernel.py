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
    for want in ("op", "numel", "run", "device", "ctx"):
        name = want
        while name in taken:
            name += "_"
        out[want] = name
    return out


def _checks(spec: OpSpec, op: str, device: str | None = None) -> str:
    """The argument checks: for the CPU alone (*device* None), or for the device named by *device*."""
    lead = spec.lead.name

    def tensor_check(name: str) -> str:
        if device is None:
            return f"OPB_CHECK_DEVICE({op}, {name}, kDLCPU)"
        return f"OPB_CHECK_DEVICE_LIKE({op}, {device}, {name}, {lead})"

    def optional_check(name: str) -> str:
        if device is None:
            return f'::opbridge::check_device({op}, "{name}", {name}.value(), kDLCPU)'
        return f'::opbridge::check_device_like({op}, {device}, "{name}", {name}.value(), "{lead}", {lead})'

    allowed = ", ".join(DTYPES[d][0] for d in spec.dtypes)
    parts = [render("op/check_lead.cc.tmpl", op=op, lead=lead, allowed=allowed, device=device or "kDLCPU")]
    for name in [a.name for a in spec.schema.arguments if a.type.is_tensor and not a.type.optional
                 and a.name != lead] + spec.outputs:
        parts.append(render("op/check_tensor.cc.tmpl", op=op, name=name, lead=lead,
                            device_check=tensor_check(name)))
    parts += [render("op/check_optional.cc.tmpl", op=op, name=a.name, lead=lead, device_check=optional_check(a.name))
              for a in spec.schema.arguments if a.type.is_tensor and a.type.optional]
    return "".join(parts).rstrip("\n")


def _checked(spec: OpSpec) -> list[tuple[str, str]]:
    """(C++ type, name) of what the shared checks take: the outputs, then the schema's tensors."""
    view = "const opbridge::TensorView&"
    out = [(view, o) for o in spec.outputs]
    out += [("const opbridge::Optional<opbridge::TensorView>&" if a.type.optional else view, a.name)
            for a in spec.schema.arguments if a.type.is_tensor]
    return out


def _check_args(spec: OpSpec, op: str, device: str) -> str:
    """The arguments of a kernel's call of the checks in ``<op>.h``."""
    return ", ".join([op, device, *(name for _, name in _checked(spec))])


def render_checks(spec: OpSpec) -> str:
    """Source of ``csrc/<op>.h``: the argument checks its CPU and CUDA kernels share."""
    names = _locals(spec)
    params = [f"const char* {names['op']}", f"int {names['device']}",
              *(f"{t} {n}" for t, n in _checked(spec))]
    return render("op/checks.h.tmpl", name=spec.name, schema=str(spec.schema), origin=spec.origin,
                  device=names["device"], lead=spec.lead.name,
                  params=_wrap_params(f"{spec.name}_check", params, indent=len("inline void ") + 1),
                  checks=_checks(spec, names["op"], names["device"]))


def _dispatch(spec: OpSpec, op: str, run: str) -> str:
    return render("op/dispatch.cc.tmpl", dtypes=", ".join(spec.dtypes), op=op, lead=spec.lead.name, run=run,
                  ctypes=", ".join(DTYPES[d][1] for d in spec.dtypes)).rstrip("\n")


def _wrap_params(kernel: str, params: list[str], indent: int = 6) -> str:
    """Parameters packed greedily onto lines of at most 100 characters, aligned after the ``(``."""
    pad = " " * (len(kernel) + indent)
    lines = [""]
    for i, p in enumerate(params):
        piece = p + ("," if i < len(params) - 1 else "")
        if lines[-1] and len(pad) + len(lines[-1]) + 1 + len(piece) > 100:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}" if lines[-1] else piece
    return ("\n" + pad).join(lines)


def _kernel_params(spec: OpSpec) -> list[str]:
    params = [f"TensorView {o}" for o in spec.outputs]
    return params + [f"{cxx_type(a.type)} {a.name}" for a in spec.schema.arguments]


def render_kernel(spec: OpSpec, declaration: str) -> str:
    """Source of ``csrc/<op>.cc`` for *spec*; *declaration* names the file with its reference."""
    names = _locals(spec)
    outs = spec.outputs
    lead = spec.lead.name
    has_list = any(a.type.is_list for a in spec.schema.arguments)
    includes = render("op/include_list.cc.tmpl") if has_list else ""
    if spec.cuda:
        includes += f'\n#include "{spec.name}.h"\n'
    if outs:
        chunk = render("op/chunk.cc.tmpl", name=spec.name,
                       chunk_params=", ".join([*(f"T* {o}" for o in outs), f"const T* {lead}"]),
                       lead=lead, chunk_body="\n".join(
                           f"    {o}[i] = opbridge::from_compute<T>(opbridge::to_compute({lead}[i]));"
                           for o in outs))
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
    checks = (f"  {spec.name}_check({_check_args(spec, names['op'], 'kDLCPU')});" if spec.cuda
              else _checks(spec, names["op"]))
    return render(
        "op/kernel.cc.tmpl", name=spec.name, schema=str(spec.schema), origin=spec.origin,
        declaration=declaration, placeholder=placeholder, includes=includes, chunk=chunk,
        kernel=spec.kernel, params=_wrap_params(spec.kernel, _kernel_params(spec)), op=names["op"],
        checks=checks, numel=names["numel"], lead=lead, run=names["run"],
        compute=compute, dispatch=_dispatch(spec, names["op"], names["run"]),
    )


def render_cuda_kernel(spec: OpSpec) -> str:
    """Source of ``csrc/<op>.cu``: the CUDA twin of :func:`render_kernel`'s kernel."""
    names = _locals(spec)
    lead = spec.lead.name
    kernel = f"{spec.name}_cuda"
    functor = "".join(part.capitalize() for part in spec.name.split("_")) + "Element"
    common = {"ctx": names["ctx"], "lead": lead, "numel": names["numel"], "functor": functor}
    if spec.outputs:
        compute = "".join(render("op/compute_outputs.cu.tmpl", out=o, **common) for o in spec.outputs)
        placeholder = f"each output is a copy of {lead}"
    else:
        compute = render("op/compute_mutating.cu.tmpl", **common)
        placeholder = "the mutated arguments are left as they are"
    return render(
        "op/kernel.cu.tmpl", name=spec.name, schema=str(spec.schema), origin=spec.origin,
        placeholder=placeholder, functor=functor, kernel=kernel,
        params=_wrap_params(kernel, _kernel_params(spec)), op=names["op"],
        check_args=_check_args(spec, names["op"], "kDLCUDA"),
        numel=names["numel"], lead=lead, ctx=names["ctx"], run=names["run"], compute=compute.rstrip("\n"),
        dispatch=_dispatch(spec, names["op"], names["run"]),
    )
