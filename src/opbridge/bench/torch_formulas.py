"""PyTorch's formulas for the built-in ops: what ``bench kernels`` and ``bench gpu`` time opbridge against.

:func:`torch_impls` maps an op's name to its :class:`TorchImpl`
variants (tried in order; see :attr:`~opbridge.bench.workloads.Workload.torch`).
Imports torch when called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TorchImpl:
    """How PyTorch computes an op.

    Attributes
    ----------
    new
        ``new(*args)`` -> tuple of new tensors, in the order of the op's
        results (its returned tensors; for a mutating op, the new values of
        its mutated arguments in schema order). Timed eagerly and compiled.
    out
        Eager, into buffers: ``out(*args, outs)`` writes the results into the
        tensors *outs*; for a mutating op ``out(*args)`` updates the
        arguments in place. None where torch has no such form.
    out_note
        How *out* is composed, when it is not one native ``out=`` call.
    what
        What *new* calls, for the results.
    label
        Names the variant when an op has several (see :attr:`Workload.torch`).
    """

    new: Callable[..., tuple[Any, ...]]
    out: Callable[..., Any] | None = None
    out_note: str = ""
    what: str = ""
    label: str = ""




def torch_impls() -> dict[str, tuple[TorchImpl, ...]]:
    """``{op name: torch variants}`` of every op with a torch formula (imports torch)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    def acc(dtype: torch.dtype) -> torch.dtype:
        # The accumulation dtype: float32 for 16-bit inputs, float64 stays float64.
        return torch.promote_types(dtype, torch.float32)

    def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
        # (R, 1) in the accumulation dtype, no full-size temporary: vector_norm reduces in one pass.
        h = x.shape[-1]
        r: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc(x.dtype))
        return r.pow_(2).div_(h).add_(eps).rsqrt_()

    def rms_into(dst: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        torch.mul(x, rstd(x, eps), out=dst)
        dst.mul_(w)

    def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1] // 2
        return x[..., :d], x[..., d:]

    def silu_mul_new(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = halves(x)  # once: each slice costs a torch call (about 1 us of a 4 us formula at 8x64)
        return (F.silu(a) * b,)

    def silu_mul_out(x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        a, b = halves(x)
        torch.ops.aten.silu.out(a, out=outs[0])
        outs[0].mul_(b)

    def gelu_mul(approximate: str) -> TorchImpl:
        def new(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            a, b = halves(x)
            return (F.gelu(a, approximate=approximate) * b,)

        def out(x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
            a, b = halves(x)
            torch.ops.aten.gelu.out(a, approximate=approximate, out=outs[0])
            outs[0].mul_(b)

        return TorchImpl(new, out, f"gelu(a, approximate={approximate!r}, out=buf) then buf.mul_(b)",
                         f"F.gelu(a, approximate={approximate!r}) * b", f"approximate={approximate!r}")

    # The gated backward ops as torch.autograd computes the gradient of act(a) * b (mul, act's backward
    # kernel, act), the halves' gradients joined into grad_x = [grad_a | grad_b] (or written into its halves).
    def silu_mul_backward_new(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = halves(x)
        return (torch.cat([torch.ops.aten.silu_backward(grad * b, a), grad * F.silu(a)], dim=-1),)

    def silu_mul_backward_out(grad: torch.Tensor, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        a, b = halves(x)
        grad_a, grad_b = halves(outs[0])
        torch.ops.aten.silu_backward.grad_input(grad * b, a, grad_input=grad_a)
        torch.ops.aten.silu.out(a, out=grad_b)
        grad_b.mul_(grad)

    def gelu_mul_backward_new(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = halves(x)
        return (torch.cat([torch.ops.aten.gelu_backward(grad * b, a, approximate="tanh"),
                           grad * F.gelu(a, approximate="tanh")], dim=-1),)

    def gelu_mul_backward_out(grad: torch.Tensor, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        a, b = halves(x)
        grad_a, grad_b = halves(outs[0])
        torch.ops.aten.gelu_backward.grad_input(grad * b, a, approximate="tanh", grad_input=grad_a)
        torch.ops.aten.gelu.out(a, approximate="tanh", out=grad_b)
        grad_b.mul_(grad)

    def fused_add_rms_new(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, ...]:
        s = x + residual
        return F.rms_norm(s, (s.shape[-1],), w, eps), s

    def fused_add_rms_inplace(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        residual.add_(x)
        rms_into(x, residual, w, eps)

    def rms_backward_new(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, ...]:
        a = acc(x.dtype)
        xf, gf, wf = x.to(a), grad.to(a), w.to(a)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * r
        gx = gf * wf
        dx = r * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        dw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype)

    def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
        # vLLM's _apply_rotary_emb_torch: in x's dtype, NeoX halves or GPT-J even/odd pairs.
        cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1) if is_neox else (x[..., ::2], x[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)

    def rope_new(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                 cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor | None, ...]:
        # vLLM's RotaryEmbedding.forward_native.
        positions = positions.flatten()
        n, rot = positions.shape[0], cache.shape[-1]
        cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            v = t.reshape(n, -1, head_size)
            return torch.cat((rope_rotate(v[..., :rot], cos, sin, is_neox), v[..., rot:]), dim=-1).reshape(t.shape)

        return apply(query), apply(key)

    def rope_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cache: torch.Tensor, is_neox: bool) -> None:
        positions = positions.flatten()
        n, half = positions.shape[0], cache.shape[-1] // 2
        cos, sin = cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
        for t in (query, key):
            if t is None:
                continue
            r = t.view(n, -1, head_size)[..., :2 * half]
            x1, x2 = (r[..., :half], r[..., half:]) if is_neox else (r[..., ::2], r[..., 1::2])
            o1 = x1 * cos - x2 * sin
            x2.mul_(cos).add_(x1 * sin)
            x1.copy_(o1)

    def step_new(num_seqs: int, num_queries: int, block_size: int, input_tokens: torch.Tensor,
                 sampled: torch.Tensor, input_positions: torch.Tensor, seq_lens: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The new input_tokens, input_positions, seq_lens and slot_mapping (the mutated arguments' order).
        q, pad = num_queries, num_seqs - num_queries
        pos = seq_lens[:q].to(torch.int64)
        blocks = block_tables[:q].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
        zeros = input_tokens.new_zeros(pad)
        return (torch.cat((sampled.reshape(q), zeros)), torch.cat((pos, zeros)),
                torch.cat((seq_lens[:q] + 1, seq_lens[q:])),
                torch.cat((blocks * block_size + pos % block_size, slot_mapping.new_full((pad,), -1))))

    def step_inplace(num_seqs: int, num_queries: int, block_size: int, input_tokens: torch.Tensor,
                     sampled: torch.Tensor, input_positions: torch.Tensor, seq_lens: torch.Tensor,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> None:
        q = num_queries
        pos = input_positions[:q]
        pos.copy_(seq_lens[:q])
        seq_lens[:q].add_(1)
        input_tokens[:q].copy_(sampled.reshape(q))
        blocks = block_tables[:q].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
        torch.add(pos % block_size, blocks, alpha=block_size, out=slot_mapping[:q])
        input_tokens[q:].zero_()
        input_positions[q:].zero_()
        slot_mapping[q:].fill_(-1)

    return {
        "add": (TorchImpl(lambda x, y: (torch.add(x, y),), lambda x, y, outs: torch.add(x, y, out=outs[0]),
                          "torch.add(x, y, out=buf)", "torch.add(x, y)"),),
        "gelu": (TorchImpl(lambda x: (F.gelu(x, approximate="tanh"),),
                           lambda x, outs: torch.ops.aten.gelu.out(x, approximate="tanh", out=outs[0]),
                           "gelu(x, approximate='tanh', out=buf)", "F.gelu(x, approximate='tanh')"),),
        "gelu_backward": (TorchImpl(
            lambda grad, x: (torch.ops.aten.gelu_backward(grad, x, approximate="tanh"),),
            lambda grad, x, outs: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh",
                                                                         grad_input=outs[0]),
            "aten.gelu_backward.grad_input(grad, x, approximate='tanh', grad_input=buf)",
            "aten.gelu_backward(grad, x, approximate='tanh')"),),
        "rms_norm": (TorchImpl(
            lambda x, w, eps: (F.rms_norm(x, (x.shape[-1],), w, eps),),
            lambda x, w, eps, outs: rms_into(outs[0], x, w, eps),
            "F.rms_norm has no out=; composed: vector_norm -> (R,1) rstd, mul(x, rstd, out=buf), buf.mul_(w)",
            "F.rms_norm(x, (H,), w, eps)"),),
        "rms_norm_backward": (TorchImpl(rms_backward_new, what="formula, float32 or wider (no CPU aten kernel)"),),
        "silu_and_mul": (TorchImpl(silu_mul_new, silu_mul_out,
                                   "silu(a, out=buf) then buf.mul_(b)", "F.silu(a) * b"),),
        "gelu_and_mul": (gelu_mul("none"), gelu_mul("tanh")),
        "silu_and_mul_backward": (TorchImpl(
            silu_mul_backward_new, silu_mul_backward_out,
            "aten.silu_backward.grad_input(grad * b, a, grad_input=buf[..., :d]), silu(a, out=buf[..., d:]), "
            "buf[..., d:].mul_(grad)",
            "the gradient torch.autograd computes for F.silu(a) * b, written out: "
            "torch.cat([aten.silu_backward(grad * b, a), grad * F.silu(a)], -1)"),),
        "gelu_and_mul_backward": (TorchImpl(
            gelu_mul_backward_new, gelu_mul_backward_out,
            "aten.gelu_backward.grad_input(grad * b, a, approximate='tanh', grad_input=buf[..., :d]), "
            "gelu(a, approximate='tanh', out=buf[..., d:]), buf[..., d:].mul_(grad)",
            "the gradient torch.autograd computes for F.gelu(a, approximate='tanh') * b, written out: "
            "torch.cat([aten.gelu_backward(grad * b, a, approximate='tanh'), "
            "grad * F.gelu(a, approximate='tanh')], -1)"),),
        "gelu_tanh_and_mul": (gelu_mul("tanh"),),
        "fused_add_rms_norm": (TorchImpl(
            fused_add_rms_new, fused_add_rms_inplace,
            "in place: residual.add_(x), vector_norm -> (R,1) rstd, mul(residual, rstd, out=x), x.mul_(w)",
            "s = x + residual; (F.rms_norm(s, (H,), w, eps), s)"),),
        "rotary_embedding": (TorchImpl(
            rope_new, rope_inplace,
            "in place on views of query and key: index_select the cos/sin rows, o1 = x1 cos - x2 sin, "
            "x2.mul_(cos).add_(x1 sin), x1.copy_(o1)",
            "vLLM's RotaryEmbedding.forward_native: index_select, chunk, rotate halves (NeoX) or pairs "
            "(GPT-J), torch.cat"),),
        "advance_step_flashattn": (TorchImpl(
            step_new, step_inplace,
            "in place, vectorised: copy_ tokens and positions, seq_lens.add_(1), gather the block ids, "
            "add(pos % bs, block, alpha=bs, out=slot_mapping), fill the padding",
            "vectorised torch: gather the block ids, torch.cat of queries and padding"),),
    }
