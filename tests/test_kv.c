/* test_kv.c: the cache itself: storage types (error bounds on random and adversarial vectors, no NaN/inf, exact zeros),
 * the byte accounting for SmolLM2's shape against a formula computed here, byte budgets, spec errors, and the
 * attention: policies with room for everything are bit-identical to full, pos=cache is bit-identical to pos=orig
 * with nothing evicted and equals a dense rank-rotating reference written here with eviction, the residual keeps the
 * newest tokens exact, and 1 or 2 OpenMP threads give the same bits.
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim (hd), T tokens. */
#include "tests/test_kv_util.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * Storage types
 * ------------------------------------------------------------------------------------------------------------- */

/* The test's own f16 arithmetic, in double (independent of kv_codec.h): the f16 spacing at a value, and the smallest
 * f16 >= v and the largest f16 <= v, saturating at ±65504 as the codec's scales and minimums do. */
#define F16_MAX 65504.0
static double f16_ulp(double a) {   /* spacing of f16 around |a| (normal: 2^(e-10); subnormal: 2^-24) */
    a = fabs(a);
    if (a < ldexp(1, -14)) return ldexp(1, -24);
    int e;
    frexp(a, &e);   /* a = f * 2^e, f in [0.5, 1): a in [2^(e-1), 2^e) */
    return ldexp(1, e - 1 - 10);
}
static double f16_up(double v) {    /* smallest f16 >= v, v >= 0 */
    if (v <= 0) return 0;
    double u = f16_ulp(v), r = ceil(v / u) * u;
    return r > F16_MAX ? F16_MAX : r;
}
static double f16_down(double v) {  /* largest f16 <= v */
    if (v >= 0) { double u = f16_ulp(v), r = floor(v / u) * u; return r > F16_MAX ? F16_MAX : r; }
    double r = -f16_up(-v);
    return r < -F16_MAX ? -F16_MAX : r;
}
static double bf16_half_ulp(double a) {   /* half the bf16 spacing around |a| (8 significant bits; subnormal 2^-133) */
    a = fabs(a);
    if (a < ldexp(1, -126)) return ldexp(1, -134);
    int e;
    frexp(a, &e);
    return ldexp(1, e - 1 - 8);
}
#define BF16_MAX 3.3895313892515355e38   /* (2 - 2^-7) · 2^127 */

/* What element j of x (hd) may decode to in type ty, from the layout alone (kv_codec.h), computed here in double: the
 * element clamped to what the format can express (f16, bf16: their largest finite value; q8: ±127·d; q4, q2: the
 * code range [m, m + qmax·d], which holds every element unless a scale or minimum saturated at ±65504), then within
 * *tol of that. The scale d is the smallest f16 >= (the group's amax/127, or (max - m)/qmax) · (1 + 2^-24): the codec
 * rounds the quotient to f32 (at most one f32 rounding, 2^-24 relative) before it rounds up to f16; m is the group's
 * minimum rounded down to f16. The error is then at most d/2 (the code's rounding) plus the f32 roundings of the
 * encoder's x/d or (x - m)/d and of the decoder's d·q + m, each at most 2^-24 of the larger operand: (|x| + |m|) · 2^-22
 * covers them with room. */
static double type_target(KVType ty, const float *x, int hd, int j, double *tol) {
    double a = x[j];
    if (ty == KV_F16) {
        double y = fmax(-F16_MAX, fmin(F16_MAX, a));
        *tol = f16_ulp(y) / 2;
        return y;
    }
    if (ty == KV_BF16) {
        double y = fmax(-BF16_MAX, fmin(BF16_MAX, a));
        *tol = bf16_half_ulp(y);
        return y;
    }
    int G = 1;
    while (G < 32 && hd % (2 * G) == 0) G *= 2;   /* gcd(hd, 32) for these even head_dims */
    int g0 = j / G * G;
    double amax = 0, mn = x[g0], mx = x[g0];
    for (int i = g0; i < g0 + G; i++) { amax = fmax(amax, fabs(x[i])); mn = fmin(mn, x[i]); mx = fmax(mx, x[i]); }
    double lo, hi, d, m = 0;
    if (ty == KV_Q8) {
        d = f16_up(amax / 127 * (1 + ldexp(1, -24)));
        lo = -127 * d; hi = 127 * d;
    } else {
        int qmax = ty == KV_Q4 ? 15 : 3;
        m = f16_down(mn);
        d = f16_up((mx - m) / qmax * (1 + ldexp(1, -24)));
        lo = m; hi = m + qmax * d;
    }
    *tol = d / 2 + (fabs(a) + fabs(m)) * ldexp(1, -22) + 1e-45;
    return fmax(lo, fmin(hi, a));
}

/* Every storage type on adversarial vectors: each element's error against the layout's bound computed above (asserted
 * element by element: a single element over its bound fails), zeros exact, and no finite input decoding to inf or
 * NaN, at head_dims 6 (groups of 2), 8, 64 and 80 (groups of 16). */
