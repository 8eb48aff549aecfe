#!/usr/bin/env bash
# The one-command GPU check (issue 12): on a machine with a CUDA GPU, run the CUDA tests, the
# torch- and JAX-on-GPU tests, a plugin scaffolded with --cuda (scripts/gpu-check-plugin.sh),
# `opbridge bench jax-gpu --quick`, `opbridge bench gpu --quick` and the
# CUDA launch-cost benchmark, and write one JSON summary (results/gpu-check/summary.json, or
# $GPU_CHECK_OUT/summary.json), beside gpu.txt (the GPU) and toolchain.txt (the host compiler, its libstdc++ and nvcc).
# Without a GPU it says so and exits 0. Not one of the README's two commands: CI has no GPU.
#
#   scripts/gpu-check.sh            # uses $PYTHON, else .venv/bin/python, else python3
#   GPU_CHECK_QUICK=0 scripts/gpu-check.sh   # the full bench gpu run instead of --quick
#   GPU_CHECK_WHEELS=DIR scripts/gpu-check.sh  # first install DIR/*.whl (no index, no deps) into a
#                                  # temporary directory on PYTHONPATH: tvm-ffi, jax-tvm-ffi or
#                                  # liger-kernel on a machine without network
#   GPU_CHECK_KERNELS=1 scripts/gpu-check.sh   # the kernel tables against every peer instead of
#                                  # bench gpu --quick: the norms and the gated ops (forward and
#                                  # backward) at 1, 8, 256, 4096 rows, every op at 8192 x 8192
#                                  # (about 4 more minutes on an H200, timed before the gated
#                                  # backward ops joined)
#   GPU_CHECK_SWEEPS=1 scripts/gpu-check.sh    # also the launch-policy sweeps (scripts/cuda-sweep.sh,
#                                  # built here with nvcc), or =DIR: the binaries already built into
#                                  # DIR (SWEEP_BUILD_ONLY=DIR scripts/cuda-sweep.sh); per case, the
#                                  # current and the fastest policy go into the summary (the norm
#                                  # sweep's staged kernels as a step of their own, sweep_norm_staged)
#   GPU_CHECK_ONLY="cuda_tests bench_gpu_serving" scripts/gpu-check.sh  # only the steps named (as in
#                                  # steps.txt; a step's crash reruns come with it), adding to the
#                                  # summary already in the output folder: one check split over the
#                                  # calls of a machine lent for a few minutes at a time
#   GPU_CHECK_STEP_LIMIT=SECONDS scripts/gpu-check.sh  # each step under `timeout` (exit status 124)
#   GPU_CHECK_BUDGET=SECONDS scripts/gpu-check.sh  # the whole check's time: each step gets at most what is
#                                  # left (less 20 s for the summary), the steps it leaves no 20 s are
#                                  # not run (steps.txt: "NAME skipped 0"): one call of a lent machine
#   GPU_CHECK_ARCHIVE=FILE scripts/gpu-check.sh  # at the end, the output folder packed into FILE (.tar.gz):
#                                  # for a machine that hands back a few files
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_CHECK_START=$SECONDS
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${GPU_CHECK_OUT:-results/gpu-check}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_CACHE_DIR:-$PWD/.cache/opbridge} OPBRIDGE_NO_PROGRESS=${OPBRIDGE_NO_PROGRESS:-1}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$GPU_CHECK_WHEELS"/*.whl \
    || { echo "gpu-check: installing the wheels in $GPU_CHECK_WHEELS failed"; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
echo "gpu-check: $(cat "$OUT/gpu.txt"); writing $OUT"
# The toolchain the device builds opbridge's host code with (the torch shim, the C entries): a crash in a copy of
# libstdc++'s code is read against these.
CXX_USED=${OPBRIDGE_CXX:-${CXX:-c++}}
{
  echo "c++ ($CXX_USED): $("$CXX_USED" --version 2>&1 | head -1)"
  echo "its libstdc++.so: $("$CXX_USED" -print-file-name=libstdc++.so 2>&1)"
  LOADED='import ctypes, re; ctypes.CDLL("libstdc++.so.6")
print(*sorted(set(re.findall(r"\S*libstdc\+\+\S*", open("/proc/self/maps").read()))))'
  echo "libstdc++ loaded by $PY: $("$PY" -c "$LOADED" 2>&1)"
  echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
} > "$OUT/toolchain.txt" 2>&1 || true

