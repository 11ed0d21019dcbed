/* kv_impl.h: what kv.c (the cache, kv_attend_ref) and attn_cpu.c (the fast CPU attention) share and nothing else
 * includes: the f32 key and value of a live slot as attention sees them, RoPE on one vector, the per-step cos/sin
 * table, and the size of attention's blocks of keys.
 * It is not an interface: kv.h is. Keys and values are read here in one place so that the reference and the fast
 * path cannot disagree on what a stored token means (type, region, position mode).
 * Dimensions: head_dim, budget (slots per lane). Indices: i rank in a lane's live list, s slot.
 */
#ifndef KVLAB_KV_IMPL_H
#define KVLAB_KV_IMPL_H

#include "kv.h"
#include "kv_codec.h"

#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

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

/* A key of per-channel band b (kgroup=channel) as stored: a pointer to its f32 row while its group is open, else
 * decoded from its codes and its group's scales and minimums into x (head_dim), x returned (kv.c). */
const float *kv_chan_key(const KVCache *c, const KVLane *ln, int b, int slot, float *x);
/* How many keys per-channel band b of the lane can take from now, none of them sealing a group: the open group's free
 * rows but its last (or, with no open group, those of the empty group the next store opens, band_pop's choice), 0
 * when the next store seals or lands in a sealed group. Stores into such rows change no stored key's bits: each new
 * key waits in f32 in the open group (the chunk path's rule, attn_cpu.c). */
int kv_chan_room(const KVCache *c, const KVLane *ln, int b);

/* The f32 key and value of a low-rank cache's slot (c->krank, c->vrank; kv.c, "Low rank"): before the lane's fit, its
 * full-rank staging row decoded as a full-rank cache reads it; after it, basis times coefficients, the key then rotated
 * by its position (pos=orig, the table c->lr_cs) or, in either case under pos=cache, by its rank i. x (head_dim). */
const float *kv_lowrank_key(const KVCache *c, const KVLane *ln, int i, float *x);
const float *kv_lowrank_value(const KVCache *c, const KVLane *ln, int i, float *x);
/* What a fitted lane's slot will read back for a token not stored yet (the chunk path's new tokens): y (head_dim) =
 * basis times the coefficients of k (pre-RoPE key) or v, encoded in the band's type as kv_append stores them; the key
 * not rotated. Only for a side with a rank (c->krank, c->vrank) and a lane with ln->lr_fitted. */
void kv_lowrank_new_key(const KVCache *c, const KVLane *ln, float *y, const float *k);
void kv_lowrank_new_value(const KVCache *c, const KVLane *ln, float *y, const float *v);

/* Decoding in registers (CPU only), for kv_decode and attn_cpu.c's decode step, which reads values as stored. */
static inline float kv_f16_scale(const uint8_t *b) {
#ifdef __F16C__
    return _cvtsh_ss(kv_get16(b));   /* vcvtph2ps: the exact conversion kv_f16_to_f32 computes */
#else
    return kv_f16_to_f32(kv_get16(b));
#endif
}
/* Byte offset of element e's unit in a vector of type ty (group Gc), for prefetching */
static inline size_t kv_stored_offset(int ty, int e, int Gc) {
    return (size_t)(kv_type_grouped(ty) ? e / Gc : e) * (size_t)kv_unit_bytes(ty, Gc);
}
/* Elements d0 .. d0+15 of a stored vector of type ty (codec group Gc), in out[0..16), the bits kv_decode_elem gives:
 * with AVX2 each type in registers where its groups hold the 16 columns whole (Gc % 16 == 0: every head_dim that is a
 * multiple of 16; q4 Gc % 32 == 0), else element by element. */
static inline __attribute__((always_inline)) void kv_decode16(float *out, int ty, const uint8_t *b, int d0, int Gc) {
#ifdef __AVX2__
    if (ty == KV_F32) {
        _mm256_storeu_ps(out, _mm256_loadu_ps((const float *)(const void *)b + d0));
        _mm256_storeu_ps(out + 8, _mm256_loadu_ps((const float *)(const void *)b + d0 + 8));
        return;
    }
#ifdef __F16C__
    if (ty == KV_F16) {
        _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(b + 2 * d0))));
        _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(b + 2 * d0 + 16))));
        return;
    }
