/* run.c: the Llama forward pass with a KV-cache policy, the sampler, and the generate and chat loops: read it top to
 * bottom (activations, then one decode step, step by step, then sampling, then generation). The model comes from
 * model.c, the weight matmuls from matmul.c, the cache and its policies from kv.c and policies.c, the command line from
 * cli.c; the evaluation modes (eval.c) call the forward pass defined here.
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, kv_dim (= n_kv_heads * head_dim),
 * q_dim (= n_heads * head_dim), vocab_size, seq_len. Indices: l layer, h head, t position, i row.
 */
#include "run.h"
#include "attn.h"
#include "exp_neg.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * The forward pass
 * ------------------------------------------------------------------------------------------------------------- */

int state_init_chunk(RunState *s, const Config *c, int n_max) {
    size_t q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t d = (size_t)c->dim > q ? (size_t)c->dim : q, n = (size_t)n_max;
    size_t total = n * (3 * d + 2 * (size_t)c->hidden_dim + q + 2 * kv + 2 * q + (size_t)c->vocab_size);
    memset(s, 0, sizeof *s);
    s->mem = calloc(total, sizeof(float));
    if (!s->mem) return -1;
    s->n_max = n_max;
    float *p = s->mem;
    s->x = p; p += n * d;
    s->xb = p; p += n * d;
    s->xb2 = p; p += n * d;
    s->hb = p; p += n * c->hidden_dim;
    s->hb2 = p; p += n * c->hidden_dim;
    s->q = p; p += n * q;
    s->k = p; p += n * kv;
    s->v = p; p += n * kv;
    s->att = p; p += n * q;
    s->qpf = p; p += n * q;
    s->logits = p;
    return 0;
}

int state_init(RunState *s, const Config *c) { return state_init_chunk(s, c, 1); }

void state_free(RunState *s) { free(s->mem); s->mem = NULL; }

/* out = w ⊙ x / sqrt(mean(x²) + eps)  (RMSNorm, Zhang & Sennrich 2019). */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    float ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (r * x[i]);
}

static void timer_add(double *acc, double t0) { if (acc) *acc += now_s() - t0; }

/* The forward pass in three parts, so a teacher-forced stream can run a chunk of n tokens layer by layer (every
 * policy today is layer-local: its decisions at layer l depend only on layer l's attention). Matmuls are batched over
 * the chunk; eviction, storing and the policy step token by token inside the layer, in position order, and attention
 * goes a chunk at a time only while that gives the same bits (kv_attend_chunk), so the result is bit-identical to
 * decoding the tokens one at a time. forward() is the n = 1 case. A policy that declares
 * cross_layer (kv.h) makes forward_chunk go token by token. */

void forward_begin(Model *m, RunState *s, const int *tokens, int n, int pos0) {
    int dim = m->config.dim;
    s->n = n;
    s->pos0 = pos0;
    for (int t = 0; t < n; t++)
        memcpy(s->x + (size_t)t * dim, m->w.token_embedding + (size_t)tokens[t] * dim, (size_t)dim * sizeof(float));
}

/* h[i] = silu(h[i])·u[i] over n values, silu(g) = g·σ(g) = g / (1 + e^−g) (the SwiGLU's gate): g / (1 + e) for g ≥ 0
 * and g·e / (1 + e) for g < 0, with e = e^−|g| from exp_neg.h (never overflows; the same bits with or without AVX2,
 * so decode and -chunk agree whatever the build). */
void swiglu(float *h, const float *u, int n) {
    int i = 0;
#ifdef __AVX2__
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {   /* the 8-lane body below in 16 lanes: the same operations */
        __m512 g = _mm512_loadu_ps(h + i), e = exp_neg16(_mm512_castsi512_ps(
                                               _mm512_or_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
        __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ),
                                          _mm512_mul_ps(g, e), g);
        _mm512_storeu_ps(h + i, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                              _mm512_loadu_ps(u + i)));
    }
#endif
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(h + i), e = exp_neg8(_mm256_or_ps(g, sign));   /* e^−|g| */
        __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        float g = h[i], e = exp_neg(-fabsf(g));
        h[i] = (g >= 0 ? g : g * e) / (1.0f + e) * u[i];
    }
}

/* Layer l of a batch: the rows of s (s->n of them) are the sequences' tokens one after another, sequence j's n rows at
 * its own positions pos0.. in its own cache. Matmuls and element-wise steps go over every row at once (a row's
 * arithmetic is its own, whatever the rows beside it: matmul_n's contract), attention and the policy per sequence. */
