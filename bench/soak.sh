#!/usr/bin/env bash
# The demo's soak: many requests of mixed size (log-uniform 16..8192 tokens
# of Llama-3-8B's KV cache, 2 KiB to 1 GiB each) through `kvpipe demo` over
# each transport, every byte verified, and each side's peak RSS held to a
# bound that does not grow with the number of requests:
#   prefill <= kv_buffer_size + 2 x the largest request + 512 MiB
#              (the pipe's registered buffer, the request being built and the
#              one being copied in, and the process itself)
#   decode  <= the largest request + recv_window_bytes (64 MiB) + 512 MiB
#              (the request being checked, the receive window, the process)
# Over ucx both sides' pools are memory UCX allocates, which its shared-memory
# lane maps into the peer, so pages touched count in both processes' RSS
# (decode's own pool and prefill's, measured here at about 2 x kv_buffer_size
# more), and UCX keeps its own pools: decode's bound adds 2 x kv_buffer_size,
# both sides' add 256 MiB.
#
#   bench/soak.sh                        # 500 requests over shm, tcp and ucx
#   bench/soak.sh --requests 40          # the short form ctest runs (soak_test)
#   bench/soak.sh --transports tcp --seed 7 --build build
#
# Prints one line per transport and exits 1 if any run failed, lost or
# corrupted a byte, or passed its RSS bound. Where the build has no UCX the
# ucx run shows as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
requests=500 transports=shm,tcp,ucx seed=1 build=build
while [ $# -gt 0 ]; do
    case $1 in
    --requests) requests=$2; shift 2 ;;
    --transports) transports=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) echo "usage: bench/soak.sh [--requests N] [--transports shm,tcp,ucx] [--seed S] [--build DIR]" >&2
       exit 2 ;;
    esac
done
kvpipe=$build/kvpipe
[ -x "$kvpipe" ] || { echo "soak: no $kvpipe (build first: make)" >&2; exit 2; }

failed=0
printf "%-4s %8s %9s %7s %9s %13s %13s %8s\n" transport requests GB GB/s seconds \
    "prefill MiB" "decode MiB" verdict
for t in ${transports//,/ }; do
    case $t in
    shm) flags="" ;;
    tcp) flags="--no-shm" ;;
    ucx)
        if ! "$kvpipe" info | grep -q "^  ucx *available"; then
            printf "%-9s SKIPPED (this build or host has no UCX)\n" "$t"
            continue
        fi
        flags="--protocol rdma --no-shm" ;;
    *) echo "soak: unknown transport $t (shm, tcp, ucx)" >&2; exit 2 ;;
    esac
    log=$(mktemp)
    # shellcheck disable=SC2086 # flags are words
    if ! "$kvpipe" demo --requests "$requests" --tokens-mix 16..8192 --seed "$seed" \
            $flags --json >"$log" 2>&1; then
        printf "%-9s FAILED: kvpipe demo --requests %s --tokens-mix 16..8192 --seed %s %s\n" \
            "$t" "$requests" "$seed" "$flags"
        tail -5 "$log"
        failed=1
        rm -f "$log"
        continue
    fi
    /usr/bin/python3 - "$log" "$t" "$requests" <<'EOF' || failed=1
import json, sys
log, transport, requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
ucx = transport == "ucx"
text = open(log).read()
doc = json.loads(text.strip().splitlines()[-1])
mib = 1 << 20
largest = doc["largest_request_bytes"] / mib
kv = doc["kv_buffer_size"] / mib
bound_p = kv + 2 * largest + 512 + (256 if ucx else 0)
bound_d = largest + 64 + 512 + (2 * kv + 256 if ucx else 0)
bad = []
if "every byte verified" not in text: bad.append("bytes not verified")
if doc["errors"]: bad.append("%d errors" % doc["errors"])
if doc["requests"] != requests: bad.append("%d requests done" % doc["requests"])
if doc["transport"] != transport: bad.append("ran over " + doc["transport"])
if doc["prefill_rss_mib"] > bound_p: bad.append("prefill RSS over its bound")
if doc["decode_rss_mib"] > bound_d: bad.append("decode RSS over its bound")
print("%-9s %8d %9.1f %7.2f %9.1f %6.0f/%-6.0f %6.0f/%-6.0f %s" % (
    transport, doc["requests"], doc["bytes"] / 1e9, doc["gbps"], doc["seconds"],
    doc["prefill_rss_mib"], bound_p, doc["decode_rss_mib"], bound_d,
    "ok" if not bad else "FAILED: " + ", ".join(bad)))
sys.exit(1 if bad else 0)
EOF
    rm -f "$log"
done
exit $failed
