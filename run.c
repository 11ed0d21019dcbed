/* run.c: load a model.bin (mmap + validation), run the Llama forward pass with a KV-cache policy, sample, and drive
 * the generate / chat / tokenize / detokenize modes from the command line.
 * The cache and its policies live behind kv.h; evaluation modes (ppl, passkey, bench) live in eval.c.
 * It deliberately reads no foreign format (that is export.c) and batches nothing in decode: one token at a time.
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, kv_dim (= n_kv_heads * head_dim),
 * q_dim (= n_heads * head_dim), vocab_size, seq_len. Indices: l layer, h head, t position, i row.
 */
#include "run.h"
#include "attn.h"
#include "quant.h"
#include "exp_neg.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

int run_errorf(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}
#define errorf run_errorf

/* ---------------------------------------------------------------------------------------------------------------
 * Loading model.bin (docs/FORMAT.md). Every size in the header is checked against the file length before use.
 * ------------------------------------------------------------------------------------------------------------- */

static uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static int32_t rd_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static float rd_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

size_t matrix_bytes(int wtype, size_t rows, size_t cols) {
    return wtype == WTYPE_Q8 ? rows * (cols / Q8_GROUP) * sizeof(BlockQ8) : rows * cols * sizeof(float);
}

/* Bytes of the weight section a config implies (FORMAT.md's order, each tensor 64-byte aligned). */
static size_t weights_bytes_for(const Config *c) {
    size_t d = c->dim, hd = c->head_dim, q = (size_t)c->n_heads * hd, kv = (size_t)c->n_kv_heads * hd, f = 4;
    size_t h = c->hidden_dim;
    int t = c->wtype;
    size_t per_layer = align64(d * f) + align64(matrix_bytes(t, q, d)) + 2 * align64(matrix_bytes(t, kv, d))
                       + align64(matrix_bytes(t, d, q)) + align64(d * f) + 2 * align64(matrix_bytes(t, h, d))
                       + align64(matrix_bytes(t, d, h));
    size_t b = align64((size_t)c->vocab_size * d * f) + (c->has_rope_factors ? align64(hd / 2 * f) : 0)
               + (size_t)c->n_layers * per_layer + align64(d * f);
    if (!c->tied) b += align64(matrix_bytes(t, c->vocab_size, d));
    return b;
}

int model_parse(Model *m, const uint8_t *data, size_t size, char *err, size_t errlen) {
    if (size < MODEL_HEADER_BYTES)
        return errorf(err, errlen, "file is %zu bytes, shorter than the %d-byte model.bin header", size,
                      MODEL_HEADER_BYTES);
    if (rd_u32(data) != MODEL_MAGIC)
        return errorf(err, errlen, "not a kvlab model.bin (magic 0x%08x, expected 0x%08x); convert with ./export",
                      rd_u32(data), MODEL_MAGIC);
    if (rd_u32(data + 4) != MODEL_VERSION)
        return errorf(err, errlen, "model.bin version %u is not supported (this build reads version %d); re-export",
                      rd_u32(data + 4), MODEL_VERSION);
    Config *c = &m->config;
    c->dim = rd_i32(data + 8);
    c->hidden_dim = rd_i32(data + 12);
    c->n_layers = rd_i32(data + 16);
    c->n_heads = rd_i32(data + 20);
    c->n_kv_heads = rd_i32(data + 24);
    c->head_dim = rd_i32(data + 28);
    c->vocab_size = rd_i32(data + 32);
    c->seq_len = rd_i32(data + 36);
    c->rope_pairing = rd_i32(data + 40);
    c->tied = rd_i32(data + 44);
    c->wtype = rd_i32(data + 48);
    c->has_rope_factors = rd_i32(data + 52);
    c->rope_theta = rd_f32(data + 56);
    c->norm_eps = rd_f32(data + 60);
    uint64_t tok_off = rd_u64(data + 64), tok_bytes = rd_u64(data + 72);
    uint64_t w_off = rd_u64(data + 80), w_bytes = rd_u64(data + 88), file_bytes = rd_u64(data + 96);
    if (file_bytes != size)
        return errorf(err, errlen, "file is %zu bytes but its header says %llu: truncated or corrupt", size,
                      (unsigned long long)file_bytes);
    for (int i = 104; i < MODEL_HEADER_BYTES; i++)
        if (data[i]) return errorf(err, errlen, "reserved header byte %d is not zero: corrupt header", i);
    if (tok_bytes && (tok_off < MODEL_HEADER_BYTES || tok_off > size || tok_bytes > size - tok_off))
        return errorf(err, errlen, "tokenizer section (offset %llu, %llu bytes) lies outside the file",
                      (unsigned long long)tok_off, (unsigned long long)tok_bytes);
    m->tokenizer_section = tok_bytes ? data + tok_off : NULL;
    m->tokenizer_bytes = tok_bytes;
    m->vocab_only = c->n_layers == 0;
    if (m->vocab_only) {
        if (!tok_bytes) return errorf(err, errlen, "model.bin has neither layers nor a tokenizer");
        return 0;
    }
    /* ranges: generous upper bounds that no real Llama reaches, low enough that products cannot overflow size_t */
    struct { const char *name; long v, lo, hi; } f[] = {
        {"dim", c->dim, 1, 1 << 16}, {"hidden_dim", c->hidden_dim, 1, 1 << 18}, {"n_layers", c->n_layers, 1, 1024},
        {"n_heads", c->n_heads, 1, 1024}, {"n_kv_heads", c->n_kv_heads, 1, 1024}, {"head_dim", c->head_dim, 2, 1024},
        {"vocab_size", c->vocab_size, 1, 1 << 22}, {"seq_len", c->seq_len, 1, 1 << 24},
        {"rope_pairing", c->rope_pairing, 0, 1}, {"tied", c->tied, 0, 1}, {"wtype", c->wtype, 0, 1},
        {"has_rope_factors", c->has_rope_factors, 0, 1},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < f[i].lo || f[i].v > f[i].hi)
            return errorf(err, errlen, "header field %s = %ld is out of range [%ld, %ld]", f[i].name, f[i].v,
                          f[i].lo, f[i].hi);
    if (c->n_heads % c->n_kv_heads)
        return errorf(err, errlen, "n_heads %d is not a multiple of n_kv_heads %d", c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2) return errorf(err, errlen, "head_dim %d is odd: RoPE needs pairs", c->head_dim);
    if (!(c->rope_theta > 0 && c->rope_theta < 1e12f))
        return errorf(err, errlen, "rope_theta %g is out of range (0, 1e12)", c->rope_theta);
    if (!(c->norm_eps > 0 && c->norm_eps < 1))
        return errorf(err, errlen, "norm_eps %g is out of range (0, 1)", c->norm_eps);
    if (c->wtype == WTYPE_Q8 && (c->dim % Q8_GROUP || (c->n_heads * c->head_dim) % Q8_GROUP
                                 || c->hidden_dim % Q8_GROUP))
        return errorf(err, errlen, "wtype 1 (q8) needs dim %d, n_heads*head_dim %d and hidden_dim %d to be multiples "
                      "of %d", c->dim, c->n_heads * c->head_dim, c->hidden_dim, Q8_GROUP);
    size_t need = weights_bytes_for(c);
    if (w_bytes != need)
        return errorf(err, errlen, "weight section is %llu bytes but the config needs %zu",
                      (unsigned long long)w_bytes, need);
    if (w_off % 64 || w_off < MODEL_HEADER_BYTES || w_off > size || w_bytes != size - w_off)
        return errorf(err, errlen, "weight section (offset %llu, %llu bytes) lies outside the file or is unaligned "
                      "(it must start on a 64-byte boundary and end the file)",
                      (unsigned long long)w_off, (unsigned long long)w_bytes);
    if (tok_bytes && tok_off + tok_bytes > w_off)
        return errorf(err, errlen, "tokenizer section (offset %llu, %llu bytes) overlaps the weights at %llu",
                      (unsigned long long)tok_off, (unsigned long long)tok_bytes, (unsigned long long)w_off);

    /* carve the weights (FORMAT.md's order) */
    const uint8_t *p = data + w_off;
    size_t d = c->dim, hd = c->head_dim, q = (size_t)c->n_heads * hd, kv = (size_t)c->n_kv_heads * hd;
#define TAKE(n) ((const float *)(p += align64((n) * 4), p - align64((n) * 4)))
#define TAKE_MAT(r, k) ((Matrix){(p += align64(matrix_bytes(c->wtype, (r), (k))), \
                                  p - align64(matrix_bytes(c->wtype, (r), (k)))), c->wtype})
    Weights *w = &m->w;
    w->token_embedding = TAKE((size_t)c->vocab_size * d);
    w->rope_factors = c->has_rope_factors ? TAKE(hd / 2) : NULL;
    w->layers = calloc((size_t)c->n_layers, sizeof(LayerWeights));
    if (!w->layers) return errorf(err, errlen, "out of memory");
    for (int l = 0; l < c->n_layers; l++) {
        LayerWeights *L = &w->layers[l];
        L->attn_norm = TAKE(d);
        L->wq = TAKE_MAT(q, d);
        L->wk = TAKE_MAT(kv, d);
        L->wv = TAKE_MAT(kv, d);
        L->wo = TAKE_MAT(d, q);
        L->ffn_norm = TAKE(d);
        L->w1 = TAKE_MAT((size_t)c->hidden_dim, d);
        L->w2 = TAKE_MAT(d, (size_t)c->hidden_dim);
        L->w3 = TAKE_MAT((size_t)c->hidden_dim, d);
    }
    w->final_norm = TAKE(d);
    w->classifier = c->tied ? (Matrix){w->token_embedding, WTYPE_F32} : TAKE_MAT((size_t)c->vocab_size, d);