static int forward_layer_seqs(Model *m, RunState *s, const BatchSeq *seqs, int n_seqs, int l) {
    const Config *c = &m->config;
    const LayerWeights *L = &m->w.layers[l];
    int dim = c->dim, hd = c->head_dim, q_dim = c->n_heads * hd, kv_dim = c->n_kv_heads * hd, hid = c->hidden_dim;
    int n = s->n;
    double t0;
    /* attention block: xb = RMSNorm(x); q, k, v projections (before RoPE: the cache applies it per pos mode) */
    /* element-wise steps go over the chunk's tokens in parallel: each token's arithmetic is its own */
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int t = 0; t < n; t++)
        rmsnorm(s->xb + (size_t)t * dim, s->x + (size_t)t * dim, L->attn_norm, dim, c->norm_eps);
    t0 = now_s();
    matmul_n(s->q, s->xb, L->wq, q_dim, dim, n);
    matmul_n(s->k, s->xb, L->wk, kv_dim, dim, n);
    matmul_n(s->v, s->xb, L->wv, kv_dim, dim, n);
    timer_add(&s->t_matmul, t0);
    /* steps 1-2, evict if a lane is full and store k, v; steps 3-4, attend and show the policy: token by token in
       order (on the CPU, kv_attend_chunk attends for many tokens at once while no slot can be freed) */
    /* a fast memory tier with prefetch=1: this layer's input, normed as layer l+1 norms its own, predicts layer
       l+1's queries (InfiniGen's observation that consecutive layers' inputs are alike; kv_prefetch); x is still
       layer l's input here */
    int predict = 0;
    for (int j = 0; j < n_seqs; j++) predict |= seqs[j].cache->tiers && seqs[j].cache->spec.prefetch;
    predict &= l + 1 < c->n_layers;
    if (predict)
        for (int t = 0; t < n; t++)
            rmsnorm(s->xb2 + (size_t)t * dim, s->x + (size_t)t * dim, m->w.layers[l + 1].attn_norm, dim, c->norm_eps);
    t0 = now_s();
    for (int j = 0, row = 0; j < n_seqs; row += seqs[j].n, j++) {
        KVCache *cache = seqs[j].cache;
        int nj = seqs[j].n, p0 = seqs[j].pos0;
        float *att = s->att + (size_t)row * q_dim;
        const float *q = s->q + (size_t)row * q_dim, *k = s->k + (size_t)row * kv_dim, *v = s->v + (size_t)row * kv_dim;
        if (nj == 0) continue;
        kv_set_prefetch_queries(cache, l, l > 0 && cache->tiers && cache->spec.prefetch ? s->qpf + (size_t)row * q_dim
                                                                                          : NULL);
        if (!cache->device) {
            if (kv_attend_chunk(cache, att, l, p0, nj, q, k, v, seqs[j].hook, seqs[j].hook_ctx)) return -1;
        } else
            for (int t = 0; t < nj; t++) {   /* the device mirror (attn.cu): same steps, same policy code */
                int pos = p0 + t;
                if (kv_append(cache, l, pos, k + (size_t)t * kv_dim, v + (size_t)t * kv_dim)) return -1;
                attn_dev_attend(cache, att + (size_t)t * q_dim, l, pos, q + (size_t)t * q_dim, seqs[j].hook != NULL);
                if (seqs[j].hook) seqs[j].hook(seqs[j].hook_ctx, l, cache, pos);
            }
    }
    timer_add(&s->t_attn, t0);
    t0 = now_s();
    if (predict) matmul_n(s->qpf, s->xb2, m->w.layers[l + 1].wq, q_dim, dim, n);   /* layer l+1's, read there */
    /* x += Wo · att */
    matmul_n(s->xb2, s->att, L->wo, dim, q_dim, n);
    /* SwiGLU feed-forward: x += W2 · (silu(W1 · xb) ⊙ W3 · xb), xb = RMSNorm(x) (Shazeer 2020) */
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int t = 0; t < n; t++) {
        float *x = s->x + (size_t)t * dim;
        for (int i = 0; i < dim; i++) x[i] += s->xb2[(size_t)t * dim + i];
        rmsnorm(s->xb + (size_t)t * dim, x, L->ffn_norm, dim, c->norm_eps);
    }
    matmul_n(s->hb, s->xb, L->w1, hid, dim, n);
    matmul_n(s->hb2, s->xb, L->w3, hid, dim, n);
    #pragma omp parallel for schedule(static) if (n >= 8)
    for (int t = 0; t < n; t++) swiglu(s->hb + (size_t)t * hid, s->hb2 + (size_t)t * hid, hid);
    matmul_n(s->xb, s->hb, L->w2, dim, hid, n);
    for (size_t i = 0; i < (size_t)n * dim; i++) s->x[i] += s->xb[i];
    timer_add(&s->t_matmul, t0);
    return 0;
}

int forward_layer(Model *m, RunState *s, KVCache *cache, int l) {
    BatchSeq one = {cache, s->pos0, s->n, s->after_attn, s->hook_ctx};
    return forward_layer_seqs(m, s, &one, 1, l);
}

void forward_end(Model *m, RunState *s) {
    const Config *c = &m->config;
    int dim = c->dim;
    if (s->logits_rows == LOGITS_NONE) return;
    int t0 = s->logits_rows == LOGITS_LAST ? s->n - 1 : 0;   /* the first row wanted */
    for (int t = t0; t < s->n; t++)
        rmsnorm(s->x + (size_t)t * dim, s->x + (size_t)t * dim, m->w.final_norm, dim, c->norm_eps);
    double clock = now_s();
    matmul_n(s->logits + (size_t)t0 * c->vocab_size, s->x + (size_t)t0 * dim, m->w.classifier, c->vocab_size, dim,
             s->n - t0);
    timer_add(&s->t_matmul, clock);
}

int forward_chunk(Model *m, RunState *s, KVCache *cache, const int *tokens, int n, int pos0) {
    if (n > 1 && !kv_layer_local(cache)) {
        /* a policy that reads other layers' attention: one token at a time (each pass writes logits row 0). Row t
           gets token t's logits, t = 1..n-2 as they come; token 0's wait in row n-1 and are swapped in at the end. */
        size_t V = (size_t)m->config.vocab_size;
        float *lg = s->logits;
        for (int t = 0; t < n; t++) {
            if (forward_chunk(m, s, cache, tokens + t, 1, pos0 + t)) return -1;
            if (t > 0 && t < n - 1) memcpy(lg + t * V, lg, V * sizeof(float));
            if (t == 0) memcpy(lg + (n - 1) * V, lg, V * sizeof(float));
        }
        for (size_t i = 0; i < V; i++) { float x = lg[i]; lg[i] = lg[(n - 1) * V + i]; lg[(n - 1) * V + i] = x; }
        s->n = n;
        s->pos0 = pos0;
        return 0;
    }
    forward_begin(m, s, tokens, n, pos0);
    for (int l = 0; l < m->config.n_layers; l++)
        if (forward_layer(m, s, cache, l)) return -1;
    forward_end(m, s);
    return 0;
}

