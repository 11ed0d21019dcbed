/* kv.c: the KV cache (lanes of slots, storage types, the f32 residual, RoPE by position mode), its memory
 * accounting, the -kv spec parser, steps 1-2 (kv_append), step 3's definition (kv_attend_ref, the reference every
 * other attention path is checked against) and step 4 (kv_attend_policy).
 * It knows no policy: eviction decisions come through the KVPolicyOps table (kv.h, policies.c).
 * It deliberately holds no fast attention: attn_cpu.c has the CPU one (kv_attend_cpu, kv_attend_chunk), attn.cu the
 * CUDA one; and it does not batch several sequences: one stream per cache.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget (slots per lane), R (residual slots per lane).
 * Indices: l layer, h query head, g kv head, t position, s slot, i rank in a lane's live list.
 */
#include "kv.h"
#include "kv_codec.h"
#include "kv_impl.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#ifdef __F16C__
#include <immintrin.h>
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

const char *const kv_type_names[KV_NTYPES] = {"f32", "f16", "bf16", "q8", "q4"};

/* ---------------------------------------------------------------------------------------------------------------
 * Storage types: the codec (layouts, rounding, error bounds) is kv_codec.h, shared with attn.cu's kernels; here are
 * the loops over a vector's units.
 * ------------------------------------------------------------------------------------------------------------- */

size_t kv_vector_bytes(KVType ty, int head_dim) {
    int G = kv_group(head_dim);
    return (size_t)kv_codec_units(ty, head_dim, G) * (size_t)kv_unit_bytes(ty, G);
}

/* The loops over units, called with a constant type for each type, so the compiler drops the codec's switch on the
 * type and vectorizes each loop (one generic loop over units decodes f32 and bf16 several times slower). Decoding
 * runs once per key and value per step: G = 32, the group of every head_dim divisible by 32, gets a loop of its own
 * with the group size constant (a q4 key decodes about a quarter faster). */
static inline void encode_units(uint8_t *dst, int ty, const float *x, int G, int n) {
    for (int u = 0; u < n; u++) kv_encode_unit(dst, ty, x, G, u);
}
static inline void decode_units(float *x, int ty, const uint8_t *src, int G, int u, int n) {
    if (G == 32) for (; u < n; u++) kv_decode_unit(x, ty, src, 32, u);
    else for (; u < n; u++) kv_decode_unit(x, ty, src, G, u);
}

void kv_encode(uint8_t *dst, KVType ty, const float *x, int head_dim) {
    int G = kv_group(head_dim), n = kv_codec_units(ty, head_dim, G);
    switch (ty) {
    case KV_F32: encode_units(dst, KV_F32, x, G, n); break;
    case KV_F16: encode_units(dst, KV_F16, x, G, n); break;
    case KV_BF16: encode_units(dst, KV_BF16, x, G, n); break;
    case KV_Q8: encode_units(dst, KV_Q8, x, G, n); break;
    case KV_Q4: encode_units(dst, KV_Q4, x, G, n); break;
    default: break;
    }
}

void kv_decode(float *x, KVType ty, const uint8_t *src, int head_dim) {
    int G = kv_group(head_dim), n = kv_codec_units(ty, head_dim, G), u = 0;
    switch (ty) {
    case KV_F32: decode_units(x, KV_F32, src, G, 0, n); break;
    case KV_F16:
#ifdef __F16C__
        /* vcvtph2ps: the same exact conversion as kv_f16_to_f32, 8 at a time (decode runs once per key per step) */
        for (; u + 8 <= head_dim; u += 8)
            _mm256_storeu_ps(x + u, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + 2 * u))));
#endif
        decode_units(x, KV_F16, src, G, u, n);
        break;
    case KV_BF16: decode_units(x, KV_BF16, src, G, 0, n); break;
    case KV_Q8: decode_units(x, KV_Q8, src, G, 0, n); break;
    case KV_Q4: decode_units(x, KV_Q4, src, G, 0, n); break;
    default: break;
    }
}

