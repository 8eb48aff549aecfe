"""Writing benchmark results: progress on stderr, JSON, CSV and plots into one folder.

Every benchmark that writes files calls :func:`write_results`, which writes
``results.json`` and ``results.csv`` always and the PNG plots only where
matplotlib is installed; without it the plots are skipped with one line
saying how to get them (:data:`PLOTS_HINT`), and the run still succeeds.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opbridge.bench.timing import machine_info

#: How to get the plots (matplotlib is an optional dependency).
PLOTS_HINT = 'pip install "opbridge[bench]"'


def say(bench: str, msg: str) -> None:
    """One progress line on stderr, ``bench <name>: <msg>``."""
    print(f"bench {bench}: {msg}", file=sys.stderr, flush=True)


def sig(x: float, digits: int = 4) -> float:
    """*x* rounded to *digits* significant digits (ratios and rates span many decades)."""
    return float(f"{x:.{digits}g}")


def fmt_x(v: float | None) -> str:
    """A ratio as ``1.23x``, or ``-`` where there is none."""
    return "-" if v is None else f"{v:.2f}x"


def loadavg() -> float | None:
    """The 1-minute load average (other work competing for the cores), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (``sys.modules["matplotlib"] = None`` counts as missing)."""
    if "matplotlib" in sys.modules:
        return sys.modules["matplotlib"] is not None
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def write_results(result: dict[str, Any], out: Path, csv_fields: Sequence[str], rows: Sequence[dict[str, Any]],
                  plots: Callable[[dict[str, Any], Path], list[Path]] | None, *,
                  bench: str) -> dict[str, Any]:
    """Write ``results.csv`` and the plots into *out*; return the files' paths.

    ``results.json`` is named in the answer; the caller writes it last (with
    the answer in it) through :func:`write_json`. *plots* draws the PNGs
    into a folder (None: no plots); without matplotlib they are skipped with
    one line on stderr, and the answer says why under ``plots_skipped``.
    """
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {"dir": str(out), "json": str(out / "results.json"), "csv": str(out / "results.csv")}
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(csv_fields))
        w.writeheader()
        w.writerows(rows)
    files["plots"] = []
    if plots is None:
        return files
    if not have_matplotlib():
        files["plots_skipped"] = f"matplotlib is not installed; for the plots: {PLOTS_HINT}"
        say(bench, f"plots skipped: {files['plots_skipped']}")
        return files
    files["plots"] = [str(p) for p in plots(result, out / "plots")]
    return files


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Write *result* as indented JSON to *path*."""
    Path(path).write_text(json.dumps(result, indent=1))


def files_line(files: dict[str, Any]) -> str:
    """What :func:`write_results` wrote, in one line of a text report."""
    plots = (f"plots skipped: {files['plots_skipped']}" if files.get("plots_skipped")
             else f"{len(files['plots'])} plots")
    return f"results: {files['dir']} (results.json, results.csv, {plots})"


def checked_result(benchmark: str, quick: bool, problems: list[str]) -> dict[str, Any]:
    """The head of a benchmark's result whose candidates are checked against a reference: its name,
    whether it ran ``--quick``, ``ok`` exactly when no candidate disagreed (``problems``, listed by
    :func:`closing_lines`; the command then exits 0) and the machine it ran on."""
    return {"benchmark": benchmark, "quick": quick, "ok": not problems, "problems": problems,
            "machine": machine_info()}


def closing_lines(result: dict[str, Any], *, skipped_ops: bool = True) -> list[str]:
    """A text report's last lines: ops left out, candidates that disagreed with the reference
    (``result["problems"]``), and where the results were written."""
    lines = [f"skipped {n}: {why}" for n, why in result.get("skipped_ops", {}).items()] if skipped_ops else []
    if result.get("problems"):
        lines += ["", f"FAILED: {len(result['problems'])} candidate(s) disagree with the float64 reference:"]
        lines += [f"  {p}" for p in result["problems"]]
    if result.get("files"):
        lines.append(files_line(result["files"]))
    return lines


class Progress:
    """A text progress bar on stderr: counts, current step, elapsed time and ETA.

    Steps have weights (their expected cost); the ETA extrapolates the time
    per unit of weight done so far. On a terminal the bar redraws in place;
    otherwise each step prints one line.
    """

    def __init__(self, total: float, steps: int, *, stream: Any = None, width: int = 24,
                 name: str = "bench kernels") -> None:
        self.total = max(total, 1e-9)
        self.steps = steps
        self.done_weight = 0.0
        self.done_steps = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.name = name
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    @staticmethod
    def _clock(seconds: float) -> str:
        s = int(seconds + 0.5)
        return f"{s // 60}m{s % 60:02d}s"

    def show(self, label: str) -> None:
        """Draw the bar with *label* as the step now running."""
        frac = min(self.done_weight / self.total, 1.0)
        filled = round(frac * self.width)
        elapsed = time.monotonic() - self.start
        eta = "?" if self.done_weight <= 0 else self._clock(elapsed * (self.total - self.done_weight)
                                                             / self.done_weight)
        line = (f"{self.name} [{'#' * filled}{'.' * (self.width - filled)}] {self.done_steps}/{self.steps} "
                f"{frac:4.0%}  {self._clock(elapsed)} elapsed, ETA {eta}  {label}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self, weight: float) -> None:
        """Mark a step of *weight* done."""
        self.done_weight += weight
        self.done_steps += 1

    def note(self, msg: str) -> None:
        """Print a message on its own line without losing the bar."""
        self.stream.write(("\r\x1b[2K" if self.tty else "") + f"{self.name}: {msg}\n")
        self.stream.flush()

    def finish(self) -> None:
        """Draw the final state and end the line."""
        self.show("done")
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
