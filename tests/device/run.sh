#!/usr/bin/env bash
# The GPU device script (docs/gpu.md, "The device bundle"). It runs from a
# bundle that tests/device/bundle.sh made, on a bare machine with a GPU: no
# compiler, no network, no package manager needed.
#
#     DIR/run.sh [--double] [--device N] [--python PATH] [--budget SECONDS] [--only STEP,...]
#
# One JSON line per figure on stdout, a status line per step and a summary
# line last; with $OUT set, everything (results.jsonl, each step's stdout and
# stderr) goes there too, else under DIR/logs/<time>/. Each step runs under
# its own timeout, cut to what is left of --budget (default 330 s), so one hang
# cannot eat the run; the steps, in order:
#
#   machine     nvidia-smi (GPUs, driver), CPUs, kernel, glibc, Python, torch
#   bundle      check_bundle.sh: every file here loads from the bundle alone
#   info        kvpipe info: the memory kinds (cuda with the driver's version)
#   gpu_check   device memory between two processes over tcp (staged) and shm
#               (CUDA IPC), READ and WRITE, 1 and 64 requests, odd offsets,
#               every byte and guard byte checked; rates against the driver's
#               own pinned and device-to-device copies of this run
#   vllm_tcp    vLLM v1's MooncakeConnector pattern (device.py vllm): PyTorch
#   vllm_shm    CUDA tensors as KV blocks, P2PHANDSHAKE, batch_register_memory,
#               ten threads of batch_transfer_sync_write, every block checked
#               on the device; tcp = MC_FORCE_TCP=1 (and no shm), shm = as the
#               engine picks on one host; p50/p99 per call, GB/s against raw
#               TCP with ten streams (tcp) or a device-to-device copy (shm)
#   pipe_tcp    kvpipe.Pipe with CUDA tensors: an 8k-token Llama-3-8B request
#   pipe_shm    (input tokens, roi, keys, values, hidden states), send_tensor
#               of each, recv_tensor(device="cuda:N") in another process,
#               every byte checked on the device; against a pinned
#               device-to-host copy
#   scaling     tcp and shm READ/WRITE at 1 and 16 MiB with 1, 2, 4, 8, 16
#               threads (kvpipe bench) against raw multi-stream loopback TCP
#               and multi-threaded memcpy with as many threads, same run
#   soft_roce   ucx over a soft-RoCE device (rdma link add ... type rxe),
#               READ and WRITE verified, or one line saying why not
#
# --double: the same on the CUDA driver's test double (double/libfakecuda.so),
# smaller; device memory from the driver API instead of torch, soft-RoCE only
# rehearsed (ucx over UCX's tcp). Its figures mean nothing; CI runs it.
# Exit 0: every step passed or was skipped; 1: a step failed; 2: bad usage;
# 77: (not --double) no CUDA driver with a device here.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
double=0 device=0 python="" budget=330 only=""
usage() { echo "usage: run.sh [--double] [--device N] [--python PATH] [--budget SECONDS] [--only STEP,...]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --double) double=1 ;;
        --device) [ $# -ge 2 ] || usage; device=$2; shift ;;
        --python) [ $# -ge 2 ] || usage; python=$2; shift ;;
        --budget) [ $# -ge 2 ] || usage; budget=$2; shift ;;
        --only) [ $# -ge 2 ] || usage; only=",$2,"; shift ;;
        -h|--help) sed -n '2,44p' "$0"; exit 0 ;;
        *) usage ;;
    esac
    shift