int forward_batch(Model *m, RunState *s, const BatchSeq *seqs, int n_seqs, const int *tokens) {
    int n = 0;
    for (int j = 0; j < n_seqs; j++) {
        if (seqs[j].n < 0 || (seqs[j].n > 1 && !kv_layer_local(seqs[j].cache))) return -1;
        n += seqs[j].n;
    }
    if (n < 1 || n > s->n_max) return -1;
    forward_begin(m, s, tokens, n, 0);
    for (int l = 0; l < m->config.n_layers; l++)
        if (forward_layer_seqs(m, s, seqs, n_seqs, l)) return -1;
    if (s->logits_rows != LOGITS_LAST) {
        forward_end(m, s);
        return 0;
    }
    /* each sequence's last row only: the rows moved to the front (row k from rows[k] ≥ k, in ascending k, so no row
       is overwritten before it moves), their logits computed, then put back at their rows in descending k */
    int dim = m->config.dim, k = 0, rows[n_seqs];
    size_t V = (size_t)m->config.vocab_size;
    for (int j = 0, row = 0; j < n_seqs; row += seqs[j].n, j++)
        if (seqs[j].n) rows[k++] = row + seqs[j].n - 1;
    for (int i = 0; i < k; i++)
        if (rows[i] != i) memcpy(s->x + (size_t)i * dim, s->x + (size_t)rows[i] * dim, (size_t)dim * sizeof(float));
    s->n = k;
    s->logits_rows = LOGITS_ALL;
    forward_end(m, s);
    s->n = n;
    s->logits_rows = LOGITS_LAST;
    for (int i = k - 1; i >= 0; i--)
        if (rows[i] != i) memcpy(s->logits + (size_t)rows[i] * V, s->logits + (size_t)i * V, V * sizeof(float));
    return 0;
}

int forward(Model *m, RunState *s, KVCache *cache, int token, int pos) {
    return forward_chunk(m, s, cache, &token, 1, pos);
}

int forward_prefill(Model *m, RunState *s, KVCache *cache, const int *ids, size_t n, int pos, int chunk) {
    if (chunk > s->n_max) chunk = s->n_max;
    int rows = s->logits_rows;
    for (size_t i = 0; i < n; i += (size_t)chunk) {
        int nt = n - i < (size_t)chunk ? (int)(n - i) : chunk;
        /* only the prompt's last token's logits (none when the caller asked for none: a prompt fed in pieces) */
        s->logits_rows = i + (size_t)nt < n || rows == LOGITS_NONE ? LOGITS_NONE : LOGITS_LAST;
        int rc = forward_chunk(m, s, cache, ids + i, nt, pos + (int)i);
        s->logits_rows = rows;
        if (rc) return -1;
    }
    /* forward_chunk left the last chunk's logits in rows: the next token is predicted by its last row */
    int last = n ? (int)((n - 1) % (size_t)chunk) : 0;
    if (last) memmove(s->logits, s->logits + (size_t)last * m->config.vocab_size,
                      (size_t)m->config.vocab_size * sizeof(float));
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Sampling
 * ------------------------------------------------------------------------------------------------------------- */

static float rand_f32(uint64_t *state) { return (splitmix64(state) >> 40) * (1.0f / 16777216.0f); }  /* [0,1) */

float scan_max(const float *x, int n) {
    float mx = x[0];
    int i = 1;
#ifdef __AVX512F__
    /* 16 lanes, each x[0] then the rule over its own elements (maxps(a, b) is a > b ? a : b), then the lanes by the
       rule: the same maximum (a NaN is skipped either way; only which zero, +0 or -0, could differ) */
    __m512 mv = _mm512_set1_ps(x[0]);
    for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(_mm512_loadu_ps(x + i), mv);
    float lane[16];
    _mm512_storeu_ps(lane, mv);
    for (int k = 0; k < 16; k++) mx = lane[k] > mx ? lane[k] : mx;
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

int sample_argmax(const float *logits, int n) {
    if (n < 1) return 0;
    float mx = scan_max(logits, n);
    if (mx != mx) return 0;   /* logits[0] is NaN: nothing is greater */
    int i = 0;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(logits + i), mv, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
#endif
    for (; i < n; i++)
        if (logits[i] == mx) return i;
    return 0;
}

typedef struct { float p; int i; } ProbIndex;
static int cmp_prob_desc(const void *a, const void *b) {
    const ProbIndex *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->i - y->i;   /* ties by id: the order never depends on qsort's internals */
}

int sampler_init(Sampler *sp, int vocab_size, float temperature, float topp, uint64_t seed) {
    sp->vocab_size = vocab_size;
    sp->temperature = temperature;
    sp->topp = topp;
    sp->rng = seed;
    sp->probindex = malloc((size_t)vocab_size * sizeof(ProbIndex));
    return sp->probindex ? 0 : -1;
}
void sampler_free(Sampler *sp) { free(sp->probindex); }

/* Greedy at temperature 0; otherwise softmax(logits / T), then top-p: the smallest set of most likely tokens whose
 * mass is >= p (Holtzman et al. 2019), renormalized. Modifies logits. */
int sample(Sampler *sp, float *logits) {
    int n = sp->vocab_size;
    if (sp->temperature == 0.0f) return sample_argmax(logits, n);
    float mx = logits[0];
    for (int i = 1; i < n; i++) if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (int i = 0; i < n; i++) { logits[i] = expf((logits[i] - mx) / sp->temperature); sum += logits[i]; }
    ProbIndex *pi = sp->probindex;
    for (int i = 0; i < n; i++) { pi[i].p = (float)(logits[i] / sum); pi[i].i = i; }
    qsort(pi, (size_t)n, sizeof *pi, cmp_prob_desc);
    int last = n - 1;
    double cum = 0;
    if (sp->topp < 1.0f)
        for (int i = 0; i < n; i++) { cum += pi[i].p; if (cum >= sp->topp) { last = i; break; } }
    double mass = 0;
    for (int i = 0; i <= last; i++) mass += pi[i].p;
    double r = rand_f32(&sp->rng) * mass, acc = 0;
    for (int i = 0; i <= last; i++) { acc += pi[i].p; if (r < acc) return pi[i].i; }
    return pi[last].i;
}

static void ids_append_text(IdList *l, const Model *m, const char *text) {
    int *ids;
    size_t n;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, strlen(text), 0, &ids, &n, err, sizeof err))
        fatal("tokenizer: %s", err);
    for (size_t i = 0; i < n; i++) ids_push(l, ids[i]);
    free(ids);
}

