#!/usr/bin/env bash
# An interrupted run keeps what it measured: SIGINT (or SIGTERM) at several moments of ppl, passkey, bench and
# generate stops at the next token or chunk, exits 130 (143), prints its summary, and leaves every -o, -tokenlog and
# -kvlog file as whole JSON lines; a partial ppl record's figures equal those of a run with -n set to the tokens it
# reports, and its -tokenlog lines are that run's first lines.
set -u
cd "$(dirname "$0")/.."
tmp=tests/tmp/signals; rm -rf "$tmp"; mkdir -p "$tmp"
RUN=${KVLAB_RUN:-./run}; EXPORT=${KVLAB_EXPORT:-./export}
SMOL=models/smollm2-135m-instruct.bin
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }

# a random model big enough that a run takes seconds (ids-only: ppl reads ids from -f)
"$EXPORT" --random "$tmp/m.bin" --dim 256 --hidden 512 --layers 4 --heads 8 --kv-heads 4 --vocab 512 --seq 2048 \
    --seed 5 >/dev/null 2>&1 || fail "export --random"
M=$tmp/m.bin
# 40,000 ids: long enough that no run below ends before its signal on a quiet machine (2,000 took under 0.7 s)
python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange(2, 512)) for _ in range(40000)))" \
    >"$tmp/ids.txt"

# jsonl FILE: every line a JSON object (an empty or absent file counts as zero lines); prints the count
jsonl() {
    python3 - "$1" <<'PY'
import json, sys
n = 0
try:
    data = open(sys.argv[1], "rb").read()
except FileNotFoundError:
    data = b""
if data and not data.endswith(b"\n"):
    sys.exit("the last line is cut: %r" % data[-60:])
for line in data.splitlines():
    json.loads(line); n += 1
print(n)
PY
}

# --- ppl, interrupted at three moments, -chunk 16 and token by token ---
k=0
for case in "0.7 16" "2 16" "3.5 1"; do
    set -- $case; after=$1; chunk=$2; k=$((k + 1))
    o=$tmp/p$k.jsonl; t=$tmp/p$k.tok
    timeout --foreground --preserve-status -s INT "$after" "$RUN" "$M" -m ppl -f "$tmp/ids.txt" -c 512 -chunk "$chunk" \
        -kv window:64 -kv sink:64 -kv h2o:64 -o "$o" -tokenlog "$t" >/dev/null 2>"$tmp/err"; rc=$?
    no=$(jsonl "$o" 2>&1); nt=$(jsonl "$t" 2>&1)
    if [ $rc -eq 0 ]; then echo "SKIP ppl SIGINT after ${after}s: the run ended first"; continue; fi
    if [ $rc -eq 130 ] && [ "$no" = 4 ] && [[ "$nt" =~ ^[0-9]+$ ]] && grep -q "stopped by SIGINT after" "$tmp/err" \
       && grep -q "^shadow (full, f32)" "$tmp/err"; then
        pass "ppl -chunk $chunk, SIGINT after ${after}s: exit 130, table printed, 4 whole -o records, $nt whole -tokenlog lines"
    else fail "ppl -chunk $chunk, SIGINT after ${after}s: rc $rc, -o: $no, -tokenlog: $nt, $(tail -c 300 "$tmp/err")"; continue; fi
    n=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['scored_tokens'])" "$o")
    "$RUN" "$M" -m ppl -f "$tmp/ids.txt" -c 512 -chunk "$chunk" -kv window:64 -kv sink:64 -kv h2o:64 -n "$n" \
        -o "$tmp/n$k.jsonl" -tokenlog "$tmp/n$k.tok" >/dev/null 2>&1 || fail "ppl -n $n"
    if python3 - "$o" "$tmp/n$k.jsonl" "$n" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
n = int(sys.argv[3])
skip = {"partial", "seconds", "wall_seconds", "cmd", "threads"}   # threads: the default follows the load (cli.c)
assert len(a) == len(b) == 4, (len(a), len(b))
for x, y in zip(a, b):
    assert x["partial"] is True and y["partial"] is False, "partial flags"
    # the shadow stops at -c (ctx); the three evicting caches score every token
    assert x["scored_tokens"] == y["scored_tokens"] == n, "scored_tokens"
    assert x["all_tokens"] == (min(n, x["ctx"]) if x["kv"] == "shadow" else n), ("all_tokens", x["kv"], x["all_tokens"])
    for key in x:
        if key not in skip:
            assert x[key] == y[key], (x["kv"], key, x[key], y[key])
