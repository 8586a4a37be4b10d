#!/usr/bin/env bash
# Checks the floors of the tree (tools/build_defs/floors.bzl, README: Layout):
#   1. no target of a floor depends on a target of a higher floor (or of its
#      sibling: ops/ and graphs/, train/ and checkpoint/ do not see each
#      other), by bazel query;
#   2. `visibility` turns a new upward dependency into a build error: a probe
#      package under engine/ that depends on //layers:linear must fail
#      analysis with "is not visible" (the probe is removed afterwards);
#   3. no device branch outside the backends (tools/layering/check_device_branches.py),
#      no getenv in kernels/ or ops/;
#   4. the README's layout table matches the tree (tools/layering/check_readme_layout.py).
# Prints one line per check and exits non-zero on the first failure.
#
#   tools/check_layering.sh        # .ci/run runs it after the tests
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "check_layering: FAIL: $*" >&2
  exit 1
}

# 1. Every floor, and what it must not reach.
declare -A above=(
  [engine]="//kernels/... + //launch/... + //ops/... + //graphs/... + //layers/... + //optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [kernels]="//launch/... + //ops/... + //graphs/... + //layers/... + //optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [launch]="//kernels/... + //ops/... + //graphs/... + //layers/... + //optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [ops]="//graphs/... + //layers/... + //optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [graphs]="//ops/... + //layers/... + //optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [layers]="//optim/... + //train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [optim]="//train/... + //checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [train]="//checkpoint/... + //capi/... + //trainer/... + //benchmarks/..."
  [checkpoint]="//train/... + //capi/... + //trainer/... + //benchmarks/..."
  [capi]="//trainer/... + //benchmarks/..."
)
for floor in engine kernels launch ops graphs layers optim train checkpoint capi; do
  upward=$(./bazelw query --noshow_progress "deps(//$floor/...) intersect (${above[$floor]})" 2>/dev/null) ||
    fail "bazel query for //$floor failed"
  [ -z "$upward" ] || fail "//$floor depends on a higher floor: $upward"
done
echo "check_layering: no floor depends on a higher one (engine, kernels, launch, ops, graphs, layers, optim, train, checkpoint, capi)"

# 2. An upward dependency must not build.
probe=engine/layering_probe
trap 'rm -rf "$probe"' EXIT
mkdir -p "$probe"
cat >"$probe/BUILD.bazel" <<'EOF'
cc_library(
    name = "probe",
    deps = ["//layers:linear"],
)
EOF
if output=$(./bazelw build --nobuild --noshow_progress "//$probe:probe" 2>&1); then
  fail "a target under engine/ could depend on //layers:linear; visibility does not guard the floors"
fi
grep -q "is not visible" <<<"$output" || fail "the probe failed for another reason than visibility: $output"
echo "check_layering: an upward dependency (//$probe -> //layers:linear) fails to build: not visible"
rm -rf "$probe"

# 3. Device branches live in the backends only (tools/layering/check_device_branches.py
#    lists the files allowed to branch, with their reasons); no environment
#    switches in kernels or ops.
python3 tools/layering/check_device_branches.py --root . || fail "a device branch outside the backends (above)"
envs=$(grep -rn 'getenv' --include=*.cc --include=*.h --include=*.cu --include=*.cuh kernels ops || true)
[ -z "$envs" ] || fail "getenv in kernels/ or ops/ (a kernel choice must be an op parameter):
$envs"
echo "check_layering: no getenv in kernels/ or ops/"

# 4. The README's layout table names the folders that exist, and every one of them.
python3 tools/layering/check_readme_layout.py --root . || fail "the README's layout table does not match the tree (above)"