/* ---------------------------------------------------------------------------------------------------------------
 * -kvlog: one JSON line per cache event, in every mode that runs a cache
 * ------------------------------------------------------------------------------------------------------------- */

/* Evictions: the evicted token (position, id, text), the policy's score and reason. Merges: the merged slot's
 * positions first_pos..pos and how many slots became one (pool), or the victim's position, the position of the kept
 * slot it was merged into and their keys' cosine (merge=1). Recodes: the token that moved down a precision band and
 * its storage form there. */
static void kvlog_event(void *ctx, const KVEvent *ev) {
    KVLog *lg = ctx;
    const IdList *st = lg->stream;
    int known = st && ev->pos >= 0 && (size_t)ev->pos < st->n;
    char piece[2 * TOKDEC_OUT_MAX + 8] = "";
    if (lg->m->has_tokenizer && known) {
        TokenDecoder d;
        tokdec_init(&d, &lg->m->tokenizer);
        size_t n = tokdec_push(&d, st->ids[ev->pos], piece, sizeof piece - 8);
        n += tokdec_flush(&d, piece + n, sizeof piece - 8 - n);
        piece[n] = 0;
    }
    static const char *const names[] = {"evict", "merge", "recode"};
    Line *l = &lg->line;
    line_printf(l, "{\"kv\":\"");
    line_json_str(l, lg->cache->spec.text);
    line_printf(l, "\",\"event\":\"%s\",", names[ev->kind]);
    if (lg->doc >= 0) line_printf(l, "\"doc\":%d,", lg->doc);
    line_printf(l, "\"step\":%d,\"layer\":%d,\"kv_head\":%d,", ev->pos_now, ev->layer, ev->kv_head);
    if (ev->kind == KV_EV_EVICT) {
        line_printf(l, "\"evicted_pos\":%d,", ev->pos);
        if (ev->pos0 != ev->pos) line_printf(l, "\"first_pos\":%d,", ev->pos0);   /* a merged slot */
    }
    else if (ev->kind == KV_EV_MERGE && ev->into >= 0)   /* merge-on-evict: the victim and the kept slot it joined */
        line_printf(l, "\"pos\":%d,\"into\":%d,\"cosine\":%.9g,", ev->pos, ev->into, ev->score);
    else if (ev->kind == KV_EV_MERGE) line_printf(l, "\"pos\":%d,\"first_pos\":%d,\"merged\":%d,", ev->pos, ev->pos0, ev->n);
    else line_printf(l, "\"pos\":%d,\"band\":%d,\"ktype\":\"%s\",\"vtype\":\"%s\",", ev->pos, ev->band,
                     kv_type_names[ev->ktype], kv_type_names[ev->vtype]);
    line_printf(l, "\"token_id\":%d,\"token\":\"", known ? st->ids[ev->pos] : -1);
    line_json_str(l, piece);
    if (ev->kind == KV_EV_EVICT) line_printf(l, "\",\"score\":%.9g,\"reason\":\"%s\"}\n", ev->score, ev->reason);
    else line_printf(l, "\"}\n");
    outfile_line(lg->out, l);
}

void kvlog_attach(KVLog *lg, OutFile *out, const Model *m, const IdList *stream, KVCache *c) {
    memset(lg, 0, sizeof *lg);
    lg->out = out;
    lg->m = m;
    lg->stream = stream;
    lg->cache = c;
    lg->doc = -1;
    c->on_event = kvlog_event;
    c->event_ctx = lg;
}

/* The engine state of one generation: model, cache, sampler, the token stream so far. */
typedef struct {
    Model *m;
    RunState s;
    KVCache cache;
    Sampler sampler;
    IdList stream;     /* every token fed so far, by position */
    int pos;           /* next position */
    int capacity;      /* tokens the cache can ever hold (full), or INT_MAX for evicting policies */
    OutFile kvlog_file;
    KVLog kvlog;
    TokenDecoder dec;
    int print_ids;
    int verbose;       /* -v: also print each prompt's ids */
    uint64_t seed;
    double t_prompt, t_decode;
    uint64_t dec_bytes_read;   /* KV bytes attention read in decode steps (the cache's second axis) */
    long dec_steps;
    int n_prompt, n_gen;
} Session;