#undef TAKE
#undef TAKE_MAT
    if (c->has_rope_factors)
        for (int i = 0; i < c->head_dim / 2; i++)
            if (!(w->rope_factors[i] > 0 && w->rope_factors[i] < 1e6f))
                return errorf(err, errlen, "rope factor %d = %g is not a positive finite number", i, w->rope_factors[i]);
    return 0;
}

int model_open(Model *m, const char *path, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return errorf(err, errlen, "cannot open model '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return errorf(err, errlen, "model '%s' is not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return errorf(err, errlen, "model '%s' is empty", path);
    }
    m->size = (size_t)st.st_size;
    m->data = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m->data == MAP_FAILED) {
        m->data = NULL;
        return errorf(err, errlen, "cannot mmap model '%s': %s", path, strerror(errno));
    }
    char why[400];
    if (model_parse(m, m->data, m->size, why, sizeof why)) {
        model_close(m);
        return errorf(err, errlen, "model '%s': %s", path, why);
    }
    if (m->tokenizer_section) {
        if (tokenizer_init(&m->tokenizer, m->tokenizer_section, m->tokenizer_bytes, why, sizeof why)) {
            model_close(m);
            return errorf(err, errlen, "model '%s': tokenizer: %s", path, why);
        }
        m->has_tokenizer = 1;
        if (!m->vocab_only && m->tokenizer.vocab_size != m->config.vocab_size) {
            model_close(m);
            return errorf(err, errlen, "model '%s': tokenizer has %d tokens but the model's vocab is %d", path,
                          m->tokenizer.vocab_size, m->config.vocab_size);
        }
    }
    return 0;
}

void model_close(Model *m) {
    if (m->has_tokenizer) tokenizer_free(&m->tokenizer);
    free(m->w.layers);
    if (m->data) munmap((void *)m->data, m->size);
    memset(m, 0, sizeof *m);
}

KVShape model_kv_shape(const Model *m, int seq_len) {
    const Config *c = &m->config;
    KVShape s = {c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, seq_len, c->rope_theta, c->rope_pairing,
                 m->w.rope_factors};
    return s;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The forward pass
 * ------------------------------------------------------------------------------------------------------------- */

int state_init_chunk(RunState *s, const Config *c, int n_max) {
    size_t q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t d = (size_t)c->dim > q ? (size_t)c->dim : q, n = (size_t)n_max;
    size_t total = n * (3 * d + 2 * (size_t)c->hidden_dim + q + 2 * kv + q + (size_t)c->vocab_size);
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

/* The matmul kernels. A tile is R weight rows × T tokens (R ≤ 4, T ≤ 4, both constants in each instantiation so the
 * accumulators live in registers): every 8-wide block of a weight row is loaded once per tile and used for T tokens,
 * every block of an x vector once per tile and used for R rows. The tile shape, the thread count and the chunk size
 * decide only which outputs are computed together, never how one is computed: each output has one fixed arithmetic,
 * written down below, so a token's logits are bit-identical in decode (n = 1) and in any chunk, on any thread count,
 * with or without AVX2 (the portable C does the same operations in the same order). */
#define TILE_MAX 4

/* a·b + c: one fused multiply-add where the build has FMA (fmaf becomes the vfmadd instruction, no libm call), else a
 * multiply then an add; a build uses one or the other on all its paths. -std=c11 keeps GCC from contracting a*b+c
 * on its own, so the choice is made here only. */
#ifdef __FMA__
#define madd_f32(a, b, c) fmaf(a, b, c)
#define madd_ps(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define madd_f32(a, b, c) ((a) * (b) + (c))
#define madd_ps(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#endif

/* f32: out = Σ_j w[j]·x[j] as 8 partial sums a_k over j ≡ k (mod 8) in the whole 8-wide blocks (a_k = w·x + a_k by
 * madd_f32, j ascending), then s = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)) (the order of the 256→128→64→32-bit
 * AVX reduction), then the tail j ≥ cols − cols % 8 ascending, s = w[j]·x[j] + s by madd_f32. Eight lanes (one ymm
 * per output) leave room for 16 outputs in the 16 ymm registers; with FMA the sum rounds once per term. */
#ifdef __AVX2__
static inline float hsum8_ps(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));   /* a_k + a_k+4 */
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));                                           /* (a0+a4) + (a2+a6), ... */
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

/* out[t·ld_out + r·ld_r] = W_r · x_t for the tile's R rows (row r at w + r·ldw elements) and T tokens
 * (x: (T, cols)). */
static inline __attribute__((always_inline)) void dot_f32_tile(float *out, size_t ld_out, size_t ld_r,
                                                               const float *w, size_t ldw, const float *x, int R,
                                                               int T, int cols) {
    float a[TILE_MAX][TILE_MAX][8];
    int j = 0;
#ifdef __AVX2__
    __m256 acc[TILE_MAX][TILE_MAX];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (; j + 8 <= cols; j += 8) {
        __m256 wv[TILE_MAX];
        /* the empty asm pins each loaded block in a register: without it GCC reloads it as a memory operand of
         * every multiply-add (R·T + T loads per step instead of R + T), and the loads, not the FMAs, set the pace */
        for (int r = 0; r < R; r++) {
            wv[r] = _mm256_loadu_ps(w + r * ldw + j);
            __asm__("" : "+x"(wv[r]));
        }
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * cols + j);
            __asm__("" : "+x"(xv));
            for (int r = 0; r < R; r++) acc[r][t] = madd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = hsum8_ps(acc[r][t]);
            for (int jj = j; jj < cols; jj++) s = madd_f32(w[r * ldw + jj], x[(size_t)t * cols + jj], s);
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
    (void)a;
#else
    memset(a, 0, sizeof a);
    for (; j + 8 <= cols; j += 8)
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                for (int k = 0; k < 8; k++)
                    a[r][t][k] = madd_f32(w[r * ldw + j + k], x[(size_t)t * cols + j + k], a[r][t][k]);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            const float *v = a[r][t];
            float s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
            for (int jj = j; jj < cols; jj++) s = madd_f32(w[r * ldw + jj], x[(size_t)t * cols + jj], s);
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
#endif
}

