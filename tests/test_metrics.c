/* test_metrics: the evaluation's per-token figures and the sampler on hand-made inputs whose values are known in
 * closed form, so that each is checked against arithmetic, not against kvlab's own output:
 *  - eval_kl_div: KL([.5,.5] ‖ [.9,.1]) = 0.5108 nats and the reverse 0.3681 (the direction matters), also inside a
 *    wider vocabulary (the 4-lane path) and on a 49,152-token row;
 *  - eval_logsumexp at extremes: ±1e38, 49,152 equal logits, terms that underflow, -inf, NaN;
 *  - eval_token: top-1 (ties to the first index), Δp, ΔNLL, NLL, and KL in the shadow-first direction;
 *  - sample(): top-p 0.5 on {0.6, 0.3, 0.1} draws only token 0 over 1,000 seeds, top-p 0.85 never token 2, and the
 *    temperature's effect on the frequencies within a binomial bound;
 *  - scan_max and sample_argmax (AVX-512 lanes) against their scalar loops on rows with NaNs, signed zeros, ties;
 *  - eval_select_kth (the top-B recall's thresholds) against qsort, bit for bit;
 *  - passkey_first_integer's edge cases (no digits, leading zeros, a second number, more than 9 digits); digits split
 *    over tokens are tests/test_passkey.sh's (SmolLM2 writes one digit per token).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "eval.h"
#include "tests/check.h"

/* logits of a distribution: log p (any constant shift gives the same softmax) */
static void logits_of(float *x, const double *p, int n) {
    for (int i = 0; i < n; i++) x[i] = p[i] > 0 ? (float)log(p[i]) : -INFINITY;
}

static double kl_of(const float *a, const float *b, int n) {
    return eval_kl_div(a, eval_logsumexp(a, n), b, eval_logsumexp(b, n), n);
}

/* Rounding bound for KL computed from float logits: each logit log p is rounded to float, |δ| ≤ 2⁻²⁴·|log p| ≤ 6e-8·|log p|;
 * ∂KL/∂(logit) is at most |log(p/q)| + 1 ≤ 3 for these distributions, over 4 logits: ≤ 4 · 3 · 6e-8 · 2.31 ≈ 1.7e-6
 * (|ln 0.1| = 2.31 the largest); the double sums add ~1e-16. 2e-6 holds with that margin. */
#define KL_TOL 2e-6

static void test_kl(void) {
    const double p[2] = {0.5, 0.5}, q[2] = {0.9, 0.1};
    float a[2], b[2];
    logits_of(a, p, 2);
    logits_of(b, q, 2);
    /* closed forms: Σ p ln(p/q) */
    double fwd = 0.5 * log(0.5 / 0.9) + 0.5 * log(0.5 / 0.1), rev = 0.9 * log(0.9 / 0.5) + 0.1 * log(0.1 / 0.5);
    double kf = kl_of(a, b, 2), kr = kl_of(b, a, 2);
    CHECK(fabs(fwd - 0.5108) <= 5e-5 && fabs(rev - 0.3681) <= 5e-5, "closed forms: KL([.5,.5] ‖ [.9,.1]) = %.6f, reverse %.6f",
          fwd, rev);
    CHECK_LE(fabs(kf - fwd), KL_TOL, "eval_kl_div([.5,.5] ‖ [.9,.1]) = %.7f nats (closed form %.7f, |err| %.1e ≤ %.0e)", kf,
             fwd, fabs(kf - fwd), KL_TOL);
    CHECK_LE(fabs(kr - rev), KL_TOL, "eval_kl_div([.9,.1] ‖ [.5,.5]) = %.7f nats (closed form %.7f, |err| %.1e ≤ %.0e)", kr,
             rev, fabs(kr - rev), KL_TOL);
    /* the same two distributions inside 11 tokens, on positions 5 and 8 (the 4-lane loop and the tail both used); the
       other 9 tokens have logit -200 on both sides: mass e^-200 ≈ 1e-87 each, nothing measurable */
    float a11[11], b11[11];
    for (int i = 0; i < 11; i++) a11[i] = b11[i] = -200.0f;
    a11[5] = a[0]; a11[8] = a[1];
    b11[5] = b[0]; b11[8] = b[1];
    double k11 = kl_of(a11, b11, 11), r11 = kl_of(b11, a11, 11);
    CHECK_LE(fabs(k11 - fwd) + fabs(r11 - rev), 2 * KL_TOL,
             "KL of the same pair inside an 11-token vocabulary: %.7f and reverse %.7f", k11, r11);
    /* a 49,152-token row (SmolLM2's vocabulary): p uniform, q with 0.9 on token 7 and 0.1 spread over the rest.
       KL(p ‖ q) = (1/V) ln((1/V)/0.9) + ((V-1)/V) ln((1/V)/(0.1/(V-1))), in closed form */
    int V = 49152;
    float *u = malloc((size_t)V * sizeof(float)), *w = malloc((size_t)V * sizeof(float));
    for (int i = 0; i < V; i++) { u[i] = 0.0f; w[i] = (float)log(0.1 / (V - 1)); }
    w[7] = (float)log(0.9);
    double want = (1.0 / V) * log((1.0 / V) / 0.9) + ((V - 1.0) / V) * log((1.0 / V) / (0.1 / (V - 1)));
    double got = kl_of(u, w, V);
    /* float logits of size ≤ 13.1: |δ| ≤ 7.8e-7 each, ∂KL/∂w_i = q_i - p_i summed over i in absolute value ≤ 2,
       so |err| ≤ 2 · 7.8e-7 = 1.6e-6 */
    CHECK_LE(fabs(got - want), 1.6e-6, "KL over 49,152 tokens: %.7f (closed form %.7f)", got, want);
    double same = kl_of(w, w, V);
    CHECK(same == 0.0, "KL of a row with itself is exactly 0 (got %.3g): clamped, never negative", same);
    free(u);
    free(w);
}

