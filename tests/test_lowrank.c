/* test_lowrank.c: low rank (lowrank.c's Jacobi eigen-decomposition; rank=, krank=, vrank=, calib= in kv.c).
 *   - the eigen solver on seeded random second moments (n = 1, 2, 7, 64, 256) and on degenerate ones: converged,
 *     eigenvalues in decreasing order, eigenvectors orthonormal and A·v = λ·v, the trace kept, within bounds derived
 *     from double rounding (tests/test_lowrank_eigh.sh compares it with NumPy's eigh through the modes below);
 *   - spec errors: bad ranks, calib= alone, q4 over an odd rank, the combinations not built (prec=,
 *     merging, merge-on-evict, per-channel keys, fast=);
 *   - before calib tokens the cache gives the bits of the same spec without rank= (f32 and q8, both position modes,
 *     eviction before the fit included);
 *   - at full rank (R = head_dim, f32 coefficients) every reconstructed key and value is the original within the
 *     bound below, and attention matches the plain full cache within the bound that key error implies; at R < head_dim
 *     on keys and values that lie exactly in R-dim subspaces likewise;
 *   - kv_attend_cpu against kv_attend_ref within tests/attn_ref_check.h's bound on low-rank caches;
 *   - clone/restore keeps the bases (and the calibration in progress);
 *   - kv_bytes against an independent formula, every term, for SmolLM2's shape after 4,096 synthetic tokens, and the
 *     bytes one step reads.
 * Modes for tests/lowrank_eigh.py: --eigen IN OUT (a matrix in, its eigenpairs out, text) and --dump-cov MODEL TEXT
 * N LAYER OUT (the pre-RoPE keys' second moment of kv head 0 of LAYER over the first N tokens of TEXT).
 * Dimensions: n (matrix order), head_dim (hd), R (rank). */
#include "kv.h"
#include "kv_impl.h"
#include "lowrank.h"
#include "run.h"
#include "tests/attn_ref_check.h"
#include "tests/test_kv_util.h"

#include <float.h>

#define EPS DBL_EPSILON

/* ---- the eigen solver ---- */

/* a (n, n) = XᵀX / m over m seeded rows of scaled normal values: column d scaled by scale^d, so the spectrum spans
 * several orders of magnitude, as real key moments do */
static void random_moment(double *a, int n, int m, double scale, uint64_t seed) {
    trng_seed(seed);
    float x[n];
    memset(a, 0, (size_t)n * n * sizeof(double));
    for (int r = 0; r < m; r++) {
        double sc = 1;
        for (int d = 0; d < n; d++) { x[d] = (float)(trng_normal() * sc); sc *= scale; }
        lowrank_accumulate(a, x, n);
    }
    for (size_t e = 0; e < (size_t)n * n; e++) a[e] /= m;
}

/* Checks the eigenpairs (w, v) of a (n, n). Bounds (Golub & Van Loan §8.5.5: Jacobi is backward stable, the computed
 * V is orthogonal to O(sweeps·n·u) and A·V - V·Λ is O(sweeps·n·u·‖A‖_F)): each rotation rounds each of the two
 * columns it mixes by a few units u = 2^-52, and a column is mixed about sweeps·n times, so 4·sweeps·n·u is the
 * worst-case growth; measured when set: orthonormality 8.0e-14 and residual 7.6e-15·‖A‖_F at n = 256 (10 sweeps),
 * about 1/30 and 1/300 of the bound; 6.1e-14 against 2.3e-13 for 2I + J/n (one sweep), the closest. */
