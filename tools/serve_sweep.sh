#!/usr/bin/env bash
# The serving sweep README reports (`make serve-sweep`): SmolLM2, a generated trace of REQUESTS requests (default 64)
# of 256 to 1,024 document tokens over four licence texts, N answer tokens (default 16), a request every 2 steps.
#   1. access patterns at a pool of 100% of the demand under full: sequential, random, hotspot (hit rate, TTFT);
#   2. pool sizes 100, 50, 25, 10% (hotspot): full (preempting), the default adapt: chain, and the static
#      full,type=q8, sink:256,type=q8 and h2o:256 at 100% and 10%;
#   3. quality against each request's own full shadow (-shadow 1) for the static policies once (their answers do not
#      depend on the pool) and for adapt at every pool size (its switches do).
# Each run appends its records to OUT/sweep.jsonl as it ends, so an interrupted sweep keeps what it measured; a
# progress line with an ETA after each run; the table (markdown) at the end, from the records: tools/serve_table.py.
# Usage: tools/serve_sweep.sh [OUT_DIR]   (env: REQUESTS, N, RUN, MODEL)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-build/serve_sweep}
RUN=${RUN:-./run}
M=${MODEL:-models/smollm2-135m-instruct.bin}
REQ=${REQUESTS:-64}
N=${N:-16}
[ -f "$M" ] || { echo "serve_sweep: $M missing (make model)" >&2; exit 1; }
mkdir -p "$OUT"
L=/usr/share/common-licenses
T="-docs $L/GPL-3 -docs $L/Apache-2.0 -docs $L/Artistic -docs $L/MPL-2.0 -requests $REQ -lengths 256,1024 -n $N -arrival 2 -s 1"
ADAPT=adapt:full@0/q8@80/h2o:1024@90/h2o:256@95
runs=()
for p in sequential random hotspot; do runs+=("pattern=$p|-pattern $p -pool 100% -kv full"); done
for pool in 50% 25% 10%; do runs+=("pool=$pool|-pattern hotspot -pool $pool -kv full"); done
for pool in 100% 50% 25% 10%; do runs+=("pool=$pool|-pattern hotspot -pool $pool -kv $ADAPT -shadow 1"); done
runs+=("pool=100%|-pattern hotspot -pool 100% -kv full,type=q8 -kv sink:256,type=q8 -kv h2o:256")
runs+=("pool=10%|-pattern hotspot -pool 10% -kv full,type=q8 -kv sink:256,type=q8 -kv h2o:256 -shadow 1")
: >"$OUT/sweep.jsonl"
t0=$(date +%s)
n=${#runs[@]}
for i in "${!runs[@]}"; do
    tag=${runs[$i]%%|*} args=${runs[$i]#*|}
    "$RUN" "$M" -m serve $T $args -o "$OUT/run$i.jsonl" 2>"$OUT/run$i.err"
    rc=$?
    [ $rc -eq 0 ] || { echo "serve_sweep: run $((i + 1)) ($tag $args) exited $rc: $(tail -1 "$OUT/run$i.err")" >&2; exit $rc; }
    sed "s/^{/{\"sweep\":\"$tag\",/" "$OUT/run$i.jsonl" >>"$OUT/sweep.jsonl"
    el=$(( $(date +%s) - t0 )); done_n=$((i + 1))
    printf 'serve_sweep: %d/%d runs (%s %s), %dm%02ds, ETA %dm%02ds\n' $done_n $n "$tag" "${args##*-kv }" $((el / 60)) \
        $((el % 60)) $((el * (n - done_n) / done_n / 60)) $((el * (n - done_n) / done_n % 60)) >&2
done
el=$(( $(date +%s) - t0 ))
echo "serve_sweep: $n runs in $((el / 60))m$((el % 60))s; records in $OUT/sweep.jsonl" >&2
python3 tools/serve_table.py "$OUT/sweep.jsonl"
