"""The CUDA kernels fit their registers: no kernel of ``opbridge/csrc/*.cu`` spills to local memory.

(And the gated activations' launch rule, which is host code: checked here too, compiled by nvcc.)

A launch policy that asks for an occupancy (``min_blocks`` in ``include/opbridge/cuda_norm_policy.h``)
caps each thread's registers; whether its kernel then fits them depends on how nvcc holds the
row in registers (``load_units``, ``held_t``), which a small change to a kernel can undo
silently. ptxas reports spills when it compiles (``-Xptxas -v``), so this needs nvcc and no GPU.
Compiled for sm_90, the architecture the policies were tuned on.
"""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _nvcc import NVCC, nvcc_command
from opbridge.build import compile as compile_mod

CSRC = Path(compile_mod.INCLUDE_DIR).parent / "csrc"
SOURCES = sorted(p.name for p in CSRC.glob("*.cu"))

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_SPILL = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")


def spills(ptxas_log: str) -> dict[str, int]:
    """Bytes of spill stores per kernel, from ptxas' verbose log."""
    found: dict[str, int] = {}
    name = None
    for line in ptxas_log.splitlines():
        if (m := _ENTRY.search(line)) is not None:
            name = m["name"]
        elif name is not None and (m := _SPILL.search(line)) is not None:
            found[name] = int(m["stores"]) + int(m["loads"])
            name = None
    return found


def test_spills_reads_ptxas_log() -> None:
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert spills(log) == {"_Z1kv": 20, "_Z1jv": 0}


