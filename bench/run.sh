#!/usr/bin/env bash
# kvpipe benchmark driver: every figure is a ratio against a baseline measured
# in the same run on the same machine.
#
#   bench/run.sh [--build DIR] [--duration SECONDS] [--repeat N] [--only tcp|batch|shm|pipe|small|sweep|ucx|ucxbatch|samehost|integrity|mdscale]
#
# Sections:
#   tcp   kvpipe bench READ/WRITE over TCP vs raw loopback TCP (bench/raw_tcp.c), both
#         with one block reused (cache-resident) and walking memory as the bench does
#   batch tcp batches of 16 from one thread vs raw loopback TCP; vLLM v1's pattern
#         (10 threads x 128 x 32 KiB WRITEs) vs the best single-thread batch row
#   shm   kvpipe bench READ/WRITE over shm vs single-thread memcpy (bench/memcpy_baseline.c)
#   pipe  kvpipe bench --pipe (copying and in-place send) vs engine READ of the
#         same size, and vs memcpy
#   small small tensors and latency: kvpipe bench --pipe rates vs ZeroMQ PUSH/PULL
#         (bench/zmq_pushpull.c), the pipe's round trip vs ZeroMQ REQ/REP
#         (bench/pipe_ping.c, bench/zmq_reqrep.c), one engine READ vs a raw TCP
#         request/response (bench/engine_lat.c, raw_tcp --request)
#   sweep kvpipe bench --sweep over TCP and shm: GB/s and batch latency
#         p50/p99/p999 per block size x batch size x threads (one run each)
#   ucx   kvpipe bench READ/WRITE over ucx (protocol rdma) of the target's pool
#         memory vs ucx_perftest ucp_get/ucp_put_bw (Debian ucx-utils), each
#         UCX_TLS of this host, and of registered memory vs bench/ucp_reg (the
#         same loop on registered application memory)
#   ucxbatch  one thread, batches of 32 READs/WRITEs of 1 MiB over ucx on UCX's shared
#         memory (a one-block pool target): from one local block vs ucp_get /
#         ucp_put_bw, and from a block per request vs memcpy of the same walk
#   samehost  kvpipe READ/WRITE over shm vs over ucx on UCX's shared memory
#   integrity kvpipe bench READ/WRITE over tcp and shm, and the pipe at 64 MiB, with
#         integrity on (KVPIPE_INTEGRITY=1 on both sides) vs off, back to back; and
#         the digest's own speed (bench/digest_speed.c) beside its candidates
#   mdscale   1,000 segments in a fresh etcd and a fresh redis-server (bench/md_scale.c):
#         segment lookup p50/p99 cold and warm vs one store GET, and how long a
#         changed descriptor takes to reach a caching engine (its watch) vs one PUT
# Each pair runs back to back and the median of --repeat runs is kept, which
# damps noise from other load. Results go to stdout and bench/results/latest.md
# (latest-SECTION.md for an --only run), and with gnuplot installed a plot of
# every kvpipe figure beside its baseline to bench/results/latest.png
# (latest-SECTION.png).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build="$here/../build"
duration=3
repeat=3
only=""
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "bench/run.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
kvpipe="$build/kvpipe"
for bin in "$kvpipe" "$build/raw_tcp" "$build/memcpy_baseline" "$build/zmq_pushpull" \
    "$build/zmq_reqrep" "$build/pipe_ping" "$build/engine_lat" "$build/md_scale" \
    "$build/digest_speed"; do
    [ -x "$bin" ] || { echo "bench/run.sh: $bin not built (cmake --build $build)" >&2; exit 1; }
done
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
gbps_of() { sed -n 's/.*"gbps": *\([0-9.]*\).*/\1/p' | tail -n 1; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
human() { awk -v b="$1" 'BEGIN { if (b >= 1048576) printf "%d MiB", b/1048576; else printf "%d KiB", b/1024 }'; }

# start_target PROTO EXTRA... : runs a bench target, sets $segment
start_target() {
    local proto=$1; shift
    local port; port=$(free_port)
    local log="$tmp/target-$port.out"
    "$kvpipe" bench --mode target --local-server-name "127.0.0.1:$port" --protocol "$proto" \
        --buffer-size 512M "$@" > "$log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do grep -qs serving "$log" && break; sleep 0.1; done
    grep -q serving "$log" || { cat "$log" >&2; exit 1; }
    segment="127.0.0.1:$port"
}
stop_target() { kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'; }

# batch_of BLOCK: the initiator's batch size (requests of BLOCK bytes)
batch_of() {
    local batch=$(( (64 << 20) / $1 )); [ $batch -gt 128 ] && batch=128; [ $batch -lt 2 ] && batch=2
    echo "$batch"
}
# initiator PROTO OP BLOCK EXTRA... : prints gbps; fails unless the transport
# that moved the bytes is the one PROTO asks for (rdma: ucx), so a row never
# measures a fallback
initiator() {
    local proto=$1 op=$2 block=$3; shift 3
    local batch; batch=$(batch_of "$block")
    local want=$proto; [ "$proto" = rdma ] && want=ucx
    "$kvpipe" bench --mode initiator --local-server-name "127.0.0.1:$(free_port)" \
        --segment-id "$segment" --protocol "$proto" --operation "$op" --block-size "$block" \
        --batch-size "$batch" --buffer-size 512M --duration "$duration" --json "$@" \
        > "$tmp/initiator.out"
    local used; used=$(sed -n 's/.*"transport": *"\([a-z]*\)".*/\1/p' "$tmp/initiator.out" | tail -n 1)
    if [ "$used" != "$want" ]; then
        echo "bench/run.sh: $proto $op of $block bytes ran over '$used', not $want" >&2; exit 1
    fi
    gbps_of < "$tmp/initiator.out"
}

out="$here/results/latest${only:+-$only}.md" # a partial run does not overwrite the full one
png="$here/results/latest${only:+-$only}.png"
data="$tmp/plot" # what the plot shows: one file per panel, written by the sections
mkdir -p "$data"
{
echo "# kvpipe benchmark"
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -r); duration ${duration}s, median of $repeat;"
echo "load average at the start $(cut -d' ' -f1-3 /proc/loadavg) (other work shares the cores)."
echo "Command: \`bench/run.sh --duration $duration --repeat $repeat${only:+ --only $only}\`"
echo
if command -v gnuplot > /dev/null && case "$only" in ""|tcp|shm|pipe) true ;; *) false ;; esac; then
    echo "![kvpipe beside its baselines, GB/s]($(basename "$png"))"
    echo
