/* run.h: the engine's types and the functions tests call: model.bin loading, the forward pass, sampling, and the
 * command-line parser. run.c implements them; eval.c (evaluation modes) builds on them.
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, seq_len.
 */
#ifndef KVLAB_RUN_H
#define KVLAB_RUN_H

#include <limits.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kv.h"
#include "tokenizer.h"

#define MODEL_MAGIC 0x424C564Bu   /* "KVLB" little-endian */
#define MODEL_VERSION 1
#define MODEL_HEADER_BYTES 256

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

/* Activations of n tokens (n <= n_max; decode has n_max = 1): one allocation, carved into named buffers. Row t
 * of each buffer belongs to the token at position pos0 + t. */
typedef struct {
    float *x;       /* (n_max, dim) residual stream */
    float *xb;      /* (n_max, dim) normed input of a block; later the FFN output */
    float *xb2;     /* (n_max, dim) attention block output */
    float *hb;      /* (n_max, hidden_dim) */
    float *hb2;     /* (n_max, hidden_dim) */
    float *q;       /* (n_max, n_heads * head_dim) */
    float *k;       /* (n_max, n_kv_heads * head_dim) */
    float *v;       /* (n_max, n_kv_heads * head_dim) */
    float *att;     /* (n_max, n_heads * head_dim) attention output */
    float *logits;  /* (n_max, vocab_size) */
    float *mem;
    int n_max, n, pos0;
    double t_matmul, t_attn;   /* seconds spent, accumulated over calls (t_attn: steps 1-4 and after_attn) */
    /* Called after layer l attended at position pos (the evaluation reads attention probabilities here); NULL = none */
    void (*after_attn)(void *ctx, int l, const KVCache *cache, int pos);
    void *hook_ctx;
} RunState;

typedef struct {
    int vocab_size;
    float temperature, topp;
    uint64_t rng;        /* splitmix64 state */
    void *probindex;     /* (vocab_size) scratch */
} Sampler;

#define MAX_FILES 64
#define MAX_POLICIES 32
typedef struct {
    const char *model_path, *mode, *prompt, *system, *kvlog, *device, *out, *ppl_mode, *tokenlog;
    const char *files[MAX_FILES];
    int n_files;
    const char *kv[MAX_POLICIES];
    int n_kv;
    int steps, steps_set, ctx, chunk, print_ids, add_bos, verbose, seed_set;
    const char *help;    /* NULL, or what -h asks for: "usage", "policies", "flags" */
    float temperature, topp;
    unsigned long long seed;
    KVType kvt;
    int argc;            /* the command line, for the records of -o */
    char **argv;
} Options;

/* Parse and validate a model.bin held in memory (data, size bytes). 0, or -1 + message. Never exits. */
int model_parse(Model *m, const uint8_t *data, size_t size, char *err, size_t errlen);
/* Open, mmap, validate, and load the tokenizer. 0, or -1 + message naming the file and the problem. */
int model_open(Model *m, const char *path, char *err, size_t errlen);
void model_close(Model *m);
/* The cache geometry of the model with a context of seq_len tokens. */
KVShape model_kv_shape(const Model *m, int seq_len);

int state_init(RunState *s, const Config *c);                 /* n_max = 1 */
int state_init_chunk(RunState *s, const Config *c, int n_max); /* room for chunks of n_max tokens */
void state_free(RunState *s);
/* out (rows) = W (rows, cols) · x (cols), rows split over threads (results independent of the thread count).
 * W f32: f32 products in 8 lanes. W q8: x is quantized per group of 32 (f32 scale), int8 products summed exactly
 * per 4 values, scaled and accumulated in 8 f32 lanes (see run.c). cols must be a multiple of 32 for q8. */
void matmul(float *out, const float *x, Matrix W, int rows, int cols);
/* out (n, rows) = x (n, cols) · Wᵀ: the same per-output arithmetic as matmul, for n tokens at once (bit-identical
 * to n calls of matmul). Not reentrant for q8 (one scratch buffer for the quantized x): call it from one thread. */
void matmul_n(float *out, const float *x, Matrix W, int rows, int cols, int n);
/* h[i] = silu(h[i])·u[i] for i < n, the SwiGLU's gate (Shazeer 2020) with exp_neg.h's exp: the same bits with or
 * without AVX2 (tests/test_exp_neg.c) */
void swiglu(float *h, const float *u, int n);
/* Bytes of a (rows, cols) matrix of weight type wtype, unpadded. */
size_t matrix_bytes(int wtype, size_t rows, size_t cols);
/* One decode step of the token at position pos through every layer, with the cache's policy; logits in s->logits.
 * Returns 0, or -1 when a lane is full and the policy cannot evict (full past its context). */
