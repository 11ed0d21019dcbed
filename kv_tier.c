/* kv_tier.c: two memory tiers under one cache (fast=BYTES, prefetch=1): which slots sit in the fast tier, what a
 * step moves into it, what a prefetch moved ahead and whether the step then read it.
 *
 * The model (docs/DESIGN.md, Memory tiers). Every token's key and value have their home in the slow tier (host
 * memory behind a link of -link GB/s): they are written there once when stored, off the critical path, so leaving
 * the fast tier costs nothing. The fast tier (device memory) holds copies of some slots, at most `lane_cap` vector
 * bytes per lane (fast= split evenly over the lanes: each lane is one kv head of one layer and is read by its own
 * queries only, so a shared tier would only let one layer's misses push out another's working set). A step's
 * attention reads its set S of slots (every live slot, or a selection policy's choice) from the fast tier; the
 * slots of S that are not there are moved in first (demand bytes: the step waits for them), and the fast tier then
 * drops what it ranks lowest: the least recently read slot (LRU), where the slots of one read count in rank order
 * (older first). A new token is computed in the fast tier and enters it as the most recent.
 * So that a read never pushes out a slot it is about to read, S's resident slots are marked most recent first, then
 * its missing ones are moved in, in rank order; a set larger than the tier streams through it (its oldest slots
 * leave again before the step ends).
 *
 * Prefetch (prefetch=1, InfiniGen in spirit: Lee et al. 2024, arXiv:2406.19707, section 4.3): while layer l-1
 * computes, the forward pass predicts layer l's query from layer l-1's input (run.c: layer l's query projection
 * applied to it, as InfiniGen uses the similarity of consecutive layers' inputs) and hands it to kv_prefetch, which
 * asks the policy what that query would read (select, or every live slot) and moves the missing slots in ahead:
 * those bytes overlap with compute, so they are counted apart from demand bytes; a prefetched slot that the step
 * reads is a prefetch hit, one that leaves the fast tier unread was wasted. Layer 0 has no earlier layer: its tier
 * keeps the previous step's set (LRU), which is what predicting the next step from this step's query gives.
 *
 * The data never move in memory (one address space on the CPU): this file keeps the bookkeeping, the bytes moved
 * and the hit counts, and the modelled stall time comes from them (eval.c, run.c). On a GPU the slow tier would be
 * pinned host memory and the moves cudaMemcpyAsync on a second stream; the CUDA mirror refuses tiers for now
 * (attn.cu).
 *
 * Per lane: state[slot] (0 slow only, 1 also in the fast tier, 2 there by a prefetch and not read since), the fast
 * tier's recency list through prev/next (head the least recent), its bytes. Indices: s slot, i rank.
 */
#include "kv.h"
#include "kv_impl.h"
#include "util.h"

#include <stdlib.h>

enum { SLOW = 0, FAST = 1, PREFETCHED = 2 };

struct KVTierLane {
    uint8_t *state;   /* (cap) SLOW, FAST or PREFETCHED */
    int *prev, *next; /* (cap) the recency list of the fast tier's slots, least recent first */
    int head, tail;   /* -1: the fast tier holds nothing of this lane */
    int *miss;        /* (budget) scratch of a use: the slots it missed (lane 0's only, shared) */
    size_t bytes;     /* vector bytes of this lane in the fast tier */
};

static size_t slot_bytes(const KVCache *c, const KVLane *ln, int s) {
    int b = kv_slot_band(ln, s);
    return c->band_kb[b] + c->band_vb[b];
}

static void unlink_slot(KVTierLane *tl, int s) {
    int p = tl->prev[s], n = tl->next[s];
    if (p >= 0) tl->next[p] = n; else tl->head = n;
    if (n >= 0) tl->prev[n] = p; else tl->tail = p;
}

static void push_recent(KVTierLane *tl, int s) {
    tl->prev[s] = tl->tail;
    tl->next[s] = -1;
    if (tl->tail >= 0) tl->next[tl->tail] = s; else tl->head = s;
    tl->tail = s;
}

/* The lane's fast-tier bytes change (room was made first, so the tier stays within its share at every moment). */
static void add_bytes(KVCache *c, KVTierLane *tl, size_t add, size_t sub) {
    tl->bytes = tl->bytes + add - sub;
    c->tier.fast_bytes = c->tier.fast_bytes + add - sub;
    if (c->tier.fast_bytes > c->tier.fast_peak) c->tier.fast_peak = c->tier.fast_bytes;
}