fi
} > "$out"

baseline_raw_tcp() { "$build/raw_tcp" --block-size "$1" --duration "$duration" | gbps_of; }
# raw TCP walking the memory the bench's READ (or WRITE) walks: the target's
# 512 MiB buffer on one side, the initiator's batch x block on the other
initiator_span() { echo $(( $(batch_of "$1") * $1 )); }
baseline_raw_read() {
    "$build/raw_tcp" --block-size "$1" --duration "$duration" --send-span $((512 << 20)) \
        --recv-span "$(initiator_span "$1")" | gbps_of
}
baseline_raw_write() {
    "$build/raw_tcp" --block-size "$1" --duration "$duration" --send-span "$(initiator_span "$1")" \
        --recv-span $((512 << 20)) | gbps_of
}
baseline_memcpy() { "$build/memcpy_baseline" --size "$1" --duration "$duration" | gbps_of; }
med() { printf '%s\n' "$@" | median; }

# engine_section PROTO TITLE BASELINE_LABEL BASELINE_FN BLOCK... : READ and
# WRITE of each block size against the baseline, run back to back.
engine_section() {
    local proto=$1 title=$2 label=$3 base_fn=$4; shift 4
    local extra=(); [ "$proto" = tcp ] && extra=(--no-shm)
    start_target "$proto" "${extra[@]}"
    echo "## $title"
    echo
    echo "| block | $label GB/s | READ GB/s | READ / $label | WRITE GB/s | WRITE / $label |"
    echo "|---|---|---|---|---|---|"
    for block in "$@"; do
        local bases=() reads=() writes=()
        for _ in $(seq "$repeat"); do
            bases+=("$("$base_fn" "$block")")
            reads+=("$(initiator "$proto" read "$block" "${extra[@]}")")
            writes+=("$(initiator "$proto" write "$block" "${extra[@]}")")
        done
        local base read write
        base=$(med "${bases[@]}")
        read=$(med "${reads[@]}")
        write=$(med "${writes[@]}")
        echo "| $(human "$block") | $base | $read | $(ratio "$read" "$base") | $write | $(ratio "$write" "$base") |"
        echo "\"$(human "$block")\" $base $read $write" >> "$data/$proto.dat"
    done
    echo
    stop_target
}

# The tcp section: READ and WRITE against raw TCP reusing one block (which
# the caches hold) and against raw TCP walking the same memory as the bench
# (the target's buffer, the initiator's batch x block), run back to back.
section_tcp() {
    start_target tcp --no-shm
    echo "## TCP (loopback) vs raw loopback TCP"
    echo
    echo "raw: one block reused on each side (cache-resident); raw walk: raw TCP through"
    echo "as much memory as the bench moves through (512 MiB served, batch x block filled),"
    echo "per direction. READ and WRITE: kvpipe bench's defaults (2 threads, 4 workers,"
    echo "4 connections). \"1 block\": the same, at raw's footprint on the target's side"
    echo "(--buffer-size of one block: every request moves the same block)."
    echo
    echo "| block | raw GB/s | raw walk READ-wise GB/s | READ GB/s | READ / raw walk | READ 1 block GB/s | READ 1 block / raw | raw walk WRITE-wise GB/s | WRITE GB/s | WRITE / raw walk | WRITE 1 block GB/s | WRITE 1 block / raw |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    for block in 65536 1048576 16777216; do
        local bases=() rwalks=() wwalks=() reads=() writes=() oreads=() owrites=()
        for _ in $(seq "$repeat"); do
            bases+=("$(baseline_raw_tcp "$block")")
            oreads+=("$(initiator tcp read "$block" --no-shm --buffer-size "$block")")
            owrites+=("$(initiator tcp write "$block" --no-shm --buffer-size "$block")")
            rwalks+=("$(baseline_raw_read "$block")")
            reads+=("$(initiator tcp read "$block" --no-shm)")
            wwalks+=("$(baseline_raw_write "$block")")
            writes+=("$(initiator tcp write "$block" --no-shm)")
        done
        local base rwalk wwalk read write oread owrite
        base=$(med "${bases[@]}"); rwalk=$(med "${rwalks[@]}"); wwalk=$(med "${wwalks[@]}")
        read=$(med "${reads[@]}"); write=$(med "${writes[@]}")
        oread=$(med "${oreads[@]}"); owrite=$(med "${owrites[@]}")
        echo "| $(human "$block") | $base | $rwalk | $read | $(ratio "$read" "$rwalk") | $oread | $(ratio "$oread" "$base") | $wwalk | $write | $(ratio "$write" "$wwalk") | $owrite | $(ratio "$owrite" "$base") |"
        echo "\"$(human "$block")\" $base $read $write" >> "$data/tcp.dat"
    done
    echo
    stop_target
}

