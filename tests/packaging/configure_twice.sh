#!/usr/bin/env bash
# A second configure of a build folder (the README's `make` configures on
# every call) changes no compiler flag and no generated header, so it
# rebuilds nothing. CMake 3.25's pkg_check_modules read libzmq's "-isystem"
# flag one way when it ran pkg-config and another when it reused its cached
# answer, and a second configure rebuilt every object (CMakeLists.txt).
#   configure_twice.sh SOURCE_DIR
set -euo pipefail
src=$1
work=$(mktemp -d /tmp/kvpipe-configure.XXXXXX)
trap 'rm -rf "$work"' EXIT
# The checksums of what decides how each object is compiled.
sums() {
    (cd "$work/b" && find . \( -name flags.make -o -path './include/*.h' \) -print0 |
        sort -z | xargs -0 md5sum)
}
configure() {
    cmake -S "$src" -B "$work/b" -DKVP_WERROR=ON > "$work/$1.log" 2>&1 ||
        { cat "$work/$1.log"; exit 1; }
}
configure first
sums > "$work/first.sum"
cp "$work/b/CMakeFiles/kvpipe_objects.dir/flags.make" "$work/first.flags.make"
configure second
sums > "$work/second.sum"
if ! cmp -s "$work/first.sum" "$work/second.sum"; then
    echo "FAIL: the second configure changed these files (their objects would all be rebuilt):"
    diff "$work/first.sum" "$work/second.sum" | sed -n 's/^> [0-9a-f]*  //p'
    echo "the library's flags, first configure (<) against second (>):"
    diff "$work/first.flags.make" "$work/b/CMakeFiles/kvpipe_objects.dir/flags.make" || true
    exit 1
fi
echo "ok: $(wc -l < "$work/first.sum") flags files and generated headers unchanged by a second configure"
