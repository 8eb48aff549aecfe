"""The C entries: an op's public callable in C, built beside the running program.

A C entry (``call/py_entry.h``) runs a call without a Python frame,
DLPack capsule or tvm-ffi's Python binding: it views each argument as a
DLTensor, makes the outputs and calls the kernel through tvm-ffi's C API. It
returns ``NotImplemented`` for anything it does not take, and the adapter's
Python path runs as before. Two use this module: NumPy's
(:mod:`opbridge.adapters.numpy.native`) and the tensor entry
(:mod:`opbridge.call.exchange`: Paddle's tensors through their DLPack exchange
table, MindSpore's through their methods).

Here, once for both:

- :class:`CEntry`: when an entry library is built and loaded. Never at import
  and never in the caller's way: the first op that wants it starts the build in
  a background thread, which runs the compiler in a detached child at a lower
  priority (it finishes and fills the cache even if the program exits first:
  :mod:`opbridge.build.detached`); once the library is loaded every op so far,
  and every later one, gets its entry. A process that finds it in the cache
  loads it at once. A library loaded from an AOT build compiles nothing here.
  A failed build warns once and leaves the Python path in place.
- :func:`takes` (which ops an entry can run), :func:`op_facts` (what its
  constructor is given) and :func:`dl_code` (a dtype as the entries name it).
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from opbridge import config, loader
from opbridge.call import core
from opbridge.errors import BuildError, OpbridgeError

if TYPE_CHECKING:
    from opbridge.build.compile import BuildSpec
    from opbridge.build.detached import Child
    from opbridge.declare import OpDef

L = TypeVar("L")

#: The directory of ``py_entry.h``, the C entries' shared call: an include directory of every entry's build
#: (kept out of opbridge's kernel include directory, whose every change would rebuild every kernel library).
SHARED_DIR = Path(__file__).resolve().parent

_KINDS = {"int": 2, "float": 1, "bool": 3}
MAX_ARGS = 16  # opbridge::entry::kMaxArgs: arguments and new outputs together

# DLPack's type codes (dlpack.h: kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool)
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6
_DL_TYPES = {"float16": (_DL_FLOAT, 16), "float32": (_DL_FLOAT, 32), "float64": (_DL_FLOAT, 64),
             "bfloat16": (_DL_BFLOAT, 16), "int8": (_DL_INT, 8), "int16": (_DL_INT, 16), "int32": (_DL_INT, 32),
             "int64": (_DL_INT, 64), "uint8": (_DL_UINT, 8), "bool": (_DL_BOOL, 8)}


def dl_code(name: str) -> int:
    """Dtype *name* as the C entries compare element types: ``code | bits << 8 | lanes << 16``
    (``opbridge::entry::TypeCode``)."""
    code, bits = _DL_TYPES[name]
    return code | bits << 8 | 1 << 16


def takes(op: OpDef) -> bool:
    """Whether a C entry can run *op*: tensor returns (new outputs, shaped by ``like`` or a shape rule,
    or the arguments it writes); arguments tensors (optional too, not lists) or int, float, bool
    scalars; a CPU kernel."""
    args, returns = op.schema.arguments, op.schema.returns
    if "cpu" not in op.kernels or (op.n_outputs and op.shape is None):
        return False
    if not all(r.type.is_tensor and not r.type.is_list for r in returns):
        return False
    if len(args) + op.n_outputs > MAX_ARGS:
        return False
    return all((a.type.is_tensor and not a.type.is_list)
               or (not a.type.is_tensor and not a.type.optional and not a.type.is_list and a.type.base in _KINDS)
               for a in args)


def op_facts(op: OpDef, dtype_name: Callable[[Any], str]) -> tuple[Any, ...]:
    """What an entry's constructor takes after the kernel (``opbridge::entry::Init``): kinds, like, rule,
    returns, mutated, rows, dtype_arg, dtypes. *dtype_name* names a framework dtype (``"float32"``),
    for the shape rule's answers."""
    args = op.schema.arguments
    kinds = [(4 if a.type.optional else 0) if a.type.is_tensor else _KINDS[a.type.base] for a in args]
    like = core.like_indices(op)

    def rule(a: tuple[Any, ...]) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(int(d) for d in s.shape), dl_code(s.dtype if isinstance(s.dtype, str) else dtype_name(s.dtype)))
                for s in op.output_specs(a)]

    mutated = [i for i, a in enumerate(args) if a.is_mutated]
    dtypes = sorted(dl_code(name) for name in op.dtypes)
    return (kinds, like or [], None if like is not None or not op.n_outputs else rule, list(op.return_sources),
            mutated, list(op.row_strided), op.dtype_arg, dtypes)


