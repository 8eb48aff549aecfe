"""The object store: one compiled object per translation unit, reused across builds.

A JIT build of a library is cached whole (:mod:`opbridge.build.jit`); when that
misses (a kernel file or a header was edited, a library gained a source), the
objects of the translation units that did not change come from here, so that
only the edited ones recompile. The lookup follows ccache's "direct mode":

1. A unit's *base key* hashes the compile command (compiler, flags, include
   directories and the source's path, so ``__FILE__`` and ``#include "..."``
   resolve alike), the toolchain's version and the source's contents.
2. The base key names a *manifest*: the headers that the unit's last compile
   included, read from the compiler's depfile (``-MMD -MF``; nvcc ``-MD -MF``).
3. The object's *key* hashes the base key and the present contents of each of
   those headers, so a header edit misses exactly for the units including it.

Layout under ``<cache>/objects`` (created 0700 inside the private cache)::

    <kk>/<base>.json     manifest: {"deps": [header paths], "seconds": compile time}
    <kk>/<key>.o         an object
    <kk>/<key>.sha256    the object's digest, written after it: an object is used
                         only if this exists and matches, so a half-written or
                         damaged object is compiled again, never linked
    gen/<digest>/<name>  generated translation units, content-addressed
    tmp/                 entries being written (``os.replace``-d into place)

Every file is written under a temporary name and ``os.replace``-d, so a build
killed at any point leaves nothing that counts. A build hard-links the objects
it uses into its own scratch directory before checking them, so concurrent
builds and :func:`prune` never pull an object from under a link step.

Bounds: after each build that compiled something,
:func:`opbridge.build.housekeeping.auto_prune` removes entries unused for
:data:`MAX_AGE_S`, then the least recently used objects and built modules until
the cache holds at most ``OPBRIDGE_OBJECT_CACHE_MB`` (default :data:`MAX_BYTES`);
:meth:`ObjectStore.prune` does the same for the object store alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opbridge.build.cache import cache_root
from opbridge.build.toolchain import CompilerGroup, run_compiler

#: Bumped when the key or layout changes, which orphans (and so prunes) every entry.
FORMAT = "opbridge-objects-1"
#: The default size bound of the cache (least recently used go first; ``OPBRIDGE_OBJECT_CACHE_MB``).
MAX_BYTES = 1 << 30
#: Entries unused for this long are removed.
MAX_AGE_S = 30 * 24 * 3600
#: A leftover temporary file older than this belongs to a killed build.
_STALE_TMP_S = 3600


@dataclass(frozen=True)
class Unit:
    """One translation unit: its source and the command compiling it (no output arguments)."""

    source: Path
    command: tuple[str, ...]
    toolchain: str
    first_cost: float | None = None
    """Expected compile seconds before the unit was ever compiled (None: judge by its size)."""

    @property
    def name(self) -> str:
        """The source's file name, for reports."""
        return self.source.name


class CompileError(Exception):
    """A unit did not compile; carries the full command and the compiler's output."""

    def __init__(self, command: list[str], log: str) -> None:
        super().__init__(log)
        self.command = command
        self.log = log


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a make-style depfile (``obj: src dep1 dep2 \\``), in order."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    _, sep, rest = text.partition(": ")
    if not sep:
        return []
    deps: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\" and i + 1 < len(rest) and rest[i + 1] in " #":
            cur.append(rest[i + 1])
            i += 2
            continue
        if ch == "$" and rest[i + 1: i + 2] == "$":
            cur.append("$")
            i += 2
            continue
        if ch.isspace():
            if cur:
                deps.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        deps.append("".join(cur))
    return deps


