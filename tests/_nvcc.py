"""nvcc for the tests that compile opbridge's CUDA headers without running them on a GPU (the kernels'
registers, host programs): one command line for all of them."""

from __future__ import annotations

from pathlib import Path

from opbridge.build import compile as compile_mod

NVCC = compile_mod.nvcc_path()


def nvcc_command(source: Path, *flags: str) -> list[str]:
    """nvcc for sm_90 on *source* with opbridge's and tvm-ffi's headers and *flags* (the output options to add)."""
    from tvm_ffi import libinfo

    includes = [compile_mod.INCLUDE_DIR, libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return [str(NVCC), "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90", *flags,
            *[f"-I{p}" for p in includes], str(source)]
