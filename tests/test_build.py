"""The JIT build: content-hashed cache keys, private cache, crash-safe locks, errors."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import opbridge
import opbridge._version
from opbridge import loader
from opbridge.build import cache, jit
from opbridge.build import compile as bcompile
from opbridge.build import ninja as bninja

SCALE_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void scale_cpu(TensorView out, TensorView x, double alpha) {
  OPB_CHECK_DTYPE("scale", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("scale", out, x);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * float(alpha);
}
OPBRIDGE_EXPORT(scale_cpu);
"""


def _spec(tmp_path: Path, text: str = SCALE_CC, name: str = "scale") -> bcompile.BuildSpec:
    src = tmp_path / f"{name}.cc"
    src.write_text(text)
    return bcompile.BuildSpec(name=name, sources=(src,))


def test_cache_key_hashes_contents_not_paths_or_mtimes(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    key = bcompile.fingerprint(spec)
    os.utime(spec.sources[0], (0, 0))
    assert bcompile.fingerprint(spec) == key, "mtime must not change the key"
    other = tmp_path / "elsewhere"
    other.mkdir()
    moved = _spec(other)
    assert bcompile.fingerprint(moved) == key, "the same contents elsewhere must share the key"
    spec.sources[0].write_text(SCALE_CC + "\n// changed\n")
    assert bcompile.fingerprint(spec) != key, "new contents must change the key"
    flagged = bcompile.BuildSpec(name="scale", sources=moved.sources, cflags=("-DFOO",))
    assert bcompile.fingerprint(flagged) != key, "flags must change the key"


def test_cuda_flags_reach_nvcc_and_key_cuda_builds_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # OPBRIDGE_CUDA_FLAGS: a launch policy tried in the product's kernels (-DOPB_RMS_NORM_STAGES=3)
    # builds its own module beside the default one, and CPU modules are untouched
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}\n")
    cuda = bcompile.BuildSpec(name="k", sources=(src,), device="cuda")
    cpu = _spec(tmp_path)
    monkeypatch.delenv("OPBRIDGE_CUDA_FLAGS", raising=False)
    keys = bcompile.fingerprint(cuda), bcompile.fingerprint(cpu)
    monkeypatch.setenv("OPBRIDGE_CUDA_FLAGS", "-DOPB_RMS_NORM_STAGES=3 '-DNAME=a b'")
    assert bcompile._default_flags(cuda)[1][-2:] == ["-DOPB_RMS_NORM_STAGES=3", "-DNAME=a b"]
    assert bcompile.fingerprint(cuda) != keys[0] and bcompile.fingerprint(cpu) == keys[1]
    monkeypatch.setenv("OPBRIDGE_CUDA_FLAGS", "-DX='unclosed")
    with pytest.raises(ValueError, match="OPBRIDGE_CUDA_FLAGS must split as shell words"):
        bcompile.fingerprint(cuda)


def test_cxx_flags_reach_every_compile_and_link_and_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # OPBRIDGE_CXX_FLAGS: a sanitizer build (-fsanitize=... on the compile and the link) gets its own module
    spec = _spec(tmp_path)
    monkeypatch.delenv("OPBRIDGE_CXX_FLAGS", raising=False)
    key = bcompile.fingerprint(spec)
    monkeypatch.setenv("OPBRIDGE_CXX_FLAGS", "-fsanitize=undefined '-DNAME=a b'")
    compile_cmd = bcompile.compile_command(spec, spec.sources[0])
    assert compile_cmd[-4:-2] == ["-fsanitize=undefined", "-DNAME=a b"], compile_cmd  # after ours: they win
    link = bcompile.link_command(spec, [tmp_path / "a.o"], tmp_path / "m.so")
    assert "-fsanitize=undefined" in link
    assert bcompile.fingerprint(spec) != key
    monkeypatch.setenv("OPBRIDGE_CXX_FLAGS", "-DX='unclosed")
    with pytest.raises(ValueError, match="OPBRIDGE_CXX_FLAGS must split as shell words"):
        bcompile.fingerprint(spec)


