"""The generated Python files of an op: its declaration, its test and its benchmark."""

from __future__ import annotations

from dataclasses import dataclass

from opbridge.scaffold.spec import OpSpec
from opbridge.scaffold.templates import render
from opbridge.schema import Argument, Type

#: Values the generated test and benchmark pass for arguments check_op has no generic value for.
_SAMPLE = {"str": '""', "int": "1", "float": "0.5", "bool": "True"}


@dataclass(frozen=True)
class Layout:
    """Where the op's files go and how they import each other.

    Attributes
    ----------
    module
        Importable name of the declaration module (``my_op_op`` or ``pkg.ops.my_op``).
    declaration
        The declaration file, relative to the root (for comments).
    library
        Python that defines or imports ``LIBRARY`` in the declaration module.
    project
        Whether the op joins a project's library, whose other ops may have CUDA kernels.
    """

    module: str
    declaration: str
    library: str
    project: bool = False


def standalone(spec: OpSpec) -> Layout:
    """A directory of its own: ``csrc/<op>.cc`` (and ``.cu``, ``.h``), ``<op>_op.py``, tests and benchmark."""
    sources = ", ".join(f'"csrc/{f}"' for f in spec.sources)
    lib = (f'from opbridge import Library{", like" if _new_returns(spec) else ""}\n\n'
           f'LIBRARY = Library("{spec.namespace}", sources=[{sources}])')
    return Layout(f"{spec.name}_op", f"{spec.name}_op.py", lib)


def in_project(spec: OpSpec, package: str) -> Layout:
    """Inside a project from ``opbridge new --project``: the declaration goes in ``<package>/ops/``."""
    like = "from opbridge import like\n" if _new_returns(spec) else ""
    lib = f"{like}\nfrom {package}.ops._library import LIBRARY"
    return Layout(f"{package}.ops.{spec.name}", f"{package}/ops/{spec.name}.py", lib, project=True)


def _new_returns(spec: OpSpec) -> int:
    return sum(1 for r in spec.schema.returns if r.type.alias is None)


def _ref_annotation(t: Type) -> str:
    if t.is_tensor:
        base = "np.ndarray"
    else:
        base = {"int": "int", "float": "float", "bool": "bool", "str": "str"}[t.base]
        base = f"Sequence[{base}]" if t.is_list else base
    return f"{base} | None" if t.optional else base


def _params(spec: OpSpec) -> str:
    """The reference's parameters: all positional, in schema order (how opbridge calls references).

    A default is written only where every later parameter has one too: a keyword-only argument
    without a default may follow a defaulted one in a schema, not in a positional signature.
    """
    args = spec.schema.arguments
    out: list[str] = []
    for i, a in enumerate(args):
        text = f"{a.name}: {_ref_annotation(a.type)}"
        if a.has_default and all(b.has_default for b in args[i + 1:]):
            text += f" = {a.default!r}"
        out.append(text)
    return ", ".join(out)


def _returns_annotation(spec: OpSpec) -> str:
    n = len(spec.schema.returns)
    return "None" if n == 0 else "np.ndarray" if n == 1 else f"tuple[{', '.join(['np.ndarray'] * n)}]"


def _reference_body(spec: OpSpec) -> str:
    lead = spec.lead.name
    alias = {a.type.alias.set: a.name for a in spec.schema.arguments if a.type.alias is not None}
    values = [f"{lead}.copy()" if r.type.alias is None else alias[r.type.alias.set]
              for r in spec.schema.returns]
    if not values:
        mutated = ", ".join(a.name for a in spec.schema.mutated_args)
        return f"    # Mutate {mutated} in place here."
    return f"    return {', '.join(values)}"


def placeholder(spec: OpSpec) -> str:
    """What the generated kernel and reference compute, in words."""
    if _new_returns(spec):
        return f"each new output is a copy of ``{spec.lead.name}``"
    return "the mutated arguments are left as they are"


def render_declaration(spec: OpSpec, layout: Layout) -> str:
    """Source of the declaration module."""
    n_new = _new_returns(spec)
    options = ""
    if n_new:
        options += f"\n    shape=like({', '.join([f'{chr(34)}{spec.lead.name}{chr(34)}'] * n_new)}),"
    if spec.kernel != f"{spec.name}_cpu" or (layout.project and not spec.cuda):
        # Named: in a project whose library has CUDA sources, an op's default kernels include <op>_cuda.
        options += f'\n    kernels={{"cpu": "{spec.kernel}"}},'
        if layout.project and not spec.cuda:
            options += f'  # a CUDA kernel would add "cuda": "{spec.name}_cuda" (csrc/{spec.name}.cu)'
    # The kernel dispatches over exactly these; every adapter checks them before calling it.
    options += f"\n    dtypes=({''.join(repr(d) + ', ' for d in spec.dtypes).rstrip(' ')}),"
    lists = any(a.type.is_list for a in spec.schema.arguments)
    imports = "from collections.abc import Sequence\n\n" if lists else ""
    imports += f"import numpy as np\n{layout.library}"
    files = ", ".join(f"csrc/{f}" for f in spec.sources)
    return render(
        "op/declaration.py.tmpl", name=spec.name, imports=imports,
        kernel_files=f"kernels: {files}" if spec.cuda else f"kernel: {files}",
        schema=str(spec.schema).replace('"', '\\"'), options=options, params=_params(spec),
        returns=_returns_annotation(spec), summary=f"The ``{spec.namespace}::{spec.name}`` op.",
        placeholder=placeholder(spec), body=_reference_body(spec),
    )


