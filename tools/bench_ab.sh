#!/usr/bin/env bash
# tools/bench_ab.sh RUN_BEFORE RUN_AFTER: did a change move the speed? The figures of make bench that a refactor must
# keep (decode tok/s at context 256 with f32 and q8 weights, ./run -m bench; batched evaluation, ./run -m ppl -chunk 64
# on the first 2,048 tokens of the Debian Reference, tok/s per policy run), for two ./run binaries in interleaved
# rounds: each round runs both, the order alternating, so drift in the machine's load falls on both alike.
# Prints min/median/max per binary and the median ratio after/before. BENCH_RUNS rounds (default 5; BENCH_PPL_RUNS of
# them, default 3, also run ppl), OMP_NUM_THREADS (default 2). On a busy machine the figures are not the machine's:
# the load average is printed at the start and the end.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?usage: tools/bench_ab.sh RUN_BEFORE RUN_AFTER}; B=${2:?usage: tools/bench_ab.sh RUN_BEFORE RUN_AFTER}
RUNS=${BENCH_RUNS:-5}; PPL_RUNS=${BENCH_PPL_RUNS:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
F32=models/smollm2-135m-instruct.bin; Q8=models/smollm2-135m-instruct.q8.bin
TEXT=/usr/share/debian-reference/debian-reference.en.txt.gz
for f in "$F32" "$Q8" "$TEXT"; do [ -f "$f" ] || { echo "bench_ab: $f is missing (make bench makes the models)" >&2; exit 1; }; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
{ zcat "$TEXT" || true; } | head -c 20000 >"$tmp/text.txt"   # more than 2,048 tokens; -n 2048 scores 2,048

decode() {   # RUN MODEL -> decode tok/s at context 256
    rm -f "$tmp/b.jsonl"
    "$1" "$2" -m bench -c 320 -n 64 -o "$tmp/b.jsonl" 2>/dev/null
    grep '"context":256,' "$tmp/b.jsonl" | grep -o '"decode_tok_s":[0-9.]*' | cut -d: -f2 | grep . ||
        { echo "bench_ab: $1 $2 -m bench gave no context-256 record" >&2; exit 1; }
}
ppl() {   # RUN -> tok/s per policy run, -chunk 64
    "$1" "$F32" -m ppl -f "$tmp/text.txt" -c 2048 -n 2048 -chunk 64 2>&1 | grep -o '[0-9.]* tok/s per policy run' |
        cut -d' ' -f1 | grep . || { echo "bench_ab: $1 -m ppl failed" >&2; exit 1; }
}

echo "bench_ab: before $A, after $B; $(getconf _NPROCESSORS_ONLN) cores, OMP_NUM_THREADS=$OMP_NUM_THREADS, $RUNS rounds ($PPL_RUNS with ppl), load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A R
for r in $(seq 1 "$RUNS"); do
    order="a b"; [ $((r % 2)) -eq 0 ] && order="b a"
    for w in $order; do
        run=$A; [ "$w" = b ] && run=$B
        R[f32_$w]+="$(decode "$run" "$F32") "; R[q8_$w]+="$(decode "$run" "$Q8") "
        [ "$r" -le "$PPL_RUNS" ] && R[ppl_$w]+="$(ppl "$run") "
    done
    last() { echo "$1" | awk '{ print $NF }'; }
    echo "bench_ab: round $r ($order): decode f32 $(last "${R[f32_a]}") / $(last "${R[f32_b]}"), q8" \
         "$(last "${R[q8_a]}") / $(last "${R[q8_b]}") tok/s (before / after)"
done
stats() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%9.2f %9.2f %9.2f", v[1], v[int((NR + 1) / 2)], v[NR] }'; }
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
printf '\n%-38s %29s   %29s   %s\n' "figure" "before: min median max" "after: min median max" "after/before"
for k in f32 q8 ppl; do
    [ -n "${R[${k}_a]:-}" ] || continue
    name=$(case $k in f32) echo "decode f32, tok/s (context 256)" ;; q8) echo "decode q8, tok/s (context 256)" ;;
                      ppl) echo "ppl f32 -chunk 64, tok/s per run" ;; esac)
    printf '%-38s %29s   %29s   %.3f\n' "$name" "$(stats ${R[${k}_a]})" "$(stats ${R[${k}_b]})" \
        "$(awk -v a="$(median ${R[${k}_a]})" -v b="$(median ${R[${k}_b]})" 'BEGIN { print b / a }')"
done
echo "bench_ab: load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
