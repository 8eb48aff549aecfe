"""The launch-policy sweeps' summary (scripts/sweep_summary.py) and its place in gpu-check's summary:
read from lines in the sweeps' own formats (the sweeps themselves need a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check_summary  # noqa: E402
import sweep_summary  # noqa: E402

# As scripts/cuda_norm_sweep.cu and scripts/cuda_gated_sweep.cu print them.
NORM = """\
NVIDIA H200: device-to-device copy 4100 GB/s (read + write); times are per launch inside a CUDA graph
rms_norm           bfloat16  8192 x 8192  units 4 threads  256 bound  256 3bar cached    40.100 us  0.760 copy  max|diff| 0  <- current policy
rms_norm           bfloat16  8192 x 8192  units 4 threads  256 bound  256 3bar stream    32.000 us  0.952 copy  max|diff| 0
rms_norm           bfloat16  8192 x 8192  units 8 threads  128 bound  256 fast cached    41.000 us  0.743 copy  max|diff| 0.0078
rms_norm           bfloat16  8192 x 8192  units 1 threads 1024 bound 1024 fast cached    20.000 us  1.520 copy  max|diff| 0.75
rms_norm           float32      1 x 4096  units 1 threads 1024 bound 1024 fast cached     2.100 us  0.010 copy  max|diff| 2.4e-07
rms_norm           float32      1 x 4096  units 4 threads  256 bound  256 3bar cached     2.000 us  0.011 copy  max|diff| 0  <- current policy
rms_norm bfloat16 1 x 4096: rows do not fit the cached kernel (the two-pass form runs)
"""  # noqa: E501
GATED = """\
silu_and_mul          float32      1 x 14336 128-bit threads 128 units 1 cached blocks     28 x 1         3.350 us  0.031 copy  max|diff| 0  <- current policy
silu_and_mul          float32      1 x 14336  64-bit threads  64 units 1 cached blocks    112 x 1         2.900 us  0.036 copy  max|diff| 0
footprint: silu_and_mul float32 1 x 14336 current policy: outputs alternating over 2 buffers 1.100 us (0.093 copy); inputs rotating over 4 copies 4.000 us (0.026 copy)
"""  # noqa: E501


def test_cases_name_the_current_and_the_fastest_policy() -> None:
    found = sweep_summary.cases(NORM + GATED)
    assert [(c.op, c.dtype, c.shape) for c in found] == [
        ("rms_norm", "bfloat16", (8192, 8192)), ("rms_norm", "float32", (1, 4096)),
        ("silu_and_mul", "float32", (1, 14336))]
    big, small, gated = found
    assert big.current is not None and big.current.us == 40.1 and big.current.policy.endswith("3bar cached")
    assert big.best.policy == "units 4 threads 256 bound 256 3bar stream" and big.best.copy == 0.952
    assert big.speedup == pytest.approx(40.1 / 32.0, abs=1e-3)
    # a result unlike the current one's is never the fastest; an ulp apart (another order of summation) is no mismatch
    assert big.mismatches == ["units 1 threads 1024 bound 1024 fast cached"]
    assert small.speedup == 1.0 and not small.mismatches  # the current policy is the fastest
    assert gated.best.policy == "64-bit threads 64 units 1 cached blocks 112 x 1"  # the footprint line is no policy
    assert len(gated.runs) == 2
    text = sweep_summary.table(found)
    assert "MISMATCH in 1" in text and "x1.25" in text and "rows do not fit" not in text


def test_gpu_check_summary_folds_the_sweeps(tmp_path: Path) -> None:
    (tmp_path / "steps.txt").write_text("sweep_norm 0 30\nsweep_gated 0 40\n")
    (tmp_path / "gpu.txt").write_text("NVIDIA H200, 570.00, 143771 MiB")
    (tmp_path / "sweep_norm.log").write_text(NORM)
    (tmp_path / "sweep_gated.log").write_text(GATED)
    assert gpu_check_summary.main(tmp_path) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [c["shape"] for c in summary["sweep_norm"]] == [[8192, 8192], [1, 4096]]
    assert summary["sweep_norm"][0]["mismatches"] and summary["sweep_gated"][0]["speedup"] == pytest.approx(1.155)
    assert summary["cuda_tests"] == {"missing": True}  # the steps not run are said to be missing
    assert summary["sweep_norm_staged"] is None
    (tmp_path / "sweep_norm_staged.log").write_text(STAGED)  # the staged kernels' own step
    assert gpu_check_summary.main(tmp_path) == 0
    staged = json.loads((tmp_path / "summary.json").read_text())["sweep_norm_staged"]
    assert [c["op"] for c in staged] == ["rms_norm", "rms_norm_backward"] and "staged 3" in staged[0]["best"]["policy"]


# The norm sweep's lines since kMinBlocks and the backward: occupancy words inside the policy.
OCCUPANCY = """\
rms_norm           bfloat16  8192 x 8192  units 1 threads 1024 bound 1024 fast cached regs  32 local   0 per_sm  2    88.000 us  1.000 copy  max|diff| 0  <- current policy
rms_norm           bfloat16  8192 x 8192  units 2 threads  512 bound  512 fast cached minblocks 3 regs  40 local   0 per_sm  3    70.000 us  1.300 copy  max|diff| 0.0078
rms_norm_backward  bfloat16  8192 x 8192  units 2 threads  512 bound  512 minblocks 2 regs  64 local   0 per_sm  2 grid   264   120.000 us  0.900 copy  max|diff| 0  <- current policy
rms_norm_backward  bfloat16  8192 x 8192  units 2 threads  512 bound  512 regs  96 local   0 per_sm  1 grid   132   150.000 us  0.700 copy  max|diff| 0.0039
rms_norm_backward  bfloat16  8192 x 8192  units 2 threads  512 bound  512 minblocks 4 regs  32 local 312 per_sm  4 grid   528    99.000 us  0.500 copy  max|diff| 0.5
"""  # noqa: E501


def test_occupancy_policies_and_the_backward_read_as_cases() -> None:
    fwd, bwd = sweep_summary.cases(OCCUPANCY)
    assert fwd.best.policy == "units 2 threads 512 bound 512 fast cached minblocks 3 regs 40 local 0 per_sm 3"
    assert fwd.speedup == pytest.approx(88 / 70, abs=1e-3)
    assert bwd.op == "rms_norm_backward" and bwd.speedup == 1.0  # the old 96-register form is slower
    # a policy whose result differs beyond rounding is a mismatch, never the fastest
    assert bwd.mismatches == ["units 2 threads 512 bound 512 minblocks 4 regs 32 local 312 per_sm 4 grid 528"]


# The staged kernels' lines (cuda_norm_staged.h): "staged S" and the dynamic shared memory in the policy.
STAGED = """\
rms_norm           bfloat16  8192 x 8192  units 1 threads 1024 bound 1024 fast cached regs  32 local   0 per_sm  2    88.000 us  1.000 copy  max|diff| 0  <- current policy
rms_norm           bfloat16  8192 x 8192  units 4 threads  256 bound  256 fast cached staged 3 regs  28 local   0 per_sm  4 smem 49152    68.000 us  1.290 copy  max|diff| 0
rms_norm           bfloat16  8192 x 8192  units 1 threads 1024 bound 1024 fast cached staged 2 regs  29 local   0 per_sm  2 smem 32768    99.000 us  0.890 copy  max|diff| 0.25
rms_norm_backward  bfloat16  8192 x 8192  units 2 threads  512 bound  512 minblocks 2 regs  64 local   0 per_sm  2 grid   264   120.000 us  0.900 copy  max|diff| 0  <- current policy
rms_norm_backward  bfloat16  8192 x 8192  units 2 threads  512 bound  512 staged 2 regs  59 local   0 per_sm  2 smem 65536 grid   264    90.000 us  1.200 copy  max|diff| 0.0039
"""  # noqa: E501


def test_staged_kernels_read_as_policies_of_their_case() -> None:
    fwd, bwd = sweep_summary.cases(STAGED)
    assert fwd.best.policy == "units 4 threads 256 bound 256 fast cached staged 3 regs 28 local 0 per_sm 4 smem 49152"
    assert fwd.speedup == pytest.approx(88 / 68, abs=1e-3)
    mismatch = "units 1 threads 1024 bound 1024 fast cached staged 2 regs 29 local 0 per_sm 2 smem 32768"
    assert fwd.mismatches == [mismatch]
    assert bwd.best.policy == "units 2 threads 512 bound 512 staged 2 regs 59 local 0 per_sm 2 smem 65536 grid 264"
    assert bwd.speedup == pytest.approx(120 / 90, abs=1e-3)
