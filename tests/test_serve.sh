#!/usr/bin/env bash
# -m serve on SmolLM2 (serve.c; the pool alone is tests/test_pool.c, pool caches against single-run caches
# tests/test_kv_pool.c):
#  - outputs do not depend on the schedule: each request's greedy ids are the same with -max-seqs 1 (every request
#    alone in its cache), -max-seqs 16 (batched), -prefix 0 (no prefix caching) and a pool of 15% of the demand (with
#    preemptions, which must happen), for full, sink in q8 and h2o with alloc=ada (a layer's heads sharing its pages);
#  - prefix caching on a scripted trace: three identical prompts arriving one after another, so the 2nd and 3rd find
#    the 1st's pages: hit rate = 2 * 16 * floor((n - 1) / 16) / (3 n) for a prompt of n tokens, by hand from the
#    records' prompt_tokens; the hit tokens per request are 0, then that block count; the ids equal -prefix 0's;
#  - the shadow pass: full scores KL 0 / top-1 1 against itself; -shadow 2's replay of each request alone gives the
#    served logits bit for bit; a request's figures are the same served with others as alone (the pass's shared
#    prefix changes nothing);
#  - a multi-turn request whose next turn does not fit -c is cut there and -shadow scores what was served; requests
#    over -c fail, each with a "failed":true record;
#  - a soak: 1,000 generated requests (random pattern, 1 to 16 document tokens, 1 token each) through a pool of 10%,
#    under full and under an adapt: chain that switches to q8 and h2o:16,
#    with -max-seqs 32: every request finishes, no failure; serve checks the pool's invariants after every step
#    (kv_pool_check, the lanes' page references = the pool's) and that no page is held at the end, and exits with an
#    error otherwise. Under KVLAB_SANITIZE (ASan + UBSan) the same 1,000 requests on a tiny random model with
#    SmolLM2's tokenizer (export --random --vocab-from);
#  - adapt: two chains on a short pool (thresholds; shrinking instead of preempting): switches logged per request and
#    counted per run, each at or above its threshold, -shadow 2's replay of each request's switches reproduces its
#    served logits, unswitched requests have KL 0, fewer preemptions than full on the same pool;
#  - bad input: no source of requests, two sources, -pattern with -trace, a bad -pool, a bad trace line, a spec the
#    pool cannot page, bad adapt: chains: one error line and a non-zero exit.
# SKIPs without models/smollm2-135m-instruct.bin.
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
tmp=tests/tmp/serve; rm -rf "$tmp"; mkdir -p "$tmp"
if [ ! -f "$M" ]; then echo "SKIP serve on SmolLM2: $M missing (make model)"; exit 0; fi
command -v python3 >/dev/null || { echo "FAIL serve: python3 is needed to read the records"; exit 0; }
L=/usr/share/common-licenses
DOCS="-docs $L/GPL-3 -docs $L/Apache-2.0 -docs $L/Artistic -docs $L/BSD"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; }

if [ -z "${KVLAB_SANITIZE:-}" ]; then
    A="$DOCS -requests 10 -lengths 64,200 -n 48 -pattern hotspot -arrival 1 -kv full -kv sink:32,type=q8 -kv h2o:48,alloc=ada"
    i=0
    for cfg in "-max-seqs 16" "-max-seqs 1" "-prefix 0" "-pool 15%"; do
        i=$((i + 1))
        "$RUN" "$M" -m serve $A $cfg -o "$tmp/sched$i.jsonl" 2>"$tmp/sched$i.err"
        rc=$?
        [ $rc -eq 0 ] || fail "serve $cfg: exit $rc: $(tail -n 2 "$tmp/sched$i.err")"
    done
    python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
