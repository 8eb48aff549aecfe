"""NumPy's C entry (opbridge.adapters.numpy.native): the calls it takes, the ones it leaves to Python."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from _split_sum import (
    REPEAT_FIRST_CC,
    SPLIT_SUM_CC,
    declare_repeat_first,
    declare_split_sum,
    shape_rule_dimensions_below_zero_are_refused,
)
from opbridge import ops
from opbridge.adapters import numpy as npa
from opbridge.adapters.numpy import native
from opbridge.call import memory
from opbridge.testing.compare import assert_close


@pytest.fixture(scope="module")
def entry() -> native.Library:
    ops.add(np.ones(2, np.float32), np.ones(2, np.float32))  # registers the op's NumPy path
    lib = native.library(build_now=True)
    if lib is None:
        pytest.skip("the NumPy C entry could not be built here")
    return lib


def _calls(name: str) -> int:
    got = npa.entry_calls(getattr(ops, name).opdef)
    assert got is not None, f"{name} has no C entry"
    return got


def _taken(name: str, *args: Any) -> Any:
    """Call the op; assert that the C entry took the call (a first call registers the op's NumPy path)."""
    getattr(ops, name)(*args)
    before = _calls(name)
    got = getattr(ops, name)(*args)
    assert _calls(name) == before + 1, f"{name}: the C entry did not take the call"
    return got


def _left(name: str, *args: Any) -> Any:
    """Call the op; assert that the Python path took it."""
    getattr(ops, name)(*args)
    before = _calls(name)
    got = getattr(ops, name)(*args)
    assert _calls(name) == before, f"{name}: the C entry took a call it must leave to Python"
    return got


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_entry_results_equal_the_reference(entry: native.Library, dtype: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(dtype)
    y = rng.standard_normal((5, 64)).astype(dtype)
    w = rng.standard_normal(64).astype(dtype)
    g = rng.standard_normal((5, 64)).astype(dtype)
    assert np.array_equal(_taken("add", x, y), x + y)
    for name, args in (("gelu", (x,)), ("rms_norm", (x, w, 1e-5)), ("gelu_backward", (g, x)),
                       ("rms_norm_backward", (g, x, w))):
        op = getattr(ops, name).opdef
        got = _taken(name, *args)
        want = op.reference(*[a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args])
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert len(got) == len(want)
        for gi, wi in zip(got, want):
            assert gi.dtype == x.dtype and gi.flags.c_contiguous and gi.flags.owndata
            rtol, atol = op.tolerance(dtype)
            assert_close(gi.astype(np.float64), np.asarray(wi, np.float64), rtol=rtol * 8, atol=atol * 8, dtype=dtype,
                         name=name)


def test_integers_and_scalars(entry: native.Library) -> None:
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert np.array_equal(_taken("add", a, a), a + a)
    x = np.ones((2, 8), np.float32)
    w = np.ones(8, np.float32)
    want = _taken("rms_norm", x, w, 1e-6)
    # numpy.float64 is a float (the Python path took it, in 1.1 us); numpy.float32 is not: Python converts it
    np.testing.assert_array_equal(_taken("rms_norm", x, w, np.float64(1e-6)), want)
    np.testing.assert_array_equal(_left("rms_norm", x, w, np.float32(1e-6)), want)


def test_calls_left_to_python(entry: native.Library) -> None:
    x = np.ones((4, 8), np.float32)
    _taken("add", x[:, ::2], x[:, ::2])  # strided: declined, then the call on its dense copies is the entry's
    before = _calls("add")
    with pytest.raises(TypeError, match="got >f4"):  # byte-swapped: refused, by the Python path
        ops.add(x.astype(">f4"), x.astype(">f4"))
    assert _calls("add") == before
    big = np.ones(memory.MIN_BYTES // 4, np.float32)
    out = _left("add", big, big)  # a pool output
    assert out[0] == 2.0
    before = _calls("add")
    with pytest.raises(TypeError):  # another opaque 2-byte type than ml_dtypes' bfloat16
        ops.add(np.zeros(4, "V2"), np.zeros(4, "V2"))
    assert _calls("add") == before


def test_read_only_inputs(entry: native.Library) -> None:
    """A read-only array (NumPy's view of a JAX array is one) the kernel only reads: taken as it is (the
    Python path aliased it for DLPack, 15 us a call); one the op writes, or out=: the Python path names it."""
    x = np.arange(8, dtype=np.float32)
    ro = x.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(_taken("add", ro, ro), x + x)
    w, res = np.ones(64, np.float32), np.ones((2, 64), np.float32)
    frozen = np.ones((2, 64), np.float32)
    frozen.flags.writeable = False
    _taken("fused_add_rms_norm", res.copy(), frozen.copy(), w, 1e-6)  # writeable arguments: taken
    before = _calls("fused_add_rms_norm")
    with pytest.raises(ValueError, match="argument 'input' is read-only, and fused_add_rms_norm writes it"):
        ops.fused_add_rms_norm(frozen, res, w, 1e-6)
    assert _calls("fused_add_rms_norm") == before
    np.testing.assert_array_equal(res, np.ones((2, 64), np.float32))
    out = np.zeros(8, np.float32)
    out.flags.writeable = False
    before = _calls("add")
    with pytest.raises(ValueError, match="out= holds a read-only array"):
        ops.add(x, x, out=out)
    assert _calls("add") == before and not out.any()


def test_ml_dtypes_bfloat16(entry: native.Library) -> None:
    """ml_dtypes' bfloat16 arrays (NumPy has no bfloat16 of its own): taken by the entry, outputs made in
    it, by a shape rule too, and out=; an array of 8 took 10.8 us on the Python path, 0.19 here."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    b = x.astype(ml_dtypes.bfloat16)
    got = _taken("add", b, b)
    assert got.dtype == b.dtype
    np.testing.assert_array_equal(got.astype(np.float32), (2 * b.astype(np.float32)).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))
    half = _taken("silu_and_mul", b)
    assert half.dtype == b.dtype and half.shape == (4, 32)
    assert_close(half.astype(np.float32), ops.silu_and_mul.opdef.reference(b.astype(np.float32)), rtol=2e-2,
                 atol=2e-2)
    o = np.empty_like(b)
    before = _calls("gelu")
    assert ops.gelu(b, out=o) is o and _calls("gelu") == before + 1
    np.testing.assert_array_equal(o.astype(np.float32), ops.gelu(b).astype(np.float32))


def test_ml_dtypes_imported_after_the_entry_loaded() -> None:
    """The entry learns of ml_dtypes' bfloat16 from the Python path's first bfloat16 call."""
    pytest.importorskip("ml_dtypes")
    code = ("import numpy as np, opbridge.ops as ops\nfrom opbridge.adapters import numpy as npa\n"
            "from opbridge.adapters.numpy import native\n"
            "native.library(build_now=True)\nx = np.ones(8, np.float32)\nops.add(x, x); ops.add(x, x)\n"
            "import ml_dtypes\nb = x.astype(ml_dtypes.bfloat16)\nops.add(b, b)\n"
            "n = npa.entry_calls(ops.add.opdef)\nops.add(b, b)\nprint(npa.entry_calls(ops.add.opdef) - n)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "1"


@pytest.mark.parametrize(("args", "error", "match"), [
    ((np.ones(3, np.int8), np.ones(3, np.int8)), TypeError, "add: x must have dtype"),
    ((np.ones(3, np.float32), np.ones(4, np.float32)), ValueError, "add"),
    ((np.ones(3, np.float32), np.ones(3, np.float64)), TypeError, "add"),
])
def test_errors_are_the_python_paths(entry: native.Library, args: tuple[Any, ...], error: type, match: str) -> None:
    """A call the kernel refuses raises what the Python path raises, and the next call is unaffected."""
    before = _calls("add")
    with pytest.raises(error, match=match) as got:
        ops.add(*args)
    spec = [(a.tolist(), str(a.dtype)) for a in args]
    code = ("import numpy as np, opbridge.ops as ops\n"
            f"args = [np.array(v, d) for v, d in {spec!r}]\n"
            "try:\n    ops.add(*args)\nexcept Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n")
    env = {**os.environ, "OPBRIDGE_NUMPY_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out == f"{type(got.value).__name__}: {got.value}"
    assert _calls("add") == before
    np.testing.assert_array_equal(_taken("add", np.ones(3, np.float32), np.ones(3, np.float32)), 2.0)


def test_threads(entry: native.Library) -> None:
    x = np.arange(1 << 17, dtype=np.float32)  # 512 KiB: the GIL is released around the kernel
    want = x + x
    before = _calls("add")
    bad: list[str] = []

    def work() -> None:
        for _ in range(50):
            if not np.array_equal(ops.add(x, x), want):
                bad.append("wrong result")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and _calls("add") == before + 200


def test_off_builds_and_loads_nothing() -> None:
    code = ("import numpy as np, opbridge.ops as ops\n"
            "from opbridge.adapters import numpy as npa\nfrom opbridge.adapters.numpy import native\n"
            "ops.add(np.ones(2, np.float32), np.ones(2, np.float32))\n"
            "print(native.library(build_now=False) is None, native.ENTRY.builder is None, "
            "npa.entry_calls(ops.add.opdef))\n")
    env = {**os.environ, "OPBRIDGE_NUMPY_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "True", "None"]


def test_what_the_entry_takes() -> None:
    # Every built-in op: like-shaped outputs, a shape rule's (the gated activations), written arguments.
    assert {name: native.takes(op) for name, op in ops.LIBRARY.ops.items()} == dict.fromkeys(ops.LIBRARY.ops, True)


def test_outputs_shaped_by_a_shape_rule(entry: native.Library) -> None:
    """silu_and_mul's output halves the last dim: the entry asks the rule once per signature."""
    rng = np.random.default_rng(3)
    for shape in ((8, 64), (3, 2, 10), (1, 2)):
        for dtype in ("float32", "float64"):
            x = rng.standard_normal(shape).astype(dtype)
            got = _taken("silu_and_mul", x)
            assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == x.dtype
            assert_close(got, ops.silu_and_mul.reference(x.astype(np.float64)).astype(dtype), dtype=dtype)
    before = _calls("silu_and_mul")
    with pytest.raises(ValueError, match="silu_and_mul: x's last dim must be even"):  # the rule's own error
        ops.silu_and_mul(np.ones((2, 3), np.float32))
    big = np.ones((memory.MIN_BYTES // 4, 2), np.float32)  # a pool-sized output: the Python path's
    assert ops.silu_and_mul(big).shape == (memory.MIN_BYTES // 4, 1)
    assert _calls("silu_and_mul") == before
    # More signatures than the rule cache keeps, from four threads (the rule is Python: threads switch
    # while it runs): every answer stays right.
    bad: list[str] = []

    def work(seed: int) -> None:
        for n in np.random.default_rng(seed).permutation(np.arange(2, 700, 2)):
            x = np.full((1, int(n)), 0.5, np.float32)
            got = ops.gelu_and_mul(x)
            if got.shape != (1, n // 2) or not np.allclose(got, ops.gelu_and_mul.reference(x)[0, 0], rtol=1e-5):
                bad.append(f"n={n}: {got.shape}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:3]


def test_ops_that_write_their_arguments(entry: native.Library) -> None:
    """vLLM's in-place ops run in the entry too (returning None), and what they write equals the reference."""
    rng = np.random.default_rng(1)
    x, r = rng.standard_normal((2, 6, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    xs, rs = x.copy(), r.copy()
    assert _taken("fused_add_rms_norm", xs, rs, w, 1e-6) is None
    want_x, want_r = x.astype(np.float64), r.astype(np.float64)
    for _ in range(2):  # _taken calls twice: the reference too
        ops.fused_add_rms_norm.reference(want_x, want_r, w.astype(np.float64), 1e-6)
    assert_close(xs, want_x.astype(np.float32), dtype="float32")
    assert_close(rs, want_r.astype(np.float32), dtype="float32")

    pos = np.array([0, 3, 5], np.int64)
    q, k = rng.standard_normal((2, 3, 32)).astype(np.float32)
    cache = rng.standard_normal((8, 32)).astype(np.float32)
    q1, k1, q2 = q.copy(), k.copy(), q.copy()
    ops.rotary_embedding(pos, q1, k1, 32, cache, True)
    before = _calls("rotary_embedding")
    assert ops.rotary_embedding(pos, q2, None, 32, cache, True) is None  # an optional tensor: None, taken
    assert _calls("rotary_embedding") == before + 1
    np.testing.assert_array_equal(q2, q1)


def test_writes_the_entry_leaves_to_python(entry: native.Library) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w = np.ones(32, np.float32)
    before = _calls("fused_add_rms_norm")
    with pytest.raises(ValueError, match="mutated argument 'input' overlaps argument 'residual'"):
        ops.fused_add_rms_norm(x, x, w, 1e-6)  # the Python path names the pair
    wide = rng.standard_normal((4, 64)).astype(np.float32)
    strided, dense = wide[:, ::2], wide[:, ::2].copy()
    res1, res2 = x.copy(), x.copy()
    ops.fused_add_rms_norm(strided, res1, w, 1e-6)  # strided: the Python path writes back into it
    _taken("fused_add_rms_norm", dense, res2, w, 1e-6)
    ops.fused_add_rms_norm(strided, res1, w, 1e-6)  # twice, as _taken did
    np.testing.assert_array_equal(strided, dense)
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ops.fused_add_rms_norm(ro, x.copy(), w, 1e-6)
    assert _calls("fused_add_rms_norm") == before + 2  # only the two dense calls of _taken


def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("lib", None), ("builder", None), ("failed", False), ("waiting", [])):
        monkeypatch.setattr(native.ENTRY, name, value)


class _FakeChild:
    """Stands in for the build's detached child: wait() blocks until *release*, then returns *result*."""

    def __init__(self, entered: threading.Event, release: threading.Event, result: tuple[int, str]) -> None:
        self.entered, self.release, self.result = entered, release, result

    def wait(self) -> tuple[int, str]:
        self.entered.set()
        self.release.wait(10)
        return self.result


def test_built_in_the_background_when_not_cached(entry: native.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in the cache: the first op starts the build beside the caller; what waited runs once it is loaded."""
    from opbridge.build import jit

    path = entry.path
    entered, release = threading.Event(), threading.Event()
    _fresh_state(monkeypatch)
    monkeypatch.setattr(jit, "cached_artifact", lambda spec: path if release.is_set() else None)
    monkeypatch.setattr(native.ENTRY, "start_child", lambda: _FakeChild(entered, release, (0, "")))
    got: list[native.Library] = []
    native.when_ready(ops.add.opdef, got.append)
    assert entered.wait(10)
    native.when_ready(ops.gelu.opdef, got.append)  # while the compiler runs: must not wait for it
    assert not got and native.ENTRY.builder is not None and native.ENTRY.builder.is_alive()
    release.set()
    native.ENTRY.builder.join(10)
    assert len(got) == 2 and got[0] is got[1] is native.loaded()
    native.when_ready(ops.rms_norm.opdef, got.append)  # loaded: runs at once
    assert len(got) == 3


def test_a_failed_build_warns_once_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge.build import jit

    _fresh_state(monkeypatch)
    monkeypatch.setattr(jit, "cached_artifact", lambda spec: None)
    released = threading.Event()
    released.set()
    log = "entry.cc:3:1: error: no compiler here\n"
    monkeypatch.setattr(native.ENTRY, "start_child", lambda: _FakeChild(threading.Event(), released, (1, log)))
    got: list[Any] = []
    with pytest.warns(RuntimeWarning, match=r"NumPy calls stay on the Python fast path.*no compiler here"):
        native.when_ready(ops.add.opdef, got.append)
        assert native.ENTRY.builder is not None
        native.ENTRY.builder.join(10)
    native.when_ready(ops.gelu.opdef, got.append)
    assert not got and native.loaded() is None and native.ENTRY.failed


SCALE_INPLACE_CC = """
#include <opbridge/opbridge.h>
void scale__cpu(opbridge::TensorView x, double alpha) {
  float* p = static_cast<float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= float(alpha);
}
OPBRIDGE_EXPORT(scale__cpu);
"""


def test_an_op_returning_the_argument_it_writes(entry: native.Library, tmp_path: Any) -> None:
    import opbridge

    (tmp_path / "scale_.cc").write_text(SCALE_INPLACE_CC)
    lib = opbridge.Library("np_entry_alias", sources=["scale_.cc"], root=tmp_path, dtypes=["float32"])

    @lib.op("scale_(Tensor(a!) x, float alpha) -> Tensor(a!)")
    def scale_(x: np.ndarray, alpha: float) -> np.ndarray:
        x *= alpha
        return x

    x = np.ones(5, np.float32)
    assert scale_(x, 2.0) is x  # the first call registers the op's NumPy path
    before = npa.entry_calls(lib.ops["scale_"])
    assert before is not None, "scale_ has no C entry"
    got = scale_(x, 3.0)
    assert got is x and npa.entry_calls(lib.ops["scale_"]) == before + 1
    np.testing.assert_array_equal(x, np.full(5, 6.0, np.float32))




def test_out_of_outputs_a_shape_rule_gives(entry: native.Library, tmp_path: Any) -> None:
    """out= a tuple for an op whose outputs its shape rule gives (of two dtypes): the entry compares each with
    the rule's answer, and leaves a mismatch to Python's ValueError."""
    import opbridge

    (tmp_path / "split_sum.cc").write_text(
        "#include <opbridge/opbridge.h>\nusing tvm::ffi::TensorView;\n" + SPLIT_SUM_CC)
    lib = opbridge.Library("np_entry_outs", sources=["split_sum.cc"], root=tmp_path, dtypes=["float32"])
    split_sum = declare_split_sum(lib)

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    outs = (np.zeros(3, np.float32), np.zeros(1, np.int64))
    split_sum(x, out=outs)  # the first call registers the op's NumPy path
    calls = lambda: npa.entry_calls(lib.ops["split_sum"])  # noqa: E731
    before = calls()
    assert before is not None, "split_sum has no C entry"
    assert split_sum(x, out=outs) is outs and calls() == before + 1
    np.testing.assert_array_equal(outs[0], x.sum(axis=1))
    np.testing.assert_array_equal(outs[1], [3])
    with pytest.raises(ValueError, match=r"split_sum: out\[1\] has shape \(1,\) and dtype int32"):
        split_sum(x, out=(outs[0], np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match=r"split_sum: out\[0\] has shape \(4,\)"):
        split_sum(x, out=(np.zeros(4, np.float32), outs[1]))
    assert calls() == before + 1


def test_a_shape_rule_dimension_below_zero_is_refused(entry: native.Library, tmp_path: Any) -> None:
    import opbridge

    (tmp_path / "rep.cc").write_text("#include <opbridge/opbridge.h>\nusing tvm::ffi::TensorView;\n" + REPEAT_FIRST_CC)
    lib = opbridge.Library("np_entry_rep", sources=["rep.cc"], root=tmp_path, dtypes=["float32"])
    repeat_first = declare_repeat_first(lib)
    shape_rule_dimensions_below_zero_are_refused(repeat_first, lambda a: a,
                                                 lambda: npa.entry_calls(lib.ops["repeat_first"]))


def test_entry_takes_row_strided_slices_and_leaves_other_layouts(entry: native.Library) -> None:
    """rotary_embedding declares query and key row_strided: the entry rotates vLLM's column slices of
    one qkv array in place (no dense copy, no Python path); every-other columns, and a key that meets
    query, go to the Python path (a dense copy, and the alias error)."""
    from opbridge.ops.rotary import _cos_sin_cache

    rng = np.random.default_rng(0)
    pos, cache = rng.integers(0, 16, 6), _cos_sin_cache(16, 8).astype(np.float32)
    qkv = rng.standard_normal((6, 40)).astype(np.float32)
    want_q, want_k = np.ascontiguousarray(qkv[:, :16]), np.ascontiguousarray(qkv[:, 16:24])
    ops.rotary_embedding(pos, want_q, want_k, 8, cache, True)
    ops.rotary_embedding(pos, want_q, want_k, 8, cache, True)
    v = qkv[:, 24:].copy()
    _taken("rotary_embedding", pos, qkv[:, :16], qkv[:, 16:24], 8, cache, True)  # called twice
    np.testing.assert_array_equal(qkv[:, :16], want_q)
    np.testing.assert_array_equal(qkv[:, 16:24], want_k)
    np.testing.assert_array_equal(qkv[:, 24:], v)
    wide = rng.standard_normal((6, 32)).astype(np.float32)
    _left("rotary_embedding", pos, wide[:, ::2], None, 8, cache, True)
    before = _calls("rotary_embedding")
    with pytest.raises(ValueError, match="rotary_embedding: mutated argument 'query' overlaps argument 'key'"):
        ops.rotary_embedding(pos, qkv[:, :16], qkv[:, 8:16], 8, cache, True)
    assert _calls("rotary_embedding") == before


def test_out_is_written_by_the_entry(entry: native.Library) -> None:
    """out=: the entry's out= builtin writes the caller's array and returns it; what it cannot take, Python does."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, 16)).astype(np.float32), rng.standard_normal((4, 16)).astype(np.float32)
    o = np.empty_like(x)
    ops.add(x, y, out=o)  # a first call registers the op's NumPy path
    before = _calls("add")
    assert ops.add(x, y, out=o) is o and _calls("add") == before + 1
    np.testing.assert_array_equal(o, x + y)
    h = np.empty((4, 8), np.float32)  # a shape rule's op
    ops.silu_and_mul(x, out=h)
    before = _calls("silu_and_mul")
    assert ops.silu_and_mul(x, out=h) is h and _calls("silu_and_mul") == before + 1
    assert_close(h, ops.silu_and_mul.opdef.reference(x))
    before = _calls("add")
    xc = x.copy()
    assert ops.add(xc, y, out=xc) is xc  # out= is an input: Python's fresh buffer, copied back
    np.testing.assert_array_equal(xc, x + y)
    wide = np.zeros((4, 32), np.float32)
    ops.add(x, y, out=wide[:, ::2])  # strided out=: written through a dense copy
    np.testing.assert_array_equal(wide[:, ::2], x + y)
    np.testing.assert_array_equal(wide[:, 1::2], 0)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ops.add(x, y, out=ro)
    pair = np.empty_like(x)
    assert ops.add(x, y, out=(pair,)) is pair
    assert _calls("add") == before, "the entry took an out= it must leave to Python"


def test_out_of_several_outputs_is_written_by_the_entry(entry: native.Library) -> None:
    """out= of an op whose returns are its outputs (rms_norm_backward's (dx, dw)): a tuple, which the entry
    writes and returns; outputs that overlap an input or each other, and a wrong shape, it leaves to Python."""
    rng = np.random.default_rng(4)
    g, x = (rng.standard_normal((4, 16)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(16).astype(np.float32)
    want = ops.rms_norm_backward(g, x, w)
    outs = (np.full_like(g, np.nan), np.full_like(w, np.nan))
    ops.rms_norm_backward(g, x, w, out=outs)
    before = _calls("rms_norm_backward")
    assert ops.rms_norm_backward(g, x, w, out=outs) is outs and _calls("rms_norm_backward") == before + 1
    for got, ref in zip(outs, want, strict=True):
        np.testing.assert_array_equal(got, ref)
    gc = g.copy()
    dx, dw = ops.rms_norm_backward(gc, x, w, out=(gc, np.empty_like(w)))  # dx over grad: a fresh buffer
    np.testing.assert_array_equal(dx, want[0])
    np.testing.assert_array_equal(dw, want[1])
    buf = np.zeros(80, np.float32)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap in memory"):  # outputs sharing bytes
        ops.rms_norm_backward(g, x, w, out=(buf[:64].reshape(4, 16), buf[56:72]))
    assert not buf.any()
    with pytest.raises(ValueError, match=r"rms_norm_backward: out\[1\] has shape \(8,\)"):
        ops.rms_norm_backward(g, x, w, out=(outs[0], np.empty(8, np.float32)))
    with pytest.raises(TypeError, match="out= takes a tensor or a tuple of them, got a list of 2"):
        ops.rms_norm_backward(g, x, w, out=list(outs))
    assert _calls("rms_norm_backward") == before + 1, "the entry took an out= it must leave to Python"


def test_out_of_a_wrong_shape_raises_the_kernels_error_once(entry: native.Library) -> None:
    x = np.ones((4, 16), np.float32)
    small = np.full((2, 16), 7, np.float32)
    ops.add(x, x, out=np.empty_like(x))
    before = _calls("add")
    with pytest.raises(ValueError, match="add"):
        ops.add(x, x, out=small)
    assert _calls("add") == before