int kv_type_parse(const char *s) {
    for (int i = 0; i < KV_NTYPES; i++) if (strcmp(s, kv_type_names[i]) == 0) return i;
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * RoPE. The angles are computed in double so a large position keeps its precision; kv_rope and the rank table of
 * pos=cache share rope_cs and kv_rope_apply, so rotating by rank t gives the same bits as rotating by position t.
 * ------------------------------------------------------------------------------------------------------------- */

/* cs (head_dim/2, 2): cos and sin of pos · freq_i. */
static void rope_cs(float *cs, const KVShape *s, int pos) {
    for (int i = 0; i < s->head_dim / 2; i++) {
        double freq = pow((double)s->rope_theta, -2.0 * i / s->head_dim);
        if (s->rope_factors) freq /= s->rope_factors[i];
        double a = pos * freq;
        cs[2 * i] = (float)cos(a);
        cs[2 * i + 1] = (float)sin(a);
    }
}

/* GCC 12 turns this loop's rotation pattern into fused multiply-add-subtract (vfmaddsub) even with
 * -ffp-contract=off, which would make the bits depend on the instruction set: its vectorizer stays off here. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
void kv_rope_apply(float *x, const KVShape *s, const float *cs) {
    int half = s->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float c = cs[2 * i], sn = cs[2 * i + 1];
        int i0 = s->rope_pairing ? i : 2 * i, i1 = s->rope_pairing ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * c - x1 * sn;
        x[i1] = x0 * sn + x1 * c;
    }
}

void kv_rope_cs(float *cs, const KVShape *s, int pos) { rope_cs(cs, s, pos); }

void kv_rope(float *x, const KVShape *s, int pos) {
    float cs[s->head_dim];
    rope_cs(cs, s, pos);
    kv_rope_apply(x, s, cs);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Spec parsing: NAME[:BUDGET][,key=value...]
 * ------------------------------------------------------------------------------------------------------------- */

/* A budget: tokens ("1024") or bytes ("64MiB", "512KiB", "1GiB", "4096B"). 0 ok, -1 bad. */
static int parse_budget(const char *s, int *tokens, size_t *bytes) {
    char *end;
    errno = 0;
    if (*s < '0' || *s > '9') return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    if (*end == 0) {
        if (v > 1u << 30) return -1;
        *tokens = (int)v; *bytes = 0;
        return 0;
    }
    unsigned long long mul = 0;
    if (strcmp(end, "B") == 0) mul = 1;
    else if (strcmp(end, "KiB") == 0) mul = 1ull << 10;
    else if (strcmp(end, "MiB") == 0) mul = 1ull << 20;
    else if (strcmp(end, "GiB") == 0) mul = 1ull << 30;
    if (!mul || v > (1ull << 50) / mul) return -1;
    *bytes = (size_t)(v * mul); *tokens = 0;
    return 0;
}

#define TYPE_CHOICES "f32, f16, bf16, q8, q4"
#define COMMON_KEYS "type, ktype, vtype, residual, pos, agg"

int kv_spec_parse(KVSpec *sp, const char *text, KVType default_type, char *err, size_t errlen) {
    memset(sp, 0, sizeof *sp);
    sp->ktype = sp->vtype = default_type;
    if (strlen(text) >= sizeof sp->text) return errorf(err, errlen, "kv spec '%.40s...' is too long", text);
    strcpy(sp->text, text);
    size_t tl = strlen(text);
    if (tl == 0) return errorf(err, errlen, "empty kv spec; policies: %s", kv_policy_names());
    if (text[0] == ',' || text[tl - 1] == ',' || strstr(text, ",,"))   /* strtok would skip them */
        return errorf(err, errlen, "empty part in kv spec '%s': NAME[:BUDGET][,key=value...]; policies: %s", text,
                      kv_policy_names());
    char buf[sizeof sp->text];
    strcpy(buf, text);
    char *save = NULL, *part = strtok_r(buf, ",", &save);
    if (!part || !*part) return errorf(err, errlen, "empty kv spec; policies: %s", kv_policy_names());
    /* NAME[:BUDGET] */
    char *colon = strchr(part, ':');
    if (colon) *colon = 0;
    if (strlen(part) >= sizeof sp->name || !kv_policy_find(part))
        return errorf(err, errlen, "unknown kv policy '%s' in '%s'; policies: %s", part, text, kv_policy_names());
    strcpy(sp->name, part);
    if (colon && strspn(colon + 1, "0123456789") == strlen(colon + 1) && strlen(colon + 1) > 0 &&
        (strlen(colon + 1) > 10 || strtoull(colon + 1, NULL, 10) > 1u << 30))
        return errorf(err, errlen, "budget %s in '%s' is over the largest of %d tokens per lane", colon + 1, text,
                      1 << 30);
    if (colon && parse_budget(colon + 1, &sp->budget, &sp->budget_bytes))
        return errorf(err, errlen, "bad budget '%s' in '%s': give tokens per lane (1024) or bytes for the whole "
                      "cache (64MiB, 512KiB, 1GiB, 4096B)", colon + 1, text);
    if (colon && sp->budget == 0 && sp->budget_bytes == 0)
        return errorf(err, errlen, "budget 0 in '%s': a lane needs at least one slot; give tokens per lane (1024) "
                      "or bytes for the whole cache (64MiB)", text);
    /* each common key once; type= and ktype=/vtype= exclude each other in either order */
    int seen_type = 0, seen_kv = 0, seen_res = 0, seen_pos = 0, seen_agg = 0;
    while ((part = strtok_r(NULL, ",", &save))) {
        char *eq = strchr(part, '=');
        if (!eq || eq == part || !eq[1])
            return errorf(err, errlen, "bad option '%s' in '%s': options are key=value", part, text);
        *eq = 0;
        const char *key = part, *val = eq + 1;
        int *seen = NULL;
        if (!strcmp(key, "type") || !strcmp(key, "ktype") || !strcmp(key, "vtype")) {
            int ty = kv_type_parse(val);
            if (ty < 0) return errorf(err, errlen, "unknown storage type %s=%s in '%s'; types: " TYPE_CHOICES,
                                      key, val, text);
            int bit = key[0] == 't' ? 4 : key[0] == 'k' ? 1 : 2;
            if ((bit == 4 && seen_kv) || (bit != 4 && seen_type))
                return errorf(err, errlen, "'%s' conflicts with type= in '%s': give type= or ktype=/vtype=", key, text);
            if (seen_kv & bit) return errorf(err, errlen, "option '%s' given twice in '%s'", key, text);
            if (bit == 4) seen = &seen_type; else seen_kv |= bit;
            if (key[0] != 'v') sp->ktype = (KVType)ty;
            if (key[0] != 'k') sp->vtype = (KVType)ty;
        } else if (!strcmp(key, "residual")) {
            char *end;
            long r = strtol(val, &end, 10);
            if (*end || end == val || r < 0 || r > 1 << 24)
                return errorf(err, errlen, "bad residual=%s in '%s': a token count >= 0", val, text);
            sp->residual = (int)r;
            seen = &seen_res;
        } else if (!strcmp(key, "pos")) {
            if (!strcmp(val, "orig")) sp->pos = POS_ORIG;
            else if (!strcmp(val, "cache")) sp->pos = POS_CACHE;
            else return errorf(err, errlen, "unknown pos=%s in '%s'; choices: orig, cache", val, text);
            seen = &seen_pos;
        } else if (!strcmp(key, "agg")) {
            if (!strcmp(val, "mean")) sp->agg = AGG_MEAN;
            else if (!strcmp(val, "max")) sp->agg = AGG_MAX;
            else return errorf(err, errlen, "unknown agg=%s in '%s'; choices: mean, max", val, text);
            seen = &seen_agg;
        } else {
            if (sp->n_params == KV_MAX_PARAMS) return errorf(err, errlen, "too many options in '%s'", text);
            if (strlen(key) >= sizeof sp->keys[0] || strlen(val) >= sizeof sp->vals[0])
                return errorf(err, errlen, "option '%s' too long in '%s'", key, text);
            for (int i = 0; i < sp->n_params; i++)
                if (!strcmp(sp->keys[i], key)) return errorf(err, errlen, "option '%s' given twice in '%s'", key, text);
            strcpy(sp->keys[sp->n_params], key);
            strcpy(sp->vals[sp->n_params], val);
            sp->n_params++;
        }
        if (seen) {
            if (*seen) return errorf(err, errlen, "option '%s' given twice in '%s'", key, text);
            *seen = 1;
        }
    }
    return 0;
}

const char *kv_spec_value(const KVSpec *sp, const char *key) {
    for (int i = 0; i < sp->n_params; i++)
        if (!strcmp(sp->keys[i], key)) return sp->vals[i];
    return NULL;
}

const char *kv_spec_get(KVSpec *sp, const char *key) {
    for (int i = 0; i < sp->n_params; i++)
        if (!strcmp(sp->keys[i], key)) { sp->used[i] = 1; return sp->vals[i]; }
    return NULL;
}

int kv_spec_check_mode(const KVSpec *sp, const char *mode, char *err, size_t errlen) {
    const KVPolicyOps *ops = kv_policy_find(sp->name);
    if (ops && ops->prompt_end && !strcmp(mode, "ppl") && !kv_spec_value(sp, "prefill"))
        return errorf(err, errlen, "'%s' in ppl mode needs prefill=P, the number of tokens after which %s "
                      "compresses (ppl has no prompt), e.g. %s,prefill=1024", sp->text, sp->name, sp->text);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Layout and accounting. One formula serves kv_alloc_bytes_for, kv_cache_init and kv_bytes.
 * ------------------------------------------------------------------------------------------------------------- */

/* Slots in the f32 region: the residual, or none when both types are f32 already (the region would change nothing). */
static int residual_slots(const KVSpec *sp, int slots) {
    if (sp->ktype == KV_F32 && sp->vtype == KV_F32) return 0;
    return sp->residual < slots ? sp->residual : slots;
}

/* Per-slot bytes other than vectors: position (int32), one live-list and one free-list entry (int), policy meta. */
static size_t slot_meta_bytes(size_t policy_meta) { return sizeof(int32_t) + 2 * sizeof(int) + policy_meta; }

static size_t f32_vec_pair_bytes(int head_dim) { return 2 * (size_t)head_dim * sizeof(float); }

size_t kv_alloc_bytes_for(const KVShape *s, const KVSpec *sp, const KVPolicyOps *ops, int budget) {
    int slots = ops && ops->grows ? s->seq_len : budget, R = residual_slots(sp, slots);
    size_t pol = ops && ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(sp, budget) : 0;
    size_t typed = kv_vector_bytes(sp->ktype, s->head_dim) + kv_vector_bytes(sp->vtype, s->head_dim);
    size_t lane = (size_t)(slots - R) * typed + (size_t)R * f32_vec_pair_bytes(s->head_dim)
                  + (size_t)slots * slot_meta_bytes(pol);
    return (size_t)s->n_layers * s->n_kv_heads * lane;
}

static KVBytes lane_bytes(const KVCache *c, const KVLane *ln) {
    KVBytes b = {0};
    int R = c->residual, live_r = R - ln->n_free_r, live_q = ln->n_live - live_r;
    size_t f32p = f32_vec_pair_bytes(c->shape.head_dim), meta = slot_meta_bytes(c->meta_bytes);
    b.vec_alloc = (size_t)(c->budget - R) * (c->k_bytes + c->v_bytes) + (size_t)R * f32p;
    b.vec_live = (size_t)live_q * (c->k_bytes + c->v_bytes) + (size_t)live_r * f32p;
    b.meta_alloc = (size_t)c->budget * meta;
    b.meta_live = (size_t)ln->n_live * meta;
    b.total_alloc = b.vec_alloc + b.meta_alloc;
    b.total_live = b.vec_live + b.meta_live;
    /* bytes per element: f32 4, f16/bf16 2, q8 1, q4 0.5; computed in eighths to stay integral */
    static const int eighths[KV_NTYPES] = {32, 16, 16, 8, 4};
    b.formula_alloc = (size_t)c->shape.head_dim * c->budget * (eighths[c->spec.ktype] + eighths[c->spec.vtype]) / 8;
    return b;
}

KVBytes kv_lane_bytes(const KVCache *c, int l, int g) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    KVBytes b = lane_bytes(c, ln);
    /* the lane's peak in bytes: its peak slots, newest first in the f32 region */
    int R = c->residual, pr = ln->peak_live < R ? ln->peak_live : R;
    b.peak_live = (size_t)(ln->peak_live - pr) * (c->k_bytes + c->v_bytes)
                  + (size_t)pr * f32_vec_pair_bytes(c->shape.head_dim)
                  + (size_t)ln->peak_live * slot_meta_bytes(c->meta_bytes);
    return b;
}

KVBytes kv_bytes(const KVCache *c) {
    KVBytes b = {0};
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads;
    for (int i = 0; i < n_lanes; i++) {
        KVBytes x = lane_bytes(c, &c->lanes[i]);
        b.vec_alloc += x.vec_alloc; b.vec_live += x.vec_live;
        b.meta_alloc += x.meta_alloc; b.meta_live += x.meta_live;
        b.formula_alloc += x.formula_alloc;
    }
    b.total_alloc = b.vec_alloc + b.meta_alloc;
    b.total_live = b.vec_live + b.meta_live;
    b.peak_live = c->peak_live_bytes > b.total_live ? c->peak_live_bytes : b.total_live;
    return b;
}

/* Bytes of one live token: its vectors (typed or f32 region) and its per-slot metadata. */
static size_t token_bytes(const KVCache *c, int f32_region) {
    return (f32_region ? f32_vec_pair_bytes(c->shape.head_dim) : c->k_bytes + c->v_bytes)
           + slot_meta_bytes(c->meta_bytes);
}


/* ---------------------------------------------------------------------------------------------------------------
 * The cache
 * ------------------------------------------------------------------------------------------------------------- */

static size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    c->shape = *shape;
    c->spec = *spec;
    const KVPolicyOps *ops = kv_policy_find(spec->name);
    if (!ops) return errorf(err, errlen, "unknown kv policy '%s'; policies: %s", spec->name, kv_policy_names());
    if (shape->n_layers < 1 || shape->n_kv_heads < 1 || shape->n_heads < 1 || shape->n_heads % shape->n_kv_heads)
        return errorf(err, errlen, "bad attention shape: %d layers, %d heads, %d kv heads", shape->n_layers,
                      shape->n_heads, shape->n_kv_heads);
    if (shape->head_dim < 2 || shape->head_dim % 2)
        return errorf(err, errlen, "head_dim %d is odd: RoPE needs pairs", shape->head_dim);
    int budget = spec->budget;
    if (spec->budget_bytes) {
        if (ops->grows)
            return errorf(err, errlen, "'%s': %s's lanes grow to the context (-c) after its compression, so a byte "
                          "budget does not set its size; give its budget in tokens (%s:1024)", spec->text,
                          spec->name, spec->name);
        /* the largest token budget whose allocated bytes fit (allocation grows with the budget) */
        int lo = 0, hi = 1 << 24;
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            if (kv_alloc_bytes_for(shape, spec, ops, mid) <= spec->budget_bytes) lo = mid; else hi = mid - 1;
        }
        if (lo == 0) return errorf(err, errlen, "byte budget %zu B in '%s' is smaller than one slot per lane (%zu B)",
                                   spec->budget_bytes, spec->text, kv_alloc_bytes_for(shape, spec, ops, 1));
        budget = lo;
    }
    if (!budget) {
        if (ops->needs_budget)
            return errorf(err, errlen, "'%s' needs a budget: %s:TOKENS or %s:BYTES (e.g. %s:1024, %s:64MiB)",
                          spec->text, spec->name, spec->name, spec->name, spec->name);
        budget = shape->seq_len;
    }
    if (budget < 1) return errorf(err, errlen, "'%s': no budget and no context length", spec->text);
    if (spec->residual > budget)
        return errorf(err, errlen, "residual=%d in '%s' exceeds the budget of %d tokens (residual tokens are part of "
                      "it)", spec->residual, spec->text, budget);
    c->budget = ops->grows ? (shape->seq_len > budget ? shape->seq_len : budget) : budget;
    c->residual = residual_slots(spec, c->budget);
    c->policy.ops = ops;
    c->policy.spec = &c->spec;
    c->policy.budget = budget;
    c->policy.n_lanes = shape->n_layers * shape->n_kv_heads;
    c->policy.n_kv_heads = shape->n_kv_heads;
    c->policy.n_heads = shape->n_heads;
    c->policy.agg = spec->agg;
    if (ops->init && ops->init(&c->policy, &c->spec, shape, budget, err, errlen)) {
        kv_cache_free(c);
        return -1;
    }
    for (int i = 0; i < c->spec.n_params; i++)
        if (!c->spec.used[i]) {
            errorf(err, errlen, "'%s' takes no option '%s' (in '%s'); its options: %s; every policy takes "
                   COMMON_KEYS, spec->name, c->spec.keys[i], spec->text, *ops->options ? ops->options : "none");
            kv_cache_free(c);
            return -1;
        }

    int hd = shape->head_dim, n_lanes = c->policy.n_lanes, B = c->budget, R = c->residual;
    c->k_bytes = kv_vector_bytes(spec->ktype, hd);
    c->v_bytes = kv_vector_bytes(spec->vtype, hd);
    c->meta_bytes = ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(&c->spec, budget) : 0;
    /* one arena for every lane, each array 16-byte aligned (the padding is not cache memory and is not counted) */
    size_t per_lane = align16((size_t)B * sizeof(int32_t)) + align16((size_t)B * sizeof(int))
                      + align16((size_t)(B - R) * sizeof(int)) + align16((size_t)R * sizeof(int))
                      + 2 * align16((size_t)R * hd * sizeof(float)) + align16((size_t)B * c->meta_bytes)
                      + align16((size_t)(B - R) * c->k_bytes) + align16((size_t)(B - R) * c->v_bytes);
    c->arena_bytes = per_lane * n_lanes;
    /* calloc: large arenas come zeroed from the kernel page by page, so a cache costs memory as it fills; malloc's
       alignment (max_align_t, 16 bytes on the targets we build for) is what the arrays need */
    c->arena = calloc(1, c->arena_bytes ? c->arena_bytes : 16);
    c->lanes = calloc((size_t)n_lanes, sizeof(KVLane));
    c->scores = calloc((size_t)shape->n_heads * B, sizeof(float));
    c->agg = calloc((size_t)shape->n_kv_heads * B, sizeof(float));
    c->mean = calloc((size_t)shape->n_kv_heads * B, sizeof(float));
    c->kbuf = calloc((size_t)shape->n_kv_heads * B * hd, sizeof(float));
    size_t kt_bytes = (size_t)shape->n_kv_heads * kv_key_panel_slots(B) * hd * sizeof(float);
    c->ktbuf = aligned_alloc(64, (kt_bytes + 63) / 64 * 64);   /* panels are read with aligned loads */
    c->vbuf = calloc((size_t)shape->n_kv_heads * B * hd, sizeof(float));
    c->qbuf = calloc((size_t)shape->n_heads * hd, sizeof(float));
    c->vptr = calloc((size_t)shape->n_kv_heads * B, sizeof(float *));
    c->victim_buf = calloc((size_t)B, sizeof(int));
    c->score_buf = calloc((size_t)B, sizeof(double));
    if (spec->pos == POS_CACHE) c->rope_cs = calloc((size_t)B * hd, sizeof(float));
    c->rope_t = calloc((size_t)hd, sizeof(float));
    c->rope_t_pos = -1;
    if (!c->arena || !c->lanes || !c->scores || !c->agg || !c->mean || !c->kbuf || !c->ktbuf || !c->vbuf || !c->qbuf
        || !c->vptr
        || !c->victim_buf || !c->score_buf
        || (spec->pos == POS_CACHE && !c->rope_cs) || !c->rope_t) {
        size_t want = c->arena_bytes;
        kv_cache_free(c);
        return errorf(err, errlen, "cannot allocate the KV cache of '%s': %d slot%s per lane x %d lanes = %.2f GiB; "
                      "use a smaller -c or budget", spec->text, B, B == 1 ? "" : "s", n_lanes, want / 1073741824.0);
    }
    if (c->rope_cs)
        for (int i = 0; i < B; i++) rope_cs(c->rope_cs + (size_t)i * hd, shape, i);
    uint8_t *p = c->arena;