def _needs_value(a: Argument) -> bool:
    """Whether check_op has no generic value for *a* (it has ints, floats, bools, defaults and None)."""
    t = a.type
    return not t.is_tensor and not a.has_default and not t.optional and (t.is_list or t.base == "str")


def _sample(t: Type) -> str:
    if not t.is_list:
        return _SAMPLE[t.base]
    return "[" + ", ".join([_SAMPLE[t.base]] * (t.list_size or 1)) + "]"  # int[2]: two items


def render_test(spec: OpSpec, layout: Layout) -> str:
    """Source of ``test_<op>.py``: check_op and fuzz_op over the float dtypes (and int ones) in every framework
    installed (the others skip, saying why)."""
    scalars = {a.name: _sample(a.type) for a in spec.schema.arguments if _needs_value(a)}
    ints = spec.int_dtypes
    generated = bool(scalars or ints)
    imports = "from typing import Any\n\n" if generated or spec.cuda else ""
    imports += "import numpy as np\n" if ints or spec.cuda else ""
    imports += "import pytest\nfrom opbridge.testing import FRAMEWORKS, check_op, unavailable\n"
    imports += "from opbridge.testing.fuzz import fuzz_op\n"
    imports += "from opbridge.testing.matrix import elementwise_cases\n" if generated or spec.cuda else ""
    imports += f"\nfrom {layout.module} import {spec.name}"
    defs = [f"FLOAT_DTYPES = {_tuple(spec.float_dtypes)}", f"INT_DTYPES = {_tuple(ints)}", "", "",
            "def usable(framework: str) -> None:",
            '    """Skip where *framework* is not installed here, or cannot run in this process."""',
            "    reason = unavailable(framework)",
            "    if reason is not None:",
            "        pytest.skip(reason)"]
    cases = ""
    if generated:
        defs.append("#: values for the arguments check_op has no generic value for")
        values = ", ".join(f'"{k}": {v}' for k, v in scalars.items())
        defs.append(f"SCALARS: dict[str, Any] = {{{values}}}")
        defs.append("")
        defs.append("")
        defs.append("def cases(dtype: str, rng: Any) -> list[dict[str, Any]]:")
        defs.append('    """The generic elementwise matrix; integer dtypes get rounded values."""')
        defs.append(f'    out = [{{**c, **SCALARS}} for c in elementwise_cases({spec.name}, "float32", rng)]')
        defs.append("    if dtype in INT_DTYPES:")
        defs.append("        out = [{k: np.rint(v).astype(dtype) if isinstance(v, np.ndarray) else v")
        defs.append("                for k, v in c.items()} for c in out]")
        defs.append("    return out")
        cases = "cases, "
    fuzz_cases = "cases=cases, " if generated else ""
    tests = []
    if spec.float_dtypes:
        tests.append(f'''

@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_{spec.name}(framework: str) -> None:
    usable(framework)
    dtypes = [d for d in FLOAT_DTYPES if framework != "numpy" or d != "bfloat16"]
    if not dtypes:
        pytest.skip("NumPy has none of the op's dtypes")
    report = check_op({spec.name}, {cases}dtypes=dtypes, framework=framework)
    assert report.checks["forward"] > 0''')
    if ints:
        tests.append(f'''


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_{spec.name}_int(framework: str, dtype: str) -> None:
    usable(framework)
    # The cases carry integer arrays; check_op's dtype only applies to floating values.
    report = check_op({spec.name}, lambda d, rng: cases(dtype, rng), dtypes=["float32"], framework=framework)
    assert report.checks["forward"] > 0''')
    tests.append(f'''


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_{spec.name}_fuzzed(framework: str) -> None:
    """hypothesis draws dtypes, values and memory layouts, out= buffers and inconsistent arguments."""
    pytest.importorskip("hypothesis")
    usable(framework)
    report = fuzz_op({spec.name}, framework, {fuzz_cases}examples=25)
    assert report.examples["calls"] > 0, report.skipped''')
    if spec.cuda:
        tests.append(render("op/test_cuda.py.tmpl", name=spec.name,
                            cases="cases(dtype, rng)" if generated else
                            f'elementwise_cases({spec.name}, "float32", rng)'))
    return render("op/test.py.tmpl", name=spec.name, imports=imports, definitions="\n".join(defs),
                  tests="".join(tests) + "\n")


def _tuple(items: tuple[str, ...]) -> str:
    inner = ", ".join(f'"{i}"' for i in items)
    return f"({inner},)" if len(items) == 1 else f"({inner})"


def _bench_arg(a: Argument, int_dtype: bool) -> str:
    if a.type.is_tensor:
        if a.type.optional:
            return "None"
        value = "rng.standard_normal(shape)"
        return f"np.rint({value}).astype(dtype)" if int_dtype else f"{value}.astype(dtype)"
    if a.has_default:
        return repr(a.default)
    if a.type.optional:
        return "None"
    return _sample(a.type)


def render_bench(spec: OpSpec, layout: Layout, script: str) -> str:
    """Source of ``bench_<op>.py``."""
    numpy_floats = [d for d in spec.float_dtypes if d != "bfloat16"]
    dtype = numpy_floats[0] if numpy_floats else (spec.int_dtypes or ("float32",))[0]
    int_dtype = dtype in spec.int_dtypes
    args = ", ".join(_bench_arg(a, int_dtype) for a in spec.schema.arguments)
    mutated = tuple(i for i, a in enumerate(spec.schema.arguments) if a.is_mutated)
    return render("op/bench.py.tmpl", name=spec.name, script=script, make_args=args, dtype=dtype,
                  qualname=f"{spec.namespace}::{spec.name}", mutated=repr(mutated),
                  import_op=f"from {layout.module} import {spec.name}")
