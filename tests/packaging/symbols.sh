#!/usr/bin/env bash
# libkvpipe.so exports the public API and nothing else, under the SONAME the
# build promises, and the CLI is a client of that API only.
#   symbols.sh LIBKVPIPE_SO INCLUDE_DIR GENERATED_INCLUDE_DIR SONAME CLI
set -euo pipefail
lib=$1 inc=$2 geninc=$3 soname=$4 cli=$5
fail=0

exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)
other=$(grep -v '^kvp_' <<<"$exported" || true)
if [ -n "$other" ]; then
    echo "FAIL: libkvpipe.so exports symbols outside the kvp_ API:"; echo "$other"; fail=1
fi

# Every function a public header declares with KVP_API is exported.
declared=$(cat "$inc"/kvpipe/*.h "$geninc"/kvpipe/*.h |
           tr '\n' ' ' | grep -o 'KVP_API [^;(]*(' | grep -o 'kvp_[a-z0-9_]*($' | tr -d '(' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
if [ -n "$missing" ]; then
    echo "FAIL: declared with KVP_API but not exported:"; echo "$missing"; fail=1
fi
# ... and every kvp_ function declared at all carries KVP_API (but the static
# inline wrappers that pass a struct's size to a *_size function, docs/abi.md).
all_decl=$(cat "$inc"/kvpipe/*.h "$geninc"/kvpipe/*.h | grep -E '^[A-Za-z][^(#]*\bkvp_[a-z0-9_]+\(' |
           grep -v '^static inline ' |
           grep -o 'kvp_[a-z0-9_]*(' | tr -d '(' | sort -u)
unmarked=$(comm -23 <(echo "$all_decl") <(echo "$declared"))
if [ -n "$unmarked" ]; then
    echo "FAIL: public functions without KVP_API (hidden in libkvpipe.so):"; echo "$unmarked"; fail=1
fi

got=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
if [ "$got" != "$soname" ]; then
    echo "FAIL: SONAME is '$got', expected '$soname'"; fail=1
fi
# The CLI links the shared library (so it can only use what it exports).
if ! grep -q "NEEDED.*\[$soname\]" <<<"$(readelf -d "$cli")"; then
    echo "FAIL: $cli does not link $soname"; fail=1
fi
n=$(wc -l <<<"$exported")
[ $fail = 0 ] && echo "ok: $n symbols exported, all kvp_ and all declared; SONAME $soname"
exit $fail
