/* fuzz_kvspec.c: libFuzzer target for the -kv spec parser (kv_spec_parse, kv_spec_check_mode) and the policy side of
 * kv_cache_init, then a short token stream through whatever cache was built: 40 steps of kv_append + kv_attend_cpu
 * (past the context, so evicting policies evict and `full` reports its end), the accounting, a reset and 8 more steps.
 * Input: byte 0 picks the model shape, the default storage type (-kvt) and whether a prompt length is announced; the
 * rest, up to a NUL, is the spec text. Budgets over 4096 tokens or 64 MiB are parsed but not allocated (memory). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"

static const KVShape shapes[4] = {
    {2, 4, 2, 8, 24, 10000.0f, 0, NULL},
    {1, 3, 1, 6, 16, 500000.0f, 1, NULL},
    {1, 2, 2, 80, 12, 10000.0f, 0, NULL},
    {3, 9, 3, 64, 20, 100000.0f, 1, NULL},
};

static void steps(KVCache *c, int from, int to) {
    const KVShape *s = &c->shape;
    size_t qn = (size_t)s->n_heads * s->head_dim, kn = (size_t)s->n_kv_heads * s->head_dim;
    float *q = malloc(qn * sizeof(float)), *k = malloc(kn * sizeof(float)), *v = malloc(kn * sizeof(float));
    float *out = malloc(qn * sizeof(float));
    for (int t = from; t < to; t++) {
        for (size_t i = 0; i < qn; i++) q[i] = sinf(0.7f * (float)(t + 1) * (float)(i + 3));
        for (size_t i = 0; i < kn; i++) { k[i] = cosf(0.3f * (float)(t * 7 + (int)i)); v[i] = sinf((float)(t + (int)i)); }
        for (int l = 0; l < s->n_layers; l++) {
            if (kv_append(c, l, t, k, v)) goto done;   /* full: the cache is at its end */
            kv_attend_cpu(c, out, l, t, q);
            for (size_t i = 0; i < qn; i++)
                if (!isfinite(out[i])) abort();       /* finite inputs must give finite attention */
        }
    }
done:
    free(q); free(k); free(v); free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    char text[512];
    size_t n = size - 1 < sizeof text - 1 ? size - 1 : sizeof text - 1;
    memcpy(text, data + 1, n);
    text[n] = 0;
    KVShape shape = shapes[data[0] & 3];
    KVType deft = (KVType)((data[0] >> 2) % KV_NTYPES);
    KVSpec spec;
    char err[512];
    if (kv_spec_parse(&spec, text, deft, err, sizeof err)) return 0;
    kv_spec_check_mode(&spec, "ppl", err, sizeof err);
    kv_spec_check_mode(&spec, "generate", err, sizeof err);
    if (spec.budget > 4096 || spec.budget_bytes > (64u << 20)) return 0;
    KVCache c;
    if (kv_cache_init(&c, &shape, &spec, err, sizeof err)) return 0;
    if (data[0] & 0x80) kv_set_prompt_len(&c, 6);
    steps(&c, 0, 40);
    KVBytes b = kv_bytes(&c);
    if (b.total_live > b.total_alloc) abort();
    char desc[256];
    kv_describe(&c, desc, sizeof desc);
    int pos[64];
    for (int l = 0; l < shape.n_layers; l++)
        for (int g = 0; g < shape.n_kv_heads; g++) {
            if (kv_lane_positions(&c, l, g, pos, 64) > c.budget) abort();
            kv_lane_bytes(&c, l, g);
        }
    kv_cache_reset(&c);
    steps(&c, 0, 8);
    kv_cache_free(&c);
    return 0;
}
