#!/usr/bin/env bash
# Replays every committed fuzz input through its target, in whatever build runs the suite (make test: the normal
# build; make test-debug: ASan + UBSan): tests/fuzz/corpus/TARGET (the minimized corpora), tests/fuzz/crashes/TARGET
# (each input that once crashed kvlab; tests/fuzz/README.md says which bug) and the seeds tests/fuzz/make_seeds.sh
# makes. $BIN/replay_TARGET is the libFuzzer target linked with tests/fuzz/replay_main.c instead of libFuzzer, so no
# clang is needed. One PASS per target and directory, one per crash reproducer; a crash is a FAIL naming the input.
# Usage: tests/test_fuzz_replay.sh [TEST_BIN_DIR] (from tests/run.sh).
set -u
cd "$(dirname "$0")/.."
bin=${1:-tests/bin}
EXPORT=${KVLAB_EXPORT:-./export}
seeds=tests/tmp/fuzz_seeds
log=tests/tmp/fuzz_replay.log
mkdir -p tests/tmp
if ! KVLAB_EXPORT=$EXPORT tests/fuzz/make_seeds.sh "$seeds" >"$log" 2>&1; then
    echo "FAIL fuzz replay: tests/fuzz/make_seeds.sh failed: $(tail -2 "$log")"; exit 1
fi
export KVLAB_FUZZ_VOCABS=$seeds/vocabs   # fuzz_encode's vocabularies, the same ones tools/fuzz.sh uses
found=0
for r in "$bin"/replay_*; do
    [ -x "$r" ] || continue
    found=1
    t=${r##*/replay_}
    for dir in tests/fuzz/corpus/$t "$seeds/$t"; do
        [ -d "$dir" ] || continue
        n=$(find "$dir" -maxdepth 1 -type f | wc -l)
        [ "$n" -gt 0 ] || continue
        if "$r" "$dir" >"$log" 2>&1; then echo "PASS fuzz replay $t: $n inputs of $dir"
        else echo "FAIL fuzz replay $t: $dir crashed (exit $?): $(grep -m3 -E 'ERROR|runtime error|fuzz_|Assert' "$log")"; fi
    done
    for f in tests/fuzz/crashes/$t/*; do
        [ -f "$f" ] || continue
        case $f in *.md|*.txt) continue ;; esac
        if "$r" "$f" >"$log" 2>&1; then echo "PASS crash reproducer $f no longer crashes"
        else echo "FAIL crash reproducer $f crashes again (exit $?): $(grep -m3 -E 'ERROR|runtime error|fuzz_' "$log")"; fi
    done
done
[ $found = 1 ] || echo "FAIL fuzz replay: no $bin/replay_* binaries (make test builds them)"
exit 0
