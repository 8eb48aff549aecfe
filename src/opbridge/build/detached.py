"""Builds that finish even when the program that started them exits first.

The C entries and shims that opbridge compiles beside a running program
(torch's dispatcher shim, NumPy's C entry) take seconds to build, longer
than many scripts run. Compiled in a child that dies with its program, they
would never land in the cache for a script shorter than the build: each run
would compile again, be stopped at exit, and print the same "building" line.
So such a build runs in a process of its own, in a session of its own (a
Ctrl-C aimed at the program does not reach it), on CPU the program leaves
idle when it runs in the background (:data:`LOWER_PRIORITY`); it installs its result in the cache itself, and the
program that started it, while it lives, waits for it on a thread and loads
the result. A later process finds the result. While a build is in flight (a
live process holds its lock: :func:`in_flight`), a background request starts
no second process, which would only wait on the lock beside a temporary of
its own: :func:`locked_compile` returns None, and the program waits for that
build on a thread. It takes the lock without waiting before it starts a
child, which inherits it: a child that the machine's load keeps from running
holds it already. A foreground build takes
the lock over from a background build that gets no CPU
(:mod:`opbridge.build.preempt`).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from opbridge.build import preempt
from opbridge.build.cache import await_build, build_lock, lock_held
from opbridge.build.toolchain import missing_compiler

#: How much lower than the program a background build runs (``nice``), where it cannot run idle.
BACKGROUND_NICENESS = 10

#: A child's first lines (it then calls ``_lower(niceness)``): a background build (niceness > 0) runs
#: ``nice`` lower and, on Linux, under SCHED_IDLE, inherited by the compiler, in a scheduler autogroup
#: at ``nice`` 19. The child leads a session of its own, which Linux's autogroups (on by default in
#: desktop and many server kernels) schedule as a group of its own at the group's weight, whatever its
#: tasks' nice: at nice 10 in its own group, the torch shim's build beside a program's OpenMP kernel on
#: this 2-core machine stretched calls of 55-90 us to 8 ms (a scheduler slice) half the time for its 12 s.
LOWER_PRIORITY = """\
def _lower(n):
    if n > 0:
        os.nice(n)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
        except OSError:
            pass
"""

# The child that compiles one library: run by the interpreter in isolated mode, standard library only.
# argv: niceness, output, temporary output, lock file, the descriptor of that lock file that the program took
# for it and handed down (-1: none), the log line for a compiler that is not there, then the compiler command
# (which writes the temporary output). The lock is taken by preempt.take (whose source runs first; on a handed
# descriptor it holds already, it only records the child as its holder): a foreground child stops a starved
# background holder. Under the lock: nothing to do if
# another build installed the output; else compile, install by rename, then write the compiler's
# log. Exit status 0: the output is installed. Before the rename it records the output's size beside it
# (installed() below reads it): an output cut short is rebuilt, never loaded.
_LOCKED_COMPILE = Path(preempt.__file__).read_text() + """\
import subprocess, sys
""" + LOWER_PRIORITY + """\
nice, out, tmp, lock, held, missing, *cmd = sys.argv[1:]
_lower(int(nice))
fd = int(held) if int(held) >= 0 else os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
take(fd)
log, code = "", 0

def installed():
    try:
        size = os.path.getsize(out)
        with open(out + ".bytes") as f:
            return size == int(f.read())
    except FileNotFoundError:
        return os.path.exists(out) and os.path.getsize(out) > 0 and not os.path.exists(out + ".bytes")
    except (OSError, ValueError):
        return False

try:
    if not installed():
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            log, code = r.stdout, r.returncode
        except FileNotFoundError:  # no such compiler
            log, code = missing, 127
        except OSError as e:
            log, code = f"cannot run {cmd[0]}: {e}", 126
        if code == 0:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            with open(out + ".bytes", "w") as f:
                f.write(str(os.path.getsize(tmp)))
            os.replace(tmp, out)
finally:
    if os.path.exists(tmp):
        os.unlink(tmp)
    fcntl.flock(fd, fcntl.LOCK_UN)
