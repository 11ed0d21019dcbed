#!/usr/bin/env bash
# tools/tasks.sh (`make tasks`, the task grid and its leaderboard) at its smallest on SmolLM2: one task, one length of
# 256 tokens, 2 items, no shared runs: a record per (policy, item) for the grid's 13 policies, the leaderboard's 13
# rows with full at ratio 1, a second run reusing the finished run; then the steps ceiling (full alone, at 256 tokens
# here) and ratios (every family at four ratios, at 512 tokens here: 28 policies), run side by side (TASKS_JOBS=2), a
# record per (policy, item) each; a run that fails stops the grid with status 1 and says so.
# About 2 minutes on 2 quiet cores. SKIPs without the model and under KVLAB_SANITIZE.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/tasks_grid; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
M=models/smollm2-135m-instruct.bin
[ -f "$M" ] || { echo "SKIP tasks grid: $M missing (make model)"; exit 0; }
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP tasks grid on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
export RUN=${KVLAB_RUN:-./run} TASKS_LIST=niah_single TASKS_LENGTHS=256 TASKS_ITEMS=1 TASKS_SHARED=0
tools/tasks.sh "$tmp/out" >"$tmp/log" 2>&1 || fail "tools/tasks.sh exited $?: $(tail -3 "$tmp/log")"
n_rec=$(grep -c '"mode":"task"' "$tmp/out/niah_single.256.jsonl" 2>/dev/null)
n_kv=$(grep -o '"kv":"[^"]*"' "$tmp/out/niah_single.256.jsonl" 2>/dev/null | sort -u | wc -l)
[ "$n_rec" = 26 ] && [ "$n_kv" = 13 ] && pass "26 records of 13 policies (2 items each)" ||
    fail "records: $n_rec of $n_kv policies: $(tail -n 2 "$tmp/log")"
rows=$(grep -c '^| niah_single | 256 |' "$tmp/out/leaderboard.md" 2>/dev/null)
grep -q '^| niah_single | 256 | `full` | 2 | [0-9.]* | [0-9.]* | 1.000 |$' "$tmp/out/leaderboard.md" && [ "$rows" = 13 ] &&
    pass "leaderboard.md: 13 rows, full at ratio 1.000" || fail "leaderboard.md: $(cat "$tmp/out/leaderboard.md")"
tools/tasks.sh "$tmp/out" >"$tmp/log2" 2>&1
grep -q 'niah_single.256: reused' "$tmp/log2" && grep -q '0 run(s) measured' "$tmp/log2" &&
    pass "a second run reuses the finished run" || fail "second run: $(cat "$tmp/log2")"
TASKS_JOBS=2 TASKS_STEPS="ceiling ratios" TASKS_CEILING_LENGTHS=256 TASKS_RATIO_LENGTH=512 tools/tasks.sh "$tmp/steps" >"$tmp/log3" 2>&1 ||
    fail "tools/tasks.sh ceiling ratios exited $?: $(tail -3 "$tmp/log3")"
c_kv=$(grep -o '"kv":"[^"]*"' "$tmp/steps/ceiling_niah_single.256.jsonl" 2>/dev/null | sort | uniq -c | awk '{print $1, $2}')
r_rec=$(grep -c '"mode":"task"' "$tmp/steps/ratios_niah_single.512.jsonl" 2>/dev/null)
r_kv=$(grep -o '"kv":"[^"]*"' "$tmp/steps/ratios_niah_single.512.jsonl" 2>/dev/null | sort -u | wc -l)
[ "$c_kv" = '2 "kv":"full"' ] && [ "$r_rec" = 56 ] && [ "$r_kv" = 28 ] &&
    pass "ceiling: full's 2 records; ratios: 56 records of 28 policies (5 of full's storage forms, 4 budgets of sink, h2o, snapkv, quest, pool and 3 of h2o,alloc=pyramid)" ||
    fail "steps: ceiling '$c_kv', ratios $r_rec records of $r_kv policies: $(tail -n 2 "$tmp/log3")"
RUN=false tools/tasks.sh "$tmp/fails" >"$tmp/log4" 2>&1; rc=$?
[ $rc = 1 ] && grep -q 'niah_single.256 stopped (status 1' "$tmp/log4" && grep -q 'did not finish: niah_single.256' "$tmp/log4" &&
    [ ! -f "$tmp/fails/niah_single.256.done" ] && pass "a failing run: status 1, named, not marked done" ||
    fail "a failing run: status $rc: $(cat "$tmp/log4")"
