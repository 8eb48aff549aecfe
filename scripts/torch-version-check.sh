#!/usr/bin/env bash
# Run the core and torch conformance tests under another torch than the pinned one, here, without a GPU:
# by default the GPU machine's (2.11.0, a CUDA build from PyPI, about 5 GB with its CUDA libraries), so
# that what differs there is found before device time is spent on it. Runs on the CPU; the GPU tests skip.
# The virtual environment is made once and kept (VENV); the kernel cache is its own (a fresh build).
#
#   scripts/torch-version-check.sh [TORCH_VERSION] [PYTEST_ARGS...]   (PYTEST_ARGS: say -x or -k EXPR, to both runs)
#   VENV=/tmp/opb-torch-2.11.0 (default /tmp/opb-torch-VERSION)   CACHE=VENV/cache
#
# Found this way (2026-11-27): the torch native shim failed to build under a CUDA torch without a CUDA
# toolkit (it included c10/cuda headers), and under torch 2.11 Liger's gated backward in bench gpu lost
# its saved tensors (2.11 frees them with the forward's output).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
VERSION=${1:-2.11.0}
[ $# -gt 0 ] && shift
VENV=${VENV:-/tmp/opb-torch-$VERSION}
CACHE=${CACHE:-$VENV/cache}
PY=${PYTHON:-python3}
TVM=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('apache-tvm-ffi'))" 2> /dev/null || echo "")
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2> /dev/null; then
  echo "torch-version-check: making $VENV with torch $VERSION (a few GB of downloads, once)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$VERSION" "apache-tvm-ffi${TVM:+==$TVM}" numpy ninja pyyaml \
    pytest pytest-xdist hypothesis expecttest "setuptools>=77" wheel build matplotlib
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . > /dev/null  # subprocess tests import opbridge
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
export OPBRIDGE_CACHE_DIR=$CACHE OPBRIDGE_NO_PROGRESS=1 PYTHONFAULTHANDLER=1
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests --ignore=tests/conformance "$@" || status=1
OPBRIDGE_FRAMEWORK=torch "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/conformance "$@" || status=1
exit $status
