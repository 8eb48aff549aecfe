"""Generated wrappers: typed signatures and NumPy docstrings from the declarations, lazy, kept current."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from opbridge import codegen, registry
from opbridge.codegen import StaleGeneratedFilesError
from opbridge.codegen import cli as codegen_cli
from opbridge.codegen.cli import _note_import_path
from opbridge.codegen.docstrings import parse

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_plugin"

KERNELS = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void axpy_cpu(TensorView out, TensorView x, TensorView y, double alpha) {
  const float* a = static_cast<const float*>(x.data_ptr());
  const float* b = static_cast<const float*>(y.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = float(alpha) * a[i] + b[i];
}
OPBRIDGE_EXPORT(axpy_cpu);
// pick and bump_ are never called here; every kernel a library declares must be exported all the same.
void pick_cpu(TensorView, TensorView, TensorView, tvm::ffi::Optional<TensorView>, tvm::ffi::Array<int64_t>, bool,
              tvm::ffi::String) {}
OPBRIDGE_EXPORT(pick_cpu);
void bump__cpu(TensorView, double) {}
OPBRIDGE_EXPORT(bump__cpu);
void halve__cpu(TensorView, tvm::ffi::Optional<TensorView>) {}
OPBRIDGE_EXPORT(halve__cpu);
"""

DECLARATIONS = '''
from collections.abc import Sequence
from typing import Any

import opbridge

LIB = opbridge.Library("{ns}", sources=["k.cc"])


@LIB.op("axpy(Tensor x, Tensor y, float alpha=2.0) -> Tensor", shape=opbridge.like("x"))
def axpy(x: Any, y: Any, alpha: float = 2.0) -> Any:
    """``alpha * x + y``, elementwise.

    Parameters
    ----------
    x
        The scaled tensor.
    y : Tensor
        The added tensor.
    alpha
        The factor.

    Returns
    -------
    Tensor
        Same shape as ``x``.

    Examples
    --------
    >>> axpy(x, y, 3.0)
    """
    return alpha * x + y


@LIB.op("pick(Tensor x, Tensor? w, int[] dims, *, bool keep=False, str name=\\"a\\\\\\\\b\\") "
        "-> (Tensor, Tensor)", kernels={{"cpu": "pick_cpu"}}, shape=opbridge.like("x", "x"))
def pick(x: Any, w: Any, dims: Sequence[int], *, keep: bool = False, name: str = "a") -> Any:
    return x, x


@LIB.op("bump_(Tensor(a!) x, float by) -> Tensor(a!)", dtypes=("float64", "float32"))
def bump_(x: Any, by: float) -> Any:
    """Add ``by`` to ``x`` in place and return it."""
    x += by
    return x


@LIB.op("halve_(Tensor(a!) x, Tensor(b!)? y) -> ()")
def halve_(x: Any, y: Any) -> None:
    """Halve ``x`` and ``y`` in place."""
    x /= 2
'''


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path]:
    root = tmp_path_factory.mktemp("codegen")
    ns = f"cg_{root.name[-6:].replace('-', '_')}"
    (root / "k.cc").write_text(KERNELS)
    name = f"{ns}_decl"
    (root / f"{name}.py").write_text(DECLARATIONS.format(ns=ns))
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
    return module, root


def _load_generated(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrappers_have_the_schemas_signatures_and_types(declared: tuple[ModuleType, Path],
                                                        tmp_path: Path) -> None:
    decl, _ = declared
    paths = codegen.generate(decl.LIB, tmp_path)
    assert [p.name for p in paths] == ["_custom_ops.py", "_custom_ops.pyi"]
    wrappers = _load_generated(paths[0], f"{decl.LIB.namespace}_wrappers")
    assert sorted(wrappers.__all__) == sorted(decl.LIB.ops)
    for name, op in decl.LIB.ops.items():
        mine = inspect.signature(getattr(wrappers, name))
        theirs = inspect.signature(op.call)
        assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in theirs.parameters.values()], name
    pick = inspect.signature(wrappers.pick)
    assert {k: str(p.annotation) for k, p in pick.parameters.items()} == {
        "x": "Tensor", "w": "Tensor | None", "dims": "Sequence[int]", "keep": "bool", "name": "str",
        "out": "tuple[Tensor, Tensor] | None"}
    assert pick.return_annotation == "tuple[Tensor, Tensor]"
    assert inspect.signature(wrappers.bump_).return_annotation == "Tensor | tuple[Tensor, Tensor]"
    stub = ast.parse(paths[1].read_text())
    assert {n.name for n in stub.body if isinstance(n, ast.FunctionDef)} == set(decl.LIB.ops)