def test_cache_key_covers_headers_beside_the_sources(tmp_path: Path) -> None:
    # `#include "x.h"` finds x.h beside the including file, in no include directory; the key
    # must cover it, and what it includes in turn, or an edit would load the old module.
    (tmp_path / "sub").mkdir()
    (tmp_path / "scale.h").write_text('#include "sub/more.h"\n#define SCALE_H 1\n')
    (tmp_path / "sub" / "more.h").write_text('#include "../scale.h"\n#define MORE 1\n')  # a cycle: read once
    spec = _spec(tmp_path, '#include "scale.h"\n#include "absent_here.h"\n' + SCALE_CC)
    assert [name for name, _ in bcompile.local_headers(spec)] == ["scale.h", "sub/more.h"]
    key = bcompile.fingerprint(spec)
    (tmp_path / "sub" / "more.h").write_text("#define MORE 2\n")
    assert bcompile.fingerprint(spec) != key, "a header included by a local header must change the key"
    key = bcompile.fingerprint(spec)
    (tmp_path / "scale.h").write_text("#define SCALE_H 2\n")
    assert bcompile.fingerprint(spec) != key, "a header beside the source must change the key"


def test_cache_key_covers_headers_toolchain_and_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "helper.h").write_text("#define HELPER 1\n")
    src = tmp_path / "s.cc"
    src.write_text(SCALE_CC)
    spec = bcompile.BuildSpec(name="s", sources=(src,), include_dirs=(inc,))
    key = bcompile.fingerprint(spec)
    (inc / "helper.h").write_text("#define HELPER 2\n")
    assert bcompile.fingerprint(spec) != key, "an included header's contents must change the key"
    key = bcompile.fingerprint(spec)
    monkeypatch.setattr(bcompile, "toolchain_fingerprint", lambda device: "another compiler 99")
    assert bcompile.fingerprint(spec) != key
    monkeypatch.undo()
    monkeypatch.setattr(opbridge._version, "__version__", "9.9.9")
    assert bcompile.fingerprint(spec) != key


def test_cache_dir_is_created_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c" / "opb"
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(root))
    assert cache.cache_root() == root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_refuses_group_writable_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(root))
    with pytest.raises(opbridge.CacheSecurityError, match="group- or world-writable"):
        cache.cache_root()
    with pytest.raises(PermissionError):  # the built-in base class works too
        jit.build(_spec(tmp_path))


@pytest.mark.skipif(os.getuid() != 0, reason="changing a directory's owner needs root")
def test_refuses_cache_dir_owned_by_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(root))
    with pytest.raises(opbridge.CacheSecurityError, match="owned by uid 65534"):
        cache.cache_root()


def test_a_cache_dir_its_owner_cannot_write_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a PermissionError from the first mkdir inside it, at the first op call. (This machine's tests run
    as root, whom no mode stops, so the directory's access check answers for a user it would stop.)"""
    root = tmp_path / "read-only"
    root.mkdir(mode=0o500)
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(root))
    monkeypatch.setattr(cache.os, "access", lambda path, mode: Path(path) != root)
    with pytest.raises(opbridge.CacheError, match=f"cannot write to the cache directory {root}"):
        cache.cache_root()
    assert cache.cache_root(create=False) == root  # looking (doctor, housekeeping) still works


def test_build_then_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec(tmp_path)
    assert jit.cached_artifact(spec) is None
    so = jit.build(spec)
    assert so.is_file() and (so.parent / "manifest.json").is_file()
    assert jit.cached_artifact(spec) == so
    t0 = time.perf_counter()
    assert jit.build(spec) == so
    assert time.perf_counter() - t0 < 5  # a hit never recompiles (generous bound: no ninja run)
    assert loader.exports(so) == ["scale_cpu"]


def test_compile_error_raises_build_error_with_file_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    broken = SCALE_CC.replace("float(alpha);", "float(alpha)  // missing semicolon\n  int y = ;")
    spec = _spec(tmp_path, broken, name="broken")
    with pytest.raises(opbridge.BuildError) as info:
        jit.build(spec)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "broken.cc" in err.command
    assert err.errors and all("broken.cc:" in e for e in err.errors), err.errors
    assert "first errors" in str(err)
    assert jit.cached_artifact(spec) is None, "a failed build must cache nothing"
    entries = list((tmp_path / "cache" / "jit").iterdir())
    assert [e.name for e in entries] == ["locks"], f"no partial artifact may remain: {entries}"


