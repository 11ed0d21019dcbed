#!/usr/bin/env bash
# -m passkey on SmolLM2 at a short -c (docs/DESIGN.md, "Passkey"; llama.cpp's passkey prompt):
#  - the key sentence sits at the requested depth: the prompt's parts, tokenized here one by one from llama.cpp's
#    passkey text, give where the key and the question must start for each depth (depth 0 right after the
#    instruction, depth 1 right before the question), against the -o record's key_pos and question_pos;
#  - `full` answers every key correctly at -c 256 at depths 0 to 0.75 (a key is 5 digit tokens for SmolLM2, so each
#    correct answer is a number read over several tokens). At depth 1 SmolLM2-135M continues the key sentence's
#    own words instead (" the pass key. The pass key is", measured): its answers there are recorded, not asserted;
#  - a tiny window (window:32) fails at depth 0, where the key is evicted long before the question, and answers at
#    depth 1, where the key sentence is inside the window: the placement seen through the cache;
#  - every record is scored as README documents: answer = the first run of ASCII digits of answer_text as a number
#    (leading zeros dropped), null with answer_status "no_number" when it has none (window:32's answers at depth 0
#    have no digit), correct = (answer == key);
#  - the grid flags: -lengths 256,200 -depths 1,0.5 gives those cells in that order (2 keys each) and the two-turn
#    variant at the longest length; -passkey2 0 skips it; a length over -c or too short for the fixed text is one
#    error line naming it;
#  - the shared prefill (-prefix 1) gives every record -prefix 0 gives, at -chunk 64, 7 and 1.
# SKIPs without models/smollm2-135m-instruct.bin, and under KVLAB_SANITIZE (minutes under ASan; the normal build runs it).
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
tmp=tests/tmp/passkey; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP passkey on SmolLM2: $M missing (make model)"; exit 0; fi
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP passkey on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL passkey: python3 is needed to read the records"; exit 0; }

"$RUN" "$M" -m passkey -c 256 -kv full -kv window:32 -o "$tmp/pk.jsonl" 2>"$tmp/err"; rc=$?
if [ $rc -ne 0 ]; then echo "FAIL passkey run: exit $rc: $(tail -3 "$tmp/err")"; exit 0; fi
tok() { "$RUN" "$M" -m tokenize -i "$1" 2>/dev/null | wc -w; }
# llama.cpp's passkey text (examples/passkey), the parts as the prompt joins them: each starts with a space, where
# SmolLM2's pre-tokenizer splits, so the prompt's tokens are the parts' tokens in order
P=$(tok "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.")
F=$(tok " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
Q=$(tok " What is the pass key? The pass key is")
D=$(tok "12345")
python3 - "$tmp/pk.jsonl" "$P" "$F" "$Q" "$D" "$RUN" "$M" <<'PY'
import json, math, re, subprocess, sys
pk, P, F, Q, D, run, model = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6], sys.argv[7]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
def ntok(text):
    return len(subprocess.run([run, model, "-m", "tokenize", "-i", text], capture_output=True, text=True).stdout.split())
def parse(text):   # README: first run of ASCII digits, leading zeros dropped, at most 9 digits read
    m = re.search(r"[0-9]+", text)
    return None if m is None else int(m.group(0).lstrip("0")[:9] or "0")
recs = [json.loads(l) for l in open(pk)]
one = [r for r in recs if r["mode"] == "passkey"]
full = [r for r in one if r["kv"] == "full"]
win = [r for r in one if r["kv"] == "window:32"]
check(len(full) == 10 and len(win) == 10, f"-c 256: 5 depths x 2 keys per policy at length 256 ({len(full)} full, "
      f"{len(win)} window:32 records; lengths 64 and 128 are too short for the prompt)")
# placement: the key sentence before filler round(depth * fillers) (half up), the question after the last filler
bad = []
for r in one:
    n, d = r["fillers"], r["depth"]
    before = math.floor(d * n + 0.5)
    K = ntok(f" The pass key is {r['key']}. Remember it. {r['key']} is the pass key.")
    want_key = P + before * F
    want_q = want_key + K + (n - before) * F
    if (r["key_pos"], r["question_pos"], r["prompt_tokens"]) != (want_key, want_q, want_q + Q):
        bad.append(f"{r['kv']} depth {d}: key at {r['key_pos']} (want {want_key}), question at {r['question_pos']} "
                   f"(want {want_q}), {r['prompt_tokens']} tokens (want {want_q + Q})")
