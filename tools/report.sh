#!/usr/bin/env bash
# make report: kvlab's evaluation of KV-cache policies on SmolLM2-135M-Instruct and the Debian Reference text, written
# as REPORT.md with PNG plots (gnuplot). Issue 5, item 6.
#
#   make report                       the full grid (REPORT_TOKENS=8192 tokens; on a 2-core Xeon, 2026-12-07: main
#                                     11m37s, quant 8m46s, pos 4m52s, passkey 2m58s, select 2m12s, tiers 1m19s,
#                                     passkey_sel 16m23s (13m20s run alone since a prompt reuses what the one
#                                     before computed), compress 27m50s (its merge=1 specs go token by token): about
#                                     76 minutes; the estimate printed first says what this machine expects, and
#                                     underestimates compress), written to build/report/: the committed report/
#                                     changes only with REPORT_OUT=report
#   REPORT_OUT=report make report     the full grid, replacing the committed report/REPORT.md and report/*.png
#   REPORT_QUICK=1 make report        a small grid (512 tokens, fewer policies, passkey -c 384 and -c 1024) to test
#                                     the script (about 10 minutes on 2 cores), written to build/report-quick/
#   REPORT_OUT=DIR                    where REPORT.md and the plots go (default: above; the first line printed says)
#   REPORT_TOKENS=N                   the stream length (budgets scale with it: see "grid" below); N >= 512
#   REPORT_PASSKEY_CTX=P              passkey -c (full grid; default 1024: lengths 256, 512, 1024)
#   REPORT_FORCE=1                    rerun every measurement (by default one whose JSON is complete is reused)
#   REPORT_PLOTS_ONLY=1               only rebuild the plots and REPORT.md from this grid's data (see "Data" below)
#   REPORT_DRY_RUN=1                  print the plan (directories, packages to install, commands) and exit
#   REPORT_PROGRESS_S=S               seconds between progress lines during a measurement (default 60)
#   REPORT_STEPS="main quant ..."     measure only these steps (the others are drawn from their data if this grid has
#                                     it, else left out of REPORT.md's plots); default: all
#   OMP_NUM_THREADS                   threads (default: nproc)
#
# What it runs (every figure's command line is written into REPORT.md, from the "cmd" field of the JSON):
#   main    ./run -m ppl over the first N tokens, -c N: full, window and sink at budgets S and L, the sink-count sweep
#           0/1/2/4/8 at S with pos=cache, window/h2o/tova/scissorhands/random at 10% and 20% of N; -tokenlog
#   quant   ./run -m ppl, same text and -c: f16/q8/q4 storage (± residual=64), q4 keys with q8 values and the
#           reverse, and h2o at 20% stored in q8 and q4 (one frontier with the evicting caches)
#   pos     ./run -m ppl over 3N tokens, -c N: sink:L with pos=orig and pos=cache (past the trained context); -tokenlog
#   passkey ./run -m passkey -c P: full, window, sink, h2o, tova at budget P/8 (depth x length grid + two turns)
#   select  ./run -m ppl over the first NS = min(N, 2048) tokens, -c NS (quick: NS = N): topk, quest, cluster, blocks
#           (selection: every token kept, B read per query) and h2o, sink, tova (eviction: B kept) at B = 64 and 256
#           (quick: 32, 64); KL and recall against the KV bytes read per step, recall_topk the bound
#   tiers   ./run -m ppl, same text and -c: quest:256 (quick: quest:64) with fast=5%/10%/25%, each with and without
#           prefetch=1: hit rate, bytes moved per token, modelled stall
#   passkey_sel ./run -m passkey -c 8192 -lengths 4096,8192 -depths 0.25,0.5,0.75 -passkey2 0: full, topk and quest
#           at 64/256 with prompt=dense, h2o:64/256, tova:256, sink:64/256 (quick: -c 1024 -lengths 512,1024; full,
#           topk:64, quest:64, h2o:64, sink:64); the longest step of the full grid
#   compress ./run -m ppl, the text and -c of main: keep every token in fewer bytes (q2, KIVI's per-channel keys,
#           precision by age for keys and values apart, low-rank keys and values, merge-on-evict, pooling), eviction at
#           5% with and without merging, eviction combined with precision, and selection at S: with main and quant,
#           the compression frontier (plot i: KL vs resident bytes and vs bytes read per step, every family)
# All runs use -chunk 64 (batched, bit-identical to token by token). Each run writes JSON lines (-o) to DATA/NAME.dat
# and its stderr to DATA/NAME.log.dat (raw data, not committed).
#
# Data: each grid has its own directory, so that a quick or shorter run neither replaces the full grid's data (an
# hour of measurements) nor is read back as it by REPORT_PLOTS_ONLY=1: report/ for the full grid (where the
# commands quoted in the committed REPORT.md and README point), build/report-quick/ for REPORT_QUICK=1 and
# build/report-TAG/ for other grids. An interrupted measurement (Ctrl-C) keeps what ./run wrote and is reported
# as incomplete at the end; the next run measures it again, reusing the complete ones.
#
# First it measures throughput (two short ppl runs and a short greedy decode) and prints an estimate of this grid's
# time and of the full grid's, from a cost model: per token a fixed cost (matmuls), plus a cost per attended token
# (for a selection policy, per key it scans), plus a rough cost for a fast tier's bookkeeping and prefetch.
#
# Dependencies: gnuplot (pngcairo or png), awk, python3 (small data wrangling), the Debian Reference text; the
# missing ones are listed with what each is for, then installed with apt-get --no-install-recommends.
set -euo pipefail
cd "$(dirname "$0")/.."
T_START=$(date +%s)
QUICK=${REPORT_QUICK:-0}
PLOTS_ONLY=${REPORT_PLOTS_ONLY:-0}
DRY_RUN=${REPORT_DRY_RUN:-0}
PROGRESS_S=${REPORT_PROGRESS_S:-60}
if [ "$QUICK" = 1 ]; then N=${REPORT_TOKENS:-512}; else N=${REPORT_TOKENS:-8192}; fi
NPROC=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)   # nproc alone obeys OMP_NUM_THREADS
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$NPROC}
MODEL=models/smollm2-135m-instruct.bin
GZ=/usr/share/debian-reference/debian-reference.en.txt.gz
CHUNK=64
say() { echo "report: $*" >&2; }

# ---- grid -------------------------------------------------------------------------------------------------------
# budgets: S and L (256 and 1024 at N=8192: N/32 and N/8), B10 and B20 (10% and 20% of N: 820 and 1640 at 8192)
S=$((N / 32)); L=$((N / 8)); B10=$(((N + 9) / 10)); B20=$((2 * B10))
[ "$S" -ge 16 ] || { echo "report: REPORT_TOKENS=$N is too small (budgets would be under 16 tokens; 512 is the least)" >&2; exit 1; }
if [ "$QUICK" = 1 ]; then
    MAIN=(full "window:$S" "window:$L" "sink:$S" "sink:$L" "sink:$S,pos=cache,sinks=0" "sink:$S,pos=cache,sinks=1"
          "sink:$S,pos=cache" "window:$B10" "h2o:$B10" "h2o:$B20" "tova:$B10" "scissorhands:$B10" "random:$B10")
    QUANT=("full,type=q8" "full,type=q4" "full,type=q4,residual=64" "full,ktype=q4,vtype=q8")
    PK_C=384
    PK=(full "window:$((PK_C / 8))" "h2o:$((PK_C / 8))")
    POS_C=$((N / 2)); POS_B=$((POS_C / 4))
else
    MAIN=(full "window:$S" "window:$L" "sink:$S" "sink:$L")
    for k in 0 1 2 4 8; do MAIN+=("sink:$S,pos=cache,sinks=$k"); done
    for b in "$B10" "$B20"; do for p in window h2o tova scissorhands random; do MAIN+=("$p:$b"); done; done
    QUANT=("full,type=f16" "full,type=q8" "full,type=q4" "full,type=q8,residual=64" "full,type=q4,residual=64"
           "full,ktype=q4,vtype=q8" "full,ktype=q8,vtype=q4" "h2o:$B20,type=q8" "h2o:$B20,type=q4,residual=64")
    PK_C=${REPORT_PASSKEY_CTX:-1024}
    PK=(full "window:$((PK_C / 8))" "sink:$((PK_C / 8))" "h2o:$((PK_C / 8))" "tova:$((PK_C / 8))")
    POS_C=$N; POS_B=$L
fi
POS=("sink:$POS_B" "sink:$POS_B,pos=cache")
POS_N=$((3 * POS_C))
# selection against eviction and memory tiers over the first NS tokens (-c NS): selection at read budgets SEL_B,
# eviction at the same budgets; quest:TIER_B with a fast tier of 5/10/25% of the vectors, with and without prefetch
if [ "$QUICK" = 1 ]; then NS=$N; SEL_B=(32 64); TIER_B=64; else NS=$((N < 2048 ? N : 2048)); SEL_B=(64 256); TIER_B=256; fi
SEL=()
for b in "${SEL_B[@]}"; do for p in topk quest cluster blocks h2o sink tova; do SEL+=("$p:$b"); done; done
TIERS=()
for f in 5 10 25; do TIERS+=("quest:$TIER_B,fast=$f%" "quest:$TIER_B,fast=$f%,prefetch=1"); done
# passkey with selection (prompt=dense: the prompt read densely, the answer selecting, as Quest decodes) and eviction
if [ "$QUICK" = 1 ]; then
    PKS_C=1024; PKS_LENS=512,1024
    PKS=(full "topk:64,prompt=dense" "quest:64,prompt=dense" "h2o:64" "sink:64")
else
    PKS_C=8192; PKS_LENS=4096,8192
    PKS=(full "topk:64,prompt=dense" "topk:256,prompt=dense" "quest:64,prompt=dense" "quest:256,prompt=dense"
         "h2o:64" "h2o:256" "tova:256" "sink:64" "sink:256")
fi
PKS_DEPTHS=0.25,0.5,0.75
# the compression frontier (with main's and quant's caches: same text, -c and shadow); B5 = 5% of N
B5=$(((N + 19) / 20))
if [ "$QUICK" = 1 ]; then
    COMP=("full,type=q2" "full,type=q2,kgroup=channel" "full,krank=16,calib=$((N / 4))" "h2o:$B10,merge=1" "pool:$B10" "topk:$S")
else
    COMP=("full,type=q2" "full,type=q2,residual=128" "full,type=q2,kgroup=channel" "full,type=q2,kgroup=channel,residual=128"
          "full,type=q4,kgroup=channel" "full,ktype=f16" "full,kprec=f32:128/q4,vprec=f32:128/q8"
          "full,prec=f32:64/q8:512/q4" "full,prec=f32:128/q4:1024/q2"
          "full,krank=16" "full,krank=32" "full,rank=32" "full,krank=32,type=q8" "full,rank=16,type=q4"
          "h2o:$B5" "h2o:$B5,merge=1" "h2o:$B10,merge=1" "sink:$B10,merge=1" "window:$B10,merge=1" "pool:$B10"
          "h2o:$B20,prec=f32:64/q8:256/q4" "h2o:$((N / 4)),type=q4,kgroup=channel,residual=64" "topk:$S" "quest:$S")
fi