static void test_logsumexp(void) {
    float big[3] = {1e38f, 1e38f, 0.0f};
    double l = eval_logsumexp(big, 3);
    /* 1e38 + ln 2 rounds to 1e38 in double: the result is finite and exactly the float's value */
    CHECK(l == (double)1e38f, "logsumexp{1e38, 1e38, 0} = %.17g (no overflow; ln 2 is below the ulp of 1e38)", l);
    float small[2] = {-1e38f, -1e38f};
    l = eval_logsumexp(small, 2);
    CHECK(l == (double)-1e38f, "logsumexp{-1e38, -1e38} = %.17g (the max is subtracted first: no underflow to -inf)", l);
    float e88[5] = {88.0f, 88.0f, 88.0f, 88.0f, 88.0f};   /* e^88 overflows float, not the shifted sum */
    l = eval_logsumexp(e88, 5);
    CHECK_LE(fabs(l - (88.0 + log(5.0))), 1e-13, "logsumexp of five 88s = 88 + ln 5 = %.15f", l);
    int V = 49152;
    float *x = malloc((size_t)V * sizeof(float));
    for (int i = 0; i < V; i++) x[i] = 3.0f;
    l = eval_logsumexp(x, V);
    /* e^0 = 1 exactly, so the sum is exactly 49152: only log's rounding remains (≤ 1 ulp of 13.8, 2e-15) */
    CHECK_LE(fabs(l - (3.0 + log((double)V))), 1e-14, "logsumexp of 49,152 equal logits = 3 + ln 49152 = %.15f", l);
    for (int i = 0; i < V; i++) x[i] = -800.0f;   /* e^-800 underflows double: every term but the max is 0 */
    x[V - 1] = 0.0f;
    l = eval_logsumexp(x, V);
    CHECK(l == 0.0, "logsumexp{0, -800 × 49,151} = %.3g: the underflowing terms add exactly nothing", l);
    x[V - 1] = -INFINITY;
    x[12] = 0.0f;
    l = eval_logsumexp(x, V);
    CHECK(l == 0.0, "a -inf logit (probability 0) is allowed: %.3g", l);
    x[100] = NAN;
    l = eval_logsumexp(x, V);
    CHECK(isnan(l), "a NaN logit makes the result NaN (%.3g), never a plausible number", l);
    free(x);
}

