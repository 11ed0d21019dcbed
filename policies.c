/* policies.c: the KV-cache policies, one section each, registered in one table at the end.
 * A policy reads a lane through its read-only view (ranks, positions, its own metadata: kv.h) and answers with verbs
 * on ranks (evict, merge, select); storage, attention and accounting are kv.c's. It deliberately knows nothing of the
 * model or of the device the attention runs on.
 *
 * HOW TO ADD A POLICY: write a section below with a KVPolicyOps table (kv.h says what each callback is told and
 * when), cite the paper and section it implements, declare its per-slot metadata in meta_bytes_per_slot (kv.c
 * allocates it, zeroes it for each new token, moves it with the token and counts it; kv_rank_meta reads it by rank),
 * keep its other state in one block from state_new (clone/restore copy it as bytes), read its own keys with
 * kv_spec_get in init (an unread key is an error), list them in .options, check that the budget exceeds what it
 * protects (the current token counted) by at least one slot it chooses itself, never name a protected rank, break
 * ties by the oldest position, give it an .example that runs in every mode, and add it to `registry` at the end.
 * Nothing outside this file changes, but the tests' independent reference (tests/test_policies.c) gains its case.
 *
 * Rules every policy here follows (docs/DESIGN.md, Semantics): `evict` is asked at step 1 of the token at pos_now,
 * before it is stored, from the state after step pos_now-1; `recent=R` protects positions pos_now-R+1..pos_now (the
 * current token counted); a score-based policy keeps one token set per kv head (lane), from the attention of the
 * query heads of its GQA group aggregated by agg= (mean or max); thresholds compare the group mean whatever agg= is;
 * decisions at layer l depend only on layer l's own attention (a chunked prefill runs every token of a chunk through
 * layer l before layer l+1, run.c's forward_layer).
 *
 * Dimensions: budget (slots per lane), n_lanes (n_layers * n_kv_heads). Indices: s slot, i rank in a lane's live
 * list (live slots in increasing position order), t position.
 */
#include "kv.h"
#include "util.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* An integer option from a value string; 0 = absent (out untouched), 1 = set, -1 = bad (message written). */
static int parse_int_opt(const KVSpec *sp, const char *key, const char *v, long lo, long hi, long *out, char *err,
                         size_t errlen) {
    if (!v) return 0;
    char *end;
    long x = strtol(v, &end, 10);
    if (end == v || *end || x < lo || x > hi)
        return errorf(err, errlen, "bad %s=%s in '%s': an integer in [%ld, %ld]", key, v, sp->text, lo, hi);
    *out = x;
    return 1;
}

/* Reads and marks key as used; see parse_int_opt. */
static int opt_int(KVSpec *sp, const char *key, long lo, long hi, long *out, char *err, size_t errlen) {
    return parse_int_opt(sp, key, kv_spec_get(sp, key), lo, hi, out, err, errlen);
}

/* The budget must leave at least one slot the policy chooses beyond the `protected` ones (current token counted);
 * `what` names them as the spec does ("recent=64"), `fix` says what else could change. */
static int check_budget(const KVSpec *sp, const char *name, int budget, int protected, const char *what,
                        const char *fix, char *err, size_t errlen) {
    if (budget > protected) return 0;
    return errorf(err, errlen, "'%s': %s protects %d tokens (the current one counted), which leaves %s no slot to "
                "choose in a budget of %d: the budget must exceed them by at least one (a budget >= %d%s%s)",
                sp->text, what, protected, name, budget, protected + 1, *fix ? ", or " : "", fix);
}

/* The policy's state: one zeroed block of `bytes` (kv_cache_free frees it; clone/restore copy it as bytes, so it
 * holds no pointers). NULL when out of memory. */
static void *state_new(KVPolicy *p, size_t bytes) {
    p->state = calloc(1, bytes);
    p->state_bytes = p->state ? bytes : 0;
    return p->state;
}

static int lane_layer(const KVPolicy *p, int lane) { return lane / p->n_kv_heads; }

/* The f32 metadata of rank i (kv.c aligns each slot's metadata to its size of 4 bytes). */
static float *rank_f32(const KVLane *ln, int i) { return (float *)(void *)kv_rank_meta(ln, i, 4); }
static size_t meta_4(const KVSpec *sp, int budget) { (void)sp; (void)budget; return 4; }

/* The rank just past the candidates when positions > t - recent are protected: ranks [0, return) are candidates. */
static int candidates_end(const KVLane *ln, int t, int recent) {
    int n = ln->n_live;
    while (n > 0 && kv_rank_pos(ln, n - 1) > t - recent) n--;
    return n;
}

/* The candidate rank in [i0, i1) with the lowest f32 score in meta; ties go to the oldest (the first). */
static int argmin_f32(const KVLane *ln, int i0, int i1) {
    int best = i0;
    for (int i = i0 + 1; i < i1; i++)
        if (*rank_f32(ln, i) < *rank_f32(ln, best)) best = i;
    return best;
}

/* ---------------------------------------------------------------------------------------------------------------
 * full: never evicts. The lane holds the whole context (-c); past it the cache is full and generation stops.
 * ------------------------------------------------------------------------------------------------------------- */

/* full_prefix of the policies that act only when a lane is full (full, window, sink, random), and of the selection
   policies whose state changes only when they select (quest, topk) */
static int until_full(const KVPolicy *p) { return INT_MAX; }

static const KVPolicyOps policy_full = {
    .example = "full",
    .name = "full", .family = "eviction",
    .paper = "the plain KV cache of a Transformer decoder (Vaswani et al. 2017)",
    .summary = "never evict; budget = the context (-c)", .options = "", .reason = "none",
    .needs_budget = 0, .evicts = 0, .full_prefix = until_full,
};

/* ---------------------------------------------------------------------------------------------------------------
 * window:W: the W most recent tokens, the current one included (the sliding window of Longformer, Beltagy et al.
 * 2020, §3.1, applied to the cache). Victim: the oldest live token. window:1 is allowed: each token sees itself.
 * ------------------------------------------------------------------------------------------------------------- */

static int window_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    victims[0] = 0;
    score[0] = 0;
    return 1;
}

/* keep score: the position (the oldest goes first) */
static void window_keep(const KVPolicy *p, int lane, const KVLane *ln, int t, double *score) {
    for (int i = 0; i < ln->n_live; i++) score[i] = kv_rank_pos(ln, i);
}

/* protects: a full lane of W tokens evicts its oldest, whose position is at most pos_now - W */
static int window_protects(const KVPolicy *p) { return p->budget; }

static const KVPolicyOps policy_window = {
    .example = "window:16",
    .name = "window", .family = "eviction",
    .paper = "sliding window: Longformer, Beltagy et al. 2020, arXiv:2004.05150, section 3.1",
    .summary = "window:W keeps the W most recent tokens", .options = "", .reason = "oldest",
    .needs_budget = 1, .evicts = 1, .evict = window_evict, .keep_score = window_keep, .full_prefix = until_full,
    .protects = window_protects,
};

/* ---------------------------------------------------------------------------------------------------------------
 * sink:N,sinks=S: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
 * arXiv:2309.17453, §3.2 "Rolling KV Cache with Attention Sinks"): the S first tokens (attention sinks) and the N-S
 * most recent. Victim: the oldest token that is not a sink. Sinks are never evicted, so they are always live[0..S-1].
 * Default S = 4 (the paper's choice).
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int sinks; } SinkState;

/* sinks=S (default 4) and the budget rule, into st: sink's own keys, which duo's streaming lanes take as they are. */
static int sink_params(KVSpec *sp, int budget, SinkState *st, char *err, size_t errlen) {
    long s = 4;
    if (opt_int(sp, "sinks", 0, 1 << 24, &s, err, errlen) < 0) return -1;
    st->sinks = (int)s;
    char what[48], fix[48];
    snprintf(what, sizeof what, "sinks=%d", st->sinks);
    snprintf(fix, sizeof fix, "sinks <= %d", budget - 2 >= 0 ? budget - 2 : 0);
    return check_budget(sp, sp->name, budget, st->sinks + 1, what, budget >= 2 ? fix : "", err, errlen);
}

static int sink_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    SinkState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    return sink_params(sp, budget, st, err, errlen);
}

static int sink_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    SinkState *st = p->state;
    victims[0] = st->sinks;
    score[0] = 0;
    return 1;
}

/* keep score: the sinks protected, then the position */
static void sink_keep(const KVPolicy *p, int lane, const KVLane *ln, int t, double *score) {
    const SinkState *st = p->state;
    for (int i = 0; i < ln->n_live; i++) score[i] = i < st->sinks ? INFINITY : kv_rank_pos(ln, i);
}

/* protects: a full lane holds the S sinks and N - S others; the oldest of those is at most pos_now - (N - S) */
static int sink_protects(const KVPolicy *p) { return p->budget - ((const SinkState *)p->state)->sinks; }

static void sink_describe(const KVPolicy *p, char *buf, size_t len) {
    snprintf(buf, len, "sinks=%d", ((const SinkState *)p->state)->sinks);
}

static const KVPolicyOps policy_sink = {
    .example = "sink:16,sinks=4",
    .name = "sink", .family = "eviction",
    .paper = "StreamingLLM: Xiao et al. 2023, arXiv:2309.17453, section 3.2",
    .summary = "sink:N,sinks=S keeps S attention sinks + the N-S most recent (StreamingLLM)",
    .options = "sinks=S (default 4)", .reason = "oldest after the sinks", .needs_budget = 1, .evicts = 1,
    .init = sink_init, .evict = sink_evict, .describe = sink_describe, .keep_score = sink_keep,
    .full_prefix = until_full, .protects = sink_protects,
};

