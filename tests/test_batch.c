/* Many sequences in one batch (forward_batch, run.h): S independent sequences, each with its own cache and policy,
 * fed in rounds where every sequence takes 0 to 9 tokens (a prefill chunk, a decode step, or a pause: continuous
 * batching), must give each token's logits bit for bit as that sequence run alone, token by token (forward). Checked
 * on a random GQA model (export --random: 3 layers, 4 query heads over 2 kv heads) with caches of every family that
 * runs inside a chunk: full, window with q4 and a residual, sink with pos=cache, h2o (scores), snapkv at the prompt
 * end, pool (merging), topk (selection), precision by age; and with 1 and 2 threads. Also: a sequence whose cache is
 * full fails the batch, and a batch larger than the state is refused. */
#include "../run.h"
#include "check.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NSEQ 8
#define NTOK 120
#define MAXROUND 9

static const char *specs[NSEQ] = {
    "full", "window:24,type=q4,residual=8", "sink:20,pos=cache", "h2o:16", "snapkv:24,prefill=40,obs=8", "pool:24,group=2",
    "topk:12", "tova:16,prec=f32:4/q8:6/q4",
};

static int make_cache(KVCache *c, const Model *m, const char *text) {
    char err[512];
    KVShape shape = model_kv_shape(m, m->config.seq_len);
    KVSpec spec;
    if (kv_spec_parse(&spec, text, KV_F32, err, sizeof err) || kv_cache_init(c, &shape, &spec, err, sizeof err)) {
        CHECK(0, "cache '%s': %s", text, err);
        return -1;
    }
    return 0;
}

/* token ids of sequence j: a seeded stream of its own */
static int ids[NSEQ][NTOK];

/* logits of every token of sequence j run alone, token by token: (NTOK, vocab) */
static float *alone(Model *m, int j) {
    size_t V = (size_t)m->config.vocab_size;
    float *all = malloc((size_t)NTOK * V * sizeof(float));
    KVCache c;
    RunState s;
    if (!all || make_cache(&c, m, specs[j])) { free(all); return NULL; }
    if (state_init(&s, &m->config)) { printf("out of memory\n"); exit(1); }
    for (int t = 0; t < NTOK; t++) {
        if (forward(m, &s, &c, ids[j][t], t)) { CHECK(0, "%s alone: forward failed at %d", specs[j], t); break; }
        memcpy(all + (size_t)t * V, s.logits, V * sizeof(float));
    }
    state_free(&s);
    kv_cache_free(&c);
    return all;
}

/* every sequence in one batch, in rounds of 0..MAXROUND tokens each (seeded); returns the number of tokens whose
   logits differ from ref[j] (-1 on a failure) */
static long batched(Model *m, float *const *ref, uint64_t seed, int last_only, int *rounds_out) {
    size_t V = (size_t)m->config.vocab_size;
    KVCache c[NSEQ];
    RunState s;
    for (int j = 0; j < NSEQ; j++)
        if (make_cache(&c[j], m, specs[j])) return -1;
    if (state_init_chunk(&s, &m->config, NSEQ * MAXROUND)) { printf("out of memory\n"); exit(1); }
    if (last_only) s.logits_rows = LOGITS_LAST;
    int done[NSEQ] = {0}, tokens[NSEQ * MAXROUND], rounds = 0;
    long bad = 0;
    for (;;) {
        BatchSeq seq[NSEQ];
        int n = 0, left = 0;
        for (int j = 0; j < NSEQ; j++) {
            int want = (int)(splitmix64(&seed) % (MAXROUND + 1));
            if (want > NTOK - done[j]) want = NTOK - done[j];
            if (done[j] < 40 && !strncmp(specs[j], "snapkv", 6) && done[j] + want > 40) want = 40 - done[j];
            seq[j] = (BatchSeq){&c[j], done[j], want, NULL, NULL};
            for (int t = 0; t < want; t++) tokens[n++] = ids[j][done[j] + t];
            left += NTOK - done[j];
        }
        if (left == 0) break;
        if (n == 0) continue;
        if (forward_batch(m, &s, seq, NSEQ, tokens)) { CHECK(0, "forward_batch failed in round %d", rounds); bad = -1; break; }
        rounds++;
        for (int j = 0, row = 0; j < NSEQ; row += seq[j].n, j++) {
            for (int t = last_only && seq[j].n ? seq[j].n - 1 : 0; t < seq[j].n; t++)
                bad += memcmp(s.logits + (size_t)(row + t) * V, ref[j] + (size_t)(done[j] + t) * V, V * sizeof(float)) != 0;
            done[j] += seq[j].n;
        }
    }
    state_free(&s);
    for (int j = 0; j < NSEQ; j++) kv_cache_free(&c[j]);
    *rounds_out = rounds;
    return bad;
}

