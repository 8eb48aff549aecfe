"""The plugin's ops in PyTorch: every op against its reference, the YAML op's autograd, errors, wrappers."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cases import CASES  # noqa: E402
from opbridge.testing import check_op  # noqa: E402

from vllm_plugin import _custom_ops as ops  # noqa: E402
from vllm_plugin.ops import LIBRARY  # noqa: E402


@pytest.mark.parametrize("name", sorted(LIBRARY.ops))
def test_op_matches_reference(name: str) -> None:
    op = LIBRARY.ops[name]
    report = check_op(op, CASES[name], dtypes=("float32", "bfloat16"))
    assert report.checks["forward"] > 0 and report.checks["opcheck"] > 0
    if op.backward is not None:
        assert report.checks["grad"] > 0


def test_yaml_op_backward_through_autograd() -> None:
    x = torch.randn(5, 12, dtype=torch.float64).float().requires_grad_()
    y = ops.silu_and_mul(x)
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_()
    a, b = x64.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, x64, g.double())
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)


def test_in_place_ops_mutate_and_return_none() -> None:
    x = torch.arange(6, dtype=torch.float32)
    assert ops.scale_(x, 0.5) is None
    torch.testing.assert_close(x, torch.arange(6, dtype=torch.float32) * 0.5)
    seq_lens = torch.tensor([3, 4], dtype=torch.int32)
    tokens, positions, slots = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), \
        torch.zeros(2, dtype=torch.int64)
    tables = torch.tensor([[7, 8], [9, 10]], dtype=torch.int32)
    sampled = torch.tensor([[11], [12]])
    ops.advance_step_flashattn(2, 2, 4, tokens, sampled, positions, seq_lens, slots, tables)
    assert tokens.tolist() == [11, 12] and positions.tolist() == [3, 4] and seq_lens.tolist() == [4, 5]
    assert slots.tolist() == [7 * 4 + 3, 10 * 4 + 0]


def test_advance_step_rejects_a_block_index_past_the_table_and_writes_nothing() -> None:
    seq_lens = torch.tensor([8], dtype=torch.int32)  # position 8 needs block 2 of a 2-block table
    tokens = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"advance_step_flashattn: sequence 0 needs block 2 .* has 2 blocks"):
        ops.advance_step_flashattn(1, 1, 4, tokens, torch.tensor([[5]]), torch.zeros(1, dtype=torch.int64),
                                   seq_lens, torch.zeros(1, dtype=torch.int64),
                                   torch.tensor([[1, 2]], dtype=torch.int32))
    assert seq_lens.tolist() == [8] and tokens.tolist() == [0]
    with pytest.raises(TypeError, match="seq_lens must have dtype int32, got int64"):
        ops.advance_step_flashattn(1, 1, 4, tokens, torch.tensor([[5]]), torch.zeros(1, dtype=torch.int64),
                                   torch.tensor([1]), torch.zeros(1, dtype=torch.int64),
                                   torch.tensor([[1, 2]], dtype=torch.int32))


def test_silu_and_mul_rejects_an_odd_last_dim() -> None:
    with pytest.raises(ValueError, match="silu_and_mul: x's last dim must be even"):
        ops.silu_and_mul(torch.ones(2, 5))


def test_wrappers_have_the_ops_signatures_and_docs() -> None:
    for name, op in LIBRARY.ops.items():
        wrapper = getattr(ops, name)
        assert inspect.signature(wrapper).parameters.keys() == inspect.signature(op.call).parameters.keys()
        assert "Parameters\n    ----------" in (wrapper.__doc__ or ""), name


def test_registered_in_torch_ops() -> None:
    x = torch.randn(3, 8)
    torch.testing.assert_close(torch.ops.vllm_plugin.silu_and_mul(x), ops.silu_and_mul(x))
    a = np.asarray(ops.silu_and_mul(x.numpy()))
    torch.testing.assert_close(torch.from_numpy(a), ops.silu_and_mul(x))
