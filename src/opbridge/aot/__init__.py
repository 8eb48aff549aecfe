"""Ahead-of-time builds: a plugin's kernels compiled into one ``_C_ops`` module for its wheel.

:func:`build_aot` is what ``opbridge build --aot`` and ``pip install .`` (through
:mod:`opbridge.aot.setuptools`) run. Importing this package compiles nothing
and imports neither setuptools nor any framework.
"""

from opbridge.aot.build import (
    DEFAULT_MODULE,
    build_aot,
    build_info,
    check_exports,
    declared_kernels,
    is_current,
    module_filename,
    module_name,
)

__all__ = [
    "DEFAULT_MODULE",
    "build_aot",
    "build_info",
    "check_exports",
    "declared_kernels",
    "is_current",
    "module_filename",
    "module_name",
]
