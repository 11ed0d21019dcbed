#!/usr/bin/env bash
# tools/report.sh (make report) through its dry run (REPORT_DRY_RUN=1: the plan, then exit; nothing installed, run or
# written), a few seconds and no gnuplot needed:
#  - where REPORT.md and the plots go: not into the committed report/ unless REPORT_OUT=report says so; the quick
#    grid and other grids keep their data apart from the full grid's (report/*.dat);
#  - the packages it would install are listed, each with what it is for, with --no-install-recommends;
#  - the eight steps' commands (main, quant, pos, passkey, select, tiers, passkey_sel, compress), full grid and quick;
#  - a step is reused only when its log says a run with the very same arguments completed; an interrupted one is
#    measured again (REPORT_PLOTS_ONLY=1 draws it as it is);
#  - bad settings: REPORT_TOKENS too small, REPORT_PLOTS_ONLY=1 without data, an unknown step in REPORT_STEPS.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/report; rm -rf "$tmp"; mkdir -p "$tmp"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }
for v in $(compgen -e | grep '^REPORT_'); do unset "$v"; done   # the caller's settings would change every plan

# plan NAME VAR=VALUE...: the dry run's output in $tmp/NAME.out, its exit status in $tmp/NAME.rc
plan() {
    local name=$1; shift
    env "$@" REPORT_DRY_RUN=1 bash tools/report.sh >"$tmp/$name.out" 2>&1; echo $? >"$tmp/$name.rc"
}
# has NAME FIXED-STRING: the plan printed that line fragment
has() { grep -qF -- "$2" "$tmp/$1.out"; }
check() {   # NAME DESCRIPTION WANT_RC FIXED-STRING...: exit status WANT_RC and every string in the output
    local name=$1 what=$2 rc=$3; shift 3
    local s ok=1
    [ "$(cat "$tmp/$name.rc")" = "$rc" ] || ok=0
    for s in "$@"; do has "$name" "$s" || ok=0; done
    if [ $ok = 1 ]; then pass "report.sh $what"
    else fail "report.sh $what: exit $(cat "$tmp/$name.rc") (want $rc), wanted: $*; got: $(head -c 1500 "$tmp/$name.out")"; fi
}
snapshot() { git status --porcelain --ignored -- report/ 2>/dev/null; ls -la report/ 2>/dev/null; }
before=$(snapshot)

# --- where the output goes ---
plan default REPORT_FORCE=1   # FORCE: every command printed, whatever report/ holds from an earlier run
check default "default (full grid): REPORT.md and plots to build/report/, data in report/" 0 \
    "report: output: build/report/REPORT.md and build/report/*.png" "data: report/*.dat" "-o report/main.dat" \
    "report: dry run (REPORT_DRY_RUN=1)"
grep -q '^report: output: report/' "$tmp/default.out" && fail "report.sh default plan writes into report/"
plan quick REPORT_QUICK=1 REPORT_FORCE=1   # FORCE: every command printed, whatever build/report-quick holds
check quick "REPORT_QUICK=1: output and data in build/report-quick/, none in report/" 0 \
    "report: output: build/report-quick/REPORT.md" "data: build/report-quick/*.dat" \
    "-f build/report-quick/text_512.txt.dat" "-o build/report-quick/main.dat"
grep -qE ' (-f|-o|-tokenlog) report/' "$tmp/quick.out" && fail "report.sh REPORT_QUICK=1 plans a file in report/"
# the selection, tier and passkey-with-selection steps, full grid and quick
check default "full grid: select (2,048 tokens, B 64 and 256), tiers (quest:256), passkey_sel (-c 8192)" 0 \
    "plan: select: ./run models/smollm2-135m-instruct.bin -m ppl -f report/text_8192.txt.dat -c 2048 -n 2048 -chunk 64 -kv topk:64 -kv quest:64 -kv cluster:64 -kv blocks:64 -kv h2o:64 -kv sink:64 -kv tova:64 -kv topk:256" \
    "-kv tova:256 -o report/select.dat" \
    "plan: tiers: ./run models/smollm2-135m-instruct.bin -m ppl -f report/text_8192.txt.dat -c 2048 -n 2048 -chunk 64 -kv quest:256,fast=5% -kv quest:256,fast=5%,prefetch=1" \
    "-kv quest:256,fast=25%,prefetch=1 -o report/tiers.dat" \
    "plan: passkey_sel: ./run models/smollm2-135m-instruct.bin -m passkey -c 8192 -lengths 4096,8192 -depths 0.25,0.5,0.75 -passkey2 0 -chunk 64 -s 1 -kv full -kv topk:64,prompt=dense -kv topk:256,prompt=dense -kv quest:64,prompt=dense -kv quest:256,prompt=dense -kv h2o:64 -kv h2o:256 -kv tova:256 -kv sink:64 -kv sink:256 -o report/passkey_sel.dat"
