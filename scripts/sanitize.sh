#!/usr/bin/env bash
# Run opbridge's CPU kernels and C entries under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds every module (the op library, NumPy's C entry, Paddle's and MindSpore's tensor entry, JAX's
# handler shim) with OPBRIDGE_CXX_FLAGS="-fsanitize=address,undefined ..." into a cache of its own, then
# runs through them: the conformance suite in NumPy, Paddle and JAX (its XLA handler shim), the serving
# ops' tests (NumPy and torch), Paddle's and MindSpore's tensor entries' tests, and a fuzz pass
# (hypothesis) in NumPy and torch. First a canary, a kernel that writes past its output, must be caught. Any
# out-of-bounds access, use after free or undefined behaviour aborts the run with the sanitizer's
# report, and the script exits non-zero.
#
#   scripts/sanitize.sh                 # everything above (about 4 minutes on 2 cores, once built)
#   scripts/sanitize.sh --quick         # the canary, NumPy's conformance and the C entries' tests (CI)
#   scripts/sanitize.sh --random        # the fuzz pass draws new examples (default: CI's fixed ones)
#   EXAMPLES=200 scripts/sanitize.sh    # more fuzz examples per check (default 40)
# Exit status: 0 clean, 1 a report (or the canary went unnoticed), 2 usage, 77 no sanitizer runtime.
#
# The sanitizer runtime must come first in the process, so python runs with LD_PRELOAD=libasan.so (of
# the compiler that builds the modules), and libstdc++ beside it: python does not link it, and ASan
# cannot intercept C++ throws (every argument error a kernel raises) unless it is there when ASan
# starts. Leak checking is off: CPython and torch keep memory until exit.
# torch's own C++ shim is built by torch's toolchain without these flags (OPBRIDGE_TORCH_NATIVE=0 here),
# so torch calls take opbridge's Python path into the sanitized kernels.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
random=()
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --random) random=(--random) ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

[ -x .venv/bin/python ] || scripts/envs.sh
cxx=${OPBRIDGE_CXX:-${CXX:-c++}}
asan=$("$cxx" -print-file-name=libasan.so 2> /dev/null || true)
stdcxx=$("$cxx" -print-file-name=libstdc++.so 2> /dev/null || true)
if [ -z "$asan" ] || [ ! -e "$asan" ] || [ "$asan" = "libasan.so" ] || [ ! -e "$stdcxx" ]; then
  echo "sanitize.sh: $cxx has no AddressSanitizer runtime (libasan.so); install it (Debian: libasan8)" >&2
  exit 77
fi

export OPBRIDGE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_SANITIZE_CACHE_DIR:-$PWD/.cache/opbridge-sanitize}
# OPBRIDGE_OUTPUT_CACHE_MB=0: large outputs are freed, not kept for reuse, so a use after free is seen.
export OPBRIDGE_NO_PROGRESS=1 OPBRIDGE_TORCH_NATIVE=0 OPBRIDGE_OUTPUT_CACHE_MB=0
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

run() {
  echo "+ $*" >&2
  LD_PRELOAD="$asan $stdcxx" "$@"
}

# The canary: a kernel that writes one element past its output must abort with ASan's report, or the runs
# below would prove nothing.
canary=$(mktemp -d)
trap 'rm -rf "$canary"' EXIT
cat > "$canary/canary.cc" <<'EOF'
#include <opbridge/opbridge.h>
void overrun_cpu(tvm::ffi::TensorView out, tvm::ffi::TensorView x) {
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i <= x.numel(); ++i) o[i] = 1.0f;  // one past the end
}
OPBRIDGE_EXPORT(overrun_cpu);
EOF
cat > "$canary/canary.py" <<'EOF'
import sys
import numpy as np
import opbridge
lib = opbridge.Library("sanitize_canary", sources=["canary.cc"], root=sys.argv[1])
lib.op("overrun(Tensor x) -> Tensor", shape=opbridge.like("x"), dtypes=["float32"])(lambda x: x)
lib.ops["overrun"].call(np.ones(16, np.float32))
print("canary: the overrun went unnoticed")
EOF
if run .venv/bin/python "$canary/canary.py" "$canary" > "$canary/log" 2>&1 || ! grep -q "heap-buffer-overflow" "$canary/log"; then
  tail -20 "$canary/log" >&2
  echo "sanitize.sh: ASan did not catch the canary's write past its output; the runs would prove nothing" >&2
  exit 1
fi
echo "sanitize.sh: ASan caught the canary's write past its output" >&2

PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -x)
run env OPBRIDGE_FRAMEWORK=numpy "${PYTEST[@]}" tests/conformance
run "${PYTEST[@]}" tests/test_numpy_native.py tests/test_exchange_entry.py
[ "$quick" = 1 ] && { echo "sanitize.sh: NumPy's conformance and the C entries' tests clean under ASan and UBSan"; exit 0; }
run "${PYTEST[@]}" tests/test_serving_ops.py tests/test_numpy_adapter.py
run env OPBRIDGE_FRAMEWORK=paddle "${PYTEST[@]}" tests/conformance
run env OPBRIDGE_FRAMEWORK=jax "${PYTEST[@]}" tests/conformance
if [ -x .venv-ms/bin/python ]; then
  run .venv-ms/bin/python -m pytest -q -p no:cacheprovider -x tests/test_method_entry.py
fi
run .venv/bin/python -m opbridge fuzz --frameworks numpy torch --examples "${EXAMPLES:-40}" ${random[@]+"${random[@]}"}
echo "sanitize.sh: no sanitizer report (ASan, UBSan) in any of the runs above"
