#!/usr/bin/env bash
# Launch-policy sweep of the CUDA row-cached RMS kernels (scripts/cuda_norm_sweep.cu): rms_norm and
# fused_add_rms_norm at 1, 8, 256, 4096 rows of 4096 and at 8192 x 8192, float32 and bfloat16, under
# every units-per-thread / launch-bound / block-sum policy, against the current one. A tuning aid for
# include/opbridge/cuda_norm.h's policies; needs nvcc and a CUDA GPU (not yet run on one).
#
#   scripts/cuda-norm-sweep.sh               # builds for OPBRIDGE_CUDA_ARCHS (default: this GPU's)
#   PYTHON=python3 scripts/cuda-norm-sweep.sh   # the Python whose tvm-ffi gives the headers
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
command -v nvcc > /dev/null || { echo "cuda-norm-sweep: nvcc not found (install the CUDA toolkit)"; exit 1; }
TVM_INC=$("$PY" -c "from tvm_ffi import libinfo; print(libinfo.find_include_path())")
DLPACK_INC=$("$PY" -c "from tvm_ffi import libinfo; print(libinfo.find_dlpack_include_path())")
ARCHS=${OPBRIDGE_CUDA_ARCHS:-native}
GENCODE=()
if [ "$ARCHS" = native ]; then GENCODE=(-arch=native); else
  for a in ${ARCHS//,/ }; do GENCODE+=(-gencode "arch=compute_$a,code=sm_$a"); done
fi
BIN=$(mktemp -d)/cuda_norm_sweep
nvcc -std=c++17 -O3 --expt-relaxed-constexpr "${GENCODE[@]}" -Isrc/opbridge/include -I"$TVM_INC" -I"$DLPACK_INC" \
  -cudart static -o "$BIN" scripts/cuda_norm_sweep.cu
"$BIN"
