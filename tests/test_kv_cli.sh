#!/usr/bin/env bash
# The KV policies through ./run on a tiny random model (ids-only, no download): every bad spec of issue 4 is one
# error line naming the bad part and the valid choices; every policy generates past twice its budget; -kvlog writes
# one JSON line per eviction; a policy with room for every token generates the same ids as full; duo's errors
# (-calib missing, unreadable or empty, full= outside [0, 1]) and its two ends (no full lane: sink's ids; all: full's).
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/kv_cli; rm -rf "$tmp"; mkdir -p "$tmp"
RUN=${KVLAB_RUN:-./run}; EXPORT=${KVLAB_EXPORT:-./export}

pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }

# seed 12: no greedy run below generates id 1, the BOS of an ids-only model, which ends generation (seed 11's did)
if ! "$EXPORT" --random "$tmp/tiny.bin" --dim 48 --hidden 112 --layers 3 --heads 6 --kv-heads 2 --vocab 97 --seq 128 \
    --seed 12 >/dev/null 2>"$tmp/export_err"; then
    fail "export --random: $(head -c 300 "$tmp/export_err")"; exit 1
fi
M=$tmp/tiny.bin
PROMPT="1 2 3 4 5 6 7 8 9 10 11 12"
# a calibration text of 100 ids, for the policies that choose their lanes on one (-h policies: "needs: -calib FILE")
awk 'BEGIN { srand(3); for (i = 0; i < 100; i++) printf "%d ", int(rand() * 97); print "" }' >"$tmp/calib.txt"
CALIB_POLS=" $("$RUN" -h policies | awk '/^  [^ ]/ { n = $1; sub(/:.*/, "", n) } /^    needs: -calib/ { printf "%s ", n }')"
calib_for() {   # SPEC: the -calib arguments its policy needs, if any
    case "$CALIB_POLS" in *" ${1%%[:,]*} "*) echo "-calib $tmp/calib.txt" ;; esac
}

# expect_error SPEC PATTERN...: non-zero exit below 128 (not a signal), stderr matches every PATTERN (fixed strings)
expect_error() {
    local spec=$1; shift
    "$RUN" "$M" -t 0 -n 4 -i "$PROMPT" -kv "$spec" >"$tmp/out" 2>"$tmp/err"; local rc=$? ok=1
    for pat in "$@"; do grep -qF -- "$pat" "$tmp/err" || ok=0; done
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && [ $ok -eq 1 ] && ! grep -qE "Sanitizer|runtime error" "$tmp/err"; then
        pass "./run -kv '$spec' -> $(head -1 "$tmp/err" | head -c 200)"
    else
        fail "./run -kv '$spec': exit $rc, stderr: $(head -c 300 "$tmp/err")"
    fi
}

expect_error "window" "needs a budget" "window:1024"
expect_error "window:0" "budget 0" "tokens per lane"
expect_error "h2o:64,recent=80" "recent=80" "recent <= 63"
expect_error "h2o:64,recent=64" "recent=64" "recent <= 63"
expect_error "sink:4,sinks=4" "sinks=4" "sinks <= 2"
expect_error "sink:abc" "'abc'" "tokens per lane (1024) or bytes"
expect_error "nosuch:5" "'nosuch'" "$("$RUN" -h | sed -n 's/^policies: \([^(]*\) (.*/\1/p')"
expect_error "window:8,type=q3" "type=q3" "f32, f16, bf16, q8, q4"
expect_error "window:8,pos=middle" "pos=middle" "orig, cache"
expect_error "window:8,colour=red" "'colour'" "every policy takes type, ktype, vtype, residual, prec"
expect_error "full,prec=f32:4" "prec=f32:4" "the last takes the rest"
expect_error "full,prec=f32/q8" "prec=f32/q8" "every band but the last gives its tokens"
expect_error "full,prec=f32:4/q3" "'q3'" "f32, f16, bf16, q8, q4"
expect_error "full,type=q8,prec=f32:4/q8" "conflicts with type=" "prec=f32:R/T"
expect_error "pool:10,group=4,recent=8,sinks=0" "pool:10,group=4,recent=8" "at least sinks + recent + group = 12"
expect_error "pool:5" "= 10" "with the default recent=N/2: a budget >= 15"
expect_error "pool:16,group=1" "bad group=1" "[2,"
expect_error "topk:1MiB" "topk:1MiB" "topk:256"
expect_error "quest:16" "page=16" "a budget >= 32, or page <= 8"
expect_error "quest:1MiB" "quest:1MiB" "quest:256"
expect_error "blocks:8" "global=4 and local=4" "local <= 3"
expect_error "topk:16,prompt=yes" "unknown prompt=yes" "sparse" "dense"
expect_error "h2o:16,prompt=dense" "h2o does not select" "topk, quest, blocks"
expect_error "window:16,prompt=sparse" "window does not select" "topk, quest, blocks"
expect_error "topk:16,promt=dense" "'promt'" "every selection policy takes prompt"
# prompt=dense needs a prompt: ppl has none
echo "1 2 3 4 5 6 7 8" >"$tmp/ids.txt"
"$RUN" "$M" -m ppl -f "$tmp/ids.txt" -kv quest:16,page=4,prompt=dense >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -qF "prompt=dense" "$tmp/err" && grep -qF "ppl has no prompt" "$tmp/err"; then
    pass "-m ppl -kv quest:16,page=4,prompt=dense -> $(head -1 "$tmp/err" | head -c 200)"
