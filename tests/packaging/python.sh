#!/usr/bin/env bash
# The Python package as a user gets it: for Debian's /usr/bin/python3 a wheel
# from `python3 -m build --wheel --no-isolation`, for the python3 first on PATH
# (a pyenv one, where it differs) `pip install .`, each offline (--no-index)
# into a fresh venv with the mooncake shim beside it; then the Python tests run
# against the installed package (no PYTHONPATH, outside the tree), pip show
# lists it and pip uninstall removes every file.
#   python.sh SOURCE_DIR VERSION KVPIPE_CLI KVPY_PIPE_PEER
set -euo pipefail
src=$1 version=$2 cli=$3 peer=$4
work=$(mktemp -d /tmp/kvpipe-python.XXXXXX)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

interpreters=(/usr/bin/python3)
other=$(command -v python3 || true)
if [ -n "$other" ] && [ "$("$other" -c 'import sys; print(sys.base_prefix)')" != \
                        "$(/usr/bin/python3 -c 'import sys; print(sys.base_prefix)')" ]; then
    interpreters+=("$other")
fi

n=0
for py in "${interpreters[@]}"; do
    n=$((n + 1))
    venv=$work/venv$n
    # Debian's interpreter sees Debian's numpy (python3-numpy), which test_pipe
    # needs; the venv's own site-packages still come first.
    if [ "$py" = /usr/bin/python3 ]; then
        "$py" -m venv --system-site-packages "$venv"
    else
        "$py" -m venv "$venv"
    fi
    log=$work/install$n.log
    if [ "$py" = /usr/bin/python3 ]; then
        how="python3 -m build --wheel --no-isolation; pip install the wheel"
        (cd "$work" && "$py" -m build --wheel --no-isolation --outdir "$work/dist$n" "$src") > "$log" 2>&1 &&
            "$venv/bin/pip" install --no-index "$work/dist$n"/kvpipe-"$version"-*.whl >> "$log" 2>&1 ||
            { cat "$log"; echo "FAIL: $py: $how"; exit 1; }
    else
        how="pip install ."
        (cd "$src" && "$venv/bin/pip" install --no-index .) > "$log" 2>&1 ||
            { cat "$log"; echo "FAIL: $py: $how"; exit 1; }
    fi
    "$venv/bin/pip" install --no-index "$src/python/mooncake_shim" >> "$log" 2>&1 ||
        { cat "$log"; echo "FAIL: $py: pip install python/mooncake_shim"; exit 1; }
    "$venv/bin/pip" show kvpipe > "$work/show$n" && grep -qx "Version: $version" "$work/show$n" ||
        { cat "$work/show$n"; echo "FAIL: pip show kvpipe"; exit 1; }
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
    where=$(cd "$work" && "$venv/bin/python" -c 'import kvpipe, mooncake; print(kvpipe.__file__, mooncake.__file__)')
    for f in $where; do
        case "$f" in "$site"/*) ;; *) echo "FAIL: imported $f, not from $site"; exit 1 ;; esac
    done
    [ -f "$site/kvpipe-stubs/__init__.pyi" ] || { echo "FAIL: no stubs in $site"; exit 1; }
    echo "ok: $py ($("$py" -c 'import platform; print(platform.python_version())')): $how; imports from the venv"

    for t in "$src"/python/tests/test_*.py; do
        if grep -q '^import numpy' "$t" && ! "$venv/bin/python" -c 'import numpy' 2>/dev/null; then
            echo "SKIP: $(basename "$t"): this interpreter has no numpy"
            continue
        fi
        out=$work/$(basename "$t" .py).$n.log
        (cd "$work" && KVPIPE_CLI=$cli KVPY_PIPE_PEER=$peer PYTHONDONTWRITEBYTECODE=1 \
            timeout 300 "$venv/bin/python" "$t") > "$out" 2>&1 ||
            { cat "$out"; echo "FAIL: $py: $(basename "$t") against the installed package"; exit 1; }
        echo "ok:   $(basename "$t"): $(grep SUMMARY "$out" || tail -1 "$out")"
    done

    "$venv/bin/pip" uninstall -y kvpipe kvpipe-mooncake-shim > "$work/uninstall$n.log" 2>&1 ||
        { cat "$work/uninstall$n.log"; echo "FAIL: pip uninstall"; exit 1; }
    left=$(ls "$site" | grep -iE '^(kvpipe|mooncake)' || true)
    [ -z "$left" ] || { echo "FAIL: left after pip uninstall: $left"; exit 1; }
    echo "ok: pip uninstall removed every file"
done
