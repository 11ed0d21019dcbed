#!/usr/bin/env bash
# The evaluation's methodology on a tiny random model (ids-only: -f files hold token ids):
#  - batched evaluation (-chunk N) is bit-identical to token-by-token for every layer-local policy, on 1 and 2 threads;
#  - every figure of -o recomputed from -tokenlog (tests/ppl_crosscheck.py: span and all tokens, exp(mean NLL), mean
#    KL, top-1 share, recall, Δp and ΔNLL from the NLLs) and the stderr table read back against -o, on one document
#    longer than -c and on two documents;
#  - streaming `full` over one n_ctx chunk gives the chunked (llama-perplexity) mode's NLL on the second half;
#  - perplexity pools NLL over documents (10 and 1,000 tokens);
#  - every cache and score restarts between documents (H2O's scores from document A never reach document B);
#  - empty, one-token input and snapkv without prefill= in ppl are errors.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/eval; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }

./export --random "$tmp/m.bin" --dim 64 --hidden 160 --layers 3 --heads 8 --kv-heads 2 --vocab 211 --seq 96 \
    --seed 5 >/dev/null 2>&1 || fail "export --random"
M=$tmp/m.bin
ids() { awk -v n="$1" -v s="$2" 'BEGIN { srand(s); for (i = 0; i < n; i++) printf "%d ", int(rand() * 211); print "" }'; }
ids 300 1 >"$tmp/a.txt"
ids 10 2 >"$tmp/d10.txt"
ids 1000 3 >"$tmp/d1000.txt"
ids 80 4 >"$tmp/calib.txt"

# nll_sum LOG POLICY [DOC] [FROM_POS]: Σ and count of the policy's NLL in a -tokenlog, from position FROM_POS on
nll_sum() {
    awk -v pol="\"kv\":\"$2\"" -v doc="${3:-}" -v from="${4:-0}" '
        { if (doc != "" && index($0, "{\"doc\":" doc ",") != 1) next
          match($0, /"pos":[0-9]+/); p = substr($0, RSTART + 6, RLENGTH - 6) + 0
          if (p < from) next
          key = pol ",\"nll\":"; i = index($0, key); if (!i) next
          rest = substr($0, i + length(key)); if (!match(rest, /^[-0-9.e+]+/)) next
          s += substr(rest, 1, RLENGTH); n++ }
        END { printf "%.12g %d\n", s, n }' "$1"
}

