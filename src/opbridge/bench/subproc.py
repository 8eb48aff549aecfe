"""Measurements in fresh interpreters: the scripts, running them, and the JSON they print last.

``bench build`` and ``bench frameworks`` time cold builds and warm starts,
which only a fresh process measures: each runs a small script (``python -c``)
that prints one JSON document as its last line. The C++ of the peers they
build (a torch, Paddle or MindSpore ``add``) lives beside this module in
``peer_*.cc`` (package data ``bench/*.cc``), read by :func:`peer_source`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

from opbridge.bench import BenchError

#: Lines of a failed subprocess's stderr kept for its report.
TAIL_LINES = 25

#: Wall time, and CPU time of this process plus every finished descendant (the compilers): the latter
#: is far less disturbed by other load on the machine.
CLOCK = """
import resource as _r, time as _t
def _clock():
    s, c = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)
    return _t.perf_counter(), s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
"""

#: The cold builds need no torch: hide it while importing tvm_ffi (which imports torch when it can) to
#: keep the untimed set-up short. After `from opbridge import ops`, so opbridge does not see torch in use.
TVM_FFI_WITHOUT_TORCH = """
sys.modules["torch"] = None
try:
    import tvm_ffi, tvm_ffi.cpp
finally:
    del sys.modules["torch"]
"""

#: opbridge's cold build of its op library, timed after `import tvm_ffi`.
OPBRIDGE_COLD = CLOCK + """
import json, sys
from opbridge import ops
""" + TVM_FFI_WITHOUT_TORCH + """
start, cpu0 = _clock()
path = ops.LIBRARY.build("cpu")
end, cpu1 = _clock()
print(json.dumps({"seconds": end - start, "cpu_seconds": cpu1 - cpu0, "path": str(path),
                  "ops": sorted(ops.LIBRARY.ops),
                  "sources": [p.name for p in ops.LIBRARY.sources_for("cpu")]}))
"""


def peer_source(name: str) -> str:
    """The C++ source ``bench/peer_<name>.cc`` (a peer's equivalent op)."""
    return Path(__file__).with_name(f"peer_{name}.cc").read_text()


def run(label: str, cmd: list[str], env: dict[str, str], timeout: float,
        forward: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """Run *cmd*; forward stderr lines starting with *forward* live; return (exit, stdout, stderr tail)."""
    with tempfile.TemporaryFile("w+") as out, \
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True) as proc:
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        try:
            for line in proc.stderr or ():
                tail.append(line.rstrip("\n"))
                if forward and line.startswith(forward):
                    sys.stderr.write(line)
                    sys.stderr.flush()
            code = proc.wait()
        finally:
            timer.cancel()
        if timed_out.is_set():
            tail.append(f"{label}: killed after {timeout:.0f} s")
        out.seek(0)
        return code, out.read(), "\n".join(tail)


def last_json(stdout: str) -> dict[str, Any] | None:
    """The JSON object on the last line of *stdout* that starts with ``{``, or None."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                doc: dict[str, Any] = json.loads(line)
                return doc
            except json.JSONDecodeError:
                return None
    return None


def script(label: str, python: str, code: str, env: dict[str, str], *argv: str,
           timeout: float = 900) -> dict[str, Any]:
    """Run *code* under *python*; its JSON, or ``{"error", "exit", "stderr_tail"}`` with the exact error."""
    status, stdout, tail = run(label, [python, "-c", code, *argv], env, timeout)
    doc = last_json(stdout)
    if status != 0 or doc is None:
        lines = [ln for ln in tail.splitlines() if ln.strip()]
        # The most specific line: the last exception line, else the last line.
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
        return {"error": (errs or lines or [f"exit {status}, no output"])[-1].strip(), "exit": status,
                "stderr_tail": tail}
    return doc


def script_or_raise(label: str, code: str, env: dict[str, str], *argv: str, timeout: float = 600) -> dict[str, Any]:
    """:func:`script` under this interpreter; raise :class:`BenchError` (with the stderr tail) on failure."""
    doc = script(label, sys.executable, code, env, *argv, timeout=timeout)
    if "error" in doc and "exit" in doc:
        tail = "\n".join(doc["stderr_tail"].splitlines()[-15:])
        raise BenchError(f"{label}: subprocess failed (exit {doc['exit']}):\n{tail}")
    return doc
