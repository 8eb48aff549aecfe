"""PyTorch's own OpInfo sample inputs, mapped onto ``torch.ops.opbridge.*`` (issues 11 and 19).

The samples of ``op_db`` for ``add`` (same-shape operands), ``nn.functional.gelu``
(``approximate="tanh"``) and ``nn.functional.rms_norm`` (last dimension, with a
weight), in every dtype each op declares, contiguous and non-contiguous
(``SampleInput.noncontiguous()``): forward results and input gradients against
torch's own ops, at the op's declared tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

import opbridge  # noqa: E402
from opbridge import ops  # noqa: E402


def _op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db  # type: ignore[no-any-return]


def _info(name: str) -> Any:
    return next(o for o in _op_db() if o.name == name and o.variant_test_name == "")


Mapped = tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]


def _add(s: Any) -> Mapped | None:
    other = s.args[0] if s.args else None
    if s.kwargs or not isinstance(other, torch.Tensor) or other.shape != s.input.shape:
        return None
    return torch.ops.opbridge.add, torch.add, (s.input, other)


def _gelu(s: Any) -> Mapped | None:
    if s.args or s.kwargs.get("approximate") != "tanh":
        return None
    return (torch.ops.opbridge.gelu, lambda x: torch.nn.functional.gelu(x, approximate="tanh"), (s.input,))


def _rms_norm(s: Any) -> Mapped | None:
    x = s.input
    if len(s.args) < 2 or s.args[1] is None or tuple(s.args[0]) != tuple(x.shape[-1:]):
        return None
    eps = s.kwargs.get("eps")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    if eps <= 0:
        return None
    weight = s.args[1]
    return (lambda a, w: torch.ops.opbridge.rms_norm(a, w, eps),
            lambda a, w: torch.nn.functional.rms_norm(a, (a.shape[-1],), w, eps), (x, weight))


CASES = {"add": ("add", _add), "gelu": ("nn.functional.gelu", _gelu),
         "rms_norm": ("nn.functional.rms_norm", _rms_norm)}


def _samples(name: str, dtype: Any) -> Iterator[tuple[str, Mapped]]:
    info_name, mapper = CASES[name]
    info = _info(info_name)
    if dtype not in info.supported_dtypes("cpu"):
        return
    for i, s in enumerate(info.sample_inputs("cpu", dtype, requires_grad=dtype.is_floating_point)):
        for layout, sample in (("contiguous", s), ("noncontiguous", s.noncontiguous())):
            mapped = mapper(sample)
            if mapped is not None:
                yield f"sample {i} {layout} {tuple(sample.input.shape)}", mapped


def _params() -> list[Any]:
    return [pytest.param(name, dt, id=f"{name}-{dt}") for name in CASES
            for dt in getattr(ops, name).opdef.dtypes]


@pytest.mark.parametrize(("name", "dtype_name"), _params())
def test_opinfo_samples_match_torch(name: str, dtype_name: str) -> None:
    op: opbridge.OpDef = getattr(ops, name).opdef
    dtype = getattr(torch, dtype_name)
    rtol, atol = op.tolerance(dtype_name)
    seen = 0
    for label, (ours, theirs, args) in _samples(name, dtype):
        seen += 1
        got, want = ours(*args), theirs(*args)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: {m}")
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not inputs or not dtype.is_floating_point or got.numel() == 0:
            continue
        grad = torch.randn_like(want)
        g_ours = torch.autograd.grad(got, inputs, grad)
        g_theirs = torch.autograd.grad(want, inputs, grad)
        for k, (a, b) in enumerate(zip(g_ours, g_theirs)):
            # Gradients sum over rows (rms_norm's weight): allow the reduction's rounding.
            scale = max(1, a.numel() and args[0].numel() // max(1, a.numel()))
            torch.testing.assert_close(a, b, rtol=rtol * scale, atol=atol * scale,
                                       msg=lambda m, label=label, k=k: f"{label}: gradient {k}: {m}")
    if seen == 0:
        pytest.skip(f"no OpInfo sample of {name} maps onto opbridge's op in {dtype_name}")