else fail "-m ppl -kv quest:16,page=4,prompt=dense: exit $rc, stderr: $(head -c 300 "$tmp/err")"; fi

# duo: its lanes are chosen on -calib FILE, which it requires; full= in [0, 1]; -calib needs a spec that reads it
expect_run_error() {   # DESCRIPTION PATTERN... -- ARGS...: ./run MODEL ARGS fails (1..127), stderr has every PATTERN
    local what=$1 pats=() ok=1; shift
    while [ "$1" != "--" ]; do pats+=("$1"); shift; done; shift
    "$RUN" "$M" "$@" >"$tmp/out" 2>"$tmp/err"; local rc=$?
    for pat in "${pats[@]}"; do grep -qF -- "$pat" "$tmp/err" || ok=0; done
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && [ $ok -eq 1 ] && ! grep -qE "Sanitizer|runtime error" "$tmp/err"; then
        pass "$what -> $(grep -v '^run: note' "$tmp/err" | head -1 | head -c 200)"
    else fail "$what: exit $rc, stderr: $(head -c 300 "$tmp/err")"; fi
}
: >"$tmp/empty.txt"
G=(-t 0 -n 4 -i "$PROMPT")
expect_run_error "duo without -calib" "duo:16,full=0.25" "-calib FILE" -- "${G[@]}" -kv duo:16,full=0.25
expect_run_error "duo without -calib in ppl" "-calib FILE" -- -m ppl -f "$tmp/calib.txt" -kv duo:16,full=0.25
expect_run_error "duo without full=" "needs full=F" "[0, 1]" -- "${G[@]}" -kv duo:16 -calib "$tmp/calib.txt"
expect_run_error "duo full=1.5" "bad full=1.5" "[0, 1]" -- "${G[@]}" -kv duo:16,full=1.5 -calib "$tmp/calib.txt"
expect_run_error "duo full=x" "bad full=x" "[0, 1]" -- "${G[@]}" -kv duo:16,full=x -calib "$tmp/calib.txt"
expect_run_error "duo with a byte budget" "in tokens" -- "${G[@]}" -kv duo:16KiB,full=0.5 -calib "$tmp/calib.txt"
expect_run_error "duo's budget at -c" "below -c" -- "${G[@]}" -c 16 -kv duo:16,full=0.5 -calib "$tmp/calib.txt"
expect_run_error "a missing -calib file" "cannot open" "$tmp/nosuch.txt" -- "${G[@]}" -kv duo:16,full=0.5 \
    -calib "$tmp/nosuch.txt"
expect_run_error "an empty -calib file" "$tmp/empty.txt" "0 tokens" "at least 2" -- "${G[@]}" -kv duo:16,full=0.5 \
    -calib "$tmp/empty.txt"
cp "$tmp/calib.txt" "$tmp/calib_copy.txt"
expect_run_error "-kvlog onto the -calib file" "is the input" "calib_copy.txt" -- "${G[@]}" -kv duo:16,full=0.5 \
    -calib "$tmp/calib_copy.txt" -kvlog "$tmp/calib_copy.txt"
