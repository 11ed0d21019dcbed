#!/usr/bin/env bash
# make bench: kvlab's CPU speed on SmolLM2-135M-Instruct, against the read bandwidth measured in the same run.
#  - bandwidth: build/bw (f32 sum over 512 MiB, best of 7 passes), once per round;
#  - decode tok/s with f32 and q8 weights: ./run -m bench at context 256 (-c 320 -n 64: the context-256 record's
#    decode_tok_s, 64 greedy steps after a 256-token prompt), JSON from -o;
#  - the bandwidth limit: bandwidth / weight bytes read per token. Bytes counted from the file's header: the whole
#    weight section, except that an untied model reads one embedding row, not the embedding (the q8 file's case);
#    the f32 file is tied, so its embedding is read in full as the classifier. KV reads (about 11.8 MB per token at
#    context 256 in f32) are left out, so the fraction shown is conservative;
#  - batched evaluation: ./run -m ppl on the first 2,048 tokens of the Debian Reference (f32, `full` plus the shadow:
#    2 runs per token), -chunk 64 against -chunk 1, tok/s per policy run as ppl reports it;
#  - decode at long context: ./run -m bench -lengths 256,1024,4096,8192 (-c 8224, 32 steps) with f32 weights and
#    f32 or q8 KV (full, full,type=q8), p50 ms per token against the limit of the same round: (weight bytes + the KV
#    bytes that step read, kv_read_bytes_per_step) / bandwidth; BENCH_LONG_RUNS rounds (default 3) of them;
#  - evicting policies batched at steady state: ./run -m ppl -c 256 on the same text with h2o:64 and sink:64 (every
#    token past 64 evicts), -chunk 64 against -chunk 1, in the ppl rounds;
#  - many sequences in one batch: build/batch_bench (full, 256-token prompts, 32 batched decode steps) at S = 1, 2, 4,
#    8, 16: tok/s over all sequences and against S = 1, in the ppl rounds;
#  - optionally llama.cpp: LLAMA_BENCH=/path/llama-bench with LLAMA_F32=... and LLAMA_Q8=... GGUFs runs
#    `llama-bench -p 0 -n 128 -t THREADS` on each, in the same rounds, and `llama-bench -pg 4032,64` on the f32 GGUF
#    in the long-context rounds (prompt and decode together); where llama-batched-bench sits beside llama-bench,
#    also its decode alone at the long contexts' depths (`-npp 4096,8192 -ntg 32 -npl 1`: 32 tokens decoded after
#    a prompt of 4,096 or 8,192, as kvlab's -lengths records; llama.cpp's default f16 KV), against kvlab's f32 and
#    q8 KV decode (mean tok/s of the same 32 steps) in the same round (llama.cpp is never a dependency).
# Rounds are interleaved (bw, f32, q8, [llama f32, llama q8], ppl 64, ppl 1), min/median/max over BENCH_RUNS rounds
# (default 5; BENCH_PPL_RUNS, default 3, of them also run ppl). Threads: OMP_NUM_THREADS (default 2). The load
# average is printed at the start and the end: on a busy machine the figures are not the machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${BENCH_RUNS:-5}
PPL_RUNS=${BENCH_PPL_RUNS:-3}
LONG_RUNS=${BENCH_LONG_RUNS:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
F32=models/smollm2-135m-instruct.bin
Q8=models/smollm2-135m-instruct.q8.bin
GGUF=.cache/SmolLM2-135M-Instruct.Q4_1.gguf
TEXT=/usr/share/debian-reference/debian-reference.en.txt.gz
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

[ -f "$F32" ] || make model
[ -f "$Q8" ] || ./export "$GGUF" "$Q8" --wtype q8
[ -f "$TEXT" ] || { echo "bench: $TEXT is missing (apt-get install debian-reference-en)"; exit 1; }
# the first 2,048 tokens: the longest byte prefix of the text (to 8 bytes) that tokenizes to at most 2,048 tokens
{ zcat "$TEXT" || true; } | head -c 20000 >"$tmp/head.txt"   # zcat stops on SIGPIPE
lo=1000; hi=20000
while [ $((hi - lo)) -gt 8 ]; do
    mid=$(((lo + hi) / 2))
    n=$(head -c $mid "$tmp/head.txt" | ./run "$F32" -m tokenize -f /dev/stdin 2>/dev/null | wc -w)
    if [ "$n" -le 2048 ]; then lo=$mid; else hi=$mid; fi
done
head -c $lo "$tmp/head.txt" >"$tmp/ppl.txt"
ppl_tokens=$(./run "$F32" -m tokenize -f "$tmp/ppl.txt" 2>/dev/null | wc -w)

# weight bytes read per decoded token, from the header (docs/FORMAT.md)
bytes_per_token() {
    local h; h=($(od -An -t d4 -j 8 -N 48 "$1")); local w; w=$(od -An -t u8 -j 88 -N 8 "$1" | xargs)
    local dim=${h[0]} vocab=${h[6]} tied=${h[9]}
    if [ "$tied" -eq 1 ]; then echo "$w"
    else echo $((w - (vocab * dim * 4 + 63) / 64 * 64 + dim * 4)); fi
}
B_F32=$(bytes_per_token "$F32"); B_Q8=$(bytes_per_token "$Q8")

decode() {   # MODEL -> decode tok/s at context 256
    rm -f "$tmp/b.jsonl"
    ./run "$1" -m bench -c 320 -n 64 -o "$tmp/b.jsonl" 2>/dev/null
    grep '"context":256,' "$tmp/b.jsonl" | grep -o '"decode_tok_s":[0-9.]*' | cut -d: -f2 | grep . ||
        { echo "bench: ./run $1 -m bench gave no context-256 record" >&2; exit 1; }
}
ppl() {   # CTX CHUNK [ARGS...] -> tok/s per policy run of ./run -m ppl -c CTX -chunk CHUNK on the text
    local ctx=$1 chunk=$2; shift 2
    ./run "$F32" -m ppl -f "$tmp/ppl.txt" -c "$ctx" "$@" -chunk "$chunk" 2>&1 | grep -o '[0-9.]* tok/s per policy run' |
        cut -d' ' -f1 | grep . || { echo "bench: ./run -m ppl -c $ctx $* -chunk $chunk failed" >&2; exit 1; }
}
EVICT=(-kv h2o:64 -kv sink:64)   # at -c 256: evicting policies at steady state, every token past 64 evicts
LONG_CTX=(256 1024 4096 8192)
long_decode() {   # BW -> "spec context p50_ms fraction_of_limit" lines, f32 weights, f32 and q8 KV
    rm -f "$tmp/long.jsonl"
    ./run "$F32" -m bench -c 8224 -n 32 -lengths "$(IFS=,; echo "${LONG_CTX[*]}")" -kv full -kv full,type=q8 \
        -o "$tmp/long.jsonl" 2>/dev/null || { echo "bench: ./run -m bench -c 8224 failed" >&2; exit 1; }
    python3 - "$tmp/long.jsonl" "$1" "$B_F32" <<'PY'
import json, sys
bw, wb = float(sys.argv[2]) * 1e9, float(sys.argv[3])
for l in open(sys.argv[1]):
    r = json.loads(l)
    limit_ms = (wb + r["kv_read_bytes_per_step"]) / bw * 1e3
    print("%s %d %.3f %.4f %.3f" % ("q8" if "q8" in r["kv"] else "f32", r["context"], r["decode_ms_p50"],
                                    limit_ms / r["decode_ms_p50"], r["decode_tok_s"]))
PY
}
LLAMA_BATCHED=${LLAMA_BENCH:+$(dirname "$LLAMA_BENCH")/llama-batched-bench}
llama_depth() {   # -> "context S_TG" lines: llama.cpp's decode tok/s after a prompt of each long context >= 4096
    "$LLAMA_BATCHED" -m "$LLAMA_F32" -c 8224 -b 2048 -ub 512 -npp 4096,8192 -ntg 32 -npl 1 -t "$OMP_NUM_THREADS" \
        2>/dev/null | awk -F'|' '$2 + 0 >= 4096 { gsub(/ /, ""); print $2, $9 }'
}
batch() {   # -> "S tok/s" lines
    build/batch_bench "$F32" -p 256 -d 32 -r 1 1 2 4 8 16 | awk 'NR > 1 { print $1, $3 }'
}
llama() {   # GGUF -> tok/s
    "$LLAMA_BENCH" -m "$1" -p 0 -n 128 -t "$OMP_NUM_THREADS" -o json 2>/dev/null | grep -o '"avg_ts": *[0-9.]*' | grep -o '[0-9.]*$'
}

echo "bench: $(getconf _NPROCESSORS_ONLN) cores, OMP_NUM_THREADS=$OMP_NUM_THREADS, $RUNS rounds ($PPL_RUNS with ppl), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "bench: weight bytes read per token: f32 $B_F32, q8 $B_Q8; ppl text: $ppl_tokens tokens of the Debian Reference"
declare -A R
for r in $(seq 1 "$RUNS"); do
    R[bw]+="$(build/bw 512 7 | awk '{print $(NF - 1)}') "
    R[bw_last]=$(echo ${R[bw]} | awk '{print $NF}')
    f=$(decode "$F32"); q=$(decode "$Q8")
    R[f32]+="$f "; R[q8]+="$q "
    R[f32_frac]+="$(awk -v t="$f" -v bw="${R[bw_last]}" -v b="$B_F32" 'BEGIN { printf "%.4f", t / (bw * 1e9 / b) }') "
    R[q8_frac]+="$(awk -v t="$q" -v bw="${R[bw_last]}" -v b="$B_Q8" 'BEGIN { printf "%.4f", t / (bw * 1e9 / b) }') "
    if [ -n "${LLAMA_BENCH:-}" ]; then
        [ -n "${LLAMA_F32:-}" ] && R[llama_f32]+="$(llama "$LLAMA_F32") "
        [ -n "${LLAMA_Q8:-}" ] && R[llama_q8]+="$(llama "$LLAMA_Q8") "
    fi
    if [ "$r" -le "$PPL_RUNS" ]; then
        c64=$(ppl 2048 64); c1=$(ppl 2048 1)
        R[ppl64]+="$c64 "; R[ppl1]+="$c1 "
        R[ppl_x]+="$(awk -v a="$c64" -v b="$c1" 'BEGIN { printf "%.2f", a / b }') "
        e64=$(ppl 256 64 "${EVICT[@]}"); e1=$(ppl 256 1 "${EVICT[@]}")
        R[ev64]+="$e64 "; R[ev1]+="$e1 "
        R[ev_x]+="$(awk -v a="$e64" -v b="$e1" 'BEGIN { printf "%.2f", a / b }') "
        while read -r S tps; do R[batch_$S]+="$tps "; [ "$S" = 1 ] && b1=$tps
            R[batch_x_$S]+="$(awk -v a="$tps" -v b="$b1" 'BEGIN { printf "%.2f", a / b }') "; done < <(batch)
    fi
    if [ "$r" -le "$LONG_RUNS" ]; then
        declare -A TPS=()
        while read -r kt ctx ms frac tps; do
            R[long_${kt}_$ctx]+="$ms "; R[long_frac_${kt}_$ctx]+="$frac "; TPS[${kt}_$ctx]=$tps
        done < <(long_decode "${R[bw_last]}")
        if [ -n "${LLAMA_F32:-}" ] && [ -x "${LLAMA_BATCHED:-}" ]; then
            while read -r ctx tg; do
                R[llama_tg_$ctx]+="$tg "
                for kt in f32 q8; do
                    R[llama_x_${kt}_$ctx]+="$(awk -v a="${TPS[${kt}_$ctx]}" -v b="$tg" 'BEGIN { printf "%.3f", a / b }') "
                done
            done < <(llama_depth)
        fi
        if [ -n "${LLAMA_BENCH:-}" ] && [ -n "${LLAMA_F32:-}" ]; then
            R[llama_pg]+="$("$LLAMA_BENCH" -m "$LLAMA_F32" -p 0 -n 0 -pg 4032,64 -t "$OMP_NUM_THREADS" -o json 2>/dev/null |
                grep -o '"avg_ts": *[0-9.]*' | grep -o '[0-9.]*$' | tail -1) "
        fi
    fi
    echo "bench: round $r: bw ${R[bw_last]} GB/s, decode f32 $f q8 $q tok/s${c64:+, ppl chunk 64 $c64 chunk 1 $c1 tok/s}"
    c64=
