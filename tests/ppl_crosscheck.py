#!/usr/bin/env python3
"""Every figure of a `./run -m ppl` run's -o records recomputed from its -tokenlog, and its stderr table read back
against -o. Written from README.md's field list and docs/DESIGN.md's definitions, not from eval.c:

  span (per policy): the tokens at positions < ctx (each document's own positions) that the policy scored
  span_tokens, span_nll = mean NLL over the span, span_ppl = exp(span_nll)
  all_tokens, all_nll, all_ppl: the same over every token the policy scored (nll not null)
  kl, top1, recall: means of the per-token kl, top1, recall over the span
  dp   = mean over the span of exp(-nll_policy) - exp(-nll_shadow)   (p_policy(y) - p_shadow(y))
  dnll = mean over the span of nll_policy - nll_shadow
  scored_tokens: tokenlog lines; documents: distinct docs
  recall = the mean of recall_per_layer (the same mean taken the other way round)
  recall_per_layer[l] = the mean of recall_per_lane over layer l's kv heads (lane l * n_kv_heads + g, printed %.17g)
  bucket_n[b], bucket_nll[b], bucket_ppl[b] (bucket_tokens W): count, mean NLL and exp(mean) of the tokens the policy
      scored at tokenlog positions pos with pos // W == b, over every document; null where it scored none there;
      as many buckets as the last one any policy scored in; the stderr table "perplexity by position", when printed,
      gives bucket_ppl with 4 decimals ("-" for null)

Tolerances, derived from the printing: -o and -tokenlog print %.9g, whose rounding is at most half a unit in the 9th
significant digit, 5e-9 relative. A mean of printed values is off by at most 5e-9 * mean|x|; dp and dnll take two
printed NLLs per token, each derivative at most 1 in size, so 5e-9 * mean(|nll_p| + |nll_s|); exp(mean) has that
bound relative; the -o value adds its own 5e-9 * |value|; summing in double adds N * 2.2e-16 relative, 1e-12 at
most here. The table prints fixed decimals: half a unit of the last printed decimal, plus the -o rounding.

Usage: ppl_crosscheck.py OUT.jsonl TOKENLOG.jsonl TABLE.txt [--nonzero-kl KV]... [--zero-kl KV]...
Prints PASS/FAIL lines (tests/run.sh counts them).
"""
import json
import math
import sys

R9 = 5e-9       # relative rounding of %.9g
SUM = 1e-12     # double summation, relative


