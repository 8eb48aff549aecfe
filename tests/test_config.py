"""Settings (environment variables) read one way each: a misspelt value is an error naming the setting.

Before, the yes/no settings were parsed by five copies of two rules: ``OPBRIDGE_TORCH_NATIVE=maybe`` meant on,
``OPBRIDGE_VERBOSE=2`` meant off, ``OPBRIDGE_MAX_JOBS=abc`` meant the CPU count and ``OPBRIDGE_CUDA_ARCHS=sm90``
reached nvcc, while ``OPBRIDGE_THREADING`` and the output-cache settings already refused what they could not read.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from opbridge import config

FLAGS: dict[str, tuple[Callable[[], bool], bool]] = {  # setting: (accessor, its value when unset)
    "OPBRIDGE_VERBOSE": (config.verbose, False),
    "OPBRIDGE_NO_PROGRESS": (lambda: not config.show_progress(), False),
    "OPBRIDGE_HUGEPAGES": (config.hugepages, True),
    "OPBRIDGE_NUMPY_NATIVE": (config.numpy_native, True),
    "OPBRIDGE_EXCHANGE_ENTRY": (config.exchange_entry, True),
    "OPBRIDGE_TORCH_NATIVE": (config.torch_native, True),
}


@pytest.mark.parametrize("name", FLAGS)
def test_yes_no_settings_read_alike_and_refuse_anything_else(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    read, unset = FLAGS[name]
    monkeypatch.delenv(name, raising=False)
    assert read() is unset
    for value, expected in (("", unset), ("1", True), ("ON", True), (" yes ", True), ("True", True),
                            ("0", False), ("off", False), ("No", False), ("FALSE", False)):
        monkeypatch.setenv(name, value)
        assert read() is expected, (name, value)
    for bad in ("maybe", "2", "enable", "-1"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be one of 1, true, yes, on, 0, false, no, off"):
            read()


def test_max_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPBRIDGE_MAX_JOBS", raising=False)
    assert config.max_jobs() >= 1
    monkeypatch.setenv("OPBRIDGE_MAX_JOBS", "3")
    assert config.max_jobs() == 3
    for bad in ("abc", "0", "-2", "1.5"):
        monkeypatch.setenv("OPBRIDGE_MAX_JOBS", bad)
        with pytest.raises(ValueError, match="OPBRIDGE_MAX_JOBS must be"):
            config.max_jobs()


def test_cuda_archs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPBRIDGE_CUDA_ARCHS", raising=False)
    assert config.cuda_archs() == ["80", "90"]
    monkeypatch.setenv("OPBRIDGE_CUDA_ARCHS", " ")
    assert config.cuda_archs() == ["80", "90"]
    monkeypatch.setenv("OPBRIDGE_CUDA_ARCHS", "90a, 100;120f")
    assert config.cuda_archs() == ["90a", "100", "120f"]
    for bad in ("sm90", "compute_90", ";", "9.0"):
        monkeypatch.setenv("OPBRIDGE_CUDA_ARCHS", bad)
        with pytest.raises(ValueError, match="OPBRIDGE_CUDA_ARCHS must list compute capabilities"):
            config.cuda_archs()


def test_cpp_reads_yes_no_settings_as_python_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPBRIDGE_CUDA_SYNC_CHECKS is read by the CUDA kernels themselves (include/opbridge/settings.h): "false",
    "no" and "off" meant on there, as any value but "0" did."""
    from opbridge.build import compile as compile_mod

    source = tmp_path / "yes_no.cc"
    source.write_text('#include <opbridge/settings.h>\n#include <cstdio>\n'
                      'int main(int argc, char** argv) {\n'
                      '  for (int i = 1; i < argc; ++i) std::printf("%d\\n", opbridge::yes_no(argv[i], 7));\n}\n')
    exe = tmp_path / "yes_no"
    subprocess.run([config.cxx(), "-std=c++17", f"-I{compile_mod.INCLUDE_DIR}", str(source), "-o", str(exe)],
                   check=True, capture_output=True)
    values = ["", " ", "1", "ON", " yes ", "True", "0", "off", "No", "FALSE", "maybe", "2", "-1", "o",
              "\t1\n", "1\x1f", "\x1c0"]  # C's isspace only: str.strip() would also trim \x1c-\x1f
    got = subprocess.run([str(exe), *values], check=True, capture_output=True, text=True).stdout.split()
    for value, cpp in zip(values, got, strict=True):
        monkeypatch.setenv("OPBRIDGE_X", value)
        try:
            python = "7" if not value.strip(config._BLANK) else str(int(config._flag("OPBRIDGE_X")))
        except ValueError:
            python = "-1"
        assert cpp == python, (value, cpp, python)
