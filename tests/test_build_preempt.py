"""A foreground build takes the lock from a background build that gets no CPU (opbridge.build.preempt).

Before, ``opbridge build`` (or a program's ``build_now``) waited on the lock
of a background build started earlier, which runs on idle CPU only: beside a
program that keeps every core busy, for as long as that program ran.
A background build here is a stand-in that sleeps: one that makes no progress.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from opbridge.build import preempt

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc"),
                                reason="SCHED_IDLE and /proc are Linux's")

# Takes the lock argv[1] through preempt.take (recording itself), says so, then sleeps argv[2] seconds holding it.
_HOLDER = textwrap.dedent("""
    import os, sys, time
    from opbridge.build import preempt
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    preempt.take(fd)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _idle(pid: int) -> None:
    """Run *pid* idle from now on: a background build made idle once it holds its lock (set from its start,
    on a machine whose cores CI keeps busy, it might not reach the lock within the test's patience)."""
    os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def _holder(lock: Path, idle: bool, seconds: float, own_session: bool = True) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=own_session)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    proc.stdout.close()
    if idle:
        _idle(proc.pid)
    return proc


def _take(lock: Path, preempt_: bool = True, timeout: float = 60) -> tuple[list[int], float]:
    """preempt.take on *lock* from a thread: what it stopped and how long it took (fails past *timeout*)."""
    result: list[Any] = []
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    start = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(preempt.take(fd, preempt_)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"waited over {timeout} s for the lock"
    os.close(fd)
    return result[0], time.monotonic() - start


def test_a_starved_background_holder_is_stopped(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    holder = _holder(lock, idle=True, seconds=300)
    stopped, seconds = _take(lock)
    assert stopped == [holder.pid] and seconds < 30
    assert holder.wait(10) == -signal.SIGTERM
    fd = os.open(lock, os.O_RDONLY)
    assert preempt.holder(fd) == os.getpid()  # the lock file names its new holder
    os.close(fd)


@pytest.mark.parametrize("case", ["progressing", "normal priority", "not a session of its own", "no preempt",
                                  "the waiter runs idle"])
def test_other_holders_are_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    lock = tmp_path / "x.lock"
    if case == "progressing":  # a session that used a full core over every sample
        monkeypatch.setattr(preempt, "session_cpu_s", lambda sid: time.monotonic())
    if case == "the waiter runs idle":
        runs_idle = preempt.runs_idle
        monkeypatch.setattr(preempt, "runs_idle", lambda pid=0: pid == 0 or runs_idle(pid))
    holder = _holder(lock, idle=case != "normal priority", seconds=2, own_session=case != "not a session of its own")
    stopped, seconds = _take(lock, preempt_=case != "no preempt")
    assert stopped == [] and holder.wait(10) == 0 and seconds > 1


pytest.importorskip("torch")
from opbridge.adapters.torch.native import build as shim_build  # noqa: E402

# A stand-in compiler: waits argv[3] seconds, counts its runs in argv[2], writes the library argv[1].
_FAKE_CC = ("import sys, time; time.sleep(float(sys.argv[3])); open(sys.argv[2], 'a').write('1'); "
            "open(sys.argv[1], 'w').write('lib')")


def test_a_foreground_shim_build_takes_over_from_a_starved_background_one(tmp_path: Path) -> None:
    out = tmp_path / "lib.so"
    background = shim_build.Job(out=out, make_command=lambda tmp: [
        sys.executable, "-c", _FAKE_CC, str(tmp), str(tmp_path / "background-runs"), "300"])
    from opbridge.build.cache import build_lock, lock_held

    end = time.monotonic() + 60
    while not lock_held(build_lock(out)) and time.monotonic() < end:
        time.sleep(0.05)
    _idle(background.child.proc.pid)
    start = time.monotonic()
    foreground = shim_build.Job(out=out, make_command=lambda tmp: [
        sys.executable, "-c", _FAKE_CC, str(tmp), str(tmp_path / "foreground-runs"), "0.1"])
    assert foreground.wait() == out and time.monotonic() - start < 30
    assert background.wait() == out  # the program that started the background build loads this one
    assert background.child.proc.returncode < 0 and not (tmp_path / "background-runs").exists()
    assert (tmp_path / "foreground-runs").read_text() == "1" and out.read_text() == "lib"


def _slow_cxx(tmp_path: Path) -> tuple[Path, Path]:
    """A one-function source, and a compiler that is the real one but for 300 s first where $SLOW_CXX is set
    (the background build's; its version query, part of the cache key, is not slowed)."""
    src = tmp_path / "k.cc"
    src.write_text('extern "C" int opb_k() { return 1; }\n')
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\n[ -n \"$SLOW_CXX\" ] && [ \"$1\" != --version ] && sleep 300\n"
                   f"exec {os.environ.get('CXX', 'c++')} \"$@\"\n")
    cxx.chmod(0o755)
    return src, cxx


def test_a_foreground_jit_build_takes_over_from_a_starved_background_one(tmp_path: Path) -> None:
    """The same for the JIT cache's lock (the C entries' child builds through it)."""
    src, cxx = _slow_cxx(tmp_path)
    env = dict(_env(), OPBRIDGE_CACHE_DIR=str(tmp_path / "cache"), OPBRIDGE_CXX=str(cxx), OPBRIDGE_NO_PROGRESS="1")
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from opbridge.build import compile as c, jit
        if sys.argv[1:] == ["slow"]:
            os.environ["SLOW_CXX"] = "1"
        spec = c.BuildSpec(name="k", sources=(Path({str(src)!r}),))
        print(jit.awaited_artifact(spec) if sys.argv[1:] == ["await"] else jit.build(spec), flush=True)
    """)
    background = subprocess.Popen([sys.executable, "-c", script, "slow"], env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while not list((tmp_path / "cache").glob("jit/.k-*tmp-*")) and time.monotonic() < end:
        time.sleep(0.05)
    _idle(background.pid)
    waiter = subprocess.Popen([sys.executable, "-c", script, "await"], env=env, stdout=subprocess.PIPE, text=True)
    built = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert background.wait(30) < 0  # stopped
    assert waiter.communicate(timeout=30)[0] == built.stdout  # awaited_artifact waited for the foreground build
    assert built.stdout.strip().endswith("k.so")


def test_a_program_whose_c_entry_build_was_stopped_loads_the_foreground_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C entries' path end to end: a program's background child (idle from its start) builds through the
    JIT cache; a foreground build stops it; the program's thread loads what the foreground build installed."""
    src, cxx = _slow_cxx(tmp_path)
    (tmp_path / "probe_preempted.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        from opbridge.build import compile as c
        from opbridge.call.c_entry import CEntry
        ENTRY = CEntry("a probe", "probe_preempted", spec=lambda: c.BuildSpec(name="k", sources=(Path({str(src)!r}),)),
                       load=lambda p: p, enabled=lambda: True, fallback="nothing")
    """))
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OPBRIDGE_CXX", str(cxx))
    monkeypatch.syspath_prepend(str(tmp_path))
    from opbridge.build import detached, jit

    monkeypatch.setattr(detached, "python_env", lambda: dict(_env(), SLOW_CXX="1"))
    import probe_preempted  # type: ignore[import-not-found]

    entry = probe_preempted.ENTRY
    child = entry.start_child()
    waiting = threading.Thread(target=entry._background, args=(child,), daemon=True)
    waiting.start()
    end = time.monotonic() + 120
    while not list((tmp_path / "cache").glob("jit/.k-*tmp-*")) and time.monotonic() < end:
        time.sleep(0.05)
    assert list((tmp_path / "cache").glob("jit/.k-*tmp-*")), "the background child never started its compile"
    built = jit.build(entry.spec())  # in the foreground: stops the child
    waiting.join(60)
    assert child.proc.returncode is not None and child.proc.returncode < 0
    assert entry.lib == built and not entry.failed