/* Leave the fast tier: slot s's copy is dropped (its home in the slow tier stays). */
static void drop(KVCache *c, const KVLane *ln, KVTierLane *tl, int s) {
    size_t b = slot_bytes(c, ln, s);
    if (tl->state[s] == PREFETCHED) c->tier.wasted_bytes += b;
    unlink_slot(tl, s);
    tl->state[s] = SLOW;
    add_bytes(c, tl, 0, b);
}

/* Drop least recent slots until `need` more bytes fit in the lane's share. */
static void make_room(KVCache *c, const KVLane *ln, KVTierLane *tl, size_t need) {
    while (tl->bytes + need > c->tier.lane_cap && tl->head >= 0) drop(c, ln, tl, tl->head);
}

/* Slot s into the fast tier as the most recent (its bytes moved in, counted by the caller). kv_tier_init made every
 * share hold at least one slot of any band, so it fits once the others left. */
static void enter(KVCache *c, const KVLane *ln, KVTierLane *tl, int s, int state) {
    size_t b = slot_bytes(c, ln, s);
    make_room(c, ln, tl, b);
    tl->state[s] = (uint8_t)state;
    push_recent(tl, s);
    add_bytes(c, tl, b, 0);
}

int kv_tier_init(KVCache *c, char *err, size_t errlen) {
    const KVSpec *sp = &c->spec;
    if (!sp->fast_bytes && sp->fast_frac <= 0) {
        if (sp->prefetch) return errorf(err, errlen, "prefetch=1 in '%s' needs a fast tier (fast=BYTES)", sp->text);
        return 0;
    }
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads;
    size_t vec = 0, slot_max = 0;
    for (int i = 0; i < n_lanes; i++)   /* the lanes' vector bytes, as kv_bytes counts them (kv.c) */
        for (int b = 0; b < c->n_bands; b++)
            vec += (size_t)c->lanes[i].band_slots[b] * (c->band_kb[b] + c->band_vb[b]);
    for (int b = 0; b < c->n_bands; b++)
        if (c->band_kb[b] + c->band_vb[b] > slot_max) slot_max = c->band_kb[b] + c->band_vb[b];
    size_t cap = sp->fast_bytes ? sp->fast_bytes : (size_t)(sp->fast_frac * (double)vec);
    if (cap > vec)
        return errorf(err, errlen, "fast=%s in '%s' is %zu B, more than the cache's %zu B of vectors: every slot "
                      "would fit in the fast tier (fast=100%% is the largest)", sp->fast_text, sp->text, cap, vec);
    if (cap / (size_t)n_lanes < slot_max)
        return errorf(err, errlen, "fast=%s in '%s' is %zu B, less than one slot (%zu B of key and value) for each "
                      "of the %d lanes (%zu B)", sp->fast_text, sp->text, cap, slot_max, n_lanes,
                      slot_max * (size_t)n_lanes);
    c->tier.cap = cap;
    c->tier.lane_cap = cap / (size_t)n_lanes;
    c->tier.vec_alloc = vec;
    c->tiers = calloc((size_t)n_lanes, sizeof *c->tiers);
    if (!c->tiers) return errorf(err, errlen, "out of memory");
    for (int i = 0; i < n_lanes; i++) {
        KVTierLane *tl = &c->tiers[i];
        int cap_slots = c->lanes[i].cap;
        tl->state = calloc((size_t)cap_slots, 1);
        tl->prev = malloc((size_t)cap_slots * sizeof(int));
        tl->next = malloc((size_t)cap_slots * sizeof(int));
        if (!tl->state || !tl->prev || !tl->next) return errorf(err, errlen, "out of memory");
        tl->head = tl->tail = -1;
    }
    c->tiers[0].miss = malloc((size_t)c->budget * sizeof(int));
    if (!c->tiers[0].miss) return errorf(err, errlen, "out of memory");
    return 0;
}

void kv_tier_free(KVCache *c) {
    if (!c->tiers) return;
    for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) {
        free(c->tiers[i].state); free(c->tiers[i].prev); free(c->tiers[i].next);
    }
    free(c->tiers[0].miss);
    free(c->tiers);
    c->tiers = NULL;
}

