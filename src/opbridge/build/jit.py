"""JIT builds into the private cache, safe against concurrent and killed builds.

Protocol (after Triton's cache and flashinfer's loader):

1. The entry's name is a hash of everything that determines the artifact.
2. A hit is an entry whose ``manifest.json`` exists; the manifest is written
   last, so a half-built entry never counts.
3. On a miss: take the entry's ``flock``, check again, build in a private
   temporary directory, write the manifest, then ``os.replace`` the directory
   into place. A build killed at any point leaves at most a stray temporary
   directory, and the kernel drops its lock.
4. The build itself compiles only the translation units whose objects the
   object store (:mod:`opbridge.build.objects`) lacks, then links; the
   manifest lists which units were ``compiled`` and which ``reused``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from opbridge.build import housekeeping
from opbridge.build.cache import await_build, cache_root, file_lock, lock_held
from opbridge.build.compile import BuildSpec, fingerprint
from opbridge.build.incremental import build_module

_MANIFEST = "manifest.json"


def _entry_dir(spec: BuildSpec) -> Path:
    key = fingerprint(spec)
    return cache_root() / "jit" / f"{spec.name}-{spec.device}-{key[:20]}"


def _complete(entry: Path, so: Path) -> bool:
    """Whether *entry* holds a finished build: its manifest, and the module at the size it recorded.

    A module cut short (a full disk, a crash after the rename on a filesystem that did not order the
    writes, a stray truncation) would crash the process that maps it (SIGBUS), not raise: such an
    entry is a miss, and the next build replaces it.
    """
    try:
        recorded = json.loads((entry / _MANIFEST).read_text()).get("bytes")
        size = so.stat().st_size
    except (OSError, ValueError, AttributeError):
        return False
    return size > 0 and (recorded is None or recorded == size)  # None: written before sizes were recorded


def cached_artifact(spec: BuildSpec) -> Path | None:
    """Return the cached module for *spec*, or None; never builds, never raises on a miss."""
    try:
        entry = _entry_dir(spec)
    except OSError:
        return None
    so = entry / f"{spec.name}.so"
    if _complete(entry, so):
        housekeeping.touch(entry)
        return so
    return None


def _lock(entry: Path) -> Path:
    return entry.parent / "locks" / (entry.name + ".lock")


def in_flight(spec: BuildSpec) -> bool:
    """Whether a build of *spec* is in flight: a live process holds its build lock now. Never waits."""
    try:
        return lock_held(_lock(_entry_dir(spec)))
    except OSError:
        return False


def awaited_artifact(spec: BuildSpec) -> Path | None:
    """The cached module for *spec* once no build of it holds its lock (one in flight finishes first),
    or None; never builds, and never takes the lock from a background build (:func:`.cache.await_build`)."""
    try:
        return await_build(_lock(_entry_dir(spec)), lambda: cached_artifact(spec))
    except OSError:
        return None


def build(spec: BuildSpec, force: bool = False) -> Path:
    """Build *spec* (or reuse the cached build) and return the ``.so`` path; *force*: compile every unit again
    and relink, whatever the cache holds.

    Raises
    ------
    BuildError
        If compilation fails; nothing is cached in that case.
    CacheSecurityError
        If the cache directory is not private to this user.
    """
    entry = _entry_dir(spec)
    so = entry / f"{spec.name}.so"
    if not force and _complete(entry, so):
        housekeeping.touch(entry)
        return so
    with file_lock(_lock(entry)):
        if not force and _complete(entry, so):
            return so
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
        try:
            (tmp / "obj").mkdir()
            start = time.monotonic()
            report = build_module(spec, tmp / "obj", tmp / so.name, recompile=force)
            # The objects live on in the object store; hard links here would
            # only keep pruned ones on disk.
            shutil.rmtree(tmp / "obj")
            manifest = {
                "name": spec.name,
                "device": spec.device,
                "sources": [str(s) for s in spec.sources],
                "seconds": round(time.monotonic() - start, 3),
                "created": time.time(),
                "compiled": report.compiled,
                "reused": report.reused,
                "compile_seconds": report.compile_seconds,
                "bytes": (tmp / so.name).stat().st_size,
            }
            with open(tmp / so.name, "rb") as f:  # on disk before the entry is published
                os.fsync(f.fileno())
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
            if entry.exists():
                shutil.rmtree(entry)
            os.replace(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    if report.compiled:
        housekeeping.auto_prune(protect=entry)
    return so
