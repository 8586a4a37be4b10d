# shellcheck shell=bash
# Sourced by killed_rank_check.sh and restart_check.sh (tools/gpu_bundle.sh
# installs it beside them): their arguments, and the fault both inject into a
# trainer run on 2 ranks.

# check_args NAME ARGS...: reads a check's arguments, TRAINER WORK_DIR [extra
# trainer flags], into trainer, work (made) and the array extra_flags; a
# missing one ends the check with NAME's usage.
# shellcheck disable=SC2034  # the sourcing check reads them
check_args() {
  local name=$1
  shift
  trainer=${1:?usage: $name TRAINER WORK_DIR [flags]}
  work=${2:?usage: $name TRAINER WORK_DIR [flags]}
  extra_flags=("${@:3}")
  mkdir -p "$work"
}

# kill_worker_once LAUNCHER LOG PATTERN: waits until LOG has a line matching
# PATTERN (grep's basic regex; at most 120 s), then SIGKILLs the launcher's
# last worker process and says which.
kill_worker_once() {
  local launcher=$1 log=$2 pattern=$3 victim
  for _ in $(seq 1 240); do
    grep -q "$pattern" "$log" && break
    sleep 0.5
  done
  victim=$(pgrep -P "$launcher" | tail -n 1)
  echo "workers of launcher $launcher: $(pgrep -P "$launcher" | tr '\n' ' '); killing $victim"
  kill -9 "$victim"
}