def test_a_mutating_op_is_typed_with_what_it_returns_on_jax_arrays(declared: tuple[ModuleType, Path],
                                                                   tmp_path: Path) -> None:
    """torch, NumPy, Paddle and MindSpore return a mutating op's declared returns (None for ``-> ()``); JAX,
    whose arrays are immutable, the new values of its mutated arguments, then the returns, as one tuple
    (opbridge.adapters.jax). The stub says both (it said None), and the wrapper returns what the op returns
    (it dropped JAX's new values)."""
    decl, _ = declared
    codegen.generate(decl.LIB, tmp_path)
    stub = (tmp_path / "_custom_ops.pyi").read_text()
    assert "def halve_(x: _Tensor, y: _Tensor | None) -> tuple[_Tensor, _Tensor | None] | None:" in stub
    assert "def bump_(x: _Tensor, by: float) -> _Tensor | tuple[_Tensor, _Tensor]:" in stub
    docs = {n.name: ast.get_docstring(n) or "" for n in ast.parse(stub).body if isinstance(n, ast.FunctionDef)}
    assert " ".join(docs["halve_"].split()).startswith(
        "Halve ``x`` and ``y`` in place. Returns None; on JAX arrays, which are immutable, the new values of "
        "``x``, ``y`` as a tuple (the arrays passed in are unchanged).")
    assert "Returns its returns; on JAX arrays, which are immutable, the new values of ``x``, then its " \
        "returns, as a tuple" in " ".join(docs["bump_"].split())
    wrappers = _load_generated(tmp_path / "_custom_ops.py", f"{decl.LIB.namespace}_mutating")
    assert inspect.signature(wrappers.halve_).return_annotation == "tuple[Tensor, Tensor | None] | None"
    wrappers._OPS["halve_"] = lambda x, y: (x / 2, None)  # JAX's answer, without importing JAX
    assert wrappers.halve_(4.0, None) == (2.0, None)
    assert "None or tuple of Tensor" in (inspect.getdoc(wrappers.halve_) or "")


def test_docstrings_combine_the_schema_and_the_reference(declared: tuple[ModuleType, Path],
                                                         tmp_path: Path) -> None:
    decl, _ = declared
    codegen.generate(decl.LIB, tmp_path)
    wrappers = _load_generated(tmp_path / "_custom_ops.py", f"{decl.LIB.namespace}_docs")
    doc = inspect.getdoc(wrappers.axpy) or ""
    parsed = parse(doc)
    assert parsed.summary == "``alpha * x + y``, elementwise."
    entries = parsed.entries("Parameters")
    assert (entries["x"], entries["y"], entries["alpha"]) == (["The scaled tensor."], ["The added tensor."],
                                                              ["The factor."])
    assert "alpha : float, default 2.0" in doc
    assert parsed.sections["Examples"] == [">>> axpy(x, y, 3.0)"]
    assert f"{decl.LIB.namespace}::axpy(Tensor x, Tensor y, float alpha=2.0) -> Tensor" in doc
    bump = inspect.getdoc(wrappers.bump_) or ""
    assert "Mutates ``x`` in place." in bump and "x : Tensor\n    Mutated in place." in bump
    pick = inspect.getdoc(wrappers.pick) or ""
    assert "Kernels: ``pick_cpu`` (cpu); backward: none." in pick
    assert "name : str, default 'a\\\\b'" in pick  # the backslash default survives quoting


def test_wrappers_and_stubs_show_the_declared_dtypes(declared: tuple[ModuleType, Path],
                                                     tmp_path: Path) -> None:
    decl, _ = declared
    codegen.generate(decl.LIB, tmp_path)
    wrappers = _load_generated(tmp_path / "_custom_ops.py", f"{decl.LIB.namespace}_dtypes")
    stub = ast.parse((tmp_path / "_custom_ops.pyi").read_text())
    stub_docs = {n.name: ast.get_docstring(n) or "" for n in stub.body if isinstance(n, ast.FunctionDef)}
    for name, op in decl.LIB.ops.items():
        line = f"Dtypes: {', '.join(op.dtypes)}."
        assert line in (inspect.getdoc(getattr(wrappers, name)) or "").splitlines(), name
        assert line in stub_docs[name].splitlines(), name
    assert decl.LIB.ops["bump_"].dtypes == ("float64", "float32")  # the op's own, not the default
    assert "Dtypes: float64, float32." in stub_docs["bump_"]
    assert stub_docs["axpy"].startswith("``alpha * x + y``, elementwise.")  # the summary, shortened
    assert "Parameters" not in stub_docs["axpy"]


