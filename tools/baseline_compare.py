#!/usr/bin/env python3
"""Compare two tools/baseline.sh directories (before and after a change): every -tokenlog line's figures that both
formats have (doc, pos, token, next, and per policy kv, nll, kl: fields added later, such as top1 and recall, are
left out) and every ids file must be identical. Prints one line per file and exits 1 on any difference.
usage: tools/baseline_compare.py BEFORE_DIR AFTER_DIR"""
import json
import os
import sys


def tokenlog(path):
    out = []
    for line in open(path):
        r = json.loads(line)
        out.append((r["doc"], r["pos"], r["token"], r["next"],
                    tuple((p["kv"], p["nll"], p.get("kl")) for p in r["policies"])))
    return out


def main():
    a, b = sys.argv[1], sys.argv[2]
    names = sorted(f for f in os.listdir(a) if f.endswith((".tok", ".ids")))
    bad = 0
    for f in names:
        pa, pb = os.path.join(a, f), os.path.join(b, f)
        if not os.path.exists(pb):
            print("MISSING", f); bad += 1; continue
        same = tokenlog(pa) == tokenlog(pb) if f.endswith(".tok") else open(pa).read() == open(pb).read()
        print("SAME" if same else "DIFFERENT", f)
        bad += not same
    print("%d files, %d different or missing" % (len(names), bad))
    sys.exit(1 if bad or not names else 0)


if __name__ == "__main__":
    main()
