"""``row_strided`` arguments: the core's layout test and the declaration's checks.

The kernels' side (``opbridge::row_stride``, the exact ``check_disjoint``) is
tested through rotary_embedding in test_serving_ops.py, and every framework's
hand-over in tests/conformance/test_row_strided.py.
"""

from __future__ import annotations

import itertools
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import opbridge
from opbridge.call.overlap import byte_rows, ndarray_rows, row_strided, rows_meet
from opbridge.errors import DeclarationError


@pytest.mark.parametrize(("shape", "strides", "rows"), [
    ((4, 8), (8, 1), True),          # contiguous
    ((4, 8), (24, 1), True),         # a column slice of a (4, 24) tensor
    ((4, 2, 8), (48, 8, 1), True),   # the same, heads split
    ((2, 3, 8), (72, 8, 1), True),   # batch-strided, seq contiguous
    ((2, 3, 8), (72, 24, 1), False),  # seq strided too
    ((4, 8), (16, 2), False),        # every other column
    ((4, 8), (-8, 1), False),        # rows reversed
    ((4, 8), (0, 1), False),         # one row broadcast
    ((4, 8), (4, 1), False),         # overlapping rows
    ((1, 8), (0, 1), True),          # one row: its stride is never used
    ((4, 1, 8), (24, 99, 1), True),  # a dim of size 1 has any stride
    ((0, 8), (3, 1), True),          # empty
    ((5,), (2,), True),              # 1-D: each row one element
    ((), (), True),
])
def test_row_strided_layouts(shape: tuple[int, ...], strides: tuple[int, ...], rows: bool) -> None:
    assert row_strided(shape, strides) is rows


def test_ndarray_rows_reads_byte_strides() -> None:
    qkv = np.zeros((5, 48), np.float32)
    assert ndarray_rows(qkv) and ndarray_rows(qkv[:, 16:32]) and ndarray_rows(qkv[::2, :16])
    assert not ndarray_rows(qkv[:, ::2]) and not ndarray_rows(qkv[::-1]) and not ndarray_rows(qkv.T)
    odd = np.lib.stride_tricks.as_strided(np.zeros(64, np.uint8).view(np.float32)[:1], (2, 1), (6, 4))
    assert not ndarray_rows(odd)  # a stride that is not a whole number of elements


_NAMES = itertools.count()


def _lib() -> opbridge.Library:
    return opbridge.Library(f"row_strided_decl{next(_NAMES)}", sources=[])


def test_declaration_records_argument_indices() -> None:
    op = _lib().op("f(Tensor(a!) q, Tensor(b!)? k, int n) -> ()", row_strided=["k", "q", "q"])(
        lambda q, k, n: None)
    assert op.opdef.row_strided == (0, 1)


@pytest.mark.parametrize(("names", "message"), [
    (["n"], r"f: row_strided names 'n', which is not one of its Tensor arguments \['q', 'k'\]"),
    (["x"], r"f: row_strided names 'x'"),
    ("q", r"f: row_strided takes argument names, e.g. \('q',\), not the string 'q'"),
])
def test_declaration_refuses_what_is_not_a_tensor_argument(names: object, message: str) -> None:
    with pytest.raises(DeclarationError, match=message):
        _lib().op("f(Tensor(a!) q, Tensor(b!)? k, int n) -> ()", row_strided=names)(lambda q, k, n: None)


def _cells(r: tuple[int, int, int, int]) -> set[int]:
    begin, n, size, step = r
    return {begin + i * step + k for i in range(n) for k in range(size)}


def _random_rows(rng: random.Random) -> tuple[int, int, int, int]:
    n, size, begin = rng.randint(0, 5), rng.randint(0, 6), rng.randint(0, 40)
    step = size + rng.randint(0, 6)
    return (begin, 1, n * size, n * size) if n <= 1 or size == 0 or step == size else (begin, n, size, step)


def test_rows_meet_is_exact() -> None:
    rng = random.Random(0)
    for _ in range(5000):
        a, b = _random_rows(rng), _random_rows(rng)
        assert rows_meet(a, b) == bool(_cells(a) & _cells(b)), (a, b)
    assert byte_rows(0, (4, 8), (96, 4), 4) == (0, 4, 32, 96)
    assert byte_rows(0, (4, 8), (64, 8), 4) is None


def test_the_kernels_rows_test_is_the_same(tmp_path: Path) -> None:
    """include/opbridge/byte_rows.h (the kernels' check_disjoint, the NumPy and torch C entries) gives
    rows_meet's answers, and accepts the layouts row_strided does."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    include = Path(opbridge.__file__).parent / "include"
    (tmp_path / "t.cc").write_text("""
#include <opbridge/byte_rows.h>
#include <cstdio>
int main() {
  long long a[4], b[4], shape[2], strides[2];
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld", &a[0], &a[1], &a[2], &a[3],
                    &b[0], &b[1], &b[2], &b[3], &shape[0], &shape[1], &strides[0], &strides[1]) == 12) {
    opbridge::rows::ByteRows x{a[0], a[1], a[2], a[3]}, y{b[0], b[1], b[2], b[3]}, r;
    const int64_t sh[2] = {shape[0], shape[1]}, st[2] = {strides[0], strides[1]};
    std::printf("%d %d\\n", int(opbridge::rows::meet(x, y)), int(opbridge::rows::of(2, sh, st, 1, 0, &r)));
  }
}
""")
    subprocess.run([cxx, "-std=c++17", "-I", str(include), str(tmp_path / "t.cc"), "-o", str(tmp_path / "t")],
                   check=True)
    rng = random.Random(1)
    cases = []
    for _ in range(3000):
        shape = (rng.randint(0, 4), rng.randint(0, 4))
        cases.append((_random_rows(rng), _random_rows(rng), shape, (rng.randint(-2, 8), rng.randint(-1, 2))))
    text = "".join(" ".join(map(str, (*a, *b, *sh, *st))) + "\n" for a, b, sh, st in cases)
    got = subprocess.run([str(tmp_path / "t")], input=text, capture_output=True, text=True, check=True).stdout
    for (a, b, sh, st), line in zip(cases, got.splitlines(), strict=True):
        assert line == f"{int(rows_meet(a, b))} {int(row_strided(sh, st))}", (a, b, sh, st, line)