static void check_eigen(const char *what, const double *a, int n) {
    double *w = malloc((size_t)n * sizeof(double)), *v = malloc((size_t)n * n * sizeof(double));
    int sweeps = lowrank_eigen(w, v, a, n);
    CHECK(sweeps >= 0, "eigen %s (n %d): converged in %d sweeps", what, n, sweeps);
    double fro = 0, tr = 0, sw = 0;
    for (int i = 0; i < n; i++) {
        tr += a[(size_t)i * n + i]; sw += w[i];
        for (int j = 0; j < n; j++) fro += a[(size_t)i * n + j] * a[(size_t)i * n + j];
    }
    fro = sqrt(fro);
    double tol = 4.0 * (sweeps > 0 ? sweeps : 1) * n * EPS, orth = 0, res = 0;
    int sorted = 1;
    for (int i = 0; i < n; i++) {
        if (i && w[i] > w[i - 1]) sorted = 0;
        for (int j = 0; j < n; j++) {
            double dot = 0;
            for (int d = 0; d < n; d++) dot += v[(size_t)i * n + d] * v[(size_t)j * n + d];
            double e = fabs(dot - (i == j));
            if (!(e <= orth)) orth = e;
        }
        for (int r = 0; r < n; r++) {   /* (A v_i)_r - w_i v_ir */
            double av = 0;
            for (int d = 0; d < n; d++) av += a[(size_t)r * n + d] * v[(size_t)i * n + d];
            double e = fabs(av - w[i] * v[(size_t)i * n + r]);
            if (!(e <= res)) res = e;
        }
    }
    CHECK(sorted, "eigen %s (n %d): eigenvalues in decreasing order", what, n);
    CHECK_LE(orth, tol, "eigen %s (n %d): eigenvectors orthonormal, max |VVᵀ - I| %.2e <= %.2e", what, n, orth, tol);
    CHECK_LE(res, tol * (fro > 0 ? fro : 1), "eigen %s (n %d): max |A v - λ v| %.2e <= %.2e ‖A‖_F", what, n, res,
             tol);
    CHECK_LE(fabs(sw - tr), tol * (fro > 0 ? fro : 1), "eigen %s (n %d): Σλ = trace within %.2e", what, n,
             fabs(sw - tr));
    free(w); free(v);
}

static void test_eigen(void) {
    static const int ns[] = {1, 2, 7, 64, 256};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        int n = ns[k];
        double *a = malloc((size_t)n * n * sizeof(double));
        random_moment(a, n, 3 * n + 5, 0.97, 100 + n);
        check_eigen("random moment", a, n);
        random_moment(a, n, n / 2 + 1, 1.0, 200 + n);   /* rank-deficient: about n/2 zero eigenvalues */
        check_eigen("rank-deficient moment", a, n);
        for (int i = 0; i < n; i++)   /* repeated eigenvalues: 2·I plus a rank-one term */
            for (int j = 0; j < n; j++) a[(size_t)i * n + j] = 2.0 * (i == j) + 1.0 / n;
        check_eigen("2I + J/n", a, n);
        double *w = malloc((size_t)n * sizeof(double)), *v = malloc((size_t)n * n * sizeof(double));
        lowrank_eigen(w, v, a, n);
        double e = fabs(w[0] - 3.0);
        for (int i = 1; i < n; i++) e = fmax(e, fabs(w[i] - 2.0));
        CHECK_LE(e, 8 * n * EPS * 3, "eigen 2I + J/n (n %d): eigenvalues 3, 2, ..., 2 within %.2e", n, e);
        memset(a, 0, (size_t)n * n * sizeof(double));
        check_eigen("zero", a, n);
        free(w); free(v); free(a);
    }
    double w[3], v[9], share;
    const double d[9] = {4, 0, 0, 0, 1, 0, 0, 0, 0};
    lowrank_eigen(w, v, d, 3);
    share = lowrank_energy(w, 3, 1);
    CHECK(w[0] == 4 && w[1] == 1 && w[2] == 0 && share == 0.8, "eigen diag(4, 1, 0): 4, 1, 0; rank-1 energy %g = 0.8",
          share);
}

/* ---- the cache ---- */

