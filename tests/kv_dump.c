/* kv_dump: the CPU attention over a grid of shapes, storage types, position modes and evicting policies, printing
 * one FNV-1a hash per case of every attention output and every probability it produced, per (token, layer) in
 * token order. `kv_dump` runs token by token (kv_append + kv_attend_cpu); `kv_dump chunk` feeds the same tokens
 * through kv_attend_chunk layer by layer in chunks of 5, 64, 1, 17, 2 and 40 tokens (in turn), as forward_chunk
 * does. tests/test_kv_portable.sh builds it twice, with the machine's vector instructions and with none (kv.c's
 * portable C), runs both modes on 1 and 2 threads, and checks that every hash agrees: the attention arithmetic is
 * defined by its order, not by the instruction set, the chunking or the threads. Not a test by itself. */
#include "kv.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

#define STEPS 300
#define LAYERS 2

/* One (token, layer) is hashed as probs_hash ^ out_hash: its probabilities (c->scores after its step 4, in rank order
 * per query head) and its output. */
static uint64_t probs_hash(const KVCache *c, int l) {
    int G = c->shape.n_heads / c->shape.n_kv_heads;
    uint64_t h = 0xcbf29ce484222325ull;
    for (int hh = 0; hh < c->shape.n_heads; hh++)
        h = fnv(h, c->scores + (size_t)hh * c->budget,
                (size_t)c->lanes[l * c->shape.n_kv_heads + hh / G].n_live * sizeof(float));
    return h;
}
static uint64_t out_hash(const float *out, int nq) {
    return fnv(0xcbf29ce484222325ull, out, (size_t)nq * sizeof(float));
}
/* kv_attend_chunk's hook, after token pos's step 4: its probabilities (its output comes when the chunk is done) */
static void hook(void *ctx, int l, const KVCache *c, int pos) { ((uint64_t *)ctx)[pos * LAYERS + l] = probs_hash(c, l); }

int main(int argc, char **argv) {
    int chunked = argc > 1 && !strcmp(argv[1], "chunk");
    static const struct { int heads, kv_heads, hd; } shapes[] = {{9, 3, 64}, {6, 2, 12}, {4, 4, 80}, {8, 2, 8},
                                                                {10, 2, 128}, {6, 1, 24}, {4, 2, 32}, {12, 2, 32}};
    /* scissorhands with drop= frees several slots at once, so chunks find room again in mid-stream */
    static const char *specs[] = {"full", "window:37", "h2o:40,ktype=q8,vtype=q4,residual=8", "sink:50,ktype=f16,vtype=bf16,pos=cache",
                                  "tova:33,ktype=q4,vtype=q8,residual=8", "scissorhands:45,pos=cache", "snapkv:64,type=q8",
                                  "scissorhands:45,drop=12,ktype=q8", "full,prec=f32:12/q8:20/q4",
                                  "full,kprec=f32:20/q4,vprec=f16:6/q8", "full,rank=4,type=q8,calib=111",
                                  "full,krank=6,calib=70,pos=cache", "full,type=q4,kgroup=channel,kgsize=12",
                                  "h2o:40,ktype=q4,vtype=q8,kgroup=channel,kgsize=8,residual=8", "topk:24",
                                  "full,type=q2,kgroup=channel,kgsize=10", "sink:45,type=q8,kgroup=channel,kgsize=16"};
    static const int chunks[] = {5, 64, 1, 17, 2, 40};
    uint64_t rng = 7;
    for (size_t a = 0; a < sizeof shapes / sizeof shapes[0]; a++)
        for (size_t b = 0; b < sizeof specs / sizeof specs[0]; b++) {
            KVShape shape = {LAYERS, shapes[a].heads, shapes[a].kv_heads, shapes[a].hd, STEPS, 10000.0f, (int)(a & 1), NULL};
            KVSpec spec;
            KVCache c;
            char err[256];
            if (kv_spec_parse(&spec, specs[b], KV_F32, err, sizeof err) ||
                kv_cache_init(&c, &shape, &spec, err, sizeof err)) {
                fprintf(stderr, "kv_dump: %s: %s\n", specs[b], err);
                return 1;
            }
            int nq = shape.n_heads * shape.head_dim, nkv = shape.n_kv_heads * shape.head_dim;
            /* inputs per (layer, token), drawn in token order */
            float *q = malloc(sizeof(float) * LAYERS * STEPS * nq), *k = malloc(sizeof(float) * LAYERS * STEPS * nkv);
            float *v = malloc(sizeof(float) * LAYERS * STEPS * nkv), *out = malloc(sizeof(float) * 64 * nq);
            uint64_t *item = malloc(sizeof(uint64_t) * LAYERS * STEPS);
            if (!q || !k || !v || !out || !item) { fprintf(stderr, "kv_dump: out of memory\n"); return 1; }
            for (int t = 0; t < STEPS; t++)
                for (int l = 0; l < LAYERS; l++) {
                    size_t r = (size_t)l * STEPS + t;
                    for (int i = 0; i < nkv; i++) {
                        k[r * nkv + i] = (float)((splitmix64(&rng) >> 40) * 0x1p-22) - 2.0f;
                        v[r * nkv + i] = (float)((splitmix64(&rng) >> 40) * 0x1p-24) - 0.5f;
                    }
                    for (int i = 0; i < nq; i++) q[r * nq + i] = (float)((splitmix64(&rng) >> 40) * 0x1p-22) - 2.0f;
                }
            if (!chunked) {
                for (int t = 0; t < STEPS; t++)
                    for (int l = 0; l < LAYERS; l++) {
                        size_t r = (size_t)l * STEPS + t;
                        if (kv_append(&c, l, t, k + r * nkv, v + r * nkv)) { fprintf(stderr, "kv_dump: append failed\n"); return 1; }
                        kv_attend_cpu(&c, out, l, t, q + r * nq);
                        item[t * LAYERS + l] = probs_hash(&c, l) ^ out_hash(out, nq);
                    }
            } else {
                for (int t0 = 0, ci = 0; t0 < STEPS; ci++) {
                    int n = chunks[ci % 6] < STEPS - t0 ? chunks[ci % 6] : STEPS - t0;
                    for (int l = 0; l < LAYERS; l++) {
                        size_t r = (size_t)l * STEPS + t0;
                        if (kv_attend_chunk(&c, out, l, t0, n, q + r * nq, k + r * nkv, v + r * nkv, hook, item)) {
                            fprintf(stderr, "kv_dump: the cache is full\n");
                            return 1;
                        }
                        for (int u = 0; u < n; u++) item[(t0 + u) * LAYERS + l] ^= out_hash(out + (size_t)u * nq, nq);
                    }
                    t0 += n;
                }
            }
            uint64_t h = fnv(0xcbf29ce484222325ull, item, sizeof(uint64_t) * LAYERS * STEPS);
            printf("heads %2d/%d head_dim %3d %-34s %016llx\n", shape.n_heads, shape.n_kv_heads, shape.head_dim,
                   specs[b], (unsigned long long)h);
            free(q); free(k); free(v); free(out); free(item);
            kv_cache_free(&c);
        }
    return 0;
}
