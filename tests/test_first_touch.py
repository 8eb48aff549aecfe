"""Where users first touch opbridge (issue 11): importing the package is enough for torch.ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("imports", ["import opbridge\nimport torch", "import torch\nimport opbridge"])
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
