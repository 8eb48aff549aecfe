"""Fold the outputs of scripts/gpu-check.sh into one JSON summary (``<out>/summary.json``)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep_summary, beside this script, also when imported
import sweep_summary


def _junit(path: Path) -> dict[str, object]:
    if not path.exists():
        return {"missing": True}
    root = ET.parse(path).getroot()  # noqa: S314 - our own pytest's output
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    failed, crashed = [], []
    for c in suite.iter("testcase"):
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            failed.append(f"{c.get('classname')}::{c.get('name')}")
            if "crashed while running" in (bad.get("message") or ""):  # a native fault in an xdist worker
                crashed.append(failed[-1])
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed, "crashed": crashed}


def _standing_lines(value: object) -> list[str]:
    """A bench gpu result's closing list of the cases a peer won (opbridge.bench.gpu's standing, as the run
    saved it or, for a run from before it did, computed from its cases); none where opbridge is not
    importable or *value* is no bench gpu result."""
    if not isinstance(value, dict) or value.get("benchmark") != "gpu":
        return []
    try:
        from opbridge.bench.gpu.cases import standing
        from opbridge.bench.gpu.text import standing_lines
    except ImportError:
        return []
    lines: list[str] = standing_lines(value.get("standing") or standing(value.get("results") or []))
    return lines


def _last_json(text: str) -> object:
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def main(out: Path) -> int:
    steps = {}
    for line in (out / "steps.txt").read_text().splitlines():
        name, rc, secs = line.split()
        # "skipped": GPU_CHECK_BUDGET left the step no time, so it did not run
        steps[name] = {"exit_status": None, "skipped": True} if rc == "skipped" else {
            "exit_status": int(rc), "seconds": int(secs)}
    summary: dict[str, object] = {"gpu": (out / "gpu.txt").read_text().strip(), "steps": steps}
    for name in ("cuda_tests", "torch_gpu_tests", "jax_gpu_tests", "torch_gpu_fuzz"):
        summary[name] = _junit(out / f"{name}.xml")
    for key, folder in (("bench_gpu", "bench-gpu"), ("bench_jax_gpu", "bench-jax-gpu"),
                        ("bench_gpu_serving", "bench-gpu-serving"), ("bench_gpu_large", "bench-gpu-large")):
        bench = out / folder / "results.json"
        summary[key] = json.loads(bench.read_text()) if bench.exists() else None
    for bench in sorted(out.glob("bench-gpu-*/results.json")):  # more bench gpu runs (a module, ops or rows each)
        summary.setdefault(bench.parent.name.replace("-", "_"), json.loads(bench.read_text()))
    log = out / "bench_overhead_cuda.log"
    summary["bench_overhead_cuda"] = _last_json(log.read_text()) if log.exists() else None
    for name in ("sweep_norm", "sweep_norm_staged", "sweep_gated"):  # GPU_CHECK_SWEEPS: the sweeps, per case
        log = out / f"{name}.log"
        summary[name] = [c.as_json() for c in sweep_summary.cases(log.read_text())] if log.exists() else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [n for n, s in steps.items() if s["exit_status"]]
    skipped = [n for n, s in steps.items() if s.get("skipped")]
    verdict = "FAILED: " + ", ".join(failed) if failed else ("every step run passed" if skipped else "all steps passed")
    if skipped:
        verdict += "; not run, for want of time (GPU_CHECK_BUDGET): " + ", ".join(skipped)
    print(f"gpu-check: {verdict}; summary in {out / 'summary.json'}")
    for key, value in summary.items():  # each bench gpu run's cases where a peer was faster
        lines = _standing_lines(value)
        if lines:
            print(f"{key}:" + "\n".join(lines))
    if steps and len(skipped) == len(steps):
        print("gpu-check: no step ran: GPU_CHECK_BUDGET left none of them 20 s")
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
