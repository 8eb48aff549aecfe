# The step machinery of scripts/gpu-check.sh, sourced by it (and by its tests with stand-in commands).
# Needs OUT (the output folder, with steps.txt in it) and GPU_CHECK_START (the $SECONDS the check began at).
#   step NAME COMMAND...  run COMMAND as step NAME: its output to OUT/NAME.log, "NAME STATUS SECONDS" to
#                         OUT/steps.txt (replacing an earlier line of NAME), the log's last 3 lines echoed
# under these settings:
#   GPU_CHECK_ONLY="NAME ..."  only the steps named (a step's crash reruns, NAME_no_native and NAME_gdb,
#                              come with it)
#   GPU_CHECK_STEP_LIMIT=S     each step under `timeout S` (exit status 124)
#   GPU_CHECK_BUDGET=S         the whole check's seconds: each step is also bounded by what is left of them,
#                              less GPU_CHECK_RESERVE (default 20: the summary, the archive); a step that would
#                              get under 20 s is not run, and steps.txt says "NAME skipped 0"
# Seconds are whole numbers (anything else stops the check). A step over its limit gets SIGTERM, and
# SIGKILL 10 s later (a process stuck in a driver call may ignore the first).

check_seconds() {  # check_seconds NAME: stop with an error unless $NAME is unset, empty or a whole number
  local v=${!1:-}
  if [ -n "$v" ] && ! [[ $v =~ ^[0-9]+$ ]]; then
    echo "gpu-check: $1 must be a whole number of seconds, got '$v'" >&2
    exit 2
  fi
}
check_seconds GPU_CHECK_BUDGET
check_seconds GPU_CHECK_RESERVE
check_seconds GPU_CHECK_STEP_LIMIT

wanted() {  # wanted NAME: whether GPU_CHECK_ONLY (unset: every step) names NAME or the step it reruns
  [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
  local w
  for w in $GPU_CHECK_ONLY; do
    case "$1" in "$w" | "${w}_no_native" | "${w}_gdb") return 0 ;; esac
  done
  return 1
}
record() {  # record NAME STATUS SECONDS: the step's line in steps.txt, replacing an earlier one
  sed -i "/^$1 /d" "$OUT/steps.txt"
  echo "$1 $2 $3" >> "$OUT/steps.txt"
}
step_limit() {  # step_limit: the seconds the next step may take (empty: no bound), -1 when it should not run
  local lim=${GPU_CHECK_STEP_LIMIT:-}
  if [ -n "${GPU_CHECK_BUDGET:-}" ]; then
    local left=$((GPU_CHECK_BUDGET - (SECONDS - GPU_CHECK_START) - ${GPU_CHECK_RESERVE:-20}))
    if [ "$left" -lt 20 ]; then echo -1; return; fi
    if [ -z "$lim" ] || [ "$left" -lt "$lim" ]; then lim=$left; fi
  fi
  echo "$lim"
}
step() {  # step NAME COMMAND...: run, keep the log and the exit status
  local name=$1; shift
  wanted "$name" || return 0
  local lim
  lim=$(step_limit)
  if [ "$lim" = "-1" ]; then
    echo "== $name: not run, under 20 s of GPU_CHECK_BUDGET=$GPU_CHECK_BUDGET left"
    record "$name" skipped 0
    rm -f "$OUT/$name.log" "$OUT/$name.xml"  # an earlier call's, which would read as this one's
    return 0
  fi
  echo "== $name${lim:+ (at most $lim s)}: $*"
  local t0=$SECONDS
  local limit=()
  [ -n "$lim" ] && limit=(timeout -k 10 "$lim")
  "${limit[@]}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$((SECONDS - t0))"
  tail -3 "$OUT/$name.log"
}
