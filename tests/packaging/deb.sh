#!/usr/bin/env bash
# cpack's Debian packages: libkvpipe, libkvpipe-dev and kvpipe hold what they
# should, and (as root, when none of them is installed already) install with
# dpkg -i, work, and leave nothing behind after dpkg -r.
#   deb.sh BUILD_DIR SOURCE_DIR VERSION SOVERSION
set -euo pipefail
build=$1 src=$2 version=$3 soversion=$4
work=$(mktemp -d /tmp/kvpipe-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
arch=$(dpkg --print-architecture)

(cd "$work" && cpack --config "$build/CPackConfig.cmake" -G DEB -B "$work/out" > cpack.log 2>&1) ||
    { cat "$work/cpack.log"; echo "FAIL: cpack"; exit 1; }
for p in libkvpipe libkvpipe-dev kvpipe; do
    [ -f "$work/out/${p}_${version}_${arch}.deb" ] ||
        { ls "$work/out"; echo "FAIL: cpack made no ${p}_${version}_${arch}.deb"; exit 1; }
done
fail=0
# contents PKG: the package's files (not folders), one a line, without the
# leading "./"; symlinks as "path -> target".
contents() {
    dpkg-deb -c "$work/out/${1}_${version}_${arch}.deb" | { grep -v '^d' || true; } |
        awk '{ $1=$2=$3=$4=$5=""; sub(/^ +/, ""); print }' | sed 's|^\./||' | sort
}
check() { # PKG EXPECTED-LINES...: each line must be in PKG (a regex, whole line)
    local pkg=$1; shift
    local got; got=$(contents "$pkg")
    for want in "$@"; do
        grep -qxE "$want" <<<"$got" || { echo "FAIL: $pkg lacks $want"; fail=1; }
    done
    echo "$got" > "$work/$pkg.files"
}
check libkvpipe "usr/lib/libkvpipe\.so\.$soversion -> libkvpipe\.so\.$version" \
    "usr/lib/libkvpipe\.so\.$version"
check libkvpipe-dev "usr/include/kvpipe/kvpipe\.h" "usr/include/kvpipe/version\.h" \
    "usr/include/kvpipe/info\.h" "usr/lib/libkvpipe\.a" "usr/lib/libkvpipe\.so -> libkvpipe\.so\.$soversion" \
    "usr/lib/pkgconfig/kvpipe\.pc" "usr/lib/cmake/kvpipe/kvpipeConfig\.cmake" \
    "usr/lib/cmake/kvpipe/kvpipeConfigVersion\.cmake" "usr/share/doc/kvpipe/LICENSE" \
    "usr/share/doc/kvpipe/examples/target\.c"
check kvpipe "usr/bin/kvpipe"
# Nothing in two packages, and nothing outside /usr.
dups=$(cat "$work"/*.files | sed 's/ -> .*//' | sort | uniq -d)
[ -z "$dups" ] || { echo "FAIL: in more than one package: $dups"; fail=1; }
if grep -v '^usr/' "$work"/*.files; then echo "FAIL: files outside /usr"; fail=1; fi
# The runtime package holds the library only; the CLI package the CLI only.
[ "$(wc -l < "$work/libkvpipe.files")" = 2 ] || { echo "FAIL: libkvpipe holds more"; cat "$work/libkvpipe.files"; fail=1; }
[ "$(wc -l < "$work/kvpipe.files")" = 1 ] || { echo "FAIL: kvpipe holds more"; cat "$work/kvpipe.files"; fail=1; }
# Dependencies: Debian's libraries for libkvpipe; libkvpipe for the others.
deps=$(dpkg-deb -f "$work/out/libkvpipe_${version}_${arch}.deb" Depends)
for d in libzmq5 libcjson1 libcurl4 libmicrohttpd12 libhiredis; do
    grep -q "$d" <<<"$deps" || { echo "FAIL: libkvpipe does not depend on $d: $deps"; fail=1; }
done
for p in libkvpipe-dev kvpipe; do
    dpkg-deb -f "$work/out/${p}_${version}_${arch}.deb" Depends | grep -q "libkvpipe (= $version)" ||
        { echo "FAIL: $p does not depend on libkvpipe (= $version)"; fail=1; }
done
[ $fail = 0 ] || exit 1
echo "ok: libkvpipe, libkvpipe-dev, kvpipe: file lists and dependencies"

if [ "$(id -u)" != 0 ]; then echo "SKIP: dpkg -i/-r needs root"; exit 77; fi
for p in libkvpipe libkvpipe-dev kvpipe; do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
        echo "SKIP: $p is installed on this machine already; not touching it"; exit 77
    fi
done
# From here the packages are on the system: always remove them again.
cleanup() {
    dpkg -r kvpipe libkvpipe-dev libkvpipe > /dev/null 2>&1 || true
    dpkg -P kvpipe libkvpipe-dev libkvpipe > /dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
dpkg -i "$work"/out/*.deb > "$work/dpkg-i.log" 2>&1 || { cat "$work/dpkg-i.log"; echo "FAIL: dpkg -i"; exit 1; }
[ "$(/usr/bin/kvpipe --version)" = "kvpipe $version" ] || { echo "FAIL: /usr/bin/kvpipe"; exit 1; }
[ "$(pkg-config --modversion kvpipe)" = "$version" ] || { echo "FAIL: pkg-config after dpkg -i"; exit 1; }
# A client built against the system install (no paths given) runs.
cc -o "$work/initiator" "$src/examples/initiator.c" $(pkg-config --cflags --libs kvpipe) ||
    { echo "FAIL: compiling against the installed package"; exit 1; }
out=$("$work/initiator" 2>&1 || true)
grep -q usage <<<"$out" || { echo "FAIL: the client does not run: $out"; exit 1; }
# (/lib is /usr/lib on a merged-/usr system.)
# (A pipe into grep -q fails under pipefail when ldd is still writing: SIGPIPE.)
linked=$(ldd "$work/initiator")
grep -qE "libkvpipe.so.$soversion => (/usr)?/lib/libkvpipe.so.$soversion" <<<"$linked" ||
    { echo "FAIL: the client does not load /usr/lib/libkvpipe.so.$soversion: $linked"; exit 1; }
echo "ok: dpkg -i; /usr/bin/kvpipe and a client built with pkg-config run"
dpkg -r kvpipe libkvpipe-dev libkvpipe > "$work/dpkg-r.log" 2>&1 || { cat "$work/dpkg-r.log"; echo "FAIL: dpkg -r"; exit 1; }
left=""
for f in $(cat "$work"/*.files | sed 's/ -> .*//'); do
    [ -e "/$f" ] || [ -L "/$f" ] && left="$left /$f"
done
[ -d /usr/include/kvpipe ] && left="$left /usr/include/kvpipe"
[ -d /usr/lib/cmake/kvpipe ] && left="$left /usr/lib/cmake/kvpipe"
[ -z "$left" ] || { echo "FAIL: left after dpkg -r:$left"; exit 1; }
echo "ok: dpkg -r removed every file"
# libkvpipe's maintainer scripts (ldconfig) keep it known to dpkg until purged.
dpkg -P kvpipe libkvpipe-dev libkvpipe > "$work/dpkg-P.log" 2>&1 || { cat "$work/dpkg-P.log"; echo "FAIL: dpkg -P"; exit 1; }
if dpkg-query -W libkvpipe libkvpipe-dev kvpipe > /dev/null 2>&1; then
    echo "FAIL: dpkg still knows the packages after dpkg -P"; exit 1
fi
echo "ok: dpkg -P: dpkg knows none of them"
