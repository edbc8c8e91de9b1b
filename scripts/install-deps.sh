#!/bin/sh
# Install the Debian 12 packages kvpipe needs to build and test. Does nothing
# when they are all present. Run as root (or with sudo available).
set -eu
# Build: compilers, CMake, the libraries kvpipe links (UCX, libsodium and
# libxxhash too).
# Tests: real stores, valgrind, clang for the fuzzers, clang-format for the
# format check, nftables and iproute2 for the network-fault suite, UCX's
# perftest, gnuplot for benchmark plots, and Python's packaging tools for the
# wheel and venv tests, curl for the README's metrics line, libabigail's
# abidiff (and xz) for the ABI check.
PKGS="build-essential cmake pkg-config libzmq3-dev libcurl4-openssl-dev libmicrohttpd-dev
libhiredis-dev libcjson-dev libucx-dev libsodium-dev libxxhash-dev zlib1g-dev
redis-server etcd-server python3 python3-dev python3-numpy valgrind
clang clang-format libclang-rt-14-dev nftables iproute2 ucx-utils gnuplot-nox
python3-venv python3-setuptools python3-wheel python3-build curl abigail-tools xz-utils"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing:$missing" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
