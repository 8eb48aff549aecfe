"""The built-in library object; its kernel sources are every file in ``opbridge/csrc``."""

from __future__ import annotations

from pathlib import Path

from opbridge.library import Library

CSRC = Path(__file__).resolve().parent.parent / "csrc"

LIBRARY = Library(
    "opbridge",
    sources=sorted([*CSRC.glob("*.cc"), *CSRC.glob("*.cu")]),
    prebuilt="opbridge._C_ops",
    python_module="opbridge.ops",
    # Every built-in kernel computes float64 in double (the 16-bit types and float32 in float32).
    dtypes=("float32", "float16", "bfloat16", "float64"),
    kernels_check_inputs=True,  # include/opbridge/ops/<op>.h; tests/test_builtin_ops.py holds them to it
)
