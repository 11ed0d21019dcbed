/* serve.c: -m serve, many requests over one KV pool (pool.h). A trace of requests (trace.h) arrives on a clock of
 * decode steps; a scheduler admits them while the pool has pages, runs every admitted sequence in one batch per step
 * (forward_batch: the weight matmuls over all of them, attention and the policy per sequence), and when the pool runs
 * short preempts the most recently admitted sequence, which gives its pages back and is recomputed from its tokens
 * when pages are free again (vLLM's default, recompute). Prompts that share a prefix share its pages under `full`
 * (automatic prefix caching: a block's pages keyed by the chain of its token ids). Each -kv spec replays the whole
 * trace over a fresh pool of the same size.
 *
 * The clock: step s is one forward_batch call; a request arriving at step a joins the queue when the clock reaches a
 * (idle stretches are skipped). Each step feeds every decoding sequence its one new token and the prefilling ones up
 * to -chunk prompt tokens in all (chunked prefill, first come first served). Answers are greedy. A sequence's tokens
 * are its prompt, its answers and later turns' prompts, fed in order; preemption keeps them and a restart feeds them
 * again, which gives the same cache bit for bit (forward_batch's logits do not depend on how tokens are chunked).
 *
 * Figures (vLLM's definitions): time to first token from the wall time its arrival step began; time per output token
 * over its later tokens; queueing delay from arrival to admission; prefix hit rate = prompt tokens served from cached
 * pages / prompt tokens; occupancy = pages held by running sequences / the pool's pages, cached pages counting as free.
 */
#include "eval_impl.h"
#include "pool.h"
#include "run.h"
#include "serve.h"
#include "trace.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { S_QUEUED, S_RUNNING, S_DONE, S_FAILED };

int serve_adapt_parse(const char *text, KVType default_type, Adapt *a, char *err, size_t errlen) {
    if (strcmp(text, "adapt") && strncmp(text, "adapt:", 6)) return 1;
    memset(a, 0, sizeof *a);
    char chain[512];
    snprintf(chain, sizeof chain, "%s", text[5] ? text + 6 : ADAPT_DEFAULT);
    if (!chain[0]) return errorf(err, errlen, "'%s': adapt: needs a chain, MEMBER@OCC/... (e.g. %s)", text, ADAPT_DEFAULT);
    KVType kt = default_type, vt = default_type;
    for (char *m = chain, *next; m; m = next) {
        next = strchr(m, '/');
        if (next) *next++ = 0;
        char *at = strrchr(m, '@'), *end;
        if (!at || at == m)
            return errorf(err, errlen, "'%s': each member of an adapt: chain is SPEC@OCCUPANCY%% (e.g. q8@80), not '%s'",
                          text, m);
        *at++ = 0;
        long occ = strtol(at, &end, 10);
        if (end == at || (*end && strcmp(end, "%")) || occ < 0 || occ > 100)
            return errorf(err, errlen, "'%s': member '%s' holds from an occupancy in percent, 0 to 100, not '%s'", text,
                          m, at);
        if (a->n == ADAPT_MAX) return errorf(err, errlen, "'%s': at most %d members", text, ADAPT_MAX);
        if (a->n == 0 && occ != 0)
            return errorf(err, errlen, "'%s': the first member holds from occupancy 0 (%s@0), not @%ld", text, m, occ);
        if (a->n > 0 && occ <= a->at[a->n - 1])
            return errorf(err, errlen, "'%s': the occupancies must increase (%s@%ld after @%d)", text, m, occ,
                          a->at[a->n - 1]);
        /* the member as a spec: a type alone is full in it; no type given keeps the previous member's */
        char base[160];
        int ty = kv_type_parse(m), typed = ty >= 0 || strstr(m, "type=") != NULL;
        if (strlen(m) > 100) return errorf(err, errlen, "'%s': a member of over 100 characters", text);
        if (ty >= 0) snprintf(base, sizeof base, "full,type=%.100s", m);
        else snprintf(base, sizeof base, "%.100s", m);
        KVSpec sp;
        if (kv_spec_parse(&sp, base, default_type, err, errlen)) return -1;
        if (!typed && a->n > 0) {
            size_t n = strlen(base);
            if (kt == vt) snprintf(base + n, sizeof base - n, ",type=%s", kv_type_names[kt]);
            else snprintf(base + n, sizeof base - n, ",ktype=%s,vtype=%s", kv_type_names[kt], kv_type_names[vt]);
            if (kv_spec_parse(&sp, base, default_type, err, errlen)) return -1;
        }
        if (kv_spec_check_mode(&sp, "serve", err, errlen)) return -1;
        kt = sp.ktype;
        vt = sp.vtype;
        const KVPolicyOps *ops = kv_policy_find(sp.name);
        if (!ops) return errorf(err, errlen, "'%s': unknown kv policy '%s'; policies: %s", text, sp.name, kv_policy_names());
        int full = !strcmp(sp.name, "full");
        if (!full) {
            if (!ops->evicts || !ops->keep_score)
                return errorf(err, errlen, "'%s': member '%s': an adapt: chain shrinks a sequence by its policy's keep "
                              "score, which %s has not (h2o, tova, lru, sink, window have one)", text, m, sp.name);
            if (a->scorer[0] && strcmp(a->scorer, sp.name))
                return errorf(err, errlen, "'%s': the members besides full are one policy (%s and %s here): a switch "
                              "carries its scores from member to member", text, a->scorer, sp.name);
            snprintf(a->scorer, sizeof a->scorer, "%s", sp.name);
        }
        if (kv_spec_value(&sp, "merge") || kv_spec_value(&sp, "alloc"))
            return errorf(err, errlen, "'%s': member '%s': merge= and alloc= are not taken in an adapt: chain", text, m);
        a->full[a->n] = full;
        a->ktype[a->n] = sp.ktype;
        a->vtype[a->n] = sp.vtype;
        a->at[a->n] = (int)occ;
        snprintf(a->spec[a->n], sizeof a->spec[0], "%s", base);
        a->n++;
    }
    return 0;
}

/* A position serving chose a token at: its row in the SampleLog, the admission (life) it was sampled in */
typedef struct { int pos, life; long row; } Sampled;

typedef struct Seq {
    const TraceReq *tr;
    IdList ids;          /* every token of the sequence so far: prompts, answers (the last answer token unfed) */
    int fed;             /* ids[0 .. fed) are in the cache */
    int n_prompt;        /* tokens of the first turn's prompt */
    int turn, out_turn;  /* the turn being answered, tokens generated for it */
    int answering;       /* 1: the last fed token's logits give the next answer token */
    int stop;            /* the chat format's end-of-turn id, or -1 */
    int state, admitted_order;
    KVCache cache;
    int has_cache;
    int hit_tokens;      /* prompt tokens served from cached pages (first admission) */
    int published;       /* blocks of the first prompt published to the prefix cache (or adopted from it) */
    uint64_t chain_key;  /* the key of block published - 1, the chain the next block's key continues */
    int preemptions;
    int cut;             /* 1: ended before its last turn, which did not fit the cache (-c) */
    int short_doc;       /* 1: a document has fewer tokens than doc_tokens asked for (it is used whole) */
    IdList out;          /* generated tokens, every turn */
    /* adapt: the member its cache holds now and the one it started from (this admission's; a preemption starts
       over), and each switch: the step, the tokens in the cache then, the member it went to, the occupancy */
    int member, start_member, n_sw, cap_sw;
    size_t gen_base;     /* answer tokens generated before this admission (a preempted life's), not replayed as such */
    struct { long step; int at, member; double occ; int shortage; } *sw;
    long arrive_step;
    double t_arrive, t_admit, t_first, t_last;
    Sampled *sc;         /* -shadow: every position a token was chosen at, in order */
    int n_sc, cap_sc;
    double kl, top1;     /* -shadow: sums over the nq positions scored; differ: positions whose replay differs */
    long nq, differ;
} Seq;

