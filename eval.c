/* eval.c: the evaluation modes of ./run: perplexity through the evicting cache (-m ppl), with every -kv policy run on
 * the same token stream next to an automatic f32 never-evicting shadow (KL, top-1 agreement, Δp, ΔNLL, attention-mass
 * recall), and the llama.cpp-compatible chunked perplexity. Results: a table on stderr, JSON lines with -o, per-token
 * lines with -tokenlog. docs/DESIGN.md's "Semantics" and "Evaluation" sections define every number printed here.
 * It deliberately adds no model code: every token goes through run.c's forward(), exactly as in generation.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, vocab_size, ctx (-c: the shadow's length). Indices: t position in the
 * document, l layer, g kv head, h query head, d document.
 */
#include "eval.h"
#include "eval_impl.h"

#include <errno.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef KVLAB_GIT
#define KVLAB_GIT "unknown"
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * SHA-256 (FIPS 180-4), for the model and text digests every JSON record carries.
 * ------------------------------------------------------------------------------------------------------------- */


static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha_block(Sha256 *s, const uint8_t *p) {
    uint32_t w[64], a[8];
    for (int i = 0; i < 16; i++) w[i] = (uint32_t)p[4 * i] << 24 | p[4 * i + 1] << 16 | p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(a, s->h, sizeof a);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = a[7] + (ror(a[4], 6) ^ ror(a[4], 11) ^ ror(a[4], 25)) + ((a[4] & a[5]) ^ (~a[4] & a[6])) + SHA_K[i] + w[i];
        uint32_t t2 = (ror(a[0], 2) ^ ror(a[0], 13) ^ ror(a[0], 22)) + ((a[0] & a[1]) ^ (a[0] & a[2]) ^ (a[1] & a[2]));
        memmove(a + 1, a, 7 * sizeof(uint32_t));
        a[4] += t1;
        a[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) s->h[i] += a[i];
}

void sha_init(Sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c,
                                   0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof h0);
    s->n = 0;
}

void sha_update(Sha256 *s, const void *data, size_t len) {
    const uint8_t *p = data;
    while (len) {
        size_t used = s->n % 64, take = 64 - used < len ? 64 - used : len;
        if (used == 0 && len >= 64) { sha_block(s, p); take = 64; }
        else { memcpy(s->buf + used, p, take); if (used + take == 64) sha_block(s, s->buf); }
        s->n += take; p += take; len -= take;
    }
}

/* hex: 65 bytes */
static void sha_final_hex(Sha256 *s, char *hex) {
    uint64_t bits = s->n * 8;
    uint8_t pad = 0x80, zero = 0, len[8];
    sha_update(s, &pad, 1);
    while (s->n % 64 != 56) sha_update(s, &zero, 1);
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha_update(s, len, 8);
    for (int i = 0; i < 8; i++) sprintf(hex + 8 * i, "%08x", s->h[i]);
}

void sha256_hex(const void *data, size_t len, char *hex) {
    Sha256 s;
    sha_init(&s);
    sha_update(&s, data, len);
    sha_final_hex(&s, hex);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Records: every JSON line carries the command line, git commit, model and text digests, seed and threads.
 * ------------------------------------------------------------------------------------------------------------- */


void provenance_init(Provenance *pv, const Model *m, const Options *o, const Sha256 *text) {
    memset(pv, 0, sizeof *pv);
    line_shell_words(&pv->cmdline, o->argc, o->argv);
    line_printf(&pv->cmdline, "%s", "");   /* a NUL-terminated string even for an empty command line */
    /* the model's digest goes only into -o records: hashing 0.5 GB takes seconds, so it is skipped without -o */
    if (o->out) sha256_hex(m->data, m->size, pv->model_sha);
    Sha256 t = *text;
    sha_final_hex(&t, pv->text_sha);
    pv->threads = run_threads();
    pv->seed = o->seed;
}

/* The provenance fields every -o record ends with, and the closing brace and newline. */
void json_provenance_end(Line *l, const Provenance *pv) {
    line_printf(l, "\"cmd\":\"");
    line_json_str(l, pv->cmdline.s);
    line_printf(l, "\",\"git\":\"%s\",\"model_sha256\":\"%s\",\"text_sha256\":\"%s\",\"seed\":%llu,\"threads\":%d}\n",
                KVLAB_GIT, pv->model_sha, pv->text_sha, pv->seed, pv->threads);
}

/* ---------------------------------------------------------------------------------------------------------------
 * One policy's run over the token stream, and the shadow.
 * ------------------------------------------------------------------------------------------------------------- */



typedef struct {
    const Model *m;
    PolicyRun *shadow;
    float *shadow_prob;     /* (chunk, n_heads, ctx) the shadow's attention probabilities at the current layer */
    int ctx;
    int pos0;               /* position of the chunk's first token */
    int *spans;             /* (2 * the largest budget) scratch of kv_lane_read */
    double *group_prob;     /* (threads, 2·ctx) scratch: one GQA group's mean probabilities and eval_select_kth's
                               integers, for the top-B recall */
    int *topk_B, n_topk;    /* the policies' distinct budgets B */
    double *topk;           /* (chunk, n_topk) the top-B recall of each token of the chunk at the current layer */
} EvalCtx;

typedef struct { EvalCtx *e; PolicyRun *r; } HookCtx;

/* The stream evaluation's context for runs[0] the shadow and the policies runs[1..n_runs), chunks of `chunk` tokens,
 * -c ctx: its scratch allocated (or the run ends with an error naming it); eval_ctx_free frees it. */
static void eval_ctx_init(EvalCtx *e, const Model *m, PolicyRun *runs, int n_runs, int ctx, int chunk) {
    int most = 0;
    for (int k = 0; k < n_runs; k++) most = runs[k].cache.budget > most ? runs[k].cache.budget : most;
    *e = (EvalCtx){m, &runs[0], calloc((size_t)chunk * m->config.n_heads * ctx, sizeof(float)), ctx, 0,
                   calloc((size_t)2 * most, sizeof(int)), calloc((size_t)run_threads() * 2 * ctx, sizeof(double)),
                   calloc((size_t)n_runs, sizeof(int)), 0, calloc((size_t)chunk * n_runs, sizeof(double))};
    if (!e->shadow_prob || !e->spans || !e->group_prob || !e->topk_B || !e->topk)
        fatal("out of memory for the shadow's attention (%d tokens)", ctx);
    for (int k = 1; k < n_runs; k++) {
        int B = runs[k].cache.policy.budget, seen = 0;
        for (int i = 0; i < e->n_topk; i++) seen |= e->topk_B[i] == B;
        if (!seen) e->topk_B[e->n_topk++] = B;
    }
}
static void eval_ctx_free(EvalCtx *e) {
    free(e->shadow_prob);
    free(e->spans);
    free(e->group_prob);
    free(e->topk_B);
    free(e->topk);
}

/* A per-lane-and-step counter of the cache per query (one query of a lane per token: GQA's heads share it). */
static double per_query(const KVCache *c, uint64_t count) {
    double q = (double)c->steps_read * c->shape.n_layers * c->shape.n_kv_heads;
    return q > 0 ? (double)count / q : 0;
}

/* A policy's top-B recall, the mean over layers (PolicyRun.recall_topk). */
static double recall_topk_mean(const PolicyRun *r, int L) {
    double x = 0;
    for (int l = 0; l < L; l++) x += r->recall_n ? r->recall_topk[l] / r->recall_n : 0;
    return x / L;
}

/* A fast tier's figures (kv_tier_figures: over `steps` tokens since `before`, NULL: since init; compute_s, seconds of
 * compute per token): one line to f, or JSON fields (each followed by a comma) to a record. */
static KVTierFigures tier_figures(const KVCache *c, const KVTierStats *before, long steps, double compute_s,
                                  double link_gbs) {
    return kv_tier_figures(&c->tier, before, steps, compute_s, link_gbs * 1e9);
}
static void tier_print(FILE *f, const KVCache *c, const KVTierFigures *x, double compute_s) {
    char buf[512];
    kv_tier_line(buf, sizeof buf, c, x, compute_s);
    fprintf(f, "  %s: %s\n", c->spec.text, buf);
}
static void tier_json(Line *ln, const KVCache *c, const KVTierFigures *x, double compute_s, double link_gbs) {
    line_printf(ln, "\"kv_fast_bytes\":%zu,\"kv_fast_peak_bytes\":%zu,\"tier_hit_rate\":%.9g,"
                "\"kv_demand_bytes_per_token\":%.1f,\"kv_prefetch_bytes_per_token\":%.1f,\"prefetch_hit_rate\":%.9g,"
                "\"kv_wasted_bytes_per_token\":%.1f,\"kv_predict_bytes_per_token\":%.1f,\"link_gbs\":%g,"
                "\"stall_ms_per_token\":%.6g,\"compute_ms_per_token\":%.6g,", c->tier.cap, c->tier.fast_peak,
                x->hit_rate, x->demand, x->prefetch, x->prefetch_hit_rate, x->wasted, x->predict, link_gbs,
                x->stall_s * 1e3, compute_s * 1e3);
}

/* After the shadow's layer l attended at pos: keep its per-head probabilities for this token of the chunk (live
 * order = position order: it never evicts and restarts with each document). Runs go in lockstep layer by layer, so
 * only the current layer is kept. */
static void shadow_hook(void *ctx, int l, const KVCache *c, int pos) {
    HookCtx *hc = ctx;
    EvalCtx *e = hc->e;
    int H = c->shape.n_heads, n = pos + 1;
    float *dst = e->shadow_prob + (size_t)(pos - e->pos0) * H * e->ctx;
    for (int h = 0; h < H; h++)
        memcpy(dst + (size_t)h * e->ctx, c->scores + (size_t)h * c->budget, (size_t)n * sizeof(float));
}

/* A double's bits as an unsigned integer that orders as the values do (-0 just below +0; a NaN above +inf, or below
 * -inf with its sign bit set): a negative value's bits all flipped, a positive one's sign bit set. */
static inline uint64_t order_bits(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u >> 63 ? ~u : u | (uint64_t)1 << 63;
}
static inline double order_value(uint64_t u) {
    u = u >> 63 ? u & ~((uint64_t)1 << 63) : ~u;
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* eval_select_kth (eval.h): a most-significant-digit radix selection over order_bits, 12 bits a pass (the first
 * pass, the sign and the exponent, is counted once for every k): each pass counts the candidates' digits, keeps the
 * bin that holds the k-th largest (k counted down by the candidates above it) and gathers its candidates into buf (n
 * integers of scratch), until at most 32 are left (then sorted) or the bits run out (then they are all equal).
 * Linear passes with no data-dependent branch in the counting, where a quickselect's partitions mispredict about
 * every other comparison; the thresholds are the same numbers either way. */
#define SELECT_BITS 12
void eval_select_kth(const double *x, int n, const int *k, int nk, double *thr, uint64_t *buf) {
    static const int bins = 1 << SELECT_BITS;
    const int sh0 = 64 - SELECT_BITS;
    int top[1 << SELECT_BITS], cnt[1 << SELECT_BITS];
    memset(top, 0, sizeof top);
    for (int i = 0; i < n; i++) top[order_bits(x[i]) >> sh0]++;
    for (int j = 0; j < nk; j++) {
        int want = k[j], b = bins - 1, m = 0;
        while (want > top[b]) want -= top[b--];
        for (int i = 0; i < n; i++) {   /* branch-free gather: every value written, the count moves on a match */
            uint64_t u = order_bits(x[i]);
            buf[m] = u;
            m += (int)(u >> sh0) == b;
        }
        for (int hi = sh0; m > 32 && hi > 0;) {
            int w = hi < SELECT_BITS ? hi : SELECT_BITS, sh = hi - w, mask = (1 << w) - 1, mm = 0;
            memset(cnt, 0, (size_t)(mask + 1) * sizeof(int));
            for (int i = 0; i < m; i++) cnt[(buf[i] >> sh) & (uint64_t)mask]++;
            for (b = mask; want > cnt[b];) want -= cnt[b--];
            for (int i = 0; i < m; i++) {
                uint64_t u = buf[i];
                buf[mm] = u;
                mm += (int)((u >> sh) & (uint64_t)mask) == b;
            }
            m = mm;
            hi = sh;
        }
        for (int i = 1; i < m; i++) {   /* the last few, descending (all equal when the bits ran out) */
            uint64_t u = buf[i];
            int a = i;
            for (; a > 0 && buf[a - 1] < u; a--) buf[a] = buf[a - 1];
            buf[a] = u;
        }
        thr[j] = order_value(buf[want - 1]);
    }
}

/* The top-B recall at pos of the shadow's probabilities sp (n_heads rows of ctx) for the budgets B[0..nb), into
 * out[0..nb): per GQA group, the mass of the shadow's mean probability on its B most attended positions (1 while
 * pos < B: every position), the mean over the groups. Per group, eval_select_kth gives each budget's threshold, the
 * B-th largest, then one pass over the positions in order sums, for each budget, the values above its threshold, and
 * the threshold is added once for each tie it takes: each figure depends on the probabilities, the position and B
 * alone, not on the other budgets of the run. x: 2·ctx doubles of scratch. */
static void recall_topk(const EvalCtx *e, const float *sp, int pos, const int *B, int nb, double *x, double *out) {
    const Config *cf = &e->m->config;
    int H = cf->n_heads, G = cf->n_kv_heads, group = H / G, n = pos + 1;
    uint64_t *buf = (uint64_t *)(void *)(x + e->ctx);
    double thr[nb], top[nb], t[nb];
    int above[nb], kk[nb], nk = 0;
    for (int i = 0; i < nb; i++)
        if (B[i] < n) kk[nk++] = B[i];   /* the budgets that leave something out */
    for (int i = 0; i < nb; i++) out[i] = 0;
    for (int g = 0; g < G; g++) {
        for (int p = 0; p < n; p++) x[p] = 0;
        for (int hh = 0; hh < group; hh++) {
            const float *ph = sp + (size_t)(g * group + hh) * e->ctx;
            for (int p = 0; p < n; p++) x[p] += ph[p];
        }
        eval_select_kth(x, n, kk, nk, t, buf);
        for (int i = 0, j = 0; i < nb; i++) thr[i] = B[i] < n ? t[j++] : -INFINITY;   /* every position */
        for (int i = 0; i < nb; i++) { top[i] = 0; above[i] = 0; }
        for (int p = 0; p < n; p++)
            for (int i = 0; i < nb; i++)
                if (x[p] > thr[i]) { top[i] += x[p]; above[i]++; }
        for (int i = 0; i < nb; i++)
            if (B[i] < n) out[i] += (top[i] + (B[i] - above[i]) * thr[i]) / group;
    }
    for (int i = 0; i < nb; i++) out[i] = B[i] < n ? out[i] / G : 1;
}

/* After the shadow attended the chunk's first nt tokens at a layer: the top-B recall of each (token, policy budget),
 * which depends on nothing but the shadow's probabilities, the position and B, so the policies that share a budget
 * (a grid's window, sink, h2o ... at B) read one figure, computed here in parallel rather than in each policy's
 * hook, on the thread that runs the policy's steps. */
static void topk_layer(EvalCtx *e, int nt) {
    int H = e->m->config.n_heads;
    #pragma omp parallel for schedule(dynamic)
    for (int u = 0; u < nt; u++) {
        int pos = e->pos0 + u, tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        double *out = e->topk + (size_t)u * e->n_topk;
        if (pos < e->ctx)
            recall_topk(e, e->shadow_prob + (size_t)u * H * e->ctx, pos, e->topk_B, e->n_topk,
                        e->group_prob + (size_t)tid * 2 * e->ctx, out);
        else for (int i = 0; i < e->n_topk; i++) out[i] = 1;
    }
}

/* The top-B recall topk_layer computed for this token and c's budget */
static double topk_of(const EvalCtx *e, const KVCache *c, int pos) {
    int i = 0;
    while (e->topk_B[i] != c->policy.budget) i++;   /* every policy's budget is in the list */
    return e->topk[(size_t)(pos - e->pos0) * e->n_topk + i];
}

/* ---- merge-on-evict's coverage (eval.h, EvalCover) ---- */

int eval_cover_init(EvalCover *cv, int n_layers, int n_kv_heads, int ctx) {
    memset(cv, 0, sizeof *cv);
    cv->n_kv_heads = n_kv_heads;
    cv->n_lanes = n_layers * n_kv_heads;
    cv->ctx = ctx;
    cv->next = malloc((size_t)cv->n_lanes * ctx * sizeof(int32_t));
    cv->tail = malloc((size_t)cv->n_lanes * ctx * sizeof(int32_t));
    if (!cv->next || !cv->tail) { eval_cover_free(cv); return -1; }
    eval_cover_reset(cv);
    return 0;
}

void eval_cover_free(EvalCover *cv) {
    free(cv->next);
    free(cv->tail);
    memset(cv, 0, sizeof *cv);
}

void eval_cover_reset(EvalCover *cv) {
    for (size_t i = 0; i < (size_t)cv->n_lanes * cv->ctx; i++) {
        cv->next[i] = -1;
        cv->tail[i] = (int32_t)(i % (size_t)cv->ctx);
    }
}

void eval_cover_merge(EvalCover *cv, int lane, int v, int u) {
    if (lane < 0 || lane >= cv->n_lanes || v < 0 || u < 0 || v >= cv->ctx || u >= cv->ctx || u == v) return;
    int32_t *next = cv->next + (size_t)lane * cv->ctx, *tail = cv->tail + (size_t)lane * cv->ctx;
    next[tail[u]] = v;
    tail[u] = tail[v];
}

void eval_cover_event(void *ctx, const KVEvent *ev) {
    EvalCover *cv = ctx;
    if (ev->kind == KV_EV_MERGE && ev->into >= 0)
        eval_cover_merge(cv, ev->layer * cv->n_kv_heads + ev->kv_head, ev->pos, ev->into);
    if (cv->fn) cv->fn(cv->fn_ctx, ev);
}

void eval_cover_masses(const EvalCover *cv, int lane, const int *pos, int n, const float *p, size_t stride, int k,
                       double *out) {
    const int32_t *next = cv->next + (size_t)lane * cv->ctx;
    double r[EVAL_COVER_K] = {0};
    for (int i = 0; i < n; i++)
        for (int x = pos[i]; x >= 0 && x < cv->ctx; x = next[x])
            for (int j = 0; j < k; j++) r[j] += p[(size_t)j * stride + x];
    for (int j = 0; j < k; j++) out[j] = r[j];
}

/* After a policy's layer l attended at pos < ctx: attention-mass recall = the share of the shadow's probability, from
 * the query heads of each group (mean over them), that falls on the positions the lane holds now; and the top-B
 * recall beside it. */
static void recall_hook(void *ctx, int l, const KVCache *c, int pos) {
    HookCtx *hc = ctx;
    EvalCtx *e = hc->e;
    if (pos >= e->ctx) return;
    int H = c->shape.n_heads, G = c->shape.n_kv_heads, group = H / G;
    const float *sp = e->shadow_prob + (size_t)(pos - e->pos0) * H * e->ctx;
    double sum = 0;
    if (hc->r->cover.next || c->merges || c->policy.ops->select) {
        for (int g = 0; g < G; g++) {
            double r = 0;
            if (hc->r->cover.next) {   /* merge=1: every position each live slot covers (EvalCover) */
                int n = kv_lane_positions(c, l, g, e->spans, c->budget);
                for (int h0 = 0; h0 < group; h0 += EVAL_COVER_K) {   /* the group's heads in one walk of the lists */
                    int k = group - h0 < EVAL_COVER_K ? group - h0 : EVAL_COVER_K;
                    double m[EVAL_COVER_K];
                    eval_cover_masses(&hc->r->cover, l * G + g, e->spans, n, sp + (size_t)(g * group + h0) * e->ctx,
                                      (size_t)e->ctx, k, m);
                    for (int j = 0; j < k; j++) r += m[j];
                }
            } else {   /* what the query read, as position ranges (kv_lane_read) */
                int n = kv_lane_read(c, l, g, e->spans, c->budget);
                for (int hh = 0; hh < group; hh++) {
                    const float *ph = sp + (size_t)(g * group + hh) * e->ctx;
                    for (int j = 0; j < n; j++)
                        for (int p = e->spans[2 * j]; p <= e->spans[2 * j + 1]; p++) r += ph[p];
                }
            }
            hc->r->recall_lane[l * G + g] += r / group;
            sum += r / group;
        }
        hc->r->recall[l] += sum / G;
        hc->r->cur_recall[pos - e->pos0] += sum / G;
        hc->r->recall_topk[l] += topk_of(e, c, pos);
        if (l == 0) hc->r->recall_n++;
        return;
    }
    for (int g = 0; g < G; g++) {
        const KVLane *ln = &c->lanes[l * G + g];
        double r = 0;
        int n = ln->n_live, p0 = n ? ln->pos[ln->live[0]] : 0;
        /* positions increase along the list: a lane holding one unbroken range (full, window, any cache still
           filling) is summed straight from the row, with the same four sums as the general gather */
        int range = n && ln->pos[ln->live[n - 1]] - p0 == n - 1;
        for (int hh = 0; hh < group; hh++) {   /* four sums over the ranks (i mod 4), so the adds overlap */
            const float *ph = sp + (size_t)(g * group + hh) * e->ctx;
            double a[4] = {0, 0, 0, 0};
            int i = 0;
            if (range) {
                for (; i + 4 <= n; i += 4)
                    for (int x = 0; x < 4; x++) a[x] += ph[p0 + i + x];
                for (; i < n; i++) a[i % 4] += ph[p0 + i];
            } else {
                for (; i + 4 <= n; i += 4)
                    for (int x = 0; x < 4; x++) a[x] += ph[ln->pos[ln->live[i + x]]];
                for (; i < n; i++) a[i % 4] += ph[ln->pos[ln->live[i]]];
            }
            r += (a[0] + a[1]) + (a[2] + a[3]);
        }
        hc->r->recall_lane[l * G + g] += r / group;
        sum += r / group;
    }
    hc->r->recall[l] += sum / G;
    hc->r->cur_recall[pos - e->pos0] += sum / G;
    hc->r->recall_topk[l] += topk_of(e, c, pos);   /* 1 while pos < B: all the mass (full; a cache filling) */
    if (l == 0) hc->r->recall_n++;
}

/* e^x for x ≤ 0 in double, within about 2 ulp of the true value: x = k·ln2 + r with k = round(x·log2 e) (the
 * 1.5·2⁵² trick) and r reduced in two steps (Cody-Waite), |r| ≤ ln2/2; e^r by its Taylor series to r¹³ (remainder
 * below 1e-17 relative) in Horner's order; times 2ᵏ built in the exponent bits. Below −708 (near 2⁻¹⁰²²) it is 0;
 * NaN stays NaN. Four lanes with AVX2, one without, the same operations in the same order (mul then add, never fused).
 * The log-softmax sums below take 49,152 exponentials per token and policy: glibc's exp was 5% of a batched run. */
#define EXPD_LO (-708.0)
#define EXPD_MAGIC 6755399441055744.0   /* 1.5·2⁵²: adding it rounds to an integer, kept in the low mantissa bits */
#define EXPD_LN2_HI 6.93147180369123816490e-01
#define EXPD_LN2_LO 1.90821492927058770002e-10
static const double expd_taylor[14] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                       1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                       1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};   /* 1/13!, 1/12!, ..., 1/1!, 1/0! */
static inline double exp_neg_d(double x) {
    if (x != x) return x;
    if (x < EXPD_LO) return 0;
    double t = x * 1.44269504088896338700 + EXPD_MAGIC, k = t - EXPD_MAGIC;
    double r = (x - k * EXPD_LN2_HI) - k * EXPD_LN2_LO;
    double p = expd_taylor[0];
    for (int i = 1; i < 14; i++) p = p * r + expd_taylor[i];
    int64_t tb, mb, bits;
    double magic = EXPD_MAGIC, p2;
    memcpy(&tb, &t, 8);
    memcpy(&mb, &magic, 8);
    bits = (tb - mb + 1023) << 52;
    memcpy(&p2, &bits, 8);
    return p * p2;
}
#ifdef __AVX2__
static inline __m256d exp_neg_d4(__m256d x) {
    __m256d ok = _mm256_cmp_pd(x, _mm256_set1_pd(EXPD_LO), _CMP_NLT_UQ);   /* x ≥ −708, or NaN (stays NaN) */
    x = _mm256_max_pd(_mm256_set1_pd(EXPD_LO), x);                         /* maxpd returns x when x is NaN */
    __m256d magic = _mm256_set1_pd(EXPD_MAGIC);
    __m256d t = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.44269504088896338700)), magic);
    __m256d k = _mm256_sub_pd(t, magic);
    __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(k, _mm256_set1_pd(EXPD_LN2_HI))),
                              _mm256_mul_pd(k, _mm256_set1_pd(EXPD_LN2_LO)));
    __m256d p = _mm256_set1_pd(expd_taylor[0]);
    for (int i = 1; i < 14; i++) p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(expd_taylor[i]));
    __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(magic)),
                                                      _mm256_set1_epi64x(1023)), 52);
    return _mm256_and_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(bits)), ok);
}
#endif

