#!/usr/bin/env bash
# The one test runner: runs every test program and script, counts the PASS/FAIL/SKIP lines they print,
# and ends with the slowest tests (wall seconds) and "N passed, N failed, N skipped". Exit status is non-zero on any failure or on a test that crashed.
# Usage: tests/run.sh [BUILD_DIR]   (BUILD_DIR holds the test binaries; default tests/bin)
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
pass=0; fail=0; skip=0; crashed=0
log=$(mktemp); times=$(mktemp); trap 'rm -f "$log" "$times"' EXIT
run_one() {   # name, command...
    local name=$1; shift
    echo "== $name"
    local t0=$SECONDS
    "$@" >"$log" 2>&1; local rc=$?
    cat "$log"
    echo "$((SECONDS - t0)) $name" >>"$times"
    local p f s
    p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log"); s=$(grep -c '^SKIP ' "$log")
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name exited with status $rc without a failed check"; fail=$((fail + 1)); crashed=1
    fi
}
for t in "$bin"/test_*; do
    [ -x "$t" ] || continue
    run_one "$(basename "$t")" "$t"
done
for t in tests/test_*.sh; do
    [ -f "$t" ] || continue
    run_one "$(basename "$t")" bash "$t" "$bin"
done
echo
echo "slowest (seconds):"; sort -rn "$times" | head -8 | sed 's/^/  /'
echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ] && [ $crashed -eq 0 ]