if cmp -s "$tmp/calib.txt" "$tmp/calib_copy.txt"; then pass "the -calib file was left as it was"
else fail "-kvlog onto the -calib file changed it"; fi
expect_run_error "-calib with no policy reading it" "-calib" "no -kv here does" "duo" -- "${G[@]}" -kv sink:16 \
    -calib "$tmp/calib.txt"

# every policy generates 60 tokens with a budget of 16, greedy, no error: 12 prompt positions + 59 fed back (the last
# sampled token is printed, not fed) = 71 positions, more than twice the budget
# (every registered policy's -h policies example, then variants)
for spec in $("$RUN" -h policies | sed -n 's/^    example: //p' | grep -v '^full$') "sink:16,pos=cache" \
            "tova:16,per=layer" "h2o:16,type=q8,residual=4" "window:16,ktype=q4,vtype=f16" "h2o:16KiB" \
            "topk:16,prompt=dense" "quest:16,page=4,prompt=dense,pos=cache"; do
    # shellcheck disable=SC2046
    out=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv "$spec" $(calib_for "$spec") 2>"$tmp/err"); rc=$?
    n=$(echo "$out" | wc -w)
    if [ $rc -eq 0 ] && [ "$n" -eq 60 ]; then pass "./run -kv '$spec' generates 60 tokens past twice its budget"
    else fail "./run -kv '$spec': exit $rc, $n tokens, stderr: $(tail -c 300 "$tmp/err")"; fi
done

# a selection policy's lanes hold -c tokens whatever it reads: topk:100 with -c 32 has 32 slots and stops at -c
"$RUN" "$M" -t 0 -c 32 -n 0 -i "$PROMPT" -kv topk:100 >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -eq 0 ] && grep -q "32 slots per lane" "$tmp/err" && [ "$(wc -w <"$tmp/out")" -eq $((32 - 12 + 1)) ]; then
    pass "topk:100 with -c 32: 32 slots per lane, generation stops at the context ($(wc -w <"$tmp/out") tokens)"
else fail "topk:100 with -c 32: exit $rc, $(wc -w <"$tmp/out") tokens, $(grep -o '[0-9]* slots per lane' "$tmp/err")"; fi

# memory tiers: bad values refused; a tier changes what is counted, never what is computed
expect_error "full,fast=1B" "fast=1B" "less than one slot"
expect_error "full,prefetch=1" "prefetch=1" "needs a fast tier"
expect_error "full,fast=abc" "bad fast=abc" "25%"
expect_error "full,fast=1GiB" "fast=1GiB" "more than the cache's" "fast=100% is the largest"
"$RUN" "$M" -t 0 -n 4 -i "$PROMPT" -kv window:8 -link 32 >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "no -kv spec has one" "$tmp/err"; then pass "-link without a fast= tier -> $(head -1 "$tmp/err" | head -c 120)"
else fail "-link without a tier: exit $rc, $(head -c 200 "$tmp/err")"; fi
"$RUN" "$M" -t 0 -n 4 -i "$PROMPT" -link 0 >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "bad -link '0'" "$tmp/err"; then pass "./run -link 0 -> $(head -1 "$tmp/err")"
else fail "./run -link 0: exit $rc, $(head -c 200 "$tmp/err")"; fi
for pair in "h2o:40|h2o:40,fast=25%,prefetch=1" "quest:32,page=4|quest:32,page=4,fast=10%,prefetch=1" \
            "window:20|window:20,fast=2KiB" "cluster:16,k=4|cluster:16,k=4,fast=20%,prefetch=1" \
            "topk:16,prompt=dense|topk:16,prompt=dense,fast=15%,prefetch=1"; do
    a=${pair%%|*}; b=${pair#*|}
    ga=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv "$a" 2>/dev/null); gb=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv "$b" 2>/dev/null)
    if [ -n "$ga" ] && [ "$ga" = "$gb" ]; then pass "./run -kv '$b' generates the ids of '$a' (a tier only counts)"
    else fail "./run -kv '$b': ids differ from '$a'"; fi
done
seq 1 96 | tr '\n' ' ' >"$tmp/ids96.txt"
"$RUN" "$M" -m ppl -c 96 -chunk 8 -f "$tmp/ids96.txt" -kv "quest:32,page=4,fast=10%,prefetch=1" -kv "full,fast=50%" \
    -link 16 -o "$tmp/tier.jsonl" >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -eq 0 ] && grep -q "memory tiers (modelled; the slow tier's link at 16 GB/s" "$tmp/err" &&
   [ "$(grep -c '"tier_hit_rate"' "$tmp/tier.jsonl")" -eq 2 ] && grep -q '"link_gbs":16' "$tmp/tier.jsonl" &&
   grep -q "keys scanned" "$tmp/err"; then
    pass "ppl with two tiered caches: the tiers' section on stderr, tier_hit_rate and link_gbs in both -o records, reads per query"
