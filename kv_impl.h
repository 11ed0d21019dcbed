/* kv_impl.h: what kv.c (the cache, kv_attend_ref) and attn_cpu.c (the fast CPU attention) share and nothing else
 * includes: the f32 key and value of a live slot as attention sees them, RoPE on one vector, the per-step cos/sin
 * table, and the size of the key-panel scratch the cache allocates for attn_cpu.c.
 * It is not an interface: kv.h is. Keys and values are read here in one place so that the reference and the fast
 * path cannot disagree on what a stored token means (type, region, position mode).
 * Dimensions: head_dim, budget (slots per lane). Indices: i rank in a lane's live list, s slot.
 */
#ifndef KVLAB_KV_IMPL_H
#define KVLAB_KV_IMPL_H

#include "kv.h"

/* RoPE of x (head_dim) with a cos, sin table cs (head_dim/2, 2) as kv_rope_cs makes it; pairing per shape (kv.c). */
void kv_rope_apply(float *x, const KVShape *s, const float *cs);
/* The cos, sin table of position t, computed once per step and shared by every layer, key and query (kv.c). */
const float *kv_rope_at(KVCache *c, int t);

/* 1 when the query at position t reads the set its selection policy chooses (kv_attend_select), 0 when it reads
 * every live token through the ordinary attention: any other policy, and under prompt=dense the prompt's queries
 * (positions before kv_set_prompt_len's end). */
static inline int kv_query_selects(const KVCache *c, int t) {
    return c->policy.ops->select && !(c->prompt_dense && t < c->policy.prompt_len);
}

/* Keys per work item of attention's score phase (kv_attend_cpu, kv_attend_chunk): small enough to balance the lanes
 * over the threads, large enough that an item's cost dwarfs handing it out. */
#define KV_KEY_BLOCK 64
/* slots per lane of a cache's key panels (ktbuf): its budget rounded up to whole blocks */
static inline size_t kv_key_panel_slots(int budget) {
    return (size_t)(budget + KV_KEY_BLOCK - 1) / KV_KEY_BLOCK * KV_KEY_BLOCK;
}

/* A key of per-channel band b (kgroup=channel) as stored: a pointer to its f32 row while its group is open, else
 * decoded from its codes and its group's scales and minimums into x (head_dim), x returned (kv.c). */
const float *kv_chan_key(const KVCache *c, const KVLane *ln, int b, int slot, float *x);

/* The f32 key of the lane's i-th live slot as step 3 sees it: read as is from an f32 band (or an open per-channel
 * group) or decoded from its band's key form, then, under pos=cache, rotated by its rank i (the table c->rope_cs,
 * = kv_rope_cs(i)); under pos=orig it was rotated by its position when stored. Returns a pointer into the cache (f32,
 * pos=orig) or x (head_dim) when it had to be decoded or rotated. Inline: the fast path calls it once per key. */
static inline const float *kv_lane_key(const KVCache *c, const KVLane *ln, int i, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim, b = kv_slot_band(ln, slot);
    const uint8_t *src = ln->k[b] + (size_t)(slot - ln->band_first[b]) * c->band_kb[b];
    const float *k = c->band_kchan[b] ? kv_chan_key(c, ln, b, slot, x)
                   : c->band_ktype[b] == KV_F32 ? (const float *)(const void *)src : NULL;
    if (c->spec.pos == POS_ORIG && k) return k;
    if (k && k != x) memcpy(x, k, (size_t)hd * sizeof(float));
    else if (!k) kv_decode(x, c->band_ktype[b], src, hd);
    if (c->spec.pos == POS_CACHE) kv_rope_apply(x, &c->shape, c->rope_cs + (size_t)i * hd);
    return x;
}

/* The f32 value of the lane's i-th live slot: a pointer into the cache, or x (head_dim) when it had to be decoded. */
static inline const float *kv_lane_value(const KVCache *c, const KVLane *ln, int i, float *x) {
    int slot = ln->live[i], b = kv_slot_band(ln, slot);
    const uint8_t *src = ln->v[b] + (size_t)(slot - ln->band_first[b]) * c->band_vb[b];
    if (c->band_vtype[b] == KV_F32) return (const float *)(const void *)src;
    kv_decode(x, c->band_vtype[b], src, c->shape.head_dim);
    return x;
}

/* The memory tiers' bookkeeping (kv_tier.c), called by kv.c where slots are stored, freed, recoded and read; each a
 * no-op with one tier. kv_tier_init after the lanes are carved (0, or -1 + message: prefetch without fast=, a fast
 * tier smaller than one slot per lane). kv_tier_read: the ranks (m, increasing; NULL every live rank) a query of the
 * lane reads, before they are read; kv_tier_prefetch_ranks: ranks moved in ahead; kv_tier_move: a recode moved the
 * token of slot `from` (from_bytes in its old form) to slot `to`. */
int kv_tier_init(KVCache *c, char *err, size_t errlen);
void kv_tier_free(KVCache *c);
void kv_tier_reset(KVCache *c);
void kv_tier_copy(KVCache *dst, const KVCache *src);
void kv_tier_store(KVCache *c, int lane, int slot);
void kv_tier_release(KVCache *c, int lane, int slot);
void kv_tier_move(KVCache *c, int lane, int from, int to, size_t from_bytes);
void kv_tier_read(KVCache *c, int lane, const int *ranks, int m);
void kv_tier_prefetch_ranks(KVCache *c, int lane, const int *ranks, int m);

#endif
