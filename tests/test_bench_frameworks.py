"""Tests of ``opbridge bench frameworks`` and its worker protocol.

Structure only: no assertion looks at a timing. The runs are tiny (``--quick``
with a few rounds, no cold build: the workers load the library from the
ambient ``OPBRIDGE_CACHE_DIR``), and cover NumPy and torch; frameworks that
are not installed are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opbridge.bench import frameworks, fw_worker, load
from opbridge.cli import build_parser
from opbridge.ops import LIBRARY

SRC = Path(frameworks.__file__).resolve().parents[2]
HAVE_TORCH = importlib.util.find_spec("torch") is not None
STATS = {"p20", "p50", "p80", "rounds"}


def _worker(*argv: str, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OPBRIDGE_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "opbridge.bench.fw_worker", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"the worker must print exactly one JSON line; got {proc.stdout!r}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[0])


def _check_section(row: dict[str, Any]) -> None:
    assert {"op", "mode", "shape", "dtype", "candidates", "verified", "number", "stats_us", "ratio",
            "ratios"} <= set(row)
    assert set(row["candidates"]) == {"opbridge", "native"}
    assert set(row["stats_us"]) == {"opbridge", "native"}
    for stats in row["stats_us"].values():
        assert set(stats) == STATS
        assert 0 < stats["p20"] <= stats["p50"] <= stats["p80"]
    assert set(row["ratios"]) == {"p20", "p50", "p80"}
    assert row["ratio"] == row["ratios"]["p50"] > 0
    assert row["number"] >= 1


@pytest.fixture(scope="module")
def library_path() -> str:
    return str(LIBRARY.build("cpu"))


def test_registered_and_parses() -> None:
    mod = load("frameworks")
    assert mod is frameworks
    args = build_parser().parse_args(["bench", "frameworks", "--quick", "--json", "--frameworks", "numpy",
                                      "torch", "--builds", "--ms-python", "/nonexistent/python"])
    assert args.frameworks == ["numpy", "torch"] and args.quick and args.json and args.builds
    assert args.ms_python == "/nonexistent/python" and not args.no_cold_build


def test_worker_protocol_numpy(library_path: str) -> None:
    code, doc = _worker("numpy", "--rounds", "2", "--number", "5", "--module", library_path)
    assert code == 0
    assert doc["protocol"] == fw_worker.PROTOCOL and doc["framework"] == "numpy"
    assert {"python", "executable", "versions", "module", "rounds", "max_number", "sections",
            "skipped_sections", "errors"} <= set(doc)
    assert doc["errors"] == {}
    # the timings go through NumPy's C entry, built before them (not on the Python path while it builds)
    assert list(doc["natives"]) == ["NumPy C entry"] and doc["natives"]["NumPy C entry"].endswith(".so")
    # The same file, found in the shared cache (or, should the sources have changed since the
    # fixture built it, loaded explicitly: "pinned").
    assert doc["module"]["loaded_path"] == library_path
    assert doc["module"]["requested_path"] == library_path
    assert list(doc["sections"]) == ["add/eager/8"]
    row = doc["sections"]["add/eager/8"]
    _check_section(row)
    assert row["verified"] == "exact"


SERVING = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul")


@pytest.mark.parametrize(("framework", "in_place"), [("numpy", "np.add(input, residual, out=residual)"),
                                                      ("torch", "residual.add_(x)")])
def test_worker_times_the_serving_ops(library_path: str, framework: str, in_place: str) -> None:
    """Each serving op gets a verified, timed section at 8x64; mutating ops compare every written argument."""
    pytest.importorskip(framework)
    code, doc = _worker(framework, "--rounds", "2", "--number", "5", "--module", library_path, "--ops", *SERVING)
    assert code == 0 and doc["errors"] == {} and doc["ops"] == list(SERVING)
    vmap = ["rms_norm/vmap/32x8x1024"] if framework == "torch" else []  # torch.func.vmap of rms_norm, one call
    assert list(doc["sections"]) == [f"{op}/eager/8x64" for op in SERVING] + vmap
    for key, row in doc["sections"].items():
        _check_section(row)
        assert row["shape"] == ([32, 8, 1024] if "vmap" in key else [8, 64])
        assert row["verified"].endswith("allclose(rtol=1e-05, atol=1e-05)")
    fused = doc["sections"]["fused_add_rms_norm/eager/8x64"]
    assert fused["verified"].startswith("input, residual as written, each candidate on fresh copies of the inputs")
    assert doc["sections"]["rotary_embedding/eager/8x64"]["verified"].startswith("query, key as written")
    assert in_place in fused["candidates"]["native"]
    assert fused["candidates"]["opbridge"] == "opbridge.ops.fused_add_rms_norm(input, residual, weight, eps)"


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_worker_times_out_calls(library_path: str, framework: str) -> None:
    """``add_out`` and ``silu_and_mul_out``: the calls with out= a preallocated array, verified against the
    framework's own op with out= (add exactly)."""
    pytest.importorskip(framework)
    code, doc = _worker(framework, "--rounds", "2", "--number", "5", "--module", library_path,
                        "--ops", "add_out", "silu_and_mul_out")
    assert code == 0 and doc["errors"] == {}
    assert list(doc["sections"]) == ["add_out/eager/8", "silu_and_mul_out/eager/8x64"]
    for row in doc["sections"].values():
        _check_section(row)
    add = doc["sections"]["add_out/eager/8"]
    assert add["candidates"]["opbridge"] == "opbridge.ops.add(x, y, out=o)" and "out=o" in add["candidates"]["native"]
    assert add["verified"] == "exact"