# ---- directories: R holds this grid's data, OUT gets REPORT.md and the plots (see "Data" above) -----------------
INVOKE=
[ "$QUICK" = 1 ] && INVOKE+="REPORT_QUICK=1 "
[ -n "${REPORT_TOKENS:-}" ] && INVOKE+="REPORT_TOKENS=$N "
[ "$QUICK" != 1 ] && [ -n "${REPORT_PASSKEY_CTX:-}" ] && INVOKE+="REPORT_PASSKEY_CTX=$PK_C "
if [ "$QUICK" = 1 ]; then R=build/report-quick$([ "$N" = 512 ] || echo "-$N")
elif [ "$N" = 8192 ] && [ "$PK_C" = 1024 ]; then R=report
else R=build/report-$N$([ "$PK_C" = 1024 ] || echo "-pk$PK_C"); fi
if [ -n "${REPORT_OUT:-}" ]; then OUT=${REPORT_OUT%/}; INVOKE+="REPORT_OUT=$OUT "
elif [ "$R" = report ]; then OUT=build/report
else OUT=$R; fi
INVOKE+="make report"
say "output: $OUT/REPORT.md and $OUT/*.png$([ -n "${REPORT_OUT:-}" ] || echo " (REPORT_OUT=DIR to change)"); data: $R/*.dat"
if [ "$OUT" = report ] && [ "$R" != report ]; then
    say "REPORT_OUT=report with a grid other than the full one: this replaces the committed full-grid report"
fi

# ---- the seven measurements: NAME and ./run's arguments (ARGS_NAME; -o R/NAME.dat is added) ---------------------
TEXT=$R/text_$N.txt.dat; TEXT3=$R/text_$POS_N.txt.dat
STEPS=(main quant pos passkey select tiers passkey_sel compress)
for s in ${REPORT_STEPS:-}; do
    case " ${STEPS[*]} " in *" $s "*) ;; *) echo "report: unknown step '$s' in REPORT_STEPS; steps: ${STEPS[*]}" >&2; exit 1;; esac
done
kvargs() { for s in "$@"; do printf -- '-kv\n%s\n' "$s"; done; }
mapfile -t ARGS_main < <(kvargs "${MAIN[@]}")
mapfile -t ARGS_quant < <(kvargs "${QUANT[@]}")
mapfile -t ARGS_pos < <(kvargs "${POS[@]}")
mapfile -t ARGS_passkey < <(kvargs "${PK[@]}")
ARGS_main=("$MODEL" -m ppl -f "$TEXT" -c "$N" -chunk "$CHUNK" "${ARGS_main[@]}" -tokenlog "$R/main.tok.dat")
ARGS_quant=("$MODEL" -m ppl -f "$TEXT" -c "$N" -chunk "$CHUNK" "${ARGS_quant[@]}")
ARGS_pos=("$MODEL" -m ppl -f "$TEXT3" -c "$POS_C" -chunk "$CHUNK" "${ARGS_pos[@]}" -tokenlog "$R/pos.tok.dat")
ARGS_passkey=("$MODEL" -m passkey -c "$PK_C" -chunk "$CHUNK" -s 1 "${ARGS_passkey[@]}")
mapfile -t ARGS_select < <(kvargs "${SEL[@]}")
mapfile -t ARGS_tiers < <(kvargs "${TIERS[@]}")
mapfile -t ARGS_passkey_sel < <(kvargs "${PKS[@]}")
ARGS_select=("$MODEL" -m ppl -f "$TEXT" -c "$NS" -n "$NS" -chunk "$CHUNK" "${ARGS_select[@]}")
ARGS_tiers=("$MODEL" -m ppl -f "$TEXT" -c "$NS" -n "$NS" -chunk "$CHUNK" "${ARGS_tiers[@]}")
ARGS_passkey_sel=("$MODEL" -m passkey -c "$PKS_C" -lengths "$PKS_LENS" -depths "$PKS_DEPTHS" -passkey2 0 -chunk "$CHUNK" -s 1
                  "${ARGS_passkey_sel[@]}")
mapfile -t ARGS_compress < <(kvargs "${COMP[@]}")
ARGS_compress=("$MODEL" -m ppl -f "$TEXT" -c "$N" -chunk "$CHUNK" "${ARGS_compress[@]}")
# A step's log (R/NAME.log.dat) starts with "report: started: ./run ARGS" and ends with "report: complete: ./run ARGS"
# only when ./run finished: a step counts as done only for these very arguments, so another grid's data never does.
# step_state NAME: complete, partial (started, not finished: interrupted or failed; R/NAME.dat keeps what ./run
# wrote) or none
step_state() {
    local -n args=ARGS_$1
    local log=$R/$1.log.dat
    if [ -s "$R/$1.dat" ] && grep -qxF "report: complete: ./run ${args[*]}" "$log" 2>/dev/null; then echo complete
    elif grep -qxF "report: started: ./run ${args[*]}" "$log" 2>/dev/null; then echo partial
    else echo none; fi
}
records() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }
# why a partial step stopped, from the last line report.sh wrote into its log
stopped() { grep -E '^report: (interrupted|failed)' "$R/$1.log.dat" 2>/dev/null | tail -1 | sed 's/^report: //' || true; }

# ---- dependencies -----------------------------------------------------------------------------------------------
# REPORT_ASSUME_MISSING="PKG ..." treats those as missing (tests/test_report.sh checks the listing with it)
present() {
    case " ${REPORT_ASSUME_MISSING:-} " in *" $1 "*) return 1;; esac
    case $1 in
        gnuplot-nox) command -v gnuplot;;   # any gnuplot with a png terminal will do, not only Debian's
        debian-reference-en) [ -f "$GZ" ];;
        python3) command -v python3;;
    esac >/dev/null 2>&1
}
why() {
    case $1 in
        gnuplot-nox) echo "gnuplot draws the PNG plots";;
        debian-reference-en) echo "the text measured: $GZ";;
        python3) echo "turns ./run's JSON lines into gnuplot tables and REPORT.md";;
    esac
}
need=()
if [ "$PLOTS_ONLY" = 1 ]; then deps=(gnuplot-nox python3); else deps=(gnuplot-nox debian-reference-en python3); fi
for p in "${deps[@]}"; do present "$p" || need+=("$p"); done
# with recommends, Debian 12 installs 47 packages instead of 6 (imagemagick, ghostscript, groff, fonts: 112 MB more),
# none of which is used here
APT=(apt-get install -y -q --no-install-recommends)
# the packages apt-get would install, dependencies included (a simulation: no root needed, nothing changes)
apt_plan() { apt-get install -s --no-install-recommends "${need[@]}" 2>/dev/null | awk '$1 == "Inst" { printf "%s%s", (n++ ? " " : ""), $2 }'; }
if [ ${#need[@]} -gt 0 ]; then
    say "missing, to install with: ${APT[*]} ${need[*]}"
    for p in "${need[@]}"; do say "  $p: $(why "$p")"; done
    if ! command -v apt-get >/dev/null 2>&1; then say "  no apt-get on this machine: install them yourself"
    elif plan=$(apt_plan) && [ -n "$plan" ]; then say "  with their dependencies, apt-get adds $(echo "$plan" | wc -w) packages: $plan"
    else plan=; say "  (apt-get cannot resolve them from its package lists yet: it runs apt-get update first)"; fi
fi

# ---- the plan -----------------------------------------------------------------------------------------------------
say "$NPROC cores, OMP_NUM_THREADS=$OMP_NUM_THREADS, load average $(cut -d' ' -f1-3 /proc/loadavg)"
say "grid: $([ "$QUICK" = 1 ] && echo 'QUICK (REPORT_QUICK=1)' || echo full), $N tokens, budgets S=$S L=$L 10%=$B10 20%=$B20;" \
    "main ${#MAIN[@]} policies, quant ${#QUANT[@]}, pos ${#POS[@]} over $POS_N tokens (-c $POS_C), passkey ${#PK[@]} at -c $PK_C;" \
    "select ${#SEL[@]} (B = ${SEL_B[*]}) and tiers ${#TIERS[@]} over $NS tokens (-c $NS), passkey_sel ${#PKS[@]} at -c $PKS_C (lengths $PKS_LENS)," \
    "compress ${#COMP[@]} over $N tokens"
for s in "${STEPS[@]}"; do
    declare -n args=ARGS_$s
    case $PLOTS_ONLY/${REPORT_FORCE:-0}/$(step_state "$s") in
        1/*/none) say "plan: $s: no data for this grid in $R/";;
        1/*/partial) say "plan: $s: incomplete data in $R/$s.dat ($(records "$R/$s.dat") records; $(stopped "$s")): drawn as it is";;
        1/*) say "plan: $s: reuse $R/$s.dat";;
        0/0/complete) say "plan: $s: reuse $R/$s.dat (complete)";;
        */partial) say "plan: $s: ./run ${args[*]} -o $R/$s.dat (again: replaces the $(records "$R/$s.dat") records of an earlier run, $(stopped "$s"))";;
        *) say "plan: $s: ./run ${args[*]} -o $R/$s.dat";;
    esac
    unset -n args
done
if [ "$PLOTS_ONLY" = 1 ] && { [ ! -s "$R/calibration.dat" ] || [ "$(step_state main)" = none ]; }; then
    echo "report: REPORT_PLOTS_ONLY=1 needs the data of an earlier run of this grid in $R/ (main.dat, calibration.dat ...):" \
         "run $INVOKE first" >&2
    exit 1
fi
[ "$DRY_RUN" = 1 ] && { say "dry run (REPORT_DRY_RUN=1): nothing installed, run or written"; exit 0; }

