"""AOT modules per device: ``pkg._C_ops`` for the CPU, ``pkg._C_ops_cuda`` beside it, and who builds which.

The CUDA module compiles wherever ``nvcc`` is (no GPU needed); its kernels
run only on a GPU, which ``scripts/gpu-check.sh`` covers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from setuptools import Distribution

import opbridge
from opbridge import aot, loader
from opbridge.aot import setuptools as aot_setuptools
from opbridge.aot.setuptools import BuildOpbridgeExt, opbridge_extensions
from opbridge.build.toolchain import nvcc_path
from opbridge.errors import BackendUnavailableError, BuildError

SCALE_CC = """
#include <opbridge/opbridge.h>
void scale_cpu(tvm::ffi::TensorView out, tvm::ffi::TensorView x, double alpha) {}
OPBRIDGE_EXPORT(scale_cpu);
"""
SCALE_CU = """
#include <opbridge/cuda.h>
void scale_cuda(tvm::ffi::TensorView out, tvm::ffi::TensorView x, double alpha) {}
OPBRIDGE_EXPORT(scale_cuda);
"""
DECLARATIONS = """
import opbridge
from pathlib import Path
root = Path(__file__).resolve().parent.parent
LIB = opbridge.Library("{ns}", sources=[p for p in {sources!r} if (root / p).exists()], root=root,
                       prebuilt="{pkg}._C_ops")

@LIB.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"))
def scale(x, alpha):
    return x * alpha