def test_lock_is_released_when_holder_is_killed(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from opbridge.build.cache import file_lock
            with file_lock(Path({str(lock)!r})):
                print("held", flush=True)
                time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    got = threading.Event()

    def take() -> None:
        with cache.file_lock(lock):
            got.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not got.wait(0.5), "the lock must be exclusive while its holder lives"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    assert got.wait(10), "a killed holder's lock must be released by the kernel"


def test_killed_build_leaves_no_hang_and_no_partial_entry(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    src = tmp_path / "slow.cc"
    src.write_text(SCALE_CC.replace("scale", "slow"))
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(cache_dir), "OPBRIDGE_NO_PROGRESS": "1"}
    script = textwrap.dedent(f"""
        from pathlib import Path
        from opbridge.build import compile as c, jit
        jit.build(c.BuildSpec(name="slow", sources=(Path({str(src)!r}),)))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(cache_dir.glob("jit/.slow-*tmp-*")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run([sys.executable, "-c", script + "\nprint('built')"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "built" in done.stdout
    manifests = list(cache_dir.glob("jit/slow-*/manifest.json"))
    assert len(manifests) == 1


def test_progress_is_shown_for_builds_over_a_second(tmp_path: Path) -> None:
    src = tmp_path / "p.cc"
    src.write_text(SCALE_CC.replace("scale", "prog"))
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("OPBRIDGE_NO_PROGRESS", None)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from opbridge.build import compile as c, jit
        jit.build(c.BuildSpec(name="prog", sources=(Path({str(src)!r}),)))
    """)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "opbridge: building prog (cpu)" in res.stderr
    assert "done in" in res.stderr


def test_builds_at_once_share_one_progress_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal, two builds running at once draw one status line (the first shown draws both; which is
    first depends on when each one's thread runs: CI19 drew the inner one first)."""
    import io
    import time

    from opbridge.build.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with Progress("lib", True) as one:
        one.status = "1/3 compiled"
        with Progress("shim", True) as two:
            two.status = "compiling shim.cc"
            time.sleep(1.6)
        time.sleep(0.4)
    text = term.getvalue()
    both = [d for d in text.split("\r") if d.startswith("opbridge: building ") and " | building " in d]
    assert any("building lib: 1/3 compiled" in d and "building shim: compiling shim.cc" in d for d in both), text
    assert "opbridge: building shim: done in" in text and "opbridge: building lib: done in" in text
    assert not Progress._shown


def test_native_entries_build_beside_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """natives.start builds the shim on a daemon thread while the caller goes on; results() builds the C entries
    in the caller's thread, one after the other, then waits for the shim, and answers in SERVES' order."""
    from opbridge.aot import natives

    release = threading.Event()
    order: list[tuple[str, bool]] = []

    def build(label: str) -> natives.Built:
        if label == "torch native kernels":
            release.wait(10)
        order.append((label, threading.current_thread() is threading.main_thread()))
        return natives.Built(label, Path(label), 0.0)

    monkeypatch.setattr(natives, "_build", build)
    building = natives.Building(list(natives.SERVES))
    time.sleep(0.2)
    assert order == []  # the shim's thread waits; the C entries wait for results()
    threading.Timer(0.3, release.set).start()
    assert [b.label for b in building.results()] == list(natives.SERVES)
    assert order == [("NumPy C entry", True), ("tensor C entry", True), ("torch native kernels", False)]


def test_ctrl_c_in_opbridge_build_exits_at_once(tmp_path: Path) -> None:
    """An interrupted `opbridge build` exits at once and says only that it was interrupted: it waits neither
    for the shim's compile (about 30 s here, on a daemon thread) nor for a library compile its compile
    threads started after the signal (toolchain.CompilerGroup)."""
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache"), "OPBRIDGE_NO_PROGRESS": "1",
           # every import compiled from source, as in a fresh environment: the shim's thread then holds the
           # GIL for seconds importing torch, and the compile threads start compilers after the signal
           # before the main thread sees it
           "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    # All threads' stacks on SIGUSR1, for a run that does not exit. SIGINT as a terminal's foreground job has
    # it: a test run started in the background (`cmd &` from a script) ignores it, and so would the build
    # (CI15, CI16, CI19 and CI20 timed out on that alone).
    code = ("import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv = ['opbridge', 'build']; runpy.run_module('opbridge', run_name='__main__')")
    # In a session of its own, as a terminal's foreground job: Ctrl-C reaches the program (its compilers run
    # in sessions of their own, which it stops; the shim's detached builder finishes by design).
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    cache, end = tmp_path / "cache", time.monotonic() + 120
    while not (cache / "objects" / "gen").exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.1)  # until the library's build writes its units (a fresh clone's imports take a while)
    time.sleep(1)  # compiling by now: the library, and the shim beside it
    try:  # which signals it ignores and catches (a bit mask, SIGINT's bit 2), for a run that does not exit
        masks = [ln for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ln.startswith("Sig")]
    except OSError:
        masks = []
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running 30 s after SIGINT ({'; '.join(masks)}); its threads:\n{err[-6000:]}")
    waited = time.monotonic() - sent
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "opbridge: interrupted", err
    assert waited < 8, f"exited {waited:.1f} s after SIGINT"  # 0.3-0.6 s here; a wait for a compile took 7-17


def test_a_stopped_compiler_group_kills_its_compilers_and_starts_none() -> None:
    """CompilerGroup.stop ends a running compiler at once and refuses the next, which a build's compile
    thread may start after a Ctrl-C its caller has not yet seen."""
    from opbridge.build.toolchain import CompilerGroup, GroupStoppedError, run_compiler

    group = CompilerGroup()
    assert run_compiler(["sh", "-c", "echo out; echo err >&2"], group).stdout == "out\n"
    result: list[subprocess.CompletedProcess[str]] = []
    worker = threading.Thread(target=lambda: result.append(run_compiler(["sleep", "60"], group)))
    start = time.monotonic()
    worker.start()
    while not group._running and time.monotonic() - start < 10:
        time.sleep(0.01)
    group.stop()
    worker.join(10)
    assert not worker.is_alive() and result[0].returncode == -9, result
    assert time.monotonic() - start < 10
    with pytest.raises(GroupStoppedError):
        run_compiler(["true"], group)


def test_an_interrupted_build_stops_its_compilers(tmp_path: Path) -> None:
    """Ctrl-C during a build's compiles: the build raises at once, and no compiler it started runs on,
    whether it had started (and held its output pipe in a child of its own) or was about to start."""
    from opbridge.build import incremental
    from opbridge.build.objects import Unit
    from opbridge.build.progress import Progress
    from opbridge.build.toolchain import CompilerGroup, run_compiler

    pids = tmp_path / "pids"

    class Store:  # each compile runs a shell whose child holds the pipe, as a compiler driver's cc1plus does
        def compile(self, unit: Unit, obj: Path, group: CompilerGroup) -> float:
            run_compiler(["sh", "-c", f"sleep 60 & echo $! >> {pids}; wait"], group)
            return 60.0

    missing = [(Unit(tmp_path / f"u{i}.cc", ("c++",), "t"), tmp_path / f"u{i}.o") for i in range(4)]
    main = threading.main_thread().ident
    assert main is not None
    # As a terminal's Ctrl-C, which the kernel may hand to any thread (here a compile thread's): the
    # build's wait must see it all the same. (A test run started in the background ignores SIGINT: Python's
    # handler here.)
    workers: list[int | None] = []
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt() -> None:
        workers[:] = [t.ident for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")]
        signal.pthread_kill(workers[0] if workers and workers[0] else main, signal.SIGINT)

    threading.Timer(1.0, interrupt).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            incremental._compile_all(missing, Store(), incremental.BuildReport(),  # type: ignore[arg-type]
                                     Progress("lib", False))
    finally:
        signal.signal(signal.SIGINT, old_handler)
    assert workers, "the signal went to a compile thread"
    assert time.monotonic() - start < 10
    started = [int(p) for p in pids.read_text().split()]
    assert started  # the compiles had started; none of their children lives on
    time.sleep(0.2)
    for pid in started:  # gone, or a zombie its new parent has not reaped yet
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            continue
        assert state == "Z", (pid, state)


def test_a_failed_unit_lets_the_running_compiles_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One unit does not compile: the build fails, but compiles already running finish (their objects are
    stored for the next build); only Ctrl-C stops them."""
    from opbridge.build import incremental
    from opbridge.build.objects import CompileError, Unit
    from opbridge.build.progress import Progress
    from opbridge.build.toolchain import CompilerGroup, run_compiler

    monkeypatch.setenv("OPBRIDGE_MAX_JOBS", "2")
    done = tmp_path / "slow.done"

    class Store:
        def compile(self, unit: Unit, obj: Path, group: CompilerGroup) -> float:
            if unit.name == "bad.cc":
                time.sleep(0.3)  # the slow unit's compiler is running by now
                raise CompileError(["c++", "bad.cc"], "bad.cc:1:1: error: expected ';'")
            run_compiler(["sh", "-c", f"sleep 1.5; touch {done}"], group)
            return 1.5

    missing = [(Unit(tmp_path / n, ("c++",), "t"), tmp_path / f"{n}.o") for n in ("slow.cc", "bad.cc")]
    with pytest.raises(opbridge.BuildError, match=r"bad\.cc did not compile"):
        incremental._compile_all(missing, Store(), incremental.BuildReport(),  # type: ignore[arg-type]
                                 Progress("lib", False))
    assert done.exists()


def test_nothing_is_compiled_at_import(tmp_path: Path) -> None:
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}
    code = "import opbridge, opbridge.ops, sys; print(opbridge.ops.add.schema); print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["add(Tensor x, Tensor y) -> Tensor", "False"]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.so"))


def test_unknown_device_says_there_is_no_toolchain() -> None:
    from opbridge import ops

    with pytest.raises(opbridge.BackendUnavailableError, match="no toolchain for device 'npu'"):
        loader.build_spec(ops.LIBRARY, "npu")


def test_library_exports_every_declared_kernel() -> None:
    from opbridge import ops

    path = loader.loaded_path(ops.LIBRARY, "cpu")
    declared = sorted(op.kernels["cpu"] for op in ops.LIBRARY.ops.values())
    assert sorted(loader.exports(path)) == declared


def test_cache_key_does_not_depend_on_install_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path)
    key = bcompile.fingerprint(spec)
    _, lib = bcompile._tvm_ffi_paths()
    moved = ([str(tmp_path / "venv2" / "include"), str(tmp_path / "venv2" / "dlpack")],
             tmp_path / "venv2" / "lib" / lib.name)
    monkeypatch.setattr(bcompile, "_tvm_ffi_paths", lambda: moved)
    assert bcompile.fingerprint(spec) == key, "another virtualenv with the same tvm-ffi must share the cache"


# -- the per-translation-unit object store ------------------------------------


def _multi_lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bcompile.BuildSpec, Path]:
    """A three-source library over an include dir: a.cc includes common.h, b.cc nested.h
    (which includes common.h), c.cc nothing. Plain C++ (no opbridge.h): compiles in a blink."""
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OPBRIDGE_NO_PROGRESS", "1")
    src, inc = tmp_path / "src", tmp_path / "inc"
    src.mkdir()
    inc.mkdir()
    (inc / "common.h").write_text("inline int common() { return 1; }\n")
    (inc / "nested.h").write_text("#include <common.h>\ninline int nested() { return common() + 1; }\n")
    (src / "a.cc").write_text('#include "common.h"\nOPB_TEST_API int a_fn() { return common(); }\n')
    (src / "b.cc").write_text('#include <nested.h>\nOPB_TEST_API int b_fn() { return nested(); }\n')
    (src / "c.cc").write_text('OPB_TEST_API int c_fn() { return 3; }\n')
    spec = bcompile.BuildSpec(name="multi", sources=tuple(src / n for n in ("a.cc", "b.cc", "c.cc")),
                              include_dirs=(inc,), cflags=(VISIBLE,))
    return spec, src


def _built(spec: bcompile.BuildSpec, force: bool = False) -> dict[str, list[str]]:
    """Build *spec*; return which units the build compiled and which it reused."""
    import json

    so = jit.build(spec, force=force)
    manifest = json.loads((so.parent / "manifest.json").read_text())
    return {"compiled": sorted(manifest["compiled"]), "reused": sorted(manifest["reused"])}


def _call(so: Path, fn: str) -> int:
    from opbridge._tvm import load_library

    return int(load_library(so)[fn]())


#: The translation units every module gets beside its sources (export list; checks and typed calls).
GENERATED = ["_opbridge_exports.cc", "_opbridge_runtime.cc"]
ALL_UNITS = [*GENERATED, "a.cc", "b.cc", "c.cc"]
#: Test sources mark their functions OPB_TEST_API: exported although modules build with -fvisibility=hidden.
VISIBLE = '-DOPB_TEST_API=extern "C" __attribute__((visibility("default")))'


def test_editing_one_source_recompiles_only_its_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, src = _multi_lib(tmp_path, monkeypatch)
    assert _built(spec) == {"compiled": ALL_UNITS, "reused": []}
    first = jit.build(spec)
    (src / "b.cc").write_text('#include <nested.h>\nOPB_TEST_API int b_fn() { return nested() * 10; }\n')
    assert _built(spec) == {"compiled": ["b.cc"], "reused": [*GENERATED, "a.cc", "c.cc"]}
    so = jit.build(spec)
    assert (_call(so, "a_fn"), _call(so, "b_fn"), _call(so, "c_fn")) == (1, 20, 3)
    # Undoing the edit finds the first module again (the whole-library cache): nothing compiles.
    (src / "b.cc").write_text('#include <nested.h>\nOPB_TEST_API int b_fn() { return nested(); }\n')
    assert jit.build(spec) == first


def test_force_compiles_every_unit_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`opbridge build --force` (jit.build(force=True)) recompiles; it only relinked cached objects."""
    spec, _ = _multi_lib(tmp_path, monkeypatch)
    _built(spec)
    assert _built(spec, force=True) == {"compiled": ALL_UNITS, "reused": []}
    assert _call(jit.build(spec), "c_fn") == 3


def test_header_edit_recompiles_exactly_its_includers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = _multi_lib(tmp_path, monkeypatch)
    _built(spec)
    inc = spec.include_dirs[0]
    (inc / "common.h").write_text("inline int common() { return 5; }\n")
    assert _built(spec)["compiled"] == ["a.cc", "b.cc"], "a.cc includes it, b.cc through nested.h"
    (inc / "nested.h").write_text("#include <common.h>\ninline int nested() { return common() + 2; }\n")
    assert _built(spec)["compiled"] == ["b.cc"]
    so = jit.build(spec)
    assert (_call(so, "a_fn"), _call(so, "b_fn")) == (5, 7)


def test_damaged_or_half_written_object_is_never_linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge.build import incremental, objects

    spec, src = _multi_lib(tmp_path, monkeypatch)
    _built(spec)
    store = objects.ObjectStore()
    by_name = {u.name: u for u in incremental.units(spec, store)}
    damaged = store.stored_object(by_name["a.cc"])
    half = store.stored_object(by_name["b.cc"])
    assert damaged is not None and damaged.is_file() and half is not None and half.is_file()
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated after it was stored
    half.with_suffix(".sha256").unlink()  # as if killed between the object and its digest
    (src / "c.cc").write_text('OPB_TEST_API int c_fn() { return 4; }\n')  # the library misses
    assert _built(spec) == {"compiled": ["a.cc", "b.cc", "c.cc"], "reused": GENERATED}
    so = jit.build(spec)
    assert (_call(so, "a_fn"), _call(so, "b_fn"), _call(so, "c_fn")) == (1, 2, 4)
    assert not list(store.tmp.iterdir()), "no temporary file may be left behind"


def test_compile_failure_stores_nothing_for_that_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, src = _multi_lib(tmp_path, monkeypatch)
    (src / "c.cc").write_text('OPB_TEST_API int c_fn() { return 3 }\n')
    with pytest.raises(opbridge.BuildError) as info:
        jit.build(spec)
    assert "c.cc" in info.value.command and any("c.cc:" in e for e in info.value.errors)
    (src / "c.cc").write_text('OPB_TEST_API int c_fn() { return 3; }\n')
    built = _built(spec)
    assert "c.cc" in built["compiled"]
    assert set(built["compiled"]) | set(built["reused"]) == set(ALL_UNITS)


def test_prune_removes_least_recently_used_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge.build import objects

    spec, _ = _multi_lib(tmp_path, monkeypatch)
    _built(spec)
    store = objects.ObjectStore()
    stored = sorted(store.root.glob("??/*.o"))
    assert len(stored) == len(ALL_UNITS)
    assert store.prune() == 0, "within the default bounds nothing goes"
    old = stored[0]
    os.utime(old, (1, 1))
    size = old.stat().st_size
    assert store.prune(max_bytes=sum(p.stat().st_size for p in stored) - 1) == size
    assert not old.exists() and not old.with_suffix(".sha256").exists()
    assert all(p.exists() for p in stored[1:])
    assert store.prune(max_age_s=0) > 0 and not list(store.root.glob("??/*.o"))


def test_concurrent_builds_share_the_store(tmp_path: Path) -> None:
    """Two processes building libraries with the same sources at once both succeed."""
    shared = tmp_path / "shared.cc"
    shared.write_text('OPB_TEST_API int shared_fn() { return 7; }\n')
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache"), "OPBRIDGE_NO_PROGRESS": "1"}
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from opbridge._tvm import load_library
        from opbridge.build import compile as c, jit
        so = jit.build(c.BuildSpec(name=sys.argv[1], sources=(Path({str(shared)!r}),), cflags=({VISIBLE!r},)))
        print(load_library(so).shared_fn())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, name], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("lib_one", "lib_two")]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip() == "7"
    assert len(list((tmp_path / "cache" / "objects").glob("??/*.o"))) == 1 + len(GENERATED)  # shared.cc once


