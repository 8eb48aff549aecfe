"""The scripts ``opbridge bench build`` runs, each in a fresh subprocess (:mod:`opbridge.bench.build`).

Each prints one JSON document last: the cold tvm-ffi build of the library's
sources, one-source rebuilds, torch's ``load_inline`` of an equivalent op,
the warm starts on torch and NumPy, and ``import tvm_ffi`` alone.
"""

from __future__ import annotations

from opbridge.bench.subproc import CLOCK, TVM_FFI_WITHOUT_TORCH

TVM_FFI_COLD = CLOCK + """
import json, sys, time
from pathlib import Path
from opbridge.build.compile import INCLUDE_DIR
from opbridge.build.ninja import write_ninja
from opbridge.loader import build_spec
from opbridge.ops import LIBRARY
""" + TVM_FFI_WITHOUT_TORCH + """
build_dir, flags = json.loads(sys.argv[1])
# The same inputs as opbridge's build, including the files it generates (written, untimed).
spec = build_spec(LIBRARY, "cpu")
gen = Path(build_dir) / "generated"
gen.mkdir()
write_ninja(spec, gen, gen / "unused.so")
sources = [str(s) for s in spec.sources] + sorted(str(p) for p in gen.glob("*.cc"))
includes = [str(INCLUDE_DIR), *map(str, spec.include_dirs)]
start, cpu_start = _clock()
path = tvm_ffi.cpp.build("opbridge_bench_tvm_ffi", sources=sources, extra_cflags=[*flags, *spec.cflags],
                         extra_ldflags=["-fopenmp", *spec.ldflags], extra_include_paths=includes,
                         build_directory=build_dir)
wall, cpu = _clock()
seconds, cpu_seconds = wall - start, cpu - cpu_start
assert tvm_ffi.load_module(path)["add_cpu"] is not None
names = [Path(s).name for s in sources]
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "sources": names}))
"""

REBUILD_ONE = CLOCK + """
import dataclasses, json, shutil, sys
from pathlib import Path
from opbridge.build import jit
from opbridge.loader import build_spec
from opbridge.ops import LIBRARY
""" + TVM_FFI_WITHOUT_TORCH + """
work = Path(sys.argv[1])
spec = build_spec(LIBRARY, "cpu")
copies = []
for src in spec.sources:
    copies.append(work / src.name)
    shutil.copyfile(src, copies[-1])
spec = dataclasses.replace(spec, sources=tuple(copies))
jit.build(spec)  # the cold build of the copies, untimed
runs = []
for i, src in enumerate(copies):
    src.write_text(src.read_text() + f"\\n// opbridge bench build: edit {i}\\n")
    start, cpu0 = _clock()
    so = jit.build(spec)
    end, cpu1 = _clock()
    compiled = json.loads((so.parent / "manifest.json").read_text())["compiled"]
    runs.append({"source": src.name, "seconds": end - start, "cpu_seconds": cpu1 - cpu0, "compiled": compiled})
print(json.dumps({"runs": runs}))
"""

TORCH_LOAD_INLINE = CLOCK + """
import json, sys, time
import torch
import torch.utils.cpp_extension as ext
src, build_dir, flags = json.loads(sys.argv[1])
start, cpu_start = _clock()
mod = ext.load_inline("opbridge_bench_torch_add", cpp_sources=[src], functions=["add"],
                      extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=build_dir)
wall, cpu = _clock()
seconds, cpu_seconds = wall - start, cpu - cpu_start
x, y = torch.randn(8), torch.randn(8)
assert torch.equal(mod.add(x, y), x + y)
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds}))
"""


def _warm_start(setup: str, check: str, extra: dict[str, str] | None = None) -> str:
    """A warm start's script: *setup* (imports, the inputs ``x`` and ``y``: untimed), then ``import
    opbridge``, ``from opbridge import ops`` and the first ``ops.add(x, y)``, each timed; *check*, an
    expression of ``z``, must hold. Prints the three times and their total as JSON, with *extra*
    (``{key: Python expression}``) beside them."""
    fields = "".join(f', "{key}": {value}' for key, value in (extra or {}).items())
    return f"""
import json, sys, time
{setup}
t0 = time.perf_counter()
import opbridge
t1 = time.perf_counter()
from opbridge import ops
t2 = time.perf_counter()
z = ops.add(x, y)
t3 = time.perf_counter()
assert {check}
print(json.dumps({{"import_opbridge": t1 - t0, "import_ops": t2 - t1, "first_call": t3 - t2,
                  "total": t3 - t0{fields}}}))
"""


WARM_TORCH = _warm_start("import torch\nx, y = torch.randn(8), torch.randn(8)", "torch.equal(z, x + y)")

WARM_NUMPY = _warm_start(
    "import numpy as np\n"
    "x, y = np.random.rand(8).astype(np.float32), np.random.rand(8).astype(np.float32)\n"
    'torch_before = "torch" in sys.modules',  # before import opbridge: does it import torch?
    "np.array_equal(z, x + y)",
    {"torch_in_sys_modules_before": "torch_before", "torch_in_sys_modules_after": '"torch" in sys.modules'})

IMPORT_TVM_FFI = """
import json, sys, time
t0 = time.perf_counter()
if PRE_IMPORT_TORCH:
    import torch
t1 = time.perf_counter()
import tvm_ffi
t2 = time.perf_counter()
print(json.dumps({"import_torch": t1 - t0, "import_tvm_ffi": t2 - t1,
                  "torch_in_sys_modules": "torch" in sys.modules}))
"""
