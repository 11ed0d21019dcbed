/* attn_bench: kv_attend_cpu alone, on SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 kv heads,
 * head_dim 64), with every lane filled to N tokens of random keys and values. It times one decode step's attention
 * over all 30 layers (the cache is far larger than L2 past a few hundred tokens), median of repeats, and prints
 * ms per step, the bytes of K and V read per step and the rate. Usage: build/attn_bench [N...] [-kv SPEC]
 * (default N: 256 1024 2048 4096, SPEC full). Threads: OMP_NUM_THREADS. */
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

int main(int argc, char **argv) {
    int ns[16], n_ns = 0;
    const char *spec_text = "full";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-kv") && i + 1 < argc) spec_text = argv[++i];
        else if (n_ns < 16 && atoi(argv[i]) > 0) ns[n_ns++] = atoi(argv[i]);
        else { fprintf(stderr, "usage: %s [N...] [-kv SPEC]\n", argv[0]); return 1; }
    }
    if (n_ns == 0) { ns[0] = 256; ns[1] = 1024; ns[2] = 2048; ns[3] = 4096; n_ns = 4; }
    printf("%8s %10s %12s %10s %10s   (%s, 30 layers x 3 lanes, head_dim 64, GQA 3)\n", "tokens", "ms/step",
           "KV MB/step", "GB/s", "GMAC/s", spec_text);
    for (int a = 0; a < n_ns; a++) {
        int N = ns[a];
        KVShape shape = {30, 9, 3, 64, N + 1, 100000.0f, 0, NULL};
        KVSpec spec;
        KVCache c;
        char err[256];
        if (kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err) || kv_cache_init(&c, &shape, &spec, err, sizeof err)) {
            fprintf(stderr, "attn_bench: %s\n", err);
            return 1;
        }
        float k[3 * 64], v[3 * 64], q[9 * 64], out[9 * 64];
        uint64_t rng = 1;
        for (int t = 0; t < N; t++)
            for (int l = 0; l < 30; l++) {
                for (int i = 0; i < 3 * 64; i++) {
                    k[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-24) - 0.5f;
                    v[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-24) - 0.5f;
                }
                if (kv_append(&c, l, t, k, v)) { fprintf(stderr, "attn_bench: append failed\n"); return 1; }
            }
        for (int i = 0; i < 9 * 64; i++) q[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-24) - 0.5f;
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
