/* model.h: a model.bin in memory: its config, its weights (pointers into the mmapped file) and its tokenizer;
 * loading and validation (model.c). The file format itself (header layout, bounds) is model_format.h, shared with
 * export.c. It does not run the model (run.c) and reads no foreign format (export.c).
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, seq_len.
 */
#ifndef KVLAB_MODEL_H
#define KVLAB_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kv.h"
#include "model_format.h"
#include "tokenizer.h"


/* A weight matrix (rows, cols), row-major: f32 values, or for WTYPE_Q8 (rows, cols / 32) BlockQ8 groups (quant.h).
 * Passed by value; matmul_n dispatches on type. */
typedef struct {
    const void *data;
    int type;   /* WTYPE_* */
} Matrix;

typedef struct {
    const float *attn_norm;  /* (dim) */
    Matrix wq;               /* (n_heads * head_dim, dim) */
    Matrix wk;               /* (n_kv_heads * head_dim, dim) */
    Matrix wv;               /* (n_kv_heads * head_dim, dim) */
    Matrix wo;               /* (dim, n_heads * head_dim) */
    const float *ffn_norm;   /* (dim) */
    Matrix w1;               /* (hidden_dim, dim) gate */
    Matrix w2;               /* (dim, hidden_dim) down */
    Matrix w3;               /* (hidden_dim, dim) up */
} LayerWeights;

typedef struct {
    const float *token_embedding;  /* (vocab_size, dim) f32 */
    const float *rope_factors;     /* (head_dim / 2) or NULL */
    LayerWeights *layers;          /* (n_layers) */
    const float *final_norm;       /* (dim) */
    Matrix classifier;             /* (vocab_size, dim); the f32 token_embedding when tied */
} Weights;

typedef struct {
    Config config;
    Weights w;
    const uint8_t *data;            /* the mmapped file */
    size_t size;                    /* bytes */
    const uint8_t *tokenizer_section;
    size_t tokenizer_bytes;
    Tokenizer tokenizer;
    int has_tokenizer;              /* 0: an ids-only model */
    int vocab_only;                 /* 1: a --vocab-only file, no layers */
} Model;

/* Parse and validate a model.bin held in memory (data, size bytes). 0, or -1 + message. Never exits. */
int model_parse(Model *m, const uint8_t *data, size_t size, char *err, size_t errlen);
/* Open, mmap, validate, and load the tokenizer. 0, or -1 + message naming the file and the problem. */
int model_open(Model *m, const char *path, char *err, size_t errlen);
void model_close(Model *m);
/* The cache geometry of the model with a context of seq_len tokens. */
KVShape model_kv_shape(const Model *m, int seq_len);

/* Bytes of a (rows, cols) matrix of weight type wtype, unpadded. */
size_t matrix_bytes(int wtype, size_t rows, size_t cols);

#endif