done
[ -f "$B/BUILD_INFO.json" ] || {
    echo "run.sh: $B is not a device bundle; make one with tests/device/bundle.sh DIR and run DIR/run.sh" >&2
    exit 2
}
SECONDS=0
logs=${OUT:-$B/logs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$logs"
results=$logs/results.jsonl
: >"$results"
say() { echo "$1" | tee -a "$results"; }

# The programs find their libraries in lib/ (LD_LIBRARY_PATH, set for them
# alone); libstdc++ and libgcc_s only where the machine has none. The Python
# module needs none of it (its RPATH): the interpreter and PyTorch keep the
# machine's libraries.
has_lib() { ldconfig -p 2>/dev/null | grep -q " $1 " || ls /lib*/"$1" /usr/lib*/"$1" /lib/*/"$1" /usr/lib/*/"$1" >/dev/null 2>&1; }
lib_path=$B/lib
for l in libstdc++.so.6 libgcc_s.so.1; do
    has_lib "$l" || { lib_path=$B/lib:$B/lib/fallback; break; }
done
export KVPIPE_BUNDLE_LD_LIBRARY_PATH=$lib_path # device.py runs the programs with it
# UCX's modules, and libibverbs' soft-RoCE provider (an absolute name gets
# "-rdmav34.so" appended: lib/librxe-rdmav34.so).
export UCX_MODULE_DIR=$B/lib/ucx RDMAV_DRIVERS=$B/lib/librxe
export PYTHONPATH=$B/python:$B/py PYTHONDONTWRITEBYTECODE=1
unset LD_LIBRARY_PATH

# Python >= 3.11 (the module is abi3), with torch where one has it.
pick_python() {
    local with_torch="" plain="" p
    for p in "$python" ${VIRTUAL_ENV:+"$VIRTUAL_ENV/bin/python3"} python3 /opt/*/bin/python3 /opt/*/*/bin/python3 /root/*/bin/python3 \
             /root/.*/bin/python3 /workspace/*/bin/python3 /home/*/*/bin/python3 /home/*/.*/bin/python3 \
             /usr/local/bin/python3 /usr/bin/python3; do
        [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 || continue
        timeout 20 "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || continue
        [ -n "$plain" ] || plain=$(command -v "$p")
        [ -n "$python" ] && break
        if [ "$double" = 0 ] && timeout 90 "$p" -c 'import torch' 2>/dev/null; then
            with_torch=$(command -v "$p"); break
        fi
    done
    echo "${with_torch:-$plain}"
}
py=$(pick_python)
[ -n "$py" ] || { say '{"error": "no Python >= 3.11 here (--python PATH)"}'; exit 1; }
export PATH=$(dirname "$py"):$PATH

if [ "$double" = 1 ]; then
    export KVPIPE_LIBCUDA=$B/double/libfakecuda.so KVPT_FAKECUDA=$B/double/libfakecuda.so
    backend=driver
    say '{"note": "--double: the CUDA driver is the test double; no GPU is used and no figure means anything"}'
else
    backend=auto
    # The driver and a device, asked of the driver itself, before anything.
    why=$("$py" - "${KVPIPE_LIBCUDA:-libcuda.so.1}" "$device" <<'EOF'
import ctypes, sys
lib, device = sys.argv[1], int(sys.argv[2])
try:
    cu = ctypes.CDLL(lib)
except OSError as e:
    sys.exit("no CUDA driver here (%s)" % e)
n = ctypes.c_int(0)
r = cu.cuInit(0)
if r == 0:
    r = cu.cuDeviceGetCount(ctypes.byref(n))
if r != 0 or n.value <= device:
    sys.exit("the CUDA driver %s has no device %d (error %d, %d devices)" % (lib, device, r, n.value))
EOF
    ) || {
        "$py" -c 'import json, sys; print(json.dumps({"skip": sys.argv[1], "ran": "nothing"}))' "$why" | tee -a "$results"
        exit 77
    }
fi

declare -A status
order=()
# step NAME LIMIT COMMAND...: run it under timeout, its JSON lines to stdout.
step() {
    local name=$1 limit=$2 rc t0=$SECONDS
    shift 2
    case "$only" in "" | *",$name,"*) ;; *) return ;; esac
    order+=("$name")
    local left=$((budget - SECONDS - 10))
    if [ "$left" -lt 15 ]; then
        status[$name]=skipped
        say "{\"step\": \"$name\", \"status\": \"skipped\", \"why\": \"the budget of $budget s is spent\"}"
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    timeout -k 10 "$limit" "$@" 2>"$logs/$name.err" | tee "$logs/$name.out" | grep '^{' | tee -a "$results"
    rc=${PIPESTATUS[0]}
    case "$rc" in
        0) status[$name]=passed ;;
        77) status[$name]=skipped ;;
        124 | 137) status[$name]=timeout ;;
        *) status[$name]=failed ;;
    esac
    say "{\"step\": \"$name\", \"status\": \"${status[$name]}\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit\": $limit}"
    [ "${status[$name]}" = passed ] || [ "${status[$name]}" = skipped ] || tail -5 "$logs/$name.err" >&2
}

dev=(--device "$device" --backend "$backend")
if [ "$double" = 1 ]; then
    check_args=(--quick)
    vllm_args=(--blocks-per-thread 2 --block-bytes 65536 --calls 5 --baseline-seconds 0.5)
    pipe_args=(--tokens 256)
    scaling_args=(--threads 1,2 --duration 0.3)
    rxe_args=(--rehearse --duration 0.5)
else
    check_args=()
    vllm_args=()
    pipe_args=()
    scaling_args=(--duration 0.5)
    rxe_args=(--rdma "$B/bin/rdma" --ip "$B/bin/ip")
fi

step machine 60 "$py" "$B/py/device.py" machine --device "$device"
step bundle 90 "$B/check_bundle.sh" "$B" "$py"
step info 30 "$py" "$B/py/device.py" info --kvpipe "$B/bin/kvpipe"
step gpu_check 150 env LD_LIBRARY_PATH="$lib_path" "$B/bin/gpu_check" --device "$device" "${check_args[@]+"${check_args[@]}"}"
step vllm_tcp 100 "$py" "$B/py/device.py" vllm --transport tcp "${dev[@]}" --raw-tcp "$B/bin/raw_tcp" "${vllm_args[@]+"${vllm_args[@]}"}"
step vllm_shm 100 "$py" "$B/py/device.py" vllm --transport shm "${dev[@]}" "${vllm_args[@]+"${vllm_args[@]}"}"
step pipe_tcp 100 "$py" "$B/py/device.py" pipe --transport tcp "${dev[@]}" "${pipe_args[@]+"${pipe_args[@]}"}"
step pipe_shm 100 "$py" "$B/py/device.py" pipe --transport shm "${dev[@]}" "${pipe_args[@]+"${pipe_args[@]}"}"
step scaling 220 "$py" "$B/py/device.py" scaling --kvpipe "$B/bin/kvpipe" --raw-tcp "$B/bin/raw_tcp" \
    --memcpy "$B/bin/memcpy_baseline" "${scaling_args[@]+"${scaling_args[@]}"}"
step soft_roce 90 "$py" "$B/py/device.py" rxe --kvpipe "$B/bin/kvpipe" --raw-tcp "$B/bin/raw_tcp" "${rxe_args[@]}"

failed=0
summary=""
for s in "${order[@]}"; do
    summary+="\"$s\": \"${status[$s]}\", "
    case "${status[$s]}" in passed | skipped) ;; *) failed=$((failed + 1)) ;; esac
done
say "{\"summary\": {${summary}\"failed\": $failed, \"double\": $([ "$double" = 1 ] && echo true || echo false), \"seconds\": $SECONDS, \"python\": \"$py\", \"logs\": \"$logs\", \"bundle\": $(tr -d '\n' <"$B/BUILD_INFO.json" | sed 's/.*"commit": *\("[^"]*"\).*/\1/')}}"
[ "$failed" = 0 ]