section_batch() {
    start_target tcp --no-shm
    echo "## TCP batches (one initiator thread, 16 requests a batch) vs raw loopback TCP"
    echo
    echo "The calls vLLM and SGLang make: one thread, a batch of 16 requests at a time,"
    echo "waited for before the next (kvpipe bench --threads 1 --batch-size 16), against"
    echo "the strongest plain stream (raw, cache-resident). Then vLLM v1's pattern (ten"
    echo "threads, each a batch of 128 WRITEs of 32 KiB at a time) against the best of"
    echo "these single-thread rows."
    echo
    echo "raw x4: four such streams at once (the engine's four connections to a peer)."
    echo
    echo "| block | raw GB/s | raw x4 GB/s | READ GB/s | READ / raw | READ / raw x4 | WRITE GB/s | WRITE / raw | WRITE / raw x4 |"
    echo "|---|---|---|---|---|---|---|---|---|"
    local best=0
    for block in 65536 1048576 16777216; do
        local bases=() fours=() reads=() writes=()
        for _ in $(seq "$repeat"); do
            bases+=("$(baseline_raw_tcp "$block")")
            fours+=("$("$build/raw_tcp" --block-size "$block" --duration "$duration" --streams 4 | gbps_of)")
            reads+=("$(initiator tcp read "$block" --no-shm --threads 1 --batch-size 16)")
            writes+=("$(initiator tcp write "$block" --no-shm --threads 1 --batch-size 16)")
        done
        local base four read write
        base=$(med "${bases[@]}"); four=$(med "${fours[@]}")
        read=$(med "${reads[@]}"); write=$(med "${writes[@]}")
        echo "| $(human "$block") | $base | $four | $read | $(ratio "$read" "$base") | $(ratio "$read" "$four") | $write | $(ratio "$write" "$base") | $(ratio "$write" "$four") |"
        best=$(printf '%s\n' "$best" "$read" "$write" | sort -g | tail -n 1)
    done
    echo
    local v1s=()
    for _ in $(seq "$repeat"); do
        v1s+=("$(initiator tcp write 32768 --no-shm --threads 10 --batch-size 128)")
    done
    local v1; v1=$(med "${v1s[@]}")
    echo "| vLLM v1 pattern GB/s | best single-thread row GB/s | v1 / best |"
    echo "|---|---|---|"
    echo "| $v1 | $best | $(ratio "$v1" "$best") |"
    echo
    stop_target
}

section_shm() {
    engine_section shm "shm (same host) vs single-thread memcpy" memcpy baseline_memcpy \
        1048576 16777216 67108864
}

section_pipe() {
    echo "## Tensor pipe (64 MiB tensors) vs engine READ and memcpy"
    echo
    echo "copy: kvp_pipe_send() copies each tensor into registered memory; in-place:"
    echo "the tensor is built in a pipe buffer (kvp_pipe_tensor_alloc) and sent as is."
    echo "The receiver checks the stamp of every 64 KiB block."
    echo
    echo "| protocol | send | engine READ GB/s | memcpy GB/s | pipe GB/s | pipe / engine | pipe / memcpy |"
    echo "|---|---|---|---|---|---|---|"
    local size=$((64 << 20)) count=$(( 64 * duration ))
    for proto in tcp shm; do
        local extra=(); [ "$proto" = tcp ] && extra=(--no-shm)
        start_target "$proto" "${extra[@]}"
        for send in copy in-place; do
            local engs=() pipes=() bases=()
            for _ in $(seq "$repeat"); do
                engs+=("$(initiator "$proto" read "$size" "${extra[@]}")")
                bases+=("$(baseline_memcpy "$size")")
                pipes+=("$("$kvpipe" bench --pipe --tensor-size "$size" --count "$count" \
                    --protocol "$proto" --send "$send" "${extra[@]}" --json | gbps_of)")
            done
            local eng pipe base
            eng=$(med "${engs[@]}")
            base=$(med "${bases[@]}")
            pipe=$(med "${pipes[@]}")
            echo "| $proto | $send | $eng | $base | $pipe | $(ratio "$pipe" "$eng") | $(ratio "$pipe" "$base") |"
            echo "\"$proto $send\" $eng $base $pipe" >> "$data/pipe.dat"
        done
        stop_target
    done
    echo
}

# ---------------------------------------------------------- small section ---

json_field() { sed -n "s/.*\"$1\": *\"*\([^,\"}]*\).*/\1/p" | tail -n 1; }
# pipe_rate SIZE COUNT EXTRA... : tensors/s of kvpipe bench --pipe. The
# warm-up is long enough for the pair to have read each other's descriptor.
pipe_rate() {
    local size=$1 count=$2; shift 2
    "$kvpipe" bench --pipe --tensor-size "$size" --count "$count" --warmup 2000 --json "$@" \
        > "$tmp/rate.out" 2> "$tmp/rate.err" || { cat "$tmp/rate.err" >&2; echo 0; return; }
    awk -v ops="$(json_field ops < "$tmp/rate.out")" -v s="$(json_field seconds < "$tmp/rate.out")" \
        'BEGIN { if (s > 0) printf "%.0f", ops / s; else print 0 }'
}
zmq_rate() { "$build/zmq_pushpull" --size "$1" --duration "$duration" | json_field msgs_per_s; }
# lat_pair CMD... : "median p99" of a latency program's JSON line
lat_pair() {
    local out; out=$("$@")
    echo "$(json_field median_us <<< "$out") $(json_field p99_us <<< "$out")"
}
med_col() { local col=$1; shift; printf '%s\n' "$@" | awk -v c="$col" '{print $c}' | median; }

