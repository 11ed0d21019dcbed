#!/usr/bin/env bash
# merge=1 (merge-on-evict) through ./run on a tiny random model (ids-only: -f files hold token ids):
#  - batched evaluation (-chunk 7, 64) gives the per-token NLL, KL and recall of token-by-token decode bit for bit, on
#    1 and 2 threads, and the same -kvlog events: the chunk path batches only while every lane has room, and a merge
#    happens only when a lane is full, so every merge runs token by token; the weights the merges use are added at
#    step 4, which runs token by token in both paths from the same probabilities;
#  - every position stays covered (a victim joins a kept slot): recall is 1 against the shadow, below 1 for plain h2o;
#  - -kvlog names each merge's victim and the kept slot it joined (into); -o agrees with -tokenlog and the table.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/merge; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
RUN=${KVLAB_RUN:-./run}
"${KVLAB_EXPORT:-./export}" --random "$tmp/m.bin" --dim 64 --hidden 160 --layers 3 --heads 8 --kv-heads 2 --vocab 211 \
    --seq 96 --seed 5 >/dev/null 2>&1 || fail "export --random"
M=$tmp/m.bin
awk 'BEGIN { srand(7); for (i = 0; i < 240; i++) printf "%d ", int(rand() * 211); print "" }' >"$tmp/a.txt"
POLS=(-kv h2o:16,merge=1 -kv sink:16,sinks=2,merge=1 -kv tova:12,merge=1,type=q8 -kv window:10,merge=1,pos=cache
      -kv scissorhands:16,drop=3,merge=1 -kv h2o:16,merge=1,prec=f32:4/q8 -kv h2o:16)
OMP_NUM_THREADS=2 "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 96 "${POLS[@]}" -chunk 1 -tokenlog "$tmp/c1.jsonl" \
    -kvlog "$tmp/k1.jsonl" -o "$tmp/o1.jsonl" 2>"$tmp/err1"
rc1=$?
sort "$tmp/k1.jsonl" >"$tmp/k1.sorted"
for c in 7 64; do
    for th in 1 2; do
        OMP_NUM_THREADS=$th "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 96 "${POLS[@]}" -chunk $c \
            -tokenlog "$tmp/c$c.t$th.jsonl" -kvlog "$tmp/k$c.t$th.jsonl" 2>"$tmp/err"
        if [ $rc1 -eq 0 ] && cmp -s "$tmp/c1.jsonl" "$tmp/c$c.t$th.jsonl" &&
            sort "$tmp/k$c.t$th.jsonl" | cmp -s - "$tmp/k1.sorted"; then
            pass "merge=1: -chunk $c on $th thread(s) gives token-by-token's per-token NLL, KL and recall bit for bit and the same $(wc -l <"$tmp/k1.jsonl") -kvlog events"
        else fail "merge=1: -chunk $c, $th threads differs from -chunk 1 (rc $rc1): $(tail -n 2 "$tmp/err" "$tmp/err1")"; fi
    done
done
# recall from -o: 1 with merge=1 (every position is covered by some slot), below 1 for plain h2o at the same budget
rec() { grep "\"kv\":\"$1\"" "$tmp/o1.jsonl" | grep -o '"recall":[-0-9.e+]*' | cut -d: -f2; }
r1=$(rec h2o:16,merge=1); r0=$(rec h2o:16)
if awk -v a="$r1" -v b="$r0" 'BEGIN { exit !(a != "" && b != "" && a == 1 && b < 1) }'; then
    pass "recall counts what merged slots cover: h2o:16,merge=1 $r1, h2o:16 $r0"
else fail "recall: h2o:16,merge=1 '$r1' (want 1), h2o:16 '$r0' (want < 1)"; fi
# -kvlog: merges name the victim and the slot it joined; no victim is evicted alone
n_merge=$(grep -c '"kv":"h2o:16,merge=1","event":"merge".*"pos":[0-9]*,"into":[0-9]*,"cosine":' "$tmp/k1.jsonl")
n_evict=$(grep -c '"kv":"h2o:16,merge=1","event":"evict"' "$tmp/k1.jsonl")
# 240 tokens (239 fed: the last is only predicted), 3 layers x 2 kv heads, 16 slots: a merge at each of the steps
# 16..238 in every lane
if [ "$n_merge" -eq $(((239 - 16) * 6)) ] && [ "$n_evict" -eq 0 ]; then
    pass "-kvlog: h2o:16,merge=1 logs $n_merge merges with victim, into= and cosine, no eviction"
else fail "-kvlog: $n_merge merges (want $(((239 - 16) * 6))), $n_evict evictions (want 0)"; fi
# -o against -tokenlog and the table (recall included)
python3 tests/ppl_crosscheck.py "$tmp/o1.jsonl" "$tmp/c1.jsonl" "$tmp/err1"
rc=$?; [ $rc -le 1 ] || fail "ppl_crosscheck.py did not run (status $rc)"
grep -q 'h2o:16,merge=1 ' "$tmp/err1" && pass "ppl's table lists h2o:16,merge=1" || fail "ppl's table: $(tail -3 "$tmp/err1")"
exit 0
