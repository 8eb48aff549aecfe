"""The framework a conformance run tests (``OPBRIDGE_FRAMEWORK``, default torch), its harness, and the ops.

The test runner starts one process per framework (paddle and mindspore cannot
share a process, and MindSpore needs its own NumPy-1 environment); every
module here skips as a whole where the framework is not installed.
"""

from __future__ import annotations

import os

import pytest

from opbridge import ops
from opbridge.testing.harness import get

FRAMEWORK = os.environ.get("OPBRIDGE_FRAMEWORK", "torch")
H = get(FRAMEWORK)
REASON = H.skip_reason()
#: ``pytestmark = framework_mark`` in a module skips it where the framework is missing.
framework_mark = pytest.mark.skipif(REASON is not None, reason=f"{FRAMEWORK}: {REASON}")

#: The C entry the framework's calls go through first (opbridge.call.c_entry), loaded before any test
#: (built now where the cache lacks it), so every test meets it, not only those after a background build.
C_ENTRIES = {"numpy": "opbridge.adapters.numpy.native", "paddle": "opbridge.call.exchange",
             "mindspore": "opbridge.call.exchange"}
if REASON is None and FRAMEWORK in C_ENTRIES:
    from opbridge.call import c_entry

    c_entry.module_entry(C_ENTRIES[FRAMEWORK]).library(build_now=True)

OPS = list(ops.LIBRARY.ops.values())
GRAD_OPS = [op for op in OPS if op.backward is not None]