section_small() {
    echo "## Small tensors and latency"
    echo
    echo "Rates: kvpipe bench --pipe over TCP (--no-shm) and shm, tensors/s, against ZeroMQ"
    echo "PUSH/PULL over loopback TCP (the pipe's control plane) moving messages of the same"
    echo "size. Between two kvpipe pipes small tensors travel inline; the announced row is"
    echo "MooncakePipe's path (--inline-max-bytes 0: an announcement, a READ, an ACK each)."
    echo
    echo "| tensor | ZeroMQ msgs/s | pipe tcp /s | tcp / ZeroMQ | pipe shm /s | shm / ZeroMQ | announced tcp /s | announced / ZeroMQ |"
    echo "|---|---|---|---|---|---|---|---|"
    local size
    for size in 4096 65536; do
        local count=$(( size == 4096 ? 10000 * duration : 2000 * duration ))
        local zs=() ts=() ss=() as=()
        for _ in $(seq "$repeat"); do
            zs+=("$(zmq_rate "$size")")
            ts+=("$(pipe_rate "$size" "$count" --no-shm)")
            ss+=("$(pipe_rate "$size" "$count" --protocol shm)")
            as+=("$(pipe_rate "$size" "$count" --no-shm --inline-max-bytes 0)")
        done
        local z t sh a
        z=$(med "${zs[@]}"); t=$(med "${ts[@]}"); sh=$(med "${ss[@]}"); a=$(med "${as[@]}")
        echo "| $(human "$size") | $z | $t | $(ratio "$t" "$z") | $sh | $(ratio "$sh" "$z") | $a | $(ratio "$a" "$z") |"
    done
    echo
    echo "Latency of 4 KiB: the pipe's round trip (send, the peer echoes, receive; one"
    echo "thread per side, over TCP; inline with deferred ACKs, inline with --ack-delay-us 0,"
    echo "and announced) against ZeroMQ REQ/REP; one engine READ against a raw"
    echo "TCP request/response (24-byte request, 4 KiB answer). Medians of $repeat runs of"
    echo "$((1000 * duration)) round trips each."
    echo
    echo "| what | baseline | median us | p99 us | baseline median us | baseline p99 us | median / baseline |"
    echo "|---|---|---|---|---|---|---|"
    local n=$((1000 * duration)) zl=() pl=() dl=() al=() rl=() el=()
    start_target tcp --no-shm
    for _ in $(seq "$repeat"); do
        zl+=("$(lat_pair "$build/zmq_reqrep" --size 4096 --count "$n")")
        pl+=("$(lat_pair "$build/pipe_ping" --size 4096 --count "$n" --no-shm)")
        dl+=("$(lat_pair "$build/pipe_ping" --size 4096 --count "$n" --no-shm --ack-delay-us 0)")
        al+=("$(lat_pair "$build/pipe_ping" --size 4096 --count "$n" --no-shm --inline-max-bytes 0)")
        rl+=("$(lat_pair "$build/raw_tcp" --request --block-size 4096 --count "$n")")
        el+=("$(lat_pair "$build/engine_lat" --segment-id "$segment" --block-size 4096 --count "$n" --no-shm)")
    done
    stop_target
    local zm zp
    zm=$(med_col 1 "${zl[@]}"); zp=$(med_col 2 "${zl[@]}")
    local row
    for row in "pipe ping, inline|pl" "pipe ping, inline, ACKs at once|dl" \
        "pipe ping, announced|al"; do
        local label=${row%%|*} arr="${row##*|}[@]" m p
        m=$(med_col 1 "${!arr}"); p=$(med_col 2 "${!arr}")
        echo "| $label | ZeroMQ REQ/REP | $m | $p | $zm | $zp | $(ratio "$m" "$zm") |"
    done
    local rm rp em ep
    rm=$(med_col 1 "${rl[@]}"); rp=$(med_col 2 "${rl[@]}")
    em=$(med_col 1 "${el[@]}"); ep=$(med_col 2 "${el[@]}")
    echo "| engine READ 4 KiB | raw TCP request/response | $em | $ep | $rm | $rp | $(ratio "$em" "$rm") |"
    echo
}

# One run of the sweep per transport, both sides started by kvpipe bench
# itself; its table as it prints it.
section_sweep() {
    echo "## Sweep: block size x batch size x threads"
    echo
    echo "\`kvpipe bench --sweep\` (both sides on this host; latency is that of one batch,"
    echo "from its submission to its last completion; one run, ${duration}s per point)."
    for proto in tcp shm; do
        local extra=(); [ "$proto" = tcp ] && extra=(--no-shm)
        echo
        echo "$proto:"
        echo
        echo '```'
        "$kvpipe" bench --sweep --protocol "$proto" "${extra[@]}" --duration "$duration" \
            --block-size 4K,64K,1M,16M --batch-size 1,32 --threads 1,2 --buffer-size 512M
        echo '```'
    done
    echo
}

