#!/usr/bin/env bash
# tools/leaderboard.py on scripted -m task records (no model): the mean score per (task, kv), full's mean on the
# same items, and the compression ratio (each item's kv_live_bytes over full's, averaged; --bytes peak: all 9999 here), worked by hand below;
# a policy without full beside it has no ratio; no task record is an error.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/leaderboard; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
rec() {   # TASK KV ITEM SCORE BYTES
    printf '{"mode":"task","task":"%s","kv":"%s","length":1024,"depth":0.5,"item":%d,"score":%s,"exact":0,"kv_live_bytes":%d,"kv_peak_live_bytes":9999}\n' "$@"
}
{
    rec vt full 0 1 1000; rec vt full 1 0.5 2000
    rec vt sink:64 0 0 250; rec vt sink:64 1 1 1000       # mean 0.5; ratios 0.25, 0.5 -> 0.375
    rec vt h2o:64,recent=8 0 0.25 100; rec vt h2o:64,recent=8 1 0.25 100   # mean 0.25; ratios 0.1, 0.05 -> 0.075
    rec cwe sink:64 0 0.3 10                              # no full for cwe: ratio null
    echo '{"mode":"ppl","kv":"full"}'
    # a shared context's records: a task of their own ("niah_multikey/turns"), matched with full by question
    for q in 0 1; do
        printf '{"mode":"task","task":"niah_multikey","kv":"full","length":1024,"depth":0.5,"shared":"turns","question":%d,"item":0,"score":1,"kv_live_bytes":%d}\n' $q $((1000 + 200 * q))
        printf '{"mode":"task","task":"niah_multikey","kv":"sink:64","length":1024,"depth":0.5,"shared":"turns","question":%d,"item":0,"score":%d,"kv_live_bytes":300}\n' $q $((1 - q))
    done   # sink: mean 0.5; ratios 0.3, 0.25 -> 0.275
} >"$tmp/r.jsonl"
python3 tools/leaderboard.py "$tmp/r.jsonl" --jsonl "$tmp/lb.jsonl" --dat "$tmp/lb.dat" >"$tmp/table" 2>"$tmp/err" ||
    fail "leaderboard.py exited $?: $(cat "$tmp/err")"
python3 - "$tmp/lb.jsonl" <<'PY'
import json, sys
rows = {(r["task"], r["kv"]): r for r in map(json.loads, open(sys.argv[1])) if r["length"] == 1024}
want = {("vt", "full"): (2, 0.75, 0.75, 1.0), ("vt", "sink:64"): (2, 0.5, 0.75, 0.375),
        ("vt", "h2o:64,recent=8"): (2, 0.25, 0.75, 0.075), ("cwe", "sink:64"): (1, 0.3, None, None),
        ("niah_multikey/turns", "full"): (2, 1.0, 1.0, 1.0), ("niah_multikey/turns", "sink:64"): (2, 0.5, 1.0, 0.275)}
bad = []
for k, (n, mean, fm, ratio) in want.items():
    r = rows.get(k)
    close = lambda a, b: (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-12)
    if not r or r["items"] != n or not close(r["mean"], mean) or not close(r["full_mean"], fm) or not close(r["bytes_ratio"], ratio):
        bad.append(f"{k}: {r}")
pol = rows.get(("vt", "h2o:64,recent=8"), {}).get("policy")
print(("PASS" if not bad and len(rows) == 6 and pol == "h2o" else "FAIL") +
      f" leaderboard rows: means, full's means and bytes ratios as worked by hand ({len(rows)} rows, policy {pol})"
      + (": " + "; ".join(bad) if bad else ""))
PY
n_blocks=$(grep -c '^# ' "$tmp/lb.dat")
[ "$n_blocks" = 5 ] && grep -q '^0.375000 0.500000 sink:64$' "$tmp/lb.dat" &&
    pass "the plot table has a block per (task, length, policy) with a ratio (5), sink's point at 0.375, 0.5" ||
    fail "lb.dat: $(cat "$tmp/lb.dat")"
grep -q '^| vt | 1024 | `sink:64` | 2 | 0.500 | 0.750 | 0.375 |$' "$tmp/table" && pass "the markdown table row of sink:64" ||
    fail "table: $(cat "$tmp/table")"
echo '{"mode":"ppl","kv":"full"}' >"$tmp/none.jsonl"
python3 tools/leaderboard.py "$tmp/none.jsonl" >/dev/null 2>"$tmp/err2"; rc=$?
[ $rc = 1 ] && grep -q "no -m task record" "$tmp/err2" && pass "no task record: exit 1 with a message" ||
    fail "no task record: rc $rc $(cat "$tmp/err2")"
python3 tools/leaderboard.py "$tmp/r.jsonl" --bytes peak --jsonl "$tmp/peak.jsonl" >/dev/null 2>&1
python3 -c "
import json, sys
r = [x for x in map(json.loads, open('$tmp/peak.jsonl')) if x['task'] == 'vt' and x['kv'] == 'sink:64']
sys.exit(not (r and r[0]['bytes_ratio'] == 1.0 and r[0]['bytes'] == 'peak'))" &&
    pass "--bytes peak divides kv_peak_live_bytes (9999 each: ratio 1)" || fail "--bytes peak: $(cat "$tmp/peak.jsonl")"
