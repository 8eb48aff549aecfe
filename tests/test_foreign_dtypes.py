"""Arguments tvm-ffi cannot pass get the op's error naming them, never an abort or a bare conversion error.

Dtypes no kernel takes and tvm-ffi has no name for (complex): a kernel's check names the dtype it got
(``opbridge::dtype_name``). tvm-ffi cannot name DLPack's complex types and throws; thrown while the
check's message was being written, that exception unwound through the error stream's throwing destructor
and terminated the process ("Fatal Python error: Aborted"): on the first call where the kernel checks the
argument (a weight), and on the second where the entry that skips the Python checks takes the call (the
op's lead argument). Each call runs in a child process, so an abort fails the test instead of ending the run.

Tensors DLPack cannot carry (NumPy's other byte orders, long double and object arrays; torch's quantized
tensors) and Python ints outside int64 (which tvm-ffi passes as ``ffi.BigInt``, taken by no kernel): the op's
TypeError or ValueError from the op-call core (``opbridge.call.unpassable``, ``core.check_int64``), on every
path a call may take. Paddle's and MindSpore's are in their adapters' tests, JAX's in its.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
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
                                            r"weight\.astype\(\"float32\"\)"):
            ops.rms_norm(x, np.ones(4).astype(dtype))


def _quantized(torch: Any, t: Any) -> Any:
    with warnings.catch_warnings():  # torch deprecates its quantized tensors; they are still made, and met
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)


def test_a_quantized_torch_tensor_is_named() -> None:
    """A quantized tensor as an argument: the op's TypeError naming it, through the dispatcher (torch's
    "Could not run 'opbridge::rms_norm' with arguments from the 'QuantizedCPU' backend" on the first call),
    the fast path and the C entry (DLPack's "QUInt/QInt types are not supported by dlpack" after it) and
    out= alike."""
    torch = pytest.importorskip("torch")

    from opbridge import ops

    x = torch.ones(2, 4)
    qw, qx = _quantized(torch, torch.ones(4)), _quantized(torch, torch.ones(2, 4))

    def named(op: str, arg: str) -> str:
        return (rf"{op}: argument '{arg}' has dtype quint8 \(a quantized tensor\), which no kernel takes \(DLPack "
                rf"has no quantized types\); convert it first, e.g. {arg}\.dequantize\(\)")

    for call, op, arg in ((lambda: torch.ops.opbridge.rms_norm(x, qw), "rms_norm", "weight"),
                          (lambda: ops.rms_norm(x, qw), "rms_norm", "weight"),
                          (lambda: ops.rms_norm(x, qw), "rms_norm", "weight"),  # the fast path's, or the entry's
                          (lambda: ops.add(x, qx), "add", "y"),
                          (lambda: ops.add(qx, x), "add", "x"),
                          (lambda: ops.add(x, qx, out=torch.empty(2, 4)), "add", "y")):
        with pytest.raises(TypeError, match=named(op, arg)):
            call()
    torch.testing.assert_close(ops.rms_norm(x, qw.dequantize()), ops.rms_norm(x, torch.ones(4)), atol=0.1, rtol=0)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_ints_outside_int64_are_named(framework: str) -> None:
    """An int beyond int64 for an int argument (rotary_embedding's head_size) or a float one (eps): the op's
    ValueError naming it and the range, not tvm-ffi's "Expected `int` but got `ffi.BigInt`" (torch's parser:
    "Expected a value of type 'int' ... but instead found type 'int'"), on the first call and on the paths a
    later one takes (fast path, C entry)."""
    fw = pytest.importorskip(framework)

    from opbridge import ops

    def t(a: Any) -> Any:
        return fw.from_numpy(a) if framework == "torch" else a

    rng = np.random.default_rng(0)
    q, k = t(rng.standard_normal((2, 8)).astype(np.float32)), t(rng.standard_normal((2, 8)).astype(np.float32))
    pos, cache = t(np.zeros(2, np.int64)), t(rng.standard_normal((4, 8)).astype(np.float32))
    x, w = t(np.ones((2, 4), np.float32)), t(np.ones(4, np.float32))
    head = (r"rotary_embedding: argument 'head_size' must be in int64's range \[-2\*\*63, 2\*\*63 - 1\] "
            r"\(a kernel's int64_t\)")
    eps = (r"rms_norm: argument 'eps' is the int 1180591620717411303424, outside int64's range \[-2\*\*63, "
           r"2\*\*63 - 1\], in which a kernel takes an int for a float; pass it as a float, e.g. float\(eps\)")
    for _ in range(2):
        ops.rotary_embedding(pos, q, k, 8, cache, True)  # the first call of each op installs its fast paths
        ops.rms_norm(x, w)
        with pytest.raises(ValueError, match=head + ", got the int 1180591620717411303424"):
            ops.rotary_embedding(pos, q, k, 2**70, cache, True)
        with pytest.raises(ValueError, match=head + ", got the int -9223372036854775809"):
            ops.rotary_embedding(pos, q, k, -(2**63) - 1, cache, True)
        with pytest.raises(ValueError, match=head + ", got an int of 16610 bits"):  # past str()'s digit limit too
            ops.rotary_embedding(pos, q, k, 10**5000, cache, True)
        with pytest.raises(ValueError, match=eps):
            ops.rms_norm(x, w, 2**70)
        with pytest.raises(TypeError, match="rotary_embedding: argument 'head_size' must be int, got float"):
            ops.rotary_embedding(pos, q, k, 8.0, cache, True)
