"""Link a module from per-translation-unit objects, compiling only those the store lacks.

The JIT path's builder (:func:`opbridge.build.jit.build` calls it on a cache
miss): every unit is looked up in the :class:`~opbridge.build.objects.ObjectStore`;
the missing ones compile in parallel (``OPBRIDGE_MAX_JOBS``), the longest
first (by their last compile time, else their source's size) so that the last
one to start is a short one; then one link step writes the module.
"""

from __future__ import annotations

import shlex
import sys
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from opbridge import config
from opbridge.build.compile import (
    BuildSpec,
    compile_command,
    generated_sources,
    link_command,
)
from opbridge.build.isa import native_isa_id, uses_native_isa
from opbridge.build.objects import CompileError, ObjectStore, Unit
from opbridge.build.progress import Progress, first_errors
from opbridge.build.toolchain import CompilerGroup, require_compiler, run_compiler, toolchain_fingerprint
from opbridge.errors import BuildError

#: First-compile estimates of the generated units, in the size-in-kB scale of the
#: sources' own estimates (a built-in kernel source: 3-5 kB, 4-9 s): the runtime
#: unit parses tvm-ffi's headers (about a small kernel's time), the export list
#: is a blink. Without them the runtime unit (a 0.3 kB file) started last.
GENERATED_COST = {"_opbridge_runtime.cc": 3.0, "_opbridge_exports.cc": 0.1}


@dataclass
class BuildReport:
    """What one build did: units compiled and units reused, by source file name."""

    compiled: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    compile_seconds: dict[str, float] = field(default_factory=dict)


def units(spec: BuildSpec, store: ObjectStore) -> list[Unit]:
    """*spec*'s translation units: its sources, then its generated ones (written into *store*)."""
    toolchain = toolchain_fingerprint(spec.device)
    if uses_native_isa(spec):
        # "-march=native" in the command names no CPU: the object is this CPU's.
        toolchain += "\nnative: " + native_isa_id()
    out = [Unit(src, tuple(compile_command(spec, src)), toolchain) for src in (Path(s).resolve() for s in spec.sources)]
    for name, text in generated_sources(spec):
        src = store.generated(name, text)
        out.append(Unit(src, tuple(compile_command(spec.unit_spec(name), src)), toolchain, GENERATED_COST.get(name)))
    return out


def _say(line: str) -> None:
    if config.verbose():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def build_module(spec: BuildSpec, scratch: Path, output: Path, store: ObjectStore | None = None,
                 recompile: bool = False) -> BuildReport:
    """Build *spec*'s module at *output*, with objects in *scratch* (a private directory); with *recompile*,
    every unit is compiled (and stored) even where the object store has it.

    Raises
    ------
    BuildError
        With the failing command and the compiler's first errors, if a unit
        does not compile or the link fails; saying how to get one if there is no C++ compiler.
    """
    require_compiler(config.cxx())  # at once, not from a compile thread (it links too)
    store = store if store is not None else ObjectStore()
    report = BuildReport()
    all_units = units(spec, store)
    objects = [scratch / f"{i:03d}_{u.source.stem}.o" for i, u in enumerate(all_units)]
    missing = []
    for unit, obj in zip(all_units, objects, strict=True):
        if not recompile and store.fetch(unit, obj):
            report.reused.append(unit.name)
        else:
            missing.append((unit, obj))
    missing.sort(key=lambda item: -store.cost_hint(item[0]))
    label = f"{spec.name} ({spec.device})"
    with Progress(label, config.show_progress()) as progress:
        if missing:
            progress.status = f"compiling {len(missing)} unit(s), {len(report.reused)} reused"
            _compile_all(missing, store, report, progress)
        cmd = link_command(spec, objects, output)
        progress.status = f"{len(missing)} compiled, {len(report.reused)} reused, linking"
        _say(shlex.join(cmd))
        proc = run_compiler(cmd)
        if proc.returncode != 0:
            log = proc.stdout + proc.stderr
            raise BuildError(f"linking {label} failed (exit {proc.returncode})",
                             command=shlex.join(cmd), errors=first_errors(log), log=log)
    return report


#: How often a build's main thread wakes while its compiles run, to see a signal (seconds).
_POLL_S = 0.2


def _compile_all(missing: list[tuple[Unit, Path]], store: ObjectStore, report: BuildReport,
                 progress: Progress) -> None:
    total = len(missing)
    pool = ThreadPoolExecutor(max_workers=max(1, min(config.max_jobs(), total)))
    group = CompilerGroup()
    try:
        pending: dict[Future[float], Unit] = {}
        for unit, obj in missing:
            _say(shlex.join([*unit.command, "-o", str(obj)]))
            pending[pool.submit(store.compile, unit, obj, group)] = unit
        while pending:
            # Polled: a Ctrl-C that the kernel hands to a compile thread leaves a wait without a timeout
            # blocked until a compile ends; the main thread sees it once it runs again.
            done, _ = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
            for fut in done:
                unit = pending.pop(fut)
                err = fut.exception()
                if isinstance(err, CompileError):
                    raise BuildError(f"building {progress.label} failed: {unit.name} "
                                     f"did not compile", command=shlex.join(err.command),
                                     errors=first_errors(err.log), log=err.log) from None
                if err is not None:
                    raise err
                report.compiled.append(unit.name)
                report.compile_seconds[unit.name] = round(fut.result(), 3)
                progress.status = (f"{len(report.compiled)}/{total} compiled, {len(pending)} left, "
                                   f"last: {unit.name}")
    except BaseException as e:
        # Ctrl-C (or an exit): running compiles stop now, and none starts (CompilerGroup says why the
        # compilers do not get the signal themselves). A unit that failed to compile: no queued compile
        # starts, and running ones finish, so that their objects are in the store for the next build.
        if not isinstance(e, Exception):
            group.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
