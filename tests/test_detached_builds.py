"""Builds beside the program (torch's shim, NumPy's C entry) finish when the program exits first.

Before, a script shorter than the build stopped the compiler at exit: every
run compiled again and printed the same "building ... once" line, and the
shim never reached the cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from opbridge.build import detached, preempt
from opbridge.errors import BuildError

pytest.importorskip("torch")
from opbridge.adapters.torch.native import build as shim_build

# A stand-in compiler: waits, counts its runs in argv[2], writes the library argv[1].
_FAKE_CC = ("import sys, time; time.sleep(float(sys.argv[3])); open(sys.argv[2], 'a').write('1'); "
            "open(sys.argv[1], 'w').write('lib')")


def _fake(counter: Path, seconds: float = 1.0) -> Any:
    return lambda tmp: [sys.executable, "-c", _FAKE_CC, str(tmp), str(counter), str(seconds)]


def _wait_for(path: Path, seconds: float = 60) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists():
            return True
        time.sleep(0.1)
    return False


def test_a_job_finishes_after_its_program_exits(tmp_path: Path) -> None:
    out, counter = tmp_path / "lib.so", tmp_path / "runs"
    code = (f"import sys; from pathlib import Path; from opbridge.adapters.torch.native import build; "
            f"build.Job(background=True, out=Path({str(out)!r}), make_command=lambda tmp: "
            f"[sys.executable, '-c', {_FAKE_CC!r}, str(tmp), {str(counter)!r}, '5'])")  # outlasts torch's exit
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert not out.exists() and time.monotonic() - started < 30  # the program did not wait for the build
    assert _wait_for(out), "the detached build did not install the library after its program exited"
    assert out.read_text() == "lib" and counter.read_text() == "1"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so"] == ["lib.so"]  # no temporary left


def test_concurrent_jobs_compile_once(tmp_path: Path) -> None:
    out, counter = tmp_path / "lib.so", tmp_path / "runs"
    jobs = [shim_build.Job(out=out, make_command=_fake(counter)) for _ in range(3)]
    assert {job.wait() for job in jobs} == {out}
    assert counter.read_text() == "1"


def _counting_children(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The detached children started from now on (each a detached.Child), recorded as they start."""
    started: list[Any] = []

    class Counted(detached.Child):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(detached, "Child", Counted)
    return started


def _stop(job: Any) -> None:
    """Kill a job's child and its compiler (SIGKILL, its whole session), as a machine's OOM killer or a reboot would."""
    job.child.stop()
    assert job.child.proc.returncode == -signal.SIGKILL


