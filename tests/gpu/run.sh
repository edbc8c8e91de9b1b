#!/usr/bin/env bash
# The GPU suite, in one go, on a machine with an NVIDIA driver and a GPU
# (docs/gpu.md, "Running on a GPU"):
#
#     tests/gpu/run.sh [--quick] [--device N] [--build DIR]
#
# 1. checks that the CUDA driver (libcuda.so.1, or the file KVPIPE_LIBCUDA
#    names) loads and sees a device; exits 77 saying why when not;
# 2. configures and builds kvpipe (Release) in DIR (default build-gpu) from
#    this tree: the library, tests/gpu/gpu_check and the Python module only;
#    the packages are Debian's (scripts/install-deps.sh installs them);
# 3. runs gpu_check on the driver: device memory between two processes over
#    tcp (staged) and shm (CUDA IPC where the driver allows it), READ and
#    WRITE, every byte checked, then throughput against the driver's own
#    copies (JSON lines, kept in DIR/gpu_check.jsonl);
# 4. runs python/tests/test_gpu_vllm.py on the driver: the vLLM v1 pattern
#    through kvpipe's mooncake.engine (P2PHANDSHAKE, batch_register_memory of
#    device KV blocks, ten threads of batch_transfer_sync_write, every byte
#    checked on the device);
# 5. prints the figures.
#
# Exit 0: everything passed; 1: something failed (above); 2: bad usage;
# 77: no driver or no device here. --quick: smaller throughput runs. A few
# minutes on a 16-core machine, most of it the build.
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=() device=0 build=build-gpu
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=(--quick) ;;
        --device) [ $# -ge 2 ] || { echo "run.sh: --device needs a number" >&2; exit 2; }
                  device=$2; shift ;;
        --build) [ $# -ge 2 ] || { echo "run.sh: --build needs a folder" >&2; exit 2; }
                 build=$2; shift ;;
        *) echo "usage: tests/gpu/run.sh [--quick] [--device N] [--build DIR]" >&2; exit 2 ;;
    esac
    shift
done
SECONDS=0

for tool in cmake cc make python3; do
    command -v "$tool" >/dev/null ||
        { echo "run.sh: $tool is missing: run scripts/install-deps.sh (as root) first" >&2; exit 1; }
done

# 1. The driver and a device, asked of the driver itself (no toolkit needed).
lib=${KVPIPE_LIBCUDA:-libcuda.so.1}
rc=0
python3 - "$lib" "$device" <<'EOF' || rc=$?
import ctypes, sys
lib, device = sys.argv[1], int(sys.argv[2])
try:
    cu = ctypes.CDLL(lib)
except OSError as e:
    print("run.sh: no CUDA driver here (%s): the GPU suite needs one" % e, file=sys.stderr)
    sys.exit(77)
r, n = cu.cuInit(0), ctypes.c_int(0)
if r == 0:
    r = cu.cuDeviceGetCount(ctypes.byref(n))
if r != 0 or n.value <= device:
    print("run.sh: the CUDA driver %s has no device %d (cuInit/cuDeviceGetCount: error %d, "
          "%d devices)" % (lib, device, r, n.value), file=sys.stderr)
    sys.exit(77)
version = ctypes.c_int(0)
cu.cuDriverGetVersion(ctypes.byref(version))
name = ctypes.create_string_buffer(256)
if hasattr(cu, "cuDeviceGetName") and cu.cuDeviceGetName(name, 256, device) == 0:
    print("run.sh: device %d: %s, driver API %d, %s" % (device, name.value.decode(),
                                                       version.value, lib))
else:
    print("run.sh: device %d, driver API %d, %s" % (device, version.value, lib))
EOF
[ "$rc" = 0 ] || exit "$rc"
# The driver's test double (tests/support/fake_cuda) exports its helpers: the
# Python test reaches it through KVPT_FAKECUDA. Only for trying this script
# where no GPU is; its figures mean nothing.
if python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1]).fakecuda_copies' "$lib" 2>/dev/null; then
    echo "run.sh: $lib is the driver's TEST DOUBLE, not a GPU: its figures mean nothing"
    export KVPT_FAKECUDA=$lib
else
    unset KVPT_FAKECUDA
fi

# 2. Build.
mkdir -p "$build"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVP_TESTS=ON -DKVP_PYTHON=ON >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; echo "run.sh: configure failed (missing packages: scripts/install-deps.sh)"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target gpu_check kvpipe_python >"$build/build.log" 2>&1 ||
    { tail -40 "$build/build.log"; echo "run.sh: build failed (log: $build/build.log)"; exit 1; }
echo "run.sh: built in $SECONDS s ($build)"

# 3. gpu_check.
failed=0
out=$build/gpu_check.jsonl
"$build/tests/gpu_check" --device "$device" "${quick[@]}" | tee "$out" || failed=1

# 4. The vLLM v1 pattern, on the same driver; a skip is a failure here.
KVPT_REQUIRE_CUDA=1 KVPT_CUDA_DEVICE=$device PYTHONDONTWRITEBYTECODE=1 \
PYTHONPATH="$build/python:python/mooncake_shim" \
    timeout 300 python3 python/tests/test_gpu_vllm.py -v 2>&1 | tee "$build/test_gpu_vllm.log" || failed=1
grep -q "SUMMARY: 4 run, 0 failed, 0 errors, 0 skipped" "$build/test_gpu_vllm.log" ||
    { echo "run.sh: test_gpu_vllm.py did not run all four cases cleanly"; failed=1; }

# 5. The figures.
echo
echo "run.sh: throughput (GB/s; ratio: this rate over the baseline's, both from this run)"
python3 - "$out" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "rate" in r:
        base = " %5.2fx %s" % (r["ratio"], r["baseline"]) if "baseline" in r else ""
        print("  %-22s %8.2f GB/s  %4d MiB  %s%s" % (r["rate"], r["GBps"], r["bytes"] >> 20,
                                                  r["driver"], base))
EOF
echo "run.sh: $([ "$failed" = 0 ] && echo passed || echo FAILED) in $SECONDS s"
exit "$failed"
