"""The serving ops (opbridge/ops/serving.py, rotary.py, advance_step.py) against independent implementations.

silu_and_mul / gelu_and_mul (and backward), fused_add_rms_norm,
rotary_embedding and advance_step_flashattn are compared with torch / NumPy
formulas re-derived from vLLM's reference code (not with the op's own NumPy
reference), every rejection path of rotary_embedding and
advance_step_flashattn is checked to name the argument and to leave every
buffer unwritten, and the ops are run under torch.compile(fullgraph=True) and
jax.jit. The generic matrix (check_op, conformance) runs in
test_builtin_ops.py / tests/conformance.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opbridge.ops as ops

torch = pytest.importorskip("torch")
F = torch.nn.functional

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def close(got: Any, want: Any, dtype: Any = torch.float32, scale: float = 1.0) -> None:
    rtol, atol = TOL[dtype]
    got = torch.from_numpy(np.array(got)) if isinstance(got, np.ndarray) else torch.as_tensor(got)
    want = torch.from_numpy(np.array(want)) if isinstance(want, np.ndarray) else torch.as_tensor(want)
    torch.testing.assert_close(got.double(), want.double(),
                               rtol=rtol * scale, atol=atol * scale)


def rounded(t: Any, dtype: Any) -> Any:
    """t rounded to dtype, as float64 (inputs are rounded before the reference sees them)."""
    return t.to(dtype).double()


# ---------------------------------------------------------------------------
# silu_and_mul / gelu_and_mul
# ---------------------------------------------------------------------------

ACTS: dict[str, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
    "silu": (ops.silu_and_mul, ops.silu_and_mul_backward, F.silu),
    "gelu": (ops.gelu_and_mul, ops.gelu_and_mul_backward, lambda a: F.gelu(a, approximate="tanh")),
}


def torch_and_mul(act: Callable[..., Any], x: Any) -> Any:
    """vLLM's forward_native: act(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    return act(x[..., :d]) * x[..., d:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ACTS)
@pytest.mark.parametrize("shape", [(2,), (3, 10), (2, 3, 258), (0, 8), (257, 1024)])
def test_and_mul_forward(kind: str, dtype: Any, shape: tuple[int, ...]) -> None:
    fwd, _, act = ACTS[kind]
    x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype)
    y = fwd(x)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    close(y, torch_and_mul(act, x.double()).to(dtype), dtype)
    out = torch.empty_like(y)  # destination passing through out=
    assert fwd(x, out=out) is out
    torch.testing.assert_close(out, y, rtol=0, atol=0)
    if dtype == torch.float32:  # NumPy arrays run the same kernel
        np.testing.assert_array_equal(fwd(x.numpy()), y.numpy())


@pytest.mark.parametrize("kind", ACTS)
def test_activation_error_bounds(kind: str) -> None:
    """The bounds documented in opbridge/activations.h, over 2,000,001 points of [-20, 20]."""
    fwd, bwd, _ = ACTS[kind]
    a = np.linspace(-20, 20, 2_000_001).astype(np.float32)
    x = np.concatenate([a, np.ones_like(a)])[None]
    a64 = a.astype(np.float64)
    if kind == "silu":
        s = 1 / (1 + np.exp(-a64))
        f, df = a64 * s, s * (1 + a64 * (1 - s))
        rel_bound, mask = 2.5e-7, np.abs(f) > 1e-30
    else:
        z = 2 * np.sqrt(2 / np.pi) * (a64 + 0.044715 * a64**3)
        s = 1 / (1 + np.exp(-z))
        f = a64 * s
        df = s + a64 * 2 * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * a64**2) * np.exp(-z) * s * s
        rel_bound, mask = 2.5e-6, np.abs(f) > 1e-6
    y = fwd(x)[0].astype(np.float64)
    assert np.max(np.abs(y - f)[mask] / np.abs(f[mask])) <= rel_bound
    assert np.max(np.abs(y - f)[np.abs(f) > 1e-30] / np.abs(f[np.abs(f) > 1e-30])) <= 1.5e-5
    g = bwd(np.ones((1, a.size), np.float32), x)[0].astype(np.float64)
    assert np.max(np.abs(g[: a.size] - df)) <= 3e-7
    np.testing.assert_array_equal(g[a.size:], y)  # d/db = act(a), the forward's value bit for bit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ACTS)
def test_and_mul_backward_matches_torch_autograd(kind: str, dtype: Any) -> None:
    fwd, bwd, act = ACTS[kind]
    x = (torch.randn(5, 3, 66, dtype=torch.float64) * 3).to(dtype)
    g = torch.randn(5, 3, 33, dtype=torch.float64).to(dtype)
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(torch_and_mul(act, x64), x64, g.double())
    close(bwd(g, x), want.to(dtype), dtype)  # the backward op itself
    xr = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(fwd(xr), xr, g)  # wired as the op's backward
    close(got, want.to(dtype), dtype)
    assert got.dtype == dtype and got.shape == x.shape


@pytest.mark.parametrize("kind", ACTS)
def test_and_mul_rejects_odd_last_dim(kind: str) -> None:
    fwd, bwd, _ = ACTS[kind]
    name = f"{kind}_and_mul"
    for x in (torch.ones(3, 7), np.ones((3, 7), np.float32), torch.ones(())):
        with pytest.raises(ValueError, match=rf"{name}: x's last dim must be even"):
            fwd(x)
    with pytest.raises(ValueError, match=rf"{name}_backward: x's last dim must be even"):
        bwd(torch.ones(3, 3), torch.ones(3, 7))
    msg = rf"{name}_backward: grad must have x's shape with the last dim halved"
    with pytest.raises(ValueError, match=msg):
        bwd(torch.ones(3, 4), torch.ones(3, 6))
    with pytest.raises(TypeError, match=rf"{name}: x must have dtype float32, float16, bfloat16 or float64"):
        fwd(torch.ones(3, 4, dtype=torch.int16))
    # A strided input is accepted (issue 11): the same result as on a contiguous copy.
    strided = torch.randn(4, 16)[:, ::2]
    torch.testing.assert_close(fwd(strided), fwd(strided.contiguous()), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# fused_add_rms_norm
# ---------------------------------------------------------------------------


def vllm_fused_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """vLLM's RMSNorm.forward_native with a residual: the sum is rounded to the dtype, then normed in fp32."""
    res = (x.float() + residual.float()).to(x.dtype)
    r = res.float()
    y = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return y, res


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (2, 3, 129), (0, 16), (300, 1024)])
def test_fused_add_rms_norm_matches_vllm(dtype: Any, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    res = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype)
    w = torch.randn(shape[-1], dtype=torch.float64).to(dtype)
    want_y, want_res = vllm_fused_add_rms_norm(x, res, w, 1e-5)
    px, pr = x.data_ptr(), res.data_ptr()
    assert ops.fused_add_rms_norm(x, res, w, 1e-5) is None
    assert x.data_ptr() == px and res.data_ptr() == pr  # in place
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)  # one fp32 add, rounded once
    close(x, want_y.to(dtype), dtype)
    if shape[0]:  # input is exactly rms_norm of the residual it returns (the same fp32 formula)
        close(x, ops.rms_norm(res, w, 1e-5), dtype)


