/* test_kv_util.h: helpers shared by tests/test_kv.c and tests/test_policies.c: a tiny attention shape, a seeded
 * generator, cache creation that fails the test with the message, and set printing. No model is needed: the tests
 * drive kv_append + kv_attend_cpu directly with synthetic k, v, q.
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim. */
#ifndef KVLAB_TEST_KV_UTIL_H
#define KVLAB_TEST_KV_UTIL_H
#include "kv.h"
#include "tests/check.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* xorshift64*: a seeded stream for test data only */
static uint64_t trng_state = 88172645463325252ull;
static inline void trng_seed(uint64_t s) { trng_state = s * 2685821657736338717ull + 1; }
static inline uint64_t trng_u64(void) {
    trng_state ^= trng_state >> 12; trng_state ^= trng_state << 25; trng_state ^= trng_state >> 27;
    return trng_state * 2685821657736338717ull;
}
static inline float trng_unif(void) { return (float)((trng_u64() >> 40) * (1.0 / 16777216.0)); }   /* [0, 1) */
static inline float trng_normal(void) {                                                              /* Box-Muller */
    double u = (trng_u64() >> 11) * (1.0 / 9007199254740992.0) + 1e-300, v = (trng_u64() >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static inline KVShape tshape(int n_layers, int n_heads, int n_kv_heads, int head_dim, int seq_len) {
    KVShape s = {n_layers, n_heads, n_kv_heads, head_dim, seq_len, 10000.0f, 0, NULL};
    return s;
}

/* tshape with RoPE made the identity to f32 precision (frequency factors of 1e30), so scores are plain dot products:
 * the policy tests craft query-key alignments that decide attention. head_dim <= 512. */
static inline KVShape tshape_norope(int n_layers, int n_heads, int n_kv_heads, int head_dim, int seq_len) {
    static float off[256];
    for (int i = 0; i < 256; i++) off[i] = 1e30f;
    KVShape s = tshape(n_layers, n_heads, n_kv_heads, head_dim, seq_len);
    s.rope_factors = off;
    return s;
}

/* Parse + init; on error print FAIL with the message and return -1. */
static inline int tcache(KVCache *c, const KVShape *s, const char *spec_text) {
    KVSpec sp;
    char err[512];
    if (kv_spec_parse(&sp, spec_text, KV_F32, err, sizeof err) || kv_cache_init(c, s, &sp, err, sizeof err)) {
        CHECK(0, "create cache '%s': %s", spec_text, err);
        return -1;
    }
    return 0;
}

/* Parse + init a spec expected to fail: returns kv_spec_parse's or kv_cache_init's status (a cache made after all is
 * freed), the message in err. */
static inline int tcache_error(const KVShape *s, const char *spec_text, char *err, size_t errlen) {
    KVSpec sp;
    KVCache c;
    err[0] = 0;
    int rc = kv_spec_parse(&sp, spec_text, KV_F32, err, errlen);
    if (!rc) rc = kv_cache_init(&c, s, &sp, err, errlen);
    if (!rc) kv_cache_free(&c);
    return rc;
}

/* The dense attention of one query head in double, the reference the policy tests compare outputs with: q (hd) and
 * keys k (n, hd) as the caller rotated them (or not), value rows v[i] (hd, f32); returns max_j |o_j - out[j]| for
 * o = softmax(q·k_i/√hd)·V (INFINITY when out holds a NaN). */
static inline double tdense_err(const double *q, const double *k, const float *const *v, int n, int hd,
                                const float *out) {
    double sc[n > 0 ? n : 1], mx = -1e300, sum = 0, o[hd], e = 0;
    for (int j = 0; j < hd; j++) o[j] = 0;
    for (int i = 0; i < n; i++) {
        double d = 0;
        for (int j = 0; j < hd; j++) d += q[j] * k[(size_t)i * hd + j];
        sc[i] = d / sqrt((double)hd);
        if (sc[i] > mx) mx = sc[i];
    }
    for (int i = 0; i < n; i++) { sc[i] = exp(sc[i] - mx); sum += sc[i]; }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < hd; j++) o[j] += sc[i] / sum * v[i][j];
    for (int j = 0; j < hd; j++) {
        double x = fabs(o[j] - out[j]);
        if (!(x <= e)) e = x != x ? INFINITY : x;
    }
    return e;
}

/* A key of a per-channel band (kgroup=channel, kv.h) decoded from the cache's bytes by the layout kv.c documents:
 * band b's key region holds the rows' codes (band_kb bytes each), then from the next 16-byte boundary each group's
 * head_dim f16 scales and head_dim f16 minimums, then from the next boundary the open group's f32 keys (row r at
 * r mod G); code e of a row at bits bits·(e mod (8/bits)) of byte e·bits/8; x_e = d_e·q_e + m_e in f32. */
static inline void tchan_key(const KVCache *c, const KVLane *ln, int b, int slot, float *x) {
    int hd = c->shape.head_dim, G = c->kgroup, S = ln->band_slots[b], r = slot - ln->band_first[b], j = r / G;
    int bits = c->band_ktype[b] == KV_Q8 ? 8 : c->band_ktype[b] == KV_Q4 ? 4 : 2, per = 8 / bits;
    size_t kb = c->band_kb[b], hdr = ((size_t)S * kb + 15) / 16 * 16, groups = (size_t)(S + G - 1) / G;
    size_t open = hdr + (groups * 4 * hd + 15) / 16 * 16;
    const uint8_t *base = ln->k[b];
    if (ln->kopen[b] == j) { memcpy(x, base + open + (size_t)(r % G) * hd * 4, (size_t)hd * 4); return; }
    const uint8_t *h = base + hdr + (size_t)j * 4 * hd, *q = base + (size_t)r * kb;
    for (int e = 0; e < hd; e++) {
        float d = kv_f16_to_f32((uint16_t)(h[2 * e] | h[2 * e + 1] << 8));
        float m = kv_f16_to_f32((uint16_t)(h[2 * hd + 2 * e] | h[2 * hd + 2 * e + 1] << 8));
        int code = (q[e / per] >> (bits * (e % per))) & ((1 << bits) - 1);
        x[e] = d * (float)code + m;
    }
}

static inline void tprint_set(char *buf, size_t len, const int *p, int n) {
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < n && o + 12 < len; i++) o += (size_t)snprintf(buf + o, len - o, "%s%d", i ? "," : "", p[i]);
}

/* blocks:B,global=G,local=L,stride=S's positions at query position t over positions 0..t (policies.c), written from
 * its definition: the first G, the L newest, every S-th between, the strided part cut oldest first beyond B; returns
 * the count, and in *n_cut how many strided positions the cap cut */
static inline int tblocks_ref(int t, int B, int G, int Lc, int S, int *want, int *n_cut) {
    int m = 0, fixed = 0, strided = 0;
    for (int p = 0; p <= t; p++) {
        if (p < G || p > t - Lc) fixed++;
        else if (p % S == 0) strided++;
    }
    int cut = strided - (B - fixed);
    *n_cut = cut > 0 ? cut : 0;
    for (int p = 0; p <= t; p++) {
        if (p < G || p > t - Lc) want[m++] = p;
        else if (p % S == 0) {
            if (cut > 0) cut--;
            else want[m++] = p;
        }
    }
    return m;
}

#endif