static void test_storage_types(void) {
    const int hds[] = {6, 8, 64, 80};
    const KVType types[] = {KV_F16, KV_BF16, KV_Q8, KV_Q4, KV_Q2};
    enum { KINDS = 12 };
    static const char *kind_names[KINDS] = {"random N(0,1)", "zeros", "all equal 3.7", "all equal -1e-3",
                                            "one channel 1e4 x the rest", "near +-65504", "beyond f16 (+-1e6, 3e38)",
                                            "f16 subnormals and f32 denormals", "alternating signs",
                                            "scales 1e-3..1e3", "1e-6 with one 1e5", "ties: half steps"};
    for (int ti = 0; ti < 5; ti++)
        for (int hi = 0; hi < 4; hi++) {
            int hd = hds[hi];
            KVType ty = types[ti];
            double worst_ratio = 0;
            int nonfinite = 0, zero_exact = 1, n_checked = 0, n_over = 0;
            char first_over[160] = "";
            float x[80], y[80];
            uint8_t buf[80 * 4 + 64];
            for (int kind = 0; kind < KINDS; kind++)
                for (int rep = 0; rep < (kind == 0 || kind == 9 ? 50 : 4); rep++) {
                    trng_seed((uint64_t)(rep * 100 + kind + 10000 * hd));
                    for (int j = 0; j < hd; j++) {
                        float r = trng_normal();
                        switch (kind) {
                        case 0: x[j] = r; break;
                        case 1: x[j] = 0; break;
                        case 2: x[j] = 3.7f; break;
                        case 3: x[j] = -1e-3f; break;
                        case 4: x[j] = j == (rep * 7 + 1) % hd ? 1e4f * (rep % 2 ? -1 : 1) : 1e-4f * r; break;
                        case 5: x[j] = (j % 2 ? -1 : 1) * (65504.0f - (float)(j % 5) * 8 + (rep == 3 ? 15.9f : 0)); break;
                        case 6: x[j] = j % 4 == 0 ? 1e6f : j % 4 == 1 ? -3e38f : j % 4 == 2 ? 3.4028235e38f : 65520.0f * r;
                                break;
                        case 7: x[j] = (j % 2 ? -1 : 1) * (j % 3 == 0 ? 1e-40f : (float)ldexp(1 + j % 4, -25 - rep)); break;
                        case 8: x[j] = (j % 2 ? -1.0f : 1.0f) * (1.0f + 0.01f * (float)j); break;
                        case 9: x[j] = r * powf(10.0f, (float)(j % 7) - 3); break;
                        case 10: x[j] = j == 1 ? 1e5f : 1e-6f * r; break;
                        default: x[j] = (float)(j % 8) * 0.5f + 0.25f * (rep % 2); break;   /* halfway between codes */
                        }
                    }
                    memset(buf, 0xA5, sizeof buf);
                    size_t nb = kv_vector_bytes(ty, hd);
                    kv_encode(buf, ty, x, hd);
                    int sentinel_ok = 1;
                    for (size_t i = nb; i < sizeof buf; i++) sentinel_ok &= buf[i] == 0xA5;
                    if (!sentinel_ok) { CHECK(0, "%s hd %d: encode wrote past %zu bytes", kv_type_names[ty], hd, nb); return; }
                    kv_decode(y, ty, buf, hd);
                    for (int j = 0; j < hd; j++) {
                        if (!isfinite(y[j])) { nonfinite++; continue; }
                        if (kind == 1 && (y[j] != 0.0f || signbit(y[j]))) zero_exact = 0;
                        double tol, want = type_target(ty, x, hd, j, &tol), err = fabs((double)y[j] - want);
                        double r = err / tol;
                        if (!(r <= 1.0)) {
                            if (!n_over++)
                                snprintf(first_over, sizeof first_over, ", first: %s x[%d] = %.9g -> %.9g (bound %.3g)",
                                         kind_names[kind], j, (double)x[j], (double)y[j], tol);
                        }
                        if (!(r <= worst_ratio)) worst_ratio = r != r ? INFINITY : r;
                        n_checked++;
                    }
                }
            CHECK(nonfinite == 0 && zero_exact && n_over == 0, "%s head_dim %d: %d elements of %d kinds of vectors each "
                  "within its layout's bound (worst err/bound %.3f, %d over%s), zeros decode to +0, no NaN/inf",
                  kv_type_names[ty], hd, n_checked, KINDS, worst_ratio, n_over, first_over);
        }
    /* the layouts' sizes: Q8_0-like 2 + G bytes per group, Q4_1-like 4 + G/2, q2 4 + ceil(G/4) (G = gcd(head_dim, 32)) */
    CHECK(kv_vector_bytes(KV_Q8, 64) == 68 && kv_vector_bytes(KV_Q4, 64) == 40 && kv_vector_bytes(KV_Q8, 80) == 90 &&
          kv_vector_bytes(KV_Q4, 80) == 60 && kv_vector_bytes(KV_Q8, 8) == 10 && kv_vector_bytes(KV_Q4, 8) == 8 &&
          kv_vector_bytes(KV_F16, 80) == 160 && kv_vector_bytes(KV_Q2, 64) == 24 && kv_vector_bytes(KV_Q2, 80) == 40 &&
          kv_vector_bytes(KV_Q2, 8) == 6 && kv_vector_bytes(KV_Q2, 6) == 15,
          "vector bytes: q8 68/90/10, q4 40/60/8, q2 24/40/6/15 for head_dim 64/80/8(/6)");
    /* q2's element order, written out: codes 0,1,2,3 in the lowest bits first, byte by byte */
    float ramp[8] = {0, 1, 2, 3, 3, 2, 1, 0};
    uint8_t q2[6];
    kv_encode(q2, KV_Q2, ramp, 8);
    CHECK(q2[0] == 0x00 && q2[1] == 0x3c && q2[2] == 0x00 && q2[3] == 0x00 && q2[4] == (0 | 1 << 2 | 2 << 4 | 3 << 6) &&
          q2[5] == (3 | 2 << 2 | 1 << 4 | 0 << 6), "q2 of 0,1,2,3,3,2,1,0: scale 1.0 (f16 0x3c00), minimum 0, codes "
          "packed element j at bits 2(j mod 4) of byte j/4 (bytes %02x %02x %02x %02x %02x %02x)", q2[0], q2[1], q2[2],
          q2[3], q2[4], q2[5]);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Accounting: SmolLM2-135M's attention shape (30 layers, 3 kv heads, head_dim 64), 4096 tokens
 * ------------------------------------------------------------------------------------------------------------- */

static void test_accounting(void) {
    KVShape s = tshape(30, 9, 3, 64, 4096);
    /* bytes of one key or value vector, written out from the layouts: G = 32, two groups */
    const size_t vec[KV_NTYPES] = {64 * 4, 64 * 2, 64 * 2, 2 * (2 + 32), 2 * (4 + 32 / 2), 2 * (4 + 32 / 4)};
    const double per_elem[KV_NTYPES] = {4, 2, 2, 1, 0.5, 0.25};
    struct { const char *policy; size_t meta; } pols[] = {
        {"full", 0}, {"window:4096", 0}, {"h2o:4096", 4}, {"scissorhands:4096", 1024 / 8}, {"lru:4096", 4}};
    for (int ty = 0; ty < KV_NTYPES; ty++)
        for (int pi = 0; pi < 5; pi++)
            for (int res = 0; res < 2; res++) {
                char spec[96];
                int R = res ? 64 : 0;
                snprintf(spec, sizeof spec, "%s,type=%s%s", pols[pi].policy, kv_type_names[ty], res ? ",residual=64" : "");
                KVCache c;
                if (tcache(&c, &s, spec)) continue;
                int R_eff = ty == KV_F32 ? 0 : R;   /* an f32 cache has nothing to keep apart */
                size_t lanes = 30 * 3, T = 4096;
                size_t per_slot_meta = 4 /* position */ + 4 /* live list */ + 4 /* free list */ + pols[pi].meta;
                size_t want_vec = lanes * ((T - R_eff) * 2 * vec[ty] + R_eff * 2 * 64 * 4);
                size_t want_meta = lanes * T * per_slot_meta;
                size_t want_formula = (size_t)(2.0 * 30 * 3 * 64 * 4096 * per_elem[ty]);
                KVBytes b0 = kv_bytes(&c);
                CHECK(b0.vec_alloc == want_vec && b0.meta_alloc == want_meta && b0.total_alloc == want_vec + want_meta
                      && b0.total_live == 0 && b0.formula_alloc == want_formula &&
                      kv_alloc_bytes_for(&s, &c.spec, c.policy.ops, c.policy.budget) == b0.total_alloc &&
                      kv_lane_bytes(&c, 7, 2).total_alloc * lanes == b0.total_alloc,
                      "SmolLM2 shape, 4096 tokens, '%s': %zu B = vectors %zu + positions/lists/metadata %zu (formula "
                      "2*L*kvh*hd*T*bytes %zu)", spec, b0.total_alloc, b0.vec_alloc, b0.meta_alloc, b0.formula_alloc);
                /* fill every slot of a few caches: 4096 tokens through every layer (storage only, no attention) */
                if (pi == 0 && (ty == KV_F32 || ty == KV_Q4)) {
                    float k[3 * 64], v[3 * 64];
                    for (int j = 0; j < 3 * 64; j++) { k[j] = 0.01f * (float)(j % 17); v[j] = 0.02f * (float)(j % 13); }
                    int fill_ok = 1;
                    for (int t = 0; t < 4096 && fill_ok; t++)
                        for (int l = 0; l < 30; l++) fill_ok &= kv_append(&c, l, t, k, v) == 0;
                    KVBytes b = kv_bytes(&c), lb = kv_lane_bytes(&c, 7, 2);
                    CHECK(fill_ok && b.total_live == b0.total_alloc && b.peak_live == b0.total_alloc &&
                          c.live_bytes == b.total_live && lb.peak_live == lb.total_alloc, "'%s' filled with 4096 "
                          "tokens: live = peak = allocated = %zu B", spec, b.total_live);
                }
                kv_cache_free(&c);
            }
    /* live bytes while filling, with a residual: the newest tokens sit in f32, older ones in q4 */
    KVCache c;
    if (!tcache(&c, &s, "window:100,type=q4,residual=16")) {
        float k[3 * 64] = {0}, v[3 * 64] = {0};
        for (int t = 0; t < 10; t++) for (int l = 0; l < 30; l++) kv_append(&c, l, t, k, v);
        KVBytes b10 = kv_bytes(&c);
        for (int t = 10; t < 40; t++) for (int l = 0; l < 30; l++) kv_append(&c, l, t, k, v);
        KVBytes b40 = kv_bytes(&c);
        size_t lanes = 90, meta = 12;
        CHECK(b10.vec_live == lanes * 10 * 512 && b10.meta_live == lanes * 10 * meta &&
              b40.vec_live == lanes * (16 * 512 + 24 * 80) && b40.meta_live == lanes * 40 * meta,
              "window:100,type=q4,residual=16: live bytes count 10 f32 tokens at t=9, 16 f32 + 24 q4 at t=39");
        kv_cache_free(&c);
    }
}

static void test_byte_budgets(void) {
    KVShape s = tshape(30, 9, 3, 64, 8192);
    const char *specs[] = {"window:1MiB,type=q8", "h2o:512KiB", "sink:64MiB,type=q4,residual=32", "full:2MiB,type=f16",
                           "scissorhands:3MiB,ktype=q8,vtype=q4"};
    const size_t bytes[] = {1 << 20, 512 << 10, 64 << 20, 2 << 20, 3 << 20};
    for (int i = 0; i < 5; i++) {
        KVCache c;
        if (tcache(&c, &s, specs[i])) continue;
        size_t at = kv_alloc_bytes_for(&s, &c.spec, c.policy.ops, c.budget);
        size_t above = kv_alloc_bytes_for(&s, &c.spec, c.policy.ops, c.budget + 1);
        CHECK(at == kv_bytes(&c).total_alloc && at <= bytes[i] && above > bytes[i], "'%s' resolves to %d tokens per "
              "lane: %zu B allocated <= %zu B < %zu B for one token more", specs[i], c.budget, at, bytes[i], above);
        kv_cache_free(&c);
    }
    KVSpec sp;
    KVCache c;
    char err[512];
    int rc = kv_spec_parse(&sp, "window:1KiB", KV_F32, err, sizeof err) || kv_cache_init(&c, &s, &sp, err, sizeof err);
    CHECK(rc && strstr(err, "smaller than one slot"), "window:1KiB for 90 lanes is an error: %s", err);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Spec errors: each names the bad part and lists the valid choices
 * ------------------------------------------------------------------------------------------------------------- */

static void test_bad_specs(void) {
    KVShape s = tshape(2, 4, 2, 8, 256);
    struct { const char *spec, *names, *lists; } cases[] = {
        {"window", "'window' needs a budget", "window:1024"},
        {"window:0", "budget 0", "tokens per lane"},
        {"h2o:64,recent=80", "recent=80", "recent <= 63"},
        {"h2o:64,recent=64", "recent=64", "recent <= 63"},
        {"sink:4,sinks=4", "sinks=4", "sinks <= 2"},
        {"sink:abc", "'abc'", "tokens per lane (1024) or bytes"},
        {"nosuch:5", "'nosuch'", kv_policy_names()},   /* every registered policy is listed */
        {"window:8,type=q3", "type=q3", "f32, f16, bf16, q8, q4"},
        {"window:8,ktype=q3", "ktype=q3", "f32, f16, bf16, q8, q4"},
        {"window:8,pos=middle", "pos=middle", "orig, cache"},
        {"window:8,agg=median", "agg=median", "mean, max"},
        {"window:8,foo=1", "'foo'", "every policy takes type, ktype, vtype, residual, prec"},
        {"h2o:64,recnet=8", "'recnet'", "recent=R"},
        {"tova:8,per=head", "per=head", "lane, layer"},
        {"scissorhands:8,drop=9", "drop=9", "drop <= 7"},
        {"scissorhands:8,history=0", "history=0", "[1, "},
        {"lru:8,thresh=-1", "thresh=-1", "(0, 1e6]"},
        {"random:8,seed=x", "seed=x", "integer"},
        {"snapkv:32", "obs=32", "obs <= 31"},
        {"snapkv:64,kernel=4", "kernel=4", "odd"},
        {"snapkv:1MiB", "snapkv", "in tokens"},
        {"tova:1", "budget of 1", "budget >= 2"},
        {"window:8,residual=9", "residual=9", "budget of 8"},
        {"window:8,type=q8,ktype=f16", "ktype", "type= or ktype=/vtype="},
        {"window:8,pos=orig,pos=cache", "'pos' given twice", "pos"},
        {"window:8,bare", "'bare'", "key=value"},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        KVSpec sp;
        KVCache c;
        char err[512] = "";
        int rc = kv_spec_parse(&sp, cases[i].spec, KV_F32, err, sizeof err);
        if (!rc) {
            rc = kv_cache_init(&c, &s, &sp, err, sizeof err);
            if (!rc) kv_cache_free(&c);
        }
        CHECK(rc && strstr(err, cases[i].names) && strstr(err, cases[i].lists), "bad spec '%s': %s", cases[i].spec, err);
    }
    /* snapkv in ppl mode needs prefill=, not in generate; with prefill= it is fine */
    KVSpec sp;
    char err[512] = "";
    kv_spec_parse(&sp, "snapkv:64", KV_F32, err, sizeof err);
    int rc_ppl = kv_spec_check_mode(&sp, "ppl", err, sizeof err);
    CHECK(rc_ppl && strstr(err, "prefill=") && strstr(err, "snapkv:64"), "snapkv:64 in ppl mode: %s", err);
    CHECK(kv_spec_check_mode(&sp, "generate", err, sizeof err) == 0, "snapkv:64 in generate mode is accepted");
    kv_spec_parse(&sp, "snapkv:64,prefill=512", KV_F32, err, sizeof err);
    CHECK(kv_spec_check_mode(&sp, "ppl", err, sizeof err) == 0, "snapkv:64,prefill=512 in ppl mode is accepted");
    /* valid specs of every policy */
    const char *good[] = {"full", "full,ktype=q8,vtype=f16", "window:1", "sink:6,sinks=2,pos=cache", "sink:1024",
                          "h2o:64,recent=63", "h2o:2", "tova:2,per=layer,agg=max", "scissorhands:16,recent=4,history=8,drop=12",
                          "lru:4,thresh=0.5", "random:2,seed=7", "snapkv:33", "window:2048,type=q8,residual=64",
                          "h2o:1MiB,type=q4"};
    int ok = 1;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        KVCache c;
        KVSpec g;
        if (kv_spec_parse(&g, good[i], KV_F32, err, sizeof err) || kv_cache_init(&c, &s, &g, err, sizeof err)) {
            printf("  '%s': %s\n", good[i], err);
            ok = 0;
        } else kv_cache_free(&c);
    }
    CHECK(ok, "%zu valid specs of every policy are accepted", sizeof good / sizeof good[0]);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Attention
 * ------------------------------------------------------------------------------------------------------------- */

#define AL 2
#define ANH 6
#define ANKV 2
#define AHD 16
#define AT 40

static float AK[AT][AL][ANKV * AHD], AV[AT][AL][ANKV * AHD], AQ[AT][AL][ANH * AHD];

static void make_stream(uint64_t seed) {
    trng_seed(seed);
    for (int t = 0; t < AT; t++)
        for (int l = 0; l < AL; l++) {
            for (int j = 0; j < ANKV * AHD; j++) { AK[t][l][j] = trng_normal(); AV[t][l][j] = trng_normal(); }
            for (int j = 0; j < ANH * AHD; j++) AQ[t][l][j] = 0.7f * trng_normal();
        }
}

/* Runs the stream; outputs (AT, AL, ANH * AHD) and, when pos is not NULL, each lane's positions after the last step. */
static int run_attention(const char *spec, float *outs, int prompt_len) {
    KVShape s = tshape(AL, ANH, ANKV, AHD, 64);
    KVCache c;
    if (tcache(&c, &s, spec)) return -1;
    if (prompt_len) kv_set_prompt_len(&c, prompt_len);
    for (int t = 0; t < AT; t++)
        for (int l = 0; l < AL; l++) {
            if (kv_append(&c, l, t, AK[t][l], AV[t][l])) { kv_cache_free(&c); return -1; }
            kv_attend_cpu(&c, outs + ((size_t)t * AL + l) * ANH * AHD, l, t, AQ[t][l]);
        }
    int ev = c.n_evictions;
    kv_cache_free(&c);
    return ev;
}

static float out_a[AT * AL * ANH * AHD], out_b[AT * AL * ANH * AHD];

static void test_room_for_all_is_full(void) {
    make_stream(11);
    if (run_attention("full", out_a, 0) < 0) return;
    const char *specs[] = {"window:40", "sink:40,sinks=4", "h2o:40", "h2o:64,recent=2", "tova:40", "tova:40,per=layer",
                           "scissorhands:41,drop=3", "lru:40", "random:40", "snapkv:40", "snapkv:48,obs=8",
                           "full,residual=8", "window:40,pos=orig,agg=max"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        int ev = run_attention(specs[i], out_b, strncmp(specs[i], "snapkv", 6) ? 0 : 30);
        CHECK(ev == 0 && !memcmp(out_a, out_b, sizeof out_a), "'%s' with room for all %d tokens: outputs bit-identical "
              "to full (f32), %d evictions", specs[i], AT, ev);
    }
    /* and for a quantized type, against full of the same type */
    run_attention("full,type=q8", out_a, 0);
    int ev = run_attention("h2o:40,type=q8", out_b, 0);
    CHECK(ev == 0 && !memcmp(out_a, out_b, sizeof out_a), "h2o:40,type=q8 with room for all: bit-identical to full,type=q8");
}

static void test_pos_cache_no_eviction(void) {
    make_stream(12);
    run_attention("window:64", out_a, 0);
    int ev = run_attention("window:64,pos=cache", out_b, 0);
    CHECK(ev == 0 && !memcmp(out_a, out_b, sizeof out_a), "nothing evicted: pos=cache outputs bit-identical to pos=orig "
          "(f32, %d tokens)", AT);
    /* rope_pairing=1 (halves) and rope factors take the same path */
    KVShape s = tshape(AL, ANH, ANKV, AHD, 64);
    float fac[AHD / 2];
    for (int i = 0; i < AHD / 2; i++) fac[i] = 1.0f + i;
    s.rope_pairing = 1;
    s.rope_factors = fac;
    float *outs[2] = {out_a, out_b};
    const char *sp[2] = {"full", "full,pos=cache"};
    for (int m = 0; m < 2; m++) {
        KVCache c;
        if (tcache(&c, &s, sp[m])) return;
        for (int t = 0; t < AT; t++)
            for (int l = 0; l < AL; l++) {
                kv_append(&c, l, t, AK[t][l], AV[t][l]);
                kv_attend_cpu(&c, outs[m] + ((size_t)t * AL + l) * ANH * AHD, l, t, AQ[t][l]);
            }
        kv_cache_free(&c);
    }
    CHECK(!memcmp(out_a, out_b, sizeof out_a), "nothing evicted, halves pairing + rope factors: pos=cache bit-identical "
          "to pos=orig");
}

/* The test's own RoPE, in double: pairs (2i, 2i+1), theta 10000. */
static void ref_rope(double *x, int hd, int pos) {
    for (int i = 0; i < hd / 2; i++) {
        double a = pos * pow(10000.0, -2.0 * i / hd), c = cos(a), s = sin(a), x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
    }
}

/* With eviction, pos=cache equals a dense reference over the kept positions, keys rotated by their rank and the query
 * by n-1; pos=orig equals the same reference with true positions. */
static void test_pos_cache_reference(void) {
    make_stream(13);
    const char *specs[] = {"sink:6,sinks=2,pos=cache", "window:5,pos=cache", "h2o:7,pos=cache", "sink:6,sinks=2",
                           "tova:5,pos=cache,residual=2"};
    for (int si = 0; si < 5; si++) {
        KVShape s = tshape(AL, ANH, ANKV, AHD, 64);
        KVCache c;
        if (tcache(&c, &s, specs[si])) continue;
        int by_rank = c.spec.pos == POS_CACHE, pos[64];
        double max_err = 0;
        float out[ANH * AHD];
        for (int t = 0; t < AT; t++)
            for (int l = 0; l < AL; l++) {
                kv_append(&c, l, t, AK[t][l], AV[t][l]);
                kv_attend_cpu(&c, out, l, t, AQ[t][l]);
                for (int h = 0; h < ANH; h++) {
                    int g = h / (ANH / ANKV), n = kv_lane_positions(&c, l, g, pos, 64);
                    double q[AHD], k[64 * AHD];
                    const float *vr[64];
                    for (int j = 0; j < AHD; j++) q[j] = AQ[t][l][h * AHD + j];
                    ref_rope(q, AHD, by_rank ? n - 1 : t);
                    for (int i = 0; i < n; i++) {
                        for (int j = 0; j < AHD; j++) k[i * AHD + j] = AK[pos[i]][l][g * AHD + j];
                        ref_rope(k + i * AHD, AHD, by_rank ? i : pos[i]);
                        vr[i] = AV[pos[i]][l] + g * AHD;
                    }
                    double e = tdense_err(q, k, vr, n, AHD, out + h * AHD);
                    if (!(e <= max_err)) max_err = e;
                }
            }
        int ev = c.n_evictions;
        kv_cache_free(&c);
        /* f32 RoPE (cos/sin rounded to f32) and 16-term f32 dot products of N(0,1) data, scores up to ~5, |v| <= ~4:
           measured 1.2e-6; 64 f32 ulps of 4 = 3.1e-5 */
        CHECK_LE(max_err, 64 * 4 * 1.2e-7, "'%s' (%d evictions): every output equals a dense f64 reference rotating "
                 "the kept pre-RoPE keys by %s (max err %.3g)", specs[si], ev, by_rank ? "rank" : "position", max_err);
    }
}

/* residual=R: the newest R tokens are exact f32 (outputs of a 1-token-window-free check: with q4 and residual equal to
 * the budget, nothing is ever quantized, so outputs equal f32) and older ones are quantized. */
static void test_residual(void) {
    make_stream(14);
    run_attention("window:8", out_a, 0);
    int ev = run_attention("window:8,type=q4,residual=8", out_b, 0);
    CHECK(ev > 0 && !memcmp(out_a, out_b, sizeof out_a), "window:8,type=q4,residual=8: all 8 tokens stay f32, outputs "
          "bit-identical to f32");
    /* residual < budget: keys older than R decode from q4 exactly as kv_decode(kv_encode(k)) */
    KVShape s = tshape(1, 2, 1, AHD, 64);
    KVCache c;
    if (tcache(&c, &s, "window:10,type=q4,residual=3")) return;
    for (int t = 0; t < 20; t++) kv_append(&c, 0, t, AK[t][0], AV[t][0]);
    const KVLane *ln = &c.lanes[0];
    int ok = ln->n_live == 10 && c.n_bands == 2 && ln->n_free[0] == 0, Q = c.budget - c.residual;
    for (int i = 0; i < ln->n_live && ok; i++) {
        int slot = ln->live[i], p = ln->pos[slot];
        float want[AHD], got[AHD];
        uint8_t enc[AHD * 4];
        memcpy(want, AK[p][0], sizeof want);
        kv_rope(want, &s, p);
        if (p >= 17) ok &= slot >= Q && !memcmp(ln->k[0] + (size_t)(slot - Q) * AHD * 4, want, sizeof want);
        else {
            kv_encode(enc, KV_Q4, want, AHD);
            kv_decode(want, KV_Q4, enc, AHD);
            kv_decode(got, KV_Q4, ln->k[1] + (size_t)slot * c.k_bytes, AHD);
            ok &= slot < Q && !memcmp(got, want, sizeof want);
        }
    }
    CHECK(ok, "window:10,type=q4,residual=3 at t=19: positions 17..19 in f32 slots, 10..16 in q4 slots, each key "
          "stored once");
    kv_cache_free(&c);
}

static void test_reset_and_full_stop(void) {
    make_stream(15);
    KVShape s = tshape(AL, ANH, ANKV, AHD, 16);
    KVCache c;
    if (tcache(&c, &s, "full")) return;
    int rc = 0, t = 0;
    for (; t < 17 && !rc; t++) rc = kv_append(&c, 0, t, AK[t][0], AV[t][0]);
    CHECK(rc == -1 && t == 17, "full with -c 16: the 17th token cannot be stored (kv_append returns -1)");
    kv_cache_reset(&c);
    KVBytes b = kv_bytes(&c);
    CHECK(c.lanes[0].n_live == 0 && b.total_live == 0 && b.peak_live == b.total_alloc / 2 &&
          c.lanes[0].peak_live == 16 && kv_append(&c, 0, 0, AK[0][0], AV[0][0]) == 0,
          "after kv_cache_reset every lane is empty and accepts position 0 again; peaks since init are kept (layer 0 "
          "of 2 was full: peak = half the allocation)");
    kv_cache_free(&c);
    /* kv_describe shows the resolved defaults */
    if (tcache(&c, &s, "h2o:10")) return;
    char d[256];
    kv_describe(&c, d, sizeof d);
    CHECK(strstr(d, "recent=5") && strstr(d, "budget 10"), "kv_describe: %s", d);
    kv_cache_free(&c);
}

/* 1 and 2 threads: a shape big enough that kv_attend_cpu really runs its lanes in parallel (4 kv heads, head_dim 64,
 * 8 query heads, 200 slots: 100k multiply-adds per layer, above kv.c's threshold of 65536). */
static void test_threads(void) {
#ifdef _OPENMP
    enum { TL = 1, TNH = 8, TNKV = 4, THD = 64, TT = 216 };
    KVShape s = tshape(TL, TNH, TNKV, THD, 512);
    const char *specs[] = {"h2o:200,type=q8,residual=8,pos=cache", "tova:200,per=layer", "scissorhands:200,drop=4,type=q4",
                           "random:200"};
    static float k[TNKV * THD], v[TNKV * THD], q[TNH * THD], outs[2][TT][TL][TNH * THD];
    for (int i = 0; i < 4; i++) {
        int ev[2] = {0, 0};
        for (int run = 0; run < 2; run++) {
            omp_set_num_threads(run + 1);
            KVCache c;
            if (tcache(&c, &s, specs[i])) return;
            trng_seed(17);
            for (int t = 0; t < TT; t++)
                for (int l = 0; l < TL; l++) {
                    for (int j = 0; j < TNKV * THD; j++) { k[j] = trng_normal(); v[j] = trng_normal(); }
                    for (int j = 0; j < TNH * THD; j++) q[j] = 0.3f * trng_normal();
                    kv_append(&c, l, t, k, v);
                    kv_attend_cpu(&c, outs[run][t][l], l, t, q);
                }
            ev[run] = c.n_evictions;
            kv_cache_free(&c);
        }
        CHECK(ev[0] > 0 && ev[0] == ev[1] && !memcmp(outs[0], outs[1], sizeof outs[0]), "'%s': 1 and 2 OpenMP threads "
              "give bit-identical outputs at every step (%d evictions each)", specs[i], ev[0]);
    }
    omp_set_num_threads(1);
#else
    SKIP("threads: built without OpenMP");
#endif
}

/* Every registered policy has a name, a summary, a paper and an example spec that runs in every cache mode: the
 * tests' loops over "every policy" use the examples, so a new policy is covered without being named. */
static void test_registry(void) {
    KVShape s = tshape(2, 4, 2, 8, 256);
    int n = 0;
    for (int i = 0; kv_policy_at(i); i++, n++) {
        const KVPolicyOps *p = kv_policy_at(i);
        CHECK(p->name && *p->name && p->summary && *p->summary && p->paper && *p->paper && p->example,
              "policy %d (%s) has a name, summary, paper and example", i, p->name ? p->name : "?");
        KVSpec sp;
        KVCache c;
        char err[512] = "";
        int rc = kv_spec_parse(&sp, p->example, KV_F32, err, sizeof err);
        const char *modes[] = {"generate", "chat", "ppl", "passkey", "bench"};
        for (int m = 0; m < 5 && !rc; m++) rc = kv_spec_check_mode(&sp, modes[m], err, sizeof err);
        if (!rc) rc = kv_cache_init(&c, &s, &sp, err, sizeof err);
        if (!rc) kv_cache_free(&c);
        CHECK(rc == 0 && !strcmp(sp.name, p->name), "'%s' example '%s' parses and builds a cache in every mode%s%s",
              p->name, p->example, *err ? ": " : "", err);
    }
    CHECK(n >= 9, "the registry holds %d policies", n);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Keys per channel (kgroup=channel, kv.h): the quantization against a brute force here, attention over the keys
 * decoded here, eviction inside a sealed group, clone/restore, and the bytes of SmolLM2's shape at 4096 tokens
 * ------------------------------------------------------------------------------------------------------------- */

#define CHD 16
static float c_noperm[CHD / 2];   /* rope factors of +inf: every angle 0, so RoPE is exactly the identity */
static KVShape chan_shape(int n_kv, int seq_len) {
    for (int i = 0; i < CHD / 2; i++) c_noperm[i] = INFINITY;
    KVShape s = tshape(1, n_kv * 2, n_kv, CHD, seq_len);
    s.rope_factors = c_noperm;
    return s;
}

/* The lane's slot holding position p, or -1. */
static int slot_of(const KVLane *ln, int p) {
    for (int s = 0; s < ln->cap; s++) if (ln->pos[s] == p) return s;
    return -1;
}

/* Brute-force bound of channel e of a group whose (true) keys are rows[0..n): d/2 plus f32 rounding, d and m as the
 * layout defines them (type_target's reasoning, per channel over the group's tokens). */
static double chan_bound(float rows[][CHD], int n, int e, int qmax, double x) {
    double mn = rows[0][e], mx = rows[0][e];
    for (int i = 1; i < n; i++) { mn = fmin(mn, rows[i][e]); mx = fmax(mx, rows[i][e]); }
    double m = f16_down(mn), d = f16_up((mx - m) / qmax * (1 + ldexp(1, -24)));
    return d / 2 + (fabs(x) + fabs(m)) * ldexp(1, -22) + 1e-45;
}

static void test_kgroup_specs(void) {
    KVShape s = chan_shape(1, 64);
    struct { const char *spec, *names, *lists; } bad[] = {
        {"full,type=q2,kgroup=tokens", "kgroup=tokens", "token"},
        {"full,type=q2,kgroup=channel,kgsize=0", "kgsize=0", "[1, 4096]"},
        {"full,type=q2,kgsize=16", "kgsize=", "kgroup=channel"},
        {"full,type=f16,kgroup=channel", "kgroup=channel", "q8, q4 or q2"},
        {"full,type=q4,kgroup=channel,kgroup=token", "'kgroup' given twice", "kgroup"},
        {"topk:8,type=q4,kgroup=channel", "does not combine with a selection policy", "eviction policies"},
        {"pool:16,group=2,recent=8,type=q4,kgroup=channel", "with a merging policy", "without merging"},
        {"h2o:16,type=q4,kgroup=channel,fast=50%", "memory tiers, fast=", "one memory tier"},
        {"h2o:16,type=q4,kgroup=channel,merge=1", "merge-on-evict, merge=1", "sealed group's ranges"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[512];
        int rc = tcache_error(&s, bad[i].spec, err, sizeof err);
        CHECK(rc && strstr(err, bad[i].names) && strstr(err, bad[i].lists), "bad spec '%s': %s", bad[i].spec, err);
    }
    KVCache c;
    if (tcache(&c, &s, "h2o:16,prec=f32:4/q8:4/q2,kgroup=channel,kgsize=3")) return;
    char d[256];
    kv_describe(&c, d, sizeof d);
    CHECK(c.kgroup == 3 && !c.band_kchan[0] && c.band_kchan[1] && c.band_kchan[2] && strstr(d, "groups of 3"),
          "prec=f32:4/q8:4/q2,kgroup=channel,kgsize=3: the q8 and q2 bands' keys per channel, the f32 band's not (%s)", d);
    kv_cache_free(&c);
    if (tcache(&c, &s, "full,ktype=q4,vtype=f16,kgroup=channel")) return;
    CHECK(c.kgroup == KV_KGSIZE_DEFAULT && c.band_kchan[0], "kgroup=channel without kgsize groups %d tokens",
          KV_KGSIZE_DEFAULT);
    kv_cache_free(&c);
}

/* full with keys per channel, groups of 8, 44 tokens (5 sealed groups and an open one of 4), with and without a
 * residual: every sealed key within its group's per-channel d/2 of the true key (d, m computed here over the group's
 * 8 true keys), every key of the open group (and of the residual) exact; then attention through kv_attend_ref
 * equals a dense f64 attention over the keys decoded here from the bytes (tchan_key) and the exact f32 values. */
static void test_kgroup_quantization(void) {
    enum { T = 44, KG = 8 };
    static const char *types[] = {"q8", "q4", "q2"};
    static const int qmaxes[] = {255, 15, 3};
    KVShape s = chan_shape(1, 64);
    static float K[T][CHD], V[T][CHD], Q[2 * CHD];
    trng_seed(71);
    for (int t = 0; t < T; t++)
        for (int e = 0; e < CHD; e++) {
            /* channel scales spread as real keys' are (a few channels carry outliers: KIVI's reason) */
            K[t][e] = trng_normal() * (e % 5 == 0 ? 8.0f : 1.0f) + (e == 3 ? 20.0f : 0.0f);
            V[t][e] = trng_normal();
        }
    for (int j = 0; j < 2 * CHD; j++) Q[j] = 0.5f * trng_normal();
    for (int ti = 0; ti < 3; ti++)
        for (int res = 0; res < 2; res++) {
            char spec[96];
            int R = res ? 6 : 0;
            snprintf(spec, sizeof spec, "full,ktype=%s,vtype=f32,kgroup=channel,kgsize=%d%s", types[ti], KG,
                     res ? ",residual=6" : "");
            KVCache c;
            if (tcache(&c, &s, spec)) continue;
            for (int t = 0; t < T; t++) kv_append(&c, 0, t, K[t], V[t]);
            const KVLane *ln = &c.lanes[0];
            int b = c.n_bands - 1, n_over = 0, n_exact_bad = 0, inexact = 0;
            double worst = 0;
            /* band b holds positions 0 .. T-1-R in order; groups of KG rows: tokens jKG .. jKG+KG-1 */
            int in_band = T - R, sealed = in_band / KG * KG;
            for (int p = 0; p < T; p++) {
                int slot = slot_of(ln, p);
                float x[CHD];
                if (R && slot >= ln->band_first[0]) {   /* the residual band: f32 */
                    memcpy(x, ln->k[0] + (size_t)(slot - ln->band_first[0]) * CHD * 4, sizeof x);
                    n_exact_bad += memcmp(x, K[p], sizeof x) != 0;
                    continue;
                }
                tchan_key(&c, ln, b, slot, x);
                if (p >= sealed) { n_exact_bad += memcmp(x, K[p], sizeof x) != 0; continue; }
                for (int e = 0; e < CHD; e++) {
                    double tol = chan_bound(&K[p / KG * KG], KG, e, qmaxes[ti], K[p][e]);
                    double err = fabs((double)x[e] - K[p][e]);
                    inexact += x[e] != K[p][e];
                    if (!(err <= tol)) n_over++;
                    if (!(err / tol <= worst)) worst = err / tol;
                }
            }
            CHECK(n_over == 0 && n_exact_bad == 0 && inexact > 0 && ln->kopen[b] == sealed / KG,
                  "'%s' after %d tokens: %d sealed keys each within its group's per-channel d/2 (worst err/bound "
                  "%.3f, %d over), the open group's %d and the residual's %d keys exact f32", spec, T, sealed, worst,
                  n_over, in_band - sealed, R);
            /* attention: kv_attend_ref against f64 over the decoded keys (RoPE is the identity here) */
            float out[2 * CHD];
            kv_attend_ref(&c, out, 0, T - 1, Q);
            double q[CHD], k[T * CHD], e_max = 0;
            const float *vr[T];
            for (int h = 0; h < 2; h++) {
                for (int e = 0; e < CHD; e++) q[e] = Q[h * CHD + e];
                for (int i = 0; i < ln->n_live; i++) {
                    int slot = ln->live[i], bb = kv_slot_band(ln, slot);
                    float x[CHD];
                    if (c.band_kchan[bb]) tchan_key(&c, ln, bb, slot, x);
                    else memcpy(x, ln->k[bb] + (size_t)(slot - ln->band_first[bb]) * CHD * 4, sizeof x);
                    for (int e = 0; e < CHD; e++) k[i * CHD + e] = x[e];
                    vr[i] = V[ln->pos[slot]];
                }
                double err = tdense_err(q, k, vr, ln->n_live, CHD, out + h * CHD);
                if (!(err <= e_max)) e_max = err;
            }
            /* 16-term f32 dots of keys up to ~40 against queries ~0.5 (scores ~40): 64 f32 ulps of 40 */
            CHECK_LE(e_max, 64 * 40 * 1.2e-7, "'%s': kv_attend_ref equals f64 attention over the keys decoded here "
                     "from the bytes (max err %.3g)", spec, e_max);
            kv_cache_free(&c);
        }
}

/* window:8 with q2 keys per channel in groups of 4 and f32 values: from t = 8 on, each step evicts the oldest token
 * (a sealed group's) and the new one takes its freed row (no group is open or empty). A new key inside every
 * channel's range is coded with the group's scales, the group's other keys keeping their bits; a key outside (all
 * 50.0) re-quantizes the group: the new key within the new d/2, the others within the new d/2 of what they decoded to
 * before. The lane always holds its 8 slots, and the live bytes counted as it goes equal kv_bytes' recount. */
static void test_kgroup_eviction(void) {
    KVShape s = chan_shape(1, 64);
    KVCache c;
    if (tcache(&c, &s, "window:8,ktype=q2,vtype=f32,kgroup=channel,kgsize=4")) return;
    const KVLane *ln = &c.lanes[0];
    float k[CHD], v[CHD], before[8][CHD], after[CHD];
    int kept_ok = 1, fit_ok = 1, req_ok = 1, full_ok = 1, bytes_ok = 1, t = 0;
    trng_seed(5);
    for (; t < 8; t++) {   /* channel e alternates between -1 - e/16 and +1 + e/16: every range [-1.x, 1.x] */
        for (int e = 0; e < CHD; e++) { k[e] = (t % 2 ? 1.0f : -1.0f) * (1.0f + e / 16.0f); v[e] = trng_normal(); }
        kv_append(&c, 0, t, k, v);
    }
    for (; t < 33; t++) {   /* keys inside the groups' ranges, then one outside (t = 32) */
        int outside = t == 32, victim = t - 8, vs = slot_of(ln, victim), j = (vs - ln->band_first[0]) / 4;
        int mates[3], nm = 0;
        for (int r = j * 4; r < j * 4 + 4; r++)
            if (ln->band_first[0] + r != vs) {
                mates[nm] = ln->band_first[0] + r;
                tchan_key(&c, ln, 0, mates[nm], before[nm]);
                nm++;
            }
        for (int e = 0; e < CHD; e++) { k[e] = outside ? 50.0f : 0.9f * (2 * trng_unif() - 1); v[e] = trng_normal(); }
        kv_append(&c, 0, t, k, v);
        int ns = slot_of(ln, t);
        full_ok &= ln->n_live == 8 && ns == vs;
        bytes_ok &= c.live_bytes == kv_bytes(&c).total_live;
        /* the group's new scales, from the header (tchan_key decodes with them) */
        tchan_key(&c, ln, 0, ns, after);
        double mn[CHD], mx[CHD];
        for (int e = 0; e < CHD; e++) { mn[e] = k[e]; mx[e] = k[e]; }
        for (int i = 0; i < nm; i++)
            for (int e = 0; e < CHD; e++) { mn[e] = fmin(mn[e], before[i][e]); mx[e] = fmax(mx[e], before[i][e]); }
        for (int i = 0; i < nm; i++) {
            float x[CHD];
            tchan_key(&c, ln, 0, mates[i], x);
            if (!outside) kept_ok &= !memcmp(x, before[i], sizeof x);
            else
                for (int e = 0; e < CHD; e++) {
                    double m = f16_down(mn[e]), d = f16_up((mx[e] - m) / 3 * (1 + ldexp(1, -24)));
                    req_ok &= fabs((double)x[e] - before[i][e]) <= d / 2 + (fabs(x[e]) + fabs(m)) * ldexp(1, -22);
                }
        }
        for (int e = 0; e < CHD; e++) {
            /* fits: the group's range is still the first keys' [-1-e/16, 1+e/16]; else the new range */
            double lo = outside ? fmin(mn[e], -1 - e / 16.0) : -1 - e / 16.0, hi = outside ? mx[e] : 1 + e / 16.0;
            double m = f16_down(lo), d = f16_up((hi - m) / 3 * (1 + ldexp(1, -24)));
            int ok = fabs((double)after[e] - k[e]) <= d / 2 + (fabs(k[e]) + fabs(m)) * ldexp(1, -22);
            if (outside) req_ok &= ok; else fit_ok &= ok;
        }
    }
    CHECK(full_ok && bytes_ok, "window:8, q2 keys per channel in groups of 4: after each eviction the new token takes "
          "the freed row of the sealed group, the lane holds its 8 slots, live bytes = kv_bytes' recount");
    CHECK(fit_ok && kept_ok, "a new key inside its group's ranges is coded with the group's scales (within d/2) and the "
          "group's other keys keep their bits");
    CHECK(req_ok, "a new key outside them (50.0) re-quantizes the group: it and the others within the new d/2 of "
          "their true / previous values");
    kv_cache_free(&c);
}

/* clone/restore mid-group: a clone taken with an open group half full continues bit-identically to the original. */
static void test_kgroup_clone(void) {
    KVShape s = chan_shape(2, 64);
    KVCache a, b;
    char err[256];
    if (tcache(&a, &s, "h2o:20,type=q4,kgroup=channel,kgsize=6,residual=3")) return;
    static float k[60][2 * CHD], v[60][2 * CHD], q[60][4 * CHD], oa[4 * CHD], ob[4 * CHD];
    trng_seed(9);
    for (int t = 0; t < 60; t++) {
        for (int j = 0; j < 2 * CHD; j++) { k[t][j] = trng_normal(); v[t][j] = trng_normal(); }
        for (int j = 0; j < 4 * CHD; j++) q[t][j] = trng_normal();
    }
    for (int t = 0; t < 14; t++) { kv_append(&a, 0, t, k[t], v[t]); kv_attend_cpu(&a, oa, 0, t, q[t]); }
    int open = a.lanes[0].kopen[1];
    if (kv_cache_clone(&b, &a, err, sizeof err)) { CHECK(0, "clone: %s", err); kv_cache_free(&a); return; }
    int same = 1;
    for (int t = 14; t < 60; t++) {
        kv_append(&a, 0, t, k[t], v[t]);
        kv_append(&b, 0, t, k[t], v[t]);
        kv_attend_cpu(&a, oa, 0, t, q[t]);
        kv_attend_cpu(&b, ob, 0, t, q[t]);
        same &= !memcmp(oa, ob, sizeof oa) && a.live_bytes == b.live_bytes;
    }
    CHECK(open >= 0 && same && a.n_evictions > 0 && a.n_evictions == b.n_evictions, "h2o:20 with q4 keys per channel: "
          "a clone taken with group %d open continues bit-identically (%d evictions)", open, a.n_evictions);
    kv_cache_restore(&b, &a, err, sizeof err);
    CHECK(!memcmp(a.arena, b.arena, a.arena_bytes) && b.lanes[0].kopen[1] == a.lanes[0].kopen[1],
          "restore copies the groups' bytes and which group is open");
    kv_cache_free(&a);
    kv_cache_free(&b);
}

/* kv_bytes against the formula with every term, SmolLM2's shape (30 layers, 3 kv heads, head_dim 64) filled with
 * 4096 tokens, q8/q4/q2, keys per token and per channel (groups of 32), without and with residual=64; and what a
 * step reads. Per lane, with R residual slots and S = 4096 - R typed ones:
 *   allocated vectors = R·2·64·4 + S·(key + value bytes) (+ per channel: ⌈S/32⌉·(64 f16 scales + 64 f16 minimums)
 *                       + 32·64·4 for the open group's f32 keys); metadata = 4096·(position + live + free entry)
 *   per token: key = value = kv_vector_bytes; per channel: key = 64·bits/8 codes
 *   live at 4010 tokens (per channel: 125 - R/32 sealed groups, 10 keys open): the sealed keys' codes, their groups'
 *   headers, the open keys in f32 (64·4 each), every value, the residual, the metadata of 4010 slots. */
static void test_kgroup_accounting(void) {
    KVShape s = tshape(30, 9, 3, 64, 4096);
    static const KVType tys[] = {KV_Q8, KV_Q4, KV_Q2};
    static const int bits[] = {8, 4, 2};
    static const size_t vec[] = {2 * (2 + 32), 2 * (4 + 16), 2 * (4 + 8)};   /* per token, two groups of 32 */
    static float k[3 * 64], v[3 * 64], q[9 * 64], out[9 * 64];
    for (int ti = 0; ti < 3; ti++)
        for (int ch = 0; ch < 2; ch++)
            for (int res = 0; res < 2; res++) {
                char spec[96];
                size_t R = res ? 64 : 0, S = 4096 - R, lanes = 90, meta = 12;
                snprintf(spec, sizeof spec, "full,type=%s%s%s", kv_type_names[tys[ti]], ch ? ",kgroup=channel" : "",
                         res ? ",residual=64" : "");
                KVCache c;
                if (tcache(&c, &s, spec)) continue;
                size_t kb = ch ? (size_t)64 * bits[ti] / 8 : vec[ti], hdr = 64 * 2 + 64 * 2, open = 32 * 64 * 4;
                size_t want_vec = lanes * (R * 2 * 64 * 4 + S * (kb + vec[ti]) + (ch ? (S + 31) / 32 * hdr + open : 0));
                size_t want_meta = lanes * 4096 * meta;
                KVBytes b0 = kv_bytes(&c);
                int ok0 = b0.vec_alloc == want_vec && b0.meta_alloc == want_meta &&
                          kv_alloc_bytes_for(&s, &c.spec, c.policy.ops, c.policy.budget) == b0.total_alloc &&
                          b0.formula_alloc == (size_t)(2.0 * 30 * 3 * 64 * 4096 * bits[ti] / 8);
                trng_seed(3);
                int fill_ok = 1, t = 0;
                for (; t < 4010 && fill_ok; t++) {
                    for (int j = 0; j < 3 * 64; j++) { k[j] = trng_normal(); v[j] = trng_normal(); }
                    for (int l = 0; l < 30; l++) fill_ok &= kv_append(&c, l, t, k, v) == 0;
                }
                size_t n_typed = 4010 - R, sealed = ch ? n_typed / 32 * 32 : n_typed, n_open = n_typed - sealed;
                size_t live_lane = R * 2 * 64 * 4 + sealed * kb + n_typed * vec[ti] +
                                   (ch ? sealed / 32 * hdr + n_open * 64 * 4 : 0);
                KVBytes b1 = kv_bytes(&c);
                int ok1 = b1.vec_live == lanes * live_lane && b1.meta_live == lanes * 4010 * meta &&
                          c.live_bytes == b1.total_live;
                uint64_t read0 = c.bytes_read;
                for (int j = 0; j < 9 * 64; j++) q[j] = trng_normal();
                kv_attend_cpu(&c, out, 0, t - 1, q);
                int ok_read = c.bytes_read - read0 == 3 * live_lane;
                for (; t < 4096 && fill_ok; t++)
                    for (int l = 0; l < 30; l++) fill_ok &= kv_append(&c, l, t, k, v) == 0;
                KVBytes b2 = kv_bytes(&c);
                /* full at 4096 tokens: every group sealed (S is a multiple of 32), the open buffer idle */
                int ok2 = b2.total_live == b0.total_alloc - (ch ? lanes * open : 0) && c.live_bytes == b2.total_live;
                CHECK(fill_ok && ok0 && ok1 && ok_read && ok2, "'%s', SmolLM2 shape: allocated %zu B = vectors %zu "
                      "(want %zu) + metadata %zu; at 4010 tokens live vectors %zu (want %zu), one step of layer 0 "
                      "reads %llu B (want %zu); at 4096 live %zu", spec, b0.total_alloc, b0.vec_alloc, want_vec,
                      b0.meta_alloc, b1.vec_live, lanes * live_lane, (unsigned long long)(c.bytes_read - read0),
                      3 * live_lane, b2.total_live);
                kv_cache_free(&c);
            }
}

int main(void) {
    test_registry();
    test_storage_types();
    test_accounting();
    test_byte_budgets();
    test_bad_specs();
    test_room_for_all_is_full();
    test_pos_cache_no_eviction();
    test_pos_cache_reference();
    test_residual();
    test_reset_and_full_stop();
    test_threads();
    test_kgroup_specs();
    test_kgroup_quantization();
    test_kgroup_eviction();
    test_kgroup_clone();
    test_kgroup_accounting();
    CHECK_EXIT();
}