def test_fused_add_rms_norm_numpy_and_rejections() -> None:
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    res = np.ones_like(x)
    w = np.full(16, 2, np.float32)
    want_y, want_res = vllm_fused_add_rms_norm(*map(torch.from_numpy, (x, res, w)), 1e-6)
    ops.fused_add_rms_norm(x, res, w)
    close(res, want_res)
    close(x, want_y)
    t = torch.ones(4, 16)
    cases = [
        ((t.clone(), torch.ones(4, 8), torch.ones(16)), ValueError,
         "residual must have the same shape as input"),
        ((t.clone(), t.clone(), torch.ones(8)), ValueError, "weight must have size 16"),
        ((t.clone(), t.clone().half(), torch.ones(16)), TypeError,
         "residual must have the same dtype as input"),
        ((t.clone(), t.clone(), torch.ones(16), -1.0), ValueError, "eps must be >= 0"),
        ((t, t, torch.ones(16)), ValueError, "mutated argument 'input' overlaps argument 'residual'"),
    ]
    for args, exc, msg in cases:
        before = [a.clone() for a in args[:2]]
        with pytest.raises(exc, match=f"fused_add_rms_norm: {re.escape(msg)}"):
            ops.fused_add_rms_norm(*args)
        for a, b in zip(args[:2], before, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # A strided residual is updated in place all the same (issue 11): copy in, compute, copy back.
    x, wide = torch.randn(4, 16), torch.randn(4, 32)
    res = wide[:, ::2]
    x2, res2 = x.clone(), res.contiguous()
    ops.fused_add_rms_norm(x, res, torch.ones(16))
    ops.fused_add_rms_norm(x2, res2, torch.ones(16))
    torch.testing.assert_close(x, x2, rtol=0, atol=0)
    torch.testing.assert_close(res, res2, rtol=0, atol=0)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_fused_add_rms_norm_rejects_overlap(framework: str) -> None:
    """A mutated argument sharing memory with any other tensor argument is refused before anything is written."""
    buf = torch.arange(12 * 16, dtype=torch.float32).reshape(12, 16)
    x, res = buf[:4], buf[4:8]
    cases = [
        ((x, x, buf[8]), "input", "residual"),  # the same tensor
        ((buf[:4], buf[2:6], buf[8]), "input", "residual"),  # overlapping slices
        ((x, res, x[1]), "input", "weight"),  # a read-only argument inside a mutated one
        ((buf[8:12], res, buf[7]), "residual", "weight"),  # at the last element
    ]
    for args, name, other in cases:
        before = buf.clone()
        call = tuple(a.numpy() for a in args) if framework == "numpy" else args
        msg = f"fused_add_rms_norm: mutated argument '{name}' overlaps argument '{other}' in memory; pass separate"
        with pytest.raises(ValueError, match=f"^{re.escape(msg)} tensors$"):
            ops.fused_add_rms_norm(*call)
        torch.testing.assert_close(buf, before, rtol=0, atol=0)
    adjacent = (x, res, buf[8])  # touching is not overlapping
    want_y, want_res = vllm_fused_add_rms_norm(*(a.clone() for a in adjacent), 1e-6)
    ops.fused_add_rms_norm(*(tuple(a.numpy() for a in adjacent) if framework == "numpy" else adjacent))
    close(res, want_res)
    close(x, want_y)


# ---------------------------------------------------------------------------
# rotary_embedding
# ---------------------------------------------------------------------------


def cos_sin_cache(max_position: int, rot_dim: int, dtype: Any = torch.float32) -> Any:
    """vLLM's RotaryEmbedding._compute_cos_sin_cache (base 10000)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.einsum("i,j->ij", torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def vllm_rotary(positions: Any, query: Any, key: Any, head_size: int, cache: Any,
                is_neox: bool) -> tuple[Any, Any]:
    """vLLM's RotaryEmbedding.forward_native (+ _apply_rotary_emb_torch), in float64."""
    lead = positions.ndim
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cache.double().index_select(0, positions).chunk(2, dim=-1)
    rot_dim = cache.shape[1]

    def apply(x: Any) -> Any:
        shape = x.shape
        heads = int(np.prod(shape[lead:])) // head_size  # not -1: vLLM's view fails on zero tokens
        x = x.double().reshape(n, heads, head_size)
        xr, xp = x[..., :rot_dim], x[..., rot_dim:]
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if is_neox:
            x1, x2 = torch.chunk(xr, 2, dim=-1)
        else:
            x1, x2 = xr[..., ::2], xr[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        xr = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((xr, xp), dim=-1).reshape(shape)

    return apply(query), None if key is None else apply(key)


# (positions shape, query trailing dims, key trailing dims or None, head_size, rot_dim)
ROTARY_LAYOUTS = [
    ((5,), (4 * 8,), (2 * 8,), 8, 8),
    ((6,), (4, 16), (1, 16), 16, 16),
    ((3, 4), (2 * 10,), None, 10, 6),
    ((2, 3), (3, 12), (3, 12), 12, 4),
    ((0,), (16,), (8,), 8, 8),
    ((700,), (8 * 64,), (2 * 64,), 64, 64),
]


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ROTARY_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}-{v[2]}-hs{v[3]}-rot{v[4]}")
def test_rotary_matches_vllm(layout: tuple[Any, ...], dtype: Any, is_neox: bool) -> None:
    pshape, qdims, kdims, head_size, rot_dim = layout
    cache = cos_sin_cache(4096, rot_dim, dtype)
    positions = torch.randint(0, 4096, pshape)
    q = torch.randn(*pshape, *qdims).to(dtype)
    k = None if kdims is None else torch.randn(*pshape, *kdims).to(dtype)
    want_q, want_k = vllm_rotary(positions, q, k, head_size, cache, is_neox)
    ptr = q.data_ptr()
    assert ops.rotary_embedding(positions, q, k, head_size, cache, is_neox) is None
    assert q.data_ptr() == ptr
    close(q, want_q.to(dtype), dtype)
    if k is not None:
        close(k, want_k.to(dtype), dtype)
    # the elements past rot_dim of every head are untouched, bit for bit
    heads = int(np.prod(qdims)) // head_size
    n = positions.numel()
    tail = q.reshape(n, heads, head_size)[..., rot_dim:]
    want_tail = want_q.to(dtype).reshape(n, heads, head_size)[..., rot_dim:]
    torch.testing.assert_close(tail, want_tail, rtol=0, atol=0)


def test_rotary_numpy_and_complex_form() -> None:
    """GPT-J style is multiplication of (x[2i] + i x[2i+1]) by e^{i p f_i}: an independent derivation."""
    rng = np.random.default_rng(1)
    pos = rng.integers(0, 100, 9)
    q = rng.standard_normal((9, 3 * 8)).astype(np.float32)
    cache = cos_sin_cache(100, 8).numpy()
    z = q.astype(np.float64).reshape(9, 3, 4, 2)
    zc = (z[..., 0] + 1j * z[..., 1]) * np.exp(1j * np.arctan2(cache[pos, 4:], cache[pos, :4]))[:, None, :]
    want = np.stack([zc.real, zc.imag], axis=-1).reshape(9, 24)
    ops.rotary_embedding(pos, q, None, 8, cache, False)
    np.testing.assert_allclose(q, want, rtol=1e-5, atol=1e-5)


def _rotary_args(**over: Any) -> dict[str, Any]:
    args = {
        "positions": torch.tensor([0, 3, 9, 2]),
        "query": torch.randn(4, 2 * 8),
        "key": torch.randn(4, 8),
        "head_size": 8,
        "cos_sin_cache": cos_sin_cache(10, 8),
        "is_neox": True,
    }
    args.update(over)
    return args


ROTARY_REJECTIONS: list[tuple[str, dict[str, Any], type, str]] = [
    ("position == max_position", {"positions": torch.tensor([0, 3, 10, 2])}, ValueError,
     r"positions must be in \[0, max_position\) with max_position = 10 .*got positions\[2\] = 10"),
    ("negative position, last", {"positions": torch.tensor([0, 3, 9, -1])}, ValueError,
     r"positions must be in .*got positions\[3\] = -1"),
    ("huge position", {"positions": torch.tensor([2**62, 0, 0, 0])}, ValueError,
     r"positions must be in .*got positions\[0\] = 4611686018427387904"),
    ("2-D positions, bad index",
     {"positions": torch.tensor([[0, 1], [11, 2]]), "query": torch.randn(2, 2, 16),
      "key": torch.randn(2, 2, 8)},
     ValueError, r"positions must be in .*got positions\[1, 0\] = 11"),
    ("int16 positions", {"positions": torch.tensor([0, 1, 2, 3], dtype=torch.int16)}, TypeError,
     "positions must have dtype int64 or int32, got int16"),
    ("float positions", {"positions": torch.tensor([0.0, 1.0, 2.0, 3.0])}, TypeError,
     "positions must have dtype int64 or int32, got float32"),
    ("3-D positions",
     {"positions": torch.zeros(1, 2, 2, dtype=torch.int64), "query": torch.randn(1, 2, 2, 16), "key": None},
     ValueError, r"positions must have shape \(num_tokens,\) or \(batch, seq\)"),
    ("head_size 0", {"head_size": 0}, ValueError, "head_size must be > 0, got 0"),
    ("head_size -8", {"head_size": -8}, ValueError, "head_size must be > 0, got -8"),
    ("query width", {"query": torch.randn(4, 20)}, ValueError,
     r"query's last dim \(20\) must be a multiple of head_size"),
    ("query head dim", {"query": torch.randn(4, 2, 6)}, ValueError, "query's last dim must be head_size"),
    ("query tokens", {"query": torch.randn(5, 16)}, ValueError, r"query must have shape \(\*positions.shape"),
    ("query int16", {"query": torch.ones(4, 16, dtype=torch.int16)}, TypeError,
     "query must have dtype float32"),
    ("key tokens", {"key": torch.randn(3, 8)}, ValueError, r"key must have shape \(\*positions.shape"),
    ("key width", {"key": torch.randn(4, 12)}, ValueError,
     r"key's last dim \(12\) must be a multiple of head_size"),
    ("kv heads", {"query": torch.randn(4, 3 * 8), "key": torch.randn(4, 2 * 8)}, ValueError,
     r"query's number of heads \(3\) must be a multiple of key's \(2\)"),
    ("key dtype", {"key": torch.randn(4, 8).half()}, TypeError,
     r"key must have the same dtype as query \(float32\)"),
    ("cache dtype", {"cos_sin_cache": cos_sin_cache(10, 8).half()}, TypeError,
     r"cos_sin_cache must have the same dtype as query"),
    ("odd rot_dim", {"cos_sin_cache": torch.randn(10, 7)}, ValueError, r"cos_sin_cache's last dim \(rot_dim"),
    ("rot_dim > head_size", {"cos_sin_cache": torch.randn(10, 10)}, ValueError, r"cos_sin_cache's last dim"),
    ("1-D cache", {"cos_sin_cache": torch.randn(80)}, ValueError, "cos_sin_cache must be 2-D"),
]

#: Non-contiguous arguments: computed right, or (where an adapter still refuses them) a clear error.
ROTARY_STRIDED: list[tuple[str, dict[str, Any], str]] = [
    ("query non-contiguous", {"query": torch.randn(4, 32)[:, ::2]}, "query must be contiguous"),
    ("key non-contiguous", {"key": torch.randn(4, 16)[:, ::2]}, "key must be contiguous"),
    ("positions non-contiguous", {"positions": torch.tensor([0, 1, 3, 1, 9, 0, 2, 5])[::2]},
     "positions must be contiguous"),
    ("cache non-contiguous", {"cos_sin_cache": torch.randn(10, 16)[:, ::2]}, "cos_sin_cache must be contiguous"),
]


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize(("what", "over", "exc", "msg"), ROTARY_REJECTIONS,
                         ids=[r[0] for r in ROTARY_REJECTIONS])
def test_rotary_rejects(what: str, over: dict[str, Any], exc: type, msg: str, framework: str) -> None:
    args = _rotary_args(**over)
    if framework == "numpy":
        if any(isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16,) for v in args.values()):
            pytest.skip("numpy has no bfloat16")
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    before = {n: v.copy() if isinstance(v, np.ndarray) else v.clone()
              for n, v in args.items() if hasattr(v, "shape")}
    with pytest.raises(exc, match="rotary_embedding: " + msg):
        ops.rotary_embedding(**args)
    for n, v in before.items():  # nothing was written
        np.testing.assert_array_equal(np.asarray(args[n]), np.asarray(v), err_msg=f"{what}: {n} changed")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize(("what", "over", "refusal"), ROTARY_STRIDED, ids=[r[0] for r in ROTARY_STRIDED])
