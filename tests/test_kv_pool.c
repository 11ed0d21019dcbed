/* Caches whose lanes live in a serving pool's pages (kv_cache_init_pool, kv.h; pool.h). S sequences of different
 * policies share one pool and run in one batch (forward_batch) in seeded rounds of 0..9 tokens; each token's logits
 * must equal the same sequence run alone with a single run's cache, bit for bit, while the pool's invariants hold
 * after every round (kv_pool_check; the pages the caches hold = the pool's held pages; a round takes at most
 * kv_pages_needed pages; the pool is the caches' only vector storage: vectors_outside). The policies include snapkv, whose lanes shrink at the prompt's end and give pages back
 * (lane_shed_pages), eviction, merging and selection. Also: a pool too small makes kv_append fail; freeing every
 * cache leaves the pool whole; specs the pool cannot page are refused; a second sequence that adopts the first's
 * prompt pages (prefix caching, kv_cache_adopt_prefix) gives the logits of its own full run. Random GQA model
 * (export --random: 3 layers, 4 query heads over 2 kv heads, head_dim 16). */
#include "../run.h"
#include "../pool.h"
#include "check.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NSEQ 8
#define NTOK 120
#define MAXROUND 9
#define PROMPT 40

static const char *specs[NSEQ] = {
    "full", "window:24,type=q4", "sink:20,pos=cache", "h2o:16", "snapkv:24,prefill=40,obs=8", "pool:24,group=2",
    "topk:12", "h2o:20,merge=1,type=q8",
};

static int make_cache(KVCache *c, const Model *m, const char *text, KVPool *pool) {
    char err[512];
    KVShape shape = model_kv_shape(m, m->config.seq_len);
    KVSpec spec;
    if (kv_spec_parse(&spec, text, KV_F32, err, sizeof err)
        || (pool ? kv_cache_init_pool(c, &shape, &spec, pool, err, sizeof err)
                 : kv_cache_init(c, &shape, &spec, err, sizeof err))) {
        CHECK(0, "cache '%s'%s: %s", text, pool ? " (pool)" : "", err);
        return -1;
    }
    kv_set_prompt_len(c, PROMPT);
    return 0;
}

static int ids[NSEQ][NTOK];

/* logits of every token of sequence j run alone with a single run's cache, token by token: (NTOK, vocab) */
static float *alone(Model *m, int j) {
    size_t V = (size_t)m->config.vocab_size;
    float *all = malloc((size_t)NTOK * V * sizeof(float));
    KVCache c;
    RunState s;
    if (!all || make_cache(&c, m, specs[j], NULL)) { free(all); return NULL; }
    if (state_init(&s, &m->config)) { printf("out of memory\n"); exit(1); }
    for (int t = 0; t < NTOK; t++) {
        if (forward(m, &s, &c, ids[j][t], t)) { CHECK(0, "%s alone: forward failed at %d", specs[j], t); break; }
        memcpy(all + (size_t)t * V, s.logits, V * sizeof(float));
    }
    state_free(&s);
    kv_cache_free(&c);
    return all;
}

/* The pool is the only place a pool cache keeps vectors: no lane has vector arrays of its own (k, v), each page a
   lane holds is a page of the pool (its key and value rows where kv_pool_page says), and every live slot falls in a
   page the lane holds. Returns the violations. */
static int vectors_outside(const KVCache *c, const KVPool *pool) {
    int bad = 0;
    for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) {
        const KVLane *ln = &c->lanes[i];
        bad += ln->k[0] != NULL || ln->v[0] != NULL || c->n_bands != 1;
        for (int j = 0; j < ln->n_pages; j++) {
            int id = ln->page_id[j];
            uint8_t *pg = id >= 0 && id < pool->n_pages ? kv_pool_page(pool, id) : NULL;
            bad += !pg || ln->kpg[0][j] != pg || ln->vpg[0][j] != pg + (size_t)c->page_slots * c->band_kb[0];
        }
        for (int r = 0; r < ln->n_live; r++) bad += (ln->live[r] - ln->band_first[0]) >> ln->pg_shift >= ln->n_pages;
    }
    return bad;
}

/* every sequence in one batch over one pool; counts differing tokens, broken invariants (*broken) and the most
   pages any cache gave back in a round (*shed) */
