#!/usr/bin/env bash
# Run opbridge's CPU kernels and C entries under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds every module (the op library, NumPy's C entry, Paddle's and MindSpore's tensor entry, JAX's
# handler shim) with OPBRIDGE_CXX_FLAGS="-fsanitize=address,undefined ..." into a cache of its own, then
# runs through them: the conformance suite and the serving ops' tests in NumPy (and torch's tests of the
# serving ops, whose kernels are the same), and a fuzz pass (hypothesis) in NumPy and torch. Any
# out-of-bounds access, use after free or undefined behaviour aborts the run with the sanitizer's
# report, and the script exits non-zero.
#
#   scripts/sanitize.sh                 # everything above (about 15 minutes on 2 cores)
#   scripts/sanitize.sh --quick         # conformance only
#   EXAMPLES=200 scripts/sanitize.sh    # more fuzz examples per check (default 40)
#
# The sanitizer runtime must come first in the process, so python runs with LD_PRELOAD=libasan.so (of
# the compiler that builds the modules). Leak checking is off: CPython and torch keep memory until exit.
# torch's own C++ shim is built by torch's toolchain without these flags (OPBRIDGE_TORCH_NATIVE=0 here),
# so torch calls take opbridge's Python path into the sanitized kernels.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

[ -x .venv/bin/python ] || scripts/envs.sh
cxx=${OPBRIDGE_CXX:-${CXX:-c++}}
asan=$("$cxx" -print-file-name=libasan.so)
if [ ! -e "$asan" ] || [ "$asan" = "libasan.so" ]; then
  echo "sanitize.sh: $cxx has no AddressSanitizer runtime (libasan.so); install it (Debian: libasan8)" >&2
  exit 1
fi

export OPBRIDGE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_SANITIZE_CACHE_DIR:-$PWD/.cache/opbridge-sanitize}
export OPBRIDGE_NO_PROGRESS=1 OPBRIDGE_TORCH_NATIVE=0
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

run() {
  echo "+ $*" >&2
  LD_PRELOAD="$asan" "$@"
}

PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -x)
run env OPBRIDGE_FRAMEWORK=numpy "${PYTEST[@]}" tests/conformance
[ "$quick" = 1 ] && { echo "sanitize.sh: conformance clean under ASan and UBSan"; exit 0; }
run "${PYTEST[@]}" tests/test_serving_ops.py tests/test_numpy_adapter.py tests/test_numpy_native.py
run .venv/bin/python -m opbridge fuzz --frameworks numpy torch --examples "${EXAMPLES:-40}" --random
echo "sanitize.sh: no sanitizer report (ASan, UBSan) in the conformance suite, the serving ops' tests and the fuzz pass"