static void test_spec_errors(void) {
    KVShape s = tshape(1, 2, 1, 64, 64);
    char err[512];
    static const struct { const char *spec, *want; } bad[] = {
        {"full,rank=0", "bad rank=0"},
        {"full,rank=65", "rank=65 in 'full,rank=65' is over head_dim 64"},   /* named as given, not krank= */
        {"full,vrank=100", "over head_dim 64"},
        {"full,rank=8,krank=4", "conflicts with rank="},
        {"full,krank=4,rank=8", "conflicts with rank="},
        {"full,calib=64", "give rank=, krank= or vrank="},
        {"full,rank=8,calib=0", "bad calib=0"},
        {"full,krank=8,krank=4", "given twice"},
        {"full,krank=7,type=q4", "must be even"},
        {"full,rank=8,prec=f32:8/q8", "not with prec= or residual="},
        {"full,rank=8,type=q8,residual=8", "not with prec= or residual="},
        {"pool:32,group=2,rank=8", "merging policy"},
        {"full,rank=8,fast=50%", "memory tiers"},
        {"h2o:16,rank=8,merge=1", "merge-on-evict"},
        {"full,rank=8,type=q4,kgroup=channel", "kgroup=channel"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = tcache_error(&s, bad[i].spec, err, sizeof err);
        CHECK(rc && strstr(err, bad[i].want), "spec '%s' is an error naming '%s' (%s)", bad[i].spec, bad[i].want, err);
    }
    KVCache c;
    if (!tcache(&c, &s, "full,krank=7,type=q8,calib=16")) {
        CHECK(c.krank == 7 && c.vrank == 0 && c.calib == 16 && c.band_kb[0] == 7 * 3 && c.band_vb[0] == 64 + 4,
              "full,krank=7,type=q8: 7 coefficients in q8 groups of gcd(7, 32) = 1 (3 bytes each), values q8 (68 B)");
        kv_cache_free(&c);
    }
    if (!tcache(&c, &s, "full,rank=8,calib=1000")) {
        CHECK(c.calib == 64, "calib=1000 with a context of 64 is clipped to 64 (%d)", c.calib);
        kv_cache_free(&c);
    }
}

/* Seeded keys, values and queries for a stream: (n_tokens, n_kv_heads * hd) k and v, (n_tokens, n_heads * hd) q.
 * With basis (R, hd) rows given, k and v are combinations of them only (an exactly rank-R stream). */
static void make_stream(float *k, float *v, float *q, int T, int nkv, int nh, int hd, const double *kb,
                        const double *vb, int R, uint64_t seed) {
    trng_seed(seed);
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < nkv; g++) {
            float *kr = k + ((size_t)t * nkv + g) * hd, *vr = v + ((size_t)t * nkv + g) * hd;
            if (!kb) for (int d = 0; d < hd; d++) { kr[d] = trng_normal() * (1.0f + (d % 5)); vr[d] = trng_normal(); }
            else {
                double zk[R], zv[R];
                for (int j = 0; j < R; j++) { zk[j] = trng_normal() * (1 + j % 3); zv[j] = trng_normal(); }
                for (int d = 0; d < hd; d++) {
                    double a = 0, b = 0;
                    for (int j = 0; j < R; j++) { a += zk[j] * kb[(size_t)j * hd + d]; b += zv[j] * vb[(size_t)j * hd + d]; }
                    kr[d] = (float)a; vr[d] = (float)b;
                }
            }
        }
        for (int e = 0; e < nh * hd; e++) q[(size_t)t * nh * hd + e] = trng_normal() * 0.3f;
    }
}

/* R orthonormal rows of hd (Gram-Schmidt twice over seeded normal rows, in double) */
static void random_basis(double *b, int R, int hd, uint64_t seed) {
    trng_seed(seed);
    for (int j = 0; j < R; j++) {
        for (int d = 0; d < hd; d++) b[(size_t)j * hd + d] = trng_normal();
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < j; i++) {
                double dot = 0;
                for (int d = 0; d < hd; d++) dot += b[(size_t)i * hd + d] * b[(size_t)j * hd + d];
                for (int d = 0; d < hd; d++) b[(size_t)j * hd + d] -= dot * b[(size_t)i * hd + d];
            }
        double nn = 0;
        for (int d = 0; d < hd; d++) nn += b[(size_t)j * hd + d] * b[(size_t)j * hd + d];
        for (int d = 0; d < hd; d++) b[(size_t)j * hd + d] /= sqrt(nn);
    }
}

/* Before calib tokens a low-rank cache is the same cache as without rank=: the same attention bits token by token
 * (kv_attend_ref and kv_attend_cpu), h2o evicting before the fit included. */
