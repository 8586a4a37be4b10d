#!/usr/bin/env bash
# run.sh of the GPU bundle (installed by tools/gpu_bundle.sh): runs on a GPU
# machine, writes logs and JSON into OUT_DIR, prints one summary line last.
#
#   run.sh OUT_DIR [--sanitize]
#
# OUT_DIR receives at most 8 files (the device tool brings back no more):
#   summary.txt tests.log programs.log sanitizer.log and the benchmarks JSON
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT_DIR [--sanitize]}
sanitize=${2:-}
mkdir -p "$out"
work=$(mktemp -d)
export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/summary.txt"

# 1. Tests: each bundled binary, results as XML, all output in one log.
: >"$out/tests.log"
for binary in "$here"/tests/*; do
  name=$(basename "$binary")
  echo "=== $name" >>"$out/tests.log"
  "$binary" --gtest_output="xml:$work/$name.xml" >>"$out/tests.log" 2>&1
  echo "=== $name exit $?" >>"$out/tests.log"
done
test_line=$(python3 "$here/count_test_results.py" --quiet-skips "$work"/*.xml | tee -a "$out/tests.log" | tail -n 1)

# 2. Programs: the trainer and the benchmarks.
programs_failed=0
: >"$out/programs.log"
run_program() {
  echo "=== $*" >>"$out/programs.log"
  "$@" >>"$out/programs.log" 2>&1
  local status=$?
  echo "=== exit $status" >>"$out/programs.log"
  [ "$status" -eq 0 ] || programs_failed=$((programs_failed + 1))
}
run_program "$here/bin/trainer" --device cuda
run_program "$here/bin/launch_overhead" --out "$out/launch_overhead.json"
run_program "$here/bin/capture_demo" --device cuda --replays 10
run_program "$here/bin/gemm_bench" --out "$out/gemm_bench.json"
run_program "$here/bin/memory_bound_bench" --out "$out/memory_bound.json"

# 3. Optional: compute-sanitizer memcheck and racecheck over the test binaries.
# API errors are not reported: every CUDA call's status is already checked by
# SG_CUDA_CHECK, and the negative tests provoke some on purpose (an unjoined
# capture, timing untimed events); the sanitizer's job here is kernel memory.
sanitizer_line="sanitizer not run"
if [ "$sanitize" = "--sanitize" ]; then
  sanitizer_errors=0
  : >"$out/sanitizer.log"
  for tool in memcheck racecheck; do
    for binary in "$here"/tests/*; do
      echo "=== $tool $(basename "$binary")" >>"$out/sanitizer.log"
      # racecheck looks at shared memory inside kernels; under it the thousand
      # graph replays take minutes and add nothing memcheck has not covered.
      filter=()
      [ "$tool" = racecheck ] && filter=(--gtest_filter='-*ThousandReplays*')
      compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 "$binary" "${filter[@]}" \
        >>"$out/sanitizer.log" 2>&1
      status=$?
      echo "=== exit $status" >>"$out/sanitizer.log"
      [ "$status" -eq 0 ] || sanitizer_errors=$((sanitizer_errors + 1))
    done
  done
  sanitizer_line="sanitizer: $sanitizer_errors failing run(s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer.log" | sort | uniq -c >>"$out/summary.txt"
fi

summary="gpu bundle: tests $test_line; programs: $programs_failed failed; $sanitizer_line"
echo "$summary" | tee -a "$out/summary.txt"
rm -rf "$work"
case "$test_line" in *" 0 failed"*) ;; *) exit 1 ;; esac
[ "$programs_failed" -eq 0 ] || exit 1
