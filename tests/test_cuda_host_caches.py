"""The CUDA launchers' host state per device, in host programs that nvcc compiles and that run without a GPU
(``tests/cuda_host/*.cu``):

- ``include/opbridge/cuda.h``'s ``ResidentCache`` keeps each (device, threads, shared memory) answer of the
  occupancy API apart, so a machine with two GPU models gets each device's own;
- ``include/opbridge/cuda_error_flag.h``'s ``ErrorFlag`` keeps one error record per device, so two devices'
  kernels that report in one epoch leave two whole records (a shared record could mix one error's fields
  with the other's code), each taken once, and a device's record alone where a call asks for it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from _nvcc import NVCC, nvcc_command  # tests/_nvcc.py

SOURCES = Path(__file__).resolve().parent / "cuda_host"


def _run_host_program(name: str, tmp_path: Path) -> None:
    """Compile ``cuda_host/<name>.cu`` for the host and run it: it prints ``ok`` and exits 0, else what failed."""
    exe = tmp_path / name
    done = subprocess.run([*nvcc_command(SOURCES / f"{name}.cu"), "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_resident_cache_keeps_devices_apart(tmp_path: Path) -> None:
    _run_host_program("resident_cache", tmp_path)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_error_flag_keeps_one_record_per_device(tmp_path: Path) -> None:
    _run_host_program("error_flag", tmp_path)
