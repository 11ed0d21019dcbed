#!/usr/bin/env bash
# Long streams (`make stream`): perplexity over the whole Debian Reference (about 212K SmolLM2 tokens, 26 times the
# model's trained context of 8,192) through each evicting policy, by 1,024-token bucket of position: the decay
# curve. StreamingLLM's claim (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
# arXiv:2309.17453) is that sinks with positions by rank in the cache (pos=cache) stay flat where positions by
# original index (pos=orig) leave the trained range; window, h2o and tova show what the other families do there.
#
# One ./run -m ppl per policy (the runs share nothing but the text; one process each means an interrupted stream
# loses only the policy it was in): each writes OUT/POLICY.jsonl, a policy whose record is complete is reused on the
# next run (STREAM_FORCE=1 measures it again), and an interrupted one keeps its partial record ("partial":true,
# its scored_tokens the -n that reproduces it). Then OUT/decay.dat (bucket start, then each policy's bucket_ppl,
# "nan" where it scored nothing) and, with gnuplot, OUT/decay.png. ./run prints its progress line with an ETA.
#
# Usage: tools/stream.sh [OUT_DIR]     (default build/stream)
# Environment: STREAM_TEXT=FILE (default: the Debian Reference, decompressed into OUT), STREAM_TOKENS=N (score at
# most N tokens: -n), STREAM_KV="SPEC ..." (default below), STREAM_BUCKET=W (default 1024), STREAM_CTX=C (-c, the
# shadow's span; default 2048), STREAM_FORCE=1, RUN, MODEL.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-build/stream}
RUN=${RUN:-./run}
M=${MODEL:-models/smollm2-135m-instruct.bin}
KV=${STREAM_KV:-"sink:256,pos=cache sink:256,pos=orig window:256 h2o:256 tova:256"}
W=${STREAM_BUCKET:-1024}
C=${STREAM_CTX:-2048}
say() { echo "stream: $*" >&2; }
[ -f "$M" ] || { say "$M missing (make model)"; exit 1; }
mkdir -p "$OUT"
TEXT=${STREAM_TEXT:-}
if [ -z "$TEXT" ]; then
    GZ=/usr/share/debian-reference/debian-reference.en.txt.gz
    [ -f "$GZ" ] || { say "$GZ missing: apt-get install debian-reference-en (or STREAM_TEXT=FILE)"; exit 1; }
    TEXT=$OUT/debian-reference.en.txt
    if [ ! -s "$TEXT" ]; then
        { zcat "$GZ" >"$TEXT.tmp" && mv -f "$TEXT.tmp" "$TEXT"; } || { say "could not decompress $GZ into $TEXT"; exit 1; }
    fi
fi
[ -s "$TEXT" ] || { say "STREAM_TEXT '$TEXT' is missing or empty"; exit 1; }
LIMIT=(); [ -n "${STREAM_TOKENS:-}" ] && LIMIT=(-n "$STREAM_TOKENS")
file_of() { echo "$OUT/$(echo "$1" | tr ':,=' '_._').jsonl"; }   # sink:256,pos=cache -> sink_256.pos_cache.jsonl
complete() { [ -s "$1" ] && grep -q '"partial":false' "$1" && grep -q "\"bucket_tokens\":$W," "$1" &&
             { [ -z "${STREAM_TOKENS:-}" ] || grep -q "\"scored_tokens\":$STREAM_TOKENS," "$1"; }; }
stop=0
trap 'stop=1' INT TERM
t0=$(date +%s); n=0; total=$(echo $KV | wc -w)
for kv in $KV; do
    n=$((n + 1))
    f=$(file_of "$kv")
    if [ "${STREAM_FORCE:-0}" != 1 ] && complete "$f"; then say "$n/$total $kv: reused $f"; continue; fi
    say "$n/$total $kv: -m ppl over $TEXT ${LIMIT[*]} -c $C -chunk 64 -bucket $W"
    rm -f "$f"
    "$RUN" "$M" -m ppl -f "$TEXT" "${LIMIT[@]}" -c "$C" -chunk 64 -bucket "$W" -kv "$kv" -o "$f" 2>"$f.err"
    rc=$?
    tail -1 "$f.err" >&2
    if [ $rc -ne 0 ] || [ $stop = 1 ]; then
        say "$kv stopped (status $rc): its record so far is in $f; the rest is not measured (rerun to go on)"
        break
    fi
    el=$(( $(date +%s) - t0 ))
    say "$n/$total done, $((el / 60))m$((el % 60))s"
done
# the decay table from every policy's record there is (python3: the JSON lines)
python3 - "$OUT/decay.dat" $(for kv in $KV; do f=$(file_of "$kv"); [ -s "$f" ] && echo "$f"; done) <<'EOF'
import json, sys
out, files = sys.argv[1], sys.argv[2:]
cols = []
for f in files:
    for line in open(f):
        r = json.loads(line)
        if r.get("mode") == "ppl" and r["kv"] != "shadow":
            cols.append((r["kv"] + (" (partial)" if r["partial"] else ""), r["bucket_tokens"], r["bucket_ppl"]))
if not cols:
    sys.exit("stream: no record to tabulate")
n = max(len(c[2]) for c in cols)
with open(out, "w") as o:
    o.write("position " + " ".join('"%s"' % c[0] for c in cols) + "\n")
    for b in range(n):
        vals = [c[2][b] if b < len(c[2]) and c[2][b] is not None else float("nan") for c in cols]
        o.write("%d %s\n" % (b * cols[0][1], " ".join("%.4f" % v for v in vals)))
print("stream: %s: %d buckets x %d policies" % (out, n, len(cols)), file=sys.stderr)
EOF
if command -v gnuplot >/dev/null; then
    k=$(($(head -1 "$OUT/decay.dat" | wc -w) - 1))
    gnuplot <<GP && say "plot: $OUT/decay.png"
set terminal png size 900,500
set output "$OUT/decay.png"
set title "perplexity per $W-token bucket of position, Debian Reference (SmolLM2-135M, trained context 8,192)"
set xlabel "position (tokens)"; set ylabel "perplexity"; set logscale y; set key top left
set arrow from 8192, graph 0 to 8192, graph 1 nohead dashtype 2
plot for [i=2:$((k + 1))] "$OUT/decay.dat" using 1:i with lines title columnheader(i)
GP
else say "no gnuplot: the table $OUT/decay.dat is the result (apt-get install gnuplot-nox for the plot)"; fi