# ---- ucx: the same UCX_TLS and UCX settings for kvpipe and ucx_perftest:
# endpoints with peer error handling (-e; kvpipe's always have it), which
# UCX 1.13's shared-memory transports serve only with their ERROR_HANDLING
# on, and kvpipe's 1 s keepalive. UCX_TLS sets to measure: UCX's tcp and
# shared memory here; on RDMA hosts add e.g. "rc,sm,self" or "dc,sm,self".
ucx_tls_sets=${KVP_BENCH_UCX_TLS:-"tcp sm,self"}
ucx_env() {
    export UCX_TLS=$1 UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y \
        UCX_KEEPALIVE_INTERVAL=1s UCX_WARN_UNUSED_ENV_VARS=n
}

# perftest_once TEST SIZE ITERS: decimal GB/s of one ucx_perftest run (its
# MB/s are MiB/s)
perftest_once() {
    local test=$1 size=$2 iters=$3 port; port=$(free_port)
    ucx_perftest -p "$port" -e > "$tmp/perftest-server.out" 2>&1 &
    local srv=$!
    for _ in $(seq 100); do ss -ltn "sport = :$port" | grep -q LISTEN && break; sleep 0.05; done
    ucx_perftest 127.0.0.1 -p "$port" -e -t "$test" -s "$size" -n "$iters" \
        -w $(( iters / 10 + 1 )) -f 2> "$tmp/perftest-client.err" |
        awk 'NF >= 8 && $1 ~ /^[0-9]+$/ { v = $6 } END { if (v != "") printf "%.4f", v * 1048576 / 1e9 }'
    wait "$srv" 2>/dev/null || true
}

# baseline_perftest TEST SIZE: ucx_perftest for about --duration seconds
baseline_perftest() {
    local test=$1 size=$2 n gbps
    n=$(( (64 << 20) / size )); [ $n -lt 4 ] && n=4
    gbps=$(perftest_once "$test" "$size" "$n")
    n=$(awk -v g="${gbps:-0}" -v s="$size" -v d="$duration" \
        'BEGIN { n = int(g * 1e9 * d / s); if (n < 10) n = 10; if (n > 200000) n = 200000; print n }')
    perftest_once "$test" "$size" "$n"
}

# baseline_ucp_reg get|put SIZE: bench/ucp_reg for --duration seconds
baseline_ucp_reg() { "$build/ucp_reg" --op "$1" --block-size "$2" --duration "$duration" | gbps_of; }

# The issue's shape over UCX's shared memory: one initiator thread, batches
# of 32 requests of 1 MiB, a one-block pool target, at two local footprints,
# each against the strongest baseline with that footprint, in the same run:
# every request from one local block (ucx_perftest's: ucp_put_bw keeps 32
# puts of one block in flight, ucp_get one get), and a block per request (a
# caller's batch, 32 MiB the initiator walks) against memcpy of the same
# walk (over shared memory UCX's put and get are a copy into or out of the
# mapped block).
section_ucxbatch() {
    echo "## ucx batches (one thread, 32 x 1 MiB a batch, UCX_TLS=sm,self)"
    echo
    if ! command -v ucx_perftest > /dev/null ||
        ! grep -q '^  ucx ' <<<"$("$kvpipe" info 2>/dev/null)"; then
        echo "skipped: needs ucx_perftest (ucx-utils) and a kvpipe built with ucx"; echo; return
    fi
    ucx_env sm,self
    local block=1048576 batch=32
    local span=$((batch * block))
    start_target rdma --no-shm --pool --buffer-size "$block"
    local args=(--no-shm --threads 1 --batch-size "$batch" --buffer-size "$block")
    local gets=() puts=() reads1=() writes1=() cpr=() cpw=() reads=() writes=()
    for _ in $(seq "$repeat"); do
        gets+=("$(baseline_perftest ucp_get "$block")")
        reads1+=("$(initiator rdma read "$block" "${args[@]}" --local-span "$block")")
        puts+=("$(baseline_perftest ucp_put_bw "$block")")
        writes1+=("$(initiator rdma write "$block" "${args[@]}" --local-span "$block")")
        cpr+=("$("$build/memcpy_baseline" --size "$block" --src-span "$block" \
            --dst-span "$span" --duration "$duration" | gbps_of)")
        reads+=("$(initiator rdma read "$block" "${args[@]}")")
        cpw+=("$("$build/memcpy_baseline" --size "$block" --src-span "$span" \
            --dst-span "$block" --duration "$duration" | gbps_of)")
        writes+=("$(initiator rdma write "$block" "${args[@]}")")
    done
    stop_target
    echo "| local side | READ baseline | GB/s | READ GB/s | READ / baseline | WRITE baseline | GB/s | WRITE GB/s | WRITE / baseline |"
    echo "|---|---|---|---|---|---|---|---|---|"
    local b r w p
    b=$(med "${gets[@]}"); r=$(med "${reads1[@]}"); p=$(med "${puts[@]}"); w=$(med "${writes1[@]}")
    echo "| one block (ucx_perftest's) | ucp_get | $b | $r | $(ratio "$r" "$b") | ucp_put_bw | $p | $w | $(ratio "$w" "$p") |"
    b=$(med "${cpr[@]}"); r=$(med "${reads[@]}"); p=$(med "${cpw[@]}"); w=$(med "${writes[@]}")
    echo "| a block per request (32 MiB) | memcpy, same walk | $b | $r | $(ratio "$r" "$b") | memcpy, same walk | $p | $w | $(ratio "$w" "$p") |"
    echo
    unset UCX_TLS
}

