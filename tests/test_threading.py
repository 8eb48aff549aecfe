"""The CPU threading policies (OPBRIDGE_THREADING=omp|pool): which is in force, and that both
compute the same results.

Each policy is read once per process by the kernels, so each runs in a child
process on inputs above the parallel grain; the children print digests of
their outputs, which must match each other bit for bit (the reductions use
fixed partitions) and the NumPy references.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import hashlib, json, sys
import numpy as np
import opbridge.ops as ops
from opbridge.testing import assert_close

rng = np.random.default_rng(0)
x = rng.standard_normal((513, 1031), dtype=np.float32)   # 528,903 elements: above the grain
y = rng.standard_normal((513, 1031), dtype=np.float32)
w = rng.standard_normal(1031, dtype=np.float32)
g = rng.standard_normal((513, 1031), dtype=np.float32)
xx = rng.standard_normal((513, 2062), dtype=np.float32)
results = {
    "add": ops.add(x, y),
    "gelu": ops.gelu(x),
    "rms_norm": ops.rms_norm(x, w, 1e-6),
    "rms_norm_backward": ops.rms_norm_backward(g, x, w, 1e-6),
    "silu_and_mul": ops.silu_and_mul(xx),
}
refs = {
    "add": ops.add.reference(x, y),
    "gelu": ops.gelu.reference(x),
    "rms_norm": ops.rms_norm.reference(x, w, 1e-6),
    "rms_norm_backward": ops.rms_norm_backward.reference(g, x, w, 1e-6),
    "silu_and_mul": ops.silu_and_mul.reference(xx),
}
digests = {}
for name, got in results.items():
    got = got if isinstance(got, tuple) else (got,)
    ref = refs[name] if isinstance(refs[name], tuple) else (refs[name],)
    for a, b in zip(got, ref):
        assert_close(a, b, dtype="float32")
    digests[name] = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in got)).hexdigest()
print(json.dumps(digests))
"""


def _run(policy: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPBRIDGE_THREADING=policy, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def test_omp_and_pool_policies_agree_bitwise() -> None:
    runs = {p: _run(p) for p in ("omp", "pool")}
    for policy, proc in runs.items():
        assert proc.returncode == 0, f"{policy}: {proc.stderr[-2000:]}"
    digests = {p: json.loads(proc.stdout.strip().splitlines()[-1]) for p, proc in runs.items()}
    assert digests["omp"] == digests["pool"]


_POLICY_CHILD = r"""
import sys
if sys.argv[1] == "torch":
    import torch
import numpy as np
import opbridge.ops as ops
from opbridge import loader
from opbridge.ops._library import LIBRARY
ops.add(np.ones(4, np.float32), np.ones(4, np.float32))
print(loader.threading_policy(LIBRARY))
"""


@pytest.mark.parametrize(
    ("env", "imports", "expected"),
    [
        (None, "numpy", "omp"),  # the default: the OpenMP team
        (None, "torch", "omp"),  # torch's OpenMP team
        ("pool", "numpy", "pool"),
        ("pool", "torch", "pool"),
    ],
)
def test_policy_resolution(env: str | None, imports: str, expected: str) -> None:
    child_env = {k: v for k, v in os.environ.items() if k != "OPBRIDGE_THREADING"}
    if env is not None:
        child_env["OPBRIDGE_THREADING"] = env
    proc = subprocess.run([sys.executable, "-c", _POLICY_CHILD, imports], env=child_env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == expected


def test_misspelt_policy_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge import config

    monkeypatch.setenv("OPBRIDGE_THREADING", "openmp")
    with pytest.raises(ValueError, match="OPBRIDGE_THREADING must be one of omp, pool"):
        config.threading()
    monkeypatch.setenv("OPBRIDGE_THREADING", "pool")
    assert config.threading() == "pool"
    monkeypatch.delenv("OPBRIDGE_THREADING")
    assert config.threading() == "omp"


_FORK = r"""
import os, sys
import numpy as np
import opbridge.ops as ops

x = np.ones((1024, 2048), np.float32)  # above the parallel grain: the parent's OpenMP team runs
ops.add(x, x)
pid = os.fork()
if pid == 0:
    y = ops.add(x, x)  # a parallel kernel in the child: GNU OpenMP would wait here for dead threads
    os._exit(0 if float(y[-1, -1]) == 2.0 else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
@pytest.mark.parametrize("policy", ["omp", "pool"])
def test_forked_child_runs_parallel_kernels(policy: str) -> None:
    """A child forked after a parallel kernel (a multiprocessing or DataLoader worker) runs kernels."""
    env = {**os.environ, "OPBRIDGE_THREADING": policy, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0"]
