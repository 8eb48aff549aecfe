"""Builds without a C++ compiler: one BuildError saying what was looked for and how to fix it.

Every way opbridge starts a compiler is covered: the JIT build (a user's library, the JAX
handler, the C entries), the object store's compile of one unit, the AOT ninja build and the
detached build of the torch shim.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import opbridge
from opbridge.build import compile as bcompile
from opbridge.build import detached, jit
from opbridge.build import ninja as bninja
from opbridge.build.objects import ObjectStore, Unit
from opbridge.build.toolchain import run_compiler

MISSING = "opbridge-no-such-cxx"
KERNEL = "#include <opbridge/opbridge.h>\n"
JAX_HANDLER = Path(opbridge.__file__).parent / "adapters" / "jax" / "handler.cc"


@pytest.fixture
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache and OPBRIDGE_CXX naming a compiler that is nowhere."""
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OPBRIDGE_CXX", MISSING)
    (tmp_path / "k.cc").write_text(KERNEL)
    return tmp_path


def _says_how_to_fix(error: BaseException, compiler: str = MISSING, origin: str = "$OPBRIDGE_CXX") -> None:
    text = str(error)
    assert "no C++ compiler found" in text and repr(compiler) in text and origin in text, text
    assert "Install one" in text and "set OPBRIDGE_CXX" in text, text


@pytest.mark.parametrize("source", ["user", "jax-handler"])
def test_jit_build_without_a_compiler_raises_build_error(no_compiler: Path, source: str) -> None:
    src = no_compiler / "k.cc" if source == "user" else JAX_HANDLER
    spec = bcompile.BuildSpec(name="opbridge_jax_handler" if source != "user" else "k", sources=(src,))
    with pytest.raises(opbridge.BuildError) as info:
        jit.build(spec)
    _says_how_to_fix(info.value)
    assert not list((no_compiler / "cache").rglob("*.so")), "nothing is cached"


def test_the_default_compiler_missing_from_path_is_named(no_compiler: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPBRIDGE_CXX")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(no_compiler / "empty"))
    with pytest.raises(opbridge.BuildError) as info:
        jit.build(bcompile.BuildSpec(name="k", sources=(no_compiler / "k.cc",)))
    _says_how_to_fix(info.value, "c++", "neither OPBRIDGE_CXX nor CXX is set")
    assert "on PATH" in str(info.value)


def test_object_store_compile_and_run_compiler_raise_build_error(no_compiler: Path) -> None:
    with pytest.raises(opbridge.BuildError) as info:
        run_compiler([MISSING, "--version"])
    _says_how_to_fix(info.value)
    unit = Unit(no_compiler / "k.cc", (MISSING, "-c", str(no_compiler / "k.cc")), "toolchain")
    with pytest.raises(opbridge.BuildError) as info:
        ObjectStore(no_compiler / "objects").compile(unit, no_compiler / "k.o")
    _says_how_to_fix(info.value)


def test_aot_ninja_build_checks_the_compiler_first(no_compiler: Path) -> None:
    spec = bcompile.BuildSpec(name="k", sources=(no_compiler / "k.cc",))
    with pytest.raises(opbridge.BuildError) as info:
        bninja.run_ninja(spec, no_compiler)
    _says_how_to_fix(info.value)


def test_detached_build_logs_the_same_message(no_compiler: Path) -> None:
    out, tmp = no_compiler / "shim.so", no_compiler / "shim.tmp.so"
    tmp.write_bytes(b"")
    code, log = detached.locked_compile([MISSING, "-o", str(tmp)], out, tmp, background=False).wait()
    assert code != 0 and not out.exists()
    _says_how_to_fix(RuntimeError(log))


def test_a_build_error_without_a_file_line_error_says_the_outputs_last_line() -> None:
    """A full disk ('No space left on device'), a linker failure or a killed compiler prints no file:line error;
    the message then carries the output's last line instead of only 'did not compile'."""
    from opbridge.errors import BuildError

    log = "as: warning\nFatal error: can't write 4 bytes to section .text of k.o: No space left on device\n"
    e = BuildError("building k (cpu) failed: k.cc did not compile", "c++ -c k.cc", [], log)
    assert str(e).endswith("last output: Fatal error: can't write 4 bytes to section .text of k.o: "
                           "No space left on device")
    assert "last output" not in str(BuildError("m", "c", ["k.cc:1:1: error: x"], "k.cc:1:1: error: x"))
