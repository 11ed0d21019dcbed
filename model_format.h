/* model_format.h: the model.bin header (docs/FORMAT.md), the one definition that export.c writes and model.c reads:
 * the magic, the version, the config fields at their offsets, and the bounds a config must keep. Header-only
 * (static inline) so that ./export, which links nothing of ./run, includes the same code.
 * It does not read the tokenizer or weight sections (tokenizer.c, model.c) and knows no foreign format (export.c).
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, seq_len.
 */
#ifndef KVLAB_MODEL_FORMAT_H
#define KVLAB_MODEL_FORMAT_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MODEL_MAGIC 0x424C564Bu   /* "KVLB" little-endian */
#define MODEL_VERSION 1
#define MODEL_HEADER_BYTES 256
#define MODEL_ALIGN 64            /* every section and tensor starts on a 64-byte boundary */

typedef struct {
    int dim;            /* model width */
    int hidden_dim;     /* SwiGLU width */
    int n_layers, n_heads, n_kv_heads, head_dim;
    int vocab_size;
    int seq_len;        /* trained context, tokens */
    int rope_pairing;   /* 0 adjacent pairs, 1 halves */
    int tied;           /* classifier = embedding */
    int wtype;          /* matrices: WTYPE_F32 or WTYPE_Q8 (docs/FORMAT.md) */
    int has_rope_factors;
    float rope_theta, norm_eps;
} Config;

/* Weight types of the matrices (model.bin's wtype; norms and the embedding are always f32). */
enum { WTYPE_F32 = 0, WTYPE_Q8 = 1 };

/* The header: the config and where the sections are (bytes from the start of the file). */
typedef struct {
    Config config;
    uint64_t tokenizer_offset, tokenizer_bytes;   /* tokenizer_bytes 0: an ids-only model */
    uint64_t weights_offset, weights_bytes;
    uint64_t file_bytes;
} ModelHeader;

/* Byte offsets of the fields (docs/FORMAT.md); 104..255 are reserved and zero. */
enum {
    MH_MAGIC = 0, MH_VERSION = 4, MH_INTS = 8,   /* 12 int32 from dim to has_rope_factors, in Config's order */
    MH_ROPE_THETA = 56, MH_NORM_EPS = 60, MH_TOK_OFFSET = 64, MH_TOK_BYTES = 72, MH_W_OFFSET = 80, MH_W_BYTES = 88,
    MH_FILE_BYTES = 96, MH_RESERVED = 104
};

static inline void mh_put32(uint8_t *h, int off, uint32_t v) { memcpy(h + off, &v, 4); }
static inline void mh_put64(uint8_t *h, int off, uint64_t v) { memcpy(h + off, &v, 8); }
static inline uint32_t mh_get32(const uint8_t *h, int off) { uint32_t v; memcpy(&v, h + off, 4); return v; }
static inline uint64_t mh_get64(const uint8_t *h, int off) { uint64_t v; memcpy(&v, h + off, 8); return v; }

/* The config's int fields in file order, as pointers (one list for writing and reading). */
static inline void model_config_ints(Config *c, int **f) {
    int *p[12] = {&c->dim, &c->hidden_dim, &c->n_layers, &c->n_heads, &c->n_kv_heads, &c->head_dim, &c->vocab_size,
                  &c->seq_len, &c->rope_pairing, &c->tied, &c->wtype, &c->has_rope_factors};
    memcpy(f, p, sizeof p);
}

/* h (MODEL_HEADER_BYTES) from hd: magic, version, fields, zero reserved bytes. The host must be little-endian. */
static inline void model_header_pack(uint8_t *h, const ModelHeader *hd) {
    memset(h, 0, MODEL_HEADER_BYTES);
    mh_put32(h, MH_MAGIC, MODEL_MAGIC);
    mh_put32(h, MH_VERSION, MODEL_VERSION);
    Config c = hd->config;
    int *f[12];
    model_config_ints(&c, f);
    for (int i = 0; i < 12; i++) mh_put32(h, MH_INTS + 4 * i, (uint32_t)*f[i]);
    memcpy(h + MH_ROPE_THETA, &c.rope_theta, 4);
    memcpy(h + MH_NORM_EPS, &c.norm_eps, 4);
    mh_put64(h, MH_TOK_OFFSET, hd->tokenizer_offset);
    mh_put64(h, MH_TOK_BYTES, hd->tokenizer_bytes);
    mh_put64(h, MH_W_OFFSET, hd->weights_offset);
    mh_put64(h, MH_W_BYTES, hd->weights_bytes);
    mh_put64(h, MH_FILE_BYTES, hd->file_bytes);
}

