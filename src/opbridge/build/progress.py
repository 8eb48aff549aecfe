"""What a running build shows and what a failed one reports.

:class:`Progress` prints one updating status line once a build has run for a
second; :func:`first_errors` picks the compiler's first ``file:line`` errors
out of a log for :class:`~opbridge.errors.BuildError`.
"""

from __future__ import annotations

import re
import sys
import threading
import time

_ERROR_RE = re.compile(r"^(?P<loc>[^\s:][^:]*:\d+(?::\d+)?): (?:fatal )?error[:\s]", re.M)
_NVCC_ERROR_RE = re.compile(r"^(?P<loc>[^\s(][^(]*\(\d+\)): error", re.M)


def first_errors(log: str, limit: int = 5) -> list[str]:
    """The first *limit* ``file:line: error`` lines (gcc/clang or nvcc style) of *log*."""
    found: list[str] = []
    for line in log.splitlines():
        if _ERROR_RE.match(line) or _NVCC_ERROR_RE.match(line):
            found.append(line.strip())
        if len(found) >= limit:
            break
    return found


class Progress:
    """Prints one updating status line once a build has run for a second.

    Builds running at once in one process (on threads of its own) share the line on a terminal: the one
    shown longest draws every shown build's status.
    """

    _lock = threading.Lock()
    _shown: list[Progress] = []  # in the order they were first shown

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.status = "starting"
        self.start = time.monotonic()
        self.shown = False
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread.start()
        return self

    def _part(self) -> str:
        return f"building {self.label}: {self.status} ({time.monotonic() - self.start:.1f}s)"

    def _run(self) -> None:
        if self._stop.wait(1.0):
            return
        with Progress._lock:
            self.shown = True
            Progress._shown.append(self)
        if not self.tty:
            # A log file gets one line when the build turns slow, one when it ends.
            sys.stderr.write(f"opbridge: building {self.label} ({self.status})...\n")
            sys.stderr.flush()
            self._stop.wait()
            return
        while not self._stop.is_set():
            with Progress._lock:
                if Progress._shown and Progress._shown[0] is self:
                    sys.stderr.write("\ropbridge: " + " | ".join(p._part() for p in Progress._shown) + "\033[K")
                    sys.stderr.flush()
            self._stop.wait(0.25)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
        if self.shown:
            done = "failed" if exc[0] else "done"
            lead, tail = ("\r", "\033[K") if self.tty else ("", "")
            with Progress._lock:
                Progress._shown.remove(self)
                sys.stderr.write(f"{lead}opbridge: building {self.label}: {done} in "
                                 f"{time.monotonic() - self.start:.1f}s{tail}\n")
                sys.stderr.flush()
