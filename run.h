/* run.h: the engine: activations, the Llama forward pass with a KV-cache policy, sampling, and the generate and
 * chat loops (run.c). The model comes from model.h, the cache from kv.h, the matmuls from matmul.h.
 *
 * Dimensions: dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, seq_len.
 */
#ifndef KVLAB_RUN_H
#define KVLAB_RUN_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cli.h"
#include "kv.h"
#include "matmul.h"
#include "model.h"
#include "tokenizer.h"
#include "util.h"

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
    float *qpf;     /* (n_max, n_heads * head_dim) the next layer's predicted queries (a fast tier's prefetch=1) */
    float *logits;  /* (n_max, vocab_size) */
    float *mem;
    int n_max, n, pos0;
    /* which rows forward_end computes logits for: LOGITS_ALL (0, what a fresh state does), LOGITS_LAST (row n-1
       only; the other rows are left as they were) or LOGITS_NONE. A prompt's tokens other than its last need none:
       the classifier is a fifth of SmolLM2's multiply-adds per token. The rows computed are the same bits either
       way (matmul_n's rows are independent). */
    int logits_rows;
    double t_matmul, t_attn;   /* seconds spent, accumulated over calls (t_attn: steps 1-4 and after_attn) */
    /* Called after layer l attended at position pos (the evaluation reads attention probabilities here); NULL = none */
    void (*after_attn)(void *ctx, int l, const KVCache *cache, int pos);
    void *hook_ctx;
} RunState;
enum { LOGITS_ALL, LOGITS_LAST, LOGITS_NONE };

typedef struct {
    int vocab_size;
    float temperature, topp;
    uint64_t rng;        /* splitmix64 state */
    void *probindex;     /* (vocab_size) scratch */
} Sampler;

int state_init(RunState *s, const Config *c);                 /* n_max = 1 */
int state_init_chunk(RunState *s, const Config *c, int n_max); /* room for chunks of n_max tokens */
void state_free(RunState *s);
/* h[i] = silu(h[i])·u[i] for i < n, the SwiGLU's gate (Shazeer 2020) with exp_neg.h's exp: the same bits with or
 * without AVX2 (tests/test_exp_neg.c) */
void swiglu(float *h, const float *u, int n);
/* One decode step of the token at position pos through every layer, with the cache's policy; logits in s->logits.
 * Returns 0, or -1 when a lane is full and the policy cannot evict (full past its context). */
int forward(Model *m, RunState *s, KVCache *cache, int token, int pos);
/* The same for n teacher-forced tokens at positions pos0.. (n <= s->n_max), layer by layer: matmuls batched, the
 * attention and the policy stepped token by token inside each layer. Bit-identical to n calls of forward() for
 * layer-local policies. Logits of token t in s->logits + t * vocab_size. */
int forward_chunk(Model *m, RunState *s, KVCache *cache, const int *tokens, int n, int pos0);
/* A prompt: ids[0..n) at positions pos.., min(chunk, s->n_max) tokens at a time through forward_chunk; the last
 * token's logits are left in s->logits (row 0), the only ones computed (none when s->logits_rows is LOGITS_NONE:
 * a prompt fed in pieces; s->logits_rows is restored). 0, or -1 as forward. Generate, chat and -m bench prefill with
 * PREFILL_CHUNK. */
#define PREFILL_CHUNK 64
int forward_prefill(Model *m, RunState *s, KVCache *cache, const int *ids, size_t n, int pos, int chunk);
/* Many sequences in one batch: sequence j feeds seqs[j].n tokens (0 or more; each with n > 1 layer-local) at positions
 * seqs[j].pos0.. into its own cache, its tokens' rows one after another in tokens and in s->logits (sequence j's first
 * row after the rows of sequences 0..j-1; Σ n <= s->n_max). The weight matmuls go over every row at once, so a step
 * reads the weights once for all the sequences (the point of batching: decode is bound by reading them); attention
 * and the policy run per sequence, with its hook after each of its tokens' step 4. Each row's arithmetic is its own,
 * so the logits are bit-identical to running each sequence alone (forward_chunk, or forward token by token), for any
 * mix of prefill chunks and decode steps (continuous batching) and any thread count. With s->logits_rows LOGITS_LAST
 * only each sequence's last row gets logits (a server samples from nothing else). Returns 0, or -1 when a lane is
 * full and its policy cannot evict (the other sequences' caches may have taken this step's tokens up to that layer),
 * or when the batch is empty, too large for s, or holds a chunk of a cross-layer policy. */
