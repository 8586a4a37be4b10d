#!/usr/bin/env bash
# Builds what the GPU machines run into gpu_bundle/ (git-ignored): one
# statically linked test binary per test package with GPU tests, the trainer
# and its checks, the benchmarks (C++ and the PyTorch peers), the Python
# package with libstepgraph_c.so and its tests, the result counter and run.sh;
# then packs it into gpu_bundle_packed/bundle.tar.xz, which is what travels.
#
#   tools/gpu_bundle.sh            # build here, on the machine with Bazel
#   # then, through the device tool, with gpu_bundle_packed in carry:
#   tar -xJf gpu_bundle_packed/bundle.tar.xz -C /tmp && /tmp/gpu_bundle/run.sh "$OUT" [--sanitize]
#
# Binaries are stripped and only cudart, cuBLASLt, NCCL and the C/C++ runtime
# are loaded from the system there. Every binary carries the compiled kernels
# (about 10 MB each), so the folder is larger than the 64 MiB that may travel;
# packed it must stay under 48 MiB, or this script fails.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle=gpu_bundle
packed=gpu_bundle_packed
limit_bytes=$((48 * 1024 * 1024))

test_targets=$(./bazelw query 'attr(tags, "gpu_bundle", kind("cc_test", //...))' 2>/dev/null)
binary_targets=$(./bazelw query 'kind("cc_binary", //trainer/... + //benchmarks/... + //tools/demo/...)' 2>/dev/null)
multirank_targets=$(./bazelw query 'attr(tags, "gpu_multirank", kind("cc_test", //...))' 2>/dev/null)
echo "gpu_bundle: building $(echo $test_targets | wc -w) test binaries and $(echo $binary_targets | wc -w) programs" >&2
# shellcheck disable=SC2086
./bazelw build --config=bundle $test_targets $binary_targets $multirank_targets //capi:libstepgraph_c.so \
  //tests/python:trainer_reference

rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/bin" "$bundle/python" "$bundle/multirank"
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
for label in $multirank_targets; do   # run under a launcher by run.sh's multigpu stage
  package=${label#//}; package=${package%%:*}
  name=${label##*:}
  install -m 0755 "bazel-bin/$package/$name" "$bundle/multirank/$name"
done
cp -r python/stepgraph "$bundle/python/"
install -m 0755 bazel-bin/capi/libstepgraph_c.so "$bundle/python/stepgraph/"
mkdir -p "$bundle/python_tests" "$bundle/benchmarks"
cp tests/python/*.py python/README.md "$bundle/python_tests/"
# The trainer run by python_trainer_parity_test (Python against the trainer, bit for bit).
install -m 0755 bazel-bin/tests/python/trainer_reference "$bundle/bin/trainer_reference"
cp README.md "$bundle/python_tests/top_README.md"   # readme_test checks it shows the tested example
cp benchmarks/*.py "$bundle/benchmarks/"
find "$bundle" -name __pycache__ -prune -exec rm -rf {} +
install -m 0755 tools/count_test_results.py "$bundle/count_test_results.py"
install -m 0755 tools/trainer_checks.sh "$bundle/trainer_checks.sh"
install -m 0755 tools/killed_rank_check.sh "$bundle/killed_rank_check.sh"
install -m 0644 tools/kill_worker.sh "$bundle/kill_worker.sh"  # sourced by the two checks
install -m 0755 tools/compare_losses.py "$bundle/compare_losses.py"
install -m 0755 tools/compare_checkpoints.py "$bundle/compare_checkpoints.py"
install -m 0755 tools/determinism_checks.sh "$bundle/determinism_checks.sh"
install -m 0755 tools/restart_check.sh "$bundle/restart_check.sh"
install -m 0644 tests/trainer/trainer_fuzz_test.py "$bundle/trainer_fuzz_test.py"
install -m 0755 tools/ncu_summary.py "$bundle/ncu_summary.py"
install -m 0755 tools/gpu_run.sh "$bundle/run.sh"

rm -rf "$packed"
mkdir -p "$packed"
# xz -9's 64 MiB dictionary spans several binaries, so the kernels every
# binary carries are packed about once: 23 MiB against 50 MiB at xz's default
# 8 MiB dictionary (92 files, 408 MiB unpacked).
tar -cf - "$bundle" | xz -9 -T2 >"$packed/bundle.tar.xz"
size=$(du -sb "$packed" | cut -f1)
echo "gpu_bundle: $(du -sh "$bundle" | cut -f1) in $bundle/ ($(find "$bundle" -type f | wc -l) files)," \
  "packed $(du -sh "$packed" | cut -f1) in $packed/bundle.tar.xz" >&2
if [ "$size" -gt "$limit_bytes" ]; then
  echo "gpu_bundle: packed larger than 48 MiB; the device tool carries at most 64 MiB. Merge or shrink binaries." >&2
  exit 1
fi