/* q8: out = Σ_g dw_g·dx_g·Σ_j qw[j]·qx[j] over the groups of one weight row, the arithmetic tests/test_q8.c writes
 * out: per group, 8 exact int32 sums s_m of 4 consecutive products (values 4m..4m+3), then acc_m += (float)s_m ·
 * (dw·dx) in 8 f32 lanes (a multiply, then an add: no fused multiply-add), then the 8 lanes summed in order 0..7.
 * With AVX2 the int8 products come from vpmaddubsw on |qw| and qx·sign(qw) (each pair sum ≤ 2·127·127 fits int16,
 * as values are in [-127, 127]) and vpmaddwd, whose int32 lane m is exactly s_m; dw·dx is one vmulps of two
 * broadcasts (the same rounding as the scalar product); without AVX2, portable C computes the same sums. */
static inline __attribute__((always_inline)) void dot_q8_tile(float *out, size_t ld_out, size_t ld_r,
                                                              const BlockQ8 *w, size_t ldw, const int8_t *xq,
                                                              const float *xd, int R, int T,
                                                              int n_groups) {
    float acc[TILE_MAX][TILE_MAX][8];
    size_t cols = (size_t)n_groups * Q8_GROUP;
#ifdef __AVX2__
    __m256 va[TILE_MAX][TILE_MAX];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) va[r][t] = _mm256_setzero_ps();
    for (int g = 0; g < n_groups; g++) {
        __m256i qw[TILE_MAX], aw[TILE_MAX];
        __m256 dw[TILE_MAX];
        for (int r = 0; r < R; r++) {
            const BlockQ8 *b = w + r * ldw + g;
            qw[r] = _mm256_loadu_si256((const __m256i *)b->q);
            aw[r] = _mm256_sign_epi8(qw[r], qw[r]);
            __asm__("" : "+x"(qw[r]), "+x"(aw[r]));   /* kept in registers, as the f32 tile's blocks */
#ifdef __F16C__
            dw[r] = _mm256_set1_ps(_cvtsh_ss(b->d));   /* exact, as kv_f16_to_f32 */
#else
            dw[r] = _mm256_set1_ps(kv_f16_to_f32(b->d));
#endif
        }
        for (int t = 0; t < T; t++) {
            __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + t * cols + (size_t)g * Q8_GROUP));
            __m256 dx = _mm256_broadcast_ss(xd + (size_t)t * n_groups + g);
            __asm__("" : "+x"(qx));
            for (int r = 0; r < R; r++) {
                __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(qx, qw[r])), ones);
                __m256 sc = _mm256_mul_ps(dw[r], dx);
                va[r][t] = _mm256_add_ps(va[r][t], _mm256_mul_ps(_mm256_cvtepi32_ps(s32), sc));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) _mm256_storeu_ps(acc[r][t], va[r][t]);
#else
    memset(acc, 0, sizeof acc);
    for (int g = 0; g < n_groups; g++)
        for (int r = 0; r < R; r++) {
            const BlockQ8 *b = w + r * ldw + g;
            float dw = kv_f16_to_f32(b->d);
            for (int t = 0; t < T; t++) {
                const int8_t *qx = xq + t * cols + (size_t)g * Q8_GROUP;
                float sc = dw * xd[(size_t)t * n_groups + g];
                for (int m = 0; m < 8; m++) {
                    int32_t s = 0;
                    for (int k = 0; k < 4; k++) s += (int32_t)b->q[4 * m + k] * qx[4 * m + k];
                    acc[r][t][m] += (float)s * sc;
                }
            }
        }
#endif
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = acc[r][t][0];
            for (int m = 1; m < 8; m++) s += acc[r][t][m];
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
}

/* The quantized activations of a q8 matmul: grown when a larger (n, cols) arrives, kept for the process (no
 * per-token allocation). */
static struct {
    int8_t *q;    /* (n, cols) */
    float *d;     /* (n, cols / 32) scales */
    size_t cap;   /* elements of q */
} act_q8;

/* One tile with R and T turned into constants (a switch over the shapes the loops below produce), so each case is
 * compiled with its accumulators in registers. */
#define TILE_CASE(R, T)                                                                                              \
    case (R) * 8 + (T):                                                                                              \
        if (q8) dot_q8_tile(out, ld_out, ld_r, (const BlockQ8 *)w, ld_r * (cols / Q8_GROUP), xq, xd, R, T,         \
                            cols / Q8_GROUP);                                                                        \
        else dot_f32_tile(out, ld_out, ld_r, (const float *)w, ld_r * cols, x, R, T, cols);                          \
        break;
static void matmul_tile(float *out, size_t ld_out, size_t ld_r, const void *w, const float *x, const int8_t *xq,
                        const float *xd, int q8, int R, int T, int cols) {
    switch (R * 8 + T) {
    TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
    TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
    TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
    TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
    }
}
#undef TILE_CASE

/* Bytes of weight rows a thread works through for every block of tokens before moving on: the panel stays in L2
 * (512 KiB per core) while a block of up to 4 tokens' x (≤ 24 KiB at cols 1536) stays in L1 (32 KiB). */
#define PANEL_BYTES (192 * 1024)
/* rows a decode tile reads at once, each from its own stretch of W: 3 measured fastest (1: 13.3, 2: 8.7-9.7,
 * 3: 8.2, 4: 7.8-8.9 ms per q8 token on one core) */
#define DECODE_STREAMS 3

/* out (n, rows) = x (n, cols) · W (rows, cols)ᵀ: row i of out[t] is W_i · x_t. Each thread takes one contiguous
 * range of rows (whole tiles, so each streams its part of W once per panel pass), cut into panels that stay in L2;
 * a panel is swept once per block of tokens by tiles of rows × tokens. Decode (n = 1) reads DECODE_STREAMS rows
 * per tile, each from its own contiguous stretch of the thread's rows. For q8 weights every x_t is quantized once
 * (groups of 32, f32 scale, quant.h), before the rows. */
