#!/usr/bin/env bash
# A plugin scaffolded with CUDA kernels, built into a wheel's modules and tested (a step of
# scripts/gpu-check.sh): `opbridge new --project gpuplug --cuda` plus two more --cuda ops (two
# outputs and an optional tensor; a mutating op), `pip install` (both modules, _C_ops.so and
# _C_ops_cuda.so), then the project's own tests from the installed copy: on a GPU its generated
# tests compare every CUDA kernel with its CPU twin over the op's test matrix, and the installed
# CUDA module must export every declared CUDA kernel with nothing compiled at run time; then two
# generated benchmarks (on a GPU: the CUDA kernel checked against the CPU one, then timed).
#
#   scripts/gpu-check-plugin.sh [WORKDIR]     # $PYTHON, else .venv/bin/python, else python3
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
case $PY in /*) ;; */*) PY="$PWD/$PY" ;; *) PY=$(command -v "$PY") ;; esac  # absolute: the tests run elsewhere
WORK=${1:-$(mktemp -d)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OPBRIDGE_NO_PROGRESS=1
mkdir -p "$WORK"
"$PY" -m opbridge new --project gpuplug --cuda --out "$WORK" --force > /dev/null
"$PY" -m opbridge new pair_op --schema "pair_op(Tensor x, Tensor y, Tensor? w, float alpha=0.5) -> (Tensor, Tensor)" \
  --dtypes float32,float16,bfloat16 --cuda --out "$WORK/gpuplug" --force > /dev/null
"$PY" -m opbridge new bump_ --schema "bump_(Tensor(a!) x, float by=2.0) -> ()" --cuda --out "$WORK/gpuplug" \
  --force > /dev/null
rm -rf "$WORK/site"
OPBRIDGE_CACHE_DIR="$WORK/build-cache" OPBRIDGE_AOT_DEVICES=cpu,cuda \
  "$PY" -m pip install -q --no-build-isolation --no-deps --no-compile --target "$WORK/site" "$WORK/gpuplug"
ls "$WORK/site/gpuplug/"*.so
# From the installed copy, with an empty cache: nothing may compile.
cd "$WORK/site"
OPBRIDGE_CACHE_DIR="$WORK/run-cache" PYTHONPATH="$WORK/site:$PYTHONPATH" \
  "$PY" -m pytest -q -rs -p no:cacheprovider "$WORK/gpuplug/tests"
# The generated benchmarks: on a GPU they check the CUDA kernel against the CPU one, then time it.
for op in pair_op bump_; do
  OPBRIDGE_CACHE_DIR="$WORK/run-cache" PYTHONPATH="$WORK/site:$PYTHONPATH" \
    "$PY" "$WORK/gpuplug/benchmarks/bench_$op.py" --quick
done
# Nothing of the plugin's own is compiled, nor the JAX handler shim its CPU module carries (opbridge's C
# entries, which only speed calls up, may be built into the cache once per machine, in the background).
compiled() { find "$WORK/run-cache" \( -name '*gpuplug*' -o -name '*opbridge_jax_handler*' \) 2> /dev/null; }
if [ -n "$(compiled)" ]; then echo "gpu-check-plugin: the installed plugin compiled at run time:"; compiled; exit 1; fi
echo "gpu-check-plugin: ok ($WORK)"