def prelude_source(op: OpDef, array_type: str, fn: str) -> str:
    """The public callable's lines (4-space indented) that hand a call whose dispatching argument is exactly
    the global *array_type* to the entry builtin *fn* first (:func:`opbridge.call.callable.install_prelude`)."""
    names = [a.name for a in op.schema.arguments]
    return (f"    if type({names[op.dispatch_arg]}) is {array_type}:\n"
            f"        _ce_r = {fn}({', '.join(names)})\n"
            "        if _ce_r is not NotImplemented:\n"
            "            return _ce_r\n")


def out_prelude_source(op: OpDef, array_type: str, fn_out: str) -> str:
    """The same for a call with ``out=`` (8-space indented, for ``install_prelude``'s *out_prelude*): the
    entry's out= builtin *fn_out*, for an op whose call returns its ``out=`` (:func:`.core.returns_its_outs`),
    ``out`` one array of that type (a tuple of them, which the entry tests, for an op with more outputs);
    ``""`` for any other op."""
    if not core.returns_its_outs(op):
        return ""
    names = [a.name for a in op.schema.arguments]
    kind = array_type if op.n_outputs == 1 else "tuple"
    return (f"        if type(out) is {kind} and type({names[op.dispatch_arg]}) is {array_type}:\n"
            f"            _ce_r = {fn_out}({', '.join(names)}, out)\n"
            "            if _ce_r is not NotImplemented:\n"
            "                return _ce_r\n")


# The background build's child (opbridge.build.detached), after its LOWER_PRIORITY lines: argv is its
# niceness, then the module whose ENTRY it builds. Its last line names what it built (_BUILT), which the
# program loads: the cache the child was started for, even if the program's OPBRIDGE_CACHE_DIR has
# changed since (a starved idle build can outlive a test that set it).
_BUILT = "opbridge built: "
_CHILD = f"""\
import importlib, os, sys
_lower(int(sys.argv[1]))
path, error = importlib.import_module(sys.argv[2]).ENTRY.build()
if error is not None:
    print(error)
    sys.exit(1)
print({_BUILT!r} + str(path))
"""