d0 = [r for r in full if r["depth"] == 0]
d1 = [r for r in full if r["depth"] == 1]
check(not bad and d0 and d1 and all(r["key_pos"] == P for r in d0) and
      all(r["question_pos"] == r["key_pos"] + ntok(f" The pass key is {r['key']}. Remember it. {r['key']} is the pass key.")
          for r in d1),
      f"key sentence at the requested depth in all {len(one)} prompts (instruction {P} tokens, filler {F}, question {Q}; "
      f"depth 0: key at {d0[0]['key_pos'] if d0 else '?'} = right after the instruction; depth 1: question at "
      f"{d1[0]['question_pos'] if d1 else '?'} = right after the key sentence)" + (": " + "; ".join(bad[:4]) if bad else ""))
inner = [r for r in full if r["depth"] < 1]
ok = [r for r in inner if r["correct"]]
check(len(ok) == len(inner) == 8, f"full at -c 256, depths 0 to 0.75: {len(ok)}/{len(inner)} keys answered correctly "
      f"({', '.join(repr(r['answer_text']) for r in inner[:3])} ...); depth 1 (not asserted): "
      f"{sum(r['correct'] for r in d1)}/{len(d1)}, {[r['answer_text'] for r in d1]}")
check(D >= 2, f"a 5-digit key is {D} tokens for SmolLM2: correct answers read a number over several tokens")
w0 = [r for r in win if r["depth"] == 0]
w1 = [r for r in win if r["depth"] == 1]
check(len(w0) == 2 and not any(r["correct"] for r in w0),
      f"window:32 at depth 0 (key at {P}, question at {w0[0]['question_pos'] if w0 else '?'}): {sum(r['correct'] for r in w0)}"
      f"/{len(w0)} correct (answers {[r['answer_text'] for r in w0]})")
check(len(w1) == 2 and all(r["correct"] for r in w1),
      f"window:32 at depth 1 (the key sentence inside the last 32 tokens): {sum(r['correct'] for r in w1)}/{len(w1)} correct")
# scoring, on every record
bad, nonum = [], 0
for r in one:
    want = parse(r["answer_text"])
    status = r.get("answer_status")
    nonum += status == "no_number"
    if r["answer"] != want or (want is None) != (status == "no_number") or r["correct"] != (want == r["key"]):
        bad.append(f"{r['answer_text']!r}: answer {r['answer']}, status {status}, correct {r['correct']}")
check(not bad and nonum > 0 and nonum < len(one), f"answer, answer_status, correct as README documents on {len(one)} "
      f"records ({nonum} without a digit: null, no_number)" + (": " + "; ".join(bad[:4]) if bad else ""))
two = [r for r in recs if r["mode"] == "passkey2"]
check(len(two) == 4 and all(r["answers"] == [-1 if r[k] is None else r[k] for k in ("answer_first", "answer_second")]
                            for r in two),
      f"passkey2: {len(two)} records (2 per policy), answers = [answer_first, answer_second] with -1 for none")
PY

# the grid flags: cells in the order given, the two-turn variant at the longest length, or none with -passkey2 0
"$RUN" "$M" -m passkey -c 256 -lengths 256,200 -depths 1,0.5 -kv window:32 -o "$tmp/grid.jsonl" 2>"$tmp/grid_err"
rc1=$?
"$RUN" "$M" -m passkey -c 256 -lengths 200 -depths 0.25 -passkey2 0 -kv window:32 -o "$tmp/grid0.jsonl" 2>"$tmp/grid0_err"
rc2=$?
python3 - "$tmp/grid.jsonl" "$tmp/grid0.jsonl" "$rc1" "$rc2" "$tmp/grid_err" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])] if sys.argv[3] == "0" else []
b = [json.loads(l) for l in open(sys.argv[2])] if sys.argv[4] == "0" else []
cells = [(r["length"], r["depth"]) for r in a if r["mode"] == "passkey"]
want = [(256, 1), (256, 1), (256, 0.5), (256, 0.5), (200, 1), (200, 1), (200, 0.5), (200, 0.5)]
two = [r["length"] for r in a if r["mode"] == "passkey2"]
head = open(sys.argv[5]).read().splitlines()[:1] + [l for l in open(sys.argv[5]) if l.startswith("passkey:")][:1]
print(("PASS " if cells == want and two == [256, 256] else "FAIL ") +
      f"-lengths 256,200 -depths 1,0.5: (length, depth) of the records in order {cells} (want {want}), two-turn "
      f"records at lengths {two} (want the longest, 256, twice); {head[-1].strip() if head else ''}")
