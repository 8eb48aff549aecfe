"""The ahead-of-time build's ninja path: ``build.ninja`` for a :class:`~opbridge.build.compile.BuildSpec`,
run with progress, a failure converted into :class:`~opbridge.errors.BuildError` with the compiler's first
``file:line`` errors.

The JIT path compiles through the object store instead (:mod:`opbridge.build.incremental`); both take
their commands from :mod:`opbridge.build.compile`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from opbridge import config
from opbridge.build.compile import BuildSpec, compile_args, compile_command, generated_sources, link_command
from opbridge.build.progress import Progress, first_errors
from opbridge.build.toolchain import require_compiler
from opbridge.errors import BackendUnavailableError, BuildError


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_ninja(spec: BuildSpec, build_dir: Path, output: Path) -> Path:
    """Write ``build.ninja`` for *spec* into *build_dir*; return its path.

    The ahead-of-time build's path: ninja keeps its objects in *build_dir*
    between builds. The JIT path compiles through the object store instead
    (:mod:`opbridge.build.incremental`).
    """
    sources = list(spec.sources)
    for gname, text in generated_sources(spec):
        gpath = build_dir / gname
        gpath.write_text(text)
        sources.append(gpath)
    lines = [
        "ninja_required_version = 1.3",
        "rule cc",
        "  command = $command",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $in",
        "rule link",
        "  command = $command",
        "  description = link $out",
    ]
    objects = []
    for i, src in enumerate(sources):
        # Build-level variables are expanded before $in/$out exist: spell the paths out.
        obj = f"obj/{i:03d}_{src.stem}.o"
        args = compile_args(compile_command(spec.unit_spec(src.name), src.resolve()), obj, obj + ".d")
        lines.append(f"build {obj}: cc {_ninja_escape(str(src.resolve()))}")
        lines.append(f"  command = {_ninja_command(args)}")
        objects.append(obj)
    link = link_command(spec, [Path(o) for o in objects], output)
    lines.append(f"build {_ninja_escape(str(output))}: link {' '.join(objects)}")
    lines.append(f"  command = {_ninja_command(link)}")
    lines.append(f"default {_ninja_escape(str(output))}")
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ninja_command(args: list[str]) -> str:
    """A shell command line as a ninja variable's value (arguments quoted, ``$`` escaped)."""
    return " ".join(shlex.quote(a).replace("$", "$$") for a in args)


def run_ninja(spec: BuildSpec, build_dir: Path) -> None:
    """Run ninja in *build_dir*, with progress; raise BuildError on failure."""
    require_compiler(config.cxx())  # ninja's own "c++: not found" would not say how to get one
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as ninja_pkg

            ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        except ImportError as e:
            raise BackendUnavailableError("the `ninja` build tool was not found") from e
    cmd = [ninja, "-j", str(config.max_jobs())]
    if config.verbose():
        cmd.append("-v")
    env = {"NINJA_STATUS": "[%f/%t done, %r running] "}
    log: list[str] = []
    label = f"{spec.name} ({spec.device})"
    with subprocess.Popen(cmd, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, **env}) as proc, \
            Progress(label, config.show_progress()) as progress:
        assert proc.stdout is not None  # guaranteed by stdout=PIPE
        for line in proc.stdout:
            log.append(line)
            if config.verbose():
                sys.stderr.write(line)
            m = re.match(r"\[(\d+)/(\d+) done, (\d+) running\] (\w+) (.*)", line)
            if m:
                progress.status = (f"{m.group(1)}/{m.group(2)} steps done, {m.group(3)} running, "
                                   f"last: {m.group(4)} {Path(m.group(5).strip()).name}")
        rc = proc.wait()
    if rc != 0:
        text = "".join(log)
        failed = re.search(r"^FAILED: .*\n(.*)$", text, re.M)
        command = failed.group(1).strip() if failed else " ".join(cmd)
        errors = first_errors(text)
        raise BuildError(f"building {label} failed (ninja exit {rc})",
                         command=command, errors=errors, log=text)