/* log-softmax pieces of a logit vector: max and log Σ exp(x - max), in double; the sum in four partial sums
 * (i ≡ k mod 4 below 4·⌊n/4⌋), folded as (s0 + s1) + (s2 + s3), plus the tail, with or without AVX2. */
double eval_logsumexp(const float *x, int n) {
    float mx = scan_max(x, n);
    double s[4] = {0, 0, 0, 0}, tail = 0;
    int i = 0;
#ifdef __AVX2__
    __m256d acc = _mm256_setzero_pd(), m = _mm256_set1_pd(mx);
    for (; i + 4 <= n; i += 4)
        acc = _mm256_add_pd(acc, exp_neg_d4(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), m)));
    _mm256_storeu_pd(s, acc);
#else
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) s[k] += exp_neg_d((double)x[i + k] - mx);
#endif
    for (; i < n; i++) tail += exp_neg_d((double)x[i] - mx);
    return mx + log(((s[0] + s[1]) + (s[2] + s[3])) + tail);
}

/* KL(p ‖ q) for p = softmax(a), q = softmax(b), in nats; summed as eval_logsumexp sums. */
double eval_kl_div(const float *a, double lse_a, const float *b, double lse_b, int n) {
    double s[4] = {0, 0, 0, 0}, tail = 0;
    int i = 0;
#ifdef __AVX2__
    __m256d acc = _mm256_setzero_pd(), la4 = _mm256_set1_pd(lse_a), lb4 = _mm256_set1_pd(lse_b);
    for (; i + 4 <= n; i += 4) {
        __m256d la = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i)), la4);
        __m256d lb = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(b + i)), lb4);
        acc = _mm256_add_pd(acc, _mm256_mul_pd(exp_neg_d4(la), _mm256_sub_pd(la, lb)));
    }
    _mm256_storeu_pd(s, acc);
#else
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) {
            double la = a[i + k] - lse_a, lb = b[i + k] - lse_b;
            s[k] += exp_neg_d(la) * (la - lb);
        }
#endif
    for (; i < n; i++) {
        double la = a[i] - lse_a, lb = b[i] - lse_b;
        tail += exp_neg_d(la) * (la - lb);
    }
    double kl = ((s[0] + s[1]) + (s[2] + s[3])) + tail;
    return kl > 0 ? kl : 0;   /* rounding can leave -1e-17 for identical distributions */
}

EvalToken eval_token(const float *ref, double lse_ref, const float *x, double lse_x, int y, int n) {
    EvalToken t;
    double nll_ref = lse_ref - ref[y];
    t.nll = lse_x - x[y];
    t.kl = eval_kl_div(ref, lse_ref, x, lse_x, n);   /* the reference first: KL(p_ref ‖ q) */
    t.dnll = t.nll - nll_ref;
    t.dp = exp(-t.nll) - exp(-nll_ref);
    t.top1 = sample_argmax(x, n) == sample_argmax(ref, n);
    return t;
}

