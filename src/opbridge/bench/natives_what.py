"""What each framework's native entry calls, in words: the ``native`` candidate's description in the reports.

One table per framework, the same ops as :mod:`opbridge.bench.natives`'
factories, each saying what that factory's call runs (torch's from the
formulas in :mod:`opbridge.bench.torch_formulas`, Paddle's by what its
version ships). A formula changed in ``natives.py`` is described anew here.
"""

from __future__ import annotations

__all__ = ["descriptions"]


# -- numpy ------------------------------------------------------------------------


_NUMPY_WHAT = {
    "add": "np.add(x, y)",
    "gelu": "0.5*x*(1 + np.tanh(sqrt(2/pi)*(x + 0.044715*x**3)))",
    "rms_norm": "x / np.sqrt(np.mean(x*x, -1, keepdims=True) + eps) * w",
    "silu_and_mul": "a / (1 + np.exp(-a)) * b, x = [a | b]",
    "gelu_and_mul": "gelu_tanh(a) * b (the gelu formula), x = [a | b]",
    "fused_add_rms_norm": "in place: np.add(input, residual, out=residual), then the rms_norm formula "
                          "into input (np.divide(..., out=input), np.multiply(input, w, out=input))",
    "rotary_embedding": "in place on views of query and key: gather the cos/sin rows, o1 = x1 cos - x2 sin, "
                        "x2 *= cos, x2 += x1 sin, x1[...] = o1",
    "add_out": "np.add(x, y, out=o)",
    "silu_and_mul_out": "np.divide(a, 1 + np.exp(-a), out=o); np.multiply(o, b, out=o), x = [a | b]",
}


# -- torch ------------------------------------------------------------------------


def _torch_what() -> dict[str, str]:
    from opbridge.bench.torch_formulas import torch_impls

    impls = torch_impls()
    return {"add": "torch.add(x, y)", "gelu": "F.gelu(x, approximate='tanh')",
            "rms_norm": "F.rms_norm(x, (H,), w, eps)",
            "silu_and_mul": impls["silu_and_mul"][0].what,
            "gelu_and_mul": impls["gelu_tanh_and_mul"][0].what,
            "fused_add_rms_norm": impls["fused_add_rms_norm"][0].out_note,
            "rotary_embedding": impls["rotary_embedding"][0].out_note,
            "add_out": "torch.add(x, y, out=o)", "silu_and_mul_out": "torch.mul(F.silu(a), b, out=o), x = [a | b]"}


# -- jax --------------------------------------------------------------------------


_JAX_WHAT = {op: f"jax.jit(<jnp formula of {op}>)(...), called eagerly, waited for (opbridge.bench.natives."
                 f"jax_formulas)" for op in ("gelu", "rms_norm", "silu_and_mul", "gelu_and_mul",
                                             "fused_add_rms_norm", "rotary_embedding")}
_JAX_WHAT["add"] = "jax.jit(jnp.add)(x, y).block_until_ready(), called eagerly"


# -- paddle -----------------------------------------------------------------------


def _paddle_what() -> dict[str, str]:
    import paddle.nn.functional as F  # noqa: N812

    return {
        "add": "paddle.add(x, y)", "gelu": "F.gelu(x, approximate=True)",
        # F.rms_norm has no CPU kernel (Paddle 3.3: "The kernel `rms_norm` is not registered").
        "rms_norm": "x * paddle.rsqrt(paddle.mean(x*x, -1, keepdim=True) + eps) * w",
        "silu_and_mul": "F.swiglu(x)" if hasattr(F, "swiglu") else "F.silu(a) * b, x = [a | b]",
        "gelu_and_mul": "F.gelu(a, approximate=True) * b, x = [a | b]",
        "fused_add_rms_norm": "in place: residual.add_(input), paddle.assign(<rms_norm formula>(residual), "
                              "output=input)",
        "rotary_embedding": "index_select the cos/sin rows, rotate halves (NeoX) or pairs (GPT-J), concat; "
                            "paddle.assign(..., output=query) and key",
        "add_out": "paddle.add(x, y, out=o)",
        "silu_and_mul_out": ("paddle.assign(F.swiglu(x), output=o)" if hasattr(F, "swiglu")
                             else "paddle.assign(F.silu(a) * b, output=o), x = [a | b]"),
    }


# -- mindspore --------------------------------------------------------------------


_MINDSPORE_WHAT = {
    "add": "mindspore.ops.add(x, y)",
    "gelu": "mindspore.ops.gelu(x, approximate='tanh')",
    "rms_norm": "x * ops.rsqrt(ops.mean(x*x, -1, True) + eps) * w",
    "silu_and_mul": "ops.silu(a) * b, x = [a | b]",
    "gelu_and_mul": "ops.gelu(a, approximate='tanh') * b, x = [a | b]",
    "fused_add_rms_norm": "s = ops.add(input, residual); residual.copy_(s); input.copy_(<rms_norm formula>(s))",
    "rotary_embedding": "ops.gather the cos/sin rows, rotate halves (NeoX) or pairs (GPT-J), ops.cat; "
                        "query.copy_(...) and key",
}


def descriptions(framework: str) -> dict[str, str]:
    """``{op name: what its native entry calls}`` for *framework* (imports torch and paddle for theirs)."""
    if framework == "torch":
        return _torch_what()
    if framework == "paddle":
        return _paddle_what()
    return {"numpy": _NUMPY_WHAT, "jax": _JAX_WHAT, "mindspore": _MINDSPORE_WHAT}[framework]
