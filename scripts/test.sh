#!/usr/bin/env bash
# Build and run every test: first the normal build (-Werror), then the whole
# suite again built with AddressSanitizer and UndefinedBehaviorSanitizer.
# The tests start their own servers (metadata store, redis-server, etcd) on
# free loopback ports. Ends with ctest's summary of the sanitizer run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-2}

cmake -S . -B build -DKVP_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

cmake -S . -B build-asan -DKVP_WERROR=ON -DKVP_SANITIZE=ON >/dev/null
cmake --build build-asan -j"$jobs"
# Leak checking runs too; halt on the first UBSan report.
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    ctest --test-dir build-asan --output-on-failure -j"$jobs"
