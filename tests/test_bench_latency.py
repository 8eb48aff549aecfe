"""``opbridge bench latency``: every pair computes the same thing, and a short run reports every op."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")

from opbridge.bench import latency

OPS = {"add", "gelu", "rms_norm", "silu_and_mul", "fused_add_rms_norm"}


def test_workloads_cover_the_serving_ops_and_agree_with_torch() -> None:
    loads = latency._workloads((4, 64))  # raises if a pair disagrees
    assert set(loads) == OPS


def test_short_run_reports_quiet_and_loaded_percentiles() -> None:
    result = latency.run(argparse.Namespace(quick=True, calls=30, shape=(4, 64)))  # an explicit --calls wins
    assert result["calls"] == 30
    for load in ("quiet", "loaded"):
        assert set(result[load]) == OPS
        for by in result[load].values():
            assert set(by) == {"opbridge", "torch"}
            assert all(0 < q["p50"] <= q["p99"] <= q["p99.9"] for q in by.values())
    assert set(result["p99_ratio_loaded"]) == OPS
    assert "fused_add_rms_norm" in latency.format_text(result)
    # the torch shim was built before the timing, not left to an idle background build
    assert list(result["natives"]) == ["torch native kernels"]
    assert result["natives"]["torch native kernels"].endswith(".so")


def test_arguments_are_checked_by_the_parser() -> None:
    parser = argparse.ArgumentParser()
    latency.add_arguments(parser)
    assert parser.parse_args(["--shape", "8x64"]).shape == (8, 64) == parser.parse_args(["--shape", "8,64"]).shape
    for bad in (["--shape", "8y64"], ["--calls", "0"], ["--calls", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
