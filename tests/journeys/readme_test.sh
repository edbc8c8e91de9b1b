#!/usr/bin/env bash
# The README's commands as acceptance tests: every command of its ```sh
# blocks runs exactly as written, in README order, in one session at the
# repository root (a command ending in & stays running in the background,
# as in a user's shell, until the end). A command that cannot run inside the
# test suite is listed in `excused` below with the reason and where it is
# tested instead. A README command in neither fails the test (so a new one is
# either run or excused on purpose), as does an excused command the README no
# longer has. Each foreground command must exit 0 within its limit; each
# background one must still be running at the end, or have exited 0, and
# exit 0 on SIGTERM (how a user stops a server).
#
# usage: readme_test.sh ROOT BUILD_DIR   (ctest: readme_test)
set -uo pipefail
root=$1
build=$2
limit=${KVPT_README_LIMIT_S:-300} # seconds per command
if ! [ "$build" -ef "$root/build" ]; then
    echo "readme_test: SKIPPED: the README's commands use ./build, this build is $build"
    exit 77
fi
cd "$root" || exit 1

declare -A excused=(
    ["make test"]="the README's test command itself: CI runs it, and this test runs inside it"
    ["make asan"]="make test builds build-asan/ and runs the whole suite there"
    ["make tsan"]="make test builds build-tsan/ and runs the whole suite there"
    ["cmake -S . -B build -DKVP_PYTHON=OFF"]="would reconfigure build/ under the running suite; tests/packaging/options_off.sh builds with the optional parts off"
    ["cmake -S . -B build -DKVP_WITH_REDIS=OFF"]="would reconfigure build/ under the running suite; tests/packaging/options_off.sh builds with the optional parts off"
    ["sudo make install && sudo ldconfig"]="installs into /usr/local; tests/packaging/install_examples.sh installs into a prefix and builds examples/ against it"
    ["cc app.c -o app \$(pkg-config --cflags --libs kvpipe)"]="app.c stands for the reader's program; tests/packaging/install_examples.sh builds examples/ with this line"
    ["target_link_libraries(app PRIVATE kvpipe::kvpipe)"]="a CMake line; tests/packaging/install_examples.sh builds examples/ with find_package"
)

# The commands of the README's sh blocks, one per line: continuations joined,
# comments and blank lines dropped.
mapfile -t cmds < <(awk '
    /^```/ { insh = ($0 == "```sh"); next }
    !insh { next }
    { line = (held != "" ? held " " : "") $0; held = "" }
    line ~ /\\$/ { sub(/[ \t]*\\$/, "", line); held = line; next }
    { sub(/^[ \t]+/, "", line); sub(/[ \t]+#.*$/, "", line); sub(/[ \t]+$/, "", line) }
    line == "" || line ~ /^#/ { next }
    { gsub(/[ \t]+/, " ", line); print line }' README.md)
if [ "${#cmds[@]}" -lt 10 ]; then
    echo "readme_test: FAIL: found only ${#cmds[@]} commands in README.md"
    exit 1
fi

set -m # each background command in its own process group, stopped as a whole
declare -a bg_pids=() bg_cmds=()
failed=0 ran=0 skipped=0
declare -A seen=()
cleanup() { for p in "${bg_pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done; }
trap cleanup EXIT

for cmd in "${cmds[@]}"; do
    if [ -n "${excused[$cmd]+x}" ]; then
        seen[$cmd]=1
        skipped=$((skipped + 1))
        echo "readme_test: SKIPPED: $cmd  -- ${excused[$cmd]}"
        continue
    fi
    ran=$((ran + 1))
    if [[ $cmd == *" &" ]]; then
        echo "readme_test: START: $cmd"
        bash -c "${cmd% &}" &
        bg_pids+=($!)
        bg_cmds+=("$cmd")
        continue
    fi
    echo "readme_test: RUN: $cmd"
    start=$SECONDS
    timeout -k 5 "$limit" bash -c "$cmd"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        echo "readme_test: ok ($((SECONDS - start)) s): $cmd"
    else
        failed=$((failed + 1))
        [ "$rc" -eq 124 ] && rc="timed out after $limit s"
        echo "readme_test: FAIL ($rc): $cmd"
    fi
done

# Background commands: a finite one has had time to finish, or gets until
# the deadline; the servers (they serve until stopped) get SIGTERM at once
# (waiting out the deadline for them cost this serial test 15 s). Each must
# exit 0.
serves='metadata-server|--mode target'
deadline=$((SECONDS + 15))
for i in "${!bg_pids[@]}"; do
    p=${bg_pids[$i]}
    if ! [[ ${bg_cmds[$i]} =~ $serves ]]; then
        while kill -0 "$p" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    fi
    kill -0 "$p" 2>/dev/null && kill -TERM -- "-$p" 2>/dev/null
    wait "$p"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        failed=$((failed + 1))
        echo "readme_test: FAIL (background, exit $rc): ${bg_cmds[$i]}"
    fi
done
bg_pids=()

for cmd in "${!excused[@]}"; do
    if [ -z "${seen[$cmd]+x}" ]; then
        failed=$((failed + 1))
        echo "readme_test: FAIL: excused but no longer in README.md: $cmd"
    fi
done
echo "readme_test: $ran commands run, $skipped excused, $failed failed"
[ "$failed" -eq 0 ]
