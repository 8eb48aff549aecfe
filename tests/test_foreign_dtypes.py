"""Dtypes no kernel takes and tvm-ffi has no name for (complex) get the op's TypeError, never an abort.

A kernel's check names the dtype it got (``opbridge::dtype_name``). tvm-ffi cannot name DLPack's
complex types and throws; thrown while the check's message was being written, that exception
unwound through the error stream's throwing destructor and terminated the process ("Fatal Python
error: Aborted"): on the first call where the kernel checks the argument (a weight), and on the
second where the entry that skips the Python checks takes the call (the op's lead argument).
Each call runs in a child process, so an abort fails the test instead of ending the run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CALLS = {
    "numpy": """
        import numpy as np
        import opbridge.ops as O
        x = np.ones((2, 4), np.float32)
        calls = [lambda: O.rms_norm(x, np.ones(4, np.complex64)),
                 lambda: O.add(x, x.astype(np.complex128))]
        O.gelu(np.ones(2, np.float32))  # the C entry takes the next call on its own
        calls.append(lambda: O.gelu(np.ones(2, np.complex64)))
    """,
    "torch": """
        import torch
        import opbridge.ops as O
        x = torch.ones(2, 4)
        O.gelu(x)
        calls = [lambda: O.rms_norm(x, torch.ones(4, dtype=torch.complex64)),
                 lambda: O.gelu(torch.ones(2, dtype=torch.complex64)),
                 lambda: torch.ops.opbridge.add(x, x.to(torch.complex64))]
    """,
}


@pytest.mark.parametrize("framework", sorted(CALLS))
def test_a_complex_argument_is_a_type_error(framework: str) -> None:
    pytest.importorskip(framework)
    src = textwrap.dedent(CALLS[framework]) + textwrap.dedent("""
        for call in calls:
            try:
                call()
            except TypeError as e:
                print("TypeError:", e)
            else:
                print("no error")
    """)
    got = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, f"exit status {got.returncode}\n{got.stdout}\n{got.stderr[-3000:]}"
    lines = got.stdout.splitlines()
    assert len(lines) == 3 and all(ln.startswith("TypeError: ") for ln in lines), got.stdout
    assert all("complex64" in ln or "complex128" in ln for ln in lines), got.stdout


@pytest.mark.parametrize("dtype", [">f4", "longdouble", "object"])
def test_an_array_dlpack_cannot_carry_is_named(dtype: str) -> None:
    """NumPy arrays DLPack refuses (another byte order, long double, object) as a non-lead argument: the
    op's TypeError naming the argument, not tvm-ffi's bare BufferError ("DLPack only supports ...")."""
    import numpy as np

    from opbridge import ops

    x = np.ones((2, 4), np.float32)
    for _ in range(2):  # the first call and one the C entry may take
        with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' has dtype .*, which no kernel takes "
                                            r"\(DLPack only supports .*\); convert it first, e.g. "
                                            r"\.astype\(\"float32\"\)"):
            ops.rms_norm(x, np.ones(4).astype(dtype))