done
stats() {   # values... -> "min median max"
    printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%10.3f %10.3f %10.3f", v[1], v[int((NR + 1) / 2)], v[NR] }'
}
printf '\n%-44s %10s %10s %10s\n' "figure" "min" "median" "max"
row() { [ -n "${R[$2]:-}" ] && printf '%-44s %s\n' "$1" "$(stats ${R[$2]})"; return 0; }
row "read bandwidth, GB/s" bw
row "decode f32, tok/s (context 256)" f32
row "  fraction of bandwidth limit (same round)" f32_frac
row "decode q8, tok/s (context 256)" q8
row "  fraction of bandwidth limit (same round)" q8_frac
row "llama.cpp f32 (llama-bench -n 128), tok/s" llama_f32
row "llama.cpp Q8_0 (llama-bench -n 128), tok/s" llama_q8
row "ppl f32 -chunk 64, tok/s per run" ppl64
row "ppl f32 -chunk 1, tok/s per run" ppl1
row "  speed-up (same round)" ppl_x
row "ppl -c 256 h2o:64, sink:64 -chunk 64, tok/s" ev64
row "ppl -c 256 h2o:64, sink:64 -chunk 1, tok/s" ev1
row "  speed-up (same round)" ev_x
for kt in f32 q8; do for ctx in "${LONG_CTX[@]}"; do
    row "decode ms/token, $kt KV, context $ctx" "long_${kt}_$ctx"
    row "  fraction of (weights + KV read) / bw" "long_frac_${kt}_$ctx"
done; done
row "llama.cpp f32 -pg 4032,64, tok/s (prompt+gen)" llama_pg
for ctx in "${LONG_CTX[@]}"; do
    row "llama.cpp f32 decode after $ctx (f16 KV), tok/s" "llama_tg_$ctx"
    row "  kvlab f32 KV / llama.cpp (same round)" "llama_x_f32_$ctx"
    row "  kvlab q8 KV / llama.cpp (same round)" "llama_x_q8_$ctx"
done
for S in 1 2 4 8 16; do row "S=$S sequences in one batch, tok/s" "batch_$S"; row "  vs S=1 (same round)" "batch_x_$S"; done
echo "bench: load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