def _write_atomic(path: Path, data: bytes, tmp_dir: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ObjectStore:
    """Compiled objects keyed by their command, toolchain, source and included headers.

    Parameters
    ----------
    root
        The store's directory; default ``<cache>/objects``.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else cache_root() / "objects"
        self.tmp = self.root / "tmp"
        self.tmp.mkdir(parents=True, mode=0o700, exist_ok=True)
        self._digests: dict[str, str] = {}

    # -- keys ---------------------------------------------------------------

    def base_key(self, unit: Unit) -> str:
        """Hash of what a unit's object depends on before its headers are known."""
        h = hashlib.sha256()
        for part in (FORMAT, unit.toolchain, "\0".join(unit.command)):
            h.update(part.encode() + b"\0\0")
        h.update(unit.source.read_bytes())
        return h.hexdigest()

    def _header_digest(self, path: str, fresh: bool = False) -> str:
        """A header's digest, read once per store object (per build) unless *fresh*."""
        if fresh or path not in self._digests:
            try:
                self._digests[path] = _sha256_file(Path(path))
            except OSError:
                return "missing"
        return self._digests[path]

    def _key(self, base: str, deps: list[str], fresh: bool = False) -> str:
        h = hashlib.sha256(base.encode())
        for dep in deps:
            h.update(b"\0" + self._header_digest(dep, fresh).encode())
        return h.hexdigest()

    def _path(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / f"{key}{suffix}"

    def _manifest(self, base: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self._path(base, ".json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("deps"), list) else None

    def cost_hint(self, unit: Unit) -> float:
        """Seconds the unit's last compile took, else its first-cost estimate or its source's size in kB.

        Orders compiles longest first, so that the last one to start is short.
        """
        try:
            manifest = self._manifest(self.base_key(unit))
            if manifest and isinstance(manifest.get("seconds"), (int, float)):
                return float(manifest["seconds"])
            if unit.first_cost is not None:
                return unit.first_cost
            return unit.source.stat().st_size / 1000
        except OSError:
            return 0.0

    # -- lookup and store ---------------------------------------------------

    def stored_object(self, unit: Unit, base: str | None = None) -> Path | None:
        """Where the unit's object is stored under its present headers, or None without a manifest.

        The file there may be absent or unsound; :meth:`fetch` checks.
        """
        base = base or self.base_key(unit)
        manifest = self._manifest(base)
        if manifest is None:
            return None
        return self._path(self._key(base, [str(d) for d in manifest["deps"]]), ".o")

    def fetch(self, unit: Unit, dest: Path) -> bool:
        """Hard-link (or copy) the unit's stored object to *dest* if there is a sound one.

        Never raises for a missing, half-written or damaged entry: that is a miss.
        """
        try:
            base = self.base_key(unit)
            obj = self.stored_object(unit, base)
            if obj is None:
                return False
            digest = obj.with_suffix(".sha256")
            dest.unlink(missing_ok=True)
            try:
                os.link(obj, dest)
            except OSError:
                if not obj.is_file():
                    return False
                dest.write_bytes(obj.read_bytes())
            # Checked on the linked copy: what is linked is what was checked.
            if digest.read_text().strip() != _sha256_file(dest):
                dest.unlink(missing_ok=True)
                return False
            now = time.time()
            for used in (obj, digest, self._path(base, ".json")):
                os.utime(used, (now, now))
            return True
        except OSError:
            dest.unlink(missing_ok=True)
            return False

    def compile(self, unit: Unit, dest: Path, group: CompilerGroup | None = None) -> float:
        """Compile *unit* into *dest* (its compiler one of *group*, where given) and store the object;
        return the seconds it took.

        Raises
        ------
        CompileError
            If the compiler fails (nothing is stored).
        BuildError
            If the compiler is not there.
        """
        from opbridge.build.compile import compile_args

        depfile = dest.with_suffix(".d")
        args = compile_args(list(unit.command), dest, depfile)
        base = self.base_key(unit)
        start_wall, start = time.time(), time.monotonic()
        proc = run_compiler(args, group)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise CompileError(args, proc.stdout + proc.stderr)
        try:
            deps = [d for d in parse_depfile(depfile.read_text())
                    if Path(d).resolve() != unit.source.resolve()]
        except OSError:
            return seconds  # no depfile: usable for this build, not reusable
        deps = [str(Path(d).resolve()) for d in deps]
        # A source or header edited while it compiled: the object may match
        # neither version, so it is used for this build but not stored.
        for path in (unit.source, *map(Path, deps)):
            try:
                if path.stat().st_mtime > start_wall:
                    return seconds
            except OSError:
                return seconds
        key = self._key(base, deps, fresh=True)
        self._path(key, "").parent.mkdir(mode=0o700, exist_ok=True)
        self._path(base, "").parent.mkdir(mode=0o700, exist_ok=True)
        tmp_obj = Path(tempfile.mkdtemp(dir=self.tmp)) / "obj.o"
        try:
            os.link(dest, tmp_obj)
        except OSError:
            tmp_obj.write_bytes(dest.read_bytes())
        os.replace(tmp_obj, self._path(key, ".o"))
        tmp_obj.parent.rmdir()
        _write_atomic(self._path(key, ".sha256"), _sha256_file(dest).encode(), self.tmp)
        manifest = {"source": str(unit.source), "deps": deps, "seconds": round(seconds, 3)}
        _write_atomic(self._path(base, ".json"), json.dumps(manifest).encode(), self.tmp)
        return seconds

    def generated(self, name: str, text: str) -> Path:
        """A generated translation unit written once at a stable, content-addressed path."""
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        path = self.root / "gen" / digest / name
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
            _write_atomic(path, text.encode(), self.tmp)
        os.utime(path.parent)
        return path

    # -- bounds -------------------------------------------------------------

    def prune(self, max_bytes: int = MAX_BYTES, max_age_s: float = MAX_AGE_S) -> int:
        """Remove stale and least recently used entries; return how many bytes were freed.

        Skipped (returns 0) while another process prunes. Safe during builds:
        a build uses hard links of its objects, which outlive their removal here.
        """
        fd = os.open(self.root / ".prune.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            return self._prune_locked(max_bytes, max_age_s, time.time())
        finally:
            os.close(fd)

    def _prune_locked(self, max_bytes: int, max_age_s: float, now: float) -> int:
        freed = self.prune_leftovers(max_age_s, now)
        objects: list[tuple[float, int, Path]] = []
        for path in self.root.glob("??/*.o"):
            try:
                st = path.stat()
            except OSError:
                continue
            objects.append((st.st_mtime, st.st_size, path))
        objects.sort()
        total = sum(size for _, size, _ in objects)
        for mtime, size, path in objects:
            if now - mtime <= max_age_s and total <= max_bytes:
                break
            # The digest goes first: from then on the object is a miss, never half there.
            path.with_suffix(".sha256").unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            total -= size
            freed += size
        return freed

    def prune_leftovers(self, max_age_s: float = MAX_AGE_S, now: float | None = None) -> int:
        """Remove what no build will use again; return the bytes freed.

        Unit manifests and generated units unused for *max_age_s*, digests whose
        object is gone, and temporary files of killed builds. Objects themselves
        are left to :meth:`prune` and :func:`opbridge.build.housekeeping.prune`.
        The caller holds the store's prune lock.
        """
        now = time.time() if now is None else now
        freed = 0
        for path in self.root.glob("??/*"):
            try:
                st = path.stat()
                orphan = path.suffix == ".sha256" and not path.with_suffix(".o").exists()
                if path.suffix != ".o" and (orphan or now - st.st_mtime > max_age_s):
                    path.unlink(missing_ok=True)
                    freed += st.st_size
            except OSError:
                continue
        for path in [*self.tmp.iterdir(), *(self.root / "gen").glob("*")]:
            limit = _STALE_TMP_S if path.parent == self.tmp else max_age_s
            try:
                if now - path.stat().st_mtime > limit:
                    freed += _remove(path)
            except OSError:
                continue
        return freed


def _remove(path: Path) -> int:
    if path.is_dir():
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path, ignore_errors=True)
        return size
    size = path.stat().st_size
    path.unlink(missing_ok=True)
    return size