PY
    then pass "ppl partial records ($n tokens) equal a run with -n $n, every figure"
    else fail "ppl partial records differ from -n $n"; fi
    if [ "$(wc -l <"$t")" -eq "$n" ] && cmp -s "$t" <(head -n "$n" "$tmp/n$k.tok"); then
        pass "ppl -tokenlog after SIGINT: the $n lines of the -n $n run"
    else fail "ppl -tokenlog after SIGINT: $(wc -l <"$t") lines, not the first $n of the -n run"; fi
done

# SIGTERM: exit 143, records partial
timeout --foreground --preserve-status -s TERM 1 "$RUN" "$M" -m ppl -f "$tmp/ids.txt" -c 512 -chunk 16 -kv window:64 \
    -o "$tmp/term.jsonl" >/dev/null 2>"$tmp/err"; rc=$?
if [ $rc -eq 143 ] && [ "$(jsonl "$tmp/term.jsonl")" = 2 ] && grep -q '"partial":true' "$tmp/term.jsonl"; then
    pass "ppl SIGTERM: exit 143, 2 whole records marked partial"
elif [ $rc -eq 0 ]; then echo "SKIP ppl SIGTERM: the run ended first"
else fail "ppl SIGTERM: rc $rc, $(tail -c 200 "$tmp/err")"; fi

# --- generate with -kvlog, interrupted at two moments ---
for after in 0.5 1.5; do
    timeout --foreground --preserve-status -s INT "$after" "$RUN" "$M" -ids -i "5 6 7" -t 0 -n 0 -c 100000 -kv window:32 \
        -kvlog "$tmp/g.kvlog" >"$tmp/out" 2>"$tmp/err"; rc=$?
    nk=$(jsonl "$tmp/g.kvlog" 2>&1)
    if [ $rc -eq 130 ] && [[ "$nk" =~ ^[0-9]+$ ]] && grep -q "SIGINT: generation stopped" "$tmp/err" \
       && grep -q "^prompt 3 tok" "$tmp/err"; then
        pass "generate, SIGINT after ${after}s: exit 130, summary printed, -kvlog $nk whole lines"
    elif grep -q "generated BOS" "$tmp/err"; then echo "SKIP generate SIGINT: the sample reached BOS first"
    else fail "generate, SIGINT after ${after}s: rc $rc, -kvlog: $nk, $(tail -c 300 "$tmp/err")"; fi
done

# --- bench ---
timeout --foreground --preserve-status -s INT 2 "$RUN" "$M" -m bench -c 16384 -n 512 -kv full -kv window:64 -o "$tmp/b.jsonl" \
    >/dev/null 2>"$tmp/err"; rc=$?
nb=$(jsonl "$tmp/b.jsonl" 2>&1)
if [ $rc -eq 130 ] && [[ "$nb" =~ ^[0-9]+$ ]] && grep -q "bench: stopped by SIGINT" "$tmp/err"; then
    pass "bench, SIGINT after 2s: exit 130, $nb whole records"
elif [ $rc -eq 0 ]; then echo "SKIP bench SIGINT: the run ended first"
else fail "bench, SIGINT: rc $rc, -o: $nb, $(tail -c 300 "$tmp/err")"; fi

# --- passkey (needs a tokenizer: SmolLM2) ---
if [ -f "$SMOL" ] && [ -z "${KVLAB_SANITIZE:-}" ]; then
    for after in 4 12; do
        timeout --foreground --preserve-status -s INT "$after" "$RUN" "$SMOL" -m passkey -c 512 -kv window:64 -kv sink:64 \
            -o "$tmp/pk$after.jsonl" >/dev/null 2>"$tmp/err"; rc=$?
        np=$(jsonl "$tmp/pk$after.jsonl" 2>&1)
        if [ $rc -eq 130 ] && [[ "$np" =~ ^[0-9]+$ ]] && grep -q "passkey: stopped by SIGINT" "$tmp/err"; then
            pass "passkey, SIGINT after ${after}s: exit 130, $np whole records"
        elif [ $rc -eq 0 ]; then echo "SKIP passkey SIGINT after ${after}s: the run ended first"
        else fail "passkey, SIGINT after ${after}s: rc $rc, -o: $np, $(tail -c 300 "$tmp/err")"; fi
    done
else
    echo "SKIP passkey SIGINT: $SMOL absent (make model) or a sanitizer build"
fi
