#!/usr/bin/env bash
# The main job: set up the environments, build the op library, and show every
# built-in op running, checked and timed in every installed framework.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/envs.sh
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_CACHE_DIR:-$PWD/.cache/opbridge}
# advance_step's int64 token ids need JAX's 64-bit mode; JAX narrows int64 to int32 without it (rotary's positions
# run either way).
JAX_ENABLE_X64=1 .venv/bin/python -m opbridge.demo --frameworks numpy,torch,jax,paddle "$@"
if [ "${OPBRIDGE_SKIP_MINDSPORE:-0}" != "1" ]; then
  .venv-ms/bin/python -m opbridge.demo --frameworks mindspore "$@"
fi
