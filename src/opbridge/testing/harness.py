"""Framework harnesses: the small interface the shared conformance matrix drives.

One harness per framework (``harness_<name>.py``) converts NumPy data in and
out, differentiates, compiles and reports data pointers, so one test matrix
(``tests/conformance``) checks every op in every framework the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

#: harness name -> module defining ``HARNESS``
HARNESSES = {
    "numpy": "opbridge.testing.harness_numpy",
    "torch": "opbridge.testing.harness_torch",
    "jax": "opbridge.testing.harness_jax",
    "paddle": "opbridge.testing.harness_paddle",
    "mindspore": "opbridge.testing.harness_mindspore",
}


class Harness(Protocol):
    """What the conformance matrix needs from a framework."""

    name: str
    #: dtypes this framework's arrays support here, e.g. ("float64", "float32", "float16", "bfloat16");
    #: the conformance matrix runs each op over those of its declared dtypes listed here
    dtypes: tuple[str, ...]
    #: whether ops mutate arguments in place (False for JAX: mutated args come back as results)
    mutates_in_place: bool

    def skip_reason(self) -> str | None:
        """None when the framework is importable and usable, else why not."""

    def from_numpy(self, a: np.ndarray, dtype: str | None) -> Any:
        """A framework array holding *a* cast to *dtype* (ints keep their dtype when dtype is None)."""

    def to_numpy(self, x: Any) -> np.ndarray:
        """*x* as a NumPy array (16-bit floats widened to float32)."""

    def vjp(self, fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int],
            cotangent: np.ndarray) -> list[np.ndarray]:
        """Gradients of ``sum(fn(*args) * cotangent)`` w.r.t. ``args[i]`` for i in *argnums*."""

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """*fn* compiled in the framework's graph mode, or None when there is none."""

    def data_ptr(self, x: Any) -> int:
        """Address of *x*'s first element."""


def get(name: str) -> Harness:
    """Import and return the harness called *name*."""
    module = importlib.import_module(HARNESSES[name])
    harness: Harness = module.HARNESS
    return harness
