"""The native shim keeps its C++ runtime to itself (``adapters/torch/native/exports.map``).

On an H200 (2026-11-28) the GPU tests' tvm-ffi errors, raised in processes that had loaded the cached shim
before ``import tvm_ffi``, were SIGSEGVs: libtvm_ffi.so, loaded as the shim's dependency, had bound its libstdc++
calls to the copies the shim exported, and the device's shim was built by another compiler than its
libstdc++. These tests fail on this machine too where the shim exports them or is loaded first.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from opbridge import config
from opbridge.adapters.torch import native


@pytest.fixture(scope="module")
def shim_path() -> str:
    if not native.enabled():
        pytest.skip("OPBRIDGE_TORCH_NATIVE=0")
    sh = native.shim(build_now=True)
    if sh is None:
        pytest.skip("the native shim could not be built here (no compiler?)")
    return str(sh.path)


def test_the_shim_exports_its_c_entries_and_nothing_else(shim_path: str) -> None:
    nm = shutil.which("nm")
    if nm is None:  # binutils come with the linker that built the shim; a machine without them is odd
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", shim_path], capture_output=True, text=True,
                         check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    entries = {n for n in names if n.startswith("opb_")}
    assert {"opb_register", "opb_set_kernel", "opb_entry"} <= entries
    assert names - entries == set(), "the shim exports more than its C entries"


def test_no_library_binds_a_symbol_to_the_shim(shim_path: str, tmp_path: Path) -> None:
    """A fresh process registers the ops with the shim cached (so the shim loads at registration, before
    any kernel) and raises a kernel's error; the dynamic linker's log shows what each library bound where."""
    probe = ("import torch\n"
             "from opbridge import ops\n"
             "from opbridge.adapters.torch import native\n"
             "assert native._SHIM is not None, 'the shim was not loaded at registration'\n"
             "try:\n"
             "    ops.rotary_embedding(torch.tensor([0, 99]), torch.randn(2, 8), None, 8, torch.randn(4, 8), True)\n"
             "except ValueError:\n"
             "    print('raised')\n")
    log = tmp_path / "ld"  # the dynamic linker's log (tens of MB) goes to ld.<pid>
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(config.cache_dir()), "OPBRIDGE_TORCH_NATIVE": "1",
           "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["raised"], done.stdout + done.stderr[-3000:]
    logged = "".join(p.read_text(errors="replace") for p in tmp_path.glob("ld.*"))
    name = re.escape(os.path.basename(shim_path))
    into_shim = re.compile(rf"binding file (\S+) \[\d+\] to \S*{name} \[\d+\]: \S+ symbol `([^']+)'")
    bound = [(m[1], m[2]) for m in into_shim.finditer(logged)]
    assert any(symbol.startswith("opb_") for _, symbol in bound), "no log of ctypes' lookups in the shim"
    foreign = sorted({(lib, symbol) for lib, symbol in bound
                      if not symbol.startswith("opb_")  # its entries, looked up by ctypes
                      and os.path.basename(lib) != os.path.basename(shim_path)})  # and its own calls
    assert foreign == [], f"{len(foreign)} bindings into the shim, e.g. {foreign[:3]}"
