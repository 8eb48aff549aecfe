"""The built-in op library, namespace ``opbridge``.

Each op is reachable as ``opbridge.ops.<name>`` (any supported framework's
arrays) and, once torch is in use, as ``torch.ops.opbridge.<name>``.
Kernels live in ``opbridge/csrc`` (every file there is compiled into the
library); the NumPy references in the modules below are the declarations.
"""

from __future__ import annotations

# The modules declare their ops in this order, which is the library's: not sorted.
# isort: off
from opbridge.ops._library import LIBRARY
from opbridge.ops.basic import add, gelu, gelu_backward, rms_norm, rms_norm_backward
from opbridge.ops.serving import (
    fused_add_rms_norm,
    gelu_and_mul,
    gelu_and_mul_backward,
    silu_and_mul,
    silu_and_mul_backward,
)
from opbridge.ops.rotary import rotary_embedding
from opbridge.ops.advance_step import advance_step_flashattn
# isort: on

__all__ = [
    "LIBRARY",
    "add",
    "advance_step_flashattn",
    "fused_add_rms_norm",
    "gelu",
    "gelu_and_mul",
    "gelu_and_mul_backward",
    "gelu_backward",
    "rms_norm",
    "rms_norm_backward",
    "rotary_embedding",
    "silu_and_mul",
    "silu_and_mul_backward",
]
