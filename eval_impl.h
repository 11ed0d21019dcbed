/* eval_impl.h: what eval.c shares with task.c (-m task): the records' provenance, one policy's run over a prompt
 * (PolicyRun), prompt encoding, chunked prefill, the greedy answer and the progress line. Not a public interface:
 * only the evaluation modes include it.
 */
#ifndef KVLAB_EVAL_IMPL_H
#define KVLAB_EVAL_IMPL_H

#include "eval.h"

typedef struct { uint32_t h[8]; uint8_t buf[64]; uint64_t n; } Sha256;
void sha_init(Sha256 *s);
void sha_update(Sha256 *s, const void *data, size_t len);

/* A growing NUL-terminated string (prompts): s holds n bytes; str_add appends t, exiting on out of memory. */
typedef struct { char *s; size_t n, cap; } Str;
void str_add(Str *b, const char *t);

/* Records: every JSON line carries the command line, git commit, model and text digests, seed and threads. */
typedef struct {
    Line cmdline;          /* the command line, shell-quoted so that it can be run again */
    char model_sha[65], text_sha[65];
    int threads;
    unsigned long long seed;
} Provenance;

typedef struct {
    double nll;        /* Σ negative log-likelihood, nats */
    long n;            /* tokens scored */
} Nll;

typedef struct {
    KVCache cache;
    RunState s;
    int alive;              /* 0 once a non-evicting cache is full: it scores nothing more in this document */
    int is_shadow;
    Nll all;                /* every token it scored */
    Nll span;               /* tokens in the span every policy covered (position < ctx) */
    double kl, top1, dp, dnll;   /* Σ over the span, against the shadow */
    double *recall;         /* (n_layers) Σ over steps and kv heads of attention-mass recall */
    double *recall_topk;    /* (n_layers) the same for the exact top-B positions of the shadow's attention, B the
                               policy's budget: the recall no choice of B positions can beat */
    double *recall_lane;    /* (n_layers * n_kv_heads) Σ over steps of each lane's recall (recall_per_lane, -calib) */
    long recall_n;          /* steps counted per layer (× n_kv_heads in the sum) */
    double cur_nll;         /* this token's NLL, for -tokenlog (NaN when the run scored nothing) */
    EvalToken cur;          /* this token's figures against the shadow, for -tokenlog (inside the span) */
    double *cur_recall;     /* (chunk) per token of the current chunk: Σ over layers of its recall, for -tokenlog */
    double seconds;         /* time in this run's forward pass (its share of the lockstep run) */
    KVLog kvlog;            /* -kvlog's writer for this cache */
    IdList view;            /* ppl: the current document's token ids, for the log (not owned) */
    IdList asked;           /* passkey: every token fed since the question's cache reset, by position (owned) */
    KVBytes peak;           /* the largest allocation and live bytes seen */
    EvalCover cover;        /* merge=1: what each live slot covers, for recall (next NULL: not followed) */
    Nll *bucket;            /* -bucket: (n_bucket) the NLL of the tokens at positions [b*W, (b+1)*W) of their
                               document, W = bucket_w (the decay curve); NULL: not kept (calibration) */
    int n_bucket, bucket_w;
} PolicyRun;
/* The provenance of a job's records: text the digest of its input text so far (finalized on a copy). */
void provenance_init(Provenance *pv, const Model *m, const Options *o, const Sha256 *text);
/* The provenance fields every -o record ends with, and the closing brace and newline. */
void json_provenance_end(Line *l, const Provenance *pv);
/* One policy's cache and activations for -kv spec_text (or the shadow, in f32), ctx tokens (-c), chunks of up to
 * `chunk` tokens; caps: (n_layers * n_kv_heads) slots of each lane (o->kv_caps[k]), or NULL. Exits with a message
 * on a bad spec or no memory. policy_run_free frees it. */
void policy_run_init(PolicyRun *r, const Model *m, const Options *o, const char *spec_text, int ctx, int shadow,
                     int chunk, const int *caps);
