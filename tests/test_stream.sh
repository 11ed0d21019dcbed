#!/usr/bin/env bash
# tools/stream.sh (`make stream`, the long-stream decay curve) on a tiny random model and 700 token ids: one -o record
# per policy with the decay curve, decay.dat = those records' bucket_ppl (row b at position b * W, "nan" for null),
# a complete policy reused on a second run (no new ./run), a partial one measured again, a missing text an error.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/stream; rm -rf "$tmp"; mkdir -p "$tmp"
EXPORT=${KVLAB_EXPORT:-./export}
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
"$EXPORT" --random "$tmp/tiny.bin" --dim 48 --hidden 112 --layers 2 --heads 4 --kv-heads 2 --vocab 97 --seq 64 \
    --seed 5 >/dev/null 2>&1 || fail "export --random"
awk 'BEGIN { srand(7); for (i = 0; i < 700; i++) printf "%d ", int(rand() * 97); print "" }' >"$tmp/ids.txt"
export RUN=${KVLAB_RUN:-./run} MODEL=$tmp/tiny.bin STREAM_TEXT=$tmp/ids.txt STREAM_BUCKET=100 STREAM_CTX=64 STREAM_KV="sink:16,pos=cache full window:8"
tools/stream.sh "$tmp/out" >"$tmp/log" 2>&1 || fail "tools/stream.sh exited $?: $(tail -3 "$tmp/log")"
python3 - "$tmp/out" <<'PY'
import json, math, sys
d = sys.argv[1]
names = {"sink:16,pos=cache": "sink_16.pos_cache", "full": "full", "window:8": "window_8"}
recs = {}
for kv, f in names.items():
    for line in open(f"{d}/{f}.jsonl"):
        r = json.loads(line)
        if r["kv"] == kv:
            recs[kv] = r
ok = len(recs) == 3 and all(r["bucket_tokens"] == 100 and not r["partial"] for r in recs.values())
print(("PASS" if ok else "FAIL") + f" one complete record per policy with bucket_tokens 100 ({sorted(recs)})")
rows = [l.split() for l in open(f"{d}/decay.dat")]
head, body = rows[0], rows[1:]
n_b = max(len(r["bucket_ppl"]) for r in recs.values())
bad = []
if len(body) != n_b or n_b != 7:
    bad.append(f"{len(body)} rows, records have {n_b} buckets (699 scored tokens: 7)")
for b, row in enumerate(body):
    if int(row[0]) != 100 * b:
        bad.append(f"row {b} position {row[0]}")
    for k, kv in enumerate(names):
        want = recs[kv]["bucket_ppl"][b] if b < len(recs[kv]["bucket_ppl"]) else None
        got = float(row[k + 1])
        if (want is None) != math.isnan(got) or (want is not None and abs(got - want) > 0.5e-4 + 1e-8 * want):
            bad.append(f"row {b} {kv}: {row[k + 1]} vs {want}")
nulls = sum(math.isnan(float(row[2])) for row in body)   # full's column: it stops at -c 64, inside bucket 0
print(("PASS" if not bad and nulls == 6 else "FAIL") + f" decay.dat = the records' bucket_ppl over {len(body)} rows "
      f"(full: nan past -c 64 in {nulls} rows)" + (": " + "; ".join(bad[:4]) if bad else ""))
PY
tools/stream.sh "$tmp/out" >"$tmp/log2" 2>&1
n_reused=$(grep -c ': reused ' "$tmp/log2"); n_run=$(grep -c -- '-m ppl over' "$tmp/log2")
[ "$n_reused" = 3 ] && [ "$n_run" = 0 ] && pass "a second run reuses the 3 complete records" ||
    fail "second run: $n_reused reused, $n_run measured: $(head -3 "$tmp/log2")"
sed -i 's/"partial":false/"partial":true/' "$tmp/out/window_8.jsonl"
tools/stream.sh "$tmp/out" >"$tmp/log3" 2>&1
grep -q 'window:8: -m ppl over' "$tmp/log3" && [ "$(grep -c ': reused ' "$tmp/log3")" = 2 ] &&
    grep -q '"partial":false' "$tmp/out/window_8.jsonl" && pass "a partial record is measured again, the others reused" ||
    fail "partial record: $(head -4 "$tmp/log3")"
STREAM_TEXT=$tmp/missing.txt tools/stream.sh "$tmp/out" >"$tmp/log4" 2>&1; rc=$?
[ $rc -ne 0 ] && grep -q "missing.txt' is missing or empty" "$tmp/log4" && pass "a missing STREAM_TEXT is an error (status $rc)" ||
    fail "missing text: rc $rc: $(cat "$tmp/log4")"