void kv_tier_reset(KVCache *c) {
    if (!c->tiers) return;
    for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) {
        KVTierLane *tl = &c->tiers[i];
        memset(tl->state, 0, (size_t)c->lanes[i].cap);
        tl->head = tl->tail = -1;
        tl->bytes = 0;
    }
    c->tier.fast_bytes = 0;
}

void kv_tier_copy(KVCache *dst, const KVCache *src) {
    if (!src->tiers || !dst->tiers) return;
    for (int i = 0; i < src->shape.n_layers * src->shape.n_kv_heads; i++) {
        const KVTierLane *s = &src->tiers[i];
        KVTierLane *d = &dst->tiers[i];
        size_t n = (size_t)src->lanes[i].cap;
        memcpy(d->state, s->state, n);
        memcpy(d->prev, s->prev, n * sizeof(int));
        memcpy(d->next, s->next, n * sizeof(int));
        d->head = s->head; d->tail = s->tail; d->bytes = s->bytes;   /* miss: scratch, not copied */
    }
    dst->tier = src->tier;
}

void kv_tier_store(KVCache *c, int lane, int s) {
    if (!c->tiers) return;
    enter(c, &c->lanes[lane], &c->tiers[lane], s, FAST);
}

void kv_tier_release(KVCache *c, int lane, int s) {
    if (!c->tiers || c->tiers[lane].state[s] == SLOW) return;
    drop(c, &c->lanes[lane], &c->tiers[lane], s);
}

/* Recode: the token in slot `from` now lives in slot `to` (another band), in the same tier and at the same place in
 * the recency list; its fast-tier bytes change to the new form's (from_bytes before). Done where the token lies (no
 * move counted). A recode to a larger form makes room first, which may push out this very slot if it is the least
 * recent. */
void kv_tier_move(KVCache *c, int lane, int from, int to, size_t from_bytes) {
    if (!c->tiers) return;
    KVTierLane *tl = &c->tiers[lane];
    const KVLane *ln = &c->lanes[lane];
    tl->state[to] = tl->state[from];
    tl->state[from] = SLOW;
    if (tl->state[to] == SLOW) return;
    int p = tl->prev[from], n = tl->next[from];
    tl->prev[to] = p; tl->next[to] = n;
    if (p >= 0) tl->next[p] = to; else tl->head = to;
    if (n >= 0) tl->prev[n] = to; else tl->tail = to;
    size_t b = slot_bytes(c, ln, to);
    add_bytes(c, tl, 0, from_bytes);
    while (tl->bytes + b > c->tier.lane_cap && tl->head != to) drop(c, ln, tl, tl->head);
    if (tl->bytes + b > c->tier.lane_cap) {   /* it is the least recent left: it leaves too */
        if (tl->state[to] == PREFETCHED) c->tier.wasted_bytes += b;
        unlink_slot(tl, to);
        tl->state[to] = SLOW;
        return;
    }
    add_bytes(c, tl, b, 0);
}

/* The slots of `ranks` (m of them, increasing; NULL: every live rank) as one use: the resident ones become the most
 * recent, in rank order, then the missing ones are moved in, in rank order, as `state` (FAST for a read, PREFETCHED
 * for a prefetch). A read counts reads, hits, prefetch hits and demand bytes; a prefetch counts prefetched bytes. */
static void use(KVCache *c, int lane, const int *ranks, int m, int state) {
    KVTierLane *tl = &c->tiers[lane];
    const KVLane *ln = &c->lanes[lane];
    int n_miss = 0, *miss = c->tiers[0].miss;
    for (int j = 0; j < m; j++) {
        int s = ln->live[ranks ? ranks[j] : j];
        if (tl->state[s] == SLOW) { miss[n_miss++] = s; continue; }
        if (state == FAST) {
            c->tier.hits++;
            if (tl->state[s] == PREFETCHED) { c->tier.prefetch_hits++; tl->state[s] = FAST; }
        }
        unlink_slot(tl, s);
        push_recent(tl, s);
    }
    /* each missing slot goes in after the pass above, so it can only push out slots outside the set, or, for a
       set larger than the tier, slots of the set already read (which are not read again) */
    for (int j = 0; j < n_miss; j++) {
        int s = miss[j];
        size_t b = slot_bytes(c, ln, s);
        if (state == FAST) c->tier.demand_bytes += b;
        else { c->tier.prefetch_bytes += b; c->tier.prefetch_slots++; }
        c->bytes_moved += b;
        enter(c, ln, tl, s, state);
    }
    if (state == FAST) c->tier.reads += (uint64_t)m;
}