static long pooled(Model *m, float *const *ref, uint64_t seed, int *broken, int *shed) {
    size_t V = (size_t)m->config.vocab_size;
    char err[256];
    KVPool pool;
    KVCache c[NSEQ];
    RunState s;
    /* f32 pages of 16 slots: head_dim 16 -> 2,048 B; room for every lane of every sequence at full length */
    if (kv_pool_init(&pool, (size_t)NSEQ * 3 * 2 * 8 * 2048, 2048, err, sizeof err)) { CHECK(0, "%s", err); return -1; }
    for (int j = 0; j < NSEQ; j++)
        if (make_cache(&c[j], m, specs[j], &pool)) return -1;
    if (state_init_chunk(&s, &m->config, NSEQ * MAXROUND)) { printf("out of memory\n"); exit(1); }
    int done[NSEQ] = {0}, tokens[NSEQ * MAXROUND];
    long bad = 0;
    for (;;) {
        BatchSeq seq[NSEQ];
        int n = 0, left = 0, need = 0, before[NSEQ];
        for (int j = 0; j < NSEQ; j++) {
            int want = (int)(splitmix64(&seed) % (MAXROUND + 1));
            if (want > NTOK - done[j]) want = NTOK - done[j];
            if (done[j] < PROMPT && !strncmp(specs[j], "snapkv", 6) && done[j] + want > PROMPT) want = PROMPT - done[j];
            seq[j] = (BatchSeq){&c[j], done[j], want, NULL, NULL};
            for (int t = 0; t < want; t++) tokens[n++] = ids[j][done[j] + t];
            left += NTOK - done[j];
            need += kv_pages_needed(&c[j], want);
            before[j] = kv_pages_held(&c[j]);
        }
        if (left == 0) break;
        if (n == 0) continue;
        int taken0 = (int)pool.taken;
        if (forward_batch(m, &s, seq, NSEQ, tokens)) { CHECK(0, "forward_batch failed"); bad = -1; break; }
        int held = 0;
        for (int j = 0; j < NSEQ; j++) {
            held += kv_pages_held(&c[j]);
            if (before[j] - kv_pages_held(&c[j]) > *shed) *shed = before[j] - kv_pages_held(&c[j]);
        }
        *broken += kv_pool_check(&pool, err, sizeof err) != 0 || held != kv_pool_n_held(&pool)
                   || (int)pool.taken - taken0 > need;
        for (int j = 0; j < NSEQ; j++) *broken += vectors_outside(&c[j], &pool);
        for (int j = 0, row = 0; j < NSEQ; row += seq[j].n, j++) {
            for (int t = 0; t < seq[j].n; t++)
                bad += memcmp(s.logits + (size_t)(row + t) * V, ref[j] + (size_t)(done[j] + t) * V, V * sizeof(float)) != 0;
            done[j] += seq[j].n;
        }
    }
    state_free(&s);
    for (int j = 0; j < NSEQ; j++) kv_cache_free(&c[j]);
    *broken += kv_pool_n_free(&pool) != pool.n_pages || kv_pool_check(&pool, err, sizeof err) != 0;
    kv_pool_free(&pool);
    return bad;
}

/* Sequence A (full) stores a prompt of 64 tokens, its 4 blocks published per lane; B adopts A's first 3 blocks and
   feeds the rest: B's logits from position 48 on must equal a full run of the same tokens. */
static void prefix(Model *m) {
    char err[256];
    size_t V = (size_t)m->config.vocab_size;
    KVPool pool;
    KVCache a, b, ref;
    RunState s;
    if (kv_pool_init(&pool, (size_t)64 * 2048, 2048, err, sizeof err)) { CHECK(0, "%s", err); return; }
    if (make_cache(&a, m, "full", &pool) || make_cache(&b, m, "full", &pool) || make_cache(&ref, m, "full", NULL)) return;
    if (state_init(&s, &m->config)) { printf("out of memory\n"); exit(1); }
    int n_lanes = m->config.n_layers * m->config.n_kv_heads, pages[3 * 6], ok = n_lanes == 6;
    float *want = malloc((size_t)80 * V * sizeof(float));
    for (int t = 0; t < 80 && want; t++) {
        ok &= forward(m, &s, &ref, ids[0][t], t) == 0;
        memcpy(want + (size_t)t * V, s.logits, V * sizeof(float));
    }
    for (int t = 0; t < 64; t++) ok &= forward(m, &s, &a, ids[0][t], t) == 0;
    for (int j = 0; j < 3 && ok; j++)
        for (int i = 0; i < n_lanes; i++) {
            int id = kv_lane_page_id(&a, i, j);
            kv_pool_ref(&pool, id);
            pages[j * n_lanes + i] = id;
        }
    int rc = ok ? kv_cache_adopt_prefix(&b, pages, 3, err, sizeof err) : -1;
    CHECK(rc == 0, "an empty full cache adopts 3 prompt pages per lane (%s)", rc ? err : "ok");
    long bad = 0;
    for (int t = 48; t < 80 && rc == 0 && want; t++) {
        ok &= forward(m, &s, &b, ids[0][t], t) == 0;
        bad += memcmp(s.logits, want + (size_t)t * V, V * sizeof(float)) != 0;
    }
    CHECK(ok && rc == 0 && bad == 0 && kv_pool_n_held(&pool) == 4 * 6 + 2 * 6,
          "the adopting sequence's logits at positions 48..79 equal its own full run bit for bit (%ld differ); the "
          "pool holds A's 4 and B's 2 own pages per lane, the 3 shared once (%d held)", bad, kv_pool_n_held(&pool));
    KVCache h;
    if (!make_cache(&h, m, "h2o:16", &pool)) {
        CHECK(kv_cache_adopt_prefix(&h, pages, 3, err, sizeof err) == -1 && strstr(err, "only full"),
              "an evicting policy is refused prefix pages (%s)", err);
        kv_cache_free(&h);
    }
    kv_cache_free(&a);
    kv_cache_free(&b);
    CHECK(kv_pool_n_held(&pool) == 0 && kv_pool_check(&pool, err, sizeof err) == 0,
          "after both caches are freed no page is held (%d)", kv_pool_n_held(&pool));
    free(want);
    state_free(&s);
    kv_cache_free(&ref);
    kv_pool_free(&pool);
}