cells0 = [(r["length"], r["depth"]) for r in b if r["mode"] == "passkey"]
two0 = [r for r in b if r["mode"] == "passkey2"]
print(("PASS " if cells0 == [(200, 0.25)] * 2 and not two0 else "FAIL ") +
      f"-lengths 200 -depths 0.25 -passkey2 0: {len(cells0)} records at {sorted(set(cells0))}, {len(two0)} two-turn")
PY
# the shared prefill (-prefix 1, the default): the policies that only store over a prompt's first tokens start from
# one full-cache prefill of them; every record (answer, answer_text, positions, the two-turn answers) must equal
# -prefix 0's, where each policy prefills alone, at -chunk 64 and 7 (-chunk 1: h2o left out, token by token is slow);
# the prompts after the first reuse what the one before computed of the tokens they share
PKP=(-kv full -kv window:48 -kv sink:48 -kv topk:16,prompt=dense -kv quest:32,prompt=dense -kv snapkv:64 -kv h2o:48)
for cfg in 64:0 64:1 7:1 1:1; do
    ch=${cfg%:*} pf=${cfg#*:} pols=("${PKP[@]}")
    [ "$ch" = 1 ] && pols=("${PKP[@]:0:12}")
    "$RUN" "$M" -m passkey -c 256 -lengths 256 -depths 0.25,0.75 -chunk "$ch" -prefix "$pf" "${pols[@]}" \
        -o "$tmp/pf_$ch.$pf.jsonl" 2>"$tmp/pf_$ch.$pf.err" || echo "FAIL -m passkey -chunk $ch -prefix $pf: $(tail -n 2 "$tmp/pf_$ch.$pf.err")"
done
python3 - "$tmp" <<'PY'
import json, re, sys
d = sys.argv[1]
def recs(name):
    try: lines = open(f"{d}/pf_{name}.jsonl").read().splitlines()
    except OSError: return []
    out = []
    for l in lines:
        r = json.loads(l)
        for k in ("cmd", "git", "threads"): r.pop(k, None)
        out.append(json.dumps(r, sort_keys=True))
    return sorted(out)
ref = recs("64.0")
for name in ("64.1", "7.1", "1.1"):
    got = recs(name)
    want = ref if name != "1.1" else sorted(r for r in ref if '"kv": "h2o:48"' not in r)
    err = open(f"{d}/pf_{name}.err").read()
    m = re.search(r"passkey: (\d+) prompt tokens moved in from one shared full-cache prefill per prompt", err)
    moved = int(m.group(1)) if m else 0
    # what a prompt computed serves the next, which starts with the same tokens: the shared prefill keeps them, and
    # the eviction policies (window, sink, h2o) resume from their own cache saved there
    m = re.search(r"kept (\d+) from the prompt before\), (\d+) resumed from a policy's own cache", err)
    kept, resumed = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    kvs = sorted({json.loads(r)["kv"] for r in got})
    print(("PASS " if got == want and len(got) >= 30 and moved > 0 and kept > 0 and resumed > 0 else "FAIL ") +
          f"-prefix 1 -chunk {name.split('.')[0]}: {len(got)} records of {len(kvs)} policies, every one equal to -prefix 0's "
          f"(own prefill, -chunk 64): {got == want}; {moved} prompt tokens moved in from the shared prefill, which kept "
          f"{kept} from the prompt before; {resumed} resumed from a policy's own saved cache")
PY
expect_error() {   # NAME PATTERN ARGS...: exit 1, one stderr line (after the CPU note) matching PATTERN
    local name=$1 pat=$2; shift 2
    "$RUN" "$M" -m passkey "$@" >/dev/null 2>"$tmp/e"; local rc=$?
    grep -v "^run: note" "$tmp/e" >"$tmp/e1"
    if [ $rc -eq 1 ] && [ "$(wc -l <"$tmp/e1")" -eq 1 ] && grep -qF -- "$pat" "$tmp/e1"; then echo "PASS $name -> $(cat "$tmp/e1")"
    else echo "FAIL $name: rc $rc, stderr: $(head -c 300 "$tmp/e")"; fi
}
expect_error "-lengths over -c" "-lengths: 300 tokens is over -c 256" -c 256 -lengths 200,300
expect_error "-lengths too short" "-lengths: 150 tokens is too short" -c 256 -lengths 150
exit 0
