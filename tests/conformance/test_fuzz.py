"""Differential fuzzing of every built-in op through the framework's call paths (hypothesis).

The matrix (``test_conformance.py``) runs each op's declared cases in a few
fixed layouts. Here :func:`opbridge.testing.fuzz.fuzz_op` lets hypothesis draw
the case, its values, the dtype and, where the framework has views (NumPy,
torch; Paddle and MindSpore slices), a memory layout per tensor, and checks
every call path against the float64 reference, ``out=`` buffers in those
layouts or overlapping an input, and inconsistent arguments (a named error,
nothing written); see that module for each check.

The examples are derandomized, so CI sees the same ones every run;
``OPBRIDGE_FUZZ_EXAMPLES=N`` runs N random examples per test instead (for a
longer fuzzing session), and ``OPBRIDGE_FUZZ_DEVICE=cuda`` runs torch's on
CUDA tensors (``scripts/gpu-check.sh`` does).
"""

from __future__ import annotations

import os

import pytest

import opbridge
from opbridge import ops
from opbridge.testing.fuzz import CHECKS, fuzz_op
from opbridge.testing.harness import get

FRAMEWORK = os.environ.get("OPBRIDGE_FRAMEWORK", "torch")
DEVICE = os.environ.get("OPBRIDGE_FUZZ_DEVICE", "cpu")
_REASON = get(FRAMEWORK).skip_reason()
if _REASON is None and DEVICE != "cpu":
    import torch

    if FRAMEWORK != "torch":
        _REASON = f"OPBRIDGE_FUZZ_DEVICE={DEVICE} is for torch"
    elif DEVICE == "cuda" and not torch.cuda.is_available():
        _REASON = "OPBRIDGE_FUZZ_DEVICE=cuda, and torch sees no CUDA GPU"
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"{FRAMEWORK}: {_REASON}")

_EXAMPLES = int(os.environ.get("OPBRIDGE_FUZZ_EXAMPLES", "0") or 0)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("op", list(ops.LIBRARY.ops.values()), ids=lambda op: op.name)
def test_fuzzed(op: opbridge.OpDef, check: str) -> None:
    report = fuzz_op(op, FRAMEWORK, examples=_EXAMPLES or 12, checks=[check], device=DEVICE,
                     derandomize=not _EXAMPLES)
    if check in report.skipped:
        pytest.skip(report.skipped[check])
    assert report.examples[check] > 0