def test_rotary_strided(what: str, over: dict[str, Any], refusal: str, framework: str) -> None:
    _strided_like_dense(ops.rotary_embedding, _rotary_args(**over), refusal, framework)


def test_rotary_reference_rejects_like_the_kernel() -> None:
    for _, over, exc, msg in ROTARY_REJECTIONS:
        if "contiguous" in msg or (exc is TypeError and "positions" not in msg):
            continue  # no memory layout; float dtypes: check_op runs the reference in float64
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in _rotary_args(**over).items()}
        with pytest.raises(exc, match="rotary_embedding: " + msg):
            ops.rotary_embedding.reference(**args)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rotary_rotates_qkv_slices_where_they_are(framework: str, dtype: str, kernel_args: list[list[Any]]) -> None:
    """vLLM's query and key, column slices of one qkv tensor, reach the kernel as they are (the op
    declares them row_strided): no dense copy in or back, the same result as on dense copies, and
    the value columns untouched."""
    seen = kernel_args
    tokens, heads, kv_heads, d = 9, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=getattr(torch, dtype))
    if framework == "numpy":
        qkv = qkv.numpy()
    before = qkv.copy() if framework == "numpy" else qkv.clone()
    q, k = qkv[:, :heads * d], qkv[:, heads * d:(heads + kv_heads) * d]
    pos, cache = torch.randint(0, 10, (tokens,)), cos_sin_cache(10, d, getattr(torch, dtype))
    if framework == "numpy":
        pos, cache = pos.numpy(), cache.numpy()
    ops.rotary_embedding(pos, q, k, d, cache, False)
    # (torch's fast path hands them to the kernel directly; a checked path must keep them too)
    assert all(full[1] is q and full[2] is k for full in seen), "query and key were copied"
    dq = np.ascontiguousarray(np.asarray(before[:, :heads * d]))
    dk = np.ascontiguousarray(np.asarray(before[:, heads * d:(heads + kv_heads) * d]))
    ops.rotary_embedding(np.asarray(pos), dq, dk, d, np.asarray(cache), False)
    np.testing.assert_array_equal(np.asarray(q), dq)
    np.testing.assert_array_equal(np.asarray(k), dk)
    np.testing.assert_array_equal(np.asarray(qkv)[:, (heads + kv_heads) * d:],
                                  np.asarray(before)[:, (heads + kv_heads) * d:])