class CEntry(Generic[L]):
    """When one C entry library is built and loaded (see the module's docstring).

    *what* names it in messages (``"NumPy's C entry"``), *module* is the module
    whose ``ENTRY`` this is (the build's child imports it), *spec* gives its
    build, *load* loads a built library, *enabled* says whether it is on, and
    *fallback* says what the program does without it (for the warning), and
    *per* what it is built once for (for the progress line).
    """

    def __init__(self, what: str, module: str, spec: Callable[[], BuildSpec], load: Callable[[Path], L],
                 enabled: Callable[[], bool], fallback: str, per: str = "Python version") -> None:
        self.what, self.module, self.spec, self.load, self.enabled = what, module, spec, load, enabled
        self.fallback, self.per = fallback, per
        self.lock = threading.RLock()
        self.lib: L | None = None
        self.failed = False
        self.builder: threading.Thread | None = None
        #: what runs once the library is loaded
        self.waiting: list[Callable[[L], None]] = []

    def loaded(self) -> L | None:
        """The library if this process has loaded it (no build)."""
        return self.lib

    def library(self, build_now: bool = False) -> L | None:
        """The library: loaded, or built now with *build_now*; None while it is not there (or failed).

        Building now does not wait for this process's background build: it takes
        the build over if that one gets no CPU (:mod:`opbridge.build.preempt`).
        """
        if self.lib is None and build_now and not self.failed:
            path, error = self.build()
            with self.lock:
                if self.lib is None and not self.failed:
                    self._finish(path, error)
        return self.lib

    def build(self) -> tuple[Path | None, Exception | None]:
        """Compile the library (or find it in the cache); the path, or what went wrong. Takes no lock."""
        from opbridge.build import jit

        try:
            return jit.build(self.spec()), None
        except (OpbridgeError, OSError) as e:
            return None, e

    def cached(self) -> Path | None:
        """The built library in the cache, or None (nothing is built)."""
        from opbridge.build import jit

        return jit.cached_artifact(self.spec())

    def awaited(self) -> Path | None:
        """The built library in the cache once no build of it is in flight, or None (nothing is built)."""
        from opbridge.build import jit

        return jit.awaited_artifact(self.spec())

    def _finish(self, path: Path | None, error: Exception | None) -> None:
        """Load the built library and run what waited for it, or warn once. Holds the lock."""
        if path is not None:
            try:
                self.lib = self.load(path)
            except OSError as e:
                error = e
        if self.lib is None:
            self.failed = True
            self.waiting.clear()
            if not threading.main_thread().is_alive():  # the program is exiting: its build died with it
                return
            warnings.warn(f"opbridge: {self.fallback}: {self.what} could not be built or loaded ({error})",
                          RuntimeWarning, stacklevel=4)
            return
        waiting = list(self.waiting)
        self.waiting.clear()
        for then in waiting:
            then(self.lib)

    def start_child(self) -> Child:
        """:meth:`build` in a detached child at a lower priority (it finishes if this process exits first).

        Started before the caller returns, not from the thread that waits for it:
        a script that exits at once would otherwise end before the thread spawned it.
        """
        from opbridge.build import detached

        code = detached.LOWER_PRIORITY + _CHILD
        return detached.Child([sys.executable, "-c", code, str(detached.niceness(True)), self.module],
                              detached.python_env())

    def _background(self, child: Child) -> None:
        """The background build: waits for *child* without the lock (a first call of another op must not
        wait for the compiler), then loads under it."""
        from opbridge.build.progress import first_errors

        code, log = child.wait()
        lines = log.strip().splitlines()
        built = Path(lines[-1][len(_BUILT):]) if code == 0 and lines and lines[-1].startswith(_BUILT) else None
        path = built if built is not None and built.is_file() else self.cached()
        if path is None and code != 0:  # stopped by a foreground build that took its lock (build.preempt)?
            path = self.awaited()
        error: Exception | None = None
        if path is None:
            last = lines[-1:] or [f"its build process exited with status {code}"]
            error = BuildError(f"building {self.what} failed: {last[0]}", errors=first_errors(log), log=log)
        with self.lock:
            if self.lib is None and not self.failed:
                self._finish(path, error)

    def _join(self) -> None:
        """Wait for another process's build of the library (it holds the build's lock), then load it; start
        a build of this process's own only where that one installed nothing (it failed, or was killed)."""
        path = self.awaited()
        if path is None:
            try:
                child = self.start_child()
            except OSError as e:
                with self.lock:
                    if self.lib is None and not self.failed:
                        self._finish(None, e)
                return
            self._background(child)
            return
        with self.lock:
            if self.lib is None and not self.failed:
                self._finish(path, None)

    def when_ready(self, op: OpDef, then: Callable[[L], None]) -> None:
        """Run ``then(library)`` once the entry is loaded: now, or from the background build it starts.

        Nothing runs while the entry is off or for an op it cannot run
        (:func:`takes`). An op of a library loaded from an AOT build (which
        compiles nothing at run time and touches no cache) gets the entry only
        once another library's op, or :meth:`library` (``opbridge build``),
        has loaded it.
        """
        if not (self.enabled() and takes(op)) or self.failed:
            return
        with self.lock:
            if self.lib is not None:
                then(self.lib)
                return
            if self.failed:
                return
            prebuilt = loader.loaded_prebuilt(op.library, "cpu")
            if not prebuilt and self.builder is None:
                path = self.cached()
                if path is not None:
                    self._finish(path, None)
                if self.lib is not None:
                    then(self.lib)
                    return
                if self.failed:
                    return
            self.waiting.append(then)
            if prebuilt or self.builder is not None:
                return
            from opbridge.build import jit

            # Another process's build in flight: wait for it rather than start a builder that would only
            # wait on its lock (a new user's short runs in a row each left one).
            joined = jit.in_flight(self.spec())
            if joined:
                target: Callable[..., None] = self._join
                args: tuple[Any, ...] = ()
            else:
                try:
                    args = (self.start_child(),)
                except OSError as e:
                    self._finish(None, e)
                    return
                target = self._background
            self.builder = threading.Thread(target=target, args=args,
                                            name=f"opbridge-{self.module.rpartition('.')[2]}-entry-build",
                                            daemon=True)
            self.builder.start()
        if config.show_progress():
            doing = (f"{self.what} is being built in the background by another process (once per {self.per})"
                     if joined else f"building {self.what} in the background (once per {self.per}; it finishes "
                                    f"even if this program exits first)")
            print(f"opbridge: {doing}; until it is ready, {self.fallback}; `opbridge build` builds it now",
                  file=sys.stderr)


def module_entry(module: str) -> CEntry[Any]:
    """The ``ENTRY`` of *module* (for tools that list every entry)."""
    entry: CEntry[Any] = importlib.import_module(module).ENTRY
    return entry