/* caps: (n_layers * n_kv_heads) slots of each lane (kv_cache_init_lanes: o->kv_caps, duo's lanes), or NULL. */
void policy_run_init(PolicyRun *r, const Model *m, const Options *o, const char *spec_text, int ctx, int shadow,
                            int chunk, const int *caps) {
    KVType kvt = o->kvt;
    const char *mode = o->mode;
    memset(r, 0, sizeof *r);
    char err[512];
    KVSpec spec;
    if (kv_spec_parse(&spec, spec_text, shadow ? KV_F32 : kvt, err, sizeof err) ||
        kv_spec_check_mode(&spec, mode, err, sizeof err))
        fatal("-kv: %s", err);
    KVShape shape = model_kv_shape(m, ctx);
    if (kv_cache_init_lanes(&r->cache, &shape, &spec, caps, err, sizeof err)) fatal("%s", err);
    if (state_init_chunk(&r->s, &m->config, chunk)) fatal("out of memory");
    if (!strcmp(o->device, "ref")) kv_set_backend(&r->cache, KV_BACKEND_REF);   /* -d ref: the whole job by definition */
    r->recall = calloc((size_t)m->config.n_layers, sizeof(double));
    r->recall_topk = calloc((size_t)m->config.n_layers, sizeof(double));
    r->recall_lane = calloc((size_t)m->config.n_layers * m->config.n_kv_heads, sizeof(double));
    r->cur_recall = calloc((size_t)chunk, sizeof(double));
    if (!r->recall || !r->recall_topk || !r->recall_lane || !r->cur_recall) fatal("out of memory");
    r->is_shadow = shadow;
}

void policy_specs_check(const Model *m, const Options *o, int ctx) {
    KVShape shape = model_kv_shape(m, ctx);
    for (int k = 0; k < o->n_kv; k++) {
        char err[512];
        KVSpec spec;
        KVCache c;
        if (kv_spec_parse(&spec, o->kv[k], o->kvt, err, sizeof err) || kv_spec_check_mode(&spec, o->mode, err, sizeof err))
            fatal("-kv: %s", err);
        if (kv_cache_init_lanes(&c, &shape, &spec, o->kv_caps[k], err, sizeof err)) fatal("%s", err);
        kv_cache_free(&c);
    }
}

void task_job_open(TaskJob *j, const Model *m, const Options *o, int ctx, const Sha256 *text, uint64_t seed) {
    policy_specs_check(m, o, ctx);
    OutFile none = OUTFILE_NONE;
    j->out = j->kvlog = none;
    if (o->out) outfile_open(&j->out, "-o", o->out, 1);
    if (o->kvlog) outfile_open(&j->kvlog, "-kvlog", o->kvlog, 0);
    provenance_init(&j->pv, m, o, text);
    j->pv.seed = seed;
    run_job_start();
}

void task_job_close(TaskJob *j) {
    line_free(&j->pv.cmdline);
    outfile_close(&j->out);
    outfile_close(&j->kvlog);
}

void policy_run_free(PolicyRun *r) {
    line_free(&r->kvlog.line);
    free(r->asked.ids);
    kv_cache_free(&r->cache);
    state_free(&r->s);
    free(r->recall);
    free(r->recall_topk);
    free(r->recall_lane);
    free(r->cur_recall);
    free(r->bucket);
    eval_cover_free(&r->cover);
}

/* Each lane's mean recall over the steps counted, lane order (l * n_kv_heads + g), comma-separated; %.17g, so a
 * reader gets the very doubles the lane choice ranks (eval_choose_lanes). */
static void json_recall_lanes(Line *l, const PolicyRun *r, int n_lanes) {
    for (int i = 0; i < n_lanes; i++)
        line_printf(l, "%s%.17g", i ? "," : "", r->recall_n ? r->recall_lane[i] / r->recall_n : 0);
}

/* The spectrum of a low-rank cache's calibration span (kv_lowrank_spectrum) at ranks 8, 16, 32, per layer: into the
 * -o record (ln) as "spectrum":{...}, or with ln NULL as a table on stderr (-v), with the resident bytes now beside the
 * peak (which holds the full-rank staging until the fit). Nothing for a full-rank cache. */
static const int SPECTRUM_RANKS[3] = {8, 16, 32};
static void lowrank_spectrum_report(const PolicyRun *r, Line *ln) {
    const KVCache *c = &r->cache;
    int L = c->shape.n_layers;
    if (!(c->krank || c->vrank)) return;
    double sh[9];
    static const char *const rows[3] = {"pre_rope_k", "post_rope_k", "v"};
    if (ln) {
        line_printf(ln, "\"spectrum\":{\"ranks\":[8,16,32],\"tokens\":%d", kv_lowrank_spectrum(c, 0, SPECTRUM_RANKS, 3, sh));
        for (int m = 0; m < 3; m++) {
            line_printf(ln, ",\"%s\":[", rows[m]);
            for (int l = 0; l < L; l++) {
                kv_lowrank_spectrum(c, l, SPECTRUM_RANKS, 3, sh);
                line_printf(ln, "%s[%.6f,%.6f,%.6f]", l ? "," : "", sh[m * 3], sh[m * 3 + 1], sh[m * 3 + 2]);
            }
            line_printf(ln, "]");
        }
        line_printf(ln, "},\"kv_alloc_bytes_end\":%zu,", kv_bytes(c).total_alloc);
        return;
    }
    KVBytes b = kv_bytes(c);
    fprintf(stderr, "\n%s: low rank (krank %d, vrank %d), resident now %.2f MiB (bases %.3f MiB, staging %.2f MiB), "
            "peak %.2f MiB\n  energy share of the top r eigenvalues over the calibration span of %d tokens, mean of "
            "the kv heads:\n  %5s  %-24s %-24s %-24s\n  %5s  %7s %7s %7s  %7s %7s %7s  %7s %7s %7s\n",
            c->spec.text, c->krank, c->vrank, b.total_alloc / 1048576.0, b.basis_bytes / 1048576.0,
            b.stage_bytes / 1048576.0, r->peak.total_alloc / 1048576.0, kv_lowrank_spectrum(c, 0, SPECTRUM_RANKS, 3, sh),
            "", "keys before RoPE", "keys after RoPE", "values", "layer", "r=8", "r=16", "r=32", "r=8", "r=16", "r=32",
            "r=8", "r=16", "r=32");
    double mean[9] = {0};
    for (int l = 0; l < L; l++) {
        kv_lowrank_spectrum(c, l, SPECTRUM_RANKS, 3, sh);
        fprintf(stderr, "  %5d ", l);
        for (int e = 0; e < 9; e++) { fprintf(stderr, " %7.4f%s", sh[e], e % 3 == 2 ? " " : ""); mean[e] += sh[e] / L; }
        fprintf(stderr, "\n");
    }
    fprintf(stderr, "  %5s ", "mean");
    for (int e = 0; e < 9; e++) fprintf(stderr, " %7.4f%s", mean[e], e % 3 == 2 ? " " : "");
    fprintf(stderr, "\n");
}

void note_bytes(PolicyRun *r) {
    KVBytes b = kv_bytes(&r->cache);
    if (b.total_alloc > r->peak.total_alloc) r->peak.total_alloc = b.total_alloc;
    if (b.peak_live > r->peak.peak_live) r->peak.peak_live = b.peak_live;
    r->peak.formula_alloc = b.formula_alloc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * -m ppl
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int *ids; size_t n; } Doc;

static Doc tokenize_doc(const Model *m, const char *path, Sha256 *text_sha) {
    size_t len;
    char *text = read_file(path, &len), err[256];
    sha_update(text_sha, text, len);
    Doc d = {0};
    if (!m->has_tokenizer) {   /* an ids-only model reads token ids, as detokenize does */
        if (strlen(text) != len || ids_parse(text, m->config.vocab_size, &d.ids, &d.n, err, sizeof err))
            fatal("'%s': an ids-only model reads whitespace-separated token ids: %s", path,
                  strlen(text) != len ? "the file holds a NUL byte" : err);
        free(text);
        return d;
    }
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, len, m->tokenizer.add_bos, &d.ids, &d.n, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    free(text);
    return d;
}

/* The seconds left when `done` of `total` tokens took `elapsed`, assuming each token costs a + b·(its index) (a
 * stream through caches that grow with it: attention reads more keys the later the token), so that d tokens take
 * E(d) = a·d + b·d². a and b come from now and from the earliest of the job's earlier progress points at or past
 * half of done (`hist`, n of them); b < 0 (the work per token fell: a cache stopped at -c) counts as 0, which is the
 * plain rate. */
static double eta_growing(const double (*hist)[2], int n, long done, long total, double elapsed) {
    double d = (double)done, lin = elapsed / d, b = 0;
    for (int i = 0; i < n; i++)
        if (hist[i][0] >= d / 2 && hist[i][0] < d) {
            b = (lin - hist[i][1] / hist[i][0]) / (d - hist[i][0]);
            break;
        }
    if (!(b > 0)) b = 0;
    double a = lin - b * d, T = (double)total;
    return a * (T - d) + b * (T * T - d * d);
}

/* One progress line on stderr ("\r"-ended on a terminal until the end). */
static void progress_line(const char *what, long done, long total, double rate, double eta) {
    fprintf(stderr, "%s %ld/%ld tokens, %.1f tok/s, ETA %dm%02ds%s", what, done, total, rate, (int)eta / 60,
            (int)eta % 60, isatty(2) && done < total ? "\r" : "\n");
}

void progress_growing(double t_start, long done, long total, const char *what) {
    static double last = 0, job = -1, hist[256][2];
    static int n = 0;
    double now = now_s(), elapsed = now - t_start + 1e-9;
    if (t_start != job) { job = t_start; n = 0; }
    double eta = done > 0 ? eta_growing((const double (*)[2])hist, n, done, total, elapsed) : 0;
    if (done > 0) {   /* every call is a point; a full history keeps every other one */
        if (n == 256) for (n = 0; n < 128; n++) { hist[n][0] = hist[2 * n][0]; hist[n][1] = hist[2 * n][1]; }
        hist[n][0] = (double)done;
        hist[n][1] = elapsed;
        n++;
    }
    if (done < total && now - last < 5.0) return;
    last = now;
    progress_line(what, done, total, done / elapsed, eta);
}

void progress(double t_start, long done, long total, const char *what) {
    static double last = 0;
    double now = now_s();
    if (done < total && now - last < 5.0) return;
    last = now;
    double rate = done / (now - t_start + 1e-9);
    progress_line(what, done, total, rate, rate > 0 ? (total - done) / rate : 0);
}

/* Streaming perplexity: each document through every policy and the shadow, a chunk of `chunk` tokens at a time,
 * all runs in lockstep layer by layer (forward_layer), so the shadow's attention at (token, layer) is at hand when
 * a policy's recall at that (token, layer) is measured. chunk = 1 is token-by-token decode; any chunk gives the
 * same bits (tests/test_eval.sh). At most max_tokens tokens are scored (0: all); SIGINT/SIGTERM stops it after the
 * current chunk; `what` labels the progress lines. Returns the tokens scored. */