typedef struct {
    const Model *m;
    const Options *o;
    const char *spec;
    KVPool pool;
    int n_lanes, prefix, max_seqs, chunk, order;
    uint64_t salt;       /* the spec's text hashed: prefix keys of different specs never meet */
    const Adapt *ad;     /* adapt: the chain, or NULL */
    char carrier[ADAPT_MAX][192];   /* adapt: what member m's cache is made from (a full member with a scorer: P:-c) */
    long n_switch[ADAPT_MAX], n_shortage;   /* adapt: switches into member m; those made because the pool ran short */
} Server;

/* The first turn's prompt: the chat template around system, the documents (each cut to doc_tokens tokens, decoded back
 * to text) and the question; without a template, BOS per the model and the text. */
static void first_prompt(Seq *q, const Model *m, const Options *o) {
    const TraceReq *r = q->tr;
    Str user = {0};
    str_add(&user, "");
    for (int d = 0; d < r->n_docs; d++) {
        if (r->doc_tokens > 0) {
            int *t;
            size_t nt;
            char err[256], buf[TOKDEC_OUT_MAX];
            if (tokenizer_encode(&m->tokenizer, (const unsigned char *)r->docs[d], strlen(r->docs[d]), 0, &t, &nt,
                                 err, sizeof err))
                fatal("serve: request %d: tokenizer: %s", r->id, err);
            TokenDecoder dec;
            tokdec_init(&dec, &m->tokenizer);
            q->short_doc |= nt < (size_t)r->doc_tokens;
            for (size_t i = 0; i < nt && i < (size_t)r->doc_tokens; i++) {
                size_t k = tokdec_push(&dec, t[i], buf, sizeof buf - 1);
                buf[k] = 0;
                str_add(&user, buf);
            }
            size_t k = tokdec_flush(&dec, buf, sizeof buf - 1);
            buf[k] = 0;
            str_add(&user, buf);
            free(t);
        } else str_add(&user, r->docs[d]);
        str_add(&user, "\n\n");
    }
    if (r->n_turns) str_add(&user, r->turns[0]);
    Line text = {0};
    int bos, special = 1;
    const char *system = r->system ? r->system : o->system;
    if (chat_prompt_text(&text, &bos, &q->stop, m, system, user.s, 1)) {
        special = 0;
        q->stop = -1;
        bos = m->tokenizer.add_bos;
        line_printf(&text, "%s%s%s", system ? system : "", system ? "\n\n" : "", user.s);
    }
    int *t;
    size_t nt;
    char err[256];
    int rc = special ? tokenizer_encode_special(&m->tokenizer, (const unsigned char *)text.s, text.n, bos, &t, &nt,
                                                err, sizeof err)
                     : tokenizer_encode(&m->tokenizer, (const unsigned char *)text.s, text.n, bos, &t, &nt, err,
                                        sizeof err);
    if (rc) fatal("serve: request %d: tokenizer: %s", r->id, err);
    for (size_t i = 0; i < nt; i++) ids_push(&q->ids, t[i]);
    q->n_prompt = (int)nt;
    free(t);
    line_free(&text);
    free(user.s);
}

/* A later turn's prompt appended (the assistant's answer closed as chat does). */
static void next_turn(Seq *q, const Model *m) {
    Line text = {0};
    int bos, stop, *t;
    size_t nt;
    char err[256];
    if (chat_prompt_text(&text, &bos, &stop, m, NULL, q->tr->turns[q->turn], 0)) {
        line_printf(&text, "\n\n%s", q->tr->turns[q->turn]);
        if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text.s, text.n, 0, &t, &nt, err, sizeof err))
            fatal("serve: tokenizer: %s", err);
    } else if (tokenizer_encode_special(&m->tokenizer, (const unsigned char *)text.s, text.n, 0, &t, &nt, err,
                                        sizeof err))
        fatal("serve: tokenizer: %s", err);
    for (size_t i = 0; i < nt; i++) ids_push(&q->ids, t[i]);
    free(t);
    line_free(&text);
}

/* The key of lane's page for block j of ids, chained: chain[j] = kv_pool_chain(chain[j-1], block j, salt). */
static uint64_t lane_key(uint64_t block_key, int lane) { return kv_pool_chain(block_key, NULL, 0, (uint64_t)lane + 1); }

/* The spec text a sequence's cache is made from: the -kv spec, or under adapt: its member's carrier. */
static const char *seq_spec(const Server *sv, int member) { return sv->ad ? sv->carrier[member] : sv->spec; }

static void cache_init_spec(KVCache *c, const Server *sv, const char *text, int n_prompt) {
    char err[512];
    KVShape shape = model_kv_shape(sv->m, sv->o->ctx);
    KVSpec spec;
    if (kv_spec_parse(&spec, text, sv->o->kvt, err, sizeof err)
        || kv_cache_init_pool(c, &shape, &spec, (KVPool *)&sv->pool, err, sizeof err))
        fatal("serve: -kv %s: %s", text, err);
    kv_set_prompt_len(c, n_prompt);
}

/* The pool's occupancy now: pages held by running sequences / pages (cached pages count as free). */
static double pool_occupancy(const Server *sv) { return (double)kv_pool_n_held(&sv->pool) / sv->pool.n_pages; }

/* adapt: the member the occupancy calls for, the last whose threshold it has reached. */
static int adapt_level(const Server *sv) {
    double occ = 100.0 * pool_occupancy(sv);
    int m = 0;
    while (m + 1 < sv->ad->n && occ >= sv->ad->at[m + 1]) m++;
    return m;
}

/* A queued sequence's cache, empty; under adapt in the member the occupancy calls for now, at least `floor`. */
static int cache_make(Server *sv, Seq *q, int floor) {
    if (sv->ad) {
        int lvl = adapt_level(sv);
        q->member = q->start_member = lvl > floor ? lvl : floor;
        q->n_sw = 0;
    }
    cache_init_spec(&q->cache, sv, seq_spec(sv, sv->ad ? q->member : 0), q->n_prompt);
    q->has_cache = 1;
    return 0;
}

/* adapt: move a running sequence's cache to member `to` (kv_cache_transfer: its tokens re-encoded, the lowest keep
 * scores dropped when the member's budget is smaller), logged in the sequence with the step and the occupancy that
 * called for it. 0, or 1 when the pool has not the pages for the move (nothing changed). */
static int seq_switch(Server *sv, Seq *q, int to, long step, double occ, int shortage) {
    KVCache next;
    char err[512];
    cache_init_spec(&next, sv, sv->carrier[to], q->n_prompt);
    int rc = kv_cache_transfer(&next, &q->cache, q->fed, err, sizeof err);
    if (rc < 0) fatal("serve: request %d: switching to '%s': %s", q->tr->id, sv->ad->spec[to], err);
    if (rc == 1) { kv_cache_free(&next); return 1; }
    kv_cache_free(&q->cache);
    kv_cache_move(&q->cache, &next);
    if (q->n_sw == q->cap_sw) {
        q->cap_sw = q->cap_sw ? 2 * q->cap_sw : 4;
        q->sw = realloc(q->sw, (size_t)q->cap_sw * sizeof *q->sw);
        if (!q->sw) fatal("out of memory");
    }
    q->sw[q->n_sw].step = step;
    q->sw[q->n_sw].at = q->fed;
    q->sw[q->n_sw].member = to;
    q->sw[q->n_sw].occ = occ;
    q->sw[q->n_sw].shortage = shortage;
    q->n_sw++;
    q->member = to;
    sv->n_switch[to]++;
    sv->n_shortage += shortage;
    return 0;
}

