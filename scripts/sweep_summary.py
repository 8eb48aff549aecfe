"""Read the launch-policy sweeps' output (scripts/cuda-sweep.sh) into what a tuning decision needs.

For each case (op, dtype, shape): the current policy's time, the fastest policy and its time, the
speedup, and every policy whose result differs from the current policy's by more than rounding (a bug
in that policy, never a tuning choice; such a policy is never the fastest one). Rounding: a norm's
policies sum a row in other orders, so float32 results differ in the last bits and 16-bit ones by an
ulp. ``scripts/gpu_check_summary.py`` folds it into gpu-check's summary; on its own:

    python scripts/sweep_summary.py sweep.log [...]     # a table, fastest policy per case
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# "<op> <dtype> <rows> x <cols> <policy words> <time> us <fraction> copy  max|diff| <diff>[  <- current policy]"
_LINE = re.compile(r"^(?P<op>\w+)\s+(?P<dtype>\w+)\s+(?P<rows>\d+) x (?P<cols>\d+)\s+(?P<policy>.*?)\s+"
                   r"(?P<us>[\d.]+) us\s+(?P<copy>[\d.]+) copy\s+max\|diff\| (?P<diff>\S+)(?P<mark>.*)$")


# The most a policy's result may differ from the current policy's by rounding alone (outputs below 2
# in magnitude): float32 a few ulps; 16-bit types 4 ulps of values in [1, 2).
ROUNDING = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2.0**-5, "float16": 2.0**-8}


@dataclass
class Run:
    policy: str
    us: float
    copy: float  # fraction of the device's copy bandwidth
    matches: bool = True  # the result is the current policy's, up to rounding


@dataclass
class Case:
    op: str
    dtype: str
    shape: tuple[int, int]
    runs: list[Run] = field(default_factory=list)
    current: Run | None = None
    mismatches: list[str] = field(default_factory=list)

    @property
    def best(self) -> Run:
        """The fastest policy whose result matches the current one's."""
        return min((r for r in self.runs if r.matches), key=lambda r: r.us)

    @property
    def speedup(self) -> float | None:
        """The current policy's time over the fastest one's (1.0: the current policy is the fastest)."""
        return None if self.current is None else round(self.current.us / self.best.us, 3)

    def as_json(self) -> dict[str, object]:
        best, cur = self.best, self.current
        return {"op": self.op, "dtype": self.dtype, "shape": list(self.shape), "policies": len(self.runs),
                "current": None if cur is None else vars(cur), "best": vars(best), "speedup": self.speedup,
                "mismatches": self.mismatches}


def cases(text: str) -> list[Case]:
    """One record per case of a sweep's output, in the order the sweep ran them."""
    found: dict[tuple[str, str, int, int], Case] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        rows, cols = int(m["rows"]), int(m["cols"])
        case = found.setdefault((m["op"], m["dtype"], rows, cols), Case(m["op"], m["dtype"], (rows, cols)))
        matches = float(m["diff"]) <= ROUNDING.get(m["dtype"], 0.0)
        run = Run(" ".join(m["policy"].split()), float(m["us"]), float(m["copy"]), matches)
        case.runs.append(run)
        if "current policy" in m["mark"]:
            case.current = run
        elif not matches:
            case.mismatches.append(run.policy)
    return list(found.values())


def table(found: list[Case]) -> str:
    """The cases as text: one line each, the fastest policy beside the current one."""
    lines = []
    for c in found:
        best, cur = c.best, c.current
        now = "no current policy" if cur is None else f"{cur.us:.3f} us ({cur.copy:.2f} copy)"
        gain = "" if c.speedup is None else f", x{c.speedup:.2f}"
        lines.append(f"{c.op:<22} {c.dtype:<8} {c.shape[0]}x{c.shape[1]:<7} current {now:<26} "
                     f"best {best.us:.3f} us ({best.copy:.2f} copy{gain}) {best.policy}"
                     + (f"  MISMATCH in {len(c.mismatches)}: {'; '.join(c.mismatches)}" if c.mismatches else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    print(table([c for p in sys.argv[1:] for c in cases(Path(p).read_text())]))
