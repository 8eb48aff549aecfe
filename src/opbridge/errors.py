"""The opbridge exception tree.

Every class also subclasses the matching built-in, so ``except ValueError``
keeps working for callers who do not know opbridge.
"""

from __future__ import annotations


class OpbridgeError(Exception):
    """Base class of every error opbridge raises on purpose."""


class DeclarationError(OpbridgeError, ValueError):
    """An op or library declaration is inconsistent (bad schema, bad kernel map...)."""


class BuildError(OpbridgeError, RuntimeError):
    """Compiling a kernel library failed.

    Attributes
    ----------
    command
        The command line that failed.
    errors
        The compiler's first error lines, each starting with ``file:line``.
    log
        The full compiler output.
    """

    def __init__(self, message: str, command: str = "", errors: list[str] | None = None, log: str = ""):
        self.command = command
        self.errors = list(errors or [])
        self.log = log
        parts = [message]
        if command:
            parts.append(f"command: {command}")
        if self.errors:
            parts.append("first errors:\n  " + "\n  ".join(self.errors))
        else:  # no file:line error (a full disk, a killed compiler, the linker): the output's last line says why
            last = [line.strip() for line in log.splitlines() if line.strip()][-1:]
            if last and last[0] not in message:
                parts.append(f"last output: {last[0]}")
        super().__init__("\n".join(parts))


class CacheSecurityError(OpbridgeError, PermissionError):
    """The build cache directory is not private to the current user."""


class CacheError(OpbridgeError, OSError):
    """The build cache directory cannot be made or written (a path through a file, a read-only parent)."""


class BackendUnavailableError(OpbridgeError, RuntimeError):
    """A device or framework has no usable toolchain or runtime here (for example CUDA without a GPU)."""


class UsageError(OpbridgeError, ValueError):
    """A command line asks for something that does not exist, or for options that do not go together: the
    ``opbridge`` command prints its message and exits 2."""


class UnsupportedFrameworkError(OpbridgeError, TypeError):
    """An op was called with arrays of a type no adapter handles."""