# wanted, step (GPU_CHECK_ONLY, GPU_CHECK_STEP_LIMIT, GPU_CHECK_BUDGET)
source scripts/gpu_check_steps.sh
[ -n "${GPU_CHECK_ONLY:-}" ] && touch "$OUT/steps.txt" || : > "$OUT/steps.txt"
# -v and unbuffered output: each test's name reaches the log as it starts, so a crash (a native fault
# kills the process before pytest reports) still names the test it happened in. --capture=sys, not
# pytest's default fd capture: file descriptor 2 stays the log, so the traceback that faulthandler
# writes there on a fault (SIGSEGV, SIGABRT) reaches it; with fd capture it stayed in the capture
# file and was lost with the process (the torch- and JAX-GPU steps' one SIGSEGV on an H200, 2026-11-26,
# left no traceback).
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# -p no:benchmark: pytest-benchmark (on the device machine's image) warns at start-up under xdist, and our
# filterwarnings = error made that an INTERNALERROR of every GPU test step (H200, 2026-11-27).
PYTEST=("$PY" -m pytest -v --capture=sys -p no:cacheprovider -p no:benchmark -o addopts=""
        -W ignore::pytest.PytestUnraisableExceptionWarning)
# The GPU test steps run their tests in one pytest-xdist worker (a process of its own, not a fork: CUDA
# survives) that xdist replaces when a native fault kills it: the fault fails that test only, named in
# the log and the junit XML ("worker 'gw0' crashed while running '<test>'", the summary's "crashed"),
# the worker's faulthandler traceback reaches the log, and the step's other tests still run. In the
# H200 runs of 2026-11-26 a SIGSEGV in the 3rd of 11 torch-GPU tests ended that step with 8 never run.
# Without pytest-xdist, one process as before.
ISOLATE=()
"$PY" -c "import xdist" 2> /dev/null && ISOLATE=(-n 1 --max-worker-restart 100)
# After a native crash (exit 134 or 139) of a test step: the same tests again with torch's native
# kernels off (OPBRIDGE_TORCH_NATIVE=0), then under cuda-gdb (gdb itself is not on the device
# machine) for a native backtrace of every thread, as steps NAME_no_native and NAME_gdb. The torch-
# and JAX-GPU steps died by SIGSEGV in two H200 runs (2026-11-26), at the same tests, with no
# faulthandler traceback in the log; reruns on a cache without the torch shim passed.
crash_diag() {  # crash_diag NAME COMMAND...: after a native crash, in one process or in an xdist worker
  local name=$1; shift
  case "$(awk -v n="$name" '$1 == n {print $2}' "$OUT/steps.txt" | tail -1)" in
    134|139) ;;
    skipped | "") return 0 ;;  # not run (GPU_CHECK_BUDGET, GPU_CHECK_ONLY)
    *) grep -q "crashed while running" "$OUT/$name.log" 2> /dev/null || return 0 ;;
  esac
  step "${name}_no_native" env OPBRIDGE_TORCH_NATIVE=0 "$@" "${ISOLATE[@]}"
  if command -v cuda-gdb > /dev/null; then  # in one process, without ISOLATE's worker
    step "${name}_gdb" timeout 300 cuda-gdb -q -batch -ex run -ex "info threads" -ex "thread apply all bt 30" \
      --args "$@"
  fi
}
# The test commands without ISOLATE, which each step adds.
# With the native shim's symbol tests: they check, under the device's own compiler, what exports.map fixed
# (the shim lent its C++ runtime to libtvm_ffi: SIGSEGVs of every tvm-ffi error on an H200, 2026-11-28).
TORCH_GPU=("${PYTEST[@]}" tests/test_torch_adapter.py tests/test_torch_native_symbols.py
  -k "cuda or gpu or native_symbols")
