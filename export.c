/* export.c: writes kvlab's model.bin (docs/FORMAT.md) from a GGUF file (v2/v3, architecture llama), a llama2.c
 * checkpoint (legacy or versioned fp32) or a seed (tiny random models for tests). It is the only code in kvlab that
 * knows a foreign format. Quantized GGUF tensors are dequantized to f32 exactly as ggml defines them
 * (ggml-quants.c, dequantize_row_*). Input files are untrusted: every count, length, offset and shape is checked
 * against the file length before use, and parsers return a message instead of exiting.
 * It does not transpose or permute weights (GGUF llama and llama2.c weights are already row-major (out, in) and laid
 * out for adjacent-pair RoPE), and reads no other architecture. --wtype q8 quantizes the matrices from their f32
 * (dequantized) values into int8 groups (quant.h); it does not copy a GGUF's own Q8_0 blocks.
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, kv_dim = n_kv_heads*head_dim, vocab_size,
 * seq_len. Tensors are named as in GGUF (token_embd.weight, blk.N.attn_q.weight, ...) in every error message. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "export.h"
#include "util.h"
#include "model_format.h"
#include "quant.h"
#include "kv.h"

/* ---------------------------------------------------------------------------------------------------------------
 * Errors and small helpers */

static uint16_t rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd_u64(const uint8_t *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static float rd_f32(const uint8_t *p) { uint32_t u = rd_u32(p); float f; memcpy(&f, &u, 4); return f; }
static float rd_f16(const uint8_t *p) { return export_f16_to_f32(rd_u16(p)); }

/* Names in files are not NUL-terminated and may be huge: print at most 64 bytes of them. */
#define NAMEFMT "%.*s"
#define NAMEARG(p, n) (int)((n) < 64 ? (n) : 64), (p)

/* ---------------------------------------------------------------------------------------------------------------
 * f16 / bf16 */

/* One copy of each conversion: kv.h's, which the KV cache's f16/bf16 storage uses too. */
float export_f16_to_f32(uint16_t h) { return kv_f16_to_f32(h); }
float export_bf16_to_f32(uint16_t h) { return kv_bf16_to_f32(h); }

/* ---------------------------------------------------------------------------------------------------------------
 * ggml types and dequantization.
 * Block layouts from ggml-common.h. Each value is computed with the same f32 operations in the same order as
 * ggml's reference dequantize_row_*: an f16 scale (11 significant bits) times integers of at most 12 bits together
 * (Q6_K: 8-bit scale, 6-bit quant), which f32's 24-bit significand holds exactly, then at most one addition or
 * subtraction, the only rounding. So the results are bit-identical to ggml's, FMA contraction or not (checked with
 * gcc -ffp-contract=fast and clang -O3 -march=native against tests/golden/dequant). */

typedef struct { uint32_t id; const char *name; uint32_t blck, bytes; } GgmlType;

/* Every type ggml defines (ids and block geometry from ggml.c's type_traits), so that tensors export does not read
 * can still be bounds-checked. */
static const GgmlType ggml_types[] = {
    {0, "F32", 1, 4},        {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},     {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 40},
    {10, "Q2_K", 256, 84},   {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},  {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98},{19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},  {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},       {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},      {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

static const GgmlType *ggml_type(uint32_t id) {
    for (size_t i = 0; i < sizeof(ggml_types) / sizeof(ggml_types[0]); i++)
        if (ggml_types[i].id == id) return &ggml_types[i];
    return NULL;
}

const char *export_ggml_type_name(uint32_t type) {
    const GgmlType *t = ggml_type(type);
    return t ? t->name : NULL;
}

int export_ggml_type_size(uint32_t type, size_t *block_elems, size_t *block_bytes) {
    const GgmlType *t = ggml_type(type);
    if (!t) return -1;
    *block_elems = t->blck;
    *block_bytes = t->bytes;
    return 0;
}

#define QK 32      /* elements per block of the simple quants (Q4_0 .. Q8_0) */
#define QK_K 256   /* elements per super-block of the K-quants */

/* Q4_0: f16 d, 16 bytes of nibbles. Element j is the low nibble of byte j, element j+16 the high one; value d*(q-8). */
static void deq_q4_0(float *y, const uint8_t *b) {
    float d = rd_f16(b);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((b[2 + j] & 0xf) - 8) * d;
        y[j + QK / 2] = (float)((b[2 + j] >> 4) - 8) * d;
    }
}

/* Q4_1: f16 d, f16 m, 16 bytes of nibbles; value d*q + m. */
static void deq_q4_1(float *y, const uint8_t *b) {
    float d = rd_f16(b), m = rd_f16(b + 2);
    for (int j = 0; j < QK / 2; j++) {
        float lo = (float)(b[4 + j] & 0xf) * d, hi = (float)(b[4 + j] >> 4) * d;
        y[j] = lo + m;
        y[j + QK / 2] = hi + m;
    }
}

/* Q5_0: f16 d, u32 of fifth bits (bit j for element j), 16 bytes of nibbles; value d*(q-16). */
static void deq_q5_0(float *y, const uint8_t *b) {
    float d = rd_f16(b);
    uint32_t qh = rd_u32(b + 2);
    for (int j = 0; j < QK / 2; j++) {
        int lo = (b[6 + j] & 0xf) | (int)((qh >> j) & 1) << 4;
        int hi = (b[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + QK / 2] = (float)(hi - 16) * d;
    }
}

/* Q5_1: f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; value d*q + m. */
static void deq_q5_1(float *y, const uint8_t *b) {
    float d = rd_f16(b), m = rd_f16(b + 2);
    uint32_t qh = rd_u32(b + 4);
    for (int j = 0; j < QK / 2; j++) {
        int lo = (b[8 + j] & 0xf) | (int)((qh >> j) & 1) << 4;
        int hi = (b[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        float a = (float)lo * d, c = (float)hi * d;
        y[j] = a + m;
        y[j + QK / 2] = c + m;
    }
}

/* Q8_0: f16 d, 32 int8; value d*q. */
static void deq_q8_0(float *y, const uint8_t *b) {
    float d = rd_f16(b);
    for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* Q2_K: 16 bytes of (4-bit scale | 4-bit min << 4), 64 bytes of 2-bit quants, f16 d, f16 dmin.
 * 16 sub-blocks of 16; value (d*scale)*q - dmin*min. Quant bytes hold 4 sub-blocks each, at shifts 0,2,4,6. */
static void deq_q2_k(float *y, const uint8_t *b) {
    const uint8_t *sc = b, *q = b + 16;
    float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
    int is = 0;
    for (int half = 0; half < 2; half++, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int part = 0; part < 2; part++, is++) {
                float dl = d * (float)(sc[is] & 0xf), ml = dmin * (float)(sc[is] >> 4);
                for (int l = 0; l < 16; l++) {
                    float v = dl * (float)((q[l + 16 * part] >> shift) & 3);
                    *y++ = v - ml;
                }
            }
        }
    }
}

/* Q3_K: 32 bytes of high bits (hmask), 64 bytes of low 2 bits, 12 bytes of 6-bit scales, f16 d.
 * 16 sub-blocks of 16; value (d*(scale-32))*(q - (high bit clear ? 4 : 0)). Scale j: low 4 bits from byte j (j<8)
 * or the high nibble of byte j-8, top 2 bits from byte 8 + j%4 at shift 2*(j/4). */
static void deq_q3_k(float *y, const uint8_t *b) {
    const uint8_t *hm = b, *q = b + 32, *s = b + 96;
    float d = rd_f16(b + 108);
    int scale[16];
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? (s[j] & 0xf) : (s[j - 8] >> 4);
        int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        scale[j] = (lo | hi << 4) - 32;
    }
    int is = 0;
    uint8_t bit = 1;
    for (int half = 0; half < 2; half++, q += 32) {
        for (int shift = 0; shift < 8; shift += 2, bit = (uint8_t)(bit << 1)) {
            for (int part = 0; part < 2; part++, is++) {
                float dl = d * (float)scale[is];
                for (int l = 0; l < 16; l++) {
                    int k = l + 16 * part;
                    int v = ((q[k] >> shift) & 3) - ((hm[k] & bit) ? 0 : 4);
                    *y++ = dl * (float)v;
                }
            }
        }
    }
}

/* The 6-bit (scale, min) pair j of the 12-byte K-quant scale array (Q4_K, Q5_K): pairs 0-3 sit in the low 6 bits
 * of bytes j and j+4; pairs 4-7 take 4 bits from byte j+4 and their top 2 bits from the spare bits of bytes j-4, j. */
static void kq_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles. 8 sub-blocks of 32; each 32-byte group of
 * nibbles holds two sub-blocks (low nibbles, then high). value (d*scale)*q - dmin*min. */
static void deq_q4_k(float *y, const uint8_t *b) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *s = b + 4, *q = b + 16;
    for (int g = 0; g < 4; g++, q += 32) {
        for (int part = 0; part < 2; part++) {
            int sc, mn;
            kq_scale_min(2 * g + part, s, &sc, &mn);
            float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                float v = dl * (float)(part ? q[l] >> 4 : q[l] & 0xf);
                *y++ = v - ml;
            }
        }
    }
}

/* Q5_K: as Q4_K plus 32 bytes of fifth bits (qh) before the nibbles: sub-block i takes bit i of qh[l]. */
static void deq_q5_k(float *y, const uint8_t *b) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *q = b + 48;
    for (int g = 0; g < 4; g++, q += 32) {
        for (int part = 0; part < 2; part++) {
            int sc, mn, i = 2 * g + part;
            kq_scale_min(i, s, &sc, &mn);
            float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                int v = (part ? q[l] >> 4 : q[l] & 0xf) | ((qh[l] >> i) & 1) << 4;
                float a = dl * (float)v;
                *y++ = a - ml;
            }
        }
    }
}

