#!/usr/bin/env bash
# Install the build into a fresh prefix, check what landed, build examples/
# against the installed package (pkg-config; find_package shared and static)
# and run the programs of one build against those of another.
#   install_examples.sh BUILD_DIR SOURCE_DIR VERSION SOVERSION
set -euo pipefail
build=$1 src=$2 version=$3 soversion=$4
work=$(mktemp -d /tmp/kvpipe-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
. "$(dirname "$0")/lib.sh"
prefix=$work/prefix

cmake --install "$build" --prefix "$prefix" > "$work/install.log"

# What an install holds, exactly (docs and examples by pattern).
(cd "$prefix" && find . -type f -o -type l | sed 's|^\./||' | grep -v '^share/doc/kvpipe/' |
    sed 's/-[a-z]*\.cmake$/-CONFIG.cmake/' | sort) > "$work/files"
cat > "$work/expected" <<LIST
bin/kvpipe
include/kvpipe/engine.h
include/kvpipe/export.h
include/kvpipe/info.h
include/kvpipe/kvpipe.h
include/kvpipe/metadata_server.h
include/kvpipe/metrics.h
include/kvpipe/pipe.h
include/kvpipe/status.h
include/kvpipe/tensor.h
include/kvpipe/version.h
lib/cmake/kvpipe/kvpipeConfig.cmake
lib/cmake/kvpipe/kvpipeConfigVersion.cmake
lib/cmake/kvpipe/kvpipeStaticTargets-CONFIG.cmake
lib/cmake/kvpipe/kvpipeStaticTargets.cmake
lib/cmake/kvpipe/kvpipeTargets-CONFIG.cmake
lib/cmake/kvpipe/kvpipeTargets.cmake
lib/libkvpipe.a
lib/libkvpipe.so
lib/libkvpipe.so.$soversion
lib/libkvpipe.so.$version
lib/pkgconfig/kvpipe.pc
LIST
# Mooncake's C API (compat/mooncake), in a build with KVP_MOONCAKE_C.
mooncake=0
[ -e "$build/compat/mooncake/libkvpipe_mooncake.so" ] && mooncake=1
if [ $mooncake = 1 ]; then
    cat >> "$work/expected" <<LIST
include/kvpipe/mooncake/transfer_engine_c.h
lib/cmake/KvpipeMooncake/KvpipeMooncakeConfig.cmake
lib/cmake/KvpipeMooncake/KvpipeMooncakeConfigVersion.cmake
lib/cmake/KvpipeMooncake/KvpipeMooncakeTargets-CONFIG.cmake
lib/cmake/KvpipeMooncake/KvpipeMooncakeTargets.cmake
lib/libkvpipe_mooncake.so
lib/libkvpipe_mooncake.so.$soversion
lib/libkvpipe_mooncake.so.$version
lib/pkgconfig/kvpipe-mooncake.pc
LIST
fi
# Public headers in the tree must all be installed (a new one needs no edit
# here only if it lands in include/kvpipe/).
for h in "$src"/include/kvpipe/*.h; do
    grep -qx "include/kvpipe/$(basename "$h")" "$work/expected" ||
        echo "include/kvpipe/$(basename "$h")" >> "$work/expected"
done
sort -o "$work/expected" "$work/expected"
if ! diff -u "$work/expected" "$work/files"; then
    echo "FAIL: installed files differ from the expected list (- expected, + installed)"; exit 1
fi
for f in README.md CHANGELOG.md LICENSE engine.md pipe.md examples/target.c examples/Makefile \
         examples/CMakeLists.txt examples/common.h; do
    [ -f "$prefix/share/doc/kvpipe/$f" ] || { echo "FAIL: share/doc/kvpipe/$f not installed"; exit 1; }
done
echo "ok: install holds the expected files"
"$prefix/bin/kvpipe" --version | grep -qx "kvpipe $version" || { echo "FAIL: installed CLI"; exit 1; }

# pkg-config: the version, and a client that links -lkvpipe alone.
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
[ "$(pkg-config --modversion kvpipe)" = "$version" ] || { echo "FAIL: pkg-config version"; exit 1; }
[ "$(pkg-config --libs kvpipe | xargs)" = "-L$prefix/lib -lkvpipe" ] ||
    { echo "FAIL: pkg-config --libs is '$(pkg-config --libs kvpipe)'"; exit 1; }
# libkvpipe.a with what pkg-config --static adds (Libs.private).
cc -o "$work/initiator-static" "$src/examples/initiator.c" $(pkg-config --cflags kvpipe) \
    $(pkg-config --static --libs kvpipe | sed 's/-lkvpipe/-l:libkvpipe.a/') ||
    { echo "FAIL: linking libkvpipe.a with pkg-config --static"; exit 1; }
grep -q 'NEEDED.*libkvpipe' <<<"$(readelf -d "$work/initiator-static")" &&
    { echo "FAIL: the static client links libkvpipe.so"; exit 1; }
make -s -C "$src/examples" OUT="$work/pc" > "$work/make.log" 2>&1 ||
    { cat "$work/make.log"; echo "FAIL: examples with pkg-config"; exit 1; }
needed=$(readelf -d "$work/pc/initiator" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')
[ "$needed" = "libc.so.6 libkvpipe.so.$soversion " ] ||
    { echo "FAIL: a pkg-config client needs '$needed', not just libkvpipe"; exit 1; }
echo "ok: examples built with pkg-config; a client needs only libkvpipe.so.$soversion"

# find_package: kvpipe::kvpipe, and kvpipe::kvpipe_static; the version file
# refuses another minor version.
unset PKG_CONFIG_PATH
for variant in shared static; do
    static=OFF; [ $variant = static ] && static=ON
    cmake -S "$src/examples" -B "$work/cm-$variant" -DCMAKE_PREFIX_PATH="$prefix" \
        -DKVP_EXAMPLES_STATIC=$static > "$work/cm-$variant.log" 2>&1 &&
    cmake --build "$work/cm-$variant" >> "$work/cm-$variant.log" 2>&1 ||
        { cat "$work/cm-$variant.log"; echo "FAIL: examples with find_package ($variant)"; exit 1; }
done
grep -q 'NEEDED.*libkvpipe' <<<"$(readelf -d "$work/cm-static/target")" &&
    { echo "FAIL: the static example links libkvpipe.so"; exit 1; }
mkdir -p "$work/badver"
cat > "$work/badver/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(v LANGUAGES C)
find_package(kvpipe 99.0 QUIET)
if(kvpipe_FOUND)
  message(FATAL_ERROR "kvpipe 99.0 found")
endif()
CM
cmake -S "$work/badver" -B "$work/badver/b" -DCMAKE_PREFIX_PATH="$prefix" > "$work/badver.log" 2>&1 ||
    { cat "$work/badver.log"; echo "FAIL: the version file accepts 99.0"; exit 1; }
echo "ok: examples built with find_package (kvpipe::kvpipe, kvpipe::kvpipe_static)"

# Programs of different builds against each other, over P2PHANDSHAKE.
base=$(free_port_block 400)
run_pair "target(pkg-config) <- initiator(find_package)" \
    "$work/pc/target" "127.0.0.1:$base" -- "$work/cm-shared/initiator" "127.0.0.1:$base"
run_pair "target(static) <- initiator(pkg-config)" \
    "$work/cm-static/target" "127.0.0.1:$((base + 1))" -- "$work/pc/initiator" "127.0.0.1:$((base + 1))"
run_pair "target(find_package) <- initiator(pkg-config --static)" \
    "$work/cm-shared/target" "127.0.0.1:$((base + 2))" -- "$work/initiator-static" "127.0.0.1:$((base + 2))"
run_pair "target(pkg-config) <- poll_initiator(find_package)" \
    "$work/pc/target" "127.0.0.1:$((base + 3))" -- "$work/cm-shared/poll_initiator" "127.0.0.1:$((base + 3))"
cat > "$work/pipe.json" <<JSON
{"prefill_url": "127.0.0.1:$((base + 20))", "decode_url": "127.0.0.1:$((base + 220))",
 "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
JSON
run_pair "pipe_receiver(pkg-config) <- pipe_sender(find_package)" \
    "$work/pc/pipe_receiver" "$work/pipe.json" 50 -- "$work/cm-shared/pipe_sender" "$work/pipe.json" 50

# Mooncake's C API: a program written against Mooncake's transfer_engine_c.h,
# built unchanged against the installed kvpipe-mooncake (pkg-config, and
# find_package(KvpipeMooncake)), the two builds run against each other.
if [ $mooncake = 1 ]; then
    prog=$src/tests/compat/mooncake_c_api_prog.c
    export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
    [ "$(pkg-config --modversion kvpipe-mooncake)" = "$version" ] ||
        { echo "FAIL: pkg-config kvpipe-mooncake version"; exit 1; }
    cc -o "$work/mc-pc" "$prog" $(pkg-config --cflags --libs kvpipe-mooncake) \
        -Wl,-rpath,"$prefix/lib" || { echo "FAIL: the Mooncake C API program with pkg-config"; exit 1; }
    unset PKG_CONFIG_PATH
    mkdir -p "$work/mc-cm"
    cat > "$work/mc-cm/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.18)
project(mc LANGUAGES C)
find_package(KvpipeMooncake $version REQUIRED)
add_executable(mc_prog $prog)
target_link_libraries(mc_prog PRIVATE KvpipeMooncake::KvpipeMooncake)
CM
    cmake -S "$work/mc-cm" -B "$work/mc-cm/b" -DCMAKE_PREFIX_PATH="$prefix" > "$work/mc-cm.log" 2>&1 &&
    cmake --build "$work/mc-cm/b" >> "$work/mc-cm.log" 2>&1 ||
        { cat "$work/mc-cm.log"; echo "FAIL: the Mooncake C API program with find_package"; exit 1; }
    needed=$(readelf -d "$work/mc-pc" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')
    [ "$needed" = "libc.so.6 libkvpipe_mooncake.so.$soversion " ] ||
        { echo "FAIL: the Mooncake C API program needs '$needed'"; exit 1; }
    KVPIPE_DISABLE_SHM=1 run_pair "mooncake target(pkg-config) <- initiator(find_package)" \
        "$work/mc-pc" target P2PHANDSHAKE 127.0.0.1 "$work/mc-info" -- \
        "$work/mc-cm/b/mc_prog" initiator P2PHANDSHAKE 127.0.0.1 "$work/mc-info"
    # Linked as NIXL's plugin links it, -ltransfer_engine, through a symlink in
    # a folder of its own (docs/mooncake-c-api.md): the program records the
    # library's SONAME, libkvpipe_mooncake.so.N, and finds it through the one
    # rpath the doc gives, with no LD_LIBRARY_PATH.
    mkdir -p "$work/te"
    ln -s "$prefix/lib/libkvpipe_mooncake.so" "$work/te/libtransfer_engine.so"
    export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
    cc -o "$work/mc-te" "$prog" $(pkg-config --cflags kvpipe-mooncake) -L"$work/te" \
        -ltransfer_engine -Wl,-rpath,"$(pkg-config --variable=libdir kvpipe-mooncake)" ||
        { echo "FAIL: the Mooncake C API program with -ltransfer_engine"; exit 1; }
    unset PKG_CONFIG_PATH
    (unset LD_LIBRARY_PATH; ldd "$work/mc-te") | grep -q "not found" &&
        { echo "FAIL: -ltransfer_engine: $(ldd "$work/mc-te" | grep 'not found')"; exit 1; }
    KVPIPE_DISABLE_SHM=1 run_pair "mooncake target(-ltransfer_engine) <- initiator(pkg-config)" \
        env -u LD_LIBRARY_PATH "$work/mc-te" target P2PHANDSHAKE 127.0.0.1 "$work/mc-info2" -- \
        "$work/mc-pc" initiator P2PHANDSHAKE 127.0.0.1 "$work/mc-info2"
fi
echo "ok: install, examples and their runs"