def test_a_native_that_misses_a_written_argument_fails_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both mutated arguments are compared: a formula that leaves residual alone is an error, not timed."""
    import numpy as np

    from opbridge import ops
    from opbridge.bench import fw_sections, natives

    right = natives._TABLES["numpy"]

    def wrong() -> dict[str, Any]:
        table = right()

        def input_only(a: Any) -> Any:
            x, residual, w, eps = a
            return lambda: np.copyto(x, ops.rms_norm(x + residual, w, eps))

        return {**table, "fused_add_rms_norm": input_only}

    monkeypatch.setitem(natives._TABLES, "numpy", wrong)
    sections, _, _ = fw_sections.SECTIONS["numpy"](["fused_add_rms_norm", "rms_norm"])
    results, errors = fw_worker.run_sections("numpy", sections, rounds=1, number=2, target_s=1e-4)
    assert list(results) == ["rms_norm/eager/8x64"]
    assert list(errors) == ["fused_add_rms_norm/eager/8x64"]
    assert "verification failed" in errors["fused_add_rms_norm/eager/8x64"]
    assert "residual: results differ" in errors["fused_add_rms_norm/eager/8x64"]


def test_in_place_timing_stays_bounded() -> None:
    """Timing calls fused_add_rms_norm on the same buffers over and over: the residual must not grow."""
    import numpy as np

    from opbridge.bench import fw_sections

    (section,), _, _ = fw_sections.SECTIONS["numpy"](["fused_add_rms_norm"])
    x, residual = section.fns["opbridge"].args[:2]  # functools.partial over the timed buffers
    for _ in range(20000):
        section.fns["opbridge"]()
        section.fns["native"]()
    assert np.isfinite(residual).all() and np.isfinite(x).all()
    assert float(np.sqrt(np.mean(residual * residual, axis=-1)).max()) < 3


def test_asynchronous_sections_size_each_candidates_samples() -> None:
    """A slow native formula (MindSpore's take milliseconds) no longer cuts opbridge's samples to one call."""
    import time

    from opbridge.bench.fw_sections import Section

    def slow() -> None:
        time.sleep(0.001)

    args: dict[str, Any] = {"descriptions": {}, "to_numpy": lambda a: a}
    queued = Section("add", "pynative", (8,), lambda: None, slow, sync=lambda: None, **args)
    calls = fw_worker._calibrate(queued, number=50, target_s=0.001)  # asynchronous: samples of ~10 ms
    assert calls["opbridge"] == 50 and 1 <= calls["native"] <= 10
    row = fw_worker._time(queued, rounds=2, number=50, target_s=0.001)
    assert row["calls"]["opbridge"] == 50 and row["number"] == row["calls"]["native"]
    assert row["stats_us"]["native"]["p50"] >= 1000 > row["stats_us"]["opbridge"]["p50"]
    eager = Section("add", "eager", (8,), lambda: None, slow, **args)
    assert len(set(fw_worker._calibrate(eager, number=50, target_s=0.001).values())) == 1  # one shared count


def test_ops_option() -> None:
    """--ops: all per-call ops by default, add with --quick; unknown names and --parity are refused, as is
    --row-seconds without --parity."""
    from opbridge.bench import fw_sections
    from opbridge.errors import UsageError

    assert frameworks._settings(_args())["ops"] == ["add"]
    assert frameworks._settings(_args(quick=False))["ops"] == list(fw_sections.PER_CALL_OPS)
    assert frameworks._settings(_args(ops=["rms_norm", "add", "rms_norm"]))["ops"] == ["rms_norm", "add"]
    with pytest.raises(UsageError, match=r"--ops: no per-call section for 'nope', 'gelu_backward'; choose from add, "):
        frameworks._settings(_args(ops=["rms_norm", "nope", "gelu_backward"]))
    with pytest.raises(UsageError, match="--parity does not run"):
        frameworks._settings(_args(ops=["add"], parity=True))
    with pytest.raises(UsageError, match="--row-seconds times the rows of the parity table"):
        frameworks._settings(_args(row_seconds=2.0))
    assert frameworks._settings(_args(row_seconds=2.0, parity=True))["parity_row_s"] == 2.0
    args = build_parser().parse_args(["bench", "frameworks", "--ops", "rms_norm", "rotary_embedding"])
    assert args.ops == ["rms_norm", "rotary_embedding"]


def test_ops_option_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from opbridge.cli import main

    assert main(["bench", "frameworks", "--ops", "rms_norm", "nope", "--frameworks", "numpy"]) == 2  # usage
    err = capsys.readouterr().err
    assert "--ops: no per-call section for 'nope'" in err and "rotary_embedding" in err
    assert err.startswith("usage: opbridge bench frameworks")


def test_worker_loads_the_module_it_is_given(library_path: str, tmp_path: Path) -> None:
    """A module at a path the worker's own build key does not name is loaded explicitly ("pinned")."""
    copy = tmp_path / "elsewhere" / Path(library_path).name
    copy.parent.mkdir()
    shutil.copy2(library_path, copy)
    code, doc = _worker("numpy", "--rounds", "1", "--number", "2", "--module", str(copy))
    assert code == 0, doc
    assert doc["module"]["pinned"] is True
    assert doc["module"]["loaded_path"] == str(copy)
    assert doc["module"]["requested_path"] == str(copy) != doc["module"]["own_key_path"]


def test_worker_reports_a_missing_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "paddle", None)  # find_spec() then reports it as absent
    doc = fw_worker.measure("paddle", rounds=1, number=1)
    assert doc["framework"] == "paddle" and "not installed" in doc["unavailable"]
    assert "sections" not in doc


