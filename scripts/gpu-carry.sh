#!/usr/bin/env bash
# Prepare, on this machine, what a GPU machine without network needs to run scripts/gpu-check.sh and the
# launch-policy sweeps quickly: into DIR (default .whl, an ignored path; carry it to the device machine)
#   DIR/*.whl          apache-tvm-ffi and jax-tvm-ffi at this environment's versions, and liger-kernel (a
#                      bench gpu peer), for the device's Python (CARRY_PYTHON, default 3.12)
#   DIR/obc            the built-in library's CUDA module, built for CARRY_ARCHS (default 90): a cache to
#                      point OPBRIDGE_CACHE_DIR at, found without compiling where the device's nvcc,
#                      tvm-ffi and OPBRIDGE_CUDA_ARCHS match this build's
#   DIR/obc-staged     the same with rms_norm's staged policies on (cuda_norm_staged.h): use it with
#                      OPBRIDGE_CUDA_FLAGS="-DOPB_RMS_NORM_STAGES=3 -DOPB_RMS_NORM_BACKWARD_STAGES=2"
#   DIR/sweep          the sweep binaries (scripts/cuda-sweep.sh), for GPU_CHECK_SWEEPS=DIR/sweep
# About 10 minutes on 2 cores, most of it nvcc; needs PyPI for the wheels.
#
#   scripts/gpu-carry.sh [DIR]
#   CARRY_DRY_RUN=1 scripts/gpu-carry.sh   # print the commands, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
DIR=$(realpath -m --relative-to="$PWD" "${1:-.whl}")  # relative where it is inside the tree, as carried
ABS=$(realpath -m "$DIR")
case "$DIR" in ../* | /*) echo "gpu-carry: note: $ABS is outside the tree; the device tool carries paths inside it" >&2 ;; esac
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
ARCHS=${CARRY_ARCHS:-90}
STAGED_FLAGS="-DOPB_RMS_NORM_STAGES=3 -DOPB_RMS_NORM_BACKWARD_STAGES=2"
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2> /dev/null; }
TVM=$(version apache-tvm-ffi) || { echo "gpu-carry: apache-tvm-ffi is not installed for $PY" >&2; exit 1; }
JTF=$(version jax-tvm-ffi) || JTF=""
run() {  # run COMMAND...: echoed; with CARRY_DRY_RUN=1 only echoed
  echo "+ $*"
  [ "${CARRY_DRY_RUN:-0}" = "1" ] || "$@"
}
WHEELS=("apache-tvm-ffi==$TVM" "liger-kernel")
[ -n "$JTF" ] && WHEELS+=("jax-tvm-ffi==$JTF")
run mkdir -p "$DIR"
run "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${CARRY_PYTHON:-3.12}" \
  --platform manylinux_2_28_x86_64 -d "$DIR" "${WHEELS[@]}"
build() {  # build CACHE [FLAGS]: the CUDA module into CACHE, then only what the device loads is kept
  run env OPBRIDGE_CACHE_DIR="$(realpath -m "$1")" OPBRIDGE_CUDA_ARCHS="$ARCHS" OPBRIDGE_CUDA_FLAGS="${2:-}" \
    OPBRIDGE_NO_PROGRESS=1 "$PY" -m opbridge build --device cuda
  # the CPU C entries and the torch shim are built on the device for its own Python and torch
  run rm -rf "$1"/jit/opbridge_numpy_entry-* "$1"/jit/opbridge_exchange_entry-* "$1/torch-native" "$1/objects"
  # an earlier run's module of other sources: only the one just built or reused is carried (the newest
  # manifest: a reuse touches it)
  [ "${CARRY_DRY_RUN:-0}" = "1" ] ||
    ls -t "$1"/jit/opbridge_cuda-cuda-*/manifest.json | tail -n +2 | xargs -r -n 1 dirname | xargs -r rm -rf
}
build "$DIR/obc"
build "$DIR/obc-staged" "$STAGED_FLAGS"
run env OPBRIDGE_CUDA_ARCHS="$ARCHS" PYTHON="$PY" SWEEP_BUILD_ONLY="$ABS/sweep" scripts/cuda-sweep.sh all
[ "${CARRY_DRY_RUN:-0}" = "1" ] || du -sh "$DIR"
cat << EOF
gpu-carry: done. On the device machine (carry $DIR), for example:
  OPBRIDGE_CACHE_DIR=\$PWD/$DIR/obc OPBRIDGE_CUDA_ARCHS=$ARCHS GPU_CHECK_WHEELS=$DIR GPU_CHECK_SWEEPS=$DIR/sweep \\
    scripts/gpu-check.sh
  OPBRIDGE_CACHE_DIR=\$PWD/$DIR/obc-staged OPBRIDGE_CUDA_ARCHS=$ARCHS OPBRIDGE_CUDA_FLAGS="$STAGED_FLAGS" \\
    GPU_CHECK_WHEELS=$DIR GPU_CHECK_ONLY="cuda_tests bench_gpu" scripts/gpu-check.sh
On a machine lent for one call of some minutes, the tests and benchmarks in it, packed into one file:
  OPBRIDGE_CACHE_DIR=\$PWD/$DIR/obc OPBRIDGE_CUDA_ARCHS=$ARCHS GPU_CHECK_WHEELS=$DIR GPU_CHECK_BUDGET=540 \\
    GPU_CHECK_OUT=/tmp/gpu-check GPU_CHECK_ARCHIVE=/tmp/gpu-check.tgz scripts/gpu-check.sh
EOF
