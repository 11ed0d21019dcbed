/* attn_bench: the CPU attention alone, on SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 kv heads,
 * head_dim 64), with every lane filled to N tokens of random keys and values.
 *   default: one decode step's attention over all 30 layers (kv_attend_cpu; the cache is far larger than L2 past a
 *            few hundred tokens), median of 201 repeats: ms per step, the bytes of K and V read per step and the rate;
 *   -chunk C: C more tokens through all 30 layers with kv_attend_chunk (steps 1-4, as forward_layer runs a chunk),
 *            median of 15 repeats on freshly filled caches: ms per token. -chunk 1 is token by token.
 * Usage: build/attn_bench [N...] [-kv SPEC] [-chunk C] (default N: 256 1024 2048 4096, SPEC full). Threads:
 * OMP_NUM_THREADS. */
#include "kv.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static float rnd(uint64_t *rng) { return (float)((splitmix64(rng) >> 40) * 0x1p-24) - 0.5f; }

/* A cache of the bench's shape with room for N + extra tokens, filled with N tokens of random keys and values. */
static int fill(KVCache *c, const char *spec_text, int N, int extra, uint64_t *rng) {
    KVShape shape = {30, 9, 3, 64, N + extra + 1, 100000.0f, 0, NULL};
    KVSpec spec;
    char err[256];
    if (kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err) || kv_cache_init(c, &shape, &spec, err, sizeof err)) {
        fprintf(stderr, "attn_bench: %s\n", err);
        return -1;
    }
    float k[3 * 64], v[3 * 64];
    for (int t = 0; t < N; t++)
        for (int l = 0; l < 30; l++) {
            for (int i = 0; i < 3 * 64; i++) { k[i] = rnd(rng); v[i] = rnd(rng); }
            if (kv_append(c, l, t, k, v)) { fprintf(stderr, "attn_bench: append failed\n"); return -1; }
        }
    return 0;
}

int main(int argc, char **argv) {
    int ns[16], n_ns = 0, chunk = 0;
    const char *spec_text = "full";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-kv") && i + 1 < argc) spec_text = argv[++i];
        else if (!strcmp(argv[i], "-chunk") && i + 1 < argc && atoi(argv[i + 1]) > 0) chunk = atoi(argv[++i]);
        else if (n_ns < 16 && atoi(argv[i]) > 0) ns[n_ns++] = atoi(argv[i]);
        else { fprintf(stderr, "usage: %s [N...] [-kv SPEC] [-chunk C]\n", argv[0]); return 1; }
    }
    if (n_ns == 0) { ns[0] = 256; ns[1] = 1024; ns[2] = 2048; ns[3] = 4096; n_ns = 4; }
    uint64_t rng = 1;
    if (chunk) {
        printf("%8s %10s   (%s, -chunk %d: steps 1-4 for %d tokens, 30 layers x 3 lanes, head_dim 64, GQA 3)\n",
               "tokens", "ms/token", spec_text, chunk, chunk);
        float *q = malloc(sizeof(float) * chunk * 9 * 64), *k = malloc(sizeof(float) * chunk * 3 * 64);
        float *v = malloc(sizeof(float) * chunk * 3 * 64), *out = malloc(sizeof(float) * chunk * 9 * 64);
        if (!q || !k || !v || !out) { fprintf(stderr, "attn_bench: out of memory\n"); return 1; }
        for (int a = 0; a < n_ns; a++) {
            double ts[15];
            for (int r = 0; r < 15; r++) {
                KVCache c;
                if (fill(&c, spec_text, ns[a], chunk, &rng)) return 1;
                for (int i = 0; i < chunk * 9 * 64; i++) q[i] = rnd(&rng);
                for (int i = 0; i < chunk * 3 * 64; i++) { k[i] = rnd(&rng); v[i] = rnd(&rng); }
                double t0 = now();
                for (int l = 0; l < 30; l++)
                    if (kv_attend_chunk(&c, out, l, ns[a], chunk, q, k, v, NULL, NULL)) {
                        fprintf(stderr, "attn_bench: the cache is full\n");
                        return 1;
                    }
                ts[r] = (now() - t0) / chunk;
                kv_cache_free(&c);
            }
            qsort(ts, 15, sizeof ts[0], cmp_double);
            printf("%8d %10.3f\n", ns[a], ts[7] * 1e3);
        }
        free(q); free(k); free(v); free(out);
        return 0;
    }
    printf("%8s %10s %12s %10s %10s   (%s, 30 layers x 3 lanes, head_dim 64, GQA 3)\n", "tokens", "ms/step",
           "KV MB/step", "GB/s", "GMAC/s", spec_text);
    for (int a = 0; a < n_ns; a++) {
        int N = ns[a];
        KVCache c;
        if (fill(&c, spec_text, N, 0, &rng)) return 1;
        float q[9 * 64], out[9 * 64];
        for (int i = 0; i < 9 * 64; i++) q[i] = rnd(&rng);
        int n_live = c.lanes[0].n_live;
        double ts[201];
        for (int r = 0; r < 201; r++) {
            double t0 = now();
            for (int l = 0; l < 30; l++) kv_attend_cpu(&c, out, l, N - 1, q);
            ts[r] = now() - t0;
        }
        qsort(ts, 201, sizeof ts[0], cmp_double);
        double med = ts[100];
        double bytes = (double)kv_bytes(&c).vec_live;   /* every live key and value is read once per step */
        double macs = 30.0 * 9 * n_live * 64 * 2;
        printf("%8d %10.3f %12.1f %10.1f %10.1f\n", n_live, med * 1e3, bytes / 1e6, bytes / med / 1e9,
               macs / med / 1e9);
        kv_cache_free(&c);
    }
    return 0;
}
