#!/usr/bin/env bash
# Create (or update) the two environments opbridge is developed and tested in:
#   .venv     torch 2.13 (CPU), JAX + jax-tvm-ffi, PaddlePaddle, NumPy 2
#   .venv-ms  MindSpore 2.10 with NumPy < 2 (its autograd crashes under NumPy 2,
#             while JAX and jax-tvm-ffi need NumPy 2, so they cannot share one env)
# Both install opbridge in editable mode. Re-running is cheap: pip skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$@" -q --disable-pip-version-check 2>&1 | grep -v -e '^WARNING: Location' -e '^$' || true; }

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
pip_q .venv/bin/pip install -e ".[torch,jax,paddle,dev]"
.venv/bin/python -c "import torch, jax, jax_tvm_ffi, paddle, numpy; assert numpy.__version__ >= '2'" \
  || { echo "envs.sh: .venv is incomplete" >&2; exit 1; }

if [ "${OPBRIDGE_SKIP_MINDSPORE:-0}" != "1" ]; then
  if [ ! -x .venv-ms/bin/python ]; then "$PY" -m venv .venv-ms; fi
  pip_q .venv-ms/bin/pip install -e ".[torch,mindspore]" pytest hypothesis
  .venv-ms/bin/python -c "import mindspore, numpy; assert numpy.__version__ < '2'" \
    || { echo "envs.sh: .venv-ms is incomplete" >&2; exit 1; }
fi
