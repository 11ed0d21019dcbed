/* kv.c: the KV cache (lanes of slots, storage types, RoPE by position mode), its memory accounting, the -kv spec
 * parser, and kv_attend_cpu, the reference attention every other path is checked against.
 * It knows no policy: eviction decisions come through the KVPolicyOps table (kv.h, policies.c).
 * It deliberately does not batch several sequences or several query tokens: one token, one layer at a time.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget (slots per lane). Indices: l layer, h query head,
 * g kv head, t position, s slot, i rank in a lane's live list.
 */
#include "kv.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

const char *const kv_type_names[KV_NTYPES] = {"f32", "f16", "bf16", "q8", "q4"};

static int errorf(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Storage types. q8 and q4 quantize a vector in groups of G = gcd(head_dim, 32) elements, as llama.cpp's Q8_0 and
 * Q4_1 do with G = 32 (ggml-common.h): q8 stores an f16 scale d = max|x|/127 and G int8 values q = round(x/d);
 * q4 stores an f16 scale d = (max-min)/15, an f16 minimum m, and G 4-bit values q = round((x-m)/d), two per byte
 * (element j low nibble, element j+G/2 high nibble, Q4_1's order). An all-zero group has d = 0 and decodes to zeros.
 * ------------------------------------------------------------------------------------------------------------- */

static int gcd_int(int a, int b) { while (b) { int t = a % b; a = b; b = t; } return a; }
static int kv_group(int head_dim) { return gcd_int(head_dim, 32); }

size_t kv_vector_bytes(KVType ty, int head_dim) {
    int G = kv_group(head_dim), n_groups = head_dim / G;
    switch (ty) {
    case KV_F32: return (size_t)head_dim * 4;
    case KV_F16: case KV_BF16: return (size_t)head_dim * 2;
    case KV_Q8: return (size_t)n_groups * (2 + G);
    case KV_Q4: return (size_t)n_groups * (4 + G / 2);
    default: return 0;
    }
}

/* Encode x (head_dim) into dst (kv_vector_bytes(ty) bytes). */
static void kv_encode(uint8_t *dst, KVType ty, const float *x, int head_dim) {
    int G = kv_group(head_dim);
    switch (ty) {
    case KV_F32: memcpy(dst, x, (size_t)head_dim * 4); break;
    case KV_F16: for (int i = 0; i < head_dim; i++) { uint16_t h = kv_f32_to_f16(x[i]); memcpy(dst + 2 * i, &h, 2); } break;
    case KV_BF16: for (int i = 0; i < head_dim; i++) { uint16_t h = kv_f32_to_bf16(x[i]); memcpy(dst + 2 * i, &h, 2); } break;
    case KV_Q8:
        for (int g0 = 0; g0 < head_dim; g0 += G, dst += 2 + G) {
            float amax = 0;
            for (int j = 0; j < G; j++) amax = fmaxf(amax, fabsf(x[g0 + j]));
            uint16_t dh = kv_f32_to_f16(amax / 127.0f);
            float d = kv_f16_to_f32(dh);   /* quantize with the scale as it will be read back */
            memcpy(dst, &dh, 2);
            for (int j = 0; j < G; j++) {
                float q = d > 0 ? roundf(x[g0 + j] / d) : 0.0f;
                q = fminf(127.0f, fmaxf(-127.0f, q));
                dst[2 + j] = (uint8_t)(int8_t)q;
            }
        }
        break;
    case KV_Q4:
        for (int g0 = 0; g0 < head_dim; g0 += G, dst += 4 + G / 2) {
            float mn = x[g0], mx = x[g0];
            for (int j = 1; j < G; j++) { mn = fminf(mn, x[g0 + j]); mx = fmaxf(mx, x[g0 + j]); }
            uint16_t dh = kv_f32_to_f16((mx - mn) / 15.0f), mh = kv_f32_to_f16(mn);
            float d = kv_f16_to_f32(dh), m = kv_f16_to_f32(mh);
            memcpy(dst, &dh, 2);
            memcpy(dst + 2, &mh, 2);
            for (int j = 0; j < G / 2; j++) {
                int q[2];
                for (int half = 0; half < 2; half++) {
                    float v = d > 0 ? roundf((x[g0 + j + half * G / 2] - m) / d) : 0.0f;
                    q[half] = (int)fminf(15.0f, fmaxf(0.0f, v));
                }
                dst[4 + j] = (uint8_t)(q[0] | (q[1] << 4));
            }
        }
        break;
    default: break;
    }
}

/* Decode src into x (head_dim f32). */
static void kv_decode(float *x, KVType ty, const uint8_t *src, int head_dim) {
    int G = kv_group(head_dim);
    uint16_t h;
    switch (ty) {
    case KV_F32: memcpy(x, src, (size_t)head_dim * 4); break;
    case KV_F16: for (int i = 0; i < head_dim; i++) { memcpy(&h, src + 2 * i, 2); x[i] = kv_f16_to_f32(h); } break;
    case KV_BF16: for (int i = 0; i < head_dim; i++) { memcpy(&h, src + 2 * i, 2); x[i] = kv_bf16_to_f32(h); } break;
    case KV_Q8:
        for (int g0 = 0; g0 < head_dim; g0 += G, src += 2 + G) {
            memcpy(&h, src, 2);
            float d = kv_f16_to_f32(h);
            for (int j = 0; j < G; j++) x[g0 + j] = d * (float)(int8_t)src[2 + j];
        }
        break;
    case KV_Q4:
        for (int g0 = 0; g0 < head_dim; g0 += G, src += 4 + G / 2) {
            uint16_t mh;
            memcpy(&h, src, 2);
            memcpy(&mh, src + 2, 2);
            float d = kv_f16_to_f32(h), m = kv_f16_to_f32(mh);
            for (int j = 0; j < G / 2; j++) {
                x[g0 + j] = d * (float)(src[4 + j] & 15) + m;
                x[g0 + j + G / 2] = d * (float)(src[4 + j] >> 4) + m;
            }
        }
        break;
    default: break;
    }
}

int kv_type_parse(const char *s) {
    for (int i = 0; i < KV_NTYPES; i++) if (strcmp(s, kv_type_names[i]) == 0) return i;
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * RoPE
 * ------------------------------------------------------------------------------------------------------------- */

void kv_rope(float *x, const KVShape *s, int pos) {
    int half = s->head_dim / 2;
    for (int i = 0; i < half; i++) {
        /* computed in double so the angle of a large position keeps its precision; the same code serves every path */
        double freq = pow((double)s->rope_theta, -2.0 * i / s->head_dim);
        if (s->rope_factors) freq /= s->rope_factors[i];
        double a = pos * freq;
        float c = (float)cos(a), sn = (float)sin(a);
        int i0 = s->rope_pairing ? i : 2 * i, i1 = s->rope_pairing ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1];
        x[i0] = x0 * c - x1 * sn;
        x[i1] = x0 * sn + x1 * c;
    }
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

int kv_spec_parse(KVSpec *sp, const char *text, KVType default_type, char *err, size_t errlen) {
    memset(sp, 0, sizeof *sp);
    sp->ktype = sp->vtype = default_type;
    if (strlen(text) >= sizeof sp->text) return errorf(err, errlen, "kv spec '%.40s...' is too long", text);
    strcpy(sp->text, text);
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
    if (colon && parse_budget(colon + 1, &sp->budget, &sp->budget_bytes))
        return errorf(err, errlen, "bad budget '%s' in '%s': give tokens per lane (1024) or bytes (64MiB, 512KiB, "
                      "1GiB, 4096B)", colon + 1, text);
    if (colon && sp->budget == 0 && sp->budget_bytes == 0)
        return errorf(err, errlen, "budget 0 in '%s': a lane needs at least one slot", text);
    int type_set = 0;
    while ((part = strtok_r(NULL, ",", &save))) {
        char *eq = strchr(part, '=');
        if (!eq || eq == part || !eq[1])
            return errorf(err, errlen, "bad option '%s' in '%s': options are key=value", part, text);
        *eq = 0;
        const char *key = part, *val = eq + 1;
        if (!strcmp(key, "type") || !strcmp(key, "ktype") || !strcmp(key, "vtype")) {
            int ty = kv_type_parse(val);
            if (ty < 0) return errorf(err, errlen, "unknown storage type %s=%s in '%s'; types: " TYPE_CHOICES,
                                      key, val, text);
            if (key[0] != 'v') sp->ktype = (KVType)ty;
            if (key[0] != 'k') sp->vtype = (KVType)ty;
            if (!strcmp(key, "type")) type_set = 1;
            else if (type_set) return errorf(err, errlen, "'%s' conflicts with type= in '%s'", key, text);
        } else if (!strcmp(key, "residual")) {
            char *end;
            long r = strtol(val, &end, 10);
            if (*end || end == val || r < 0 || r > 1 << 24)
                return errorf(err, errlen, "bad residual=%s in '%s': a token count >= 0", val, text);
            sp->residual = (int)r;
        } else if (!strcmp(key, "pos")) {
            if (!strcmp(val, "orig")) sp->pos = POS_ORIG;
            else if (!strcmp(val, "cache")) sp->pos = POS_CACHE;
            else return errorf(err, errlen, "unknown pos=%s in '%s'; choices: orig, cache", val, text);
        } else if (!strcmp(key, "agg")) {
            if (!strcmp(val, "mean")) sp->agg = AGG_MEAN;
            else if (!strcmp(val, "max")) sp->agg = AGG_MAX;
            else return errorf(err, errlen, "unknown agg=%s in '%s'; choices: mean, max", val, text);
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
    }
    return 0;
}

const char *kv_spec_get(KVSpec *sp, const char *key) {
    for (int i = 0; i < sp->n_params; i++)
        if (!strcmp(sp->keys[i], key)) { sp->used[i] = 1; return sp->vals[i]; }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The cache
 * ------------------------------------------------------------------------------------------------------------- */

/* Per-lane bytes of everything but the vectors: positions, live list, free list, residual f32 copies, policy
 * metadata. */
static size_t lane_meta_bytes(const KVShape *s, const KVSpec *sp, size_t policy_bytes_per_slot, int budget) {
    size_t per_slot = sizeof(int32_t) /* pos */ + sizeof(int) /* live */ + sizeof(int) /* free */ + policy_bytes_per_slot;
    return (size_t)budget * per_slot + (size_t)sp->residual * s->head_dim * 4 * 2;
}

static size_t lane_vec_bytes(const KVShape *s, const KVSpec *sp, int budget) {
    return (size_t)budget * (kv_vector_bytes(sp->ktype, s->head_dim) + kv_vector_bytes(sp->vtype, s->head_dim));
}

size_t kv_alloc_bytes_for(const KVShape *s, const KVSpec *sp, const KVPolicyOps *ops, int budget) {
    /* a policy's metadata per slot depends only on the policy, not its state (kv.h), so no init is needed here */
    size_t pol = ops && ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(NULL) : 0;
    size_t lanes = (size_t)s->n_layers * s->n_kv_heads;
    return lanes * (lane_vec_bytes(s, sp, budget) + lane_meta_bytes(s, sp, pol, budget));
}

int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    c->shape = *shape;
    c->spec = *spec;
    const KVPolicyOps *ops = kv_policy_find(spec->name);
    if (!ops) return errorf(err, errlen, "unknown kv policy '%s'; policies: %s", spec->name, kv_policy_names());
    if (shape->head_dim % 2) return errorf(err, errlen, "head_dim %d is odd: RoPE needs pairs", shape->head_dim);
    int budget = spec->budget;
    if (spec->budget_bytes) {
        /* the largest token budget whose allocated bytes fit (allocation grows with the budget) */
        int lo = 0, hi = shape->seq_len > 0 ? 1 << 24 : 0;
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
    if (spec->residual > budget)
        return errorf(err, errlen, "residual=%d in '%s' exceeds the budget of %d tokens", spec->residual, spec->text, budget);
    c->budget = budget;
    c->policy.ops = ops;
    c->policy.spec = &c->spec;
    c->policy.budget = budget;
    c->policy.n_lanes = shape->n_layers * shape->n_kv_heads;
    c->policy.n_kv_heads = shape->n_kv_heads;
    c->policy.agg = spec->agg;
    if (ops->init && ops->init(&c->policy, &c->spec, shape, budget, err, errlen)) return -1;
    for (int i = 0; i < c->spec.n_params; i++)
        if (!c->spec.used[i]) {
            errorf(err, errlen, "'%s' takes no option '%s' (in '%s'); every policy takes type, ktype, vtype, "
                   "residual, pos, agg", spec->name, c->spec.keys[i], spec->text);
            kv_cache_free(c);
            return -1;
        }

    int hd = shape->head_dim, n_lanes = c->policy.n_lanes, R = spec->residual;
    c->k_bytes = kv_vector_bytes(spec->ktype, hd);
    c->v_bytes = kv_vector_bytes(spec->vtype, hd);
    /* one arena for every lane: pos, live, free lists, K, V, residual copies */
    size_t per_lane = (size_t)budget * (sizeof(int32_t) + 2 * sizeof(int)) + (size_t)budget * (c->k_bytes + c->v_bytes)
                      + (size_t)R * hd * 2 * sizeof(float) + 64;
    c->arena_bytes = per_lane * n_lanes;
    c->arena = calloc(1, c->arena_bytes);
    c->lanes = calloc((size_t)n_lanes, sizeof(KVLane));
    c->scores = calloc((size_t)shape->n_heads * budget, sizeof(float));
    c->agg = calloc((size_t)budget, sizeof(float));
    c->kbuf_rows = budget;
    c->kbuf = calloc((size_t)shape->n_kv_heads * budget * hd, sizeof(float));
    if (!c->arena || !c->lanes || !c->scores || !c->agg || !c->kbuf) {
        kv_cache_free(c);
        return errorf(err, errlen, "out of memory for a KV cache of %d slots per lane (%zu bytes)", budget, c->arena_bytes);
    }
    uint8_t *p = c->arena;
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        ln->pos = (int32_t *)p; p += (size_t)budget * sizeof(int32_t);
        ln->live = (int *)p; p += (size_t)budget * sizeof(int);
        ln->free_slots = (int *)p; p += (size_t)budget * sizeof(int);
        ln->k = p; p += (size_t)budget * c->k_bytes;
        ln->v = p; p += (size_t)budget * c->v_bytes;
        p = (uint8_t *)(((uintptr_t)p + 15) & ~(uintptr_t)15);
        ln->kres = R ? (float *)p : NULL; p += (size_t)R * hd * sizeof(float);
        ln->vres = R ? (float *)p : NULL; p += (size_t)R * hd * sizeof(float);
        p = (uint8_t *)(((uintptr_t)p + 15) & ~(uintptr_t)15);
    }
    kv_cache_reset(c);
    return 0;
}

void kv_cache_reset(KVCache *c) {
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads;
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        ln->n_live = 0;
        ln->n_free = c->budget;
        for (int s = 0; s < c->budget; s++) {
            ln->pos[s] = -1;
            ln->free_slots[s] = c->budget - 1 - s;   /* pop order 0, 1, 2, ... */
        }
    }
    if (c->policy.ops && c->policy.ops->reset) c->policy.ops->reset(&c->policy);
    c->peak_live_bytes = 0;
}

void kv_cache_free(KVCache *c) {
    if (c->policy.ops && c->policy.ops->free) c->policy.ops->free(&c->policy);
    free(c->arena); free(c->lanes); free(c->scores); free(c->agg); free(c->kbuf);
    memset(c, 0, sizeof *c);
}

static void lane_remove(KVLane *ln, int slot) {
    int i = 0;
    while (i < ln->n_live && ln->live[i] != slot) i++;
    if (i == ln->n_live) return;
    memmove(ln->live + i, ln->live + i + 1, (size_t)(ln->n_live - i - 1) * sizeof(int));
    ln->n_live--;
    ln->pos[slot] = -1;
    ln->free_slots[ln->n_free++] = slot;
}

int kv_append(KVCache *c, int l, int t, const float *k, const float *v) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, R = c->spec.residual;
    float tmp[hd];
    for (int g = 0; g < s->n_kv_heads; g++) {
        int lane = l * s->n_kv_heads + g;
        KVLane *ln = &c->lanes[lane];
        /* step 1: evict when full */
        if (ln->n_live == c->budget) {
            int victims[64];
            double score[64];
            int n = c->policy.ops->victims ? c->policy.ops->victims(&c->policy, lane, ln, t, victims, 64, score) : 0;
            if (n <= 0) return -1;
            for (int j = 0; j < n; j++) {
                if (c->on_evict)
                    c->on_evict(c->evict_ctx, t, l, g, ln->pos[victims[j]], score[j], c->spec.name);
                lane_remove(ln, victims[j]);
                c->n_evictions++;
            }
        }
        /* step 2: store */
        int slot = ln->free_slots[--ln->n_free];
        memcpy(tmp, k + (size_t)g * hd, (size_t)hd * sizeof(float));
        if (c->spec.pos == POS_ORIG) kv_rope(tmp, s, t);
        kv_encode(ln->k + (size_t)slot * c->k_bytes, c->spec.ktype, tmp, hd);
        kv_encode(ln->v + (size_t)slot * c->v_bytes, c->spec.vtype, v + (size_t)g * hd, hd);
        if (R) {
            memcpy(ln->kres + (size_t)(t % R) * hd, tmp, (size_t)hd * sizeof(float));
            memcpy(ln->vres + (size_t)(t % R) * hd, v + (size_t)g * hd, (size_t)hd * sizeof(float));
        }
        ln->pos[slot] = t;
        ln->live[ln->n_live++] = slot;
        if (ln->n_live > ln->peak_live) ln->peak_live = ln->n_live;
        if (c->policy.ops->on_insert) c->policy.ops->on_insert(&c->policy, lane, slot, t);
    }
    size_t live = kv_bytes(c).total_live;
    if (live > c->peak_live_bytes) c->peak_live_bytes = live;
    return 0;
}

/* The f32 key (rotated as the position mode says) of the lane's i-th live slot, written to x. Residual copies are
 * read for the newest R positions (t - R < pos <= t). */
static const float *lane_key(const KVCache *c, const KVLane *ln, int i, int t, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim, R = c->spec.residual, p = ln->pos[slot];
    const float *src;
    if (R && p > t - R) src = ln->kres + (size_t)(p % R) * hd;
    else if (c->spec.ktype == KV_F32) src = (const float *)(ln->k + (size_t)slot * c->k_bytes);
    else { kv_decode(x, c->spec.ktype, ln->k + (size_t)slot * c->k_bytes, hd); src = x; }
    if (c->spec.pos == POS_CACHE) {
        if (src != x) memcpy(x, src, (size_t)hd * sizeof(float));
        kv_rope(x, &c->shape, i);
        return x;
    }
    return src;
}

static const float *lane_value(const KVCache *c, const KVLane *ln, int i, int t, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim, R = c->spec.residual, p = ln->pos[slot];
    if (R && p > t - R) return ln->vres + (size_t)(p % R) * hd;
    if (c->spec.vtype == KV_F32) return (const float *)(ln->v + (size_t)slot * c->v_bytes);
    kv_decode(x, c->spec.vtype, ln->v + (size_t)slot * c->v_bytes, hd);
    return x;
}

void kv_attend_cpu(KVCache *c, float *out, int l, int t, const float *q) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, n_kv = s->n_kv_heads, group = s->n_heads / n_kv, budget = c->budget;
    float scale = 1.0f / sqrtf((float)hd);
    /* lanes are independent: any thread count gives the same bits */
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < n_kv; g++) {
        const KVLane *ln = &c->lanes[l * n_kv + g];
        int n = ln->n_live;
        float *keys = c->kbuf + (size_t)g * c->kbuf_rows * hd;   /* (n, hd) f32 keys, when not read in place */
        float qh[hd], vtmp[hd];
        for (int hh = 0; hh < group; hh++) {
            int h = g * group + hh;
            float *sc = c->scores + (size_t)h * budget;
            memcpy(qh, q + (size_t)h * hd, (size_t)hd * sizeof(float));
            kv_rope(qh, s, c->spec.pos == POS_CACHE ? n - 1 : t);
            float mx = -INFINITY;
            for (int i = 0; i < n; i++) {
                const float *k = hh == 0 ? lane_key(c, ln, i, t, keys + (size_t)i * hd) : keys + (size_t)i * hd;
                if (hh == 0 && k != keys + (size_t)i * hd) memcpy(keys + (size_t)i * hd, k, (size_t)hd * sizeof(float));
                float dot = 0;
                for (int d = 0; d < hd; d++) dot += qh[d] * k[d];
                sc[i] = dot * scale;
                if (sc[i] > mx) mx = sc[i];
            }
            float sum = 0;
            for (int i = 0; i < n; i++) { sc[i] = expf(sc[i] - mx); sum += sc[i]; }
            float inv = 1.0f / sum;
            for (int i = 0; i < n; i++) sc[i] *= inv;
        }
        /* out_h = Σ_i p_hi v_i, each value decoded once for the whole group */
        for (int hh = 0; hh < group; hh++) memset(out + (size_t)(g * group + hh) * hd, 0, (size_t)hd * sizeof(float));
        for (int i = 0; i < n; i++) {
            const float *v = lane_value(c, ln, i, t, vtmp);
            for (int hh = 0; hh < group; hh++) {
                int h = g * group + hh;
                float p = c->scores[(size_t)h * budget + i], *o = out + (size_t)h * hd;
                for (int d = 0; d < hd; d++) o[d] += p * v[d];
            }
        }
    }
    /* step 4: show the policy the group's probabilities */
    if (!c->policy.ops->on_attend) return;
    for (int g = 0; g < n_kv; g++) {
        const KVLane *ln = &c->lanes[l * n_kv + g];
        for (int i = 0; i < ln->n_live; i++) {
            float a = 0;
            for (int hh = 0; hh < group; hh++) {
                float p = c->scores[(size_t)(g * group + hh) * budget + i];
                if (c->spec.agg == AGG_MAX) a = hh == 0 ? p : fmaxf(a, p);
                else a += p;
            }
            c->agg[i] = c->spec.agg == AGG_MAX ? a : a / group;
        }
        c->policy.ops->on_attend(&c->policy, l * n_kv + g, ln, c->agg, t);
    }
    if (c->policy.ops->on_layer_done) c->policy.ops->on_layer_done(&c->policy, l, t);
}