int forward(Model *m, RunState *s, KVCache *cache, int token, int pos);
/* The same for n teacher-forced tokens at positions pos0.. (n <= s->n_max), layer by layer: matmuls batched, the
 * attention and the policy stepped token by token inside each layer. Bit-identical to n calls of forward() for
 * layer-local policies. Logits of token t in s->logits + t * vocab_size. */
int forward_chunk(Model *m, RunState *s, KVCache *cache, const int *tokens, int n, int pos0);
/* A prompt: ids[0..n) at positions pos.., min(chunk, s->n_max) tokens at a time through forward_chunk; the last
 * token's logits are left in s->logits (row 0). 0, or -1 as forward. Generate, chat and -m bench prefill with
 * PREFILL_CHUNK. */
#define PREFILL_CHUNK 64
int forward_prefill(Model *m, RunState *s, KVCache *cache, const int *ids, size_t n, int pos, int chunk);
/* forward_chunk's parts, for running several caches in lockstep layer by layer (the evaluation's shadow). */
void forward_begin(Model *m, RunState *s, const int *tokens, int n, int pos0);
int forward_layer(Model *m, RunState *s, KVCache *cache, int l);
void forward_end(Model *m, RunState *s);

int sampler_init(Sampler *sp, int vocab_size, float temperature, float topp, uint64_t seed);
void sampler_free(Sampler *sp);
int sample(Sampler *sp, float *logits);
int sample_argmax(const float *logits, int n);

/* Strict number parsing: the whole string, in [lo, hi]. 0, or -1. */
int parse_long(const char *s, long lo, long hi, long *out);
int parse_float(const char *s, double lo, double hi, double *out);
/* Whitespace-separated decimal token ids, each in [0, vocab). *ids malloc'd. 0, or -1 + message naming the bad id. */
int ids_parse(const char *text, int vocab, int **ids, size_t *n, char *err, size_t errlen);
/* The command line (DESIGN.md's CLI). 0, or -1 + message naming the bad flag or value. Never exits. */
int options_parse(Options *o, int argc, char **argv, char *err, size_t errlen);
void usage(FILE *f);
/* README's flag table (markdown): which mode reads which flag. */
void usage_flags_markdown(FILE *f);
/* -h policies: every registered policy with its keys, defaults and source. */
void usage_policies(FILE *f);

long peak_rss_kib(void);
int run_threads(void);   /* OpenMP threads a parallel region uses (1 without OpenMP) */
double now_s(void);
/* Print "run: message" on stderr and exit non-zero (main's way out; parsers return errors instead). */
void fatal(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));   /* monotonic clock, seconds */
/* Read a whole file (NUL-terminated copy, length in *len); exits with a message on error. */
char *read_file(const char *path, size_t *len);
/* Evaluation modes (eval.c). Each returns the exit status: 0, or 128 + the signal when SIGINT/SIGTERM stopped it
 * (what it measured up to then is printed and written, marked partial). */
int run_ppl(Model *m, const Options *o);
int run_bench(Model *m, const Options *o);
int run_passkey(Model *m, const Options *o);
/* The passkey answer's score: the first run of decimal digits in text as a number (leading zeros dropped, at most 9
 * digits read), or -1 when text has no digit. */
long passkey_first_integer(const char *text);
/* A note for stderr, held until run_job_start() prints the pending ones (so errors found first stand alone). */
void run_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void run_job_start(void);
/* A seed for a run without -s: different for runs started at the same moment. */
uint64_t seed_fresh(void);

/* One JSON line being composed (grown as needed), and a file it is written to whole (-o, -tokenlog, -kvlog). */
typedef struct { char *s; size_t n, cap; } Line;
typedef struct { int fd; const char *flag, *path; } OutFile;   /* fd -1: not open, lines are dropped */
#define OUTFILE_NONE {-1, NULL, NULL}
void line_printf(Line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void line_json_str(Line *l, const char *s);                 /* s as the body of a JSON string, escaped */
void line_shell_words(Line *l, int argc, char **argv);     /* argv as a shell command, quoted where needed */
void line_free(Line *l);
/* Open path for `flag` (named in errors): append (-o) or truncate. Exits with a message on error. */
void outfile_open(OutFile *f, const char *flag, const char *path, int append);
/* Write l in one piece and empty it; exits with a message on a write error. */
void outfile_line(OutFile *f, Line *l);
void outfile_close(OutFile *f);
/* SIGINT/SIGTERM: the first sets run_signal (the signal number); loops stop at their next boundary. */
extern volatile sig_atomic_t run_signal;
void run_catch_signals(void);
const char *run_signal_name(int sig);
int run_errorf(char *err, size_t errlen, const char *fmt, ...);

#endif
