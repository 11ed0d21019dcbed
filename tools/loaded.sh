#!/usr/bin/env bash
# The quick start on a quiet machine and with busy neighbours (`yes > /dev/null`, one per neighbour): generation
# tok/s (the summary line) for each OpenMP setting, median of ROUNDS runs, rounds interleaved. This is how the
# default thread count and wait policy were chosen (README, Threads). Usage: tools/loaded.sh [ROUNDS]
set -u
cd "$(dirname "$0")/.."
rounds=${1:-3}
M=models/smollm2-135m-instruct.bin
[ -f "$M" ] || { echo "loaded: $M missing: make model" >&2; exit 1; }
run_once() {   # ENV... : tok/s of one quick-start run
    env "$@" ./run "$M" -m chat -t 0 -n 200 -kv sink:128 -i "Explain why the sky is blue." 2>&1 >/dev/null |
        sed -n 's/.*generated [0-9]* tok, \([0-9.]*\) tok\/s.*/\1/p'
}
settings=("KVLAB_THREADS_DEFAULT=0" "KVLAB_THREADS_DEFAULT=0 OMP_WAIT_POLICY=passive"
          "KVLAB_THREADS_DEFAULT=0 GOMP_SPINCOUNT=10000" "KVLAB_THREADS_DEFAULT=0 OMP_NUM_THREADS=1"
          "KVLAB_THREADS_DEFAULT=1")
names=("OpenMP's default (spin)" "OMP_WAIT_POLICY=passive" "GOMP_SPINCOUNT=10000" "OMP_NUM_THREADS=1"
       "kvlab's default")
[ -n "${LOADED_ONLY:-}" ] && { settings=("${settings[@]:$LOADED_ONLY:1}"); names=("${names[@]:$LOADED_ONLY:1}"); }
printf "%-28s %12s %12s %12s\n" "setting (tok/s, median)" "quiet" "1 neighbour" "2 neighbours"
for i in "${!settings[@]}"; do
    row=()
    for busy in 0 1 2; do
        pids=(); for ((b = 0; b < busy; b++)); do yes >/dev/null & pids+=($!); done
        vals=(); for ((r = 0; r < rounds; r++)); do vals+=("$(run_once ${settings[$i]})"); done
        for p in "${pids[@]}"; do kill "$p"; done; wait 2>/dev/null
        row+=("$(printf '%s\n' "${vals[@]}" | sort -g | sed -n "$(((rounds + 1) / 2))p")")
    done
    printf "%-28s %12s %12s %12s\n" "${names[$i]}" "${row[@]}"
done
