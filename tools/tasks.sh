#!/usr/bin/env bash
# The task grid and its leaderboard (`make tasks`): RULER's synthetic tasks through every policy family at two
# compression ratios, scored against the truth, and kvpress's view of the result (score against resident KV bytes over
# full's, tools/leaderboard.py).
#   tasks:    niah_single niah_multikey niah_multivalue niah_multiquery vt cwe (TASKS_LIST to change)
#   lengths:  1024 and 4096 tokens (TASKS_LENGTHS), -c the length, 4 items per (task, length): depths 0.25 and 0.75
#             with 2 items each (cwe has no depth: 4 items), seed 1
#   policies at each length L, budgets B = L/4 and L/10 (25% and 10% of full's f32 bytes for the evicting ones):
#             full; sink:B; h2o:B; snapkv:B (query=aware: the question in its observation window) and
#             snapkv:B,query=agnostic (compressed before the question; under B = 64: obs=B/2, quest's page=B/4);
#             quest:B (selection: it keeps
#             every token, so its resident bytes stay full's and its saving is in bytes read); full,type=q4 and
#             h2o:B,type=q4 (storage)
#   shared:   niah_multikey -questions 4 at 1024 tokens, -shared turns and -shared requests, the same policies
# One ./run -m task per (task, length) or shared run, its records in OUT/NAME.jsonl; one that ended is marked
# OUT/NAME.done and reused on the next run (TASKS_FORCE=1 measures again); an interrupted one keeps the records it
# wrote and is measured again next time. A progress line with an ETA after each run. Then OUT/leaderboard.md (the
# markdown table), OUT/leaderboard.jsonl and, with gnuplot, OUT/leaderboard.png.
# Usage: tools/tasks.sh [OUT_DIR]   (default build/tasks; env: TASKS_LIST, TASKS_LENGTHS, TASKS_ITEMS (per depth,
# default 2), TASKS_SHARED=0 (skip the shared-context runs), TASKS_FORCE, RUN, MODEL)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-build/tasks}
RUN=${RUN:-./run}
M=${MODEL:-models/smollm2-135m-instruct.bin}
LIST=${TASKS_LIST:-"niah_single niah_multikey niah_multivalue niah_multiquery vt cwe"}
LENGTHS=${TASKS_LENGTHS:-"1024 4096"}
ITEMS=${TASKS_ITEMS:-2}
say() { echo "tasks: $*" >&2; }
[ -f "$M" ] || { say "$M missing (make model)"; exit 1; }
mkdir -p "$OUT"
policies() {   # L -> the -kv arguments
    local L=$1 b
    printf -- '-kv\nfull\n-kv\nfull,type=q4\n'
    for b in $((L / 4)) $((L / 10)); do
        local snap=snapkv:$b   # its observation window (default 32) must leave slots to choose: at most B/2
        local quest=quest:$b   # and quest's pages (default 16 tokens) at least two in the budget
        [ $b -lt 64 ] && snap+=",obs=$((b / 2))" && quest+=",page=$((b / 4))"
        printf -- '-kv\nsink:%d\n-kv\nh2o:%d\n-kv\n%s\n-kv\n%s,query=agnostic\n-kv\n%s\n-kv\nh2o:%d,type=q4\n' \
            $b $b "$snap" "$snap" "$quest" $b
    done
}
runs=()   # NAME|LENGTH|ARGS
for L in $LENGTHS; do
    for t in $LIST; do
        if [ "$t" = cwe ]; then runs+=("$t.$L|$L|-task $t -items $((ITEMS * 2))")
        else runs+=("$t.$L|$L|-task $t -depths 0.25,0.75 -items $ITEMS"); fi
    done
done
if [ "${TASKS_SHARED:-1}" != 0 ]; then
    L=${LENGTHS%% *}
    for sh in turns requests; do
        runs+=("shared_$sh.$L|$L|-task niah_multikey -questions 4 -shared $sh -depths 0.25,0.75 -items $ITEMS")
    done
fi
stop=0
trap 'stop=1' INT TERM
t0=$(date +%s); n=${#runs[@]}; measured=0
for i in "${!runs[@]}"; do
    IFS='|' read -r name L args <<<"${runs[$i]}"
    f=$OUT/$name.jsonl
    if [ "${TASKS_FORCE:-0}" != 1 ] && [ -f "$OUT/$name.done" ]; then say "$((i + 1))/$n $name: reused"; continue; fi
    rm -f "$f" "$OUT/$name.done"
    mapfile -t kv < <(policies "$L")
    # shellcheck disable=SC2086
    "$RUN" "$M" -m task $args -c "$L" -lengths "$L" -s 1 "${kv[@]}" -o "$f" 2>"$OUT/$name.err"
    rc=$?
    if [ $rc -ne 0 ] || [ $stop = 1 ]; then
        say "$name stopped (status $rc: $(tail -1 "$OUT/$name.err")); its records so far are in $f"
        break
    fi
    touch "$OUT/$name.done"
    measured=$((measured + 1))
    el=$(( $(date +%s) - t0 )); left=0
    for j in $(seq $((i + 1)) $((n - 1))); do [ -f "$OUT/${runs[$j]%%|*}.done" ] || left=$((left + 1)); done
    eta=$((el * left / measured))
    printf 'tasks: %d/%d %s, %dm%02ds, ETA %dm%02ds\n' $((i + 1)) "$n" "$name" $((el / 60)) $((el % 60)) \
        $((eta / 60)) $((eta % 60)) >&2
done
el=$(( $(date +%s) - t0 ))
say "$measured run(s) measured in $((el / 60))m$((el % 60))s"
files=(); for r in "${runs[@]}"; do [ -s "$OUT/${r%%|*}.jsonl" ] && files+=("$OUT/${r%%|*}.jsonl"); done
[ ${#files[@]} -gt 0 ] || { say "no records"; exit 1; }
python3 tools/leaderboard.py "${files[@]}" --jsonl "$OUT/leaderboard.jsonl" --plot "$OUT/leaderboard.png" \
    >"$OUT/leaderboard.md" || exit 1
say "leaderboard: $OUT/leaderboard.md, $OUT/leaderboard.jsonl"
[ $stop = 1 ] && exit 130
exit 0
