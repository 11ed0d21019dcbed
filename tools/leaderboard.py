#!/usr/bin/env python3
"""The task leaderboard (kvpress's view: score against compression), from `./run -m task -o` records.

For each (task, length, policy spec) it gives the mean score over its records and the mean compression ratio, where an
item's ratio is the policy's resident KV bytes over full's on the same item (--bytes live, the default:
kv_live_bytes, what the cache held when the answer was written, kvpress's compression ratio; --bytes peak:
kv_peak_live_bytes, the most it ever held, which for a prefill-time policy such as snapkv is full's, since it
compresses only after the prompt) (same task, length,
depth, item and question; a policy with no full record beside it gets no ratio: null). full itself is the ceiling
at ratio 1. The policy name (the spec before ':' or ',') groups a family's budgets into one curve of the plot.

  leaderboard.py RECORDS.jsonl... [--metric M] [--bytes live|peak] [--jsonl OUT] [--dat OUT] [--plot OUT.png]

--bytes live|peak: which resident bytes (above).
--metric: the record field scored (default score: RULER's string match; exact; match_file or match_full for code;
f1_full, rouge_l_full, same_full, or docqa's f1_truth, for the natural tasks, whose dialogue turns count as items).
A shared-context record's task reads "niah_multikey/turns" (or /requests), so its protocol is a task of its own.
--jsonl: one JSON line per (task, length, kv): task, length, kv, policy, items, metric, mean, full_mean, bytes_ratio.
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
    return (task_label(r), r.get("length"), r.get("depth"), r.get("item"), r.get("question"), r.get("turn"))


def task_label(r):
    return r["task"] + ("/" + r["shared"] if r.get("shared") else "")


def build(records, metric, field):
    """[(task, kv, policy, items, mean, full_mean, bytes_ratio, length)], sorted by task, length, policy, ratio."""
    full = {}
    for r in records:
        if r["kv"] == "full" and metric in r:
            full[item_key(r)] = r
    groups = defaultdict(list)
    for r in records:
        if metric in r and r[metric] is not None:
            groups[(task_label(r), r.get("length"), r["kv"])].append(r)
    rows = []
    for (task, length, kv), rs in groups.items():
        mean = sum(float(r[metric]) for r in rs) / len(rs)
        ratios, fulls = [], []
        for r in rs:
            f = full.get(item_key(r))
            if f is None:
                continue
            fulls.append(float(f[metric]))
            if f.get(field):
                ratios.append(r[field] / f[field])
        ratio = sum(ratios) / len(ratios) if len(ratios) == len(rs) else None
        full_mean = sum(fulls) / len(fulls) if fulls else None
        rows.append((task, kv, policy_name(kv), len(rs), mean, full_mean, ratio, length))
    rows.sort(key=lambda x: (x[0], x[7] or 0, x[2] != "full", x[2], -(x[6] if x[6] is not None else -1)))
    return rows


def main():
    args = sys.argv[1:]
    opts = {"--metric": "score", "--bytes": "live", "--jsonl": None, "--dat": None, "--plot": None}
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
    if opts["--bytes"] not in ("live", "peak"):
        sys.exit(f"leaderboard.py: --bytes {opts['--bytes']}: live or peak")
    field = "kv_live_bytes" if opts["--bytes"] == "live" else "kv_peak_live_bytes"
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
    rows = build(records, metric, field)
    if not rows:
        print(f"leaderboard.py: no -m task record with '{metric}' in {', '.join(files)}", file=sys.stderr)
        return 1
    fmt = lambda x, p=4: "-" if x is None else f"{x:.{p}f}"
    print(f"| task | length | kv | items | {metric} | full's | bytes / full's |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for task, kv, _, n, mean, fm, ratio, length in rows:
        print(f"| {task} | {length} | `{kv}` | {n} | {fmt(mean, 3)} | {fmt(fm, 3)} | {fmt(ratio, 3)} |")
    if opts["--jsonl"]:
        with open(opts["--jsonl"], "w") as o:
            for task, kv, pol, n, mean, fm, ratio, length in rows:
                o.write(json.dumps({"leaderboard": metric, "task": task, "length": length, "kv": kv, "policy": pol,
                                    "items": n,
                                    "mean": mean, "full_mean": fm, "bytes": opts["--bytes"],
                                    "bytes_ratio": ratio}) + "\n")
    tasks = sorted({(r[0], r[7] or 0) for r in rows})   # a panel per (task, length)
    if opts["--dat"] or opts["--plot"]:
        dat = opts["--dat"] or opts["--plot"] + ".dat"
        series = []   # (task index, policy, block index)
        with open(dat, "w") as o:
            block = 0
            for ti, task in enumerate(tasks):
                here = [r for r in rows if (r[0], r[7] or 0) == task]
                for pol in sorted({r[2] for r in here}):
                    pts = sorted((r[6], r[4], r[1]) for r in here if r[2] == pol and r[6] is not None)
                    if not pts:
                        continue
                    o.write(f"# {task[0]} {task[1]} {pol}\n")
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
                    lines += [f"set title '{task[0]}, {task[1]} tokens'", "plot " + ", ".join(plots)]
            lines.append("unset multiplot")
            subprocess.run(["gnuplot"], input="\n".join(lines) + "\n", text=True, check=True)
            print(f"leaderboard.py: plot {opts['--plot']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