int run_context(const Model *m, const Options *o) {
    if (o->ctx) return o->ctx;
    int trained = m->config.seq_len;
    int capped = !strcmp(o->mode, "passkey") || !strcmp(o->mode, "task") || !strcmp(o->mode, "bench");
    return capped ? (trained < 2048 ? trained : 2048) : trained;
}

static void session_init(Session *se, Model *m, const Options *o, uint64_t seed) {
    memset(se, 0, sizeof *se);
    se->m = m;
    se->seed = seed;
    const Config *c = &m->config;
    int ctx = run_context(m, o);
    char err[512];
    KVSpec spec;
    if (kv_spec_parse(&spec, o->n_kv ? o->kv[0] : "full", o->kvt, err, sizeof err) ||
        kv_spec_check_mode(&spec, o->mode, err, sizeof err))
        fatal("-kv: %s", err);
    KVShape shape = model_kv_shape(m, ctx);
    /* ragged lanes when the driver chose them (duo's full lanes, from -calib), else the budget for every lane */
    if (kv_cache_init_lanes(&se->cache, &shape, &spec, o->n_kv ? o->kv_caps[0] : NULL, err, sizeof err))
        fatal("%s", err);
    se->capacity = kv_capacity(&se->cache);
    if (state_init_chunk(&se->s, c, PREFILL_CHUNK) || sampler_init(&se->sampler, c->vocab_size, o->temperature, o->topp, seed))
        fatal("out of memory");
    se->kvlog_file = (OutFile)OUTFILE_NONE;
    if (o->kvlog) {
        outfile_open(&se->kvlog_file, "-kvlog", o->kvlog, 0);
        kvlog_attach(&se->kvlog, &se->kvlog_file, m, &se->stream, &se->cache);
    }
    if (m->has_tokenizer) tokdec_init(&se->dec, &m->tokenizer);
    se->print_ids = o->print_ids || !m->has_tokenizer;
    se->verbose = o->verbose;
}

static void session_free(Session *se) {
    outfile_close(&se->kvlog_file);
    line_free(&se->kvlog.line);
    kv_cache_free(&se->cache);
    state_free(&se->s);
    sampler_free(&se->sampler);
    free(se->stream.ids);
}

/* Feed one token at the next position. Returns 0, or -1 when the cache is full (full past -c). */
static int session_feed(Session *se, int token) {
    if (se->pos >= se->capacity) return -1;
    ids_push(&se->stream, token);
    if (forward(se->m, &se->s, &se->cache, token, se->pos)) { se->stream.n--; return -1; }
    se->pos++;
    return 0;
}

/* Generated text goes to stdout without its control bytes (a model can emit ESC sequences or a bell): every byte
 * below 0x20 but tab, newline and carriage return, and DEL, is dropped, as llama2.c's safe_printf drops unprintable
 * single-byte pieces. -ids and -m detokenize give the exact ids and bytes. */
static void emit_text(const char *buf, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)buf[i];
        if ((c >= 0x20 && c != 0x7f) || c == '\t' || c == '\n' || c == '\r') putchar(c);
    }
    fflush(stdout);
}
static void emit_token(Session *se, int id) {
    if (se->print_ids) { printf("%d ", id); fflush(stdout); return; }
    char buf[TOKDEC_OUT_MAX];
    emit_text(buf, tokdec_push(&se->dec, id, buf, sizeof buf));
}
static void emit_flush(Session *se) {
    if (!se->print_ids) {
        char buf[TOKDEC_OUT_MAX];
        emit_text(buf, tokdec_flush(&se->dec, buf, sizeof buf));
    }
    printf("\n");
    fflush(stdout);
}

/* Generation ends at EOS, end of turn, the chat format's closing id, and BOS: a BOS the model generates starts a new
 * text (llama2.c stops there too); on an ids-only model BOS is llama2.c's id 1. */
static int is_stop(const Model *m, int id, int extra_stop) {
    if (!m->has_tokenizer) return id == 1;
    return id == m->tokenizer.eos_id || id == m->tokenizer.eot_id || (m->tokenizer.bos_id >= 0 && id == m->tokenizer.bos_id)
           || (extra_stop >= 0 && id == extra_stop);
}

/* How a generation ended. */
enum { GEN_DONE = 0, GEN_FULL, GEN_SIGNAL, GEN_NO_ROOM };

/* Prefill the prompt ids, then sample up to `steps` tokens (or until a stop id, a full cache or SIGINT/SIGTERM),
 * printing them. feed_last: also feed the last sampled token, so the cache holds the whole answer (chat continues
 * from it). Returns GEN_*; GEN_NO_ROOM (the prompt does not fit under full or snapkv, said on stderr) runs nothing. */