def main():
    args = sys.argv[1:]
    if len(args) < 3:
        sys.exit(__doc__)
    out_path, log_path, table_path = args[:3]
    nonzero, zero = [], []
    rest = args[3:]
    while rest:
        flag, kv = rest[0], rest[1]
        (nonzero if flag == "--nonzero-kl" else zero).append(kv)
        rest = rest[2:]
    recs = [json.loads(l) for l in open(out_path) if l.strip()]
    recs = [r for r in recs if r.get("mode") == "ppl"]
    lines = [json.loads(l) for l in open(log_path) if l.strip()]
    failures = 0

    def check(ok, msg):
        nonlocal failures
        print(("PASS " if ok else "FAIL ") + msg)
        failures += not ok

    if not recs or not lines:
        check(False, f"ppl cross-check: {len(recs)} -o records, {len(lines)} tokenlog lines")
        return 1
    ctx = recs[0]["ctx"]
    docs = {l["doc"] for l in lines}
    # per policy, in the order of the tokenlog: lists of (nll, nll_shadow, entry, in_span)
    per = {}
    for l in lines:
        pols = l["policies"]
        shadow = pols[0]
        if shadow["kv"] != "shadow":
            check(False, f"tokenlog line doc {l['doc']} pos {l['pos']}: the first policy is {shadow['kv']}, not the shadow")
            return 1
        for p in pols:
            per.setdefault(p["kv"], []).append((p["nll"], shadow["nll"], p, l["pos"] < ctx, l["pos"]))

    def fields_ok(kv, rows):
        # a policy's entry has kl/top1/recall exactly inside the span, and the shadow scores every span token
        bad = 0
        for nll, snll, p, in_span, _ in rows:
            has = "kl" in p and "top1" in p and "recall" in p
            if kv == "shadow":
                bad += has or (in_span and nll is None)
            else:
                bad += has != (in_span and nll is not None) or (has and snll is None)
        return bad

    for r in recs:
        kv = r["kv"]
        rows = per.get(kv)
        if rows is None:
            check(False, f"-o record '{kv}' has no tokenlog entries")
            continue
        bad = fields_ok(kv, rows)
        check(bad == 0, f"{kv}: tokenlog has kl, top1, recall exactly on its span tokens ({bad} lines otherwise)")
        span = [x for x in rows if x[3] and x[0] is not None]
        scored = [x for x in rows if x[0] is not None]
        errs = []   # (name, |error|, tolerance)

        def mean_check(name, values, mags, o_value, exp_of=False):
            n = len(values)
            m = sum(values) / n if n else 0.0
            bound = R9 * (sum(mags) / n if n else 0.0) + SUM * abs(m)
            if exp_of:
                m, bound = math.exp(m), math.exp(m) * bound
            tol = bound + R9 * abs(o_value) + 1e-300
            errs.append((name, abs(m - o_value), tol, m, o_value))

        counts_ok = (r["span_tokens"] == len(span) and r["all_tokens"] == len(scored) and
                     r["scored_tokens"] == len(lines) and r["documents"] == len(docs))
        check(counts_ok, f"{kv}: span_tokens {r['span_tokens']} (tokenlog {len(span)}), all_tokens {r['all_tokens']} "
              f"({len(scored)}), scored_tokens {r['scored_tokens']} ({len(lines)}), documents {r['documents']} ({len(docs)})")
        if not span:
            continue
        nll = [x[0] for x in span]
        mean_check("span_nll", nll, [abs(v) for v in nll], r["span_nll"])
        mean_check("span_ppl", nll, [abs(v) for v in nll], r["span_ppl"], exp_of=True)
        alln = [x[0] for x in scored]
        mean_check("all_nll", alln, [abs(v) for v in alln], r["all_nll"])
        mean_check("all_ppl", alln, [abs(v) for v in alln], r["all_ppl"], exp_of=True)
        if kv != "shadow":
            kl = [x[2]["kl"] for x in span]
            mean_check("kl", kl, [abs(v) for v in kl], r["kl"])
            mean_check("top1", [x[2]["top1"] for x in span], [0.0] * len(span), r["top1"])
            rc = [x[2]["recall"] for x in span]
            mean_check("recall", rc, [abs(v) for v in rc], r["recall"])
            mean_check("dp", [math.exp(-p) - math.exp(-s) for p, s, *_ in span],
                       [abs(p) + abs(s) for p, s, *_ in span], r["dp"])
            mean_check("dnll", [p - s for p, s, *_ in span], [abs(p) + abs(s) for p, s, *_ in span], r["dnll"])
            layers = r["recall_per_layer"]
            # recall_per_layer prints %.6g: each value is off by at most half a unit of its 6th significant digit
            lm = sum(layers) / len(layers)
            half6 = sum(0.5 * 10 ** (math.floor(math.log10(abs(v))) - 5) if v else 0.0 for v in layers) / len(layers)
            errs.append(("mean(recall_per_layer)", abs(lm - r["recall"]), half6 + R9 * r["recall"] + SUM, lm,
                         r["recall"]))
            lanes = r["recall_per_lane"]
            g = len(lanes) // len(layers)
            if g * len(layers) != len(lanes) or g < 1:
                errs.append((f"recall_per_lane has {len(lanes)} lanes for {len(layers)} layers", 1.0, 0.0, 0.0, 0.0))
            for l, v in enumerate(layers if g * len(layers) == len(lanes) else []):
                m = sum(lanes[l * g:(l + 1) * g]) / g
                half = 0.5 * 10 ** (math.floor(math.log10(abs(v))) - 5) if v else 0.0
                errs.append((f"mean(recall_per_lane of layer {l})", abs(m - v), half + SUM, m, v))
        worst = max(errs, key=lambda e: e[1] / e[2])
        ok = all(e[1] <= e[2] for e in errs)
        detail = "; ".join(f"{e[0]} {e[4]:.9g} vs {e[3]:.9g}" for e in errs if not e[1] <= e[2])
        check(ok, f"{kv}: -o span_nll, span_ppl, all_nll, all_ppl" + (", kl, top1, recall, dp, dnll" if kv != "shadow" else "")
              + ", recall_per_layer = the lanes' means" * (kv != "shadow")
              + f" = the tokenlog's means over {len(span)} span / {len(scored)} scored tokens (worst: {worst[0]} "
              f"|err| {worst[1]:.2g}, tolerance {worst[2]:.2g})" + (f": {detail}" if detail else ""))

    # the decay curve: per policy, its scored tokens grouped by position bucket
    n_out = 0
    for r in recs:
        if "bucket_tokens" in r:
            w = r["bucket_tokens"]
            n_out = max([n_out] + [x[4] // w + 1 for x in per.get(r["kv"], []) if x[0] is not None])
    n_bucket_recs = 0
    for r in recs:
        if "bucket_tokens" not in r or r["kv"] not in per:
            continue
        n_bucket_recs += 1
        w, kv = r["bucket_tokens"], r["kv"]
        groups = [[] for _ in range(n_out)]
        for x in per[kv]:
            if x[0] is not None:
                groups[x[4] // w].append(x[0])
        bad = []
        if not (len(r["bucket_n"]) == len(r["bucket_nll"]) == len(r["bucket_ppl"]) == n_out):
            bad.append(f"{len(r['bucket_n'])} buckets, the tokenlog's positions span {n_out}")
        for b, g in enumerate(groups[:len(r["bucket_n"])]):
            if r["bucket_n"][b] != len(g):
                bad.append(f"bucket {b}: n {r['bucket_n'][b]} vs {len(g)}")
            elif not g:
                if r["bucket_nll"][b] is not None or r["bucket_ppl"][b] is not None:
                    bad.append(f"bucket {b}: empty but not null")
            else:
                m = sum(g) / len(g)
                bound = R9 * sum(abs(v) for v in g) / len(g) + SUM * abs(m)
                if abs(m - r["bucket_nll"][b]) > bound + R9 * abs(r["bucket_nll"][b]) + 1e-300:
                    bad.append(f"bucket {b}: nll {r['bucket_nll'][b]:.9g} vs {m:.9g}")
                e = math.exp(m)
                if abs(e - r["bucket_ppl"][b]) > e * bound + R9 * r["bucket_ppl"][b]:
                    bad.append(f"bucket {b}: ppl {r['bucket_ppl'][b]:.9g} vs {e:.9g}")
        check(not bad, f"{kv}: bucket_n, bucket_nll, bucket_ppl ({n_out} buckets of {w}) = the tokenlog's counts and "
              f"means by position" + (": " + "; ".join(bad[:4]) if bad else ""))
    # the stderr decay table, when printed: its columns in -o's record order, 4 decimals
    text = open(table_path, encoding="utf-8", errors="replace").read().splitlines()
    if n_bucket_recs and any(l.startswith("perplexity by position") for l in text):
        i = next(i for i, l in enumerate(text) if l.startswith("perplexity by position")) + 2
        bad, n_cmp = [], 0
        for b in range(n_out):
            f = text[i + b].split() if i + b < len(text) else []
            w = recs[0]["bucket_tokens"]
            if not f or f[0] != f"{b * w}-{(b + 1) * w - 1}" or len(f) != len(recs) + 1:
                bad.append(f"row {b}: '{' '.join(f)}'")
                continue
            for k, r in enumerate(recs):
                want = r["bucket_ppl"][b]
                if (f[k + 1] == "-") != (want is None):
                    bad.append(f"row {b} {r['kv']}: {f[k + 1]} vs {want}")
                elif want is not None:
                    n_cmp += 1
                    if abs(float(f[k + 1]) - want) > 0.5e-4 + R9 * want:
                        bad.append(f"row {b} {r['kv']}: {f[k + 1]} vs {want:.9g}")
        check(not bad and n_cmp > 0, f"stderr decay table = -o bucket_ppl ({n_out} rows, {n_cmp} cells)"
              + (": " + "; ".join(bad[:4]) if bad else ""))

    for kv in nonzero + zero:
        kls = [x[2]["kl"] for x in per.get(kv, []) if "kl" in x[2]]
        finite = bool(kls) and all(v >= 0 and math.isfinite(v) for v in kls)
        if kv in nonzero:
            check(finite and max(kls) > 0, f"{kv}: KL against the shadow is finite, >= 0 and not all 0 over {len(kls)} "
                  f"span tokens (max {max(kls) if kls else float('nan'):.4g})")
        else:
            check(finite and max(kls) == 0, f"{kv}: KL against the shadow is exactly 0 on all {len(kls)} span tokens")

    # the stderr table against -o: columns tokens ppl ΔNLL KL top1 Δp ppl(all) recall KV-MiB read-MiB (11 with the
    # name, which may hold spaces: taken from the right); fixed decimals 4 5 5 4 5 4 4 2 3
    by_name = {("shadow (full, f32)" if r["kv"] == "shadow" else r["kv"]): r for r in recs}
    rows = {}
    for line in open(table_path, encoding="utf-8", errors="replace"):
        f = line.split()
        if len(f) < 11:
            continue
        name = " ".join(f[:-10])
        if name in by_name:
            rows[name] = f[-10:]
    spec = [("span_tokens", 0, None), ("span_ppl", 1, 4), ("dnll", 2, 5), ("kl", 3, 5), ("top1", 4, 4), ("dp", 5, 5),
            ("all_ppl", 6, 4), ("recall", 7, 4), ("kv_alloc_bytes", 8, 2), ("kv_read_bytes_per_token", 9, 3)]
    bad, worst, n_cmp = [], 0.0, 0
    for name, r in by_name.items():
        if name not in rows:
            bad.append(f"no table row for '{name}'")
            continue
        for field, col, dec in spec:
            cell = rows[name][col]
            if cell == "-":
                if field in r and r["kv"] != "shadow":
                    bad.append(f"{name} {field}: '-' in the table")
                continue
            want = r[field] / 1048576.0 if field.startswith("kv_") else r[field]
            tol = (0 if dec is None else 0.5 * 10 ** -dec) + R9 * abs(want) + 1e-12
            err = abs(float(cell) - want)
            n_cmp += 1
            worst = max(worst, err / tol)
            if not err <= tol:
                bad.append(f"{name} {field}: table {cell}, -o {want:.9g}")
    check(not bad and n_cmp > 0, f"stderr table = -o for {len(by_name)} rows, {n_cmp} cells within half a unit of the "
          f"last printed decimal (worst at {worst:.2f} of it)" + (": " + "; ".join(bad[:6]) if bad else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:   # a broken record is a failed check, never a silent exit (status 1 = FAIL lines printed)
        print(f"FAIL ppl_crosscheck.py: {type(e).__name__}: {e}")
        sys.exit(1)