/* ---------------------------------------------------------------------------------------------------------------
 * duo:B,full=F,sinks=S: DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with
 * Retrieval and Streaming Heads", arXiv:2410.10819, section 2): retrieval lanes keep every token (a full cache up to
 * -c, never evicting, the cache stopping at -c as `full` does), streaming lanes keep S attention sinks and the B-S
 * most recent tokens, exactly sink:B,sinks=S (sink's keys, budget rule and victim are the code above, not a copy).
 * One lane is one (layer, kv head): a GQA group shares its lane, so the split is per kv head, as the paper's is for
 * GQA models. The paper finds its retrieval heads by optimizing a gate per head on synthetic passkey data; here the
 * DRIVER chooses them (the allocation family: the policy knows no model and no text): with -calib FILE, the
 * round(F · n_lanes) lanes where sink:B holds the least of the shadow's attention on that text are full
 * (eval_calib and eval_choose_lanes in eval.c).
 * How the policy receives the lane mask: as ragged budgets. The driver makes the cache with kv_cache_init_lanes,
 * -c slots for a full lane and B for a streaming one, and the policy tells them apart by their cap (cap > B: full).
 * We chose that over a mask in the spec or in the policy's state because the memory then follows the mask with
 * nothing more (a streaming lane allocates B slots, never -c), clone/restore already copy the caps, and the policy
 * keeps no per-lane table. Made with kv_cache_init (every lane B), it IS sink:B: the calibration run is that cache.
 * The budget is in tokens and below -c (a byte budget would have to split bytes the full lanes take by -c; a
 * streaming lane of -c slots would be a full one); full=F in [0, 1] is required, sinks= as sink's. No metadata.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { SinkState sink; /* first: sink's callbacks read it through p->state */ double full; } DuoState;

static int duo_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    DuoState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    const char *f = kv_spec_get(sp, "full");
    if (!f) return errorf(err, errlen, "'%s': duo needs full=F, the share of lanes (layer, kv head) that keep every "
                          "token, in [0, 1] (e.g. duo:%d,full=0.25)", sp->text, budget);
    if (parse_float(f, 0, 1, &st->full))
        return errorf(err, errlen, "bad full=%s in '%s': the share of lanes that keep every token, a number in [0, 1]",
                      f, sp->text);
    if (sp->budget_bytes)
        return errorf(err, errlen, "'%s': give duo's budget in tokens (duo:256,full=%s): its full lanes take -c slots "
                      "each, so its bytes follow from the budget, full= and -c", sp->text, f);
    if (budget >= shape->seq_len)
        return errorf(err, errlen, "'%s': a streaming lane of %d slots holds the whole context (-c %d), as a full lane "
                      "does: duo's budget must be below -c", sp->text, budget, shape->seq_len);
    return sink_params(sp, budget, &st->sink, err, errlen);
}

/* a full lane (cap above the budget) never evicts: kv_append then reports the cache full, as under `full` */
static int duo_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    if (ln->cap > p->budget) return 0;
    return sink_evict(p, lane, ln, t, victims, max, score);
}

/* the smallest full lane: streaming lanes take any number of tokens */
static int duo_capacity(const KVPolicy *p) {
    int cap = INT_MAX;
    for (int i = 0; i < p->n_lanes; i++)
        if (p->lanes[i].cap > p->budget && p->lanes[i].cap < cap) cap = p->lanes[i].cap;
    return cap;
}

static double duo_calib_full(const KVPolicy *p) { return ((const DuoState *)p->state)->full; }

static void duo_describe(const KVPolicy *p, char *buf, size_t len) {
    int n_full = 0;
    for (int i = 0; i < p->n_lanes; i++) n_full += p->lanes[i].cap > p->budget;
    snprintf(buf, len, "sinks=%d full=%g (%d of %d lanes full)", ((const DuoState *)p->state)->sink.sinks,
             ((const DuoState *)p->state)->full, n_full, p->n_lanes);
}

static const KVPolicyOps policy_duo = {
    .example = "duo:16,full=0.25",
    .name = "duo", .family = "allocation",
    .paper = "DuoAttention: Xiao et al. 2024, arXiv:2410.10819, section 2 (retrieval and streaming heads); the "
             "streaming lanes are StreamingLLM's (Xiao et al. 2023, arXiv:2309.17453)",
    .summary = "duo:B,full=F: the share F of lanes with the lowest sink:B recall on -calib FILE keep every token up to "
               "-c, the rest are sink:B (DuoAttention)",
    .options = "full=F (required: the share of lanes kept full, in [0, 1]; needs -calib FILE), sinks=S (default 4)",
    .reason = "oldest after the sinks (a streaming lane)", .needs_budget = 1, .evicts = 1, .init = duo_init,
    .evict = duo_evict, .capacity = duo_capacity, .calib_full = duo_calib_full, .describe = duo_describe,
};

/* ---------------------------------------------------------------------------------------------------------------
 * h2o:N,recent=R: Heavy-Hitter Oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
 * of Large Language Models", arXiv:2306.14048, §4 and its Algorithm 1, the greedy eviction): each token's attention is
 * accumulated over every step since it was stored (per lane: one set per kv head, the group's probabilities aggregated
 * by agg=); the R most recent tokens (current included) are always kept; the victim is the other token with the lowest
 * accumulated attention. Default R = N/2, the paper's even split between recent and heavy tokens. Metadata: one f32
 * sum.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int recent; } RecentState;

static int h2o_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    RecentState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    long r = budget / 2 > 1 ? budget / 2 : 1;
    if (opt_int(sp, "recent", 1, 1 << 24, &r, err, errlen) < 0) return -1;
    st->recent = (int)r;
    char what[48], fix[48];
    snprintf(what, sizeof what, "recent=%d", st->recent);
    snprintf(fix, sizeof fix, "recent <= %d", budget - 1);
    return check_budget(sp, "h2o", budget, st->recent, what, budget >= 2 ? fix : "", err, errlen);
}

static void h2o_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int t) {
    for (int i = 0; i < ln->n_live; i++) *rank_f32(ln, i) += prob[i];
}

static int h2o_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    RecentState *st = p->state;
    int i = argmin_f32(ln, 0, candidates_end(ln, t, st->recent));
    victims[0] = i;
    score[0] = *rank_f32(ln, i);
    return 1;
}

/* keep score: recent protected, the others their accumulated attention */
static void h2o_keep(const KVPolicy *p, int lane, const KVLane *ln, int t, double *score) {
    const RecentState *st = p->state;
    int end = candidates_end(ln, t, st->recent);
    for (int i = 0; i < ln->n_live; i++) score[i] = i < end ? *rank_f32(ln, i) : INFINITY;
}

/* protects: positions > pos_now - recent are never candidates (candidates_end) */
static int recent_protects(const KVPolicy *p) { return ((const RecentState *)p->state)->recent; }

static void recent_describe(const KVPolicy *p, char *buf, size_t len) {
    snprintf(buf, len, "recent=%d", ((const RecentState *)p->state)->recent);
}

static const KVPolicyOps policy_h2o = {
    .example = "h2o:16,recent=8",
    .name = "h2o", .family = "eviction",
    .paper = "H2O: Zhang et al. 2023, arXiv:2306.14048, section 4, Algorithm 1",
    .summary = "h2o:N,recent=R keeps the R most recent + the heaviest accumulated attention (H2O)",
    .options = "recent=R (default N/2)", .reason = "lowest accumulated attention outside recent", .needs_budget = 1,
    .evicts = 1, .init = h2o_init, .meta_bytes_per_slot = meta_4, .observe = h2o_observe, .evict = h2o_evict,
    .describe = recent_describe, .keep_score = h2o_keep, .protects = recent_protects,
};

/* ---------------------------------------------------------------------------------------------------------------
 * tova:N,per=lane|layer: Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
 * arXiv:2401.06104, §3, the section introducing TOVA): drop the token with the lowest attention at the last step. In
 * the paper the current query first attends over N+1 tokens and the lowest is dropped after; here, as the step order
 * of docs/DESIGN.md requires (the budget is what a query attends to), the victim is chosen when the lane is full from
 * the PREVIOUS step's attention, before the current token is stored. The paper keeps one set per layer, scoring with
 * the attention averaged over all heads of the layer: per=layer does that (the mean, or the max with agg=max, over
 * every query head of the layer, so every lane of a layer holds the same positions); per=lane (default) keeps one set
 * per kv head from its GQA group's attention. Only the current token is protected. Metadata: one f32, the last step's attention.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int per_layer; float layer_score[]; /* (budget) sum or max over the lanes of the layer */ } TovaState;

static int tova_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    const char *per = kv_spec_get(sp, "per");
    int per_layer = per && !strcmp(per, "layer");
    TovaState *st = state_new(p, sizeof *st + (per_layer ? (size_t)budget * sizeof(float) : 0));
    if (!st) return errorf(err, errlen, "out of memory");
    if (per && strcmp(per, "lane") && strcmp(per, "layer"))
        return errorf(err, errlen, "unknown per=%s in '%s'; choices: lane, layer", per, sp->text);
    const char *al = kv_spec_value(sp, "alloc");
    if (per_layer && al && !strcmp(al, "ada"))   /* per=layer reads rank i as one token in every lane of a layer */
        return errorf(err, errlen, "'%s': tova's per=layer keeps one set of positions in every lane of a layer, and "
                      "alloc=ada lets the lanes hold different ones: use per=lane (the default) with alloc=ada",
                      sp->text);
    st->per_layer = per_layer;
    return check_budget(sp, "tova", budget, 1, "tova", "", err, errlen);
}

static void tova_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int t) {
    TovaState *st = p->state;
    if (!st->per_layer) {
        for (int i = 0; i < ln->n_live; i++) *rank_f32(ln, i) = prob[i];
        return;
    }
    /* per=layer: every lane of the layer holds the same positions in the same order, so rank i is one token */
    int g = lane % p->n_kv_heads;
    for (int i = 0; i < ln->n_live; i++) {
        float *s = &st->layer_score[i];
        if (g == 0) *s = prob[i];
        else if (p->agg == AGG_MAX) *s = fmaxf(*s, prob[i]);
        else *s += prob[i];
    }
}

static void tova_on_layer_done(KVPolicy *p, int layer, int t) {
    TovaState *st = p->state;
    if (!st->per_layer) return;
    for (int g = 0; g < p->n_kv_heads; g++) {
        const KVLane *ln = &p->lanes[layer * p->n_kv_heads + g];
        /* the mean over all heads of the layer = the mean of the group means (groups are equal in size) */
        for (int i = 0; i < ln->n_live; i++)
            *rank_f32(ln, i) = p->agg == AGG_MAX ? st->layer_score[i] : st->layer_score[i] / p->n_kv_heads;
    }
}

