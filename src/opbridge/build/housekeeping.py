"""What the build cache holds, and pruning it: least recently used first, never an entry in use.

The cache (``OPBRIDGE_CACHE_DIR``) holds three kinds of entries:

``jit/<library>-<device>-<key>/``
    a whole built module (:mod:`opbridge.build.jit`); its ``manifest.json`` is
    touched each time the entry is used, so its time is the last use.
``objects/<kk>/<key>.o``
    one compiled translation unit (:mod:`opbridge.build.objects`), touched when
    a build links it.
``torch-native/<key>/``
    torch's dispatcher shim for one torch version, Python ABI and tvm-ffi
    (:mod:`opbridge.adapters.torch.native.build`); its library is touched
    each time a process loads it. One per torch version and source revision
    accumulates as they change. A compile killed mid-way leaves its ``tmp*.so``
    there: :func:`remove_shim_temporaries` removes it (in every prune, and before
    each build of the shim).

:func:`prune` removes entries least recently used first until the cache holds
at most a size (``OPBRIDGE_OBJECT_CACHE_MB``, default 1024, after every build
that compiled something; ``opbridge cache prune --max-mb``), keeps each
library's newest builds (``--keep``), and drops what has gone unused for 30
days. A module entry is never removed while its build lock is held (a build or
a prune of it is running) or, by default, within ten minutes of its last use (a
process may be between building a module and loading it). An object may go at
any time: builds use hard links of theirs.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from opbridge import config
from opbridge.build.cache import SHIMS_DIR, build_lock, cache_root
from opbridge.build.objects import MAX_AGE_S, MAX_BYTES, ObjectStore

#: A module entry used this recently survives an automatic prune.
RECENT_S = 600.0
#: A temporary directory this old belongs to a killed build.
_STALE_TMP_S = 3600.0
#: A torch shim's temporary this old, with its directory's build locks free, belongs to a killed compile.
SHIM_TMP_AGE_S = 60.0
_MANIFEST = "manifest.json"


def size_bound() -> int:
    """The most bytes the cache keeps: ``OPBRIDGE_OBJECT_CACHE_MB`` (MiB), default 1024 MiB.

    Read at each call, like every ``OPBRIDGE_*`` setting; a value that is not a
    positive number raises ValueError naming it (:func:`opbridge.config.object_cache_mb`).
    """
    mib = config.object_cache_mb()
    return MAX_BYTES if mib is None else max(1, int(mib * (1 << 20)))


@dataclass(frozen=True)
class Entry:
    """One removable cache entry: a built module's directory or a stored object."""

    kind: str
    """``"module"``, ``"object"`` or ``"shim"``."""
    path: Path
    size: int
    last_used: float
    library: str = ""
    """``<library>-<device>`` for a module entry."""


@dataclass
class CacheInfo:
    """What the cache holds (``opbridge cache info``)."""

    root: Path
    modules: int = 0
    module_bytes: int = 0
    objects: int = 0
    object_bytes: int = 0
    shims: int = 0
    shim_bytes: int = 0
    other_bytes: int = 0
    libraries: dict[str, int] = field(default_factory=dict)
    """Module entries per ``<library>-<device>``."""

    @property
    def total_bytes(self) -> int:
        """Every byte under the cache directory."""
        return self.module_bytes + self.object_bytes + self.shim_bytes + self.other_bytes

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready record."""
        return {"root": str(self.root), "modules": self.modules, "module_bytes": self.module_bytes,
                "objects": self.objects, "object_bytes": self.object_bytes, "shims": self.shims,
                "shim_bytes": self.shim_bytes, "other_bytes": self.other_bytes,
                "total_bytes": self.total_bytes, "bound_bytes": size_bound(), "libraries": self.libraries}


@dataclass
class PruneReport:
    """What :func:`prune` removed and what it left because it was in use."""

    removed: list[Entry] = field(default_factory=list)
    kept_in_use: int = 0
    temporaries: list[Path] = field(default_factory=list)
    """Temporary files of killed torch shim compiles (:func:`remove_shim_temporaries`)."""

    @property
    def freed_bytes(self) -> int:
        """Bytes of the removed entries."""
        return sum(e.size for e in self.removed)


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _library_of(entry_name: str) -> str:
    """``<library>-<device>`` of a module entry's directory name (``<library>-<device>-<key>``)."""
    return entry_name.rsplit("-", 1)[0]