/* The tokens a sequence's cache can hold: under adapt, -c for every member (a request that full cannot hold fails,
 * whatever member it would end in). */
static int seq_capacity(const Server *sv, const Seq *q) {
    return sv->ad ? sv->o->ctx : kv_capacity(&q->cache);
}

/* Prefix caching at admission (full only, a first admission): the longest run of the prompt's whole blocks, the last
 * token excluded (its logits must be computed), whose pages every lane finds; they are adopted. Returns tokens hit. */
static int prefix_adopt(Server *sv, Seq *q) {
    int P = kv_page_slots(&q->cache), n_blocks = (q->n_prompt - 1) / P, hit = 0;
    if (!sv->prefix || n_blocks <= 0) return 0;
    int *pages = malloc((size_t)n_blocks * sv->n_lanes * sizeof(int));
    if (!pages) fatal("out of memory");
    uint64_t key = sv->salt;
    for (int j = 0; j < n_blocks; j++) {
        key = kv_pool_chain(key, q->ids.ids + (size_t)j * P, P, sv->salt);
        int all = 1;
        for (int i = 0; i < sv->n_lanes && all; i++) {
            int id = kv_pool_lookup(&sv->pool, lane_key(key, i));
            all = id >= 0;
            pages[(size_t)j * sv->n_lanes + i] = id;
        }
        if (!all) break;
        hit = j + 1;
        q->chain_key = key;
    }
    if (hit) {
        for (size_t e = 0; e < (size_t)hit * sv->n_lanes; e++) kv_pool_ref(&sv->pool, pages[e]);
        char err[256];
        if (kv_cache_adopt_prefix(&q->cache, pages, hit, err, sizeof err)) fatal("serve: %s", err);
        q->fed = hit * P;
        q->published = hit;
    }
    free(pages);
    return hit * P;
}

/* After a step: publish the prompt's blocks the sequence has now fed whole (full only). */
static void prefix_publish(Server *sv, Seq *q) {
    int P = kv_page_slots(&q->cache), whole = (q->n_prompt - 1) / P;
    if (!sv->prefix) return;
    uint64_t key = q->published ? q->chain_key : sv->salt;
    while (q->published < whole && q->fed >= (q->published + 1) * P) {
        int j = q->published;
        key = kv_pool_chain(key, q->ids.ids + (size_t)j * P, P, sv->salt);
        for (int i = 0; i < sv->n_lanes; i++) kv_pool_publish(&sv->pool, kv_lane_page_id(&q->cache, i, j), lane_key(key, i));
        q->published++;
    }
    q->chain_key = key;
}

/* Tokens a running sequence feeds at its next step: all it has pending, at most `chunk`. */
static int next_step_tokens(const Seq *q, int chunk) {
    int pending = (int)q->ids.n - q->fed;
    return pending < chunk ? pending : chunk;
}

static void seq_release(Seq *q) {
    if (q->has_cache) kv_cache_free(&q->cache);
    q->has_cache = 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
/* The p-th percentile (0..100) of n values, nearest rank; NaN for none. Sorts v. */
static double percentile(double *v, int n, double p) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int k = (int)ceil(p / 100.0 * n) - 1;
    return v[k < 0 ? 0 : k >= n ? n - 1 : k];
}

/* Quality against the request's own full-cache shadow, in a second pass after the trace (the pool is not involved).
 * While serving, every row of logits a token was chosen from is kept (SampleLog: 4 * vocab_size bytes a sampled
 * position, 196 KB on SmolLM2, in an unlinked temporary file). The pass then feeds each request's tokens, as served,
 * to `full` in f32 and compares, at each sampled position, the full cache's next-token distribution with the served
 * one: KL(full ‖ served) and whether their argmax agree (the figures of -m ppl). Requests go in the lexicographic order
 * of their tokens, and the full cache keeps the prefix the next request shares with the last one (kv_cache_truncate),
 * so a trace whose prompts share documents is fed to full about once; chunked feeding gives the bits of feeding token
 * by token. -shadow 2 also replays each request alone through a single run's cache of its policy and checks that its
 * logits equal the served ones bit for bit (the pool holds what a single run's cache holds: tests/test_kv_pool.c). */
typedef struct {
    FILE *f;   /* rows of V floats, in the order sampled */
    long n;
    int V;
} SampleLog;

static void sample_log(SampleLog *lg, Seq *r, int pos, const float *logits) {
    if (r->n_sc == r->cap_sc) {
        r->cap_sc = r->cap_sc ? 2 * r->cap_sc : 16;
        r->sc = realloc(r->sc, (size_t)r->cap_sc * sizeof *r->sc);
        if (!r->sc) fatal("out of memory");
    }
    r->sc[r->n_sc++] = (Sampled){.pos = pos, .life = r->preemptions, .row = lg->n++};
    if (fwrite(logits, sizeof(float), (size_t)lg->V, lg->f) != (size_t)lg->V)
        fatal("serve: -shadow: could not write the served logits to a temporary file (%zu bytes a token): %s",
              (size_t)lg->V * sizeof(float), strerror(errno));
}

static void sample_read(const SampleLog *lg, long row, float *dst) {
    if (fseeko(lg->f, (off_t)row * lg->V * (off_t)sizeof(float), SEEK_SET)
        || fread(dst, sizeof(float), (size_t)lg->V, lg->f) != (size_t)lg->V)
        fatal("serve: -shadow: could not read the served logits back from the temporary file");
}

static const struct Seq *shadow_order_q;   /* the requests cmp_by_ids orders (qsort has no context argument) */
static int cmp_by_ids(const void *a, const void *b) {
    const IdList *x = &shadow_order_q[*(const int *)a].ids, *y = &shadow_order_q[*(const int *)b].ids;
    size_t n = x->n < y->n ? x->n : y->n;
    for (size_t i = 0; i < n; i++)
        if (x->ids[i] != y->ids[i]) return x->ids[i] < y->ids[i] ? -1 : 1;
    return (x->n > y->n) - (x->n < y->n);
}

static void shadow_cache(KVCache *c, const Model *m, const Options *o, const char *text, KVType kvt, int n_prompt) {
    KVShape shape = model_kv_shape(m, o->ctx);
    char err[512];
    KVSpec spec;
    if (kv_spec_parse(&spec, text, kvt, err, sizeof err) || kv_cache_init(c, &shape, &spec, err, sizeof err))
        fatal("serve: the shadow pass's '%s': %s", text, err);
    kv_set_prompt_len(c, n_prompt);
}
/* Under adapt: the request's switches replayed on the replay's policy cache, each when as many tokens are in it as
 * when it switched serving (before position `at`), by the same move. *next: the switches done so far. */
static void shadow_switches(KVCache *c, const Model *m, const Options *o, const Server *sv, const Seq *r, int pos,
                            int *next) {
    for (; *next < r->n_sw && r->sw[*next].at == pos; (*next)++) {
        KVCache d;
        char err[512];
        shadow_cache(&d, m, o, sv->carrier[r->sw[*next].member], o->kvt, r->n_prompt);
        if (kv_cache_transfer(&d, c, pos, err, sizeof err))
            fatal("serve: the replay of request %d could not switch at position %d: %s", r->tr->id, pos, err);
        kv_cache_free(c);
        kv_cache_move(c, &d);
    }
}