# ---- install, build ---------------------------------------------------------------------------------------------
if [ ${#need[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || { echo "report: missing ${need[*]}, and no apt-get to install them" >&2; exit 1; }
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "$plan" ]; then say "apt-get update"; $SUDO apt-get update -q; fi
    say "installing: ${need[*]}"
    $SUDO "${APT[@]}" "${need[@]}"
fi
# libgd's png terminal writes small palette PNGs (tens of KB); pngcairo's antialiased truecolor ones are 3-10x larger
if gnuplot -e 'set terminal' 2>&1 | grep -qw png; then PNG_T="png noenhanced font 'Sans,9'"
else PNG_T="pngcairo noenhanced font 'Sans,9'"; fi
TERM_PNG="$PNG_T size 900,560"
[ -x ./run ] || make all
[ -f "$MODEL" ] || make model
mkdir -p "$R" "$OUT"

# At the end, however it ends (done, Ctrl-C, an error): which measurements are not complete, and what to do
CUR=; WATCH=
summary() {
    local s st inc=()
    for s in "${STEPS[@]}"; do
        st=$(step_state "$s")
        case $st in
            complete) ;;
            partial) inc+=("$s ($(stopped "$s"); $(records "$R/$s.dat") records kept in $R/$s.dat)");;
            *) inc+=("$s (not run)");;
        esac
    done
    if [ ${#inc[@]} -eq 0 ]; then say "all ${#STEPS[@]} measurements complete (data in $R/)"; return; fi
    say "INCOMPLETE: ${#inc[@]} of ${#STEPS[@]} measurements: $(printf '%s; ' "${inc[@]}" | sed 's/; $//')"
    say "$INVOKE measures them again (complete ones are reused); REPORT_PLOTS_ONLY=1 draws what they recorded"
}
# Ctrl-C reaches ./run too (same process group); bash runs this trap once ./run has exited, so the step's log says it
# was interrupted (and its .dat stays as ./run left it) before the script ends
on_signal() {
    trap - INT TERM HUP
    [ -z "$WATCH" ] || kill "$WATCH" 2>/dev/null || true
    if [ -n "$CUR" ]; then
        printf '\nreport: interrupted after %d s\n' $(($(date +%s) - CUR_T0)) >>"$R/$CUR.log.dat"   # ./run may stop mid-line
        say "$CUR: interrupted: $(records "$R/$CUR.dat") records kept in $R/$CUR.dat"
    fi
    exit 130
}
trap on_signal INT TERM HUP
trap summary EXIT

# ---- text -------------------------------------------------------------------------------------------------------
ntok() { ./run "$MODEL" -m tokenize -f "$1" 2>/dev/null | wc -w; }
# the longest prefix of the Debian Reference (whole lines) that tokenizes to at most $1 tokens, into $2
make_text() {
    local want=$1 out=$2 src=$R/src.tmp lo hi mid
    [ -s "$out" ] && [ "$(ntok "$out")" -le "$want" ] && [ "$(ntok "$out")" -ge $((want - 40)) ] && return 0
    { zcat "$GZ" || true; } | head -c $((want * 6 + 4096)) >"$src"   # zcat ends on SIGPIPE
    lo=0; hi=$(wc -c <"$src")
    while [ $((hi - lo)) -gt 1 ]; do
        mid=$(((lo + hi) / 2))
        if [ "$(head -c "$mid" "$src" | ntok /dev/stdin)" -le "$want" ]; then lo=$mid; else hi=$mid; fi
    done
    head -c "$lo" "$src" | sed '$d' >"$out"   # drop the last, partial line
    rm -f "$src"
}
if [ "$PLOTS_ONLY" != 1 ]; then
    make_text "$N" "$TEXT"; make_text "$POS_N" "$TEXT3"
fi
say "text: $(ntok "$TEXT") tokens ($(wc -c <"$TEXT") bytes) and $(ntok "$TEXT3") tokens of $GZ"

# ---- throughput and the estimate --------------------------------------------------------------------------------
jget() { awk -v k="\"$2\":" '{ i = index($0, k); if (i) { x = substr($0, i + length(k)); sub(/[,}].*/, "", x); print x; exit } }' "$1"; }   # first numeric field $2 of a JSON-lines file
CAL=$R/calibration.dat
if [ "$PLOTS_ONLY" != 1 ] && { [ "${REPORT_FORCE:-0}" = 1 ] || [ ! -s "$CAL" ] || ! grep -q "threads=$OMP_NUM_THREADS " "$CAL"; }; then
    CN=$([ "$QUICK" = 1 ] && echo 384 || echo 1024)
    make_text "$CN" "$R/cal.txt.dat"
    cn=$(($(ntok "$R/cal.txt.dat") - 1))
    rm -f "$R/cal1.tmp" "$R/cal2.tmp"
    say "measuring throughput ($cn tokens: window:8 with a 64-token shadow, then full with a $cn-token shadow, then decode)"
    ./run "$MODEL" -m ppl -f "$R/cal.txt.dat" -c 64 -chunk $CHUNK -kv window:8 -o "$R/cal1.tmp" 2>/dev/null
    ./run "$MODEL" -m ppl -f "$R/cal.txt.dat" -c $((cn + 1)) -chunk $CHUNK -kv full -o "$R/cal2.tmp" 2>/dev/null
    t0=$(date +%s.%N)
    ./run "$MODEL" -t 0 -n 32 -i "The Debian system" -kv full >/dev/null 2>&1
    t3=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
    # t1 = (cn + 63) a + small;  t2 = 2 cn a + 2 sum_t t b;  decode: 32 unbatched steps (model load included).
    # b_fit is b before clamping: at or below 0 when attention hides in the timing noise (a short calibration, a
    # loaded machine), and then the estimate leaves attention out
    awk -v t1="$(jget "$R/cal1.tmp" seconds)" -v t2="$(jget "$R/cal2.tmp" seconds)" -v t3="$t3" -v n="$cn" \
        -v th="$OMP_NUM_THREADS" -v load="$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN {
        a = t1 / (n + 64); att = n * (n + 1); b = bfit = (t2 - 2 * n * a) / att; if (b < 0) b = 0
        printf "threads=%d a=%.6g b=%.6g d=%.6g load=%s b_fit=%.6g n=%d\n", th, a, b, t3 / 32, load, bfit, n }' >"$CAL"
    rm -f "$R/cal1.tmp" "$R/cal2.tmp"
fi
read -r _ A B DEC _ < <(tr '=' ' ' <"$CAL" | awk '{print $1, $4, $6, $8, $10}')
# the measured throughput in words, for this log and REPORT.md; ns per attended token (one query-key pair through
# every layer: a few ns on a CPU, far less on a GPU), with 3 significant digits whatever its size
THROUGHPUT=$(awk -v a="$A" -v b="$B" -v d="$DEC" -v cal="$(cat "$CAL")" 'BEGIN {
    bfit = b; n = "?"; k = split(cal, f, " ")
    for (i = 1; i <= k; i++) { split(f[i], kv, "="); if (kv[1] == "b_fit") bfit = kv[2]; if (kv[1] == "n") n = kv[2] }
    if (b > 0) att = sprintf("%s ns per attended token", sprintf(b * 1e9 >= 1000 ? "%.0f" : "%.3g", b * 1e9))
    else att = sprintf("attention not measurable in the %s-token calibration (fit: %.3g ns per attended token, " \
                       "taken as 0: the estimate runs short)", n, bfit * 1e9)
    printf "%.1f tok/s per policy run (matmuls), %s, %.0f ms per unbatched decode step", 1 / a, att, d * 1e3 }')
say "throughput: $THROUGHPUT"

