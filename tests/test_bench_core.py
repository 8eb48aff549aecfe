"""The shared core of ``opbridge bench``: GB/s arithmetic, report files without matplotlib, no C++ in Python.

CPU only, no timing asserted.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from opbridge import bench
from opbridge.bench import report, subproc, timing

BENCH_DIR = Path(bench.__file__).parent


def test_gbps_is_bytes_over_microseconds() -> None:
    assert timing.gbps(1e9, 1e6) == pytest.approx(1.0)  # 1 GB in 1 s
    assert timing.gbps(3 * 4096 * 4, 10.0) == pytest.approx(4.9152)  # 48 KiB in 10 µs
    # summary() reports µs: a GB/s computed from it must not be 10^6 too small
    stats = timing.summary({"x": [2e-3] * 3})  # 2 ms per call
    assert timing.gbps(2e9, stats["x"]["p50"]) == pytest.approx(1000.0)


def test_calls_per_sample_is_bounded() -> None:
    assert timing.calls_per_sample(0.02, 1e-3) == 20
    assert timing.calls_per_sample(0.02, 1.0) == 1
    assert timing.calls_per_sample(0.02, 1e-12, cap=500) == 500


def test_no_cpp_in_python_strings() -> None:
    for path in BENCH_DIR.rglob("*.py"):
        assert "#include" not in path.read_text(), f"{path}: C++ belongs in a .cc file read at run time"
    for name in ("torch_add", "paddle_add", "mindspore_add"):
        assert "add" in subproc.peer_source(name)
    assert (BENCH_DIR / "stream_kernels.cc").is_file()


def test_no_bench_module_over_500_lines() -> None:
    for path in BENCH_DIR.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path


def test_exit_status() -> None:
    assert bench.exit_status({"ok": False}) == 1
    assert bench.exit_status({"ok": True}) == bench.exit_status({}) == 0


def _write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    drawn: list[Path] = []

    def plots(result: dict[str, Any], folder: Path) -> list[Path]:
        drawn.append(folder)
        return [folder / "x.png"]

    result = {"benchmark": "t", "rows": [1, 2]}
    files = report.write_results(result, tmp_path / "out", ("a", "b"), [{"a": 1, "b": 2}], plots, bench="t")
    report.write_json({**result, "files": files}, files["json"])
    files["drawn"] = drawn
    return files


def test_results_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert not report.have_matplotlib()
    files = _write(tmp_path, monkeypatch)
    assert files["drawn"] == [] and files["plots"] == []
    assert 'pip install "opbridge[bench]"' in files["plots_skipped"]
    assert capsys.readouterr().err.count("plots skipped") == 1
    assert json.loads(Path(files["json"]).read_text())["rows"] == [1, 2]
    with open(files["csv"], newline="") as f:
        assert list(csv.DictReader(f)) == [{"a": "1", "b": "2"}]
    assert "plots skipped" in report.files_line(files)


def test_results_with_a_plotter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "have_matplotlib", lambda: True)
    files = _write(tmp_path, monkeypatch)
    assert files["drawn"] == [tmp_path / "out" / "plots"] and files["plots"] == [str(tmp_path / "out/plots/x.png")]
    assert "plots_skipped" not in files


def test_kernels_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench kernels`` writes its JSON and CSV, skips the plots with the hint, and succeeds."""
    pytest.importorskip("torch")
    from opbridge.bench import kernels
    from opbridge.cli import build_parser

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["bench", "kernels", "--quick", "--ops", "add", "--sizes", "3x130", "--dtypes", "float32",
            "--rounds", "1", "--target-ms", "0.1", "--stream-n", "65536", "--no-memory", "--out", str(tmp_path)]
    result = kernels.run(build_parser().parse_args(argv))
    files = result["files"]
    assert files["plots"] == [] and 'pip install "opbridge[bench]"' in files["plots_skipped"]
    assert Path(files["json"]).is_file() and Path(files["csv"]).is_file()
    assert "plots skipped" in kernels.format_text(result)
    assert bench.exit_status(result) == 0


def test_gpu_run_without_a_gpu_is_a_skip() -> None:
    from opbridge.bench import gpu

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    gpu.add_arguments(parser)
    if gpu.unavailable() is None:
        pytest.skip("a CUDA GPU is present")
    result = gpu.run(parser.parse_args(["--quick"]))
    assert result["skipped"].startswith("no CUDA GPU") and bench.exit_status(result) == 0
    assert gpu.format_text(result).startswith("opbridge bench gpu: skipped")
