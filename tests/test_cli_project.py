"""The command line in and on a plugin project: op names `new` refuses, `--import` of a project's files, the
project's own ops found without `--import`, and the checks an AOT build makes before it ships a module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opbridge import Library, config, like, registry, scaffold
from opbridge.aot import build_aot
from opbridge.build.library import build_spec
from opbridge.cli import build_parser
from opbridge.errors import DeclarationError
from opbridge.loader import check_signature


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The suite's JIT cache (the project's module builds once for the whole suite), no progress lines."""
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(config.cache_dir()), "OPBRIDGE_NO_PROGRESS": "1",
           "OPBRIDGE_TORCH_NATIVE": "0"}
    env.pop("OPBRIDGE_VERBOSE", None)
    return env


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project as `opbridge new --project cli-plugin` writes it, with a second op; copied by `project`."""
    parent = tmp_path_factory.mktemp("made")
    scaffold.new_project("cli-plugin", parent)
    scaffold.new_op(scaffold.from_schema("scale_add", "(Tensor x, Tensor y, float alpha) -> Tensor"),
                    parent / "cli-plugin")
    return parent / "cli-plugin"


@pytest.fixture
def project(made: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "cli-plugin"))


def opbridge(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opbridge", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


# -- opbridge new: names that would not make a working op -------------------------------------------------------


@pytest.mark.parametrize("name", ["class", "def", "lambda", "None"])
def test_new_refuses_a_python_keyword_as_the_op_name_and_writes_nothing(
        project: Path, env: dict[str, str], name: str) -> None:
    before = _files(project)
    proc = opbridge(project, env, "new", name, "--schema", f"{name}(Tensor x) -> Tensor")
    assert proc.returncode == 2, proc.stderr
    assert f"op name {name!r} must be a Python identifier (it is a Python keyword)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _files(project) == before
    # ... so the project still takes ops
    proc = opbridge(project, env, "new", "twice")
    assert proc.returncode == 0, proc.stderr
    assert (project / "cli_plugin" / "ops" / "twice.py").is_file()


def test_a_keyword_is_refused_from_a_prototype_and_as_a_namespace_or_project(tmp_path: Path) -> None:
    with pytest.raises(scaffold.ScaffoldError, match="Python keyword"):
        scaffold.to_spec({"op": "Pass", "kernel_name": "pass", "input_desc": [{"name": "x", "type": "float"}],
                          "output_desc": [{"name": "y", "type": "float"}]})
    with pytest.raises(scaffold.ScaffoldError, match="namespace 'class' must be a Python identifier"):
        scaffold.from_schema("fine", None, namespace="class")
    with pytest.raises(scaffold.ScaffoldError, match="does not give a Python package name"):
        scaffold.new_project("import", tmp_path)
    assert not (tmp_path / "import").exists()


@pytest.mark.parametrize(("name", "where"), [
    ("np", "cli_plugin/ops/np.py"),              # `import numpy as np` in the declaration
    ("list", "benchmarks/bench_list.py"),        # the benchmark calls list(...)
    ("verify", "benchmarks/bench_verify.py"),    # one of the benchmark's helpers
    ("x", "cli_plugin/ops/x.py"),                # the op's own argument
    ("importlib", "cli_plugin/ops/__init__.py"),  # each op module becomes an attribute of the ops package
    ("LIBRARY", "cli_plugin/ops/LIBRARY.py"),
])
def test_new_refuses_a_name_the_generated_files_use_for_something_else(
        project: Path, name: str, where: str) -> None:
    before = _files(project)
    with pytest.raises(scaffold.ScaffoldError, match=f"op name '{name}' is a name that {where} uses"):
        scaffold.new_op(scaffold.from_schema(name, None), project)
    assert _files(project) == before


def test_new_refuses_a_private_op_in_a_project_which_its_package_would_never_import(project: Path) -> None:
    with pytest.raises(scaffold.ScaffoldError, match="starts with '_'"):
        scaffold.new_op(scaffold.from_schema("_hidden", None), project)


def test_builtin_and_soft_keyword_names_the_files_do_not_use_still_work(tmp_path: Path) -> None:
    for name in ("match", "type", "sum"):
        scaffold.new_op(scaffold.from_schema(name, None), tmp_path / name)
        assert (tmp_path / name / f"{name}_op.py").is_file()


def test_new_in_a_project_that_does_not_import_keeps_nothing_and_says_where_in_one_line(
        project: Path, env: dict[str, str]) -> None:
    broken = project / "cli_plugin" / "ops" / "broken.py"
    broken.write_text("def class(x):\n    return x\n")  # what `opbridge new class` wrote before
    before = _files(project)
    proc = opbridge(project, env, "new", "twice")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"SyntaxError: invalid syntax at {broken}:1" in proc.stderr, proc.stderr
    assert "twice's files were not kept" in proc.stderr
    assert _files(project) == before


# -- --import of a project's files, and the project's ops without --import -----------------------------------


def test_import_of_a_file_inside_the_projects_package_imports_it_as_its_module(
        project: Path, env: dict[str, str]) -> None:
    proc = opbridge(project, env, "list", "--json", "--import", "cli_plugin/ops/scale_add.py")
    assert proc.returncode == 0, proc.stderr
    assert '"qualname": "cli_plugin::scale_add"' in proc.stdout
    proc = opbridge(project, env, "codegen", "--check", "--import", "cli_plugin/ops/scale_add.py")
    assert proc.returncode == 0, proc.stderr
    assert "cli_plugin: current" in proc.stdout


def test_a_module_that_fails_to_import_is_one_line_naming_it(project: Path, env: dict[str, str]) -> None:
    (project / "cli_plugin" / "ops" / "broken.py").write_text("import numpy\nimport no_such_module_here\n")
    for command in (["list"], ["build"], ["codegen", "--check"], ["fuzz", "--frameworks", "numpy"],
                    ["build", "--aot", "--out", "out"]):
        proc = opbridge(project, env, *command, "--import", "cli_plugin/ops/scale_add.py")
        assert proc.returncode == 2, (command, proc.stderr)
        assert "Traceback" not in proc.stderr, (command, proc.stderr)
        (line,) = proc.stderr.splitlines()
        broken = project / "cli_plugin" / "ops" / "broken.py"
        assert line.startswith("opbridge: error: --import cli_plugin/ops/scale_add.py (as "
                               "cli_plugin.ops.scale_add): importing it raised ModuleNotFoundError: No module "
                               f"named 'no_such_module_here' (at {broken}:2)"), line
    verbose = opbridge(project, {**env, "OPBRIDGE_VERBOSE": "1"}, "list", "--import", "cli_plugin/ops/broken.py")
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr
    # without --import, in the project's root: the project's own module, said to be imported by default
    proc = opbridge(project, env, "list")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("opbridge: error: cli_plugin.ops, this project's ops (imported by default"), \
        proc.stderr


def test_the_cli_uses_the_project_it_runs_in_without_import(project: Path, env: dict[str, str]) -> None:
    proc = opbridge(project, env, "list")
    assert proc.returncode == 0, proc.stderr
    assert "cli_plugin::scale_add" in proc.stdout and "cli_plugin::identity" in proc.stdout
    proc = opbridge(project, env, "codegen", "--check")
    assert proc.returncode == 0, proc.stderr
    assert f"cli_plugin: current {project / 'cli_plugin' / '_custom_ops.py'}" in proc.stdout
    proc = opbridge(project, env, "build", "--library", "cli_plugin")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cli_plugin (cpu): ")
    proc = opbridge(project, env, "fuzz", "--ops", "scale_add", "--frameworks", "numpy", "--examples", "2",
                    "--checks", "calls")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numpy cli_plugin::scale_add: 1 check(s) ran, 0 failed" in proc.stdout
    # outside the project, nothing of it is imported
    proc = opbridge(project.parent, env, "list")
    assert proc.returncode == 0 and "cli_plugin" not in proc.stdout


def test_help_says_how_a_projects_own_ops_are_found() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("list", "build", "fuzz", "codegen"):
        text = " ".join(sub.choices[command].format_help().split())
        assert "[tool.opbridge] package" in text and "PKG.ops" in text, command
    assert "[tool.opbridge] package" in " ".join(parser.format_help().split())


# -- next steps: rerun codegen after changing a declaration ------------------------------------------------------


def test_next_steps_and_the_project_readme_say_to_rerun_codegen(project: Path) -> None:
    steps = scaffold.next_steps(scaffold.from_schema("twice", None), project)
    (line,) = [s for s in steps if "opbridge codegen" in s]
    assert "after changing a declaration in cli_plugin/ops/" in line and "backward=" in line
    readme = (project / "README.md").read_text()
    assert "run `opbridge codegen` in this folder" in readme
    assert "test_generated_wrappers_are_current" in readme
    assert not any("codegen" in s for s in scaffold.next_steps(scaffold.from_schema("twice", None), project.parent))


# -- Library sources opbridge does not compile ------------------------------------------------------------------


@pytest.mark.parametrize("sources", [["kern.c"], ["good.cc", "kern.c"], ["notes.cxx2"], ["good.cc", "notes.cxx2"]],
                         ids=lambda s: "+".join(s))
def test_a_source_of_a_suffix_no_device_compiles_is_a_declaration_error(tmp_path: Path, sources: list[str]) -> None:
    """Alone, such a file was named only when the build found nothing else to compile; beside a .cc it was left
    out of every build without a word. Both are the same error now, when the library is declared."""
    for name in sources:
        (tmp_path / name).write_text("int x;\n")
    bad = sources[-1]
    namespace = f"suffix_{tmp_path.name[-8:]}"
    with pytest.raises(DeclarationError, match=r"opbridge does not compile \(\.c(xx2)?\): it compiles \.cc, \.cpp, "
                                               r"\.cxx for cpu and \.cu for cuda") as info:
        Library(namespace, sources=sources, root=tmp_path)
    message = str(info.value)
    assert message.startswith(f"library {namespace!r}: source"), message
    assert str((tmp_path / bad).resolve()) in message, message
    assert ("a C file compiles as C++ renamed .cc" in message) is bad.endswith(".c")
    assert "good.cc" not in message
    assert namespace not in {lib.namespace for lib in registry.libraries()}  # not declared half-way


def test_headers_among_the_sources_are_taken_and_missing_sources_are_no_such_file(tmp_path: Path) -> None:
    (tmp_path / "good.cc").write_text("int x;\n")
    lib = Library(f"headers_{tmp_path.name[-8:]}", sources=["good.cc", "good.h", "good.hpp", "good.cuh"],
                  root=tmp_path)
    assert lib.sources_for("cpu") == ((tmp_path / "good.cc").resolve(),) and lib.sources_for("cuda") == ()
    gone = Library(f"cugone_{tmp_path.name[-8:]}", sources=["kern.cu"], root=tmp_path)
    for device in ("cpu", "cuda"):  # as a missing .cc is reported
        with pytest.raises(DeclarationError, match=f"no source file {tmp_path / 'kern.cu'}"):
            build_spec(gone, device)


# -- AOT builds check the kernels' signatures ---------------------------------------------------------------------


SIG_INT = """\
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void sa_cpu(TensorView o, TensorView x, TensorView y, int64_t a) {
  OPB_CHECK_DTYPE("sa", x, opbridge::kFloat32);
  const float* xs = opbridge::data_ptr<const float>(x);
  const float* ys = opbridge::data_ptr<const float>(y);
  for (int64_t i = 0; i < x.numel(); ++i) opbridge::data_ptr<float>(o)[i] = xs[i] + float(a) * ys[i];
}
OPBRIDGE_EXPORT(sa_cpu);
"""


def test_an_aot_build_refuses_a_kernel_whose_signature_does_not_take_the_schemas_arguments(tmp_path: Path) -> None:
    (tmp_path / "sig.cc").write_text(SIG_INT)
    lib = Library(f"sigaot_{tmp_path.name[-8:]}", sources=["sig.cc"], root=tmp_path)

    @lib.op("sa(Tensor x, Tensor y, float alpha) -> Tensor", shape=like("x"), dtypes=["float32"])
    def sa(x, y, alpha):  # type: ignore[no-untyped-def]
        return x + alpha * y

    with pytest.raises(DeclarationError) as caught:
        build_aot(lib, tmp_path / "out")
    with pytest.raises(DeclarationError) as first_call:  # what the loader says at the first call
        check_signature(lib.ops["sa"], "sa_cpu", "v:TTTl")
    assert str(first_call.value) in str(caught.value)
    assert "argument #3 (float alpha) arrives as double, the kernel takes int64_t" in str(caught.value)
    assert not (tmp_path / "out" / "_C_ops.so").exists()


def test_aot_cli_fails_on_a_wrong_signature(tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "sig.cc").write_text(SIG_INT)
    (tmp_path / "sigdecl.py").write_text(textwrap.dedent("""\
        import opbridge
        lib = opbridge.Library("sigcli_t", sources=["sig.cc"])
        @lib.op("sa(Tensor x, Tensor y, float alpha) -> Tensor", shape=opbridge.like("x"), dtypes=["float32"])
        def sa(x, y, alpha):
            return x + alpha * y
        """))
    proc = opbridge(tmp_path, env, "build", "--aot", "--import", "sigdecl.py", "--library", "sigcli_t",
                    "--out", "out")
    assert proc.returncode == 1, proc.stderr
    assert "kernel sa_cpu(TensorView, TensorView, TensorView, int64_t) does not take" in proc.stderr
    assert not (tmp_path / "out").exists()
