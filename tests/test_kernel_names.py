"""A declared kernel name the module does not export fails when the module is built or loaded, not at a call.

The error names the library, the op, the kernel, the device, where the op was declared (the
``Library.op`` line, or the manifest entry's ``file:line``) and the closest exported names.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import aot, loader, manifest, registry
from opbridge.build import jit
from opbridge.errors import DeclarationError

SCALE_CC = """\
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void scale_cpu(TensorView out, TensorView x, double alpha) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * float(alpha);
}
OPBRIDGE_EXPORT(scale_cpu);
void negate_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = -a[i];
}
OPBRIDGE_EXPORT(negate_cpu);
"""

#: A user's declaration module; ``{kernel}`` is the scale op's cpu kernel name (line 5 declares it).
DECL = """\
import opbridge

lib = opbridge.Library("{ns}", sources=["scale.cc"], dtypes=["float32"])

@lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"),
        kernels={{"cpu": "{kernel}"}})
def scale(x, alpha):
    return x * alpha

@lib.op("negate(Tensor x) -> Tensor", shape=opbridge.like("x"))
def negate(x):
    return -x

@lib.op("gpu_only(Tensor x) -> Tensor", shape=opbridge.like("x"), kernels={{"cuda": "gpu_only_cuda"}})
def gpu_only(x):
    return x
"""
DECL_LINE = 5

MANIFEST = """\
library:
  namespace: {ns}
  sources: [scale.cc]
ops:
  - func: negate(Tensor x) -> Tensor
    shape: {{like: x}}
    reference: {refs}.negate
  - func: scale(Tensor x, float alpha) -> Tensor
    kernels: {{cpu: {kernel}}}
    shape: {{like: x}}
    reference: {refs}.scale
"""
MANIFEST_LINE = 8  # the scale entry's mapping starts on this line

REFS = """\
def negate(x):
    return -x


def scale(x, alpha):
    return x * alpha
"""


@pytest.fixture
def namespaces() -> Iterator[list[str]]:
    """Namespaces a test declares; dropped from the registry afterwards, so that nothing that lists every
    library (the CLI in this process, AOT builds) meets a test's misspelt kernel."""
    names: list[str] = []
    yield names
    for ns in names:
        registry._LIBRARIES.pop(ns, None)


def _ns(tmp_path: Path, stem: str, namespaces: list[str]) -> str:
    ns = f"{stem}_{tmp_path.name[-8:].replace('-', '_')}"
    namespaces.append(ns)
    return ns


def _declare(tmp_path: Path, ns: str, kernel: str) -> Any:
    """Import a declaration module written to *tmp_path*, as a user's file would be."""
    (tmp_path / "scale.cc").write_text(SCALE_CC)
    path = tmp_path / f"{ns}_decl.py"
    path.write_text(DECL.format(ns=ns, kernel=kernel))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(ns: str, origin: str, module: str = "built") -> str:
    return (f"{ns}: op 'scale' names kernel 'scale_cpuu' for cpu, which the {module} cpu module does not "
            f"export (did you mean 'scale_cpu'?); declared at {origin}")


