#!/usr/bin/env bash
# Launch-policy sweeps of opbridge's CUDA kernels, each against the policy the ops ship; tuning aids
# for the policies in include/opbridge/, needing nvcc and a CUDA GPU:
#   norm   rms_norm and fused_add_rms_norm (cuda_norm.h), rms_norm's backward (cuda_norm_backward.h):
#          1, 8, 64, 256, 1024, 4096 rows of 4096 and 8192 x 8192, every units-per-thread / launch-bound /
#          block-sum / occupancy policy (scripts/cuda_norm_sweep.cu)
#   gated  silu_and_mul, gelu_and_mul and silu_and_mul_backward (cuda_gated.h): 1, 8, 256, 4096 rows
#          of 14336 and 8192 x 8192, 32-512 threads x 1-8 units of 128 bits (and of 64 bits to 256 rows)
#
#   scripts/cuda-sweep.sh [norm|gated|all]      # default all; builds for OPBRIDGE_CUDA_ARCHS (default: this GPU's)
#   PYTHON=python3 scripts/cuda-sweep.sh gated  # the Python whose tvm-ffi gives the headers
#   SWEEP_BUILD_ONLY=DIR scripts/cuda-sweep.sh  # build the binaries into DIR and stop (no GPU needed)
#   SWEEP_CHECK=1 SWEEP_BUILD_ONLY=DIR ...      # only check that they compile: unoptimised, PTX alone (2x faster;
#                                               #   binaries that are not for timing)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-all}" in
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  norm|gated) SWEEPS=("$1") ;;
  all) SWEEPS=(norm gated) ;;
  *) echo "cuda-sweep: unknown sweep '$1' (norm, gated or all; --help)" >&2; exit 2 ;;
esac
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
command -v nvcc > /dev/null || { echo "cuda-sweep: nvcc not found (install the CUDA toolkit)" >&2; exit 1; }
TVM_INC=$("$PY" -c "from tvm_ffi import libinfo; print(libinfo.find_include_path())")
DLPACK_INC=$("$PY" -c "from tvm_ffi import libinfo; print(libinfo.find_dlpack_include_path())")
ARCHS=${OPBRIDGE_CUDA_ARCHS:-native}
OPT=(-O3) CODE=sm  # machine code per architecture, optimised
if [ "${SWEEP_CHECK:-0}" = 1 ]; then
  [ -n "${SWEEP_BUILD_ONLY:-}" ] || { echo "cuda-sweep: SWEEP_CHECK=1 builds binaries not for timing: set SWEEP_BUILD_ONLY=DIR too" >&2; exit 2; }
  OPT=(-O0 -Xcicc -O0) CODE=compute  # PTX alone, unoptimised: ptxas never runs
fi
GENCODE=()
if [ "$ARCHS" = native ]; then GENCODE=(-arch=native); else
  for a in ${ARCHS//,/ }; do GENCODE+=(-gencode "arch=compute_$a,code=${CODE}_$a"); done
fi
DIR=${SWEEP_BUILD_ONLY:-$(mktemp -d)}
mkdir -p "$DIR"
for s in "${SWEEPS[@]}"; do
  nvcc -std=c++17 "${OPT[@]}" --expt-relaxed-constexpr "${GENCODE[@]}" -Isrc/opbridge/include -I"$TVM_INC" -I"$DLPACK_INC" \
    -cudart static -o "$DIR/cuda_${s}_sweep" "scripts/cuda_${s}_sweep.cu"
done
if [ -n "${SWEEP_BUILD_ONLY:-}" ]; then for s in "${SWEEPS[@]}"; do echo "built $DIR/cuda_${s}_sweep"; done; exit 0; fi
for s in "${SWEEPS[@]}"; do "$DIR/cuda_${s}_sweep"; done