int main(void) {
    const char *path = "tests/tmp/kv_pool.bin";
    char err[512];
    Model m;
    if (system("mkdir -p tests/tmp && ./export --random tests/tmp/kv_pool.bin --dim 64 --hidden 128 --layers 3 "
               "--heads 4 --kv-heads 2 --vocab 256 --seq 256 --seed 5 >/dev/null 2>&1") != 0 ||
        model_open(&m, path, err, sizeof err)) {
        CHECK(0, "export/open %s: %s", path, err);
        CHECK_EXIT();
    }
    uint64_t g = 17;
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
            int broken = 0, shed = 0;
            long bad = pooled(&m, ref, seed, &broken, &shed);
            CHECK(bad == 0 && broken == 0 && shed > 0,
                  "%d sequences (%s ... %s) in one pool, one batch (schedule %llu, %d thread%s): every token's logits "
                  "equal the sequence run alone with its own cache bit for bit (%ld of %d differ); the pool's "
                  "invariants held after every round, its pages the only vector storage, and it is whole at the end (%d "
                  "broken); a cache gave pages back "
                  "(%d at most in one round)", NSEQ, specs[0], specs[NSEQ - 1], (unsigned long long)seed,
                  threads[ti], threads[ti] > 1 ? "s" : "", bad, NSEQ * NTOK, broken, shed);
        }
    }
    prefix(&m);

    /* a pool of 5 pages: full's 6 lanes cannot all take their first page */
    KVPool small;
    KVCache c;
    RunState s;
    if (!kv_pool_init(&small, 5 * 2048, 2048, err, sizeof err) && !make_cache(&c, &m, "full", &small)) {
        if (state_init(&s, &m.config)) { printf("out of memory\n"); exit(1); }
        int rc = forward(&m, &s, &c, 1, 0);
        CHECK(rc == -1, "a pool of 5 pages under a cache of 6 lanes: the first token fails (rc %d)", rc);
        kv_cache_free(&c);
        CHECK(kv_pool_n_free(&small) == 5, "and freeing the cache gives every page back (%d free)",
              kv_pool_n_free(&small));
        state_free(&s);
        kv_pool_free(&small);
    }
    /* what the pool cannot page yet */
    const char *refused[] = {"full,prec=f32:8/q8", "h2o:16,residual=4,type=q4", "full,kgroup=channel,type=q4",
                             "full,rank=8", "h2o:16,fast=50%"};
    KVPool p;
    if (!kv_pool_init(&p, 64 * 2048, 2048, err, sizeof err)) {
        for (int i = 0; i < 5; i++) {
            KVShape shape = model_kv_shape(&m, m.config.seq_len);
            KVSpec spec;
            int rc = kv_spec_parse(&spec, refused[i], KV_F32, err, sizeof err) == 0
                     ? kv_cache_init_pool(&c, &shape, &spec, &p, err, sizeof err) : 0;
            CHECK(rc == -1 && strstr(err, "not paged yet"), "'%s' in a pool is refused: %s", refused[i], err);
        }
        KVShape shape = model_kv_shape(&m, m.config.seq_len);
        KVSpec spec;
        KVPool tiny;
        if (!kv_spec_parse(&spec, "full", KV_F32, err, sizeof err) && !kv_pool_init(&tiny, 1024, 64, err, sizeof err)) {
            int rc = kv_cache_init_pool(&c, &shape, &spec, &tiny, err, sizeof err);
            CHECK(rc == -1 && strstr(err, "does not fit"), "a page of 64 B under an f32 slot of 128 B is refused: %s", err);
            kv_pool_free(&tiny);
        }
        kv_pool_free(&p);
    }
    for (int j = 0; j < NSEQ; j++) free(ref[j]);
    model_close(&m);
    CHECK_EXIT();
}
