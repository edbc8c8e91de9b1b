#!/bin/sh
# Fail when a commit since BASE has a subject over 72 characters (the rule
# scripts/hooks/commit-msg keeps as one commits; README, "Tests"). History
# before BASE, the tip of main when the rule came in, is not judged. Only
# the first-parent line from HEAD is: a merge, and the commits it brings
# from its other side, pass (they were judged on their own branch, or
# predate the rule). Outside a git checkout, or in one that lacks BASE (a
# shallow clone, a tarball's tree), it says so and passes.
#   check-subjects.sh [REV]     (default HEAD)
set -eu
cd "$(dirname "$0")/.."
base=982aadeeecde146b74b5c8a57a50ae8a390f0bbf
max=72
rev=${1:-HEAD}
if ! git rev-parse -q --verify "$rev^{commit}" >/dev/null 2>&1; then
    echo "check-subjects: not a git checkout: not checked"
    exit 0
fi
if ! git rev-parse -q --verify "$base^{commit}" >/dev/null 2>&1; then
    echo "check-subjects: $base is not in this clone (shallow?): not checked"
    exit 0
fi
if ! git merge-base --is-ancestor "$base" "$rev"; then
    echo "check-subjects: $rev does not descend from $base: not checked"
    exit 0
fi
tab=$(printf '\t')
bad=$(git log --first-parent --no-merges --format="%h$tab%s" "$base..$rev" |
      while IFS=$tab read -r hash subject; do
          # Characters, not bytes (where the locale exists; else bytes: stricter).
          len=$(printf '%s' "$subject" | LC_ALL=C.UTF-8 wc -m)
          [ "$len" -le "$max" ] || echo "$hash ($len) $subject"
      done)
if [ -n "$bad" ]; then
    echo "check-subjects: subjects over $max characters (say what changed in at most $max;"
    echo "the story goes in the body; git rebase -i to reword):"
    echo "$bad"
    exit 1
fi
n=$(git rev-list --first-parent --no-merges --count "$base..$rev")
echo "check-subjects: $n commits since ${base%"${base#???????}"}, every subject at most $max characters"