typedef struct {
    KVCache *cache;
    int pos0, n;
    KVAttnHook hook;   /* NULL = none */
    void *hook_ctx;
} BatchSeq;
int forward_batch(Model *m, RunState *s, const BatchSeq *seqs, int n_seqs, const int *tokens);
/* forward_chunk's parts, for running several caches in lockstep layer by layer (the evaluation's shadow). */
void forward_begin(Model *m, RunState *s, const int *tokens, int n, int pos0);
int forward_layer(Model *m, RunState *s, KVCache *cache, int l);
void forward_end(Model *m, RunState *s);

int sampler_init(Sampler *sp, int vocab_size, float temperature, float topp, uint64_t seed);
void sampler_free(Sampler *sp);
/* The next token from logits (vocab_size, modified in place): argmax at temperature 0, else softmax(logits / T)
 * sampled within the top-p nucleus (Holtzman et al. 2019) with the sampler's splitmix64 stream. */
int sample(Sampler *sp, float *logits);
int sample_argmax(const float *logits, int n);   /* the first index of the largest logit */
/* The largest of x[0..n), n >= 1, as the loop mx = x[0]; mx = x[i] > mx ? x[i] : mx computes it (NaNs skipped, but
 * x[0] NaN gives NaN; AVX-512 in 16 lanes, the same value). */
float scan_max(const float *x, int n);

/* -kvlog (every mode that runs a cache): one JSON line per event of cache c ("evict": the slot freed, its position,
 * token id and text when the stream holds it, the policy's score and reason), written whole to out, which several
 * caches may share (each line names its policy). stream: the token ids by position (may grow; NULL = ids unknown);
 * doc: set it to the document index in ppl (-1: none). */
typedef struct {
    OutFile *out;
    const Model *m;
    const IdList *stream;
    const KVCache *cache;
    int doc;
    Line line;   /* the record being composed */
} KVLog;
void kvlog_attach(KVLog *lg, OutFile *out, const Model *m, const IdList *stream, KVCache *c);

/* The context (-c) a mode runs with, tokens: -c, else the trained context (passkey, task and bench: at most 2048). It is
 * full's lanes, the shadow's length, and the tokens duo's calibration reads (eval_calib): one rule for all. */
int run_context(const Model *m, const Options *o);

/* -m generate and -m chat: one cache with o's policy, the prompt prefilled, tokens sampled and printed; the summary
 * line on stderr. cuda: attention on the device mirror (attn.h). Returns the exit status (0; 1 when a prompt does not
 * fit under full; 128 + the signal when SIGINT/SIGTERM stopped it). */
int run_generate_chat(Model *m, const Options *o, int cuda);
/* One user turn in the model's chat format (ChatML, Llama 2, Llama 3; the first turn opens with the system turn:
 * `system`, or ChatML's default one from the template when NULL; a later one with the close of the assistant's
 * answer before it, as -m chat feeds it), ending where the assistant's answer begins, as the text that
 * tokenizer_encode_special encodes: into *t (initialized here; line_free it). *bos: 1 when BOS goes before it;
 * *stop: the id that ends the assistant's turn, or -1 when only EOS does. Returns 0, or -1 (t untouched) when the
 * model has no chat template kvlab knows. */
int chat_prompt_text(Line *t, int *bos, int *stop, const Model *m, const char *system, const char *user, int first);

#endif
