#!/usr/bin/env bash
# Elastic restarts on real ranks (Note [Elastic restarts] in trainer/distributed.h):
# runs the trainer on 2 ranks of this host to --steps with checkpoints every
# 5 steps, once uninterrupted and once with --max-restarts 1 and one worker
# SIGKILLed mid-run, and checks that the restarted run ends with exit 0 and
# a checkpoint equal to the uninterrupted run's, bit for bit.
#
#   restart_check.sh TRAINER WORK_DIR [extra trainer flags, e.g. --dp 2]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/kill_worker.sh
source "$here/kill_worker.sh"
check_args restart_check.sh "$@"
rm -f "$work"/whole.safetensors* "$work"/restarted.safetensors*
flags=(--nproc-per-node 2 --steps 60 --save-every 5 --log-every 1 --comm-timeout 10 "${extra_flags[@]}")
"$trainer" "${flags[@]}" --checkpoint "$work/whole.safetensors" >"$work/whole.log" 2>&1 || {
  cat "$work/whole.log"
  echo "CHECK FAILED: the uninterrupted run failed"
  exit 1
}
log="$work/restarted.log"
"$trainer" "${flags[@]}" --max-restarts 1 --checkpoint "$work/restarted.safetensors" >"$log" 2>&1 &
launcher=$!
kill_worker_once "$launcher" "$log" '^step 23 '  # mid-run, past a checkpoint
wait "$launcher"
status=$?
cat "$log"
ok=0
[ "$status" -eq 0 ] || { echo "launcher exit $status"; ok=1; }
grep -q 'restarting every rank (restart 1 of 1)' "$log" || ok=1
grep -q '^restart 1: resuming from' "$log" || ok=1
# A per-rank set: its manifest names each part's checksum, and each part is compared too.
for file in "$work/whole.safetensors" "$work/whole.safetensors".step*; do
  [ -e "$file" ] || continue
  other="$work/restarted.safetensors${file#"$work/whole.safetensors"}"
  python3 "$here/compare_checkpoints.py" "$file" "$other" || ok=1
done
if [ "$ok" -eq 0 ]; then
  echo "CHECK ok: a rank killed at step 23 was restarted and the run ended equal to an uninterrupted one, bit for bit"
else
  echo "CHECK FAILED: the restarted run did not end as an uninterrupted one"
fi
exit "$ok"
