#!/usr/bin/env bash
# snapkv's query=aware|agnostic on SmolLM2 under -m task (policies.c, the snapkv section; task.c, ask_one and ask_shared):
#  - the default is query=aware, bit for bit: the same answers, scores and bytes, and the same evictions (every -kvlog
#    event: step, layer, head, position) as the spec with query=aware written out;
#  - the compression point, read from -kvlog's evict events: aware evicts only at the step of the prompt's last token
#    (prompt_tokens - 1 of the record; for -questions question 1's prompt), agnostic only at the step of the context's
#    last token (question_pos - 1), before any question token; each lane drops exactly the tokens it held there beyond
#    the budget, once (so no later question compresses again), for one question, -shared turns and -shared requests;
#  - -shared requests, aware: question 1's answer is the one -shared turns gives (the same prompt, compressed the same);
#  - bad values: query=foo, query=agnostic outside -m task, query= in ppl: one error line naming the key, exit 1.
# SKIPs without models/smollm2-135m-instruct.bin, and under KVLAB_SANITIZE (minutes under ASan).
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
tmp=tests/tmp/query; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP query= on SmolLM2: $M missing (make model)"; exit 0; fi
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP query= on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL query: python3 is needed to read the records"; exit 0; }
B=96
KV=(-kv snapkv:$B -kv snapkv:$B,query=aware -kv snapkv:$B,query=agnostic)
ask() {   # NAME ARGS...: one -m task run with the three snapkv specs, records and kvlog under $tmp/NAME
    local name=$1; shift
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$RUN" "$M" -m task "$@" -depths 0.5 -items 1 "${KV[@]}" \
        -o "$tmp/$name.jsonl" -kvlog "$tmp/$name.kvlog" 2>"$tmp/$name.err"
    local rc=$?
    if [ $rc -eq 0 ]; then echo "PASS -m task $name: exit 0"; else echo "FAIL -m task $name: exit $rc: $(tail -n 2 "$tmp/$name.err")"; fi
}
ask one -task niah_single -c 384 -lengths 384
ask turns -task niah_multikey -questions 2 -shared turns -c 512 -lengths 512
ask requests -task niah_multikey -questions 2 -shared requests -c 512 -lengths 512
python3 - "$tmp" "$B" <<'PY'
import collections, json, os, sys
tmp, B = sys.argv[1], int(sys.argv[2])
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
def load(name):
    recs = [json.loads(l) for l in open(os.path.join(tmp, name + ".jsonl"))] if os.path.exists(os.path.join(tmp, name + ".jsonl")) else []
    evs = collections.defaultdict(list)
    p = os.path.join(tmp, name + ".kvlog")
    for l in (open(p) if os.path.exists(p) else []):
        e = json.loads(l)
        if e["event"] == "evict": evs[e["kv"]].append((e["step"], e["layer"], e["kv_head"], e["evicted_pos"]))
    return recs, evs
d, a, g = f"snapkv:{B}", f"snapkv:{B},query=aware", f"snapkv:{B},query=agnostic"
one, turns, req = load("one"), load("turns"), load("requests")
answers = {}
for name, (recs, evs) in (("one", one), ("turns", turns), ("requests", req)):
    by = {kv: [r for r in recs if r["kv"] == kv] for kv in (d, a, g)}
    keys = ("answer", "score", "prompt_tokens", "answer_tokens", "kv_live_bytes", "kv_peak_live_bytes")
    same = by[d] and len(by[d]) == len(by[a]) and all(all(x[k] == y[k] for k in keys) for x, y in zip(by[d], by[a]))
    check(same and evs[d] and evs[d] == evs[a],
          f"{name}: the default is query=aware bit for bit: answers {[r['answer'][:12] for r in by[d]]}, bytes, and "
          f"{len(evs[d])} evictions the same (step, layer, head, position)")
    if not by[d] or not by[g]: check(False, f"{name}: records for every spec"); continue
    r1 = by[d][0]
    P, C = r1["prompt_tokens"], r1["question_pos"]   # question 1's prompt (its end), the context (its end)
    for kv, at in ((a, P - 1), (g, C - 1)):
        steps = sorted({e[0] for e in evs[kv]})
        lanes = collections.Counter((e[1], e[2]) for e in evs[kv])
        want = at + 1 - B   # a lane holds at + 1 tokens when the token at `at` has attended: all but B go
        late = [e for e in evs[kv] if e[3] > at]
        check(steps == [at] and lanes and set(lanes.values()) == {want} and not late,
              f"{name}: {kv.split(',')[-1]}: every eviction at step {steps} (want [{at}]: "
              f"{'the prompt' if kv == a else 'the context'}'s last token; question 1 at {C}, prompt {P} tokens), "
              f"{sorted(set(lanes.values()))} per lane (want {want}, once) in {len(lanes)} lanes, none after {at}")
    answers[name] = by[a]
if "turns" in answers and "requests" in answers:
    t1, q1 = answers["turns"][0], answers["requests"][0]
    check(t1["question"] == q1["question"] == 1 and t1["answer"] == q1["answer"] and
          t1["prompt_tokens"] == q1["prompt_tokens"],
          f"aware: question 1 the same answer under turns and requests ({t1['answer'][:30]!r}, {q1['answer'][:30]!r})")
PY

source tests/lib.sh   # expect_error
expect_error "query=foo" "bad query=foo in 'snapkv:64,query=foo': aware" -m task -task vt -kv snapkv:64,query=foo
expect_error "query=agnostic in generate" "query=agnostic compresses at the end of the shared context, which only -m task knows" \
    -m generate -i hello -n 2 -kv snapkv:64,query=agnostic
expect_error "query= in ppl" "query= has no meaning in ppl mode" -m ppl -kv snapkv:64,prefill=128,query=aware
exit 0