static long ppl_stream(const Model *m, Doc *docs, int n_docs, PolicyRun *runs, int n_runs, EvalCtx *e,
                       OutFile *tokenlog, int chunk, long max_tokens, const char *what) {
    int V = m->config.vocab_size, ctx = e->ctx;
    long total = 0, done = 0;
    for (int d = 0; d < n_docs; d++) total += (long)docs[d].n - 1;
    if (max_tokens && max_tokens < total) total = max_tokens;
    Line tl = {0};
    double t_start = now_s();
    HookCtx hooks[n_runs];
    int nt_run[n_runs];
    struct { double lse; EvalToken tok; } *sc = calloc((size_t)chunk * n_runs, sizeof *sc);   /* (chunk, n_runs) */
    if (!sc) fatal("out of memory");
    for (int k = 0; k < n_runs; k++) {
        hooks[k] = (HookCtx){e, &runs[k]};
        runs[k].s.after_attn = runs[k].is_shadow ? shadow_hook : recall_hook;
        runs[k].s.hook_ctx = &hooks[k];
        KVCache *c = &runs[k].cache;
        if (c->merge_evict && !runs[k].cover.next) {   /* follow its merges, -kvlog's writer (if any) after */
            if (eval_cover_init(&runs[k].cover, c->shape.n_layers, c->shape.n_kv_heads, ctx))
                fatal("out of memory for the merge coverage of '%s' (%d tokens)", c->spec.text, ctx);
            runs[k].cover.fn = c->on_event;
            runs[k].cover.fn_ctx = c->event_ctx;
            c->on_event = eval_cover_event;
            c->event_ctx = &runs[k].cover;
        }
    }
    for (int d = 0; d < n_docs && done < total && !run_signal; d++) {
        /* every cache, score and position restarts with each document */
        for (int k = 0; k < n_runs; k++) {
            kv_cache_reset(&runs[k].cache);
            if (runs[k].cover.next) eval_cover_reset(&runs[k].cover);
            runs[k].alive = 1;
            runs[k].view = (IdList){docs[d].ids, docs[d].n, docs[d].n};
            runs[k].kvlog.doc = d;
        }
        const int *tok = docs[d].ids;
        long n_feed = (long)docs[d].n - 1;   /* the last token is only predicted */
        if (n_feed > total - done) n_feed = total - done;
        for (long t0 = 0; t0 < n_feed && !run_signal; t0 += chunk) {
            int nt = n_feed - t0 < chunk ? (int)(n_feed - t0) : chunk;
            e->pos0 = (int)t0;
            for (int k = 0; k < n_runs; k++) memset(runs[k].cur_recall, 0, (size_t)nt * sizeof(double));
            /* how many of this chunk's tokens each run takes: the shadow and non-evicting caches stop at -c */
            for (int k = 0; k < n_runs; k++) {
                PolicyRun *r = &runs[k];
                int cap = r->is_shadow ? ctx : kv_capacity(&r->cache);   /* full and snapkv stop when full */
                nt_run[k] = !r->alive ? 0 : (cap - t0 < nt ? (int)(cap - t0 > 0 ? cap - t0 : 0) : nt);
                if (nt_run[k] == 0) { r->alive = 0; continue; }
                double a = now_s();
                forward_begin((Model *)m, &r->s, tok + t0, nt_run[k], (int)t0);
                r->seconds += now_s() - a;
            }
            for (int l = 0; l < m->config.n_layers; l++)
                for (int k = 0; k < n_runs; k++) {
                    if (!nt_run[k]) continue;
                    double a = now_s();
                    if (forward_layer((Model *)m, &runs[k].s, &runs[k].cache, l))
                        fatal("'%s' could not store position %ld", runs[k].cache.spec.text, t0);
                    /* evaluation work, counted in the shadow's seconds rather than in any policy's */
                    if (runs[k].is_shadow) topk_layer(e, nt_run[k]);
                    runs[k].seconds += now_s() - a;
                }
            for (int k = 0; k < n_runs; k++)
                if (nt_run[k]) {
                    double a = now_s();
                    forward_end((Model *)m, &runs[k].s);
                    runs[k].seconds += now_s() - a;
                    note_bytes(&runs[k]);
                }
            /* each (token, run) of the chunk scored on its own, in parallel: log-sum-exp, then (inside the span) the
               figures against the shadow; the sums below stay in token order, so the totals do not depend on the
               threads */
            #pragma omp parallel for schedule(static)
            for (int x = 0; x < nt * n_runs; x++) {
                int j = x / n_runs, k = x % n_runs;
                if (j >= nt_run[k]) continue;
                sc[x].lse = eval_logsumexp(runs[k].s.logits + (size_t)j * V, V);
            }
            #pragma omp parallel for schedule(static)
            for (int x = 0; x < nt * n_runs; x++) {
                int j = x / n_runs, k = x % n_runs;
                if (k == 0 || j >= nt_run[k] || t0 + j >= ctx) continue;
                sc[x].tok = eval_token(runs[0].s.logits + (size_t)j * V, sc[j * n_runs].lse,
                                       runs[k].s.logits + (size_t)j * V, sc[x].lse, tok[t0 + j + 1], V);
            }
            for (int j = 0; j < nt; j++, done++) {
                long t = t0 + j;
                int next = tok[t + 1], in_span = t < ctx;
                double shadow_nll = 0;
                int L = m->config.n_layers;
                for (int k = 0; k < n_runs; k++) {
                    PolicyRun *r = &runs[k];
                    r->cur_nll = NAN;
                    if (j >= nt_run[k]) continue;
                    const float *lg = r->s.logits + (size_t)j * V;
                    double lse = sc[j * n_runs + k].lse, nll = lse - lg[next];
                    r->cur_nll = nll;
                    r->all.nll += nll; r->all.n++;
                    if (r->bucket) {   /* runs scored token by token in order: the sums need no care for threads */
                        Nll *b = &r->bucket[t / r->bucket_w];
                        b->nll += nll; b->n++;
                    }
                    if (r->is_shadow) { shadow_nll = nll; continue; }
                    if (in_span) {
                        const EvalToken *et = &sc[j * n_runs + k].tok;
                        r->span.nll += nll; r->span.n++;
                        r->cur = *et;
                        r->kl += et->kl;
                        r->top1 += et->top1;
                        r->dp += et->dp;
                        r->dnll += et->dnll;
                    }
                }
                if (in_span) { runs[0].span.nll += shadow_nll; runs[0].span.n++; }
                if (tokenlog->fd >= 0) {
                    line_printf(&tl, "{\"doc\":%d,\"pos\":%ld,\"token\":%d,\"next\":%d,\"policies\":[", d, t, tok[t], next);
                    for (int k = 0; k < n_runs; k++) {
                        PolicyRun *r = &runs[k];
                        line_printf(&tl, "%s{\"kv\":\"", k ? "," : "");
                        line_json_str(&tl, r->is_shadow ? "shadow" : r->cache.spec.text);
                        if (isnan(r->cur_nll)) line_printf(&tl, "\",\"nll\":null}");
                        else if (r->is_shadow || !in_span) line_printf(&tl, "\",\"nll\":%.9g}", r->cur_nll);
                        else {   /* the per-token terms of the span means of -o: kl, top1, recall (mean over layers;
                                    null when not finite, which JSON has no number for) */
                            double rc = r->cur_recall[j] / L;
                            line_printf(&tl, "\",\"nll\":%.9g,\"kl\":%.9g,\"top1\":%d,\"recall\":", r->cur_nll,
                                        r->cur.kl, r->cur.top1);
                            if (isfinite(rc)) line_printf(&tl, "%.9g}", rc);
                            else line_printf(&tl, "null}");
                        }
                    }
                    line_printf(&tl, "]}\n");
                    outfile_line(tokenlog, &tl);
                }
            }
            progress_growing(t_start, done, total, what);
        }
    }
    free(sc);
    line_free(&tl);
    return done;
}

/* llama-perplexity's method (examples/perplexity, commit c392e50): the stream is cut into n_ctx-token chunks
 * (a trailing partial chunk is dropped), BOS replaces each chunk's first token when the model adds BOS, the cache is
 * cleared per chunk, and only the second half is scored: logits at positions n_ctx/2 .. n_ctx-2. Returns 1 when
 * SIGINT/SIGTERM stopped it between chunks. */
static int ppl_chunked(const Model *m, Doc *docs, int n_docs, PolicyRun *runs, int n_runs, int n_ctx, int chunk) {
    int V = m->config.vocab_size, first = n_ctx / 2;
    int *in = malloc((size_t)n_ctx * sizeof(int));
    if (!in) fatal("out of memory");
    for (int d = 0; d < n_docs; d++) {
        size_t n_chunks = docs[d].n / (size_t)n_ctx;
        if (n_chunks < 2)
            fatal("-ppl-mode chunked needs at least 2*%d tokens (as llama-perplexity); document %d has %zu", n_ctx,
                  d + 1, docs[d].n);
        for (size_t ch = 0; ch < n_chunks; ch++) {
            if (run_signal) { free(in); return 1; }
            const int *tok = docs[d].ids + ch * n_ctx;
            memcpy(in, tok, (size_t)n_ctx * sizeof(int));
            if (m->has_tokenizer && m->tokenizer.add_bos) in[0] = m->tokenizer.bos_id;
            for (int k = 0; k < n_runs; k++) {
                PolicyRun *r = &runs[k];
                kv_cache_reset(&r->cache);
                r->view = (IdList){in, (size_t)n_ctx, (size_t)n_ctx};
                r->kvlog.doc = d;
                for (int j0 = 0; j0 < n_ctx - 1; j0 += chunk) {
                    int nt = n_ctx - 1 - j0 < chunk ? n_ctx - 1 - j0 : chunk;
                    if (forward_chunk((Model *)m, &r->s, &r->cache, in + j0, nt, j0))
                        fatal("'%s' filled up inside a chunk", r->cache.spec.text);
                    for (int j = j0 > first ? j0 : first; j < j0 + nt; j++) {
                        const float *lg = r->s.logits + (size_t)(j - j0) * V;
                        double nll = eval_logsumexp(lg, V) - lg[tok[j + 1]];
                        r->all.nll += nll; r->all.n++;
                        r->span.nll += nll; r->span.n++;
                    }
                }
                note_bytes(r);
            }
            fprintf(stderr, "[%zu] ppl %.4f\n", ch + 1, exp(runs[0].all.nll / runs[0].all.n));
        }
    }
    free(in);
    return 0;
}

/* -o's decay curve of one run: bucket_tokens W, then per bucket b (the tokens predicted from positions
 * [b*W, (b+1)*W) of their document, summed over documents) the count, the mean NLL (nats) and its perplexity; a
 * bucket the run scored nothing in (full after -c) is null. */
static void json_buckets(Line *ln, const PolicyRun *r, int n_out) {
    line_printf(ln, "\"bucket_tokens\":%d,\"bucket_n\":[", r->bucket_w);
    for (int b = 0; b < n_out; b++) line_printf(ln, "%s%ld", b ? "," : "", r->bucket[b].n);
    line_printf(ln, "],\"bucket_nll\":[");
    for (int b = 0; b < n_out; b++)
        if (r->bucket[b].n) line_printf(ln, "%s%.9g", b ? "," : "", r->bucket[b].nll / r->bucket[b].n);
        else line_printf(ln, "%snull", b ? "," : "");
    line_printf(ln, "],\"bucket_ppl\":[");
    for (int b = 0; b < n_out; b++)
        if (r->bucket[b].n) line_printf(ln, "%s%.9g", b ? "," : "", exp(r->bucket[b].nll / r->bucket[b].n));
        else line_printf(ln, "%snull", b ? "," : "");
    line_printf(ln, "],");
}

/* -bucket given: the decay curve on stderr, a row per bucket of position, a column per run ("-": nothing scored). */
static void bucket_table(FILE *f, const PolicyRun *runs, int n_runs, int n_out) {
    fprintf(f, "\nperplexity by position (%d-token buckets of each document):\n%-16s", runs[0].bucket_w, "positions");
    for (int k = 0; k < n_runs; k++) {
        const char *name = runs[k].is_shadow ? "shadow" : runs[k].cache.spec.text;
        fprintf(f, " %14.14s", name);
    }
    fputc('\n', f);
    for (int b = 0; b < n_out; b++) {
        char range[48];
        snprintf(range, sizeof range, "%ld-%ld", (long)b * runs[0].bucket_w, (long)(b + 1) * runs[0].bucket_w - 1);
        fprintf(f, "%-16s", range);
        for (int k = 0; k < n_runs; k++)
            if (runs[k].bucket[b].n) fprintf(f, " %14.4f", exp(runs[k].bucket[b].nll / runs[k].bucket[b].n));
            else fprintf(f, " %14s", "-");
        fputc('\n', f);
    }
}