# cost (seconds) of the grid: ppl runs (shadow + policies) and passkey runs, from the spec strings
estimate() {   # N S L B10 B20 POS_C PK_C "MAIN..." "QUANT..." "POS..." "PK..." NS "SEL..." "TIERS..." PKS_C PKS_LENS "PKS..." "COMP..."
    python3 - "$A" "$B" "$DEC" "$@" <<'EOF'
import sys
a, b, d = map(float, sys.argv[1:4])
n, S, L, B10, B20, posc, pkc = map(int, sys.argv[4:11])
groups = [g.split() for g in sys.argv[11:15]]
ns, sel, tiers = int(sys.argv[15]), sys.argv[16].split(), sys.argv[17].split()
pksc, pks_lens, pks = int(sys.argv[18]), [int(x) for x in sys.argv[19].split(",")], sys.argv[20].split()
comp = sys.argv[21].split()
def budget(spec, c):
    head = spec.split(',')[0]
    return int(head.split(':')[1]) if ':' in head else c
def attended(tokens, B):
    B = min(B, tokens)
    return B * (B + 1) / 2 + (tokens - B) * B
def ppl(tokens, c, specs):
    t = tokens * a * 0 + min(tokens, c) * a + attended(min(tokens, c), c) * b   # the shadow
    for s in specs:
        full = s.split(',')[0].split(':')[0] == 'full'
        k = min(tokens, c) if full else tokens
        t += k * a + attended(k, budget(s, c)) * b
    return t
def passkey(c, specs, lens=None, per_len=10, two=True):
    # full and the dense-prompt selections take their prompt from one shared full prefill per prompt (-prefix 1):
    # counted once, then each policy's own answer
    t = 0
    if lens is None: lens = [L for L in (c // 4, c // 2, c) if L >= 182]   # shorter: too short for the prompt's fixed text
    shared = [s for s in specs if "prompt=dense" in s or s.split(",")[0] == "full"]
    if shared:
        for L in lens: t += per_len * (L * a + attended(L, L) * b)
        if two: t += 2 * (c * a + attended(c, c) * b)
    for s in specs:
        own = s in shared
        B = c if "prompt=dense" in s else budget(s, c)   # a dense prompt attends to every token
        for L in lens: t += per_len * ((0 if own else L * a + attended(L, B) * b) + 8 * d)
        if two: t += 2 * ((0 if own else c * a + attended(c, B) * b) + 16 * d)
    return t
# selection (stream mode: every query selects): per token the matmuls, plus the keys a query scans: topk scores all
# of them, quest a bound per page of 16 and its B, cluster its centroids (about 1 per 32 keys) and its B, blocks and
# the evicting caches their B. A fast tier adds its bookkeeping, and prefetch the predicted next query's selection
# pass: TIER and PREFETCH are in units of a token's matmuls, rough (on 2 cores a tiered quest run took about twice an
# untiered one at 2,048 tokens)
TIER, PREFETCH = 1.0, 1.0
def scanned_sum(tokens, s):
    fm, B = s.split(",")[0].split(":")[0], budget(s, tokens)
    if fm == "topk": return attended(tokens, tokens)
    per_page = {"quest": 16, "cluster": 32}.get(fm)
    return attended(tokens, B) + (tokens * tokens / 2 / per_page if per_page else 0)
def ppl_select(tokens, specs):
    t = tokens * a + attended(tokens, tokens) * b   # the shadow
    for s in specs:
        t += tokens * a + scanned_sum(tokens, s) * b
        if "fast=" in s: t += tokens * a * (TIER + (PREFETCH + scanned_sum(tokens, s) * b / tokens / a if "prefetch=1" in s else 0))
    return t
main, quant, pos, pk = groups
parts = [("main", ppl(n, n, main)), ("quant", ppl(n, n, quant)), ("pos", ppl(3 * posc, posc, pos)), ("passkey", passkey(pkc, pk)),
         ("select", ppl_select(ns, sel)), ("tiers", ppl_select(ns, tiers)), ("passkey_sel", passkey(pksc, pks, pks_lens, 6, False)),
         ("compress", ppl(n, n, [s for s in comp if s.split(",")[0].split(":")[0] not in ("topk", "quest")]) +
                      sum(n * a + scanned_sum(n, s) * b for s in comp if s.split(",")[0].split(":")[0] in ("topk", "quest")))]
print(" ".join("%s=%.0f" % p for p in parts), "total=%.0f" % sum(p[1] for p in parts))
EOF
}
EST=$(estimate "$N" "$S" "$L" "$B10" "$B20" "$POS_C" "$PK_C" "${MAIN[*]}" "${QUANT[*]}" "${POS[*]}" "${PK[*]}" \
    "$NS" "${SEL[*]}" "${TIERS[*]}" "$PKS_C" "$PKS_LENS" "${PKS[*]}" "${COMP[*]}")
FULL_MAIN=(full window:256 window:1024 sink:256 sink:1024 sink:256,pos=cache,sinks=0 sink:256,pos=cache,sinks=1
           sink:256,pos=cache,sinks=2 sink:256,pos=cache,sinks=4 sink:256,pos=cache,sinks=8)
for b in 820 1640; do for p in window h2o tova scissorhands random; do FULL_MAIN+=("$p:$b"); done; done
FULL_QUANT=(full,type=f16 full,type=q8 full,type=q4 full,type=q8,residual=64 full,type=q4,residual=64
            full,ktype=q4,vtype=q8 full,ktype=q8,vtype=q4 h2o:1640,type=q8 h2o:1640,type=q4,residual=64)
PKF=${REPORT_PASSKEY_CTX:-1024}
FULL_PK=(full "window:$((PKF / 8))" "sink:$((PKF / 8))" "h2o:$((PKF / 8))" "tova:$((PKF / 8))")
FULL_SEL=(); for b in 64 256; do for p in topk quest cluster blocks h2o sink tova; do FULL_SEL+=("$p:$b"); done; done
FULL_TIERS=(); for f in 5 10 25; do FULL_TIERS+=("quest:256,fast=$f%" "quest:256,fast=$f%,prefetch=1"); done
FULL_PKS=(full topk:64,prompt=dense topk:256,prompt=dense quest:64,prompt=dense quest:256,prompt=dense h2o:64 h2o:256
          tova:256 sink:64 sink:256)
FULL_COMP=(full,type=q2 full,type=q2,residual=128 full,type=q2,kgroup=channel full,type=q2,kgroup=channel,residual=128
           full,type=q4,kgroup=channel full,ktype=f16 full,kprec=f32:128/q4,vprec=f32:128/q8 full,prec=f32:64/q8:512/q4
           full,prec=f32:128/q4:1024/q2 full,krank=16 full,krank=32 full,rank=32 full,krank=32,type=q8
           full,rank=16,type=q4 h2o:410 h2o:410,merge=1 h2o:820,merge=1 sink:820,merge=1 window:820,merge=1 pool:820
           h2o:1640,prec=f32:64/q8:256/q4 h2o:2048,type=q4,kgroup=channel,residual=64 topk:256 quest:256)
EST_FULL=$(estimate 8192 256 1024 820 1640 8192 "$PKF" "${FULL_MAIN[*]}" "${FULL_QUANT[*]}" "sink:1024 sink:1024,pos=cache" "${FULL_PK[*]}" \
    2048 "${FULL_SEL[*]}" "${FULL_TIERS[*]}" 8192 4096,8192 "${FULL_PKS[*]}" "${FULL_COMP[*]}")
mmss() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
fmt() { local kv out=; for kv in $1; do out+="${out:+, }${kv%%=*} $(mmss "${kv#*=}")"; done; echo "$out"; }
say "estimate for this grid at $OMP_NUM_THREADS thread(s), this load: $(fmt "$EST")"
say "estimate for the full grid (8192 tokens, passkey -c $PKF) at $OMP_NUM_THREADS thread(s), this load: $(fmt "$EST_FULL")"

# ---- runs -------------------------------------------------------------------------------------------------------
declare -A EST_S
for kv in $EST; do EST_S[${kv%%=*}]=${kv#*=}; done
# ETAs: the estimates scaled by measured/estimated of the steps run so far (the cost model runs short on long lanes
# and on a loaded machine); the current step's remaining time is ./run's own ETA where it prints one
MEAS_SUM=0; EST_SUM=0
scaled() { if [ "$EST_SUM" -gt 0 ]; then echo $(($1 * MEAS_SUM / EST_SUM)); else echo "$1"; fi; }
clock() { date -d "@$(($(date +%s) + $1))" +%H:%M; }   # the time of day in $1 seconds
grid_eta() {   # REMAINING_S_OF_CURRENT INDEX_OF_CURRENT: when the grid should be done
    local rem=0 i
    for ((i = $2 + 1; i < ${#STEPS[@]}; i++)); do
        [ "${REPORT_FORCE:-0}" != 1 ] && [ "$(step_state "${STEPS[$i]}")" = complete ] && continue
        wanted "${STEPS[$i]}" || continue
        rem=$((rem + ${EST_S[${STEPS[$i]}]}))
    done
    clock $(($1 + $(scaled "$rem")))
}
# every PROGRESS_S seconds while step NAME (index I) runs: how far it is, from its log, and the grid's ETA
watch_progress() {   # NAME I
    local log=$R/$1.log.dat line eta el est
    while sleep "$PROGRESS_S" >/dev/null 2>&1 && kill -0 $$ 2>/dev/null; do
        el=$(($(date +%s) - CUR_T0)); est=$(scaled "${EST_S[$1]}")
        eta=$((est > el ? est - el : 0))
        # ppl's and passkey's own progress line (every 5 s), with its ETA
        line=$(grep -E '^(ppl:|passkey) [0-9]+/[0-9]+ tokens' "$log" | tail -1 || true)
        if [ -n "$line" ]; then
            eta=$(echo "$line" | sed -n 's/.*ETA \([0-9]*\)m\([0-9]*\)s.*/\1 \2/p' | awk '{ print $1 * 60 + $2 }')
        else line="loading"; fi
        say "[$(($2 + 1))/${#STEPS[@]}] $1, $(mmss "$el") in: $line; grid done around $(grid_eta "${eta:-0}" "$2")"
    done
}
declare -A SECS
run_step() {   # I: the I-th step
    local i=$1 name=${STEPS[$1]}
    local -n args=ARGS_$name
    local out=$R/$name.dat log=$R/$name.log.dat rc=0
    if [ "$PLOTS_ONLY" = 1 ] || { [ "${REPORT_FORCE:-0}" != 1 ] && [ "$(step_state "$name")" = complete ]; }; then
        [ "$(step_state "$name")" = none ] || say "$name: reusing $out"
        return 0
    fi
    rm -f "$out"   # ./run appends to -o
    say "[$((i + 1))/${#STEPS[@]}] $name: ./run ${args[*]}"
    local est; est=$(scaled "${EST_S[$name]}")
    say "[$((i + 1))/${#STEPS[@]}] $name: estimated $(mmss "${EST_S[$name]}")$([ "$EST_SUM" = 0 ] || echo ", $(mmss "$est") at the pace so far"), done around $(clock "$est"); grid done around $(grid_eta "$est" "$i")"
    echo "report: started: ./run ${args[*]}" >"$log"
    CUR=$name; CUR_T0=$(date +%s)
    watch_progress "$name" "$i" & WATCH=$!
    ./run "${args[@]}" -o "$out" 2>>"$log" || rc=$?
    kill "$WATCH" 2>/dev/null || true; wait "$WATCH" 2>/dev/null || true; WATCH=
    if [ $rc -ne 0 ]; then
        printf '\nreport: failed (exit %d)\n' $rc >>"$log"; CUR=
        tail -5 "$log" >&2; exit 1
    fi
    SECS[$name]=$(($(date +%s) - CUR_T0)); CUR=
    MEAS_SUM=$((MEAS_SUM + SECS[$name])); EST_SUM=$((EST_SUM + ${EST_S[$name]}))
    echo "report: seconds: ${SECS[$name]}" >>"$log"
    echo "report: complete: ./run ${args[*]}" >>"$log"
    say "$name: $(mmss "${SECS[$name]}") (estimated $(mmss "${EST_S[$name]}")); $(grep -E '^(ppl: [0-9.]+ s|.*: [0-9]+/[0-9]+ correct)' "$log" | tail -1)"
}
wanted() { [ -z "${REPORT_STEPS:-}" ] || case " $REPORT_STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
for i in "${!STEPS[@]}"; do
    if wanted "${STEPS[$i]}"; then run_step "$i"; else say "${STEPS[$i]}: not measured (REPORT_STEPS=\"$REPORT_STEPS\")"; fi
done
[ "$PLOTS_ONLY" = 1 ] || ! wanted passkey || [ -s "$R/passkey.dat" ] || { echo "report: passkey wrote no records" >&2; exit 1; }
T_RUNS=$(($(date +%s) - T_START))
INCOMPLETE=$(for s in "${STEPS[@]}"; do [ "$(step_state "$s")" = complete ] || echo -n "$s "; done)

# the records of the measurements, for both python programs below (each runs as PY_RECORDS + its own text)
PY_RECORDS='
import json, sys, os
def records(R, name):   # the JSON lines of R/NAME.dat; an interrupted run may leave its last line cut short
    p, rs = os.path.join(R, name + ".dat"), []
    for l in (open(p) if os.path.exists(p) else []):
        try: rs.append(json.loads(l))
        except ValueError: pass
    return rs
'

# ---- tables for gnuplot (python3: JSON lines -> whitespace-separated columns) -----------------------------------
{ echo "$PY_RECORDS"; cat; } <<'EOF' | python3 - "$R"
import math
R = sys.argv[1]
main, quant, pos, pk = (records(R, k) for k in ("main", "quant", "pos", "passkey"))
def fam(kv): return kv.split(",")[0].split(":")[0]
plain = lambda kv: "," not in kv
# (a) ppl and KL vs budget, one block per family (plain specs: f32, pos=orig, default parameters)
with open(os.path.join(R, "a_budget.tab.dat"), "w") as f:
    fams = []
    for r in main:
        if r["kv"] != "shadow" and plain(r["kv"]) and fam(r["kv"]) != "full" and fam(r["kv"]) not in fams:
            fams.append(fam(r["kv"]))
    for fm in fams:
        f.write("%s\n" % fm)   # the block's first line: gnuplot's columnheader
        for r in sorted((r for r in main if plain(r["kv"]) and fam(r["kv"]) == fm), key=lambda r: r["budget"]):
            f.write("%d %.6g %.6g %.6g %.6g\n" % (r["budget"], r["span_ppl"], r["kl"], r["top1"], r["recall"]))
        f.write("\n\n")
shadow = [r for r in main if r["kv"] == "shadow"]
with open(os.path.join(R, "a_shadow.tab.dat"), "w") as f:
    if shadow: f.write("%.6g\n" % shadow[0]["span_ppl"])
# (b) KL vs allocated bytes: evicting caches (f32, default parameters) per family, quantized storage, both; one file
# each (an empty index block would renumber gnuplot's blocks)
def kind(kv):
    q = any(k in kv for k in ("type=", "ktype=", "vtype="))
    if q: return "quant" if fam(kv) == "full" else "both"
    return "evict" if plain(kv) else None
rows = [r for r in main + quant if r["kv"] != "shadow" and r.get("kl", 0) > 0 and kind(r["kv"])]
for k in ("evict", "quant", "both"):
    with open(os.path.join(R, "b_%s.tab.dat" % k), "w") as f:
        for r in sorted((r for r in rows if kind(r["kv"]) == k), key=lambda r: r["kv_alloc_bytes"]):
            f.write('%.6g %.6g "%s" %s\n' % (r["kv_alloc_bytes"] / 1048576, r["kl"], r["kv"], fam(r["kv"])))
# the lower envelope over the bytes in column col: the caches no other cache beats with both fewer bytes and a lower
# KL, as "MiB KL spec" lines
def envelope(path, rs, col):
    with open(path, "w") as f:
        best = math.inf
        for r in sorted(rs, key=lambda r: (r[col], r["kl"])):
            if r["kl"] < best:
                best = r["kl"]
                f.write('%.6g %.6g "%s"\n' % (r[col] / 1048576, r["kl"], r["kv"]))
envelope(os.path.join(R, "b_envelope.tab.dat"), rows, "kv_alloc_bytes")
with open(os.path.join(R, "b_full.tab.dat"), "w") as f:
    for r in main:
        if r["kv"] == "full": f.write("%.6g\n" % (r["kv_alloc_bytes"] / 1048576))
# (d) passkey: accuracy per (policy, length, depth); cells too short for a prompt are absent
depths = [0.0, 0.25, 0.5, 0.75, 1.0]
pols = []
for r in pk:
    if r["kv"] not in pols: pols.append(r["kv"])
lens = sorted({r["length"] for r in pk if r["mode"] == "passkey"})
with open(os.path.join(R, "d_passkey.tab.dat"), "w") as f:
    for p in pols:
        f.write("# %s\n" % p)
        for li, L in enumerate(lens):
            for di, dp in enumerate(depths):
                c = [r for r in pk if r["mode"] == "passkey" and r["kv"] == p and r["length"] == L and abs(r["depth"] - dp) < 1e-6]
                ok = sum(1 for r in c if r["correct"])
                f.write("%d %d %s %d %d\n" % (di, li, ("%.4g" % (ok / len(c))) if c else "NaN", ok, len(c)))
        f.write("\n\n")
with open(os.path.join(R, "d_passkey.meta.dat"), "w") as f:
    f.write("lengths %s\n" % " ".join(str(L) for L in lens))
    for p in pols:
        two = [r for r in pk if r["mode"] == "passkey2" and r["kv"] == p]
        a = sum(1 for r in two if r["answers"][0] == r["keys"][0]); b = sum(1 for r in two if r["answers"][1] == r["keys"][1])
        tot = [r for r in pk if r["mode"] == "passkey" and r["kv"] == p]
        f.write("policy %s %d %d %d %d %d %d\n" % (p, sum(1 for r in tot if r["correct"]), len(tot), a, len(two), b, len(two)))
# (f) selection against eviction: KL and recall vs the KV bytes a step reads, one file per family; the top-B recall
# (the bound) per budget
MiB = 1048576.0
SELECTION = ("topk", "quest", "cluster", "blocks")
sel = [r for r in records(R, "select") if r["kv"] != "shadow"]
for k, keep in (("sel", lambda r: fam(r["kv"]) in SELECTION), ("evict", lambda r: fam(r["kv"]) not in SELECTION)):
    with open(os.path.join(R, "f_%s.tab.dat" % k), "w") as f:
        for r in sorted(filter(keep, sel), key=lambda r: r["kv_read_bytes_per_token"]):
            f.write('%.6g %.6g %.6g %.6g "%s"\n' % (r["kv_read_bytes_per_token"] / MiB, r["kl"], r["recall"], r["recall_topk"], r["kv"]))
with open(os.path.join(R, "f_bound.tab.dat"), "w") as f:
    for B in sorted({r["budget"] for r in sel}):
        rs = [r["recall_topk"] for r in sel if r["budget"] == B]
        f.write("%d %.6g\n" % (B, sum(rs) / len(rs)))
# (g) memory tiers: hit rate and bytes moved vs the fast tier's share of the vectors, one block per prefetch setting
# (0, then 1)
def fast_pct(kv): return float(next(x for x in kv.split(",") if x.startswith("fast="))[5:].rstrip("%"))
tiers = [r for r in records(R, "tiers") if r["kv"] != "shadow" and "fast=" in r["kv"]]
with open(os.path.join(R, "g_tiers.tab.dat"), "w") as f:
    for pf in (0, 1):
        rs = sorted((r for r in tiers if ("prefetch=1" in r["kv"]) == (pf == 1)), key=lambda r: fast_pct(r["kv"]))
        for r in rs:
            f.write("%.6g %.6g %.6g %.6g %.6g\n" % (fast_pct(r["kv"]), r["kv_fast_bytes"] / MiB, r["tier_hit_rate"],
                    r["kv_demand_bytes_per_token"] / MiB, r["kv_prefetch_bytes_per_token"] / MiB))
        if not rs: f.write("NaN NaN NaN NaN NaN\n")
        f.write("\n\n")
# (h) passkey with selection: accuracy vs budget, one block per length and family (full apart, in the meta file)
pks = [r for r in records(R, "passkey_sel") if r["mode"] == "passkey"]
plens = sorted({r["length"] for r in pks})
pfams = []
for r in pks:
    if fam(r["kv"]) != "full" and fam(r["kv"]) not in pfams: pfams.append(fam(r["kv"]))
def acc(rs): return sum(1 for r in rs if r["correct"]) / len(rs)
with open(os.path.join(R, "h_passkey_sel.tab.dat"), "w") as f:
    for L in plens:
        for fm in pfams:
            f.write("# %d %s\n" % (L, fm))
            bs = sorted({r["budget"] for r in pks if fam(r["kv"]) == fm and r["length"] == L})
            for B in bs: f.write("%d %.6g\n" % (B, acc([r for r in pks if fam(r["kv"]) == fm and r["length"] == L and r["budget"] == B])))
            if not bs: f.write("NaN NaN\n")
            f.write("\n\n")
with open(os.path.join(R, "h_passkey_sel.meta.dat"), "w") as f:
    f.write("lengths %s\n" % " ".join(str(L) for L in plens))
    f.write("families %s\n" % " ".join(pfams))
    for L in plens:
        rs = [r for r in pks if fam(r["kv"]) == "full" and r["length"] == L]
        f.write("full %d %s\n" % (L, "%.6g" % acc(rs) if rs else "NaN"))
# (i) the compression frontier: every cache of main, quant and compress (one text, one -c, one shadow) by family,
# KL against resident bytes (kv_alloc_bytes) and against KV bytes read per step; each axis with its lower envelope
def family(kv):
    fm = fam(kv)
    if fm in SELECTION: return "selection"
    if "rank=" in kv: return "low rank"
    if fm == "pool" or "merge=1" in kv: return "merging"
    stored = any(k in kv for k in ("type=", "prec=", "kgroup="))
    if fm == "full": return "precision" if stored else None
    return "eviction + precision" if stored else "eviction"
FRONT = [r for r in main + quant + records(R, "compress") if r["kv"] != "shadow" and r.get("kl", 0) > 0 and family(r["kv"])]
for fm in ("eviction", "precision", "merging", "low rank", "selection", "eviction + precision"):
    with open(os.path.join(R, "i_%s.tab.dat" % fm.replace(" + ", "_").replace(" ", "_")), "w") as f:
        for r in sorted((r for r in FRONT if family(r["kv"]) == fm), key=lambda r: r["kv_alloc_bytes"]):
            f.write('%.6g %.6g %.6g "%s"\n' % (r["kv_alloc_bytes"] / MiB, r["kv_read_bytes_per_token"] / MiB, r["kl"], r["kv"]))
for col, name in (("kv_alloc_bytes", "alloc"), ("kv_read_bytes_per_token", "read")):
    envelope(os.path.join(R, "i_envelope_%s.tab.dat" % name), FRONT, col)
EOF

# (c) per-token NLL from -tokenlog, one column per chosen policy, then a trailing moving average (awk)
# tokcols FILE OUT SPEC...: pos, then the NLL of each SPEC (the shadow is "shadow"); NaN where null
tokcols() {
    local in=$1 out=$2; shift 2
    [ -s "$in" ] || { : >"$out"; return 0; }
    awk -v want="$*" 'BEGIN { n = split(want, w, " ") }
    { match($0, /"pos":[0-9]+/); pos = substr($0, RSTART + 6, RLENGTH - 6)
      delete v; m = split($0, parts, /\{"kv":"/)
      for (i = 2; i <= m; i++) { k = parts[i]; sub(/".*/, "", k); x = parts[i]
        if (match(x, /"nll":[-0-9.e+]+/)) v[k] = substr(x, RSTART + 6, RLENGTH - 6); else v[k] = "NaN" }
      line = pos; for (j = 1; j <= n; j++) line = line " " ((w[j] in v) ? v[w[j]] : "NaN"); print line }' "$in" >"$out"
}
# smooth IN OUT W: trailing moving average of every column but the first over W rows (NaN rows end a policy)
smooth() {
    [ -s "$1" ] || { : >"$2"; return 0; }
    awk -v W="$3" '{ for (j = 2; j <= NF; j++) { if ($j == "NaN") { s[j] = "x"; continue }
          if (NR > W) sum[j] -= h[j, NR % W]; h[j, NR % W] = $j; sum[j] += $j }
        line = $1; for (j = 2; j <= NF; j++) line = line " " ((s[j] == "x" || NR < W) ? "NaN" : sprintf("%.5g", sum[j] / W)); print line }' "$1" >"$2"
}
MA=$([ "$QUICK" = 1 ] && echo 16 || echo 64)
tokcols "$R/main.tok.dat" "$R/c_nll.tab.dat" shadow "window:$S" "sink:$S" "sink:$S,pos=cache,sinks=0"
smooth "$R/c_nll.tab.dat" "$R/c_nll_ma.tab.dat" "$MA"
smooth "$R/c_nll.tab.dat" "$R/c_nll_ma8.tab.dat" 8
tokcols "$R/pos.tok.dat" "$R/e_pos.tab.dat" shadow "sink:$POS_B" "sink:$POS_B,pos=cache"
MA_POS=$((POS_N / 64))
smooth "$R/e_pos.tab.dat" "$R/e_pos_ma.tab.dat" "$MA_POS"

# ---- plots ------------------------------------------------------------------------------------------------------
famcol() { case $1 in window) echo '#9467bd';; sink) echo '#1f77b4';; h2o) echo '#2ca02c';; tova) echo '#ff7f0e';;
    scissorhands) echo '#8c564b';; random) echo '#7f7f7f';; topk) echo '#d62728';; quest) echo '#17becf';;
    cluster) echo '#e377c2';; blocks) echo '#bcbd22';; *) echo '#000000';; esac; }
