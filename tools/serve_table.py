#!/usr/bin/env python3
"""The serving sweep's records (tools/serve_sweep.sh: -m serve's -o JSON lines, each with the sweep's tag) as
markdown tables: access patterns, then one row per pool size and policy, quality from the runs that had -shadow 1."""
import json
import sys

recs = [json.loads(line) for line in open(sys.argv[1])]
runs = [r for r in recs if r["kind"] == "run"]

print("| pattern | hit rate | TTFT p50 / p95 s | tok/s |")
print("|---|---|---|---|")
for r in runs:
    if r["sweep"].startswith("pattern="):
        print(f"| {r['sweep'][8:]} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
              f"{r['throughput_tok_s']:.1f} |")
print()
# quality: a policy's shadow figures (the static ones measured once; adapt per pool)
quality = {}
for r in runs:
    if "kl" in r:
        quality[(r["kv"], r["sweep"])] = (r["kl"], r["top1"])
        quality.setdefault((r["kv"], None), (r["kl"], r["top1"]))
print("| pool | policy | done / failed | preemptions | switches (on a short pool) | tok/s | TTFT p95 s | TPOT p95 ms "
      "| occupancy mean / peak | steps >= 80 / 90 / 95 / 99% | KL, top-1 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
order = {"pool=100%": 0, "pool=50%": 1, "pool=25%": 2, "pool=10%": 3}
rows = [r for r in runs if r["sweep"].startswith("pool=") or (r["sweep"] == "pattern=hotspot")]
rows.sort(key=lambda r: (order.get(r["sweep"], 0), r["kv"]))
for r in rows:
    pool = "100%" if r["sweep"] == "pattern=hotspot" else r["sweep"][5:]
    steps = max(r["steps"], 1)
    at = " / ".join(f"{100.0 * r[k] / steps:.0f}" for k in ("steps_at_80", "steps_at_90", "steps_at_95", "steps_at_99"))
    sw = "-"
    if "switches_to" in r:
        sw = f"{sum(r['switches_to'].values())} ({r['switches_on_short_pool']})"
    q = quality.get((r["kv"], r["sweep"]))
    if not q and not r["kv"].startswith("adapt"):   # a static policy answers the same at every pool size
        q = quality.get((r["kv"], None))
    qs = "0 (itself)" if r["kv"] == "full" else f"{q[0]:.4f}, {q[1]:.3f}" if q else "-"
    print(f"| {pool} | `{r['kv']}` | {r['finished']} / {r['failed']} | {r['preemptions']} | {sw} | "
          f"{r['throughput_tok_s']:.1f} | {r['ttft_p95_s']:.2f} | {r['tpot_p95_ms']:.0f} | "
          f"{r['occupancy_mean']:.2f} / {r['occupancy_peak']:.2f} | {at} | {qs} |")
# occupancy over the run, 64 columns of equal steps, each its highest level: _ below 80%, . 80, : 90, | 95, # 99
print("\nOccupancy over time (one character per 1/64 of the run's steps, its peak: `_` < 80%, `.` >= 80, `:` >= 90, "
      "`|` >= 95, `#` >= 99%):\n")
for r in rows:
    curve = r["occupancy"]
    if not curve:
        continue
    cols = []
    for j in range(64):
        part = curve[j * len(curve) // 64:max((j + 1) * len(curve) // 64, j * len(curve) // 64 + 1)]
        peak = max(part)
        cols.append("#" if peak >= 0.99 else "|" if peak >= 0.95 else ":" if peak >= 0.90 else "." if peak >= 0.80 else "_")
    pool = "100%" if r["sweep"] == "pattern=hotspot" else r["sweep"][5:]
    print(f"    {pool:>4} {r['kv'][:38]:<38} {''.join(cols)}")
wall = sum(r["wall_s"] for r in runs)
print(f"\n{len(runs)} runs, {wall / 60:.1f} minutes of serving (the shadow passes not counted)")
