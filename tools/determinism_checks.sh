#!/usr/bin/env bash
# Reproducibility of the trainer, as a user would check it (Note
# [Deterministic algorithm choice] in engine/algorithm_choice.h): for each
# configuration below, on a text file,
#   1. two graphed and two eager runs print the same loss at every step and
#      end with checkpoints equal bit for bit;
#   2. a run stopped halfway and resumed prints the uninterrupted run's losses
#      for the second half and ends with its checkpoint, bit for bit;
# and the default configuration resumes exactly on the Markov source too.
#
#   determinism_checks.sh TRAINER WORK_DIR TEXT_FILE [--steps N] [--long N] [--only NAME,...] [-- extra trainer flags]
#
# --long N: the default configuration's four runs go N steps (1,000 for the
# record), the others --steps (default 30). Extra flags go to every run (e.g.
# --nproc-per-node 2 --tp 2). Exit status 0 when every check holds.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
trainer=${1:?usage: determinism_checks.sh TRAINER WORK_DIR TEXT_FILE [options]}
work=${2:?usage: determinism_checks.sh TRAINER WORK_DIR TEXT_FILE [options]}
text=${3:?usage: determinism_checks.sh TRAINER WORK_DIR TEXT_FILE [options]}
shift 3
steps=30
long=0
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=${2:?}; shift 2 ;;
    --long) long=${2:?}; shift 2 ;;
    --only) only=${2:?}; shift 2 ;;
    --) shift; break ;;
    *) echo "determinism_checks.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
extra=("$@")
compare=${COMPARE_CHECKPOINTS:-$here/compare_checkpoints.py}
mkdir -p "$work"
failures=0
checks=0

# The configurations: a name and the trainer flags that make it (STEPS: --steps, so a
# schedule decays over the whole run and a resumed half keeps it).
configs=(
  "default|"
  "fp16|--dtype fp16"
  "fp8_current|--fp8 current"
  "fp8_delayed|--fp8 delayed"
  "fp8_block|--fp8 block"
  "moe|--experts 4"
  "dropout|--dropout 0.1"
  "lr_schedule|--lr-schedule cosine --warmup-steps 5 --decay-steps STEPS"
  "buckets|--buckets pow2"
)

run() {  # run LOG flags...: one trainer run, its output into LOG
  local log=$1
  shift
  "$trainer" "$@" "${extra[@]}" >"$log" 2>&1
  local status=$?
  if [ "$status" -ne 0 ]; then
    echo "  trainer $* ${extra[*]} exited $status:"
    tail -n 5 "$log" | sed 's/^/    /'
  fi
  return "$status"
}
losses() { grep -E '^step [0-9]+ loss ' "$1" | awk '{print $2, $4}'; }
check() {  # check DESCRIPTION STATUS
  checks=$((checks + 1))
  if [ "$2" -eq 0 ]; then echo "CHECK ok: $1"; else echo "CHECK FAILED: $1"; failures=$((failures + 1)); fi
}
same_losses() {  # same_losses A B [FIRST_STEP]: equal loss lines from FIRST_STEP on, and some
  local first=${3:-1}
  diff <(losses "$1" | awk -v f="$first" '$1 >= f') <(losses "$2" | awk -v f="$first" '$1 >= f') >/dev/null &&
    [ "$(losses "$2" | awk -v f="$first" '$1 >= f' | wc -l)" -gt 0 ]
}
same_checkpoints() {  # same_checkpoints A B: A and B, and each per-rank part of A's set against B's of that name
  local file status=0 found=0
  for file in "$1" "$1".step*; do
    [ -e "$file" ] || continue
    found=1
    python3 "$compare" "$file" "$2${file#"$1"}" | sed 's/^/  /'
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  [ "$found" -eq 1 ] || { echo "  no checkpoint $1"; status=1; }
  return "$status"
}

reproducible() {  # reproducible NAME STEPS DATA_FLAGS FLAGS...
  local name=$1 n=$2 data=$3
  shift 3
  local d="$work/$name" ok=0
  mkdir -p "$d"
  for mode in graph eager; do
    for r in 1 2; do
      rm -f "$d/$mode$r.safetensors"*
      # shellcheck disable=SC2086
      run "$d/$mode$r.log" $data --mode "$mode" --steps "$n" --log-every 1 --checkpoint "$d/$mode$r.safetensors" "$@" ||
        ok=1
    done
  done
  if [ "$ok" -eq 0 ]; then
    same_losses "$d/graph1.log" "$d/graph2.log" && same_losses "$d/graph1.log" "$d/eager1.log" &&
      same_losses "$d/graph1.log" "$d/eager2.log" || ok=1
    for other in graph2 eager1 eager2; do same_checkpoints "$d/graph1.safetensors" "$d/$other.safetensors" || ok=1; done
    echo "  losses (graph 1): $(losses "$d/graph1.log" | awk 'NR <= 4 || NR % 250 == 0 {printf "%s:%s ", $1, $2}')"
  fi
  check "$name: two graphed and two eager runs of $n steps equal at every step and bit for bit at the end" "$ok"
}

resumes() {  # resumes NAME STEPS DATA_FLAGS FLAGS...
  local name=$1 n=$2 data=$3
  shift 3
  local d="$work/$name" half=$((n / 2)) ok=0
  mkdir -p "$d"
  rm -f "$d/whole.safetensors"* "$d/resumed.safetensors"*
  # shellcheck disable=SC2086
  run "$d/whole.log" $data --steps "$n" --log-every 1 --checkpoint "$d/whole.safetensors" "$@" &&
    run "$d/first_half.log" $data --steps "$half" --log-every 1 --checkpoint "$d/resumed.safetensors" "$@" &&
    run "$d/second_half.log" $data --steps "$n" --log-every 1 --checkpoint "$d/resumed.safetensors" --resume "$@" ||
    ok=1
  if [ "$ok" -eq 0 ]; then
    same_losses "$d/whole.log" "$d/second_half.log" $((half + 1)) || ok=1
    same_checkpoints "$d/whole.safetensors" "$d/resumed.safetensors" || ok=1
  fi
  check "$name: stopped at step $half and resumed, equal to the uninterrupted run over steps $((half + 1))-$n, bit for bit" "$ok"
}

for entry in "${configs[@]}"; do
  name=${entry%%|*}
  flags=${entry#*|}
  flags=${flags//STEPS/$steps}
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then continue; fi
  echo "--- $name: trainer --data TEXT $flags ${extra[*]}"
  n=$steps
  if [ "$name" = default ] && [ "$long" -gt 0 ]; then n=$long; fi
  start=$SECONDS
  # shellcheck disable=SC2086
  reproducible "$name" "$n" "--data $text" $flags
  # shellcheck disable=SC2086
  resumes "$name" "$steps" "--data $text" $flags
  echo "--- $name: $((SECONDS - start)) s"
done
if [ -z "$only" ] || [[ ",$only," == *",default,"* ]]; then
  resumes markov_default "$steps" ""
fi

echo "determinism checks: $checks checks, $failures failed"
[ "$failures" -eq 0 ]