int run_ppl(Model *m, const Options *o) {
    if (o->n_files == 0) fatal("-m ppl needs text: -f FILE (repeatable, one document each)");
    int chunked = !strcmp(o->ppl_mode, "chunked");
    if (chunked && o->steps_set) fatal("-n is for -ppl-mode stream (chunked mode scores whole chunks)");
    if (chunked && o->ctx && o->ctx < 4)   /* it scores positions n_ctx/2 .. n_ctx-2 of each chunk */
        fatal("-ppl-mode chunked -c %d scores no token: use -c 4 or more", o->ctx);
    long max_tokens = o->steps_set ? o->steps : 0;
    if (o->steps_set && max_tokens == 0) fatal("-m ppl -n 0 scores nothing: give the tokens to score, or no -n for all");
    int ctx = run_context(m, o);
    Sha256 text_sha;
    sha_init(&text_sha);
    Doc docs[MAX_FILES];
    long n_tokens = 0;
    for (int d = 0; d < o->n_files; d++) {
        docs[d] = tokenize_doc(m, o->files[d], &text_sha);
        if (docs[d].n < 2)
            fatal("'%s' has %zu token%s: perplexity needs at least 2 (one to read, one to score)", o->files[d],
                  docs[d].n, docs[d].n == 1 ? "" : "s");
        n_tokens += (long)docs[d].n;
    }
    int chunk = o->chunk ? o->chunk : 1;
    /* runs[0] is the shadow (stream mode), then each -kv policy in order */
    int n_pol = o->n_kv ? o->n_kv : 1, n_runs = n_pol + !chunked;
    PolicyRun *runs = calloc((size_t)n_runs, sizeof *runs);
    if (!runs) fatal("out of memory");
    if (!chunked) policy_run_init(&runs[0], m, o, "full", ctx, 1, chunk, NULL);
    for (int k = 0; k < n_pol; k++)
        policy_run_init(&runs[k + !chunked], m, o, o->n_kv ? o->kv[k] : "full", ctx, 0, chunk,
                        o->n_kv ? o->kv_caps[k] : NULL);
    /* the runs go layer by layer in lockstep: one policy that is not layer-local makes the stream token by token
       (the chunk-sized buffers stay; only their first row is used) */
    if (!chunked && chunk > 1)
        for (int k = 0; k < n_runs; k++)
            if (!kv_layer_local(&runs[k].cache)) {
                run_note("ppl: '%s' is not layer-local: -chunk %d falls back to token by token",
                         runs[k].cache.spec.text, chunk);
                chunk = 1;
                break;
            }
    /* the decay curve: NLL per bucket of position, over the longest document */
    int bucket_w = o->bucket ? o->bucket : 1024;
    size_t longest = 0;
    for (int d = 0; d < o->n_files; d++) longest = docs[d].n > longest ? docs[d].n : longest;
    if (!chunked)
        for (int k = 0; k < n_runs; k++) {
            runs[k].bucket_w = bucket_w;
            runs[k].n_bucket = (int)((longest - 1 + bucket_w - 1) / bucket_w);
            runs[k].bucket = calloc((size_t)runs[k].n_bucket, sizeof *runs[k].bucket);
            if (!runs[k].bucket) fatal("out of memory");
        }
    EvalCtx e = {.m = m, .ctx = ctx};
    if (!chunked) eval_ctx_init(&e, m, runs, n_runs, ctx, chunk);
    OutFile tokenlog = OUTFILE_NONE, out = OUTFILE_NONE, kvlog = OUTFILE_NONE;
    if (o->tokenlog) outfile_open(&tokenlog, "-tokenlog", o->tokenlog, 0);
    if (o->out) outfile_open(&out, "-o", o->out, 1);
    if (o->kvlog) {
        outfile_open(&kvlog, "-kvlog", o->kvlog, 0);
        for (int k = 0; k < n_runs; k++)
            if (!runs[k].is_shadow) kvlog_attach(&runs[k].kvlog, &kvlog, m, &runs[k].view, &runs[k].cache);
    }
    run_job_start();
    fprintf(stderr, "ppl: %d document%s, %ld tokens, -c %d, mode %s, %d polic%s\n", o->n_files, o->n_files > 1 ? "s" : "",
            n_tokens, ctx, o->ppl_mode, n_pol, n_pol > 1 ? "ies" : "y");
    double t0 = now_s();
    long total = n_tokens - o->n_files, done = total;
    if (max_tokens && max_tokens < total) total = max_tokens;
    int partial;
    if (chunked) partial = ppl_chunked(m, docs, o->n_files, runs, n_runs, ctx, chunk);
    else {
        done = ppl_stream(m, docs, o->n_files, runs, n_runs, &e, &tokenlog, chunk, max_tokens, "ppl:");
        partial = done < total;
    }
    double secs = now_s() - t0;

    Provenance pv;
    provenance_init(&pv, m, o, &text_sha);
    fprintf(stderr, "\n%-34s %8s %9s %9s %9s %7s %9s %9s %7s %10s %10s\n", "policy (span: positions < -c)", "tokens",
            "ppl", "ΔNLL", "KL", "top1", "Δp", "ppl(all)", "recall", "KV MiB", "read MiB");
    Line ln = {0};
    int n_bucket_out = 0;   /* the buckets up to the last one any run scored a token in */
    for (int k = 0; k < n_runs && !chunked; k++)
        for (int b = 0; b < runs[k].n_bucket; b++)
            if (runs[k].bucket[b].n && b + 1 > n_bucket_out) n_bucket_out = b + 1;
    for (int k = 0; k < n_runs; k++) {
        PolicyRun *r = &runs[k];
        double n = r->span.n ? (double)r->span.n : 1;
        double rec = 0;
        int L = m->config.n_layers;
        for (int l = 0; l < L; l++) rec += r->recall_n ? r->recall[l] / r->recall_n : 0;
        rec /= L;
        const char *name = r->is_shadow ? "shadow (full, f32)" : r->cache.spec.text;
        /* the second axis: KV bytes attention read per token, over every token this cache ran */
        double read = r->cache.steps_read ? (double)r->cache.bytes_read / r->cache.steps_read : 0;
        if (r->is_shadow || chunked)
            fprintf(stderr, "%-34s %8ld %9.4f %9s %9s %7s %9s %9.4f %7s %10.2f %10.3f\n", name, r->span.n,
                    exp(r->span.nll / n), "-", "-", "-", "-", exp(r->all.nll / (r->all.n ? r->all.n : 1)), "-",
                    r->peak.total_alloc / 1048576.0, read / 1048576.0);
        else
            fprintf(stderr, "%-34s %8ld %9.4f %9.5f %9.5f %7.4f %9.5f %9.4f %7.4f %10.2f %10.3f\n", name, r->span.n,
                    exp(r->span.nll / n), r->dnll / n, r->kl / n, r->top1 / n, r->dp / n,
                    exp(r->all.nll / (r->all.n ? r->all.n : 1)), rec, r->peak.total_alloc / 1048576.0, read / 1048576.0);
        if (out.fd < 0) continue;
        line_printf(&ln, "{\"mode\":\"ppl\",\"ppl_mode\":\"%s\",\"kv\":\"", o->ppl_mode);
        line_json_str(&ln, r->is_shadow ? "shadow" : r->cache.spec.text);
        line_printf(&ln, "\",\"budget\":%d,\"ctx\":%d,\"documents\":%d,\"partial\":%s,\"scored_tokens\":%ld,"
                    "\"span_tokens\":%ld,\"span_nll\":%.9g,\"span_ppl\":%.9g,\"all_tokens\":%ld,\"all_nll\":%.9g,"
                    "\"all_ppl\":%.9g,", r->cache.policy.budget, ctx, o->n_files, partial ? "true" : "false", done,
                    r->span.n, r->span.nll / n, exp(r->span.nll / n), r->all.n, r->all.n ? r->all.nll / r->all.n : 0,
                    r->all.n ? exp(r->all.nll / r->all.n) : 0);
        if (!r->is_shadow && !chunked) {
            line_printf(&ln, "\"kl\":%.9g,\"top1\":%.9g,\"dp\":%.9g,\"dnll\":%.9g,\"recall\":%.9g,\"recall_topk\":%.9g,"
                        "\"recall_per_layer\":[", r->kl / n, r->top1 / n, r->dp / n, r->dnll / n, rec,
                        recall_topk_mean(r, L));
            for (int l = 0; l < L; l++)
                line_printf(&ln, "%s%.6g", l ? "," : "", r->recall_n ? r->recall[l] / r->recall_n : 0);
            line_printf(&ln, "],\"recall_per_lane\":[");
            json_recall_lanes(&ln, r, L * m->config.n_kv_heads);
            line_printf(&ln, "],");
        }
        if (!chunked) json_buckets(&ln, r, n_bucket_out);
        if (r->cache.tiers) {
            double cs = r->cache.steps_read ? r->seconds / r->cache.steps_read : 0;
            KVTierFigures x = tier_figures(&r->cache, NULL, r->cache.steps_read, cs, o->link_gbs);
            tier_json(&ln, &r->cache, &x, cs, o->link_gbs);
        }
        lowrank_spectrum_report(r, &ln);
        line_printf(&ln, "\"keys_scanned_per_query\":%.4f,\"slots_read_per_query\":%.4f,",
                    per_query(&r->cache, r->cache.keys_scanned), per_query(&r->cache, r->cache.slots_read));
        line_printf(&ln, "\"kv_alloc_bytes\":%zu,\"kv_peak_live_bytes\":%zu,\"kv_formula_bytes\":%zu,"
                    "\"kv_read_bytes_per_token\":%.1f,\"kv_moved_bytes_per_token\":%.1f,\"seconds\":%.3f,"
                    "\"wall_seconds\":%.3f,", r->peak.total_alloc, r->peak.peak_live, r->peak.formula_alloc, read,
                    r->cache.steps_read ? (double)r->cache.bytes_moved / r->cache.steps_read : 0,
                    chunked ? secs / n_runs : r->seconds, secs);
        json_provenance_end(&ln, &pv);
        outfile_line(&out, &ln);
    }
    if (o->bucket_set && !chunked) bucket_table(stderr, runs, n_runs, n_bucket_out);
    int any_select = 0;
    for (int k = 0; k < n_runs; k++) any_select |= runs[k].cache.policy.ops->select != NULL;
    if (any_select && !chunked) {
        fprintf(stderr, "\nreads per query (per lane and token; recall beside the recall of the exact top-B positions "
                "of the shadow's attention, B the budget):\n");
        for (int k = 1; k < n_runs; k++) {
            PolicyRun *r = &runs[k];
            int L = m->config.n_layers;
            double rec = 0;
            for (int l = 0; l < L; l++) rec += r->recall_n ? r->recall[l] / r->recall_n : 0;
            fprintf(stderr, "  %-34s keys scanned %9.1f, slots read %9.1f, recall %.4f of top-%d's %.4f\n",
                    r->cache.spec.text, per_query(&r->cache, r->cache.keys_scanned),
                    per_query(&r->cache, r->cache.slots_read), rec / L, r->cache.policy.budget,
                    recall_topk_mean(r, L));
        }
    }
    for (int k = 0; k < n_runs; k++)
        if (runs[k].cache.tiers) {
            if (k == 1 || !runs[k - 1].cache.tiers)
                fprintf(stderr, "\nmemory tiers (modelled; the slow tier's link at %g GB/s, -link):\n", o->link_gbs);
            const KVCache *c = &runs[k].cache;
            double cs = c->steps_read ? runs[k].seconds / c->steps_read : 0;
            KVTierFigures x = tier_figures(c, NULL, c->steps_read, cs, o->link_gbs);
            tier_print(stderr, c, &x, cs);
        }
    if (o->verbose)
        for (int k = 0; k < n_runs; k++) lowrank_spectrum_report(&runs[k], NULL);
    for (int k = 0; k < n_runs; k++)   /* a low-rank cache whose basis never came: its bytes are full rank's */
        if (runs[k].cache.stage)
            fprintf(stderr, "ppl: note: '%s': the low-rank basis was never fitted (calib is %d tokens, the run "
                    "fed %ld), so every vector stayed at full rank in the staging rows and its bytes above count "
                    "them: give calib= below the tokens fed\n", runs[k].cache.spec.text, runs[k].cache.calib, done);
    fprintf(stderr, "ppl: %.1f s, %.1f tok/s per policy run, peak RSS %.1f MiB\n", secs,
            secs > 0 ? (double)done * n_runs / secs : 0, peak_rss_kib() / 1024.0);
    if (partial && chunked)
        fprintf(stderr, "ppl: stopped by %s: the figures above cover the chunks scored%s\n", run_signal_name(run_signal),
                out.fd >= 0 ? "; -o records say \"partial\":true" : "");
    else if (partial)
        fprintf(stderr, "ppl: stopped by %s after %ld of %ld tokens: the figures above cover those %ld (-n %ld "
                "reproduces them)%s\n", run_signal_name(run_signal), done, total, done, done,
                out.fd >= 0 ? "; -o records say \"partial\":true" : "");
    line_free(&ln);
    line_free(&pv.cmdline);
    outfile_close(&tokenlog);
    outfile_close(&out);
    outfile_close(&kvlog);
    for (int k = 0; k < n_runs; k++) policy_run_free(&runs[k]);
    free(runs);
    eval_ctx_free(&e);
    for (int d = 0; d < o->n_files; d++) free(docs[d].ids);
    return run_signal ? 128 + run_signal : 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * -calib FILE: allocation by calibration (DuoAttention's retrieval and streaming lanes, policies.c duo). Before the
 * job, the spec's streaming form (its cache made with every lane at the budget: sink:B with the same sinks) runs the
 * calibration text beside the shadow, exactly as -m ppl -f FILE -n (-c) would (ppl_stream, the same recall), and
 * each lane's mean recall ranks it: the lanes where the streaming form loses the most of the shadow's attention are
 * the ones that need every token.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { double recall; int lane; } LaneRecall;

static int lane_recall_cmp(const void *a, const void *b) {
    const LaneRecall *x = a, *y = b;
    if (x->recall != y->recall) return x->recall < y->recall ? -1 : 1;   /* lowest recall first ... */
    return x->lane - y->lane;                                             /* ... and among equals the lower lane */
}

int eval_choose_lanes(int *chosen, const double *recall, int n_lanes, double share) {
    if (n_lanes < 1 || !(share >= 0 && share <= 1)) return -1;
    for (int i = 0; i < n_lanes; i++) if (!isfinite(recall[i])) return -1;
    LaneRecall *order = malloc((size_t)n_lanes * sizeof *order);
    if (!order) return -1;
    for (int i = 0; i < n_lanes; i++) order[i] = (LaneRecall){recall[i], i};
    qsort(order, (size_t)n_lanes, sizeof *order, lane_recall_cmp);
    int n = (int)round(share * n_lanes);
    for (int i = 0; i < n_lanes; i++) chosen[i] = 0;
    for (int i = 0; i < n; i++) chosen[order[i].lane] = 1;
    free(order);
    return n;
}

int *eval_calib(Model *m, const Options *o, int k) {
    KVSpec spec;
    char err[512];
    if (!strcmp(o->kv[k], "adapt") || !strncmp(o->kv[k], "adapt:", 6)) return NULL;   /* serve's chains: no calibration */
    if (kv_spec_parse(&spec, o->kv[k], o->kvt, err, sizeof err)) fatal("-kv: %s", err);
    const KVPolicyOps *ops = kv_policy_find(spec.name);
    if (!ops->calib_full) return NULL;
    int ctx = run_context(m, o), chunk = PREFILL_CHUNK;   /* any chunk gives the same bits: the fastest */
    int L = m->config.n_layers, G = m->config.n_kv_heads, n_lanes = L * G;
    Sha256 sha;
    sha_init(&sha);
    Doc d = tokenize_doc(m, o->calib, &sha);
    if (d.n < 2)
        fatal("-calib '%s' has %zu token%s: calibration measures the attention of every position but the last (as "
              "ppl), so it needs at least 2", o->calib, d.n, d.n == 1 ? "" : "s");
    /* runs[0] the shadow, runs[1] the spec with every lane at its budget: its streaming form */
    PolicyRun runs[2];
    policy_run_init(&runs[0], m, o, "full", ctx, 1, chunk, NULL);
    policy_run_init(&runs[1], m, o, o->kv[k], ctx, 0, chunk, NULL);
    PolicyRun *r = &runs[1];
    EvalCtx e;
    eval_ctx_init(&e, m, runs, 2, ctx, chunk);
    OutFile none = OUTFILE_NONE;
    char desc[512];
    kv_describe(&r->cache, desc, sizeof desc);
    run_job_start();
    fprintf(stderr, "calib: '%s' chooses its full lanes on '%s' (%zu tokens, the first %ld read, -c %d): each lane's "
            "recall in its streaming form (%s) against the shadow\n", spec.text, o->calib, d.n,
            d.n - 1 < (size_t)ctx ? (long)d.n - 1 : (long)ctx, ctx, desc);
    long done = ppl_stream(m, &d, 1, runs, 2, &e, &none, chunk, ctx, "calib:");
    int *caps = NULL;
    if (!run_signal) {
        double *recall = calloc((size_t)n_lanes, sizeof(double));
        int *full = malloc((size_t)n_lanes * sizeof(int));
        caps = malloc((size_t)n_lanes * sizeof(int));
        if (!recall || !full || !caps) fatal("out of memory");
        for (int i = 0; i < n_lanes; i++) recall[i] = r->recall_n ? r->recall_lane[i] / r->recall_n : 0;
        double share = ops->calib_full(&r->cache.policy), sum_full = 0, sum_rest = 0;
        int n_full = eval_choose_lanes(full, recall, n_lanes, share), B = r->cache.policy.budget;
        if (n_full < 0) fatal("calib: '%s': a lane's recall is not finite", spec.text);
        for (int i = 0; i < n_lanes; i++) {
            caps[i] = full[i] ? ctx : B;
            if (full[i]) sum_full += recall[i]; else sum_rest += recall[i];
        }
        /* the chosen lanes, lowest recall first, as layer.kvhead and recall */
        fprintf(stderr, "calib: %d of %d lanes full (round(%g x %d)), lowest recall first, layer.kvhead recall:",
                n_full, n_lanes, share, n_lanes);
        for (int j = 0, shown = 0; j < n_full; j++) {
            int best = -1;
            for (int i = 0; i < n_lanes; i++)   /* the j-th lowest: n_full x n_lanes, tiny */
                if (full[i] == 1 && (best < 0 || recall[i] < recall[best])) best = i;
            full[best] = 2;
            fprintf(stderr, "%s%d.%d %.4f", shown++ % 8 ? "  " : "\ncalib:   ", best / G, best % G, recall[best]);
        }
        fprintf(stderr, "%s\ncalib: mean recall %.4f on the full lanes, %.4f on the %d streaming ones\n",
                n_full ? "" : " none", n_full ? sum_full / n_full : 0, n_lanes > n_full ? sum_rest / (n_lanes - n_full) : 0,
                n_lanes - n_full);
        if (o->out) {
            OutFile out = OUTFILE_NONE;
            outfile_open(&out, "-o", o->out, 1);
            Provenance pv;
            provenance_init(&pv, m, o, &sha);   /* text_sha256: the calibration text's, as calib_sha256 */
            Line ln = {0};
            line_printf(&ln, "{\"mode\":\"duo_calib\",\"kv\":\"");
            line_json_str(&ln, spec.text);
            line_printf(&ln, "\",\"budget\":%d,\"full_share\":%.9g,\"ctx\":%d,\"calib\":\"", B, share, ctx);
            line_json_str(&ln, o->calib);
            line_printf(&ln, "\",\"calib_sha256\":\"%s\",\"calib_tokens\":%zu,\"tokens\":%ld,\"lanes\":%d,"
                        "\"full_lanes\":[", pv.text_sha, d.n, done, n_lanes);
            for (int i = 0, w = 0; i < n_lanes; i++)
                if (full[i]) line_printf(&ln, "%s[%d,%d]", w++ ? "," : "", i / G, i % G);
            line_printf(&ln, "],\"full_recall\":%.9g,\"streaming_recall\":%.9g,\"recall_per_lane\":[",
                        n_full ? sum_full / n_full : 0, n_lanes > n_full ? sum_rest / (n_lanes - n_full) : 0);
            json_recall_lanes(&ln, r, n_lanes);
            line_printf(&ln, "],");
            json_provenance_end(&ln, &pv);
            outfile_line(&out, &ln);
            line_free(&ln);
            line_free(&pv.cmdline);
            outfile_close(&out);
        }
        free(recall);
        free(full);
    }
    policy_run_free(&runs[0]);
    policy_run_free(&runs[1]);
    eval_ctx_free(&e);
    free(d.ids);
    return caps;
}

/* ---------------------------------------------------------------------------------------------------------------
 * -m bench: time to first token, prefill tok/s, decode ms/token (p50/p95) at several context lengths, KV bytes, peak
 * resident memory, and where decode time goes (matmuls, attention with the policy's work, the rest). Monotonic
 * wall clock; a warm-up run (not counted) first pages the weights in.
 * ------------------------------------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Token ids for a bench prompt of n tokens: the text of -f (or the passkey filler) tokenized, repeated. */
static int *bench_tokens(const Model *m, const Options *o, int n, Sha256 *text_sha) {
    static const char filler[] = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
    int *out = malloc((size_t)n * sizeof(int));
    if (!out) fatal("out of memory");
    if (!m->has_tokenizer) {   /* ids-only model: a fixed pseudo-random id stream */
        uint64_t x = 12345;
        for (int i = 0; i < n; i++) { x = x * 6364136223846793005ull + 1442695040888963407ull; out[i] = (int)((x >> 33) % m->config.vocab_size); }
        return out;
    }
    size_t len;
    char *text = o->n_files ? read_file(o->files[0], &len) : strdup(filler), err[256];
    if (!text) fatal("out of memory");
    len = strlen(text);
    sha_update(text_sha, text, len);
    int *ids;
    size_t nids;
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, len, m->tokenizer.add_bos, &ids, &nids, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    if (nids == 0) fatal("the bench text has no tokens");
    for (int i = 0; i < n; i++) out[i] = ids[i % nids];
    free(ids);
    free(text);
    return out;
}

int run_bench(Model *m, const Options *o) {
    int ctx_max = run_context(m, o);
    if (o->steps_set && o->steps == 0) fatal("-m bench -n 0 times no decode step: give the steps per context (default 32)");
    int steps = o->steps_set ? o->steps : 32;
    int n_pol = o->n_kv ? o->n_kv : 1;
    /* context lengths: 128, 512, 2048, ... (x4) up to -c, each leaving room for the decode steps */
    if (ctx_max < steps + 1)
        fatal("-m bench -c %d leaves no room for a prompt and %d decode steps: use -c %d or more (or fewer -n)", ctx_max,
              steps, steps + 1);
    int lens[MAX_PASSKEY_CELLS + 1], n_lens = 0;
    if (o->n_lengths)   /* -lengths: the contexts asked, each with room for the decode steps */
        for (int i = 0; i < o->n_lengths; i++) {
            if (o->lengths[i] + steps > ctx_max)
                fatal("-lengths: a context of %d tokens and %d decode steps is over -c %d: use -c %d or more (or fewer "
                      "-n)", o->lengths[i], steps, ctx_max, o->lengths[i] + steps);
            lens[n_lens++] = o->lengths[i];
        }
    else {
        for (int L = 128; L + steps <= ctx_max && n_lens < MAX_PASSKEY_CELLS; L *= 4) lens[n_lens++] = L;
        if (n_lens == 0 || lens[n_lens - 1] + steps < ctx_max) lens[n_lens++] = ctx_max - steps > 1 ? ctx_max - steps : 1;
    }
    Sha256 text_sha;
    sha_init(&text_sha);
    int *tok = bench_tokens(m, o, ctx_max, &text_sha);
    OutFile out = OUTFILE_NONE;
    policy_specs_check(m, o, ctx_max);   /* every spec the cache refuses, before any work */
    if (o->out) outfile_open(&out, "-o", o->out, 1);
    Provenance pv;
    provenance_init(&pv, m, o, &text_sha);
    Line ln = {0};
    run_job_start();
    fprintf(stderr, "bench: contexts up to %d tokens (-c), %d decode steps each, %d thread%s\n", ctx_max, steps,
            pv.threads, pv.threads == 1 ? "" : "s");
    fprintf(stderr, "%-28s %7s %9s %10s %9s %9s %8s %8s %8s %10s %10s %10s\n", "policy", "context", "TTFT ms",
            "prefill t/s", "p50 ms", "p95 ms", "matmul%", "attn%", "other%", "KV MiB", "live MiB", "read MiB");
    double *ms = malloc((size_t)steps * sizeof(double));
    for (int k = 0; k < n_pol && !run_signal; k++) {
        PolicyRun r;
        policy_run_init(&r, m, o, o->n_kv ? o->kv[k] : "full", ctx_max, 0, PREFILL_CHUNK,
                        o->n_kv ? o->kv_caps[k] : NULL);
        /* warm-up: page the weights in, wake the threads */
        for (int t = 0; t < 8; t++) forward(m, &r.s, &r.cache, tok[t], t);
        for (int li = 0; li < n_lens && !run_signal; li++) {
            int L = lens[li];
            kv_cache_reset(&r.cache);
            kv_set_prompt_len(&r.cache, L);
            double t0 = now_s();
            /* the prompt as generate prefills it: PREFILL_CHUNK tokens at a time */
            if (forward_prefill(m, &r.s, &r.cache, tok, (size_t)L, 0, PREFILL_CHUNK))
                fatal("'%s' filled up within %d tokens", r.cache.spec.text, L);
            if (run_signal) break;   /* a prefill interrupted: nothing of this context measured */
            int next = sample_argmax(r.s.logits, m->config.vocab_size);
            double ttft = now_s() - t0;
            r.s.t_matmul = r.s.t_attn = 0;
            uint64_t read0 = r.cache.bytes_read, moved0 = r.cache.bytes_moved;
            long steps0 = r.cache.steps_read;
            KVTierStats tier0 = r.cache.tier;
            double td0 = now_s();
            int done = 0;
            for (int st = 0; st < steps && !run_signal; st++) {
                double a = now_s();
                if (forward(m, &r.s, &r.cache, next, L + st)) break;
                next = sample_argmax(r.s.logits, m->config.vocab_size);
                ms[done++] = (now_s() - a) * 1e3;
            }
            double tdec = now_s() - td0;
            qsort(ms, (size_t)done, sizeof *ms, cmp_double);
            double p50 = done ? ms[done / 2] : 0, p95 = done ? ms[(int)(0.95 * (done - 1) + 0.5)] : 0;
            KVBytes b = kv_bytes(&r.cache);
            double fm = tdec > 0 ? r.s.t_matmul / tdec : 0, fa = tdec > 0 ? r.s.t_attn / tdec : 0;
            long rd_steps = r.cache.steps_read - steps0;
            double read = rd_steps ? (double)(r.cache.bytes_read - read0) / rd_steps : 0;   /* KV bytes per step */
            fprintf(stderr, "%-28s %7d %9.1f %10.1f %9.2f %9.2f %7.1f%% %7.1f%% %7.1f%% %10.2f %10.2f %10.3f%s\n",
                    r.cache.spec.text, L, ttft * 1e3, L / ttft, p50, p95, 100 * fm, 100 * fa, 100 * (1 - fm - fa),
                    b.total_alloc / 1048576.0, b.total_live / 1048576.0, read / 1048576.0,
                    done < steps ? " (partial)" : "");
            double moved = rd_steps ? (double)(r.cache.bytes_moved - moved0) / rd_steps : 0;
            double cs = done ? tdec / done : 0;
            KVTierFigures tx = tier_figures(&r.cache, &tier0, rd_steps, cs, o->link_gbs);
            if (r.cache.tiers) tier_print(stderr, &r.cache, &tx, cs);
            if (out.fd < 0) continue;
            line_printf(&ln, "{\"mode\":\"bench\",\"kv\":\"");
            line_json_str(&ln, r.cache.spec.text);
            line_printf(&ln, "\",\"budget\":%d,\"context\":%d,\"partial\":%s,\"ttft_ms\":%.3f,\"prefill_tok_s\":%.3f,"
                        "\"decode_steps\":%d,\"decode_ms_p50\":%.4f,\"decode_ms_p95\":%.4f,\"decode_tok_s\":%.3f,"
                        "\"matmul_frac\":%.4f,\"attn_frac\":%.4f,\"kv_alloc_bytes\":%zu,\"kv_live_bytes\":%zu,"
                        "\"kv_peak_live_bytes\":%zu,\"kv_read_bytes_per_step\":%.1f,\"kv_moved_bytes_per_step\":%.1f,"
                        "\"peak_rss_kib\":%ld,", r.cache.policy.budget, L,
                        done < steps ? "true" : "false", ttft * 1e3, L / ttft, done, p50, p95,
                        tdec > 0 ? done / tdec : 0, fm, fa, b.total_alloc, b.total_live, b.peak_live, read, moved,
                        peak_rss_kib());
            if (r.cache.tiers) tier_json(&ln, &r.cache, &tx, cs, o->link_gbs);
            json_provenance_end(&ln, &pv);
            outfile_line(&out, &ln);
        }
        policy_run_free(&r);
    }
    fprintf(stderr, "bench: peak RSS %.1f MiB\n", peak_rss_kib() / 1024.0);
    if (run_signal) fprintf(stderr, "bench: stopped by %s: the rows above are what was measured\n",
                            run_signal_name(run_signal));
    free(ms);
    free(tok);
    line_free(&ln);
    line_free(&pv.cmdline);
    outfile_close(&out);
    return run_signal ? 128 + run_signal : 0;
}


/* ---------------------------------------------------------------------------------------------------------------
 * -m passkey: llama.cpp's passkey retrieval (examples/passkey): an instruction, the filler repeated to the length,
 * the key sentence at a relative depth, the question; plain completion, greedy, the first integer of the answer must
 * equal the key. The prompt goes through the policy's cache exactly as in generation (chunked, bit-identical).
 * Two-turn variant: a first and a second key at two depths; after the first answer, the same cache is asked for the
 * second, nothing recomputed.
 * ------------------------------------------------------------------------------------------------------------- */

const char PK_PREFIX[] = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                                "them. I will quiz you about the important information there.";
const char PK_FILLER[] = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

void str_add(Str *b, const char *t) {
    size_t k = strlen(t);
    if (b->n + k + 1 > b->cap) {
        b->cap = (b->n + k + 1) * 2;
        b->s = realloc(b->s, b->cap);
        if (!b->s) fatal("out of memory");
    }
    memcpy(b->s + b->n, t, k + 1);
    b->n += k;
}

/* Encode text and append to ids (growing *cap). */
void encode_append(const Model *m, const char *text, int add_bos, int **ids, size_t *n, size_t *cap) {
    int *t;
    size_t nt;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, strlen(text), add_bos, &t, &nt, err, sizeof err))
        fatal("tokenizer: %s", err);
    if (*n + nt > *cap) {
        *cap = (*n + nt) * 2;
        *ids = realloc(*ids, *cap * sizeof(int));
        if (!*ids) fatal("out of memory");
    }
    memcpy(*ids + *n, t, nt * sizeof(int));
    *n += nt;
    free(t);
}

