"""The vllm_plugin ops, declared once each.

Every module in this folder declares its ops into :data:`LIBRARY`, and every
``*.yaml`` here is an op manifest loaded into it: as with the vLLM-MindSpore
plugin's ``VLLM_MS_EXTENSION_MODULE``, adding an op needs no registration
list, only its kernel in ``csrc/`` and its declaration here. The declarations
are the one list that the build, the wrappers and the tests read.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from opbridge import manifest

from vllm_plugin.ops._library import LIBRARY

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
for _manifest in sorted(Path(__file__).parent.glob("*.yaml")):
    manifest.load(_manifest, LIBRARY)

__all__ = ["LIBRARY"]