def module_entries(root: Path) -> Iterator[Entry]:
    """The complete module entries under *root*/jit (those with a manifest)."""
    jit = root / "jit"
    if not jit.is_dir():
        return
    for d in jit.iterdir():
        manifest = d / _MANIFEST
        try:
            if d.name.startswith(".") or d.name == "locks" or not manifest.is_file():
                continue
            yield Entry("module", d, _dir_size(d), manifest.stat().st_mtime, _library_of(d.name))
        except OSError:
            continue


def _shim_library(entry_dir: Path) -> Path | None:
    """A shim entry's library (a compile in flight writes a ``tmp*.so`` beside it), if it has one."""
    return next((p for p in entry_dir.glob("*.so") if not p.name.startswith("tmp")), None)


def shim_entries(root: Path) -> Iterator[Entry]:
    """The built torch shims under *root*/torch-native (a directory with its library; last use: its time)."""
    shims = root / SHIMS_DIR
    if not shims.is_dir():
        return
    for d in shims.iterdir():
        try:
            lib = _shim_library(d) if not d.name.startswith(".") else None
            if lib is not None:
                yield Entry("shim", d, _dir_size(d), lib.stat().st_mtime, SHIMS_DIR)
        except OSError:
            continue


def object_entries(root: Path) -> Iterator[Entry]:
    """The stored objects under *root*/objects (each with its digest file, counted in its size)."""
    for obj in (root / "objects").glob("??/*.o"):
        try:
            st = obj.stat()
            digest = obj.with_suffix(".sha256")
            extra = digest.stat().st_size if digest.exists() else 0
            yield Entry("object", obj, st.st_size + extra, st.st_mtime)
        except OSError:
            continue


def info(root: Path | None = None) -> CacheInfo:
    """Count and size what the cache at *root* (default: the configured one) holds."""
    root = root if root is not None else cache_root(create=False)
    out = CacheInfo(root)
    if not root.is_dir():
        return out
    for e in module_entries(root):
        out.modules += 1
        out.module_bytes += e.size
        out.libraries[e.library] = out.libraries.get(e.library, 0) + 1
    for e in object_entries(root):
        out.objects += 1
        out.object_bytes += e.size
    for e in shim_entries(root):
        out.shims += 1
        out.shim_bytes += e.size
    out.other_bytes = max(0, _dir_size(root) - out.module_bytes - out.object_bytes - out.shim_bytes)
    return out


def touch(entry_dir: Path) -> None:
    """Record a use of the module entry *entry_dir* (its manifest's time); never raises."""
    try:
        os.utime(entry_dir / _MANIFEST)
    except OSError:
        pass


def _lock_path(entry: Path) -> Path:
    return entry.parent / "locks" / (entry.name + ".lock")


def _remove_dir(path: Path, lock: Path | None) -> bool:
    """Remove the directory *path* unless someone holds *lock* (its build's ``flock``), never half of it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600) if lock is not None else None
    except OSError:
        return False
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        # Out of sight first (one rename), then deleted: a reader never sees half an entry.
        doomed = path.with_name(f".{path.name}.pruned-{os.getpid()}")
        try:
            os.replace(path, doomed)
        except OSError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def _remove_module(entry: Entry) -> bool:
    """Remove a module entry under its build lock, unless someone holds the lock."""
    lock = _lock_path(entry.path)
    try:
        lock.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    except OSError:
        return False
    return _remove_dir(entry.path, lock)


def _remove_shim(entry: Entry) -> bool:
    """Remove a shim's directory unless a compile holds its lock (opbridge.build.detached)."""
    lib = _shim_library(entry.path)
    return _remove_dir(entry.path, build_lock(lib) if lib is not None else None)


def _remove_object(entry: Entry) -> bool:
    # The digest goes first: from then on the object is a miss, never half there.
    entry.path.with_suffix(".sha256").unlink(missing_ok=True)
    entry.path.unlink(missing_ok=True)
    return True