static void test_token(void) {
    /* p (shadow) = [.5, .3, .2], q (policy) = [.2, .5, .3] */
    const double p[3] = {0.5, 0.3, 0.2}, q[3] = {0.2, 0.5, 0.3};
    float a[3], b[3];
    logits_of(a, p, 3);
    logits_of(b, q, 3);
    double la = eval_logsumexp(a, 3), lb = eval_logsumexp(b, 3);
    EvalToken t = eval_token(a, la, b, lb, 0, 3);
    double kl = 0.5 * log(0.5 / 0.2) + 0.3 * log(0.3 / 0.5) + 0.2 * log(0.2 / 0.3);
    /* float logits: |δ| ≤ 1.2e-7 each (half an ulp at |ln .2| = 1.61), so NLL = lse − x[y] is within 2.4e-7, ΔNLL
       (two of them) within 4.8e-7, each probability e^−NLL within 2.4e-7 relative: the sum of the three errors
       checked is ≤ 1e-6; 2e-6 leaves room for the double sums */
    CHECK(t.top1 == 0, "top-1: argmax q = 1, argmax p = 0 -> disagree (%d)", t.top1);
    CHECK_LE(fabs(t.nll - -log(0.2)) + fabs(t.dnll - log(0.5 / 0.2)) + fabs(t.dp - (0.2 - 0.5)), 2e-6,
             "y = 0: NLL %.6f (−ln .2), ΔNLL %.6f (ln 2.5), Δp %.6f (.2 − .5)", t.nll, t.dnll, t.dp);
    CHECK_LE(fabs(t.kl - kl), KL_TOL, "eval_token's KL is KL(p_shadow ‖ q) = %.6f (closed form %.6f; reverse would be %.6f)",
             t.kl, kl, 0.2 * log(0.2 / 0.5) + 0.5 * log(0.5 / 0.3) + 0.3 * log(0.3 / 0.2));
    t = eval_token(a, la, b, lb, 1, 3);
    CHECK_LE(fabs(t.dp - (0.5 - 0.3)) + fabs(t.dnll - log(0.3 / 0.5)), 2e-6, "y = 1: Δp %.6f (.5 − .3), ΔNLL %.6f (ln .6)",
             t.dp, t.dnll);
    /* the pair through eval_token: the shadow first */
    const double p2[2] = {0.5, 0.5}, q2[2] = {0.9, 0.1};
    float a2[2], b2[2];
    logits_of(a2, p2, 2);
    logits_of(b2, q2, 2);
    t = eval_token(a2, eval_logsumexp(a2, 2), b2, eval_logsumexp(b2, 2), 1, 2);
    CHECK_LE(fabs(t.kl - 0.5108256), 1e-6, "eval_token(shadow [.5,.5], policy [.9,.1]).kl = %.7f = 0.5108 (not 0.3681)", t.kl);
    CHECK(t.top1 == 1 && fabs(t.dp - (0.1 - 0.5)) <= 2e-6, "y = 1: top-1 1 (argmax of [.5,.5] is 0 by the first index, as "
          "that of [.9,.1]), Δp %.6f (.1 − .5)", t.dp);
    /* a shifted copy is the same distribution: KL 0, Δp 0, ΔNLL 0, top-1 1 */
    float c[3];
    for (int i = 0; i < 3; i++) c[i] = a[i] + 7.0f;
    t = eval_token(a, la, c, eval_logsumexp(c, 3), 2, 3);
    CHECK(t.top1 == 1 && t.kl <= 1e-12 && fabs(t.dp) <= 1e-6 && fabs(t.dnll) <= 1e-6,
          "the same distribution shifted by 7: top-1 1, KL %.1e, Δp %.1e, ΔNLL %.1e", t.kl, t.dp, t.dnll);
    /* ties: each side's argmax is its first largest logit */
    float t1[3] = {1, 1, 0}, t2[3] = {1, 1, 0}, t3[3] = {0, 1, 1};
    EvalToken x = eval_token(t1, eval_logsumexp(t1, 3), t2, eval_logsumexp(t2, 3), 0, 3);
    EvalToken y = eval_token(t1, eval_logsumexp(t1, 3), t3, eval_logsumexp(t3, 3), 0, 3);
    CHECK(x.top1 == 1 && y.top1 == 0, "ties: {1,1,0} vs itself agrees (%d); {1,1,0} (argmax 0) vs {0,1,1} (argmax 1) "
          "does not (%d)", x.top1, y.top1);
}

/* Draws with sample() from the distribution p at temperature T and top-p topp, one fresh sampler per seed
 * 1..n_seeds (the first draw of each); counts per token in cnt. */
static void draw(const double *p, int n, float T, float topp, int n_seeds, long *cnt) {
    Sampler sp;
    float x[8];
    for (int i = 0; i < n; i++) cnt[i] = 0;
    for (int s = 1; s <= n_seeds; s++) {
        if (sampler_init(&sp, n, T, topp, (uint64_t)s)) { CHECK(0, "sampler_init"); return; }
        logits_of(x, p, n);
        int k = sample(&sp, x);
        if (k >= 0 && k < n) cnt[k]++;
        sampler_free(&sp);
    }
}

/* |count − N·q| ≤ 5·sqrt(N·q·(1−q)) for each token: a correct sampler's count is Binomial(N, q); the normal tail
 * beyond 5 standard deviations is 5.7e-7 (two-sided), so with fixed seeds a correct sampler fails with probability
 * below 1e-6 per token. (rand_f32 has 24 bits: a bias of at most 2^-24 per draw, nothing at this N.) */
