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
