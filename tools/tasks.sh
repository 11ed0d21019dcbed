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
#             quest:B,prompt=dense (selection, with the Quest paper's dense prefill: the prompt's queries read every
#             token, the answer's select; it keeps every token, so its resident bytes stay full's and its saving is in
#             bytes read); q4 storage at its two ratios: full,type=q4 (0.176 of full's bytes, the 25% entry: q4 keeps
#             no more) and h2o:(57% of L),type=q4 (0.100: the 10% entry). 13 policies.
#   shared:   niah_multikey -questions 4 at 1024 tokens, -shared turns and -shared requests, the same policies
# Two more steps, named in TASKS_STEPS (default "grid"; e.g. TASKS_STEPS="grid ceiling ratios"):
#   ceiling:  full alone at 1024, 4096 and 8192 tokens (TASKS_CEILING_LENGTHS), every task, 4 items: the score every
#             policy is read against
#   ratios:   every family at four compression ratios at 1024 tokens (TASKS_RATIO_LENGTH), budgets B = L/2, L/4, L/10,
#             L/20: sink, h2o and snapkv (eviction), quest (selection: bytes read, not resident), pool:B (merging,
#             where B >= 16),
#             h2o:B,alloc=pyramid (allocation, where B >= 40), and precision at its own ratios (full with type=q8, q4, q2 and
#             ktype=q4,vtype=q2); TASKS_RATIO_LIST chooses the tasks (default: the grid's)
# One ./run -m task per (task, length) or shared run, its records in OUT/NAME.jsonl; one that ended is marked
# OUT/NAME.done and reused on the next run (TASKS_FORCE=1 measures again); an interrupted one keeps the records it
# wrote and is measured again next time. A progress line with an ETA after each run. Then OUT/leaderboard.md (the
# markdown table), OUT/leaderboard.jsonl and, with gnuplot, OUT/leaderboard.png.
# Usage: tools/tasks.sh [OUT_DIR]   (default build/tasks; env: TASKS_LIST, TASKS_LENGTHS, TASKS_ITEMS (per depth,
# default 2), TASKS_SHARED=0 (skip the shared-context runs), TASKS_FORCE, TASKS_JOBS (runs at a time, default the
# number of cores), RUN, MODEL)
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
policies() {   # L SET -> the -kv arguments
    local L=$1 set=$2 b
    if [ "$set" = ceiling ]; then printf -- '-kv\nfull\n'; return; fi
    if [ "$set" = ratios ]; then
        printf -- '-kv\n%s\n' full full,type=q8 full,type=q4 full,type=q2 full,ktype=q4,vtype=q2
        for b in $((L / 2)) $((L / 4)) $((L / 10)) $((L / 20)); do
            local snap=snapkv:$b quest=quest:$b,prompt=dense
            [ $b -lt 64 ] && snap+=",obs=$((b / 2))" && quest+=",page=$((b / 4))"
            printf -- '-kv\n%s\n' sink:$b h2o:$b "$snap" "$quest"
            # pool keeps 4 sinks, recent=B/2 and a group of 4 waiting: B >= 16
            [ $b -ge 16 ] && printf -- '-kv\npool:%d\n' $b
            # PyramidKV gives the top layer B/20 slots, and h2o needs 2 at least
            [ $((b / 20)) -ge 2 ] && printf -- '-kv\nh2o:%d,alloc=pyramid\n' $b
        done
        return
    fi
    # q4 storage at its two ratios: full,type=q4 (0.176 of full's bytes, the most q4 can keep: the 25% entry) and
    # h2o with 57% of the tokens in q4 (0.57 x 0.176 = 0.100: the 10% entry)
    printf -- '-kv\nfull\n-kv\nfull,type=q4\n-kv\nh2o:%d,type=q4\n' $((L * 57 / 100))
    for b in $((L / 4)) $((L / 10)); do
        local snap=snapkv:$b   # its observation window (default 32) must leave slots to choose: at most B/2
        local quest=quest:$b,prompt=dense   # and quest's pages (default 16 tokens) at least two in the budget
        [ $b -lt 64 ] && snap+=",obs=$((b / 2))" && quest+=",page=$((b / 4))"
        printf -- '-kv\nsink:%d\n-kv\nh2o:%d\n-kv\n%s\n-kv\n%s,query=agnostic\n-kv\n%s\n' \
            $b $b "$snap" "$snap" "$quest"
    done
}
runs=()   # NAME|LENGTH|SET|ARGS
item_args() {   # TASK -> its items' arguments: 4 items, at two depths where the task has depths
    if [ "$1" = cwe ]; then echo "-task $1 -items $((ITEMS * 2))"; else echo "-task $1 -depths 0.25,0.75 -items $ITEMS"; fi
}
for step in ${TASKS_STEPS:-grid}; do
    case $step in
    grid)
        for L in $LENGTHS; do for t in $LIST; do runs+=("$t.$L|$L|grid|$(item_args $t)"); done; done
        if [ "${TASKS_SHARED:-1}" != 0 ]; then
            L=${LENGTHS%% *}
            for sh in turns requests; do
                runs+=("shared_$sh.$L|$L|grid|-task niah_multikey -questions 4 -shared $sh -depths 0.25,0.75 -items $ITEMS")
            done
        fi;;
    ceiling)
        for L in ${TASKS_CEILING_LENGTHS:-1024 4096 8192}; do
            for t in $LIST; do runs+=("ceiling_$t.$L|$L|ceiling|$(item_args $t)"); done
        done;;
    ratios)
        L=${TASKS_RATIO_LENGTH:-1024}
        for t in ${TASKS_RATIO_LIST:-$LIST}; do runs+=("ratios_$t.$L|$L|ratios|$(item_args $t)"); done;;
    *) say "unknown step '$step' in TASKS_STEPS: grid, ceiling, ratios"; exit 1;;
    esac
