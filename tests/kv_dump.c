/* kv_dump: kv_attend_cpu over a grid of shapes, storage types, position modes and evicting policies, printing one
 * FNV-1a hash per case of every attention output and every probability it produced. tests/test_kv_portable.sh
 * builds it twice, with the machine's vector instructions and with none (kv.c's portable C), and checks that every
 * hash agrees: the attention arithmetic is defined by its order, not by the instruction set. Not a test by itself. */
#include "kv.h"
#include <stdio.h>
#include <string.h>

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

int main(void) {
    static const struct { int heads, kv_heads, hd; } shapes[] = {{9, 3, 64}, {6, 2, 12}, {4, 4, 80}, {8, 2, 8},
                                                                {10, 2, 128}, {6, 1, 24}};
    static const char *specs[] = {"full", "window:37", "h2o:40,ktype=q8,vtype=q4", "sink:50,ktype=f16,vtype=bf16,pos=cache",
                                  "tova:33,ktype=q4,vtype=q8,residual=8", "scissorhands:45,pos=cache", "snapkv:64,type=q8"};
    int steps = 300;
    uint64_t rng = 7;
    for (size_t a = 0; a < sizeof shapes / sizeof shapes[0]; a++)
        for (size_t b = 0; b < sizeof specs / sizeof specs[0]; b++) {
            KVShape shape = {2, shapes[a].heads, shapes[a].kv_heads, shapes[a].hd, steps, 10000.0f, (int)(a & 1), NULL};
            KVSpec spec;
            KVCache c;
            char err[256];
            if (kv_spec_parse(&spec, specs[b], KV_F32, err, sizeof err) ||
                kv_cache_init(&c, &shape, &spec, err, sizeof err)) {
                fprintf(stderr, "kv_dump: %s: %s\n", specs[b], err);
                return 1;
            }
            int nq = shape.n_heads * shape.head_dim, nkv = shape.n_kv_heads * shape.head_dim;
            float q[nq], k[nkv], v[nkv], out[nq];
            uint64_t h = 0xcbf29ce484222325ull;
            for (int t = 0; t < steps; t++)
                for (int l = 0; l < 2; l++) {
                    for (int i = 0; i < nkv; i++) {
                        k[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-22) - 2.0f;
                        v[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-24) - 0.5f;
                    }
                    for (int i = 0; i < nq; i++) q[i] = (float)((splitmix64(&rng) >> 40) * 0x1p-22) - 2.0f;
                    if (kv_append(&c, l, t, k, v)) { fprintf(stderr, "kv_dump: append failed\n"); return 1; }
                    kv_attend_cpu(&c, out, l, t, q);
                    h = fnv(h, out, sizeof out);
                    for (int hh = 0; hh < shape.n_heads; hh++)
                        h = fnv(h, c.scores + (size_t)hh * c.budget,
                                (size_t)c.lanes[l * shape.n_kv_heads + hh / (shape.n_heads / shape.n_kv_heads)].n_live *
                                    sizeof(float));
                }
            printf("heads %2d/%d head_dim %3d %-34s %016llx\n", shape.n_heads, shape.n_kv_heads, shape.head_dim,
                   specs[b], (unsigned long long)h);
            kv_cache_free(&c);
        }
    return 0;
}
