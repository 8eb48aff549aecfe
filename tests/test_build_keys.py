"""The build cache key covers every header a build can include from its include directories, whatever the
header's suffix, and the directories its cflags name with -I or -iquote (a new user's edit of such a header
once reused the stale module, silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opbridge.build.compile import BuildSpec, fingerprint


@pytest.mark.parametrize("header", ["extra.h", "extra.hh", "extra.hxx", "extra.inl", "extra.ipp", "extra.tpp"])
def test_a_header_under_include_dirs_keys_the_build(tmp_path: Path, header: str) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    src = tmp_path / "k.cc"
    src.write_text(f'#include "{header}"\n')
    (inc / header).write_text("#define EXTRA 1.0f\n")
    spec = BuildSpec("keys", (src,), include_dirs=(inc,))
    before = fingerprint(spec)
    (inc / header).write_text("#define EXTRA 3.0f\n")
    assert fingerprint(spec) != before


@pytest.mark.parametrize("flags", [("-I{d}",), ("-I", "{d}"), ("-iquote", "{d}"), ("-iquote{d}",)])
def test_a_header_on_an_include_flag_keys_the_build(tmp_path: Path, flags: tuple[str, ...]) -> None:
    inc = tmp_path / "inc2"
    inc.mkdir()
    src = tmp_path / "k.cc"
    src.write_text('#include "viaflag.h"\n')
    (inc / "viaflag.h").write_text("#define VIAFLAG 1\n")
    spec = BuildSpec("keys", (src,), cflags=tuple(f.format(d=inc) for f in flags))
    before = fingerprint(spec)
    (inc / "viaflag.h").write_text("#define VIAFLAG 5\n")
    assert fingerprint(spec) != before


def test_an_isystem_tree_is_not_hashed(tmp_path: Path) -> None:
    inc = tmp_path / "third_party"
    inc.mkdir()
    (inc / "big.h").write_text("// v1\n")
    src = tmp_path / "k.cc"
    src.write_text('#include <big.h>\n')
    spec = BuildSpec("keys", (src,), cflags=("-isystem", str(inc)))
    before = fingerprint(spec)
    (inc / "big.h").write_text("// v2\n")
    assert fingerprint(spec) == before


def _units(spec: BuildSpec, root: Path) -> dict[str, tuple[str, ...]]:
    from opbridge.build import incremental, objects

    return {u.source.name: u.command for u in incremental.units(spec, objects.ObjectStore(root))}


def test_flags_for_sources_only_keep_opbridges_units_plain(tmp_path: Path) -> None:
    """The C entries' include directories and defines reach their own source, not the runtime and export
    units, which then compile once for both entries (one object); a library's flags reach every unit."""
    from opbridge.adapters.numpy import native
    from opbridge.build.compile import OPBRIDGE_UNITS
    from opbridge.build.ninja import write_ninja
    from opbridge.call import exchange

    plain = _units(BuildSpec("plain", ()), tmp_path)
    numpy_entry, tensor_entry = _units(native.spec(), tmp_path), _units(exchange.spec(), tmp_path)
    for name in OPBRIDGE_UNITS:
        assert numpy_entry[name] == tensor_entry[name] == plain[name]
    assert "-DOPB_NUMPY_VERSION" in " ".join(numpy_entry["entry.cc"])
    src = tmp_path / "k.cc"
    src.write_text("int k() { return 1; }\n")
    flagged = dict(include_dirs=(tmp_path,), cflags=("-DUSER_ABI=2",))
    library = _units(BuildSpec("lib", (src,), **flagged), tmp_path)  # type: ignore[arg-type]
    only = BuildSpec("lib", (src,), flags_for_sources_only=True, **flagged)  # type: ignore[arg-type]
    for name in OPBRIDGE_UNITS:
        assert "-DUSER_ABI=2" in library[name] and f"-I{tmp_path}" in library[name]
        assert "-DUSER_ABI=2" not in _units(only, tmp_path)[name]
    assert "-DUSER_ABI=2" in _units(only, tmp_path)["k.cc"]
    assert fingerprint(only) != fingerprint(BuildSpec("lib", (src,), **flagged))  # type: ignore[arg-type]
    # The AOT build's ninja file compiles each unit as the JIT build does.
    (tmp_path / "ninja").mkdir()
    ninja = write_ninja(only, tmp_path / "ninja", tmp_path / "lib.so").read_text()
    commands = {unit: next(line for line in ninja.splitlines() if "command" in line and unit in line)
                for unit in ("_opbridge_runtime.cc", "k.cc")}
    assert "USER_ABI" not in commands["_opbridge_runtime.cc"] and "-DUSER_ABI=2" in commands["k.cc"]