static int session_generate(Session *se, const IdList *prompt, int steps, int extra_stop, int feed_last) {
    if (se->capacity != INT_MAX && (size_t)se->pos + prompt->n > (size_t)se->capacity) {
        fprintf(stderr, "run: the prompt needs %zu more tokens but the cache holds %d (-c) under '%s', %d of them "
                "used; use a larger -c or an evicting policy\n", prompt->n, se->capacity, se->cache.spec.text, se->pos);
        return GEN_NO_ROOM;
    }
    if (se->verbose) {
        fprintf(stderr, "run: prompt ids (%zu):", prompt->n);
        for (size_t i = 0; i < prompt->n; i++) fprintf(stderr, " %d", prompt->ids[i]);
        fprintf(stderr, "\n");
    }
    double t0 = now_s();
    kv_set_prompt_len(&se->cache, se->pos + (int)prompt->n);   /* snapkv compresses at the end of the first prompt */
    /* batched prefill (bit-identical to feeding the tokens one by one); the stream first, for -kvlog's text */
    for (size_t i = 0; i < prompt->n; i++) ids_push(&se->stream, prompt->ids[i]);
    if (forward_prefill(se->m, &se->s, &se->cache, prompt->ids, prompt->n, se->pos, PREFILL_CHUNK))
        fatal("the prompt needs more than the %d tokens the cache holds (-c); use a larger -c or an evicting policy",
              se->capacity);
    se->pos += (int)prompt->n;
    se->n_prompt += (int)prompt->n;
    double t1 = now_s();
    se->t_prompt += t1 - t0;
    int end = run_signal ? GEN_SIGNAL : GEN_DONE;
    uint64_t read0 = se->cache.bytes_read;
    long steps0 = se->cache.steps_read;
    for (int k = 0; k < steps && end == GEN_DONE; k++) {
        int next = sample(&se->sampler, se->s.logits);
        if (is_stop(se->m, next, extra_stop)) {
            if (next == (se->m->has_tokenizer ? se->m->tokenizer.bos_id : 1))
                fprintf(stderr, "\nrun: the model generated BOS (id %d), the start of a new text: generation stopped\n",
                        next);
            break;
        }
        emit_token(se, next);
        se->n_gen++;
        if (k + 1 == steps && !feed_last) break;
        if (session_feed(se, next)) end = GEN_FULL;
        else if (run_signal) end = GEN_SIGNAL;
    }
    se->t_decode += now_s() - t1;
    se->dec_bytes_read += se->cache.bytes_read - read0;
    se->dec_steps += se->cache.steps_read - steps0;
    emit_flush(se);
    if (end == GEN_FULL) fprintf(stderr, "run: the cache is full (%d tokens, -c): generation stopped\n", se->capacity);
    if (end == GEN_SIGNAL) fprintf(stderr, "run: %s: generation stopped\n", run_signal_name(run_signal));
    return end;
}

static void print_summary(Session *se, const Options *o) {
    KVBytes b = kv_bytes(&se->cache);
    char dev[256];
    attn_dev_describe(&se->cache, dev, sizeof dev);
    if (se->cache.backend == KV_BACKEND_REF) snprintf(dev, sizeof dev, "device ref (kv_attend_ref)");
    if (o->verbose) {
        const KVShape *sh = &se->cache.shape;
        fprintf(stderr, "layer  KiB allocated  KiB live  live slots per kv head (peak)\n");
        for (int l = 0; l < sh->n_layers; l++) {
            size_t alloc = 0, live = 0;
            for (int g = 0; g < sh->n_kv_heads; g++) {
                KVBytes lb = kv_lane_bytes(&se->cache, l, g);
                alloc += lb.total_alloc;
                live += lb.total_live;
            }
            fprintf(stderr, "%5d %14.1f %9.1f ", l, alloc / 1024.0, live / 1024.0);
            for (int g = 0; g < sh->n_kv_heads; g++) {
                const KVLane *ln = &se->cache.lanes[l * sh->n_kv_heads + g];
                fprintf(stderr, " %d (%d)", ln->n_live, ln->peak_live);
            }
            fprintf(stderr, "\n");
        }
        fprintf(stderr, "KV bytes: vectors %zu alloc / %zu live, metadata %zu alloc / %zu live, evictions %d\n",
                b.vec_alloc, b.vec_live, b.meta_alloc, b.meta_live, se->cache.n_evictions);
    }
    double tps = se->n_gen > 1 && se->t_decode > 0 ? (se->n_gen - 1) / se->t_decode : 0;
    fprintf(stderr, "prompt %d tok (%.1f tok/s), generated %d tok, %.2f tok/s, kv %s budget %d: %.2f MiB allocated "
            "(formula 2*L*kvh*hd*tokens*bytes = %.2f MiB), %.2f MiB live, peak %.2f MiB, read %.3f MiB per decode step, "
            "moved %.3f MiB; peak RSS %.1f MiB; %s\n",
            se->n_prompt, se->t_prompt > 0 ? se->n_prompt / se->t_prompt : 0, se->n_gen, tps, se->cache.spec.text,
            se->cache.policy.budget, b.total_alloc / 1048576.0, b.formula_alloc / 1048576.0, b.total_live / 1048576.0,
            b.peak_live / 1048576.0, se->dec_steps ? (double)se->dec_bytes_read / se->dec_steps / 1048576.0 : 0,
            se->cache.bytes_moved / 1048576.0, peak_rss_kib() / 1024.0, dev);
    if (se->cache.tiers) {   /* over every token the cache saw, prompt and generated */
        long steps = se->cache.steps_read;
        double cs = steps ? (se->t_prompt + se->t_decode) / steps : 0;
        KVTierFigures x = kv_tier_figures(&se->cache.tier, NULL, steps, cs, o->link_gbs * 1e9);
        char buf[512];
        kv_tier_line(buf, sizeof buf, &se->cache, &x, cs);
        fprintf(stderr, "memory tiers (modelled, every token; the slow tier's link at %g GB/s): %s\n", o->link_gbs, buf);
    }
}


/* The chat formats kvlab renders, chosen from the model's chat template text. */
typedef enum { CHAT_NONE, CHAT_CHATML, CHAT_LLAMA2, CHAT_LLAMA3 } ChatFormat;

static ChatFormat chat_format(const Model *m) {
    const char *t = m->tokenizer.chat_template;
    if (!t) return CHAT_NONE;
    if (strstr(t, "<|im_start|>")) return CHAT_CHATML;
    if (strstr(t, "<|start_header_id|>")) return CHAT_LLAMA3;
    if (strstr(t, "[INST]")) return CHAT_LLAMA2;
    return CHAT_NONE;
}

