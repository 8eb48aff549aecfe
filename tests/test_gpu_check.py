"""``scripts/gpu-check.sh`` without a GPU: its step machinery (``scripts/gpu_check_steps.sh``) with stand-in
commands, the summary it folds them into, and the pytest flags of its GPU test steps."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _steps(out: Path, body: str, status: int = 0, **env: str) -> str:
    """Run *body* (bash) after sourcing the step machinery with OUT=*out*; its stdout (and stderr)."""
    out.mkdir(exist_ok=True)
    (out / "gpu.txt").write_text("stand-in GPU\n")
    script = f"GPU_CHECK_START=$SECONDS\nsource scripts/gpu_check_steps.sh\n: > \"$OUT/steps.txt\"\n{body}\n"
    keep = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**keep, "OUT": str(out), **env})
    assert r.returncode == status, r.stdout + r.stderr
    return r.stdout + r.stderr


def _lines(out: Path) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in (out / "steps.txt").read_text().splitlines()}


def test_each_step_is_bounded_by_its_limit_and_what_is_left_of_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "out"
    text = _steps(out, "step first sleep 3\nstep second true\nstep third true",
                  GPU_CHECK_BUDGET="22", GPU_CHECK_RESERVE="0")
    steps = _lines(out)
    assert steps["first"][0] == "0" and re.search(r"== first \(at most 2[12] s\)", text), text
    # 3 s of 22 gone: under 20 s left, so the later steps do not run, and say so
    assert steps["second"] == ["skipped", "0"] and steps["third"] == ["skipped", "0"], steps
    assert "== second: not run, under 20 s of GPU_CHECK_BUDGET=22 left" in text
    assert not (out / "second.log").exists()

    # a step not run leaves no earlier call's log or results behind to be read as its own
    (out / "fourth.log").write_text("an earlier call's log")
    (out / "fourth.xml").write_text("<testsuite/>")
    _steps(out, "step fourth true", GPU_CHECK_BUDGET="5")
    assert not (out / "fourth.log").exists() and not (out / "fourth.xml").exists()

    out = tmp_path / "limit"
    text = _steps(out, "step slow sleep 30\nstep quick echo done", GPU_CHECK_STEP_LIMIT="1")
    steps = _lines(out)
    assert steps["slow"][0] == "124" and int(steps["slow"][1]) < 5, steps  # timeout's status
    assert steps["quick"][0] == "0" and "done" in text

    # a step that ignores SIGTERM is killed 10 s later
    out = tmp_path / "hang"
    _steps(out, "step hang bash -c 'trap \"\" TERM; sleep 60'", GPU_CHECK_STEP_LIMIT="1")
    status, secs = _lines(out)["hang"]
    assert status == "137" and int(secs) < 20, (status, secs)

    for bad in ({"GPU_CHECK_BUDGET": "540s"}, {"GPU_CHECK_STEP_LIMIT": "5m"}, {"GPU_CHECK_RESERVE": "-1"}):
        text = _steps(tmp_path / "bad", "step a true", status=2, **bad)
        assert f"{next(iter(bad))} must be a whole number of seconds, got '{next(iter(bad.values()))}'" in text

    out = tmp_path / "only"
    _steps(out, "step a true\nstep b true\nstep a_no_native true", GPU_CHECK_ONLY="a")
    assert sorted(_lines(out)) == ["a", "a_no_native"]


def test_the_summary_lists_the_steps_not_run_and_fails_on_a_failed_one(
        tmp_path: Path, script_module: Callable[[str], Any], capsys: pytest.CaptureFixture[str]) -> None:
    summary = script_module("gpu_check_summary")
    out = tmp_path / "out"
    _steps(out, "step ran sleep 2\nstep late true", GPU_CHECK_BUDGET="21", GPU_CHECK_RESERVE="0")
    assert summary.main(out) == 0
    said = capsys.readouterr().out
    assert "every step run passed; not run, for want of time (GPU_CHECK_BUDGET): late" in said
    assert "FAILED" not in said
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps["late"] == {"exit_status": None, "skipped": True}

    _steps(out, "step ran false\nstep late true", GPU_CHECK_BUDGET="100")
    assert summary.main(out) == 1
    assert "FAILED: ran" in capsys.readouterr().out

    _steps(out, "step ran true\nstep late true", GPU_CHECK_BUDGET="10")  # nothing ran: not a pass
    assert summary.main(out) == 2
    assert "no step ran" in capsys.readouterr().out


def test_the_gpu_test_steps_keep_pytest_benchmark_out(tmp_path: Path) -> None:
    """The device machine's image has pytest-benchmark, whose start-up warning under xdist our
    filterwarnings = error turned into an INTERNALERROR of every GPU test step (H200, 2026-11-27). A
    stand-in plugin registered under the same name fails the start-up; gpu-check's flags keep it out."""
    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    m = re.search(r'PYTEST=\("\$PY" -m pytest (.*?)\)\n', script, re.DOTALL)
    assert m is not None, "gpu-check.sh no longer sets PYTEST"
    flags = shlex.split(m[1].replace("\\\n", " "))
    site = tmp_path / "site"
    dist = site / "standin_benchmark-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: standin-benchmark\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nbenchmark = standin_benchmark\n")
    (site / "standin_benchmark.py").write_text(textwrap.dedent("""
        def pytest_configure(config):
            raise RuntimeError("the benchmark plugin broke start-up")
        """))
    (tmp_path / "test_standin.py").write_text("def test_ok():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", *args, "test_standin.py"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)

    without = [f for i, f in enumerate(flags) if f != "no:benchmark" and flags[i + 1:i + 2] != ["no:benchmark"]]
    broken = run(without)
    assert broken.returncode != 0 and "the benchmark plugin broke start-up" in broken.stdout + broken.stderr
    ok = run(flags)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
