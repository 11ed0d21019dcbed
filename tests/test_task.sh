#!/usr/bin/env bash
# -m task on SmolLM2 (task.h; the generators and the scorer alone are tests/test_task.c): every task at one length
# (-c 384 -lengths 384; cwe 512), full and sink:64:
#  - exit status 0 and one JSON line per (policy, item) with the fields README lists;
#  - score and exact recomputed here from answer and expected by RULER's rule (the share of expected answers found in
#    the output, ASCII case ignored; exact: all found);
#  - each prompt fits its length with its answer tokens, and fills it (within two filler sentences);
#  - placement: for niah_single and passkey (one needle), the needle at depth 0.5 starts floor(0.5 * fillers + 0.5)
#    filler sentences (their token count measured here) after the needle at depth 0 (the haystack's start): exact;
#  - full keeps more bytes than sink:64, whose peak is 64 slots per lane;
#  - shared context (-task niah_multikey -questions 3, -shared turns and requests, full and sink:64): one record per
#    question; question 1 is the same prompt in both protocols and gets the same answer (requests prefilled the context,
#    cloned and restored the cache: bit-identical); full's live bytes per token are one constant, the cache holding
#    every turn so far under turns and only the context with this question under requests (restored each time);
#  - the shared prefill (-prefix 1, the default): eleven policies, those that only store over a prompt's first tokens
#    (full, window, sink, random, snapkv aware and agnostic, quest with prompt=dense) moved in from one full-cache
#    prefill, the others (h2o, quest selecting from the first query, q8 storage, pos=cache) alone, at -chunk 7 and
#    32: every record's answer and bytes equal -prefix 0's, and stderr counts the tokens moved in;
#  - bad flags: an unknown -task, -task without -m task, -m task without -task, a length over -c: one error line.
# SKIPs without models/smollm2-135m-instruct.bin, and under KVLAB_SANITIZE (minutes under ASan).
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
tmp=tests/tmp/task; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP task on SmolLM2: $M missing (make model)"; exit 0; fi
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP task on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL task: python3 is needed to read the records"; exit 0; }

for t in passkey niah_single niah_multikey niah_multivalue niah_multiquery vt cwe; do
    depths=0.5; case $t in passkey|niah_single) depths=0,0.5;; esac
    len=384; [ $t = cwe ] && len=512   # cwe's smallest list (50 entries) and 80 answer tokens need more
    "$RUN" "$M" -m task -task $t -c $len -lengths $len -depths $depths -items 1 -kv full -kv sink:64 \
        -o "$tmp/$t.jsonl" 2>"$tmp/$t.err"
    rc=$?
    if [ $rc -eq 0 ]; then echo "PASS -m task -task $t: exit 0 ($(grep -c . "$tmp/$t.jsonl") records)"
    else echo "FAIL -m task -task $t: exit $rc: $(tail -n 2 "$tmp/$t.err")"; fi
done
F=$("$RUN" "$M" -m tokenize -i " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." 2>/dev/null | wc -w)
python3 - "$tmp" "$F" <<'PY'
import json, math, os, sys
tmp, F = sys.argv[1], int(sys.argv[2])
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
fields = ["mode", "task", "family", "variant", "kv", "budget", "length", "depth", "item", "item_seed", "prompt_tokens",
          "answer_tokens", "fillers", "needle_pos", "question_pos", "chat", "expected", "answer", "cache_full", "found",
          "score", "exact", "kv_live_bytes", "kv_peak_live_bytes", "kv_alloc_bytes", "cmd", "git", "model_sha256", "seed"]
per_answer = {"passkey": 16, "niah_single": 24, "niah_multikey": 24, "niah_multivalue": 48, "niah_multiquery": 48,
              "vt": 40, "cwe": 80}
