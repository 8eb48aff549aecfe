"""Build locks that a foreground build takes over from a starved background build.

A background build (:mod:`opbridge.build.detached`) runs on idle CPU only
(SCHED_IDLE): beside a program that keeps every core busy, it makes almost no
progress. A foreground build of the same library (``opbridge build``, or a
program's ``build_now``) that waited on its lock would wait as long: a
priority inversion, which an ordinary user cannot mend by raising the holder
(leaving SCHED_IDLE needs the privilege to lower ``nice``, RLIMIT_NICE).

So a lock's holder records its process id in the lock file, and a waiter
that does not itself run idle watches the holder instead of blocking: where
the holder is a detached background build (it runs SCHED_IDLE and leads a
session of its own, its compilers inside it) whose session used under
:data:`STARVED` of one core over :data:`SAMPLE_S`, the waiter stops that
session (SIGTERM, then SIGKILL) and builds itself. A holder that makes
progress, or one that is not a detached background build, is waited for.
The program that started a stopped build waits for the lock and loads what
the foreground build installed.

Standard library only and no ``from __future__``: the isolated child of
:data:`opbridge.build.detached._LOCKED_COMPILE` runs this file's source.
"""

import fcntl
import os
import signal
import time

#: How long a waiter watches a background holder's session before judging its progress, in seconds.
SAMPLE_S = 0.5
#: A background holder whose session used less than this share of one core over a sample is starved.
STARVED = 0.25
#: How often a waiter looks at the lock and its holder again, in seconds.
POLL_S = 0.1
#: How long a stopped holder has to leave after SIGTERM before it gets SIGKILL, in seconds.
TERM_GRACE_S = 2.0


def runs_idle(pid: int = 0) -> bool:
    """Whether process *pid* (0: this one) runs under SCHED_IDLE (never, where there is none)."""
    try:
        return os.sched_getscheduler(pid) == os.SCHED_IDLE
    except (AttributeError, OSError):
        return False


def session_cpu_s(sid: int) -> float:
    """CPU seconds used by the processes of session *sid*, with the children they have reaped."""
    ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command: state ppid pgrp session ... utime(11) stime(12) cutime(13) cstime(14)
        if int(fields[3]) == sid:
            ticks += sum(int(v) for v in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def holder(fd: int) -> int | None:
    """The process id the lock file *fd*'s holder recorded, or None."""
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def detached_background(pid: int) -> bool:
    """Whether *pid* is a detached background build: it runs idle and leads a session of its own, so
    stopping its session stops its compilers and nothing else."""
    try:
        return runs_idle(pid) and os.getsid(pid) == pid and os.getpgid(pid) == pid
    except OSError:
        return False


def starved(pid: int) -> bool:
    """Whether the background build *pid* made under :data:`STARVED` of a core's progress over a
    sample (:data:`SAMPLE_S`, which this waits)."""
    before = session_cpu_s(pid)
    time.sleep(SAMPLE_S)
    return session_cpu_s(pid) - before < STARVED * SAMPLE_S


def stop_session(pid: int, fd: int) -> bool:
    """Stop the session led by *pid*, which holds the lock file *fd*, and take the lock: SIGTERM, then
    SIGKILL if it still holds the lock after :data:`TERM_GRACE_S`. Whether this now holds the lock (not
    where a third process took it first)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except OSError:  # gone already (or not ours)
            pass
        end = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < end:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                time.sleep(POLL_S / 2)
            if holder(fd) != pid:  # a third process took the lock first
                return False
    return False


def take(fd: int, preempt: bool = True) -> list[int]:
    """Lock the open lock file *fd* exclusively (``flock``) and record this process as its holder.

    With *preempt*, a process that does not run idle takes the lock from a
    starved detached background build (see the module's docstring) instead
    of waiting for it. Returns the process ids it stopped.
    """
    stopped: list[int] = []
    if preempt and not runs_idle() and os.path.isdir("/proc"):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid = holder(fd)  # stale for a moment after a new holder takes the lock: polled, not waited on
                if pid is None or pid == os.getpid() or not detached_background(pid):
                    time.sleep(POLL_S)  # a holder at our priority: no inversion to mend
                elif starved(pid) and detached_background(pid):
                    stopped.append(pid)
                    if stop_session(pid, fd):
                        break
    else:
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return stopped