def _ptxas_log(source: str, flags: tuple[str, ...] = ()) -> str:
    # --cubin: the device code alone, which is what ptxas reports on (a full -c compiles the host side
    # as well, 2.5x the time for rms_norm.cu)
    cmd = [*nvcc_command(CSRC / source, *flags), "--cubin", "-o", os.devnull, "-Xptxas", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_no_cuda_kernel_spills_registers() -> None:
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        logs = dict(zip(SOURCES, pool.map(_ptxas_log, SOURCES)))
    spilling = {}
    for source, log in logs.items():
        kernels = spills(log)
        assert kernels, f"{source}: no kernel in ptxas' log:\n{log[-2000:]}"
        spilling.update({f"{source}: {name}": n for name, n in kernels.items() if n})
    assert not spilling, f"kernels that spill (bytes stored + loaded): {spilling}"


# The staged kernels (cuda_norm_staged.h) are in no csrc/*.cu until a policy ships them; the norm sweep
# times them. These instances are the sweep's, for bfloat16 and float32.
STAGED_TU = """
#include <opbridge/cuda_norm_staged.h>
namespace cu = opbridge::cuda;
template <int MaxThreads>
struct P {
  static constexpr int kMaxThreads = MaxThreads;
  static constexpr bool kFastSum = true, kStream = false;
  static constexpr int min_blocks(int) { return 0; }
};
template <typename T>
void instances(void** k) {
  constexpr int N = cu::kVec<T>;
  k[0] = (void*)cu::rms_rows_staged_kernel<N, 2, P<1024>, T>;
  k[1] = (void*)cu::rms_rows_staged_kernel<N, 3, P<512>, T>;
  k[2] = (void*)cu::rms_rows_staged_kernel<N, 4, P<256>, T>;
  k[3] = (void*)cu::rms_norm_backward_staged_kernel<P<512>, N, 1, 2, T>;
  k[4] = (void*)cu::rms_norm_backward_staged_kernel<P<512>, N, 2, 3, T>;
  k[5] = (void*)cu::rms_norm_backward_staged_kernel<P<1024>, N, 2, 2, T>;
}
void all(void** k) {
  instances<__nv_bfloat16>(k);
  instances<float>(k + 6);
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_staged_kernels_copy_asynchronously_and_do_not_spill(tmp_path: Path) -> None:
    source = tmp_path / "staged.cu"
    source.write_text(STAGED_TU)
    ptx = tmp_path / "staged.ptx"
    done = subprocess.run([*nvcc_command(source), "-ptx", "-o", str(ptx)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    text = ptx.read_text()
    entries = text.count(".entry ")
    assert entries == 12, f"{entries} kernels in the PTX, want 12"
    # every kernel's rows go through shared memory by cp.async, and each waits for its copies
    assert text.count("cp.async.cg.shared.global") >= entries and text.count("cp.async.wait_group") >= 2 * entries
    # ptxas on that PTX (nvcc takes it as input), not a second compile of the source
    done = subprocess.run([*nvcc_command(ptx), "--cubin", "-o", os.devnull, "-Xptxas", "-v"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = spills(done.stderr)
    assert len(kernels) == 12 and not any(kernels.values()), kernels


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_rms_norm_with_its_staged_policies_on_compiles_without_spills() -> None:
    # what OPBRIDGE_CUDA_FLAGS="-DOPB_RMS_NORM_STAGES=3 -DOPB_RMS_NORM_BACKWARD_STAGES=2" builds
    log = _ptxas_log("rms_norm.cu", ("-DOPB_RMS_NORM_STAGES=3", "-DOPB_RMS_NORM_BACKWARD_STAGES=2"))
    kernels = spills(log)
    staged = {name: n for name, n in kernels.items() if "staged_kernel" in name}
    assert len(staged) == 4 + 10, sorted(staged)  # forward per dtype; backward per dtype and units
    assert not any(kernels.values()), {name: n for name, n in kernels.items() if n}


@pytest.fixture(scope="module")
def host_program(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The launch rules' host code (WIDTH_TU's gated widths, COVER_TU's row coverage) in one program, compiled
    by nvcc once: ``host_program widths WAVE ROWS...`` or ``host_program covers``."""
    source = tmp_path_factory.mktemp("host") / "rules.cu"
    source.write_text(WIDTH_TU + COVER_TU + MAIN_TU)
    exe = source.with_suffix("")
    done = subprocess.run([*nvcc_command(source), "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(exe)


MAIN_TU = """
#include <cstring>
int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "widths") == 0) return widths(argc - 2, argv + 2);
  return covers();
}
"""


# The unit width launch_gated uses (include/opbridge/cuda_gated.h's gated_width) for rows of 14336, on a
# device that runs `wave` narrow blocks at once (an H200: 132 SMs x 16 blocks of 128 threads).
WIDTH_TU = """
#include <opbridge/cuda_gated.h>
#include <cstdio>
#include <cstdlib>
int widths(int argc, char** argv) {
  namespace cu = opbridge::cuda;
  const long long wave = std::atoll(argv[0]);
  for (int i = 1; i < argc; ++i) {
    const long long rows = std::atoll(argv[i]);
    std::printf("%lld %d %d %d %d %d\\n", rows,
                cu::gated_width<cu::GatedCurrent, float>(rows, 14336, wave),
                cu::gated_width<cu::GatedCurrent, __nv_bfloat16>(rows, 14336, wave),
                cu::gated_width<cu::GatedBackward, float>(rows, 14336, wave),
                cu::gated_width<cu::GatedBackward, __nv_bfloat16>(rows, 14336, wave),
                cu::gated_width<cu::GatedBackward, double>(rows, 14336, wave));
  }
  return 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_gated_units_narrow_only_while_their_grid_fits_one_wave(host_program: str) -> None:
    """64-bit units where 128-bit ones would leave the device more than half idle (the H200 sweeps: 1.12-1.20x
    for the backward at 1 and 8 rows), 128-bit ones from the rows where the narrow grid passes one wave;
    float32's forward never narrows (the sweeps: up to 1.02x slower at 8 rows)."""
    rows = [1, 8, 18, 19, 37, 38, 75, 76, 256, 4096]
    out = subprocess.run([host_program, "widths", str(132 * 16), *map(str, rows)], capture_output=True, text=True,
                         check=True)
    # rows: forward float32, bfloat16; backward float32, bfloat16, float64 (elements per unit)
    got = {int(r): tuple(map(int, w)) for r, *w in (line.split() for line in out.stdout.splitlines())}
    assert got == {1: (4, 4, 2, 4, 1), 8: (4, 4, 2, 4, 1), 18: (4, 4, 2, 4, 1), 19: (4, 4, 2, 4, 2),
                   37: (4, 4, 2, 4, 2), 38: (4, 4, 4, 4, 2), 75: (4, 4, 4, 4, 2), 76: (4, 8, 4, 8, 2),
                   256: (4, 8, 4, 8, 2), 4096: (4, 8, 4, 8, 2)}
    # a device that runs fewer blocks at once narrows fewer rows: one SM of 16 blocks, none of these
    small = subprocess.run([host_program, "widths", "16", "1"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert small == ["1", "4", "8", "4", "8", "2"]


# Every launch rule of the row kernels that loop over a fixed K units per thread (no grid-stride
# within a row) must give blocks that hold the whole row: threads x units >= the row's units.
COVER_TU = """
#include <opbridge/cuda_norm_staged.h>
#include <cstdio>
namespace cu = opbridge::cuda;
template <int N>
struct FewThreads : cu::RmsNormBackwardRows<N> {  // a staged backward built with 128 threads
  static constexpr int kMaxThreads = 128;
};
template <typename P>
long long uncovered(const char* name) {
  long long bad = 0, fits = 0;
  for (long long hv = 1; hv <= 20000; ++hv) {
    const int units = cu::cached_units<P>(hv);
    if (units == 0) continue;
    ++fits;
    const int threads = cu::row_threads((hv + units - 1) / units, P::kMaxThreads);
    if ((long long)threads * units < hv || units > P::kMaxUnits || threads > P::kMaxThreads) {
      if (bad++ == 0) std::printf("%s: hv %lld units %d threads %d\\n", name, hv, units, threads);
    }
  }
  std::printf("%s %lld %lld\\n", name, fits, bad);
  return bad;
}
int covers() {
  long long bad = 0;
  bad += uncovered<cu::RmsNormRows<8>>("rms16") + uncovered<cu::RmsNormRows<4>>("rms32");
  bad += uncovered<cu::RmsNormManyRows<8>>("many16") + uncovered<cu::RmsNormFewRows<4>>("rmsfew32");
  bad += uncovered<cu::FusedAddRmsNormRows<8>>("fused16") + uncovered<cu::FusedAddRmsNormRows<4>>("fused32");
  bad += uncovered<cu::FusedAddRmsNormFewRows<4>>("fewfused32");
  bad += uncovered<cu::RmsNormBackwardRows<8>>("bwd16") + uncovered<cu::RmsNormBackwardRows<2>>("bwd64");
  bad += uncovered<cu::RmsNormBackwardStaged<8>>("staged16") + uncovered<FewThreads<8>>("few16");
  return bad != 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit)")
def test_row_kernels_blocks_hold_every_unit_of_a_row(host_program: str) -> None:
    out = subprocess.run([host_program, "covers"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    rows = {name: (int(fits), int(bad)) for name, fits, bad in (line.split() for line in out.stdout.splitlines())}
    assert all(fits > 0 for fits, _ in rows.values()), rows  # each rule takes rows it can hold
