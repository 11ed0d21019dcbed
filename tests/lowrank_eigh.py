#!/usr/bin/env python3
"""kvlab's Jacobi eigen solver (lowrank.c, through `test_lowrank --eigen IN OUT`) against NumPy's eigh (LAPACK's
syevd), on seeded random second moments (n = 8, 64, 256; spectra over several orders of magnitude, rank-deficient
ones, clustered ones) and on real ones given as files (the pre-RoPE keys of SmolLM2 layers, test_lowrank --dump-cov).

Usage: lowrank_eigh.py TEST_LOWRANK_BIN TMPDIR [COV_FILE...]; prints PASS/FAIL lines for tests/run.sh.
Tolerances: eigenvalues |w - w_np| <= 1e-9 * max|w| (both solvers are backward stable, so each eigenvalue is within
about n*eps*||A||_2 of the exact one: relative to the spectral norm is the scale their errors live on; a small
eigenvalue's own relative error can be large for both); eigenvectors, up to sign, max |v - v_np| <= 1e-7 for every
eigenvalue whose gap to its neighbours is at least 1e-5 * max|w| (perturbation theory: an eigenvector moves by about
n*eps*||A|| / gap, here at most ~1e-9, so 1e-7 leaves room yet catches any wrong or mixed vector).
"""
import subprocess
import sys

import numpy as np

REL_W, TOL_V, GAP = 1e-9, 1e-7, 1e-5


def write_matrix(path, a):
    with open(path, "w") as f:
        f.write("%d\n" % a.shape[0])
        for row in a:
            f.write(" ".join("%.17g" % x for x in row) + "\n")


def read_matrix(path):
    with open(path) as f:
        n = int(f.readline())
        a = np.array([float(x) for x in f.read().split()]).reshape(n, n)
    return a


def kvlab_eigh(binary, tmp, name, a):
    src, dst = "%s/%s.in" % (tmp, name), "%s/%s.out" % (tmp, name)
    write_matrix(src, a)
    rc = subprocess.run([binary, "--eigen", src, dst]).returncode
    with open(dst) as f:
        n, sweeps = (int(x) for x in f.readline().split())
        w = np.array([float(x) for x in f.readline().split()])
        v = np.array([float(x) for x in f.read().split()]).reshape(n, n)
    return rc, sweeps, w, v


def compare(binary, tmp, name, a):
    rc, sweeps, w, v = kvlab_eigh(binary, tmp, name, a)
    if rc != 0:
        print("FAIL eigh %s: test_lowrank --eigen exited %d (sweeps %d)" % (name, rc, sweeps))
        return
    wn, vn = np.linalg.eigh(a)
    wn, vn = wn[::-1], vn[:, ::-1]   # decreasing, as kvlab gives them; columns are eigenvectors
    scale = np.max(np.abs(wn))
    ew = np.max(np.abs(w - wn)) / scale if scale > 0 else np.max(np.abs(w - wn))
    n = len(w)
    worst_v, checked = 0.0, 0
    for i in range(n):
        gap = min([abs(wn[i] - wn[j]) for j in (i - 1, i + 1) if 0 <= j < n] or [np.inf])
        if gap < GAP * scale:
            continue
        x, y = v[i], vn[:, i]
        e = min(np.max(np.abs(x - y)), np.max(np.abs(x + y)))
        worst_v, checked = max(worst_v, e), checked + 1
    ok_w, ok_v = ew <= REL_W, worst_v <= TOL_V
    print("%s eigh %s (n %d, %d sweeps): eigenvalues within %.2e of max|w| (tolerance %.0e)"
          % ("PASS" if ok_w else "FAIL", name, n, sweeps, ew, REL_W))
    print("%s eigh %s (n %d): %d well-separated eigenvectors within %.2e up to sign (tolerance %.0e)"
          % ("PASS" if ok_v and checked > 0 else "FAIL", name, n, checked, worst_v, TOL_V))


def main():
    binary, tmp, covs = sys.argv[1], sys.argv[2], sys.argv[3:]
    rng = np.random.default_rng(20261201)
    for n in (8, 64, 256):
        x = rng.standard_normal((4 * n, n)) * (0.9 ** np.arange(n))   # a spectrum over several decades
        compare(binary, tmp, "random-%d" % n, x.T @ x / (4 * n))
        x = rng.standard_normal((n // 2, n))                         # rank n/2: half the eigenvalues ~0
        compare(binary, tmp, "rank-deficient-%d" % n, x.T @ x / n)
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))              # clustered: pairs 1e-3 apart
        lam = np.repeat(np.linspace(1, 10, n // 2), 2) + np.tile([0, 1e-3], n // 2)
        compare(binary, tmp, "clustered-%d" % n, (q * lam) @ q.T)
    for path in covs:
        a = read_matrix(path)
        compare(binary, tmp, path.rsplit("/", 1)[-1], (a + a.T) / 2)


main()