void policy_run_free(PolicyRun *r);
/* Every -kv spec of o parsed, checked against o->mode and its cache built (then freed) at ctx tokens, so that a spec
 * the cache refuses (quest's page over its budget) is said before a job runs, not when its policy's turn comes;
 * exits with the message. For the modes that run the policies one after another. */
void policy_specs_check(const Model *m, const Options *o, int ctx);
/* A task runner's job: its -o and -kvlog files and its records' provenance (text: the digest of the texts its
 * items are made of; seed: the items' seed). task_job_open checks every -kv spec first (policy_specs_check), opens
 * the files, and starts the job's clock (run_job_start); exits with a message on error. */
typedef struct { OutFile out, kvlog; Provenance pv; } TaskJob;
void task_job_open(TaskJob *j, const Model *m, const Options *o, int ctx, const Sha256 *text, uint64_t seed);
void task_job_close(TaskJob *j);
/* Fold the cache's bytes now into r->peak. */
void note_bytes(PolicyRun *r);
/* The progress line on stderr (at most every 5 s, and at the end): done of total tokens, rate, ETA. */
void progress(double t_start, long done, long total, const char *what);
/* The same for a stream whose tokens cost more the later they come (ppl through growing caches): its ETA fits a
 * cost per token linear in the token's index to the job's progress so far (eval.c, eta_growing). */
void progress_growing(double t_start, long done, long total, const char *what);

/* The passkey's text (llama.cpp's examples/passkey): its instruction and the filler sentence, repeated to the
 * length. The filler is also RULER's "noise" haystack, which -m task uses. */
extern const char PK_PREFIX[], PK_FILLER[];
/* What the prompt and answer helpers return besides success (0) or an answer (a non-negative integer). */
enum { PK_NO_NUMBER = -1, PK_CACHE_FULL = -2, PK_STOPPED = -3 };
/* Encode text and append to ids (growing *cap); exits on a tokenizer error. */
void encode_append(const Model *m, const char *text, int add_bos, int **ids, size_t *n, size_t *cap);
/* Prefill ids[0..n) from position *pos, `chunk` tokens at a time (forward_prefill); *pos advances. 0, PK_CACHE_FULL,
 * or PK_STOPPED when SIGINT/SIGTERM came between two chunks. */
int prefill(Model *m, PolicyRun *r, const int *ids, size_t n, int *pos, int chunk);
/* The shared prefill (-m task, -m passkey with -prefix 1): policy caches that only store over a prompt's first tokens
 * start from one `full,type=f32` prefill of them, which is bit for bit their own (kv_full_prefix).
 * share_from: the tokens of an n-token prompt cache c (started for the prompt: reset, its prompt length told) may
 * take from the shared prefill: kv_full_prefix, short of the last token (whose logits are the policy's own answer),
 * rounded down to a whole chunk so that the policy's own chunks are those it would prefill alone (the bits do not
 * depend on chunking, but a peak of live bytes measured while a chunk passes through a compression does).
 * share_order: policy k into order[0..k], ordered by from[] (ties in index order), so the shared cache only grows
 * as the policies are asked in that order.
 * share_move_in: shared's first `from` tokens moved into dst, just started (a clone of shared, truncated to them,
 * kv_cache_transfer); what: the mode, for the error, which exits. */
int share_from(const KVCache *c, size_t n, int chunk);
void share_order(const int *from, int k, int *order);
void share_move_in(KVCache *dst, const KVCache *shared, int from, const char *what);
/* The greedy answer after a prefilled prompt: up to max_new tokens, ending before an end-of-generation token or
 * `stop` (an id, or -1); its text, NUL-terminated, in buf (cut at cap - 1 bytes). Every generated token is fed (and
 * pushed on r->asked) so the cache can continue. 0, PK_CACHE_FULL when the cache filled up, PK_STOPPED on
 * SIGINT/SIGTERM. */
int eval_answer(Model *m, PolicyRun *r, int *pos, int max_new, int stop, char *buf, size_t cap);

#endif