def test_worker_rejects_bad_arguments() -> None:
    proc = subprocess.run([sys.executable, "-m", "opbridge.bench.fw_worker", "numpy", "--rounds", "0"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode == 2 and "positive" in proc.stderr


def test_ms_python_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frameworks, "_MS_FALLBACK", tmp_path / "no-msenv" / "python")
    fake = tmp_path / "py"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    # explicit --ms-python wins, even over the environment variable
    got = frameworks.ms_python(str(fake), {"OPBRIDGE_MS_PYTHON": "/x"}, tmp_path)
    assert got == (str(fake), "--ms-python")
    path, why = frameworks.ms_python(str(tmp_path / "missing"), {}, tmp_path)
    assert path is None and "--ms-python" in why and "missing" in why
    assert frameworks.ms_python(None, {"OPBRIDGE_MS_PYTHON": str(fake)}, tmp_path)[0] == str(fake)
    path, why = frameworks.ms_python(None, {}, tmp_path)
    assert path is None and "--ms-python" in why
    venv = tmp_path / ".venv-ms" / "bin"
    venv.mkdir(parents=True)
    shutil.copy2(fake, venv / "python")
    assert frameworks.ms_python(None, {}, tmp_path)[0] == str(venv / "python")


def test_ms_python_offers_no_checkout_venv_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from an installed package, `bench frameworks` offered <repo>/.venv-ms (a path under site-packages' parent
    that is never there) in its --help and its reason; now it says how to pass --ms-python instead."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "opbridge").mkdir(parents=True)
    checkout = tmp_path / "repo"
    (checkout / "src").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    monkeypatch.setattr(frameworks, "_MS_FALLBACK", tmp_path / "no-msenv" / "python")
    monkeypatch.setattr(frameworks, "_CHECKOUT", None, raising=False)
    monkeypatch.setattr(frameworks, "_REPO_ROOT", site.parent, raising=False)  # what it was before
    path, why = frameworks.ms_python(None, {})
    assert path is None and ".venv-ms" not in why, why
    assert "pass --ms-python PATH" in why and "OPBRIDGE_MS_PYTHON" in why
    parser = argparse.ArgumentParser()
    frameworks.add_arguments(parser)
    assert ".venv-ms" not in "".join(parser.format_help().split())  # argparse wraps at hyphens
    # From a checkout, its .venv-ms is offered where it exists.
    venv = checkout / ".venv-ms" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\n")
    (venv / "python").chmod(0o755)
    monkeypatch.setattr(frameworks, "_CHECKOUT", checkout)
    assert frameworks.ms_python(None, {}) == (str(venv / "python"), f"<repo>/.venv-ms ({venv / 'python'})")
    parser = argparse.ArgumentParser()
    frameworks.add_arguments(parser)
    assert ".venv-ms" in "".join(parser.format_help().split())
    assert frameworks._checkout(site) is None and frameworks._checkout(checkout / "src") == checkout


def _args(**over: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true")
    frameworks.add_arguments(parser)
    args = parser.parse_args(["--quick", "--no-cold-build", "--rounds", "2", "--number", "10",
                              "--target-ms", "1"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def quick_result() -> dict[str, Any]:
    names = ["numpy", "torch"] if HAVE_TORCH else ["numpy"]
    return frameworks.run(_args(frameworks=names, builds=True))


def test_quick_run_structure(quick_result: dict[str, Any], library_path: str) -> None:
    r = quick_result
    json.dumps(r)  # serialisable
    assert r["benchmark"] == "frameworks" and r["quick"] is True
    assert {"machine", "settings", "cold_build", "frameworks", "module", "ratios", "builds",
            "problems"} <= set(r)
    assert r["problems"] == []
    assert r["cold_build"] == {"skipped": "--no-cold-build", "path": library_path}
    assert r["builds"] == {"skipped": "--quick"}
    names = ["numpy", "torch"] if HAVE_TORCH else ["numpy"]
    assert list(r["frameworks"]) == names
    for fw in names:
        doc = r["frameworks"][fw]
        assert doc["framework"] == fw and doc["errors"] == {}
        _check_section(doc["sections"]["add/eager/8"])
        assert r["ratios"][fw] == {"add/eager/8": doc["sections"]["add/eager/8"]["ratio"]}
    assert r["module"]["all_equal"] is True
    assert r["module"]["loaded_paths"] == {fw: library_path for fw in names}


def test_text_report(quick_result: dict[str, Any]) -> None:
    text = frameworks.format_text(quick_result)
    assert "add/eager/8" in text and "np.add(x, y)" in text and "per-call ops (--ops): add\n" in text
    assert "all workers loaded the same .so: yes" in text
    if HAVE_TORCH:
        assert "torch.add(x, y)" in text
    # the builds section renders numbers, errors and skips alike
    fake = dict(quick_result)
    fake["builds"] = {
        "opbridge_cold": {"seconds": 10.0, "cpu_seconds": 8.0, "ops": ["add", "gelu"]},
        "opbridge_cold_add_only": {"seconds": 2.0, "cpu_seconds": 1.5},
        "paddle_cpp_extension_load": {"seconds": 20.0, "cpu_seconds": 16.0},
        "mindspore_custom_op_builder": {"error": "RuntimeError: no compiler", "exit": 1, "stderr_tail": ""},
        "ratios": {"paddle_cpp_extension_load/opbridge_cold": 2.0,
                   "paddle_cpp_extension_load/opbridge_cold (cpu)": 2.0,
                   "paddle_cpp_extension_load/opbridge_cold_add_only": 10.0,
                   "paddle_cpp_extension_load/opbridge_cold_add_only (cpu)": 10.667},
    }
    fake["frameworks"] = {**quick_result["frameworks"], "mindspore": {"framework": "mindspore",
                                                                       "skipped": "no MindSpore environment"}}
    text = frameworks.format_text(fake)
    assert "FAILED: RuntimeError: no compiler" in text
    assert "2.00x" in text and "mindspore: skipped (no MindSpore environment)" in text


def test_parity_rows_numpy_and_torch() -> None:
    """``--parity`` rows (issue 21): verified, timed, faults counted; bfloat16 NumPy arrays via ml_dtypes."""
    from opbridge.bench import parity, parity_report

    pytest.importorskip("torch")
    for fw in ("numpy", "torch"):
        rows = parity.measure(fw, rounds=1, number=1, target_s=1e-4, budget_s=1e-3, shapes=((8, 64),),
                              dtypes=("float32", "bfloat16"))
        assert len(rows) == 6 and not [r for r in rows if "error" in r], rows
        for r in rows:
            assert set(r["faults_per_call"]) == set(r["stats_us"]) >= {"numpy", "native"}
            assert r["verified"]
            if fw == "torch":
                assert r["framework_over_numpy"] > 0 and r["framework_over_native"] > 0
                assert r["verified"].startswith("framework path = NumPy path")
                assert r["framework_over_numpy_fw_memory"] > 0  # the NumPy path on torch's own memory too
        bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
        want = "numpy (ml_dtypes bfloat16)" if importlib.util.find_spec("ml_dtypes") else "torch CPU path"
        assert all(r["baseline"].startswith(want) for r in bf16), [r["baseline"] for r in bf16]
        assert len(parity_report.csv_rows(rows)) == 6
        assert all(set(c) == set(parity_report.CSV_FIELDS) for c in parity_report.csv_rows(rows))


def test_parity_targets_and_table() -> None:
    from opbridge.bench import parity, parity_report

    base = {"op": "add", "shape": [1024, 4096], "dtype": "float32", "baseline": "numpy",
            "stats_us": {k: {"p50": 1000.0} for k in ("numpy", "framework", "native")},
            "faults_per_call": {"numpy": 0, "framework": 544, "native": 16385}}
    ok = {**base, "framework": "jax", "framework_over_numpy": 1.1, "framework_over_native": 0.9}
    slow = {**base, "framework": "jax", "framework_over_numpy": 1.2, "framework_over_native": 1.3}
    paddle_slow_native = {**base, "framework": "paddle", "framework_over_numpy": 1.0, "framework_over_native": 2}
    assert parity_report.misses(ok) == [] and parity_report.misses(paddle_slow_native) == []
    assert parity_report.misses(slow) == [f"> {parity.TARGET_NUMPY}x NumPy", "slower than XLA's fusion"]
    text = "\n".join(parity_report.format_table([ok, slow, {**base, "framework": "paddle", "error": "boom"}]))
    assert "MISS: > 1.15x NumPy, slower than XLA's fusion" in text and "ERROR: boom" in text
    assert "0/544/16385" in text


def test_parity_rows_say_what_they_ran_beside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row records threads, CPUs and load; the table says which rows ran oversubscribed."""
    from opbridge.bench import parity, parity_report

    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read by OpenMP at load: the kernels keep their count
    (row,) = parity.measure("numpy", rounds=1, number=1, target_s=1e-4, budget_s=1e-3, ops=("add",),
                            shapes=((8, 64),), dtypes=("float32",))
    assert row["omp_num_threads"] == "3" and row["cpus"] >= 1
    assert row["kernel_threads"] is None or row["kernel_threads"] >= 1
    assert {"loadavg_before", "loadavg_after"} <= set(row)
    (csv,) = parity_report.csv_rows([row])
    assert csv["omp_num_threads"] == "3" and csv["cpus"] == row["cpus"]
    assert csv["kernel_threads"] == row["kernel_threads"]

    base = {"framework": "mindspore", "op": "add", "shape": [1024, 4096], "dtype": "float32",
            "baseline": "numpy", "stats_us": {k: {"p50": 1000.0} for k in ("numpy", "framework")},
            "faults_per_call": {"numpy": 0, "framework": 0}, "framework_over_numpy": 2.5,
            "framework_over_numpy_p20": 1.04,
            "omp_num_threads": None, "cpus": 2}
    calm = {**base, "loadavg_before": 0.5, "loadavg_after": 1.2}
    busy = {**base, "loadavg_before": 1.5, "loadavg_after": 5.25}
    assert not parity_report.oversubscribed(calm) and parity_report.oversubscribed(busy)
    assert not parity_report.oversubscribed({**base, "loadavg_before": None, "loadavg_after": None})
    assert not any("load average" in line for line in parity_report.format_table([calm]))
    text = "\n".join(parity_report.format_table([calm, busy]))
    assert "1 of 2 rows were timed with the 1-minute load average above the 2 usable CPUs (up to 5.25)" in text
    assert "OMP_WAIT_POLICY=passive (or OMP_NUM_THREADS=1) gives ratios that hold under load" in text
    assert "2.50x   1.04x" in text  # fw/np of the medians, then of the fastest fifth (p20)
    assert "kernel threads" not in text
    threads = [{**calm, "kernel_threads": 1}, {**busy, "kernel_threads": 2}, {**calm, "framework": "jax",
                                                                               "kernel_threads": 2}]
    assert "kernel threads (OpenMP, as the kernels see it): mindspore 1/2, jax 2" in "\n".join(
        parity_report.format_table(threads))


def test_parity_sizes_each_candidates_samples_itself() -> None:
    """A slow candidate (the framework's own formula) no longer cuts every sample to one call."""
    import time

    from opbridge.bench import parity, parity_report

    calls = {"fast": 0, "slow": 0}

    def fast() -> None:
        calls["fast"] += 1

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.005)

    stats, rounds, number = parity.calibrated_each({"fast": fast, "slow": slow}, target_s=0.002, rounds=3,
                                                   min_rounds=3, budget_s=1.0, max_calls=50)
    assert rounds == 3 and number["slow"] == 1 and number["fast"] > 1
    assert calls == {"fast": 3 + 3 * number["fast"], "slow": 3 + 3}  # 3 probe calls, then the rounds
    assert set(stats) == {"fast", "slow"} and all(s["rounds"] == 3 for s in stats.values())
    (row,) = parity_report.csv_rows([{"framework": "numpy", "op": "add", "shape": [8, 64], "dtype": "float32",
                                      "baseline": "numpy", "number": {"numpy": 40, "native": 1}}])
    assert row["number"] == "numpy=40 native=1"


def test_parity_notes_jitted_jax_against_a_fresh_numpy_output() -> None:
    from opbridge.bench import parity_report

    rows = [{"framework": "jax", "shape": [4096, 4096], "framework_over_numpy_fresh": r,
             "framework_out_over_numpy": r + 0.01} for r in (0.97, 1.04)]
    rows.append({"framework": "torch", "shape": [4096, 4096]})
    fresh, donated = parity_report._fresh_notes(rows)
    assert "jax under jax.jit at 4096x4096 / the NumPy path with a fresh np.empty output" in fresh
    assert fresh.endswith("0.97-1.04x")
    assert "with out= a donated array (no fresh output) / the NumPy path: 0.98-1.05x" in donated
