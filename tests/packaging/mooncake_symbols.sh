#!/usr/bin/env bash
# libkvpipe_mooncake.so exports exactly the functions its transfer_engine_c.h
# declares (Mooncake's C API), under the SONAME the build promises, and
# reaches kvpipe through libkvpipe.so (whose own exports symbols.sh checks).
#   mooncake_symbols.sh LIBKVPIPE_MOONCAKE_SO HEADER SONAME KVPIPE_SONAME
set -euo pipefail
lib=$1 header=$2 soname=$3 kvpipe_soname=$4
fail=0
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)
# Declarations: a line that starts a type and names a function.
declared=$(grep -E '^[a-z][a-z_0-9 ]*[ *]([A-Za-z0-9_]+)\(' "$header" |
           sed -E 's/^[a-z][a-z_0-9 ]*[ *]([A-Za-z0-9_]+)\(.*/\1/' | sort -u)
[ -n "$declared" ] || { echo "FAIL: no function found in $header"; exit 1; }
if [ "$exported" != "$declared" ]; then
    echo "FAIL: exports differ from the header's functions (- header, + exported):"
    diff <(echo "$declared") <(echo "$exported") || true
    fail=1
fi
got=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$got" = "$soname" ] || { echo "FAIL: SONAME is '$got', expected '$soname'"; fail=1; }
grep -q "NEEDED.*\[$kvpipe_soname\]" <<<"$(readelf -d "$lib")" ||
    { echo "FAIL: $lib does not link $kvpipe_soname"; fail=1; }
[ $fail = 0 ] && echo "ok: $(wc -l <<<"$exported") symbols exported, exactly the header's; SONAME $soname"
exit $fail
