#!/usr/bin/env bash
# tools/fuzz.sh: build and run kvlab's libFuzzer targets (tests/fuzz/fuzz_*.c) with AddressSanitizer and
# UndefinedBehaviorSanitizer, one target at a time on one core. Installs clang (Debian's package carries libFuzzer)
# when it is missing. Seeds are files the project makes itself (tests/fuzz/gen_seeds.py, ./export); the committed
# corpora in tests/fuzz/corpus/TARGET are minimized (libFuzzer -merge=1) and replayed by tests/test_fuzz_replay.sh.
#
# usage: tools/fuzz.sh [-t SECONDS] [-r RUNS] [--build-only] [--merge] [TARGET...]
#   -t SECONDS   time per target (default 60); -r RUNS: stop a target after RUNS executions (default: no limit)
#   --merge      afterwards, rewrite tests/fuzz/corpus/TARGET as a minimal set of inputs covering every edge found
#   TARGET       model gguf tokenizer encode kvspec cli trace (default: all)
# Crashes land in build/fuzz/crashes/TARGET/; logs (execution counts) in build/fuzz/logs/TARGET.log.
# Extra seeds (never committed): FUZZ_EXTRA_SEEDS=DIR adds DIR/TARGET/* to a run.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=60; runs=-1; build_only=0; merge=0; targets=()
while [ $# -gt 0 ]; do
    case $1 in
        -t) secs=$2; shift 2 ;;
        -r) runs=$2; shift 2 ;;
        --build-only) build_only=1; shift ;;
        --merge) merge=1; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) echo "fuzz.sh: unknown flag $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done
[ ${#targets[@]} -gt 0 ] || targets=(model gguf tokenizer encode kvspec cli trace)

CC=${FUZZ_CC:-clang}
if ! command -v "$CC" >/dev/null; then
    echo "fuzz.sh: $CC not found; installing Debian's clang (it carries libFuzzer)"
    if [ "$(id -u)" = 0 ]; then apt-get install -y clang >/dev/null; else sudo apt-get install -y clang >/dev/null; fi
fi

B=build/fuzz
mkdir -p $B/obj $B/logs $B/work $B/crashes
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all"
CFLAGS="-g -O1 -fno-omit-frame-pointer -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -DKVLAB_GIT=\"fuzz\"
        -Wall -Wno-unused-parameter -Wno-unused-function -Wno-unknown-pragmas -I. $SAN"
objs=()
# the engine's objects, as the Makefile lists them (ENGINE); main lives elsewhere (main.c, export_main.c)
engine=$(sed -n 's/^ENGINE *:= *//p' Makefile)
[ -n "$engine" ] || { echo "fuzz.sh: no ENGINE list in the Makefile" >&2; exit 2; }
for src in $engine; do
    o=$B/obj/$src.o
    if [ ! -f "$o" ] || [ "$src.c" -nt "$o" ] || [ -n "$(find . -maxdepth 1 -name '*.h' -newer "$o")" ]; then
        $CC $CFLAGS -fsanitize=fuzzer-no-link -c -o "$o" "$src.c"
    fi
    objs+=("$o")
done
for t in "${targets[@]}"; do
    [ -f tests/fuzz/fuzz_$t.c ] || { echo "fuzz.sh: no target tests/fuzz/fuzz_$t.c" >&2; exit 2; }
    $CC $CFLAGS -fsanitize=fuzzer -o $B/fuzz_$t tests/fuzz/fuzz_$t.c "${objs[@]}" -lm
done
echo "fuzz.sh: built ${targets[*]} in $B"

# Seeds: generated here, from scratch, every time (cheap); tests/fuzz/make_seeds.sh says what they are.
tests/fuzz/make_seeds.sh $B/seeds >/dev/null
[ $build_only = 1 ] && exit 0

status=0
for t in "${targets[@]}"; do
    mkdir -p $B/work/$t $B/crashes/$t tests/fuzz/corpus/$t
    dict=(); [ -f tests/fuzz/$t.dict ] && dict=(-dict=tests/fuzz/$t.dict)
    extra=(); [ -n "${FUZZ_EXTRA_SEEDS:-}" ] && [ -d "$FUZZ_EXTRA_SEEDS/$t" ] && extra=("$FUZZ_EXTRA_SEEDS/$t")
    echo "fuzz.sh: $t for ${secs}s (runs limit $runs), log $B/logs/$t.log"
    # -rss_limit_mb: a parser that tries to allocate what a header claims must fail before the limit
    if ! KVLAB_FUZZ_VOCABS=$B/seeds/vocabs \
        $B/fuzz_$t -max_total_time="$secs" -runs="$runs" -rss_limit_mb=2048 -timeout=20 -print_final_stats=1 \
        -artifact_prefix=$B/crashes/$t/ "${dict[@]}" $B/work/$t tests/fuzz/corpus/$t $B/seeds/$t "${extra[@]}" \
        >$B/logs/$t.log 2>&1; then
        echo "fuzz.sh: $t FOUND A CRASH: $(ls -t $B/crashes/$t | head -1) (log $B/logs/$t.log)"
        status=1
    fi
    grep -E "^stat::number_of_executed_units|^Done" $B/logs/$t.log | tr '\n' ' '; echo
    if [ $merge = 1 ]; then
        # edges only (-use_counters=0): a small regression corpus that keeps every covered edge; the full working
        # corpus stays in build/fuzz/work for the next run
        rm -rf $B/merged/$t; mkdir -p $B/merged/$t
        KVLAB_FUZZ_VOCABS=$B/seeds/vocabs $B/fuzz_$t -merge=1 -use_counters=0 -rss_limit_mb=2048 $B/merged/$t \
            tests/fuzz/corpus/$t $B/work/$t $B/seeds/$t >$B/logs/$t.merge.log 2>&1
        rm -rf tests/fuzz/corpus/$t; mv $B/merged/$t tests/fuzz/corpus/$t
        echo "fuzz.sh: $t corpus now $(ls tests/fuzz/corpus/$t | wc -l) files, $(du -sk tests/fuzz/corpus/$t | cut -f1) KiB"
    fi
done
exit $status
