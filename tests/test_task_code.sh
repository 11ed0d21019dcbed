#!/usr/bin/env bash
# -m task -task code on SmolLM2 (task_code.h; the pure parts alone are tests/test_task_code.c), small: -c 512
# -lengths 256,512, one item per length:
#  - exit 0, one JSON line per (policy, item), full first and marked the reference;
#  - each record's expected line is the header's next non-empty line after its cut, read here from the file;
#  - match_file and match_full recomputed here from answer, expected and full's answer by the trim rule (leading and
#    trailing space, tab, CR, VT, FF dropped; an empty answer never matches the file); full agrees with itself: 1.0;
#  - $KVLAB_CODE_ROOT at a copy of the headers with one altered: skipped=1 in the records and on stderr, that header
#    never drawn; with no -kv, full still runs (the reference) and says so;
#  - bad input: a root that does not exist, -depths, a length no cut fits: one error line, exit 1.
# SKIPs without models/smollm2-135m-instruct.bin, under KVLAB_SANITIZE, or where the pinned headers are not here.
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
tmp=tests/tmp/task_code; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP task code on SmolLM2: $M missing (make model)"; exit 0; fi
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP task code on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL task code: python3 is needed to read the records"; exit 0; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset KVLAB_CODE_ROOT

"$RUN" "$M" -m task -task code -c 512 -lengths 256,512 -items 1 -kv sink:128 -kv full -o "$tmp/a.jsonl" 2>"$tmp/a.err"
rc=$?
if [ $rc -ne 0 ] && grep -q "no pinned header is left" "$tmp/a.err"; then
    echo "SKIP task code: the pinned headers are not on this machine: $(tail -1 "$tmp/a.err")"; exit 0
fi
if [ $rc -eq 0 ]; then echo "PASS -task code -kv sink:128 -kv full: exit 0"; else echo "FAIL -task code: exit $rc: $(tail -n 2 "$tmp/a.err")"; fi

# a copy of the headers, one altered (a comment appended)
mkdir -p "$tmp/root"
for f in stdio.h stdlib.h string.h unistd.h fcntl.h signal.h pthread.h time.h errno.h math.h ctype.h locale.h \
         setjmp.h dirent.h getopt.h sched.h wchar.h; do cp /usr/include/$f "$tmp/root/"; done
echo "/* altered */" >>"$tmp/root/string.h"
KVLAB_CODE_ROOT="$tmp/root" "$RUN" "$M" -m task -task code -c 512 -lengths 256 -items 4 -o "$tmp/b.jsonl" 2>"$tmp/b.err"
rc=$?
if [ $rc -eq 0 ]; then echo "PASS KVLAB_CODE_ROOT with string.h altered: exit 0"; else echo "FAIL KVLAB_CODE_ROOT run: exit $rc: $(tail -n 2 "$tmp/b.err")"; fi
if grep -q "1 of 17 pinned headers skipped under '$tmp/root': string.h (sha256 differs)" "$tmp/b.err" &&
   grep -q "no -kv full given: full runs first anyway" "$tmp/b.err"; then
    echo "PASS stderr counts the skip (string.h, sha256 differs) and says full runs as the reference"
else echo "FAIL stderr: $(head -c 600 "$tmp/b.err")"; fi

python3 - "$tmp" <<'PY'
import json, os, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
def load(n):
    p = os.path.join(tmp, n)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
WS = " \t\r\v\f"
def same(a, b): return a.strip(WS) == b.strip(WS)
def match_file(a, e): return int(a.strip(WS) != "" and same(a, e))
def first_line(out):   # the first line with a non-whitespace byte
    for l in out.split("\n"):
        if l.strip(WS): return l
    return ""
def next_line(path, cut):
    data = open(path, "rb").read().decode("latin-1")
    assert data[cut - 1] == "\n"
    lines = data[cut:].split("\n")
    for i, l in enumerate(lines):
        if l.strip(WS): return l, data[:cut].count("\n") + i + 1
a, b = load("a.jsonl"), load("b.jsonl")
fields = ["mode", "task", "kv", "budget", "reference", "length", "item", "item_seed", "root", "file", "file_sha256",
          "files", "skipped", "cut", "line", "prompt_tokens", "answer_tokens", "expected", "answer", "output",
          "match_file", "match_full", "cache_full", "kv_live_bytes", "cmd", "git", "model_sha256", "seed"]