static int within_binomial(const long *cnt, const double *q, int n, long N, char *why, size_t cap) {
    int ok = 1;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        double mean = N * q[i], sd = sqrt(N * q[i] * (1 - q[i])), d = fabs(cnt[i] - mean);
        if (!(d <= 5 * sd)) ok = 0;
        off += (size_t)snprintf(why + off, off < cap ? cap - off : 0, "%s%ld (%.0f ± %.0f)", i ? ", " : "", cnt[i],
                                mean, 5 * sd);
    }
    return ok;
}

static void test_sample(void) {
    const double p[3] = {0.6, 0.3, 0.1};
    long c[3];
    char why[256];
    /* top-p 0.5: token 0 alone already holds 0.6 ≥ 0.5, so the nucleus is {0} */
    draw(p, 3, 1.0f, 0.5f, 1000, c);
    CHECK(c[0] == 1000, "top-p 0.5 on {0.6, 0.3, 0.1}: token 0 in all 1,000 seeds (counts %ld %ld %ld)", c[0], c[1], c[2]);
    /* top-p 0.85: 0.6 < 0.85 ≤ 0.9, so the nucleus is {0, 1}, renormalized to {2/3, 1/3} */
    draw(p, 3, 1.0f, 0.85f, 1000, c);
    const double q85[3] = {2.0 / 3, 1.0 / 3, 0};
    int ok = within_binomial(c, q85, 2, 1000, why, sizeof why);
    CHECK(c[2] == 0 && c[0] + c[1] == 1000 && ok, "top-p 0.85: token 2 never drawn in 1,000 seeds; tokens 0, 1: %s", why);
    /* top-p 1: the whole distribution */
    long N = 20000;
    draw(p, 3, 1.0f, 1.0f, (int)N, c);
    ok = within_binomial(c, p, 3, N, why, sizeof why);
    CHECK(ok, "T 1, top-p 1: %ld draws follow {0.6, 0.3, 0.1}: %s", N, why);
    /* temperature T: q ∝ p^(1/T). T 2: ∝ sqrt(p) = {.4727, .3343, .1930}; T 0.5: ∝ p² = {.7826, .1957, .0217}. A
       sampler that ignored T would give 0.6 for token 0, 25 and 35 standard deviations away at this N. */
    const double Ts[2] = {2.0, 0.5};
    for (int k = 0; k < 2; k++) {
        double q[3], z = 0;
        for (int i = 0; i < 3; i++) z += q[i] = pow(p[i], 1 / Ts[k]);
        for (int i = 0; i < 3; i++) q[i] /= z;
        draw(p, 3, (float)Ts[k], 1.0f, (int)N, c);
        ok = within_binomial(c, q, 3, N, why, sizeof why);
        CHECK(ok, "T %.1f, top-p 1: %ld draws follow p^(1/T) normalized {%.4f, %.4f, %.4f}: %s", Ts[k], N, q[0], q[1], q[2],
              why);
    }
    draw(p, 3, 0.0f, 0.9f, 100, c);
    CHECK(c[0] == 100, "T 0: the argmax in every seed (%ld of 100)", c[0]);
}

static void test_passkey_parser(void) {
    /* README: the first run of decimal digits as a number, leading zeros dropped, at most 9 digits read; -1 (null,
       "no_number") without a digit */
    struct { const char *text; long want; } cases[] = {
        {"", -1}, {" I do not know.", -1}, {" ٣٤", -1} /* Arabic-Indic digits are not decimal ASCII digits */,
        {" 12345.", 12345}, {"12345", 12345}, {" 12345. Remember it. 12345", 12345},
        {" 007", 7}, {" 00012345", 12345}, {"0", 0}, {" 000.", 0}, {"-42", 42} /* no sign is read */,
        {" 12 34", 12}, {"key: abc42def7", 42}, {" 1234567890123", 123456789}, {" 0000000000001234567891", 123456789},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        long got = passkey_first_integer(cases[i].text);
        if (got != cases[i].want) { bad++; printf("  '%s': %ld, want %ld\n", cases[i].text, got, cases[i].want); }
    }
    CHECK(bad == 0, "passkey_first_integer on %zu edge cases (no digits, leading zeros, a second number, > 9 digits, "
          "sign, non-ASCII digits): %d wrong", sizeof cases / sizeof cases[0], bad);
}

