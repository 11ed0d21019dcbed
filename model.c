/* model.c: open a model.bin (mmap), validate every header field and section against the file length before use
 * (docs/FORMAT.md, model_format.h), point the weights into the mapping, and load the tokenizer. It never copies the
 * weights and reads no foreign format (export.c).
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, kv_dim, vocab_size, seq_len.
 */
#include "model.h"
#include "quant.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------------------------
 * Loading model.bin (docs/FORMAT.md). Every size in the header is checked against the file length before use.
 * ------------------------------------------------------------------------------------------------------------- */

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
    if (mh_get32(data, MH_MAGIC) != MODEL_MAGIC)
        return errorf(err, errlen, "not a kvlab model.bin (magic 0x%08x, expected 0x%08x); convert with ./export",
                      mh_get32(data, MH_MAGIC), MODEL_MAGIC);
    if (mh_get32(data, MH_VERSION) != MODEL_VERSION)
        return errorf(err, errlen, "model.bin version %u is not supported (this build reads version %d); re-export",
                      mh_get32(data, MH_VERSION), MODEL_VERSION);
    ModelHeader h;
    model_header_unpack(&h, data);
    Config *c = &m->config;
    *c = h.config;
    uint64_t tok_off = h.tokenizer_offset, tok_bytes = h.tokenizer_bytes;
    uint64_t w_off = h.weights_offset, w_bytes = h.weights_bytes, file_bytes = h.file_bytes;
    if (file_bytes != size)
        return errorf(err, errlen, "file is %zu bytes but its header says %llu: truncated or corrupt", size,
                      (unsigned long long)file_bytes);
    for (int i = MH_RESERVED; i < MODEL_HEADER_BYTES; i++)
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
    if (model_config_check(c, err, errlen)) return -1;
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