/* -shadow 2: request r alone through a single run's cache of its policy (its last admission's member and switches
 * under adapt), token by token from its prompt's last token; r->differ = the sampled positions of that admission
 * (every admission's when the spec is not adapt: each gives the same cache) whose logits differ in any bit from the
 * served ones. */
static void request_replay(const Model *m, const Options *o, const Server *sv, Seq *r, const SampleLog *lg,
                           float *row) {
    KVCache c;
    RunState st;
    int V = m->config.vocab_size, np = r->n_prompt - 1, next_sw = 0, k = 0, last = r->sc[r->n_sc - 1].pos;
    shadow_cache(&c, m, o, seq_spec(sv, sv->ad ? r->start_member : 0), o->kvt, r->n_prompt);
    if (state_init_chunk(&st, &m->config, PREFILL_CHUNK)) fatal("out of memory");
    for (int p = 0; p < np;) {   /* the prompt but its last token, in stretches cut where it switched */
        shadow_switches(&c, m, o, sv, r, p, &next_sw);
        int end = np;
        for (int j = next_sw; j < r->n_sw; j++)
            if (r->sw[j].at > p && r->sw[j].at < end) { end = r->sw[j].at; break; }
        if (forward_prefill((Model *)m, &st, &c, r->ids.ids + p, (size_t)(end - p), p, PREFILL_CHUNK))
            fatal("serve: the replay of request %d could not prefill", r->tr->id);
        p = end;
    }
    r->differ = 0;
    for (int p = np; p <= last; p++) {
        shadow_switches(&c, m, o, sv, r, p, &next_sw);
        if (forward((Model *)m, &st, &c, r->ids.ids[p], p))
            fatal("serve: the replay of request %d could not feed position %d", r->tr->id, p);
        for (; k < r->n_sc && r->sc[k].pos == p; k++) {
            if (sv->ad && r->sc[k].life != r->preemptions) continue;
            sample_read(lg, r->sc[k].row, row);
            r->differ += memcmp(row, st.logits, (size_t)V * sizeof(float)) != 0;
        }
    }
    kv_cache_free(&c);
    state_free(&st);
}

/* The second pass over the finished requests q[0..N) (see SampleLog): r->kl, r->top1, r->nq for each, r->differ under
 * -shadow 2. Stops early (what it scored kept) on SIGINT/SIGTERM. */
