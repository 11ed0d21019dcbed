#!/usr/bin/env bash
# -m task -task summary|docqa|dialogue on SmolLM2 (task_text.h; the pure parts alone are tests/test_task_text.c),
# small: -c 512, one item per cell, short answers:
#  - exit 0; one JSON line per (policy, item), per turn for dialogue (turns 0..7); full first, marked the reference;
#  - f1_full, rouge_l_full, same_full, and docqa's f1_truth, rouge_l_truth, recomputed here in Python from the
#    records' answers (SQuAD's normalize_answer and F1, ROUGE-L by its LCS: written here, not kvlab's C); full against
#    itself: 1;
#  - docqa: the quote occurs once in the slice (read here from the licence file at slice_start..slice_end, whole words)
#    and the truth follows it; each slice starts at a paragraph (after a blank line or at the file's start);
#  - -docs <(...) (a pipe) is read whole: the records name it and its digest is sha256sum's;
#  - $KVLAB_TEXT_ROOT at a copy of the licences with one altered: skipped=1 in the records and on stderr, that text
#    never drawn; with no -kv, full still runs (the reference) and says so;
#  - bad input: -depths on summary, -questions, a -docs file that is missing or a directory, a length too short for
#    the prompt, a length no slice of -docs fits, an unknown task (the message lists the natural ones), -docs with a
#    task that makes its own text, a -kv spec the cache refuses (said before full runs, for the natural, RULER and
#    code runners), a dialogue -n whose 8 answers fill the length: one error line, exit 1.
# SKIPs without models/smollm2-135m-instruct.bin, under KVLAB_SANITIZE, or where the pinned licences are not here.
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
L=/usr/share/common-licenses
tmp=tests/tmp/task_text; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP natural tasks on SmolLM2: $M missing (make model)"; exit 0; fi
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP natural tasks on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL natural tasks: python3 is needed to read the records"; exit 0; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset KVLAB_TEXT_ROOT

run() {   # name, args...: exit 0 expected, records in $tmp/name.jsonl
    local name=$1; shift
    "$RUN" "$M" -m task "$@" -o "$tmp/$name.jsonl" 2>"$tmp/$name.err"
    local rc=$?
    if [ $rc -eq 0 ]; then echo "PASS $name: exit 0"; else echo "FAIL $name: exit $rc: $(tail -n 2 "$tmp/$name.err")"; fi
}
run docqa -task docqa -c 512 -lengths 384,512 -depths 0.25,0.75 -items 1 -n 24 -kv full -kv window:96
if grep -q "no pinned text is left" "$tmp/docqa.err"; then echo "SKIP natural tasks: no pinned licence texts here"; exit 0; fi
run summary -task summary -c 512 -lengths 512 -items 1 -n 32 -kv sink:128
run dialogue -task dialogue -c 1024 -lengths 1024 -items 1 -n 16 -kv full -kv h2o:256
run docs -task summary -c 512 -lengths 384 -items 1 -n 16 -kv full -docs <(cat "$L/GPL-3")

python3 - "$tmp" "$L" <<'EOF'
import hashlib, json, re, string, sys
tmp, lic = sys.argv[1], sys.argv[2]

def norm(s):   # SQuAD v1.1's normalize_answer
    s = s.lower()
    s = ''.join(c for c in s if c not in set(string.punctuation))
    s = re.sub(r'\b(a|an|the)\b', ' ', s)
    return s.split()

def f1(a, b):
    x, y = norm(a), norm(b)
    if not x or not y: return float(x == y)
    common = sum(min(x.count(w), y.count(w)) for w in set(x))
    if common == 0: return 0.0
    p, r = common / len(x), common / len(y)
    return 2 * p * r / (p + r)

def rouge_l(a, b):
    x, y = norm(a), norm(b)
    if not x or not y: return float(x == y)
    t = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(len(x)):
        for j in range(len(y)):
            t[i + 1][j + 1] = t[i][j] + 1 if x[i] == y[j] else max(t[i][j + 1], t[i + 1][j])
    c = t[len(x)][len(y)]
    if c == 0: return 0.0
    p, r = c / len(x), c / len(y)
    return 2 * p * r / (p + r)

def check(ok, msg):
    print(("PASS " if ok else "FAIL ") + msg)

def load(name):
    return [json.loads(l) for l in open(f"{tmp}/{name}.jsonl")]

