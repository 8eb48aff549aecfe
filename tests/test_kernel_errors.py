"""A kernel that raises is run once: its error comes from the C entry or native kernel that ran it.

The C entries (torch's and NumPy's) and the torch shim's dispatcher kernel
used to swallow a kernel's error and let the slower Python path run the
kernel again to raise it. A second run is not a repeat: a CUDA kernel's
device-side error record is taken by the first run (so the second raised
nothing: ``test_cuda.py::test_device_side_errors_are_reported`` failed on an
H200 when the entry took the call), and with ``OPBRIDGE_CUDA_SYNC_CHECKS=1``
a kernel has written before it raises (so the second applied it twice).

The kernel here writes to its input, then raises when asked: each path must
leave the input written once, and raise the kernel's own error with the type
and message of the Python path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import opbridge

KERNEL_CC = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
// out = x, after x[0] += 1; then, when asked, ValueError: a kernel whose error follows a write.
void count_then_fail_cpu(TensorView out, TensorView x, int64_t fail) {
  float* a = static_cast<float*>(x.data_ptr());
  a[0] += 1.0f;
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i];
  if (fail != 0) OPB_THROW(ValueError) << "count_then_fail: asked to fail after writing";
}
OPBRIDGE_EXPORT(count_then_fail_cpu);
"""

MESSAGE = "count_then_fail: asked to fail after writing"


@pytest.fixture
def op(make_library: Callable[..., opbridge.Library]) -> opbridge.OpDef:
    lib = make_library({"k.cc": KERNEL_CC}, prefix="kerr")

    @lib.op("count_then_fail(Tensor x, int fail) -> Tensor", shape=opbridge.like("x"), dtypes=("float32",))
    def count_then_fail(x: Any, fail: int) -> Any:
        return x

    return lib.ops["count_then_fail"]


def test_numpy_entry_raises_the_kernels_error_after_one_run(op: opbridge.OpDef) -> None:
    from opbridge.adapters.numpy import native

    lib = native.library(build_now=True)
    if lib is None:
        pytest.skip("NumPy's C entry could not be built here")
    from opbridge.adapters import numpy as np_adapter

    x = np.zeros(8, np.float32)
    np.testing.assert_array_equal(op.call(x, 0), x)  # installs the fast path, the entry in front
    np.testing.assert_array_equal(op.call(x, 0), x)
    assert np_adapter.entry_calls(op) == 1, "the C entry did not take the call"
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=MESSAGE):
        op.call(x, 1)
    assert x[0] == 1.0, "the kernel ran twice"


def test_torch_entry_and_dispatcher_raise_the_kernels_error_after_one_run(op: opbridge.OpDef) -> None:
    torch = pytest.importorskip("torch")
    from opbridge.adapters.torch import calls, native

    if not native.enabled() or native.shim(build_now=True) is None:
        pytest.skip("the torch native shim is off or could not be built here")
    calls.kernel(op, "cpu")  # hands the kernel to the native routine
    x = torch.zeros(8)
    torch.testing.assert_close(op.call(x, 0), x)  # installs the fast path and its C entry
    assert "_t_native" in op.call.__globals__, "no C entry installed"
    entry_before = native.entry_calls(op)

    x = torch.zeros(8)
    with pytest.raises(ValueError, match=MESSAGE):
        op.call(x, 1)  # the C entry
    assert x[0].item() == 1.0, "the kernel ran twice"
    assert native.entry_calls(op) == entry_before  # it raised: not a completed entry call

    x = torch.zeros(8)
    with pytest.raises(ValueError, match=MESSAGE):
        getattr(torch.ops, op.library.namespace).count_then_fail(x, 1)  # the native dispatcher kernel
    assert x[0].item() == 1.0, "the kernel ran twice"


def test_python_path_raises_the_same_error(op: opbridge.OpDef, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBRIDGE_NUMPY_NATIVE", "0")
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=MESSAGE) as err:
        op.call(x, 1)
    assert str(err.value).splitlines()[0] == MESSAGE