/* The prompt: n_junk fillers, key sentence(s) inserted before filler i_pos[k]. */
static char *passkey_text(int n_junk, const int *i_pos, const int *keys, const char *const *names, int n_keys,
                          const char *question) {
    Str b = {0};
    char line[256];
    str_add(&b, PK_PREFIX);
    for (int i = 0; i <= n_junk; i++) {
        for (int k = 0; k < n_keys; k++)
            if (i_pos[k] == i) {
                snprintf(line, sizeof line, " The %spass key is %d. Remember it. %d is the %spass key.", names[k],
                         keys[k], keys[k], names[k]);
                str_add(&b, line);
            }
        if (i < n_junk) str_add(&b, PK_FILLER);
    }
    str_add(&b, question);
    return b.s;
}

/* The tokens of text's first `bytes` bytes, BOS included when the model adds one (as the prompt is encoded): the
 * position where the part of the prompt that starts there begins, for the -o record (every part starts with a space,
 * where the pre-tokenizer splits, so the count is the same as in the whole prompt). */
static int prefix_tokens(const Model *m, const char *text, size_t bytes) {
    char *head = strndup(text, bytes);
    if (!head) fatal("out of memory");
    int *ids = NULL;
    size_t n = 0, cap = 0;
    encode_append(m, head, m->tokenizer.add_bos, &ids, &n, &cap);
    free(ids);
    free(head);
    return (int)n;
}


int eval_answer(Model *m, PolicyRun *r, int *pos, int max_new, int stop, char *buf, size_t cap) {
    TokenDecoder d;
    tokdec_init(&d, &m->tokenizer);
    size_t n = 0;
    char piece[TOKDEC_OUT_MAX];
    int rc = 0;
    buf[0] = 0;
    for (int k = 0; k < max_new; k++) {
        int next = sample_argmax(r->s.logits, m->config.vocab_size);
        if (tokenizer_is_eog(&m->tokenizer, next) || next == stop) break;
        size_t len = tokdec_push(&d, next, piece, sizeof piece);
        if (n + len < cap) { memcpy(buf + n, piece, len); n += len; }
        ids_push(&r->asked, next);
        if (forward(m, &r->s, &r->cache, next, (*pos)++)) { rc = PK_CACHE_FULL; break; }
        if (run_signal) { rc = PK_STOPPED; break; }
    }
    buf[n] = 0;
    return rc;
}

