#!/usr/bin/env bash
# Runs run_pytest.sh ($1) on the other arguments with AddressSanitizer's runtime preloaded: for a
# test that loads, through ctypes, the C library built with --config=asan (.bazelrc). Python itself
# is not instrumented, so leak detection is off (its allocator keeps memory at exit); the other
# options come from ASAN_OPTIONS (halt_on_error: a report ends the process, which the fuzz counts
# as a crash).
set -euo pipefail
runner="$1"
shift
# libstdc++ right after the runtime: ASan's __cxa_throw interceptor finds the real one only if
# it is loaded at startup (Python does not link it), else the library's first exception aborts.
preload=""
for library in libasan.so libstdc++.so; do
  path="$(g++ -print-file-name="$library")"
  if [ ! -f "$path" ]; then
    echo "asan_pytest: g++ -print-file-name=$library gave '$path', not a file" >&2
    exit 1
  fi
  preload="${preload:+$preload:}$path"
done
export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
# allocator_may_return_null: the fuzz asks for petabytes on purpose (the engine's out-of-memory
# errors), which ASan's allocator would otherwise abort on instead of failing like malloc.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0:allocator_may_return_null=1"
exec "$runner" "$@"
