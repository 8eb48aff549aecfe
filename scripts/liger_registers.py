"""Registers, spills and blocks per SM of Liger-Kernel's rms_norm forward, compiled for sm_90 without a GPU.

The peer's side of a launch-policy question (include/opbridge/cuda_norm.h): Triton compiles Liger's
``_rms_norm_forward_kernel`` for a row length with Liger's own launch settings
(``calculate_settings``: the block, a power of two, and the warps), and the ptxas that Triton ships
reports what each program holds; opbridge's kernels' figures come from ``nvcc -Xptxas -v`` (see
tests/test_cuda_registers.py) and from the norm sweep on a GPU. Needs ``triton`` and Liger-Kernel's
source (an installed ``liger_kernel``, or a directory that holds it, such as an unpacked wheel), not
torch or a driver:

    python scripts/liger_registers.py [--liger DIR] [--cols 4096 8192] [--dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

from opbridge._codegen import compile_source  # linecache keeps the source: Triton's @jit reads it back


def _liger_ops(root: str | None) -> Path:
    if root is not None:
        return Path(root) / "liger_kernel" / "ops"
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("liger_registers: liger_kernel not found (pip install liger-kernel, or --liger DIR)")
    return Path(next(iter(spec.submodule_search_locations))) / "ops"


def _kernel_and_settings(ops: Path) -> tuple[object, object]:
    """Liger's forward kernel and calculate_settings, run from their source (the modules import torch)."""
    ns: dict[str, object] = {}
    head = "import triton\nimport triton.language as tl\nfrom triton.language.extra.libdevice import rsqrt\n"
    src = (ops / "rms_norm.py").read_text()
    compile_source(head + src[src.index("_CASTING_MODE_NONE"):src.index("def rms_norm_forward")],
         f"<liger_registers: {ops / 'rms_norm.py'}>", ns)
    utils = (ops / "utils.py").read_text()
    settings = re.search(r"^def calculate_settings\(.*?(?=^\S)", utils, re.S | re.M)
    if settings is None:
        raise SystemExit(f"liger_registers: no calculate_settings in {ops / 'utils.py'}")
    compile_source("import triton\ndef is_hip():\n    return False\n" + settings.group(0),
         f"<liger_registers: {ops / 'utils.py'}>", ns)
    return ns["_rms_norm_forward_kernel"], ns["calculate_settings"]


def report(ops: Path, cols: int, dtype: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, settings = _kernel_and_settings(ops)
    block, warps = settings(cols)  # type: ignore[operator]
    sig = {"Y_ptr": f"*{dtype}", "Y_row_stride": "i32", "X_ptr": f"*{dtype}", "X_row_stride": "i32",
           "W_ptr": f"*{dtype}", "W_row_stride": "i32", "RSTD_ptr": "*fp32", "RSTD_row_stride": "i32",
           "n_cols": "i32", "eps": "fp32", "offset": "fp32", "casting_mode": "constexpr",
           "elementwise_affine": "constexpr", "BLOCK_SIZE": "constexpr"}
    aligned = ("Y_ptr", "Y_row_stride", "X_ptr", "X_row_stride", "W_ptr", "RSTD_ptr", "n_cols")  # as Triton
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}  # specialises them at a call
    const = {"casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": block}
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    spill = re.search(r"(\d+) bytes spill stores", log)
    threads = 32 * warps
    per_sm = min(2048 // threads, 65536 // (threads * -(-regs // 8) * 8), 32)
    return (f"liger rms_norm {dtype:<5} cols {cols:<6} block {block:<6} threads {threads:<5} "
            f"elements/thread {block // threads:<3} regs {regs:<3} spill {spill.group(1) if spill else 0:<4} "
            f"blocks/SM {per_sm}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--liger", help="a directory holding liger_kernel/ (default: the installed one)")
    ap.add_argument("--cols", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("liger_registers: triton is not installed (pip install triton); nothing compiled")
    ops = _liger_ops(args.liger)
    for dtype in args.dtypes:
        for cols in args.cols:
            print(report(ops, cols, dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