section_ucx() {
    echo "## ucx (protocol rdma) vs ucx_perftest on the same UCX_TLS"
    echo
    if ! command -v ucx_perftest > /dev/null; then
        echo "skipped: ucx_perftest not found (Debian package ucx-utils)"; echo; return
    fi
    if ! grep -q '^  ucx ' <<<"$("$kvpipe" info 2>/dev/null)"; then
        echo "skipped: this kvpipe has no ucx transport (KVP_WITH_UCX)"; echo; return
    fi
    echo "ucx_perftest -e (peer error handling, as kvpipe's endpoints): ucp_get (1 request in"
    echo "flight) and ucp_put_bw (32 in flight), one buffer of one block on each side, reused,"
    echo "allocated by UCX (ucp_mem_map ALLOCATE). kvpipe's target serves a buffer of its pool"
    echo "(kvpipe bench --pool: kvp_engine_alloc, the memory the pipe's tensors are in), which the"
    echo "ucx transport allocates the same way. READ/WRITE: the bench's defaults (--batch-size"
    echo "requests per batch, 2 threads, through 512 MiB on the target). \"1 block\": kvpipe at"
    echo "ucx_perftest's footprint: a target of one block, one thread, one request at a time"
    echo "through kvp_engine_read/write (--sync: on the calling thread; one block on each side),"
    echo "so below ucp_put_bw's depth (over shared memory a put into mapped memory completes at"
    echo "once, and a batch's local side would span a block per request)."
    echo
    echo "| UCX_TLS | block | ucp_get GB/s | READ GB/s | READ / ucp_get | READ 1 block GB/s | READ 1 block / ucp_get | ucp_put_bw GB/s | WRITE GB/s | WRITE / ucp_put_bw | WRITE 1 block GB/s | WRITE 1 block / ucp_put_bw |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    local reg_rows=()
    for tls in $ucx_tls_sets; do
        ucx_env "$tls"
        start_target rdma --no-shm --pool
        local big=$segment
        for block in 65536 1048576 16777216; do
            start_target rdma --no-shm --pool --buffer-size "$block"
            local small=$segment
            start_target rdma --no-shm --buffer-size "$block"
            local reg=$segment
            local gets=() puts=() reads=() writes=() sreads=() swrites=() rgets=() rputs=()
            local greads=() gwrites=()
            local one=(--no-shm --threads 1 --batch-size 1 --sync --buffer-size "$block")
            local one_write=(--no-shm --threads 1 --batch-size 32 --buffer-size "$block")
            for _ in $(seq "$repeat"); do
                gets+=("$(baseline_perftest ucp_get "$block")")
                rgets+=("$(baseline_ucp_reg get "$block")")
                segment=$big; reads+=("$(initiator rdma read "$block" --no-shm)")
                segment=$small; sreads+=("$(initiator rdma read "$block" "${one[@]}")")
                segment=$reg; greads+=("$(initiator rdma read "$block" "${one[@]}")")
                puts+=("$(baseline_perftest ucp_put_bw "$block")")
                rputs+=("$(baseline_ucp_reg put "$block")")
                segment=$big; writes+=("$(initiator rdma write "$block" --no-shm)")
                segment=$small; swrites+=("$(initiator rdma write "$block" "${one[@]}")")
                segment=$reg; gwrites+=("$(initiator rdma write "$block" "${one_write[@]}")")
            done
            stop_target
            stop_target
            local get put read write sread swrite
            get=$(med "${gets[@]}"); put=$(med "${puts[@]}")
            read=$(med "${reads[@]}"); write=$(med "${writes[@]}")
            sread=$(med "${sreads[@]}"); swrite=$(med "${swrites[@]}")
            echo "| $tls | $(human "$block") | $get | $read | $(ratio "$read" "$get") | $sread | $(ratio "$sread" "$get") | $put | $write | $(ratio "$write" "$put") | $swrite | $(ratio "$swrite" "$put") |"
            local rget rput gread gwrite
            rget=$(med "${rgets[@]}"); rput=$(med "${rputs[@]}")
            gread=$(med "${greads[@]}"); gwrite=$(med "${gwrites[@]}")
            reg_rows+=("| $tls | $(human "$block") | $rget | $gread | $(ratio "$gread" "$rget") | $rput | $gwrite | $(ratio "$gwrite" "$rput") |")
        done
        segment=$big
        stop_target
    done
    echo
    echo "Memory the application registers (kvp_engine_register) instead, which UCX 1.13 serves"
    echo "over shared memory by emulation (the target's progress copies each block into its FIFO,"
    echo "the initiator out of it: docs/transport-ucx.md, Measurements): a target of one block,"
    echo "one thread, READ one request at a time (--sync), WRITE 32 per batch (whose local side"
    echo "spans 32 blocks, 64 MiB at most), against UCP's own loop on registered memory"
    echo "(bench/ucp_reg: ucp_get_nbx one at a time, ucp_put_nbx 32 per flush), same run:"
    echo
    echo "| UCX_TLS | block | ucp_reg get GB/s | READ 1 block GB/s | READ 1 block / ucp_reg get | ucp_reg put GB/s | WRITE 1 block GB/s | WRITE 1 block / ucp_reg put |"
    echo "|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${reg_rows[@]}"
    echo
}