def test_depfile_parsing() -> None:
    from opbridge.build.objects import parse_depfile

    text = "obj/a.o: /s/a.cc /inc/x.h \\\n /inc/with\\ space.h \\\n  /inc/y.h\n"
    assert parse_depfile(text) == ["/s/a.cc", "/inc/x.h", "/inc/with space.h", "/inc/y.h"]
    assert parse_depfile("") == []


def test_aot_ninja_build_dir_still_works(tmp_path: Path) -> None:
    """The AOT path's own build dir: ninja, with the same compile commands and depfiles."""
    spec = _spec(tmp_path)
    bdir = tmp_path / "bd"
    (bdir / "obj").mkdir(parents=True)
    out = bdir / "scale.so"
    bninja.write_ninja(spec, bdir, out)
    bninja.run_ninja(spec, bdir)
    assert loader.exports(out) == ["scale_cpu"]
    first = out.stat().st_mtime_ns
    bninja.run_ninja(spec, bdir)
    assert out.stat().st_mtime_ns == first, "an up-to-date build dir relinks nothing"


# -- JIT builds for this CPU ---------------------------------------------------


def _patch_native(monkeypatch: pytest.MonkeyPatch, ident: str) -> None:
    from opbridge.build import incremental, isa

    for mod in (isa, bcompile, incremental):
        monkeypatch.setattr(mod, "native_isa_id", lambda: ident)


