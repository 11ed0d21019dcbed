#!/usr/bin/env bash
# duo's lane choice end to end on SmolLM2 (policies.c duo, eval.c eval_calib): calibrate duo:64,full=0.25 on the
# first 1,500 bytes of the Debian Reference (406 tokens; -c 256, so 256 positions are read) and check, against an
# independent route, that its full lanes are the lowest-recall ones: a plain `-m ppl -kv sink:64` over the same text
# and positions gives each lane's recall (-o recall_per_lane); here Python ranks those lanes (lowest first, ties to
# the lower lane) and takes the nearest integer to 0.25 · 90 (22.5, halves up: 23). The calibration's own per-lane
# recall must be the same numbers (the same positions and shadow: the streaming form is sink:64, sinks=4). Then the
# duo cache's resident bytes against the ragged caps computed here (23 lanes of 256 slots, 67 of 64, 524 B per f32
# slot), and its full lanes' recall on another part of the text (every token held: 1 up to f32 rounding).
# About 20 s on 2 cores. SKIPs without the model or the Debian Reference, and under KVLAB_SANITIZE.
set -u
cd "$(dirname "$0")/.."
RUN=${KVLAB_RUN:-./run}
M=models/smollm2-135m-instruct.bin
TEXT=/usr/share/debian-reference/debian-reference.en.txt.gz
tmp=tests/tmp/smol_duo; rm -rf "$tmp"; mkdir -p "$tmp"
if [ -n "${KVLAB_SANITIZE:-}" ]; then echo "SKIP duo on SmolLM2 under the sanitizer build (KVLAB_SANITIZE)"; exit 0; fi
if [ ! -f "$M" ] || [ ! -f "$TEXT" ]; then
    echo "SKIP duo on SmolLM2: $M or $TEXT missing (make model; apt-get install debian-reference-en)"; exit 0
fi
zcat "$TEXT" | head -c 1500 >"$tmp/calib.txt"
zcat "$TEXT" | head -c 40000 | tail -c 2000 >"$tmp/eval.txt"
"$RUN" "$M" -m ppl -f "$tmp/calib.txt" -c 256 -n 256 -chunk 64 -kv sink:64 -o "$tmp/sink.jsonl" 2>"$tmp/err_sink"
rc1=$?
"$RUN" "$M" -m ppl -f "$tmp/eval.txt" -c 256 -n 160 -chunk 64 -kv duo:64,full=0.25 -calib "$tmp/calib.txt" \
    -o "$tmp/duo.jsonl" 2>"$tmp/err_duo"
rc2=$?
if [ $rc1 -ne 0 ] || [ $rc2 -ne 0 ]; then
    echo "FAIL duo on SmolLM2: exit $rc1, $rc2: $(tail -3 "$tmp/err_sink" "$tmp/err_duo")"; exit 0
fi
python3 - "$tmp/sink.jsonl" "$tmp/duo.jsonl" "$tmp/err_duo" <<'EOF'
import json, math, sys
sink = [json.loads(l) for l in open(sys.argv[1]) if '"kv":"sink:64"' in l][0]
recs = [json.loads(l) for l in open(sys.argv[2])]
cal = [r for r in recs if r["mode"] == "duo_calib"][0]
ppl = [r for r in recs if r["mode"] == "ppl" and r["kv"] == "duo:64,full=0.25"][0]
err = open(sys.argv[3]).read()
def check(ok, msg):
    print(("PASS " if ok else "FAIL ") + msg)
G, L = 3, 30
rec = sink["recall_per_lane"]
n_lanes = len(rec)
check(n_lanes == L * G and sink["span_tokens"] == 256 and cal["tokens"] == 256 and cal["lanes"] == n_lanes,
      f"sink:64 over the calibration text: {n_lanes} lanes, {sink['span_tokens']} positions; the calibration read "
      f"{cal['tokens']} of its {cal['calib_tokens']} tokens")
check(cal["recall_per_lane"] == rec, "the calibration's per-lane recall is sink:64's over the same 256 positions "
      f"(all {n_lanes} equal; lowest {min(rec):.4f}, highest {max(rec):.4f})")
n = math.floor(0.25 * n_lanes + 0.5)
order = sorted(range(n_lanes), key=lambda i: (rec[i], i))
want = sorted(order[:n])
got = sorted(l * G + g for l, g in cal["full_lanes"])
check(got == want, f"duo:64,full=0.25 keeps full the {n} lanes of lowest sink:64 recall, ranked here: "
      f"{[f'{i // G}.{i % G}' for i in want]} (got {[f'{i // G}.{i % G}' for i in got]})")
mf = sum(rec[i] for i in want) / n
mr = sum(rec[i] for i in range(n_lanes) if i not in want) / (n_lanes - n)
check(abs(cal["full_recall"] - mf) <= 1e-8 * mf and abs(cal["streaming_recall"] - mr) <= 1e-8 * mr and mf < mr,
      f"mean recall of the chosen lanes {cal['full_recall']:.6f} (here {mf:.6f}) below the others' "
      f"{cal['streaming_recall']:.6f} ({mr:.6f})")
lines = [l for l in err.splitlines() if l.startswith("calib:   ")]
shown = [tuple(int(x) for x in tok.split(".")) for l in lines for tok in l.split()[1::2]]
check([l * G + g for l, g in shown] == order[:n],
      f"stderr lists the {len(shown)} chosen lanes as layer.kvhead, lowest recall first")
# resident bytes from the ragged caps: per f32 slot a key and a value (2 x 64 x 4 B), an int32 position and two
# index-list ints
per_slot = 2 * 64 * 4 + 4 + 2 * 4
want_bytes = (n * 256 + (n_lanes - n) * 64) * per_slot
check(ppl["kv_alloc_bytes"] == want_bytes, f"duo's resident bytes {ppl['kv_alloc_bytes']} = ({n} x 256 + "
      f"{n_lanes - n} x 64) slots x {per_slot} B = {want_bytes}")
full_rec = [ppl["recall_per_lane"][i] for i in want]
check(all(abs(r - 1) <= 1e-5 for r in full_rec) and ppl["kl"] > 0, f"on the evaluation text (160 positions, past "
      f"the budget) the full lanes hold all of the shadow's attention (recall {min(full_rec):.7f} .. "
      f"{max(full_rec):.7f}, 1 within f32 rounding) while the streaming lanes evict (KL {ppl['kl']:.4g} > 0)")
EOF
exit 0
