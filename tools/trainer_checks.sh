#!/usr/bin/env bash
# The trainer's checks from the command line, as a user would run them (the
# bitwise versions are tests/trainer/trainer_test.cc, on host and cuda):
#   1. the default run reaches the entropy rate within 0.05 nats;
#   2. eager and graph print the same losses for the first 20 steps;
#   3. a run stopped at step 20 and resumed prints the losses of an
#      uninterrupted run for steps 21-40.
#
#   trainer_checks.sh TRAINER WORK_DIR [extra trainer flags, e.g. --device host]
# Exit status 0 when all three hold; every trainer output is printed.
set -uo pipefail
trainer=${1:?usage: trainer_checks.sh TRAINER WORK_DIR [flags]}
work=${2:?usage: trainer_checks.sh TRAINER WORK_DIR [flags]}
shift 2
mkdir -p "$work"
failures=0

run() {  # run NAME flags...: the trainer's output into WORK_DIR/NAME.log, echoed
  local name=$1
  shift
  echo "--- trainer $* $EXTRA"
  local start=$SECONDS
  # shellcheck disable=SC2086
  "$trainer" "$@" $EXTRA >"$work/$name.log" 2>&1
  local status=$?
  cat "$work/$name.log"
  echo "--- exit $status, $((SECONDS - start)) s"
  return "$status"
}
losses() { grep -E '^step [0-9]+ loss ' "$1" | awk '{print $2, $4}'; }
check() {  # check DESCRIPTION CONDITION-STATUS
  if [ "$2" -eq 0 ]; then echo "CHECK ok: $1"; else echo "CHECK FAILED: $1"; failures=$((failures + 1)); fi
}
EXTRA="$*"

run default
grep -q "within 0.05 nats from step" "$work/default.log"
check "default run within 0.05 nats of the entropy rate" $?

run eager --mode eager --steps 20 --log-every 1 && run graph --mode graph --steps 20 --log-every 1
diff <(losses "$work/eager.log") <(losses "$work/graph.log") && [ "$(losses "$work/eager.log" | wc -l)" -eq 20 ]
check "eager and graph losses equal over the first 20 steps" $?

rm -f "$work/resume.safetensors"
run whole --steps 40 --log-every 1 &&
  run first_half --steps 20 --log-every 1 --checkpoint "$work/resume.safetensors" &&
  run second_half --steps 40 --log-every 1 --checkpoint "$work/resume.safetensors" --resume
diff <(losses "$work/whole.log" | awk '$1 > 20') <(losses "$work/second_half.log") &&
  [ "$(losses "$work/second_half.log" | wc -l)" -eq 20 ]
check "resumed run equals the uninterrupted run over steps 21-40" $?

echo "trainer checks: $failures failed"
[ "$failures" -eq 0 ]