sys.stdout.write(log)
sys.exit(1 if code else 0)
"""


def installed(out: Path) -> bool:
    """Whether *out*, built by :func:`locked_compile`, is whole: the size its build recorded beside it
    (``<out>.bytes``), or, from a build before sizes were recorded, not empty. A library cut short would
    crash the process that loads it (SIGBUS)."""
    try:
        size = out.stat().st_size
        recorded = Path(f"{out}.bytes").read_text()
    except FileNotFoundError:
        return out.exists() and out.stat().st_size > 0 and not Path(f"{out}.bytes").exists()
    except OSError:
        return False
    try:
        return size == int(recorded)
    except ValueError:
        return False


def niceness(background: bool) -> int:
    """How much lower than this process a build runs."""
    return BACKGROUND_NICENESS if background else 0


class Child:
    """A process in a session of its own (it outlives this one), writing its output to an unnamed file.

    Not a pipe: once this process is gone, a write to a pipe would kill the
    child (or raise in it) before it installs what it built.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, pass_fds: Sequence[int] = ()) -> None:
        self.argv = list(argv)
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         pass_fds=tuple(pass_fds))
        except OSError:
            self._log.close()
            raise

    def wait(self) -> tuple[int, str]:
        """The child's exit status and output, once it exits."""
        code = self.proc.wait()
        self._log.seek(0)
        log = self._log.read()
        self._log.close()
        return code, log

    def stop(self) -> None:
        """Stop the child and everything it started (its session), if it still runs."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()


def python_env() -> dict[str, str]:
    """This process's environment, with its module search path as the child's ``PYTHONPATH``.

    A child interpreter then imports the same opbridge and NumPy as this
    process, even where the program put them on ``sys.path`` itself.
    """
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def in_flight(out: Path) -> bool:
    """Whether a build of *out* is in flight: a live process holds its build lock now. Never waits.

    The lock is an ``flock``, which the kernel drops when its holder exits,
    however it exits: the lock file of a build that was killed counts for
    nothing, and the next request builds.
    """
    return lock_held(build_lock(out))


def _claim(lock: Path) -> int | None:
    """*lock* taken without waiting, as an open descriptor (for a child to inherit); None where another
    process holds it."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def locked_compile(command: Sequence[str], out: Path, tmp: Path, background: bool) -> Child | None:
    """Compile into *tmp* with *command* and rename it to *out*, under its build lock, in a detached child.

    The child compiles nothing when *out* exists once it holds the lock (a
    concurrent build installed it). Its exit status is 0 once *out* is in
    place; otherwise its output is the compiler's log (for a compiler that is not there, the
    message of :func:`~opbridge.build.toolchain.missing_compiler`).

    A *background* build starts only where no build of *out* is in flight:
    this takes the lock without waiting and hands it to the child (which holds
    it from its start, however long the machine's load keeps it from running),
    and returns None, starting nothing, where another process holds it. A
    foreground build always starts: its child waits for the lock, or takes it
    from a starved background build (:mod:`opbridge.build.preempt`).
    """
    held = _claim(build_lock(out)) if background else -1
    if held is None:
        return None
    argv = [sys.executable, "-I", "-c", _LOCKED_COMPILE, str(niceness(background)), str(out), str(tmp),
            str(build_lock(out)), str(held), str(missing_compiler(command[0])), *command]
    try:
        child = Child(argv, pass_fds=(held,) if held >= 0 else ())
        if held >= 0:  # its holder from now on, for a foreground build that finds it starved (preempt.holder)
            try:
                os.ftruncate(held, 0)
                os.pwrite(held, f"{child.proc.pid}\n".encode(), 0)
            except OSError:  # the child records itself once it runs
                pass
    finally:
        if held >= 0:
            os.close(held)  # the child's copy keeps the lock
    return child


def awaited(out: Path) -> bool:
    """Whether *out* is installed once no build of it holds its lock (one in flight finishes first);
    never takes the lock from a background build (:func:`.cache.await_build`). Never raises."""
    try:
        return await_build(build_lock(out), lambda: installed(out) or None) is not None
    except OSError:
        return False