for name, kinds, turns in (("docqa", 2, 1), ("summary", 1, 1), ("dialogue", 1, 8), ("docs", 1, 1)):
    recs = load(name)
    pols = []
    for r in recs:
        if r["kv"] not in pols: pols.append(r["kv"])
    lens = sorted({r["length"] for r in recs})
    per_pol = len(recs) // len(pols)
    check(pols[0] == "full" and all(r["reference"] == (r["kv"] == "full") for r in recs) and
          all(sum(r["kv"] == p for r in recs) == per_pol for p in pols),
          f"{name}: {len(recs)} records, {len(pols)} policies ({', '.join(pols)}), full first and the reference")
    if name == "dialogue":
        check(sorted(r["turn"] for r in recs if r["kv"] == pols[1]) == list(range(8)), "dialogue: turns 0..7 per policy")
    ok = True
    for r in recs:
        ok &= abs(f1(r["answer"], r["full_answer"]) - r["f1_full"]) < 1e-5
        ok &= abs(rouge_l(r["answer"], r["full_answer"]) - r["rouge_l_full"]) < 1e-5
        ok &= r["same_full"] == int(r["answer"].strip() == r["full_answer"].strip())
        if r["task"] == "docqa":
            ok &= abs(f1(r["answer"], r["truth"]) - r["f1_truth"]) < 1e-5
            ok &= abs(rouge_l(r["answer"], r["truth"]) - r["rouge_l_truth"]) < 1e-5
        if r["reference"]: ok &= r["f1_full"] == 1 and r["rouge_l_full"] == 1 and r["same_full"] == 1
    check(ok, f"{name}: every F1, ROUGE-L and same recomputed from the answers agrees; full scores 1 against itself")
    if name in ("docqa", "summary"):
        ok = True
        for r in recs:
            data = open(f"{lic}/{r['doc']}", "rb").read()
            ok &= hashlib.sha256(data).hexdigest() == r["doc_sha256"]
            s = data[r["slice_start"]:r["slice_end"]].decode("utf-8", "replace")
            ok &= r["slice_start"] == 0 or data[:r["slice_start"]].rstrip(b" \t").endswith(b"\n\n") or \
                  data[:r["slice_start"]].endswith(b"\n\n")
            if name == "docqa":
                words = " " + " ".join(s.split()) + " "
                ok &= words.count(" " + r["question"] + " ") == 1
                ok &= (" " + r["question"] + " " + r["truth"] + " ") in words
        check(ok, f"{name}: each slice is the pinned file's bytes from a paragraph start" +
              ("; its quote occurs once, the truth right after it" if name == "docqa" else ""))
recs = load("docs")
gpl = hashlib.sha256(open(f"{lic}/GPL-3", "rb").read()).hexdigest()
check(all(r["doc"].startswith("/dev/fd/") and r["doc_sha256"] == gpl and r["docs"] == 1 for r in recs),
      "-docs <(cat GPL-3): read whole from the pipe, its digest sha256sum's")
EOF

# a copy of the licences with one altered
mkdir -p "$tmp/root"
for f in Apache-2.0 Artistic BSD CC0-1.0 GFDL-1.2 GFDL-1.3 GPL-1 GPL-2 GPL-3 LGPL-2 LGPL-2.1 LGPL-3 MPL-1.1 MPL-2.0; do
    cp "$L/$f" "$tmp/root/"
done
echo "altered" >>"$tmp/root/GPL-2"
KVLAB_TEXT_ROOT="$tmp/root" "$RUN" "$M" -m task -task summary -c 512 -lengths 384 -items 4 -n 8 -o "$tmp/root.jsonl" \
    2>"$tmp/root.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "1 of 14 pinned texts skipped under '$tmp/root': GPL-2 (sha256 differs)" "$tmp/root.err" &&
   grep -q "no -kv full given: full runs first anyway" "$tmp/root.err" &&
   python3 -c "
import json,sys
r=[json.loads(l) for l in open('$tmp/root.jsonl')]
sys.exit(0 if len(r)==4 and all(x['skipped']==1 and x['docs']==13 and x['doc']!='GPL-2' for x in r) else 1)"; then
    echo "PASS KVLAB_TEXT_ROOT with GPL-2 altered: counted as skipped, never drawn; full runs as the reference"
else echo "FAIL KVLAB_TEXT_ROOT run: exit $rc: $(tail -n 2 "$tmp/root.err")"; fi

source tests/lib.sh   # expect_error
bad() { local want=$1; shift; expect_error "bad input ($*)" "$want" -m task "$@"; }
bad "has no depth" -task summary -c 512 -depths 0.5
bad "use -task niah_multikey" -task dialogue -c 1024 -questions 2
bad "missing.txt" -task docqa -c 512 -docs "$tmp/missing.txt"
bad "is a directory" -task summary -c 512 -docs "$tmp"
bad "is too short for -task docqa" -task docqa -c 512 -lengths 70 -n 8
printf 'A short text.\n\nOf two paragraphs.\n' >"$tmp/short.txt"
bad "no slice of whole paragraphs of -docs" -task summary -c 512 -lengths 512 -n 8 -docs "$tmp/short.txt"
bad "summary, docqa, dialogue" -task essay -c 512
bad "-docs is for the natural tasks" -task vt -c 512 -docs "$tmp/short.txt"
bad "-docs is for the natural tasks" -task code -c 512 -docs "$tmp/short.txt"
# a spec the cache refuses is said before full (asked first) runs, for every task runner
for t in summary niah_single code; do
    bad "leaves no page to choose" -task $t -c 512 -lengths 512 -kv full -kv quest:64,page=1000
done
bad "dialogue's 8 answers of 200 tokens" -task dialogue -c 1024 -n 200
