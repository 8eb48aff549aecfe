"""JAX harness: gradients through ``jax.vjp``, graph mode through ``jax.jit``.

JAX arrays are immutable, so mutating ops return the new values of their
mutated arguments instead (``mutates_in_place = False``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class JaxHarness:
    """The conformance-matrix interface for JAX (CPU)."""

    name = "jax"

    @property
    def dtypes(self) -> tuple[str, ...]:
        """float32, float16, bfloat16 and int32; float64 and int64 only with ``jax_enable_x64``."""
        import jax

        wide = ("float64", "int64") if jax.config.read("jax_enable_x64") else ()
        return ("float32", "float16", "bfloat16", "int32", *wide)

    mutates_in_place = False

    def skip_reason(self) -> str | None:
        """None when jax and jax_tvm_ffi import, else why not."""
        for module in ("jax", "jax_tvm_ffi"):
            try:
                __import__(module)
            except ImportError as e:
                return f"{module} is not installed ({e})"
        return None

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        """A jax array holding *a* cast to *dtype* (JAX narrows 64-bit ints unless jax_enable_x64)."""
        import jax.numpy as jnp

        return jnp.asarray(a) if dtype is None else jnp.asarray(a, dtype=jnp.dtype(dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        """*x* as NumPy; 16-bit floats widened to float32."""
        a = np.asarray(x)
        if a.dtype.itemsize == 2 and a.dtype.kind not in "iub":  # float16, bfloat16
            a = a.astype(np.float32)
        return a

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        """Gradients of ``sum(fn(*args) * cotangent)`` with respect to ``args[i]``, i in *argnums*."""
        import jax
        import jax.numpy as jnp

        full = list(args)

        def f(*diff: Any) -> Any:
            call = list(full)
            for i, d in zip(argnums, diff, strict=True):
                call[i] = d
            return fn(*call)

        out, pullback = jax.vjp(f, *(full[i] for i in argnums))
        grads = pullback(jnp.asarray(cotangent, dtype=out.dtype))
        return [self.to_numpy(g) for g in grads]

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """*fn* under ``jax.jit``, with its non-array arguments (scalars, lists, None) static; a list
        (``int[]``) crosses ``jit`` as a tuple, which static arguments must be (hashable), and reaches
        *fn* as a list again."""
        import jax

        jitted: dict[tuple[tuple[int, ...], tuple[int, ...]], Callable[..., Any]] = {}

        def compiled(*args: Any) -> Any:
            static = tuple(i for i, a in enumerate(args) if not isinstance(a, jax.Array))
            lists = tuple(i for i in static if isinstance(args[i], list))
            f = jitted.get((static, lists))
            if f is None:
                def as_called(*a: Any) -> Any:
                    return fn(*(list(v) if i in lists else v for i, v in enumerate(a)))

                f = jitted[static, lists] = jax.jit(as_called, static_argnums=static)
            return f(*(tuple(v) if i in lists else v for i, v in enumerate(args)))

        return compiled

    def data_ptr(self, x: Any) -> int:
        """Address of *x*'s (single-device) buffer."""
        return int(x.unsafe_buffer_pointer())


HARNESS = JaxHarness()