check default "full grid: compress over the 8,192 tokens of main (the frontier's families, 5%/10% budgets 410/820)" 0 \
    "plan: compress: ./run models/smollm2-135m-instruct.bin -m ppl -f report/text_8192.txt.dat -c 8192 -chunk 64 -kv full,type=q2 " \
    "-kv h2o:410,merge=1 -kv h2o:820,merge=1 -kv sink:820,merge=1 -kv window:820,merge=1 -kv pool:820 " "-kv topk:256 -kv quest:256 -o report/compress.dat"
check quick "REPORT_QUICK=1: compress with six caches over 512 tokens" 0 \
    "plan: compress: ./run models/smollm2-135m-instruct.bin -m ppl -f build/report-quick/text_512.txt.dat -c 512 -chunk 64 -kv full,type=q2 -kv full,type=q2,kgroup=channel -kv full,krank=16,calib=128 -kv h2o:52,merge=1 -kv pool:52 -kv topk:16 -o build/report-quick/compress.dat"
check quick "REPORT_QUICK=1: select at B 32 and 64, tiers on quest:64, passkey_sel at -c 1024 with five policies" 0 \
    "plan: select: ./run models/smollm2-135m-instruct.bin -m ppl -f build/report-quick/text_512.txt.dat -c 512 -n 512 -chunk 64 -kv topk:32 -kv quest:32" \
    "-kv tova:64 -o build/report-quick/select.dat" "-kv quest:64,fast=10%,prefetch=1 -kv quest:64,fast=25%" \
    "plan: passkey_sel: ./run models/smollm2-135m-instruct.bin -m passkey -c 1024 -lengths 512,1024 -depths 0.25,0.5,0.75 -passkey2 0 -chunk 64 -s 1 -kv full -kv topk:64,prompt=dense -kv quest:64,prompt=dense -kv h2o:64 -kv sink:64 -o build/report-quick/passkey_sel.dat"
plan quick1024 REPORT_QUICK=1 REPORT_TOKENS=1024
check quick1024 "REPORT_QUICK=1 REPORT_TOKENS=1024: its own directory" 0 \
    "report: output: build/report-quick-1024/REPORT.md" "-c 1024" "-o build/report-quick-1024/main.dat"
plan t4096 REPORT_TOKENS=4096
check t4096 "REPORT_TOKENS=4096: not the full grid's data directory" 0 \
    "report: output: build/report-4096/REPORT.md" "-o build/report-4096/main.dat"
plan explicit REPORT_OUT=report
check explicit "REPORT_OUT=report: the committed report, from report/*.dat" 0 \
    "report: output: report/REPORT.md and report/*.png; data: report/*.dat"
plan quickout REPORT_QUICK=1 REPORT_OUT=report/
check quickout "REPORT_QUICK=1 REPORT_OUT=report/: says it replaces the committed full-grid report" 0 \
    "report: output: report/REPORT.md" "data: build/report-quick/*.dat" "replaces the committed full-grid report"
plan other REPORT_QUICK=1 REPORT_OUT="$tmp/out"
check other "REPORT_OUT=DIR: REPORT.md there" 0 "report: output: $tmp/out/REPORT.md"
[ -e "$tmp/out" ] && fail "report.sh dry run created its output directory $tmp/out"

# --- dependencies: listed with why, before anything is installed ---
plan deps REPORT_ASSUME_MISSING="gnuplot-nox debian-reference-en python3"
check deps "missing packages listed with their purpose and --no-install-recommends" 0 \
    "missing, to install with: apt-get install -y -q --no-install-recommends gnuplot-nox debian-reference-en python3" \
    "  gnuplot-nox: gnuplot draws the PNG plots" \
    "  debian-reference-en: the text measured: /usr/share/debian-reference/debian-reference.en.txt.gz" \
    "  python3: turns ./run's JSON lines"