cfgs = ["-max-seqs 16", "-max-seqs 1", "-prefix 0", "-pool 15%"]
recs = [[json.loads(l) for l in open(f"{tmp}/sched{i + 1}.jsonl")] for i in range(4)]
for kv in ["full", "sink:32,type=q8", "h2o:48,alloc=ada"]:
    ids = [{r["id"]: r["ids"] for r in rs if r["kind"] == "request" and r["kv"] == kv} for rs in recs]
    same = all(x == ids[0] for x in ids) and len(ids[0]) == 10
    check(same, f"serve {kv}: the 10 requests' greedy ids are the same under {', '.join(cfgs)}")
runs = {r["kv"]: r for r in recs[3] if r["kind"] == "run"}
check(runs["full"]["preemptions"] > 0, f"the 15% pool preempted under full ({runs['full']['preemptions']} times) "
      "and the outputs above did not change")
full = [r for r in recs[0] if r["kind"] == "run" and r["kv"] == "full"][0]
check(full["hit_rate"] > 0 and [r for r in recs[2] if r["kind"] == "run" and r["kv"] == "full"][0]["hit_rate"] == 0,
      f"hotspot requests share prefixes: hit rate {full['hit_rate']:.3f} with prefix caching, 0 with -prefix 0")
fields = ["throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_ms", "tpot_p95_ms", "queue_p95_s", "occupancy_mean",
          "occupancy_peak", "steps_at_80", "steps_at_99", "mb_per_token", "occupancy", "preemptions", "hit_rate"]
check(all(f in full for f in fields) and len(full["occupancy"]) == full["steps"],
      "a run record has " + ", ".join(fields) + "; the occupancy curve one value per step")
PY

    # prefix caching, scripted: one prompt three times, each after the previous has finished
    for a in 0 400 800; do
        echo "{\"arrival\":$a,\"doc\":\"$L/BSD\",\"prompt\":\"Summarize the licence above in one sentence.\",\"n\":4}"
    done >"$tmp/trace.jsonl"
    for p in 1 0; do
        "$RUN" "$M" -m serve -trace "$tmp/trace.jsonl" -prefix $p -o "$tmp/prefix$p.jsonl" 2>"$tmp/prefix$p.err" ||
            fail "serve -trace -prefix $p: $(tail -n 2 "$tmp/prefix$p.err")"
    done
    python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