void matmul_n(float *out, const float *x, Matrix W, int rows, int cols, int n) {
    int q8 = W.type == WTYPE_Q8;
    if (q8) {
        size_t need = (size_t)n * cols;
        if (need > act_q8.cap) {
            free(act_q8.q);
            free(act_q8.d);
            act_q8.q = malloc(need);
            act_q8.d = malloc(need / Q8_GROUP * sizeof(float));
            if (!act_q8.q || !act_q8.d) fatal("out of memory");
            act_q8.cap = need;
        }
        for (size_t g = 0; g < need / Q8_GROUP; g++)
            act_q8.d[g] = quant_q8_group(act_q8.q + g * Q8_GROUP, x + g * Q8_GROUP);
    }
    size_t row_bytes = matrix_bytes(W.type, 1, cols);
    /* tile shapes (rows × tokens) for chunks, measured on Zen 3: f32 chunks use 3 × 4 (12 accumulators + 3 weight
     * + 1 x register, 16 ymm); q8
     * chunks 2 × 3, whose per-row registers (qw, |qw|, dw) leave room for 6 sums */
    int tr = n == 1 ? 1 : q8 ? 2 : 3, tt = n == 1 ? 1 : q8 ? 3 : 4;
    int panel = (int)(PANEL_BYTES / row_bytes) / tr * tr;
    if (panel < tr) panel = tr;
    /* small matrices stay on one thread: waking the team costs more than the work */
    #pragma omp parallel if ((size_t)rows * cols * n >= 65536)
    {
        int nth = 1, tid = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        int per = ((rows + nth - 1) / nth + tr - 1) / tr * tr;
        int i_end = rows < (tid + 1) * per ? rows : (tid + 1) * per;
        if (n == 1 && tid * per < i_end) {
            /* decode: DECODE_STREAMS rows at a time, taken from equal, contiguous sub-ranges of this thread's rows,
             * so each is one unbroken stream through memory that the prefetchers follow (adjacent rows in one tile
             * break the streams every row and ran ~2x slower) */
            int b = tid * per, h = (i_end - b) / DECODE_STREAMS;
            for (int i = b; i < b + h; i++)
                matmul_tile(out + i, rows, h, (const uint8_t *)W.data + (size_t)i * row_bytes, x, act_q8.q, act_q8.d,
                            q8, DECODE_STREAMS, 1, cols);
            for (int i = b + DECODE_STREAMS * h; i < i_end; i++)
                matmul_tile(out + i, rows, 1, (const uint8_t *)W.data + (size_t)i * row_bytes, x, act_q8.q, act_q8.d,
                            q8, 1, 1, cols);
        } else
        for (int p = tid * per; p < i_end; p += panel) {
            int p_end = i_end < p + panel ? i_end : p + panel;
            /* the next panel comes from memory while this one is swept: a few of its lines are asked for into L2
               after each tile, spread over the sweep (the first sweep of a panel otherwise waits on DRAM) */
            const char *next = (const char *)W.data + (size_t)p_end * row_bytes;
            size_t next_bytes = (size_t)((i_end < p_end + panel ? i_end : p_end + panel) - p_end) * row_bytes;
            size_t tiles = (size_t)((n + tt - 1) / tt) * ((p_end - p + tr - 1) / tr), ahead = 0;
            size_t per_tile = (next_bytes / 64 + tiles - 1) / tiles * 64;
            for (int t = 0; t < n; t += tt) {
                int nt = n - t < tt ? n - t : tt;
                for (int i = p; i < p_end; i += tr) {
                    matmul_tile(out + (size_t)t * rows + i, rows, 1, (const uint8_t *)W.data + (size_t)i * row_bytes,
                                x + (size_t)t * cols, q8 ? act_q8.q + (size_t)t * cols : NULL,
                                q8 ? act_q8.d + (size_t)t * (cols / Q8_GROUP) : NULL, q8,
                                p_end - i < tr ? p_end - i : tr, nt, cols);
                    for (size_t b = 0; b < per_tile && ahead < next_bytes; b += 64, ahead += 64)
                        __builtin_prefetch(next + ahead, 0, 2);
                }
            }
        }
    }
}
void matmul(float *out, const float *x, Matrix W, int rows, int cols) { matmul_n(out, x, W, rows, cols, 1); }

static void timer_add(double *acc, double t0);
double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
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

