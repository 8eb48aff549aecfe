#!/usr/bin/env bash
# Run the whole test suite: set up both environments, then run each framework's
# tests in its own process (importing paddle before mindspore in one process
# fails with a oneDNN symbol clash; MindSpore needs the NumPy-1 environment).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/envs.sh
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_CACHE_DIR:-$PWD/.cache/opbridge}
export OPBRIDGE_NO_PROGRESS=${OPBRIDGE_NO_PROGRESS:-1}
# A crash in native code prints every thread's Python stack from interpreter start, not only while
# pytest's faulthandler plugin is active (one Paddle run of 27f1010's suite died with SIGSEGV and
# no stack; 22 reruns did not reproduce it).
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
# MindSpore writes compile-failure dumps (rank_0/...) into the working directory otherwise.
export MS_OM_PATH=${MS_OM_PATH:-$PWD/.cache/mindspore-om}
status=0
run() { echo "== $*"; "$@" || status=1; }

# The pipeline's arrows point down and adapters never import each other (pyproject's [tool.importlinter]).
run .venv/bin/lint-imports --no-cache
# Core, build, CLI, torch and numpy (everything that is not another framework's): in two pytest-xdist workers, a
# test file to each at a time, where xdist is installed (a dev dependency). On this 2-core machine, warm cache,
# 1196 s in one process and 728 s in two (2026-11-28); most of it is compiles, which one process left half idle.
# -p no:benchmark: pytest-benchmark, where installed, warns under xdist at start-up, which filterwarnings makes an error.
XDIST=()
.venv/bin/python -c "import xdist" 2> /dev/null && XDIST=(-n 2 --dist loadfile -p no:benchmark)
run .venv/bin/python -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests \
  --ignore=tests/test_jax_adapter.py --ignore=tests/test_paddle_adapter.py --ignore=tests/test_exchange_entry.py \
  --ignore=tests/test_mindspore_adapter.py --ignore=tests/test_mindspore_vmap.py --ignore=tests/test_method_entry.py \
  --ignore=tests/conformance
# Then two lanes at once, each one process at a time (a framework's tests use about one core): the .venv
# frameworks here, MindSpore's and the sanitizers' in the background into a log printed after. CI of b1b1f61 ran
# them one after the other, 304 s and 305 s of its 1993 s.
lane_b() {
  status=0
  if [ "${OPBRIDGE_SKIP_MINDSPORE:-0}" != "1" ]; then
    run env OPBRIDGE_FRAMEWORK=mindspore .venv-ms/bin/python -m pytest -q -p no:cacheprovider tests/conformance
    [ -f tests/test_mindspore_adapter.py ] && run .venv-ms/bin/python -m pytest -q -p no:cacheprovider tests/test_mindspore_adapter.py \
      tests/test_mindspore_vmap.py tests/test_method_entry.py
    # MindSpore's generated Python path, which the tensor entry (call/exchange.py) otherwise takes most calls from.
    [ -f tests/test_mindspore_adapter.py ] && run env OPBRIDGE_EXCHANGE_ENTRY=0 .venv-ms/bin/python -m pytest -q \
      -p no:cacheprovider tests/test_mindspore_adapter.py
  fi
  # The C++ (kernels, C entries) under ASan and UBSan, a canary first, where the compiler has the runtime.
  sanitize=0
  scripts/sanitize.sh --quick || sanitize=$?
  case $sanitize in
    0) ;;
    77) echo "== sanitizer runs skipped: no AddressSanitizer runtime for this compiler" ;;
    *) status=1 ;;
  esac
  return $status
}
LANE_B_LOG=$(mktemp)
lane_b > "$LANE_B_LOG" 2>&1 &
lane_b_pid=$!
trap 'trap - INT TERM; kill 0' INT TERM  # an interrupt stops both lanes
for fw in numpy torch paddle; do
  run env OPBRIDGE_FRAMEWORK=$fw .venv/bin/python -m pytest -q -p no:cacheprovider tests/conformance
done
# JAX twice: as users first meet it (no 64-bit types: int64 arrays narrow to int32, so the int64 cases of rotary's
# positions and advance_step's ids are left out, their int32 ones run), and with JAX_ENABLE_X64=1 (float64, int64).
run env OPBRIDGE_FRAMEWORK=jax .venv/bin/python -m pytest -q -p no:cacheprovider tests/conformance
run env OPBRIDGE_FRAMEWORK=jax JAX_ENABLE_X64=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/conformance
[ -f tests/test_jax_adapter.py ] && run .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_jax_adapter.py
[ -f tests/test_paddle_adapter.py ] && run .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_paddle_adapter.py \
  tests/test_exchange_entry.py
# Paddle's Python fast path, which its C entry (call/exchange.py) otherwise takes nearly every call from.
[ -f tests/test_paddle_adapter.py ] && run env OPBRIDGE_EXCHANGE_ENTRY=0 .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_paddle_adapter.py
wait $lane_b_pid || status=1
echo "== MindSpore and the sanitizers (run beside the above):"
cat "$LANE_B_LOG"
rm -f "$LANE_B_LOG"
# The example plugin: its wheel built in a fresh venv, installed, tested in torch and MindSpore.
if [ "${OPBRIDGE_SKIP_WHEEL:-0}" != "1" ]; then
  run env OPBRIDGE_MINDSPORE_PYTHON="$PWD/.venv-ms/bin/python" bash examples/vllm_plugin/ci_wheel.sh
fi
exit $status
