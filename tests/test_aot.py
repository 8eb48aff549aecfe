"""AOT builds: one module per library, the setuptools integration, the wheel, loading without compiling."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import opbridge
from opbridge import aot, loader
from opbridge.aot import cli as aot_cli
from opbridge.errors import DeclarationError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_plugin"

SCALE_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void scale_cpu(TensorView out, TensorView x, double alpha) {
  OPB_CHECK_DTYPE("scale", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("scale", out, x);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * float(alpha);
}
OPBRIDGE_EXPORT(scale_cpu);
"""
NEG_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void neg_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = -a[i];
}
OPBRIDGE_EXPORT(neg_cpu);
"""


def _declare(lib: opbridge.Library, with_missing: bool = False) -> None:
    @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"))
    def scale(x: object, alpha: float) -> object:
        return x

    @lib.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def neg(x: object) -> object:
        return x

    if with_missing:
        @lib.op("absent(Tensor x) -> Tensor", shape=opbridge.like("x"))
        def absent(x: object) -> object:
            return x


@pytest.fixture(scope="module")
def two_file_lib(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root = tmp_path_factory.mktemp("aot_lib")
    (root / "scale.cc").write_text(SCALE_CC)
    (root / "neg.cc").write_text(NEG_CC)
    lib = opbridge.Library(f"aot_t_{root.name[-6:].replace('-', '_')}", sources=["scale.cc", "neg.cc"],
                           root=root, prebuilt="aotpkg._C_ops")
    _declare(lib)
    return lib


@pytest.fixture(scope="module")
def built(two_file_lib: opbridge.Library, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return aot.build_aot(two_file_lib, tmp_path_factory.mktemp("out") / "aotpkg")


def test_build_aot_makes_one_module_exporting_exactly_the_declared_kernels(
        two_file_lib: opbridge.Library, built: Path) -> None:
    assert built.name == "_C_ops.so"
    assert sorted(loader.exports(built)) == aot.declared_kernels(two_file_lib) == ["neg_cpu", "scale_cpu"]
    info = aot.build_info(built)
    assert info["namespace"] == two_file_lib.namespace and info["kernels"] == ["neg_cpu", "scale_cpu"]
    assert aot.is_current(two_file_lib, built)


def test_edited_source_makes_the_module_stale(two_file_lib: opbridge.Library, built: Path) -> None:
    src = two_file_lib.sources[1]
    text = src.read_text()
    try:
        src.write_text(text + "\n// edited\n")
        assert not aot.is_current(two_file_lib, built)
    finally:
        src.write_text(text)
    assert aot.is_current(two_file_lib, built)


def test_prebuilt_module_is_found_by_find_spec_and_the_loader(
        two_file_lib: opbridge.Library, built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A plain `.so` suffix is in EXTENSION_SUFFIXES, so any Python version finds the module.
    (built.parent / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(built.parent.parent))
    spec = importlib.util.find_spec("aotpkg._C_ops")
    assert spec is not None and Path(str(spec.origin)) == built
    assert loader._prebuilt_path(two_file_lib, "cpu") == built


def test_a_declared_kernel_no_source_exports_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "scale.cc").write_text(SCALE_CC)
    (tmp_path / "neg.cc").write_text(NEG_CC)
    lib = opbridge.Library(f"aot_missing_{tmp_path.name[-6:].replace('-', '_')}",
                           sources=["scale.cc", "neg.cc"], root=tmp_path)
    _declare(lib, with_missing=True)
    with pytest.raises(DeclarationError, match=r"op 'absent' names kernel 'absent_cpu' for cpu, which the "
                                               r"AOT-built cpu module does not export"):
        aot.build_aot(lib, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_adds_aot_to_the_build_command_and_keeps_its_handler(tmp_path: Path) -> None:
    (tmp_path / "scale.cc").write_text(SCALE_CC)
    (tmp_path / "neg.cc").write_text(NEG_CC)
    decl = tmp_path / "aot_cli_decl.py"
    ns = f"aot_cli_{tmp_path.name[-6:].replace('-', '_')}"
    decl.write_text(textwrap.dedent(f"""
        import opbridge
        lib = opbridge.Library("{ns}", sources=["scale.cc", "neg.cc"])

        @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"))
        def scale(x, alpha):
            return x

        @lib.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))
        def neg(x):
            return x
    """))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    calls: list[argparse.Namespace] = []
    build = sub.add_parser("build")
    build.add_argument("--device", default="cpu")
    build.add_argument("--library", action="append")
    build.add_argument("--import", dest="imports", action="append", default=[])
    build.set_defaults(func=lambda a: calls.append(a) or 0)
    aot_cli.register(sub)
    args = parser.parse_args(["build", "--library", ns])
    assert args.func(args) == 0 and len(calls) == 1, "without --aot the previous handler runs"
    args = parser.parse_args(["build", "--aot", "--import", str(decl), "--library", ns,
                              "--out", str(tmp_path / "o")])
    assert args.func(args) == 0
    assert sorted(loader.exports(tmp_path / "o" / "_C_ops.so")) == ["neg_cpu", "scale_cpu"]
    # and the JAX adapter's handler shim, which an installed wheel must not compile at its first JAX call
    from opbridge._tvm import tvm_ffi

    assert tvm_ffi().load_module(str(tmp_path / "o" / "_C_ops.so"))["opbridge_jax_handler"] is not None


# -- the example plugin: setuptools, the wheel, loading without compiling ----------------------


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build")
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "dist", "*.so", "__pycache__",
                                                                 "*.egg-info"))
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(work / "dist"), str(src)],
         env={**os.environ, "OPBRIDGE_NO_PROGRESS": "1"})
    (found,) = (work / "dist").glob("*.whl")
    return found


def test_wheel_is_tagged_for_any_python_3_and_holds_one_module(wheel: Path) -> None:
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl") or "-py3-none-" in wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.endswith((".so", ".pyd"))] == ["vllm_plugin/_C_ops.so"]
    for needed in ("_custom_ops.py", "_custom_ops.pyi", "ops/activation.yaml"):
        assert f"vllm_plugin/{needed}" in names
    wheel_meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
    text = zipfile.ZipFile(wheel).read(wheel_meta).decode()
    assert "Root-Is-Purelib: false" in text and "Tag: py3-none-" in text


FRESH = """
import json, os, sys
import torch
from opbridge import loader
import vllm_plugin._custom_ops as ops
lazy = "vllm_plugin.ops" not in sys.modules
import vllm_plugin.ops as decl
loaded_at_import = len(loader._MODULES)
out = ops.silu_and_mul(torch.ones(2, 4))
x = torch.ones(3)
ops.scale_(x, 2.0)
path = loader.loaded_path(decl.LIBRARY)
print(json.dumps({"lazy": lazy, "loaded_at_import": loaded_at_import, "path": str(path),
                  "exports": sorted(loader.exports(path)), "declared": sorted(
                      op.kernels["cpu"] for op in decl.LIBRARY.ops.values()),
                  "shape": list(out.shape), "x": x.tolist()}))