def _remove_stale_temporaries(jit: Path, now: float) -> None:
    """Remove the temporary directories of module builds killed over an hour ago."""
    if not jit.is_dir():
        return
    for d in jit.glob(".*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def remove_shim_temporaries(directory: Path, min_age_s: float = SHIM_TMP_AGE_S,
                            now: float | None = None) -> list[Path]:
    """Remove the ``tmp*.so`` files that killed compiles of torch's shim left in *directory*; return them.

    A compile writes its temporary only while it holds its output's build lock
    (:func:`opbridge.build.detached.locked_compile`), so they go only while this
    holds every ``*.lock`` of *directory*, taken without waiting (one held: a compile
    is in flight, nothing goes), and only when older than *min_age_s* (a build that
    just made its temporary has not taken the lock yet; were its empty placeholder
    removed, its compiler would write the file anew). Never raises.
    """
    now = time.time() if now is None else now
    fds: list[int] = []
    removed = []
    try:
        stale = [p for p in directory.glob("tmp*.so") if p.is_file() and now - p.stat().st_mtime >= min_age_s]
        for lock in sorted(directory.glob("*.lock")) if stale else []:
            fds.append(os.open(lock, os.O_RDONLY))
            fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a compile holds it
        for tmp in stale:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    except OSError:
        pass
    finally:
        for fd in fds:
            os.close(fd)
    return removed


def prune(max_bytes: int | None = None, keep: int | None = None, max_age_s: float = MAX_AGE_S,
          recent_s: float = RECENT_S, protect: Path | None = None, root: Path | None = None) -> PruneReport:
    """Remove cache entries, least recently used first; return what went.

    Parameters
    ----------
    max_bytes
        Remove entries until modules and objects together hold at most this
        many bytes (None: no size limit).
    keep
        Keep at most this many module entries per library and device, the most
        recently used (None: no limit).
    max_age_s
        Remove entries unused for this long.
    recent_s
        Module entries used within this many seconds stay (0: none is spared for its age).
    protect
        A module entry that stays whatever the limits (the one a build just made).
    root
        The cache directory; default the configured one.
    """
    root = root if root is not None else cache_root(create=False)
    report = PruneReport()
    if not root.is_dir():
        return report
    now = time.time()
    # A shim counts as a module of one library (torch-native): --keep keeps the newest.
    modules = sorted([*module_entries(root), *shim_entries(root)], key=lambda e: e.last_used, reverse=True)
    objects = list(object_entries(root))
    doomed: list[Entry] = []
    seen: dict[str, int] = {}
    for e in modules:
        seen[e.library] = seen.get(e.library, 0) + 1
        if (keep is not None and seen[e.library] > keep) or now - e.last_used > max_age_s:
            doomed.append(e)
    doomed += [e for e in objects if now - e.last_used > max_age_s]
    if max_bytes is not None:
        gone = {e.path for e in doomed}
        rest = sorted((e for e in [*modules, *objects] if e.path not in gone), key=lambda e: e.last_used)
        total = sum(e.size for e in rest)
        for e in rest:
            if total <= max_bytes:
                break
            doomed.append(e)
            total -= e.size
    _remove_stale_temporaries(root / "jit", now)
    for d in sorted((root / SHIMS_DIR).glob("[!.]*")):
        if d.is_dir():
            report.temporaries += remove_shim_temporaries(d, now=now)
    for e in doomed:
        spared = e.kind != "object" and (e.path == protect or now - e.last_used < recent_s)
        remove = {"module": _remove_module, "shim": _remove_shim, "object": _remove_object}[e.kind]
        if spared or not remove(e):
            report.kept_in_use += 1
            continue
        report.removed.append(e)
    return report


def auto_prune(protect: Path | None = None) -> PruneReport:
    """The prune after a build: the size bound (:func:`size_bound`) and the age limit.

    Skipped (an empty report) while another process prunes the object store.
    Never raises for a file that vanished or could not be removed.
    """
    store_root = cache_root() / "objects"
    store_root.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(store_root / ".prune.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return PruneReport()
        # Leftovers of killed builds (temporary files, generated units) age out in the store's own prune.
        ObjectStore(store_root).prune_leftovers()
        return prune(max_bytes=size_bound(), protect=protect)
    except OSError:
        return PruneReport()
    finally:
        os.close(fd)
