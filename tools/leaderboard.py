#!/usr/bin/env python3
"""The task leaderboard (kvpress's view: score against compression), from `./run -m task -o` records.

For each (task, policy spec) it gives the mean score over its records and the mean compression ratio, where an
item's ratio is the policy's resident KV bytes (kv_peak_live_bytes) over full's on the same item (same task, length,
depth, item and question; a policy with no full record beside it gets no ratio: null). full itself is the ceiling
at ratio 1. The policy name (the spec before ':' or ',') groups a family's budgets into one curve of the plot.

  leaderboard.py RECORDS.jsonl... [--metric M] [--jsonl OUT] [--dat OUT] [--plot OUT.png]

--metric: the record field scored (default score: RULER's string match; exact, or a natural task's f1 / rouge_l).
--jsonl: one JSON line per (task, kv): task, kv, policy, items, metric, mean, full_mean, bytes_ratio.
--dat: a gnuplot table per task (blocks separated by two blank lines: bytes_ratio, mean, kv).
--plot: with gnuplot on PATH, one panel per task, one curve per policy name (score against bytes ratio).
Prints the table (markdown) on stdout. Exit 1 on no usable record.
"""
import json
import math
import subprocess
import sys
from collections import defaultdict


def policy_name(kv):
    for sep in ":,":
        kv = kv.split(sep)[0]
    return kv


def item_key(r):
    return (r.get("task"), r.get("length"), r.get("depth"), r.get("item"), r.get("question"), r.get("turn"))


def build(records, metric):
    """[(task, kv, policy, items, mean, full_mean, bytes_ratio)], sorted by task, policy, ratio."""
    full = {}
    for r in records:
        if r["kv"] == "full" and metric in r:
            full[item_key(r)] = r
    groups = defaultdict(list)
    for r in records:
        if metric in r and r[metric] is not None:
            groups[(r["task"], r["kv"])].append(r)
    rows = []
    for (task, kv), rs in groups.items():
        mean = sum(float(r[metric]) for r in rs) / len(rs)
        ratios, fulls = [], []
        for r in rs:
            f = full.get(item_key(r))
            if f is None:
                continue
            fulls.append(float(f[metric]))
            if f.get("kv_peak_live_bytes"):
                ratios.append(r["kv_peak_live_bytes"] / f["kv_peak_live_bytes"])
        ratio = sum(ratios) / len(ratios) if len(ratios) == len(rs) else None
        full_mean = sum(fulls) / len(fulls) if fulls else None
        rows.append((task, kv, policy_name(kv), len(rs), mean, full_mean, ratio))
    rows.sort(key=lambda x: (x[0], x[2] != "full", x[2], -(x[6] if x[6] is not None else -1)))
    return rows


def main():
    args = sys.argv[1:]
    opts = {"--metric": "score", "--jsonl": None, "--dat": None, "--plot": None}
    files = []
    while args:
        a = args.pop(0)
        if a in opts:
            if not args:
                sys.exit(f"leaderboard.py: {a} needs a value")
            opts[a] = args.pop(0)
        elif a.startswith("--"):
            sys.exit(f"leaderboard.py: unknown option {a}\n{__doc__}")
        else:
            files.append(a)
    if not files:
        sys.exit(__doc__)
    metric = opts["--metric"]
    records = []
    for f in files:
        for n, line in enumerate(open(f), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"leaderboard.py: {f}:{n}: not JSON ({e})")
            if r.get("mode") == "task":
                records.append(r)
    rows = build(records, metric)
    if not rows:
        print(f"leaderboard.py: no -m task record with '{metric}' in {', '.join(files)}", file=sys.stderr)
        return 1
    fmt = lambda x, p=4: "-" if x is None else f"{x:.{p}f}"
    print(f"| task | kv | items | {metric} | full's | bytes / full's |")
    print("|---|---|--:|--:|--:|--:|")
    for task, kv, _, n, mean, fm, ratio in rows:
        print(f"| {task} | `{kv}` | {n} | {fmt(mean, 3)} | {fmt(fm, 3)} | {fmt(ratio, 3)} |")
    if opts["--jsonl"]:
        with open(opts["--jsonl"], "w") as o:
            for task, kv, pol, n, mean, fm, ratio in rows:
                o.write(json.dumps({"leaderboard": metric, "task": task, "kv": kv, "policy": pol, "items": n,
                                    "mean": mean, "full_mean": fm, "bytes_ratio": ratio}) + "\n")
    tasks = sorted({r[0] for r in rows})
    if opts["--dat"] or opts["--plot"]:
        dat = opts["--dat"] or opts["--plot"] + ".dat"
        series = []   # (task index, policy, block index)
        with open(dat, "w") as o:
            block = 0
            for ti, task in enumerate(tasks):
                for pol in sorted({r[2] for r in rows if r[0] == task}):
                    pts = sorted((r[6], r[4], r[1]) for r in rows if r[0] == task and r[2] == pol and r[6] is not None)
                    if not pts:
                        continue
                    o.write(f"# {task} {pol}\n")
                    for ratio, mean, kv in pts:
                        o.write(f"{ratio:.6f} {mean:.6f} {kv}\n")
                    o.write("\n\n")
                    series.append((ti, pol, block))
                    block += 1
        if opts["--plot"]:
            try:
                subprocess.run(["gnuplot", "--version"], capture_output=True, check=True)
            except (OSError, subprocess.CalledProcessError):
                print("leaderboard.py: no gnuplot: the table " + dat + " is the result", file=sys.stderr)
                return 0
            cols = min(len(tasks), 3)
            lines = [f"set terminal png size {380 * cols},{300 * math.ceil(len(tasks) / cols)}",
                     f"set output '{opts['--plot']}'",
                     f"set multiplot layout {math.ceil(len(tasks) / cols)},{cols}",
                     "set xrange [0:1.05]; set yrange [0:1.05]; set key bottom right font ',8'",
                     f"set xlabel 'KV bytes / full''s'; set ylabel '{metric}'"]
            for ti, task in enumerate(tasks):
                plots = [f"'{dat}' index {b} using 1:2 with linespoints title '{pol}'" for t, pol, b in series if t == ti]
                if plots:
                    lines += [f"set title '{task}'", "plot " + ", ".join(plots)]
            lines.append("unset multiplot")
            subprocess.run(["gnuplot"], input="\n".join(lines) + "\n", text=True, check=True)
            print(f"leaderboard.py: plot {opts['--plot']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