/* Greedy answer of up to max_new tokens (eval_answer); returns the first integer in it (a run of decimal digits,
 * leading zeros dropped, at most 9 digits read), or PK_NO_NUMBER; the text in buf. PK_CACHE_FULL when the cache
 * filled up, PK_STOPPED on SIGINT/SIGTERM. */
static long passkey_answer(Model *m, PolicyRun *r, int *pos, int max_new, char *buf, size_t cap) {
    int rc = eval_answer(m, r, pos, max_new, -1, buf, cap);
    return rc ? rc : passkey_first_integer(buf);
}

long passkey_first_integer(const char *text) {
    const char *p = text;
    while (*p && (*p < '0' || *p > '9')) p++;
    if (!*p) return PK_NO_NUMBER;
    while (*p == '0' && p[1] >= '0' && p[1] <= '9') p++;
    long v = 0;
    for (int k = 0; k < 9 && *p >= '0' && *p <= '9'; k++, p++) v = 10 * v + (*p - '0');
    return v;
}

/* Prefill ids[0..n) from position *pos, `chunk` tokens at a time (forward_prefill); *pos advances. 0, PK_CACHE_FULL,
 * or PK_STOPPED when SIGINT/SIGTERM came between two chunks. */
int prefill(Model *m, PolicyRun *r, const int *ids, size_t n, int *pos, int chunk) {
    for (size_t i = 0; i < n; i += (size_t)chunk) {
        size_t k = n - i < (size_t)chunk ? n - i : (size_t)chunk;
        int rows = r->s.logits_rows;
        r->s.logits_rows = i + k < n ? LOGITS_NONE : rows;   /* the last token's logits only */
        int rc = forward_prefill(m, &r->s, &r->cache, ids + i, k, *pos, chunk);
        r->s.logits_rows = rows;
        if (rc) return PK_CACHE_FULL;
        *pos += (int)k;
        if (run_signal) return PK_STOPPED;
    }
    return 0;
}

int share_from(const KVCache *c, size_t n, int chunk) {
    int f = kv_full_prefix(c), last = (int)n - 1;
    return (f < last ? f : last) / chunk * chunk;
}

void share_order(const int *from, int k, int *order) {
    int j = k;
    for (; j > 0 && from[order[j - 1]] > from[k]; j--) order[j] = order[j - 1];
    order[j] = k;
}

void share_move_in(KVCache *dst, const KVCache *shared, int from, const char *what) {
    KVCache tmp;
    char err[512];
    if (kv_cache_clone(&tmp, shared, err, sizeof err) || kv_cache_truncate(&tmp, from, err, sizeof err)
        || kv_cache_transfer(dst, &tmp, from, err, sizeof err))
        fatal("%s: moving the shared prefill into '%s': %s", what, dst->spec.text, err);
    kv_cache_free(&tmp);
}

/* 1 when policy r's cache may be saved part way through a prompt and resumed by the next prompt, which starts with
 * the same tokens (kv_cache_clone/kv_cache_restore): its state before the prompt's end depends on those tokens
 * alone (not a prompt-end policy: snapkv gathers the prompt's last queries, whose positions the prompt's length sets),
 * and nothing outside the cache follows its steps (an event observer for -kvlog, memory tiers, whose modelled
 * traffic counts every step; pages of a pool and a device mirror cannot be cloned). A resumed cache's counters
 * (evictions, bytes read, peaks) are those of its saved state: -m passkey reports none of them. */
static int passkey_resumable(const KVCache *c) {
    return !c->policy.ops->prompt_end && !c->on_event && !c->on_slot && !c->tiers && !c->pool && !c->device;
}

/* A policy's cache saved part way through a prompt for the next prompt to resume from (passkey_resumable) */
typedef struct {
    KVCache cache;   /* made on first use (made) */
    int made;
    int pos;         /* tokens of the prompt about to be asked that cache holds; 0: none */
} PkSaved;

/* Ask policy r one question: ids[0..n) prefilled from *pos, then answered greedily. fresh: a new document (the cache
 * reset, the prompt's length told to the policy, *pos = 0), whose first `from` tokens are moved in from `shared`, a
 * `full,type=f32` cache that holds them (from <= kv_full_prefix of r's cache and a whole number of chunks: bit for
 * bit what r's own prefill of them leaves; tests/test_passkey.sh compares with -prefix 0); from 0: none. With `sv`
 * (passkey_resumable): resume > 0 starts instead from sv's cache, r's own saved after the first `resume` tokens of
 * the prompt before, which these ids start with; save > 0 saves r's cache into sv after the first `save` tokens,
 * for the next prompt, and sets sv->pos = save once it has. resume and save are whole chunks, so the policy's own
 * chunks are those it would prefill alone, and the saved state is the one a fresh prefill of those tokens reaches
 * (the state of a passkey_resumable policy before the prompt's end is the tokens' alone). Returns the answer's
 * first integer, or PK_*. */
static long passkey_ask(Model *m, PolicyRun *r, const int *ids, size_t n, int fresh, const KVCache *shared, int from,
                        PkSaved *sv, int resume, int save, int *pos, int chunk, int max_new, char *answer,
                        size_t cap) {
    char err[512];
    int base = fresh ? 0 : *pos;   /* the position of ids[0] */
    if (fresh) {
        if (resume <= 0) kv_cache_reset(&r->cache);
        else if (kv_cache_restore(&r->cache, &sv->cache, err, sizeof err))
            fatal("-m passkey: resuming '%s' from the prompt before: %s", r->cache.spec.text, err);
        kv_set_prompt_len(&r->cache, (int)n);
        *pos = resume > 0 ? resume : 0;
        r->asked.n = 0;   /* for -kvlog: the token at each position */
    }
    for (size_t i = 0; i < n; i++) ids_push(&r->asked, ids[i]);
    answer[0] = 0;
    if (from > 0 && resume <= 0) {
        share_move_in(&r->cache, shared, from, "-m passkey");
        *pos = from;
    }
    if (save > *pos) {
        int pre = prefill(m, r, ids + (*pos - base), (size_t)(save - *pos), pos, chunk);
        if (pre) return pre;
        if (sv->made ? kv_cache_restore(&sv->cache, &r->cache, err, sizeof err)
                     : kv_cache_clone(&sv->cache, &r->cache, err, sizeof err))
            fatal("-m passkey: saving '%s' for the next prompt: %s", r->cache.spec.text, err);
        sv->made = 1;
        sv->pos = save;
    }
    int pre = prefill(m, r, ids + (*pos - base), n - (size_t)(*pos - base), pos, chunk);
    return pre == 0 ? passkey_answer(m, r, pos, max_new, answer, cap) : pre;
}

/* The shared prefill of one prompt (-prefix 1): each policy's share of it, from[k] = kv_full_prefix of its cache
 * (reset, told the prompt's length) below the last prompt token (whose logits are the policy's own answer) and cut to
 * whole chunks, so the policy's own chunks are those it would prefill alone; order: the policies by increasing share,
 * so the one full-cache prefill in `pre` only grows. Without sharing every from[k] is 0. */
static void passkey_share_plan(PolicyRun *runs, int n_pol, int share, size_t n, int chunk, int *from, int *order) {
    for (int k = 0; k < n_pol; k++) {
        from[k] = 0;
        if (share) {
            kv_cache_reset(&runs[k].cache);
            kv_set_prompt_len(&runs[k].cache, (int)n);
            from[k] = share_from(&runs[k].cache, n, chunk);
        }
        share_order(from, k, order);
    }
}

/* "NAME":integer, or null with "NAME_status":"no_number" (no digits in the answer) or "cache_full". */
static void json_answer(Line *l, const char *name, long got) {
    if (got >= 0) line_printf(l, "\"%s\":%ld", name, got);
    else line_printf(l, "\"%s\":null,\"%s_status\":\"%s\"", name, name, got == PK_CACHE_FULL ? "cache_full" : "no_number");
}

/* One prompt of the passkey grid: its tokens, and for the record where the key sentence and the question start. */
typedef struct {
    int *ids;
    size_t n;
    int length, li, di, n_junk, key_pos, question_pos;
    double depth;
    int keys[2];   /* the key (keys[1]: the two-turn variant's second key) */
    int two;       /* the two-turn variant (at the longest length; a second question follows the first answer) */
} PkPrompt;

/* Tokens prompts a and b start with alike */
static int common_prefix(const PkPrompt *a, const PkPrompt *b) {
    size_t i = 0;
    while (i < a->n && i < b->n && a->ids[i] == b->ids[i]) i++;
    return (int)i;
}

/* Every policy asked one prompt, in the order of their shares of the prefill (passkey_share_plan; `pre` grows to
 * each share), each answer recorded (-o) and counted in ok/asked (cell li, di) or two_ok/two_asked. Returns 0 or
 * PK_STOPPED (the policy being asked is dropped).
 * With sharing (-prefix 1), what one prompt computed also serves the next (`next`, NULL for the last), which starts
 * with the same tokens (the instruction and the filler before the earlier of the two key sentences): `pre` keeps
 * those tokens (kv_cache_truncate drops the rest) and grows from there, and each policy whose own prefill goes
 * further than its share of `pre` (eviction past its budget) saves its cache after them (saved, passkey_resumable) and
 * resumes the next prompt there. */
typedef struct {
    Model *m;
    const Options *o;
    PolicyRun *runs, *pre;
    int n_pol, n_cells, chunk, max_new, share;
    int *from, *order, *ok, *asked, *two_ok, *two_asked;
    double *secs, pre_secs;
    long shared_tokens, own_tokens, resumed_tokens, pre_kept, pre_computed;
    OutFile *out;
    Line *ln;
    Provenance *pv;
    PkSaved *saved;         /* one per policy */
    int *from_next;         /* the next prompt's shares (passkey_share_plan) */
    int pre_pos, pre_keep;  /* tokens `pre` holds, and how many of them this prompt starts with */
} PkJob;

static int passkey_prompt_all(PkJob *j, const PkPrompt *p, const PkPrompt *next) {
    char answer[512];
    /* keep: the tokens this prompt shares with the next, in whole chunks, short of either prompt's last token (whose
       logits are each policy's own answer) */
    int keep = 0;
    if (j->share && next) {
        keep = common_prefix(p, next);
        int last = (int)(p->n < next->n ? p->n : next->n) - 1;
        keep = (keep < last ? keep : last) / j->chunk * j->chunk;
        if (keep > 0) passkey_share_plan(j->runs, j->n_pol, j->share, next->n, j->chunk, j->from_next, j->order);
    }
    passkey_share_plan(j->runs, j->n_pol, j->share, p->n, j->chunk, j->from, j->order);
    int rc = 0, *ids2 = NULL;   /* the two-turn variant's second question, encoded once for every policy */
    size_t n2 = 0, cap2 = 0;
    if (p->two) encode_append(j->m, " What is the second pass key? The second pass key is", 0, &ids2, &n2, &cap2);
    if (j->share) {   /* `pre` keeps what the prompt before shared with this one */
        char err[512];
        if (j->pre_keep <= 0) kv_cache_reset(&j->pre->cache);
        else if (j->pre_keep < j->pre_pos && kv_cache_truncate(&j->pre->cache, j->pre_keep, err, sizeof err))
            fatal("-m passkey: keeping the shared prefill's first %d tokens: %s", j->pre_keep, err);
        if (j->pre_keep < j->pre_pos) j->pre_pos = j->pre_keep;
        j->pre_kept += j->pre_pos;
        kv_set_prompt_len(&j->pre->cache, (int)p->n);
        j->pre_keep = keep;
    }
    for (int q = 0; q < j->n_pol; q++) {
        int k = j->order[q], from = j->from[k];
        PolicyRun *r = &j->runs[k];
        /* resume from this policy's save of the prompt before where that goes further than its share of `pre`; save
           for the next prompt where the tokens it shares go further than its share then (equal to what the save
           holds: it stays as it is) */
        PkSaved *sv = &j->saved[k];
        int resume = sv->pos > from ? sv->pos : 0;
        int save = keep > resume && keep > j->from_next[k] && passkey_resumable(&r->cache) ? keep : 0;
        sv->pos = resume && keep == resume && keep > j->from_next[k] ? resume : 0;   /* passkey_ask sets a save */
        if (from > j->pre_pos && !resume) {
            double t0 = now_s();
            int pos0 = j->pre_pos;
            rc = prefill(j->m, j->pre, p->ids + j->pre_pos, (size_t)(from - j->pre_pos), &j->pre_pos, j->chunk);
            j->pre_secs += now_s() - t0;
            j->pre_computed += j->pre_pos - pos0;
            if (rc == PK_STOPPED) break;
            if (rc) fatal("-m passkey: the shared prefill of %d tokens did not fit -c %d", from, j->pre->cache.shape.seq_len);
        }
        double t0 = now_s();
        int pos;
        long got = passkey_ask(j->m, r, p->ids, p->n, 1, &j->pre->cache, from, sv, resume, save, &pos, j->chunk,
                               j->max_new, answer, sizeof answer);
        long second = PK_CACHE_FULL;
        if (p->two && got != PK_CACHE_FULL && got != PK_STOPPED)   /* the same cache, continued */
            second = passkey_ask(j->m, r, ids2, n2, 0, NULL, 0, NULL, 0, 0, &pos, j->chunk, j->max_new, answer,
                                 sizeof answer);
        j->secs[k] += now_s() - t0;
        if (got == PK_STOPPED || second == PK_STOPPED) { rc = PK_STOPPED; break; }
        int moved = resume ? 0 : from;
        j->shared_tokens += moved;
        j->resumed_tokens += resume;
        j->own_tokens += (long)p->n - moved - resume;
        Line *ln = j->ln;
        if (!p->two) {
            j->ok[k * j->n_cells + p->li * MAX_PASSKEY_CELLS + p->di] += got == p->keys[0];
            j->asked[k * j->n_cells + p->li * MAX_PASSKEY_CELLS + p->di]++;
            if (j->out->fd < 0) continue;
            line_printf(ln, "{\"mode\":\"passkey\",\"kv\":\"");
            line_json_str(ln, r->cache.spec.text);
            line_printf(ln, "\",\"budget\":%d,\"length\":%d,\"prompt_tokens\":%zu,\"depth\":%.6g,\"key\":%d,"
                        "\"key_pos\":%d,\"question_pos\":%d,\"fillers\":%d,", r->cache.policy.budget, p->length, p->n,
                        p->depth, p->keys[0], p->key_pos, p->question_pos, p->n_junk);
            json_answer(ln, "answer", got);
            line_printf(ln, ",\"correct\":%s,\"answer_text\":\"", got == p->keys[0] ? "true" : "false");
            line_json_str(ln, answer);
            line_printf(ln, "\",");
        } else {
            j->two_ok[2 * k] += got == p->keys[0];
            j->two_ok[2 * k + 1] += second == p->keys[1];
            j->two_asked[k]++;
            if (j->out->fd < 0) continue;
            line_printf(ln, "{\"mode\":\"passkey2\",\"kv\":\"");
            line_json_str(ln, r->cache.spec.text);
            line_printf(ln, "\",\"budget\":%d,\"length\":%d,\"keys\":[%d,%d],", r->cache.policy.budget, p->length,
                        p->keys[0], p->keys[1]);
            json_answer(ln, "answer_first", got);
            line_printf(ln, ",");
            json_answer(ln, "answer_second", second);
            line_printf(ln, ",\"answers\":[%ld,%ld],", got >= 0 ? got : -1, second >= 0 ? second : -1);
        }
        json_provenance_end(ln, j->pv);
        outfile_line(j->out, ln);
    }
    free(ids2);
    return rc;
}