grep -q 'installing:' "$tmp/deps.out" && fail "report.sh dry run installed packages"
plan depsplots REPORT_PLOTS_ONLY=1 REPORT_QUICK=1 REPORT_TOKENS=1040 REPORT_ASSUME_MISSING="gnuplot-nox debian-reference-en"
if has depsplots "no-install-recommends gnuplot-nox" && ! has depsplots "debian-reference-en"; then
    pass "report.sh REPORT_PLOTS_ONLY=1 does not install the text it does not read"
else fail "report.sh REPORT_PLOTS_ONLY=1 dependencies: $(grep missing "$tmp/depsplots.out")"; fi

# --- bad settings ---
plan small REPORT_QUICK=1 REPORT_TOKENS=128
check small "REPORT_TOKENS=128: too small, exit 1" 1 "REPORT_TOKENS=128 is too small"
plan badstep REPORT_STEPS="main frontier"
check badstep "REPORT_STEPS with an unknown step: exit 1 naming it and the steps" 1 \
    "report: unknown step 'frontier' in REPORT_STEPS; steps: main quant pos passkey select tiers passkey_sel compress"
check depsplots "REPORT_PLOTS_ONLY=1 without this grid's data: exit 1, says where and what to run" 1 \
    "needs the data of an earlier run of this grid in build/report-quick-1040/" "run REPORT_QUICK=1 REPORT_TOKENS=1040 make report first"

# --- which steps are reused: a fake data directory of an unusual grid (removed after) ---
D=build/report-quick-1056
if [ -e "$D" ]; then
    echo "SKIP report.sh step reuse: $D exists (not this test's; left alone)"
else
    trap 'rm -rf "$D"' EXIT
    mkdir -p "$D"
    plan fresh REPORT_QUICK=1 REPORT_TOKENS=1056
    args=$(sed -n 's|^report: plan: main: \./run \(.*\) -o '"$D"'/main\.dat$|\1|p' "$tmp/fresh.out")
    [ -n "$args" ] || fail "report.sh plan: no main command in $(cat "$tmp/fresh.out")"
    printf '{"kv":"full"}\n' >"$D/main.dat"
    printf 'report: started: ./run %s\nppl: ...\nreport: seconds: 3\nreport: complete: ./run %s\n' "$args" "$args" >"$D/main.log.dat"
    plan complete REPORT_QUICK=1 REPORT_TOKENS=1056
    check complete "a completed step is reused" 0 "plan: main: reuse $D/main.dat (complete)" "plan: quant: ./run"
    plan force REPORT_QUICK=1 REPORT_TOKENS=1056 REPORT_FORCE=1
    check force "REPORT_FORCE=1 reruns a completed step" 0 "plan: main: ./run $args -o $D/main.dat"
    printf 'report: started: ./run %s\nreport: complete: ./run %s\n' "${args/-c 1056/-c 512}" "${args/-c 1056/-c 512}" >"$D/main.log.dat"
    plan other_args REPORT_QUICK=1 REPORT_TOKENS=1056
    check other_args "a step completed with other arguments is not reused" 0 "plan: main: ./run $args -o $D/main.dat"
    printf '{"kv":"full"}\n{"kv":"win\n' >"$D/main.dat"
    printf 'report: started: ./run %s\nppl: 64/1055 tokens\n\nreport: interrupted after 5 s\n' "$args" >"$D/main.log.dat"
    plan partial REPORT_QUICK=1 REPORT_TOKENS=1056
    check partial "an interrupted step is measured again, saying what it replaces" 0 \
        "plan: main: ./run $args -o $D/main.dat (again: replaces the 2 records of an earlier run, interrupted after 5 s)"
    echo "threads=1 a=0.005 b=1.7e-06 d=0.05 load=1" >"$D/calibration.dat"
    plan partial_plots REPORT_QUICK=1 REPORT_TOKENS=1056 REPORT_PLOTS_ONLY=1
    check partial_plots "REPORT_PLOTS_ONLY=1 draws an interrupted step as it is" 0 \
        "plan: main: incomplete data in $D/main.dat (2 records; interrupted after 5 s): drawn as it is" \
        "plan: quant: no data for this grid in $D/"
fi

if [ "$(snapshot)" = "$before" ]; then pass "report.sh dry runs left report/ as it was"
else fail "report.sh dry runs changed report/: $(diff <(echo "$before") <(snapshot) | head -5)"; fi