"""


def _package(root: Path, pkg: str, *, cuda_source: bool) -> None:
    """A plugin source tree under *root*: ``<pkg>/ops.py`` declares ``<pkg>_ns`` over ``scale.cc`` (+ ``.cu``)."""
    (root / pkg).mkdir(parents=True)
    (root / pkg / "__init__.py").write_text("")
    (root / "scale.cc").write_text(SCALE_CC)
    if cuda_source:
        (root / "scale.cu").write_text(SCALE_CU)
    (root / pkg / "ops.py").write_text(DECLARATIONS.format(ns=f"{pkg}_ns", pkg=pkg,
                                                            sources=["scale.cc", "scale.cu"]))


def test_each_device_has_its_module_name() -> None:
    cpu, cuda = opbridge_extensions("pkg", "pkg.ops")
    assert (cpu.name, cpu.device, cpu.library) == ("pkg._C_ops", "cpu", "pkg._C_ops")
    assert (cuda.name, cuda.device, cuda.library) == ("pkg._C_ops_cuda", "cuda", "pkg._C_ops")
    cmd = BuildOpbridgeExt(Distribution({"ext_modules": [cpu, cuda], "name": "pkg"}))
    cmd.ensure_finalized()
    assert cmd.get_ext_filename("pkg._C_ops_cuda") == os.path.join("pkg", "_C_ops_cuda.so")
    lib = opbridge.Library("aotdev_names", prebuilt="somepkg._C_ops")
    assert lib.prebuilt_module("cpu") == "somepkg._C_ops" and lib.prebuilt_module("cuda") == "somepkg._C_ops_cuda"
    assert aot.module_name(lib, "cuda") == "_C_ops_cuda"
    assert opbridge.Library("aotdev_none").prebuilt_module("cuda") is None


def _applies(root: Path, pkg: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The modules ``build_ext`` would build for the package at *root*."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    cmd = BuildOpbridgeExt(Distribution({"ext_modules": opbridge_extensions(pkg, f"{pkg}.ops"), "name": pkg}))
    cmd.ensure_finalized()
    monkeypatch.setattr(cmd, "_source_root", lambda: root)
    return [ext.name for ext in cmd.extensions if cmd._applies(ext)]


def test_build_ext_builds_cuda_where_it_can_and_fails_only_where_asked_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _package(tmp_path / "a", "aotdev_a", cuda_source=True)
    _package(tmp_path / "b", "aotdev_b", cuda_source=False)
    monkeypatch.delenv("OPBRIDGE_AOT_DEVICES", raising=False)
    monkeypatch.setattr(aot_setuptools, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    assert _applies(tmp_path / "a", "aotdev_a", monkeypatch) == ["aotdev_a._C_ops", "aotdev_a._C_ops_cuda"]
    # No CUDA sources: no CUDA module, and nothing to warn about.
    assert _applies(tmp_path / "b", "aotdev_b", monkeypatch) == ["aotdev_b._C_ops"]
    assert "WARNING" not in capsys.readouterr().err

    monkeypatch.setattr(aot_setuptools, "nvcc_path", lambda: None)
    assert _applies(tmp_path / "a", "aotdev_a", monkeypatch) == ["aotdev_a._C_ops"]
    err = capsys.readouterr().err
    assert "WARNING: building aotdev_a_ns without its cuda module aotdev_a._C_ops_cuda: nvcc was not found" in err
    assert "OPBRIDGE_AOT_DEVICES=cpu,cuda makes this an error" in err

    monkeypatch.setenv("OPBRIDGE_AOT_DEVICES", "cpu,cuda")
    with pytest.raises(BuildError, match=r"_C_ops_cuda: OPBRIDGE_AOT_DEVICES names cuda, but nvcc was not found"):
        _applies(tmp_path / "a", "aotdev_a", monkeypatch)
    with pytest.raises(BuildError, match=r"names cuda, but aotdev_b_ns has no cuda sources"):
        _applies(tmp_path / "b", "aotdev_b", monkeypatch)
    monkeypatch.setenv("OPBRIDGE_AOT_DEVICES", "cpu")
    assert _applies(tmp_path / "a", "aotdev_a", monkeypatch) == ["aotdev_a._C_ops"]
    monkeypatch.setenv("OPBRIDGE_AOT_DEVICES", "cpu,npu")
    with pytest.raises(ValueError, match=r"OPBRIDGE_AOT_DEVICES must list devices among cpu, cuda, got 'cpu,npu'"):
        _applies(tmp_path / "a", "aotdev_a", monkeypatch)


def test_an_installed_package_without_its_cuda_module_says_so(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed wheel: no sources, and only the CPU module's package.
    (tmp_path / "aotdev_wheel").mkdir()
    (tmp_path / "aotdev_wheel" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = opbridge.Library("aotdev_wheel_ns", prebuilt="aotdev_wheel._C_ops")

    @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"), kernels={"cpu": "scale_cpu",
                                                                                       "cuda": "scale_cuda"})
    def scale(x: object, alpha: float) -> object:
        return x

    missing = r"aotdev_wheel_ns was installed without its cuda module aotdev_wheel\._C_ops_cuda \(`pip install`"
    with pytest.raises(BackendUnavailableError, match=missing):
        loader.load(lib, "cuda")

    # Declared by default only where a CUDA source or module is: here neither.
    plain = opbridge.Library("aotdev_wheel_plain", prebuilt="aotdev_wheel._C_ops")

    @plain.op("neg(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def neg(x: object) -> object:
        return x

    assert plain.ops["neg"].kernels == {"cpu": "neg_cpu"}


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (CUDA modules compile without a GPU)")
def test_an_installed_cuda_module_gives_the_ops_their_cuda_kernels(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CUDA_ARCHS", "90")
    src = tmp_path / "src"
    _package(src, "aotdev_cu", cuda_source=True)
    monkeypatch.syspath_prepend(str(src))
    import aotdev_cu.ops as decl  # the source tree: declares both kernels from the sources

    assert decl.LIB.ops["scale"].kernels == {"cpu": "scale_cpu", "cuda": "scale_cuda"}
    site = tmp_path / "site" / "aotdev_cu_site"
    built = aot.build_aot(decl.LIB, site, device="cuda")
    assert built.name == "_C_ops_cuda.so" and loader.exports(built) == ["scale_cuda"]
    assert aot.build_info(built)["device"] == "cuda"

    # The installed package: no sources, the CUDA module beside the package's __init__.
    (site / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site.parent))
    wheel = opbridge.Library("aotdev_cu_installed", prebuilt="aotdev_cu_site._C_ops")

    @wheel.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"))
    def scale(x: object, alpha: float) -> object:
        return x

    assert wheel.ops["scale"].kernels == {"cpu": "scale_cpu", "cuda": "scale_cuda"}
    assert loader._prebuilt_path(wheel, "cuda") == built

    # A source tree says what exists: its CUDA sources gone, a leftover CUDA module declares nothing.
    tree = opbridge.Library("aotdev_cu_cc_only", sources=["scale.cc"], root=src, prebuilt="aotdev_cu_site._C_ops")

    @tree.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"))
    def scale_cc(x: object, alpha: float) -> object:
        return x

    assert tree.ops["scale"].kernels == {"cpu": "scale_cpu"}
