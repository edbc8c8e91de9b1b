#!/usr/bin/env bash
# Is a device bundle (tests/device/bundle.sh) whole? Here (ctest device_bundle)
# and on the device (run.sh's first step), the same checks:
#
#     check_bundle.sh DIR [--max-bytes N] [PYTHON...]
#
#   - DIR holds at most N bytes (default 48 MiB);
#   - every ELF file in it resolves every library it needs (ldd, with nothing
#     in the environment but LD_LIBRARY_PATH=DIR/lib:DIR/lib/fallback; the
#     Python module with no LD_LIBRARY_PATH at all: its RPATH) from DIR, but
#     glibc's own and libstdc++/libgcc_s, which may come from the machine;
#   - bin/kvpipe --version runs that way, and the other programs load;
#   - each PYTHON (default: python3 on PATH) imports kvpipe and mooncake.engine
#     from DIR/python with an empty environment, and every library of DIR/lib
#     it maps comes from DIR/lib.
#
# One JSON line {"figure": "bundle_check", ...}; exit 0 when whole, else 1.
set -uo pipefail
dir="" max=$((48 * 1048576)) pythons=()
while [ $# -gt 0 ]; do
    case "$1" in
        --max-bytes) max=$2; shift ;;
        *) if [ -z "$dir" ]; then dir=$1; else pythons+=("$1"); fi ;;
    esac
    shift
done
[ -n "$dir" ] && [ -d "$dir" ] || { echo "usage: check_bundle.sh DIR [--max-bytes N] [PYTHON...]" >&2; exit 2; }
dir=$(cd "$dir" && pwd)
[ "${#pythons[@]}" -gt 0 ] || pythons=("$(command -v python3)")
lib_path="$dir/lib:$dir/lib/fallback"
problems=()
problem() { problems+=("$1"); echo "check_bundle: $1" >&2; }

bytes=$(du -sb "$dir" | cut -f1)
[ "$bytes" -le "$max" ] || problem "the bundle holds $bytes bytes, more than $max"

from_machine_ok() {
    case "$1" in
        linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|\
        libresolv.so.*|libutil.so.*|libanl.so.*|libmvec.so.*|libstdc++.so.*|libgcc_s.so.*) return 0 ;;
    esac
    return 1
}

elves=0
while read -r f; do
    [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
    elves=$((elves + 1))
    case "$f" in
        "$dir"/python/*) out=$(env -i ldd "$f" 2>&1) ;;
        *) out=$(env -i LD_LIBRARY_PATH="$lib_path" ldd "$f" 2>&1) ;;
    esac
    while read -r name arrow path _; do
        [ "$arrow" = "=>" ] || continue
        if [ "$path" = "not" ]; then
            problem "${f#"$dir"/}: $name not found"
        elif [ "${path#"$dir"/}" = "$path" ] && ! from_machine_ok "$name"; then
            problem "${f#"$dir"/}: $name resolved outside the bundle ($path)"
        fi
    done <<<"$out"
done < <(find "$dir" -type f \( -name '*.so*' -o -perm -u+x \) ! -name '*.py' ! -name '*.sh')

version=$(env -i LD_LIBRARY_PATH="$lib_path" "$dir/bin/kvpipe" --version 2>&1) ||
    problem "bin/kvpipe --version: $version"
for prog in gpu_check raw_tcp memcpy_baseline; do
    # Usage errors (exit 2) are fine: the program loaded.
    msg=$(env -i LD_LIBRARY_PATH="$lib_path" "$dir/bin/$prog" --no-such-option 2>&1)
    rc=$?
    [ "$rc" = 2 ] || problem "bin/$prog did not load (exit $rc): ${msg:0:200}"
done

imports=()
for py in "${pythons[@]}"; do
    msg=$(env -i "$py" -S -B -c '
import os, sys
d = sys.argv[1]
sys.path.insert(0, os.path.join(d, "python"))
import kvpipe, mooncake.engine
lib = os.path.join(d, "lib")
ours = set(os.listdir(lib))
bad = set()
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if os.path.basename(path) in ours and os.path.dirname(path) != lib:
        bad.add(path)
if bad:
    sys.exit("maps %s, not the bundle'"'"'s" % " ".join(sorted(bad)))
print("%d.%d" % sys.version_info[:2], kvpipe.__version__)
' "$dir" 2>&1) && imports+=("$msg") || problem "$py: import kvpipe: ${msg: -300}"
done

python3 - "$dir" "$bytes" "$max" "$elves" "$version" "${#problems[@]}" "${problems[@]+"${problems[@]}"}" \
    "--" "${imports[@]+"${imports[@]}"}" <<'EOF'
import json, sys
d, size, cap, elves, version, n = sys.argv[1:7]
rest = sys.argv[7:]
problems, imports = rest[:int(n)], rest[int(n) + 1:]
print(json.dumps({"figure": "bundle_check", "bundle": d, "bytes": int(size), "max_bytes": int(cap),
                  "MiB": round(int(size) / 1048576, 1), "elf_files": int(elves), "kvpipe": version,
                  "python_imports": imports, "problems": problems, "ok": not problems}))
EOF
[ "${#problems[@]}" = 0 ]
