"""scripts/sanitize.sh's command line (its runs themselves are scripts/test.sh's: ``--quick`` in CI)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sanitize.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_help_usage_errors_and_a_missing_runtime_say_so() -> None:
    got = _run("--help")
    assert got.returncode == 0 and "--quick" in got.stdout and "77 no sanitizer runtime" in got.stdout
    got = _run("--bogus")
    assert got.returncode == 2 and "unknown argument '--bogus'" in got.stderr
    got = _run("--quick", OPBRIDGE_CXX="/bin/false")  # a compiler without ASan: skipped, not failed
    assert got.returncode == 77, got.stderr
    assert "has no AddressSanitizer runtime (libasan.so)" in got.stderr
