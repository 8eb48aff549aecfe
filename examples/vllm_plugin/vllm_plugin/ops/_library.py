"""The plugin's one kernel library: every ``csrc/*.cc`` compiles into ``vllm_plugin._C_ops``.

In a source tree the sources are found next to the package (for JIT builds and
for ``pip install .``); an installed wheel has no sources and loads the
prebuilt ``_C_ops.so`` instead.
"""

from __future__ import annotations

from pathlib import Path

from opbridge import Library

_ROOT = Path(__file__).resolve().parents[2]
_SOURCES = sorted((_ROOT / "csrc").glob("*.cc")) if (_ROOT / "pyproject.toml").is_file() else []

LIBRARY = Library(
    "vllm_plugin",
    sources=_SOURCES,
    prebuilt="vllm_plugin._C_ops",
    python_module="vllm_plugin.ops",
)