#define CARVE(ptr, type, bytes) do { (ptr) = (type)(void *)p; p += align16(bytes); } while (0)
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        CARVE(ln->pos, int32_t *, (size_t)B * sizeof(int32_t));
        CARVE(ln->live, int *, (size_t)B * sizeof(int));
        CARVE(ln->free_q, int *, (size_t)(B - R) * sizeof(int));
        CARVE(ln->free_r, int *, (size_t)R * sizeof(int));
        CARVE(ln->kres, float *, (size_t)R * hd * sizeof(float));
        CARVE(ln->vres, float *, (size_t)R * hd * sizeof(float));
        CARVE(ln->meta, uint8_t *, (size_t)B * c->meta_bytes);
        CARVE(ln->k, uint8_t *, (size_t)(B - R) * c->k_bytes);
        CARVE(ln->v, uint8_t *, (size_t)(B - R) * c->v_bytes);
    }
#undef CARVE
    c->policy.lanes = c->lanes;
    kv_cache_reset(c);
    return 0;
}

void kv_cache_reset(KVCache *c) {
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads, B = c->budget, R = c->residual;
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        ln->n_live = 0;
        ln->n_free_q = B - R;
        ln->n_free_r = R;
        for (int s = 0; s < B; s++) ln->pos[s] = -1;
        for (int s = 0; s < B - R; s++) ln->free_q[s] = B - R - 1 - s;   /* pop order 0, 1, 2, ... */
        for (int s = 0; s < R; s++) ln->free_r[s] = B - 1 - s;
        memset(ln->meta, 0, (size_t)B * c->meta_bytes);
    }
    if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_RESET, -1, -1, -1, -1, -1, NULL, NULL);
    c->policy.prompt_len = 0;
    if (c->policy.ops && c->policy.ops->reset) c->policy.ops->reset(&c->policy);
    c->live_bytes = 0;
}