int forward_layer(Model *m, RunState *s, KVCache *cache, int l) {
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
    t0 = now_s();
    if (!cache->device) {
        if (kv_attend_chunk(cache, s->att, l, s->pos0, n, s->q, s->k, s->v, s->after_attn, s->hook_ctx)) return -1;
    } else
        for (int t = 0; t < n; t++) {   /* the device mirror (attn.cu): same steps, same policy code */
            int pos = s->pos0 + t;
            if (kv_append(cache, l, pos, s->k + (size_t)t * kv_dim, s->v + (size_t)t * kv_dim)) return -1;
            attn_dev_attend(cache, s->att + (size_t)t * q_dim, l, pos, s->q + (size_t)t * q_dim, s->after_attn != NULL);
            if (s->after_attn) s->after_attn(s->hook_ctx, l, cache, pos);
        }
    timer_add(&s->t_attn, t0);
    /* x += Wo · att */
    t0 = now_s();
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

void forward_end(Model *m, RunState *s) {
    const Config *c = &m->config;
    int dim = c->dim;
    for (int t = 0; t < s->n; t++)
        rmsnorm(s->x + (size_t)t * dim, s->x + (size_t)t * dim, m->w.final_norm, dim, c->norm_eps);
    double t0 = now_s();
    matmul_n(s->logits, s->x, m->w.classifier, c->vocab_size, dim, s->n);
    timer_add(&s->t_matmul, t0);
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

int forward(Model *m, RunState *s, KVCache *cache, int token, int pos) {
    return forward_chunk(m, s, cache, &token, 1, pos);
}

int forward_prefill(Model *m, RunState *s, KVCache *cache, const int *ids, size_t n, int pos, int chunk) {
    if (chunk > s->n_max) chunk = s->n_max;
    for (size_t i = 0; i < n; i += (size_t)chunk) {
        int nt = n - i < (size_t)chunk ? (int)(n - i) : chunk;
        if (forward_chunk(m, s, cache, ids + i, nt, pos + (int)i)) return -1;
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

int sample_argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (logits[i] > logits[best]) best = i;
    return best;
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

/* ---------------------------------------------------------------------------------------------------------------
 * Command line (DESIGN.md, CLI). Numbers are parsed strictly: the whole string, in range, or an error.
 * ------------------------------------------------------------------------------------------------------------- */

/* strtol and strtod skip leading white space; a number on the command line has none */
static int starts_like_number(const char *s) { return (*s >= '0' && *s <= '9') || *s == '-' || *s == '+' || *s == '.'; }

int parse_long(const char *s, long lo, long hi, long *out) {
    if (!s || !starts_like_number(s)) return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int parse_float(const char *s, double lo, double hi, double *out) {
    if (!s || !starts_like_number(s)) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}

/* The modes, and which flags each one reads: one table (FLAGS) drives the parser, the per-mode check, -h and
 * README's flag table (./run -h flags prints it; tests/test_flags.sh checks README against it). */
static const char *const MODES[] = {"generate", "chat", "ppl", "passkey", "bench", "tokenize", "detokenize"};
#define N_MODES (int)(sizeof MODES / sizeof *MODES)
enum { M_GEN = 1, M_CHAT = 2, M_PPL = 4, M_PASSKEY = 8, M_BENCH = 16, M_TOK = 32, M_DETOK = 64 };
#define M_ALL 127
#define M_CACHE (M_GEN | M_CHAT | M_PPL | M_PASSKEY | M_BENCH)   /* the modes that run a KV cache */

typedef struct {
    const char *flag, *arg;   /* arg NULL: a switch without a value */
    unsigned modes;           /* M_* bits of the modes that read it */
    const char *help;
} FlagDef;

static const FlagDef FLAGS[] = {
    {"-m", "MODE", M_ALL, "generate (default), chat, ppl, passkey, bench, tokenize, detokenize"},
    {"-i", "TEXT", M_GEN | M_CHAT | M_TOK, "prompt or text (token ids on an ids-only model)"},
    {"-f", "FILE", M_PPL | M_BENCH | M_TOK | M_DETOK,
     "text (ppl: repeatable, one document each; bench: the prompt text, repeated; detokenize: ids)"},
    {"-n", "N", M_GEN | M_CHAT | M_PPL | M_PASSKEY | M_BENCH,
     "generate, chat: tokens to generate, default 256, 0 = up to the context; ppl: score at most N tokens; "
     "passkey: answer tokens, default 8; bench: decode steps, default 32"},
    {"-t", "T", M_GEN | M_CHAT, "temperature, default 1.0, 0 = greedy"},
    {"-p", "P", M_GEN | M_CHAT, "top-p, default 0.9, in (0,1]"},
    {"-s", "SEED", M_GEN | M_CHAT | M_PASSKEY, "seed: sampling (default: fresh each run, printed); passkey: the keys (default 1)"},
    {"-c", "N", M_CACHE, "context: full's cache and the shadow's length, tokens; default: the trained context"},
    {"-y", "TEXT", M_CHAT, "system prompt"},
    {"-kv", "SPEC", M_CACHE, "KV policy NAME[:BUDGET][,key=value...]; repeatable in ppl, passkey, bench (-h policies)"},
    {"-kvt", "TYPE", M_CACHE, "default storage type: f32 (default), f16, bf16, q8, q4"},
    {"-kvlog", "FILE", M_GEN | M_CHAT, "eviction log, JSON lines"},
    {"-d", "DEV", M_CACHE, "cpu or cuda, default cuda when usable (attention only, generate and chat)"},
    {"-o", "FILE", M_PPL | M_PASSKEY | M_BENCH, "results, JSON lines, appended"},
    {"-chunk", "N", M_PPL | M_PASSKEY, "tokens per batched step, default 1 (ppl), 32 (passkey); same results"},
    {"-ppl-mode", "M", M_PPL, "stream (default) or chunked (llama-perplexity's)"},
    {"-tokenlog", "FILE", M_PPL, "per-token NLL and KL per policy, JSON lines (stream mode)"},
    {"-ids", NULL, M_GEN | M_CHAT, "print token ids instead of text"},
    {"-bos", NULL, M_GEN | M_TOK, "add BOS to the prompt or text"},
    {"-v", NULL, M_GEN | M_CHAT, "each prompt's token ids, and per-layer memory and policy detail"},
    {"-h", NULL, M_ALL, "help: -h (this), -h policies (every method, its keys and paper), -h flags (README's table)"},
};
#define N_FLAGS (int)(sizeof FLAGS / sizeof *FLAGS)

/* "generate, chat and tokenize" for a set of M_* bits */
static void modes_list(char *buf, size_t cap, unsigned modes) {
    int n = 0, k = 0;
    for (int i = 0; i < N_MODES; i++) n += (modes >> i) & 1;
    buf[0] = 0;
    for (int i = 0; i < N_MODES; i++)
        if ((modes >> i) & 1) {
            size_t len = strlen(buf);
            snprintf(buf + len, cap - len, "%s%s", k == 0 ? "" : k == n - 1 ? " and " : ", ", MODES[i]);
            k++;
        }
}

void usage(FILE *f) {
    fprintf(f, "usage: ./run MODEL.bin [options]     (modes that read a flag in brackets)\n");
    for (int i = 0; i < N_FLAGS; i++) {
        char lhs[32], text[512];
        snprintf(lhs, sizeof lhs, "%s%s%s", FLAGS[i].flag, FLAGS[i].arg ? " " : "", FLAGS[i].arg ? FLAGS[i].arg : "");
        char modes[96] = "";
        for (int m = 0; m < N_MODES && FLAGS[i].modes != M_ALL; m++)
            if ((FLAGS[i].modes >> m) & 1) snprintf(modes + strlen(modes), sizeof modes - strlen(modes), " %s", MODES[m]);
        snprintf(text, sizeof text, "%s [%s]", FLAGS[i].help, FLAGS[i].modes == M_ALL ? "all" : modes + 1);
        /* wrapped at 100 columns, continuation lines under the text */
        const char *p = text;
        int first = 1;
        while (*p) {
            size_t len = strlen(p), cut = len;
            if (len > 82) { cut = 82; while (cut > 0 && p[cut] != ' ') cut--; if (cut == 0) cut = 82; }
            fprintf(f, "  %-15s %.*s\n", first ? lhs : "", (int)cut, p);
            p += cut;
            while (*p == ' ') p++;
            first = 0;
        }
    }
    fprintf(f, "policies: %s (-h policies: their keys, defaults and papers)\n"
               "budget: tokens per lane (1024) or bytes for the whole cache (64MiB, 512KiB)\n"
               "keys of every policy: type|ktype|vtype=f32|f16|bf16|q8|q4, residual=R, pos=orig|cache, agg=mean|max\n"
               "threads: OMP_NUM_THREADS (see README, Threads)\n", kv_policy_names());
}

/* README's flag table, as markdown: a flag per row, a column per mode. */
void usage_flags_markdown(FILE *f) {
    fprintf(f, "| flag |");
    for (int m = 0; m < N_MODES; m++) fprintf(f, " %s |", MODES[m]);
    fprintf(f, " meaning |\n|---|");
    for (int m = 0; m < N_MODES; m++) fprintf(f, ":-:|");
    fprintf(f, "---|\n");
    for (int i = 0; i < N_FLAGS; i++) {
        fprintf(f, "| `%s%s%s` |", FLAGS[i].flag, FLAGS[i].arg ? " " : "", FLAGS[i].arg ? FLAGS[i].arg : "");
        for (int m = 0; m < N_MODES; m++) fprintf(f, " %s |", (FLAGS[i].modes >> m) & 1 ? "x" : "");
        fprintf(f, " %s |\n", FLAGS[i].help);
    }
}

/* -h policies: every registered method with its keys, defaults and the paper it implements. */
void usage_policies(FILE *f) {
    fprintf(f, "KV policies (-kv NAME[:BUDGET][,key=value...]; a budget is tokens per lane or bytes for the whole "
               "cache, e.g. 64MiB):\n");
    for (int i = 0; kv_policy_at(i); i++) {
        const KVPolicyOps *p = kv_policy_at(i);
        fprintf(f, "\n  %s%s\n    %s\n    keys: %s\n    source: %s\n", p->name, p->needs_budget ? ":BUDGET" : "",
                p->summary, *p->options ? p->options : "none of its own", p->paper);
    }
    fprintf(f, "\nkeys every policy takes:\n"
               "  type=T, ktype=T, vtype=T  storage of keys and values: f32 (default, or -kvt), f16, bf16, q8, q4\n"
               "  residual=R                the R newest tokens of a lane kept in f32 (KIVI's residual), default 0\n"
               "  pos=orig|cache            RoPE by original position (default) or by rank in the cache (StreamingLLM)\n"
               "  agg=mean|max              how a GQA group's attention is aggregated for the policy, default mean\n");
}

static const FlagDef *flag_find(const char *a) {
    for (int i = 0; i < N_FLAGS; i++) if (!strcmp(a, FLAGS[i].flag)) return &FLAGS[i];
    if (!strcmp(a, "--help")) return flag_find("-h");
    return NULL;
}

/* Store one flag's value into o. 0, or -1 + message. */
static int option_set(Options *o, const char *a, const char *v, char *err, size_t errlen) {
    long n;
    double x;
    if (!strcmp(a, "-m")) {
        for (int k = 0; k < N_MODES; k++) if (!strcmp(v, MODES[k])) { o->mode = MODES[k]; return 0; }
        return errorf(err, errlen, "unknown mode '-m %s'; modes: generate, chat, ppl, passkey, bench, tokenize, "
                      "detokenize", v);
    } else if (!strcmp(a, "-i")) { o->prompt = v;
    } else if (!strcmp(a, "-f")) {
        if (o->n_files == MAX_FILES) return errorf(err, errlen, "too many -f files (at most %d)", MAX_FILES);
        o->files[o->n_files++] = v;
    } else if (!strcmp(a, "-n")) {
        if (parse_long(v, 0, 1 << 30, &n)) return errorf(err, errlen, "bad -n '%s': a token count in [0, %d]", v, 1 << 30);
        o->steps = (int)n;
        o->steps_set = 1;
    } else if (!strcmp(a, "-t")) {
        if (parse_float(v, 0, 100, &x)) return errorf(err, errlen, "bad -t '%s': a temperature in [0, 100]", v);
        o->temperature = (float)x;
    } else if (!strcmp(a, "-p")) {
        if (parse_float(v, 0, 1, &x) || x == 0) return errorf(err, errlen, "bad -p '%s': top-p in (0, 1]", v);
        o->topp = (float)x;
    } else if (!strcmp(a, "-s")) {
        char *end;
        errno = 0;
        unsigned long long s = strtoull(v, &end, 10);
        if (errno || *end || end == v || *v < '0' || *v > '9')
            return errorf(err, errlen, "bad -s '%s': a seed in [0, 2^64)", v);
        o->seed = s;
        o->seed_set = 1;
    } else if (!strcmp(a, "-c")) {
        if (parse_long(v, 1, 1 << 24, &n)) return errorf(err, errlen, "bad -c '%s': a context length in [1, %d]", v, 1 << 24);
        o->ctx = (int)n;
    } else if (!strcmp(a, "-y")) { o->system = v;
    } else if (!strcmp(a, "-kv")) {
        if (o->n_kv == MAX_POLICIES) return errorf(err, errlen, "too many -kv policies (at most %d)", MAX_POLICIES);
        o->kv[o->n_kv++] = v;
    } else if (!strcmp(a, "-kvt")) {
        int ty = kv_type_parse(v);
        if (ty < 0) return errorf(err, errlen, "unknown -kvt '%s'; types: f32, f16, bf16, q8, q4", v);
        o->kvt = (KVType)ty;
    } else if (!strcmp(a, "-kvlog")) { o->kvlog = v;
    } else if (!strcmp(a, "-d")) {
        if (strcmp(v, "cpu") && strcmp(v, "cuda")) return errorf(err, errlen, "unknown device '-d %s'; devices: cpu, cuda", v);
        o->device = v;
    } else if (!strcmp(a, "-o")) { o->out = v;
    } else if (!strcmp(a, "-chunk")) {
        if (parse_long(v, 1, 1 << 16, &n)) return errorf(err, errlen, "bad -chunk '%s': a chunk size in [1, 65536]", v);
        o->chunk = (int)n;
    } else if (!strcmp(a, "-ppl-mode")) {
        if (strcmp(v, "stream") && strcmp(v, "chunked"))
            return errorf(err, errlen, "unknown -ppl-mode '%s'; modes: stream, chunked", v);
        o->ppl_mode = v;
    } else if (!strcmp(a, "-tokenlog")) { o->tokenlog = v;
    } else if (!strcmp(a, "-ids")) { o->print_ids = 1;
    } else if (!strcmp(a, "-bos")) { o->add_bos = 1;
    } else if (!strcmp(a, "-v")) { o->verbose = 1;
    }
    return 0;
}

int options_parse(Options *o, int argc, char **argv, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    o->mode = "generate";
    o->steps = 256;
    o->temperature = 1.0f;
    o->topp = 0.9f;
    o->kvt = KV_F32;
    o->device = "auto";
    o->ppl_mode = "stream";
    o->argc = argc;
    o->argv = argv;
    if (argc < 2) return errorf(err, errlen, "no model given; usage: ./run MODEL.bin [options] (-h for help)");
    int first = 2;
    if (flag_find(argv[1]) == flag_find("-h")) first = 1;   /* ./run -h [topic] */
    else o->model_path = argv[1];
    const FlagDef *given[N_FLAGS];
    int n_given = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        const FlagDef *fd = flag_find(a);
        if (!fd) return errorf(err, errlen, "unknown flag '%s' (-h lists the flags)", a);
        if (!strcmp(fd->flag, "-h")) {
            o->help = "usage";
            if (i + 1 < argc && (!strcmp(argv[i + 1], "policies") || !strcmp(argv[i + 1], "flags"))) o->help = argv[i + 1];
            return 0;
        }
        const char *v = NULL;
        if (fd->arg) {
            if (i + 1 >= argc) return errorf(err, errlen, "flag %s needs a value %s (-h lists the flags)", a, fd->arg);
            v = argv[++i];
        }
        if (option_set(o, fd->flag, v, err, errlen)) return -1;
        int seen = 0;
        for (int k = 0; k < n_given; k++) seen |= given[k] == fd;
        if (!seen) given[n_given++] = fd;
    }
    if (!o->model_path) return errorf(err, errlen, "no model given; usage: ./run MODEL.bin [options] (-h for help)");
    /* every flag given must be one the mode reads: a flag that would be ignored is an error */
    int mi = 0;
    while (strcmp(MODES[mi], o->mode)) mi++;
    for (int k = 0; k < n_given; k++)
        if (!((given[k]->modes >> mi) & 1)) {
            char modes[96];
            modes_list(modes, sizeof modes, given[k]->modes);
            return errorf(err, errlen, "%s is not used by -m %s (it is for %s)", given[k]->flag, o->mode, modes);
        }
    /* conflicts inside a mode */
    int multi = !strcmp(o->mode, "ppl") || !strcmp(o->mode, "passkey") || !strcmp(o->mode, "bench");
    if (o->n_kv > 1 && !multi)
        return errorf(err, errlen, "-kv given %d times: several policies run only in ppl, passkey and bench modes", o->n_kv);
    if (o->prompt && o->n_files && !strcmp(o->mode, "tokenize"))
        return errorf(err, errlen, "give the text with -i or -f, not both");
    if (o->n_files > 1 && strcmp(o->mode, "ppl")) return errorf(err, errlen, "-f is repeatable only in ppl mode");
    if (o->tokenlog && !strcmp(o->ppl_mode, "chunked"))
        return errorf(err, errlen, "-tokenlog is for -ppl-mode stream (chunked mode scores no shadow)");
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Generation and chat
 * ------------------------------------------------------------------------------------------------------------- */

void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "run: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(EXIT_FAILURE);
}

/* Notes (not errors: "attention runs on the CPU") wait until the job starts, so an error always stands alone. */
static char notes[1024];
void run_note(const char *fmt, ...) {
    size_t n = strlen(notes);
    if (n + 16 >= sizeof notes) return;
    n += (size_t)snprintf(notes + n, sizeof notes - n, "run: note: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(notes + n, sizeof notes - n - 1, fmt, ap);
    va_end(ap);
    strcat(notes, "\n");
}
void run_job_start(void) {
    fputs(notes, stderr);
    notes[0] = 0;
}

/* A seed when -s is not given: 8 bytes of /dev/urandom, or else the nanosecond clock and the process id mixed, so
 * runs started in the same second draw different streams. */
uint64_t seed_fresh(void) {
    uint64_t x = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    int ok = f && fread(&x, sizeof x, 1, f) == 1;
    if (f) fclose(f);
    if (!ok) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
        x = splitmix64(&x);
    }
    return x;
}

int run_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

long peak_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* A growable list of token ids. */
typedef struct { int *ids; size_t n, cap; } IdList;
static void ids_push(IdList *l, int id) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->ids = realloc(l->ids, l->cap * sizeof(int));
        if (!l->ids) fatal("out of memory");
    }
    l->ids[l->n++] = id;
}

/* Parse "12 34 56" (whitespace-separated decimal ids) for ids-only prompts and detokenize. */
static int parse_ids(const char *text, int vocab, IdList *out, char *err, size_t errlen) {
    const char *p = text;
    for (;;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) return 0;
        const char *s = p;
        while (*p && *p != ' ' && *p != '\n' && *p != '\t' && *p != '\r') p++;
        char tok[32];
        size_t len = (size_t)(p - s);
        if (len >= sizeof tok) return errorf(err, errlen, "token id '%.20s...' is not a number", s);
        memcpy(tok, s, len);
        tok[len] = 0;
        long v;
        if (parse_long(tok, LONG_MIN, LONG_MAX, &v)) return errorf(err, errlen, "token id '%s' is not a number", tok);
        if (v < 0 || v >= vocab) return errorf(err, errlen, "token id %s is out of range [0, %d)", tok, vocab);
        ids_push(out, (int)v);
    }
}

int ids_parse(const char *text, int vocab, int **ids, size_t *n, char *err, size_t errlen) {
    IdList l = {0};
    if (parse_ids(text, vocab, &l, err, errlen)) { free(l.ids); return -1; }
    *ids = l.ids;
    *n = l.n;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Output files (-o, -tokenlog, -kvlog): JSON lines, each composed in memory and written whole with write(2), so a
 * reader (or an interrupted run) never sees half a record; a write error is an error exit.
 * ------------------------------------------------------------------------------------------------------------- */

void line_printf(Line *l, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = l->cap - l->n;
        int k = vsnprintf(l->cap ? l->s + l->n : NULL, room, fmt, ap);
        va_end(ap);
        if (k < 0) fatal("cannot format an output record");
        if ((size_t)k < room) { l->n += (size_t)k; return; }
        l->cap = 2 * (l->n + (size_t)k + 64);
        l->s = realloc(l->s, l->cap);
        if (!l->s) fatal("out of memory");
    }
}

void line_json_str(Line *l, const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') line_printf(l, "\\%c", *p);
        else if (*p < 0x20) line_printf(l, "\\u%04x", *p);
        else line_printf(l, "%c", *p);
    }
}

