#!/usr/bin/env bash
# Builds what the GPU machines run into gpu_bundle/ (git-ignored): one
# statically linked test binary per test package with GPU tests, the trainer,
# the benchmarks, the Python package, the result counter and run.sh.
#
#   tools/gpu_bundle.sh            # build here, on the machine with Bazel
#   # then, through the device tool, with gpu_bundle in carry:
#   gpu_bundle/run.sh "$OUT"       # tests, trainer, benchmarks; one summary line
#   gpu_bundle/run.sh "$OUT" --sanitize   # also memcheck and racecheck on the tests
#
# Binaries are stripped and only cudart, cuBLASLt, NCCL and the C/C++ runtime
# are loaded from the system there. The bundle must stay well under the 64 MiB
# that may travel to the GPU machine; this script fails above 48 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=gpu_bundle
limit_bytes=$((48 * 1024 * 1024))

test_targets=$(./bazelw query 'attr(tags, "gpu_bundle", kind("cc_test", //...))' 2>/dev/null)
binary_targets=$(./bazelw query 'kind("cc_binary", //trainer/... + //benchmarks/... + //tools/demo/...)' 2>/dev/null)
echo "gpu_bundle: building $(echo $test_targets | wc -w) test binaries and $(echo $binary_targets | wc -w) programs" >&2
# shellcheck disable=SC2086
./bazelw build --config=bundle $test_targets $binary_targets

rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/bin" "$bundle/python"
for label in $test_targets; do
  package=${label#//}; package=${package%%:*}          # tests/engine
  name=${label##*:}                                     # gpu_tests
  install -m 0755 "bazel-bin/$package/$name" "$bundle/tests/$(basename "$package")_$name"
done
for label in $binary_targets; do
  package=${label#//}; package=${package%%:*}
  name=${label##*:}
  install -m 0755 "bazel-bin/$package/$name" "$bundle/bin/$name"
done
cp -r python/stepgraph "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
install -m 0755 tools/count_test_results.py "$bundle/count_test_results.py"
install -m 0755 tools/gpu_run.sh "$bundle/run.sh"

size=$(du -sb "$bundle" | cut -f1)
echo "gpu_bundle: $(du -sh "$bundle" | cut -f1) in $bundle/ ($(find "$bundle" -type f | wc -l) files)" >&2
if [ "$size" -gt "$limit_bytes" ]; then
  echo "gpu_bundle: larger than 48 MiB; the device tool carries at most 64 MiB. Merge or shrink binaries." >&2
  exit 1
fi
