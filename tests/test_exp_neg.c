/* test_exp_neg: kvlab's own exponential (exp_neg.h) and the SwiGLU gate built on it (run.c's swiglu):
 *  - exp_neg8 (AVX2) and exp_neg16 (AVX-512) give exp_neg's bits (portable C) on 8M points of [-90, 0], the edges,
 *    -0, NaN, -inf;
 *  - exp_neg within 2 ulp of glibc's expf on [-87, 0] (the documented accuracy: Cephes' polynomial, ~1e-7 relative);
 *  - swiglu gives, bit for bit, the definition written here in portable C (g / (1 + e) for g >= 0, g·e / (1 + e)
 *    for g < 0, e = exp_neg(-|g|)), for lengths with and without a vector tail, and is within 3e-7 relative of
 *    g / (1 + e^-g)·u computed in double. */
#include "run.h"
#include "exp_neg.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"

static uint64_t rng = 7;
static float urand(float lo, float hi) {   /* uniform [lo, hi) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)(rng >> 40) * 0x1p-24f;
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b)); }

static void test_exp(void) {
    enum { N = 1 << 23 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) x[i] = urand(-90.0f, 0.0f);
    float edge[] = {0.0f, -0.0f, -1e-30f, -87.0f, -87.0001f, -86.9999f, -88.0f, -1000.0f, -INFINITY, NAN, -0.5f, -0.6931472f};
    for (int i = 0; i < (int)(sizeof edge / sizeof *edge); i++) x[i] = edge[i];
#ifdef __AVX2__
    for (int i = 0; i + 8 <= N; i += 8) _mm256_storeu_ps(y + i, exp_neg8(_mm256_loadu_ps(x + i)));
    long diff = 0;
    for (int i = 0; i < N; i++) diff += !same_bits(y[i], exp_neg(x[i]));
    CHECK(diff == 0, "exp_neg8 (AVX2) gives exp_neg's bits on %d points of [-90, 0] and the edges (%ld differ)", N, diff);
#else
    SKIP("exp_neg8: this build has no AVX2 (exp_neg alone is used)");
#endif
#ifdef __AVX512F__
    for (int i = 0; i + 16 <= N; i += 16) _mm512_storeu_ps(y + i, exp_neg16(_mm512_loadu_ps(x + i)));
    long diff16 = 0;
    for (int i = 0; i < N; i++) diff16 += !same_bits(y[i], exp_neg(x[i]));
    CHECK(diff16 == 0, "exp_neg16 (AVX-512) gives exp_neg's bits on %d points of [-90, 0] and the edges (%ld differ)",
          N, diff16);
#else
    SKIP("exp_neg16: this build has no AVX-512");
#endif
    double worst = 0;
    for (int i = 0; i < N; i++) {
        if (!(x[i] >= -87.0f)) continue;
        float e = exp_neg(x[i]), r = expf(x[i]);
        double ulp = fabs((double)e - r) / (nextafterf(r, INFINITY) - r);
        worst = ulp > worst ? ulp : worst;
    }
    CHECK_LE(worst, 2.0, "exp_neg within 2 ulp of expf on [-87, 0] (worst %.2f ulp)", worst);
    CHECK(exp_neg(-100.0f) == 0 && exp_neg(-INFINITY) == 0 && isnan(exp_neg(NAN)) && exp_neg(0.0f) == 1.0f,
          "exp_neg: 0 below -87 and at -inf, NaN stays NaN, e^0 = 1");
    free(x);
    free(y);
}

static void test_swiglu(void) {
    int lens[] = {1, 7, 8, 9, 24, 25, 64, 1536, 1543};
    for (int li = 0; li < (int)(sizeof lens / sizeof *lens); li++) {
        int n = lens[li];
        float *h = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float));
        for (int i = 0; i < n; i++) {
            g[i] = h[i] = urand(-1.0f, 1.0f) * (i % 3 ? 12.0f : 120.0f);
            u[i] = urand(-2.0f, 2.0f);
        }
        if (n > 4) { g[0] = h[0] = -0.0f; g[1] = h[1] = NAN; g[2] = h[2] = 0.0f; g[3] = h[3] = -100.0f; }
        swiglu(h, u, n);
        long diff = 0;
        double worst = 0;
        for (int i = 0; i < n; i++) {
            float e = exp_neg(-fabsf(g[i])), want = (g[i] >= 0 ? g[i] : g[i] * e) / (1.0f + e) * u[i];
            diff += !same_bits(h[i], want);
            double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            if (isfinite(ref) && fabs(ref) > 1e-30) {
                double rel = fabs(h[i] - ref) / fabs(ref);
                worst = rel > worst ? rel : worst;
            }
        }
        CHECK(diff == 0, "swiglu over %d values: the portable definition's bits (%ld differ)", n, diff);
        CHECK_LE(worst, 3e-7, "swiglu over %d values: within 3e-7 relative of silu(g)·u in double (worst %.2e)", n, worst);
        free(h);
        free(u);
        free(g);
    }
}

int main(void) {
    test_exp();
    test_swiglu();
    CHECK_EXIT();
}
