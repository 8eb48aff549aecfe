"""The private JIT cache: ownership checks and crash-safe cross-process locks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from opbridge import config
from opbridge.build import preempt as _preempt
from opbridge.errors import CacheError, CacheSecurityError

T = TypeVar("T")

#: Where torch's dispatcher shims live in the cache: ``<cache>/torch-native/<key>/``
#: (built by :mod:`opbridge.adapters.torch.native.build`, counted and pruned by
#: :mod:`opbridge.build.housekeeping`).
SHIMS_DIR = "torch-native"


def _check_private(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise CacheSecurityError(
            f"refusing to use cache directory {path}: it is owned by uid {st.st_uid}, "
            f"not by you (uid {os.getuid()}). Set OPBRIDGE_CACHE_DIR to a directory you own."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheSecurityError(
            f"refusing to use cache directory {path}: it is group- or world-writable "
            f"(mode {stat.S_IMODE(st.st_mode):o}); another user could plant a library there. "
            f"Run `chmod 700 {path}` or set OPBRIDGE_CACHE_DIR."
        )


def cache_root(create: bool = True) -> Path:
    """Return the cache directory, created 0700, after checking it is private.

    Raises
    ------
    CacheSecurityError
        If the directory belongs to another user or is group/world-writable.
    CacheError
        If the directory cannot be made, or written (an OSError, naming the directory and the setting).
    """
    root = config.cache_dir()
    if create and not root.exists():
        old = os.umask(0o077)
        try:
            root.mkdir(parents=True, mode=0o700, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cannot create the cache directory {root}: {e.strerror or e}. Set "
                             f"OPBRIDGE_CACHE_DIR to a directory you can write (`opbridge doctor` shows the "
                             f"one in use)") from e
        finally:
            os.umask(old)
    if root.exists():
        _check_private(root)
        if create and not os.access(root, os.W_OK | os.X_OK):
            raise CacheError(f"cannot write to the cache directory {root}. Set OPBRIDGE_CACHE_DIR to a "
                             f"directory you can write (`opbridge doctor` shows the one in use)")
    return root


def unusable(root: Path) -> str | None:
    """Why the cache directory *root* cannot be used now, or None: where a build would write first (*root*, or
    the closest folder above it that exists, where it would be created) is not a directory, cannot be written,
    or holds no file that can be locked (:func:`file_lock`: every build locks its output).

    Tried, not inferred from the mode bits (which root and a read-only mount make lie): a folder is made there
    and a file in it locked, then both removed; *root* itself is not created.
    """
    where = next((p for p in (root, *root.parents) if p.exists()), root)
    doing = "used" if where == root else "created"
    fix = "set OPBRIDGE_CACHE_DIR to a directory you can write"
    if not where.is_dir():
        return f"cannot be {doing}: {where} is not a directory; {fix}"
    try:
        probe = Path(tempfile.mkdtemp(prefix=".opbridge-probe-", dir=where))
    except OSError as e:
        return f"cannot be {'written' if where == root else 'created'}: {where} is not writable ({e.strerror}); {fix}"
    try:
        with file_lock(probe / "probe.lock", preempt=False):
            pass
    except OSError as e:
        return (f"cannot be {doing}: a file in {where} cannot be locked ({e.strerror}), and every build locks its "
                f"output; {fix} on a local filesystem")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


@contextlib.contextmanager
def file_lock(path: Path, preempt: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on *path* for the duration of the block.

    The kernel drops the lock when the holder exits, however it exits, so a
    build killed half-way never leaves waiters hanging (unlike a lock file
    that is polled for existence). With *preempt*, a process that does not
    run idle takes the lock from a starved background build instead of
    waiting for it (:mod:`opbridge.build.preempt`).
    """
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _preempt.take(fd, preempt)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def build_lock(out: Path) -> Path:
    """The lock a detached build of the library *out* holds while it compiles (:mod:`.detached`)."""
    return out.with_name(out.name + ".lock")


def lock_held(path: Path) -> bool:
    """Whether some process holds an exclusive ``flock`` on *path* now (no lock file: no)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def await_build(lock: Path, built: Callable[[], T | None], settle_s: float = 0.5) -> T | None:
    """What *built* finds once no build holds *lock* (a build in flight finishes first); None when nothing is built.

    Meant for a program whose background build was stopped by a foreground build
    (:mod:`opbridge.build.preempt`): that build takes the lock moments after the
    stopped one lets go, so an empty result is final only once the lock has stayed
    free for *settle_s*. Never takes the lock from a background build. Raises OSError
    if the lock file cannot be opened.
    """
    while True:
        with file_lock(lock, preempt=False):
            pass
        result = built()
        if result is not None:
            return result
        end = time.monotonic() + settle_s
        while not lock_held(lock):
            if time.monotonic() > end:
                return None
            time.sleep(0.05)
