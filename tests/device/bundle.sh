#!/usr/bin/env bash
# The GPU device bundle (docs/gpu.md, "The device bundle"): everything
# tests/device/run.sh needs on a bare x86-64 Linux machine with a GPU, a newer
# glibc and none of Debian's libraries, in one folder of at most 48 MiB.
#
#     tests/device/bundle.sh [--from BUILD] [--build DIR] DIR
#
# Without --from it configures and builds kvpipe in Release in build-device/
# (--build DIR: elsewhere), only the targets the bundle holds; with --from it
# takes them from an existing build (the ctests bundle the test build's own
# outputs: building a second tree on a 2-core CI machine is slow). Then it
# fills DIR (emptied first):
#
#   run.sh                 the device script (tests/device/run.sh)
#   check_bundle.sh        is the bundle whole? (its first step, and a ctest)
#   bin/                   kvpipe (the CLI), gpu_check, raw_tcp, memcpy_baseline,
#                          rdma and ip (iproute2's, for the soft-RoCE step)
#   lib/                   libkvpipe.so.0.3 and every shared library the
#                          programs and modules here load that is not glibc's
#                          (ldd, transitively): run.sh puts lib/ on
#                          LD_LIBRARY_PATH for the programs; lib/ucx/ holds
#                          UCX's transport modules (UCX finds them beside
#                          libucs, or by UCX_MODULE_DIR), lib/librxe-rdmav34.so
#                          is libibverbs' soft-RoCE provider (RDMAV_DRIVERS)
#   lib/fallback/          libstdc++ and libgcc_s: run.sh adds them only on a
#                          machine that has none (a newer one is compatible,
#                          and PyTorch needs the machine's)
#   python/                kvpipe.abi3.so (CPython >= 3.11; RPATH $ORIGIN/../lib,
#                          so no LD_LIBRARY_PATH is needed to import it) and the
#                          mooncake shim
#   py/                    tests/device/device.py (the vLLM pattern, the pipe,
#                          the scaling, soft-RoCE) and the test helpers it uses
#   double/libfakecuda.so  the CUDA driver's test double, for run.sh --double
#   BUILD_INFO.json        commit, build type, sizes, the newest glibc symbol
#                          version any file here needs, what was left out
#   MANIFEST               every file with its size and sha256
#
# Stripped of debug information. Exit 0, or 1 saying what is missing.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
from="" build="$src/build-device" out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --from) [ $# -ge 2 ] || { echo "bundle.sh: --from needs a build folder" >&2; exit 2; }
                from=$2; shift ;;
        --build) [ $# -ge 2 ] || { echo "bundle.sh: --build needs a folder" >&2; exit 2; }
                 build=$2; shift ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        -*) echo "bundle.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "bundle.sh: one DIR only" >&2; exit 2; }
           out=$1 ;;
    esac
    shift
done
[ -n "$out" ] || { echo "usage: tests/device/bundle.sh [--from BUILD] [--build DIR] DIR" >&2; exit 2; }
SECONDS=0
targets=(kvpipe_cli kvpipe_shared gpu_check kvpipe_python_bundled raw_tcp memcpy_baseline fakecuda)

if [ -z "$from" ]; then
    mkdir -p "$build"
    echo "bundle.sh: building kvpipe (Release) in $build"
    nice -n 5 cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVP_TESTS=ON -DKVP_PYTHON=ON \
        >"$build/bundle-configure.log" 2>&1 ||
        { tail -30 "$build/bundle-configure.log"; echo "bundle.sh: configure failed" >&2; exit 1; }
    nice -n 5 cmake --build "$build" -j"${JOBS:-2}" --target "${targets[@]}" >"$build/bundle-build.log" 2>&1 ||
        { tail -30 "$build/bundle-build.log"; echo "bundle.sh: build failed ($build/bundle-build.log)" >&2; exit 1; }
    from=$build
fi
from=$(cd "$from" && pwd)
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$from/CMakeCache.txt")
build_type=${build_type:-RelWithDebInfo} # CMakeLists.txt's default

need() { [ -e "$1" ] || { echo "bundle.sh: $1 is missing (build the targets: ${targets[*]})" >&2; exit 1; }; }
for f in kvpipe libkvpipe.so tests/gpu_check raw_tcp memcpy_baseline python/bundled/kvpipe.abi3.so \
         tests/libfakecuda.so; do
    need "$from/$f"
done
for tool in ldd strip sha256sum readelf; do
    command -v "$tool" >/dev/null || { echo "bundle.sh: $tool is missing" >&2; exit 1; }
done

