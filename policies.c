/* policies.c: the KV-cache policies, one section each, registered in one table at the end.
 * A policy only chooses victims and keeps its own per-slot state; storage, attention and accounting are kv.c's.
 * It deliberately knows nothing of the model or of the device the attention runs on.
 *
 * HOW TO ADD A POLICY: write a section below with a KVPolicyOps table (kv.h says what each callback is told and
 * when), cite the paper and section it implements, read its own keys with kv_spec_get in init (an unread key is an
 * error), check that the budget exceeds what it protects by at least one slot, and add it to `registry` at the end.
 * Nothing outside this file changes.
 *
 * Dimensions: budget (slots per lane), n_lanes (n_layers * n_kv_heads). Indices: s slot, i rank in a lane's live list
 * (live slots in increasing position order), t position.
 */
#include "kv.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static int perr(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* An integer option; 0 = absent (def), 1 = set, -1 = bad (message written). */
static int opt_int(KVSpec *sp, const char *key, int lo, int hi, int *out, char *err, size_t errlen) {
    const char *v = kv_spec_get(sp, key);
    if (!v) return 0;
    char *end;
    long x = strtol(v, &end, 10);
    if (end == v || *end || x < lo || x > hi)
        return perr(err, errlen, "bad %s=%s in '%s': an integer in [%d, %d]", key, v, sp->text, lo, hi);
    *out = (int)x;
    return 1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * full: never evicts. The lane holds the whole context (-c); past it the cache is full and generation stops.
 * ------------------------------------------------------------------------------------------------------------- */

static const KVPolicyOps policy_full = {
    .name = "full", .summary = "never evict; budget = the context (-c)", .needs_budget = 0, .evicts = 0,
};

/* ---------------------------------------------------------------------------------------------------------------
 * window:W: the W most recent tokens, the current one included (the sliding window of Longformer, Beltagy et al.
 * 2020, §3.1, applied to the cache). Victim: the oldest live token.
 * ------------------------------------------------------------------------------------------------------------- */

static int window_victims(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    victims[0] = ln->live[0];
    score[0] = 0;
    return 1;
}

static const KVPolicyOps policy_window = {
    .name = "window", .summary = "window:W keeps the W most recent tokens", .needs_budget = 1, .evicts = 1,
    .victims = window_victims,
};

/* ---------------------------------------------------------------------------------------------------------------
 * sink:N,sinks=S: StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", §3.2):
 * the S first tokens (attention sinks) and the N-S most recent. Victim: the oldest token that is not a sink. Sinks
 * are never evicted, so they are always live[0..S-1].
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { int sinks; } SinkState;

static int sink_init(KVPolicy *p, KVSpec *sp, const KVShape *shape, int budget, char *err, size_t errlen) {
    SinkState *st = calloc(1, sizeof *st);
    if (!st) return perr(err, errlen, "out of memory");
    p->state = st;
    st->sinks = 4;
    if (opt_int(sp, "sinks", 0, 1 << 20, &st->sinks, err, errlen) < 0) return -1;
    if (budget < st->sinks + 2)
        return perr(err, errlen, "'%s': budget %d must exceed sinks=%d plus the current token by at least one slot "
                    "(budget >= %d)", sp->text, budget, st->sinks, st->sinks + 2);
    return 0;
}

static void state_free(KVPolicy *p) { free(p->state); p->state = NULL; }

static int sink_victims(KVPolicy *p, int lane, const KVLane *ln, int t, int *victims, int max, double *score) {
    SinkState *st = p->state;
    victims[0] = ln->live[st->sinks];
    score[0] = 0;
    return 1;
}

static const KVPolicyOps policy_sink = {
    .name = "sink", .summary = "sink:N,sinks=S keeps S attention sinks + the N-S most recent (StreamingLLM)",
    .needs_budget = 1, .evicts = 1, .init = sink_init, .free = state_free, .victims = sink_victims,
};

/* ---------------------------------------------------------------------------------------------------------------
 * The registry
 * ------------------------------------------------------------------------------------------------------------- */

static const KVPolicyOps *const registry[] = {&policy_full, &policy_window, &policy_sink};
#define N_POLICIES (int)(sizeof registry / sizeof registry[0])

const KVPolicyOps *kv_policy_find(const char *name) {
    for (int i = 0; i < N_POLICIES; i++) if (!strcmp(registry[i]->name, name)) return registry[i];
    return NULL;
}

const char *kv_policy_names(void) {
    static char names[256];
    if (!names[0])
        for (int i = 0; i < N_POLICIES; i++) {
            if (i) strcat(names, ", ");
            strcat(names, registry[i]->name);
        }
    return names;
}
