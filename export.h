/* export.h: what export.c offers its tests (and fuzz targets): the GGUF reader, the ggml dequantizers, the f16/bf16
 * conversions and the three exporters. ./export's CLI is the normal way in; nothing in ./run includes this.
 * Errors: every function that reads a file or a buffer returns 0 on success and -1 with a one-line message in
 * err (EXPORT_ERR_LEN bytes is enough); none of them exits. */
#ifndef KVLAB_EXPORT_H
#define KVLAB_EXPORT_H
#include <stddef.h>
#include <stdint.h>

#define EXPORT_ERR_LEN 512

/* ggml tensor type ids (ggml.h, enum ggml_type) that export can dequantize; GGUF stores them as u32. */
enum {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3, GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q2_K = 10, GGML_TYPE_Q3_K = 11, GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13, GGML_TYPE_Q6_K = 14, GGML_TYPE_BF16 = 30,
};

/* IEEE binary16 / bfloat16 bits -> f32, exact for every input (subnormals, ±inf, NaN payloads kept). */
float export_f16_to_f32(uint16_t h);
float export_bf16_to_f32(uint16_t h);

/* ggml type id -> name ("Q4_K"), or NULL for an id ggml does not define. */
const char *export_ggml_type_name(uint32_t type);
/* Block geometry of a ggml type: elements per block, bytes per block. -1 for an id ggml does not define. */
int export_ggml_type_size(uint32_t type, size_t *block_elems, size_t *block_bytes);
/* y (n) = dequantized x (n / block_elems blocks), exactly as ggml's dequantize_row_* (ggml-quants.c).
 * n must be a multiple of the type's block size. Returns -1 when export cannot dequantize this type. */
int export_dequantize(float *y, const uint8_t *x, uint32_t type, size_t n);

/* GGUF metadata value types (gguf.h) */
enum {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3, GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7, GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11, GGUF_TYPE_FLOAT64 = 12, GGUF_TYPE_COUNT = 13,
};

/* One metadata pair. Strings point into the file and are not NUL-terminated. */
typedef struct {
    const char *key;        /* (key_len) */
    size_t key_len;         /* bytes */
    uint32_t type;          /* GGUF_TYPE_* */
    uint32_t arr_type;      /* element type, arrays only */
    uint64_t arr_n;         /* element count, arrays only */
    const uint8_t *val;     /* the value; arrays: the first element; strings: the u64 length */
} GgufKV;

typedef struct {
    const char *name;       /* (name_len), points into the file */
    size_t name_len;        /* bytes */
    uint32_t n_dims;        /* 1..4 */
    uint64_t ne[4];         /* elements per dimension, ne[0] first: the contiguous one (cols); unused dims are 1 */
    uint32_t type;          /* ggml type id */
    uint64_t offset;        /* bytes from the start of the data section */
    uint64_t n_elems;       /* product of ne */
    uint64_t n_bytes;       /* bytes of data */
    const uint8_t *data;    /* (n_bytes), inside the file */
} GgufTensor;

typedef struct {
    const uint8_t *base;    /* (size) the whole file */
    size_t size;            /* bytes */
    uint32_t version;       /* 2 or 3 */
    uint64_t n_kv, n_tensors;
    GgufKV *kv;             /* (n_kv) */
    GgufTensor *tensors;    /* (n_tensors) */
    GgufTensor **by_name;   /* (n_tensors) sorted by name, for lookup */
    uint64_t alignment;     /* bytes, general.alignment or 32 */
    size_t data_offset;     /* bytes from the start of the file */
} Gguf;

/* Parses a GGUF v2/v3 file held in memory (data, size bytes): header, metadata, tensor infos, data section.
 * Checks every count, length, offset and shape against size; rejects nested arrays, unknown value or tensor types,
 * duplicate keys or tensor names, bad alignment. Spec: ggml's docs/gguf.md. gguf_free releases what it allocated. */
int gguf_parse(Gguf *g, const uint8_t *data, size_t size, char *err, size_t errlen);
void gguf_free(Gguf *g);
const GgufKV *gguf_find_kv(const Gguf *g, const char *key);
const GgufTensor *gguf_find_tensor(const Gguf *g, const char *name);

/* Weight types of the matrices in model.bin (docs/FORMAT.md, wtype). */
enum { EXPORT_WTYPE_F32 = 0, EXPORT_WTYPE_Q8 = 1 };

/* The three exporters behind ./export's CLI. Each writes OUT.tmp and renames it to out only when complete, and
 * refuses first (no file written) an out that exists and is not a regular file, an out or OUT.tmp that is one of
 * its input files (same device and inode), and an out whose directory is missing or not writable.
 * wtype EXPORT_WTYPE_Q8 quantizes every matrix (not the embedding) from its f32 values; it fails when a matrix's
 * column count is not a multiple of 32, and writes a tied model untied (FORMAT.md). */
int export_from_gguf(const char *in, const char *out, int vocab_only, int wtype, char *err, size_t errlen);
int export_from_llama2c(const char *ckpt, const char *tokenizer /* NULL = ids-only */, const char *out, int wtype,
                        char *err, size_t errlen);
typedef struct {
    int dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, seq_len;
    uint64_t seed;
    float rope_theta;
    int tied, rope_factors;     /* 1 = tied classifier; 1 = write a rope_freqs vector */
    int wtype;                  /* EXPORT_WTYPE_*; 0 = f32 */
    const char *vocab_from;     /* a GGUF whose tokenizer (chat template included) the model takes, vocab_size its
                                   token count; NULL: no tokenizer (ids-only) */
} ExportRandomSpec;
int export_random(const ExportRandomSpec *spec, const char *out, char *err, size_t errlen);

#endif
