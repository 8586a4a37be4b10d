#!/usr/bin/env bash
# A killed rank ends the others in bounded time (cuda): starts the trainer on
# 2 ranks of this host with --comm-timeout T, kills one worker (SIGKILL) once
# training runs, and checks that the launcher then ends with an error, the
# surviving rank's watchdog naming its rank and step and the survivor exiting
# by itself with status 3, within T + 2 s.
#
#   killed_rank_check.sh TRAINER WORK_DIR [extra trainer flags]
# Exit status 0 when it holds; the trainer's output is printed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/kill_worker.sh
source "$here/kill_worker.sh"
check_args killed_rank_check.sh "$@"
timeout_s=10
log="$work/killed_rank.log"
"$trainer" --nproc-per-node 2 --steps 100000000 --log-every 500 --comm-timeout "$timeout_s" "${extra_flags[@]}" >"$log" 2>&1 &
launcher=$!
kill_worker_once "$launcher" "$log" '^step '  # once training runs
start=$SECONDS
wait "$launcher"
status=$?
elapsed=$((SECONDS - start))
cat "$log"
echo "launcher exit $status, $elapsed s after the kill (--comm-timeout $timeout_s)"
# Every rank ends by itself: the killed one by its signal, the survivor by its
# watchdog (status 3) within the timeout plus its bounded abort, never killed
# by the launcher ("did not end within").
survivor_exit=$(grep -c 'trainer: rank [0-9]* exited with status 3' "$log")
if [ "$status" -ne 0 ] && [ "$elapsed" -le $((timeout_s + 2)) ] && grep -q 'trainer: rank [0-9]*: .*aborting' "$log" &&
  [ "$survivor_exit" -ge 1 ] && ! grep -q 'did not end within' "$log"; then
  echo "CHECK ok: a killed rank ended the run with the watchdog's error in $elapsed s, the survivor exiting by itself"
  exit 0
fi
echo "CHECK FAILED: a killed rank did not end the run as promised"
exit 1
