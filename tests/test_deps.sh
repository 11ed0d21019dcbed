#!/usr/bin/env bash
# The link graph (tools/deps.sh over the build's objects): no symbol defined in two objects, no circle but the cache
# and its policy registry.
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
case $bin in */tests) objs=${bin%/tests} ;; *) objs=build ;; esac
out=$(tools/deps.sh "$objs" 2>&1); rc=$?
echo "$out" | grep -E '^(PASS|FAIL) '
[ $rc -eq 0 ] || echo "$out" | sed -n '1,20p' | sed 's/^/  /'
