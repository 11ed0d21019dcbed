#!/usr/bin/env bash
# The link graph of kvlab's objects, from nm: for each object, the objects whose symbols it uses ("a -> b": a calls or
# reads something b defines). Then the checks the code's layout promises: no function defined in two objects, and no
# circle in the graph other than the cache and its policy registry (kv <-> policies). Exit 1 when a check fails.
# Usage: tools/deps.sh [BUILD_DIR]   (default build/, after make)
set -u
cd "$(dirname "$0")/.."
b=${1:-build}
objs=$(ls "$b"/*.o 2>/dev/null | grep -v -e attn_twin -e test_attn) || true
[ -n "$objs" ] || { echo "deps: no objects in $b (run make first)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for o in $objs; do
    n=$(basename "$o" .o)
    nm -g --defined-only "$o" | awk '$2 ~ /^[TDBRC]$/ {print $3}' | sort -u >"$tmp/$n.def"
    nm -u "$o" | awk '{print $2}' | sort -u >"$tmp/$n.use"
done
status=0
echo "link graph (a -> b: a uses b's symbols):"
for u in "$tmp"/*.use; do
    a=$(basename "$u" .use); deps=""
    for d in "$tmp"/*.def; do
        bname=$(basename "$d" .def)
        [ "$bname" = "$a" ] && continue
        [ -n "$(comm -12 "$u" "$d")" ] && deps="$deps $bname"
    done
    echo "  $a ->$deps"
    echo "$a$deps" >>"$tmp/edges"
done
dups=$(cat "$tmp"/*.def | sort | uniq -d | grep -v -e '^main$' -e '^_' || true)
if [ -n "$dups" ]; then echo "FAIL defined in more than one object: $(echo $dups)"; status=1
else echo "PASS no symbol is defined in two objects"; fi
# circles: a depth-first search over the edges, the kv <-> policies pair allowed
python3 - "$tmp/edges" <<'PY' || status=1
import sys
g = {}
for line in open(sys.argv[1]):
    w = line.split()
    g[w[0]] = [x for x in w[1:] if x != w[0]]
allowed = {frozenset(("kv", "policies"))}
def edge_ok(a, b): return frozenset((a, b)) in allowed
bad, state, stack = [], {}, []
def dfs(a):
    state[a] = 1; stack.append(a)
    for b in g.get(a, []):
        if edge_ok(a, b) and a in g.get(b, []): continue
        if state.get(b) == 1: bad.append(stack[stack.index(b):] + [b])
        elif b not in state: dfs(b)
    stack.pop(); state[a] = 2
for a in sorted(g):
    if a not in state: dfs(a)
if bad:
    print("FAIL circles in the link graph: " + "; ".join(" -> ".join(c) for c in bad)); sys.exit(1)
print("PASS no circle in the link graph but kv <-> policies")
PY
exit $status