# Which of shm and ucx serves a same-host peer better: kvpipe READ and WRITE
# over shm against ucx on UCX's shared memory, back to back (the reason shm
# comes first for same-host peers, docs/transport-ucx.md).
section_samehost() {
    echo "## Same host: shm vs ucx on UCX's shared memory"
    echo
    if ! grep -q '^  ucx ' <<<"$("$kvpipe" info 2>/dev/null)"; then
        echo "skipped: this kvpipe has no ucx transport (KVP_WITH_UCX)"; echo; return
    fi
    echo "kvpipe over shm against kvpipe over ucx with UCX_TLS=sm,self (--no-shm), back to back,"
    echo "each with the bench's defaults (2 threads, batches, through 512 MiB on the target,"
    echo "after one untimed pass over it). Pool: the target serves kvp_engine_alloc memory"
    echo "(over ucx, memory UCX allocated, which the initiator maps and copies itself);"
    echo "registered: memory the target registers (over ucx, UCX 1.13's emulation)."
    echo
    echo "| memory | block | shm READ GB/s | ucx READ GB/s | ucx / shm READ | shm WRITE GB/s | ucx WRITE GB/s | ucx / shm WRITE |"
    echo "|---|---|---|---|---|---|---|---|"
    ucx_env "sm,self"
    local memory
    for memory in pool registered; do
        local flag=(); [ "$memory" = pool ] && flag=(--pool)
        start_target shm "${flag[@]}"; local shm_seg=$segment
        start_target rdma --no-shm "${flag[@]}"; local ucx_seg=$segment
        for block in 1048576 16777216; do
            local sr=() ur=() sw=() uw=()
            for _ in $(seq "$repeat"); do
                segment=$shm_seg; sr+=("$(initiator shm read "$block")")
                segment=$ucx_seg; ur+=("$(initiator rdma read "$block" --no-shm)")
                segment=$shm_seg; sw+=("$(initiator shm write "$block")")
                segment=$ucx_seg; uw+=("$(initiator rdma write "$block" --no-shm)")
            done
            local a b c d
            a=$(med "${sr[@]}"); b=$(med "${ur[@]}"); c=$(med "${sw[@]}"); d=$(med "${uw[@]}")
            echo "| $memory | $(human "$block") | $a | $b | $(ratio "$b" "$a") | $c | $d | $(ratio "$d" "$c") |"
        done
        stop_target
        stop_target
    done
    echo
}

# The plot: a panel per section that ran, kvpipe beside its baseline.
plot() {
    command -v gnuplot > /dev/null || { echo "bench/run.sh: no gnuplot, no plot" >&2; return 0; }
    local panels=0 f
    for f in tcp shm pipe; do [ -s "$data/$f.dat" ] && panels=$((panels + 1)); done
    [ "$panels" -gt 0 ] || return 0
    {
        echo "set terminal pngcairo size $((520 * panels)),460 font 'sans,10'"
        echo "set output '$png'"
        echo "set multiplot layout 1,$panels title 'kvpipe beside its baselines, same run ($(nproc) cores, median of $repeat)'"
        echo "set style data histograms; set style histogram clustered gap 1"
        echo "set style fill solid 0.85 border -1; set boxwidth 0.9"
        echo "set ylabel 'GB/s'; set yrange [0:*]; set grid ytics"
        echo "set key below horizontal opaque"
        echo "set xtics nomirror"
        if [ -s "$data/tcp.dat" ]; then
            echo "set title 'TCP (loopback) by block size'"
            echo "plot '$data/tcp.dat' using 2:xtic(1) title 'raw TCP stream', '' using 3 title 'kvpipe READ', '' using 4 title 'kvpipe WRITE'"
        fi
        if [ -s "$data/shm.dat" ]; then
            echo "set title 'shm (same host) by block size'"
            echo "plot '$data/shm.dat' using 2:xtic(1) title 'memcpy, one thread', '' using 3 title 'kvpipe READ', '' using 4 title 'kvpipe WRITE'"
        fi
        if [ -s "$data/pipe.dat" ]; then
            echo "set title 'tensor pipe, 64 MiB tensors'"
            echo "set xtics rotate by -20"
            echo "plot '$data/pipe.dat' using 2:xtic(1) title 'engine READ', '' using 3 title 'memcpy, one thread', '' using 4 title 'kvpipe pipe'"
        fi
        echo "unset multiplot"
    } > "$data/plot.gp"
    gnuplot "$data/plot.gp" && echo "plot written to $png" >&2
}