def test_rotary_kernel_checks_strided_rows_when_called_directly() -> None:
    """The kernel's own checks (opbridge::row_stride, check_disjoint): rows at a stride are taken,
    other layouts named, and rows that interleave are told apart from rows that meet, exactly,
    at equal and at unequal strides."""
    from opbridge import loader

    kern = loader.kernel(ops.LIBRARY.ops["rotary_embedding"], "cpu")
    pos, cache = torch.tensor([0, 3, 9, 2, 5]), cos_sin_cache(10, 8)
    buf = torch.randn(400)

    def rows(offset: int, width: int, stride: int) -> torch.Tensor:
        return torch.as_strided(buf, (5, width), (stride, 1), offset)

    def rotated(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dq, dk = q.clone(), k.clone()
        kern(pos, dq, dk, 8, cache, True)
        return dq, dk

    # query rows [48i, 48i + 16); key rows at stride 48 (as in one qkv) and at stride 24, between them
    for k_rows in ((16, 8, 48), (16, 8, 24)):
        q, k = rows(0, 16, 48), rows(*k_rows)
        want = rotated(q, k)
        kern(pos, q, k, 8, cache, True)
        torch.testing.assert_close((q, k), want, rtol=0, atol=0)
    before = buf.clone()
    for k_rows in ((8, 8, 48), (56, 8, 40)):  # a key row meets a query row: equal, then unequal strides
        with pytest.raises(ValueError, match="rotary_embedding: key must not overlap query"):
            kern(pos, rows(0, 16, 48), rows(*k_rows), 8, cache, True)
    with pytest.raises(ValueError, match=r"rotary_embedding: query must be contiguous, or rows at a stride "
                                         r".*got shape \(5, 16\) with strides \(48, 2\)"):
        kern(pos, torch.as_strided(buf, (5, 16), (48, 2)), None, 8, cache, True)
    assert torch.equal(buf, before), "a refused call wrote"


def test_rotary_rejects_aliasing() -> None:
    qk = torch.randn(4, 16)
    msg = "rotary_embedding: mutated argument 'query' overlaps argument 'key'"
    with pytest.raises(ValueError, match=msg):
        ops.rotary_embedding(torch.zeros(4, dtype=torch.int64), qk, qk[:, :8], 8, cos_sin_cache(10, 8), True)


# ---------------------------------------------------------------------------
# advance_step_flashattn
# ---------------------------------------------------------------------------


def vllm_advance_step(num_seqs: int, num_queries: int, block_size: int, input_tokens: Any,
                      sampled_token_ids: Any, input_positions: Any, seq_lens: Any, slot_mapping: Any,
                      block_tables: Any) -> None:
    """vLLM's advance_step_flashattn_kernel, one 'thread' per sequence, in plain Python."""
    sampled = sampled_token_ids.reshape(-1)
    for i in range(num_seqs):
        if i >= num_queries:  # cuda-graph padding
            input_tokens[i], input_positions[i], slot_mapping[i] = 0, 0, -1
            continue
        input_tokens[i] = sampled[i]
        seq_len = int(seq_lens[i])
        next_seq_len = seq_len + 1
        next_input_pos = next_seq_len - 1
        seq_lens[i] = next_seq_len
        input_positions[i] = next_input_pos
        block_index, block_offset = next_input_pos // block_size, next_input_pos % block_size
        slot_mapping[i] = int(block_tables[i][block_index]) * block_size + block_offset


def step_args(num_seqs: int, num_queries: int, block_size: int, max_blocks: int,
              seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    top = max(min(block_size * max_blocks, INT32_MAX) - 1, 1)
    lens = torch.randint(0, top, (num_seqs,), generator=g, dtype=torch.int32)
    lens[num_queries:] = 7
    return {
        "num_seqs": num_seqs, "num_queries": num_queries, "block_size": block_size,
        "input_tokens": torch.full((num_seqs,), 555, dtype=torch.int64),
        "sampled_token_ids": torch.randint(0, 32000, (num_queries, 1), generator=g),
        "input_positions": torch.full((num_seqs,), 777, dtype=torch.int64),
        "seq_lens": lens,
        "slot_mapping": torch.full((num_seqs,), 999, dtype=torch.int64),
        "block_tables": torch.randint(0, 5000, (num_seqs, max_blocks), generator=g, dtype=torch.int32),
    }


def _clone(args: dict[str, Any]) -> dict[str, Any]:
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in args.items()}


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("sizes", [(1, 1, 16, 4), (8, 5, 16, 8), (4, 0, 16, 2), (0, 0, 16, 1),
                                   (40, 40, 1, 64), (70000, 69000, 32, 4), (3, 2, 2**40, 2)])
def test_advance_step_matches_vllm(sizes: tuple[int, ...], framework: str) -> None:
    args = step_args(*sizes)
    want = _clone(args)
    vllm_advance_step(**want) if sizes[0] < 1000 else _vectorised_step(want)
    if framework == "numpy":
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    assert ops.advance_step_flashattn(**args) is None
    for n, v in want.items():
        if isinstance(v, torch.Tensor):
            np.testing.assert_array_equal(np.asarray(args[n]), v.numpy(), err_msg=n)
    # the reference agrees too
    ref = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in step_args(*sizes).items()}
    ops.advance_step_flashattn.reference(**ref)
    for n, v in want.items():
        if isinstance(v, torch.Tensor):
            np.testing.assert_array_equal(ref[n], v.numpy(), err_msg=n)