void kv_cache_free(KVCache *c) {
    if (c->policy.ops && c->policy.ops->free) c->policy.ops->free(&c->policy);
    free(c->arena); free(c->lanes); free(c->scores); free(c->agg); free(c->mean); free(c->kbuf); free(c->ktbuf);
    free(c->vbuf); free(c->qbuf); free(c->vptr);
    free(c->chunk_cs);
    free(c->rope_cs); free(c->rope_t); free(c->victim_buf); free(c->score_buf);
    memset(c, 0, sizeof *c);
}

/* cos, sin of position t (head_dim/2, 2), computed once per step for every layer, key and query; a position of the
 * chunk kv_attend_chunk last tabled comes from that table (a chunk's layers visit its positions in turn). */
const float *kv_rope_at(KVCache *c, int t) {
    if (t >= c->chunk_cs_pos0 && t < c->chunk_cs_pos0 + c->chunk_cs_n)
        return c->chunk_cs + (size_t)(t - c->chunk_cs_pos0) * c->shape.head_dim;
    if (c->rope_t_pos != t) { rope_cs(c->rope_t, &c->shape, t); c->rope_t_pos = t; }
    return c->rope_t;
}

void kv_set_prompt_len(KVCache *c, int n_tokens) { c->policy.prompt_len = n_tokens > 0 ? n_tokens : 0; }