for t in per_answer:
    L = 512 if t == "cwe" else 384
    path = os.path.join(tmp, t + ".jsonl")
    recs = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    n_items = 2 if t in ("passkey", "niah_single") else 1
    missing = sorted({f for r in recs for f in fields if f not in r})
    check(len(recs) == 2 * n_items and not missing and sorted(r["kv"] for r in recs) == ["full"] * n_items + ["sink:64"] * n_items
          and all(r["task"] == t and r["length"] == L for r in recs),
          f"{t}: {len(recs)} records (want {2 * n_items}: full, sink:64), every field present" +
          (f" (missing {missing})" if missing else ""))
    bad = []
    for r in recs:
        found = sum(e.lower() in r["answer"].lower() for e in r["expected"])
        score = found / len(r["expected"])
        if r["found"] != found or abs(r["score"] - score) > 1e-6 or r["exact"] != int(found == len(r["expected"])):
            bad.append(f"{r['kv']}: answer {r['answer']!r}, expected {r['expected']}: found {r['found']} score "
                       f"{r['score']} exact {r['exact']} (want {found}, {score:.6g}, {int(found == len(r['expected']))})")
    check(recs and not bad, f"{t}: score and exact as RULER's string match on {len(recs)} records (scores "
          f"{[round(r['score'], 3) for r in recs]}; full's answer {recs[0]['answer'][:60]!r})" +
          (": " + "; ".join(bad[:2]) if bad else ""))
    fit = [r for r in recs if not (L - per_answer[t] - 2 * F <= r["prompt_tokens"] <= L - per_answer[t]
                                   and r["answer_tokens"] <= per_answer[t])]
    check(recs and not fit, f"{t}: prompts of {sorted({r['prompt_tokens'] for r in recs})} tokens fit {L} with "
          f"{per_answer[t]} answer tokens, within {2 * F} of it")
    full = [r for r in recs if r["kv"] == "full"]
    sink = [r for r in recs if r["kv"] == "sink:64"]
    check(full and sink and all(s["kv_peak_live_bytes"] < f["kv_peak_live_bytes"] for f, s in zip(full, sink)) and
          all(r["chat"] for r in recs),
          f"{t}: peak KV bytes full {full[0]['kv_peak_live_bytes'] if full else '?'} > sink:64 "
          f"{sink[0]['kv_peak_live_bytes'] if sink else '?'}; prompts in the chat template")
    if t in ("passkey", "niah_single"):
        ok, why = True, []
        for kv in ("full", "sink:64"):
            d = {r["depth"]: r for r in recs if r["kv"] == kv}
            if 0 not in d or 0.5 not in d: ok = False; continue
            at = math.floor(0.5 * d[0.5]["fillers"] + 0.5)
            got = d[0.5]["needle_pos"] - d[0]["needle_pos"]
            why.append(f"{kv}: {got} tokens (want {at} fillers x {F} = {at * F})")
            ok = ok and got == at * F
        check(ok, f"{t}: the needle at depth 0.5 after the needle at depth 0: " + "; ".join(why))
PY

for sh in turns requests; do
    "$RUN" "$M" -m task -task niah_multikey -questions 3 -shared $sh -c 768 -lengths 768 -depths 0.5 -items 1 \
        -kv full -kv sink:64 -o "$tmp/sh_$sh.jsonl" 2>"$tmp/sh_$sh.err"
    rc=$?
    if [ $rc -eq 0 ]; then echo "PASS -questions 3 -shared $sh: exit 0"; else echo "FAIL -shared $sh: exit $rc: $(tail -n 2 "$tmp/sh_$sh.err")"; fi