/* Q6_K: 128 bytes of low nibbles (ql), 64 bytes of 2-bit highs (qh), 16 int8 scales, f16 d. Two halves of 128; in
 * each, element l + 32*k (k = 0..3) takes nibble (k/2 ? high : low) of ql[l + 32*(k%2)] and bits 2k of qh[l];
 * its scale is index l/16 + 2k. value (d*scale)*(q-32). */
static void deq_q6_k(float *y, const uint8_t *b) {
    const uint8_t *ql = b, *qh = b + 128;
    const uint8_t *sc = b + 192;
    float d = rd_f16(b + 208);
    for (int half = 0; half < 2; half++, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            for (int k = 0; k < 4; k++) {
                uint8_t lbyte = ql[l + 32 * (k % 2)];
                int v = ((k / 2) ? lbyte >> 4 : lbyte & 0xf) | ((qh[l] >> (2 * k)) & 3) << 4;
                float ds = d * (float)(int8_t)sc[l / 16 + 2 * k];
                y[l + 32 * k] = ds * (float)(v - 32);
            }
        }
    }
}

static int dequant_supported(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0: case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K: return 1;
    default: return 0;
    }
}

int export_dequantize(float *y, const uint8_t *x, uint32_t type, size_t n) {
    void (*blockfn)(float *, const uint8_t *) = NULL;
    switch (type) {
    case GGML_TYPE_F32:
        for (size_t i = 0; i < n; i++) y[i] = rd_f32(x + 4 * i);
        return 0;
    case GGML_TYPE_F16:
        for (size_t i = 0; i < n; i++) y[i] = export_f16_to_f32(rd_u16(x + 2 * i));
        return 0;
    case GGML_TYPE_BF16:
        for (size_t i = 0; i < n; i++) y[i] = export_bf16_to_f32(rd_u16(x + 2 * i));
        return 0;
    case GGML_TYPE_Q4_0: blockfn = deq_q4_0; break;
    case GGML_TYPE_Q4_1: blockfn = deq_q4_1; break;
    case GGML_TYPE_Q5_0: blockfn = deq_q5_0; break;
    case GGML_TYPE_Q5_1: blockfn = deq_q5_1; break;
    case GGML_TYPE_Q8_0: blockfn = deq_q8_0; break;
    case GGML_TYPE_Q2_K: blockfn = deq_q2_k; break;
    case GGML_TYPE_Q3_K: blockfn = deq_q3_k; break;
    case GGML_TYPE_Q4_K: blockfn = deq_q4_k; break;
    case GGML_TYPE_Q5_K: blockfn = deq_q5_k; break;
    case GGML_TYPE_Q6_K: blockfn = deq_q6_k; break;
    default: return -1;
    }
    const GgmlType *t = ggml_type(type);
    for (size_t i = 0; i < n / t->blck; i++) blockfn(y + i * t->blck, x + i * t->bytes);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * GGUF reader (ggml docs/gguf.md). Layout: "GGUF", u32 version, u64 n_tensors, u64 n_kv, the metadata pairs
 * (u64-length string key, u32 type, value), the tensor infos (name, u32 n_dims, u64 ne[n_dims], u32 type,
 * u64 offset), padding to general.alignment, the data section. */

#define GGUF_MAGIC 0x46554747u   /* "GGUF" read as a little-endian u32 */
#define GGUF_DEFAULT_ALIGNMENT 32

typedef struct {
    const uint8_t *p;   /* (n) */
    size_t n, off;      /* bytes */
    char *err;
    size_t errlen;
} Cursor;

static size_t cur_left(const Cursor *c) { return c->n - c->off; }

static int cur_need(Cursor *c, size_t k, const char *what) {
    if (cur_left(c) < k)
        return errorf(c->err, c->errlen, "file ends inside %s (offset %zu, needs %zu bytes, %zu left)", what, c->off,
                    k, cur_left(c));
    return 0;
}

static int cur_u32(Cursor *c, uint32_t *v, const char *what) {
    if (cur_need(c, 4, what)) return -1;
    *v = rd_u32(c->p + c->off);
    c->off += 4;
    return 0;
}

static int cur_u64(Cursor *c, uint64_t *v, const char *what) {
    if (cur_need(c, 8, what)) return -1;
    *v = rd_u64(c->p + c->off);
    c->off += 8;
    return 0;
}

static int cur_str(Cursor *c, const char **s, size_t *len, const char *what) {
    uint64_t n;
    if (cur_u64(c, &n, what)) return -1;
    if (n > cur_left(c))
        return errorf(c->err, c->errlen, "%s: string length %llu at offset %zu runs past the end of the file "
                    "(%zu bytes left)", what, (unsigned long long)n, c->off - 8, cur_left(c));
    *s = (const char *)c->p + c->off;
    *len = (size_t)n;
    c->off += (size_t)n;
    return 0;
}

static size_t gguf_scalar_size(uint32_t type) {
    switch (type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static int name_cmp(const char *a, size_t na, const char *b, size_t nb) {
    int r = memcmp(a, b, na < nb ? na : nb);
    return r ? r : (na < nb ? -1 : na > nb);
}
static int kv_ptr_cmp(const void *a, const void *b) {
    const GgufKV *x = *(GgufKV *const *)a, *y = *(GgufKV *const *)b;
    return name_cmp(x->key, x->key_len, y->key, y->key_len);
}
static int tensor_ptr_cmp(const void *a, const void *b) {
    const GgufTensor *x = *(GgufTensor *const *)a, *y = *(GgufTensor *const *)b;
    return name_cmp(x->name, x->name_len, y->name, y->name_len);
}

/* Reads one metadata value of the given type, checking it fits in the file. */
static int gguf_read_value(Cursor *c, GgufKV *kv) {
    char what[96];
    snprintf(what, sizeof what, "the value of key '" NAMEFMT "'", NAMEARG(kv->key, kv->key_len));
    kv->val = c->p + c->off;
    if (kv->type == GGUF_TYPE_STRING) {
        const char *s;
        size_t n;
        return cur_str(c, &s, &n, what);
    }
    if (kv->type == GGUF_TYPE_ARRAY) {
        if (cur_u32(c, &kv->arr_type, what) || cur_u64(c, &kv->arr_n, what)) return -1;
        kv->val = c->p + c->off;
        if (kv->arr_type == GGUF_TYPE_ARRAY)
            return errorf(c->err, c->errlen, "key '" NAMEFMT "': nested arrays are not supported",
                        NAMEARG(kv->key, kv->key_len));
        if (kv->arr_type == GGUF_TYPE_STRING) {
            /* each string needs at least its 8-byte length */
            if (kv->arr_n > cur_left(c) / 8)
                return errorf(c->err, c->errlen, "key '" NAMEFMT "': array count %llu is larger than the file could "
                            "hold", NAMEARG(kv->key, kv->key_len), (unsigned long long)kv->arr_n);
            for (uint64_t i = 0; i < kv->arr_n; i++) {
                const char *s;
                size_t n;
                if (cur_str(c, &s, &n, what)) return -1;
            }
            return 0;
        }
        size_t es = gguf_scalar_size(kv->arr_type);
        if (!es)
            return errorf(c->err, c->errlen, "key '" NAMEFMT "': unknown array element type %u",
                        NAMEARG(kv->key, kv->key_len), kv->arr_type);
        if (kv->arr_n > cur_left(c) / es)
            return errorf(c->err, c->errlen, "key '" NAMEFMT "': array count %llu is larger than the file could hold",
                        NAMEARG(kv->key, kv->key_len), (unsigned long long)kv->arr_n);
        c->off += (size_t)kv->arr_n * es;
        return 0;
    }
    size_t es = gguf_scalar_size(kv->type);
    if (!es)
        return errorf(c->err, c->errlen, "key '" NAMEFMT "': unknown value type %u", NAMEARG(kv->key, kv->key_len),
                    kv->type);
    return cur_need(c, es, what) ? -1 : (c->off += es, 0);
}

/* An integer metadata value of any integer type, as int64 (u64 above INT64_MAX is an error). */
static int kv_int(const GgufKV *kv, int64_t *v, char *err, size_t errlen) {
    const uint8_t *p = kv->val;
    switch (kv->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_BOOL: *v = p[0]; return 0;
    case GGUF_TYPE_INT8: *v = (int8_t)p[0]; return 0;
    case GGUF_TYPE_UINT16: *v = rd_u16(p); return 0;
    case GGUF_TYPE_INT16: *v = (int16_t)rd_u16(p); return 0;
    case GGUF_TYPE_UINT32: *v = rd_u32(p); return 0;
    case GGUF_TYPE_INT32: *v = (int32_t)rd_u32(p); return 0;
    case GGUF_TYPE_INT64: *v = (int64_t)rd_u64(p); return 0;
    case GGUF_TYPE_UINT64:
        if (rd_u64(p) > (uint64_t)INT64_MAX) break;
        *v = (int64_t)rd_u64(p);
        return 0;
    }
    return errorf(err, errlen, "key '" NAMEFMT "' must be an integer in range (type %u)", NAMEARG(kv->key, kv->key_len),
                kv->type);
}

int gguf_parse(Gguf *g, const uint8_t *data, size_t size, char *err, size_t errlen) {
    memset(g, 0, sizeof *g);
    g->base = data;
    g->size = size;
    Cursor c = {data, size, 0, err, errlen};
    uint32_t magic;
    if (size < 4) return errorf(err, errlen, "not a GGUF file: %zu bytes, too short for the magic", size);
    if (cur_u32(&c, &magic, "the header")) return -1;
    if (magic != GGUF_MAGIC) return errorf(err, errlen, "not a GGUF file: wrong magic 0x%08x (expected \"GGUF\")", magic);
    if (cur_u32(&c, &g->version, "the header")) return -1;
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return errorf(err, errlen, "unsupported GGUF version: the file is big-endian");
    if (g->version != 2 && g->version != 3)
        return errorf(err, errlen, "unsupported GGUF version %u (only 2 and 3 are read)", g->version);
    if (cur_u64(&c, &g->n_tensors, "the header") || cur_u64(&c, &g->n_kv, "the header")) return -1;
    /* smallest possible pair: 8-byte key length, 4-byte type, 1-byte value; smallest tensor info: 8-byte name
     * length, u32 n_dims, one u64 dim, u32 type, u64 offset */
    if (g->n_kv > cur_left(&c) / 13)
        return errorf(err, errlen, "KV count %llu is larger than the file could hold", (unsigned long long)g->n_kv);
    if (g->n_tensors > cur_left(&c) / 32)
        return errorf(err, errlen, "tensor count %llu is larger than the file could hold",
                    (unsigned long long)g->n_tensors);
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    g->by_name = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->by_name);
    GgufKV **kv_sorted = calloc(g->n_kv ? g->n_kv : 1, sizeof *kv_sorted);
    if (!g->kv || !g->tensors || !g->by_name || !kv_sorted) {
        free(kv_sorted);
        return errorf(err, errlen, "out of memory");
    }
    int rc = -1;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        GgufKV *kv = &g->kv[i];
        if (cur_str(&c, &kv->key, &kv->key_len, "a metadata key") || cur_u32(&c, &kv->type, "a metadata type") ||
            gguf_read_value(&c, kv))
            goto done;
        kv_sorted[i] = kv;
    }
    qsort(kv_sorted, g->n_kv, sizeof *kv_sorted, kv_ptr_cmp);
    for (uint64_t i = 1; i < g->n_kv; i++)
        if (kv_ptr_cmp(&kv_sorted[i - 1], &kv_sorted[i]) == 0) {
            errorf(err, errlen, "duplicate metadata key '" NAMEFMT "'", NAMEARG(kv_sorted[i]->key, kv_sorted[i]->key_len));
            goto done;
        }
    const GgufKV *al = gguf_find_kv(g, "general.alignment");
    if (al) {
        int64_t a;
        if (kv_int(al, &a, err, errlen)) goto done;
        if (a <= 0 || (a & (a - 1)) || a > (1 << 30)) {
            errorf(err, errlen, "general.alignment %lld is not a nonzero power of two", (long long)a);
            goto done;
        }
        g->alignment = (uint64_t)a;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        GgufTensor *t = &g->tensors[i];
        if (cur_str(&c, &t->name, &t->name_len, "a tensor name") || cur_u32(&c, &t->n_dims, "a tensor info"))
            goto done;
        if (t->n_dims < 1 || t->n_dims > 4) {
            errorf(err, errlen, "tensor '" NAMEFMT "' has %u dimensions (1 to 4 allowed)", NAMEARG(t->name, t->name_len),
                 t->n_dims);
            goto done;
        }
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++)
            if (cur_u64(&c, &t->ne[d], "a tensor info")) goto done;
        if (cur_u32(&c, &t->type, "a tensor info") || cur_u64(&c, &t->offset, "a tensor info")) goto done;
        const GgmlType *ty = ggml_type(t->type);
        if (!ty) {
            errorf(err, errlen, "unsupported tensor type ? (id %u) in tensor " NAMEFMT, t->type,
                 NAMEARG(t->name, t->name_len));
            goto done;
        }
        uint64_t n = 1;
        int overflow = 0;
        for (int d = 0; d < 4; d++) {
            if (t->ne[d] == 0) {
                errorf(err, errlen, "tensor '" NAMEFMT "' has a zero dimension", NAMEARG(t->name, t->name_len));
                goto done;
            }
            if (n > UINT64_MAX / t->ne[d]) overflow = 1;
            else n *= t->ne[d];
        }
        if (overflow || n / ty->blck > UINT64_MAX / ty->bytes) {
            errorf(err, errlen, "tensor '" NAMEFMT "': shape [%llu, %llu, %llu, %llu] has a byte size that overflows "
                 "64 bits", NAMEARG(t->name, t->name_len), (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                 (unsigned long long)t->ne[2], (unsigned long long)t->ne[3]);
            goto done;
        }
        if (t->ne[0] % ty->blck) {
            errorf(err, errlen, "tensor '" NAMEFMT "': row length %llu is not a multiple of the %s block size %u",
                 NAMEARG(t->name, t->name_len), (unsigned long long)t->ne[0], ty->name, ty->blck);
            goto done;
        }
        t->n_elems = n;
        t->n_bytes = n / ty->blck * ty->bytes;
        g->by_name[i] = t;
    }
    qsort(g->by_name, g->n_tensors, sizeof *g->by_name, tensor_ptr_cmp);
    for (uint64_t i = 1; i < g->n_tensors; i++)
        if (tensor_ptr_cmp(&g->by_name[i - 1], &g->by_name[i]) == 0) {
            errorf(err, errlen, "duplicate tensor name '" NAMEFMT "'", NAMEARG(g->by_name[i]->name, g->by_name[i]->name_len));
            goto done;
        }
    /* the data section starts at the next multiple of the alignment; a file with no tensors may end right here */
    size_t pad = (size_t)((g->alignment - c.off % g->alignment) % g->alignment);
    if (g->n_tensors == 0 && pad > cur_left(&c)) pad = cur_left(&c);
    if (pad > cur_left(&c)) {
        errorf(err, errlen, "file ends before the data section (offset %zu, %zu bytes)", c.off + pad, size);
        goto done;
    }
    g->data_offset = c.off + pad;
    uint64_t data_bytes = size - g->data_offset;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        GgufTensor *t = &g->tensors[i];
        if (t->offset % g->alignment) {
            errorf(err, errlen, "tensor '" NAMEFMT "': offset %llu is not a multiple of the alignment %llu",
                 NAMEARG(t->name, t->name_len), (unsigned long long)t->offset, (unsigned long long)g->alignment);
            goto done;
        }
        if (t->offset > data_bytes || t->n_bytes > data_bytes - t->offset) {
            errorf(err, errlen, "tensor '" NAMEFMT "': data at offset %llu, %llu bytes, lies outside the data section "
                 "(%llu bytes; file truncated?)", NAMEARG(t->name, t->name_len), (unsigned long long)t->offset,
                 (unsigned long long)t->n_bytes, (unsigned long long)data_bytes);
            goto done;
        }
        t->data = data + g->data_offset + t->offset;
    }
    rc = 0;
done:
    free(kv_sorted);
    if (rc) gguf_free(g);
    return rc;
}