r1 = [json.loads(l) for l in open(f"{tmp}/prefix1.jsonl")]
r0 = [json.loads(l) for l in open(f"{tmp}/prefix0.jsonl")]
req = sorted([r for r in r1 if r["kind"] == "request"], key=lambda r: r["id"])
run = [r for r in r1 if r["kind"] == "run"][0]
n = req[0]["prompt_tokens"]
blocks = 16 * ((n - 1) // 16)
want = 2 * blocks / (3 * n)
check([r["hit_tokens"] for r in req] == [0, blocks, blocks] and abs(run["hit_rate"] - want) < 1e-6,
      f"three identical prompts of {n} tokens one after another: hit tokens {[r['hit_tokens'] for r in req]} "
      f"(want 0, {blocks}, {blocks}), hit rate {run['hit_rate']:.6f} = 2*{blocks}/(3*{n}) = {want:.6f}")
ids0 = {r["id"]: r["ids"] for r in r0 if r["kind"] == "request"}
check({r["id"]: r["ids"] for r in req} == ids0 and len(set(str(r["ids"]) for r in req)) == 1,
      "the cached and uncached runs give the same ids, and the three requests the same answer")
PY
    # the shadow pass: served logits against full fed the served tokens. full scores KL 0 and top-1 1 against itself;
    # -shadow 2's replay of each request alone gives the served logits bit for bit; and a request's figures do not
    # depend on the other requests (the pass reuses the prefix two requests share, which must change no bit): three
    # requests over one document at two lengths and two questions, together and each alone
    q1="Summarize the licence above in one sentence." q2="Who wrote this licence?"
    { echo "{\"arrival\":0,\"doc\":\"$L/Apache-2.0\",\"doc_tokens\":200,\"prompt\":\"$q1\",\"n\":12}"
      echo "{\"arrival\":0,\"doc\":\"$L/Apache-2.0\",\"doc_tokens\":200,\"prompt\":\"$q2\",\"n\":12}"
      echo "{\"arrival\":1,\"doc\":\"$L/Apache-2.0\",\"doc_tokens\":120,\"prompt\":\"$q1\",\"n\":12}"; } >"$tmp/sh.jsonl"
    SK="-kv full -kv h2o:48 -kv sink:32,type=q8"
    "$RUN" "$M" -m serve -trace "$tmp/sh.jsonl" $SK -shadow 2 -o "$tmp/sh.out" 2>"$tmp/sh.err" ||
        fail "serve -shadow 2: $(tail -n 2 "$tmp/sh.err")"
    for k in 1 2 3; do
        sed -n "${k}p" "$tmp/sh.jsonl" | sed 's/"arrival":[0-9]*/"arrival":0/' >"$tmp/sh$k.jsonl"
        "$RUN" "$M" -m serve -trace "$tmp/sh$k.jsonl" $SK -shadow 1 -o "$tmp/sh$k.out" 2>>"$tmp/sh.err" ||
            fail "serve -shadow 1, request $k alone: $(tail -n 2 "$tmp/sh.err")"
    done
    python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
req = lambda f: [r for r in map(json.loads, open(f)) if r["kind"] == "request"]
both = req(f"{tmp}/sh.out")
check(len(both) == 9 and all(r["kl"] == 0 and r["top1"] == 1 for r in both if r["kv"] == "full")
      and all(r["kl"] > 0 for r in both if r["kv"] != "full"),
      "-shadow: full against its own shadow has KL 0 and top-1 1 on every request; h2o:48 and sink:32,type=q8 KL > 0")
runs = [r for r in map(json.loads, open(f"{tmp}/sh.out")) if r["kind"] == "run"]
check(len(runs) == 3 and all(r["shadow_differs"] == 0 and r["shadow_positions"] ==
                             sum(x["shadow_positions"] for x in both if x["kv"] == r["kv"]) for r in runs),
      "-shadow 2: each run record sums its requests' replayed positions, none differing")
check(all(r["shadow_differs"] == 0 and r["shadow_positions"] == r["out_tokens"] + (r["out_tokens"] < 12) for r in both),
      "-shadow 2: each request replayed alone through its policy gives the served logits bit for bit at every "
      "sampled position (one per answer token, and the end-of-turn one when it stopped early)")
alone = {(r["kv"], k): r for k in (1, 2, 3) for r in req(f"{tmp}/sh{k}.out")}
same = all((r["kl"], r["top1"], r["ids"]) == (alone[(r["kv"], r["id"] + 1)]["kl"], alone[(r["kv"], r["id"] + 1)]["top1"],
                                             alone[(r["kv"], r["id"] + 1)]["ids"]) for r in both)
check(same, "each request's KL, top-1 and ids are the same served with the others as alone (the shadow's shared "
      "prefix changes no bit)")
PY
    # a request whose next turn does not fit -c ends there, and the shadow pass scores what was served; requests
    # larger than -c fail with a record each
    printf '{"arrival":0,"turns":["Hi","%s"],"n":4}\n' "$(printf 'x %.0s' $(seq 300))" >"$tmp/cut.jsonl"
    "$RUN" "$M" -m serve -trace "$tmp/cut.jsonl" -c 128 -shadow 1 -o "$tmp/cut.out" 2>"$tmp/cut.err"; rc=$?
    if [ $rc -eq 0 ] && grep -q '"cut":true' "$tmp/cut.out" && grep -q '"kl":' "$tmp/cut.out"; then
        pass "a second turn over -c 128 cuts the request (\"cut\":true) and -shadow scores what was served"
    else fail "cut request under -shadow: rc $rc, $(tail -1 "$tmp/cut.err")"; fi
    "$RUN" "$M" -m serve -docs $L/BSD -requests 3 -lengths 16,200 -n 4 -c 64 -o "$tmp/fail.out" 2>"$tmp/fail.err"; rc=$?
    nf=$(grep -c '"failed":true' "$tmp/fail.out")
    if [ $rc -eq 0 ] && [ "$nf" -eq 3 ] && [ "$(grep -c 'over the' "$tmp/fail.err")" -eq 3 ]; then
        pass "3 requests over -c 64 fail, each said on stderr and recorded with \"failed\":true"
    else fail "requests over -c: rc $rc, $nf failed records, $(tail -1 "$tmp/fail.err")"; fi
    # adapt: chains switch running sequences at occupancy thresholds and, on a short pool, shrink one before any
    # preemption; -shadow 2 replays each request's switches, so its policy cache's logits are the served ones at
    # every sampled position (shadow_differs 0), which checks the move and the log against each other
    B="$DOCS -requests 8 -lengths 64,240 -n 16 -pattern hotspot -arrival 0.2 -prefix 0 -pool 20%"
    "$RUN" "$M" -m serve $B -kv adapt:full@0/q8@60/h2o:64@85 -kv adapt:full@0/h2o:48@100 -shadow 2 \
        -o "$tmp/adapt.jsonl" 2>"$tmp/adapt.err" && "$RUN" "$M" -m serve $B -kv full -o "$tmp/adapt_full.jsonl" \
        2>>"$tmp/adapt.err"
    rc=$?
    [ $rc -eq 0 ] || fail "serve adapt: exit $rc: $(tail -n 2 "$tmp/adapt.err")"
    python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def check(ok, msg): print(("PASS " if ok else "FAIL ") + msg)
recs = [json.loads(l) for l in open(f"{tmp}/adapt.jsonl")] + [json.loads(l) for l in open(f"{tmp}/adapt_full.jsonl")]
run = {r["kv"]: r for r in recs if r["kind"] == "run"}
req = lambda kv: [r for r in recs if r["kind"] == "request" and r["kv"] == kv]
a, b = "adapt:full@0/q8@60/h2o:64@85", "adapt:full@0/h2o:48@100"
ra = req(a)
sw = sum(len(r["switches"]) for r in ra)
check(run[a]["finished"] == 8 and sw > 0 and sw == sum(run[a]["switches_to"].values()),
      f"{a}: 8 requests finish, {sw} switches logged in the requests, as many as the run counts ({run[a]['switches_to']})")
check(all(r["shadow_differs"] == 0 for r in ra + req(b)),
      "each request's replay follows its switches: the policy's logits are the served ones, bit for bit, at every "
      "sampled position")
unswitched = [r for r in ra + req(b) if not r["switches"] and r["member"] == "full"]
check(len(unswitched) > 0 and all(r["kl"] == 0 for r in unswitched) and all(r["kl"] > 0 for r in ra if r["switches"]),
      f"requests that stayed in full ({len(unswitched)}) have KL 0 to the full shadow (full is held as h2o with the "
      "context for budget, which never evicts); every switched one has KL > 0")
tos = [s["to"] for r in ra for s in r["switches"]]
check(all(s["occupancy"] >= {"full,type=q8": 0.6, "h2o:64,type=q8": 0.85}[s["to"]] for r in ra for s in r["switches"]
          if not s["pool_short"]), "each threshold switch happened at or above its member's occupancy")
check(run[b]["switches_on_short_pool"] > 0 and run[b]["preemptions"] < run["full"]["preemptions"],
      f"{b}: the short pool shrinks sequences ({run[b]['switches_on_short_pool']} switches) instead of preempting: "
      f"{run[b]['preemptions']} preemptions against full's {run['full']['preemptions']} on the same pool")
PY
    NSOAK=1000 POOL=10% SOAK_M=$M
else
    # SmolLM2 serves about 0.2 requests a second under ASan here: the sanitizers' soak runs on a tiny random model
    # that reads text through SmolLM2's tokenizer (export --random --vocab-from; the soak's subject is the pool, not
    # the weights), 1,000 requests as in the normal build (about 4 minutes)
    G=.cache/SmolLM2-135M-Instruct.Q4_1.gguf SOAK_M=$tmp/tiny.bin
    if [ -f "$G" ] && "${KVLAB_EXPORT:-./export}" --random "$SOAK_M" --dim 64 --hidden 128 --layers 2 --heads 4 \
        --kv-heads 2 --vocab 49152 --seq 2048 --seed 7 --tied --vocab-from "$G" 2>"$tmp/tiny.err"; then
        NSOAK=1000 POOL=10%
    else
        echo "SKIP the sanitizers' 1,000-request soak: no tiny model ($G missing or export failed: $(tail -1 "$tmp/tiny.err" 2>/dev/null)); 12 requests on SmolLM2"
        NSOAK=12 POOL=30% SOAK_M=$M
    fi
fi

# the soak: serve exits non-zero if an invariant breaks or a page is left held
"$RUN" "$SOAK_M" -m serve -docs $L/GPL-3 -docs $L/Apache-2.0 -docs $L/BSD -docs $L/MPL-2.0 -requests $NSOAK \
    -lengths 1,16 -n 1 -pattern random -arrival 0.3 -pool $POOL -max-seqs 32 -s 3 -kv full -kv adapt:full@0/q8@40/h2o:16@70 \
    -o "$tmp/soak.jsonl" 2>"$tmp/soak.err"
rc=$?
for k in 0 1; do
    done_n=$(python3 -c "import json,sys; r=[json.loads(l) for l in open('$tmp/soak.jsonl') if '\"run\"' in l][$k]; print(r['finished'], r['failed'], r['preemptions'], r['steps'], sum(r.get('switches_to', {}).values()), r['kv'])" 2>/dev/null)
    if [ $rc -eq 0 ] && [ "$(echo "$done_n" | cut -d' ' -f1-2)" = "$NSOAK 0" ]; then
        pass "soak ($(basename "$SOAK_M")): $NSOAK random requests through a $POOL pool finish with the pool's invariants checked every step and no page held at the end (finished, failed, preemptions, steps, switches, spec: $done_n)"
    else fail "soak: exit $rc, $done_n: $(tail -n 2 "$tmp/soak.err")"; fi
done

# bad input: one error line, non-zero exit
echo '{"arrival":0,"prompt":"x","bogus":1}' >"$tmp/bad.jsonl"
while IFS='|' read -r args want; do
    out=$("$RUN" "$M" -m serve $args 2>&1 >/dev/null); rc=$?
    if [ $rc -ne 0 ] && echo "$out" | grep -q -- "$want"; then pass "serve $args: refused ($want)"
    else fail "serve $args: rc $rc, '$out' (want '$want')"; fi
done <<EOF
|-m serve needs requests
-trace $tmp/bad.jsonl -docs $L/BSD|one source of requests
-trace $tmp/bad.jsonl -pattern random|shape a generated trace
-docs $L/BSD -pool 12parsecs|bad -pool
-docs $L/BSD -pool 0%|bad -pool
-trace $tmp/bad.jsonl|bogus
-docs $L/BSD -requests 2 -kv full,prec=f32:16/q8|not paged yet
-docs $L/nonexistent|nonexistent
-docs $L/BSD -kv adapt:full@10/q8@80|first member holds from occupancy 0
-docs $L/BSD -kv adapt:full@0/q8@80/q4@70|must increase
-docs $L/BSD -kv adapt:full@0/q8|SPEC@OCCUPANCY
-docs $L/BSD -kv adapt:full@0/tova:64@50/h2o:64@80|one policy
-docs $L/BSD -kv adapt:full@0/snapkv:64@50|keep score
-docs $L/BSD -kv adapt:full@0/h2o:64,merge=1@50|merge=
EOF
out=$("$RUN" "$M" -m ppl -f LICENSE -kv adapt 2>&1 >/dev/null); rc=$?
if [ $rc -ne 0 ] && echo "$out" | grep -q -- "-m serve only"; then pass "-m ppl -kv adapt: refused (adapt: follows a serving pool)"
else fail "-m ppl -kv adapt: rc $rc, '$out'"; fi