def test_a_background_request_joins_the_build_in_flight_and_starts_no_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, each short program started while the shim was building started a detached child of its own
    (12 MB and a tmp*.so each) that only waited on the lock: ten programs in a row left ten. Now a background
    request finds the lock held by a live builder and starts nothing; once that builder is gone without
    installing the shim (killed: the kernel drops its flock), the next request builds."""
    out = tmp_path / "lib.so"
    started = _counting_children(monkeypatch)
    holder = shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "holder-runs", seconds=300))
    try:
        assert not holder.joined and len(started) == 1
        assert detached.in_flight(out)  # held from the start: the child inherits the lock the program took for it
        fd = os.open(f"{out}.lock", os.O_RDONLY)
        assert preempt.holder(fd) == holder.child.proc.pid  # a foreground build can judge it starved at once
        os.close(fd)
        joined = [shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "joined-runs", 0.1))
                  for _ in range(3)]
        assert all(job.joined and job.child is None and job.tmp is None for job in joined)
        assert len(started) == 1  # no process started, and no temporary made
        assert [p for p in tmp_path.glob("tmp*.so") if p != holder.tmp] == []
        assert detached.locked_compile(["true"], out, tmp_path / "unused.so", background=True) is None
        assert len(started) == 1
    finally:
        _stop(holder)
    assert not detached.in_flight(out) and Path(f"{out}.lock").exists()  # a stale lock file holds nothing
    again = shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "again-runs", seconds=0.1))
    assert not again.joined and len(started) == 2  # a new request builds
    assert again.wait() == out and (tmp_path / "again-runs").read_text() == "1"
    assert all(job.wait() == out for job in joined)  # the joined jobs load what it built, compiling nothing
    assert len(started) == 2 and not (tmp_path / "joined-runs").exists() and not (tmp_path / "holder-runs").exists()


def test_a_joined_job_builds_itself_when_the_build_it_waited_for_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "lib.so"
    started = _counting_children(monkeypatch)
    holder = shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "holder-runs", seconds=300))
    joined = shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "joined-runs", seconds=0.1))
    assert joined.joined and len(started) == 1
    _stop(holder)
    assert joined.wait() == out and len(started) == 2 and (tmp_path / "joined-runs").read_text() == "1"
    assert not (tmp_path / "holder-runs").exists() and out.read_text() == "lib"


def test_a_foreground_request_still_starts_while_a_background_build_holds_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``opbridge build`` must not join a build that may be starved: it starts its own child, which waits for the
    lock or takes it over (build.preempt), and installs the shim once."""
    out = tmp_path / "lib.so"
    started = _counting_children(monkeypatch)
    background = shim_build.Job(background=True, out=out, make_command=_fake(tmp_path / "runs", seconds=1))
    foreground = shim_build.Job(out=out, make_command=_fake(tmp_path / "runs", seconds=0.1))
    assert not foreground.joined and len(started) == 2
    assert foreground.wait() == out and background.wait() == out
    assert (tmp_path / "runs").read_text() == "1"