/* scan_max and sample_argmax against their scalar definitions (the loop each documents) on rows that hit the
 * vector lanes' edges: NaNs first and inside, signed zeros, ties (the first index), infinities, every length 1..70
 * (a partial block of 16 at each end), the maximum at each position */
static int argmax_def(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}
static float max_def(const float *x, int n) {
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}
static void test_argmax(void) {
    float x[70];
    int bad = 0, cases = 0;
    uint64_t rng = 11;
    for (int n = 1; n <= 70; n++)
        for (int kind = 0; kind < 7; kind++)
            for (int at = 0; at < n; at++) {
                for (int i = 0; i < n; i++) x[i] = (float)(int)(splitmix64(&rng) % 5) - 2.0f;   /* many ties */
                if (kind == 1) x[at] = NAN;
                if (kind == 2) x[0] = NAN, x[at] = 7;
                if (kind == 3) for (int i = 0; i < n; i++) x[i] = i % 2 ? -0.0f : 0.0f;
                if (kind == 4) x[at] = INFINITY;
                if (kind == 5) for (int i = 0; i < n; i++) x[i] = i == at ? -1.0f : -INFINITY;
                if (kind == 6) x[at] = 3, x[n - 1 - at] = 3;   /* two maxima */
                float m = scan_max(x, n), md = max_def(x, n);
                int same = (m != m && md != md) || m == md;
                bad += !same || sample_argmax(x, n) != argmax_def(x, n);
                cases++;
            }
    CHECK(bad == 0, "scan_max and sample_argmax equal their scalar definitions on %d rows of 1..70 logits (NaN first "
          "or inside, signed zeros, ties, infinities): %d differ", cases, bad);
}

/* descending, for qsort (no NaN among the inputs it sorts) */
static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* eval_select_kth against qsort: every k of rows of 1..300 values and of probability-like rows of 8,192 (exponents
 * over 40 binades, the top-B recall's inputs), with many ties, signed zeros, negatives and infinities: the k-th
 * largest is the sorted row's element k - 1, bit for bit (and -0 below +0) */
static void test_select_kth(void) {
    enum { N = 8192 };
    static double x[N], s[N];
    static uint64_t buf[N];
    static int k[N];
    static double thr[N];
    uint64_t rng = 5;
    int bad = 0, rows = 0, sel = 0;
    for (int n = 1; n <= 300 + 5; n++) {
        int big = n > 300, len = big ? N : n, kind = n % 5;
        for (int i = 0; i < len; i++) {
            uint64_t r = splitmix64(&rng);
            if (big) x[i] = ldexp((double)(r >> 11) * 0x1p-53, -(int)(r % 40));   /* (0, 1) over 40 binades */
            else if (kind == 0) x[i] = (double)(int)(r % 7) - 3.0;                 /* ties */
            else if (kind == 1) x[i] = r % 3 ? 0.0 : -0.0;                         /* signed zeros only */
            else if (kind == 2) x[i] = r % 9 == 0 ? INFINITY : r % 9 == 1 ? -INFINITY : (double)(r >> 11) * 0x1p-40 - 1e3;
            else x[i] = (double)(r >> 11) * 0x1p-53 * (kind == 3 ? 1e-300 : 1.0);   /* distinct, tiny or in (0, 1) */
        }
        if (big && n % 2) for (int i = 0; i < len; i += 3) x[i] = x[0];   /* a third of the row one value */
        memcpy(s, x, (size_t)len * sizeof(double));
        qsort(s, (size_t)len, sizeof(double), cmp_desc);
        for (int i = 1; i < len; i++)   /* qsort keeps -0 and +0 in any order: -0 below +0 */
            if (s[i - 1] == 0 && s[i] == 0 && signbit(s[i - 1]) && !signbit(s[i])) { s[i - 1] = 0.0; s[i] = -0.0; i = 0; }
        int nk = big ? 64 : len;
        for (int j = 0; j < nk; j++) k[j] = big ? 1 + (int)(splitmix64(&rng) % len) : j + 1;
        eval_select_kth(x, len, k, nk, thr, buf);
        for (int j = 0; j < nk; j++) bad += memcmp(&thr[j], &s[k[j] - 1], sizeof(double)) != 0;
        rows++;
        sel += nk;
    }
    CHECK(bad == 0, "eval_select_kth gives the sorted row's k-th value, bit for bit, in %d selections on %d rows (ties, "
          "signed zeros, infinities, 8,192 values over 40 binades): %d differ", sel, rows, bad);
}

int main(void) {
    test_select_kth();
    test_argmax();
    test_kl();
    test_logsumexp();
    test_token();
    test_sample();
    test_passkey_parser();
    CHECK_EXIT();
}