def _vectorised_step(a: dict[str, Any]) -> None:
    q, n, bs = a["num_queries"], a["num_seqs"], a["block_size"]
    pos = a["seq_lens"][:q].long()
    a["input_tokens"][:q] = a["sampled_token_ids"][:, 0]
    a["seq_lens"][:q] += 1
    a["input_positions"][:q] = pos
    a["slot_mapping"][:q] = a["block_tables"][torch.arange(q), pos // bs].long() * bs + pos % bs
    a["input_tokens"][q:n], a["input_positions"][q:n], a["slot_mapping"][q:n] = 0, 0, -1


def test_advance_step_edges() -> None:
    """Flat sampled ids; seq_lens at INT32_MAX - 1; the largest block id whose slots fit in int64."""
    bs = 2**32
    args = step_args(2, 2, bs, 1)
    args["sampled_token_ids"] = torch.tensor([5, 6])
    args["seq_lens"][:] = torch.tensor([INT32_MAX - 1, 3], dtype=torch.int32)
    args["block_tables"][:, 0] = INT64_MAX // bs - 1
    ops.advance_step_flashattn(**args)
    assert args["input_tokens"].tolist() == [5, 6]
    assert args["seq_lens"].tolist() == [INT32_MAX, 4]
    assert args["input_positions"].tolist() == [INT32_MAX - 1, 3]
    top = (INT64_MAX // bs - 1) * bs
    assert args["slot_mapping"].tolist() == [top + INT32_MAX - 1, top + 3]
    # padded rows: seq_lens and block tables are not read, garbage there is fine
    args = step_args(3, 1, 16, 2)
    args["seq_lens"][1:] = -100
    args["block_tables"][1:] = -1
    ops.advance_step_flashattn(**args)
    assert args["seq_lens"][1:].tolist() == [-100, -100]
    assert args["slot_mapping"][1:].tolist() == [-1, -1]


def _narrowed(args: dict[str, Any]) -> dict[str, Any]:
    """*args* with the token ids, positions and slots int32, as JAX makes them without x64."""
    wide = ("input_tokens", "sampled_token_ids", "input_positions", "slot_mapping")
    return {n: v.int() if n in wide else v.clone() if isinstance(v, torch.Tensor) else v for n, v in args.items()}


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("sizes", [(8, 5, 16, 8), (70000, 69000, 32, 4), (3, 2, 2**20, 2**11)])
def test_advance_step_int32_ids_match_int64(sizes: tuple[int, ...], framework: str) -> None:
    """Token ids, positions and slots as int32 (all four) advance as the int64 call does, on the
    kernel and the reference; a slot past int32 is refused before anything is written."""
    args = step_args(*sizes)
    if sizes[2] == 2**20:  # the largest block id whose slots fit int32, at the last position it serves
        args["seq_lens"][0] = INT32_MAX - 1
        args["block_tables"][0, -1] = INT32_MAX // 2**20 - 1
    narrow = _narrowed(args)
    ref = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in _narrowed(args).items()}
    ops.advance_step_flashattn(**args)
    if framework == "numpy":
        narrow = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in narrow.items()}
    ops.advance_step_flashattn(**narrow)
    ops.advance_step_flashattn.reference(**ref)
    for n, v in args.items():
        if isinstance(v, torch.Tensor):
            assert np.asarray(narrow[n]).dtype == ref[n].dtype == np.int32
            np.testing.assert_array_equal(np.asarray(narrow[n]), v.numpy(), err_msg=n)
            np.testing.assert_array_equal(ref[n], v.numpy(), err_msg=n)
    if sizes[2] == 2**20:
        assert int(np.asarray(narrow["slot_mapping"])[0]) == 2047 * 2**20 - 2  # block 2046, its last slot
    bad = _narrowed(step_args(8, 5, 16, 8))
    bad["block_tables"][3] = INT32_MAX // 16  # one past the largest: slots up to 2^31 + 14
    if framework == "numpy":
        bad = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in bad.items()}
    before = {n: np.array(v) for n, v in bad.items() if hasattr(v, "shape")}
    msg = (r"block_tables\[3\]\[\d+\] = 134217727 is not a valid block id \(must be in \[0, 134217726\] so that "
           r"its slots id \* block_size \+ \[0, block_size\) fit in int32\)")
    with pytest.raises(ValueError, match=msg):
        ops.advance_step_flashattn(**bad)
    for n, v in before.items():
        np.testing.assert_array_equal(np.asarray(bad[n]), v, err_msg=n)
    with pytest.raises(ValueError, match=msg):
        ops.advance_step_flashattn.reference(**{n: np.array(v) if hasattr(v, "shape") else v for n, v in bad.items()})