KVBytes kv_bytes(const KVCache *c) {
    KVBytes b = {0};
    const KVShape *s = &c->shape;
    int n_lanes = s->n_layers * s->n_kv_heads;
    size_t pol = c->policy.ops && c->policy.ops->meta_bytes_per_slot ? c->policy.ops->meta_bytes_per_slot(&c->policy) : 0;
    size_t vec_slot = c->k_bytes + c->v_bytes;
    size_t meta_slot = sizeof(int32_t) + 2 * sizeof(int) + pol;
    size_t res = (size_t)c->spec.residual * s->head_dim * 4 * 2;
    for (int i = 0; i < n_lanes; i++) {
        int live = c->lanes[i].n_live;
        b.vec_live += (size_t)live * vec_slot;
        b.meta_live += (size_t)live * meta_slot + (live < c->spec.residual ? (size_t)live : (size_t)c->spec.residual)
                       * s->head_dim * 4 * 2;
    }
    b.vec_alloc = (size_t)n_lanes * c->budget * vec_slot;
    b.meta_alloc = (size_t)n_lanes * ((size_t)c->budget * meta_slot + res);
    b.total_alloc = b.vec_alloc + b.meta_alloc;
    b.total_live = b.vec_live + b.meta_live;
    b.peak_live = c->peak_live_bytes > b.total_live ? c->peak_live_bytes : b.total_live;
    /* bytes per element: f32 4, f16/bf16 2, q8 1, q4 0.5; computed in eighths to stay integral */
    static const int eighths[KV_NTYPES] = {32, 16, 16, 8, 4};
    b.formula_alloc = (size_t)s->n_layers * s->n_kv_heads * s->head_dim * c->budget
                      * (eighths[c->spec.ktype] + eighths[c->spec.vtype]) / 8;
    return b;
}

int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    int n = ln->n_live < max ? ln->n_live : max;
    for (int i = 0; i < n; i++) positions[i] = ln->pos[ln->live[i]];
    return n;
}
