"""Where users first touch opbridge (issue 11): importing the package is enough for torch.ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

PROBE = """
import sys
{imports}
assert "torch" in sys.modules
packet = torch.ops.opbridge.advance_step_flashattn
assert str(packet) == "opbridge.advance_step_flashattn", packet
print(sorted(n for n in dir(torch.ops.opbridge) if not n.startswith("_"))[:3])
"""


@pytest.mark.parametrize("imports", [
    "import opbridge\nimport torch", "import torch\nimport opbridge",
    # torch imported from inside the torch adapter's own import (as `opbridge doctor`'s probe does):
    # its import hook must not ask the half-imported adapter for ADAPTER
    "import opbridge.adapters.torch\nimport torch", "from opbridge.adapters.torch.native import build\nimport torch",
])
def test_importing_opbridge_registers_builtins_with_torch_without_building(imports: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {"OPBRIDGE_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "add" in out.stdout
    built = list(cache.rglob("*.so")) if cache.exists() else []
    assert built == [], f"registering compiled something: {built}"


def test_importing_opbridge_does_not_import_torch() -> None:
    code = "import sys, opbridge; print('torch' in sys.modules, 'opbridge.ops' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


RAW_SCALE = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
// The README's quickstart kernel: reads raw memory, checks no strides.
void scale_cpu(TensorView out, TensorView x, double alpha) {
  OPB_CHECK_DTYPE("scale", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("scale", out, x);
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * float(alpha);
}
OPBRIDGE_EXPORT(scale_cpu);
"""


def test_a_kernel_that_reads_raw_memory_only_ever_sees_dense_inputs(make_library: Any) -> None:
    """Strided inputs reach a kernel as dense copies on every path (issue 11), even one that checks no strides."""
    import numpy as np
    import torch

    from opbridge import like

    lib = make_library({"scale.cc": RAW_SCALE})

    @lib.op("scale(Tensor x, float alpha) -> Tensor", shape=like("x"), dtypes=("float32",))
    def scale(x: Any, alpha: float) -> Any:
        return x * alpha

    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = torch.from_numpy(base)
    # strided views reach it as dense copies; dense views at an offset (the last two) as they are, each
    # tensor's data pointing at its first element (DLPack's byte_offset 0): a framework that handed the
    # kernel its allocation and an offset would break every kernel written this way
    views = [(base[:, ::2], t[:, ::2]), (base.T, t.T), (base[1:, 1:], t[1:, 1:]), (base[1:], t[1:]),
             (base.reshape(-1)[5:], t.reshape(-1)[5:])]
    for view, tv in views:
        want = view * 3.0
        np.testing.assert_array_equal(scale(view, 3.0), want)
        for _ in range(2):  # the first call resolves the adapter, the second takes the fast path
            np.testing.assert_array_equal(scale(tv, 3.0).numpy(), want)
        packet = getattr(torch.ops, lib.namespace).scale
        np.testing.assert_array_equal(packet(tv, 3.0).numpy(), want)