case "$out" in /*) ;; *) out=$PWD/$out ;; esac
rm -rf "$out"
mkdir -p "$out"/{bin,lib/ucx,lib/fallback,python,py,double}

cp "$from/kvpipe" "$from/tests/gpu_check" "$from/raw_tcp" "$from/memcpy_baseline" "$out/bin/"
soname=$(readelf -d "$from/libkvpipe.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
cp -L "$from/libkvpipe.so" "$out/lib/$soname"
ln -s "$soname" "$out/lib/libkvpipe.so"
cp "$from/python/bundled/kvpipe.abi3.so" "$out/python/"
cp -r "$src/python/mooncake_shim/mooncake" "$out/python/"
cp "$from/tests/libfakecuda.so" "$out/double/"
cp "$src/tests/device/run.sh" "$src/tests/device/check_bundle.sh" "$out/"
cp "$src/tests/device/device.py" "$src/python/tests/cuda_mem.py" "$src/python/tests/kvpy_testutil.py" "$out/py/"

# UCX's transport modules (verbs, rdmacm, cma) and libibverbs' soft-RoCE
# provider, for the soft-RoCE step; iproute2's rdma and ip to add the device.
libdir=$(dirname "$(ldd "$out/lib/$soname" | awk '$1 ~ /^libucs\.so/ {print $3}')")
left_out=()
if [ -d "$libdir/ucx" ]; then
    for m in "$libdir"/ucx/libuct_*.so.0; do cp -L "$m" "$out/lib/ucx/"; done
else
    left_out+=("UCX modules: none beside $libdir/libucs")
fi
if [ -e "$libdir/libibverbs/librxe-rdmav34.so" ]; then
    cp -L "$libdir/libibverbs/librxe-rdmav34.so" "$out/lib/"
else
    left_out+=("librxe-rdmav34.so: not installed (Debian: ibverbs-providers)")
fi
for tool in rdma ip; do
    if path=$(command -v "$tool"); then cp "$path" "$out/bin/"; else left_out+=("$tool: not installed (iproute2)"); fi
done

# glibc's own libraries stay out: the machine's glibc (newer) serves them.
glibc_lib() {
    case "$1" in
        linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|\
        libresolv.so.*|libutil.so.*|libanl.so.*|libnss_*|libBrokenLocale.so.*|libmvec.so.*|libc_malloc_debug.so.*) return 0 ;;
    esac
    return 1
}
fallback_lib() { case "$1" in libstdc++.so.*|libgcc_s.so.*) return 0 ;; esac; return 1; }

# Every library the ELF files here load, through ldd (transitive). The
# library folder goes first, so ldd sees what run.sh will load.
elves() { find "$out" -type f \( -name '*.so*' -o -perm -u+x \) ! -name '*.py' ! -name '*.sh' -print |
          while read -r f; do [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] && echo "$f"; done; }
missing=0
for pass in 1 2; do
    while read -r elf; do
        while read -r name arrow path _; do
            [ "$arrow" = "=>" ] || continue
            glibc_lib "$name" && continue
            if [ "$path" = "not" ]; then
                echo "bundle.sh: $elf needs $name, which ldd cannot find here" >&2; missing=1; continue
            fi
            [ "${path#"$out"/}" = "$path" ] || continue # one of the bundle's
            dest=$out/lib/$name
            fallback_lib "$name" && dest=$out/lib/fallback/$name
            [ -e "$dest" ] || cp -L "$path" "$dest"
        done < <(LD_LIBRARY_PATH="$out/lib" ldd "$elf" 2>/dev/null)
    done < <(elves)
done
[ "$missing" = 0 ] || exit 1

chmod -R u+w "$out"
while read -r elf; do strip --strip-debug "$elf" 2>/dev/null || true; done < <(elves)

# The newest glibc symbol version anything here needs (but lib/fallback, used
# only on a machine without libstdc++): the device's glibc must be at least
# that.
glibc_needed=$(while read -r elf; do
                   case "$elf" in "$out"/lib/fallback/*) ;; *) readelf -V "$elf" 2>/dev/null ;; esac
               done < <(elves) |
               grep -o 'GLIBC_[0-9][0-9.]*' | sort -t. -k1,1 -k2,2n -k3,3n -u | tail -1)
bytes=$(du -sb "$out" | cut -f1)
commit=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$src" status --porcelain 2>/dev/null | grep -qv '^??' && echo true || echo false)
python3 - "$out/BUILD_INFO.json" "$commit" "$dirty" "$from" "$build_type" "$bytes" "$glibc_needed" \
    "${left_out[@]+"${left_out[@]}"}" <<'EOF'
import json, os, sys, time
path, commit, dirty, build, build_type, size, glibc = sys.argv[1:8]
info = {"commit": commit, "dirty": dirty == "true", "build": build, "build_type": build_type,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "bytes": int(size),
        "glibc_needed": glibc, "left_out": sys.argv[8:],
        "libraries": sorted(os.listdir(os.path.join(os.path.dirname(path), "lib")))}
json.dump(info, open(path, "w"), indent=1)
EOF
(cd "$out" && find . -type f ! -name MANIFEST | sort | while read -r f; do
     printf '%s %s %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "${f#./}"
 done) > "$out/MANIFEST"
bytes=$(du -sb "$out" | cut -f1)
echo "bundle.sh: $out: $(find "$out" -type f | wc -l) files, $((bytes / 1048576)) MiB ($bytes bytes)," \
     "needs glibc >= ${glibc_needed#GLIBC_}; from $from ($build_type) in $SECONDS s"
[ "${#left_out[@]}" = 0 ] || printf 'bundle.sh: left out: %s\n' "${left_out[@]}"