ADVANCE_REJECTIONS: list[tuple[str, Callable[[dict[str, Any]], None], type, str]] = [
    ("num_seqs < 0", lambda a: a.update(num_seqs=-1), ValueError, "num_seqs must be >= 0, got -1"),
    ("num_queries < 0", lambda a: a.update(num_queries=-1), ValueError, "num_queries must be >= 0, got -1"),
    ("num_queries > num_seqs", lambda a: a.update(num_queries=9), ValueError,
     r"num_queries \(9\) must be <= num_seqs \(8\)"),
    ("block_size 0", lambda a: a.update(block_size=0), ValueError, "block_size must be > 0, got 0"),
    ("block_size < 0", lambda a: a.update(block_size=-16), ValueError, "block_size must be > 0, got -16"),
    ("input_tokens int16", lambda a: a.update(input_tokens=a["input_tokens"].short()), TypeError,
     "input_tokens must have dtype int64 or int32, got int16"),
    ("input_tokens int32 alone", lambda a: a.update(input_tokens=a["input_tokens"].int()), TypeError,
     r"sampled_token_ids must have the same dtype as input_tokens \(int32\), got int64"),
    ("sampled int32", lambda a: a.update(sampled_token_ids=a["sampled_token_ids"].int()), TypeError,
     r"sampled_token_ids must have the same dtype as input_tokens \(int64\), got int32"),
    ("input_positions int32", lambda a: a.update(input_positions=a["input_positions"].int()), TypeError,
     r"input_positions must have the same dtype as input_tokens \(int64\), got int32"),
    ("seq_lens int64", lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError,
     "seq_lens must have dtype int32, got int64"),
    ("slot_mapping float", lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError,
     r"slot_mapping must have the same dtype as input_tokens \(int64\), got float32"),
    ("block_tables int64", lambda a: a.update(block_tables=a["block_tables"].long()), TypeError,
     "block_tables must have dtype int32, got int64"),
    ("input_tokens size", lambda a: a.update(input_tokens=torch.zeros(7, dtype=torch.int64)), ValueError,
     r"input_tokens must have size 8 in dim 0 \(num_seqs\)"),
    ("input_tokens 2-D", lambda a: a.update(input_tokens=torch.zeros(8, 1, dtype=torch.int64)), ValueError,
     "input_tokens must be 1-D"),
    ("sampled rows", lambda a: a.update(sampled_token_ids=torch.zeros(4, 1, dtype=torch.int64)), ValueError,
     r"sampled_token_ids must have size 5 in dim 0 \(num_queries\)"),
    ("sampled 2 per query", lambda a: a.update(sampled_token_ids=torch.zeros(5, 2, dtype=torch.int64)),
     ValueError,
     "sampled_token_ids must have size 1 in dim 1"),
    ("input_positions size", lambda a: a.update(input_positions=torch.zeros(9, dtype=torch.int64)),
     ValueError,
     "input_positions must have size 8 in dim 0"),
    ("seq_lens size", lambda a: a.update(seq_lens=torch.zeros(5, dtype=torch.int32)), ValueError,
     "seq_lens must have size 8 in dim 0"),
    ("slot_mapping size", lambda a: a.update(slot_mapping=torch.zeros(1, dtype=torch.int64)), ValueError,
     "slot_mapping must have size 8 in dim 0"),
    ("block_tables rows", lambda a: a.update(block_tables=torch.zeros(5, 8, dtype=torch.int32)), ValueError,
     "block_tables must have size 8 in dim 0"),
    ("block_tables 1-D", lambda a: a.update(block_tables=torch.zeros(8, dtype=torch.int32)), ValueError,
     "block_tables must be 2-D"),
    ("negative token", lambda a: a["sampled_token_ids"].__setitem__((4, 0), -3), ValueError,
     r"sampled_token_ids must be >= 0 \(token ids\), got sampled_token_ids\[4\] = -3"),
    ("negative seq_len", lambda a: a["seq_lens"].__setitem__(4, -1), ValueError,
     r"seq_lens must be >= 0, got seq_lens\[4\] = -1"),
    ("seq_len overflow", lambda a: a["seq_lens"].__setitem__(4, INT32_MAX), ValueError,
     r"seq_lens\[4\] = 2147483647 cannot be incremented without overflowing int32"),
    ("block index", lambda a: a["seq_lens"].__setitem__(4, 16 * 8), ValueError,
     r"block index beyond the table's width: sequence 4 at position 128 needs block_tables\[4\]\[8\]"),
    ("negative block id",
     lambda a: (a["seq_lens"].__setitem__(4, 20), a["block_tables"].__setitem__((4, 1), -2)),
     ValueError, r"block_tables\[4\]\[1\] = -2 is not a valid block id"),
    ("block id overflow", lambda a: (a.update(block_size=2**40), a["seq_lens"].zero_(),
                                     a["block_tables"].__setitem__((4, 0), 2**23)),
     ValueError, r"block_tables\[4\]\[0\] = 8388608 is not a valid block id \(must be in \[0, 8388606\]"),
    ("aliased outputs", lambda a: a.update(input_positions=a["slot_mapping"]), ValueError,
     "mutated argument 'input_positions' overlaps argument 'slot_mapping'"),
]


#: Non-contiguous arguments: computed right, or (where an adapter still refuses them) a clear error.
ADVANCE_STRIDED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("input_tokens non-contiguous", lambda a: a.update(input_tokens=torch.zeros(16, dtype=torch.int64)[::2]),
     "input_tokens must be contiguous"),
    ("sampled non-contiguous",
     lambda a: a.update(sampled_token_ids=torch.arange(10, dtype=torch.int64).view(5, 2)[:, :1]),
     "sampled_token_ids must be contiguous"),
    ("input_positions non-contiguous",
     lambda a: a.update(input_positions=torch.zeros(16, dtype=torch.int64)[::2]),
     "input_positions must be contiguous"),
    ("seq_lens non-contiguous", lambda a: a.update(seq_lens=torch.arange(16, dtype=torch.int32)[::2]),
     "seq_lens must be contiguous"),
    ("slot_mapping non-contiguous", lambda a: a.update(slot_mapping=torch.zeros(16, dtype=torch.int64)[::2]),
     "slot_mapping must be contiguous"),
    ("block_tables non-contiguous",
     lambda a: a.update(block_tables=torch.arange(128, dtype=torch.int32).view(8, 16)[:, ::2]),
     "block_tables must be contiguous"),
]


def _strided_like_dense(op: Callable[..., Any], args: dict[str, Any], refusal: str, framework: str) -> None:
    """*op* on *args* (one non-contiguous) equals *op* on contiguous copies, or refuses with *refusal*.

    Issue 11: every op takes any strides (mutated arguments are updated in
    place all the same); until an adapter does, it must refuse with a
    ValueError naming the op and the argument, writing nothing.
    """
    if framework == "numpy":
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    dense = {n: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v.contiguous().clone())
             if hasattr(v, "shape") else v for n, v in args.items()}
    before = {n: np.array(v) for n, v in args.items() if hasattr(v, "shape")}
    name = op.__name__
    try:
        op(**args)
    except ValueError as e:
        assert re.search(f"{name}: {refusal}", str(e)), str(e)
        for n, v in before.items():
            np.testing.assert_array_equal(np.asarray(args[n]), v, err_msg=f"{n} changed by a refused call")
        return
    op(**dense)
    for n, v in dense.items():
        if hasattr(v, "shape"):
            np.testing.assert_allclose(np.asarray(args[n]), np.asarray(v), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name}: {n} differs from the call on contiguous copies")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize(("what", "edit", "exc", "msg"), ADVANCE_REJECTIONS,
                         ids=[r[0] for r in ADVANCE_REJECTIONS])