/* The default system prompt a ChatML template inserts when the conversation has none (SmolLM2's does), read from
 * the template text: the literal after "<|im_start|>system\n" up to "<|im_end|>". Written to buf; 0 if none. */
static int chatml_default_system(const Model *m, char *buf, size_t cap) {
    const char *t = m->tokenizer.chat_template, *key = "<|im_start|>system\n";
    const char *s = t ? strstr(t, key) : NULL;
    if (!s) return 0;
    s += strlen(key);
    const char *e = strstr(s, "<|im_end|>");
    if (!e || (size_t)(e - s) >= cap || memchr(s, '{', (size_t)(e - s))) return 0;
    memcpy(buf, s, (size_t)(e - s));
    buf[e - s] = 0;
    return 1;
}

/* Append one user turn (and, first, the system turn) in the model's chat format, ending where the assistant's
 * answer begins. The turn is rendered as the template's text and encoded whole with special tokens recognized
 * (tokenizer_encode_special), as llama.cpp tokenizes a rendered chat: a user text that starts with "\n\n" is then
 * tokenized together with the "\n" before it, and marker text inside a message becomes the marker, as there.
 * Returns the id that ends the assistant's turn (-1 if only EOS does). */
static void chat_render_text(Line *tl, int *bos_out, const char **end_out, ChatFormat fmt, const char *system,
                             const char *user, int first) {
    const char *end_marker = NULL;
    int bos = 0;   /* Llama 3 opens the conversation with BOS, Llama 2 every turn */
    Line t = {0};
    switch (fmt) {
    case CHAT_CHATML:
        if (first && system) line_printf(&t, "<|im_start|>system\n%s<|im_end|>\n", system);
        line_printf(&t, "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n", user);
        end_marker = "<|im_end|>";
        break;
    case CHAT_LLAMA3:
        bos = first;
        if (first && system) line_printf(&t, "<|start_header_id|>system<|end_header_id|>\n\n%s<|eot_id|>", system);
        line_printf(&t, "<|start_header_id|>user<|end_header_id|>\n\n%s<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", user);
        end_marker = "<|eot_id|>";
        break;
    case CHAT_LLAMA2:   /* <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST]: Llama 2's chat format */
        bos = 1;
        if (first && system) line_printf(&t, "[INST] <<SYS>>\n%s\n<</SYS>>\n\n%s [/INST]", system, user);
        else line_printf(&t, "[INST] %s [/INST]", user);
        break;
    default: fatal("the model has no chat template kvlab knows (ChatML, Llama 2, Llama 3); use -m generate");
    }
    *tl = t;
    *bos_out = bos;
    *end_out = end_marker;
}

static int chat_render(IdList *l, const Model *m, ChatFormat fmt, const char *system, const char *user, int first) {
    Line t;
    int bos;
    const char *end_marker;
    chat_render_text(&t, &bos, &end_marker, fmt, system, user, first);
    int *ids;
    size_t n;
    char err[256];
    if (tokenizer_encode_special(&m->tokenizer, (const unsigned char *)t.s, t.n, bos && m->tokenizer.bos_id >= 0, &ids,
                                 &n, err, sizeof err))
        fatal("tokenizer: %s", err);
    for (size_t i = 0; i < n; i++) ids_push(l, ids[i]);
    free(ids);
    line_free(&t);
    if (!end_marker) return -1;
    int stop = tokenizer_find(&m->tokenizer, end_marker);
    if (stop < 0) fatal("the model's vocabulary has no token '%s' that its chat format needs", end_marker);
    return stop;
}

int chat_prompt_text(Line *t, int *bos, int *stop, const Model *m, const char *system, const char *user, int first) {
    ChatFormat fmt = chat_format(m);
    if (fmt == CHAT_NONE) return -1;
    char sysbuf[1024];
    if (!system && fmt == CHAT_CHATML && chatml_default_system(m, sysbuf, sizeof sysbuf)) system = sysbuf;
    const char *end_marker;
    Line turn;
    chat_render_text(&turn, bos, &end_marker, fmt, system, user, first);
    *t = (Line){0};
    /* a later turn first closes the assistant's answer as run_chat does: ChatML "<|im_end|>\n", Llama 3 "<|eot_id|>" */
    if (!first && end_marker) line_printf(t, "%s%s", end_marker, fmt == CHAT_CHATML ? "\n" : "");
    line_printf(t, "%s", turn.s);
    line_free(&turn);
    *bos = *bos && m->tokenizer.bos_id >= 0;
    *stop = end_marker ? tokenizer_find(&m->tokenizer, end_marker) : -1;
    if (end_marker && *stop < 0) fatal("the model's vocabulary has no token '%s' that its chat format needs", end_marker);
    return 0;
}

/* The start line on stderr: model shape, the resolved policy and budget, seed, threads. */
static void print_start(const Session *se, const Options *o) {
    const Config *c = &se->m->config;
    char kvdesc[512];
    kv_describe(&se->cache, kvdesc, sizeof kvdesc);
    run_job_start();
    int th = run_threads();
    fprintf(stderr, "run: %s: dim %d, %d layers, %d/%d heads, head_dim %d, vocab %d, ctx %d, RoPE theta %g, RMSNorm "
            "eps %g; kv %s; seed %llu; %d thread%s\n", o->model_path, c->dim, c->n_layers, c->n_heads, c->n_kv_heads,
            c->head_dim, c->vocab_size, c->seq_len, c->rope_theta, c->norm_eps, kvdesc, (unsigned long long)se->seed, th,
            th == 1 ? "" : "s");
}