def test_importing_the_wrappers_is_free_and_the_first_call_declares(declared: tuple[ModuleType, Path],
                                                                    tmp_path: Path) -> None:
    decl, _ = declared
    codegen.generate(decl.LIB, tmp_path)
    wrappers = _load_generated(tmp_path / "_custom_ops.py", f"{decl.LIB.namespace}_lazy")
    assert wrappers._OPS == {}, "nothing is looked up at import"
    x, y = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    np.testing.assert_array_equal(wrappers.axpy(x, y), 2 * x + 1)
    np.testing.assert_array_equal(wrappers.axpy(x, y, alpha=3.0), 3 * x + 1)
    assert wrappers._OPS["axpy"] is decl.axpy, "each wrapper calls the op's public callable"


def test_check_fails_on_stale_or_missing_files(declared: tuple[ModuleType, Path], tmp_path: Path) -> None:
    decl, _ = declared
    with pytest.raises(StaleGeneratedFilesError, match="missing"):
        codegen.generate(decl.LIB, tmp_path, check=True)
    codegen.generate(decl.LIB, tmp_path)
    assert codegen.generate(decl.LIB, tmp_path, check=True) == [tmp_path / "_custom_ops.py",
                                                                  tmp_path / "_custom_ops.pyi"]
    stub = tmp_path / "_custom_ops.pyi"
    stub.write_text(stub.read_text().replace("alpha: float = 2.0", "alpha: float = 3.0"))
    with pytest.raises(StaleGeneratedFilesError) as err:
        codegen.generate(decl.LIB, tmp_path, check=True)
    assert err.value.paths == [stub]
    assert "-def axpy(x: _Tensor, y: _Tensor, alpha: float = 3.0" in str(err.value)
    assert f"opbridge codegen --import {decl.__name__} --library {decl.LIB.namespace}" in str(err.value)


def test_check_notices_a_changed_declaration(tmp_path: Path) -> None:
    import opbridge

    (tmp_path / "k.cc").write_text(KERNELS)
    ns = f"cg_change_{tmp_path.name[-6:].replace('-', '_')}"
    lib = opbridge.Library(ns, sources=["k.cc"], root=tmp_path)

    @lib.op("axpy(Tensor x, Tensor y, float alpha=2.0) -> Tensor", shape=opbridge.like("x"))
    def axpy(x: object, y: object, alpha: float = 2.0) -> object:
        return x

    codegen.generate(lib, tmp_path)

    @lib.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def neg(x: object) -> object:
        return x

    with pytest.raises(StaleGeneratedFilesError, match="stale"):
        codegen.generate(lib, tmp_path, check=True)


def test_cli_check_exit_status(declared: tuple[ModuleType, Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    decl, _ = declared
    parser = argparse.ArgumentParser()
    codegen_cli.register(parser.add_subparsers())
    base = ["codegen", "--library", decl.LIB.namespace, "--out", str(tmp_path)]
    args = parser.parse_args([*base, "--check"])
    assert args.func(args) == 1
    assert "stale" in capsys.readouterr().err
    args = parser.parse_args(base)
    assert args.func(args) == 0
    args = parser.parse_args([*base, "--check"])
    assert args.func(args) == 0


def test_cli_notes_where_the_wrappers_can_import_a_module_read_from_a_path(
        declared: tuple[ModuleType, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--import dir/decl.py --out elsewhere`: the wrappers import `decl` by name, so say where that works."""
    decl, root = declared
    _note_import_path(decl.__name__, [str(root / f"{decl.__name__}.py")], tmp_path)
    assert f"they run where {decl.__name__!r} is importable ({root} on sys.path" in capsys.readouterr().err
    _note_import_path(decl.__name__, [str(root / f"{decl.__name__}.py")], root)  # beside it: importable there
    _note_import_path(decl.__name__, [decl.__name__], tmp_path)  # by name: importable as given
    assert capsys.readouterr().err == ""


def test_example_plugin_wrappers_are_current() -> None:
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    importlib.import_module("vllm_plugin.ops")
    codegen.generate(registry.library("vllm_plugin"), EXAMPLE / "vllm_plugin", check=True)


def test_generated_code_reads_like_handwritten_code(declared: tuple[ModuleType, Path],
                                                    tmp_path: Path) -> None:
    decl, _ = declared
    codegen.generate(decl.LIB, tmp_path)
    for path in (tmp_path / "_custom_ops.py", tmp_path / "_custom_ops.pyi"):
        text = path.read_text()
        assert all(len(line) <= 110 for line in text.splitlines()), path
        assert text.startswith("# Generated by opbridge.codegen")
        compile(text, str(path), "exec")
    assert textwrap.dedent("""\
        def _load() -> dict[str, Callable[..., Any]]:""") in (tmp_path / "_custom_ops.py").read_text()