static int tova_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    int i = argmin_f32(ln, 0, ln->n_live);
    victims[0] = i;
    score[0] = *rank_f32(ln, i);
    return 1;
}

/* keep score: the last step's attention (per=layer: the layer's, written into every lane's metadata) */
static void tova_keep(const KVPolicy *p, int lane, const KVLane *ln, int t, double *score) {
    for (int i = 0; i < ln->n_live; i++) score[i] = *rank_f32(ln, i);
}

static void tova_describe(const KVPolicy *p, char *buf, size_t len) {
    snprintf(buf, len, "per=%s", ((const TovaState *)p->state)->per_layer ? "layer" : "lane");
}

static const KVPolicyOps policy_tova = {
    .example = "tova:16",
    .name = "tova", .family = "eviction",
    .paper = "TOVA: Oren et al. 2024, Transformers are Multi-State RNNs, arXiv:2401.06104, section 3",
    .summary = "tova:N drops the lowest attention of the last step (TOVA); per=layer as the paper",
    .options = "per=lane|layer (default lane)", .reason = "lowest attention at the last step", .needs_budget = 1,
    .evicts = 1, .init = tova_init, .meta_bytes_per_slot = meta_4, .observe = tova_observe,
    .on_layer_done = tova_on_layer_done, .evict = tova_evict, .describe = tova_describe, .keep_score = tova_keep,
};

/* ---------------------------------------------------------------------------------------------------------------
 * scissorhands:N,recent=R,history=H,drop=M: Scissorhands (Liu et al. 2023, "Scissorhands: Exploiting the
 * Persistence of Importance Hypothesis for LLM KV Cache Compression at Test Time", arXiv:2305.17118, §4, its
 * Algorithms 1 (a budgeted cache per head) and 2 (compression)): over
 * the last H steps, count how often a token's attention fell below the threshold 1/(live slots) (the group MEAN is
 * compared, whatever agg=); when the lane is full, free the M tokens counted unimportant most often at once (ties:
 * oldest first), the R most recent (current included) protected; the lane then holds fewer than N tokens until it
 * refills. Defaults R = H = N/4 (at least 1), M = 1. Metadata: an H-bit ring per slot, bit (t mod H) set when the
 * token was unimportant at step t (bits of steps before the token existed are 0), so the count is exact.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int recent, history, drop; } ScissorsState;

/* Reads recent, history, drop (marking them when sp is writable), with defaults and checks. */
static int scissors_params(const KVSpec *sp, KVSpec *mark, int budget, ScissorsState *st, char *err, size_t errlen) {
    long r = budget / 4 > 1 ? budget / 4 : 1, h = r, m = 1;
    const char *vr = mark ? kv_spec_get(mark, "recent") : kv_spec_value(sp, "recent");
    const char *vh = mark ? kv_spec_get(mark, "history") : kv_spec_value(sp, "history");
    const char *vm = mark ? kv_spec_get(mark, "drop") : kv_spec_value(sp, "drop");
    if (parse_int_opt(sp, "recent", vr, 1, 1 << 24, &r, err, errlen) < 0) return -1;
    if (parse_int_opt(sp, "history", vh, 1, 1 << 20, &h, err, errlen) < 0) return -1;
    if (parse_int_opt(sp, "drop", vm, 1, 1 << 24, &m, err, errlen) < 0) return -1;
    st->recent = (int)r; st->history = (int)h; st->drop = (int)m;
    char what[48], fix[48];
    snprintf(what, sizeof what, "recent=%d", st->recent);
    snprintf(fix, sizeof fix, "recent <= %d", budget - 1);
    if (check_budget(sp, "scissorhands", budget, st->recent, what, budget >= 2 ? fix : "", err, errlen)) return -1;
    if (st->drop > budget - st->recent + 1)
        return errorf(err, errlen, "'%s': drop=%d frees more tokens than the %d a full lane has outside recent=%d "
                    "(before the current token is stored): use drop <= %d", sp->text, st->drop,
                    budget - st->recent + 1, st->recent, budget - st->recent + 1);
    return 0;
}

static size_t scissors_meta_bytes(const KVSpec *sp, int budget) {
    ScissorsState st = {0};
    char err[8];
    if (scissors_params(sp, NULL, budget, &st, err, sizeof err) && st.history < 1)   /* bad spec: init will say */
        st.history = budget / 4 > 1 ? budget / 4 : 1;
    return ((size_t)st.history + 7) / 8;
}

static int scissors_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    ScissorsState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    return scissors_params(sp, sp, budget, st, err, errlen);
}

static void scissors_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int t) {
    ScissorsState *st = p->state;
    size_t mb = ((size_t)st->history + 7) / 8;
    int bit = t % st->history;
    float thr = 1.0f / (float)ln->n_live;
    for (int i = 0; i < ln->n_live; i++) {
        uint8_t *ring = kv_rank_meta(ln, i, mb);
        if (mean[i] < thr) ring[bit / 8] |= (uint8_t)(1u << (bit % 8));
        else ring[bit / 8] &= (uint8_t)~(1u << (bit % 8));
    }
}

static int scissors_count(const ScissorsState *st, const KVLane *ln, int i) {
    size_t mb = ((size_t)st->history + 7) / 8;
    const uint8_t *ring = kv_rank_meta(ln, i, mb);
    int n = 0;
    for (size_t j = 0; j < mb; j++)
        for (uint8_t b = ring[j]; b; b &= (uint8_t)(b - 1)) n++;
    return n;
}

static int scissors_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    ScissorsState *st = p->state;
    int n_cand = candidates_end(ln, t, st->recent), n = 0;
    int want = st->drop < n_cand ? st->drop : n_cand;
    if (want > max) want = max;
    /* M rounds of "highest count, oldest first" among the candidates not yet chosen (victims hold live ranks) */
    while (n < want) {
        int best = -1, best_count = -1;
        for (int i = 0; i < n_cand; i++) {
            int taken = 0;
            for (int j = 0; j < n; j++) taken |= victims[j] == i;
            if (taken) continue;
            int cnt = scissors_count(st, ln, i);
            if (cnt > best_count) { best = i; best_count = cnt; }
        }
        victims[n] = best;
        score[n] = best_count;
        n++;
    }
    return n;
}

/* protects: positions > pos_now - recent are never candidates (candidates_end) */
static int scissors_protects(const KVPolicy *p) { return ((const ScissorsState *)p->state)->recent; }

static void scissors_describe(const KVPolicy *p, char *buf, size_t len) {
    const ScissorsState *st = p->state;
    snprintf(buf, len, "recent=%d history=%d drop=%d", st->recent, st->history, st->drop);
}

static const KVPolicyOps policy_scissorhands = {
    .example = "scissorhands:16,drop=2",
    .name = "scissorhands", .family = "eviction", .paper = "Scissorhands: Liu et al. 2023, arXiv:2305.17118, section 4",
    .summary = "scissorhands:N frees the tokens most often below 1/n attention over the last H steps (Scissorhands)",
    .options = "recent=R, history=H (default N/4 each), drop=M (default 1)",
    .reason = "most often below 1/n attention over the history", .needs_budget = 1, .evicts = 1,
    .init = scissors_init, .meta_bytes_per_slot = scissors_meta_bytes, .observe = scissors_observe,
    .evict = scissors_evict, .describe = scissors_describe, .protects = scissors_protects,
};

/* ---------------------------------------------------------------------------------------------------------------
 * lru:N,thresh=τ: least recently used, the classic cache policy with "use" read from attention: a token is used at a
 * step when its attention (the group mean) is at least τ/(live slots), τ = 1 meaning "above uniform"; a token counts
 * as used when stored; the victim is the token whose last use is oldest (ties: the oldest position). Only the
 * current token is protected. Metadata: one int32, the step of the last use.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { float thresh; } LruState;

static int lru_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    LruState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    st->thresh = 1.0f;
    const char *v = kv_spec_get(sp, "thresh");
    if (v) {
        char *end;
        double x = strtod(v, &end);
        if (end == v || *end || !(x > 0 && x <= 1e6))
            return errorf(err, errlen, "bad thresh=%s in '%s': a number in (0, 1e6], in units of 1/(live slots)", v,
                        sp->text);
        st->thresh = (float)x;
    }
    return check_budget(sp, "lru", budget, 1, "lru", "", err, errlen);
}

static void lru_on_insert(KVPolicy *p, int lane, const KVLane *ln, int rank, int pos) {
    int32_t v = pos;
    memcpy(kv_rank_meta(ln, rank, 4), &v, 4);
}

static void lru_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int t) {
    LruState *st = p->state;
    float thr = st->thresh / (float)ln->n_live;
    int32_t v = t;
    for (int i = 0; i < ln->n_live; i++)
        if (mean[i] >= thr) memcpy(kv_rank_meta(ln, i, 4), &v, 4);
}

static int lru_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    int best = 0;
    int32_t best_use = 0;
    for (int i = 0; i < ln->n_live; i++) {
        int32_t u;
        memcpy(&u, kv_rank_meta(ln, i, 4), 4);
        if (i == 0 || u < best_use) { best = i; best_use = u; }
    }
    victims[0] = best;
    score[0] = best_use;
    return 1;
}

/* keep score: the step of the last use (the least recently used goes first) */
static void lru_keep(const KVPolicy *p, int lane, const KVLane *ln, int t, double *score) {
    for (int i = 0; i < ln->n_live; i++) {
        int32_t u;
        memcpy(&u, kv_rank_meta(ln, i, 4), 4);
        score[i] = u;
    }
}

static void lru_describe(const KVPolicy *p, char *buf, size_t len) {
    snprintf(buf, len, "thresh=%g", ((const LruState *)p->state)->thresh);
}

static const KVPolicyOps policy_lru = {
    .example = "lru:16",
    .name = "lru", .family = "eviction",
    .paper = "least recently used, the classic cache policy, with use read from attention",
    .summary = "lru:N evicts the token whose attention last reached thresh/(live slots) longest ago",
    .options = "thresh=T (default 1)", .reason = "least recently used", .needs_budget = 1, .evicts = 1,
    .init = lru_init, .meta_bytes_per_slot = meta_4, .on_insert = lru_on_insert, .observe = lru_observe,
    .evict = lru_evict, .describe = lru_describe, .keep_score = lru_keep,
};

