/* Batched evaluation and policies that are not layer-local (issue 6, item 3). forward_chunk runs a chunk layer by
 * layer, which is exact only when a policy's decisions at layer l depend on layer l alone. A policy declares
 * otherwise with cross_layer (kv.h), and forward_chunk then goes token by token. Checked on stories260K with a test
 * policy that really is cross-layer: every lane evicts the slot at the rank where layer 0's first lane last put its
 * most attention, so at layer l > 0 it reads layer 0's state. Declared, chunks of 8 give the bits of token-by-token
 * decode; declared layer-local (wrongly), chunks of 8 give different logits, which shows the fallback is what makes
 * the first check pass. A registered layer-local policy (h2o) stays batched and bit-identical, and so do evicting
 * lanes with bands where the policy's victims come from the oldest band alone (KVPolicyOps.protects). */
#include "../run.h"
#include "check.h"
#include <stdlib.h>

static int hint;   /* rank of layer 0 lane 0's largest probability at its last step */

static void xl_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int pos_now) {
    if (lane != 0) return;
    int best = 0;
    for (int i = 1; i < ln->n_live; i++) if (prob[i] > prob[best]) best = i;
    hint = best;
}

static int xl_evict(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *victims, int max, double *score) {
    victims[0] = hint % ln->n_live;
    score[0] = 0;
    return 1;
}

/* Logits of `n` tokens (n, vocab) fed `chunk` at a time through spec; cross = -1 keeps the registered policy, else
 * the test policy built on window's slot handling with cross_layer = cross. */
static long batched;   /* the last run's (token, layer) pairs whose attention went a chunk at a time (chunk_steps) */

static float *run(Model *m, const int *ids, int n, int chunk, const char *spec_text, int cross, KVPolicyOps *ops) {
    char err[512];
    KVShape shape = model_kv_shape(m, m->config.seq_len);
    KVSpec spec;
    KVCache c;
    RunState s;
    if (kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err) || kv_cache_init(&c, &shape, &spec, err, sizeof err)) {
        printf("cache: %s\n", err);
        return NULL;
    }
    if (cross >= 0) {
        *ops = *c.policy.ops;
        ops->observe = xl_observe;
        ops->evict = xl_evict;
        ops->cross_layer = cross;
        c.policy.ops = ops;
    }
    hint = 0;
    size_t V = (size_t)m->config.vocab_size;
    float *all = malloc((size_t)n * V * sizeof(float));
    if (!all || state_init_chunk(&s, &m->config, chunk)) { printf("out of memory\n"); exit(1); }
    for (int t0 = 0; t0 < n; t0 += chunk) {
        int nt = n - t0 < chunk ? n - t0 : chunk;
        if (forward_chunk(m, &s, &c, ids + t0, nt, t0)) { printf("forward_chunk failed at %d\n", t0); exit(1); }
        memcpy(all + (size_t)t0 * V, s.logits, (size_t)nt * V * sizeof(float));
    }
    batched = c.chunk_steps;
    state_free(&s);
    kv_cache_free(&c);
    return all;
}

int main(void) {
    const char *s260 = "../shared/data/models/stories260K.bin";
    FILE *f = fopen(s260, "rb");
    if (!f) { SKIP("test_chunk: %s missing", s260); CHECK_EXIT(); }
    fclose(f);
    Model m;
    char err[512];
    if (system("mkdir -p tests/tmp && ./export --llama2c ../shared/data/models/stories260K.bin "
               "tests/tmp/s260_chunk.bin >/dev/null 2>&1") != 0 ||
        model_open(&m, "tests/tmp/s260_chunk.bin", err, sizeof err)) {
        CHECK(0, "stories260K export/open: %s", err);
        CHECK_EXIT();
    }
    enum { N = 120 };
    int ids[N];
    for (int i = 0; i < N; i++) ids[i] = 1 + (i * 37 + 11) % (m.config.vocab_size - 1);
    size_t bytes = (size_t)N * m.config.vocab_size * sizeof(float);
    KVPolicyOps ops;

    float *one = run(&m, ids, N, 1, "window:12", 1, &ops);
    float *eight = run(&m, ids, N, 8, "window:12", 1, &ops);
    CHECK(one && eight && !memcmp(one, eight, bytes),
          "cross-layer policy (declared): -chunk 8 falls back and gives token-by-token bits over %d tokens", N);
    free(eight);
    float *wrong = run(&m, ids, N, 8, "window:12", 0, &ops);
    float *wrong1 = run(&m, ids, N, 1, "window:12", 0, &ops);
    CHECK(wrong && wrong1 && !memcmp(one, wrong1, bytes) && memcmp(one, wrong, bytes),
          "the same policy declared layer-local: token by token unchanged, -chunk 8 differs (the policy really "
          "reads another layer)");
    free(wrong); free(wrong1); free(one);

    float *h1 = run(&m, ids, N, 1, "h2o:12", -1, &ops);
    float *h8 = run(&m, ids, N, 8, "h2o:12", -1, &ops);
    CHECK(h1 && h8 && !memcmp(h1, h8, bytes), "h2o (layer-local): -chunk 8 batched and bit-identical over %d tokens", N);
    free(h1); free(h8);
    /* evicting lanes with bands (residual=4: the 4 newest tokens in f32, the older ones in q4): a chunk at a time
       where the policy's victims come from the oldest band alone (h2o's recent=8 protects the 7 newest, more than
       the residual's 4: KVPolicyOps.protects), token by token at steady state where they may not (recent=2; tova
       promises nothing); bit-identical either way */
    long all_steps = (long)N * m.config.n_layers;
    const struct { const char *spec; int chunked; } ev[] = {
        {"h2o:16,type=q4,residual=4", 1}, {"window:16,prec=f32:4/q8:4/q4", 1}, {"sink:16,sinks=2,type=q4,residual=4", 1},
        {"scissorhands:16,recent=6,drop=3,type=q4,residual=4", 1}, {"h2o:16,recent=2,type=q4,residual=4", 0},
        {"tova:16,type=q4,residual=4", 0},
    };
    for (size_t i = 0; i < sizeof ev / sizeof ev[0]; i++) {
        float *e1 = run(&m, ids, N, 1, ev[i].spec, -1, &ops);
        long b1 = batched;
        float *e8 = run(&m, ids, N, 8, ev[i].spec, -1, &ops);
        CHECK(e1 && e8 && !memcmp(e1, e8, bytes), "%s: -chunk 8 bit-identical to token by token over %d tokens",
              ev[i].spec, N);
        if (ev[i].chunked)
            CHECK(b1 == 0 && batched == all_steps, "%s: every (token, layer) of -chunk 8 attended in chunks (%ld of %ld)",
                  ev[i].spec, batched, all_steps);
        else   /* the first 16 tokens fill the lanes: chunks until the first eviction */
            CHECK(batched > 0 && batched <= 16L * m.config.n_layers,
                  "%s: -chunk 8 goes token by token once lanes evict (%ld of %ld (token, layer) pairs in chunks)",
                  ev[i].spec, batched, all_steps);
        free(e1); free(e8);
    }
    model_close(&m);
    CHECK_EXIT();
}
