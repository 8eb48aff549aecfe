"""Declaration mistakes a new user makes, caught where they are made (or at the first build), with a message
that names the library or op and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

import opbridge
from opbridge.build.library import build_spec
from opbridge.errors import DeclarationError


def test_one_source_alone_is_a_path_not_its_characters(tmp_path: Path) -> None:
    (tmp_path / "k.cc").write_text("")
    lib = opbridge.Library("first_touch_one_source", sources="k.cc", include_dirs=tmp_path, root=tmp_path)
    assert lib.sources == (tmp_path / "k.cc",) and lib.include_dirs == (tmp_path,)
    with pytest.raises(DeclarationError, match=r"cflags=\['-O2', '-DX'\]"):
        opbridge.Library("first_touch_flags", cflags="-O2 -DX")  # type: ignore[arg-type]


def test_a_missing_source_names_the_library_and_where_paths_resolve(tmp_path: Path) -> None:
    lib = opbridge.Library("first_touch_missing", sources=["nosuch.cc"], root=tmp_path)
    where = rf"\(Library\(sources=...\) resolves relative paths against {tmp_path}\)"
    what = r"library 'first_touch_missing' \(cpu\): no source file .*nosuch.cc "
    with pytest.raises(DeclarationError, match=what + where):
        build_spec(lib, "cpu")


def test_a_backward_that_cannot_take_its_call_is_refused_when_declared() -> None:
    lib = opbridge.Library("first_touch_backward", sources=())
    with pytest.raises(DeclarationError, match=r"scale: the backward\(grad, x\) cannot take its call .*"
                                               r"e\.g\. backward=lambda grad, x, alpha: \.\.\."):
        lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"),
               backward=lambda grad, x: (grad,))(lambda x, alpha: x * alpha)
    for fine in (lambda grad, x, alpha: (grad * alpha,), lambda *a: (a[0],), lambda grad, x, alpha=1.0: (grad,)):
        lib.op(f"scale{len(lib.ops)}(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"),
               backward=fine)(lambda x, alpha: x * alpha)