/* ---------------------------------------------------------------------------------------------------------------
 * random:N,seed=K: the floor every policy must beat. The victim is drawn uniformly among the live tokens (only the
 * current token, not yet stored, is protected) by a counter-based generator: a pure function of (seed, layer,
 * kv_head, position of the token being added), SplitMix64 (Steele et al. 2014; kv.h's splitmix64 on a copy) chained
 * over the key, so results do not depend on batching, thread count or call order. No metadata.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { uint64_t seed; } RandomState;

/* SplitMix64's output for state x: its increment, then its finalizer kv_mix64 (kv.h); x is a copy, so this is a pure
 * function of x. */
static uint64_t mix64(uint64_t x) { return splitmix64(&x); }

static int random_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    RandomState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    st->seed = 1;
    const char *v = kv_spec_get(sp, "seed");
    if (v) {
        char *end;
        if (*v < '0' || *v > '9') return errorf(err, errlen, "bad seed=%s in '%s': an integer >= 0", v, sp->text);
        st->seed = strtoull(v, &end, 10);
        if (*end) return errorf(err, errlen, "bad seed=%s in '%s': an integer >= 0", v, sp->text);
    }
    return check_budget(sp, "random", budget, 1, "random", "", err, errlen);
}

static int random_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    RandomState *st = p->state;
    uint64_t r = mix64(mix64(mix64(mix64(st->seed) ^ (uint64_t)lane_layer(p, lane)) ^ (uint64_t)(lane % p->n_kv_heads))
                       ^ (uint64_t)t);
    /* r mod n: the bias is below n / 2^64, far below anything a run can observe */
    victims[0] = (int)(r % (uint64_t)ln->n_live);
    score[0] = 0;
    return 1;
}

static void random_describe(const KVPolicy *p, char *buf, size_t len) {
    snprintf(buf, len, "seed=%llu", (unsigned long long)((const RandomState *)p->state)->seed);
}

static const KVPolicyOps policy_random = {
    .example = "random:16,seed=1",
    .name = "random", .family = "eviction",
    .paper = "uniform random eviction, the baseline of the eviction papers",
    .summary = "random:N evicts a uniformly drawn token (counter-based, seed=K)",
    .options = "seed=K (default 1)", .reason = "random draw", .needs_budget = 1, .evicts = 1, .init = random_init,
    .evict = random_evict, .describe = random_describe, .full_prefix = until_full,
};

/* ---------------------------------------------------------------------------------------------------------------
 * snapkv:N,obs=W,kernel=K,prefill=P: SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
 * Generation", arXiv:2404.14469, §4, the observation window, voting and pooling): the lane grows without eviction
 * through the prompt; right after the attention of the last prompt token, each lane is compressed once to N tokens: the
 * last W prompt tokens (the observation window) are kept, and of the others the N-W with the highest score, where a
 * token's score is the attention it received from the W observation queries (summed; the GQA group aggregated by agg=,
 * one set per kv head instead of the paper's per-query-head copies), max-pooled over neighbouring positions with kernel
 * K (its clustering step). Afterwards the lane grows by one slot per token without eviction, up to -c like `full`. The
 * prompt end comes from kv_set_prompt_len (generate, chat, passkey) or prefill=P (required in ppl mode). Defaults W =
 * 32, K = 7. Metadata: one f32, the attention summed over the observation queries.
 * query=aware|agnostic (SCBench's distinction, Li et al. 2024, arXiv:2412.10319: compression that has seen the
 * question against compression of the context alone). aware (the default, the paper's SnapKV): the compression point
 * is the prompt's end, so the observation window holds the question (-m task: the prompt's question, and for
 * -questions the first question only: under -shared turns questions 2..N are later turns asked of the cache as
 * question 1 compressed it, never compressed again; under -shared requests the context and question 1 are compressed
 * together, the answer to question 1 is generated from that cache, and questions 2..N are each asked of that
 * compressed cache with question 1's tokens dropped (kv_cache_truncate), so what survived was chosen by question 1
 * and its window's slots are gone). agnostic: the compression point is the end of the shared context
 * (kv_set_context_len: -m task's tokens before the first question), so the window is the context's last W tokens and
 * no question is seen; under -shared requests the context alone is compressed once and every question is asked of
 * that same cache; under turns question 1's tokens come after the compression. agnostic needs the context's end, so
 * it is for -m task only (an error elsewhere); in ppl there is no question, so query= is an error there.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct {
    int obs, kernel, prefill;
    int agnostic;  /* query=agnostic: compress at the context's end (KVPolicy.context_len), not the prompt's */
    int prompt;   /* the prompt length this document compresses at: the first one seen, so a later prompt (a second
                     chat turn) never compresses again (docs/DESIGN.md: once) */
} SnapState;

/* The prompt length to act on (query=agnostic: the context's), or 0. */
static int snap_prompt(KVPolicy *p) {
    SnapState *st = p->state;
    int end = st->agnostic ? p->context_len : p->prompt_len;
    if (!st->prompt && end > 0) st->prompt = end;
    return st->prompt == end ? st->prompt : 0;
}
typedef struct { float score; int pos, rank; } SnapCand;

/* query= is aware, agnostic or absent; 0, or -1 + message. */
static int snap_query_check(const KVSpec *sp, const char *q, char *err, size_t errlen) {
    if (!q || !strcmp(q, "aware") || !strcmp(q, "agnostic")) return 0;
    return errorf(err, errlen, "bad query=%s in '%s': aware (compress at the prompt's end, the question seen) or "
                  "agnostic (at the shared context's end, before the question)", q, sp->text);
}

static int snap_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    SnapState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    long w = 32, k = 7, pf = 0;
    if (opt_int(sp, "obs", 1, 1 << 20, &w, err, errlen) < 0) return -1;
    if (opt_int(sp, "kernel", 1, 1 << 10, &k, err, errlen) < 0) return -1;
    if (opt_int(sp, "prefill", 1, 1 << 30, &pf, err, errlen) < 0) return -1;
    if (k % 2 == 0) return errorf(err, errlen, "bad kernel=%ld in '%s': an odd pooling width (1, 3, 5, 7, ...)", k,
                                sp->text);
    const char *q = kv_spec_get(sp, "query");
    if (snap_query_check(sp, q, err, errlen)) return -1;
    st->agnostic = q && !strcmp(q, "agnostic");
    st->obs = (int)w; st->kernel = (int)k; st->prefill = (int)pf;
    char what[48], fix[48];
    snprintf(what, sizeof what, "obs=%d", st->obs);
    snprintf(fix, sizeof fix, "obs <= %d", budget - 1);
    return check_budget(sp, "snapkv", budget, st->obs, what, budget >= 2 ? fix : "", err, errlen);
}

static void snap_reset(KVPolicy *p) {
    SnapState *st = p->state;
    p->prompt_len = st->prefill;
    st->prompt = 0;
}

static void snap_observe(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int t) {
    SnapState *st = p->state;
    int P = snap_prompt(p);
    if (P <= 0 || t >= P || t < P - st->obs) return;
    for (int i = 0; i < ln->n_live; i++) *rank_f32(ln, i) += prob[i];
}

static int snap_cmp(const void *a, const void *b) {
    const SnapCand *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? -1 : 1;   /* lowest score first ... */
    return x->pos < y->pos ? -1 : x->pos > y->pos;                    /* ... and among equals the oldest */
}

static int snap_prune(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    SnapState *st = p->state;
    int P = snap_prompt(p);
    if (P <= 0 || t != P - 1 || ln->n_live <= p->budget) return 0;
    int n_cand = candidates_end(ln, t, st->obs), n_keep = p->budget - (ln->n_live - n_cand);
    SnapCand *c = malloc((size_t)n_cand * sizeof *c);
    if (!c) { fprintf(stderr, "snapkv: out of memory\n"); abort(); }
    int half = st->kernel / 2;
    for (int i = 0; i < n_cand; i++) {   /* max pooling over the candidates, padded at both ends */
        float m = -INFINITY;
        for (int j = i - half; j <= i + half; j++)
            if (j >= 0 && j < n_cand && *rank_f32(ln, j) > m) m = *rank_f32(ln, j);
        c[i] = (SnapCand){m, kv_rank_pos(ln, i), i};
    }
    qsort(c, (size_t)n_cand, sizeof *c, snap_cmp);
    int n = n_cand - n_keep < max ? n_cand - n_keep : max;
    for (int j = 0; j < n; j++) { victims[j] = c[j].rank; score[j] = c[j].score; }
    free(c);
    return n;
}

/* ppl has no prompt: the compression point must be given (prefill=P). */
static int snap_check_mode(const KVSpec *sp, const char *mode, char *err, size_t errlen) {
    const char *q = kv_spec_value(sp, "query");
    if (snap_query_check(sp, q, err, errlen)) return -1;   /* said before any work */
    if (q && !strcmp(mode, "ppl"))
        return errorf(err, errlen, "'%s': query= has no meaning in ppl mode (there is no question; prefill=P is the "
                      "compression point): leave it out", sp->text);
    if (q && !strcmp(q, "agnostic") && strcmp(mode, "task"))
        return errorf(err, errlen, "'%s': query=agnostic compresses at the end of the shared context, which only "
                      "-m task knows (the tokens before the question); -m %s has none", sp->text, mode);
    if (!strcmp(mode, "ppl") && !kv_spec_value(sp, "prefill"))
        return errorf(err, errlen, "'%s' in ppl mode needs prefill=P, the number of tokens after which %s "
                      "compresses (ppl has no prompt), e.g. %s,prefill=1024", sp->text, sp->name, sp->text);
    return 0;
}

/* Nothing but storing before the observation window opens (obs tokens before the compression point). */
static int snap_full_prefix(const KVPolicy *p) {
    const SnapState *st = p->state;
    int end = st->agnostic ? p->context_len : p->prompt_len;
    return end > st->obs ? end - st->obs : 0;
}