/* Free n slots of lane (l, g) chosen by the policy, reporting each to the eviction log, then drop them from the live
 * list in one pass (so freeing many at once, as snapkv does, stays linear). */
static void lane_free(KVCache *c, int l, int g, KVLane *ln, const int *slots, const double *score, int n, int t) {
    int Q = c->budget - c->residual;
    for (int j = 0; j < n; j++) {
        int s = slots[j];
        if (s < 0 || s >= c->budget || ln->pos[s] < 0) {
            /* a policy bug, never an input error: stop before the lists are corrupted */
            fprintf(stderr, "kv: policy '%s' freed slot %d of layer %d kv head %d, which is not live\n",
                    c->spec.name, s, l, g);
            abort();
        }
        if (c->on_evict) c->on_evict(c->evict_ctx, t, l, g, ln->pos[s], score[j], c->policy.ops->reason);
        ln->pos[s] = -1;
        if (s < Q) ln->free_q[ln->n_free_q++] = s;
        else ln->free_r[ln->n_free_r++] = s;
        c->live_bytes -= token_bytes(c, s >= Q);
        c->n_evictions++;
    }
    int w = 0;
    for (int i = 0; i < ln->n_live; i++) {
        int s = ln->live[i];
        if (ln->pos[s] >= 0) ln->live[w++] = s;
        else if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_FREE, l * c->shape.n_kv_heads + g, s, -1, i, -1, NULL, NULL);
    }
    ln->n_live = w;
}

