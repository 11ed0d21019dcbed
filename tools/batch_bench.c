/* batch_bench: decode throughput of S independent sequences in one batch (forward_batch), each with its own cache
 * and policy, against S = 1. Every sequence is first prefilled with P tokens of its own (seeded ids, PREFILL_CHUNK at
 * a time, alone), then D decode steps run with all S sequences in one batch, each taking its greedy next token. A
 * decode step of one sequence reads every weight once for one token; a batch reads them once for S tokens, so on a
 * machine where decode is bound by reading the weights the batch's tokens per second grow with S until the matmuls
 * become compute-bound. Prints, per S: ms per batch step, tokens per second over all sequences, and the speedup over
 * S = 1 (each the median of R repeats of the D steps on freshly prefilled caches).
 * Usage: build/batch_bench MODEL [-kv SPEC] [-p P] [-d D] [-r R] [S...] (default: full, P 256, D 32, R 3, S 1 2 4 8
 * 16). Threads: OMP_NUM_THREADS. */
#include "run.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* seconds for D batched decode steps of S sequences after a P-token prefill each; -1 on an error */
static double run_once(Model *m, const char *spec_text, int S, int P, int D, uint64_t seed) {
    char err[512];
    KVShape shape = model_kv_shape(m, P + D + 1);
    KVSpec spec;
    KVCache *c = calloc((size_t)S, sizeof *c);
    BatchSeq *seq = calloc((size_t)S, sizeof *seq);
    int *ids = malloc((size_t)P * sizeof(int)), *next = malloc((size_t)S * sizeof(int));
    RunState pre, s;
    if (!c || !seq || !ids || !next || state_init_chunk(&pre, &m->config, PREFILL_CHUNK) ||
        state_init_chunk(&s, &m->config, S)) { fprintf(stderr, "batch_bench: out of memory\n"); exit(1); }
    size_t V = (size_t)m->config.vocab_size;
    double secs = -1;
    int made = 0;
    for (int j = 0; j < S; j++, made++) {
        if (kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err) || kv_cache_init(&c[j], &shape, &spec, err, sizeof err)) {
            fprintf(stderr, "batch_bench: %s\n", err);
            goto done;
        }
        for (int t = 0; t < P; t++) ids[t] = (int)(splitmix64(&seed) % V);
        if (forward_prefill(m, &pre, &c[j], ids, (size_t)P, 0, PREFILL_CHUNK)) goto done;
        next[j] = sample_argmax(pre.logits, (int)V);
    }
    double t0 = now_s();
    for (int step = 0; step < D; step++) {
        for (int j = 0; j < S; j++) seq[j] = (BatchSeq){&c[j], P + step, 1, NULL, NULL};
        if (forward_batch(m, &s, seq, S, next)) { fprintf(stderr, "batch_bench: forward_batch failed\n"); goto done; }
        for (int j = 0; j < S; j++) next[j] = sample_argmax(s.logits + (size_t)j * V, (int)V);
    }
    secs = now_s() - t0;
done:
    for (int j = 0; j < made; j++) kv_cache_free(&c[j]);
    state_free(&pre);
    state_free(&s);
    free(c); free(seq); free(ids); free(next);
    return secs;
}

int main(int argc, char **argv) {
    int P = 256, D = 32, R = 3, ss[16], n_ss = 0;
    const char *spec_text = "full", *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-kv") && i + 1 < argc) spec_text = argv[++i];
        else if (!strcmp(argv[i], "-p") && i + 1 < argc && atoi(argv[i + 1]) > 0) P = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-d") && i + 1 < argc && atoi(argv[i + 1]) > 0) D = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc && atoi(argv[i + 1]) > 0) R = atoi(argv[++i]);
        else if (!path && argv[i][0] != '-') path = argv[i];
        else if (n_ss < 16 && atoi(argv[i]) > 0 && atoi(argv[i]) <= 256) ss[n_ss++] = atoi(argv[i]);
        else { fprintf(stderr, "usage: %s MODEL [-kv SPEC] [-p P] [-d D] [-r R] [S...] (S in 1..256)\n", argv[0]); return 1; }
    }
    if (!path) { fprintf(stderr, "usage: %s MODEL [-kv SPEC] [-p P] [-d D] [-r R] [S...]\n", argv[0]); return 1; }
    if (n_ss == 0) { int d[5] = {1, 2, 4, 8, 16}; memcpy(ss, d, sizeof d); n_ss = 5; }
    Model m;
    char err[512];
    if (model_open(&m, path, err, sizeof err)) { fprintf(stderr, "batch_bench: %s\n", err); return 1; }
    printf("%4s %12s %12s %9s   (%s, prefill %d tokens per sequence, %d batched decode steps, median of %d)\n", "S",
           "ms/step", "tok/s", "vs S=1", spec_text, P, D, R);
    double base = 0;
    for (int i = 0; i < n_ss; i++) {
        double t[64];
        int r;
        for (r = 0; r < R && r < 64; r++)
            if ((t[r] = run_once(&m, spec_text, ss[i], P, D, 1000 + (uint64_t)r)) < 0) return 1;
        qsort(t, (size_t)r, sizeof t[0], cmp_double);
        double med = t[r / 2], tps = ss[i] * D / med;
        if (ss[i] == 1 || base == 0) base = ss[i] == 1 ? tps : base;
        printf("%4d %12.2f %12.1f %8.2fx\n", ss[i], med / D * 1e3, tps, base > 0 ? tps / base : 0.0);
        fflush(stdout);
    }
    model_close(&m);
    return 0;
}