def test_jit_builds_for_this_cpu_and_aot_builds_stay_portable(monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge.build.library import aot_spec, build_spec
    from opbridge.ops import LIBRARY

    _patch_native(monkeypatch, "-march=znver3 -mavx2")
    jit_spec, wheel_spec = build_spec(LIBRARY, "cpu"), aot_spec(LIBRARY, "cpu")
    src = jit_spec.sources[0]
    assert {"-march=native", "-DOPB_NATIVE_ISA"} <= set(bcompile.compile_command(jit_spec, src))
    assert "-march=native" not in bcompile.compile_command(wheel_spec, src), "a wheel runs on any x86-64"
    assert "-DOPB_NATIVE_ISA" not in bcompile.compile_command(wheel_spec, src)
    _patch_native(monkeypatch, "")  # a compiler that cannot say what native means: the portable build
    assert "-march=native" not in bcompile.compile_command(jit_spec, src)


def test_native_builds_are_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache shared by two machines: the module and every object differ by what native resolves to."""
    from opbridge.build import incremental, objects

    src = tmp_path / "k.cc"
    src.write_text("int k() { return 1; }\n")
    spec = bcompile.BuildSpec(name="k", sources=(src,), native_isa=True)
    store = objects.ObjectStore(tmp_path / "store")
    keys = {}
    for cpu in ("-march=znver3 -mavx2", "-march=sapphirerapids -mavx512f"):
        _patch_native(monkeypatch, cpu)
        unit = incremental.units(spec, store)[0]
        keys[cpu] = (bcompile.fingerprint(spec), store.base_key(unit))
    (fp_a, obj_a), (fp_b, obj_b) = keys.values()
    assert fp_a != fp_b and obj_a != obj_b
    portable = bcompile.BuildSpec(name="k", sources=(src,))
    assert bcompile.fingerprint(portable) == bcompile.fingerprint(portable), "stable"
    assert bcompile.fingerprint(portable) not in (fp_a, fp_b)


def test_native_isa_id_names_the_cpu() -> None:
    import platform

    from opbridge.build import isa

    ident = isa.native_isa_id()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert ident == ""
    else:
        assert "-march=" in ident or "target-cpu" in ident, ident
        assert "native" not in ident, "the resolved CPU, not the flag"