int main(void) {
    const char *path = "tests/tmp/batch.bin";
    char err[512];
    Model m;
    if (system("mkdir -p tests/tmp && ./export --random tests/tmp/batch.bin --dim 64 --hidden 128 --layers 3 --heads 4 "
               "--kv-heads 2 --vocab 256 --seq 256 --seed 5 >/dev/null 2>&1") != 0 ||
        model_open(&m, path, err, sizeof err)) {
        CHECK(0, "export/open %s: %s", path, err);
        CHECK_EXIT();
    }
    uint64_t g = 11;
    for (int j = 0; j < NSEQ; j++)
        for (int t = 0; t < NTOK; t++) ids[j][t] = (int)(splitmix64(&g) % (uint64_t)m.config.vocab_size);
    float *ref[NSEQ];
    for (int j = 0; j < NSEQ; j++)
        if (!(ref[j] = alone(&m, j))) CHECK_EXIT();
    int threads[2] = {1, 2};
    for (int ti = 0; ti < 2; ti++) {
#ifdef _OPENMP
        omp_set_num_threads(threads[ti]);
#else
        if (ti) break;
#endif
        for (uint64_t seed = 1; seed <= 3; seed++) {
            int rounds = 0;
            long bad = batched(&m, ref, seed, 0, &rounds);
            CHECK(bad == 0, "%d sequences (%s ... %s) in %d rounds of 0-%d tokens each (schedule %llu, %d thread%s): "
                  "every token's logits equal the sequence's own token-by-token run bit for bit (%ld of %d differ)",
                  NSEQ, specs[0], specs[NSEQ - 1], rounds, MAXROUND, (unsigned long long)seed, threads[ti],
                  threads[ti] > 1 ? "s" : "", bad, NSEQ * NTOK);
        }
    }
    /* with LOGITS_LAST, each sequence's last row of every round */
    for (uint64_t seed = 4; seed <= 5; seed++) {
        int rounds = 0;
        long bad = batched(&m, ref, seed, 1, &rounds);
        CHECK(bad == 0, "logits_rows = LOGITS_LAST: each sequence's last row of each of %d rounds (schedule %llu) "
              "equals its own token-by-token run bit for bit (%ld differ)", rounds, (unsigned long long)seed, bad);
    }
    /* a full cache fails the batch; a batch over the state's rows is refused */
    KVCache a, b;
    RunState s;
    if (!make_cache(&a, &m, "full:4") && !make_cache(&b, &m, "window:4")) {
        if (state_init_chunk(&s, &m.config, 8)) { printf("out of memory\n"); exit(1); }
        int tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        BatchSeq two[2] = {{&a, 0, 4, NULL, NULL}, {&b, 0, 4, NULL, NULL}};
        int rc1 = forward_batch(&m, &s, two, 2, tok);
        two[0].pos0 = 4; two[0].n = 1; two[1].pos0 = 4; two[1].n = 1;
        int rc2 = forward_batch(&m, &s, two, 2, tok);
        CHECK(rc1 == 0 && rc2 == -1, "full:4 beside window:4: 4 tokens each fit (rc %d), a fifth for full fails the "
              "batch (rc %d)", rc1, rc2);
        BatchSeq big[2] = {{&b, 5, 6, NULL, NULL}, {&b, 11, 6, NULL, NULL}};
        int rc3 = forward_batch(&m, &s, big, 2, tok);
        BatchSeq none[1] = {{&b, 5, 0, NULL, NULL}};
        int rc4 = forward_batch(&m, &s, none, 1, tok);
        CHECK(rc3 == -1 && rc4 == -1, "a batch of 12 rows in a state of 8 is refused (rc %d), and so is an empty one "
              "(rc %d)", rc3, rc4);
        state_free(&s);
        kv_cache_free(&a);
        kv_cache_free(&b);
    }
    for (int j = 0; j < NSEQ; j++) free(ref[j]);
    model_close(&m);
    CHECK_EXIT();
}
