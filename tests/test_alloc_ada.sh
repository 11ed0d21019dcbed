#!/usr/bin/env bash
# alloc=ada (Ada-KV: a layer's slots shared by its kv heads) through ./run on a tiny random model (ids-only: -f files
# hold token ids):
#  - batched evaluation (-chunk 7, 64) gives the per-token NLL, KL and recall of token-by-token decode (-chunk 1) bit
#    for bit, on 1 and 2 threads, and the same -kvlog events: the chunk path batches only while a layer's lanes hold
#    at most H x B - H per token to come (no layer-wide eviction), so every eviction runs token by token in both;
#  - -kvlog reports the layer-wide evictions as evict events with the policy's keep score, and the kv heads of some
#    layer free different numbers of slots (slots moved between them).
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/alloc_ada; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
RUN=${KVLAB_RUN:-./run}
"${KVLAB_EXPORT:-./export}" --random "$tmp/m.bin" --dim 64 --hidden 160 --layers 3 --heads 8 --kv-heads 2 --vocab 211 \
    --seq 96 --seed 7 >/dev/null 2>&1 || fail "export --random"
M=$tmp/m.bin
awk 'BEGIN { srand(11); for (i = 0; i < 240; i++) printf "%d ", int(rand() * 211); print "" }' >"$tmp/a.txt"
POLS=(-kv h2o:16,alloc=ada -kv tova:12,alloc=ada,safeguard=0 -kv window:10,alloc=ada -kv h2o:16,recent=2,alloc=ada,pos=cache)
OMP_NUM_THREADS=2 "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 96 "${POLS[@]}" -chunk 1 -tokenlog "$tmp/c1.jsonl" \
    -kvlog "$tmp/k1.jsonl" 2>"$tmp/err1"
rc1=$?
sort "$tmp/k1.jsonl" >"$tmp/k1.sorted"
for c in 7 64; do
    for th in 1 2; do
        OMP_NUM_THREADS=$th "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 96 "${POLS[@]}" -chunk $c \
            -tokenlog "$tmp/c$c.t$th.jsonl" -kvlog "$tmp/k$c.t$th.jsonl" 2>"$tmp/err"
        if [ $rc1 -eq 0 ] && [ -s "$tmp/c1.jsonl" ] && cmp -s "$tmp/c1.jsonl" "$tmp/c$c.t$th.jsonl" &&
            sort "$tmp/k$c.t$th.jsonl" | cmp -s - "$tmp/k1.sorted"; then
            pass "alloc=ada: -chunk $c on $th thread(s) gives -chunk 1's per-token NLL, KL and recall bit for bit and the same $(wc -l <"$tmp/k1.jsonl") -kvlog events"
        else fail "alloc=ada: -chunk $c, $th threads differs from -chunk 1 (rc $rc1): $(tail -n 2 "$tmp/err" "$tmp/err1")"; fi
    done
done
# every eviction is logged with the policy's keep score: h2o:16,alloc=ada's 3 layers free 2 slots a step once they hold
# 2 x 16, from step 16 to 238 (239 tokens fed); tova:12,alloc=ada,safeguard=0 moves slots between the kv heads of
# some layer (its two heads free different numbers; h2o's recent half makes each lane's newest candidate its lowest,
# so on this random model its heads stay even)
scored=$(grep '"kv":"h2o:16,alloc=ada","event":"evict"' "$tmp/k1.jsonl" | grep -c '"score":[0-9]')
uneven=$(grep -o '"kv":"tova:12,alloc=ada,safeguard=0","event":"evict",.*"layer":[0-9]*,"kv_head":[0-9]*' "$tmp/k1.jsonl" |
         sed 's/.*"layer":\([0-9]*\),"kv_head":\([0-9]*\)/\1 \2/' | sort | uniq -c |
         awk '{ n[$2] = n[$2] "," $1 } END { u = 0; for (l in n) { split(substr(n[l], 2), c, ","); if (c[1] != c[2]) u++ } print u }')
if [ "$scored" -eq $((3 * (239 - 16) * 2)) ] && [ "${uneven:-0}" -gt 0 ]; then
    pass "-kvlog: h2o:16,alloc=ada logs $scored evictions, each with its keep score; tova:12,alloc=ada's heads free unequal counts in $uneven layer(s)"
else fail "-kvlog: $scored scored h2o:16,alloc=ada evictions (want $((3 * (239 - 16) * 2))), tova's uneven layers '$uneven' (want > 0)"; fi
exit 0