else fail "ppl with tiered caches: exit $rc, $(tail -c 300 "$tmp/err")"; fi

# duo with no full lane is sink:B (the same greedy ids); with every lane full it is full, stopping at -c
C=(-calib "$tmp/calib.txt")
want=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv sink:16 2>/dev/null)
got=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv duo:16,full=0 "${C[@]}" 2>"$tmp/err")
if [ -n "$want" ] && [ "$got" = "$want" ] && grep -q "0 of 6 lanes full" "$tmp/err"; then
    pass "duo:16,full=0 (0 of 6 lanes full) gives sink:16's greedy ids"
else fail "duo:16,full=0: ids differ from sink:16's, or no '0 of 6 lanes full': $(tail -c 300 "$tmp/err")"; fi
want=$("$RUN" "$M" -t 0 -c 32 -n 0 -i "$PROMPT" -kv full 2>/dev/null)
got=$("$RUN" "$M" -t 0 -c 32 -n 0 -i "$PROMPT" -kv duo:16,full=1 "${C[@]}" 2>"$tmp/err")
if [ -n "$want" ] && [ "$got" = "$want" ] && [ "$(echo "$got" | wc -w)" -eq $((32 - 12 + 1)) ] &&
   grep -q "6 of 6 lanes full" "$tmp/err" && grep -q "the cache is full (32 tokens" "$tmp/err"; then
    pass "duo:16,full=1 with -c 32: every lane full, full's greedy ids, generation stops at the context"
else fail "duo:16,full=1 -c 32: $(echo "$got" | wc -w) tokens, $(tail -c 300 "$tmp/err")"; fi
"$RUN" "$M" -t 0 -c 32 -n 0 -i "$(seq -s ' ' 1 40)" -kv duo:16,full=0.5 "${C[@]}" >"$tmp/out" 2>"$tmp/err"; rc=$?
if [ $rc -eq 1 ] && grep -q "the prompt is 40 tokens, longer than the context of 32 tokens" "$tmp/err"; then
    pass "duo:16,full=0.5 refuses a 40-token prompt with -c 32 before any work, as full does"
else fail "duo with a prompt past -c: exit $rc, $(tail -c 300 "$tmp/err")"; fi

# with room for all 71 positions every policy gives full's greedy ids
ref=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv full 2>/dev/null)
for spec in "window:128" "sink:100" "h2o:80" "tova:72" "scissorhands:90" "lru:72" "random:72" "window:72,pos=cache" \
            "pool:128,recent=100" "full,prec=f32:72/q8"; do
    got=$("$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv "$spec" 2>/dev/null)
    if [ -n "$ref" ] && [ "$got" = "$ref" ]; then pass "./run -kv '$spec' with room for every token: full's greedy ids"
    else fail "./run -kv '$spec' with room for every token: ids differ from full"; fi
done

# -kvlog: one JSON line per eviction, each naming step, layer, kv head, evicted position and reason.
# window:16 over 71 positions, 3 layers x 2 kv heads: (71 - 16) * 6 = 330 evictions
"$RUN" "$M" -t 0 -n 60 -i "$PROMPT" -kv window:16 -kvlog "$tmp/log.jsonl" >/dev/null 2>"$tmp/err"
lines=$(wc -l <"$tmp/log.jsonl" 2>/dev/null || echo 0)
bad=$(grep -cvE '^\{"kv":"window:16","event":"evict","step":[0-9]+,"layer":[0-9]+,"kv_head":[0-9]+,"evicted_pos":[0-9]+,.*"reason":"oldest"\}$' \
      "$tmp/log.jsonl" 2>/dev/null)
if [ "$lines" -eq 330 ] && [ "${bad:-1}" -eq 0 ]; then pass "-kvlog: window:16 over 71 positions logs 330 evictions, reason 'oldest'"
else fail "-kvlog: $lines lines (want 330), $bad malformed: $(head -2 "$tmp/log.jsonl")"; fi
