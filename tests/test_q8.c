/* test_q8: int8 weights (model.bin wtype 1, quant.h, run.c's q8 matmul, export --wtype q8):
 *  - kv.h's f16 conversions (the scales') against F16C's, which the AVX2 kernel uses;
 *  - group quantization: values in [-127, 127], error at most half a step, NaN and infinities defined;
 *  - the q8 matmul over odd shapes: bit-identical to the documented arithmetic (int32 sums of 4 products, 8 f32
 *    lanes, lanes summed in order), n tokens at once identical to one at a time, 1 and 2 threads identical, and the
 *    error against the exact f64 product of the f32 weights within a bound derived from the two quantizations;
 *  - export: q8 sizes, a tied model written untied with its embedding quantized, llama2.c and random exports of the
 *    same weights byte-identical, columns not a multiple of 32 refused; the loader refuses wrong sizes and shapes;
 *  - a tiny random model's logits with q8 weights close to f32 weights (bound derived below, error printed).
 * The CLI side (generate, -chunk, threads, bad flags) is tests/test_q8.sh. */
#include "run.h"
#include "export.h"
#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "tests/check.h"
#include "tests/matmul_check.h"

#define TMP "tests/tmp"

static uint64_t rng_state = 42;
static float urand(void) { return (float)(splitmix64(&rng_state) >> 40) * 0x1p-23f - 1.0f; }   /* uniform [-1, 1) */

/* The q8 scales use kv.h's f16 conversions; the AVX2 kernel converts with F16C's vcvtph2ps: they must agree. */
static void test_f16(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = kv_f16_to_f32((uint16_t)h);
        if (!isnan(a) && kv_f32_to_f16(a) != h) bad++;   /* every f16 value round-trips */
    }
    CHECK(bad == 0, "kv.h f32 -> f16 -> f32 round-trips all 65536 f16 values (%d bad)", bad);
#ifdef __F16C__
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = kv_f16_to_f32((uint16_t)h), b = _cvtsh_ss((uint16_t)h);
        if (memcmp(&a, &b, 4) && !(isnan(a) && isnan(b))) bad++;
    }
    CHECK(bad == 0, "kv.h f16 -> f32 equals F16C's vcvtph2ps (the AVX2 kernel's) on all 65536 values (%d differ)", bad);
    bad = 0;
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)((urand() + 1) * 0x7fffffff) ^ (uint32_t)i;   /* any bit pattern */
        float f;
        memcpy(&f, &u, 4);
        uint16_t want = (uint16_t)_cvtss_sh(f, 0 /* round to nearest even */), got = kv_f32_to_f16(f);
        if (got != want && !(isnan(f) && (got & 0x7c00) == 0x7c00 && (got & 0x3ff))) bad++;
    }
    CHECK(bad == 0, "kv.h f32 -> f16 rounds as F16C's vcvtps2ph (nearest even) on 1e6 bit patterns (%d differ)", bad);
#else
    SKIP("no F16C: the f16 conversions are not compared with the hardware");
#endif
}

