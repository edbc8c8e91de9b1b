#!/usr/bin/env bash
# Build the libFuzzer targets (build-fuzz/, clang, ASan+UBSan) and run them,
# JOBS (2) at a time, then print per target: executions, coverage (libFuzzer's cov: and ft:),
# corpus size and crashes. See docs/fuzzing.md.
#
#   tests/fuzz/run.sh                     every target for 10^7 executions
#   tests/fuzz/run.sh --runs N TARGET...  N executions of the named targets
#   tests/fuzz/run.sh --time S            S seconds per target (with --runs: whichever first)
#   tests/fuzz/run.sh --short             CI: each target for KVP_FUZZ_SECONDS (9) seconds
#   tests/fuzz/run.sh --build-only        build the targets, run nothing
#
# New corpus entries and crash artifacts go to a scratch directory (--out DIR,
# default a new /tmp/kvpipe-fuzz.XXXXXX), never into the repo; the seeds in
# tests/fuzz/corpus/<target>/ are only read. Exit status 1 if any target
# crashed, hit a sanitizer report or broke an invariant.
set -euo pipefail
cd "$(dirname "$0")/../.."

runs=10000000
seconds=0
build=build-fuzz
out=
nice_level=${KVP_FUZZ_NICE:-10}
targets=()
build_only=0

usage() {
    sed -n '2,15s/^# \{0,1\}//p' "$0"
    exit "${1:-0}"
}

while [ $# -gt 0 ]; do
    case "$1" in
    --runs) runs=$2; shift 2 ;;
    --time) seconds=$2; shift 2 ;;
    --short) runs=0; seconds=${KVP_FUZZ_SECONDS:-9}; shift ;;
    --build-only) build_only=1; shift ;;
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "run.sh: unknown option $1" >&2; usage 2 >&2 ;;
    *) targets+=("$1"); shift ;;
    esac
done
if [ "$runs" = 0 ] && [ "$seconds" = 0 ]; then
    echo "run.sh: --runs 0 needs --time" >&2
    exit 2
fi

# -max_len per target: room for the largest valid input with slack, small
# enough that mutations stay near the format.
declare -A max_len=(
    [safetensors]=4096 [descriptor]=8192 [p2p]=8192 [rpc_meta]=1024 [config]=2048
    [tcp_wire]=1024 [shm_wire]=1024 [ucx_wire]=1024 [pipe_announce]=256 [http_store]=4096
)
# Targets whose dictionary adds the JSON tokens of dict/json.dict.
declare -A json=([safetensors]=1 [descriptor]=1 [p2p]=1 [rpc_meta]=1 [config]=1)
# More flags. The HTTP store keeps values across inputs, so libFuzzer's leak
# check after every input that allocated more than it freed would scan the
# heap nearly every time (a tenth of the speed); leaks are checked at exit.
declare -A extra=([http_store]=-detect_leaks=0)

if [ ${#targets[@]} -eq 0 ]; then
    for src in tests/fuzz/fuzz_*.c; do
        t=${src#tests/fuzz/fuzz_}
        targets+=("${t%.c}")
    done
fi
for t in "${targets[@]}"; do
    [ -f "tests/fuzz/fuzz_$t.c" ] || { echo "run.sh: no target '$t'" >&2; exit 2; }
done

CC=${CC:-clang} cmake -S . -B "$build" -DKVP_FUZZ=ON -DKVP_TESTS=OFF -DKVP_PYTHON=OFF >/dev/null
nice -n "$nice_level" cmake --build "$build" --target fuzzers -j"${JOBS:-2}" >/dev/null
[ "$build_only" = 1 ] && exit 0

[ -n "$out" ] || out=$(mktemp -d /tmp/kvpipe-fuzz.XXXXXX)
mkdir -p "$out"
echo "fuzz: scratch directory $out"

# fuzz_one TARGET: run it; its summary row to $out/TARGET.row, and
# $out/TARGET.failed if it crashed, hit a sanitizer report or broke an
# invariant.
fuzz_one() {
    local t=$1
    local corpus="$out/corpus/$t" artifacts="$out/artifacts/$t/" log="$out/$t.log"
    mkdir -p "$corpus" "$artifacts"
    local dict="$out/$t.dict"
    : >"$dict"
    [ -n "${json[$t]:-}" ] && cat tests/fuzz/dict/json.dict >>"$dict"
    [ -f "tests/fuzz/dict/$t.dict" ] && cat "tests/fuzz/dict/$t.dict" >>"$dict"
    local args=(-max_len="${max_len[$t]:-4096}" -dict="$dict" -artifact_prefix="$artifacts"
                -print_final_stats=1 -timeout=60)
    [ -n "${extra[$t]:-}" ] && args+=(${extra[$t]})
    [ "$runs" != 0 ] && args+=(-runs="$runs")
    [ "$seconds" != 0 ] && args+=(-max_total_time="$seconds")
    echo "fuzz: $t (${args[*]})"
    local start rc=0
    start=$(date +%s)
    # The first directory takes new entries; the repo's seeds are only read.
    nice -n "$nice_level" "$build/tests/fuzz/fuzz_$t" "${args[@]}" "$corpus" "tests/fuzz/corpus/$t" \
        >"$log" 2>&1 || rc=$?
    local elapsed=$(( $(date +%s) - start ))
    local execs last cov ft units crashes
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    units=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' <<<"$last")
    crashes=$(find "$artifacts" -type f \( -name "crash-*" -o -name "leak-*" -o -name "timeout-*" \
        -o -name "oom-*" \) | wc -l)
    printf '%-14s %12s %6s %7s %8s %8s %7s\n' "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" \
        "${units:-?}" "$crashes" "$elapsed" >"$out/$t.row"
    if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
        touch "$out/$t.failed"
        echo "fuzz: $t FAILED (exit $rc); log $log, artifacts in $artifacts" >&2
        grep -E 'ERROR: |SUMMARY: |invariant broken|runtime error' "$log" | head -5 >&2 || true
    fi
}

# JOBS (default 2) targets at a time: each is one process on one core, so the
# time each gets is what it would get alone.
parallel=${JOBS:-2}
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
    fuzz_one "$t" &
done
wait
summary="$out/summary.txt"
printf '%-14s %12s %6s %7s %8s %8s %7s\n' target executions cov ft corpus crashes seconds >"$summary"
failed=0
for t in "${targets[@]}"; do
    cat "$out/$t.row" >>"$summary" 2>/dev/null || echo "$t: no result" >>"$summary"
    [ -f "$out/$t.row" ] && [ ! -f "$out/$t.failed" ] || failed=1
done
cat "$summary"
exit "$failed"