#endif
    if (ty == KV_BF16) {   /* bf16 is the top half of an f32 */
        for (int h = 0; h < 2; h++) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(b + 2 * (d0 + 8 * h))));
            _mm256_storeu_ps(out + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        return;
    }
    if (Gc % 16 == 0 && ty == KV_Q8) {
        const uint8_t *u = b + (size_t)(d0 / Gc) * (2 + Gc);
        __m256 d = _mm256_set1_ps(kv_f16_scale(u));
        __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(u + 2 + d0 % Gc));
        _mm256_storeu_ps(out, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
        return;
    }
    if (Gc % 32 == 0 && ty == KV_Q4) {   /* element j of a group: byte 4 + j's low nibble (j < Gc/2), else high */
        const uint8_t *u = b + (size_t)(d0 / Gc) * (4 + Gc / 2);
        int j0 = d0 % Gc, hi = j0 >= Gc / 2;
        __m256 d = _mm256_set1_ps(kv_f16_scale(u)), m = _mm256_set1_ps(kv_f16_scale(u + 2));
        __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(u + 4 + j0 - (hi ? Gc / 2 : 0)));
        q = _mm_and_si128(hi ? _mm_srli_epi16(q, 4) : q, _mm_set1_epi8(15));
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), m));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(
                                                    _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))), m));
        return;
    }
    if (Gc % 16 == 0 && ty == KV_Q2) {   /* element j: bits 2(j % 4) of byte 4 + j/4 */
        const uint8_t *u = b + (size_t)(d0 / Gc) * (4 + Gc / 4);
        const uint8_t *c = u + 4 + (d0 % Gc) / 4;
        __m256 d = _mm256_set1_ps(kv_f16_scale(u)), m = _mm256_set1_ps(kv_f16_scale(u + 2));
        __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6), three = _mm256_set1_epi32(3);
        for (int h = 0; h < 2; h++) {
            __m256i w = _mm256_setr_epi32(c[2 * h], c[2 * h], c[2 * h], c[2 * h], c[2 * h + 1], c[2 * h + 1],
                                          c[2 * h + 1], c[2 * h + 1]);
            __m256 x = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), three));
            _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(_mm256_mul_ps(d, x), m));
        }
        return;
    }
#endif
    for (int e = 0; e < 16; e++) out[e] = kv_decode_elem(ty, b, d0 + e, Gc);
}

/* A whole vector of head_dim (a multiple of 16) through kv_decode16, codec group G; G = 32 (every head_dim that is a
 * multiple of 32) a constant, so that a column's group is a shift, not a division. kv_decode's AVX2 path. */
static inline void kv_decode_by16(float *x, int ty, const uint8_t *src, int head_dim, int G) {
    if (G == 32) for (int d0 = 0; d0 < head_dim; d0 += 16) kv_decode16(x + d0, ty, src, d0, 32);
    else for (int d0 = 0; d0 < head_dim; d0 += 16) kv_decode16(x + d0, ty, src, d0, G);
}

/* kv_decode inline, for the loops that decode a key or value per slot per step: with AVX2 and head_dim a multiple of
 * 32 its vector path without the call; otherwise kv_decode. Same bits. */
static inline void kv_decode_inline(float *x, KVType ty, const uint8_t *src, int head_dim) {
#ifdef __AVX2__
    if (head_dim % 32 == 0) { kv_decode_by16(x, ty, src, head_dim, 32); return; }
#endif
    kv_decode(x, ty, src, head_dim);
}

/* The f32 key of the lane's i-th live slot as step 3 sees it: read as is from an f32 band (or an open per-channel
 * group) or decoded from its band's key form, then, under pos=cache, rotated by its rank i (the table c->rope_cs,
 * = kv_rope_cs(i)); under pos=orig it was rotated by its position when stored. Returns a pointer into the cache (f32,
 * pos=orig) or x (head_dim) when it had to be decoded or rotated. Inline: the fast path calls it once per key. */
static inline __attribute__((always_inline)) const float *kv_lane_key(const KVCache *c, const KVLane *ln, int i, float *x) {
    if (c->krank) return kv_lowrank_key(c, ln, i, x);
    int slot = ln->live[i], hd = c->shape.head_dim, b = kv_slot_band(ln, slot);
    const uint8_t *src = kv_slot_k(c, ln, slot);
    const float *k = c->band_kchan[b] ? kv_chan_key(c, ln, b, slot, x)
                   : c->band_ktype[b] == KV_F32 ? (const float *)(const void *)src : NULL;
    if (c->spec.pos == POS_ORIG && k) return k;
    if (k && k != x) memcpy(x, k, (size_t)hd * sizeof(float));
    else if (!k) kv_decode_inline(x, c->band_ktype[b], src, hd);
    if (c->spec.pos == POS_CACHE) kv_rope_apply(x, &c->shape, c->rope_cs + (size_t)i * hd);
    return x;
}

/* The lane's i-th live value as stored, for kernels that decode in registers (attn_cpu.c's decode step): its bytes,
 * its type in *ty. A low-rank value has no stored f32 form: it is reconstructed into x (head_dim) and *ty = KV_F32. */
static inline __attribute__((always_inline)) const uint8_t *kv_lane_value_stored(const KVCache *c, const KVLane *ln, int i, float *x, uint8_t *ty) {
    if (c->vrank) { *ty = KV_F32; return (const uint8_t *)(const void *)kv_lowrank_value(c, ln, i, x); }
    int slot = ln->live[i];
    *ty = (uint8_t)c->band_vtype[kv_slot_band(ln, slot)];
    return kv_slot_v(c, ln, slot);
}

/* The f32 value of the lane's i-th live slot: a pointer into the cache, or x (head_dim) when it had to be decoded. */
static inline const float *kv_lane_value(const KVCache *c, const KVLane *ln, int i, float *x) {
    uint8_t ty;
    const uint8_t *src = kv_lane_value_stored(c, ln, i, x, &ty);
    if (ty == KV_F32) return (const float *)(const void *)src;
    kv_decode_inline(x, (KVType)ty, src, c->shape.head_dim);
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