static void snap_describe(const KVPolicy *p, char *buf, size_t len) {
    const SnapState *st = p->state;
    snprintf(buf, len, "obs=%d kernel=%d prefill=%d query=%s", st->obs, st->kernel, st->prefill,
             st->agnostic ? "agnostic" : "aware");
}

static const KVPolicyOps policy_snapkv = {
    .example = "snapkv:16,obs=4,prefill=32",
    .name = "snapkv", .family = "eviction",
    .paper = "SnapKV: Li et al. 2024, arXiv:2404.14469, section 4",
    .summary = "snapkv:N compresses the prompt once to N tokens from its last obs queries (SnapKV)",
    .options = "obs=W (default 32), kernel=K (default 7), prefill=P (the prompt length; required in ppl), "
               "query=aware|agnostic (default aware: the window holds the question; agnostic: -m task only, it ends "
               "with the shared context)",
    .reason = "prompt compression: lowest pooled attention of the observation window", .needs_budget = 1,
    .evicts = 0, .grows = 1, .prompt_end = 1, .init = snap_init, .check_mode = snap_check_mode, .reset = snap_reset,
    .meta_bytes_per_slot = meta_4, .observe = snap_observe, .prune = snap_prune, .describe = snap_describe,
    .full_prefix = snap_full_prefix,
};

/* ---------------------------------------------------------------------------------------------------------------
 * pool:N,group=G,recent=R,sinks=S: pooling of adjacent tokens, the merging family's plainest member (the
 * mean-pooled memory of Compressive Transformers, Rae et al. 2020, arXiv:1911.05507, section 3.1, applied to the KV
 * cache): the S first tokens (attention sinks, as StreamingLLM keeps them) and the R most recent (the
 * current one counted) stay as they are; between them, each G adjacent positions [S+jG, S+jG+G) become one slot as
 * soon as all G have left the recent window (at step 1 of the token at S+jG+G-1+R), key and value the mean of the G
 * (kv.c merges: under pos=orig the keys are averaged after rotation), position that of the newest of the G. A lane so
 * holds the sinks, at most R-1 recent tokens, G-1 waiting to be pooled and the pooled slots; when it still reaches N
 * slots, the oldest pooled slot is evicted (the lane is then sinks + a window over pooled history + recent). A merged
 * slot covers its G positions for recall. A group some of whose tokens are gone (a document shorter than it) is
 * never pooled. N must be at least S + R + G. Defaults R = N/2, G = 4, S = 4 (StreamingLLM's sinks: without them
 * the first tokens, which most heads attend to, are averaged away, and on SmolLM2 KL grows about tenfold). No
 * metadata.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int group, recent, sinks; } PoolState;

static int pool_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    PoolState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    long g = 4, r = budget / 2 > 1 ? budget / 2 : 1, k = 4;
    if (opt_int(sp, "group", 2, 1 << 20, &g, err, errlen) < 0) return -1;
    int given_r = opt_int(sp, "recent", 1, 1 << 24, &r, err, errlen);
    if (given_r < 0 || opt_int(sp, "sinks", 0, 1 << 24, &k, err, errlen) < 0) return -1;
    st->group = (int)g; st->recent = (int)r; st->sinks = (int)k;
    if (budget < st->sinks + st->recent + st->group) {
        /* with the default recent = N/2 the rule N >= S + N/2 + G holds from N = 2(S + G) - 1 on */
        char fix[96] = "";
        if (!given_r) snprintf(fix, sizeof fix, " (with the default recent=N/2: a budget >= %d, or give recent=)",
                               2 * (st->sinks + st->group) - 1);
        return errorf(err, errlen, "'%s': pool holds sinks=%d, recent=%d tokens, up to group-1=%d waiting to be "
                      "pooled and at least one pooled slot: the budget must be at least sinks + recent + group = %d%s",
                      sp->text, st->sinks, st->recent, st->group - 1, st->sinks + st->recent + st->group, fix);
    }
    return 0;
}

static int pool_merge(KVPolicy *p, int lane, const KVLane *ln, int t, int *first, int *count, int max) {
    PoolState *st = p->state;
    int G = st->group, end = t - st->recent;   /* the newest position outside the recent window after the store */
    if (end - st->sinks < G - 1 || (end - st->sinks + 1) % G) return 0;   /* no group [end-G+1, end] completes */
    /* its tokens sit just before the R-1 recent ones, at ranks n_live-R-G+1 .. n_live-R */
    int r0 = ln->n_live - (st->recent - 1) - G;
    if (r0 < 0 || max < 1) return 0;
    for (int i = 0; i < G; i++)
        if (kv_rank_pos(ln, r0 + i) != end - G + 1 + i || kv_rank_pos0(ln, r0 + i) != kv_rank_pos(ln, r0 + i))
            return 0;
    first[0] = r0;
    count[0] = G;
    return 1;
}

static int pool_evict(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    victims[0] = ((const PoolState *)p->state)->sinks;   /* the sinks are ranks 0..S-1: never pooled or evicted */
    score[0] = 0;
    return 1;
}

static void pool_describe(const KVPolicy *p, char *buf, size_t len) {
    const PoolState *st = p->state;
    snprintf(buf, len, "group=%d recent=%d sinks=%d", st->group, st->recent, st->sinks);
}

static const KVPolicyOps policy_pool = {
    .example = "pool:16,group=2,recent=8",
    .name = "pool", .family = "merging",
    .paper = "mean pooling of adjacent tokens (Compressive Transformers, Rae et al. 2020, arXiv:1911.05507, section 3.1)",
    .summary = "pool:N,group=G,recent=R keeps R recent tokens (and S sinks) and pools older ones G to a slot (mean)",
    .options = "group=G (default 4), recent=R (default N/2), sinks=S (default 4)", .reason = "oldest pooled slot",
    .needs_budget = 1,
    .evicts = 1, .init = pool_init, .merge = pool_merge, .evict = pool_evict, .describe = pool_describe,
};

/* ---------------------------------------------------------------------------------------------------------------
 * topk:B: exact top-k attention, the oracle of the selection family (the bound Quest, Tang et al. 2024,
 * arXiv:2406.10774, §3, and its kin approximate; top-k attention as in Gupta et al. 2021, arXiv:2106.06899): the lane
 * stores every token up to -c like `full`; each query reads the B live keys with the highest exact score, the group
 * mean over the GQA group's query heads of q·k/√head_dim (one set per lane), nothing forced in: not the sinks, not
 * the current token. Ties go to the older token. Bytes read per step count the full score pass (every key) and the B
 * values. No metadata, no state.
 * ------------------------------------------------------------------------------------------------------------- */

/* The k best of n scores (1 <= k <= n) into idx, in increasing index order: best is the highest score, the lower
 * index among equals, a total order, so the set is unique and any exact method finds the same one (topk and quest
 * break their ties this way). One pass keeps the k best seen so far in a heap (in idx) whose root is the worst of
 * them, so a candidate that loses to the root costs one comparison: O(n log k) at worst, about O(n) on real scores;
 * a second pass writes, in index order, the k indices that do not lose to that root (the k-th best). */
static int top_worse(const float *score, int a, int b) {   /* a ranks below b */
    return score[a] < score[b] || (score[a] == score[b] && a > b);
}
static void top_sift(int *heap, int k, int j, const float *score) {
    for (;;) {
        int w = j, a = 2 * j + 1, b = a + 1;
        if (a < k && top_worse(score, heap[a], heap[w])) w = a;
        if (b < k && top_worse(score, heap[b], heap[w])) w = b;
        if (w == j) return;
        int x = heap[j];
        heap[j] = heap[w];
        heap[w] = x;
        j = w;
    }
}
static int top_k(int *idx, const float *score, int n, int k) {
    for (int j = 0; j < k; j++) idx[j] = j;
    for (int j = k / 2 - 1; j >= 0; j--) top_sift(idx, k, j, score);
    for (int i = k; i < n; i++)
        if (top_worse(score, idx[0], i)) { idx[0] = i; top_sift(idx, k, 0, score); }
    int m = 0, kth = idx[0];
    for (int i = 0; i < n && m < k; i++)
        if (!top_worse(score, i, kth)) idx[m++] = i;
    return m;
}

/* top_k's answer by selection rather than a heap, for n scores and room for n ints at idx (its scratch first): the
 * k-th largest score v by Hoare's quickselect over a copy, then, in index order, every index scoring above v and the
 * lowest-index ties at v until k: the same set as top_k's order (higher score, then lower index), in the same
 * order. O(n) on average against top_k's O(n log k) when many scores climb past the root (recent tokens often do).
 * Returns -1, doing nothing useful, when a score is NaN (top_k then decides). */