int run_passkey(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("passkey needs a model with a tokenizer");
    int ctx = run_context(m, o);
    int chunk = o->chunk ? o->chunk : PREFILL_CHUNK, n_keys_per_cell = 2;
    if (o->steps_set && o->steps == 0) fatal("-m passkey -n 0 leaves no token to answer with: give the answer's length "
                                             "(default 8)");
    int max_new = o->steps_set ? o->steps : 8;
    /* the grid: -depths (default 0, .25, .5, .75, 1) by -lengths (default -c/4, -c/2, -c) */
    static const double default_depths[] = {0.0, 0.25, 0.5, 0.75, 1.0};
    const double *depths = o->n_depths ? o->depths : default_depths;
    int n_depths = o->n_depths ? o->n_depths : 5, n_lens = o->n_lengths ? o->n_lengths : 3, lens[MAX_PASSKEY_CELLS];
    for (int li = 0; li < n_lens; li++) lens[li] = o->n_lengths ? o->lengths[li] : ctx / (1 << (2 - li));
    int longest = 0;
    for (int li = 0; li < n_lens; li++) longest = lens[li] > longest ? lens[li] : longest;
    int n_pol = o->n_kv ? o->n_kv : 1;
    /* tokens per filler and the fixed part, measured with the model's tokenizer */
    int *tmp = NULL;
    size_t nt = 0, cap = 0;
    encode_append(m, PK_FILLER, 0, &tmp, &nt, &cap);
    int per_junk = (int)nt;
    nt = 0;
    encode_append(m, PK_PREFIX, 0, &tmp, &nt, &cap);
    int fixed = (int)nt + 64;   /* prefix + key sentence + question + answer room */
    free(tmp);
    if ((ctx - fixed) / per_junk < 4)   /* not even the longest length has room for the filler the depths need */
        fatal("-m passkey -c %d is too short: the fixed text takes %d tokens and the depths need 4 fillers of %d; use "
              "-c %d or more", ctx, fixed, per_junk, fixed + 4 * per_junk);
    for (int li = 0; li < o->n_lengths; li++) {   /* lengths given: each must fit in the cache and hold a prompt */
        if (lens[li] > ctx)
            fatal("-lengths: %d tokens is over -c %d, the cache of full and of the selection policies; use -c %d or a "
                  "shorter length", lens[li], ctx, lens[li]);
        if ((lens[li] - fixed) / per_junk < 4)
            fatal("-lengths: %d tokens is too short: the fixed text takes %d tokens and the depths need 4 fillers of "
                  "%d; use %d or more", lens[li], fixed, per_junk, fixed + 4 * per_junk);
    }
    uint64_t seed = o->seed_set ? o->seed : 1, rng = seed;
    Sha256 text_sha;
    sha_init(&text_sha);
    OutFile out = OUTFILE_NONE, kvlog = OUTFILE_NONE;
    policy_specs_check(m, o, ctx);   /* every spec the cache refuses, before any work */
    if (o->out) outfile_open(&out, "-o", o->out, 1);
    if (o->kvlog) outfile_open(&kvlog, "-kvlog", o->kvlog, 0);
    Provenance pv;
    provenance_init(&pv, m, o, &text_sha);
    pv.seed = seed;   /* the keys' seed: -s, or 1 */
    Line ln = {0};
    run_job_start();
    fprintf(stderr, "passkey: lengths");
    for (int li = 0; li < n_lens; li++) fprintf(stderr, " %d", lens[li]);
    fprintf(stderr, " tokens, depths");
    for (int di = 0; di < n_depths; di++) fprintf(stderr, " %g", depths[di]);
    fprintf(stderr, ", %d keys per cell, seed %llu%s\n", n_keys_per_cell, (unsigned long long)seed,
            o->passkey2 ? "" : ", no two-turn variant (-passkey2 0)");
    /* Prompt by prompt, every policy in turn, all asked the same keys at the same depths. The policies that only
     * store over a prompt's first tokens (kv_full_prefix: full; window, sink and random until a lane is full; snapkv
     * until its observation window; quest and topk under prompt=dense until the prompt's end) start from one
     * `full,type=f32` prefill of the prompt, moved into their cache at their share (-prefix 0: each prefills alone) */
    int share = o->prefix, n_cells = MAX_PASSKEY_CELLS * MAX_PASSKEY_CELLS;
    PolicyRun *runs = calloc((size_t)n_pol, sizeof *runs), pre;
    PkJob job = {m, o, runs, &pre, n_pol, n_cells, chunk, max_new, share,
                 calloc((size_t)n_pol, sizeof(int)), calloc((size_t)n_pol, sizeof(int)),
                 calloc((size_t)n_pol * n_cells, sizeof(int)), calloc((size_t)n_pol * n_cells, sizeof(int)),
                 calloc((size_t)n_pol * 2, sizeof(int)), calloc((size_t)n_pol, sizeof(int)),
                 calloc((size_t)n_pol, sizeof(double)), 0, 0, 0, 0, 0, 0, &out, &ln, &pv,
                 calloc((size_t)n_pol, sizeof(PkSaved)), calloc((size_t)n_pol, sizeof(int)), 0, 0};
    if (!runs || !job.from || !job.order || !job.ok || !job.asked || !job.two_ok || !job.two_asked || !job.secs
        || !job.saved || !job.from_next)
        fatal("out of memory");
    for (int k = 0; k < n_pol; k++) {
        policy_run_init(&runs[k], m, o, o->n_kv ? o->kv[k] : "full", ctx, 0, chunk, o->n_kv ? o->kv_caps[k] : NULL);
        if (o->kvlog) kvlog_attach(&runs[k].kvlog, &kvlog, m, &runs[k].asked, &runs[k].cache);
    }
    if (share) policy_run_init(&pre, m, o, "full,type=f32", ctx, 0, chunk, NULL);
    long total_tokens = 0, done_tokens = 0;
    for (int li = 0; li < n_lens; li++)
        if ((lens[li] - fixed) / per_junk >= 4) total_tokens += (long)lens[li] * n_depths * n_keys_per_cell * n_pol;
    if (o->passkey2) total_tokens += (long)longest * n_keys_per_cell * n_pol;
    /* the prompts, built first so that each knows the next (what it shares with it), in the order they are asked:
       lengths, depths, keys as given; then two turns (unless -passkey2 0), at the longest length: first key at depth
       0.25, second at 0.75; one cache */
    PkPrompt *prompts = calloc((size_t)(n_lens * n_depths + 1) * n_keys_per_cell, sizeof *prompts);
    int n_prompts = 0;
    if (!prompts) fatal("out of memory");
    for (int li = 0; li < n_lens; li++) {
        int n_junk = (lens[li] - fixed) / per_junk;
        if (n_junk < 4) continue;   /* the instruction, key and question alone fill it: no depth to vary */
        for (int di = 0; di < n_depths; di++)
            for (int rep = 0; rep < n_keys_per_cell; rep++) {
                PkPrompt p = {NULL, 0, lens[li], li, di, n_junk, 0, 0, depths[di], {0, 0}, 0};
                p.keys[0] = 10000 + (int)(splitmix64(&rng) % 90000);
                int i_pos = (int)(depths[di] * n_junk + 0.5);
                const char *name = "";
                char *text = passkey_text(n_junk, &i_pos, &p.keys[0], &name, 1, " What is the pass key? The pass key is");
                /* where the key sentence and the question start in the prompt as built, in tokens */
                const char *kp = strstr(text, " The pass key is"), *qp = strstr(text, " What is the pass key?");
                p.key_pos = prefix_tokens(m, text, (size_t)(kp - text));
                p.question_pos = prefix_tokens(m, text, (size_t)(qp - text));
                size_t c2 = 0;
                encode_append(m, text, m->tokenizer.add_bos, &p.ids, &p.n, &c2);
                free(text);
                prompts[n_prompts++] = p;
            }
    }
    for (int rep = 0; rep < n_keys_per_cell && o->passkey2; rep++) {
        int n_junk = (longest - fixed - 40) / per_junk;
        if (n_junk < 2) n_junk = 2;
        PkPrompt p = {NULL, 0, longest, 0, 0, n_junk, 0, 0, 0, {0, 0}, 1};
        p.keys[0] = 10000 + (int)(splitmix64(&rng) % 90000);
        p.keys[1] = 10000 + (int)(splitmix64(&rng) % 90000);
        int i_pos[2] = {n_junk / 4, 3 * n_junk / 4};
        const char *names[2] = {"first ", "second "};
        char *text = passkey_text(n_junk, i_pos, p.keys, names, 2, " What is the first pass key? The first pass key is");
        size_t c2 = 0;
        encode_append(m, text, m->tokenizer.add_bos, &p.ids, &p.n, &c2);
        free(text);
        prompts[n_prompts++] = p;
    }
    int stopped = 0;   /* SIGINT/SIGTERM: the question being asked is dropped, the records so far stay */
    double t_job = now_s();
    for (int i = 0; i < n_prompts && !stopped; i++) {
        stopped = passkey_prompt_all(&job, &prompts[i], i + 1 < n_prompts ? &prompts[i + 1] : NULL) == PK_STOPPED;
        done_tokens += (long)prompts[i].length * n_pol;
        progress(t_job, done_tokens, total_tokens, "passkey");
    }
    for (int i = 0; i < n_prompts; i++) free(prompts[i].ids);
    free(prompts);
    for (int k = 0; k < n_pol; k++) {
        PolicyRun *r = &runs[k];
        fprintf(stderr, "\n%s: accuracy (correct/keys) by length (rows) and depth (columns)\n%8s", r->cache.spec.text, "");
        for (int di = 0; di < n_depths; di++) fprintf(stderr, " %6.4g", depths[di]);
        fprintf(stderr, "\n");
        int total_ok = 0, total = 0;
        for (int li = 0; li < n_lens; li++) {
            fprintf(stderr, "%8d", lens[li]);
            if ((lens[li] - fixed) / per_junk < 4) {
                fprintf(stderr, "  too short for a passkey prompt (%d tokens of fixed text); use a larger -c\n", fixed);
                continue;
            }
            for (int di = 0; di < n_depths; di++) {
                int c = k * n_cells + li * MAX_PASSKEY_CELLS + di;
                fprintf(stderr, "    %d/%d", job.ok[c], job.asked[c]);
                total_ok += job.ok[c];
                total += job.asked[c];
            }
            fprintf(stderr, "\n");
        }
        if (o->passkey2)
            fprintf(stderr, "%s: %d/%d correct; two-turn at %d tokens: first key %d/%d, second key %d/%d, %.1f s%s\n",
                    r->cache.spec.text, total_ok, total, longest, job.two_ok[2 * k], job.two_asked[k],
                    job.two_ok[2 * k + 1], job.two_asked[k], job.secs[k], stopped ? " (stopped early)" : "");
        else fprintf(stderr, "%s: %d/%d correct, %.1f s%s\n", r->cache.spec.text, total_ok, total, job.secs[k],
                     stopped ? " (stopped early)" : "");
        if (r->cache.tiers) {   /* over every token of every question, the policy's own wall time per token */
            long steps = r->cache.steps_read;
            double cs = steps ? job.secs[k] / steps : 0;
            KVTierFigures x = tier_figures(&r->cache, NULL, steps, cs, o->link_gbs);
            fprintf(stderr, "memory tiers (modelled; the slow tier's link at %g GB/s, -link):\n", o->link_gbs);
            tier_print(stderr, &r->cache, &x, cs);
        }
    }
    if (share)   /* with -prefix 1 always, so a run that shared nothing says so */
        fprintf(stderr, "passkey: %ld prompt tokens moved in from one shared full-cache prefill per prompt (%.1f s; it "
                "computed %ld tokens and kept %ld from the prompt before), %ld resumed from a policy's own cache saved "
                "in the prompt before, %ld prefilled by the policies themselves (-prefix 0: all of them)\n",
                job.shared_tokens, job.pre_secs, job.pre_computed, job.pre_kept, job.resumed_tokens, job.own_tokens);
    for (int k = 0; k < n_pol; k++) {
        policy_run_free(&runs[k]);
        if (job.saved[k].made) kv_cache_free(&job.saved[k].cache);
    }
    if (share) policy_run_free(&pre);
    free(runs); free(job.from); free(job.order); free(job.ok); free(job.asked); free(job.two_ok); free(job.two_asked);
    free(job.secs); free(job.saved); free(job.from_next);
    if (stopped) fprintf(stderr, "passkey: stopped by %s: the question being asked was dropped; every answer above "
                         "is recorded\n", run_signal_name(run_signal));
    line_free(&ln);
    line_free(&pv.cmdline);
    outfile_close(&out);
    outfile_close(&kvlog);
    return stopped ? 128 + run_signal : 0;
}
