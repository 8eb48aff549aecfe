"""The build cache's housekeeping: ``opbridge cache info|prune`` and the size bound after builds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from opbridge.build import compile as bcompile
from opbridge.build import housekeeping, jit
from opbridge.build.cache import file_lock
from opbridge.cli import main

#: Test sources mark their functions OPB_TEST_API: exported although modules build with -fvisibility=hidden.
VISIBLE = '-DOPB_TEST_API=extern "C" __attribute__((visibility("default")))'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(root))
    monkeypatch.setenv("OPBRIDGE_NO_PROGRESS", "1")
    monkeypatch.delenv("OPBRIDGE_OBJECT_CACHE_MB", raising=False)
    return root


def _module(root: Path, name: str, key: str, size: int, age_s: float) -> Path:
    """A module entry as jit.build leaves it, last used *age_s* ago."""
    entry = root / "jit" / f"{name}-cpu-{key}"
    entry.mkdir(parents=True)
    (entry / f"{name}.so").write_bytes(b"\0" * size)
    (entry / "manifest.json").write_text(json.dumps({"name": name}))
    t = time.time() - age_s
    os.utime(entry / "manifest.json", (t, t))
    return entry


def _object(root: Path, key: str, size: int, age_s: float) -> Path:
    """A stored object and its digest, last used *age_s* ago."""
    obj = root / "objects" / key[:2] / f"{key}.o"
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.write_bytes(b"\1" * size)
    obj.with_suffix(".sha256").write_text("0" * 64)
    t = time.time() - age_s
    os.utime(obj, (t, t))
    return obj


def test_info_counts_modules_and_objects(cache: Path) -> None:
    _module(cache, "lib", "a" * 20, 1000, 100)
    _module(cache, "lib", "b" * 20, 1000, 50)
    _module(cache, "other", "c" * 20, 500, 10)
    _object(cache, "ab" + "0" * 62, 300, 5)
    info = housekeeping.info()
    assert (info.modules, info.objects) == (3, 1)
    assert info.libraries == {"lib-cpu": 2, "other-cpu": 1}
    assert info.module_bytes >= 2500 and info.object_bytes == 300 + 64
    assert info.total_bytes >= info.module_bytes + info.object_bytes


def test_prune_keep_removes_each_librarys_least_recently_used(cache: Path) -> None:
    old = _module(cache, "lib", "a" * 20, 1000, 300)
    new = _module(cache, "lib", "b" * 20, 1000, 100)
    other = _module(cache, "other", "c" * 20, 1000, 400)
    obj = _object(cache, "ab" + "0" * 62, 300, 500)
    report = housekeeping.prune(keep=1, recent_s=0)
    assert [e.path for e in report.removed] == [old]
    assert not old.exists() and new.exists() and other.exists() and obj.exists()


def test_prune_to_a_size_goes_least_recently_used_first_across_kinds(cache: Path) -> None:
    oldest = _module(cache, "lib", "a" * 20, 4000, 400)
    old_obj = _object(cache, "ab" + "0" * 62, 4000, 300)
    newer = _module(cache, "lib", "b" * 20, 4000, 200)
    new_obj = _object(cache, "cd" + "0" * 62, 4000, 100)
    report = housekeeping.prune(max_bytes=9000, recent_s=0)
    assert {e.path for e in report.removed} == {oldest, old_obj}
    assert not old_obj.with_suffix(".sha256").exists(), "the digest goes with its object"
    assert newer.exists() and new_obj.exists()
    assert housekeeping.prune(max_bytes=0, recent_s=0).freed_bytes > 0
    assert housekeeping.info().modules == 0 and housekeeping.info().objects == 0


def test_prune_never_removes_a_locked_recent_or_protected_entry(cache: Path) -> None:
    locked = _module(cache, "lib", "a" * 20, 1000, 1000)
    recent = _module(cache, "lib", "b" * 20, 1000, 5)
    protected = _module(cache, "lib", "c" * 20, 1000, 2000)
    with file_lock(locked.parent / "locks" / (locked.name + ".lock")):
        report = housekeeping.prune(max_bytes=0, protect=protected)
    assert report.removed == [] and report.kept_in_use == 3
    assert locked.exists() and recent.exists() and protected.exists()
    assert [e.path for e in housekeeping.prune(max_bytes=0, recent_s=0).removed] == [protected, locked, recent]


def test_stale_temporaries_of_killed_builds_go(cache: Path) -> None:
    tmp = cache / "jit" / ".lib-cpu-aaaa.tmp-xyz"
    tmp.mkdir(parents=True)
    (tmp / "half.so").write_bytes(b"x")
    fresh = cache / "jit" / ".lib-cpu-bbbb.tmp-xyz"
    fresh.mkdir()
    os.utime(tmp, (1, 1))
    housekeeping.prune()
    assert not tmp.exists() and fresh.exists()


def test_size_bound_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_OBJECT_CACHE_MB", "2.5")
    assert housekeeping.size_bound() == int(2.5 * (1 << 20))
    monkeypatch.setenv("OPBRIDGE_OBJECT_CACHE_MB", "")
    assert housekeeping.size_bound() == 1 << 30
    for bad in ("-1", "0", "lots", "inf"):  # named, as every setting a value of which cannot be read
        monkeypatch.setenv("OPBRIDGE_OBJECT_CACHE_MB", bad)
        with pytest.raises(ValueError, match=f"OPBRIDGE_OBJECT_CACHE_MB must be a positive number \\(of MiB\\), "
                                             f"got '{bad}'"):
            housekeeping.size_bound()


def test_build_touches_its_entry_and_prunes_to_the_bound(cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "a.cc"
    src.write_text("OPB_TEST_API int a_fn() { return 1; }\n")
    spec = bcompile.BuildSpec(name="hk", sources=(src,), cflags=(VISIBLE,))
    first = jit.build(spec).parent
    os.utime(first / "manifest.json", (1000, 1000))
    assert jit.build(spec).parent == first
    assert (first / "manifest.json").stat().st_mtime > 1000, "a cache hit records its use"
    stale = _module(cache, "hk", "z" * 20, 10_000, 3600)
    # A bound smaller than one module: the next build that compiles removes every
    # entry it may (least recently used), never the module it just built.
    monkeypatch.setenv("OPBRIDGE_OBJECT_CACHE_MB", "0.001")
    src.write_text("OPB_TEST_API int a_fn() { return 2; }\n")
    second = jit.build(spec).parent
    assert second != first and second.exists()
    assert not stale.exists()
    assert first.exists(), "used within the last ten minutes: a process may be loading it"
    assert housekeeping.info().objects == 0


def _shim(root: Path, key: str, size: int, age_s: float) -> Path:
    """A torch shim as its build leaves it (library and lock file), last loaded *age_s* ago."""
    entry = root / "torch-native" / key
    entry.mkdir(parents=True)
    lib = entry / "libopbridge_torch_native.so"
    lib.write_bytes(b"\2" * size)
    (entry / "libopbridge_torch_native.so.lock").touch()
    t = time.time() - age_s
    os.utime(lib, (t, t))
    return entry


def test_torch_shims_are_counted_kept_newest_first_and_pruned_unless_building(cache: Path) -> None:
    old = _shim(cache, "a" * 20, 1000, 40 * 86400)
    mid = _shim(cache, "b" * 20, 1000, 300)
    new = _shim(cache, "c" * 20, 1000, 100)
    (cache / "torch-native" / ("c" * 20) / "tmpx1y2.so").write_bytes(b"\3")  # a compile in flight
    info = housekeeping.info()
    assert info.shims == 3 and info.shim_bytes >= 3000 and info.modules == 0
    assert housekeeping.info().as_dict()["shims"] == 3
    report = housekeeping.prune(recent_s=0.0)  # the 30-day age limit
    assert [e.path for e in report.removed] == [old] and mid.exists() and new.exists()
    lock = mid / "libopbridge_torch_native.so.lock"
    with file_lock(lock):  # a build of that shim is running: it stays
        report = housekeeping.prune(keep=1, recent_s=0.0)
    assert report.removed == [] and report.kept_in_use == 1 and mid.exists()
    report = housekeeping.prune(keep=1, recent_s=0.0)
    assert [e.path for e in report.removed] == [mid] and new.exists()


def _old(path: Path, age_s: float = 3600) -> Path:
    path.write_bytes(b"\4" * 100)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_temporaries_of_killed_shim_compiles_go_unless_a_compile_holds_the_lock(
        cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A compile killed mid-way (its detached child included) left its tmp*.so in torch-native/<key>/ for good:
    nothing listed or removed it. A prune now removes one whose directory's build lock is free, never one a
    compile may be writing (lock held) nor one just made (its build has not taken the lock yet)."""
    killed = _old(_shim(cache, "a" * 20, 10, 100) / "tmpk1ll3d.so")
    fresh = _shim(cache, "b" * 20, 10, 100) / "tmpfr3sh.so"
    fresh.write_bytes(b"\4")
    building = _shim(cache, "c" * 20, 10, 100)
    writing = _old(building / "tmpwr1te.so")
    orphan_dir = cache / "torch-native" / ("d" * 20)  # killed before its child made the library or the lock
    orphan_dir.mkdir()
    orphan = _old(orphan_dir / "tmp0rphan.so")
    with file_lock(building / "libopbridge_torch_native.so.lock"):
        assert main(["cache", "prune", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["removed_temporaries"]) == [str(killed), str(orphan)]
    assert not killed.exists() and not orphan.exists() and fresh.exists() and writing.exists()
    assert doc["removed_shims"] == [] and (killed.parent / "libopbridge_torch_native.so").exists()
    assert main(["cache", "prune"]) == 0  # the compile is over: its leftover goes too
    assert "removed 1 temporary file(s) of killed torch shim compiles" in capsys.readouterr().out
    assert not writing.exists() and fresh.exists()


def test_loading_the_torch_shim_records_its_use(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from unittest import mock

    from opbridge.adapters.torch import native

    path = _shim(cache, "d" * 20, 10, 10 * 86400) / "libopbridge_torch_native.so"
    fake = mock.MagicMock()
    fake.opb_has_cuda.return_value = 0
    monkeypatch.setattr(native._tvm, "load_library", lambda p, python_api=False: fake)
    native.Shim(path)
    assert time.time() - path.stat().st_mtime < 60


def test_cli_cache_info_and_prune(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _module(cache, "lib", "a" * 20, 1000, 300)
    new = _module(cache, "lib", "b" * 20, 1000, 100)
    assert main(["cache", "info", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["modules"] == 2 and doc["libraries"] == {"lib-cpu": 2} and doc["bound_bytes"] == 1 << 30
    assert main(["cache", "prune", "--keep", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["removed_modules"] == [str(old)] and not old.exists() and new.exists()
    assert main(["cache", "prune", "--max-mb", "0"]) == 0
    assert "removed 1 built module(s)" in capsys.readouterr().out and not new.exists()
    assert main(["cache", "prune", "--keep", "-1"]) == 2


def test_a_module_cut_short_is_a_miss_and_is_rebuilt(cache: Path, tmp_path: Path) -> None:
    """A truncated .so in an entry (a full disk, a crash) used to be loaded and kill the process with SIGBUS;
    the manifest records the module's size, and an entry whose module differs is rebuilt."""
    src = tmp_path / "t.cc"
    src.write_text("OPB_TEST_API int t_fn() { return 1; }\n")
    spec = bcompile.BuildSpec(name="cut", sources=(src,), cflags=(VISIBLE,))
    so = jit.build(spec)
    size = so.stat().st_size
    assert json.loads((so.parent / "manifest.json").read_text())["bytes"] == size
    with open(so, "r+b") as f:
        f.truncate(1000)
    assert jit.cached_artifact(spec) is None
    assert jit.build(spec) == so and so.stat().st_size == size
    assert jit.cached_artifact(spec) == so
    manifest = json.loads((so.parent / "manifest.json").read_text())
    del manifest["bytes"]  # an entry written before sizes were recorded: accepted, unless empty
    (so.parent / "manifest.json").write_text(json.dumps(manifest))
    assert jit.cached_artifact(spec) == so
    so.write_bytes(b"")
    assert jit.cached_artifact(spec) is None