static int top_k_select(int *idx, const float *score, int n, int k) {
    float *x = (float *)(void *)idx;   /* scratch: idx is malloc'd room for n ints, each slot a float until the end */
    for (int i = 0; i < n; i++) {
        if (score[i] != score[i]) return -1;
        x[i] = score[i];
    }
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {   /* descending */
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) { float t = x[i]; x[i] = x[j]; x[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    float v = x[0];
    for (int i = 1; i < k; i++) v = x[i] < v ? x[i] : v;
    int above = 0;
    for (int i = 0; i < n; i++) above += score[i] > v;
    int m = 0, ties = k - above;
    for (int i = 0; i < n && m < k; i++)
        if (score[i] > v || (score[i] == v && ties-- > 0)) idx[m++] = i;
    return m;
}

static int topk_select(KVPolicy *p, int lane, const KVLane *ln, int t, const float *score, const float *keys,
                       const float *q, int *ranks, int max) {
    int n = ln->n_live, k = p->budget < n ? p->budget : n;
    if (k > max) k = max;
    if (k == n) { for (int i = 0; i < n; i++) ranks[i] = i; return n; }
    if (n <= max) {   /* ranks has room for the scratch */
        int m = top_k_select(ranks, score, n, k);
        if (m >= 0) return m;
    }
    return top_k(ranks, score, n, k);
}

static const KVPolicyOps policy_topk = {
    .example = "topk:16",
    .name = "topk", .family = "selection",
    .paper = "exact top-k attention, the oracle selection methods approximate (Quest, Tang et al. 2024, "
             "arXiv:2406.10774, section 3)",
    .summary = "topk:B stores every token; each query reads the B keys with the highest exact scores (oracle)",
    .options = "", .reason = "none", .needs_budget = 1, .evicts = 0, .grows = 1, .select_scores = 1,
    .select = topk_select, .full_prefix = until_full,
};

/* ---------------------------------------------------------------------------------------------------------------
 * quest:B,page=P: Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
 * arXiv:2406.10774, section 3, query-aware page selection). The lane stores every token up to -c like `full`; its
 * tokens, in rank order, are cut into pages of P consecutive ranks (page j = ranks jP..jP+P-1, the last one partial
 * while it fills). Per page and channel d, the minimum m_d and maximum M_d of its keys as attention sees them; a
 * page's score is Quest's upper bound on the score of any of its keys, Σ_d max(q_d·m_d, q_d·M_d)/√head_dim, taken
 * as the group mean over the GQA group's query heads (rotated as attention rotates them; one set per lane, as topk).
 * A query reads whole pages, floor(B/P) of them (B is rounded down to whole pages; the budget must hold at least two,
 * so that at least one is chosen): always the page holding the newest token (the query's own, partial or not), and
 * of the other pages those with the highest score, ties to the older page; when every page fits, all of them. So a
 * query reads at most B tokens, and fewer while the newest page is partial.
 * How it sees keys: the flag select_keys (kv.h), with which kv_attend_select hands over the live keys decoded and
 * rotated, as attention sees them now, and the bounds are built from them. While those keys cannot change
 * (KVPolicy.keys_fixed: one precision band, and a selection lane never frees a slot, so under pos=cache a rank's
 * rotation is fixed too) a full page's bounds are kept in the state and only the keys of pages not yet bounded are
 * asked for (select_keys_from); otherwise (prec=: a token recoded into a coarser form) every bound is rebuilt at
 * each step from every key. Minimum and maximum are exact, so kept and rebuilt bounds are the same bits. We chose
 * that over bounds built from keys passed on insert because it is correct with nothing more: a key is bounded as
 * attention sees it at the step that reads the bound. The price is simulation memory (2 · head_dim f32 per page
 * and lane) and, with prec=, time (O(n · head_dim) per lane and step), not modelled bytes.
 * Bytes read per step (select_bytes): the bounds of every page it scores, 2 · head_dim f32 each (every page but the
 * newest, which it reads anyway; none when every page fits), plus, counted by kv.c, the keys and values of the
 * pages it reads; the keys handed over to build the bounds are not counted. The bounds are not counted as resident
 * bytes (meta_bytes_per_slot is not told head_dim): they would add 2 · head_dim · 4 / P bytes per token.
 * Scores in f32, d in order, the group's sum in order then divided, as kv_attend_select scores keys for topk. Every
 * layer selects (the paper keeps its first two layers dense). Default P = 16, the paper's page size. No metadata;
 * its state is the kept bounds and scratch for the page scores.
 * ------------------------------------------------------------------------------------------------------------- */

/* The state: the header, then floats (the pages' scores, scratch; each lane's page bounds, page j's minimum then
 * maximum, head_dim each) and ints (the chosen pages, scratch; each lane's count of bounded pages). One block, no
 * pointers (clone copies it as bytes): the functions below find the parts. */
typedef struct { int page, head_dim, group, max_pages, n_lanes; float data[]; } QuestState;
static float *quest_score(QuestState *st) { return st->data; }
static float *quest_bounds(QuestState *st, int lane, int page) {
    return st->data + st->max_pages + ((size_t)lane * st->max_pages + page) * 2 * st->head_dim;
}
static int *quest_chosen(QuestState *st) {
    return (int *)(void *)(st->data + st->max_pages + (size_t)st->n_lanes * st->max_pages * 2 * st->head_dim);
}
static int *quest_bounded(QuestState *st) { return quest_chosen(st) + st->max_pages; }

static int quest_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    long P = 16;
    if (opt_int(sp, "page", 1, 1 << 20, &P, err, errlen) < 0) return -1;
    int cap = shape->seq_len > budget ? shape->seq_len : budget, max_pages = (int)((cap + P - 1) / P);
    size_t floats = (size_t)max_pages * (1 + (size_t)p->n_lanes * 2 * shape->head_dim);
    QuestState *st = state_new(p, sizeof *st + floats * sizeof(float) + ((size_t)max_pages + p->n_lanes) * sizeof(int));
    if (!st) return errorf(err, errlen, "out of memory");
    st->page = (int)P;
    st->head_dim = shape->head_dim;
    st->group = shape->n_heads / shape->n_kv_heads;
    st->max_pages = max_pages;
    st->n_lanes = p->n_lanes;
    if (budget >= 2 * P) return 0;
    char fix[48] = "";
    if (budget >= 2) snprintf(fix, sizeof fix, ", or page <= %d", budget / 2);
    return errorf(err, errlen, "'%s': quest reads whole pages, budget/page of them rounded down, always the newest "
                  "page (page=%ld tokens, the current one among them), which leaves no page to choose in a budget of "
                  "%d: the budget must hold at least two pages (a budget >= %ld%s)", sp->text, P, budget, 2 * P, fix);
}

static void quest_reset(KVPolicy *p) {
    QuestState *st = p->state;
    memset(quest_bounded(st), 0, (size_t)st->n_lanes * sizeof(int));
}

/* The first rank whose key select needs: that of the first page not bounded yet, or 0 when keys can change. */
static int quest_keys_from(const KVPolicy *p, int lane, const KVLane *ln) {
    QuestState *st = p->state;
    return p->keys_fixed ? quest_bounded(st)[lane] * st->page : 0;
}

static int quest_select(KVPolicy *p, int lane, const KVLane *ln, int t, const float *score, const float *keys,
                        const float *q, int *ranks, int max) {
    QuestState *st = p->state;
    int n = ln->n_live, P = st->page, hd = st->head_dim, group = st->group;
    int n_pages = (n + P - 1) / P, n_read = p->budget / P;
    if (n_pages <= n_read) { for (int i = 0; i < n; i++) ranks[i] = i; return n; }
    /* the bounds of every full page but the newest: those not kept yet (every one when keys can change) */
    int *bounded = &quest_bounded(st)[lane];
    for (int j = p->keys_fixed ? *bounded : 0; j < n_pages - 1; j++) {
        const float *k = keys + (size_t)j * P * hd;
        float *lo = quest_bounds(st, lane, j), *hi = lo + hd;
        for (int d = 0; d < hd; d++) lo[d] = hi[d] = k[d];
        for (int i = 1; i < P; i++)
            for (int d = 0; d < hd; d++) {
                float x = k[(size_t)i * hd + d];
                lo[d] = x < lo[d] ? x : lo[d];
                hi[d] = x > hi[d] ? x : hi[d];
            }
    }
    if (p->keys_fixed) *bounded = n_pages - 1;
    float scale = 1.0f / sqrtf((float)hd), *page_score = quest_score(st);
    for (int j = 0; j < n_pages - 1; j++) {   /* each page's score: the group mean of its bound */
        const float *lo = quest_bounds(st, lane, j), *hi = lo + hd;
        float sum = 0;
        for (int hh = 0; hh < group; hh++) {
            const float *qh = q + (size_t)hh * hd;
            float dot = 0;
            for (int d = 0; d < hd; d++) {
                float a = qh[d] * lo[d], b = qh[d] * hi[d];
                dot += a > b ? a : b;
            }
            sum += dot * scale;
        }
        page_score[j] = sum / group;
    }
    int *chosen = quest_chosen(st), n_chosen = top_k(chosen, page_score, n_pages - 1, n_read - 1), m = 0;
    for (int j = 0; j < n_chosen; j++)   /* the chosen pages in rank order, then the newest */
        for (int i = chosen[j] * P; i < (chosen[j] + 1) * P && m < max; i++) ranks[m++] = i;
    for (int i = (n_pages - 1) * P; i < n && m < max; i++) ranks[m++] = i;
    return m;
}

static uint64_t quest_select_bytes(const KVPolicy *p, int lane, const KVLane *ln, int t) {
    const QuestState *st = p->state;
    int n_pages = (ln->n_live + st->page - 1) / st->page;
    if (n_pages <= p->budget / st->page) return 0;
    return (uint64_t)(n_pages - 1) * 2 * (uint64_t)st->head_dim * sizeof(float);
}

static uint64_t quest_select_scanned(const KVPolicy *p, int lane, const KVLane *ln, int t) {
    const QuestState *st = p->state;
    int n_pages = (ln->n_live + st->page - 1) / st->page;
    return n_pages <= p->budget / st->page ? 0 : (uint64_t)(n_pages - 1);   /* one bound scored per page */
}

static void quest_describe(const KVPolicy *p, char *buf, size_t len) {
    const QuestState *st = p->state;
    snprintf(buf, len, "page=%d pages=%d", st->page, p->budget / st->page);
}

static const KVPolicyOps policy_quest = {
    .example = "quest:16,page=4",
    .name = "quest", .family = "selection",
    .paper = "Quest: Tang et al. 2024, arXiv:2406.10774, section 3",
    .summary = "quest:B,page=P stores every token; each query reads its own page + the pages of highest key-bound "
               "score, B/P pages (Quest)",
    .options = "page=P (default 16; B/P whole pages are read, at least 2)", .reason = "none", .needs_budget = 1,
    .evicts = 0, .grows = 1, .select_keys = 1, .init = quest_init, .reset = quest_reset,
    .select_keys_from = quest_keys_from, .select = quest_select, .select_bytes = quest_select_bytes,
    .select_scanned = quest_select_scanned, .describe = quest_describe, .full_prefix = until_full,
};

/* ---------------------------------------------------------------------------------------------------------------
 * blocks:B,local=L,global=G,stride=S: a static block-sparse read pattern, the same for every query whatever the
 * scores: Longformer's sliding window with global tokens and strided (dilated) attention (Beltagy et al. 2020,
 * arXiv:2004.05150, section 3.1), here with the global tokens the first G positions, and with no strided part
 * (stride past the context) the A-shape of sink + local (MInference's name, Jiang et al. 2024, arXiv:2407.02490;
 * StreamingLLM's sinks and window, Xiao et al. 2023, as a read pattern over a full cache). The lane stores every
 * token up to -c; the query at position t reads
 *   global   the first G positions (p < G, the sinks),
 *   local    the L newest (p > t - L, itself included),
 *   strided  between them every S-th position: G <= p <= t - L with p % S == 0,
 * their union (global and local overlap while t < G + L), capped at B: only the strided part is ever cut, its
 * oldest first (the newest strided positions stay). The strided positions are fixed in absolute terms (p % S == 0,
 * as the "fixed" pattern of Child et al. 2019, arXiv:1904.10509, section 4.3, rather than Longformer's gaps counted
 * from the query), so a token past the local window is read at every step or never. It is a pattern, not a choice:
 * it may read fewer than B tokens even while fewer than B are stored (topk reads them all then). The budget must
 * exceed G + L by at least one (a strided slot). Defaults: G = 4, L = B/2, and S the smallest stride whose strided
 * positions at the last position of the context (t = -c - 1) fit in B - G - L, so that with the default the cap never
 * cuts (with stride=S given, the cap does the cutting). Positions define the pattern (a lane that holds every token
 * has rank = position). Bytes read: the keys and values of the set (kv.c). No metadata.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int local, global, stride; } BlocksState;

/* multiples of S in [lo, hi], lo >= 0 */
static int multiples_in(int lo, int hi, int S) { return hi < lo ? 0 : hi / S - (lo + S - 1) / S + 1; }

static int blocks_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    BlocksState *st = state_new(p, sizeof *st);
    if (!st) return errorf(err, errlen, "out of memory");
    long G = 4, L = budget / 2 > 1 ? budget / 2 : 1, S = 0;
    if (opt_int(sp, "global", 0, 1 << 24, &G, err, errlen) < 0) return -1;
    int given_l = opt_int(sp, "local", 1, 1 << 24, &L, err, errlen);
    if (given_l < 0 || opt_int(sp, "stride", 1, 1 << 30, &S, err, errlen) < 0) return -1;
    st->global = (int)G; st->local = (int)L;
    if (!given_l && budget <= st->global + st->local) {   /* the default local = B/2 grows with the budget */
        char fix[48] = "local=";
        if (budget - st->global - 1 >= 1) snprintf(fix, sizeof fix, "local <= %d", budget - st->global - 1);
        return errorf(err, errlen, "'%s': blocks always reads global=%d and local=%d tokens (the default local=B/2), "
                      "which leaves no strided slot in a budget of %d: use a budget >= %d, or give %s", sp->text,
                      st->global, st->local, budget, 2 * st->global + 1, fix);
    }
    char what[64], fix[48];
    snprintf(what, sizeof what, "global=%d and local=%d", st->global, st->local);
    snprintf(fix, sizeof fix, "local <= %d", budget - st->global - 1);
    if (check_budget(sp, "blocks", budget, st->global + st->local, what, budget - st->global - 1 >= 1 ? fix : "",
                     err, errlen))
        return -1;
    if (!S) {   /* the smallest stride whose strided positions at t = seq_len - 1 fit beside global and local */
        int room = budget - st->global - st->local, hi = shape->seq_len - 1 - st->local;
        for (S = 1; multiples_in(st->global, hi, (int)S) > room; S++) {}
    }
    st->stride = (int)S;
    return 0;
}