/* The set S of ranks that just resolved (kv.c, before it reads the vectors): hits counted before the first pass
 * moves anything, as a real step would find them. */
void kv_tier_read(KVCache *c, int lane, const int *ranks, int m) {
    if (c->tiers) use(c, lane, ranks, m, FAST);
}

void kv_tier_prefetch_ranks(KVCache *c, int lane, const int *ranks, int m) {
    if (c->tiers) use(c, lane, ranks, m, PREFETCHED);
}

int kv_tier_check(const KVCache *c) {
    if (!c->tiers) return 0;
    size_t total = 0;
    for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) {
        const KVTierLane *tl = &c->tiers[i];
        const KVLane *ln = &c->lanes[i];
        size_t bytes = 0;
        int count = 0, listed = 0;
        for (int s = tl->head, prev = -1; s >= 0; prev = s, s = tl->next[s]) {
            if (tl->prev[s] != prev || tl->state[s] == SLOW || ln->pos[s] < 0 || ++listed > ln->cap) return -1;
            bytes += slot_bytes(c, ln, s);
        }
        for (int s = 0; s < ln->cap; s++) count += tl->state[s] != SLOW;
        if (count != listed || bytes != tl->bytes || bytes > c->tier.lane_cap) return -1;
        total += bytes;
    }
    return total == c->tier.fast_bytes && total <= c->tier.cap ? 0 : -1;
}

int kv_tier_resident(const KVCache *c, int l, int g, int rank) {
    if (!c->tiers) return 1;
    int lane = l * c->shape.n_kv_heads + g;
    return c->tiers[lane].state[c->lanes[lane].live[rank]] != SLOW;
}

KVTierFigures kv_tier_figures(const KVTierStats *now, const KVTierStats *before, long steps, double compute_s,
                              double link_bytes_s) {
    KVTierStats z = {0};
    if (!before) before = &z;
    double n = steps > 0 ? (double)steps : 1;
    KVTierFigures f = {0};
    uint64_t reads = now->reads - before->reads, pf = now->prefetch_slots - before->prefetch_slots;
    f.hit_rate = reads ? (double)(now->hits - before->hits) / (double)reads : 1;
    f.demand = (double)(now->demand_bytes - before->demand_bytes) / n;
    f.prefetch = (double)(now->prefetch_bytes - before->prefetch_bytes) / n;
    f.wasted = (double)(now->wasted_bytes - before->wasted_bytes) / n;
    f.predict = (double)(now->predict_bytes - before->predict_bytes) / n;
    f.prefetch_hit_rate = pf ? (double)(now->prefetch_hits - before->prefetch_hits) / (double)pf : 0;
    double ahead = f.prefetch / link_bytes_s - compute_s;
    f.stall_s = f.demand / link_bytes_s + (ahead > 0 ? ahead : 0);
    return f;
}

void kv_tier_line(char *buf, size_t len, const KVCache *c, const KVTierFigures *f, double compute_s) {
    const double MiB = 1048576.0;
    snprintf(buf, len, "fast tier %.2f MiB (peak %.2f MiB, %.1f%% of the cache's %.2f MiB of vectors), hit rate "
             "%.4f, moved %.3f MiB/token on a miss + %.3f MiB/token prefetched (prefetch hit rate %.4f, wasted %.3f "
             "MiB/token, the predictor read %.3f MiB/token), stall %.3f ms/token modelled over %.3f ms/token compute",
             c->tier.cap / MiB, c->tier.fast_peak / MiB, c->tier.vec_alloc ? 100.0 * c->tier.cap / c->tier.vec_alloc : 0,
             c->tier.vec_alloc / MiB, f->hit_rate, f->demand / MiB, f->prefetch / MiB, f->prefetch_hit_rate,
             f->wasted / MiB, f->predict / MiB, f->stall_s * 1e3, compute_s * 1e3);
}