static void test_group(void) {
    float x[Q8_GROUP];
    int8_t q[Q8_GROUP];
    int bad = 0;
    for (int trial = 0; trial < 1000; trial++) {
        float s = powf(10.0f, 6 * urand());
        for (int j = 0; j < Q8_GROUP; j++) x[j] = s * urand();
        float d = quant_q8_group(q, x), amax = 0;
        for (int j = 0; j < Q8_GROUP; j++) amax = fmaxf(amax, fabsf(x[j]));
        if (d != amax / 127.0f) bad++;
        for (int j = 0; j < Q8_GROUP; j++)
            if (q[j] < -127 || !(fabsf(x[j] - d * q[j]) <= 0.5f * d * (1 + 1e-6f))) bad++;
    }
    CHECK(bad == 0, "quant_q8_group: d = max|x|/127, q in [-127, 127], |x - d q| <= d/2 over 1000 groups (%d bad)", bad);
    memset(x, 0, sizeof x);
    float d0 = quant_q8_group(q, x);
    x[0] = NAN; x[3] = 2;
    float d1 = quant_q8_group(q, x);
    int nan_ok = d1 == 2 / 127.0f && q[0] == 0 && q[3] == 127;
    x[1] = INFINITY;
    float d2 = quant_q8_group(q, x);
    int inf_ok = isinf(d2);
    for (int j = 0; j < Q8_GROUP; j++) inf_ok &= q[j] == 0;
    CHECK(d0 == 0 && nan_ok && inf_ok, "zero group has d = 0; a NaN value becomes 0; a group with an infinity gets "
          "d = inf and zeros (defined, dequantizes to NaN)");
    /* quant_q8_group (vector where the build has AVX-512) against the scalar definition, bit for bit: halves that
       round away from zero (127 in the group makes d = 1, so v = x exactly), just below a half, signed zeros,
       subnormals, NaN and infinities, then random groups of every magnitude */
    static const float edge[] = {127.0f, 0.5f, -0.5f, 1.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.49999997f,
                                 -0.0f, 1e-45f, -3e-39f, 126.49999f, -127.0f, 63.5f, -63.5f, 2.4999998f, 3.5f,
                                 -1.0000001f, 0.50000006f, -126.50001f, 100.5f, -99.5f, 7.0f, -7.5f, 0.0f, 12.5f,
                                 -12.5f, 64.0f, -64.5f, 1.0f, -1.5f};
    int8_t qc[Q8_GROUP];
    int diff = 0, groups = 0;
    for (int trial = 0; trial < 20003; trial++, groups++) {
        if (trial == 0) memcpy(x, edge, sizeof x);
        else if (trial == 1) { memcpy(x, edge, sizeof x); x[0] = NAN; x[7] = INFINITY; }
        else if (trial == 2) { memcpy(x, edge, sizeof x); x[0] = -INFINITY; }
        else {
            float sc = powf(10.0f, 12 * urand() - 6);
            for (int j = 0; j < Q8_GROUP; j++) x[j] = sc * urand();
            if (trial % 7 == 0) x[trial % Q8_GROUP] = NAN;
        }
        float dv = quant_q8_group(q, x), dc = quant_q8_group_c(qc, x);
        diff += memcmp(&dv, &dc, sizeof dv) != 0 || memcmp(q, qc, sizeof q) != 0;
    }
    CHECK(diff == 0, "quant_q8_group gives quant_q8_group_c's bits (scale and values) over %d groups: edge values "
          "(halves, just below halves, signed zeros, subnormals, NaN, infinities) and random magnitudes (%d differ)",
          groups, diff);
}

/* The documented q8 arithmetic, written out: per group 8 int32 sums of 4 products, acc_m += (float)s_m * (dw*dx),
 * lanes summed 0..7. */
static float dot_q8_spec(const BlockQ8 *w, const float *x, int cols) {
    float acc[8] = {0};
    for (int g = 0; g < cols / 32; g++) {
        int8_t xq[32];
        float dx = quant_q8_group(xq, x + 32 * g), sc = kv_f16_to_f32(w[g].d) * dx;
        for (int m = 0; m < 8; m++) {
            int32_t s = 0;
            for (int k = 0; k < 4; k++) s += w[g].q[4 * m + k] * xq[4 * m + k];
            acc[m] += (float)s * sc;
        }
    }
    float s = acc[0];
    for (int m = 1; m < 8; m++) s += acc[m];
    return s;
}

/* Quantize W (rows, cols) f32 as export does. */
static BlockQ8 *quantize_matrix(const float *W, int rows, int cols) {
    BlockQ8 *b = malloc((size_t)rows * cols / 32 * sizeof *b);
    for (size_t g = 0; g < (size_t)rows * cols / 32; g++) b[g].d = kv_f32_to_f16(quant_q8_group(b[g].q, W + 32 * g));
    return b;
}