static int blocks_select(KVPolicy *p, int lane, const KVLane *ln, int t, const float *score, const float *keys,
                         const float *q, int *ranks, int max) {
    const BlocksState *st = p->state;
    int n = ln->n_live, G = st->global, L = st->local, S = st->stride, n_fixed = 0, n_strided = 0;
    for (int i = 0; i < n; i++) {
        int pos = kv_rank_pos(ln, i);
        if (pos < G || pos > t - L) n_fixed++;
        else if (pos % S == 0) n_strided++;
    }
    int skip = n_strided - (p->budget - n_fixed), m = 0;   /* strided positions over the cap, cut oldest first */
    for (int i = 0; i < n && m < max; i++) {
        int pos = kv_rank_pos(ln, i);
        if (pos < G || pos > t - L) ranks[m++] = i;
        else if (pos % S == 0) {
            if (skip > 0) skip--;
            else ranks[m++] = i;
        }
    }
    return m;
}

static void blocks_describe(const KVPolicy *p, char *buf, size_t len) {
    const BlocksState *st = p->state;
    snprintf(buf, len, "local=%d global=%d stride=%d", st->local, st->global, st->stride);
}

static const KVPolicyOps policy_blocks = {
    .example = "blocks:16,global=4,local=8,stride=8",
    .name = "blocks", .family = "selection",
    .paper = "static block-sparse patterns: Longformer, Beltagy et al. 2020, arXiv:2004.05150, section 3.1 (sliding "
             "window, strided, global); the A-shape (sink + local) of MInference, Jiang et al. 2024, arXiv:2407.02490",
    .summary = "blocks:B stores every token; each query reads the first G, the L newest and every S-th position "
               "between, at most B (strided cut oldest first)",
    .options = "local=L (default B/2), global=G (default 4), stride=S (default: the smallest that fits B-G-L at -c)",
    .reason = "none", .needs_budget = 1, .evicts = 0, .grows = 1, .init = blocks_init, .select = blocks_select,
    .describe = blocks_describe,
};

/* ---------------------------------------------------------------------------------------------------------------
 * cluster:B,k=K,sinks=S,local=W: retrieval by the nearest key clusters, after RetrievalAttention (Liu et al. 2024,
 * arXiv:2409.10516: the first tokens and a recent window are always attended, the other keys are searched through an
 * index by the query) and ClusterKV (Liu et al. 2024, arXiv:2412.03213: keys grouped by k-means, clusters ranked by
 * the query's score against their centroids and read whole until the budget). The lane stores every token up to -c
 * like `full`; the query at position t reads
 *   static    the first S positions and the W newest (p > t - W, itself included),
 *   clusters  the other keys, grouped by k-means: clusters ranked by the group mean over the GQA group's query heads
 *             of q·c/√head_dim against their centroid c (the queries rotated as attention rotates them; one set per
 *             lane, as quest ranks pages), highest first, ties to the older cluster (the lower id), read whole until
 *             B keys are read in all; the first cluster that does not fit is cut to its newest members (recency is
 *             the prior the static part already uses), so a query reads exactly B keys once the lane holds more than
 *             B, and every key before.
 * The clustering, online k-means (MacQueen 1967): a key joins it once, when it leaves the local window (at step t the
 * key at position t - W; the sinks never), as attention sees it then (select_keys: decoded from its band, rotated).
 * The first K keys to join each found a cluster, the key its centroid; each later key joins the centroid nearest in
 * squared L2 distance (ties: the older cluster), whose centroid becomes the mean of its members. Members never move
 * (no Lloyd iterations), so the index grows by one key per step, as a stream needs. L2 rather than an inner product:
 * the centroid of L2 k-means is its members' mean, so q·c is exactly the mean of their scores (the dot product is
 * linear) and the ranking orders clusters by the mean score of their keys; assigning by the largest k·c is no
 * distance (a centroid of large norm draws keys far from it), and ClusterKV's cosine assignment ignores the key norms
 * that scores depend on. Each cluster's sum is kept in double and its centroid is the f32 rounding of sum/count, the
 * members' mean rounded once whatever their number (an f32 running mean c += (k - c)/n drifts by up to n roundings);
 * distances are summed in double from the f32 key and centroid, d in order; scores in f32, d in order, the group's
 * sum in order then divided, as quest. No randomness, no threads: the index after step t is a function of the keys.
 * A key recoded later by prec= stays in its cluster's sum as it was when it joined.
 * Select advances the clustering itself: whoever calls select first at a step assigns the ranks not yet assigned, in
 * rank order, exactly once (a slot's cluster is its metadata), so a second call at the same step, with the same query
 * or another (a tier's prefetch with a predicted query), changes no state, and every later call returns what it
 * would have returned without it.
 * What differs from the papers: they cluster the prompt's keys in one batch (ClusterKV: k-means with iterations after
 * the prefill; RetrievalAttention: an approximate nearest-neighbour index over them that adapts to the queries'
 * distribution) and handle the tokens generated after it apart; here one online rule covers prompt and generation
 * alike (ppl has no prompt), and every layer selects (ClusterKV keeps its first two layers dense). Defaults: S = 4
 * (StreamingLLM's sinks), W = B/4 (at least 1), K = B/4 (at least 1): the centroids a query scores then cost an
 * eighth of the keys and values it reads (K·head_dim·4 against 2·B·head_dim·4 bytes in f32). The budget must exceed
 * S + W by one, a slot for the clusters.
 * Bytes read per step (select_bytes): the centroids scored, head_dim f32 each (the lane's clusters, at most K; none
 * while every key fits), plus, counted by kv.c, the keys and values of the read set; the cluster counts and member
 * lists an index would also read (4 bytes per cluster and per token read) are not counted. Resident bytes: the int32
 * metadata of each slot (0: not clustered, the sinks and the local window; else 1 + its cluster), counted by kv.c;
 * the centroids (K·head_dim f32 per lane) and their double sums live in the policy state, an index not counted in
 * resident bytes, as quest's bounds are not.
 * ------------------------------------------------------------------------------------------------------------- */

#define CLUSTER_MAX_K 4096   /* the state holds K·head_dim·12 bytes per lane: 270 MiB for SmolLM2's 90 lanes */

typedef struct { float score; int id; } ClusterCand;
/* The state, one block: this header, then per lane (lane_bytes each) sum (k, head_dim) double, cen (k, head_dim)
 * f32, count (k) int32 and the number of clusters; then scratch for one select: cand (k), take (k) int. */
typedef struct {
    int k, sinks, local, head_dim, group, n_lanes;
    size_t lane_bytes;
    double data[];
} ClusterState;