def test_advance_step_rejects(what: str, edit: Callable[[dict[str, Any]], None], exc: type, msg: str,
                              framework: str) -> None:
    args = step_args(8, 5, 16, 8)
    edit(args)
    if framework == "numpy":
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    before = {n: np.array(v) for n, v in args.items() if hasattr(v, "shape")}
    with pytest.raises(exc, match="advance_step_flashattn: " + msg):
        ops.advance_step_flashattn(**args)
    for n, v in before.items():  # nothing was written, not even the queries before the bad one
        np.testing.assert_array_equal(np.asarray(args[n]), v, err_msg=f"{what}: {n} changed")


@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize(("what", "edit", "refusal"), ADVANCE_STRIDED, ids=[r[0] for r in ADVANCE_STRIDED])
def test_advance_step_strided(what: str, edit: Callable[[dict[str, Any]], None], refusal: str,
                              framework: str) -> None:
    args = step_args(8, 5, 16, 8)
    edit(args)
    _strided_like_dense(ops.advance_step_flashattn, args, refusal, framework)


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_empty_tensors_overlap_nothing(framework: str) -> None:
    """The alias check skips empty tensors, mutated or not, wherever they point (as the kernels do)."""
    args = step_args(4, 0, 16, 2)
    args["sampled_token_ids"] = args["sampled_token_ids"].view(0, 1)
    want = _clone(args)
    vllm_advance_step(**want)
    x, w = torch.ones(0, 16), torch.ones(16)
    if framework == "numpy":  # torch gives empty tensors a null data_ptr(), NumPy keeps the view's address
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        args["sampled_token_ids"] = args["input_tokens"][2:4].reshape(2, 1)[:0]
        start = args["input_tokens"].__array_interface__["data"][0]
        assert args["sampled_token_ids"].__array_interface__["data"][0] == start + 16  # inside input_tokens
        x, w = x.numpy(), w.numpy()
    ops.advance_step_flashattn(**args)
    for n, v in want.items():
        if isinstance(v, torch.Tensor):
            np.testing.assert_array_equal(np.asarray(args[n]), v.numpy(), err_msg=n)
    ops.fused_add_rms_norm(x, x, w)  # one empty tensor as both mutated arguments


def test_advance_step_reference_rejects_like_the_kernel() -> None:
    """The NumPy reference raises the same errors on values; on shapes it names the same argument."""
    for _, edit, exc, msg in ADVANCE_REJECTIONS:
        if "contiguous" in msg or "overlaps" in msg:
            continue  # memory layout: the reference sees values only
        args = step_args(8, 5, 16, 8)
        edit(args)
        args = {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        shape_error = " in dim " in msg or "-D" in msg
        pattern = msg.split()[0] + " must have shape" if shape_error else msg
        with pytest.raises(exc, match="advance_step_flashattn: " + pattern):
            ops.advance_step_flashattn.reference(**args)


def test_kernel_validates_before_writing_when_called_directly() -> None:
    """Without the adapters' alias check, the kernel itself refuses overlapping tensors."""
    from opbridge import loader

    k = loader.kernel(ops.LIBRARY.ops["advance_step_flashattn"], "cpu")
    a = step_args(8, 5, 16, 8)
    buf = torch.zeros(16, dtype=torch.int64)
    a["input_positions"], a["slot_mapping"] = buf[:8], buf[4:12]
    msg = "advance_step_flashattn: input_positions must not overlap slot_mapping"
    with pytest.raises(ValueError, match=msg):
        k(*a.values())
    assert not buf.any()


# ---------------------------------------------------------------------------
# graph modes
# ---------------------------------------------------------------------------


def _serving_inputs() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "x": torch.randn(6, 64),
        "inp": torch.randn(6, 32), "res": torch.randn(6, 32), "w": torch.randn(32),
        "pos": torch.randint(0, 50, (6,)), "q": torch.randn(6, 2 * 16), "k": torch.randn(6, 16),
        "cache": cos_sin_cache(50, 16),
        **{f"s_{n}": v for n, v in step_args(8, 6, 16, 4).items() if isinstance(v, torch.Tensor)},
    }


def _all_ops(x: Any, inp: Any, res: Any, w: Any, pos: Any, q: Any, k: Any, cache: Any, s_input_tokens: Any,
             s_sampled_token_ids: Any, s_input_positions: Any, s_seq_lens: Any, s_slot_mapping: Any,
             s_block_tables: Any) -> Any:
    y = ops.silu_and_mul(x) + ops.gelu_and_mul(x)
    g = ops.silu_and_mul_backward(y, x) + ops.gelu_and_mul_backward(y, x)
    ops.fused_add_rms_norm(inp, res, w, 1e-6)
    ops.rotary_embedding(pos, q, k, 16, cache, True)
    ops.rotary_embedding(pos, q, None, 16, cache, False)
    ops.advance_step_flashattn(8, 6, 16, s_input_tokens, s_sampled_token_ids, s_input_positions, s_seq_lens,
                               s_slot_mapping, s_block_tables)
    return y * 2, g, inp + 1  # reads a mutated tensor after the mutation


def test_torch_compile_fullgraph_all_ops() -> None:
    eager_in, comp_in = _serving_inputs(), _serving_inputs()
    want = _all_ops(**eager_in)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")
        got = compiled(**comp_in)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        for n in eager_in:  # mutations happened in place, identically
            torch.testing.assert_close(comp_in[n], eager_in[n], rtol=0, atol=0, msg=n)
        assert not torch.equal(comp_in["q"], _serving_inputs()["q"])
        # gradients through the compiled gated activations
        x = torch.randn(4, 16, requires_grad=True)
        f = torch.compile(lambda t: (ops.silu_and_mul(t) * ops.gelu_and_mul(t)).sum(), fullgraph=True,
                          backend="aot_eager")
        (gc,) = torch.autograd.grad(f(x), x)
        (ge,) = torch.autograd.grad((ops.silu_and_mul(x) * ops.gelu_and_mul(x)).sum(), x)
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


def test_mutating_ops_refuse_autograd() -> None:
    q = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rotary_embedding: argument 'query' requires grad"):
        ops.rotary_embedding(torch.zeros(2, dtype=torch.int64), q, None, 8, cos_sin_cache(4, 8), True)


# ---------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------


