"""PyTorch harness: autograd through ``torch.autograd.grad``, graph mode through ``torch.compile``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class TorchHarness:
    name = "torch"
    dtypes = ("float64", "float32", "float16", "bfloat16", "int32", "int64")
    mutates_in_place = True

    def skip_reason(self) -> str | None:
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not installed"
        return None

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if dtype is None else t.to(getattr(torch, dtype)).contiguous()

    def to_numpy(self, x: Any) -> np.ndarray:
        import torch

        x = x.detach().cpu()
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        arr: np.ndarray = x.numpy()
        return arr

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        import torch

        args = list(args)
        for i in argnums:
            args[i] = args[i].detach().clone().requires_grad_(True)
        out = fn(*args)
        grads = torch.autograd.grad(out, [args[i] for i in argnums],
                                    grad_outputs=torch.from_numpy(cotangent).to(out.dtype), allow_unused=True)
        return [np.zeros(tuple(args[i].shape), np.float32) if g is None else self.to_numpy(g)
                for i, g in zip(argnums, grads, strict=True)]

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        import torch

        # aot_eager traces through Dynamo and AOTAutograd like Inductor does, without
        # Inductor's C++ codegen, which costs ~20 s per graph on a 2-core machine.
        torch._dynamo.reset()  # each compile starts fresh: tests compile one op under many shapes
        return torch.compile(fn, fullgraph=True, backend="aot_eager")

    def data_ptr(self, x: Any) -> int:
        return int(x.data_ptr())


HARNESS = TorchHarness()