static void test_matmul(void) {
    static const int shapes[][2] = {{1, 32}, {3, 64}, {37, 96}, {100, 576}, {513, 160}, {7, 1536}};
    static const int ns[] = {1, 2, 3, 4, 5, 9, 17, 23, 64, 70};   /* above 16: the chunk path's tiles (row pairs) */
    int spec_bad = 0, n_bad = 0, thr_bad = 0, bound_bad = 0;
    double worst = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], nmax = 70;
        float *W = malloc((size_t)rows * cols * 4), *x = malloc((size_t)nmax * cols * 4);
        float *y1 = malloc((size_t)nmax * rows * 4), *yn = malloc((size_t)nmax * rows * 4);
        for (size_t i = 0; i < (size_t)rows * cols; i++) W[i] = urand() / sqrtf((float)cols);
        /* activations with a few outlier channels, as real residual streams have */
        for (size_t i = 0; i < (size_t)nmax * cols; i++) x[i] = urand() * (i % 97 == 5 ? 40.0f : 1.0f);
        BlockQ8 *B = quantize_matrix(W, rows, cols);
        Matrix M = {B, WTYPE_Q8};
        for (int t = 0; t < nmax; t++) matmul(y1 + (size_t)t * rows, x + (size_t)t * cols, M, rows, cols);
        for (int t = 0; t < nmax; t++)
            for (int i = 0; i < rows; i++) {
                float want = dot_q8_spec(B + (size_t)i * cols / 32, x + (size_t)t * cols, cols);
                if (memcmp(&want, &y1[(size_t)t * rows + i], 4)) spec_bad++;
                /* the bound: |w x - ŵ x̂| <= Σ_j |w_j| |x_j - x̂_j| + |x̂_j| |w_j - ŵ_j|, with |x - x̂| <= dx/2 and
                 * |w - ŵ| <= dw/2 + 127 |dw - f16(dw)| (the value was quantized with the f32 scale, stored with the
                 * f16 one), plus f32 rounding of the sum: cols · 2^-24 · Σ|ŵ x̂| (a loose upper bound) */
                double exact = 0, bound = 0, mag = 0;
                for (int g = 0; g < cols / 32; g++) {
                    const float *wr = W + (size_t)i * cols + 32 * g, *xr = x + (size_t)t * cols + 32 * g;
                    int8_t xq[32], wq[32];
                    float dx = quant_q8_group(xq, xr), dw = quant_q8_group(wq, wr);
                    double dws = kv_f16_to_f32(kv_f32_to_f16(dw)), ew = dw / 2.0 + 127 * fabs(dw - dws);
                    for (int k = 0; k < 32; k++) {
                        exact += (double)wr[k] * xr[k];
                        bound += fabs(wr[k]) * dx / 2.0 + fabs((double)dx * xq[k]) * ew;
                        mag += fabs(dws * wq[k] * dx * xq[k]);
                    }
                }
                bound += cols * 0x1p-24 * mag;
                double err = fabs(y1[(size_t)t * rows + i] - exact);
                if (!(err <= bound)) bound_bad++;
                if (bound > 0 && err / bound > worst) worst = err / bound;
            }
        n_bad += matmul_n_differs(yn, y1, x, M, rows, cols, ns, (int)(sizeof ns / sizeof *ns));
        thr_bad += matmul_threads_differ(yn, x, M, rows, cols, nmax);
        free(W); free(x); free(y1); free(yn); free(B);
    }
    CHECK(spec_bad == 0, "q8 matmul is bit-identical to the documented arithmetic (6 shapes, rows 1..513, cols 32..1536; "
          "%d outputs differ)", spec_bad);
    CHECK(n_bad == 0, "q8 matmul_n for n = 1, 2, 3, 4, 5, 9, 17, 23, 64, 70 tokens equals one token at a time (%d cases "
          "differ)", n_bad);
#ifdef _OPENMP
    CHECK(thr_bad == 0, "q8 matmul_n: 1 and 2 threads bit-identical (%d shapes differ)", thr_bad);