done
# TASKS_JOBS runs at a time (default: one per core), each on OMP_NUM_THREADS threads (default 1 with several jobs):
# the results do not depend on the thread count, and on 2 cores two 1-thread runs finish in 115 s where one 2-thread
# run after the other takes 144 s (the thread team's waits and the policy steps that run on one thread). The longest
# runs start first.
JOBS=${TASKS_JOBS:-$(nproc)}
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { say "TASKS_JOBS='$JOBS': runs at a time, a whole number from 1"; exit 1; }
if [ "$JOBS" -gt 1 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
order=()   # run indices, longest length first (stable)
while read -r i; do order+=("$i"); done < <(for i in "${!runs[@]}"; do
    IFS='|' read -r _ L _ _ <<<"${runs[$i]}"; echo "$L $i"; done | sort -s -k1,1nr | cut -d' ' -f2)
stop=0; signalled=0; failed=""
declare -A job_of=()   # pid -> run index
trap 'stop=1; signalled=1; for p in "${!job_of[@]}"; do kill -TERM "$p" 2>/dev/null; done' INT TERM
t0=$(date +%s); n=${#runs[@]}; measured=0; finished=0
# the ETA weighs each run by its length L as L + L^2/16384 (the prefill's matmuls and its attention: a 4,096-token
# run measured about 5 times a 1,024-token one), so the long runs that go first do not inflate it
cost() { IFS='|' read -r _ L _ _ <<<"${runs[$1]}"; echo $((L + L * L / 16384)); }
todo=(); w_left=0; w_done=0
for i in "${order[@]}"; do
    name=${runs[$i]%%|*}
    if [ "${TASKS_FORCE:-0}" != 1 ] && [ -f "$OUT/$name.done" ]; then say "$name: reused"; finished=$((finished + 1)); continue; fi
    todo+=("$i"); w_left=$((w_left + $(cost "$i")))
done
reap() {   # wait for one job to end; mark it done, or stop on a failure
    local pid rc i name
    wait -n -p pid; rc=$?
    [ -n "${pid:-}" ] || return 0
    i=${job_of[$pid]}; unset "job_of[$pid]"
    name=${runs[$i]%%|*}
    if [ $rc -ne 0 ]; then   # a run that ended well while others failed or a signal came is kept
        say "$name stopped (status $rc: $(tail -1 "$OUT/$name.err")); its records so far are in $OUT/$name.jsonl"
        failed+=" $name"; stop=1   # the runs under way finish; no new one starts
        return 0
    fi
    touch "$OUT/$name.done"
    measured=$((measured + 1)); finished=$((finished + 1))
    local w; w=$(cost "$i"); w_done=$((w_done + w)); w_left=$((w_left - w))
    local el=$(( $(date +%s) - t0 )); local eta=$((el * w_left / w_done))
    printf 'tasks: %d/%d %s, %dm%02ds, ETA %dm%02ds\n' "$finished" "$n" "$name" $((el / 60)) $((el % 60)) \
        $((eta / 60)) $((eta % 60)) >&2
}
for i in "${todo[@]}"; do
    while [ ${#job_of[@]} -ge "$JOBS" ] && [ $stop = 0 ]; do reap; done
    [ $stop = 1 ] && break
    IFS='|' read -r name L set args <<<"${runs[$i]}"
    rm -f "$OUT/$name.jsonl" "$OUT/$name.done"
    mapfile -t kv < <(policies "$L" "$set")
    # shellcheck disable=SC2086
    "$RUN" "$M" -m task $args -c "$L" -lengths "$L" -s 1 "${kv[@]}" -o "$OUT/$name.jsonl" 2>"$OUT/$name.err" &
    job_of[$!]=$i
done
while [ ${#job_of[@]} -gt 0 ]; do reap; done
el=$(( $(date +%s) - t0 ))
say "$measured run(s) measured in $((el / 60))m$((el % 60))s"
[ -n "$failed" ] && say "did not finish:$failed"
files=(); for r in "${runs[@]}"; do [ -s "$OUT/${r%%|*}.jsonl" ] && files+=("$OUT/${r%%|*}.jsonl"); done
[ ${#files[@]} -gt 0 ] || { say "no records"; exit 1; }
python3 tools/leaderboard.py "${files[@]}" --jsonl "$OUT/leaderboard.jsonl" --plot "$OUT/leaderboard.png" \
    >"$OUT/leaderboard.md" || exit 1
say "leaderboard: $OUT/leaderboard.md, $OUT/leaderboard.jsonl"
[ $signalled = 1 ] && exit 130
[ -n "$failed" ] && exit 1
exit 0