missing = sorted({f for r in a + b for f in fields if f not in r})
check(len(a) == 4 and [r["kv"] for r in a] == ["full", "full", "sink:128", "sink:128"] and
      [r["reference"] for r in a] == [True, True, False, False] and [r["length"] for r in a] == [256, 512, 256, 512]
      and not missing, f"4 records, full first (the reference) then sink:128, every field present"
      + (f" (missing {missing})" if missing else ""))
bad = []
for r in a + b:
    e, no = next_line(os.path.join(r["root"], r["file"]), r["cut"])
    if e != r["expected"] or no != r["line"]: bad.append(f"{r['file']} cut {r['cut']}: {e!r} line {no}, record {r['expected']!r} line {r['line']}")
    if r["prompt_tokens"] + 48 > r["length"]: bad.append(f"prompt {r['prompt_tokens']} over {r['length']} - 48")
check(a and not bad, f"expected = the header's next non-empty line after the cut, read here ({len(a + b)} records; "
      f"e.g. {a[0]['file'] if a else '?'} line {a[0]['line'] if a else '?'}: {a[0]['expected'][:50] if a else ''!r})"
      + ("; " + "; ".join(bad[:2]) if bad else ""))
full = {(r["length"], r["item"]): first_line(r["output"]) for r in a if r["kv"] == "full"}
bad = []
for r in a:
    if first_line(r["output"]) != r["answer"]: bad.append(f"answer {r['answer']!r} is not the output's first line")
    if r["match_file"] != match_file(r["answer"], r["expected"]): bad.append(f"{r['kv']} match_file {r['match_file']}")
    if r["match_full"] != int(same(r["answer"], full[(r["length"], r["item"])])): bad.append(f"{r['kv']} match_full {r['match_full']}")
check(a and not bad, f"match_file and match_full as the trim rule gives them (file: {[r['match_file'] for r in a]}, "
      f"full: {[r['match_full'] for r in a]}; answers {[r['answer'][:30] for r in a]})" + ("; " + "; ".join(bad[:2]) if bad else ""))
fa = [r["match_full"] for r in a + b if r["kv"] == "full"]
check(len(fa) == 6 and sum(fa) / len(fa) == 1.0, f"full's agreement with itself: {sum(fa)}/{len(fa)} = 1.0")
check(len(b) == 4 and all(r["skipped"] == 1 and r["files"] == 16 and r["skipped_files"] == "string.h (sha256 differs)"
                          and r["file"] != "string.h" and r["reference"] for r in b),
      f"KVLAB_CODE_ROOT copy with string.h altered: every record says skipped=1 of 17 (files {[r['files'] for r in b]}),"
      f" drew {sorted({r['file'] for r in b})}, never string.h")
PY

expect_error() {   # NAME PATTERN ARGS...: exit 1, one stderr line (after the notes) matching PATTERN
    local name=$1 pat=$2; shift 2
    "$RUN" "$M" "$@" >/dev/null 2>"$tmp/e"; local rc=$?
    grep -v "^run: note" "$tmp/e" >"$tmp/e1"
    if [ $rc -eq 1 ] && [ "$(wc -l <"$tmp/e1")" -eq 1 ] && grep -qF -- "$pat" "$tmp/e1"; then echo "PASS $name -> $(cat "$tmp/e1")"
    else echo "FAIL $name: rc $rc, stderr: $(head -c 300 "$tmp/e")"; fi
}
KVLAB_CODE_ROOT=/nonexistent/kvlab expect_error "a root that does not exist" \
    "-task code: code root '/nonexistent/kvlab' (KVLAB_CODE_ROOT, default /usr/include): No such file or directory" \
    -m task -task code -c 512 -lengths 256
expect_error "-depths with -task code" "-task code has no depth" -m task -task code -c 512 -lengths 256 -depths 0.5
expect_error "a length no cut fits" "-lengths: 60 tokens: no pinned header under '/usr/include' has a line boundary" \
    -m task -task code -c 512 -lengths 60
expect_error "unknown -task lists code" "unknown -task 'cod'; tasks: passkey, niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, code" \
    -m task -task cod
exit 0
