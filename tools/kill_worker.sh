# shellcheck shell=bash
# Sourced by killed_rank_check.sh and restart_check.sh (tools/gpu_bundle.sh
# installs it beside them): the fault both inject into a trainer run on 2 ranks.

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