/* A free slot for a new token: an f32 slot when there is a residual region (moving its oldest token to the typed
 * region first when it is full), else a typed slot. The lane holds at most budget-1 tokens here. */
static int lane_take_slot(KVCache *c, KVLane *ln, int lane) {
    int R = c->residual, Q = c->budget - R, hd = c->shape.head_dim;
    if (R == 0) return ln->free_q[--ln->n_free_q];
    if (ln->n_free_r == 0) {
        int i = ln->n_live - R;                 /* the R f32 tokens are the newest, the last R of the live list */
        int from = ln->live[i], to = ln->free_q[--ln->n_free_q], row = from - Q;
        kv_encode(ln->k + (size_t)to * c->k_bytes, c->spec.ktype, ln->kres + (size_t)row * hd, hd);
        kv_encode(ln->v + (size_t)to * c->v_bytes, c->spec.vtype, ln->vres + (size_t)row * hd, hd);
        ln->pos[to] = ln->pos[from];
        ln->pos[from] = -1;
        memcpy(ln->meta + (size_t)to * c->meta_bytes, ln->meta + (size_t)from * c->meta_bytes, c->meta_bytes);
        ln->live[i] = to;
        ln->free_r[ln->n_free_r++] = from;
        if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_MOVE, lane, to, from, i, ln->pos[to], NULL, NULL);
        c->live_bytes = c->live_bytes - token_bytes(c, 1) + token_bytes(c, 0);
    }
    return ln->free_r[--ln->n_free_r];
}

