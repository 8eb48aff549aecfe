#!/usr/bin/env bash
# Create (or update) the two environments opbridge is developed and tested in:
#   .venv     torch 2.13 (CPU), JAX + jax-tvm-ffi, PaddlePaddle, NumPy 2
#   .venv-ms  MindSpore 2.10 with NumPy < 2 (its autograd crashes under NumPy 2,
#             while JAX and jax-tvm-ffi need NumPy 2, so they cannot share one env)
# Both install opbridge in editable mode. Re-running is cheap: what is there is skipped.
# The packages go in by uv, which pip puts into .venv first, resolving as pip would (scripts/pip-install.sh;
# .venv in 30 s against pip's 104 s); OPBRIDGE_NO_UV=1, or no uv to be had, installs them by pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
install_into() { scripts/pip-install.sh "$@" || true; }  # what is missing, the import checks below report

# Free space first: the two environments take about 6.5 GB and pip unpacks wheels in TMPDIR as it goes.
# A full disk otherwise shows up only as pip's OSError in the middle of its output, then "No module named
# 'jax'" (a CI run of 2026-11-27 died so after 63 s). Only for an environment still to be created.
need_gb() {  # need_gb GB DIR WHAT: exit with a clear message if DIR's file system has less than GB free
  local free_kb
  free_kb=$(df -Pk "$2" 2> /dev/null | awk 'NR == 2 {print $4}')
  [ -z "$free_kb" ] && return 0
  if [ "$free_kb" -lt $(($1 * 1024 * 1024)) ]; then
    echo "envs.sh: $3 needs about $1 GB free on $(df -P "$2" | awk 'NR == 2 {print $6}'), which has" \
      "$((free_kb / 1024 / 1024)) GB; free some space and run it again" >&2
    exit 1
  fi
}
todo_gb=0
[ -x .venv/bin/python ] || todo_gb=$((todo_gb + 3))
[ "${OPBRIDGE_SKIP_MINDSPORE:-0}" = "1" ] || [ -x .venv-ms/bin/python ] || todo_gb=$((todo_gb + 4))
if [ "$todo_gb" -gt 0 ]; then
  need_gb "$todo_gb" . "creating the environments"
  need_gb 2 "${TMPDIR:-/tmp}" "pip's unpacking (TMPDIR)"
fi

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
if [ "${OPBRIDGE_NO_UV:-0}" != "1" ] && [ ! -x .venv/bin/uv ]; then
  .venv/bin/pip install -q --disable-pip-version-check uv > /dev/null 2>&1 \
    || echo "envs.sh: uv could not be installed; pip installs the packages (slower)" >&2
fi
install_into .venv -e ".[torch,jax,paddle,dev]"
.venv/bin/python -c "import torch, jax, jax_tvm_ffi, paddle, numpy; assert numpy.__version__ >= '2'" \
  || { echo "envs.sh: .venv is incomplete" >&2; exit 1; }

if [ "${OPBRIDGE_SKIP_MINDSPORE:-0}" != "1" ]; then
  if [ ! -x .venv-ms/bin/python ]; then "$PY" -m venv .venv-ms; fi
  install_into .venv-ms -e ".[torch,mindspore]" pytest hypothesis
  .venv-ms/bin/python -c "import mindspore, numpy; assert numpy.__version__ < '2'" \
    || { echo "envs.sh: .venv-ms is incomplete" >&2; exit 1; }
fi