#else
    SKIP("no OpenMP: threads not compared");
#endif
    CHECK(bound_bad == 0, "q8 matmul error against the exact f64 product of the f32 weights within the derived bound "
          "(worst error/bound %.3f, %d outside)", worst, bound_bad);
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(*n);
    if (fread(p, 1, *n, f) != *n) { free(p); p = NULL; }
    fclose(f);
    return p;
}
/* A legacy llama2.c checkpoint holding an f32 model.bin's weights (untied, so the classifier is written apart). */
static int write_llama2c(const char *path, const Model *m) {
    const Config *c = &m->config;
    size_t D = c->dim, H = c->hidden_dim, L = c->n_layers, V = c->vocab_size, KV = (size_t)c->n_kv_heads * c->head_dim;
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int32_t hp[7] = {c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, -c->vocab_size, c->seq_len};
    fwrite(hp, 4, 7, f);
    fwrite(m->w.token_embedding, 4, V * D, f);
    for (size_t l = 0; l < L; l++) fwrite(m->w.layers[l].attn_norm, 4, D, f);
#define MATS(field, n) for (size_t l = 0; l < L; l++) fwrite(m->w.layers[l].field.data, 4, n, f)
    MATS(wq, D * D); MATS(wk, KV * D); MATS(wv, KV * D); MATS(wo, D * D);
    for (size_t l = 0; l < L; l++) fwrite(m->w.layers[l].ffn_norm, 4, D, f);
    MATS(w1, H * D); MATS(w2, D * H); MATS(w3, H * D);
#undef MATS
    fwrite(m->w.final_norm, 4, D, f);
    float *freq = calloc((size_t)c->seq_len * c->head_dim, 4);   /* legacy freq_cis, unused by export */
    fwrite(freq, 4, (size_t)c->seq_len * c->head_dim, f);
    free(freq);
    fwrite(m->w.classifier.data, 4, V * D, f);
    return fclose(f);
}