void line_free(Line *l) { free(l->s); memset(l, 0, sizeof *l); }

void outfile_open(OutFile *f, const char *flag, const char *path, int append) {
    f->flag = flag;
    f->path = path;
    f->fd = open(path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    if (f->fd < 0) fatal("cannot write %s '%s': %s", flag, path, strerror(errno));
}

void outfile_line(OutFile *f, Line *l) {
    size_t off = 0;
    while (f->fd >= 0 && off < l->n) {
        ssize_t k = write(f->fd, l->s + off, l->n - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fatal("cannot write %s '%s': %s", f->flag, f->path, k < 0 ? strerror(errno) : "nothing written");
        off += (size_t)k;
    }
    l->n = 0;
}

void outfile_close(OutFile *f) {
    if (f->fd >= 0 && close(f->fd)) fatal("cannot write %s '%s': %s", f->flag, f->path, strerror(errno));
    f->fd = -1;
}

/* The command line as a shell would read it back: words with characters outside a safe set single-quoted. */
void line_shell_words(Line *l, int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int safe = *a != 0;
        for (const char *p = a; *p; p++) safe &= strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789_./:=,+-@%", *p) != NULL;
        if (i) line_printf(l, " ");
        if (safe) { line_printf(l, "%s", a); continue; }
        line_printf(l, "'");
        for (const char *p = a; *p; p++) line_printf(l, *p == '\'' ? "'\\''" : "%c", *p);
        line_printf(l, "'");
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * SIGINT and SIGTERM: the first one only sets run_signal; the long loops stop at their next token (or chunk)
 * boundary, keep what they measured and exit 128 + the signal. A second one ends the process at once (the files stay
 * whole: every record is written in one piece).
 * ------------------------------------------------------------------------------------------------------------- */

volatile sig_atomic_t run_signal = 0;

static void on_signal(int sig) { run_signal = sig; }

void run_catch_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND;   /* no SA_RESTART: a read of stdin (chat) returns and the loop ends */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

const char *run_signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal"; }

char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) fatal("cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) || S_ISDIR(st.st_mode)) fatal("'%s' is not a regular file", path);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) fatal("out of memory");
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) { cap *= 2; buf = realloc(buf, cap + 1); if (!buf) fatal("out of memory"); }
    }
    if (ferror(f)) fatal("cannot read '%s'", path);
    fclose(f);
    buf[n] = 0;
    *len = n;
    return buf;
}