/* Chat turns until stdin ends (or one with -i). Returns how the last generation ended (GEN_*). */
static int run_chat(Session *se, const Options *o) {
    const Model *m = se->m;
    ChatFormat fmt = chat_format(m);
    if (fmt == CHAT_NONE) fatal("the model has no chat template kvlab knows (ChatML, Llama 2, Llama 3); use -m generate");
    char sysbuf[1024];
    const char *system = o->system;
    if (!system && fmt == CHAT_CHATML && chatml_default_system(m, sysbuf, sizeof sysbuf)) system = sysbuf;
    char line[8192];
    int interactive = isatty(fileno(stdin));
    print_start(se, o);
    int end = GEN_DONE;
    for (int turn = 0; !run_signal; turn++) {
        const char *user;
        if (turn == 0 && o->prompt) user = o->prompt;
        else {
            if (interactive) { fprintf(stderr, "user> "); fflush(stderr); }
            if (!fgets(line, sizeof line, stdin)) break;   /* end of input, or a signal (no SA_RESTART) */
            line[strcspn(line, "\n")] = 0;
            user = line;
        }
        IdList ids = {0};
        int stop = chat_render(&ids, m, fmt, system, user, turn == 0);
        if (interactive) { fprintf(stderr, "assistant> "); fflush(stderr); }
        /* -n 0: up to the end of the context (the last generated position -c - 1), as in generate, over all turns */
        int ctx = run_context(m, o), left = ctx - se->pos - (int)ids.n + 1;
        int steps = o->steps ? o->steps : se->capacity != INT_MAX ? INT_MAX : left > 1 ? left : 1;
        end = session_generate(se, &ids, steps, stop, 1);
        free(ids.ids);
        /* close the assistant's turn in the cache as the template renders it: ChatML "<|im_end|>\n", Llama 3
           "<|eot_id|>" (Llama 2 closes with EOS, which the next turn's BOS follows) */
        if (end == GEN_DONE && stop >= 0) {
            IdList close = {0};
            ids_push(&close, stop);
            if (fmt == CHAT_CHATML) ids_append_text(&close, m, "\n");
            for (size_t i = 0; i < close.n && end == GEN_DONE; i++) if (session_feed(se, close.ids[i])) end = GEN_FULL;
            free(close.ids);
        }
        if (end != GEN_DONE || o->prompt) break;   /* -i: one question, one answer; without it, turns come from stdin */
    }
    if (run_signal && end == GEN_DONE) {
        fprintf(stderr, "run: %s: chat stopped\n", run_signal_name(run_signal));
        end = GEN_SIGNAL;
    }
    return end;
}

/* Returns how the generation ended (GEN_*). */
static int run_generate(Session *se, const Options *o) {
    const Model *m = se->m;
    IdList prompt = {0};
    char err[256];
    if (!m->has_tokenizer) {
        /* ids-only model: -i takes ids; BOS is llama2.c's id 1 */
        if (o->add_bos) ids_push(&prompt, 1);
        if (o->prompt && ids_parse_into(o->prompt, m->config.vocab_size, &prompt, err, sizeof err))
            fatal("-i on an ids-only model takes token ids: %s", err);
        if (prompt.n == 0) ids_push(&prompt, 1);   /* no -i, or -i "": generation starts from BOS */
    } else {
        int bos = m->tokenizer.add_bos || o->add_bos;
        if (bos && m->tokenizer.bos_id >= 0) ids_push(&prompt, m->tokenizer.bos_id);
        if (o->prompt) ids_append_text(&prompt, m, o->prompt);
        if (prompt.n == 0) {
            if (m->tokenizer.bos_id < 0) fatal("empty prompt and the model has no BOS token: give a prompt with -i");
            ids_push(&prompt, m->tokenizer.bos_id);
        }
    }
    if (se->capacity != INT_MAX && prompt.n > (size_t)se->capacity)
        fatal("the prompt is %zu tokens, longer than the context of %d tokens (-c) under '%s'", prompt.n,
            se->capacity, se->cache.spec.text);
    print_start(se, o);
    /* -n 0: up to the context (-c). A non-evicting cache runs until it is full and says so; an evicting one stops
       when the last position it generates is -c - 1 (the token sampled there needs no slot) */
    int ctx = run_context(m, o);
    int steps = o->steps ? o->steps : se->capacity != INT_MAX ? INT_MAX
                                    : (ctx > (int)prompt.n ? ctx - (int)prompt.n + 1 : 1);
    int end = session_generate(se, &prompt, steps, -1, 0);
    free(prompt.ids);
    return end;
}

int run_generate_chat(Model *m, const Options *o, int cuda) {
    Session se;
    char err[512];
    session_init(&se, m, o, o->seed_set ? o->seed : seed_fresh());
    if (!strcmp(o->device, "ref")) kv_set_backend(&se.cache, KV_BACKEND_REF);   /* -d ref: attention by definition */
    if (cuda && attn_dev_attach(&se.cache, err, sizeof err)) {
        if (!strcmp(o->device, "cuda")) fatal("-d cuda: %s", err);
        run_note("%s: attention runs on the CPU", err);
    }
    int end = !strcmp(o->mode, "chat") ? run_chat(&se, o) : run_generate(&se, o);
    print_summary(&se, o);
    attn_dev_detach(&se.cache);
    session_free(&se);
    return end == GEN_SIGNAL ? 128 + run_signal : end == GEN_NO_ROOM ? EXIT_FAILURE : 0;
}