have() { [ -s "$R/$1.dat" ] || { say "no $R/$1.dat: skipping its plot"; return 1; }; }
# drawn() NAME TABLE...: have NAME, and one of its gnuplot tables has a row of numbers (an interrupted run may have
# recorded only the shadow)
drawn() {
    have "$1" || return 1; local t=$1; shift
    grep -qE '^[0-9]' "$@" 2>/dev/null || { say "$R/$t.dat has no records to draw: skipping its plot"; return 1; }
}
GP_HEAD="set terminal $TERM_PNG; set grid lc rgb '#dddddd'; set key outside right top; set tics nomirror"
label_quick=$([ "$QUICK" = 1 ] && echo " [quick grid, not the full grid]" || echo "")
SHADOW_PPL=$(cat "$R/a_shadow.tab.dat")
if have main; then
    pa=(); pk=(); i=0
    for fm in $(awk 'NF == 1' "$R/a_budget.tab.dat"); do
        pa+=("'$R/a_budget.tab.dat' index $i every ::1 using 1:2 with linespoints lw 2 pt 7 lc rgb '$(famcol "$fm")' title '$fm'")
        pk+=("'$R/a_budget.tab.dat' index $i every ::1 using 1:3 with linespoints lw 2 pt 7 lc rgb '$(famcol "$fm")' title '$fm'")
        i=$((i + 1))
    done
    gnuplot <<EOF
