#!/usr/bin/env bash
# A build with every optional part off (KVP_WITH_*=OFF, KVP_MOONCAKE_C=OFF): it configures and
# links without libcurl, hiredis and libmicrohttpd, and each store and the HTTP
# server left out answers with "not built in", naming its CMake option.
#   options_off.sh SOURCE_DIR
set -euo pipefail
src=$1
work=$(mktemp -d /tmp/kvpipe-options.XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake -S "$src" -B "$work/b" -DKVP_WERROR=ON -DKVP_TESTS=OFF -DKVP_PYTHON=OFF \
    -DKVP_WITH_HTTP=OFF -DKVP_WITH_ETCD=OFF -DKVP_WITH_REDIS=OFF -DKVP_WITH_HTTP_SERVER=OFF \
    -DKVP_MOONCAKE_C=OFF > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/b" -j"${JOBS:-2}" --target kvpipe_cli > "$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
fail=0
# KVP_MOONCAKE_C=OFF: no Mooncake C API library to build.
if cmake --build "$work/b" --target kvpipe_mooncake > /dev/null 2>&1; then
    echo "FAIL: KVP_MOONCAKE_C=OFF still builds libkvpipe_mooncake"; fail=1
fi
needed=$(readelf -d "$work/b/libkvpipe.so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')
case "$needed" in
*curl* | *hiredis* | *microhttpd*) echo "FAIL: libkvpipe.so still needs: $needed"; fail=1 ;;
esac
cli=$work/b/kvpipe
# expect_error NAME OPTION STATUS CMD...: CMD fails with a line saying STATUS
# (kvp_strerror's text; "" for a command that prints none), "not built in" and
# OPTION.
expect_error() {
    local name=$1 option=$2 status=$3; shift 3
    local out rc=0
    out=$("$@" 2>&1) || rc=$?
    # The error itself ("... not built in: reconfigure ... -DOPTION=ON"), not
    # the list kvpipe info prints first.
    local line
    line=$(grep -E "not built in[:;].*-D$option=ON" <<<"$out" || true)
    grep -q "$status" <<<"$line" || line=""
    if [ $rc = 0 ] || [ -z "$line" ]; then
        echo "FAIL: $name (rc $rc) does not say '$option ... not built in':"; echo "$out"; fail=1
    else
        echo "ok: $name: $line"
    fi
}
expect_error "redis store" KVP_WITH_REDIS "not supported" "$cli" info --metadata-server redis://127.0.0.1:1
expect_error "etcd store" KVP_WITH_ETCD "not supported" "$cli" info --metadata-server etcd://127.0.0.1:1
expect_error "bare h:p (etcd)" KVP_WITH_ETCD "not supported" "$cli" info --metadata-server 127.0.0.1:1
expect_error "http store" KVP_WITH_HTTP "not supported" "$cli" info --metadata-server http://127.0.0.1:1/metadata
expect_error "metadata server" KVP_WITH_HTTP_SERVER "not supported" "$cli" metadata-server --port 0
# An engine is refused too.
expect_error "bench on redis" KVP_WITH_REDIS "" "$cli" bench --mode target \
    --metadata-server redis://127.0.0.1:1 --local-server-name 127.0.0.1:0 --duration 1
# What still works: P2PHANDSHAKE, and info lists what is left out.
out=$("$cli" info --metadata-server P2PHANDSHAKE) || { echo "FAIL: info P2PHANDSHAKE"; fail=1; }
for s in "redis not built in (configure with -DKVP_WITH_REDIS=ON" "libmicrohttpd" "tcp   available"; do
    grep -qF "$s" <<<"$out" || { echo "FAIL: kvpipe info lacks '$s':"; echo "$out"; fail=1; }
done
[ $fail = 0 ] && echo "ok: a build with every KVP_WITH_* off"
exit $fail
