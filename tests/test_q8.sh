#!/usr/bin/env bash
# int8 weights through the CLI (the kernels, sizes and error bound are tests/test_q8.c):
#  - export --random --wtype q8, then generate: runs, and 1 and 2 threads give the same ids;
#  - batched evaluation (-chunk 5, 64) is bit-identical to token-by-token with q8 weights, on 1 and 2 threads;
#  - bad inputs: --wtype q4 (not yet available), an unknown type, columns not a multiple of 32, --vocab-only with
#    --wtype, a truncated or padded q8 model.bin;
#  - SmolLM2's GGUF (when cached) exports with --wtype q8 untied, as wtype 1, and generates.
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
EXPORT=${KVLAB_EXPORT:-./export}
tmp=tests/tmp/q8; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
shape=(--dim 64 --hidden 160 --layers 3 --heads 8 --kv-heads 2 --vocab 211 --seq 96 --seed 5)
"$EXPORT" --random "$tmp/q.bin" "${shape[@]}" --wtype q8 >/dev/null 2>"$tmp/err" || fail "export --random --wtype q8: $(cat "$tmp/err")"
M=$tmp/q.bin

# --- generate, threads ---
for th in 1 2; do
    OMP_NUM_THREADS=$th "$RUN" "$M" -n 24 -t 0 -ids -i "1 2 3" >"$tmp/gen$th.txt" 2>"$tmp/err$th"
    echo "rc $?" >>"$tmp/gen$th.txt"
done
if [ "$(wc -w <"$tmp/gen1.txt")" -eq 26 ] && grep -q "rc 0" "$tmp/gen1.txt" && cmp -s "$tmp/gen1.txt" "$tmp/gen2.txt"; then
    pass "q8 model generates 24 greedy ids, identical on 1 and 2 threads"
else fail "q8 generate: $(cat "$tmp/gen1.txt" "$tmp/gen2.txt" "$tmp/err1" | head -5)"; fi

# --- batched == token by token ---
awk 'BEGIN { srand(3); for (i = 0; i < 200; i++) printf "%d ", int(rand() * 211); print "" }' >"$tmp/a.txt"
POLS=(-kv full -kv window:12 -kv h2o:12,recent=4 -kv tova:12 -kv sink:12,type=q8)
OMP_NUM_THREADS=2 "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 64 "${POLS[@]}" -chunk 1 -tokenlog "$tmp/c1.jsonl" 2>"$tmp/err1"
rc1=$?
for c in 5 64; do
    for th in 1 2; do
        OMP_NUM_THREADS=$th "$RUN" "$M" -m ppl -f "$tmp/a.txt" -c 64 "${POLS[@]}" -chunk $c -tokenlog "$tmp/c$c.t$th.jsonl" \
            2>"$tmp/err"
        if [ $rc1 -eq 0 ] && [ -s "$tmp/c1.jsonl" ] && cmp -s "$tmp/c1.jsonl" "$tmp/c$c.t$th.jsonl"; then
            pass "q8 weights: ppl -chunk $c on $th thread(s) bit-identical to token-by-token for 5 policies"
        else fail "q8 ppl -chunk $c, $th threads differs from -chunk 1 (rc $rc1): $(tail -n 2 "$tmp/err" "$tmp/err1")"; fi
    done
done

# --- bad inputs ---
expect() {   # NAME "grep -E pattern" COMMAND...
    local name=$1 words=$2; shift 2
    local out rc
    out=$("$@" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 1 ] && printf '%s' "$out" | grep -qE -- "$words"; then pass "$name: $(printf '%s' "$out" | head -1)"
    else fail "$name: exit $rc, wanted /$words/, got: $(printf '%s' "$out" | head -3)"; fi
}
expect "export --wtype q4" "q4 is not yet available" "$EXPORT" --random "$tmp/x.bin" "${shape[@]}" --wtype q4
expect "export --wtype q5" "unknown type 'q5'" "$EXPORT" --random "$tmp/x.bin" "${shape[@]}" --wtype q5
expect "export --wtype q8 with dim 48" "multiple of 32.*48 columns" "$EXPORT" --random "$tmp/x.bin" --dim 48 --hidden 96 \
    --layers 1 --heads 4 --kv-heads 2 --vocab 50 --seq 16 --seed 1 --wtype q8
expect "export --wtype q8 with hidden 80" "multiple of 32.*ffn_down.*80 columns" "$EXPORT" --random "$tmp/x.bin" --dim 64 \
    --hidden 80 --layers 1 --heads 4 --kv-heads 2 --vocab 50 --seq 16 --seed 1 --wtype q8
expect "export --vocab-only --wtype q8" "no meaning with --vocab-only" "$EXPORT" in.gguf "$tmp/x.bin" --vocab-only --wtype q8
[ -e "$tmp/x.bin" ] && fail "a refused export left $tmp/x.bin"
size=$(stat -c %s "$M")
head -c $((size - 34)) "$M" >"$tmp/short.bin"
expect "run on a truncated q8 model" "truncated or corrupt" "$RUN" "$tmp/short.bin" -n 1 -ids
cp "$M" "$tmp/long.bin"; head -c 64 /dev/zero >>"$tmp/long.bin"
expect "run on a q8 model with 64 extra bytes" "truncated or corrupt" "$RUN" "$tmp/long.bin" -n 1 -ids

# --- a real GGUF ---
G=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$G" ] && [ -z "${KVLAB_SANITIZE:-}" ]; then
    "$EXPORT" "$G" "$tmp/smol.q8.bin" --wtype q8 >/dev/null 2>"$tmp/err"
    hdr=$(od -An -t d4 -j 44 -N 8 "$tmp/smol.q8.bin" | xargs)
    out=$(OMP_NUM_THREADS=1 "$RUN" "$tmp/smol.q8.bin" -n 8 -t 0 -i "The capital of France is" 2>"$tmp/err2")
    if [ "$hdr" = "0 1" ] && [ -n "$out" ]; then pass "SmolLM2 GGUF --wtype q8: tied=0 wtype=1, generates '$out'"
    else fail "SmolLM2 q8: header tied/wtype '$hdr', output '$out': $(cat "$tmp/err" "$tmp/err2" | tail -3)"; fi
    rm -f "$tmp/smol.q8.bin"
else echo "SKIP SmolLM2 q8 export (no $G, or a sanitizer build)"; fi
exit 0
