#!/usr/bin/env bash
# The ABI (docs/abi.md):
# 1. libkvpipe.so against the ABI recorded in abi/libkvpipe.abi.xz (libabigail's
#    abidiff): nothing may change but added functions. A deliberate change
#    re-records it (abi.sh --update BUILD_DIR) in the same commit, and, unless
#    it only appends a field to a sized struct, bumps the SONAME.
# 2. Releases apart: a program built against a copy of this release's headers
#    runs against a library whose every sized struct gained a field, and a
#    program built against those newer headers runs against this library
#    (fields left at 0) and gets KVP_ENOTSUP when it sets one
#    (tests/packaging/abi_prog.c; each struct against a PROT_NONE page).
#   abi.sh SOURCE_DIR BUILD_DIR
#   abi.sh --update BUILD_DIR
set -euo pipefail
if [ "$1" = --update ]; then
    build=$2 src=$(cd "$(dirname "$0")/../.." && pwd)
    abidw --headers-dir "$src/include/kvpipe" --headers-dir "$build/include/kvpipe" \
        --drop-private-types --no-corpus-path "$build/libkvpipe.so" | xz -9 >"$src/abi/libkvpipe.abi.xz"
    echo "abi.sh: recorded $src/abi/libkvpipe.abi.xz"
    exit 0
fi
src=$1 build=$2
lib=$build/libkvpipe.so
fail=0
if ! command -v abidiff >/dev/null; then
    echo "SKIPPED: abidiff not installed (Debian: abigail-tools; scripts/install-deps.sh)"
    exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ---- 1. against the recorded ABI
rc=0
xz -dc "$src/abi/libkvpipe.abi.xz" >"$tmp/recorded.abi"
abidiff --no-added-syms --headers-dir2 "$src/include/kvpipe" --headers-dir2 "$build/include/kvpipe" \
    "$tmp/recorded.abi" "$lib" || rc=$?
if [ $rc -ne 0 ]; then
    echo "FAIL: libkvpipe.so's ABI differs from abi/libkvpipe.abi.xz (abidiff exit $rc, above);"
    echo "      if that is meant, re-record it: tests/packaging/abi.sh --update $build"
    fail=1
else
    echo "ok: the ABI is abi/libkvpipe.abi.xz's (added functions aside)"
fi

# ---- 2. a release apart
mkdir -p "$tmp/src"
(cd "$src" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -C "$tmp/src" -xf -
# The next release: a field appended to each sized struct.
for s in kvp_engine_opts kvp_pipe_opts kvp_metadata_server_opts kvp_pipe_stats kvp_pipe_endpoints \
    kvp_batch_opts; do
    grep -lq "^} $s;" "$tmp"/src/include/kvpipe/*.h
    sed -i "s|^} $s;|    uint64_t abi_test_added; /* tests/packaging/abi.sh */\n} $s;|" \
        "$tmp"/src/include/kvpipe/*.h
done
cmake -S "$tmp/src" -B "$tmp/next" -DKVP_PYTHON=OFF >/dev/null
cmake --build "$tmp/next" --target kvpipe_shared -j"${JOBS:-2}" >/dev/null
cp -r "$src/include" "$tmp/this-include" # a copy of this release's headers
port() { python3 -c 'import random; print(random.randint(20000, 29000))'; }
cc -std=c11 -Wall -Werror "$src/tests/packaging/abi_prog.c" -I"$tmp/this-include" \
    -I"$build/include" -o "$tmp/prog_this" "$lib"
cc -std=c11 -Wall -Werror -DABI_PROG_NEWER "$src/tests/packaging/abi_prog.c" \
    -I"$tmp/src/include" -I"$tmp/next/include" -o "$tmp/prog_next" "$tmp/next/libkvpipe.so"
check() { # NAME LIBDIR PROG ARGS...: the program must exit 0
    local name=$1 dir=$2; shift 2
    if out=$(LD_LIBRARY_PATH=$dir "$@" 2>&1); then
        echo "ok: $name: $out"
    else
        echo "FAIL: $name:"; echo "$out"; fail=1
    fi
}
check "a program of this release on the next release's library" "$tmp/next" "$tmp/prog_this" "" "$(port)"
check "a program of the next release on this library" "$build" "$tmp/prog_next" "" "$(port)"
check "... setting the field this library lacks: KVP_ENOTSUP" "$build" "$tmp/prog_next" --set "$(port)"
exit $fail