def test_a_misspelt_kernel_fails_at_build_and_load_not_at_the_call(
    tmp_path: Path, namespaces: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_build(*a: Any, **k: Any) -> Any:
        raise AssertionError("declaring a library must not build its module")

    monkeypatch.setattr(jit, "build", no_build)
    decl = _declare(tmp_path, _ns(tmp_path, "kn_py", namespaces), "scale_cpuu")  # lazy: nothing built yet
    monkeypatch.undo()
    lib = decl.lib
    want = _expected(lib.namespace, f"{tmp_path / f'{lib.namespace}_decl.py'}:{DECL_LINE}")
    with pytest.raises(DeclarationError) as info:
        lib.build()
    msg = str(info.value)
    assert msg.startswith(want + "\n"), msg
    assert "it exports: negate_cpu, scale_cpu" in msg and "gpu_only" not in msg  # no cpu kernel: not checked
    with pytest.raises(DeclarationError, match="did you mean 'scale_cpu'"):
        lib.module("cpu")
    assert (lib.namespace, "cpu") not in loader._MODULES  # a rejected module is not kept
    # The first call (of any op of the library: the module they share is rejected) raises the same error.
    with pytest.raises(DeclarationError, match="names kernel 'scale_cpuu' for cpu"):
        decl.negate(np.ones(3, np.float32))


def test_the_correct_name_still_builds_loads_and_runs(tmp_path: Path, namespaces: list[str]) -> None:
    decl = _declare(tmp_path, _ns(tmp_path, "kn_ok", namespaces), "scale_cpu")
    assert decl.lib.build().is_file()
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(decl.scale(x, 3.0), x * 3)
    np.testing.assert_array_equal(decl.negate(x), -x)
    with pytest.raises(opbridge.BackendUnavailableError, match="no cpu kernel declared"):
        loader.kernel(decl.lib.ops["gpu_only"], "cpu")


def test_an_op_declared_after_the_load_names_the_closest_kernel_at_its_call(
    tmp_path: Path, namespaces: list[str]
) -> None:
    decl = _declare(tmp_path, _ns(tmp_path, "kn_late", namespaces), "scale_cpu")
    decl.lib.module("cpu")

    @decl.lib.op("negate2(Tensor x) -> Tensor", shape=opbridge.like("x"), kernels={"cpu": "negat_cpu"})
    def negate2(x: Any) -> Any:
        return -x

    with pytest.raises(DeclarationError, match=r"op 'negate2' names kernel 'negat_cpu' for cpu, which the loaded "
                                               r"cpu module does not export \(did you mean 'negate_cpu'\?\); "
                                               rf"declared at {__file__}:\d+"):
        negate2(np.ones(2, np.float32))


def _manifest(tmp_path: Path, ns: str, kernel: str) -> opbridge.Library:
    refs = f"{ns}_refs"
    (tmp_path / "scale.cc").write_text(SCALE_CC)
    (tmp_path / f"{refs}.py").write_text(REFS)
    (tmp_path / "ops.yaml").write_text(MANIFEST.format(ns=ns, refs=refs, kernel=kernel))
    sys.path.insert(0, str(tmp_path))
    try:
        return manifest.load(tmp_path / "ops.yaml")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_misspelt_kernel_in_a_manifest_names_its_file_and_line(tmp_path: Path, namespaces: list[str]) -> None:
    lib = _manifest(tmp_path, _ns(tmp_path, "kn_yaml", namespaces), "scale_cpuu")
    want = _expected(lib.namespace, f"{tmp_path / 'ops.yaml'}:{MANIFEST_LINE}")
    with pytest.raises(DeclarationError) as info:
        lib.build()
    assert str(info.value).startswith(want + "\n"), str(info.value)
    with pytest.raises(DeclarationError, match=rf"declared at \S*ops\.yaml:{MANIFEST_LINE}\n"):
        lib.module()


def test_the_correct_name_in_a_manifest_runs(tmp_path: Path, namespaces: list[str]) -> None:
    lib = _manifest(tmp_path, _ns(tmp_path, "kn_yaml_ok", namespaces), "scale_cpu")
    assert lib.ops["scale"].origin == f"{tmp_path / 'ops.yaml'}:{MANIFEST_LINE}"
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(lib.ops["scale"].call(x, 2.0), x * 2)


def test_aot_builds_and_prebuilt_modules_are_checked(
    tmp_path: Path, namespaces: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    decl = _declare(tmp_path, _ns(tmp_path, "kn_aot", namespaces), "scale_cpuu")
    with pytest.raises(DeclarationError, match="which the AOT-built cpu module does not export "
                                               r"\(did you mean 'scale_cpu'\?\)"):
        aot.build_aot(decl.lib, tmp_path / "bad_out")
    # An installed wheel (no sources) whose declarations misspell a kernel of its prebuilt module.
    pkg = f"kn_wheel_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / "good").mkdir()
    good = _declare(tmp_path / "good", _ns(tmp_path, "kn_aot_ok", namespaces), "scale_cpu")
    aot.build_aot(good.lib, tmp_path / "site" / pkg, name="_C_ops")
    (tmp_path / "site" / pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    wheel = opbridge.Library(_ns(tmp_path, "kn_wheel", namespaces), prebuilt=f"{pkg}._C_ops")

    @wheel.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"), kernels={"cpu": "scale_cpuu"})
    def scale(x: Any, alpha: float) -> Any:
        return x * alpha

    with pytest.raises(DeclarationError, match="which the prebuilt cpu module does not export "
                                               r"\(did you mean 'scale_cpu'\?\)"):
        wheel.module()
    wheel.ops["scale"].kernels["cpu"] = "scale_cpu"  # fixed: the same module loads, nothing compiled
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(scale(x, 2.0), x * 2)
    assert loader.loaded_prebuilt(wheel)


def test_opbridge_build_exits_1_with_the_message(tmp_path: Path, namespaces: list[str]) -> None:
    ns = _ns(tmp_path, "kn_cli", namespaces)
    (tmp_path / "scale.cc").write_text(SCALE_CC)
    decl = tmp_path / f"{ns}_decl.py"
    decl.write_text(DECL.format(ns=ns, kernel="scale_cpuu"))
    env = dict(os.environ, OPBRIDGE_NO_PROGRESS="1", OPBRIDGE_TORCH_NATIVE="0")
    code = textwrap.dedent("""
        import sys
        from opbridge.cli import commands
        commands._build_natives = lambda: True  # only the library's build is under test
        from opbridge.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    proc = subprocess.run([sys.executable, "-c", code, "build", "--import", str(decl), "--library", ns],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _expected(ns, f"{decl}:{DECL_LINE}") in proc.stderr
    assert "Traceback" not in proc.stderr