"""


def test_installed_plugin_compiles_nothing_and_loads_the_wheel_module(wheel: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(site), "OPBRIDGE_CACHE_DIR": str(cache)}
    res = _run([sys.executable, "-c", FRESH], env=env, cwd=tmp_path)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["lazy"], "importing _custom_ops imported the declarations"
    assert doc["loaded_at_import"] == 0, "importing the declarations loaded a module"
    assert Path(doc["path"]) == site / "vllm_plugin" / "_C_ops.so"
    assert doc["exports"] == doc["declared"] and len(doc["declared"]) == 5
    assert doc["shape"] == [2, 2] and doc["x"] == [2.0, 2.0, 2.0]
    assert not cache.exists(), "a kernel was compiled: the cache directory was created"


def test_setuptools_names_the_module_without_a_python_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    from setuptools import Distribution

    from opbridge.aot.setuptools import BdistWheelAnyPython, BuildOpbridgeExt, cmdclass, opbridge_extension

    ext = opbridge_extension("pkg", "pkg.ops")
    cmd = BuildOpbridgeExt(Distribution({"ext_modules": [ext], "name": "pkg"}))
    cmd.ensure_finalized()
    assert cmd.get_ext_filename("pkg._C_ops") == os.path.join("pkg", "_C_ops.so")
    assert cmdclass() == {"build_ext": BuildOpbridgeExt, "bdist_wheel": BdistWheelAnyPython}


def test_build_ext_rejects_declarations_without_the_prebuilt_library(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge.aot.setuptools import load_declared_library, opbridge_extension

    pkg = tmp_path / "noprebuilt_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("import opbridge\nLIB = opbridge.Library('noprebuilt_ns')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(DeclarationError, match=r"one Library declared with prebuilt='noprebuilt_pkg\._C"):
        load_declared_library(opbridge_extension("noprebuilt_pkg", "noprebuilt_pkg.ops"), tmp_path)