@pytest.mark.parametrize("joined", [False, True])
def test_the_background_build_line_says_opbridge_build_builds_it_now(
        joined: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One line, whether the program started the build or found one in flight, and it names the way out."""
    from opbridge.adapters.torch import native

    class Stand:
        def __init__(self, background: bool = False) -> None:
            self.joined = joined

        def wait(self) -> Path:
            raise BuildError("not built in this test")

    monkeypatch.setattr(native, "_BUILDER", None)
    monkeypatch.setattr(native, "_BUILD_FAILED", False)
    monkeypatch.setattr(native.build, "Job", Stand)
    monkeypatch.setattr(native.config, "show_progress", lambda: True)
    native._start_background()
    assert native._BUILDER is not None
    native._BUILDER.thread.join()
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.rstrip().endswith("`opbridge build` builds it now"), line
    assert ("by another process" in line) == joined and ("torch.ops calls run Python kernels" in line)


def test_a_failing_compile_raises_with_its_first_errors(tmp_path: Path) -> None:
    def failing(tmp: Path) -> list[str]:
        return [sys.executable, "-c", "print('shim.cc:7:3: error: no member named x'); raise SystemExit(1)"]

    job = shim_build.Job(out=tmp_path / "lib.so", make_command=failing)
    with pytest.raises(BuildError, match="building the torch native shim failed") as info:
        job.wait()
    assert info.value.errors == ["shim.cc:7:3: error: no member named x"]
    assert not (tmp_path / "lib.so").exists() and not job.tmp.exists()


def test_a_missing_compiler_is_a_build_error_naming_it(tmp_path: Path) -> None:
    job = shim_build.Job(out=tmp_path / "lib.so", make_command=lambda tmp: ["/nonexistent/c++", "-o", str(tmp)])
    with pytest.raises(BuildError, match=r"cannot run /nonexistent/c\+\+: .*No such file"):
        job.wait()
    assert not (tmp_path / "lib.so").exists() and not job.tmp.exists()


def test_a_job_removes_what_a_killed_compile_left_unless_a_compile_is_running(tmp_path: Path) -> None:
    """A compile killed with its detached child (SIGKILL, a full stop of the machine) left its tmp*.so beside
    the shim for good; the next job of that shim removes it, but never while another compile holds the lock."""
    from opbridge.build.cache import build_lock, file_lock

    out, counter = tmp_path / "lib.so", tmp_path / "runs"
    left = tmp_path / "tmpk1ll3d.so"
    left.write_bytes(b"half a library")
    os.utime(left, (time.time() - 600, time.time() - 600))
    with file_lock(build_lock(out)):  # another compile is writing
        job = shim_build.Job(out=out, make_command=_fake(counter, seconds=0.1))
        assert left.exists()
    assert job.wait() == out
    assert left.exists()
    out.unlink()
    assert shim_build.Job(out=out, make_command=_fake(counter, seconds=0.1)).wait() == out
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so") == ["lib.so"]


def test_cancel_stops_the_child_and_everything_it_started(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    job = shim_build.Job(out=tmp_path / "lib.so", make_command=_fake(counter, seconds=1.5))
    time.sleep(0.5)
    job.cancel()
    assert job.child.proc.poll() is not None
    time.sleep(2.5)  # the stand-in compiler, in the child's session, would have finished by now
    assert not counter.exists() and not (tmp_path / "lib.so").exists() and not job.tmp.exists()


@pytest.mark.parametrize("background", [True, False])
def test_a_background_compiler_runs_idle(tmp_path: Path, background: bool) -> None:
    """A background build's compiler runs nice-r and, on Linux, under SCHED_IDLE; a foreground one as the program."""
    out, tmp = tmp_path / "lib.so", tmp_path / "lib.so.tmp"
    probe = ("import os, sys; print(os.sched_getscheduler(0), os.nice(0), "
             "open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') else -1); "
             "open(sys.argv[1], 'w').write('built')")
    code, log = detached.locked_compile([sys.executable, "-c", probe, str(tmp)], out, tmp, background).wait()
    assert code == 0 and out.read_text() == "built", log
    policy, nice, group_nice = (int(v) for v in log.split())
    idle = getattr(os, "SCHED_IDLE", None)
    if background:
        assert nice == os.nice(0) + detached.BACKGROUND_NICENESS
        if idle is not None:
            assert policy == idle
        assert group_nice in (19, -1)  # its session's scheduler group too, where Linux has autogroups
    else:
        assert (nice, policy) == (os.nice(0), os.sched_getscheduler(0))


def _probe_entry(tmp_path: Path, name: str) -> Any:
    """A CEntry whose child builds module *name*'s ENTRY: it prints its scheduling and writes ``lib.so``."""
    from opbridge.call import c_entry

    (tmp_path / f"{name}.py").write_text(
        "import os, pathlib\nclass _E:\n    def build(self):\n        print(os.sched_getscheduler(0), os.nice(0))\n"
        f"        out = pathlib.Path({str(tmp_path / 'lib.so')!r}); out.write_text('built')\n"
        "        return out, None\nENTRY = _E()\n")

    def spec() -> Any:
        raise AssertionError("the program looked the library up in its own cache")

    return c_entry.CEntry("a probe", name, spec=spec, load=lambda p: p, enabled=lambda: True, fallback="nothing")


def test_a_c_entry_child_runs_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C entries' background child lowers itself the same way before it builds its ENTRY."""
    entry = _probe_entry(tmp_path, "probe_idle")
    monkeypatch.setattr(detached, "python_env", lambda: dict(os.environ, PYTHONPATH=str(tmp_path)))
    code, log = entry.start_child().wait()
    assert code == 0, log
    policy, nice = (int(v) for v in log.splitlines()[0].split())
    assert nice == os.nice(0) + detached.BACKGROUND_NICENESS
    assert policy == getattr(os, "SCHED_IDLE", policy)


def test_a_background_entry_loads_what_its_child_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program loads the library its child names, not its own cache's lookup, which a changed
    OPBRIDGE_CACHE_DIR (a test's, while an idle build outlived the test that started it) would miss."""
    entry = _probe_entry(tmp_path, "probe_built")
    monkeypatch.setattr(detached, "python_env", lambda: dict(os.environ, PYTHONPATH=str(tmp_path)))
    entry._background(entry.start_child())
    assert entry.lib == tmp_path / "lib.so" and not entry.failed


@pytest.mark.parametrize("installed", [True, False], ids=["that build installs it", "that build fails"])
@pytest.mark.filterwarnings("ignore:opbridge. nothing. a probe could not be built:RuntimeWarning")
def test_a_c_entry_build_in_flight_elsewhere_is_waited_for_not_started_again(
        installed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """While another process holds the entry's build lock, a program starts no builder of its own: it waits for
    that build and loads its result; only where that build installed nothing does it build itself."""
    import fcntl
    import threading

    from opbridge import ops
    from opbridge.build import compile as bcompile
    from opbridge.build import jit
    from opbridge.call import c_entry

    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OPBRIDGE_NO_PROGRESS", raising=False)
    src = tmp_path / "k.cc"
    src.write_text("int k() { return 1; }\n")
    spec = bcompile.BuildSpec(name="probe_entry", sources=(src,))
    assert not jit.in_flight(spec)
    lock = jit._lock(jit._entry_dir(spec))
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another build's lock (flock is per open file: this process counts)
    assert jit.in_flight(spec)
    entry = c_entry.CEntry("a probe", "probe_join", spec=lambda: spec, load=lambda p: p, enabled=lambda: True,
                           fallback="nothing")
    started: list[int] = []

    def start_child() -> Any:
        started.append(1)
        raise OSError("not started in this test")

    monkeypatch.setattr(entry, "start_child", start_child)
    monkeypatch.setattr(entry, "awaited", lambda: tmp_path / "lib.so" if installed else None)
    ready = threading.Event()
    entry.when_ready(ops.add.opdef, lambda lib: ready.set())
    assert "a probe is being built in the background by another process" in capsys.readouterr().err
    os.close(fd)
    assert entry.builder is not None
    entry.builder.join(10)
    if installed:  # loaded what the other build installed, started nothing
        assert started == [] and ready.is_set() and entry.lib == tmp_path / "lib.so"
    else:  # that build installed nothing: this program started its own (here: failing to start)
        assert started == [1] and entry.failed and not ready.is_set()


def test_numpy_entry_built_in_the_background_lands_after_the_program_exits(tmp_path: Path) -> None:
    """The real thing: a program that asks for NumPy's C entry and exits at once still leaves it cached."""
    cache = tmp_path / "cache"
    env = dict(os.environ, OPBRIDGE_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("OPBRIDGE_NUMPY_NATIVE", None)
    code = ("from opbridge import ops; from opbridge.adapters.numpy import native; "
            "native.when_ready(ops.add.opdef, lambda lib: None); print(native.loaded() is None)")
    got = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    assert got.stdout.split() == ["True"]  # exited before the entry was built
    built = cache / "jit"
    end = time.monotonic() + 120
    while time.monotonic() < end and not list(built.glob("opbridge_numpy_entry-*/*.so")):
        time.sleep(0.2)
    assert list(built.glob("opbridge_numpy_entry-*/*.so")), "NumPy's C entry never reached the cache"
    again = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    assert again.stdout.split() == ["False"]  # the next process loads it at once


def test_a_library_cut_short_is_not_installed_and_is_built_again(tmp_path: Path) -> None:
    """locked_compile records the output's size beside it; a truncated output (it crashed the loading process
    with SIGBUS) or an empty one is not installed(), and the next locked_compile builds it again."""
    payload = tmp_path / "payload.bin"
    payload.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    out = tmp_path / "lib.so"

    def compile_once() -> None:
        tmp = tmp_path / "tmp.so"
        code, log = detached.locked_compile(["cp", str(payload), str(tmp)], out, tmp, background=False).wait()
        assert code == 0, log

    compile_once()
    assert detached.installed(out) and out.read_bytes() == payload.read_bytes()
    with open(out, "r+b") as f:
        f.truncate(100)
    assert not detached.installed(out)
    compile_once()
    assert detached.installed(out) and out.read_bytes() == payload.read_bytes()
    Path(f"{out}.bytes").unlink()  # as a build before sizes were recorded left it
    assert detached.installed(out)
    out.write_bytes(b"")
    assert not detached.installed(out)
