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
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge.call.layout import accepted_rows, byte_rows, ndarray_rows, row_strided, rows_meet
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
    ((5,), (2,), False),             # 1-D strided: a kernel's row would span the first dim
    ((5,), (1,), True),
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


def test_layout_source_takes_dense_or_declared_rows_and_keeps_what_it_read() -> None:
    """core.layout_source: dense everywhere, rows at a stride only where declared; with capture, the
    contiguity and rows of each row_strided argument stay bound for the code after the test."""
    from opbridge.call.core import layout_source

    op = _lib().op("f(Tensor(a!) q, Tensor(b!)? k, Tensor w, int n) -> ()", row_strided=["q", "k"])(
        lambda q, k, w, n: None).opdef
    names = ["q", "k", "w", "n"]
    dense, rows = "{t}.flags.c_contiguous", "_rows_of({t})"
    plain = layout_source(op, names, dense, "_rows_of({t}) is not None")
    kept = layout_source(op, names, dense, rows, capture=("_c{t}", "_r{t}"))
    assert kept == ("((_cq := q.flags.c_contiguous) or (_rq := _rows_of(q)) is not None) and "
                    "(k is None or ((_ck := k.flags.c_contiguous) or (_rk := _rows_of(k)) is not None)) and "
                    "w.flags.c_contiguous")
    assert layout_source(op, names, dense, None) == ("q.flags.c_contiguous and (k is None or k.flags.c_contiguous) "
                                                     "and w.flags.c_contiguous")
    with pytest.raises(ValueError, match="capture needs rows"):
        layout_source(op, names, dense, None, capture=("_c{t}", "_r{t}"))

    def of(t: np.ndarray) -> tuple[int, int, int, int] | None:
        return accepted_rows(0, t.shape, t.strides, t.itemsize)

    qkv = np.zeros((4, 24), np.float32)
    cases = [(qkv[:, :8], None, qkv[:, :8].copy(), True),
             (qkv[:, :8], qkv[:, 8:16], qkv[:, 16:], False),  # w is not dense: only q and k may be rows
             (qkv[:, ::2], None, np.zeros(3), False), (qkv, qkv[::2], np.zeros(3), True)]
    for q, k, w, takes in cases:
        scope: dict[str, Any] = {"_rows_of": of, "q": q, "k": k, "w": w}
        assert eval(plain, dict(scope)) is takes
        assert bool(eval(kept, scope)) is takes
        if takes:
            for t, n in ((q, "q"), (k, "k")):
                if t is not None:
                    assert scope[f"_c{n}"] is t.flags.c_contiguous
                    assert scope.get(f"_r{n}") == (None if t.flags.c_contiguous else of(t))


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
    opbridge::rows::ByteRows x{a[0], a[1], a[2], a[3]}, y{b[0], b[1], b[2], b[3]};
    const int64_t sh[2] = {shape[0], shape[1]}, st[2] = {strides[0], strides[1]};
    std::printf("%d %d %d\\n", int(opbridge::rows::meet(x, y)), int(opbridge::rows::accepts(2, sh, st)),
                int(opbridge::rows::accepts(1, sh, st)));
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
        want = f"{int(rows_meet(a, b))} {int(row_strided(sh, st))} {int(row_strided(sh[:1], st[:1]))}"
        assert line == want, (a, b, sh, st, line)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_rms_norm_reads_per_head_views_of_a_qkv_slice(framework: str, dtype: str, kernel_args: list[list[Any]]) -> None:
    """vLLM's q-norm (Qwen3): rms_norm over the heads of query, a (tokens, heads, head_size) view of a
    column slice of qkv. rms_norm declares x row_strided: the kernel reads the view (no dense copy) and
    gives the bits it gives on a dense copy; torch.ops takes it in the native kernel."""
    torch = pytest.importorskip("torch")
    from opbridge import ops

    if framework == "numpy" and dtype == "bfloat16":
        pytest.skip("NumPy has no bfloat16 of its own")
    seen = kernel_args
    tokens, heads, kv_heads, d = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(getattr(torch, dtype))
    w = torch.randn(d).to(qkv.dtype)
    if framework == "numpy":
        qkv, w = qkv.numpy(), w.numpy()
    q = qkv[:, :heads * d].reshape(tokens, heads, d)  # a view: strides (qkv row, d, 1)
    assert (q.base is not None) if framework == "numpy" else q.data_ptr() == qkv.data_ptr()
    got = ops.rms_norm(q, w, 1e-6)
    dense = q.copy() if framework == "numpy" else q.contiguous()
    assert all(full[0] is q for full in seen), "x was copied"
    np.testing.assert_array_equal(np.asarray(got.float() if framework == "torch" else got),
                                  np.asarray(ops.rms_norm(dense, w, 1e-6).float() if framework == "torch"
                                             else ops.rms_norm(dense, w, 1e-6)))
    if framework == "torch":
        from opbridge.adapters.torch import native

        before = native.native_calls(ops.rms_norm.opdef)
        assert torch.equal(torch.ops.opbridge.rms_norm(q, w, 1e-6), got)
        if before is not None:
            assert native.native_calls(ops.rms_norm.opdef) == before + 1


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_rotary_with_batch_strided_2d_positions(framework: str) -> None:
    """positions (batch, seq) and query/key whose batches are apart (a slice of a longer sequence): the
    kernel takes them as they are (seq token rows per batch index), with the dense copies' results."""
    torch = pytest.importorskip("torch")
    from opbridge import ops
    from opbridge.ops.rotary import _cos_sin_cache

    b, s, heads, kv_heads, d = 3, 4, 2, 1, 8
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 32, (b, s), generator=gen)
    qbuf, kbuf = torch.randn(b, s + 2, heads * d, generator=gen), torch.randn(b, s + 1, kv_heads, d, generator=gen)
    cache = torch.from_numpy(_cos_sin_cache(32, d)).float()
    q, k = qbuf[:, :s], kbuf[:, 1:]  # batch strides (s + 2) and (s + 1) token rows; dims after the first dense
    want_q, want_k = q.contiguous(), k.contiguous()
    ops.rotary_embedding(pos, want_q, want_k, d, cache, False)
    before = (qbuf.clone(), kbuf.clone())
    args = (pos, q, k, d, cache, False)
    if framework == "numpy":
        args = tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)
    ops.rotary_embedding(*args)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qbuf[:, s:], before[0][:, s:]) and torch.equal(kbuf[:, :1], before[1][:, :1])
    # and with only key strided (query dense): the two tensors' rows are found differently
    q2, kbuf2 = want_q.clone(), kbuf.clone()
    ops.rotary_embedding(pos, q2, kbuf2[:, 1:], d, cache, False)
    ref_q, ref_k = want_q.clone(), want_k.clone()
    ops.rotary_embedding(pos, ref_q, ref_k, d, cache, False)
    assert torch.equal(q2, ref_q) and torch.equal(kbuf2[:, 1:], ref_k)
