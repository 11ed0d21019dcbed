/* attn_ref_check.h: how far any implementation of step 3 may be from kv_attend_ref, the definition (kv.h), and the
 * check that says so: after kv_attend_ref on a cache, ref_answer_take keeps the reference's output and probabilities
 * and computes a bound for every element from the cache's own keys, values and the query (derivation below);
 * ref_answer_check compares another implementation's output and probabilities (kv_attend_cpu, kv_attend_chunk, the
 * CUDA twin or device) with them, in the NaN-failing form, and keeps the worst error/bound ratio in a RefTally.
 * Shared by tests/test_attn_ref.c (built with AVX and as portable C) and tests/test_attn.cu (compiled as C++).
 * It does not judge the reference itself: tests/test_kv.c checks kv_attend_cpu against a float64 reference, and here
 * kv_attend_cpu agrees with kv_attend_ref within the bound, so the two agree with each other and with float64.
 * Dimensions: n_heads, head_dim (hd), budget; n live slots of a lane. Indices: h query head, i rank, d column. */
#ifndef KVLAB_ATTN_REF_CHECK_H
#define KVLAB_ATTN_REF_CHECK_H
#include "kv.h"
#include "tests/test_kv_util.h"   /* tchan_key */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------------------------
 * The bound. u = 2^-24 (f32 unit roundoff). For query head h over n live slots, with q its query (before RoPE) and
 * k_i, v_i the stored keys and values decoded to f32, let S = max_i |q|₂·|k_i|₂ / √hd: it bounds every score |s_i|
 * and every Σ_d |q_d k_id| / √hd (Cauchy-Schwarz; RoPE keeps norms). Any implementation that forms each score as an
 * f32 dot product in some order (fused multiply-adds or not), exponentiates differences of scores (in one stage, or
 * two as flash-decoding does: a split's maximum, then the merge), sums n weights in any order or split, and divides,
 * satisfies, to first order in u:
 *   scores   |ŝ_i − s_i| ≤ δs = (hd + 12)·u·S: the dot ≤ hd·u·S in any order; the product with 1/√hd u·S and that
 *            constant's own two roundings 2u·S; RoPE of q and of k in f32 (cos, sin rounded, two products and a sum
 *            per element) ≤ 4u·S each; 1u·S to spare;
 *   probs    |p̂_i − p_i| ≤ ε₁·p_i, ε₁ = 2δs + 4u·S + (n + 12)·u: score errors move p_i by e^(2δs) − 1 ≈ 2δs
 *            (a shift common to all scores cancels); two subtractions of size ≤ 2S, rounded (4u·S); two exps of
 *            ≤ 2 ulp = 4u each (glibc's expf < 1 ulp, exp_neg within 1 ulp of it, CUDA's expf ≤ 2 ulp: 8u); the
 *            merge's product (u); the sum of n weights in any order ((n − 1)·u) and the division or the product with
 *            its inverse (2u); rounded up to n + 12;
 *   output   |ô_d − o_d| ≤ (ε₁ + (n + 1)·u)·A_d, A_d = Σ_i p_i·|v_id| (the condition of the sum): the probabilities'
 *            errors, then the n products and their sum in any order (the unnormalized form Σ w_i v_i / Z likewise).
 * Two implementations both within these of the exact values differ by at most twice them: the tolerances below are
 * 2·ε₁·p_i and 2·(ε₁ + (n + 1)·u)·A_d, times 1.01 for the second-order terms (≤ (n·u)² ≈ 6e-8 at n = 4099). A
 * weight stays a normal f32 (relative errors hold) while 2S < 87: ref_answer_take counts S > 40 as a failure of the
 * test's data. At SmolLM2's head_dim 64 with S ≈ 8 and n = 513 the output bound is about 3e-4·A_d: any real bug (a
 * wrong rank, a key rotated twice, a slot missed) moves outputs by O(1/n) or more of A_d, a f32 rounding by O(1e-7).
 * Measured when the bound was set, over the grids of tests/test_attn_ref.c and tests/test_attn.cu: worst err/bound
 * 0.026 (outputs) and 0.029 (probabilities) for kv_attend_cpu and kv_attend_chunk, vector and portable builds, 0.022
 * and 0.016 for the CUDA twin; worst errors 9.4e-7 of A_d and 1.5e-6 of p_i (CPU), 1.9e-6 and 3.2e-6 (twin). The
 * largest term is the sums' order: kv_attend_ref adds n weights in rank order, the CPU path in 8 partial sums, the
 * twin per split (random-walk growth, ~√n·u, against the bound's worst case n·u).
 * ------------------------------------------------------------------------------------------------------------- */
#define REF_U 5.9604644775390625e-8   /* 2^-24 */
#define REF_S_MAX 40.0

typedef struct {
    double worst_out, worst_prob;   /* worst |error| / bound, outputs and probabilities */
    double err_out, err_prob;       /* worst |error| / A_d (outputs) and worst |error| / p_i (probabilities) */
    long values;                    /* elements compared */
    int attends, failed, nonfinite, bad_data;
    char where[512];                /* the first failure */
} RefTally;

/* The reference's answer at one attention of one layer, and the bound of each element. */
typedef struct {
    int nh, hd, budget;
    int *n;                   /* (nh) live slots of each query head's lane */
    float *out, *prob;        /* (nh, hd) and (nh, budget): kv_attend_ref's output and probabilities */
    double *tol_out, *tol_prob;
    double *A;                /* (nh, hd) A_d = Σ_i p_i·|v_id| */
    double S;                 /* the largest S of the heads */
} RefAnswer;

static int ref_answer_init(RefAnswer *a, const KVCache *c) {
    a->nh = c->shape.n_heads; a->hd = c->shape.head_dim; a->budget = c->budget; a->S = 0;
    a->n = (int *)calloc((size_t)a->nh, sizeof(int));
    a->out = (float *)calloc((size_t)a->nh * a->hd, sizeof(float));
    a->prob = (float *)calloc((size_t)a->nh * a->budget, sizeof(float));
    a->tol_out = (double *)calloc((size_t)a->nh * a->hd, sizeof(double));
    a->tol_prob = (double *)calloc((size_t)a->nh * a->budget, sizeof(double));
    a->A = (double *)calloc((size_t)a->nh * a->hd, sizeof(double));
    return a->n && a->out && a->prob && a->tol_out && a->tol_prob && a->A ? 0 : -1;
}
static void ref_answer_free(RefAnswer *a) {
    free(a->n); free(a->out); free(a->prob); free(a->tol_out); free(a->tol_prob); free(a->A);
}

/* The stored vector of the lane's i-th live slot, decoded to f32 without RoPE (x: head_dim): read from the cache's
 * bytes here rather than through kv.c's readers, so the bound does not lean on the code it checks. */
static void ref_stored(const KVCache *c, const KVLane *ln, int i, int value, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim, b = 0;
    while (slot < ln->band_first[b]) b++;   /* the band holding the slot: bands own descending ranges of slot ids */
    size_t row = (size_t)(slot - ln->band_first[b]);
    if (value) kv_decode(x, c->band_vtype[b], ln->v[b] + row * c->band_vb[b], hd);
    else if (c->band_kchan[b]) tchan_key(c, ln, b, slot, x);   /* kgroup=channel: tests/test_kv_util.h */
    else kv_decode(x, c->band_ktype[b], ln->k[b] + row * c->band_kb[b], hd);
}

/* Right after kv_attend_ref(c, out, l, t, q): keep out and c->scores, and the bound of every element (above). */
static void ref_answer_take(RefAnswer *a, RefTally *ty, const KVCache *c, int l, const float *q, const float *out) {
    int hd = a->hd, n_kv = c->shape.n_kv_heads, G = a->nh / n_kv;
    float *x = (float *)malloc((size_t)hd * sizeof(float));
    memcpy(a->out, out, (size_t)a->nh * hd * sizeof(float));
    a->S = 0;
    for (int h = 0; h < a->nh; h++) {
        const KVLane *ln = &c->lanes[l * n_kv + h / G];
        int n = a->n[h] = ln->n_live;
        const float *p = c->scores + (size_t)h * a->budget;
        double *A = a->A + (size_t)h * hd;
        memcpy(a->prob + (size_t)h * a->budget, p, (size_t)n * sizeof(float));
        double qn = 0, kmax = 0;
        for (int d = 0; d < hd; d++) { qn += (double)q[(size_t)h * hd + d] * q[(size_t)h * hd + d]; A[d] = 0; }
        for (int i = 0; i < n; i++) {
            double kn = 0;
            ref_stored(c, ln, i, 0, x);
            for (int d = 0; d < hd; d++) kn += (double)x[d] * x[d];
            kmax = kn > kmax ? kn : kmax;
            ref_stored(c, ln, i, 1, x);
            for (int d = 0; d < hd; d++) A[d] += p[i] * fabs((double)x[d]);
        }
        double S = sqrt(qn) * sqrt(kmax) / sqrt((double)hd);
        if (!(S <= REF_S_MAX) && !ty->bad_data++)
            snprintf(ty->where, sizeof ty->where, "test data outside the bound's range: S = %.3g > %.0f", S, REF_S_MAX);
        a->S = S > a->S ? S : a->S;
        double ds = (hd + 12) * REF_U * S, e1 = 2 * ds + 4 * REF_U * S + (n + 12) * REF_U;
        for (int i = 0; i < n; i++) a->tol_prob[(size_t)h * a->budget + i] = 1.01 * 2 * e1 * p[i];
        for (int d = 0; d < hd; d++) a->tol_out[(size_t)h * hd + d] = 1.01 * 2 * (e1 + (n + 1) * REF_U) * A[d];
    }
    free(x);
}

/* Compare out (nh, hd) and prob (nh rows of pstride floats, rank order; NULL: outputs only) with the answer. */
static void ref_answer_check(const RefAnswer *a, RefTally *ty, const float *out, const float *prob, size_t pstride,
                             const char *where) {
    ty->attends++;
    for (int h = 0; h < a->nh; h++) {
        for (int d = 0; d < a->hd; d++) {
            size_t e = (size_t)h * a->hd + d;
            double err = fabs((double)out[e] - a->out[e]), tol = a->tol_out[e];
            if (!isfinite(out[e])) ty->nonfinite++;
            ty->values++;
            double r = tol > 0 ? err / tol : err > 0 ? INFINITY : 0;
            if (!(err <= tol)) {   /* NaN lands here too */
                if (!ty->failed++)
                    snprintf(ty->where, sizeof ty->where, "%s: head %d column %d: %.9g, reference %.9g, bound %.3g",
                             where, h, d, out[e], a->out[e], tol);
            }
            if (!(r <= ty->worst_out)) ty->worst_out = isnan(r) ? INFINITY : r;
            double rel = a->A[e] > 0 ? err / a->A[e] : err;
            if (!(rel <= ty->err_out)) ty->err_out = isnan(rel) ? INFINITY : rel;
        }
        if (!prob) continue;
        for (int i = 0; i < a->n[h]; i++) {
            size_t e = (size_t)h * a->budget + i;
            float x = prob[(size_t)h * pstride + i];
            double err = fabs((double)x - a->prob[e]), tol = a->tol_prob[e];
            if (!isfinite(x)) ty->nonfinite++;
            ty->values++;
            double r = tol > 0 ? err / tol : err > 0 ? INFINITY : 0, rel = a->prob[e] > 0 ? err / a->prob[e] : err;
            if (!(err <= tol) && !ty->failed++)
                snprintf(ty->where, sizeof ty->where, "%s: head %d rank %d: probability %.9g, reference %.9g, "
                         "bound %.3g", where, h, i, x, a->prob[e], tol);
            if (!(r <= ty->worst_prob)) ty->worst_prob = isnan(r) ? INFINITY : r;
            if (!(rel <= ty->err_prob)) ty->err_prob = isnan(rel) ? INFINITY : rel;
        }
    }
}

#endif