# every registered policy (its -h policies example), then variants of position, aggregation and storage
EXAMPLES=()
for spec in $(./run -h policies | sed -n 's/^    example: //p'); do EXAMPLES+=(-kv "$spec"); done
[ ${#EXAMPLES[@]} -ge 18 ] || fail "./run -h policies lists $((${#EXAMPLES[@]} / 2)) examples"
POLS=("${EXAMPLES[@]}" -kv window:12 -kv sink:12,sinks=2 -kv h2o:12,recent=4 -kv tova:12,per=layer -kv window:12,pos=cache
       -kv sink:12,type=q8 -kv h2o:12,type=q4,residual=3 -kv full,type=q8,residual=16 -kv full,prec=f32:5/q8:9/q4
       -kv full,kprec=f32:8/q4,vprec=f16:3/q8 -kv full,type=f16,residual=4 -kv full,krank=4,calib=20
       -kv full,rank=4,type=q8,calib=33,pos=cache -kv full,type=q4,kgroup=channel,kgsize=6)
# a calibration text when an example's policy chooses its lanes on one (-h policies: "needs: -calib FILE")
CAL=(); ./run -h policies | grep -q '^    needs: -calib' && CAL=(-calib "$tmp/calib.txt")
# --- batched == token by token, 1 == 2 threads (low-rank bases fitted and key groups sealed inside chunks of 64) ---
OMP_NUM_THREADS=2 ./run "$M" -m ppl -f "$tmp/a.txt" -c 64 "${POLS[@]}" "${CAL[@]}" -chunk 1 -tokenlog "$tmp/c1.jsonl" \
    -o "$tmp/c1o.jsonl" -bucket 50 2>"$tmp/err1"
rc1=$?
for c in 5 64; do
    for th in 1 2; do
        OMP_NUM_THREADS=$th ./run "$M" -m ppl -f "$tmp/a.txt" -c 64 "${POLS[@]}" "${CAL[@]}" -chunk $c \
            -tokenlog "$tmp/c$c.t$th.jsonl" 2>"$tmp/err"
        if [ $rc1 -eq 0 ] && cmp -s "$tmp/c1.jsonl" "$tmp/c$c.t$th.jsonl"; then
            pass "ppl -chunk $c on $th thread(s): per-token NLL and KL bit-identical to token-by-token for $((${#POLS[@]} / 2)) policies"
        else fail "ppl -chunk $c, $th threads differs from -chunk 1 (rc $rc1): $(tail -n 2 "$tmp/err" "$tmp/err1")"; fi
    done
done
# --- the same across value blocks: attention sums a value's rows per block of 256 positions (attn_cpu.c), so on a
# model of 768 positions, 700 tokens at -c 640 give full lanes of three blocks, sparse lanes (h2o, tova) whose
# blocks hold a few rows each, and chunks that begin, end and straddle a block's edge (7 and 60 divide no multiple of
# 256 below 700; 64 does); decode on 1 thread against 2 (blocks spread over the threads); banded lanes (residual=,
# prec=, kprec=, vprec=) recode tokens into older bands as the chunk passes (attn_cpu.c, attend_union), also while
# they evict (h2o, sink, window: their victims come from the oldest band; h2o:200,recent=20 with residual=32 cannot
# promise that and goes token by token); lanes whose stored keys change at set tokens go a chunk at a time up to
# that token, which goes alone: low-rank lanes (krank=, rank=, vrank=) at their basis's fit (calib=), per-channel keys
# (kgroup=channel) at each group's seal (also with bands and while evicting); topk scores every key of a chunk's
# queries in one pass, then chooses and attends token by token ---
ids 700 5 >"$tmp/long.txt"
LONG=("${EXAMPLES[@]}" -kv full -kv full,type=q8 -kv window:300 -kv sink:300,sinks=4 -kv h2o:200,recent=20 -kv tova:150
      -kv window:300,pos=cache -kv window:300,type=q4 -kv full,type=q8,residual=64 -kv full,prec=f32:64/q8:100/q4
      -kv full,prec=f32:40/q8:5/q4 -kv full,kprec=f32:30/q4,vprec=f16:7/q8 -kv h2o:300,type=q4,residual=64
      -kv sink:300,sinks=4,type=q4,residual=32 -kv window:250,prec=f32:16/q8:64/q4 -kv h2o:200,recent=20,type=q8,residual=32)
RECODE=(-kv full,krank=4,calib=100 -kv full,rank=6,type=q8,calib=257 -kv full,vrank=4,type=q4,calib=333
        -kv full,krank=4,calib=64,pos=cache -kv full,type=q2,kgroup=channel -kv full,type=q4,kgroup=channel,kgsize=7,pos=cache
        -kv full,type=q8,kgroup=channel,kgsize=64 -kv h2o:200,type=q4,kgroup=channel,kgsize=8,residual=32
        -kv sink:300,sinks=4,type=q8,kgroup=channel -kv full,prec=f32:40/q8:64/q4,kgroup=channel,kgsize=16
        -kv window:250,type=q2,kgroup=channel,residual=16 -kv h2o:150,recent=40,type=q4,kgroup=channel,kgsize=12)
SELECT=(-kv topk:64 -kv topk:100,pos=cache -kv topk:40,type=q4 -kv topk:300,type=f16)
CAL_LONG=("${CAL[@]}"); CAL_RECODE=(); CAL_SELECT=()   # -calib only where a policy reads it
# two shapes: head_dim 8 with GQA groups of 4 (the portable kernels), head_dim 64 with groups of 3 (SmolLM2's: the
# vector kernels, four tokens at a time in the chunk paths)
for shape in "64 8 2" "192 3 1"; do
    set -- $shape
    ./export --random "$tmp/long.bin" --dim $1 --hidden 160 --layers 2 --heads $2 --kv-heads $3 --vocab 211 --seq 768 \
        --seed 6 >/dev/null 2>&1 || fail "export --random (768 positions)"
    what="dim $1, $2 heads, $3 kv heads"
    for set in LONG RECODE SELECT; do
        declare -n specs=$set cal=CAL_$set
        OMP_NUM_THREADS=2 ./run "$tmp/long.bin" -m ppl -f "$tmp/long.txt" -c 640 "${specs[@]}" "${cal[@]}" -chunk 1 \
            -tokenlog "$tmp/l1.jsonl" >/dev/null 2>"$tmp/errl1"
        rcl=$?
        for run in "1 1" "7 1" "7 2" "60 2" "64 2"; do
            set -- $run
            OMP_NUM_THREADS=$2 ./run "$tmp/long.bin" -m ppl -f "$tmp/long.txt" -c 640 "${specs[@]}" "${cal[@]}" \
                -chunk $1 -tokenlog "$tmp/l$1.t$2.jsonl" >/dev/null 2>"$tmp/err"
            if [ $rcl -eq 0 ] && [ -s "$tmp/l1.jsonl" ] && cmp -s "$tmp/l1.jsonl" "$tmp/l$1.t$2.jsonl"; then
                pass "$what, 700 tokens at -c 640, -chunk $1 on $2 thread(s): bit-identical to -chunk 1 on 2 threads for $((${#specs[@]} / 2)) policies"
            else fail "$what, 700 tokens, -chunk $1 on $2 threads differs from -chunk 1 (rc $rcl): $(tail -n 2 "$tmp/err" "$tmp/errl1")"; fi
        done
        unset -n specs cal
    done
done
# -o against -tokenlog and the tables: 300 tokens, -c 64 (evicting policies go on past the span, full stops at it;
# -bucket 50: six buckets of position, full's null after the second);
# window:12 must differ from the shadow (a finite KL above 0, whatever its size) and full must not
python3 tests/ppl_crosscheck.py "$tmp/c1o.jsonl" "$tmp/c1.jsonl" "$tmp/err1" --nonzero-kl window:12 --zero-kl full
rc=$?; [ $rc -le 1 ] || fail "ppl_crosscheck.py did not run (status $rc)"
want=$(nll_sum "$tmp/c1.jsonl" shadow); got=$(nll_sum "$tmp/c1.jsonl" full)
if [ "$want" = "$got" ]; then pass "-kv full equals the shadow bit for bit on the span ($got)"; else fail "full '$got' vs shadow '$want'"; fi

# --- streaming full over one chunk == chunked mode's second half ---
head -c 100000 "$tmp/a.txt" | tr ' ' '\n' | head -128 | xargs >"$tmp/two.txt"
tr ' ' '\n' <"$tmp/two.txt" | head -64 | xargs >"$tmp/ch1.txt"
tr ' ' '\n' <"$tmp/two.txt" | sed -n 65,128p | xargs >"$tmp/ch2.txt"
./run "$M" -m ppl -ppl-mode chunked -c 64 -f "$tmp/two.txt" -o "$tmp/chunked.jsonl" 2>"$tmp/err"
./run "$M" -m ppl -c 64 -f "$tmp/ch1.txt" -f "$tmp/ch2.txt" -tokenlog "$tmp/stream.jsonl" 2>>"$tmp/err"
read -r s1 n1 < <(nll_sum "$tmp/stream.jsonl" shadow 0 32)
read -r s2 n2 < <(nll_sum "$tmp/stream.jsonl" shadow 1 32)
chunked=$(grep -o '"all_nll":[-0-9.e+]*' "$tmp/chunked.jsonl" | cut -d: -f2)
cn=$(grep -o '"all_tokens":[0-9]*' "$tmp/chunked.jsonl" | cut -d: -f2)
if awk -v a="$s1" -v b="$s2" -v n1="$n1" -v n2="$n2" -v c="$chunked" -v cn="$cn" \
        'BEGIN { m = (a + b) / (n1 + n2); d = m - c; if (d < 0) d = -d; exit !(cn == n1 + n2 && d <= 1e-8 * (m < 0 ? -m : m)) }'; then
    pass "streaming full over each 64-token chunk gives the chunked mode's NLL on the second halves ($cn tokens)"
else fail "chunked $chunked ($cn) vs streamed ($s1 + $s2)/($n1 + $n2): $(tail -3 "$tmp/err")"; fi

# --- pooled NLL over documents of 10 and 1,000 tokens; state reset between documents ---
./run "$M" -m ppl -c 96 -kv h2o:16 -kv window:8 -f "$tmp/d10.txt" -f "$tmp/d1000.txt" -o "$tmp/pool.jsonl" \
    -tokenlog "$tmp/pool_t.jsonl" 2>"$tmp/err_pool"
python3 tests/ppl_crosscheck.py "$tmp/pool.jsonl" "$tmp/pool_t.jsonl" "$tmp/err_pool" --nonzero-kl window:8
rc=$?; [ $rc -le 1 ] || fail "ppl_crosscheck.py did not run (status $rc)"
./run "$M" -m ppl -c 96 -kv h2o:16 -f "$tmp/d10.txt" -o "$tmp/p10.jsonl" 2>>"$tmp/err"
./run "$M" -m ppl -c 96 -kv h2o:16 -f "$tmp/d1000.txt" -o "$tmp/p1000.jsonl" -tokenlog "$tmp/p1000_t.jsonl" 2>>"$tmp/err"
field() { grep "\"kv\":\"$2\"" "$1" | grep -o "\"$3\":[-0-9.e+]*" | cut -d: -f2; }
if awk -v a="$(field "$tmp/p10.jsonl" h2o:16 all_nll)" -v na="$(field "$tmp/p10.jsonl" h2o:16 all_tokens)" \
       -v b="$(field "$tmp/p1000.jsonl" h2o:16 all_nll)" -v nb="$(field "$tmp/p1000.jsonl" h2o:16 all_tokens)" \
       -v p="$(field "$tmp/pool.jsonl" h2o:16 all_nll)" -v np="$(field "$tmp/pool.jsonl" h2o:16 all_tokens)" \
       'BEGIN { m = (a * na + b * nb) / (na + nb); d = m - p; if (d < 0) d = -d; exit !(na == 9 && nb == 999 && np == 1008 && d <= 1e-8 * m) }'; then
    pass "perplexity pools NLL over documents of 10 and 1,000 tokens (9 + 999 scored)"
else fail "pooled NLL: $(cat "$tmp/pool.jsonl" "$tmp/p10.jsonl" "$tmp/p1000.jsonl" | grep -o '"all_[a-z]*":[-0-9.e+]*' | xargs)"; fi
a=$(grep '"doc":1,' "$tmp/pool_t.jsonl" | sed 's/"doc":1,//; s/,{"kv":"window:8"[^}]*}//'); b=$(sed 's/"doc":0,//' "$tmp/p1000_t.jsonl")
if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "state resets between documents: document B scores identically after A (h2o:16)"
else fail "document B depends on document A"; fi

# --- errors ---
: >"$tmp/empty.txt"; echo 5 >"$tmp/one.txt"
for f in empty one; do
    ./run "$M" -m ppl -f "$tmp/$f.txt" >/dev/null 2>"$tmp/err"; rc=$?
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "perplexity needs at least 2" "$tmp/err"; then pass "ppl on $f input: $(cat "$tmp/err")"
    else fail "ppl on $f input: rc $rc $(cat "$tmp/err")"; fi
done
./run "$M" -m ppl -f "$tmp/a.txt" -kv snapkv:16 >/dev/null 2>"$tmp/err"; rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "prefill" "$tmp/err"; then pass "snapkv in ppl without prefill=: $(cat "$tmp/err")"
else fail "snapkv without prefill=: rc $rc $(cat "$tmp/err")"; fi
./run "$M" -m ppl -f "$tmp/a.txt" -kv snapkv:40,obs=8,prefill=60 -kv h2o:16 -chunk 7 -tokenlog "$tmp/s7.jsonl" >/dev/null 2>"$tmp/err" &&
./run "$M" -m ppl -f "$tmp/a.txt" -kv snapkv:40,obs=8,prefill=60 -kv h2o:16 -chunk 1 -tokenlog "$tmp/s1.jsonl" >/dev/null 2>>"$tmp/err"
if cmp -s "$tmp/s1.jsonl" "$tmp/s7.jsonl"; then pass "snapkv:40,obs=8,prefill=60: -chunk 7 bit-identical to token-by-token"
else fail "snapkv chunked differs: $(tail -n 2 "$tmp/err")"; fi
exit 0