int kv_append(KVCache *c, int l, int t, const float *k, const float *v) {
    const KVShape *s = &c->shape;
    const KVPolicyOps *ops = c->policy.ops;
    int hd = s->head_dim, Q = c->budget - c->residual;
    float tmp[hd];
    for (int g = 0; g < s->n_kv_heads; g++) {
        int lane = l * s->n_kv_heads + g;
        KVLane *ln = &c->lanes[lane];
        /* step 1: evict when full */
        if (ln->n_live >= c->budget) {
            int n = ops->victims ? ops->victims(&c->policy, lane, ln, t, c->victim_buf, c->budget, c->score_buf) : 0;
            if (n <= 0) return -1;
            lane_free(c, l, g, ln, c->victim_buf, c->score_buf, n, t);
        }
        /* step 2: store */
        int slot = lane_take_slot(c, ln, lane);
        memcpy(tmp, k + (size_t)g * hd, (size_t)hd * sizeof(float));
        if (c->spec.pos == POS_ORIG) kv_rope_apply(tmp, s, kv_rope_at(c, t));
        if (slot < Q) {
            kv_encode(ln->k + (size_t)slot * c->k_bytes, c->spec.ktype, tmp, hd);
            kv_encode(ln->v + (size_t)slot * c->v_bytes, c->spec.vtype, v + (size_t)g * hd, hd);
        } else {
            memcpy(ln->kres + (size_t)(slot - Q) * hd, tmp, (size_t)hd * sizeof(float));
            memcpy(ln->vres + (size_t)(slot - Q) * hd, v + (size_t)g * hd, (size_t)hd * sizeof(float));
        }
        ln->pos[slot] = t;
        ln->live[ln->n_live++] = slot;
        c->live_bytes += token_bytes(c, slot >= Q);
        if (c->live_bytes > c->peak_live_bytes) c->peak_live_bytes = c->live_bytes;
        if (ln->n_live > ln->peak_live) ln->peak_live = ln->n_live;
        memset(ln->meta + (size_t)slot * c->meta_bytes, 0, c->meta_bytes);
        if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_STORE, lane, slot, -1, ln->n_live - 1, t, k + (size_t)g * hd,
                                  v + (size_t)g * hd);
        if (ops->on_insert) ops->on_insert(&c->policy, lane, ln, slot, t);
    }
    return 0;
}

