"""``opbridge new``: generate an op (kernel, declaration, test, benchmark) or a whole plugin project.

Everything generated builds and passes its tests as generated: the kernel's
computation is a placeholder that the generated NumPy reference mirrors.

- :func:`new_op` -- one op, from a schema (:func:`spec.from_schema`) or an
  msopgen-style prototype (:func:`prototype.to_spec`). Into a plain directory
  it writes ``csrc/<op>.cc``, ``<op>_op.py``, ``test_<op>.py`` and
  ``bench_<op>.py`` (with ``cuda``, also ``csrc/<op>.cu`` and the checks both
  kernels share, ``csrc/<op>.h``); into a project made by :func:`new_project` it adds the
  op to the project and regenerates its ``_custom_ops.py``.
- :func:`new_project` -- a plugin in the vLLM plugins' layout: ``csrc/``
  kernels, ``<pkg>/ops/`` declarations, one ``_C_ops`` module built by
  ``pip install .``, generated wrappers, tests and benchmarks.
- :func:`next_steps` -- what ``opbridge new`` prints after the files: the commands
  that test and benchmark the op it wrote, and where its kernel is.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from opbridge.scaffold.kernel import render_checks, render_cuda_kernel, render_kernel
from opbridge.scaffold.prototype import load_prototype, to_spec
from opbridge.scaffold.python import (
    Layout,
    in_project,
    render_bench,
    render_declaration,
    render_test,
    standalone,
)
from opbridge.scaffold.spec import FLOATING, OpSpec, ScaffoldError, from_schema, parse_dtypes
from opbridge.scaffold.templates import render

__all__ = ["OpSpec", "ScaffoldError", "from_schema", "load_prototype", "new_op", "new_project",
           "next_steps", "parse_dtypes", "project_package", "to_spec"]

#: The op a new project starts with when no schema is given.
STARTER_SCHEMA = "identity(Tensor x) -> Tensor"


def project_package(root: Path) -> str | None:
    """The package of the opbridge project at *root* (``[tool.opbridge] package``), or None."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return None
    text = pyproject.read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        m = re.search(r'^\[tool\.opbridge\]\s*\n(?:.*\n)*?package\s*=\s*"([^"]+)"', text, re.M)
        return m.group(1) if m else None
    table = tomllib.loads(text).get("tool", {}).get("opbridge", {})
    package = table.get("package")
    return str(package) if package else None


def _write(files: dict[Path, str], force: bool) -> list[Path]:
    existing = [p for p in files if p.exists()]
    if existing and not force:
        raise ScaffoldError(f"refusing to overwrite {', '.join(map(str, existing))} (pass --force)")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


def _op_files(spec: OpSpec, root: Path, layout: Layout, *, tests: Path, benches: Path) -> dict[Path, str]:
    bench = benches / f"bench_{spec.name}.py"
    files = {root / "csrc" / f"{spec.name}.cc": render_kernel(spec, layout.declaration)}
    if spec.cuda:
        files[root / "csrc" / f"{spec.name}.h"] = render_checks(spec)
        files[root / "csrc" / f"{spec.name}.cu"] = render_cuda_kernel(spec)
    return {
        **files,
        root / layout.declaration: render_declaration(spec, layout),
        tests / f"test_{spec.name}.py": render_test(spec, layout),
        bench: render_bench(spec, layout, str(bench.relative_to(root))),
    }