JAX_GPU=(env JAX_ENABLE_X64=1 "${PYTEST[@]}" tests/test_jax_adapter.py -k "gpu or cuda")
# Less the sweeps' build test: nvcc, no GPU, a minute on the device; CI runs it.
step cuda_tests "${PYTEST[@]}" "${ISOLATE[@]}" tests/test_cuda.py -k "not sweeps_build" --junitxml="$OUT/cuda_tests.xml"
step torch_gpu_tests "${TORCH_GPU[@]}" "${ISOLATE[@]}" --junitxml="$OUT/torch_gpu_tests.xml"
crash_diag torch_gpu_tests "${TORCH_GPU[@]}"
step jax_gpu_tests "${JAX_GPU[@]}" "${ISOLATE[@]}" --junitxml="$OUT/jax_gpu_tests.xml"
crash_diag jax_gpu_tests "${JAX_GPU[@]}"
# Every built-in op fuzzed on CUDA tensors: drawn dtypes, values, strided layouts, out= buffers (strided or
# sharing memory with an input) and inconsistent arguments, through ops.<op> and torch.ops (issue 12 item 7).
step torch_gpu_fuzz env OPBRIDGE_FRAMEWORK=torch OPBRIDGE_FUZZ_DEVICE=cuda "${PYTEST[@]}" "${ISOLATE[@]}" \
  tests/conformance/test_fuzz.py --junitxml="$OUT/torch_gpu_fuzz.xml"
# A plugin scaffolded with --cuda: its wheel's CUDA module, and its generated CUDA-against-CPU tests.
step plugin_cuda env PYTHON="$PY" scripts/gpu-check-plugin.sh "$(mktemp -d)"
QUICK=$([ "${GPU_CHECK_QUICK:-1}" = "1" ] && echo --quick)
# JAX on the GPU against jnp per call and XLA's fusion at 4096 x 4096 (issue 12 item 3); skips without a JAX GPU.
step bench_jax_gpu "$PY" -m opbridge bench jax-gpu $QUICK --out "$OUT/bench-jax-gpu"
# With GPU_CHECK_KERNELS=1 the kernel tables below cover every case of bench gpu --quick and more.
[ "${GPU_CHECK_KERNELS:-0}" = "1" ] || step bench_gpu "$PY" -m opbridge bench gpu $QUICK --out "$OUT/bench-gpu"
step bench_overhead_cuda "$PY" -m opbridge bench overhead --device cuda --json $QUICK
if [ "${GPU_CHECK_KERNELS:-0}" = "1" ]; then
  step bench_gpu_serving "$PY" -m opbridge bench gpu --ops rms_norm fused_add_rms_norm rms_norm_backward \
    silu_and_mul gelu_and_mul silu_and_mul_backward gelu_and_mul_backward --rows 1 8 256 4096 --no-large \
    --rounds 5 --out "$OUT/bench-gpu-serving"
  step bench_gpu_large "$PY" -m opbridge bench gpu --rows --rounds 5 --out "$OUT/bench-gpu-large"
fi
SWEEPS=""
case "${GPU_CHECK_SWEEPS:-0}" in
  0) ;;
  1) SWEEPS=$(mktemp -d); step sweep_build env PYTHON="$PY" SWEEP_BUILD_ONLY="$SWEEPS" scripts/cuda-sweep.sh all ;;
  *) SWEEPS=$GPU_CHECK_SWEEPS ;;
esac
if [ -n "$SWEEPS" ]; then
  step sweep_norm "$SWEEPS/cuda_norm_sweep" cached
  # The staged kernels in a process of their own: a fault in an untried kernel ends only this step.
  step sweep_norm_staged "$SWEEPS/cuda_norm_sweep" staged
  step sweep_gated "$SWEEPS/cuda_gated_sweep"
fi
"$PY" scripts/gpu_check_summary.py "$OUT"
status=$?
if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
  tar czf "$GPU_CHECK_ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "gpu-check: packed into $GPU_CHECK_ARCHIVE"
fi
exit $status