static size_t cluster_lane_bytes(int k, int hd) {
    size_t b = (size_t)k * hd * (sizeof(double) + sizeof(float)) + ((size_t)k + 1) * sizeof(int32_t);
    return (b + sizeof(double) - 1) / sizeof(double) * sizeof(double);
}
static uint8_t *cluster_lane(ClusterState *st, int lane) { return (uint8_t *)st->data + (size_t)lane * st->lane_bytes; }
static double *cluster_sum(ClusterState *st, int lane) { return (double *)(void *)cluster_lane(st, lane); }
static float *cluster_cen(ClusterState *st, int lane) {
    return (float *)(void *)(cluster_lane(st, lane) + (size_t)st->k * st->head_dim * sizeof(double));
}
static int32_t *cluster_count(ClusterState *st, int lane) {   /* (k), then the number of clusters */
    return (int32_t *)(void *)(cluster_cen(st, lane) + (size_t)st->k * st->head_dim);
}
static ClusterCand *cluster_cand(ClusterState *st) {
    return (ClusterCand *)(void *)cluster_lane(st, st->n_lanes);
}
static int *cluster_take(ClusterState *st) { return (int *)(cluster_cand(st) + st->k); }

static int cluster_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    long K = budget / 4 > 1 ? budget / 4 : 1, S = 4, W = budget / 4 > 1 ? budget / 4 : 1;
    if (opt_int(sp, "k", 1, CLUSTER_MAX_K, &K, err, errlen) < 0) return -1;
    if (opt_int(sp, "sinks", 0, 1 << 24, &S, err, errlen) < 0) return -1;
    int given_w = opt_int(sp, "local", 1, 1 << 24, &W, err, errlen);
    if (given_w < 0) return -1;
    size_t lb = cluster_lane_bytes((int)K, shape->head_dim);
    ClusterState *st = state_new(p, sizeof *st + lb * p->n_lanes + (size_t)K * (sizeof(ClusterCand) + sizeof(int)));
    if (!st) return errorf(err, errlen, "out of memory for the cluster index of '%s' (k=%ld)", sp->text, K);
    st->k = (int)K; st->sinks = (int)S; st->local = (int)W;
    st->head_dim = shape->head_dim;
    st->group = shape->n_heads / shape->n_kv_heads;
    st->n_lanes = p->n_lanes;
    st->lane_bytes = lb;
    if (!given_w && budget <= st->sinks + st->local) {   /* the default local = B/4 grows with the budget */
        int b = 1;
        while (b - (b / 4 > 1 ? b / 4 : 1) <= st->sinks) b++;
        char fix[48];
        if (budget - st->sinks - 1 >= 1) snprintf(fix, sizeof fix, "give local <= %d", budget - st->sinks - 1);
        else snprintf(fix, sizeof fix, "fewer sinks (local=1 and sinks <= %d)", budget - 2 >= 0 ? budget - 2 : 0);
        return errorf(err, errlen, "'%s': cluster always reads sinks=%d and local=%d tokens (the default local=B/4), "
                      "which leaves no slot for a cluster in a budget of %d: use a budget >= %d, or %s", sp->text,
                      st->sinks, st->local, budget, b, fix);
    }
    char what[64], fix[48];
    snprintf(what, sizeof what, "sinks=%d and local=%d", st->sinks, st->local);
    snprintf(fix, sizeof fix, "local <= %d", budget - st->sinks - 1);
    return check_budget(sp, "cluster", budget, st->sinks + st->local, what, budget - st->sinks - 1 >= 1 ? fix : "",
                        err, errlen);
}

static void cluster_reset(KVPolicy *p) {
    ClusterState *st = p->state;
    memset(st->data, 0, st->lane_bytes * st->n_lanes);
}

/* The key k (head_dim) joins lane's clustering: a new cluster while fewer than K exist, else the nearest centroid
 * (squared L2, double, d in order; ties to the older cluster). Returns the cluster. */
static int cluster_assign(ClusterState *st, int lane, const float *k) {
    int hd = st->head_dim, c = 0;
    double *sum = cluster_sum(st, lane);
    float *cen = cluster_cen(st, lane);
    int32_t *count = cluster_count(st, lane), *n = count + st->k;
    if (*n < st->k) c = (*n)++;
    else {
        double best = INFINITY;
        for (int j = 0; j < st->k; j++) {
            const float *cj = cen + (size_t)j * hd;
            double d2 = 0;
            for (int d = 0; d < hd; d++) {
                double x = (double)k[d] - (double)cj[d];
                d2 += x * x;
            }
            if (d2 < best) { best = d2; c = j; }
        }
    }
    count[c]++;
    for (int d = 0; d < hd; d++) {
        sum[(size_t)c * hd + d] += k[d];
        cen[(size_t)c * hd + d] = (float)(sum[(size_t)c * hd + d] / count[c]);
    }
    return c;
}

static int cluster_cmp(const void *a, const void *b) {
    const ClusterCand *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;   /* highest score first ... */
    return x->id - y->id;                                             /* ... and among equals the older cluster */
}

static int cluster_select(KVPolicy *p, int lane, const KVLane *ln, int t, const float *score, const float *keys,
                          const float *q, int *ranks, int max) {
    ClusterState *st = p->state;
    int n = ln->n_live, hd = st->head_dim, S = st->sinks, W = st->local, n_static = 0;
    /* the keys that left the local window join the clustering, in rank order, once (metadata 0: not yet) */
    for (int i = 0; i < n; i++) {
        int pos = kv_rank_pos(ln, i);
        if (pos < S || pos > t - W) { n_static++; continue; }
        int32_t id;
        memcpy(&id, kv_rank_meta(ln, i, 4), 4);
        if (id) continue;
        id = 1 + cluster_assign(st, lane, keys + (size_t)i * hd);
        memcpy(kv_rank_meta(ln, i, 4), &id, 4);
    }
    if (n <= p->budget) { for (int i = 0; i < n; i++) ranks[i] = i; return n; }
    /* rank the clusters by their group-mean score; take whole ones, the first that does not fit cut */
    int nc = cluster_count(st, lane)[st->k], room = p->budget - n_static, *take = cluster_take(st);
    const int32_t *count = cluster_count(st, lane);
    const float *cen = cluster_cen(st, lane);
    ClusterCand *cand = cluster_cand(st);
    float scale = 1.0f / sqrtf((float)hd);
    for (int j = 0; j < nc; j++) {
        float sum = 0;
        for (int hh = 0; hh < st->group; hh++) {
            const float *qh = q + (size_t)hh * hd, *c = cen + (size_t)j * hd;
            float dot = 0;
            for (int d = 0; d < hd; d++) dot += qh[d] * c[d];
            sum += dot * scale;
        }
        cand[j] = (ClusterCand){sum / st->group, j};
        take[j] = 0;
    }
    qsort(cand, (size_t)nc, sizeof *cand, cluster_cmp);
    for (int j = 0; j < nc && room > 0; j++) {
        int id = cand[j].id;
        take[id] = count[id] < room ? count[id] : room;
        room -= take[id];
    }
    /* newest first, so a cut cluster keeps its newest members; then back to increasing rank order */
    int m = 0;
    for (int i = n - 1; i >= 0 && m < max; i--) {
        int pos = kv_rank_pos(ln, i);
        int32_t id;
        memcpy(&id, kv_rank_meta(ln, i, 4), 4);
        if (pos < S || pos > t - W) ranks[m++] = i;
        else if (id && take[id - 1] > 0) { take[id - 1]--; ranks[m++] = i; }
    }
    for (int a = 0, b = m - 1; a < b; a++, b--) { int x = ranks[a]; ranks[a] = ranks[b]; ranks[b] = x; }
    return m;
}

static uint64_t cluster_select_bytes(const KVPolicy *p, int lane, const KVLane *ln, int t) {
    ClusterState *st = p->state;
    if (ln->n_live <= p->budget) return 0;
    return (uint64_t)cluster_count(st, lane)[st->k] * (uint64_t)st->head_dim * sizeof(float);
}

static uint64_t cluster_select_scanned(const KVPolicy *p, int lane, const KVLane *ln, int t) {
    ClusterState *st = p->state;
    return ln->n_live <= p->budget ? 0 : (uint64_t)cluster_count(st, lane)[st->k];   /* one score per centroid */
}

static void cluster_describe(const KVPolicy *p, char *buf, size_t len) {
    const ClusterState *st = p->state;
    snprintf(buf, len, "k=%d sinks=%d local=%d", st->k, st->sinks, st->local);
}

static const KVPolicyOps policy_cluster = {
    .example = "cluster:16,k=4",
    .name = "cluster", .family = "selection",
    .paper = "retrieval by key clusters: RetrievalAttention, Liu et al. 2024, arXiv:2409.10516; ClusterKV, Liu et al. "
             "2024, arXiv:2412.03213 (here online k-means, MacQueen 1967)",
    .summary = "cluster:B,k=K stores every token; each query reads S sinks, the W newest and the k-means key clusters "
               "of highest centroid score, B in all",
    .options = "k=K (default B/4), sinks=S (default 4), local=W (default B/4)", .reason = "none", .needs_budget = 1,
    .evicts = 0, .grows = 1, .select_keys = 1, .init = cluster_init, .reset = cluster_reset,
    .meta_bytes_per_slot = meta_4, .select = cluster_select, .select_bytes = cluster_select_bytes,
    .select_scanned = cluster_select_scanned,
    .describe = cluster_describe,
};

/* ---------------------------------------------------------------------------------------------------------------
 * The registry
 * ------------------------------------------------------------------------------------------------------------- */

static const KVPolicyOps *const registry[] = {&policy_full, &policy_window, &policy_sink, &policy_h2o, &policy_tova,
                                              &policy_scissorhands, &policy_lru, &policy_random, &policy_snapkv,
                                              &policy_pool, &policy_topk, &policy_quest,
                                              &policy_blocks, &policy_cluster, &policy_duo};
#define N_POLICIES (int)(sizeof registry / sizeof registry[0])

const KVPolicyOps *kv_policy_find(const char *name) {
    for (int i = 0; i < N_POLICIES; i++) if (!strcmp(registry[i]->name, name)) return registry[i];
    return NULL;
}

const KVPolicyOps *kv_policy_at(int i) { return i >= 0 && i < N_POLICIES ? registry[i] : NULL; }

const char *kv_policy_names(void) {
    static char names[256];
    if (!names[0])
        for (int i = 0; i < N_POLICIES; i++) {
            if (i) strcat(names, ", ");
            strcat(names, registry[i]->name);
        }
    return names;
}