# ---------------------------------------------------------- mdscale section ---
# A fresh etcd and redis-server on free loopback ports, in $tmp; md_scale on
# each, --repeat times; the median of each figure.
section_mdscale() {
    echo "## Metadata at scale: 1,000 segments"
    echo
    local etcd_bin redis_bin
    etcd_bin=$(command -v etcd || true); redis_bin=$(command -v redis-server || true)
    if [ -z "$etcd_bin" ] || [ -z "$redis_bin" ]; then
        echo "skipped: etcd and redis-server are needed (Debian etcd-server, redis-server)."
        echo
        return
    fi
    local ep pp rp
    ep=$(free_port); pp=$(free_port); rp=$(free_port)
    "$etcd_bin" --data-dir "$tmp/etcd" --listen-client-urls "http://127.0.0.1:$ep" \
        --advertise-client-urls "http://127.0.0.1:$ep" --listen-peer-urls "http://127.0.0.1:$pp" \
        --initial-advertise-peer-urls "http://127.0.0.1:$pp" \
        --initial-cluster "default=http://127.0.0.1:$pp" > "$tmp/etcd.log" 2>&1 &
    pids+=($!)
    "$redis_bin" --port "$rp" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
        > "$tmp/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        curl -s -X POST "http://127.0.0.1:$ep/v3/kv/range" -d '{"key":"eA=="}' > /dev/null 2>&1 &&
            break
        sleep 0.1
    done
    echo "\`md_scale --segments 1000 --changes 100 --rounds 5\` (bench/md_scale.c): the"
    echo "cold lookup is an engine's first \`kvp_engine_open_segment\` of a segment (one store"
    echo "round trip for its descriptor and rpc_meta, parse, transport state; no connection), the"
    echo "warm one the cached descriptor; a change is a rewritten descriptor, timed from just"
    echo "before the write until the caching engine has dropped it. Baselines: one GET and one"
    echo "PUT of a segment key with the same client, in the same run. Median of $repeat runs; ms."
    echo
    echo "| store | GET p50 / p99 | cold p50 / p99 | cold p99 / GET p99 | warm p50 / p99 | change p50 / p99 (max) | PUT p50 |"
    echo "|---|---|---|---|---|---|---|"
    local conn
    for conn in "etcd://127.0.0.1:$ep" "redis://127.0.0.1:$rp"; do
        local runs=()
        for _ in $(seq "$repeat"); do
            runs+=("$(KVPIPE_LOG=warn "$build/md_scale" --metadata-server "$conn" 2> "$tmp/md.err" |
                tail -n 1)") || { cat "$tmp/md.err" >&2; return 1; }
        done
        printf '%s\n' "${runs[@]}" | python3 -c '
import json, statistics, sys
rs = [json.loads(l) for l in sys.stdin if l.strip()]
m = lambda k: statistics.median(r[k] for r in rs)
print("| %s | %.3f / %.3f | %.3f / %.3f | %.2f | %.4f / %.4f | %.3f / %.3f (%.3f), %s | %.3f |" % (
    rs[0]["store"], m("get_p50_ms"), m("get_p99_ms"), m("cold_p50_ms"), m("cold_p99_ms"),
    m("cold_p99_ms") / m("get_p99_ms"), m("warm_p50_ms"), m("warm_p99_ms"),
    m("change_p50_ms"), m("change_p99_ms"), m("change_max_ms"), rs[0]["change_mode"],
    m("put_p50_ms")))'
    done
    echo
}

# ------------------------------------------------------ integrity section ---

# Integrity on against off, back to back: the target restarted for each
# setting (both ends must have it), the pipe's both sides set by the env.
section_integrity() {
    echo "## Integrity on vs off (docs/reliability.md, \"Integrity\")"
    echo
    echo "kvpipe bench's defaults (2 threads, 4 connections) over tcp and shm, and \`bench"
    echo "--pipe\` of 64 MiB tensors (copying send, tcp and shm), with KVPIPE_INTEGRITY=1 at"
    echo "both ends against =0, alternated in each of $repeat rounds; the median GB/s of each."
    echo
    echo "| path | block | off GB/s | on GB/s | on / off |"
    echo "|---|---|---|---|---|"
    local proto op block
    for proto in tcp shm; do
        local extra=(); [ "$proto" = tcp ] && extra=(--no-shm)
        for block in 65536 1048576 16777216; do
            for op in read write; do
                local offs=() ons=()
                for _ in $(seq "$repeat"); do
                    KVPIPE_INTEGRITY=0 start_target "$proto" "${extra[@]}"
                    offs+=("$(KVPIPE_INTEGRITY=0 initiator "$proto" "$op" "$block" "${extra[@]}")")
                    stop_target
                    KVPIPE_INTEGRITY=1 start_target "$proto" "${extra[@]}"
                    ons+=("$(KVPIPE_INTEGRITY=1 initiator "$proto" "$op" "$block" "${extra[@]}")")
                    stop_target
                done
                local off on
                off=$(med "${offs[@]}"); on=$(med "${ons[@]}")
                echo "| $proto ${op^^} | $(human "$block") | $off | $on | $(ratio "$on" "$off") |"
            done
        done
    done
    local size=$((64 << 20)) count=$(( 64 * duration ))
    for proto in tcp shm; do
        local extra=(); [ "$proto" = tcp ] && extra=(--no-shm)
        local offs=() ons=()
        for _ in $(seq "$repeat"); do
            offs+=("$(KVPIPE_INTEGRITY=0 "$kvpipe" bench --pipe --tensor-size "$size" \
                --count "$count" --protocol "$proto" "${extra[@]}" --json | gbps_of)")
            ons+=("$(KVPIPE_INTEGRITY=1 "$kvpipe" bench --pipe --tensor-size "$size" \
                --count "$count" --protocol "$proto" "${extra[@]}" --json | gbps_of)")
        done
        local off on
        off=$(med "${offs[@]}"); on=$(med "${ons[@]}")
        echo "| pipe $proto | 64 MiB | $off | $on | $(ratio "$on" "$off") |"
    done
    echo
    echo "The digest's own speed, 256 KiB chunks, one core (bench/digest_speed.c; GB/s):"
    echo
    echo "| function | in cache | walking 1 GiB |"
    echo "|---|---|---|"
    "$build/digest_speed" --duration 1 | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print("| %s | %.2f | %.2f |" % (r["function"], r["in_cache_gbps"], r["memory_gbps"]))'
    echo
}

for s in tcp batch shm pipe small sweep ucx ucxbatch samehost integrity mdscale; do
    [ -n "$only" ] && [ "$only" != "$s" ] && continue
    "section_$s" | tee -a "$out"
done
plot
echo "written to $out" >&2