static void shadow_pass(const Model *m, const Options *o, const Server *sv, Seq *q, int N, const SampleLog *lg,
                        const char *spec_text) {
    enum { CHUNK = 64 };
    int V = m->config.vocab_size, n = 0, *order = malloc((size_t)N * sizeof(int));
    float *row = malloc((size_t)V * sizeof(float));
    if (!order || !row) fatal("out of memory");
    long total = 0, done = 0;
    for (int i = 0; i < N; i++)
        if (q[i].state == S_DONE && q[i].n_sc) { order[n++] = i; total += q[i].n_sc; }
    shadow_order_q = q;
    qsort(order, (size_t)n, sizeof *order, cmp_by_ids);
    KVCache full;
    RunState st;
    shadow_cache(&full, m, o, "full", KV_F32, 0);
    if (state_init_chunk(&st, &m->config, CHUNK)) fatal("out of memory");
    const IdList *held = NULL;   /* the tokens in full: held->ids[0 .. n_held) */
    int n_held = 0;
    char err[512], what[96];
    snprintf(what, sizeof what, "serve %s: shadow pass:", spec_text);
    double t0 = now_s();
    for (int i = 0; i < n && !run_signal; i++) {
        Seq *r = &q[order[i]];
        int keep = 0, first = r->sc[0].pos, last = r->sc[r->n_sc - 1].pos, k = 0;
        while (keep < n_held && keep < first && held->ids[keep] == r->ids.ids[keep]) keep++;
        if (kv_cache_truncate(&full, keep, err, sizeof err)) fatal("serve: the shadow pass: %s", err);
        r->kl = r->top1 = 0;
        r->nq = 0;
        for (int p = keep; p <= last; p += CHUNK) {
            int nt = last + 1 - p < CHUNK ? last + 1 - p : CHUNK;
            if (forward_chunk((Model *)m, &st, &full, r->ids.ids + p, nt, p))
                fatal("serve: the shadow pass of request %d could not feed position %d", r->tr->id, p);
            for (; k < r->n_sc && r->sc[k].pos < p + nt; k++) {
                const float *a = st.logits + (size_t)(r->sc[k].pos - p) * V;
                sample_read(lg, r->sc[k].row, row);
                r->kl += eval_kl_div(a, eval_logsumexp(a, V), row, eval_logsumexp(row, V), V);
                r->top1 += sample_argmax(a, V) == sample_argmax(row, V);
                r->nq++;
            }
        }
        held = &r->ids;
        n_held = last + 1;
        if (o->shadow == 2) request_replay(m, o, sv, r, lg, row);
        done += r->n_sc;
        progress(t0, done, total, what);
    }
    kv_cache_free(&full);
    state_free(&st);
    free(order);
    free(row);
}
/* The trace, replayed once under spec. Returns 0, or 128 + signal when stopped (what ran is reported). */
static int serve_one(const Model *m, const Options *o, const Trace *t, const Seq *prompts, const char *spec_text,
                     size_t pool_bytes, OutFile *out, const Provenance *pv) {
    Server sv = {.m = m, .o = o, .spec = spec_text, .n_lanes = m->config.n_layers * m->config.n_kv_heads,
                 .max_seqs = o->max_seqs, .chunk = o->chunk};
    char err[512];
    KVShape shape = model_kv_shape(m, o->ctx);
    KVSpec spec;
    Adapt ad;
    int arc = serve_adapt_parse(spec_text, o->kvt, &ad, err, sizeof err), is_adapt = arc == 0;
    if (arc < 0) fatal("serve: -kv: %s", err);
    size_t page_bytes = 0;
    for (int k = 0; k < (is_adapt ? ad.n : 1); k++) {   /* the pool's page: the largest member's 16 slots */
        if (kv_spec_parse(&spec, is_adapt ? ad.spec[k] : spec_text, o->kvt, err, sizeof err)) fatal("serve: -kv: %s", err);
        if (kv_spec_check_mode(&spec, "serve", err, sizeof err)) fatal("serve: -kv: %s", err);
        size_t pb = (size_t)KV_POOL_PAGE_SLOTS * (kv_vector_bytes(spec.ktype, shape.head_dim)
                                                  + kv_vector_bytes(spec.vtype, shape.head_dim));
        if (pb > page_bytes) page_bytes = pb;
    }
    if (kv_pool_init(&sv.pool, pool_bytes, page_bytes, err, sizeof err)) fatal("serve: -pool: %s", err);
    sv.prefix = o->prefix && !is_adapt && !strcmp(spec.name, "full");   /* adapt: off (its members may evict) */
    if (is_adapt) {
        sv.ad = &ad;
        for (int k = 0; k < ad.n; k++) {   /* each member's cache made once now, so a spec the pool refuses stops here */
            if (ad.full[k] && ad.scorer[0])
                snprintf(sv.carrier[k], sizeof sv.carrier[k], "%s:%d,ktype=%s,vtype=%s", ad.scorer, o->ctx,
                         kv_type_names[ad.ktype[k]], kv_type_names[ad.vtype[k]]);
            else snprintf(sv.carrier[k], sizeof sv.carrier[k], "%s", ad.spec[k]);
            KVCache trial;
            if (kv_spec_parse(&spec, sv.carrier[k], o->kvt, err, sizeof err)
                || kv_cache_init_pool(&trial, &shape, &spec, &sv.pool, err, sizeof err))
                fatal("serve: -kv %s: member '%s': %s", spec_text, ad.spec[k], err);
            kv_cache_free(&trial);
        }
    }
    for (const char *c = spec_text; *c; c++) sv.salt = kv_mix64(sv.salt ^ (uint8_t)*c) + 0x9E3779B97F4A7C15ull;
    int N = t->n, V = m->config.vocab_size;
    Seq *q = calloc((size_t)N, sizeof(Seq));
    int *running = malloc((size_t)N * sizeof(int)), *waiting = malloc((size_t)N * sizeof(int)),
        *tried = malloc((size_t)N * sizeof(int));   /* adapt: running[k] could not shrink this step */
    RunState s;
    if (!q || !running || !waiting || !tried || state_init_chunk(&s, &m->config, sv.max_seqs + sv.chunk)) fatal("out of memory");
    s.logits_rows = LOGITS_LAST;   /* a step samples each sequence's last row, nothing else */
    BatchSeq *batch = malloc((size_t)sv.max_seqs * sizeof(BatchSeq));
    int *tokens = malloc((size_t)(sv.max_seqs + sv.chunk) * sizeof(int)), *bi = malloc((size_t)sv.max_seqs * sizeof(int));
    if (!batch || !tokens || !bi) fatal("out of memory");
    for (int i = 0; i < N; i++) { q[i].tr = &t->req[i]; q[i].state = -1; }
    int n_run = 0, n_wait = 0, next_arrival = 0, n_done = 0, preemptions = 0;
    long step = 0, prompt_tokens = 0, hit_tokens = 0, out_tokens = 0, fed_tokens = 0, steps_run = 0;
    double occ_sum = 0, occ_peak = 0, mb_tok_sum = 0;
    long occ_at[4] = {0};   /* steps with occupancy >= 80, 90, 95, 99% */
    static const double levels[4] = {0.80, 0.90, 0.95, 0.99};
    Line occ = {0};
    line_printf(&occ, "%s", "");
    double t0 = now_s();
    long total_out = 0;
    for (int i = 0; i < N; i++) total_out += (long)t->req[i].n_gen * (t->req[i].n_turns ? t->req[i].n_turns : 1);
    SampleLog lg = {.V = V};
    if (o->shadow && !(lg.f = tmpfile()))
        fatal("serve: -shadow: could not create a temporary file for the served logits: %s", strerror(errno));
    int rc = 0;
    while (n_done < N) {
        if (run_signal) { rc = 128 + run_signal; break; }
        double now = now_s();
        if (n_run == 0 && n_wait == 0 && next_arrival < N && t->req[next_arrival].arrival > step)
            step = t->req[next_arrival].arrival;   /* idle: the clock skips to the next arrival */
        while (next_arrival < N && t->req[next_arrival].arrival <= step) {
            Seq *r = &q[next_arrival];
            r->state = S_QUEUED;
            r->arrive_step = step;
            r->t_arrive = now;
            for (size_t e = 0; e < prompts[next_arrival].ids.n; e++) ids_push(&r->ids, prompts[next_arrival].ids.ids[e]);
            r->n_prompt = prompts[next_arrival].n_prompt;
            r->stop = prompts[next_arrival].stop;
            prompt_tokens += r->n_prompt;
            waiting[n_wait++] = next_arrival++;
        }
        /* adapt: running sequences below the member the occupancy calls for switch to it (a move that does not fit
           the pool now waits for a later step) */
        if (sv.ad) {
            int lvl = adapt_level(&sv);
            double occ = pool_occupancy(&sv);   /* the one that called for lvl, logged with each switch it makes */
            for (int k = 0; k < n_run; k++)
                if (q[running[k]].member < lvl) seq_switch(&sv, &q[running[k]], lvl, step, occ, 0);
        }
        /* pages the running sequences' next step may take */
        int reserve = 0;
        for (int k = 0; k < n_run; k++) {
            Seq *r = &q[running[k]];
            reserve += kv_pages_needed(&r->cache, next_step_tokens(r, sv.chunk));
        }
        /* admission, first come first served: the queue's head while its pending tokens' pages are there */
        while (n_wait > 0 && n_run < sv.max_seqs) {
            Seq *r = &q[waiting[0]];
            if (r->has_cache && sv.ad && r->fed == 0 && r->member < adapt_level(&sv)) seq_release(r);
            if (!r->has_cache) cache_make(&sv, r, 0);
            int first = r->admitted_order == 0 && r->preemptions == 0;
            int pending = (int)r->ids.n - r->fed;
            if (r->ids.n > (size_t)seq_capacity(&sv, r)) {
                fprintf(stderr, "serve: request %d needs %zu tokens, over the %d its cache holds under '%s' (-c): "
                        "failed\n", r->tr->id, r->ids.n, seq_capacity(&sv, r), spec_text);
                r->state = S_FAILED;
                seq_release(r);
                memmove(waiting, waiting + 1, (size_t)--n_wait * sizeof(int));
                n_done++;
                continue;
            }
            int need = kv_pages_needed(&r->cache, pending);
            while (sv.ad && need > sv.pool.n_pages && r->member + 1 < sv.ad->n) {   /* adapt: a tighter member */
                int to = r->member + 1;
                seq_release(r);
                cache_make(&sv, r, to);
                need = kv_pages_needed(&r->cache, pending);
            }
            int avail = kv_pool_n_free(&sv.pool) + kv_pool_n_cached(&sv.pool);
            if (need + reserve > avail && n_run > 0) break;
            if (need > sv.pool.n_pages) {
                fprintf(stderr, "serve: request %d needs %d pages, over the pool's %d under '%s': failed\n",
                        r->tr->id, need, sv.pool.n_pages, spec_text);
                r->state = S_FAILED;
                seq_release(r);
                memmove(waiting, waiting + 1, (size_t)--n_wait * sizeof(int));
                n_done++;
                continue;
            }
            if (need > avail) break;   /* alone and waiting for cached pages: none, so it waits for nothing */
            if (first) {
                int hit = prefix_adopt(&sv, r);
                r->hit_tokens = hit;
                hit_tokens += hit;
                r->t_admit = now;
            }
            r->state = S_RUNNING;
            r->gen_base = r->out.n;
            r->admitted_order = ++sv.order;
            reserve += kv_pages_needed(&r->cache, next_step_tokens(r, sv.chunk));
            running[n_run++] = waiting[0];
            memmove(waiting, waiting + 1, (size_t)--n_wait * sizeof(int));
        }
        if (n_run == 0) {
            if (n_wait > 0) { step++; continue; }   /* nothing fits yet (cannot happen with an empty pool) */
            continue;
        }
        /* the batch: decode tokens first, then prompt tokens up to -chunk, oldest admission first */
        int budget = sv.chunk, n_tok = 0, nb = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int k = 0; k < n_run; k++) {
                Seq *r = &q[running[k]];
                int pending = (int)r->ids.n - r->fed;
                if ((pass == 0) != (pending == 1)) continue;
                int n = pass == 0 ? 1 : pending < budget ? pending : budget;
                if (n <= 0) continue;
                if (pass == 1) budget -= n;
                bi[nb] = running[k];
                batch[nb++] = (BatchSeq){&r->cache, r->fed, n, NULL, NULL};
                for (int e = 0; e < n; e++) tokens[n_tok++] = r->ids.ids[r->fed + e];
            }
        /* preemption: while the step's pages are not there, the latest admitted sequence gives its pages back */
        for (int k = 0; k < n_run; k++) tried[k] = 0;
        for (;;) {
            int need = 0;
            for (int b = 0; b < nb; b++) need += kv_pages_needed(batch[b].cache, batch[b].n);
            if (need <= kv_pool_n_free(&sv.pool) + kv_pool_n_cached(&sv.pool)) break;
            if (sv.ad) {   /* adapt shrinks before it preempts: the lowest member, the latest admitted, one step down */
                int pick = -1;
                for (int k = 0; k < n_run; k++) {
                    Seq *c = &q[running[k]];
                    if (c->member + 1 >= sv.ad->n || tried[k]) continue;
                    if (pick < 0 || c->member < q[running[pick]].member
                        || (c->member == q[running[pick]].member && c->admitted_order > q[running[pick]].admitted_order))
                        pick = k;
                }
                if (pick >= 0) {
                    Seq *c = &q[running[pick]];
                    if (seq_switch(&sv, c, c->member + 1, step, pool_occupancy(&sv), 1)) tried[pick] = 1;
                    continue;
                }
            }
            if (n_run == 1) {   /* alone and still short: the request is larger than the pool */
                Seq *r = &q[running[0]];
                fprintf(stderr, "serve: request %d needs more pages than the pool's %d under '%s': failed\n",
                        r->tr->id, sv.pool.n_pages, spec_text);
                seq_release(r);
                r->state = S_FAILED;
                n_done++;
                n_run = 0;
                nb = 0;
                break;
            }
            int victim = 0;
            for (int k = 1; k < n_run; k++)
                if (q[running[k]].admitted_order > q[running[victim]].admitted_order) victim = k;
            Seq *r = &q[running[victim]];
            seq_release(r);
            r->n_sw = 0;   /* adapt: it starts over from the member of its next admission */
            r->fed = 0;
            r->published = 0;
            r->preemptions++;
            r->state = S_QUEUED;
            preemptions++;
            memmove(waiting + 1, waiting, (size_t)n_wait * sizeof(int));
            waiting[0] = running[victim];
            n_wait++;
            running[victim] = running[--n_run];
            tried[victim] = tried[n_run];
            int w = 0;   /* drop it from the batch, rebuilding the token list */
            n_tok = 0;
            for (int b = 0; b < nb; b++) {
                if (batch[b].cache == &r->cache) continue;
                bi[w] = bi[b];
                batch[w] = batch[b];
                for (int e = 0; e < batch[w].n; e++) tokens[n_tok++] = q[bi[w]].ids.ids[batch[w].pos0 + e];
                w++;
            }
            nb = w;
        }
        if (nb == 0) { step++; continue; }
        if (forward_batch((Model *)m, &s, batch, nb, tokens)) {
            Seq *r = &q[bi[0]];
            fatal("serve: step %ld: a sequence's cache could not take its tokens (request %d, '%s', %d pages free): "
                  "a scheduler bug", step, r->tr->id, spec_text, kv_pool_n_free(&sv.pool));
        }
        steps_run++;
        fed_tokens += n_tok;
        double t_step = now_s();
        for (int b = 0, row = 0; b < nb; row += batch[b].n, b++) {
            Seq *r = &q[bi[b]];
            r->fed += batch[b].n;
            prefix_publish(&sv, r);
            if (r->fed < (int)r->ids.n) continue;   /* still prefilling */
            const float *logits = s.logits + (size_t)(row + batch[b].n - 1) * V;
            int next = sample_argmax(logits, V);
            if (o->shadow) sample_log(&lg, r, r->fed - 1, logits);
            int stop = next == r->stop || tokenizer_is_eog(&m->tokenizer, next);
            if (r->out.n == 0) r->t_first = t_step;
            r->t_last = t_step;
            if (!stop) { ids_push(&r->out, next); r->out_turn++; out_tokens++; }
            int turn_done = stop || r->out_turn >= r->tr->n_gen || (int)r->ids.n + 1 >= seq_capacity(&sv, r);
            if (!turn_done) { ids_push(&r->ids, next); continue; }
            if (r->turn + 1 < r->tr->n_turns) {   /* the next turn: the answer's last token, then its prompt */
                if (!stop) ids_push(&r->ids, next);
                size_t served = r->ids.n;
                r->turn++;
                r->out_turn = 0;
                next_turn(r, m);
                if ((long)r->ids.n < (long)seq_capacity(&sv, r)) continue;
                r->cut = 1;   /* the next turn does not fit -c: the request ends here, its tokens those served */
                r->ids.n = served;
            }
            r->state = S_DONE;
            n_done++;
        }
        /* finished sequences leave; occupancy is measured on the step's peak, before they give their pages back */
        int held = kv_pool_n_held(&sv.pool);
        long ctx_tokens = 0;
        for (int k = 0; k < n_run; k++) ctx_tokens += q[running[k]].fed;
        double occu = (double)held / sv.pool.n_pages;
        occ_sum += occu;
        if (occu > occ_peak) occ_peak = occu;
        for (int e = 0; e < 4; e++) occ_at[e] += occu >= levels[e];
        if (ctx_tokens) mb_tok_sum += (double)held * sv.pool.page_bytes / ctx_tokens / 1e6;
        line_printf(&occ, "%s%.4f", steps_run > 1 ? "," : "", occu);
        for (int k = 0; k < n_run;)
            if (q[running[k]].state == S_DONE) { seq_release(&q[running[k]]); running[k] = running[--n_run]; }
            else k++;
        if (kv_pool_check(&sv.pool, err, sizeof err)) fatal("serve: the pool's invariants broke at step %ld: %s", step, err);
        long held_by_seqs = 0, refs = 0;   /* every reference to a page is a running sequence's lane's */
        for (int k = 0; k < n_run; k++) held_by_seqs += kv_pages_held(&q[running[k]].cache);
        for (int k = 0; k < n_wait; k++) held_by_seqs += q[waiting[k]].has_cache ? kv_pages_held(&q[waiting[k]].cache) : 0;
        for (int p = 0; p < sv.pool.n_pages; p++) refs += sv.pool.ref[p];
        if (held_by_seqs != refs)
            fatal("serve: step %ld: the sequences' lanes hold %ld page references, the pool counts %ld", step,
                  held_by_seqs, refs);
        step++;
        char what[96];
        snprintf(what, sizeof what, "serve %s: %d/%d requests,", spec_text, n_done, N);
        progress(t0, out_tokens, total_out, what);
    }
    double wall = now_s() - t0;
    for (int k = 0; k < n_run; k++) seq_release(&q[running[k]]);
    for (int k = 0; k < n_wait; k++) seq_release(&q[waiting[k]]);
    int leaked = kv_pool_n_held(&sv.pool);
    if (rc == 0 && leaked) fatal("serve: %d pages still held after every request ended", leaked);
    /* per request, then the run */
    double *ttft = malloc((size_t)N * sizeof(double)), *tpot = malloc((size_t)N * sizeof(double)),
           *queue = malloc((size_t)N * sizeof(double));
    int n_ttft = 0, n_tpot = 0, n_failed = 0, n_finished = 0;
    double kl_sum = 0, top1_sum = 0;
    long q_n = 0, differ_sum = 0;   /* -shadow 2: sampled positions whose replay differs, all requests */
    if (o->shadow && !run_signal) shadow_pass(m, o, &sv, q, N, &lg, spec_text);
    if (lg.f) fclose(lg.f);
    Line ln = {0};
    for (int i = 0; i < N; i++) {
        Seq *r = &q[i];
        n_failed += r->state == S_FAILED;
        if (r->state == S_FAILED && out->fd >= 0) {
            ln.n = 0;
            line_printf(&ln, "{\"mode\":\"serve\",\"kind\":\"request\",\"kv\":\"");
            line_json_str(&ln, spec_text);
            line_printf(&ln, "\",\"id\":%d,\"arrival\":%ld,\"prompt_tokens\":%d,\"failed\":true,", r->tr->id,
                        r->tr->arrival, r->n_prompt);
            json_provenance_end(&ln, pv);
            outfile_line(out, &ln);
        }
        if (r->state != S_DONE) continue;
        n_finished++;
        double tt = r->t_first - r->t_arrive, tp = r->out.n > 1 ? (r->t_last - r->t_first) / (r->out.n - 1) : NAN;
        ttft[n_ttft++] = tt;
        queue[n_ttft - 1] = r->t_admit - r->t_arrive;
        if (r->out.n > 1) tpot[n_tpot++] = tp;
        kl_sum += r->kl; top1_sum += r->top1; q_n += r->nq; differ_sum += r->differ;
        if (out->fd < 0) continue;
        ln.n = 0;
        line_printf(&ln, "{\"mode\":\"serve\",\"kind\":\"request\",\"kv\":\"");
        line_json_str(&ln, spec_text);
        line_printf(&ln, "\",\"id\":%d,\"arrival\":%ld,\"prompt_tokens\":%d,\"failed\":false,\"hit_tokens\":%d,\"out_tokens\":%zu,"
                    "\"turns\":%d,\"cut\":%s,\"preemptions\":%d,\"queue_s\":%.6f,\"ttft_s\":%.6f,\"tpot_ms\":%.4f,",
                    r->tr->id, r->tr->arrival, r->n_prompt, r->hit_tokens, r->out.n, r->tr->n_turns, r->cut ? "true" : "false",
                    r->preemptions,
                    r->t_admit - r->t_arrive, tt, r->out.n > 1 ? tp * 1e3 : 0.0);
        if (r->nq) line_printf(&ln, "\"shadow_positions\":%ld,\"kl\":%.8f,\"top1\":%.6f,", r->nq, r->kl / r->nq,
                               r->top1 / r->nq);
        if (r->nq && o->shadow == 2) line_printf(&ln, "\"shadow_differs\":%ld,", r->differ);
        if (sv.ad) {   /* adapt: the member it started in, each switch */
            line_printf(&ln, "\"member\":\"");
            line_json_str(&ln, ad.spec[r->start_member]);
            line_printf(&ln, "\",\"switches\":[");
            for (int e = 0; e < r->n_sw; e++) {
                line_printf(&ln, "%s{\"step\":%ld,\"at_token\":%d,\"to\":\"", e ? "," : "", r->sw[e].step, r->sw[e].at);
                line_json_str(&ln, ad.spec[r->sw[e].member]);
                line_printf(&ln, "\",\"occupancy\":%.4f,\"pool_short\":%s}", r->sw[e].occ,
                            r->sw[e].shortage ? "true" : "false");
            }
            line_printf(&ln, "],");
        }
        line_printf(&ln, "\"ids\":[");
        for (size_t e = 0; e < r->out.n; e++) line_printf(&ln, "%s%d", e ? "," : "", r->out.ids[e]);
        line_printf(&ln, "],");
        json_provenance_end(&ln, pv);
        outfile_line(out, &ln);
    }
    double ttft50 = percentile(ttft, n_ttft, 50), ttft95 = percentile(ttft, n_ttft, 95);
    double tpot50 = percentile(tpot, n_tpot, 50) * 1e3, tpot95 = percentile(tpot, n_tpot, 95) * 1e3;
    double q95 = percentile(queue, n_ttft, 95);
    double hit = prompt_tokens ? (double)hit_tokens / prompt_tokens : 0;
    double occ_mean = steps_run ? occ_sum / steps_run : 0, mbt = steps_run ? mb_tok_sum / steps_run : 0;
    fprintf(stderr, "%-28s %5d %4d %5d %6.3f %8.3f %8.3f %8.2f %8.2f %8.3f %8.1f %6.3f %6.3f %5.1f%% %5.1f%% %5.1f%% "
            "%5.1f%% %7.4f %7.1f", spec_text, n_finished, n_failed, preemptions, hit, ttft50, ttft95, tpot50, tpot95,
            q95, out_tokens / wall, occ_mean, occ_peak, 100.0 * occ_at[0] / (steps_run ? steps_run : 1),
            100.0 * occ_at[1] / (steps_run ? steps_run : 1), 100.0 * occ_at[2] / (steps_run ? steps_run : 1),
            100.0 * occ_at[3] / (steps_run ? steps_run : 1), mbt, wall);
    if (q_n) fprintf(stderr, " %8.5f %6.4f\n", kl_sum / q_n, top1_sum / q_n);
    else fprintf(stderr, " %8s %6s\n", "-", "-");
    if (q_n && o->shadow == 2)
        fprintf(stderr, "  shadow 2: %ld of %ld sampled positions replayed alone differ from the served logits\n",
                differ_sum, q_n);
    if (sv.ad) {   /* the switches, under the row */
        long all = 0;
        for (int k = 1; k < ad.n; k++) all += sv.n_switch[k];
        fprintf(stderr, "  adapt: %ld switches (%ld when the pool ran short, instead of a preemption):", all, sv.n_shortage);
        for (int k = 1; k < ad.n; k++) fprintf(stderr, "%s to %s@%d %ld", k > 1 ? "," : "", ad.spec[k], ad.at[k], sv.n_switch[k]);
        fprintf(stderr, "\n");
    }
    if (out->fd >= 0) {
        ln.n = 0;
        line_printf(&ln, "{\"mode\":\"serve\",\"kind\":\"run\",\"kv\":\"");
        line_json_str(&ln, spec_text);
        line_printf(&ln, "\",\"requests\":%d,\"finished\":%d,\"failed\":%d,%s\"pool_bytes\":%zu,\"page_bytes\":%zu,"
                    "\"pages\":%d,\"steps\":%ld,\"preemptions\":%d,\"prompt_tokens\":%ld,\"hit_tokens\":%ld,"
                    "\"hit_rate\":%.6f,\"fed_tokens\":%ld,\"out_tokens\":%ld,\"wall_s\":%.3f,\"throughput_tok_s\":%.3f,"
                    "\"ttft_p50_s\":%.6f,\"ttft_p95_s\":%.6f,\"tpot_p50_ms\":%.4f,\"tpot_p95_ms\":%.4f,"
                    "\"queue_p95_s\":%.6f,\"occupancy_mean\":%.4f,\"occupancy_peak\":%.4f,\"steps_at_80\":%ld,"
                    "\"steps_at_90\":%ld,\"steps_at_95\":%ld,\"steps_at_99\":%ld,\"mb_per_token\":%.6f,"
                    "\"occupancy\":[%s],", N, n_finished, n_failed, rc ? "\"partial\":true," : "", pool_bytes,
                    sv.pool.page_bytes, sv.pool.n_pages, steps_run, preemptions, prompt_tokens, hit_tokens, hit,
                    fed_tokens, out_tokens, wall, out_tokens / wall, n_ttft ? ttft50 : 0, n_ttft ? ttft95 : 0,
                    n_tpot ? tpot50 : 0, n_tpot ? tpot95 : 0, n_ttft ? q95 : 0, occ_mean, occ_peak, occ_at[0],
                    occ_at[1], occ_at[2], occ_at[3], mbt, occ.s);
        if (q_n) line_printf(&ln, "\"shadow_positions\":%ld,\"kl\":%.8f,\"top1\":%.6f,", q_n, kl_sum / q_n,
                             top1_sum / q_n);
        if (q_n && o->shadow == 2) line_printf(&ln, "\"shadow_differs\":%ld,", differ_sum);
        if (sv.ad) {
            line_printf(&ln, "\"switches_on_short_pool\":%ld,\"switches_to\":{", sv.n_shortage);
            for (int k = 1; k < ad.n; k++) {
                line_printf(&ln, "%s\"", k > 1 ? "," : "");
                line_json_str(&ln, ad.spec[k]);
                line_printf(&ln, "\":%ld", sv.n_switch[k]);
            }
            line_printf(&ln, "},");
        }
        json_provenance_end(&ln, pv);
        outfile_line(out, &ln);
    }
    line_free(&ln);
    line_free(&occ);
    free(ttft); free(tpot); free(queue);
    for (int i = 0; i < N; i++) { free(q[i].ids.ids); free(q[i].out.ids); }
    for (int i = 0; i < N; i++) { free(q[i].sw); free(q[i].sc); }
    free(q); free(running); free(waiting); free(tried); free(batch); free(tokens); free(bi);
    state_free(&s);
    kv_pool_free(&sv.pool);
    return rc;
}