def test_jax_jit_mutating_ops() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x, res, w = (rng.standard_normal(s).astype(np.float32) for s in ((5, 64), (5, 64), (64,)))
    want_y, want_res = vllm_fused_add_rms_norm(*map(torch.from_numpy, (x, res, w)), 1e-6)
    jx, jres, jw = jnp.asarray(x), jnp.asarray(res), jnp.asarray(w)
    new_x, new_res = jax.jit(lambda a, b, c: ops.fused_add_rms_norm(a, b, c, 1e-6))(jx, jres, jw)
    close(np.asarray(new_x), want_y)
    close(np.asarray(new_res), want_res)
    np.testing.assert_array_equal(np.asarray(jx), x)  # JAX arrays are not mutated: new values come back
    # rotary with key None (an optional mutated argument): returns (query, None). Positions int64 here,
    # as vLLM's, which JAX keeps only with x64 enabled (int32 ones: test_jax_adapter); advance_step's too.
    with jax.enable_x64(True):
        pos = jnp.asarray(rng.integers(0, 50, 5))
        q = rng.standard_normal((5, 2 * 8)).astype(np.float32)
        cache = cos_sin_cache(50, 8).numpy()
        fn = jax.jit(lambda p, qq, c: ops.rotary_embedding(p, qq, None, 8, c, True))
        new_q, new_k = fn(pos, jnp.asarray(q), jnp.asarray(cache))
        assert new_k is None
        want_q, _ = vllm_rotary(torch.from_numpy(np.array(pos)), torch.from_numpy(q), None, 8,
                                torch.from_numpy(cache), True)
        close(np.asarray(new_q), want_q)
        # advance_step: four mutated tensors come back in schema order
        a = {n: jnp.asarray(v.numpy()) if isinstance(v, torch.Tensor) else v
             for n, v in step_args(6, 4, 16, 4).items()}
        want = step_args(6, 4, 16, 4)
        vllm_advance_step(**want)
        tensors = [n for n in a if not isinstance(a[n], int)]
        step = jax.jit(lambda *t: ops.advance_step_flashattn(6, 4, 16, *t))
        got = step(*(a[n] for n in tensors))
        for n, g in zip(["input_tokens", "input_positions", "seq_lens", "slot_mapping"], got, strict=True):
            np.testing.assert_array_equal(np.asarray(g), want[n].numpy(), err_msg=n)


def test_jax_grad_gated() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_tvm_ffi")
    import jax.numpy as jnp

    x = np.random.default_rng(2).standard_normal((3, 20)).astype(np.float32)
    for fwd, _, act in ACTS.values():
        g = jax.jit(jax.grad(lambda t, f=fwd: jnp.sum(f(t) ** 2)))(jnp.asarray(x))
        x64 = torch.from_numpy(x).double().requires_grad_()
        (want,) = torch.autograd.grad((torch_and_mul(act, x64) ** 2).sum(), x64)
        close(np.asarray(g), want, scale=2.0)


# ---------------------------------------------------------------------------
# the generated cases catch broken integer kernels
# ---------------------------------------------------------------------------

BROKEN_STEP_CC = r"""
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;

// Correct for queries; mode 1 leaves the padded entries unwritten, mode 2 also
// writes one slot_mapping element past the end.
static void step(int mode, int64_t num_seqs, int64_t num_queries, int64_t block_size, TensorView input_tokens,
                 TensorView sampled, TensorView input_positions, TensorView seq_lens, TensorView slot_mapping,
                 TensorView block_tables) {
  const char* op = "broken_step";
  OPB_CHECK_CONTIGUOUS(op, input_tokens);
  int64_t* tok = opbridge::data_ptr<int64_t>(input_tokens);
  const int64_t* smp = opbridge::data_ptr<const int64_t>(sampled);
  int64_t* pos = opbridge::data_ptr<int64_t>(input_positions);
  int32_t* lens = opbridge::data_ptr<int32_t>(seq_lens);
  int64_t* slots = opbridge::data_ptr<int64_t>(slot_mapping);
  const int32_t* tables = opbridge::data_ptr<const int32_t>(block_tables);
  const int64_t width = block_tables.size(1);
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t p = lens[i];
    tok[i] = smp[i];
    lens[i] = int32_t(p + 1);
    pos[i] = p;
    slots[i] = int64_t(tables[i * width + p / block_size]) * block_size + p % block_size;
  }
  if (mode == 2) {
    for (int64_t i = num_queries; i < num_seqs; ++i) { tok[i] = 0; pos[i] = 0; slots[i] = -1; }
    slots[num_seqs] = -1;
  }
}

void unpadded_step_cpu(int64_t n, int64_t q, int64_t bs, TensorView a, TensorView b, TensorView c,
                       TensorView d, TensorView e, TensorView f) { step(1, n, q, bs, a, b, c, d, e, f); }
OPBRIDGE_EXPORT(unpadded_step_cpu);
void overrun_step_cpu(int64_t n, int64_t q, int64_t bs, TensorView a, TensorView b, TensorView c,
                      TensorView d, TensorView e, TensorView f) { step(2, n, q, bs, a, b, c, d, e, f); }
OPBRIDGE_EXPORT(overrun_step_cpu);
"""


def test_check_op_catches_broken_integer_kernels(make_library: Callable[..., Any]) -> None:
    """An int-only mutating op has no NaN sentinel: unwritten elements are caught because the generated
    initial values never equal what the op writes, out-of-bounds writes by the integer guard sentinel."""
    from opbridge.ops.advance_step import advance_step_flashattn_cases
    from opbridge.testing import check_op
    from opbridge.testing.matrix import NONCONTIGUOUS

    lib = make_library({"broken_step.cc": BROKEN_STEP_CC}, prefix="broken_step")
    schema = str(ops.LIBRARY.ops["advance_step_flashattn"].schema).replace("advance_step_flashattn", "{}")
    broken = {name: lib.op(schema.format(name), dtypes=("int64",))(ops.advance_step_flashattn.reference)
              for name in ("unpadded_step", "overrun_step")}

    def cases(dtype: str, rng: np.random.Generator) -> list[dict[str, Any]]:
        return [c for c in advance_step_flashattn_cases(dtype, rng) if not c.get(NONCONTIGUOUS)]

    quick = {"dtypes": ("float32",), "check_opcheck": False, "check_compile": False}
    with pytest.raises(AssertionError, match=r"forward check failed(.|\n)*mutated argument 'input_tokens'"):
        check_op(broken["unpadded_step"], cases, sentinel=False, **quick)
    with pytest.raises(AssertionError, match=r"sentinel check failed(.|\n)*out-of-bounds write"):
        check_op(broken["overrun_step"], cases, **quick)
