"""A native crash still reaches Python's faulthandler after tvm-ffi is loaded.

Loading ``libtvm_ffi`` replaces the SIGSEGV handler with tvm-ffi's own (no
Python traceback, no alternate stack): the torch- and JAX-GPU steps of
scripts/gpu-check.sh died by SIGSEGV with PYTHONFAULTHANDLER=1 and no traceback
in their logs. opbridge's import of tvm-ffi keeps the handler that was there;
tests/conftest.py puts it back before each test (a test module may import
tvm-ffi itself, as ``jax_tvm_ffi`` does).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaction through ctypes: Linux")

_CRASH = "import ctypes; ctypes.string_at(0)"


def _run(code: str, faulthandler: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *(["-X", "faulthandler"] if faulthandler else []), "-c", textwrap.dedent(code)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # scripts/test.sh sets it
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_a_segfault_after_loading_tvm_ffi_dumps_the_python_traceback() -> None:
    r = _run(f"""
        from opbridge import _tvm
        _tvm.tvm_ffi()
        def crash_here():
            {_CRASH}
        crash_here()
        """)
    assert r.returncode != 0
    assert "Fatal Python error: Segmentation fault" in r.stderr, r.stderr[-2000:]
    assert "in crash_here" in r.stderr, r.stderr[-2000:]


def test_the_handler_is_put_back_after_a_direct_import() -> None:
    """What conftest.py does for test modules that import tvm-ffi themselves."""
    r = _run(f"""
        from opbridge import _tvm
        saved = _tvm.fault_action()
        import tvm_ffi
        assert _tvm.restore_fault_action(saved), "tvm-ffi no longer replaces the SIGSEGV handler"
        assert not _tvm.restore_fault_action(saved)  # already in place: nothing to do
        {_CRASH}
        """)
    assert "Fatal Python error: Segmentation fault" in r.stderr, r.stderr[-2000:]


def test_without_faulthandler_nothing_is_saved() -> None:
    r = _run("""
        from opbridge import _tvm
        assert _tvm.fault_action() is None
        assert not _tvm.restore_fault_action(None)
        """, faulthandler=False)
    assert r.returncode == 0, r.stderr


def test_gpu_check_isolates_a_native_crash_to_its_test(tmp_path: Path, script_module: Callable[[str], Any]) -> None:
    """gpu-check's GPU test steps under its ISOLATE flags (one pytest-xdist worker, replaced when it dies):
    a segfault fails its own test only, the next test still runs, the faulthandler traceback names the
    crashing line, and the summary lists the test as crashed."""
    pytest.importorskip("xdist")
    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh").read_text()
    m = re.search(r"ISOLATE=\((-n [^)]*)\)", script)
    assert m is not None, "gpu-check.sh no longer sets ISOLATE"
    (tmp_path / "test_standin.py").write_text(textwrap.dedent(f"""
        def test_before():
            pass
        def test_crash_here():
            {_CRASH}
        def test_after():
            pass
        """))
    xml = tmp_path / "torch_gpu_tests.xml"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "--capture=sys", "-p", "no:cacheprovider", "-o",
                        "addopts=", *m[1].split(), "test_standin.py", f"--junitxml={xml}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 1, log[-3000:]
    assert "crashed while running 'test_standin.py::test_crash_here'" in log, log[-3000:]
    assert "PASSED test_standin.py::test_after" in log, log[-3000:]
    assert "Fatal Python error: Segmentation fault" in log and "in test_crash_here" in log, log[-3000:]
    junit = script_module("gpu_check_summary")._junit(xml)
    assert junit["crashed"] == ["test_standin::test_crash_here"] and junit["failed"] == junit["crashed"]