def regenerate_wrappers(root: Path, package: str) -> list[str]:
    """Rewrite ``<package>/_custom_ops.py`` and its stub from the project's declarations.

    Runs in a child process, so that this one does not declare the project's library.
    Returns the file names of the library's sources (what its modules compile).

    Raises
    ------
    ScaffoldError
        If importing the declarations fails (the child's error is included).
    """
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import importlib; from opbridge import codegen; "
        "lib = importlib.import_module(sys.argv[2] + '.ops').LIBRARY; "
        "codegen.generate(lib, sys.argv[1] + '/' + sys.argv[2]); "
        "print('\\n'.join(s.name for s in lib.sources))"
    )
    res = subprocess.run([sys.executable, "-c", code, str(root), package], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise ScaffoldError(f"generating {package}/_custom_ops.py failed:\n{res.stderr.strip()}")
    return res.stdout.split()


def new_op(spec: OpSpec, out: str | Path, *, force: bool = False) -> list[Path]:
    """Generate *spec*'s kernel, declaration, test and benchmark in *out*.

    Parameters
    ----------
    spec
        The op (from :func:`from_schema` or :func:`to_spec`).
    out
        A directory of its own, or the root of a project made by :func:`new_project`
        (then the op joins the project's library and its wrappers are regenerated).
    force
        Overwrite existing files.

    Returns
    -------
    list of Path
        The files written.

    Raises
    ------
    ScaffoldError
        If a file exists (without *force*) or the spec cannot be generated.
    """
    root = Path(out)
    package = project_package(root)
    if package is None:
        return _write(_op_files(spec, root, standalone(spec), tests=root, benches=root), force)
    spec = dataclasses.replace(spec, namespace=package)
    layout = in_project(spec, package)
    files = _op_files(spec, root, layout, tests=root / "tests", benches=root / "benchmarks")
    written = _write(files, force)
    compiled = regenerate_wrappers(root, package)
    missing = [f for f in spec.sources if f not in compiled]
    if missing:  # a project made before `opbridge new --cuda` globs csrc/*.cc alone
        print(f"opbridge: warning: {package}'s library does not compile {', '.join(missing)}: add the file(s) "
              f"to the sources in {package}/ops/_library.py (a project made by this opbridge globs "
              f"csrc/*.cc and csrc/*.cu)", file=sys.stderr)
    return [*written, root / package / "_custom_ops.py", root / package / "_custom_ops.pyi"]


def next_steps(spec: OpSpec, root: str | Path) -> list[str]:
    """What to do after *spec* was written into *root*, for ``opbridge new`` to print.

    The commands, run in *root* (the op's directory, or the project's root), that
    test and benchmark the op as :func:`new_op` wrote it there, and where its kernel is.
    """
    root = Path(root)
    name = spec.name
    package = project_package(root)
    if package is None:
        test, bench, declaration = f"test_{name}.py", f"python bench_{name}.py", f"{name}_op.py"
    else:  # the benchmark's directory is not the root, whose package it imports
        test, bench = f"tests/test_{name}.py", f"PYTHONPATH=. python benchmarks/bench_{name}.py"
        declaration = f"{package}/ops/{name}.py"
    test, bench = f"python -m pytest {test}", f"{bench} --quick"
    width = max(len(test), len(bench))
    cuda = f" (CUDA: csrc/{name}.cu)" if spec.cuda else ""
    return [
        "next steps:" if root == Path(".") else f"next steps, in {root}:",
        f"  {test:<{width}}  # builds the kernel, checks it against the reference",
        f"  {bench:<{width}}  # verifies, then times it",
        f"  the kernel is in csrc/{name}.cc{cuda}: a placeholder; replace it and the reference in "
        f"{declaration} together",
    ]


def new_project(name: str, out: str | Path = ".", *, spec: OpSpec | None = None,
                force: bool = False, cuda: bool = False) -> list[Path]:
    """Create the plugin project *name* in ``out/<name>`` with one op (default ``identity``).

    Parameters
    ----------
    name
        Project (distribution) name; its package is *name* with ``-`` as ``_``.
    out
        Parent directory.
    spec
        The first op; default :data:`STARTER_SCHEMA`.
    force
        Overwrite existing files.
    cuda
        Give the default first op a CUDA kernel too (see :attr:`OpSpec.cuda`).

    Returns
    -------
    list of Path
        The files written.
    """
    from opbridge import __version__

    package = name.replace("-", "_")
    if not package.isidentifier():
        raise ScaffoldError(f"project name {name!r} does not give a Python package name ({package!r})")
    root = Path(out) / name
    values = {"project": name, "package": package, "namespace": package, "opbridge_version": __version__}
    files = {
        root / "pyproject.toml": render("project/pyproject.toml.tmpl", **values),
        root / "setup.py": render("project/setup.py.tmpl", **values),
        root / "MANIFEST.in": render("project/MANIFEST.in.tmpl", **values),
        root / "README.md": render("project/README.md.tmpl", **values),
        root / ".gitignore": render("project/gitignore.tmpl"),
        root / package / "__init__.py": render("project/package_init.py.tmpl", **values),
        root / package / "py.typed": "",
        root / package / "ops" / "__init__.py": render("project/ops_init.py.tmpl", **values),
        root / package / "ops" / "_library.py": render("project/library.py.tmpl", **values),
        root / "tests" / "test_build.py": render("project/test_build.py.tmpl", **values),
    }
    written = _write(files, force)
    first = spec or from_schema("identity", STARTER_SCHEMA, dtypes=FLOATING, namespace=package, cuda=cuda)
    return written + new_op(first, root, force=force)
