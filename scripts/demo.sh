#!/usr/bin/env bash
# The main job: set up the environments, build the op library, and show every
# built-in op running, checked and timed in every installed framework.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/envs.sh
export OPBRIDGE_CACHE_DIR=${OPBRIDGE_CACHE_DIR:-$PWD/.cache/opbridge}
# JAX as users first meet it, without its 64-bit mode: rotary's positions and advance_step's token ids, positions
# and slots arrive as int32, which the kernels take.
.venv/bin/python -m opbridge.demo --frameworks numpy,torch,jax,paddle "$@"
if [ "${OPBRIDGE_SKIP_MINDSPORE:-0}" != "1" ]; then
  .venv-ms/bin/python -m opbridge.demo --frameworks mindspore "$@"
fi