void gguf_free(Gguf *g) {
    free(g->kv);
    free(g->tensors);
    free(g->by_name);
    g->kv = NULL;
    g->tensors = NULL;
    g->by_name = NULL;
}

const GgufKV *gguf_find_kv(const Gguf *g, const char *key) {
    size_t n = strlen(key);
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (g->kv[i].key_len == n && memcmp(g->kv[i].key, key, n) == 0) return &g->kv[i];
    return NULL;
}

const GgufTensor *gguf_find_tensor(const Gguf *g, const char *name) {
    GgufTensor key = {.name = name, .name_len = strlen(name)};
    GgufTensor *kp = &key, **hit = bsearch(&kp, g->by_name, g->n_tensors, sizeof *g->by_name, tensor_ptr_cmp);
    return hit ? *hit : NULL;
}

/* Typed metadata getters: 1 = found, 0 = absent, -1 = present with the wrong type (message in err). */
static int meta_int(const Gguf *g, const char *key, int64_t *v, char *err, size_t errlen) {
    const GgufKV *kv = gguf_find_kv(g, key);
    if (!kv) return 0;
    return kv_int(kv, v, err, errlen) ? -1 : 1;
}

static int meta_float(const Gguf *g, const char *key, double *v, char *err, size_t errlen) {
    const GgufKV *kv = gguf_find_kv(g, key);
    if (!kv) return 0;
    if (kv->type == GGUF_TYPE_FLOAT32) *v = rd_f32(kv->val);
    else if (kv->type == GGUF_TYPE_FLOAT64) { uint64_t u = rd_u64(kv->val); memcpy(v, &u, 8); }
    else return errorf(err, errlen, "key '%s' must be a float (type %u)", key, kv->type);
    return 1;
}

