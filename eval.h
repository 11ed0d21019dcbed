/* eval.h: the evaluation modes of ./run (eval.c): perplexity through each policy next to the f32 shadow, the
 * passkey, and the speed and memory bench. They run the engine (run.h); the engine knows nothing of them.
 */
#ifndef KVLAB_EVAL_H
#define KVLAB_EVAL_H

#include "cli.h"
#include "run.h"

/* Each returns the exit status: 0, or 128 + the signal when SIGINT/SIGTERM stopped it (what it measured up to then
 * is printed and written, marked partial). */
int run_ppl(Model *m, const Options *o);
int run_bench(Model *m, const Options *o);
int run_passkey(Model *m, const Options *o);
/* The passkey answer's score: the first run of decimal digits in text as a number (leading zeros dropped, at most 9
 * digits read), or -1 when text has no digit. */
long passkey_first_integer(const char *text);

/* The per-token figures of the evaluation (docs/DESIGN.md, "Evaluation"), exposed so that tests check them on
 * hand-made distributions and tools/kl_models.c uses the same code as ./run.
 * eval_logsumexp: log Σ_i exp(x_i) over n logits, in double (max subtracted first, so no overflow at ±1e38 and no
 * underflow of the largest term). eval_kl_div: KL(p ‖ q) in nats for p = softmax(a), q = softmax(b), lse_a and lse_b
 * their eval_logsumexp; never below 0 (rounding can leave -1e-17 for identical rows). */
double eval_logsumexp(const float *x, int n);
double eval_kl_div(const float *a, double lse_a, const float *b, double lse_b, int n);
/* eval_select_kth: thr[j] = the k[j]-th largest of x[0..n) for 1 <= k[j] <= n, j < nk, exactly (the value a
 * descending sort puts at k[j] - 1; -0 below +0, a NaN above +inf or, with its sign bit set, below -inf); buf: n
 * integers of scratch. The top-B recall's thresholds (a radix selection: eval.c says how). */
void eval_select_kth(const double *x, int n, const int *k, int nk, double *thr, uint64_t *buf);
/* One token, the distribution q = softmax(x) of a policy (or of a second model) against the reference p =
 * softmax(ref) of the shadow (or of the first model), y the true next token. The direction is KL(p_ref ‖ q). */
typedef struct {
    double nll;    /* −log q(y), nats */
    double kl;     /* KL(p ‖ q), nats */
    double dnll;   /* −log q(y) + log p(y) */
    double dp;     /* q(y) − p(y) */
    int top1;      /* 1 when argmax q = argmax p (each the first index of its largest logit) */
} EvalToken;
EvalToken eval_token(const float *ref, double lse_ref, const float *x, double lse_x, int y, int n);
/* Allocation by calibration (DuoAttention, Xiao et al. 2024, arXiv:2410.10819: retrieval lanes keep every token,
 * streaming lanes a sink cache). eval_choose_lanes is the lane choice, the one rule allocation by calibration uses:
 * recall (n_lanes, finite) is each lane's mean attention-mass recall in the streaming form; chosen (n_lanes) gets 1
 * for the round(share · n_lanes) lanes of lowest recall (C's round: halves away from zero; ties to the lower lane
 * index) and 0 for the others. Returns how many were chosen, or -1 (chosen untouched) when n_lanes < 1, share is
 * outside [0, 1] or a recall is not finite.
 * eval_calib: for -kv spec o->kv[k] whose policy takes a lane choice (calib_full, kv.h), the spec's streaming form
 * (every lane at the budget) runs -calib FILE (o->calib, which must be set) beside the shadow, as -m ppl -f FILE -n
 * (-c) does: the first min(tokens - 1, -c) positions attend and are measured (-c: run_context); the chosen lanes and
 * their recall go to stderr, and with -o a "duo_calib" record. Returns the lanes' slots (n_layers * n_kv_heads,
 * malloc'd): -c for a chosen lane, the budget for the others; NULL for a policy that takes no lane choice, or when
 * SIGINT/SIGTERM stopped the calibration (run_signal set). Exits with a message on a missing or unreadable file or
 * one of fewer than 2 tokens. */
int eval_choose_lanes(int *chosen, const double *recall, int n_lanes, double share);
int *eval_calib(Model *m, const Options *o, int k);
/* What the live slots of a merge-on-evict cache (merge=1) cover, for attention-mass recall (docs/DESIGN.md: a merged
 * slot counts the positions it covers). Such a slot covers a SET of positions, its own and every victim merged into
 * it (transitively), which need not be a range, so kv_lane_read's (first, last) spans cannot say it. The cache keeps
 * no such record (it would grow with the stream and is evaluation's question, not the cache's memory): EvalCover
 * follows the cache's merge events instead, per lane, for the positions below ctx (where recall is measured), as one
 * linked list per slot: next[p], the next position covered by the slot p's list belongs to (-1: the last), and
 * tail[p], the last position of the list headed by p. Merging the victim at v into the slot at position u appends
 * v's list to u's, O(1); the slot at position p covers p, next[p], next[next[p]], ...; a list whose head left the
 * cache is never walked again. Positions are a slot's `pos` (a merge-on-evict target keeps its own).
 * eval_cover_init: for the n_layers * n_kv_heads lanes (lane = l * n_kv_heads + g) and positions 0..ctx-1, every
 * position on its own; 0, or -1 out of memory.
 * eval_cover_reset: every position on its own again (a new document). eval_cover_merge: the victim at position v of
 * lane `lane` was merged into the slot at position u (both < ctx, else ignored: no recall is measured there).
 * eval_cover_event: a KVEventFn (kv.h) that applies a cache's merge-on-evict events to the EvalCover ctx, then calls
 * the observer the cache had before (fn, fn_ctx; e.g. -kvlog's writer) with every event.
 * eval_cover_masses: out[j] = Σ p_j[x] over every position x covered by the n live slots at positions pos[0..n) of
 * lane `lane` (kv_lane_positions), for k <= EVAL_COVER_K distributions over positions p_j = p + j·stride (ctx each);
 * each sum in the order of pos, each list in its order, all k in one walk of the lists (the walk, a chain of
 * dependent loads, is most of the cost). */
#define EVAL_COVER_K 4
typedef struct {
    int n_kv_heads, n_lanes, ctx;
    int32_t *next, *tail;   /* (n_lanes, ctx) */
    KVEventFn fn;           /* the cache's observer before eval_cover_event took its place, or NULL */
    void *fn_ctx;
} EvalCover;
int eval_cover_init(EvalCover *cv, int n_layers, int n_kv_heads, int ctx);
void eval_cover_free(EvalCover *cv);
void eval_cover_reset(EvalCover *cv);
void eval_cover_merge(EvalCover *cv, int lane, int v, int u);
void eval_cover_event(void *ctx, const KVEvent *ev);
void eval_cover_masses(const EvalCover *cv, int lane, const int *pos, int n, const float *p, size_t stride, int k,
                       double *out);
/* SHA-256 (FIPS 180-4) of data as 64 hex digits and a NUL in hex. */
void sha256_hex(const void *data, size_t len, char *hex);

#endif
