#!/usr/bin/env bash
# Build the example plugin's wheel in a fresh virtual environment, install it and
# run its tests in PyTorch and (in a separate process, from a MindSpore
# environment) in MindSpore, printing the wall time of each step.
#
#   bash examples/vllm_plugin/ci_wheel.sh
#
# Environment (all optional):
#   PYTHON                      base interpreter for the fresh venv (default: python3)
#   OPBRIDGE_CI_WORK            work directory (default: a new temporary one, removed at the end)
#   OPBRIDGE_CI_KEEP=1          keep the work directory
#   OPBRIDGE_CI_TORCH           torch requirement (default: torch==2.13.0; pip's configured
#                               find-links hold the CPU wheel, so nothing large is downloaded)
#   OPBRIDGE_CI_PIP_ARGS        extra arguments for every pip install (e.g. --find-links DIR)
#   OPBRIDGE_MINDSPORE_PYTHON   Python of an environment with MindSpore (default: the repository's .venv-ms);
#                               the MindSpore tests are skipped, with a message, when it is missing
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_REQ="${OPBRIDGE_CI_TORCH:-torch==2.13.0}"
MS_PY="${OPBRIDGE_MINDSPORE_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-ms/bin/python}"
read -r -a PIP_ARGS <<< "${OPBRIDGE_CI_PIP_ARGS:-}"
WORK="${OPBRIDGE_CI_WORK:-$(mktemp -d -t opbridge-ci-wheel.XXXXXX)}"
mkdir -p "$WORK"
if [[ -z "${OPBRIDGE_CI_KEEP:-}" && -z "${OPBRIDGE_CI_WORK:-}" ]]; then
  trap 'rm -rf "$WORK"' EXIT
fi
export OPBRIDGE_CACHE_DIR="$WORK/cache" OPBRIDGE_NO_PROGRESS=1 PIP_DISABLE_PIP_VERSION_CHECK=1

now() { date +%s.%N; }
quiet() {  # quiet LOG COMMAND...: run it with its output in LOG, shown (the end of it) only on failure
  local log="$1"; shift
  "$@" > "$log" 2>&1 || { tail -40 "$log"; return 1; }
}
TIMES=()
step() {  # step LABEL COMMAND...: run it, record its wall time
  local label="$1"; shift
  echo "==> $label"
  local t0; t0="$(now)"
  "$@"
  local dt; dt="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
  TIMES+=("$(printf '%-44s %7s s' "$label" "$dt")")
  echo "    $label: ${dt}s"
}

V="$WORK/venv"
step "create venv" "$PY" -m venv "$V"
# The tools and frameworks by opbridge's pip-install.sh (uv where the checkout's .venv has it: 53 s by pip in CI);
# opbridge and the wheel below by pip, as users install them.
step "install build tools, numpy, $TORCH_REQ" quiet "$WORK/deps.log" \
  "$REPO/scripts/pip-install.sh" "$V" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "setuptools>=70.1" wheel build pytest numpy \
  ninja pyyaml "apache-tvm-ffi>=0.1.15,<0.2" "$TORCH_REQ"
step "install opbridge from $REPO" quiet "$WORK/opbridge.log" \
  "$V/bin/pip" install -q --no-build-isolation --no-deps ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "$REPO"

# Build from a copy, so that build/ and *.egg-info stay out of the source tree.
rm -rf "$WORK/src" "$WORK/dist" "$WORK/tests"
mkdir -p "$WORK/src"
(cd "$HERE" && tar --exclude=build --exclude=dist --exclude='*.so' --exclude=__pycache__ \
  --exclude='*.egg-info' --exclude=rank_0 -cf - .) | tar -xf - -C "$WORK/src"
step "build the wheel (python -m build)" quiet "$WORK/build.log" \
  "$V/bin/python" -m build --wheel --no-isolation -o "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/*.whl)"
echo "    wheel: $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"
step "install the wheel" "$V/bin/pip" install -q --no-deps "$WHEEL"

# The tests run from a copy outside the source tree, so they import the installed plugin.
cp -r "$HERE/tests" "$WORK/tests"
rm -rf "$WORK/tests/__pycache__"
step "tests in torch" bash -c "cd '$WORK' && '$V/bin/python' -m pytest -q -p no:cacheprovider tests"

step "import + first call, fresh process" bash -c "cd '$WORK' && '$V/bin/python' -c '
import time, torch
t0 = time.perf_counter()
from vllm_plugin import _custom_ops as ops
ops.silu_and_mul(torch.ones(2, 8))
print(f\"    import + first call after import torch: {(time.perf_counter() - t0) * 1e3:.0f} ms\")
'"

if [[ -x "$MS_PY" ]] && "$MS_PY" -c "import mindspore" > /dev/null 2>&1; then
  # The MindSpore environment gets this checkout's opbridge and the wheel in a private
  # directory put first on its path; its own packages are left as they are.
  step "install opbridge + wheel for MindSpore" quiet "$WORK/ms_install.log" \
    "$MS_PY" -m pip install -q --no-deps --no-build-isolation ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} \
    --target "$WORK/ms_site" "$REPO" "$WHEEL"
  step "tests in MindSpore (separate process)" bash -c \
    "cd '$WORK' && PYTHONPATH='$WORK/ms_site' '$MS_PY' -m pytest -q -p no:cacheprovider tests/test_ops_mindspore.py"
else
  echo "==> tests in MindSpore: skipped ($MS_PY is not a Python with MindSpore; set OPBRIDGE_MINDSPORE_PYTHON)"
fi

echo
echo "wall times:"
printf '  %s\n' "${TIMES[@]}"
echo "  wheel: $(basename "$WHEEL"), $(du -k "$WHEEL" | cut -f1) KiB"
