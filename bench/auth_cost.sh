#!/usr/bin/env bash
# The cost of the authenticated mode (docs/security.md), every figure against
# the plain mode measured in the same run:
#   - connection setup: bench/auth_setup (connect + handshake + first 8-byte
#     READ, median over --count connections to each of two targets);
#   - ucx link setup: bench/auth_setup --transport ucx (UCP worker and endpoint, the
#     HELLO exchange - with the challenge-response when authenticated - and
#     a first 8-byte READ, median over --ucx-count links to each of two
#     targets), on UCX's tcp and on its shared memory; left out in a build
#     without UCX;
#   - throughput: kvpipe bench READ and WRITE over TCP (shm off) at 4 KiB and
#     64 MiB, plain and authenticated back to back, median of --repeat runs.
#
#   bench/auth_cost.sh [--build DIR] [--duration SECONDS] [--repeat N] [--ucx-count N]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build="$here/../build"
duration=3
repeat=3
ucx_count=200
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --ucx-count) ucx_count=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "bench/auth_cost.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
kvpipe="$build/kvpipe"
for bin in "$kvpipe" "$build/auth_setup"; do
    [ -x "$bin" ] || { echo "bench/auth_cost.sh: $bin not built" >&2; exit 1; }
done
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/key")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "connection setup:"
"$build/auth_setup" --key "$tmp/key" --count 2000 | tee "$tmp/setup.json"

echo "ucx link setup:"
for tls in tcp sm,self; do
    rc=0
    UCX_TLS=$tls "$build/auth_setup" --transport ucx --key "$tmp/key" --count "$ucx_count" || rc=$?
    if [ "$rc" = 77 ]; then echo "(no ucx transport in this build)"; break; fi
    [ "$rc" = 0 ] || exit 1
done

# run KEY OP BLOCK BATCH: one target + initiator pair; prints GB/s. Up to
# three tries: a free port can be taken by another program before we bind it.
run() {
    local try
    for try in 1 2 3; do
        run_once "$@" && return 0
    done
    return 1
}

run_once() {
    local key=$1 op=$2 block=$3 batch=$4 tport iport
    tport=$(free_port); iport=$(free_port)
    KVPIPE_AUTH_KEY_FILE=$key "$kvpipe" bench --mode target --local-server-name "127.0.0.1:$tport" \
        --buffer-size 256M --no-shm > "$tmp/target.log" 2>&1 &
    local tpid=$!
    pids+=("$tpid")
    for _ in $(seq 100); do grep -q serving "$tmp/target.log" && break; sleep 0.05; done
    local out
    out=$(KVPIPE_AUTH_KEY_FILE=$key "$kvpipe" bench --mode initiator \
        --local-server-name "127.0.0.1:$iport" --segment-id "127.0.0.1:$tport" --operation "$op" \
        --block-size "$block" --batch-size "$batch" --buffer-size 256M --duration "$duration" \
        --no-shm --json 2>"$tmp/initiator.err" | tail -1) || true
    kill "$tpid" 2>/dev/null || true
    wait "$tpid" 2>/dev/null || true
    python3 -c 'import json,sys; print(json.load(sys.stdin)["gbps"])' <<<"$out" 2>/dev/null || {
        echo "bench/auth_cost.sh: the initiator failed:" >&2
        cat "$tmp/initiator.err" "$tmp/target.log" >&2
        return 1
    }
}

echo "throughput (GB/s, median of $repeat; TCP, shm off):"
printf '| op | block | plain | authenticated | ratio |\n|---|---|---|---|---|\n'
for op in read write; do
    for spec in "4K 128" "64M 4"; do
        set -- $spec
        : > "$tmp/plain"; : > "$tmp/auth"
        # Alternating which mode goes first, so that neither always runs on
        # the memory the other just freed.
        for i in $(seq "$repeat"); do
            if [ $((i % 2)) = 1 ]; then
                run "" "$op" "$1" "$2" >> "$tmp/plain"
                run "$tmp/key" "$op" "$1" "$2" >> "$tmp/auth"
            else
                run "$tmp/key" "$op" "$1" "$2" >> "$tmp/auth"
                run "" "$op" "$1" "$2" >> "$tmp/plain"
            fi
        done
        p=$(median < "$tmp/plain"); a=$(median < "$tmp/auth")
        printf '| %s | %s | %s | %s | %.2f |\n' "$op" "$1" "$p" "$a" "$(echo "$a / $p" | bc -l)"
    done
done
