"""Paddle harness: autograd through ``paddle.grad``, graph mode through ``paddle.jit.to_static``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from opbridge._codegen import compile_source


class PaddleHarness:
    """Drives the conformance matrix on ``paddle.Tensor`` (CPU)."""

    name = "paddle"
    dtypes = ("float64", "float32", "float16", "bfloat16", "int32", "int64")
    mutates_in_place = True

    def skip_reason(self) -> str | None:
        """None when paddle imports, else why not."""
        try:
            with warnings.catch_warnings():  # Paddle warns at import when ccache is missing
                warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
                import paddle  # noqa: F401
        except ImportError:
            return "paddle is not installed"
        return None

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        """A CPU tensor holding *a* cast to *dtype* (the array's own dtype when None)."""
        import paddle

        t = paddle.to_tensor(np.ascontiguousarray(a), place=paddle.CPUPlace())
        return t if dtype is None else t.astype(dtype)  # type: ignore[arg-type]

    def to_numpy(self, x: Any) -> np.ndarray:
        """*x* as a NumPy array, 16-bit floats widened to float32."""
        import paddle

        x = x.detach()
        if x.dtype in (paddle.float16, paddle.bfloat16):
            x = x.astype("float32")
        return np.asarray(x.numpy())

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        """Gradients of ``sum(fn(*args) * cotangent)`` w.r.t. ``args[i]`` for i in *argnums*."""
        import paddle

        args = list(args)
        for i in argnums:
            args[i] = args[i].detach().clone()
            args[i].stop_gradient = False
        out = fn(*args)
        cot = paddle.to_tensor(np.ascontiguousarray(cotangent)).astype(out.dtype)
        grads = paddle.grad([out], [args[i] for i in argnums], grad_outputs=[cot], allow_unused=True)
        return [np.zeros(args[i].shape, np.float32) if g is None else self.to_numpy(g)
                for i, g in zip(argnums, grads, strict=True)]

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """*fn* under ``paddle.jit.to_static(full_graph=True)``: a PIR program, opbridge ops as Python ops.

        to_static transcribes the source of the function it is given and reads its
        signature, so lambdas and ``*args`` functions are wrapped, per arity, in a
        generated ``def`` (:func:`opbridge._codegen.compile_source`, so tracebacks show it).
        """
        import paddle

        programs: dict[int, Any] = {}

        def compiled(*args: Any) -> Any:
            prog = programs.get(len(args))
            if prog is None:
                names = ", ".join(f"a{i}" for i in range(len(args)))
                src = f"def graph_fn({names}):\n    return fn({names})\n"
                ns = compile_source(src, "<paddle harness graph_fn>", {"fn": fn})
                prog = programs[len(args)] = paddle.jit.to_static(ns["graph_fn"], full_graph=True)
            with warnings.catch_warnings():
                # Paddle's own backward construction reads Value.place and warns about it.
                warnings.filterwarnings("ignore", message="Tensor do not have 'place' interface",
                                        category=UserWarning)
                # Its output check compares the first element with a magic number in the output's dtype,
                # which overflows float16 (paddle/jit/dy2static/pir_partial_program.py, _is_no_value).
                warnings.filterwarnings("ignore", message="overflow encountered in cast", category=RuntimeWarning,
                                        module=r"paddle\.jit\.")
                return prog(*args)

        return compiled

    def data_ptr(self, x: Any) -> int:
        """Address of *x*'s first element."""
        return int(x.data_ptr())


HARNESS = PaddleHarness()