static void test_export_and_load(void) {
    char err[EXPORT_ERR_LEN];
    ExportRandomSpec s = {64, 96, 2, 4, 2, 0, 50, 64, 7, 10000.0f, 1 /* tied */, 0, EXPORT_WTYPE_Q8, NULL};
    int rc = export_random(&s, TMP "/q8_tied.bin", err, sizeof err);
    s.wtype = EXPORT_WTYPE_F32;
    rc |= export_random(&s, TMP "/q8_tied_f32.bin", err, sizeof err);
    Model q, f;
    char why[512];
    if (rc || model_open(&q, TMP "/q8_tied.bin", why, sizeof why) || model_open(&f, TMP "/q8_tied_f32.bin", why, sizeof why)) {
        CHECK(0, "export and load a tied q8 random model: %s %s", err, why);
        return;
    }
    /* sizes: per layer 4 matrices of (64,64)/(32,64) and 3 of (96,64)/(64,96), 34 bytes per 32 values */
    size_t expect = 0, a64 = 63;
#define T(bytes) expect += ((size_t)(bytes) + a64) & ~a64
    T(50 * 64 * 4);
    for (int l = 0; l < 2; l++) {
        T(64 * 4); T(64 * 2 * 34); T(32 * 2 * 34); T(32 * 2 * 34); T(64 * 2 * 34); T(64 * 4);
        T(96 * 2 * 34); T(64 * 3 * 34); T(96 * 2 * 34);
    }
    T(64 * 4); T(50 * 2 * 34);
#undef T
    uint64_t w_off;
    memcpy(&w_off, q.data + 80, 8);
    size_t got = q.size - (size_t)w_off;
    CHECK(q.config.wtype == WTYPE_Q8 && q.config.tied == 0 && q.w.classifier.type == WTYPE_Q8 && got == expect,
          "tied q8 export: wtype 1, written untied with a q8 classifier, weight section %zu bytes (expected %zu)", got,
          expect);
    BlockQ8 *cls = quantize_matrix(f.w.token_embedding, 50, 64);
    CHECK(!memcmp(cls, q.w.classifier.data, 50 * 2 * 34) && !memcmp(f.w.token_embedding, q.w.token_embedding, 50 * 64 * 4),
          "tied q8 export: the classifier is the f32 model's embedding quantized, the embedding stays f32");
    int same = !memcmp(f.w.layers[1].attn_norm, q.w.layers[1].attn_norm, 64 * 4);
    BlockQ8 *w2 = quantize_matrix(f.w.layers[1].w2.data, 64, 96);
    same &= !memcmp(w2, q.w.layers[1].w2.data, 64 * 3 * 34);
    CHECK(same, "q8 export: blk.1 ffn_down is the f32 values quantized (quant.h), norms copied");
    free(cls);
    free(w2);
    model_close(&q);

    /* the same weights through llama2.c and --random give the same q8 file */
    s.tied = 0;
    rc = export_random(&s, TMP "/q8_r_f32.bin", err, sizeof err);
    s.wtype = EXPORT_WTYPE_Q8;
    rc |= export_random(&s, TMP "/q8_r.bin", err, sizeof err);
    Model r;
    if (!rc && !model_open(&r, TMP "/q8_r_f32.bin", why, sizeof why)) {
        rc |= write_llama2c(TMP "/q8_l2c.ckpt", &r);
        model_close(&r);
        rc |= export_from_llama2c(TMP "/q8_l2c.ckpt", NULL, TMP "/q8_l2c.bin", EXPORT_WTYPE_Q8, err, sizeof err);
        size_t n1 = 0, n2 = 0;
        uint8_t *a = slurp(TMP "/q8_r.bin", &n1), *b = slurp(TMP "/q8_l2c.bin", &n2);
        CHECK(!rc && a && b && n1 == n2 && !memcmp(a, b, n1), "export --llama2c --wtype q8 of a random model's weights "
              "equals export --random --wtype q8, byte for byte (%zu and %zu bytes) %s", n1, n2, rc ? err : "");
        /* loader: a weight section one block short, and a header saying dim 48 */
        if (a && n1 > 256) {
            uint8_t *c = malloc(n1);
            memcpy(c, a, n1);
            uint64_t wb;
            memcpy(&wb, c + 88, 8);
            wb -= 64;
            memcpy(c + 88, &wb, 8);
            uint64_t fb = n1 - 64;
            memcpy(c + 96, &fb, 8);
            Model m;
            memset(&m, 0, sizeof m);
            int r1 = model_parse(&m, c, n1 - 64, why, sizeof why);
            free(m.w.layers);
            CHECK(r1 != 0 && strstr(why, "weight section"), "loader: q8 weight section 64 bytes short refused: %s", why);
            memcpy(c, a, n1);
            int32_t wt = 0;   /* a q8 file relabelled f32: its weight section is not the f32 size */
            memcpy(c + 48, &wt, 4);
            memset(&m, 0, sizeof m);
            r1 = model_parse(&m, c, n1, why, sizeof why);
            free(m.w.layers);
            CHECK(r1 != 0 && strstr(why, "weight section"), "loader: a q8 file relabelled wtype 0 refused: %s", why);
            memcpy(c, a, n1);
            int32_t d48 = 48;
            memcpy(c + 8, &d48, 4);
            memset(&m, 0, sizeof m);
            r1 = model_parse(&m, c, n1, why, sizeof why);
            free(m.w.layers);
            CHECK(r1 != 0 && strstr(why, "multiples of 32"), "loader: q8 with dim 48 refused: %s", why);
            memcpy(c, a, n1);
            wt = 2;
            memcpy(c + 48, &wt, 4);
            memset(&m, 0, sizeof m);
            r1 = model_parse(&m, c, n1, why, sizeof why);
            free(m.w.layers);
            CHECK(r1 != 0 && strstr(why, "wtype"), "loader: wtype 2 refused: %s", why);
            free(c);
        }
        free(a);
        free(b);
    } else {
        CHECK(0, "random f32/q8 exports: %s %s", err, why);
    }
    ExportRandomSpec bad = {48, 96, 1, 4, 2, 0, 50, 64, 7, 10000.0f, 0, 0, EXPORT_WTYPE_Q8, NULL};
    rc = export_random(&bad, TMP "/q8_bad.bin", err, sizeof err);
    CHECK(rc != 0 && strstr(err, "multiple of 32"), "export: q8 with dim 48 refused: %s", err);
    FILE *gone = fopen(TMP "/q8_bad.bin", "rb");
    CHECK(gone == NULL, "export: no output file left behind after the refusal");
    if (gone) fclose(gone);
    model_close(&f);
}

