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
