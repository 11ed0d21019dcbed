/* test_bytes.c: the memory and bandwidth axes of every storage form, at the size people quote: a SmolLM2-135M cache
 * (30 layers, 3 kv heads, head_dim 64) after 4,096 tokens. For each spec the expected bytes are written out term by
 * term from the layouts kv_codec.h documents (f32 4 bytes an element, f16 and bf16 2, q8 an f16 scale and 32 int8
 * per group of 32, q4 an f16 scale, an f16 minimum and 16 bytes per group of 32, q2 the same with 8 bytes) and the per-slot bookkeeping kv.h
 * documents (an int32 position, one live-list and one free-list int), with each lane's precision bands worked out by
 * hand from the spec: kv_vector_bytes and the cache's own band layout are never consulted. Checked: kv_bytes
 * (allocated, live, vectors and metadata apart), kv_alloc_bytes_for, and the KV bytes one decode step reads.
 * Synthetic keys and values; no model is needed. */
#include "kv.h"
#include "tests/check.h"
#include "tests/test_kv_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL 30
#define NKV 3
#define NH 9
#define HD 64
#define T 4096

/* bytes of one head_dim vector, from the layouts (not kv_vector_bytes) */
static size_t ref_vec(KVType ty) {
    switch (ty) {
    case KV_F32: return 4 * HD;
    case KV_F16: case KV_BF16: return 2 * HD;
    case KV_Q8: return (HD / 32) * (2 + 32);
    case KV_Q4: return (HD / 32) * (2 + 2 + 16);
    case KV_Q2: return (HD / 32) * (2 + 2 + 8);
    default: return 0;
    }
}
#define SLOT_META (4 + 4 + 4)   /* int32 position, live-list int, free-list int (no policy metadata here) */

typedef struct {
    const char *spec;
    int cap;                     /* slots per lane */
    int n_bands;
    KVType k[4], v[4];           /* each band's key and value form, newest first */
    int slots[4];                /* each band's slots */
} Case;

static const Case cases[] = {
    {"full", T, 1, {KV_F32}, {KV_F32}, {T}},
    {"full,type=f16", T, 1, {KV_F16}, {KV_F16}, {T}},
    {"full,type=bf16", T, 1, {KV_BF16}, {KV_BF16}, {T}},
    {"full,type=q8", T, 1, {KV_Q8}, {KV_Q8}, {T}},
    {"full,type=q4", T, 1, {KV_Q4}, {KV_Q4}, {T}},
    {"full,type=q2", T, 1, {KV_Q2}, {KV_Q2}, {T}},
    {"window:1024,kprec=f32:64/q2,vprec=f32:32/q4", 1024, 3, {KV_F32, KV_F32, KV_Q2}, {KV_F32, KV_Q4, KV_Q4},
     {32, 32, 960}},
    {"full,ktype=f16,vtype=f32", T, 1, {KV_F16}, {KV_F32}, {T}},
    {"full,prec=f32:64/q8:512/q4", T, 3, {KV_F32, KV_Q8, KV_Q4}, {KV_F32, KV_Q8, KV_Q4}, {64, 512, T - 576}},
    {"full,kprec=f32:64/q4,vprec=f32:256/q8", T, 3, {KV_F32, KV_Q4, KV_Q4}, {KV_F32, KV_F32, KV_Q8},
     {64, 192, T - 256}},
    {"window:1024,type=q4,residual=64", 1024, 2, {KV_F32, KV_Q4}, {KV_F32, KV_Q4}, {64, 960}},
    {"sink:512,kprec=f16:128/q8", 512, 2, {KV_F16, KV_Q8}, {KV_F32, KV_F32}, {128, 384}},
};

static void run_case(const Case *cs) {
    KVShape s = tshape(NL, NH, NKV, HD, T);
    KVCache c;
    if (tcache(&c, &s, cs->spec)) return;
    static float k[NKV * HD], v[NKV * HD], q[NH * HD], out[NH * HD];
    trng_seed(7);
    int ok = 1;
    uint64_t before = 0;
    for (int t = 0; t < T && ok; t++) {
        if (t == T - 1) before = c.bytes_read;
        for (int l = 0; l < NL; l++) {
            for (int i = 0; i < NKV * HD; i++) { k[i] = 2 * trng_unif() - 1; v[i] = 2 * trng_unif() - 1; }
            if (kv_append(&c, l, t, k, v)) { CHECK(0, "%s: kv_append failed at t=%d", cs->spec, t); ok = 0; break; }
            if (t == T - 1) {   /* the last token is a decode step: it attends */
                for (int i = 0; i < NH * HD; i++) q[i] = 2 * trng_unif() - 1;
                kv_attend_cpu(&c, out, l, t, q);
            }
        }
    }
    if (!ok) { kv_cache_free(&c); return; }
    size_t lane_vec = 0;
    for (int b = 0; b < cs->n_bands; b++) lane_vec += (size_t)cs->slots[b] * (ref_vec(cs->k[b]) + ref_vec(cs->v[b]));
    size_t lanes = (size_t)NL * NKV, vec = lanes * lane_vec, meta = lanes * (size_t)cs->cap * SLOT_META;
    KVBytes got = kv_bytes(&c);
    CHECK(got.vec_alloc == vec && got.vec_live == vec, "%s: vectors (codes, scales, minima) %zu B allocated and %zu B "
          "live after %d tokens == %zu lanes x %zu B per lane = %zu B", cs->spec, got.vec_alloc, got.vec_live, T,
          lanes, lane_vec, vec);
    CHECK(got.meta_alloc == meta && got.meta_live == meta, "%s: per-slot bookkeeping %zu B allocated, %zu B live == "
          "%zu lanes x %d slots x %d B = %zu B", cs->spec, got.meta_alloc, got.meta_live, lanes, cs->cap, SLOT_META,
          meta);
    CHECK(got.total_alloc == vec + meta && got.total_live == vec + meta && c.live_bytes == vec + meta,
          "%s: total %zu B allocated, %zu B live (running count %zu B) == %zu B", cs->spec, got.total_alloc,
          got.total_live, c.live_bytes, vec + meta);
    size_t pre = kv_alloc_bytes_for(&s, &c.spec, c.policy.ops, c.policy.budget);
    CHECK(pre == vec + meta, "%s: kv_alloc_bytes_for (before any cache is made) %zu B == %zu B", cs->spec, pre,
          vec + meta);
    /* the decode step at the last token read every lane's live slots once per kv head, in their stored form */
    uint64_t read = c.bytes_read - before;
    CHECK(read == vec, "%s: the decode step at position %d read %llu B == every live slot's key and value in its "
          "stored form, %zu B", cs->spec, T - 1, (unsigned long long)read, vec);
    kv_cache_free(&c);
}

int main(void) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
    CHECK_EXIT();
}