$GP_HEAD
set output '$OUT/a_budget.png'
set multiplot layout 1,2 title "(a) Perplexity and KL vs budget, $N tokens of the Debian Reference, SmolLM2-135M (Q4_1 dequantized to f32)$label_quick"
set logscale x 2; set xlabel 'budget (tokens per lane)'; set offsets graph 0.05, graph 0.05, 0, 0
set ylabel 'perplexity over the span'; set key inside top right
set logscale y
plot $(IFS=,; echo "${pa[*]}"), $SHADOW_PPL with lines dt 2 lw 2 lc rgb 'black' title 'full / shadow'
set ylabel 'KL(shadow || policy), nats / token'
plot $(IFS=,; echo "${pk[*]}")
unset multiplot
EOF
fi
if have quant; then
    FULL_MIB=$(cat "$R/b_full.tab.dat")
    bplot=("'$R/b_envelope.tab.dat' using 1:2 with lines lw 8 lc rgb '#dddddd' title 'lower envelope'")
    declare -A col=([quant]='#d62728' [both]='#17becf') pt=([evict]='pt 7 ps 1.3' [quant]='pt 5 ps 1.3' [both]='pt 9 ps 1.6')
    declare -A tl=([evict]="eviction (f32)" [quant]="full, quantized storage" [both]="eviction + quantized")
    # evicting caches: one colour per policy (their budgets are the x axis), no labels
    i=0
    for fm in $(awk '!seen[$4]++ { print $4 }' "$R/b_evict.tab.dat"); do
        i=$((i + 1))
        bplot+=("'$R/b_evict.tab.dat' using 1:(strcol(4) eq '$fm' ? \$2 : NaN) with points pt 7 ps 1.3 lc rgb '$(famcol "$fm")' title '$fm (f32)'")
    done
    for k in quant both; do
        [ -s "$R/b_$k.tab.dat" ] || continue
        bplot+=("'$R/b_$k.tab.dat' using 1:2 with points ${pt[$k]} lc rgb '${col[$k]}' title '${tl[$k]}'")
        bplot+=("'$R/b_$k.tab.dat' using 1:2:3 with labels left offset 0.8,0 font ',8' tc rgb '${col[$k]}' notitle")
    done
    gnuplot <<EOF
$GP_HEAD
set output '$OUT/b_frontier.png'
set title "(b) KL vs KV bytes allocated: eviction and quantized storage, $N tokens$label_quick"
set logscale xy; set xlabel 'KV cache allocated (MiB, whole cache)'; set ylabel 'KL(shadow || policy), nats / token'
set key inside bottom left; set xrange [*:$FULL_MIB * 1.6]
set arrow 1 from $FULL_MIB, graph 0 to $FULL_MIB, graph 1 nohead dt 2 lc rgb 'black'
set label 1 "full, f32: KL 0" at $FULL_MIB, graph 0.5 center rotate by 90 offset -1,0
plot $(IFS=,; echo "${bplot[*]}")
EOF
fi
# gnuplot's plot list for a table of position, shadow, cache A, cache B: the shadow black, A red, B blue
three_lines() {
    echo "'$1' using 1:2 with lines lw 2 lc rgb 'black' title 'shadow (full f32)'," \
         "'' using 1:3 with lines lw 2 lc rgb '#d62728' title '$2'," \
         "'' using 1:4 with lines lw 2 lc rgb '#1f77b4' title '$3'"
}
XMAX_C=$((8 * S))
if have main; then
gnuplot <<EOF
$GP_HEAD
set output '$OUT/c_nll.png'
set multiplot layout 2,1 title "(c) Per-token NLL over position: a window loses the first tokens at position $S$label_quick"
set xlabel 'position'; set ylabel "NLL, nats (moving avg $MA)"; set xrange [0:$N]
set arrow 1 from $S, graph 0 to $S, graph 1 nohead dt 2 lc rgb 'red'
set label 1 "budget $S: window evicts position 0" at $S, graph 0.95 offset 0.5,0 tc rgb 'red'
plot $(three_lines "$R/c_nll_ma.tab.dat" "window:$S" "sink:$S (4 sinks)")
set xrange [0:$XMAX_C]; set ylabel 'NLL, nats (moving avg 8)'
set label 1 "budget $S" 
plot $(three_lines "$R/c_nll_ma8.tab.dat" "window:$S" "sink:$S (4 sinks)")
unset multiplot
EOF
fi
# (d) one heatmap per policy
if have passkey; then
read -r _ LENS < <(grep '^lengths' "$R/d_passkey.meta.dat")
NP=$(grep -c '^policy' "$R/d_passkey.meta.dat")
ytics=$(echo "$LENS" | awk '{ for (i = 1; i <= NF; i++) printf "%s\"%s\" %d", (i > 1 ? ", " : ""), $i, i - 1 }')
titles=()
while read -r _ p ok tot a na b nb; do titles+=("$p: $ok/$tot; two-turn $a/$na, $b/$nb"); done < <(grep '^policy' "$R/d_passkey.meta.dat")
COLS=$((NP < 3 ? NP : 3)); ROWS=$(((NP + COLS - 1) / COLS))
{
    echo "set terminal $PNG_T size $((COLS * 320)),$((ROWS * 270 + 50))"
    echo "set output '$OUT/d_passkey.png'"
    echo "set multiplot layout $ROWS,$COLS title \"(d) Passkey accuracy by depth and length (2 keys per cell), -c $PK_C$label_quick\""
    echo "set cbrange [0:1]; set palette defined (0 '#d73027', 0.5 '#fee08b', 1 '#1a9850'); unset colorbox"
    echo "set xrange [-0.5:4.5]; set yrange [-0.5:$(echo "$LENS" | awk '{print NF - 0.5}')]"
    echo "set xtics ('0' 0, '.25' 1, '.5' 2, '.75' 3, '1' 4); set ytics ($ytics); set xlabel 'depth'; set ylabel 'length (tokens)'"
    echo "set title font ',9'"
    for i in $(seq 0 $((NP - 1))); do
        echo "set title \"${titles[$i]}\""
        echo "plot '$R/d_passkey.tab.dat' index $i using 1:2:3 with image notitle, '' index $i using 1:2:(sprintf('%d/%d', \$4, \$5)) with labels notitle"
    done
    echo "unset multiplot"
} | gnuplot
fi
if have pos; then
gnuplot <<EOF
$GP_HEAD
set output '$OUT/e_pos.png'
set multiplot layout 2,1 title "(e) sink:$POS_B over $POS_N tokens with -c $POS_C: pos=orig vs pos=cache (moving avg $MA_POS)$label_quick"
set xlabel 'position'; set ylabel 'NLL, nats'; set xrange [0:$POS_N]
set arrow 1 from $POS_C, graph 0 to $POS_C, graph 1 nohead dt 2 lc rgb 'red'
set label 1 "-c $POS_C: the shadow stops" at $POS_C, graph 0.92 offset 0.5,0 tc rgb 'red'
plot $(three_lines "$R/e_pos_ma.tab.dat" "sink:$POS_B (pos=orig)" "sink:$POS_B,pos=cache")
set ylabel 'NLL(pos=orig) - NLL(pos=cache)'; unset label 1
plot '$R/e_pos_ma.tab.dat' using 1:(\$3 - \$4) with lines lw 2 lc rgb '#d62728' title 'difference', 0 with lines lc rgb 'black' notitle
unset multiplot
EOF
fi
# (f) selection (blue) and eviction (red) at the same budgets, each point labelled by its spec; the top-B recall of
# the shadow's attention (dashed) bounds recall at that budget
if drawn select "$R/f_sel.tab.dat" "$R/f_evict.tab.dat"; then
    fsets() {   # COLUMN: the two point sets and their labels, y from COLUMN of f_sel/f_evict
        echo "'$R/f_sel.tab.dat' using 1:$1 with points pt 7 ps 1.3 lc rgb '#1f77b4' title 'selection (keeps every token)'," \
             "'' using 1:$1:5 with labels left offset 0.7,0 font ',8' tc rgb '#1f77b4' notitle," \
             "'$R/f_evict.tab.dat' using 1:$1 with points pt 5 ps 1.3 lc rgb '#d62728' title 'eviction (keeps B tokens)'," \
             "'' using 1:$1:5 with labels left offset 0.7,0 font ',8' tc rgb '#d62728' notitle"
    }
    bounds=(); bcol=('#000000' '#888888' '#555555' '#bbbbbb')
    i=0
    while read -r b v; do
        bounds+=("$v with lines dt 2 lw 2 lc rgb '${bcol[$((i % 4))]}' title 'top-$b recall of the shadow (bound at B=$b)'")
        i=$((i + 1))
    done <"$R/f_bound.tab.dat"
    gnuplot <<EOF