static void test_before_fit(void) {
    enum { T = 40, NKV = 2, NH = 4, HD = 32, CAL = 30 };
    static float k[T * NKV * HD], v[T * NKV * HD], q[T * NH * HD];
    make_stream(k, v, q, T, NKV, NH, HD, NULL, NULL, 0, 7);
    static const char *const base[] = {"full", "full,pos=cache", "full,type=q8", "h2o:12", "h2o:12,pos=cache,type=f16"};
    KVShape s = tshape(2, NH, NKV, HD, 64);
    for (size_t b = 0; b < sizeof base / sizeof base[0]; b++) {
        char spec[96];
        snprintf(spec, sizeof spec, "%s,rank=8,calib=%d", base[b], CAL);
        KVCache a, c;
        if (tcache(&a, &s, base[b])) continue;
        if (tcache(&c, &s, spec)) { kv_cache_free(&a); continue; }
        int same = 1, first_diff = -1;
        float oa[NH * HD], oc[NH * HD];
        for (int t = 0; t < T && same; t++)
            for (int l = 0; l < 2; l++) {
                kv_append(&a, l, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
                kv_append(&c, l, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
                for (int back = 0; back < 2; back++) {
                    if (back) { kv_attend_cpu(&a, oa, l, t, q + (size_t)t * NH * HD); kv_attend_cpu(&c, oc, l, t, q + (size_t)t * NH * HD); }
                    else { kv_attend_ref(&a, oa, l, t, q + (size_t)t * NH * HD); kv_attend_ref(&c, oc, l, t, q + (size_t)t * NH * HD); }
                    if (t < CAL - 1 && memcmp(oa, oc, sizeof oa)) { same = 0; first_diff = t; }
                    if (t >= CAL - 1 && memcmp(oa, oc, sizeof oa) && first_diff < 0) first_diff = t;
                }
            }
        CHECK(same && first_diff == CAL - 1 && !c.stage && c.lanes[0].lr_fitted,
              "'%s': bit-identical to '%s' for the %d tokens before the fit, low rank from token %d on (the fit's), "
              "staging freed", spec, base[b], CAL - 1, first_diff);
        kv_cache_free(&a); kv_cache_free(&c);
    }
}

/* Reconstruction at full rank, f32 coefficients. Bound for an element of a reconstructed vector x̂ of x (u = 2^-24):
 * the basis B is orthonormal in double to O(1e-15), rounded to f32 (each entry within u); the coefficients
 * c = fl32(B̃x) are within u·|c_j| plus B̃'s rounding; x̂_d = Σ_j c_j B̃_jd in f32 adds at most hd·u·Σ_j |c_j B̃_jd|
 * ≤ hd·u·‖x‖₂ (Cauchy-Schwarz, ‖B̃_{:,d}‖ ≈ 1), and B̃ᵀB̃ - I, of size 2u·√hd, moves it by 2u·√hd·‖x‖₂: in all
 * (hd + 2√hd + 4)·u·‖x‖₂. A staged key under pos=orig is rotated, rounded, rotated back (4u·‖x‖₂ more), and a
 * reconstructed one rotated again (4u). So tol = (hd + 2√hd + 16)·u·‖x‖₂. Measured when set: worst 1.9e-7·‖x‖₂
 * (hd 64, both position modes), about 1/30 of it (the sums' errors grow as √hd, the bound takes hd). */
static void test_full_rank(void) {
    enum { T = 48, NKV = 2, NH = 4, HD = 64, CAL = 24 };
    static float k[T * NKV * HD], v[T * NKV * HD], q[T * NH * HD];
    make_stream(k, v, q, T, NKV, NH, HD, NULL, NULL, 0, 11);
    KVShape s = tshape(1, NH, NKV, HD, 64);
    for (int pc = 0; pc < 2; pc++) {
        char spec[64];
        snprintf(spec, sizeof spec, "full,rank=%d,calib=%d%s", HD, CAL, pc ? ",pos=cache" : "");
        KVCache c;
        if (tcache(&c, &s, spec)) continue;
        for (int t = 0; t < T; t++) kv_append(&c, 0, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
        double worst = 0, tolu = (HD + 2 * sqrt(HD) + 16) * REF_U;
        float x[HD];
        for (int g = 0; g < NKV; g++) {
            const KVLane *ln = &c.lanes[g];
            for (int i = 0; i < ln->n_live; i++) {
                int t = ln->pos[ln->live[i]];
                /* the expected key: the original rotated in double by its position (pos=orig) or rank (pos=cache) */
                double e[HD], nx = 0;
                const float *src = k + ((size_t)t * NKV + g) * HD;
                int rot = pc ? i : t;
                for (int d = 0; d < HD; d++) { e[d] = src[d]; nx += e[d] * e[d]; }
                nx = sqrt(nx);
                for (int p = 0; p < HD / 2; p++) {
                    double a = rot * pow(10000.0, -2.0 * p / HD), c0 = cos(a), s0 = sin(a), x0 = e[2 * p], x1 = e[2 * p + 1];
                    e[2 * p] = x0 * c0 - x1 * s0; e[2 * p + 1] = x0 * s0 + x1 * c0;
                }
                const float *kk = kv_lane_key(&c, ln, i, x);
                for (int d = 0; d < HD; d++) worst = fmax(worst, fabs(kk[d] - e[d]) / nx);
                const float *vv = kv_lane_value(&c, ln, i, x), *vs = v + ((size_t)t * NKV + g) * HD;
                double nv = 0;
                for (int d = 0; d < HD; d++) nv += (double)vs[d] * vs[d];
                for (int d = 0; d < HD; d++) worst = fmax(worst, fabs(vv[d] - vs[d]) / sqrt(nv));
            }
        }
        CHECK_LE(worst, tolu, "'%s': every key and value reconstructed within %.2e·‖x‖ (bound %.2e·‖x‖)", spec, worst,
                 tolu);
        kv_cache_free(&c);
    }
}

/* Attention of a low-rank cache against the plain full cache, both through kv_attend_ref, when every reconstructed
 * key and value is within tol·‖x‖ of the original (tol as test_full_rank's). Then each score moves by at most
 * δs = ‖q‖·tol·max‖k‖/√hd, each probability by a factor within e^(±2δs), so |Δo_d| ≤ (e^(2δs) - 1)·max_i|v_id| +
 * tol·max‖v‖; both caches' own f32 attention arithmetic adds at most 2·(ε₁ + (n + 1)u)·A_d each (attn_ref_check.h's
 * bound, A_d ≤ max|v_d|), which the second term below covers with (2n + 3hd + 80)·u·max|v|. */
static void attend_vs_full(const char *spec, int R, int exact_subspace) {
    enum { T = 56, NKV = 2, NH = 4, HD = 64, CAL = 24 };
    static float k[T * NKV * HD], v[T * NKV * HD], q[T * NH * HD];
    double kb[HD * HD], vb[HD * HD];
    if (exact_subspace) { random_basis(kb, R, HD, 21); random_basis(vb, R, HD, 22); }
    make_stream(k, v, q, T, NKV, NH, HD, exact_subspace ? kb : NULL, exact_subspace ? vb : NULL, R, 23);
    KVShape s = tshape(1, NH, NKV, HD, 64);
    KVCache a, c;
    char full[64];
    snprintf(full, sizeof full, "full%s", strstr(spec, "pos=cache") ? ",pos=cache" : "");
    if (tcache(&a, &s, full)) return;
    if (tcache(&c, &s, spec)) { kv_cache_free(&a); return; }
    double tolu = (HD + 2 * sqrt(HD) + 16) * REF_U, worst = 0;
    int failed = 0;
    for (int t = 0; t < T; t++) {
        float oa[NH * HD], oc[NH * HD];
        kv_append(&a, 0, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
        kv_append(&c, 0, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
        kv_attend_ref(&a, oa, 0, t, q + (size_t)t * NH * HD);
        kv_attend_ref(&c, oc, 0, t, q + (size_t)t * NH * HD);
        int n = t + 1;
        for (int h = 0; h < NH; h++) {
            int g = h / (NH / NKV);
            double qn = 0, kmax = 0, vmax = 0, vnorm = 0;
            for (int d = 0; d < HD; d++) qn += (double)q[(size_t)t * NH * HD + h * HD + d] * q[(size_t)t * NH * HD + h * HD + d];
            for (int u = 0; u <= t; u++) {
                double kn = 0, vn = 0;
                for (int d = 0; d < HD; d++) {
                    double kx = k[((size_t)u * NKV + g) * HD + d], vx = v[((size_t)u * NKV + g) * HD + d];
                    kn += kx * kx; vn += vx * vx; vmax = fmax(vmax, fabs(vx));
                }
                kmax = fmax(kmax, sqrt(kn)); vnorm = fmax(vnorm, sqrt(vn));
            }
            double ds = sqrt(qn) * tolu * kmax / sqrt((double)HD);
            double tol = (exp(2 * ds) - 1) * vmax + tolu * vnorm + (2 * n + 3 * HD + 80) * REF_U * vmax;
            for (int d = 0; d < HD; d++) {
                double e = fabs((double)oc[h * HD + d] - oa[h * HD + d]);
                if (!(e <= tol)) failed++;
                worst = fmax(worst, e / tol);
            }
        }
    }
    CHECK(!failed, "'%s' (%s) attends as full within the bound of its reconstruction: worst error/bound %.3f",
          spec, exact_subspace ? "keys and values in exact rank-R subspaces" : "full rank", worst);
    kv_cache_free(&a); kv_cache_free(&c);
}

/* kv_attend_cpu against kv_attend_ref (the bound of tests/attn_ref_check.h) on low-rank caches before and after the
 * fit, with eviction before and after it, every coefficient type, both position modes. */
static void test_cpu_vs_ref(void) {
    enum { T = 90, NKV = 3, NH = 9, HD = 64 };
    static float k[T * NKV * HD], v[T * NKV * HD], q[T * NH * HD];
    make_stream(k, v, q, T, NKV, NH, HD, NULL, NULL, 0, 31);
    static const char *const specs[] = {
        "full,krank=16,calib=40", "full,rank=32,calib=40,pos=cache", "full,vrank=8,calib=40,type=f16",
        "h2o:24,krank=16,calib=40", "h2o:24,rank=16,calib=40,type=q8,pos=cache", "window:32,krank=32,type=q4,calib=20",
        "window:60,rank=24,type=bf16,calib=50", "topk:16,krank=16,calib=40",
    };
    KVShape s = tshape(2, NH, NKV, HD, 128);
    for (size_t x = 0; x < sizeof specs / sizeof specs[0]; x++) {
        KVCache a, b;
        if (tcache(&a, &s, specs[x])) continue;
        if (tcache(&b, &s, specs[x])) { kv_cache_free(&a); continue; }
        RefAnswer ans;
        RefTally ty;
        memset(&ty, 0, sizeof ty);
        ref_answer_init(&ans, &a);
        float oa[NH * HD], ob[NH * HD];
        for (int t = 0; t < T; t++)
            for (int l = 0; l < 2; l++) {
                kv_append(&a, l, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
                kv_append(&b, l, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
                kv_attend_ref(&a, oa, l, t, q + (size_t)t * NH * HD);
                ref_answer_take(&ans, &ty, &a, l, q + (size_t)t * NH * HD, oa);
                kv_attend_cpu(&b, ob, l, t, q + (size_t)t * NH * HD);
                char where[96];
                snprintf(where, sizeof where, "layer %d position %d", l, t);
                ref_answer_check(&ans, &ty, ob, b.scores, (size_t)b.budget, where);
            }
        CHECK(!ty.failed && !ty.nonfinite && !ty.bad_data && a.lanes[0].lr_fitted,
              "'%s': kv_attend_cpu within kv_attend_ref's bound over %d attends, worst error/bound %.3f (outputs) "
              "%.3f (probabilities)%s%s", specs[x], ty.attends, ty.worst_out, ty.worst_prob, ty.failed ? "; " : "",
              ty.failed ? ty.where : "");
        ref_answer_free(&ans);
        kv_cache_free(&a); kv_cache_free(&b);
    }
}

/* clone/restore: a clone taken during calibration fits the same bases; one taken after keeps them; both attend with
 * the bits of the original from then on. */
static void test_clone(void) {
    enum { T = 60, NKV = 2, NH = 4, HD = 32, CAL = 30 };
    static float k[T * NKV * HD], v[T * NKV * HD], q[T * NH * HD];
    make_stream(k, v, q, T, NKV, NH, HD, NULL, NULL, 0, 41);
    KVShape s = tshape(1, NH, NKV, HD, 64);
    for (int at = 10; at <= 45; at += 35) {
        KVCache a, b;
        if (tcache(&a, &s, "h2o:20,rank=8,calib=30")) continue;
        char err[256];
        int same = 1, made = 0;
        float oa[NH * HD], ob[NH * HD];
        for (int t = 0; t < T; t++) {
            if (t == at) {
                made = !kv_cache_clone(&b, &a, err, sizeof err);
                CHECK(made, "clone at token %d: %s", at, made ? "made" : err);
                if (!made) break;
            }
            kv_append(&a, 0, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
            kv_attend_cpu(&a, oa, 0, t, q + (size_t)t * NH * HD);
            if (made) {
                kv_append(&b, 0, t, k + (size_t)t * NKV * HD, v + (size_t)t * NKV * HD);
                kv_attend_cpu(&b, ob, 0, t, q + (size_t)t * NH * HD);
                same &= !memcmp(oa, ob, sizeof oa);
            }
        }
        if (made) {
            same &= !memcmp(a.lanes[1].kbasis, b.lanes[1].kbasis, 8 * HD * sizeof(float));
            CHECK(same && b.lanes[1].lr_fitted, "clone at token %d (%s the fit at %d): the same bases and attention "
                  "bits as the original", at, at < CAL ? "before" : "after", CAL);
            /* restore the clone into a fresh cache of the same spec after a reset: the bases come back */
            KVCache r;
            if (!tcache(&r, &s, "h2o:20,rank=8,calib=30")) {
                int rc = kv_cache_restore(&r, &b, err, sizeof err);
                CHECK(!rc && r.lanes[0].lr_fitted && !memcmp(r.lanes[0].kbasis, b.lanes[0].kbasis, 8 * HD * sizeof(float))
                      && !r.stage, "restore keeps the bases (and no staging once fitted)%s%s", rc ? ": " : "", rc ? err : "");
                kv_cache_free(&r);
            }
            kv_cache_free(&b);
        }
        kv_cache_free(&a);
    }
}

/* kv_bytes for SmolLM2's attention shape (30 layers, 9 heads, 3 kv heads, head_dim 64, context 8192) under
 * full,krank=32,calib=512 (f32 and q8 coefficients) and full,rank=16 (q4), against a formula written out here: per
 * lane, 8192 slots of coefficients (f32: 4·R bytes; q8: groups of gcd(R, 32) int8 values plus an f16 scale; q4: half
 * a byte each plus an f16 scale and minimum per group) and full-rank values (f32 256 B, q8 2·34 B, q4 2·20 B),
 * the bases R·64·4 per side, the staging min(8192, 512) full-rank rows until the fit, and per slot an int32 position
 * and two int list entries (12 B; full keeps no policy metadata). Live: the slots in use, the bases once fitted. One
 * step's reads: every live slot's bytes and every lane's bases. */
static void test_accounting(void) {
    KVShape s = tshape(30, 9, 3, 64, 8192);
    static const struct { const char *spec; int kr, vr; size_t kb, vb, full_kb, full_vb; } cases[] = {
        {"full,krank=32", 32, 0, 32 * 4, 64 * 4, 64 * 4, 64 * 4},
        {"full,krank=32,type=q8", 32, 0, 2 + 32, 2 * (2 + 32), 2 * (2 + 32), 2 * (2 + 32)},
        {"full,rank=16,type=q4", 16, 16, 4 + 8, 4 + 8, 2 * (4 + 16), 2 * (4 + 16)},
    };
    const int lanes = 90, slots = 8192, calib = 512, T = 4096, hd = 64;
    float k[3 * 64], v[3 * 64];
    for (size_t x = 0; x < sizeof cases / sizeof cases[0]; x++) {
        KVCache c;
        if (tcache(&c, &s, cases[x].spec)) continue;
        size_t basis = (size_t)(cases[x].kr + cases[x].vr) * hd * 4;
        size_t stage = (size_t)calib * ((cases[x].kr ? cases[x].full_kb : 0) + (cases[x].vr ? cases[x].full_vb : 0));
        size_t alloc0 = (size_t)lanes * ((size_t)slots * (cases[x].kb + cases[x].vb + 12) + basis + stage);
        KVBytes b0 = kv_bytes(&c);
        KVSpec sp;
        char err[256];
        kv_spec_parse(&sp, cases[x].spec, KV_F32, err, sizeof err);
        CHECK(b0.total_alloc == alloc0 && kv_alloc_bytes_for(&s, &sp, kv_policy_find("full"), 8192) == alloc0,
              "'%s' at init: allocated %zu B = the formula's %zu B (staging held), kv_alloc_bytes_for agrees",
              cases[x].spec, b0.total_alloc, alloc0);
        trng_seed(51);
        size_t live_mid = 0, alloc_mid = 0;
        for (int t = 0; t < T; t++) {
            for (int e = 0; e < 3 * 64; e++) { k[e] = trng_normal(); v[e] = trng_normal(); }
            for (int l = 0; l < 30; l++) kv_append(&c, l, t, k, v);
            if (t == 99) { KVBytes bm = kv_bytes(&c); live_mid = bm.total_live; alloc_mid = bm.total_alloc; }
        }
        size_t live_mid_want = (size_t)lanes * 100 * (12 + (cases[x].kr ? cases[x].full_kb : cases[x].kb)
                                                      + (cases[x].vr ? cases[x].full_vb : cases[x].vb));
        CHECK(live_mid == live_mid_want && alloc_mid == alloc0, "'%s' after 100 tokens (before the fit): live %zu B = "
              "%zu B of full-rank staging rows, allocated unchanged", cases[x].spec, live_mid, live_mid_want);
        KVBytes b = kv_bytes(&c);
        size_t alloc = (size_t)lanes * ((size_t)slots * (cases[x].kb + cases[x].vb + 12) + basis);
        size_t live = (size_t)lanes * ((size_t)T * (cases[x].kb + cases[x].vb + 12) + basis);
        CHECK(b.total_alloc == alloc && b.total_live == live && b.basis_bytes == (size_t)lanes * basis
              && b.stage_bytes == 0 && b.peak_live >= live_mid,
              "'%s' after %d tokens: allocated %zu B = %zu, live %zu B = %zu, bases %zu B, staging freed",
              cases[x].spec, T, b.total_alloc, alloc, b.total_live, live, b.basis_bytes);
        /* one step's reads: attend every layer at the last token */
        uint64_t before = c.bytes_read;
        float qv[9 * 64], out[9 * 64];
        for (int e = 0; e < 9 * 64; e++) qv[e] = 0.1f;
        for (int l = 0; l < 30; l++) kv_attend_cpu(&c, out, l, T - 1, qv);
        size_t read = (size_t)lanes * ((size_t)T * (cases[x].kb + cases[x].vb) + basis);
        CHECK(c.bytes_read - before == read, "'%s': one step reads %llu B = every live slot's coefficients and "
              "values plus every lane's bases (%zu B)", cases[x].spec, (unsigned long long)(c.bytes_read - before), read);
        kv_cache_free(&c);
    }
}

/* ---- modes for tests/lowrank_eigh.py ---- */

static int mode_eigen(const char *in, const char *out) {
    FILE *f = fopen(in, "r"), *g;
    int n;
    if (!f || fscanf(f, "%d", &n) != 1 || n < 1 || n > 4096) { fprintf(stderr, "bad matrix file %s\n", in); return 1; }
    double *a = malloc((size_t)n * n * sizeof(double)), *w = malloc((size_t)n * sizeof(double)),
           *v = malloc((size_t)n * n * sizeof(double));
    for (size_t e = 0; e < (size_t)n * n; e++)
        if (fscanf(f, "%lf", &a[e]) != 1) { fprintf(stderr, "short matrix file %s\n", in); return 1; }
    fclose(f);
    int sweeps = lowrank_eigen(w, v, a, n);
    if (!(g = fopen(out, "w"))) return 1;
    fprintf(g, "%d %d\n", n, sweeps);
    for (int i = 0; i < n; i++) fprintf(g, "%.17g%c", w[i], i == n - 1 ? '\n' : ' ');
    for (size_t e = 0; e < (size_t)n * n; e++) fprintf(g, "%.17g%c", v[e], e % n == (size_t)n - 1 ? '\n' : ' ');
    fclose(g);
    free(a); free(w); free(v);
    return sweeps < 0;
}

static int mode_dump_cov(const char *model, const char *text, int n, int layer, const char *out) {
    Model m;
    char err[512];
    if (model_open(&m, model, err, sizeof err)) { fprintf(stderr, "%s\n", err); return 1; }
    size_t len;
    FILE *f = fopen(text, "rb");
    if (!f) return 1;
    static unsigned char buf[1 << 20];
    len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    int *ids = NULL;
    size_t n_ids = 0;
    if (tokenizer_encode(&m.tokenizer, buf, len, 1, &ids, &n_ids, err, sizeof err) || n_ids < (size_t)n) {
        fprintf(stderr, "the text has fewer than %d tokens\n", n);
        return 1;
    }
    KVShape shape = model_kv_shape(&m, n);
    KVSpec spec;
    KVCache c;
    RunState s;
    char spec_text[64];
    snprintf(spec_text, sizeof spec_text, "full,krank=%d,calib=%d", shape.head_dim, n);
    if (layer < 0 || layer >= shape.n_layers || kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err)
        || kv_cache_init(&c, &shape, &spec, err, sizeof err) || state_init_chunk(&s, &m.config, 64)) {
        fprintf(stderr, "cannot run: %s\n", err);
        return 1;
    }
    if (forward_prefill(&m, &s, &c, ids, (size_t)n, 0, 64)) return 1;
    int hd = shape.head_dim;
    const double *cov = c.lr_cov + (size_t)layer * shape.n_kv_heads * 3 * hd * hd;   /* kv head 0, pre-RoPE keys */
    FILE *g = fopen(out, "w");
    if (!g) return 1;
    fprintf(g, "%d\n", hd);
    for (size_t e = 0; e < (size_t)hd * hd; e++) fprintf(g, "%.17g%c", cov[e] / n, e % hd == (size_t)hd - 1 ? '\n' : ' ');
    fclose(g);
    state_free(&s);
    kv_cache_free(&c);
    free(ids);
    model_close(&m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--eigen")) return mode_eigen(argv[2], argv[3]);
    if (argc == 7 && !strcmp(argv[1], "--dump-cov")) return mode_dump_cov(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), argv[6]);
    test_eigen();
    test_spec_errors();
    test_before_fit();
    test_full_rank();
    attend_vs_full("full,rank=64,calib=24", 64, 0);
    attend_vs_full("full,rank=64,calib=24,pos=cache", 64, 0);
    attend_vs_full("full,rank=8,calib=24", 8, 1);
    attend_vs_full("full,rank=8,calib=24,pos=cache", 8, 1);
    test_cpu_vs_ref();
    test_clone();
    test_accounting();
    CHECK_EXIT();
}