int run_serve(Model *m, const Options *opt) {
    Options oc = *opt, *o = &oc;   /* -c defaults to the trained context, at most 2048 tokens; -s to 1 */
    if (!o->ctx) o->ctx = m->config.seq_len < 2048 ? m->config.seq_len : 2048;
    if (!o->seed_set) o->seed = 1;
    OutFile out = OUTFILE_NONE;   /* opened first: a path that cannot be written stops the job before any work */
    if (o->out) outfile_open(&out, "-o", o->out, 1);
    if (!m->has_tokenizer) fatal("-m serve needs a model with a tokenizer (its requests are text)");
    Trace t;
    char err[512];
    int n_gen = o->steps_set ? o->steps : 32;
    if (n_gen < 1) fatal("-m serve: -n is the tokens each turn generates, at least 1");
    if (o->trace && trace_load(&t, o->trace, n_gen, err, sizeof err)) fatal("%s", err);
    if (o->sharegpt && trace_load_sharegpt(&t, o->sharegpt, n_gen, o->requests, err, sizeof err)) fatal("%s", err);
    uint64_t seed = o->seed;
    if (o->sharegpt && o->arrival > 0 && trace_assign_arrivals(&t, o->arrival, seed, err, sizeof err)) fatal("%s", err);
    if (!o->trace && !o->sharegpt) {
        int lo = o->n_lengths ? o->lengths[0] : 256, hi = o->n_lengths > 1 ? o->lengths[1] : o->n_lengths ? lo : 1024;
        if (trace_generate(&t, o->requests ? o->requests : 64, o->pattern ? o->pattern : "sequential",
                           (char **)o->docs, o->n_docs, seed, lo, hi, o->arrival_set ? o->arrival : 2, n_gen, err,
                           sizeof err))
            fatal("serve: %s", err);
    }
    char desc[512];
    trace_describe(&t, desc, sizeof desc);
    /* the trace's full-cache demand: what the -max-seqs largest requests hold at once under full in f32 pages, each
       request's tokens its first prompt's (tokenized here as serving will) plus n_gen per turn and later turns' text
       (bytes / 4 tokens, plus 16 for the template), at most -c: the most one batch holds, so that at 100% a pool of
       single-turn requests never runs short */
    KVShape shape = model_kv_shape(m, o->ctx);
    size_t page_f32 = (size_t)KV_POOL_PAGE_SLOTS * 2 * kv_vector_bytes(KV_F32, shape.head_dim);
    size_t n_lanes = (size_t)m->config.n_layers * m->config.n_kv_heads;
    double demand = 0, *need = malloc((size_t)t.n * sizeof(double));
    Seq *prompts = calloc((size_t)t.n, sizeof(Seq));   /* each request's first prompt, tokenized once for every spec */
    int n_short = 0;
    if (!need || !prompts) fatal("out of memory");
    for (int i = 0; i < t.n; i++) {
        const TraceReq *r = &t.req[i];
        prompts[i].tr = r;
        first_prompt(&prompts[i], m, o);
        long tok = prompts[i].n_prompt;
        n_short += prompts[i].short_doc;
        for (int k = 1; k < r->n_turns; k++) tok += (long)(strlen(r->turns[k]) / 4) + 16;
        tok += (long)r->n_gen * (r->n_turns ? r->n_turns : 1);
        if (tok > o->ctx) tok = o->ctx;
        need[i] = (double)kv_pool_pages_for((int)tok, KV_POOL_PAGE_SLOTS) * n_lanes * page_f32;
    }
    if (n_short)
        run_note("%d of %d requests ask for more document tokens than their document has: they read it whole", n_short,
                 t.n);
    qsort(need, (size_t)t.n, sizeof *need, cmp_double);
    for (int i = t.n - 1; i >= 0 && i >= t.n - o->max_seqs; i--) demand += need[i];
    free(need);
    size_t pool_bytes = o->pool_bytes ? o->pool_bytes : (size_t)(demand * (o->pool_frac > 0 ? o->pool_frac : 1.0));
    run_job_start();
    fprintf(stderr, "serve: %s; pool %.1f MiB (%.0f%% of the trace's full-cache demand, %.1f MiB in f32 pages); at most "
            "%d sequences a step, %d prompt tokens a step; prefix caching %s; %d thread%s\n", desc,
            pool_bytes / 1048576.0, 100.0 * pool_bytes / demand, demand / 1048576.0, o->max_seqs, o->chunk,
            o->prefix ? "on (full)" : "off", run_threads(), run_threads() == 1 ? "" : "s");
    Sha256 text_sha;
    sha_init(&text_sha);
    for (int d = 0; d < t.n_doc; d++) sha_update(&text_sha, t.doc[d].text, t.doc[d].bytes);
    Provenance pv;
    provenance_init(&pv, m, o, &text_sha);
    fprintf(stderr, "\n%-28s %5s %4s %5s %6s %8s %8s %8s %8s %8s %8s %6s %6s %6s %6s %6s %6s %7s %7s %8s %6s\n", "policy", "done",
            "fail", "preem", "hit", "TTFT50 s", "TTFT95 s", "TPOT50ms", "TPOT95ms", "queue95s", "tok/s", "occ", "peak",
            ">=80%", ">=90%", ">=95%", ">=99%", "MB/tok", "wall s", "KL", "top1");
    int rc = 0;
    const char *def = "full";
    int n_kv = o->n_kv ? o->n_kv : 1;
    for (int k = 0; k < n_kv && !rc; k++) rc = serve_one(m, o, &t, prompts, o->n_kv ? o->kv[k] : def, pool_bytes, &out, &pv);
    if (rc) fprintf(stderr, "serve: stopped by %s: the table holds what ran\n", run_signal_name(rc - 128));
    outfile_close(&out);
    line_free(&pv.cmdline);
    for (int i = 0; i < t.n; i++) free(prompts[i].ids.ids);
    free(prompts);
    trace_free(&t);
    return rc;
}