/* hd from h (MODEL_HEADER_BYTES, already known to be that long): the fields as stored, unchecked. */
static inline void model_header_unpack(ModelHeader *hd, const uint8_t *h) {
    memset(hd, 0, sizeof *hd);
    int *f[12];
    model_config_ints(&hd->config, f);
    for (int i = 0; i < 12; i++) *f[i] = (int32_t)mh_get32(h, MH_INTS + 4 * i);
    memcpy(&hd->config.rope_theta, h + MH_ROPE_THETA, 4);
    memcpy(&hd->config.norm_eps, h + MH_NORM_EPS, 4);
    hd->tokenizer_offset = mh_get64(h, MH_TOK_OFFSET);
    hd->tokenizer_bytes = mh_get64(h, MH_TOK_BYTES);
    hd->weights_offset = mh_get64(h, MH_W_OFFSET);
    hd->weights_bytes = mh_get64(h, MH_W_BYTES);
    hd->file_bytes = mh_get64(h, MH_FILE_BYTES);
}

/* Upper bounds that no real Llama reaches, low enough that no size product can overflow 64 bits. */
#define MODEL_MAX_DIM (1 << 16)
#define MODEL_MAX_HIDDEN (1 << 18)
#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_HEADS 1024
#define MODEL_MAX_HEAD_DIM 1024
#define MODEL_MAX_VOCAB (1 << 22)
#define MODEL_MAX_SEQ (1 << 24)
#define MODEL_MAX_THETA 1e12f

/* The one check of a model's config, for export (before writing) and run (after reading): every field in range,
 * n_heads a multiple of n_kv_heads, head_dim even (RoPE rotates pairs), θ and ε finite and in range. Groups of 32
 * for q8 matrices are checked by the caller (quant.h's Q8_GROUP). Returns 0, or -1 with a message in err. */
static inline int model_config_check(const Config *c, char *err, size_t errlen) {
    struct { const char *name; long v, lo, hi; } f[] = {
        {"dim", c->dim, 1, MODEL_MAX_DIM}, {"hidden_dim", c->hidden_dim, 1, MODEL_MAX_HIDDEN},
        {"n_layers", c->n_layers, 1, MODEL_MAX_LAYERS}, {"n_heads", c->n_heads, 1, MODEL_MAX_HEADS},
        {"n_kv_heads", c->n_kv_heads, 1, MODEL_MAX_HEADS}, {"head_dim", c->head_dim, 2, MODEL_MAX_HEAD_DIM},
        {"vocab_size", c->vocab_size, 1, MODEL_MAX_VOCAB}, {"seq_len", c->seq_len, 1, MODEL_MAX_SEQ},
        {"rope_pairing", c->rope_pairing, 0, 1}, {"tied", c->tied, 0, 1}, {"wtype", c->wtype, 0, 1},
        {"has_rope_factors", c->has_rope_factors, 0, 1},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < f[i].lo || f[i].v > f[i].hi) {
            snprintf(err, errlen, "header field %s = %ld is out of range [%ld, %ld]", f[i].name, f[i].v, f[i].lo,
                     f[i].hi);
            return -1;
        }
    if (c->n_heads % c->n_kv_heads)
        snprintf(err, errlen, "n_heads %d is not a multiple of n_kv_heads %d", c->n_heads, c->n_kv_heads);
    else if (c->head_dim % 2) snprintf(err, errlen, "head_dim %d is odd: RoPE needs pairs", c->head_dim);
    else if ((long)c->n_heads * c->head_dim > MODEL_MAX_DIM)
        snprintf(err, errlen, "n_heads * head_dim = %ld is out of range [1, %d]", (long)c->n_heads * c->head_dim,
                 MODEL_MAX_DIM);
    else if (!(c->rope_theta > 0 && c->rope_theta < MODEL_MAX_THETA))
        snprintf(err, errlen, "rope_theta %g is out of range (0, 1e12)", (double)c->rope_theta);
    else if (!(c->norm_eps > 0 && c->norm_eps < 1))
        snprintf(err, errlen, "norm_eps %g is out of range (0, 1)", (double)c->norm_eps);
    else return 0;
    return -1;
}

#endif
