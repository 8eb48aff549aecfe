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

import ast
import dataclasses
import keyword
import re
import subprocess
import sys
from pathlib import Path

from opbridge.scaffold.kernel import render_checks, render_cuda_kernel, render_kernel
from opbridge.scaffold.prototype import load_prototype, to_spec
from opbridge.scaffold.python import (
    in_project,
    render_bench,
    render_declaration,
    render_test,
    standalone,
)
from opbridge.scaffold.spec import FLOATING, OpSpec, ScaffoldError, from_schema, parse_dtypes
from opbridge.scaffold.templates import render
from opbridge.schema import parse_schema

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


def _op_files(spec: OpSpec, root: Path, package: str | None) -> dict[Path, str]:
    """*spec*'s files in *root*: a directory of its own, or the project of *package*."""
    if package is None:
        layout, tests, benches = standalone(spec), root, root
    else:
        layout, tests, benches = in_project(spec, package), root / "tests", root / "benchmarks"
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


def _identifiers(source: str) -> set[str]:
    """Every name *source* binds or reads (variables, parameters, imports, functions, builtins)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


#: The op name the generated files are rendered with to find the names they use for something else.
_PROBE = "opbridge_scaffold_probe_op"


def _check_names(spec: OpSpec, root: Path, package: str | None) -> None:
    """Refuse an op name that the generated Python would shadow something with, before anything is written.

    The files import the op by its name, so an op named like a name they use for something else
    (``np``, ``list``, ``verify``, an argument) would break them; in a project, so would a name that
    ``<package>/ops/__init__.py`` uses (each op module becomes an attribute of that package) or one
    starting with ``_`` (the package imports no private module: the op would never be declared).
    """
    name = spec.name
    if package is not None and name.startswith("_"):
        raise ScaffoldError(f"op name {name!r} starts with '_': {package}/ops/__init__.py imports only the "
                            f"modules whose names do not, so the op would never be declared; drop the '_'")
    probe = dataclasses.replace(spec, schema=parse_schema(_PROBE + str(spec.schema)[len(name):]))
    users = {path: text for path, text in _op_files(probe, root, package).items() if path.suffix == ".py"}
    if package is not None and (root / package / "ops" / "__init__.py").is_file():
        users[root / package / "ops" / "__init__.py"] = (root / package / "ops" / "__init__.py").read_text()
    for path, text in users.items():
        if name in _identifiers(text):
            shown = str(path.relative_to(root)).replace(_PROBE, name)
            raise ScaffoldError(f"op name {name!r} is a name that {shown} uses for something else (an import, a "
                                f"helper, an argument or a builtin): the op would shadow it there; choose "
                                f"another name")


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
        raise ScaffoldError(f"generating {package}/_custom_ops.py failed: {_last_error(res.stderr)} (for the "
                            f"traceback: cd {root.resolve()} && python -c 'import {package}.ops')")
    return res.stdout.split()


def _last_error(stderr: str) -> str:
    """The error a child's traceback ends with, and the last file and line it names, in one line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "the child process failed"
    places = re.findall(r'File "([^"]+)", line (\d+)', stderr)
    where = f" at {places[-1][0]}:{places[-1][1]}" if places and not places[-1][0].startswith("<") else ""
    return f"{lines[-1]}{where}"


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
    if package is not None:
        spec = dataclasses.replace(spec, namespace=package)
    _check_names(spec, root, package)
    files = _op_files(spec, root, package)
    if package is None:
        return _write(files, force)
    before = {path: path.read_text() for path in files if path.is_file()}  # what --force overwrites
    written = _write(files, force)
    try:
        compiled = regenerate_wrappers(root, package)
    except ScaffoldError as e:  # the project's package does not import: leave it as it was
        for path in written:
            if path in before:
                path.write_text(before[path])
            else:
                path.unlink(missing_ok=True)
        raise ScaffoldError(f"{e}\n{spec.name}'s files were not kept") from None
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
    steps = [
        "next steps:" if root == Path(".") else f"next steps, in {root}:",
        f"  {test:<{width}}  # builds the kernel, checks it against the reference",
        f"  {bench:<{width}}  # verifies, then times it",
        f"  the kernel is in csrc/{name}.cc{cuda}: a placeholder; replace it and the reference in "
        f"{declaration} together",
    ]
    if package is not None:
        steps.append(f"  after changing a declaration in {package}/ops/ (its schema, backward=, dtypes...), run "
                     f"`opbridge codegen` here: it rewrites {package}/_custom_ops.py(i), which "
                     f"tests/test_build.py checks is current")
    return steps


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
    if not package.isidentifier() or keyword.iskeyword(package):
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