#ifndef KVLAB_NO_MAIN   /* the modes' drivers and main */

static void ids_append_text(IdList *l, const Model *m, const char *text) {
    int *ids;
    size_t n;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, strlen(text), 0, &ids, &n, err, sizeof err))
        fatal("tokenizer: %s", err);
    for (size_t i = 0; i < n; i++) ids_push(l, ids[i]);
    free(ids);
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
    OutFile kvlog;
    Line kvline;       /* the -kvlog record being composed */
    TokenDecoder dec;
    int print_ids;
    int verbose;       /* -v: also print each prompt's ids */
    uint64_t seed;
    double t_prompt, t_decode;
    int n_prompt, n_gen;
} Session;

static void kvlog_event(void *ctx, int pos_now, int layer, int kv_head, int evicted_pos, double score,
                        const char *reason) {
    Session *se = ctx;
    char piece[2 * TOKDEC_OUT_MAX + 8] = "";
    if (se->m->has_tokenizer && evicted_pos >= 0 && (size_t)evicted_pos < se->stream.n) {
        TokenDecoder d;
        tokdec_init(&d, &se->m->tokenizer);
        size_t n = tokdec_push(&d, se->stream.ids[evicted_pos], piece, sizeof piece - 8);
        n += tokdec_flush(&d, piece + n, sizeof piece - 8 - n);
        piece[n] = 0;
    }
    Line *l = &se->kvline;
    line_printf(l, "{\"kv\":\"");
    line_json_str(l, se->cache.spec.text);
    line_printf(l, "\",\"event\":\"evict\",\"step\":%d,\"layer\":%d,\"kv_head\":%d,\"evicted_pos\":%d,\"token_id\":%d,"
                "\"token\":\"", pos_now, layer, kv_head, evicted_pos,
                evicted_pos >= 0 && (size_t)evicted_pos < se->stream.n ? se->stream.ids[evicted_pos] : -1);
    line_json_str(l, piece);
    line_printf(l, "\",\"score\":%.9g,\"reason\":\"%s\"}\n", score, reason);
    outfile_line(&se->kvlog, l);
}


static void session_init(Session *se, Model *m, const Options *o, uint64_t seed) {
    memset(se, 0, sizeof *se);
    se->m = m;
    se->seed = seed;
    const Config *c = &m->config;
    int ctx = o->ctx ? o->ctx : c->seq_len;
    char err[512];
    KVSpec spec;
    if (kv_spec_parse(&spec, o->n_kv ? o->kv[0] : "full", o->kvt, err, sizeof err) ||
        kv_spec_check_mode(&spec, o->mode, err, sizeof err))
        fatal("-kv: %s", err);
    KVShape shape = model_kv_shape(m, ctx);
    if (kv_cache_init(&se->cache, &shape, &spec, err, sizeof err)) fatal("%s", err);
    se->capacity = se->cache.policy.ops->evicts ? INT_MAX : se->cache.budget;
    if (state_init_chunk(&se->s, c, PREFILL_CHUNK) || sampler_init(&se->sampler, c->vocab_size, o->temperature, o->topp, seed))
        fatal("out of memory");
    se->kvlog = (OutFile)OUTFILE_NONE;
    if (o->kvlog) {
        outfile_open(&se->kvlog, "-kvlog", o->kvlog, 0);
        se->cache.on_evict = kvlog_event;
        se->cache.evict_ctx = se;
    }
    if (m->has_tokenizer) tokdec_init(&se->dec, &m->tokenizer);
    se->print_ids = o->print_ids || !m->has_tokenizer;
    se->verbose = o->verbose;
}