static int meta_str(const Gguf *g, const char *key, const char **s, size_t *n, char *err, size_t errlen) {
    const GgufKV *kv = gguf_find_kv(g, key);
    if (!kv) return 0;
    if (kv->type != GGUF_TYPE_STRING) return errorf(err, errlen, "key '%s' must be a string (type %u)", key, kv->type);
    *n = (size_t)rd_u64(kv->val);
    *s = (const char *)kv->val + 8;
    return 1;
}

static int meta_bool(const Gguf *g, const char *key, int *v, char *err, size_t errlen) {
    const GgufKV *kv = gguf_find_kv(g, key);
    if (!kv) return 0;
    if (kv->type != GGUF_TYPE_BOOL) return errorf(err, errlen, "key '%s' must be a bool (type %u)", key, kv->type);
    *v = kv->val[0] != 0;
    return 1;
}

/* An array of the given element type, or absent. */
static int meta_array(const Gguf *g, const char *key, uint32_t elem, const GgufKV **out, char *err, size_t errlen) {
    const GgufKV *kv = gguf_find_kv(g, key);
    *out = NULL;
    if (!kv) return 0;
    if (kv->type != GGUF_TYPE_ARRAY || kv->arr_type != elem)
        return errorf(err, errlen, "key '%s' must be an array of type %u", key, elem);
    *out = kv;
    return 1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The model.bin config and its tensor list (FORMAT.md's order: one copy of it, used by every exporter) */

/* The header, the config and its bounds are model_format.h's: the loader (model.c) reads the same definitions. */

typedef struct {
    char name[48];     /* GGUF name */
    size_t rows, cols; /* elements; rows = 1 for vectors */
    int is_vec;
} TensorSpec;

static size_t layout_add(TensorSpec *s, size_t i, const char *name, size_t rows, size_t cols, int is_vec) {
    if (s) {
        snprintf(s[i].name, sizeof s[i].name, "%s", name);
        s[i].rows = rows;
        s[i].cols = cols;
        s[i].is_vec = is_vec;
    }
    return i + 1;
}

/* Fills s (may be NULL) with the tensors of model.bin in file order; returns their count. n_layers = 0 gives none. */
static size_t model_layout(TensorSpec *s, const Config *c) {
    size_t n = 0, dim = (size_t)c->dim, hid = (size_t)c->hidden_dim, qd = (size_t)c->n_heads * (size_t)c->head_dim,
           kvd = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    char name[48];
    if (c->n_layers == 0) return 0;
    n = layout_add(s, n, "token_embd.weight", (size_t)c->vocab_size, dim, 0);
    if (c->has_rope_factors) n = layout_add(s, n, "rope_freqs.weight", 1, (size_t)c->head_dim / 2, 1);
    for (int l = 0; l < c->n_layers; l++) {
        struct { const char *suffix; size_t rows, cols; int vec; } per[] = {
            {"attn_norm", 1, dim, 1}, {"attn_q", qd, dim, 0},  {"attn_k", kvd, dim, 0},
            {"attn_v", kvd, dim, 0},  {"attn_output", dim, qd, 0}, {"ffn_norm", 1, dim, 1},
            {"ffn_gate", hid, dim, 0}, {"ffn_down", dim, hid, 0}, {"ffn_up", hid, dim, 0},
        };
        for (size_t k = 0; k < sizeof per / sizeof per[0]; k++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, per[k].suffix);
            n = layout_add(s, n, name, per[k].rows, per[k].cols, per[k].vec);
        }
    }
    n = layout_add(s, n, "output_norm.weight", 1, dim, 1);
    if (!c->tied) n = layout_add(s, n, "output.weight", (size_t)c->vocab_size, dim, 0);
    return n;
}

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---------------------------------------------------------------------------------------------------------------
 * A growable byte buffer (the tokenizer section is built in memory: a few MB at most) */

typedef struct { uint8_t *p; size_t len, cap; int oom; } Buf;

static void buf_put(Buf *b, const void *data, size_t n) {
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}
static void buf_u32(Buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    buf_put(b, x, 4);
}
static void buf_f32(Buf *b, float f) { uint32_t u; memcpy(&u, &f, 4); buf_u32(b, u); }

/* The fixed part of the tokenizer section, up to and including the chat template (FORMAT.md). */
typedef struct {
    uint32_t kind, n_tokens;
    int32_t bos, eos, eot, pad, unk;
    uint32_t add_bos, add_space_prefix;
    const char *pre; size_t pre_len;
    const char *chat; size_t chat_len;
} TokHeader;

static void tok_put_header(Buf *b, const TokHeader *h) {
    char pre[32] = {0};
    memcpy(pre, h->pre, h->pre_len);
    buf_u32(b, h->kind);
    buf_u32(b, h->n_tokens);
    int32_t ids[5] = {h->bos, h->eos, h->eot, h->pad, h->unk};
    for (int i = 0; i < 5; i++) buf_u32(b, (uint32_t)ids[i]);
    buf_u32(b, h->add_bos);
    buf_u32(b, h->add_space_prefix);
    buf_put(b, pre, 32);
    buf_u32(b, (uint32_t)h->chat_len);
    buf_put(b, h->chat, h->chat_len);
}

/* The tokenizer section from GGUF tokenizer.ggml.* metadata. No tokenizer.ggml.model: b stays empty (ids-only). */
static int tok_from_gguf(Buf *b, const Gguf *g, char *err, size_t errlen) {
    const char *model;
    size_t model_len;
    int r = meta_str(g, "tokenizer.ggml.model", &model, &model_len, err, errlen);
    if (r <= 0) return r;
    TokHeader h = {0};
    if (model_len == 5 && !memcmp(model, "llama", 5)) h.kind = 1;
    else if (model_len == 4 && !memcmp(model, "gpt2", 4)) h.kind = 2;
    else return errorf(err, errlen, "unsupported tokenizer model '" NAMEFMT "' (llama and gpt2 are supported)",
                     NAMEARG(model, model_len));
    const GgufKV *tokens, *scores, *types, *merges;
    if (meta_array(g, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, &tokens, err, errlen) < 0) return -1;
    if (!tokens) return errorf(err, errlen, "tokenizer.ggml.tokens is missing");
    if (tokens->arr_n == 0 || tokens->arr_n > MODEL_MAX_VOCAB)
        return errorf(err, errlen, "tokenizer.ggml.tokens has %llu entries (1 to %d allowed)",
                    (unsigned long long)tokens->arr_n, MODEL_MAX_VOCAB);
    h.n_tokens = (uint32_t)tokens->arr_n;
    if (meta_array(g, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, &scores, err, errlen) < 0 ||
        meta_array(g, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, &types, err, errlen) < 0 ||
        meta_array(g, "tokenizer.ggml.merges", GGUF_TYPE_STRING, &merges, err, errlen) < 0)
        return -1;
    if (scores && scores->arr_n != h.n_tokens)
        return errorf(err, errlen, "tokenizer.ggml.scores has %llu entries, tokens has %u",
                    (unsigned long long)scores->arr_n, h.n_tokens);
    if (types && types->arr_n != h.n_tokens)
        return errorf(err, errlen, "tokenizer.ggml.token_type has %llu entries, tokens has %u",
                    (unsigned long long)types->arr_n, h.n_tokens);
    struct { const char *key; int32_t *dst; } ids[] = {
        {"tokenizer.ggml.bos_token_id", &h.bos}, {"tokenizer.ggml.eos_token_id", &h.eos},
        {"tokenizer.ggml.eot_token_id", &h.eot}, {"tokenizer.ggml.padding_token_id", &h.pad},
        {"tokenizer.ggml.unknown_token_id", &h.unk},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        int64_t v;
        *ids[i].dst = -1;
        if ((r = meta_int(g, ids[i].key, &v, err, errlen)) < 0) return -1;
        if (r == 0) continue;
        if (v < 0 || v >= h.n_tokens)   /* llama.cpp also ignores an out-of-range special id */
            fprintf(stderr, "export: warning: %s = %lld is outside the vocabulary (%u tokens), stored as absent\n",
                    ids[i].key, (long long)v, h.n_tokens);
        else
            *ids[i].dst = (int32_t)v;
    }
    int add_bos = h.kind == 1, add_space = h.kind == 1;
    if (meta_bool(g, "tokenizer.ggml.add_bos_token", &add_bos, err, errlen) < 0 ||
        meta_bool(g, "tokenizer.ggml.add_space_prefix", &add_space, err, errlen) < 0)
        return -1;
    h.add_bos = (uint32_t)add_bos;
    h.add_space_prefix = (uint32_t)add_space;
    h.pre = "";
    if (meta_str(g, "tokenizer.ggml.pre", &h.pre, &h.pre_len, err, errlen) < 0) return -1;
    if (h.pre_len > 31)
        return errorf(err, errlen, "tokenizer.ggml.pre '" NAMEFMT "' is longer than 31 bytes", NAMEARG(h.pre, h.pre_len));
    h.chat = "";
    if (meta_str(g, "tokenizer.chat_template", &h.chat, &h.chat_len, err, errlen) < 0) return -1;
    if (h.chat_len > UINT32_MAX) return errorf(err, errlen, "tokenizer.chat_template is too long");
    tok_put_header(b, &h);
    /* the string arrays were bounds-checked by gguf_parse, so walking them again is safe */
    const uint8_t *tp = tokens->val;
    for (uint32_t i = 0; i < h.n_tokens; i++) {
        uint64_t n = rd_u64(tp);
        buf_f32(b, scores ? rd_f32(scores->val + 4 * (size_t)i) : 0.0f);
        buf_u32(b, types ? rd_u32(types->val + 4 * (size_t)i) : 1u);
        if (n > UINT32_MAX) return errorf(err, errlen, "token %u is longer than 4 GiB", i);
        buf_u32(b, (uint32_t)n);
        buf_put(b, tp + 8, (size_t)n);
        tp += 8 + n;
    }
    uint64_t n_merges = merges ? merges->arr_n : 0;
    if (h.kind == 2 && n_merges == 0)   /* tokenizer.c refuses such a section */
        return errorf(err, errlen, "tokenizer.ggml.merges is missing or empty: a byte-level BPE (gpt2) vocabulary needs "
                    "its merges");
    if (n_merges > UINT32_MAX) return errorf(err, errlen, "too many merges");
    buf_u32(b, (uint32_t)n_merges);
    const uint8_t *mp = merges ? merges->val : NULL;
    for (uint64_t i = 0; i < n_merges; i++) {
        uint64_t n = rd_u64(mp);
        if (n > UINT32_MAX) return errorf(err, errlen, "merge %llu is longer than 4 GiB", (unsigned long long)i);
        buf_u32(b, (uint32_t)n);
        buf_put(b, mp + 8, (size_t)n);
        mp += 8 + n;
    }
    return b->oom ? errorf(err, errlen, "out of memory") : 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Input files */

typedef struct { const uint8_t *p; size_t n; } Mapped;   /* (n) bytes, read-only */

static int map_file(Mapped *m, const char *path, char *err, size_t errlen) {
    struct stat st;
    m->p = NULL;
    m->n = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return errorf(err, errlen, "cannot open %s: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) { close(fd); return errorf(err, errlen, "cannot stat %s: %s", path, strerror(errno)); }
    if (S_ISDIR(st.st_mode)) { close(fd); return errorf(err, errlen, "%s is a directory, not a file", path); }
    if (!S_ISREG(st.st_mode)) { close(fd); return errorf(err, errlen, "%s is not a regular file", path); }
    if (st.st_size == 0) { close(fd); return errorf(err, errlen, "%s is empty", path); }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return errorf(err, errlen, "cannot map %s: %s", path, strerror(errno));
    m->p = p;
    m->n = (size_t)st.st_size;
    return 0;
}

static void unmap_file(Mapped *m) {
    if (m->p) munmap((void *)m->p, m->n);
    m->p = NULL;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The model.bin writer */

/* Where a tensor's values come from: bytes of a ggml type in an input file, or the random generator. */
typedef struct {
    const uint8_t *data;   /* NULL = random */
    uint32_t type;         /* ggml type of data */
    float center, scale;   /* random: center + scale * uniform[-1, 1) */
    int redraw_first;      /* random: the values of tensor 0 again (the q8 copy of a tied classifier) */
} TensorSrc;

/* uniform in [-1, 1): the top 24 bits, so every value is an exact f32 */
static float rand_unit(uint64_t *state) { return (float)(splitmix64(state) >> 40) * 0x1p-23f - 1.0f; }

#define CHUNK_ELEMS ((size_t)1 << 20)   /* dequantize this many values at a time: 4 MiB, a multiple of every block */

/* Whether tensor s is stored quantized under c's wtype: every matrix but the embedding (whose rows run copies). */
static int tensor_quantized(const Config *c, const TensorSpec *s) {
    return c->wtype == EXPORT_WTYPE_Q8 && !s->is_vec && strcmp(s->name, "token_embd.weight") != 0;
}
/* Bytes of tensor s in model.bin, before padding (FORMAT.md). */
static size_t tensor_bytes(const Config *c, const TensorSpec *s) {
    if (tensor_quantized(c, s)) return s->rows * (s->cols / Q8_GROUP) * sizeof(BlockQ8);
    return s->rows * s->cols * 4;
}

/* A q8 file reads its classifier as int8 groups, so a tied model is written untied: tied = 0 and an output.weight
 * that holds the embedding's values quantized (the embedding itself stays f32). Returns 1 when it untied c. */
static int untie_for_q8(Config *c) {
    if (c->wtype != EXPORT_WTYPE_Q8 || !c->tied) return 0;
    c->tied = 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The output path. model_write writes OUT.tmp and renames it over OUT, so before any work: OUT is absent or a
 * regular file (a device, directory or FIFO would be written to until it is full, or replaced by the rename), its
 * directory exists and is writable, OUT.tmp is absent or a regular file, and neither OUT nor OUT.tmp is one of the
 * input files (compared by device and inode: a hard link, a symlink or another spelling of the path is the same file;
 * writing it would destroy the input while it is being read). */

static const char *file_kind(mode_t mode) {
    return S_ISDIR(mode) ? "a directory" : S_ISCHR(mode) ? "a character device" : S_ISBLK(mode) ? "a block device"
         : S_ISFIFO(mode) ? "a FIFO" : S_ISSOCK(mode) ? "a socket" : S_ISLNK(mode) ? "a symbolic link"
         : "not a regular file";
}

/* in: n_in input paths (NULL entries are skipped), what: what each one is ("input", "checkpoint", "tokenizer"). */
static int output_check(const char *out, const char *const *in, const char *const *what, int n_in, char *err,
                        size_t errlen) {
    struct stat so, si;
    char tmp[4096], dir[4096];
    if (!out[0]) return errorf(err, errlen, "the output path is empty");
    if (snprintf(tmp, sizeof tmp, "%s.tmp", out) >= (int)sizeof tmp) return errorf(err, errlen, "output path too long");
    const char *slash = strrchr(out, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
    int have_out = stat(out, &so) == 0;
    if (!have_out && errno != ENOENT) return errorf(err, errlen, "cannot write output %s: %s", out, strerror(errno));
    if (have_out && !S_ISREG(so.st_mode))
        return errorf(err, errlen, "output %s is %s, not a regular file (export writes %s.tmp and renames it over the "
                    "output)", out, file_kind(so.st_mode), out);
    for (int i = 0; have_out && i < n_in; i++)
        if (in[i] && stat(in[i], &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
            return errorf(err, errlen, "output %s is the same file as the %s %s: refusing to overwrite it", out, what[i],
                        in[i]);
    struct stat sd;
    if (stat(dir, &sd) != 0)
        return errno == ENOENT ? errorf(err, errlen, "cannot create output %s: directory %s does not exist", out, dir)
                               : errorf(err, errlen, "cannot create output %s: directory %s: %s", out, dir,
                                      strerror(errno));
    if (!S_ISDIR(sd.st_mode)) return errorf(err, errlen, "cannot create output %s: %s is not a directory", out, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return errorf(err, errlen, "cannot create output %s: directory %s is not writable (%s)", out, dir,
                    strerror(errno));
    struct stat st;
    if (lstat(tmp, &st) == 0) {
        if (!S_ISREG(st.st_mode))
            return errorf(err, errlen, "%s (the temporary file for output %s) exists and is %s: remove it", tmp, out,
                        file_kind(st.st_mode));
        for (int i = 0; i < n_in; i++)
            if (in[i] && stat(in[i], &si) == 0 && si.st_dev == st.st_dev && si.st_ino == st.st_ino)
                return errorf(err, errlen, "%s (the temporary file for output %s) is the same file as the %s %s: "
                            "refusing to overwrite it", tmp, out, what[i], in[i]);
    }
    return 0;
}

/* Writes model.bin to out (via out.tmp, renamed when complete). specs/srcs: n tensors in model_layout's order;
 * tok: the tokenizer section (len 0 = ids-only); rng: the random generator state when a src is random. */
static int model_write(const char *out, const Config *c, const Buf *tok, const TensorSpec *specs,
                       const TensorSrc *srcs, size_t n, uint64_t *rng, char *err, size_t errlen) {
    if (c->wtype != EXPORT_WTYPE_F32 && c->wtype != EXPORT_WTYPE_Q8)
        return errorf(err, errlen, "wtype %d is not available (f32 and q8 are)", c->wtype);
    for (size_t i = 0; i < n; i++)
        if (tensor_quantized(c, &specs[i]) && specs[i].cols % Q8_GROUP)
            return errorf(err, errlen, "--wtype q8 needs every matrix's columns to be a multiple of %d: tensor %s has "
                        "%zu columns", Q8_GROUP, specs[i].name, specs[i].cols);
    uint8_t h[MODEL_HEADER_BYTES];
    size_t tok_off = tok->len ? MODEL_HEADER_BYTES : 0;
    size_t w_off = align_up(MODEL_HEADER_BYTES + tok->len, MODEL_ALIGN), w_bytes = 0;
    for (size_t i = 0; i < n; i++) w_bytes += align_up(tensor_bytes(c, &specs[i]), MODEL_ALIGN);
    ModelHeader hd = {*c, tok_off, tok->len, w_off, w_bytes, w_off + w_bytes};
    model_header_pack(h, &hd);

    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", out) >= (int)sizeof tmp) return errorf(err, errlen, "output path too long");
    /* output_check ran before: this only guards against a FIFO or symlink put there since (no hang, no follow) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK, 0666);
    if (fd < 0) return errorf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return errorf(err, errlen, "cannot create %s: not a regular file", tmp);
    }
    FILE *f = fdopen(fd, "wb");
    if (!f) { close(fd); remove(tmp); return errorf(err, errlen, "cannot create %s: %s", tmp, strerror(errno)); }
    float *buf = malloc(CHUNK_ELEMS * sizeof *buf);
    BlockQ8 *qbuf = malloc(CHUNK_ELEMS / Q8_GROUP * sizeof *qbuf);
    uint64_t first_rng = rng ? *rng : 0;   /* the generator's state at tensor 0, to redraw its values */
    static const uint8_t zeros[MODEL_ALIGN];
    int ok = buf != NULL && qbuf != NULL;
    ok = ok && fwrite(h, 1, sizeof h, f) == sizeof h;
    if (ok && tok->len) ok = fwrite(tok->p, 1, tok->len, f) == tok->len;
    size_t pos = MODEL_HEADER_BYTES + tok->len;
    if (ok) ok = fwrite(zeros, 1, w_off - pos, f) == w_off - pos;
    pos = w_off;
    for (size_t i = 0; ok && i < n; i++) {
        size_t total = specs[i].rows * specs[i].cols, blck = 1, bytes = 4;
        int quantized = tensor_quantized(c, &specs[i]);
        uint64_t redraw = first_rng, *r = srcs[i].redraw_first ? &redraw : rng;
        if (srcs[i].data) {
            export_ggml_type_size(srcs[i].type, &blck, &bytes);
        }
        for (size_t done = 0; ok && done < total;) {
            size_t k = total - done < CHUNK_ELEMS ? total - done : CHUNK_ELEMS;
            if (srcs[i].data) {
                if (export_dequantize(buf, srcs[i].data + done / blck * bytes, srcs[i].type, k)) {
                    const char *tn = export_ggml_type_name(srcs[i].type);
                    errorf(err, errlen, "unsupported tensor type %s (id %u) in tensor %s", tn ? tn : "?", srcs[i].type,
                         specs[i].name);
                    ok = 0;
                    break;
                }
                if (!strcmp(specs[i].name, "rope_freqs.weight"))   /* the bounds run.c's loader checks */
                    for (size_t j = 0; ok && j < k; j++)
                        if (!(buf[j] > 0 && buf[j] < 1e6f)) {
                            errorf(err, errlen, "tensor rope_freqs.weight: factor %zu = %g is not a positive finite "
                                 "number", done + j, (double)buf[j]);
                            ok = 0;
                        }
                if (!ok) break;
            } else {
                for (size_t j = 0; j < k; j++) buf[j] = srcs[i].center + srcs[i].scale * rand_unit(r);
            }
            if (quantized) {   /* k and cols are multiples of Q8_GROUP: no group spans two rows or two chunks */
                for (size_t g = 0; g < k / Q8_GROUP; g++)
                    qbuf[g].d = kv_f32_to_f16(quant_q8_group(qbuf[g].q, buf + g * Q8_GROUP));
                ok = fwrite(qbuf, sizeof *qbuf, k / Q8_GROUP, f) == k / Q8_GROUP;
            } else {
                ok = fwrite(buf, sizeof *buf, k, f) == k;
            }
            done += k;
        }
        size_t tb = tensor_bytes(c, &specs[i]), pad = align_up(tb, MODEL_ALIGN) - tb;
        if (ok) ok = fwrite(zeros, 1, pad, f) == pad;
    }
    free(buf);
    free(qbuf);
    if (!ok && !err[0]) errorf(err, errlen, "cannot write %s: %s", tmp, buf ? strerror(errno) : "out of memory");
    if (fclose(f) != 0 && ok) { ok = 0; errorf(err, errlen, "cannot write %s: %s", tmp, strerror(errno)); }
    if (ok && rename(tmp, out) != 0) { ok = 0; errorf(err, errlen, "cannot rename %s to %s: %s", tmp, out, strerror(errno)); }
    if (!ok) remove(tmp);
    return ok ? 0 : -1;
}

/* Builds the spec list for c; the caller frees *specs. */
static int layout_alloc(TensorSpec **specs, TensorSrc **srcs, size_t *n, const Config *c, char *err,
                        size_t errlen) {
    *n = model_layout(NULL, c);
    *specs = calloc(*n ? *n : 1, sizeof **specs);
    *srcs = calloc(*n ? *n : 1, sizeof **srcs);
    if (!*specs || !*srcs) { free(*specs); free(*srcs); return errorf(err, errlen, "out of memory"); }
    model_layout(*specs, c);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * GGUF -> model.bin */

/* An integer hyperparameter "llama.<key>" in [1, max]; required unless dflt >= 0. */
static int hparam(const Gguf *g, const char *key, int dflt, int max, int *out, char *err, size_t errlen) {
    char full[96];
    int64_t v;
    snprintf(full, sizeof full, "llama.%s", key);
    int r = meta_int(g, full, &v, err, errlen);
    if (r < 0) return -1;
    if (r == 0) {
        if (dflt < 0) return errorf(err, errlen, "required key %s is missing", full);
        *out = dflt;
        return 0;
    }
    if (v <= 0 || v > max) return errorf(err, errlen, "%s = %lld is out of range (1 to %d)", full, (long long)v, max);
    *out = (int)v;
    return 0;
}

/* Reads the llama hyperparameters and checks the tensors against them. */
static int gguf_config(Config *c, const Gguf *g, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    if (hparam(g, "embedding_length", -1, MODEL_MAX_DIM, &c->dim, err, errlen) ||
        hparam(g, "feed_forward_length", -1, MODEL_MAX_HIDDEN, &c->hidden_dim, err, errlen) ||
        hparam(g, "block_count", -1, MODEL_MAX_LAYERS, &c->n_layers, err, errlen) ||
        hparam(g, "attention.head_count", -1, MODEL_MAX_HEADS, &c->n_heads, err, errlen) ||
        hparam(g, "attention.head_count_kv", c->n_heads, MODEL_MAX_HEADS, &c->n_kv_heads, err, errlen) ||
        hparam(g, "context_length", -1, MODEL_MAX_SEQ, &c->seq_len, err, errlen))
        return -1;
    /* head_dim: attention.key_length when given (it may differ from dim/n_heads); llama rotates the whole head, so
     * rope.dimension_count, when given, must agree with it */
    int key_len = 0, rope_dim = 0, val_len = 0;
    if (hparam(g, "attention.key_length", 0, MODEL_MAX_HEAD_DIM, &key_len, err, errlen) ||
        hparam(g, "attention.value_length", 0, MODEL_MAX_HEAD_DIM, &val_len, err, errlen) ||
        hparam(g, "rope.dimension_count", 0, MODEL_MAX_HEAD_DIM, &rope_dim, err, errlen))
        return -1;
    c->head_dim = key_len ? key_len : rope_dim ? rope_dim : c->dim / c->n_heads;
    if (rope_dim && rope_dim != c->head_dim)
        return errorf(err, errlen, "llama.rope.dimension_count %d differs from head_dim %d (partial RoPE is not "
                    "supported)", rope_dim, c->head_dim);
    if (val_len && val_len != c->head_dim)
        return errorf(err, errlen, "llama.attention.value_length %d differs from key_length %d", val_len, c->head_dim);
    double theta = 10000.0, eps = 0;
    if (meta_float(g, "llama.rope.freq_base", &theta, err, errlen) < 0) return -1;
    int r = meta_float(g, "llama.attention.layer_norm_rms_epsilon", &eps, err, errlen);
    if (r < 0) return -1;
    if (r == 0) return errorf(err, errlen, "required key llama.attention.layer_norm_rms_epsilon is missing");
    c->rope_theta = (float)theta;
    c->norm_eps = (float)eps;
    const GgufTensor *emb = gguf_find_tensor(g, "token_embd.weight");
    if (!emb) return errorf(err, errlen, "required tensor token_embd.weight is missing");
    if (emb->n_dims != 2 || emb->ne[1] > MODEL_MAX_VOCAB)
        return errorf(err, errlen, "tensor token_embd.weight has %u dimensions [%llu, %llu], expected [dim, vocab]",
                    emb->n_dims, (unsigned long long)emb->ne[0], (unsigned long long)emb->ne[1]);
    c->vocab_size = (int)emb->ne[1];
    c->tied = gguf_find_tensor(g, "output.weight") == NULL;
    c->has_rope_factors = gguf_find_tensor(g, "rope_freqs.weight") != NULL;
    c->rope_pairing = 0;   /* llama GGUF Q/K rows are stored permuted for adjacent pairs (convert_hf_to_gguf) */
    return model_config_check(c, err, errlen);
}

/* The GGUF tensor for spec s, with its shape checked: [cols] for a vector, [cols, rows] for a matrix. */
static int gguf_bind(TensorSrc *src, const Gguf *g, const TensorSpec *s, char *err, size_t errlen) {
    const GgufTensor *t = gguf_find_tensor(g, s->name);
    if (!t) return errorf(err, errlen, "required tensor %s is missing", s->name);
    int ndims = 4;
    while (ndims > 1 && t->ne[ndims - 1] == 1) ndims--;
    int ok = s->is_vec ? (ndims == 1 && t->ne[0] == s->cols)
                       : (ndims <= 2 && t->ne[0] == s->cols && t->ne[1] == s->rows);
    if (!ok) {
        if (s->is_vec)
            return errorf(err, errlen, "tensor %s has shape [%llu, %llu], expected [%zu]", s->name,
                        (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], s->cols);
        return errorf(err, errlen, "tensor %s has wrong shape [%llu, %llu], expected [%zu, %zu] (ne0 = columns first)",
                    s->name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], s->cols, s->rows);
    }
    if (!dequant_supported(t->type)) {
        const char *tn = export_ggml_type_name(t->type);
        return errorf(err, errlen, "unsupported tensor type %s (id %u) in tensor %s", tn ? tn : "?", t->type, s->name);
    }
    src->data = t->data;
    src->type = t->type;
    return 0;
}

int export_from_gguf(const char *in, const char *out, int vocab_only, int wtype, char *err, size_t errlen) {
    Mapped m;
    Gguf g;
    Buf tok = {0};
    TensorSpec *specs = NULL;
    TensorSrc *srcs = NULL;
    size_t n = 0;
    int rc = -1;
    err[0] = 0;
    const char *ins[] = {in}, *what[] = {"input"};
    if (output_check(out, ins, what, 1, err, errlen)) return -1;
    if (map_file(&m, in, err, errlen)) return -1;
    if (gguf_parse(&g, m.p, m.n, err, errlen)) { unmap_file(&m); return -1; }
    const char *arch = "";
    size_t arch_len = 0;
    int r = meta_str(&g, "general.architecture", &arch, &arch_len, err, errlen);
    if (r < 0) goto done;
    if (r == 0) { errorf(err, errlen, "general.architecture is missing"); goto done; }
    if (!vocab_only && !(arch_len == 5 && !memcmp(arch, "llama", 5))) {
        errorf(err, errlen, "unsupported architecture '" NAMEFMT "' (only llama)", NAMEARG(arch, arch_len));
        goto done;
    }
    if (tok_from_gguf(&tok, &g, err, errlen)) goto done;
    Config c;
    if (vocab_only) {
        if (!tok.len) { errorf(err, errlen, "no tokenizer.ggml.model: nothing to write with --vocab-only"); goto done; }
        memset(&c, 0, sizeof c);
        c.vocab_size = (int)rd_u32(tok.p + 4);
    } else {
        if (gguf_config(&c, &g, err, errlen)) goto done;
        c.wtype = wtype;
        int untied = untie_for_q8(&c);
        if (tok.len && rd_u32(tok.p + 4) != (uint32_t)c.vocab_size) {
            errorf(err, errlen, "the tokenizer has %u tokens but token_embd.weight has %d rows", rd_u32(tok.p + 4),
                 c.vocab_size);
            goto done;
        }
        if (layout_alloc(&specs, &srcs, &n, &c, err, errlen)) goto done;
        for (size_t i = 0; i < n; i++) {
            if (untied && !strcmp(specs[i].name, "output.weight")) { srcs[i] = srcs[0]; continue; }
            if (gguf_bind(&srcs[i], &g, &specs[i], err, errlen)) goto done;
        }
    }
    rc = model_write(out, &c, &tok, specs, srcs, n, NULL, err, errlen);
done:
    free(specs);
    free(srcs);
    free(tok.p);
    gguf_free(&g);
    unmap_file(&m);
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * llama2.c checkpoints (github.com/karpathy/llama2.c, export.py) and tokenizer.bin (tokenizer.py) -> model.bin */

#define LLAMA2C_MAGIC 0x616b3432u   /* "ak42" */

/* llama2.c's tokenizer.bin: i32 max_token_length, then per token f32 score, i32 length (at most max_token_length),
 * bytes; the count is not stored. llama2.c wrote pieces with the SentencePiece space mark U+2581 replaced by ' ', and BOS/EOS as
 * "\n<s>\n" and "\n</s>\n"; they are turned back into the pieces GGUF stores, so the section reads the same whatever
 * the source. */
static int tok_from_llama2c(Buf *b, const char *path, int vocab, char *err, size_t errlen) {
    Mapped m;
    if (map_file(&m, path, err, errlen)) return -1;
    size_t off = 4, count = 0;
    int rc = -1;
    if (m.n < 4) { errorf(err, errlen, "tokenizer %s is too short for its header", path); goto done; }
    /* llama2.c's reader sizes its buffers by max_token_length: every entry must fit in it */
    int32_t max_len = (int32_t)rd_u32(m.p);
    if (max_len < 0) { errorf(err, errlen, "tokenizer %s: max_token_length %d is negative", path, max_len); goto done; }
    /* first pass: count the entries, checking each against the file length and max_token_length */
    while (off < m.n) {
        if (m.n - off < 8) {
            errorf(err, errlen, "tokenizer %s: entry %zu is cut off at the end of the file", path, count);
            goto done;
        }
        int32_t len = (int32_t)rd_u32(m.p + off + 4);
        if (len < 0 || (size_t)len > m.n - off - 8) {
            errorf(err, errlen, "tokenizer %s: token %zu length %d runs past the end of the file", path, count, len);
            goto done;
        }
        if (len > max_len) {
            errorf(err, errlen, "tokenizer %s: token %zu length %d is larger than the header's max_token_length %d",
                 path, count, len, max_len);
            goto done;
        }
        off += 8 + (size_t)len;
        count++;
    }
    if (count != (size_t)vocab) {
        errorf(err, errlen, "tokenizer %s has %zu entries but the model's vocab_size is %d", path, count, vocab);
        goto done;
    }
    TokHeader h = {.kind = 1, .n_tokens = (uint32_t)vocab, .bos = 1, .eos = 2, .eot = -1, .pad = -1, .unk = 0,
                   .add_bos = 1, .add_space_prefix = 1, .pre = "", .chat = ""};
    tok_put_header(b, &h);
    off = 4;
    Buf piece = {0};
    for (int i = 0; i < vocab; i++) {
        float score = rd_f32(m.p + off);
        size_t len = (size_t)rd_u32(m.p + off + 4);
        const uint8_t *s = m.p + off + 8;
        off += 8 + len;
        piece.len = 0;
        if (i == 1 && len == 5 && !memcmp(s, "\n<s>\n", 5)) buf_put(&piece, "<s>", 3);
        else if (i == 2 && len == 6 && !memcmp(s, "\n</s>\n", 6)) buf_put(&piece, "</s>", 4);
        else
            for (size_t k = 0; k < len; k++) {
                if (s[k] == ' ') buf_put(&piece, "\xe2\x96\x81", 3);
                else buf_put(&piece, &s[k], 1);
            }
        int type = 1;
        if (i == 0) type = 2;
        else if (i <= 2) type = 3;
        else if (len == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>') type = 6;
        buf_f32(b, score);
        buf_u32(b, (uint32_t)type);
        buf_u32(b, (uint32_t)piece.len);
        buf_put(b, piece.p, piece.len);
    }
    free(piece.p);
    buf_u32(b, 0);   /* no merges: SentencePiece BPE merges by score */
    rc = (b->oom || piece.oom) ? errorf(err, errlen, "out of memory") : 0;
done:
    unmap_file(&m);
    return rc;
}

int export_from_llama2c(const char *ckpt, const char *tokenizer, const char *out, int wtype, char *err,
                        size_t errlen) {
    Mapped m;
    Buf tok = {0};
    TensorSpec *specs = NULL;
    TensorSrc *srcs = NULL;
    size_t n = 0;
    int rc = -1;
    err[0] = 0;
    const char *ins[] = {ckpt, tokenizer}, *what[] = {"checkpoint", "tokenizer"};
    if (output_check(out, ins, what, 2, err, errlen)) return -1;
    if (map_file(&m, ckpt, err, errlen)) return -1;
    int versioned = m.n >= 4 && rd_u32(m.p) == LLAMA2C_MAGIC;
    size_t hdr = versioned ? 256 : 28;
    if (m.n < hdr) { errorf(err, errlen, "%s is too short for a llama2.c header (%zu bytes)", ckpt, m.n); goto done; }
    const uint8_t *p = m.p + (versioned ? 8 : 0);
    if (versioned) {
        int32_t version = (int32_t)rd_u32(m.p + 4);
        if (version == 2) {
            errorf(err, errlen, "%s is a llama2.c version 2 (int8) checkpoint: not supported, export it as version 1 "
                 "(fp32)", ckpt);
            goto done;
        }
        if (version != 1) { errorf(err, errlen, "unsupported llama2.c checkpoint version %d", version); goto done; }
    }
    int32_t hp[7];
    for (int i = 0; i < 7; i++) hp[i] = (int32_t)rd_u32(p + 4 * i);
    Config c = {.dim = hp[0], .hidden_dim = hp[1], .n_layers = hp[2], .n_heads = hp[3], .n_kv_heads = hp[4],
                     .vocab_size = hp[5], .seq_len = hp[6], .rope_theta = 10000.0f, .norm_eps = 1e-5f};
    if (versioned) {
        c.tied = m.p[36] != 0;
    } else {
        /* legacy: a negative vocab_size says the classifier is stored apart */
        c.tied = c.vocab_size > 0;
        if (c.vocab_size < 0 && c.vocab_size != INT32_MIN) c.vocab_size = -c.vocab_size;
    }
    if (c.n_heads <= 0 || c.dim <= 0 || c.dim % c.n_heads) {
        errorf(err, errlen, "llama2.c header: dim %d is not a positive multiple of n_heads %d", c.dim, c.n_heads);
        goto done;
    }
    c.head_dim = c.dim / c.n_heads;
    if (model_config_check(&c, err, errlen)) goto done;

    /* offsets (in floats) of each tensor kind in llama2.c's order */
    size_t D = (size_t)c.dim, H = (size_t)c.hidden_dim, L = (size_t)c.n_layers, V = (size_t)c.vocab_size,
           KV = (size_t)c.n_kv_heads * (size_t)c.head_dim, S = (size_t)c.seq_len;
    enum { EMB, RMS_ATT, WQ, WK, WV, WO, RMS_FFN, W1, W2, W3, RMS_FINAL, FREQ, WCLS, NKIND };
    size_t size[NKIND] = {V * D, L * D, L * D * D, L * KV * D, L * KV * D, L * D * D, L * D, L * H * D, L * D * H,
                          L * H * D, D, versioned ? 0 : S * (size_t)c.head_dim, c.tied ? 0 : V * D};
    static const int legacy_order[] = {EMB, RMS_ATT, WQ, WK, WV, WO, RMS_FFN, W1, W2, W3, RMS_FINAL, FREQ, WCLS};
    static const int v1_order[] = {RMS_ATT, RMS_FFN, RMS_FINAL, EMB, WQ, WK, WV, WO, W1, W2, W3, WCLS};
    const int *order = versioned ? v1_order : legacy_order;
    size_t n_order = versioned ? sizeof v1_order / sizeof v1_order[0] : sizeof legacy_order / sizeof legacy_order[0];
    size_t at[NKIND] = {0}, off = hdr / 4;
    for (size_t i = 0; i < n_order; i++) {
        at[order[i]] = off;
        off += size[order[i]];
    }
    if (off * 4 != m.n) {
        errorf(err, errlen, "%s: the header describes %zu bytes of checkpoint, the file has %zu", ckpt, off * 4, m.n);
        goto done;
    }
    if (tokenizer && tok_from_llama2c(&tok, tokenizer, c.vocab_size, err, errlen)) goto done;
    c.wtype = wtype;
    if (untie_for_q8(&c)) at[WCLS] = at[EMB];   /* the classifier is the embedding, written again as q8 */
    if (layout_alloc(&specs, &srcs, &n, &c, err, errlen)) goto done;
    /* map each model.bin tensor to its place in the checkpoint: per-kind blocks hold the layers back to back */
    for (size_t i = 0; i < n; i++) {
        const char *nm = specs[i].name;
        int kind = -1, l = 0;
        char suffix[32] = "";
        if (!strcmp(nm, "token_embd.weight")) kind = EMB;
        else if (!strcmp(nm, "output_norm.weight")) kind = RMS_FINAL;
        else if (!strcmp(nm, "output.weight")) kind = WCLS;
        else if (sscanf(nm, "blk.%d.%31[a-z_]", &l, suffix) == 2) {
            static const struct { const char *s; int k; } map[] = {
                {"attn_norm", RMS_ATT}, {"attn_q", WQ}, {"attn_k", WK}, {"attn_v", WV}, {"attn_output", WO},
                {"ffn_norm", RMS_FFN}, {"ffn_gate", W1}, {"ffn_down", W2}, {"ffn_up", W3}};
            for (size_t k = 0; k < sizeof map / sizeof map[0]; k++)
                if (!strcmp(suffix, map[k].s)) kind = map[k].k;
        }
        size_t per = specs[i].rows * specs[i].cols;
        srcs[i].data = m.p + 4 * (at[kind] + (size_t)l * per);
        srcs[i].type = GGML_TYPE_F32;
    }
    rc = model_write(out, &c, &tok, specs, srcs, n, NULL, err, errlen);
done:
    free(specs);
    free(srcs);
    free(tok.p);
    unmap_file(&m);
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Random models for tests: every value drawn in file order from one splitmix64 stream seeded with the seed.
 * Embedding rows uniform in [-1, 1); matrices uniform in ±1/sqrt(cols) (so W·x keeps x's scale); norm weights
 * 1 ± 0.1; rope factors in [1, 3). No tokenizer (ids-only), or a GGUF's (vocab_from): a tiny model that reads text
 * as a real one does, for tests whose subject is not the weights (the serving pool's soak under the sanitizers). */

int export_random(const ExportRandomSpec *r, const char *out, char *err, size_t errlen) {
    err[0] = 0;
    Config c = {.dim = r->dim, .hidden_dim = r->hidden_dim, .n_layers = r->n_layers, .n_heads = r->n_heads,
                     .n_kv_heads = r->n_kv_heads, .head_dim = r->head_dim, .vocab_size = r->vocab_size,
                     .seq_len = r->seq_len, .tied = r->tied, .has_rope_factors = r->rope_factors,
                     .rope_theta = r->rope_theta, .norm_eps = 1e-5f, .wtype = r->wtype};
    if (c.head_dim == 0 && c.n_heads > 0) c.head_dim = c.dim / c.n_heads;
    const char *ins[] = {r->vocab_from}, *what[] = {"--vocab-from"};
    if (model_config_check(&c, err, errlen) || output_check(out, ins, what, r->vocab_from ? 1 : 0, err, errlen))
        return -1;
    Buf tok = {0};
    if (r->vocab_from) {
        Mapped m;
        Gguf g;
        if (map_file(&m, r->vocab_from, err, errlen)) return -1;
        int bad = gguf_parse(&g, m.p, m.n, err, errlen);
        if (!bad) {
            bad = tok_from_gguf(&tok, &g, err, errlen);
            if (!bad && !tok.len) bad = errorf(err, errlen, "%s has no tokenizer (tokenizer.ggml.model)", r->vocab_from);
            if (!bad && rd_u32(tok.p + 4) != (uint32_t)c.vocab_size)
                bad = errorf(err, errlen, "--vocab %d: the tokenizer of %s has %u tokens", c.vocab_size, r->vocab_from,
                             rd_u32(tok.p + 4));
            gguf_free(&g);
        }
        unmap_file(&m);
        if (bad) {   /* say which file: --vocab-from is one input among the flags */
            char why[EXPORT_ERR_LEN];
            snprintf(why, sizeof why, "%s", err);
            if (!strstr(why, r->vocab_from)) errorf(err, errlen, "--vocab-from %s: %s", r->vocab_from, why);
            free(tok.p);
            return -1;
        }
    }
    int untied = untie_for_q8(&c);
    TensorSpec *specs;
    TensorSrc *srcs;
    size_t n;
    if (layout_alloc(&specs, &srcs, &n, &c, err, errlen)) { free(tok.p); return -1; }
    for (size_t i = 0; i < n; i++) {
        const TensorSpec *s = &specs[i];
        if (!strcmp(s->name, "token_embd.weight")) { srcs[i].center = 0; srcs[i].scale = 1; }
        else if (!strcmp(s->name, "rope_freqs.weight")) { srcs[i].center = 2; srcs[i].scale = 1; }
        else if (s->is_vec) { srcs[i].center = 1; srcs[i].scale = 0.1f; }
        else { srcs[i].center = 0; srcs[i].scale = 1.0f / sqrtf((float)s->cols); }
        if (untied && !strcmp(s->name, "output.weight")) { srcs[i] = srcs[0]; srcs[i].redraw_first = 1; }
    }
    uint64_t rng = r->seed;
    int rc = model_write(out, &c, &tok, specs, srcs, n, &rng, err, errlen);
    free(specs);
    free(srcs);
    free(tok.p);
    return rc;
}
