#!/usr/bin/env bash
# `pip install ARGS...` into a virtual environment, by uv where there is one, else by pip.
#
#   scripts/pip-install.sh VENV ARGS...      # ARGS as pip's: requirements, -e ., extras
#
# uv (OPBRIDGE_UV, default .venv/bin/uv, which scripts/envs.sh puts there) resolves as pip would: pip's
# configuration (index, extra indexes, find-links, constraints, certificate; `pip config list`) goes to it,
# it takes the best version across all of them as pip does (--index-strategy unsafe-best-match), and it
# compiles bytecode as pip does (where PYTHONDONTWRITEBYTECODE is set, nothing else would, and every import
# would compile torch's sources again). Here, 2026-11-28, warm caches: .venv in 30 s against pip's 104 s.
# OPBRIDGE_NO_UV=1, no uv, or uv failing: pip. Exit status: the installer's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -ge 2 ] || { echo "usage: scripts/pip-install.sh VENV ARGS... (--help)" >&2; exit 2; }
venv=$1; shift
[ -x "$venv/bin/python" ] || { echo "pip-install.sh: $venv has no bin/python" >&2; exit 2; }
uv=${OPBRIDGE_UV:-$ROOT/.venv/bin/uv}

if [ "${OPBRIDGE_NO_UV:-0}" != "1" ] && [ -x "$uv" ]; then
  cmd=("$uv" pip install -q --compile-bytecode --index-strategy unsafe-best-match --python "$venv/bin/python")
  while IFS= read -r line; do  # section.key='value'
    key=${line%%=*}; key=${key##*.}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    for item in $value; do
      case $key in
        index-url) cmd+=(--index-url "$item") ;;
        extra-index-url) cmd+=(--extra-index-url "$item") ;;
        find-links) cmd+=(--find-links "$item") ;;
        constraint) cmd+=(--constraint "$item") ;;
        cert) export SSL_CERT_FILE=${SSL_CERT_FILE:-$item} ;;
      esac
    done
  done < <("$venv/bin/python" -m pip config list 2> /dev/null)
  "${cmd[@]}" "$@" && exit 0
  echo "pip-install.sh: uv failed to install into $venv; trying pip" >&2
fi
set +eo pipefail  # the status is pip's, not grep's (which fails when it lets nothing through)
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -e '^WARNING: Location' -e '^$'
exit "${PIPESTATUS[0]}"