static void session_free(Session *se) {
    outfile_close(&se->kvlog);
    line_free(&se->kvline);
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
    emit_flush(se);
    if (end == GEN_FULL) fprintf(stderr, "run: the cache is full (%d tokens, -c): generation stopped\n", se->capacity);
    if (end == GEN_SIGNAL) fprintf(stderr, "run: %s: generation stopped\n", run_signal_name(run_signal));
    return end;
}

static void print_summary(Session *se, const Options *o) {
    KVBytes b = kv_bytes(&se->cache);
    char dev[256];
    attn_dev_describe(&se->cache, dev, sizeof dev);
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
            "(formula 2*L*kvh*hd*tokens*bytes = %.2f MiB), %.2f MiB live, peak %.2f MiB; peak RSS %.1f MiB; %s\n",
            se->n_prompt, se->t_prompt > 0 ? se->n_prompt / se->t_prompt : 0, se->n_gen, tps, se->cache.spec.text,
            se->cache.policy.budget, b.total_alloc / 1048576.0, b.formula_alloc / 1048576.0, b.total_live / 1048576.0,
            b.peak_live / 1048576.0, peak_rss_kib() / 1024.0, dev);
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
static int chat_render(IdList *l, const Model *m, ChatFormat fmt, const char *system, const char *user, int first) {
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
        end = session_generate(se, &ids, o->steps ? o->steps : INT_MAX, stop, 1);
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
        if (o->prompt && parse_ids(o->prompt, m->config.vocab_size, &prompt, err, sizeof err))
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
    int ctx = o->ctx ? o->ctx : m->config.seq_len;
    int steps = o->steps ? o->steps : se->capacity != INT_MAX ? INT_MAX
                                    : (ctx > (int)prompt.n ? ctx - (int)prompt.n + 1 : 1);
    int end = session_generate(se, &prompt, steps, -1, 0);
    free(prompt.ids);
    return end;
}

static void run_tokenize(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("this model.bin has no tokenizer (ids-only)");
    size_t len = 0;
    char *text = NULL;
    if (o->n_files) text = read_file(o->files[0], &len);
    else if (o->prompt) len = strlen(o->prompt);
    else fatal("tokenize needs text: -i TEXT or -f FILE");
    int *ids;
    size_t n;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)(text ? text : o->prompt), len, o->add_bos, &ids, &n,
                         err, sizeof err))
        fatal("tokenizer: %s", err);
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    free(text);
}

static void run_detokenize(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("this model.bin has no tokenizer (ids-only)");
    if (!o->n_files) fatal("detokenize needs a file of ids: -f FILE");
    size_t len;
    char *text = read_file(o->files[0], &len), err[256];
    if (strlen(text) != len) fatal("'%s' holds a NUL byte: a file of ids is decimal numbers", o->files[0]);
    IdList ids = {0};
    if (parse_ids(text, m->tokenizer.vocab_size, &ids, err, sizeof err)) fatal("'%s': %s", o->files[0], err);
    TokenDecoder d;
    tokdec_init(&d, &m->tokenizer);
    char buf[TOKDEC_OUT_MAX];
    for (size_t i = 0; i < ids.n; i++) fwrite(buf, 1, tokdec_push(&d, ids.ids[i], buf, sizeof buf), stdout);
    fwrite(buf, 1, tokdec_flush(&d, buf, sizeof buf), stdout);
    free(ids.ids);
    free(text);
}

/* stdout is the product: a write error (a full disk, a closed pipe) is an error exit, not a silent success */
static int finish_output(void) {
    if (fflush(stdout) || ferror(stdout)) {
        fprintf(stderr, "run: error writing the output: %s\n", strerror(errno));
        return EXIT_FAILURE;
    }
    return 0;
}

int main(int argc, char **argv) {
    Options o;
    char err[512];
    if (options_parse(&o, argc, argv, err, sizeof err)) {
        fprintf(stderr, "run: %s\n", err);
        return EXIT_FAILURE;
    }
    if (o.help) {
        if (!strcmp(o.help, "policies")) usage_policies(stdout);
        else if (!strcmp(o.help, "flags")) usage_flags_markdown(stdout);
        else usage(stdout);
        return finish_output();
    }
    Model m;
    if (model_open(&m, o.model_path, err, sizeof err)) fatal("%s", err);
    if (!strcmp(o.mode, "tokenize")) { run_tokenize(&m, &o); model_close(&m); return finish_output(); }
    if (!strcmp(o.mode, "detokenize")) { run_detokenize(&m, &o); model_close(&m); return finish_output(); }
    if (m.vocab_only) fatal("'%s' holds only a tokenizer (--vocab-only): it can tokenize and detokenize, not run",
                          o.model_path);
    /* every -kv spec is checked before anything runs or any note is printed */
    for (int k = 0; k < o.n_kv; k++) {
        KVSpec spec;
        if (kv_spec_parse(&spec, o.kv[k], o.kvt, err, sizeof err) || kv_spec_check_mode(&spec, o.mode, err, sizeof err))
            fatal("-kv: %s", err);
    }
    /* the device: -d cpu, -d cuda, or (default) cuda when this build has it and a GPU is usable */
    char dev_name[256], why[256];
    int cuda = strcmp(o.device, "cpu") && attn_cuda_usable(dev_name, sizeof dev_name, why, sizeof why);
    if (!cuda && !strcmp(o.device, "cuda")) fatal("-d cuda: %s; use -d cpu", why);
    if (!cuda && ATTN_CUDA_BUILT && strcmp(o.device, "cpu")) run_note("%s: attention runs on the CPU", why);
    if (cuda && strcmp(o.mode, "generate") && strcmp(o.mode, "chat"))
        run_note("-m %s runs attention on the CPU (the CUDA path serves generate and chat)", o.mode);
    if (o.ctx > m.config.seq_len) run_note("-c %d is past the trained context of %d tokens", o.ctx, m.config.seq_len);
    run_catch_signals();
    int rc = 0;
    if (!strcmp(o.mode, "ppl")) rc = run_ppl(&m, &o);
    else if (!strcmp(o.mode, "bench")) rc = run_bench(&m, &o);
    else if (!strcmp(o.mode, "passkey")) rc = run_passkey(&m, &o);
    else {
        Session se;
        session_init(&se, &m, &o, o.seed_set ? o.seed : seed_fresh());
        if (cuda && attn_dev_attach(&se.cache, err, sizeof err)) {
            if (!strcmp(o.device, "cuda")) fatal("-d cuda: %s", err);
            run_note("%s: attention runs on the CPU", err);
        }
        int end = !strcmp(o.mode, "chat") ? run_chat(&se, &o) : run_generate(&se, &o);
        print_summary(&se, &o);
        attn_dev_detach(&se.cache);
        session_free(&se);
        rc = end == GEN_SIGNAL ? 128 + run_signal : end == GEN_NO_ROOM ? EXIT_FAILURE : 0;
    }
    model_close(&m);
    int out_rc = finish_output();
    return rc ? rc : out_rc;
}
#endif