done
python3 - "$tmp" <<'PY'
import json, os, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
def load(sh):
    p = os.path.join(tmp, f"sh_{sh}.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
t, q = load("turns"), load("requests")
for name, recs in (("turns", t), ("requests", q)):
    check([(r["kv"], r["question"], r["shared"]) for r in recs] ==
          [(kv, i, name) for kv in ("full", "sink:64") for i in (1, 2, 3)] and
          all(len(r["expected"]) == 1 and r["score"] == float(r["expected"][0] in r["answer"]) for r in recs),
          f"-shared {name}: records of questions 1, 2, 3 per policy, each scored on its one key "
          f"(scores {[r['score'] for r in recs]})")
for kv in ("full", "sink:64"):
    a = [r for r in t if r["kv"] == kv and r["question"] == 1]
    b = [r for r in q if r["kv"] == kv and r["question"] == 1]
    check(a and b and a[0]["answer"] == b[0]["answer"] and a[0]["prompt_tokens"] == b[0]["prompt_tokens"] and
          a[0]["expected"] == b[0]["expected"],
          f"{kv}: question 1 the same prompt ({a[0]['prompt_tokens'] if a else '?'} tokens) and answer under turns and "
          f"requests ({a[0]['answer'][:30] if a else ''!r})")
ft = [r for r in t if r["kv"] == "full"]
fq = [r for r in q if r["kv"] == "full"]
held, per = 0, set()
for r in ft:
    held += r["prompt_tokens"] + r["answer_tokens"]
    per.add(r["kv_live_bytes"] / held)
for r in fq:
    per.add(r["kv_live_bytes"] / (r["prompt_tokens"] + r["answer_tokens"]))
# where each question starts: under turns a later turn starts where the turns and answers before it end; under
# requests every question starts where the context ends
pos, want = [r["question_pos"] for r in ft], []
for i, r in enumerate(ft):
    want.append(ft[0]["question_pos"] if i == 0 else sum(x["prompt_tokens"] + x["answer_tokens"] for x in ft[:i]))
check(len(ft) == 3 and pos == want and len({r["question_pos"] for r in fq}) == 1 and fq[0]["question_pos"] == pos[0],
      f"full: question_pos under turns {pos} (want {want}: each turn after the ones before), under requests "
      f"{[r['question_pos'] for r in fq]} (the context's end)")
check(len(ft) == 3 and len(fq) == 3 and len(per) == 1,
      f"full: live bytes per token {sorted(per)} over turns (every turn kept: {[r['kv_live_bytes'] for r in ft]}) and "
      f"requests (the context and one question: {[r['kv_live_bytes'] for r in fq]})")
PY

# the shared prefill against each policy's own, two items of two tasks, odd chunks
P="-kv full -kv window:64 -kv sink:64 -kv random:64 -kv snapkv:64 -kv snapkv:64,query=agnostic -kv quest:64,prompt=dense
   -kv h2o:64 -kv quest:64 -kv full,type=q8 -kv sink:64,pos=cache"
for t in niah_multikey vt; do
    chunks="7 32" len=320; [ $t = vt ] && chunks=32 len=384   # vt's smallest prompt takes 311 tokens
    for pf in 0 1; do for ch in $chunks; do
        "$RUN" "$M" -m task -task $t -c $len -lengths $len -depths 0.25,0.75 -items 1 $P -prefix $pf -chunk $ch \
            -o "$tmp/pf_${t}_${pf}_$ch.jsonl" 2>"$tmp/pf_${t}_${pf}_$ch.err" ||
            echo "FAIL -m task -task $t -prefix $pf -chunk $ch: $(tail -n 2 "$tmp/pf_${t}_${pf}_$ch.err")"
    done; done
done
python3 - "$tmp" <<'PY'
import json, re, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
keys = ("kv", "depth", "item", "prompt_tokens", "answer_tokens", "answer", "score", "kv_live_bytes", "kv_peak_live_bytes",
        "kv_alloc_bytes")
for t in ("niah_multikey", "vt"):
    chunks = (7, 32) if t == "niah_multikey" else (32,)
    runs = {(pf, ch): sorted(tuple(r[k] for k in keys) for r in map(json.loads, open(f"{tmp}/pf_{t}_{pf}_{ch}.jsonl")))
            for pf in (0, 1) for ch in chunks}
    ref = runs[(0, 32)]
    # (snapkv's peak of live bytes is measured while a chunk passes its compression layer by layer, so it depends
    # on -chunk: runs compare at one chunk size, answers across both)
    check(len(ref) == 22 and all(runs[(1, ch)] == runs[(0, ch)] for ch in chunks)
          and all([r[:6] for r in runs[(0, ch)]] == [r[:6] for r in ref] for ch in chunks),
          f"{t}: 11 policies x 2 items, every answer and byte count the same with the shared prefill (-prefix 1) and "
          f"without, at -chunk {chunks} ({len(ref)} records; answers {sorted({r[5][:12] for r in ref})[:4]}...)")
    moved = [re.search(r"task: (\d+) prompt tokens moved in", open(f"{tmp}/pf_{t}_1_{ch}.err").read()) for ch in chunks]
    n = [int(m.group(1)) if m else 0 for m in moved]
    # per item: window, sink and random take 64 (56 at -chunk 7), full and quest,prompt=dense the prompt less one
    # token, snapkv aware and agnostic all but their window (32) before the prompt's and the context's end: over
    # 2 x (3 x 56 + 4 x 200) here
    check(all(x > 2 * (3 * 56 + 4 * 200) for x in n), f"{t}: the shared prefill moved {n} prompt tokens in")
PY

source tests/lib.sh   # expect_error
expect_error "unknown -task" "unknown -task 'niah'; tasks: passkey, niah_single" -m task -task niah
expect_error "-task without -m task" "-task is not used by -m passkey (it is for task)" -m passkey -task vt
expect_error "-m task without -task" "-m task needs -task NAME" -m task
expect_error "-lengths over -c" "-lengths: 600 tokens is over -c 512" -m task -task vt -c 512 -lengths 256,600
expect_error "-lengths too short" "too short for -task cwe: its smallest prompt takes" -m task -task cwe -c 512 -lengths 100
expect_error "-questions with vt" "-questions asks the keys of niah_multikey's haystack" -m task -task vt -questions 3
expect_error "-shared alone" "-shared requests says how -questions are asked" -m task -task niah_multikey -shared requests
exit 0
