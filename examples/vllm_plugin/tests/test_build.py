"""The build is what the declarations say, and nothing is compiled to import the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from opbridge import aot, codegen, loader

import vllm_plugin
from vllm_plugin.ops import LIBRARY


def test_one_module_exports_exactly_the_declared_kernels() -> None:
    path = loader.loaded_path(LIBRARY)
    assert sorted(loader.exports(path)) == aot.declared_kernels(LIBRARY)
    assert len(aot.declared_kernels(LIBRARY)) == len(LIBRARY.ops) == 5


def test_generated_wrappers_are_current() -> None:
    codegen.generate(LIBRARY, Path(vllm_plugin.__file__).parent, check=True)


def test_installed_module_is_loaded_without_compiling(tmp_path: Path) -> None:
    prebuilt = Path(vllm_plugin.__file__).parent / aot.module_filename()
    if not prebuilt.is_file():
        import pytest

        pytest.skip("no prebuilt _C_ops module (install the plugin with pip first)")
    code = (
        "import json, sys, torch; from opbridge import loader; from vllm_plugin import _custom_ops as ops; "
        "import vllm_plugin.ops as decl; before = dict(loader._MODULES); "
        "ops.scale_(torch.ones(3), 2.0); "
        "print(json.dumps({'before': len(before), 'path': str(loader.loaded_path(decl.LIBRARY))}))"
    )
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["before"] == 0, "importing the plugin loaded a module"
    assert Path(doc["path"]) == prebuilt.resolve() or Path(doc["path"]) == prebuilt
    assert not (tmp_path / "cache").exists(), "the first call compiled instead of loading the wheel's module"