int kv_set_backend(KVCache *c, KVBackend b) {
    if (c->device || (b != KV_BACKEND_FAST && b != KV_BACKEND_REF)) return -1;
    c->backend = b;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Step 3 by its definition (kv.h, kv_attend_ref): plain loops in the plainest order, no SIMD, no threads. The fast
 * paths (attn_cpu.c, attn.cu) are tested against it within a bound derived from f32 rounding (tests/attn_ref_check.h).
 * ------------------------------------------------------------------------------------------------------------- */

void kv_attend_ref(KVCache *c, float *out, int l, int t, const float *q) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    float scale = 1.0f / sqrtf((float)hd), qr[hd], kx[hd], vx[hd];
    for (int h = 0; h < s->n_heads; h++) {
        const KVLane *ln = &c->lanes[l * s->n_kv_heads + h / group];   /* the query head's GQA lane */
        int n = ln->n_live;
        float *p = c->scores + (size_t)h * c->budget, *o = out + (size_t)h * hd, mx = -INFINITY, sum = 0;
        /* the query rotated by its position t (pos=orig) or by its lane's newest rank n-1 (pos=cache) */
        memcpy(qr, q + (size_t)h * hd, (size_t)hd * sizeof(float));
        kv_rope(qr, s, c->spec.pos == POS_CACHE ? n - 1 : t);
        /* scores (q·k_i)/√head_dim over the live ranks, k_i decoded and rotated as kv_lane_key says; d in order */
        for (int i = 0; i < n; i++) {
            const float *k = kv_lane_key(c, ln, i, kx);
            float dot = 0;
            for (int d = 0; d < hd; d++) dot += qr[d] * k[d];
            p[i] = dot * scale;
            mx = p[i] > mx ? p[i] : mx;
        }
        /* softmax, max subtracted (every exponent <= 0, the largest term 1 so sum >= 1); sums in rank order */
        for (int i = 0; i < n; i++) { p[i] = expf(p[i] - mx); sum += p[i]; }
        for (int i = 0; i < n; i++) p[i] /= sum;
        /* out = Σ_i p_i·v_i, i in rank order */
        for (int d = 0; d < hd; d++) o[d] = 0;
        for (int i = 0; i < n; i++) {
            const float *v = kv_lane_value(c, ln, i, vx);
            for (int d = 0; d < hd; d++) o[d] += p[i] * v[d];
        }
    }
    kv_attend_policy(c, l, t);
}

void kv_attend_policy(KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    int n_kv = c->shape.n_kv_heads, group = c->shape.n_heads / n_kv, budget = c->budget;
    /* what this token's attention at layer l read: every live slot of the layer's lanes (before any prune) */
    for (int g = 0; g < n_kv; g++) c->bytes_read += lane_bytes(c, &c->lanes[l * n_kv + g]).vec_live;
    if (l == 0) c->steps_read++;
    /* step 4: show the policy the group's probabilities: agg= (mean or max) and the mean (thresholds use it) */
    if (ops->on_attend)
        for (int g = 0; g < n_kv; g++) {
            KVLane *ln = &c->lanes[l * n_kv + g];
            float *agg = c->agg + (size_t)g * budget, *mean = c->mean + (size_t)g * budget;
            for (int i = 0; i < ln->n_live; i++) {
                float sum = 0, mx = 0;
                for (int hh = 0; hh < group; hh++) {
                    float p = c->scores[(size_t)(g * group + hh) * budget + i];
                    sum += p;
                    mx = hh == 0 ? p : fmaxf(mx, p);
                }
                mean[i] = sum / group;
                agg[i] = c->spec.agg == AGG_MAX ? mx : mean[i];
            }
            ops->on_attend(&c->policy, l * n_kv + g, ln, agg, c->spec.agg == AGG_MAX ? mean : agg, t);
        }
    if (ops->on_layer_done) ops->on_layer_done(&c->policy, l, t);
    if (ops->prune) {
        for (int g = 0; g < n_kv; g++) {
            KVLane *ln = &c->lanes[l * n_kv + g];
            int n = ops->prune(&c->policy, l * n_kv + g, ln, t, c->victim_buf, c->budget, c->score_buf);
            if (n > 0) lane_free(c, l, g, ln, c->victim_buf, c->score_buf, n, t);
        }
    }
}

int kv_capacity(const KVCache *c) { return c->policy.ops->evicts ? INT_MAX : c->budget; }

void kv_describe(const KVCache *c, char *buf, size_t len) {
    char pol[160] = "";
    if (c->policy.ops->describe) c->policy.ops->describe(&c->policy, pol, sizeof pol);
    snprintf(buf, len, "%s budget %d%s%s, %d slot%s per lane, k %s v %s, residual %d, pos %s, agg %s", c->spec.name,
             c->policy.budget, *pol ? " " : "", pol, c->budget, c->budget == 1 ? "" : "s", kv_type_names[c->spec.ktype],
             kv_type_names[c->spec.vtype], c->residual, c->spec.pos == POS_CACHE ? "cache" : "orig",
             c->spec.agg == AGG_MAX ? "max" : "mean");
}

int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    int n = ln->n_live < max ? ln->n_live : max;
    for (int i = 0; i < n; i++) positions[i] = ln->pos[ln->live[i]];
    return n;
}