$GP_HEAD
set terminal $PNG_T size 900,900
set output '$OUT/f_select.png'
set multiplot layout 2,1 title "(f) Selection vs eviction at B = ${SEL_B[*]}, $NS tokens (-c $NS): quality vs KV bytes read per step$label_quick"
set logscale x; set xlabel 'KV read per step (MiB, kv_read_bytes_per_token)'; set key inside top right
set logscale y; set ylabel 'KL(shadow || policy), nats / token'
plot $(fsets 2)
unset logscale y; set ylabel 'attention-mass recall'; set key inside bottom right
plot $(fsets 3)$([ ${#bounds[@]} -eq 0 ] || echo ", $(IFS=,; echo "${bounds[*]}")")
unset multiplot
EOF
fi
# (g) the fast tier: hit rate and bytes moved per token vs its size, with and without prefetch (blocks 0 and 1)
if drawn tiers "$R/g_tiers.tab.dat"; then
gnuplot <<EOF
$GP_HEAD
set output '$OUT/g_tiers.png'
set multiplot layout 1,2 title "(g) ${TIERS[0]%%,*} with a fast tier, $NS tokens (-c $NS): hit rate and bytes moved$label_quick"
set xlabel "fast tier (% of the cache's vectors)"; set key inside bottom right; set offsets graph 0.05, graph 0.05, 0, 0
set ylabel 'hit rate (tier_hit_rate)'; set yrange [0:1.05]
plot '$R/g_tiers.tab.dat' index 0 using 1:3 with linespoints lw 2 pt 7 lc rgb '#d62728' title 'prefetch=0', \
     '' index 1 using 1:3 with linespoints lw 2 pt 7 lc rgb '#1f77b4' title 'prefetch=1'
set ylabel 'MiB moved per token'; set autoscale y; set yrange [0:*]; set key inside top right
plot '$R/g_tiers.tab.dat' index 0 using 1:4 with linespoints lw 2 pt 7 lc rgb '#d62728' title 'on a miss, prefetch=0', \
     '' index 1 using 1:4 with linespoints lw 2 pt 7 lc rgb '#1f77b4' title 'on a miss, prefetch=1', \
     '' index 1 using 1:5 with linespoints lw 2 pt 5 dt 2 lc rgb '#17becf' title 'prefetched, prefetch=1'
unset multiplot
EOF
fi
# (h) passkey with selection: accuracy vs B per family, one panel per length; full as a dashed line
if drawn passkey_sel "$R/h_passkey_sel.tab.dat"; then
read -r _ PLENS < <(grep '^lengths' "$R/h_passkey_sel.meta.dat")
read -r _ PFAMS < <(grep '^families' "$R/h_passkey_sel.meta.dat")
NL=$(echo "$PLENS" | wc -w); NF_=$(echo "$PFAMS" | wc -w)
{
    echo "$GP_HEAD"
    echo "set terminal $PNG_T size $((NL * 450 + 160)),460"
    echo "set output '$OUT/h_passkey_sel.png'"
    echo "set multiplot layout 1,$NL title \"(h) Passkey accuracy vs budget B (3 depths x 2 keys per length), -c $PKS_C$label_quick\""
    echo "set logscale x 2; set xlabel 'B (tokens read per query, or kept)'; set ylabel 'accuracy (correct / keys)'"
    echo "set yrange [-0.05:1.05]; set key inside bottom right"
    echo "set xrange [$(awk 'NF == 2 && $1 != "NaN" { if (!lo || $1 < lo) lo = $1; if ($1 > hi) hi = $1 }
        END { printf "%g:%g", (lo ? lo : 1) / 1.5, (hi ? hi : 1) * 1.5 }' "$R/h_passkey_sel.tab.dat")]"
    li=0
    for L in $PLENS; do
        echo "set title 'length $L'"
        fa=$(awk -v L="$L" '$1 == "full" && $2 == L { print $3 }' "$R/h_passkey_sel.meta.dat")
        pl=(); fi=0
        for fm in $PFAMS; do
            pl+=("'$R/h_passkey_sel.tab.dat' index $((li * NF_ + fi)) using 1:2 with linespoints lw 2 pt 7 lc rgb '$(famcol "$fm")' title '$fm'")
            fi=$((fi + 1))
        done
        [ -z "$fa" ] || [ "$fa" = NaN ] || pl+=("$fa with lines dt 2 lw 2 lc rgb 'black' title 'full'")
        echo "plot $(IFS=,; echo "${pl[*]}")"
        li=$((li + 1))
    done
    echo "unset multiplot"
} | gnuplot
fi
# (i) the compression frontier: one colour per family, both axes, each with its lower envelope (grey)
if drawn compress "$R/i_precision.tab.dat" "$R/i_low_rank.tab.dat" "$R/i_merging.tab.dat"; then
    FULL_MIB=$(awk 'NR == 1 { print $1 }' "$R/b_full.tab.dat" 2>/dev/null); FULL_MIB=${FULL_MIB:-1}
    iplot() {   # COLUMN ENVELOPE: x from COLUMN (1 resident, 2 read) of every family's table, then the envelope
        local fm t pl=() i=0 icol=('#d62728' '#1f77b4' '#2ca02c' '#9467bd' '#ff7f0e' '#17becf') ipt=(7 5 9 11 13 15)
        for fm in eviction precision merging low_rank selection eviction_precision; do
            t=$R/i_$fm.tab.dat
            if [ -s "$t" ]; then
                pl+=("'$t' using $1:3 with points pt ${ipt[$i]} ps 1.4 lc rgb '${icol[$i]}' title '$(echo "$fm" | sed 's/_precision/ + precision/; s/_/ /')'")
                [ "$fm" = eviction ] || pl+=("'' using $1:3:4 with labels left offset 0.7,0 font ',7' tc rgb '${icol[$i]}' notitle")
            fi
            i=$((i + 1))
        done
        pl+=("'$R/i_envelope_$2.tab.dat' using 1:2 with lines lw 3 lc rgb '#999999' title 'lower envelope'")
        local IFS=,; echo "${pl[*]}"
    }
    gnuplot <<EOF
$GP_HEAD
set terminal $PNG_T size 1000,1000
set output '$OUT/i_compress.png'
set multiplot layout 2,1 title "(i) The compression frontier, $N tokens (-c $N): KL vs resident bytes and vs bytes read per step$label_quick"
set logscale xy; set ylabel 'KL(shadow || policy), nats / token'; set key inside bottom left
set xlabel 'KV cache allocated (MiB, whole cache: kv_alloc_bytes)'; set xrange [*:$FULL_MIB * 1.6]
set arrow 1 from $FULL_MIB, graph 0 to $FULL_MIB, graph 1 nohead dt 2 lc rgb 'black'
plot $(iplot 1 alloc)
set xlabel 'KV read per step (MiB, kv_read_bytes_per_token)'; set autoscale x; unset arrow 1
plot $(iplot 2 read)
unset multiplot
EOF
fi
T_END=$(date +%s)

# ---- REPORT.md --------------------------------------------------------------------------------------------------
{ echo "$PY_RECORDS"; cat; } <<'EOF' | python3 - "$R" "$OUT" "$INVOKE" "$INCOMPLETE" "$QUICK" "$N" "$S" "$L" "$B10" "$B20" "$POS_C" "$POS_B" "$PK_C" "$MA" "$MA_POS" "$((T_END - T_START))" \
    "$T_RUNS" "$EST" "$EST_FULL" "$(cat "$CAL")" "$THROUGHPUT" "$OMP_NUM_THREADS" "$NPROC" \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')" "$(cut -d' ' -f1-3 /proc/loadavg)" \
    "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- '*.c' '*.h' Makefile 2>/dev/null || echo ' (with uncommitted changes to the engine)')" \
    "$(du -b "$MODEL" | cut -f1)" "$(ntok "$TEXT")" "$(ntok "$TEXT3")" "$PKF" "$NS" "$TIER_B" "$PKS_C"
(R, OUT, invoke, incomplete, quick, N, S, L, B10, B20, posc, posb, pkc, ma, ma_pos, secs, secs_runs, est, est_full, cal,
 throughput, threads, nproc, cpu, load, git, model_bytes, ntext, ntext3, pkf, ns, tierb, pksc) = sys.argv[1:]
quick = quick == "1"
main, quant, pos, pk = (records(R, k) for k in ("main", "quant", "pos", "passkey"))
sel, tiers, pks = (records(R, k) for k in ("select", "tiers", "passkey_sel"))
comp = records(R, "compress")
STEPS = ("main", "quant", "pos", "passkey", "select", "tiers", "passkey_sel", "compress")
def parse_kv(s): return dict(x.split("=") for x in s.split())
E, EF, C = parse_kv(est), parse_kv(est_full), parse_kv(cal)
mmss = lambda s: "%dm%02ds" % (int(float(s)) // 60, int(float(s)) % 60)
hms = lambda s: "%dh%02dm" % (int(float(s)) // 3600, int(float(s)) % 3600 // 60)
out = []
w = out.append
def took(name):   # seconds of a measurement, from its log
    try:
        for l in open(os.path.join(R, name + ".log.dat")):
            if l.startswith("report: seconds: "): return int(l.split()[-1])
    except OSError: pass
    return None
label = " — quick grid (REPORT_QUICK=1), not the full grid" if quick else ""
w("# kvlab report%s\n" % label)
if quick:
    w("**This is the quick grid (`REPORT_QUICK=1 make report`), not the full grid**: %s tokens instead of 8,192, fewer "
      "policies, passkey at `-c %s`. It exists to test `tools/report.sh` end to end; its numbers are small-sample "
      "and are not findings. `make report` runs the full grid.\n" % (N, pkc))
if incomplete.split():
    w("**Incomplete**: the measurement%s %s did not run or did not finish (interrupted or failed): %s tables and plots "
      "show only what was recorded. `%s` measures %s again.\n" % ("s" if len(incomplete.split()) > 1 else "",
      ", ".join(incomplete.split()), "their" if len(incomplete.split()) > 1 else "its", invoke,
      "them" if len(incomplete.split()) > 1 else "it"))
w("Written by `tools/report.sh` (`make report`). Model: `models/smollm2-135m-instruct.bin` (SmolLM2-135M-Instruct, %s "
  "bytes). **The default weights are a Q4_1 GGUF dequantized to f32**: every figure below belongs to that model and "
  "none is compared with published SmolLM2 numbers.\n" % model_bytes)
w("Text: the first %s tokens (whole lines) of the Debian Reference (`zcat /usr/share/debian-reference/debian-reference.en.txt.gz`, "
  "package `debian-reference-en`); the position study uses the first %s tokens.\n" % (ntext, ntext3))
w("## Machine and run time\n")
w("| | |\n|---|---|")
w("| machine | %s cores (`nproc`), %s |" % (nproc, cpu))
w("| threads | OMP_NUM_THREADS=%s |" % threads)
w("| load average at the end | %s (other jobs shared the machine: times are this run's, not the machine's) |" % load)
w("| kvlab | `git` %s in the JSON (compiled into eval.o, stale if eval.c was not rebuilt since); checkout at %s; `-chunk 64` |"
  % (main[0]["git"] if main else "?", git))
steps = [took(k) for k in STEPS]
w("| run time | %s for the %d measurements (%s), from their logs; the throughput measurement, text preparation "
  "and plots add a minute or two |" % (mmss(sum(x for x in steps if x is not None)) if all(x is not None for x in steps) else "?",
  len(STEPS), ", ".join("%s %s" % (k, mmss(x) if x is not None else "?") for k, x in zip(STEPS, steps))))
w("| measured throughput | %s |" % throughput)
w("| this grid: estimated / measured | " + ", ".join("%s %s / %s" % (k, mmss(E[k]), mmss(took(k)) if took(k) is not None else "?") for k in STEPS)
  + "; total %s |" % mmss(E["total"]))
w("| estimate for the full grid | %s (main %s, quant %s, pos %s, passkey at -c %s %s, select %s, tiers %s, passkey_sel %s) at %s thread(s), load average %s when measured |"
  % (hms(EF["total"]), mmss(EF["main"]), mmss(EF["quant"]), mmss(EF["pos"]), pkf, mmss(EF["passkey"]), mmss(EF["select"]),
     mmss(EF["tiers"]), mmss(EF["passkey_sel"]), threads, C["load"]))
w("")
w("The estimate is a cost model fitted before the runs: per token and policy run a fixed cost (the matmuls, measured "
  "with a window:8 cache) plus a cost per attended token (measured with `full`; a selection policy's per key it "
  "scans), plus unbatched decode steps for passkey answers.\n")
def cmd(rs): return rs[0]["cmd"] if rs else "(not run)"
def f(x, d=4): return ("%%.%df" % d) % x
def ppl_table(rs):
    w("| policy | budget | ppl | ΔNLL | KL | top-1 | Δp | recall | ppl(all) | KV MiB |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        if r["kv"] == "shadow":
            w("| shadow (full, f32) | %d | %s | | | | | | %s | %.2f |" % (r["budget"], f(r["span_ppl"]), f(r["all_ppl"]), r["kv_alloc_bytes"] / 1048576))
        else:
            w("| `%s` | %d | %s | %s | %s | %s | %s | %s | %s | %.2f |" % (r["kv"], r["budget"], f(r["span_ppl"]), f(r["dnll"]),
              f(r["kl"], 5), f(r["top1"]), f(r["dp"], 5), f(r["recall"]), f(r["all_ppl"]), r["kv_alloc_bytes"] / 1048576))
    w("")
w("## Perplexity and KL vs budget\n")
w("![(a)](a_budget.png)\n")
w("Command (figure a, table below; also figures b and c):\n\n    %s\n" % cmd(main))
w("Left: perplexity over the %s-token span (positions < `-c`) for each policy with its default parameters (f32, "
  "`pos=orig`), the dashed line the shadow's (= `full`). Right: mean KL(p_shadow ‖ p_policy) per token.\n" % N)
ppl_table(main)
w("## KL vs KV bytes: eviction and quantization on one frontier\n")
w("![(b)](b_frontier.png)\n")
w("Command (quantized storage, same text and `-c`, so the same shadow as the run above):\n\n    %s\n" % cmd(quant))
w("x: bytes the whole cache allocates (`kv_alloc_bytes`: vectors, scales, positions, policy metadata); y: KL. "
  "Dots: evicting caches in f32 with default parameters (run above), one colour per policy, each budget a dot; red "
  "squares: `full` with quantized storage; cyan diamonds: eviction with quantized storage. The thick grey line joins the "
  "lower envelope (the caches no other cache beats with fewer bytes and a lower KL). `full` in f32 (KL 0) cannot be "
  "drawn on a log axis: the vertical line marks its %.2f MiB.\n" % (next((r["kv_alloc_bytes"] for r in main if r["kv"] == "full"), 0) / 1048576))
ppl_table(quant)
w("## Per-token NLL over position\n")
w("![(c)](c_nll.png)\n")
w("From `-tokenlog` of the first command: per-token NLL of the shadow, `window:%s` and `sink:%s`, a trailing moving "
  "average over %s tokens (top, whole stream) and over 8 tokens (bottom, the first %d positions). Until position %s "
  "the three caches are the same cache; at position %s the window evicts position 0, the attention sink.\n"
  % (S, S, ma, 8 * int(S), S, S))
sweep = [r for r in main if r["kv"].startswith("sink:%s,pos=cache" % S)]
if sweep:
    w("Sink-count sweep at budget %s with `pos=cache` (StreamingLLM's setting):\n" % S)
    w("| sinks | ppl | KL | top-1 |\n|---|---|---|---|")
    for r in sweep:
        k = dict(x.split("=") for x in r["kv"].split(",")[1:]).get("sinks", "4 (default)")
        w("| %s | %s | %s | %s |" % (k, f(r["span_ppl"]), f(r["kl"], 5), f(r["top1"])))
    w("")
w("## Positions past the trained context\n")
w("![(e)](e_pos.png)\n")
w("Command:\n\n    %s\n" % cmd(pos))
w("`sink:%s` with `pos=orig` (keys rotated by their true position) and `pos=cache` (by their rank in the cache) over "
  "%s tokens, three times `-c %s`; moving average over %s tokens. The shadow stops at `-c`; `ppl(all)` covers every "
  "token.\n" % (posb, ntext3, posc, ma_pos))
if int(posc) < 8192:
    w("Here `-c %s` is below SmolLM2's trained context (8,192), so even `pos=orig` never reaches a position the model "
      "was not trained on: this run only checks the pipeline, it says nothing about running past the trained "
      "context.\n" % posc)
ppl_table(pos)
w("## Passkey\n")
w("![(d)](d_passkey.png)\n")
w("Command:\n\n    %s\n" % cmd(pk))
w("Accuracy (correct/keys, 2 seeded keys per cell) by relative depth (columns) and prompt length (rows) for each "
  "policy; a length (`-c`/4) too short for the fixed text of the prompt is not run and has no row. Titles: total correct; the "
  "two-turn variant (first key at depth .25 asked first, then the second at .75 from the same cache).\n")
w("| policy | correct | two-turn: first | two-turn: second | most frequent wrong answer (`answer_text`) |\n|---|---|---|---|---|")
pols = []
for r in pk:
    if r["kv"] not in pols: pols.append(r["kv"])
for p in pols:
    one = [r for r in pk if r["mode"] == "passkey" and r["kv"] == p]
    two = [r for r in pk if r["mode"] == "passkey2" and r["kv"] == p]
    wrong = {}
    for r in one:
        if not r["correct"]: wrong[r["answer_text"]] = wrong.get(r["answer_text"], 0) + 1
    top = max(wrong.items(), key=lambda kv: kv[1]) if wrong else None
    w("| `%s` | %d/%d | %d/%d | %d/%d | %s |" % (p, sum(r["correct"] for r in one), len(one),
      sum(r["answers"][0] == r["keys"][0] for r in two), len(two), sum(r["answers"][1] == r["keys"][1] for r in two), len(two),
      "`%s` (%d×)" % (top[0].strip().replace("|", "\\|").replace("`", "'"), top[1]) if top else ""))
w("")
mib = lambda x: "%.2f" % (x / 1048576) if x is not None else ""
g = lambda r, k, d=4: f(r[k], d) if r.get(k) is not None else ""
w("## Selection against eviction: quality per byte read\n")
w("![(f)](f_select.png)\n")
w("Command:\n\n    %s\n" % cmd(sel))
w("The first %s tokens, `-c %s`. A selection policy (`topk`, `quest`, `cluster`, `blocks`) keeps every token and each "
  "query reads B of them; an evicting one (`h2o`, `sink`, `tova`) keeps B. x: the KV bytes attention read per step "
  "(`kv_read_bytes_per_token`, every lane, the selector's own reads included: topk's full score pass, quest's page "
  "bounds, cluster's centroids); top: KL, bottom: attention-mass recall, with the recall of the exact top-B positions "
  "of the shadow's attention (`recall_topk`) dashed, the bound no choice of B positions beats on the shadow's "
  "queries. Resident: `kv_peak_live_bytes`.\n" % (ns, ns))
w("| spec | KL | top-1 | recall | top-B recall | keys scanned per query | read MiB per step | resident MiB |")
w("|---|---|---|---|---|---|---|---|")
for r in sel:
    name = "shadow (full, f32)" if r["kv"] == "shadow" else "`%s`" % r["kv"]
    w("| %s | %s | %s | %s | %s | %s | %s | %s |" % (name, g(r, "kl", 5), g(r, "top1"), g(r, "recall"), g(r, "recall_topk"),
      g(r, "keys_scanned_per_query", 1), mib(r.get("kv_read_bytes_per_token")), mib(r.get("kv_peak_live_bytes"))))
w("")
w("## Memory tiers: hit rate and bytes moved\n")
w("![(g)](g_tiers.png)\n")
w("Command:\n\n    %s\n" % cmd(tiers))
w("`quest:%s` over the same %s tokens with a fast tier of 5%%, 10%% and 25%% of the cache's vectors (`fast=P%%`), with "
  "and without `prefetch=1` (the next layer's query predicted from this layer's input, its selection moved in ahead). "
  "Moved on a miss: `kv_demand_bytes_per_token`; prefetched: `kv_prefetch_bytes_per_token`; wasted: prefetched and "
  "evicted unread. The stall per token is modelled: demand / link + max(0, prefetched / link − compute), at the "
  "default `-link` of 64 GB/s, with the compute this CPU measured per token; the data do not move on a CPU, so it is "
  "bookkeeping, not a timing of a tier.\n" % (tierb, ns))
w("| spec | fast tier MiB | hit rate | moved on a miss, MiB/token | prefetched, MiB/token | prefetch hit rate | wasted, MiB/token | stall, ms/token | compute, ms/token |")
w("|---|---|---|---|---|---|---|---|---|")
for r in tiers:
    if r["kv"] == "shadow": continue
    pf = "prefetch=1" in r["kv"]
    w("| `%s` | %s | %s | %s | %s | %s | %s | %s | %s |" % (r["kv"], mib(r.get("kv_fast_bytes")), g(r, "tier_hit_rate"),
      "%.3f" % (r["kv_demand_bytes_per_token"] / 1048576), "%.3f" % (r["kv_prefetch_bytes_per_token"] / 1048576) if pf else "",
      g(r, "prefetch_hit_rate", 3) if pf else "", "%.3f" % (r["kv_wasted_bytes_per_token"] / 1048576) if pf else "",
      g(r, "stall_ms_per_token", 3), g(r, "compute_ms_per_token", 2)))
w("")
w("## Passkey with selection\n")
w("![(h)](h_passkey_sel.png)\n")
w("Command:\n\n    %s\n" % cmd(pks))
w("Accuracy (correct/keys; depths .25, .5, .75, 2 seeded keys each) by policy and prompt length, `-c %s`. The "
  "selection policies read the prompt densely (`prompt=dense`) and select only while answering, as Quest decodes; "
  "the evicting ones keep B tokens through the prompt.\n" % pksc)
one = [r for r in pks if r["mode"] == "passkey"]
plens = sorted({r["length"] for r in one})
w("| policy | " + " | ".join("length %d" % L for L in plens) + " | all |")
w("|---|" + "---|" * (len(plens) + 1))
ppols = []
for r in one:
    if r["kv"] not in ppols: ppols.append(r["kv"])
for p in ppols:
    cell = lambda rs: "%d/%d" % (sum(1 for r in rs if r["correct"]), len(rs)) if rs else ""
    w("| `%s` | %s | %s |" % (p, " | ".join(cell([r for r in one if r["kv"] == p and r["length"] == L]) for L in plens),
      cell([r for r in one if r["kv"] == p])))
w("")
w("## The compression frontier: every family on one stream\n")
w("![(i)](i_compress.png)\n")
w("Command (same text and `-c` as the first command, so the same shadow; the frontier also takes the caches of the "
  "first two commands):\n\n    %s\n" % cmd(comp))
w("Every cache of the three runs, by family: eviction (f32, tokens dropped), precision (`full` in fewer bits: q2, "
  "KIVI's per-channel keys `kgroup=channel`, precision by age `prec=`, `kprec=`/`vprec=`), merging (`pool:`, "
  "merge-on-evict `merge=1`), low rank (`rank=`, `krank=`, `vrank=`), selection (every token kept, B read) and "
  "eviction combined with precision. Top: KL against the bytes the cache allocates (`kv_alloc_bytes`, every term: "
  "codes, scales, minima, bases, positions, policy metadata); bottom: against the KV bytes one step reads "
  "(`kv_read_bytes_per_token`). The grey line is each axis's lower envelope.\n")
FRONT_ALL = [r for r in main + quant + comp if r["kv"] != "shadow" and r.get("kl") is not None]
full_r = next((r for r in main if r["kv"] == "full"), None)
if full_r and FRONT_ALL:
    w("| share of `full`'s bytes | best by resident bytes (KL) | best by bytes read per step (KL) |")
    w("|---|---|---|")
    for share in (0.05, 0.10, 0.25):
        cell = []
        for col in ("kv_alloc_bytes", "kv_read_bytes_per_token"):
            rs = [r for r in FRONT_ALL if r.get(col) is not None and r[col] <= share * full_r[col]]
            b = min(rs, key=lambda r: r["kl"]) if rs else None
            cell.append("`%s` (%s)" % (b["kv"], f(b["kl"], 5)) if b else "none at or under it")
        w("| %d%% | %s | %s |" % (round(share * 100), cell[0], cell[1]))
    w("")
w("| spec | KL | top-1 | ΔNLL | recall | resident MiB | % of full | read MiB per step |")
w("|---|---|---|---|---|---|---|---|")
for r in comp:
    name = "shadow (full, f32)" if r["kv"] == "shadow" else "`%s`" % r["kv"]
    share = "%.1f" % (100.0 * r["kv_alloc_bytes"] / full_r["kv_alloc_bytes"]) if full_r else ""
    w("| %s | %s | %s | %s | %s | %s | %s | %s |" % (name, g(r, "kl", 5), g(r, "top1"), g(r, "dnll", 5), g(r, "recall"),
      mib(r.get("kv_alloc_bytes")), share, mib(r.get("kv_read_bytes_per_token"))))
w("")
w("## Reproducing\n")
w("`%s` reruns everything and writes this report to `%s/` (measurements whose JSON in `%s/*.dat` is complete are "
  "reused; `REPORT_FORCE=1` reruns them). Raw data (`%s/*.dat`: JSON lines from `-o`, `-tokenlog`, stderr, gnuplot "
  "tables) is not committed.\n" % (invoke, OUT, R, R))
open(os.path.join(OUT, "REPORT.md"), "w").write("\n".join(out) + "\n")
EOF
say "wrote $OUT/REPORT.md and $(ls "$OUT"/*.png 2>/dev/null | wc -l) plots in $((T_END - T_START)) s"