/* Logits of a tiny random model with q8 and f32 weights. The bound: one q8 matmul has a relative RMS error of about
 * sqrt(ew² + ex²), with ew = (1/127)/sqrt(12)·sqrt(3) = 0.0039 for uniform weights (step max|w|/127, max|w| ≈ sqrt(3)
 * RMS) and ex ≈ 2.5/127/sqrt(12) = 0.0057 for near-Gaussian activations (max of 32 ≈ 2.5 RMS): 0.0069. Errors of
 * the 7·L + 1 matmuls on the path to the logits add independently: 0.0069·sqrt(7L+1) relative RMS on the logits;
 * the test allows twice that. (It is pessimistic: the residual stream carries the f32 embedding past every block,
 * and the measured error, printed, is several times smaller.) */
static void test_model_logits(void) {
    char err[EXPORT_ERR_LEN], why[512];
    const int L = 3;
    ExportRandomSpec s = {128, 320, L, 8, 2, 0, 300, 64, 11, 10000.0f, 0, 0, EXPORT_WTYPE_F32, NULL};
    int rc = export_random(&s, TMP "/q8_m_f32.bin", err, sizeof err);
    s.wtype = EXPORT_WTYPE_Q8;
    rc |= export_random(&s, TMP "/q8_m.bin", err, sizeof err);
    Model f, q;
    if (rc || model_open(&f, TMP "/q8_m_f32.bin", why, sizeof why) || model_open(&q, TMP "/q8_m.bin", why, sizeof why)) {
        CHECK(0, "export tiny f32/q8 models: %s %s", err, why);
        return;
    }
    RunState sf, sq;
    KVSpec spec;
    KVCache cf, cq;
    KVShape shape = model_kv_shape(&f, 64);
    state_init(&sf, &f.config);
    state_init(&sq, &q.config);
    kv_spec_parse(&spec, "full", KV_F32, why, sizeof why);
    kv_cache_init(&cf, &shape, &spec, why, sizeof why);
    kv_cache_init(&cq, &shape, &spec, why, sizeof why);
    double se = 0, ss = 0;
    for (int t = 0; t < 40; t++) {
        int tok = (t * 37 + 11) % 300;
        forward(&f, &sf, &cf, tok, t);
        forward(&q, &sq, &cq, tok, t);
        for (int i = 0; i < 300; i++) {
            double d = sf.logits[i] - sq.logits[i];
            se += d * d;
            ss += (double)sf.logits[i] * sf.logits[i];
        }
    }
    double rel = sqrt(se / ss), bound = 2 * 0.0069 * sqrt(7.0 * L + 1);
    CHECK_LE(rel, bound, "tiny model (3 layers, dim 128): q8 logits within relative RMS %.4f of f32 over 40 positions "
             "(measured %.4f)", bound, rel);
    kv_cache_free(&cf);
    kv_cache_free(&cq);
    state_free(&sf);
    state_free(&sq);
    model_close(&f);
    model_close(&q);
}

int main(void) {
    test_f16();
    test_group();
    test_matmul();
    test_export_and_load();
    test_model_logits();
    CHECK_EXIT();
}
