/* kv.c: the KV cache (lanes of slots, storage types, precision bands by age, RoPE by position mode), its memory
 * accounting, the -kv spec parser, steps 1-2 (kv_append: merge, evict, recode, store), step 3's definition
 * (kv_attend_ref, the reference every other attention path is checked against; kv_attend_select for selection
 * policies) and step 4 (kv_attend_policy), clone/restore.
 * It knows no policy: decisions come as verbs (evict, merge, select) through the KVPolicyOps table (kv.h,
 * policies.c), and kv.c carries them out.
 * It deliberately holds no fast attention: attn_cpu.c has the CPU one (kv_attend_cpu, kv_attend_chunk), attn.cu the
 * CUDA one; and it does not batch several sequences: one stream per cache.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, cap (slots of a lane), budget (the most of any lane).
 * Indices: l layer, h query head, g kv head, t position, s slot, i rank in a lane's live list.
 */
#include "kv.h"
#include "kv_codec.h"
#include "kv_impl.h"
#include "lowrank.h"
#include "pool.h"
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

const char *const kv_type_names[KV_NTYPES] = {"f32", "f16", "bf16", "q8", "q4", "q2"};

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
    case KV_Q2: encode_units(dst, KV_Q2, x, G, n); break;
    default: break;
    }
}

void kv_decode(float *x, KVType ty, const uint8_t *src, int head_dim) {
    int G = kv_group(head_dim), n = kv_codec_units(ty, head_dim, G), u = 0;
#ifdef __AVX2__
    if (head_dim % 16 == 0) { kv_decode_by16(x, ty, src, head_dim, G); return; }   /* in registers, the same bits */
#endif
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
    case KV_Q2: decode_units(x, KV_Q2, src, G, 0, n); break;
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

int kv_parse_bytes(const char *s, size_t *bytes) {
    int tokens;
    return parse_budget(s, &tokens, bytes) || *bytes == 0 ? -1 : 0;
}

#define TYPE_CHOICES "f32, f16, bf16, q8, q4, q2"
#define COMMON_KEYS "type, ktype, vtype, residual, prec, kprec, vprec, pos, agg, fast, prefetch, kgroup, kgsize, rank, " \
                    "krank, vrank, calib, alloc, safeguard (alloc=ada)"

/* fast=BYTES ("64MiB", "512KiB", "4096B", "4096") or fast=P% (0 < P <= 100, of the cache's vector bytes). 0, or -1. */
static int parse_fast(KVSpec *sp, const char *val) {
    size_t len = strlen(val);
    if (len >= sizeof sp->fast_text) return -1;
    strcpy(sp->fast_text, val);
    if (len > 1 && val[len - 1] == '%') {
        char *end;
        double p = strtod(val, &end);
        if (end != val + len - 1 || !(p > 0 && p <= 100)) return -1;
        sp->fast_frac = p / 100;
        return 0;
    }
    int tokens = 0;
    size_t bytes = 0;
    if (parse_budget(val, &tokens, &bytes)) return -1;
    sp->fast_bytes = tokens ? (size_t)tokens : bytes;   /* a plain number is bytes here */
    return sp->fast_bytes ? 0 : -1;
}

/* rank=R (keys and values), krank=R, vrank=R, calib=N (low rank). *seen: bits 1 krank, 2 vrank, 4 rank, 8 calib.
 * The rank's upper bound, head_dim, is checked by kv_cache_init (it needs the shape). 0, or -1 + message. */
static int parse_lowrank(KVSpec *sp, const char *key, const char *val, const char *text, int *seen, char *err,
                         size_t errlen) {
    int bit = !strcmp(key, "krank") ? 1 : !strcmp(key, "vrank") ? 2 : !strcmp(key, "rank") ? 4 : 8;
    char *end;
    long x = strtol(val, &end, 10);
    if (*seen & bit) return errorf(err, errlen, "option '%s' given twice in '%s'", key, text);
    if (bit == 8) {
        if (end == val || *end || x < 1 || x > 1 << 24)
            return errorf(err, errlen, "bad calib=%s in '%s': the tokens the low-rank basis is fitted on, in [1, %d]",
                          val, text, 1 << 24);
        sp->calib = (int)x;
    } else {
        if (end == val || *end || x < 1 || x > 4096)
            return errorf(err, errlen, "bad %s=%s in '%s': a rank, the coefficients kept per vector, in [1, head_dim]",
                          key, val, text);
        if ((bit == 4 && (*seen & 3)) || (bit != 4 && (*seen & 4)))
            return errorf(err, errlen, "'%s' conflicts with rank= in '%s': give rank= or krank=/vrank=", key, text);
        sp->rank_joint = bit == 4;
        if (bit != 2) sp->krank = (int)x;
        if (bit != 1) sp->vrank = (int)x;
    }
    *seen |= bit;
    return 0;
}

/* prec=T0:N0/T1:N1/.../TL (key "prec", "kprec" or "vprec"): the precision bands, newest first; every band but the
 * last gives its slots. kind: 0 keys, 1 values, 2 both. 0, or -1 + message. */
static int parse_prec(KVSpec *sp, const char *key, int kind, const char *val, const char *text, char *err,
                      size_t errlen) {
    char buf[64];
    KVType ty_of[KV_MAX_PREC];
    int slots_of[KV_MAX_PREC];
    if (strlen(val) >= sizeof buf) return errorf(err, errlen, "%s=%s in '%s' is too long", key, val, text);
    strcpy(buf, val);
    int n = 0;
    char *save = NULL;
    for (char *part = strtok_r(buf, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        if (n == KV_MAX_PREC)
            return errorf(err, errlen, "%s=%s in '%s' has more than %d bands", key, val, text, KV_MAX_PREC);
        char *colon = strchr(part, ':');
        if (colon) *colon = 0;
        int ty = kv_type_parse(part);
        if (ty < 0) return errorf(err, errlen, "unknown storage type '%s' in %s=%s ('%s'); types: " TYPE_CHOICES,
                                  part, key, val, text);
        ty_of[n] = (KVType)ty;
        slots_of[n] = 0;
        if (colon) {
            char *end;
            long x = strtol(colon + 1, &end, 10);
            if (end == colon + 1 || *end || x < 1 || x > 1 << 24)
                return errorf(err, errlen, "bad band '%s:%s' in %s=%s ('%s'): TYPE:TOKENS with tokens in [1, %d]",
                              part, colon + 1, key, val, text, 1 << 24);
            slots_of[n] = (int)x;
        }
        n++;
    }
    if (n == 0 || val[0] == '/' || val[strlen(val) - 1] == '/' || strstr(val, "//"))
        return errorf(err, errlen, "bad %s=%s in '%s': TYPE:TOKENS/.../TYPE, newest first, e.g. %s=f32:64/q8:512/q4",
                      key, val, text, key);
    for (int b = 0; b < n; b++)
        if ((b < n - 1) != (slots_of[b] > 0))
            return errorf(err, errlen, "bad %s=%s in '%s': every band but the last gives its tokens (TYPE:TOKENS), "
                          "the last takes the rest (TYPE), e.g. %s=f32:64/q8:512/q4", key, val, text, key);
    for (int which = 0; which < 2; which++) {
        if (kind != 2 && kind != which) continue;
        sp->n_prec[which] = n;
        memcpy(sp->prec_type[which], ty_of, sizeof ty_of);
        memcpy(sp->prec_slots[which], slots_of, sizeof slots_of);
        if (which == 0) sp->ktype = ty_of[n - 1]; else sp->vtype = ty_of[n - 1];
    }
    return 0;
}

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
    /* each common key once; type= and ktype=/vtype= exclude each other in either order, and prec= (kprec=,
     * vprec=) excludes the keys that give the same kind's types */
    int seen_type = 0, seen_kv = 0, seen_res = 0, seen_pos = 0, seen_agg = 0, seen_prec = 0, seen_fast = 0,
        seen_prefetch = 0, seen_kgroup = 0, seen_kgsize = 0, seen_rank = 0;
    /* seen_kv, seen_prec: bit 1 keys (ktype=, kprec=), 2 values (vtype=, vprec=), 4 both */
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
            int clash = seen_prec & (bit == 4 ? 7 : bit | 4);
            if (clash)
                return errorf(err, errlen, "'%s' conflicts with %s in '%s': it gives every band's type", key,
                              clash & 4 ? "prec=" : clash & 1 ? "kprec=" : "vprec=", text);
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
            if (seen_prec)
                return errorf(err, errlen, "residual= conflicts with %s in '%s': residual=R with type=T is "
                              "prec=f32:R/T", seen_prec & 4 ? "prec=" : seen_prec & 1 ? "kprec=" : "vprec=", text);
            sp->residual = (int)r;
            seen = &seen_res;
        } else if (!strcmp(key, "prec") || !strcmp(key, "kprec") || !strcmp(key, "vprec")) {
            int bit = key[0] == 'p' ? 4 : key[0] == 'k' ? 1 : 2;
            if (seen_type || seen_res || (bit == 4 ? seen_kv : seen_kv & bit))
                return errorf(err, errlen, "%s= conflicts with type=, %s and residual= in '%s': %s= gives every "
                              "band's type (residual=R with type=T is prec=f32:R/T)", key,
                              bit == 4 ? "ktype=, vtype=" : bit == 1 ? "ktype=" : "vtype=", text, key);
            if (seen_prec & bit) return errorf(err, errlen, "option '%s' given twice in '%s'", key, text);
            if ((bit == 4 && seen_prec) || (bit != 4 && seen_prec & 4))
                return errorf(err, errlen, "prec= conflicts with kprec= and vprec= in '%s': give prec= (keys and "
                              "values alike) or kprec=/vprec=", text);
            if (parse_prec(sp, key, bit == 4 ? 2 : bit == 1 ? 0 : 1, val, text, err, errlen)) return -1;
            seen_prec |= bit;
        } else if (!strcmp(key, "pos")) {
            if (!strcmp(val, "orig")) sp->pos = POS_ORIG;
            else if (!strcmp(val, "cache")) sp->pos = POS_CACHE;
            else return errorf(err, errlen, "unknown pos=%s in '%s'; choices: orig, cache", val, text);
            seen = &seen_pos;
        } else if (!strcmp(key, "fast")) {
            if (!seen_fast && parse_fast(sp, val))
                return errorf(err, errlen, "bad fast=%s in '%s': the fast memory tier's bytes for the whole cache "
                              "(64MiB, 512KiB, 4096B) or a share of the cache's vector bytes (25%%)", val, text);
            seen = &seen_fast;
        } else if (!strcmp(key, "prefetch")) {
            if (strcmp(val, "0") && strcmp(val, "1"))
                return errorf(err, errlen, "bad prefetch=%s in '%s': 0 or 1", val, text);
            sp->prefetch = val[0] == '1';
            seen = &seen_prefetch;
        } else if (!strcmp(key, "kgroup")) {
            if (!strcmp(val, "token")) sp->kgroup_channel = 0;
            else if (!strcmp(val, "channel")) sp->kgroup_channel = 1;
            else return errorf(err, errlen, "unknown kgroup=%s in '%s'; choices: token (keys quantized per token, the "
                               "default), channel (per channel over groups of kgsize tokens, KIVI)", val, text);
            seen = &seen_kgroup;
        } else if (!strcmp(key, "kgsize")) {
            char *end;
            long g = strtol(val, &end, 10);
            if (*end || end == val || g < 1 || g > KV_KGSIZE_MAX)
                return errorf(err, errlen, "bad kgsize=%s in '%s': tokens per key group, an integer in [1, %d]", val,
                              text, KV_KGSIZE_MAX);
            sp->kgsize = (int)g;
            seen = &seen_kgsize;
        } else if (!strcmp(key, "rank") || !strcmp(key, "krank") || !strcmp(key, "vrank") || !strcmp(key, "calib")) {
            if (parse_lowrank(sp, key, val, text, &seen_rank, err, errlen)) return -1;
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
    if (seen_kgsize && !sp->kgroup_channel)
        return errorf(err, errlen, "kgsize= in '%s' sets the tokens of a per-channel key group: it needs "
                      "kgroup=channel", text);
    if (seen_rank == 8)
        return errorf(err, errlen, "calib= in '%s' sets the span a low-rank basis is fitted on: give rank=, krank= or "
                      "vrank= with it", text);
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
    const char *pm = kv_spec_value(sp, "prompt");
    if (pm && !strcmp(pm, "dense") && !strcmp(mode, "ppl"))
        return errorf(err, errlen, "'%s': prompt=dense makes the prompt's queries read every token, but -m ppl has no "
                      "prompt, so every position would select exactly as with prompt=sparse: leave it out in ppl, or "
                      "use it in generate, chat, passkey or bench", sp->text);
    return ops && ops->check_mode ? ops->check_mode(sp, mode, err, errlen) : 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Layout and accounting. One formula serves kv_alloc_bytes_for, kv_cache_init and kv_bytes.
 * ------------------------------------------------------------------------------------------------------------- */

/* One kind's precision schedule (keys: which 0, values: 1), newest first: prec=/kprec=/vprec= as given, or
 * residual=R over the storage type (f32:R then the type, unless keys and values are both f32: the band would change
 * nothing), or the type alone. slots[b]: band b's slots, the last 0 (the rest). Returns the number of bands. */
static int kind_schedule(const KVSpec *sp, int which, KVType *ty, int *slots) {
    KVType base = which ? sp->vtype : sp->ktype;
    if (sp->n_prec[which]) {
        memcpy(ty, sp->prec_type[which], sizeof sp->prec_type[which]);
        memcpy(slots, sp->prec_slots[which], sizeof sp->prec_slots[which]);
        return sp->n_prec[which];
    }
    if (sp->residual > 0 && !(sp->ktype == KV_F32 && sp->vtype == KV_F32)) {
        ty[0] = KV_F32; slots[0] = sp->residual;
        ty[1] = base; slots[1] = 0;
        return 2;
    }
    ty[0] = base; slots[0] = 0;
    return 1;
}

/* A cache's precision bands from its spec, newest first: the union of the key and the value schedule's boundaries
 * (kind_schedule), each band the key form and the value form in force there; adjacent bands of the same forms become
 * one. want[b]: the slots band b asks for, the last band 0 (the rest). Returns the number of bands (at most
 * 2 * KV_MAX_PREC - 1). */
static int spec_bands(const KVSpec *sp, KVType *kt, KVType *vt, int *want) {
    KVType ty[2][KV_MAX_PREC];
    int slots[2][KV_MAX_PREC], idx[2] = {0, 0};   /* the last band of each kind has slots 0: end stays LONG_MAX */
    long end[2];   /* the slot count, newest first, where the current band of each kind ends; LONG_MAX: never */
    for (int w = 0; w < 2; w++) {
        kind_schedule(sp, w, ty[w], slots[w]);
        end[w] = slots[w][0] ? slots[w][0] : LONG_MAX;
    }
    int m = 0;
    long at = 0;
    for (;;) {
        long stop = end[0] < end[1] ? end[0] : end[1];
        KVType k = ty[0][idx[0]], v = ty[1][idx[1]];
        int w_slots = stop == LONG_MAX ? 0 : (int)(stop - at);
        if (m && k == kt[m - 1] && v == vt[m - 1]) want[m - 1] = w_slots ? want[m - 1] + w_slots : 0;
        else { kt[m] = k; vt[m] = v; want[m] = w_slots; m++; }
        if (stop == LONG_MAX) break;
        for (int w = 0; w < 2; w++)
            if (end[w] == stop) {
                idx[w]++;
                end[w] = slots[w][idx[w]] ? stop + slots[w][idx[w]] : LONG_MAX;
            }
        at = stop;
    }
    return m;
}

/* The slots of each band in a lane of cap slots: the wants newest first, clipped, the last band the rest. */
static void band_sizes(int n_bands, const int *want, int cap, int *slots) {
    int left = cap;
    for (int b = 0; b < n_bands; b++) {
        int s = b == n_bands - 1 ? left : want[b] < left ? want[b] : left;
        slots[b] = s;
        left -= s;
    }
}

/* Per-slot bytes other than vectors: position (int32; a second, pos0, when the policy merges), one live-list and one
 * free-list entry (int), policy meta, and with merge=1 (merge_w) the f32 accumulated attention mw. */
static size_t slot_meta_bytes(size_t policy_meta, int merges, int merge_w) {
    return (merges ? 2 : 1) * sizeof(int32_t) + 2 * sizeof(int) + policy_meta + (merge_w ? sizeof(float) : 0);
}
static size_t cache_slot_meta(const KVCache *c) { return slot_meta_bytes(c->meta_bytes, c->merges, c->merge_evict); }

/* merge=1 in a spec (merge-on-evict), as given: 1, 0 (absent or merge=0), or -1 for another value (kv_cache_init says
 * so); read without marking the key, for the byte formula. */
static int spec_merge_value(const KVSpec *sp) {
    const char *v = kv_spec_value(sp, "merge");
    return !v || !strcmp(v, "0") ? 0 : !strcmp(v, "1") ? 1 : -1;
}

/* A per-channel key band (kgroup=channel) of `slots` rows in groups of G: besides each row's codes (its band_kb), each
 * group's header (head_dim f16 scales, then head_dim f16 minimums) and the open group's f32 keys (min(G, slots)
 * rows). Inside the band's key region (ln->k[b]) the codes come first, then the headers, then the open buffer, each
 * part starting 16-byte aligned (the padding is not cache memory and is not counted). */
static size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }
static int chan_groups(int slots, int G) { return (slots + G - 1) / G; }
static size_t chan_hdr_bytes(int hd) { return (size_t)4 * hd; }
static int chan_open_rows(int slots, int G) { return slots < G ? slots : G; }
static size_t chan_hdr_off(size_t kb, int slots) { return align16((size_t)slots * kb); }
static size_t chan_open_off(size_t kb, int slots, int G, int hd) {
    return chan_hdr_off(kb, slots) + align16((size_t)chan_groups(slots, G) * chan_hdr_bytes(hd));
}
/* The bytes a per-channel band holds beyond its rows' codes and values: headers and the open buffer. */
static size_t chan_extra_bytes(int slots, int G, int hd) {
    return (size_t)chan_groups(slots, G) * chan_hdr_bytes(hd) + (size_t)chan_open_rows(slots, G) * hd * sizeof(float);
}

/* Bytes of one stored key of band type ty: per token kv_vector_bytes; per channel (chan) its codes only. */
static size_t band_key_bytes(KVType ty, int chan, int hd) {
    return chan ? (size_t)kv_chan_code_bytes(kv_type_bits(ty), hd) : kv_vector_bytes(ty, hd);
}

/* Low rank. The calibration span, tokens: calib= or KV_CALIB_DEFAULT, clipped to the context (-c), which full's
 * lanes stop at. A lane's staging rows: min(cap, span) (before its fit a lane holds at most that many tokens). */
#define KV_CALIB_DEFAULT 512
static int spec_calib(const KVShape *s, const KVSpec *sp) {
    int n = sp->calib ? sp->calib : KV_CALIB_DEFAULT;
    return n < s->seq_len ? n : s->seq_len;
}
static int stage_rows(int cap, int calib) { return cap < calib ? cap : calib; }
/* Bytes of a low-rank lane beyond its slots: its bases (krank + vrank rows of head_dim f32), and the staging that
 * holds full-rank keys (krank) and values (vrank) in the band's types until the fit. */
static size_t lowrank_basis_bytes(const KVSpec *sp, int hd) { return (size_t)(sp->krank + sp->vrank) * hd * sizeof(float); }
static size_t lowrank_stage_bytes(const KVShape *s, const KVSpec *sp, KVType kt, KVType vt, int cap) {
    size_t row = (sp->krank ? kv_vector_bytes(kt, s->head_dim) : 0) + (sp->vrank ? kv_vector_bytes(vt, s->head_dim) : 0);
    return (size_t)stage_rows(cap, spec_calib(s, sp)) * row;
}

/* Allocated bytes of one lane of cap slots; chan[b]: band b's keys are per channel, in groups of G tokens; extra: its
 * low-rank bases and staging. */
static size_t lane_alloc_bytes(int n_bands, const int *want, const size_t *kb, const size_t *vb, const int *chan, int G,
                               int hd, int cap, size_t slot_meta, size_t extra) {
    int slots[KV_MAX_BANDS];
    band_sizes(n_bands, want, cap, slots);
    size_t bytes = (size_t)cap * slot_meta + extra;
    for (int b = 0; b < n_bands; b++) {
        bytes += (size_t)slots[b] * (kb[b] + vb[b]);
        if (chan[b] && slots[b]) bytes += chan_extra_bytes(slots[b], G, hd);
    }
    return bytes;
}

/* G, the tokens of a per-channel key group of a spec (0: kgroup=token). */
static int spec_kgroup(const KVSpec *sp) {
    return sp->kgroup_channel ? (sp->kgsize ? sp->kgsize : KV_KGSIZE_DEFAULT) : 0;
}

/* alloc=ada's pages (kv.h, "Budgets over a layer's kv heads"): P, the largest power of two <= B/32 within [1, 16],
 * so a layer's rounding costs at most H·P <= H·B/32 slots; and its own pool's pages, n_layers · (ceil(H·B/P) + H),
 * each lane holding at most one part-filled page. */
static int ada_page_slots(int B) {
    int P = 1;
    while (2 * P <= B / 32 && 2 * P <= KV_POOL_PAGE_SLOTS) P *= 2;
    return P;
}
static size_t ada_pool_pages(const KVShape *s, int B, int P) {
    return (size_t)s->n_layers * (kv_pool_pages_for(s->n_kv_heads * B, P) + s->n_kv_heads);
}
/* The bytes of a pool's books for n_pages pages (pool.h: ref, free stack, key, keyed, chain, LRU links; the buckets,
 * the smallest power of two >= n_pages) and of a lane's page table for cap slots (key and value page pointers, ids). */
static size_t pool_books_bytes(size_t n_pages) {
    size_t buckets = 1;
    while (buckets < n_pages) buckets *= 2;
    return n_pages * (5 * sizeof(int) + sizeof(uint64_t) + 1) + buckets * sizeof(int);
}
static size_t page_table_bytes(int cap, int P) {
    return (size_t)kv_pool_pages_for(cap, P) * (2 * sizeof(uint8_t *) + sizeof(int));
}
static int ada_lane_cap(const KVShape *s, int B);

size_t kv_alloc_bytes_for(const KVShape *s, const KVSpec *sp, const KVPolicyOps *ops, int budget) {
    const char *al = kv_spec_value(sp, "alloc");
    if (al && !strcmp(al, "ada")) {   /* the cache's own pool of one storage form, lanes' metadata sized by their cap */
        KVType kt[KV_MAX_BANDS], vt[KV_MAX_BANDS];
        int want[KV_MAX_BANDS], P = ada_page_slots(budget), cap = ada_lane_cap(s, budget);
        spec_bands(sp, kt, vt, want);
        size_t pages = ada_pool_pages(s, budget, P);
        size_t pol = ops && ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(sp, budget) : 0;
        size_t per_lane = (size_t)cap * slot_meta_bytes(pol, 0, 0) + page_table_bytes(cap, P);
        return pages * P * (kv_vector_bytes(kt[0], s->head_dim) + kv_vector_bytes(vt[0], s->head_dim))
               + (size_t)s->n_layers * s->n_kv_heads * per_lane + pool_books_bytes(pages);
    }
    int slots = ops && ops->grows ? s->seq_len : budget, want[KV_MAX_BANDS], chan[KV_MAX_BANDS], G = spec_kgroup(sp);
    KVType kt[KV_MAX_BANDS], vt[KV_MAX_BANDS];
    size_t kb[KV_MAX_BANDS], vb[KV_MAX_BANDS];
    int nb = spec_bands(sp, kt, vt, want);
    int kn = sp->krank ? sp->krank : s->head_dim, vn = sp->vrank ? sp->vrank : s->head_dim;   /* stored elements */
    for (int b = 0; b < nb; b++) {
        chan[b] = G && kv_type_bits(kt[b]);
        kb[b] = chan[b] ? band_key_bytes(kt[b], 1, s->head_dim) : kv_vector_bytes(kt[b], kn);
        vb[b] = kv_vector_bytes(vt[b], vn);
    }
    size_t pol = ops && ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(sp, budget) : 0;
    size_t extra = sp->krank || sp->vrank
                   ? lowrank_basis_bytes(sp, s->head_dim) + lowrank_stage_bytes(s, sp, kt[0], vt[0], slots) : 0;
    size_t lane = lane_alloc_bytes(nb, want, kb, vb, chan, G, s->head_dim, slots,
                                   slot_meta_bytes(pol, ops && ops->merge, spec_merge_value(sp) == 1), extra);
    return (size_t)s->n_layers * s->n_kv_heads * lane;
}

static size_t band_pair_bytes(const KVCache *c, int b) { return c->band_kb[b] + c->band_vb[b]; }
/* Bytes of a live key / value of band b of this lane now: a low-rank side's full-rank staging row before the lane's
 * fit, else the band's (R coefficients after the fit). */
static size_t lane_kb(const KVCache *c, const KVLane *ln, int b) {
    return c->krank && !ln->lr_fitted ? c->stage_kb : c->band_kb[b];
}
static size_t lane_vb(const KVCache *c, const KVLane *ln, int b) {
    return c->vrank && !ln->lr_fitted ? c->stage_vb : c->band_vb[b];
}
static size_t lane_pair_bytes(const KVCache *c, const KVLane *ln, int b) { return lane_kb(c, ln, b) + lane_vb(c, ln, b); }

/* Rows of group j of band b in lane ln (G, or fewer for a short last group), and how many hold a live token. */
static int chan_group_rows(const KVCache *c, const KVLane *ln, int b, int j) {
    int left = ln->band_slots[b] - j * c->kgroup;
    return left < c->kgroup ? left : c->kgroup;
}
static int chan_group_live(const KVCache *c, const KVLane *ln, int b, int j) {
    int s0 = ln->band_first[b] + j * c->kgroup, n = 0, rows = chan_group_rows(c, ln, b, j);
    for (int r = 0; r < rows; r++) n += ln->pos[s0 + r] >= 0;
    return n;
}
/* Live key bytes of group j of a per-channel band when n of its rows hold tokens: f32 keys while it is open, codes
 * and the header once sealed, nothing when empty. */
static size_t chan_live_bytes(const KVCache *c, const KVLane *ln, int b, int j, int n) {
    if (n == 0) return 0;
    int hd = c->shape.head_dim;
    if (ln->kopen[b] == j) return (size_t)n * hd * sizeof(float);
    return (size_t)n * c->band_kb[b] + chan_hdr_bytes(hd);
}
/* Live bytes of band b's keys, every group summed (per channel bands only). */
static size_t chan_band_live(const KVCache *c, const KVLane *ln, int b) {
    size_t bytes = 0;
    for (int j = 0; j < chan_groups(ln->band_slots[b], c->kgroup); j++)
        bytes += chan_live_bytes(c, ln, b, j, chan_group_live(c, ln, b, j));
    return bytes;
}

static KVBytes lane_bytes(const KVCache *c, const KVLane *ln) {
    KVBytes b = {0};
    size_t meta = cache_slot_meta(c);
    for (int x = 0; x < c->n_bands; x++) {
        int live = c->pool ? ln->n_live : ln->band_slots[x] - ln->n_free[x];
        b.vec_alloc += c->pool ? (size_t)ln->n_pages * c->pool->page_bytes
                               : (size_t)ln->band_slots[x] * band_pair_bytes(c, x);
        if (!c->band_kchan[x]) { b.vec_live += (size_t)live * lane_pair_bytes(c, ln, x); continue; }
        if (ln->band_slots[x]) b.vec_alloc += chan_extra_bytes(ln->band_slots[x], c->kgroup, c->shape.head_dim);
        b.vec_live += (size_t)live * c->band_vb[x] + chan_band_live(c, ln, x);
    }
    /* low rank: the bases, held from init, live once fitted; the staging while the cache holds it */
    b.basis_bytes = lowrank_basis_bytes(&c->spec, c->shape.head_dim);
    b.stage_bytes = c->stage ? (size_t)stage_rows(ln->cap, c->calib) * (c->stage_kb + c->stage_vb) : 0;
    b.vec_alloc += b.basis_bytes + b.stage_bytes;
    if (ln->lr_fitted) b.vec_live += b.basis_bytes;
    b.meta_alloc = (size_t)ln->cap * meta;
    /* alloc=ada's own pool: the lane's page table (key and value page pointers, page ids) is its metadata too */
    if (c->pool_owned) b.meta_alloc += page_table_bytes(ln->cap, c->page_slots);
    b.meta_live = (size_t)ln->n_live * meta;
    b.total_alloc = b.vec_alloc + b.meta_alloc;
    b.total_live = b.vec_live + b.meta_live;
    /* bytes per element of the base (last band's) types: f32 4, f16/bf16 2, q8 1, q4 0.5, q2 0.25; in eighths,
       integral; alloc=ada's lanes share B each on average, the slots people quote */
    static const int eighths[KV_NTYPES] = {32, 16, 16, 8, 4, 2};
    int quoted = c->ada ? c->policy.budget : ln->cap;
    b.formula_alloc = (size_t)c->shape.head_dim * quoted * (eighths[c->spec.ktype] + eighths[c->spec.vtype]) / 8;
    return b;
}

KVBytes kv_lane_bytes(const KVCache *c, int l, int g) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    KVBytes b = lane_bytes(c, ln);
    /* the lane's peak in bytes: its peak slots, filling the bands newest first */
    int left = ln->peak_live;
    b.peak_live = (size_t)ln->peak_live * cache_slot_meta(c);
    for (int x = 0; x < c->n_bands; x++) {
        int s = left < ln->band_slots[x] ? left : ln->band_slots[x];
        b.peak_live += (size_t)s * lane_pair_bytes(c, ln, x);
        if (c->band_kchan[x]) b.peak_live += (size_t)chan_groups(s, c->kgroup) * chan_hdr_bytes(c->shape.head_dim);
        left -= s;
    }
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
        b.basis_bytes += x.basis_bytes; b.stage_bytes += x.stage_bytes;
    }
    if (c->pool_owned) {   /* alloc=ada: every page of the cache's pool is allocated, held or not, and its books */
        const KVPool *p = c->pool;
        b.vec_alloc = (size_t)p->n_pages * p->page_bytes;
        b.meta_alloc += pool_books_bytes((size_t)p->n_pages);
    }
    b.total_alloc = b.vec_alloc + b.meta_alloc;
    b.total_live = b.vec_live + b.meta_live;
    b.peak_live = c->peak_live_bytes > b.total_live ? c->peak_live_bytes : b.total_live;
    return b;
}

/* Bytes of one live token of the lane in band b: its vectors and its per-slot metadata; in a per-channel band its value
 * only, its key being counted with its group (chan_live_bytes). */
static size_t token_bytes(const KVCache *c, const KVLane *ln, int b) {
    return (c->band_kchan[b] ? c->band_vb[b] : lane_pair_bytes(c, ln, b)) + cache_slot_meta(c);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Low rank (rank=, krank=, vrank=; kv.h, "Low rank"). Per lane, bases fitted on the second moments of the first
 * `calib` tokens; before the fit a lane's vectors sit at full rank in the staging rows, after it each slot holds R
 * coefficients in the band's type. Keys are projected before RoPE and rotated after reconstruction.
 * ------------------------------------------------------------------------------------------------------------- */

/* 0, or -1 + message when a low-rank spec cannot run: a rank over head_dim, q4 over an odd rank (q4 packs two
 * elements of a group of gcd(R, 32) per byte), several precision bands, a merging policy or memory tiers (a merged,
 * recoded or tiered slot would need its coefficients re-fitted or re-counted: not built). */
static int lowrank_check(const KVCache *c, const KVShape *s, const KVSpec *sp, const KVPolicyOps *ops, char *err,
                         size_t errlen) {
    for (int side = 0; side < 2; side++) {
        int r = side ? sp->vrank : sp->krank;
        KVType ty = side ? c->band_vtype[0] : c->band_ktype[0];
        const char *key = sp->rank_joint ? "rank" : side ? "vrank" : "krank";
        if (r > s->head_dim)
            return errorf(err, errlen, "%s=%d in '%s' is over head_dim %d: a rank is in [1, %d]", key, r, sp->text,
                          s->head_dim, s->head_dim);
        if (r && ty == KV_Q4 && kv_group(r) % 2)
            return errorf(err, errlen, "%s=%d in '%s' with q4: q4 stores groups of gcd(rank, 32) coefficients two per "
                          "byte, so the rank must be even", key, r, sp->text);
    }
    if (c->n_bands > 1)
        return errorf(err, errlen, "'%s': low rank takes one storage type for its coefficients; not with prec= or "
                      "residual= (not built yet)", sp->text);
    if (ops->merge)
        return errorf(err, errlen, "'%s': low rank does not combine with a merging policy (%s) yet", sp->text,
                      sp->name);
    if (spec_merge_value(sp) == 1)
        return errorf(err, errlen, "'%s': low rank does not combine with merge-on-evict (merge=1) yet", sp->text);
    if (sp->fast_bytes || sp->fast_frac)
        return errorf(err, errlen, "'%s': low rank does not combine with memory tiers (fast=) yet", sp->text);
    return 0;
}

/* The rotation table by position (c->lr_cs) to cover position t: cos, sin of kv_rope_cs, so a reconstructed key is
 * rotated with the bits kv_append's rotation by t would use. 0, or -1 when out of memory (the table unchanged). */
static int lowrank_grow_cs(KVCache *c, int t) {
    if (t < c->lr_cs_n) return 0;
    int hd = c->shape.head_dim, n = c->lr_cs_n ? c->lr_cs_n : 1024;
    while (n <= t) n = n > (1 << 29) ? t + 1 : 2 * n;
    float *cs = realloc(c->lr_cs, (size_t)n * hd * sizeof(float));
    if (!cs) return -1;
    for (int p = c->lr_cs_n; p < n; p++) rope_cs(cs + (size_t)p * hd, &c->shape, p);
    c->lr_cs = cs;
    c->lr_cs_n = n;
    return 0;
}

/* A slot's staging row: the slot itself when the lane has no more slots than the span, else its position modulo the
 * span (before the fit a lane holds tokens of at most `calib` consecutive positions, so no two share a row). Key
 * first, then value. */
static uint8_t *stage_key(const KVCache *c, const KVLane *ln, int slot) {
    size_t row = ln->cap <= c->calib ? (size_t)slot : (size_t)ln->pos[slot] % (size_t)c->calib;
    return c->stage + ln->stage_off + row * (c->stage_kb + c->stage_vb);
}
static uint8_t *stage_value(const KVCache *c, const KVLane *ln, int slot) { return stage_key(c, ln, slot) + c->stage_kb; }

/* dst = the r coefficients of x (head_dim) on basis (r, head_dim), c_j = Σ_d basis_jd·x_d summed in double in d order
 * then rounded to f32, encoded in type ty over r elements. */
static __attribute__((noinline)) void lowrank_project(uint8_t *dst, KVType ty, const float *basis, int r, const float *x,
                                                      int hd) {
    float co[r];
    for (int j = 0; j < r; j++) {
        double acc = 0;
        for (int d = 0; d < hd; d++) acc += (double)basis[(size_t)j * hd + d] * x[d];
        co[j] = (float)acc;
    }
    kv_encode(dst, ty, co, r);
}

/* x (head_dim) = Σ_j c_j·basis_j for the r coefficients at src in type ty: f32, each element summed in j order from
 * 0 (a multiply, then an add), so its bits do not depend on the build. */
static void lowrank_reconstruct(float *x, const uint8_t *src, KVType ty, const float *basis, int r, int hd) {
    float co[r];
    kv_decode(co, ty, src, r);
    for (int d = 0; d < hd; d++) x[d] = 0;
    for (int j = 0; j < r; j++)
        for (int d = 0; d < hd; d++) x[d] += co[j] * basis[(size_t)j * hd + d];
}

const float *kv_lowrank_key(const KVCache *c, const KVLane *ln, int i, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim;
    if (!ln->lr_fitted) kv_decode(x, c->band_ktype[0], stage_key(c, ln, slot), hd);   /* as a full-rank cache */
    else {
        lowrank_reconstruct(x, kv_band_k(c, ln, 0, slot - ln->band_first[0]), c->band_ktype[0],
                            ln->kbasis, c->krank, hd);
        if (c->spec.pos == POS_ORIG) kv_rope_apply(x, &c->shape, c->lr_cs + (size_t)ln->pos[slot] * hd);
    }
    if (c->spec.pos == POS_CACHE) kv_rope_apply(x, &c->shape, c->rope_cs + (size_t)i * hd);
    return x;
}

const float *kv_lowrank_value(const KVCache *c, const KVLane *ln, int i, float *x) {
    int slot = ln->live[i], hd = c->shape.head_dim;
    if (!ln->lr_fitted) kv_decode(x, c->band_vtype[0], stage_value(c, ln, slot), hd);
    else lowrank_reconstruct(x, kv_band_v(c, ln, 0, slot - ln->band_first[0]), c->band_vtype[0],
                             ln->vbasis, c->vrank, hd);
    return x;
}

/* A fitted lane's f32 vector of a token not stored yet, as kv_lowrank_key (kv_lowrank_value) will read it once
 * stored: x (pre-RoPE key or value, head_dim) projected on the lane's basis and encoded (lowrank_store), then
 * reconstructed (no rotation here: the caller rotates a key by its position or rank). y (head_dim) gets it. */
static void lowrank_roundtrip(float *y, const float *x, KVType ty, const float *basis, int r, int hd) {
    uint8_t b[4 * hd + 64];   /* r coefficients in any form (f32, the largest, is 4·r bytes, r < head_dim) */
    lowrank_project(b, ty, basis, r, x, hd);
    lowrank_reconstruct(y, b, ty, basis, r, hd);
}
void kv_lowrank_new_key(const KVCache *c, const KVLane *ln, float *y, const float *k) {
    lowrank_roundtrip(y, k, c->band_ktype[0], ln->kbasis, c->krank, c->shape.head_dim);
}
void kv_lowrank_new_value(const KVCache *c, const KVLane *ln, float *y, const float *v) {
    lowrank_roundtrip(y, v, c->band_vtype[0], ln->vbasis, c->vrank, c->shape.head_dim);
}

/* Step 2 of a low-rank lane: the token at position t (k, v: head_dim, k before RoPE) into `slot` (its position
 * already set). Inside the calibration span its pre-RoPE key, its key rotated by t and its value are added to the
 * lane's second moments, whatever the policy later evicts. A fitted side stores the coefficients of the pre-RoPE
 * vector; before the fit the staging row gets what a full-rank cache would store (the key rotated under pos=orig). */
static void lowrank_store(KVCache *c, int lane, KVLane *ln, int slot, int t, const float *k, const float *v) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim;
    float kr[hd];
    memcpy(kr, k, (size_t)hd * sizeof(float));
    kv_rope_apply(kr, s, kv_rope_at(c, t));
    if (!ln->lr_fitted && ln->lr_seen < c->calib) {
        double *m = c->lr_cov + (size_t)lane * 3 * hd * hd;
        lowrank_accumulate(m, k, hd);
        lowrank_accumulate(m + (size_t)hd * hd, kr, hd);
        lowrank_accumulate(m + (size_t)2 * hd * hd, v, hd);
        ln->lr_seen++;
    }
    const float *ks = c->spec.pos == POS_ORIG ? kr : k;   /* what a full-rank cache stores */
    int row = slot - ln->band_first[0];
    if (!c->krank) kv_encode(kv_band_k(c, ln, 0, row), c->band_ktype[0], ks, hd);
    else if (ln->lr_fitted) lowrank_project(kv_band_k(c, ln, 0, row), c->band_ktype[0], ln->kbasis, c->krank, k, hd);
    else kv_encode(stage_key(c, ln, slot), c->band_ktype[0], ks, hd);
    if (!c->vrank) kv_encode(kv_band_v(c, ln, 0, row), c->band_vtype[0], v, hd);
    else if (ln->lr_fitted) lowrank_project(kv_band_v(c, ln, 0, row), c->band_vtype[0], ln->vbasis, c->vrank, v, hd);
    else kv_encode(stage_value(c, ln, slot), c->band_vtype[0], v, hd);
}

/* The fit, once the lane has seen `calib` tokens: each low-rank side's basis = the eigenvectors of its second moment
 * with the R largest eigenvalues (lowrank_eigen), rounded to f32; then every live slot's staged vector is projected
 * once (a staged key under pos=orig is first rotated back by its position: kv_rope by -pos, whose cos, sin are the
 * same numbers, the sines negated, so it undoes the rotation to within f32 rounding). The last lane fitted frees the
 * cache's staging. */
static void lane_fit(KVCache *c, int lane, KVLane *ln) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim;
    size_t before = (size_t)ln->n_live * token_bytes(c, ln, 0);
    double w[hd], *vec = malloc((size_t)hd * hd * sizeof(double));
    if (!vec) { fprintf(stderr, "kv: out of memory fitting a low-rank basis\n"); exit(EXIT_FAILURE); }
    for (int side = 0; side < 2; side++) {
        int r = side ? c->vrank : c->krank;
        if (!r) continue;
        if (lowrank_eigen(w, vec, c->lr_cov + ((size_t)lane * 3 + (side ? 2 : 0)) * hd * hd, hd) < 0)
            fprintf(stderr, "kv: warning: the Jacobi eigen-decomposition of lane %d did not converge in 100 sweeps; "
                    "its last iterate is the basis\n", lane);
        float *basis = side ? ln->vbasis : ln->kbasis;
        for (size_t e = 0; e < (size_t)r * hd; e++) basis[e] = (float)vec[e];
    }
    free(vec);
    float x[hd];
    for (int i = 0; i < ln->n_live; i++) {
        int slot = ln->live[i];
        int row = slot - ln->band_first[0];
        if (c->krank) {
            kv_decode(x, c->band_ktype[0], stage_key(c, ln, slot), hd);
            if (c->spec.pos == POS_ORIG) kv_rope(x, s, -ln->pos[slot]);
            lowrank_project(kv_band_k(c, ln, 0, row), c->band_ktype[0], ln->kbasis, c->krank, x, hd);
        }
        if (c->vrank) {
            kv_decode(x, c->band_vtype[0], stage_value(c, ln, slot), hd);
            lowrank_project(kv_band_v(c, ln, 0, row), c->band_vtype[0], ln->vbasis, c->vrank, x, hd);
        }
    }
    ln->lr_fitted = 1;
    c->live_bytes = c->live_bytes - before + (size_t)ln->n_live * token_bytes(c, ln, 0)
                    + lowrank_basis_bytes(&c->spec, hd);
    int n_lanes = s->n_layers * s->n_kv_heads, all = 1;
    for (int i = 0; i < n_lanes && all; i++) all = c->lanes[i].lr_fitted;
    if (all) { free(c->stage); c->stage = NULL; }
}

int kv_lowrank_spectrum(const KVCache *c, int l, const int *ranks, int n_ranks, double *share) {
    if (!(c->krank || c->vrank)) return 0;
    int hd = c->shape.head_dim, n_kv = c->shape.n_kv_heads;
    double *w = malloc((size_t)hd * sizeof(double)), *vec = malloc((size_t)hd * hd * sizeof(double));
    if (!w || !vec) { free(w); free(vec); return -1; }
    for (int e = 0; e < 3 * n_ranks; e++) share[e] = 0;
    for (int g = 0; g < n_kv; g++)
        for (int m = 0; m < 3; m++) {
            lowrank_eigen(w, vec, c->lr_cov + ((size_t)(l * n_kv + g) * 3 + m) * hd * hd, hd);
            for (int j = 0; j < n_ranks; j++) share[m * n_ranks + j] += lowrank_energy(w, hd, ranks[j]) / n_kv;
        }
    free(w); free(vec);
    return c->lanes[l * n_kv].lr_seen;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The cache
 * ------------------------------------------------------------------------------------------------------------- */

/* The arena bytes of one lane of cap slots, each array 16-byte aligned (the padding is not cache memory and is not
 * counted). With `base`, the lane's arrays are carved from it as well. */
static size_t lane_carve(KVCache *c, KVLane *ln, int cap, uint8_t *base) {
    int hd = c->shape.head_dim, slots[KV_MAX_BANDS];
    band_sizes(c->n_bands, c->band_want, cap, slots);
    size_t off = 0;
#define CARVE(ptr, type, bytes) do { if (base) (ptr) = (type)(void *)(base + off); off += align16(bytes); } while (0)
    if (base) { ln->cap = cap; ln->pos0 = NULL; ln->mw = NULL; }
    CARVE(ln->pos, int32_t *, (size_t)cap * sizeof(int32_t));
    CARVE(ln->live, int *, (size_t)cap * sizeof(int));
    if (c->merges) CARVE(ln->pos0, int32_t *, (size_t)cap * sizeof(int32_t));
    if (c->merge_evict) CARVE(ln->mw, float *, (size_t)cap * sizeof(float));
    CARVE(ln->meta, uint8_t *, (size_t)cap * c->meta_bytes);
    if (c->krank) CARVE(ln->kbasis, float *, (size_t)c->krank * hd * sizeof(float));
    if (c->vrank) CARVE(ln->vbasis, float *, (size_t)c->vrank * hd * sizeof(float));
    int first = cap;
    for (int b = 0; b < c->n_bands; b++) {
        first -= slots[b];
        if (base) { ln->band_first[b] = first; ln->band_slots[b] = slots[b]; }
        CARVE(ln->free[b], int *, (size_t)slots[b] * sizeof(int));
        if (c->pool) {   /* the vectors live in the pool's pages; the lane holds their table */
            int n_pg = kv_pool_pages_for(slots[b], c->page_slots);
            CARVE(ln->kpg[b], uint8_t **, (size_t)n_pg * sizeof(uint8_t *));
            CARVE(ln->vpg[b], uint8_t **, (size_t)n_pg * sizeof(uint8_t *));
            CARVE(ln->page_id, int *, (size_t)n_pg * sizeof(int));
            continue;
        }
        size_t kbytes = (size_t)slots[b] * c->band_kb[b];   /* per channel: codes, headers, the open buffer */
        if (c->band_kchan[b] && slots[b])
            kbytes = chan_open_off(c->band_kb[b], slots[b], c->kgroup, hd)
                     + (size_t)chan_open_rows(slots[b], c->kgroup) * hd * sizeof(float);
        CARVE(ln->k[b], uint8_t *, kbytes);
        CARVE(ln->v[b], uint8_t *, (size_t)slots[b] * c->band_vb[b]);
        if (base) { ln->kpg[b] = &ln->k[b]; ln->vpg[b] = &ln->v[b]; }   /* one page per band (kv.h, Paging) */
    }
    if (base) {
        int P = c->pool ? c->page_slots : 1 << 30;
        ln->pg_mask = P - 1;
        for (ln->pg_shift = 0; (1 << ln->pg_shift) < P; ln->pg_shift++) {}
    }
#undef CARVE
    return off;
}

/* prompt=dense|sparse, the key every selection policy takes (kv_query_selects acts on it): c->prompt_dense. 0, or -1
 * + message (another family's policy, or an unknown value). */
static int spec_prompt(KVCache *c, char *err, size_t errlen) {
    const char *pm = kv_spec_get(&c->spec, "prompt");
    if (!pm) return 0;
    if (!c->policy.ops->select) {
        char names[128] = "";
        for (int i = 0; kv_policy_at(i); i++)
            if (kv_policy_at(i)->select)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *names ? ", " : "",
                         kv_policy_at(i)->name);
        return errorf(err, errlen, "'%s': prompt= says whether a selection policy's prompt queries read every token "
                      "(dense) or select (sparse); %s does not select, so it takes no prompt= (the selection policies: "
                      "%s)", c->spec.text, c->spec.name, names);
    }
    if (strcmp(pm, "dense") && strcmp(pm, "sparse"))
        return errorf(err, errlen, "unknown prompt=%s in '%s'; choices: sparse (the default: every query selects), "
                      "dense (the prompt's queries read every token, the later ones select)", pm, c->spec.text);
    c->prompt_dense = !strcmp(pm, "dense");
    return 0;
}

/* The eviction policies merge=1 works on, comma-separated: ops->evicts, no merge rule of their own, and no lane
 * choice by calibration (duo ranks lanes by their streaming form's recall, which merging makes 1 in every lane). */
static void eviction_names(char *names, size_t len) {
    names[0] = 0;
    for (int i = 0; kv_policy_at(i); i++)
        if (kv_policy_at(i)->evicts && !kv_policy_at(i)->merge && !kv_policy_at(i)->calib_full)
            snprintf(names + strlen(names), len - strlen(names), "%s%s", *names ? ", " : "", kv_policy_at(i)->name);
}

/* merge=0|1, the key every eviction policy takes (merge-on-evict, lane_evict): c->merge_evict. 0, or -1 + message
 * (another value; a policy that does not evict, or that merges by its own rule). */
static int spec_merge(KVCache *c, const KVPolicyOps *ops, char *err, size_t errlen) {
    const char *v = kv_spec_get(&c->spec, "merge");
    if (!v) return 0;
    char names[160];
    eviction_names(names, sizeof names);
    if (strcmp(v, "0") && strcmp(v, "1"))
        return errorf(err, errlen, "bad merge=%s in '%s': 0 or 1 (1: merge-on-evict, each victim merged into its most "
                      "similar kept slot)", v, c->spec.text);
    if (v[0] == '0') return 0;   /* merge=0 is the default, explicit: no merging, on any policy */
    if (ops->merge)
        return errorf(err, errlen, "'%s': %s merges by its own rule already (adjacent tokens), so it takes no merge=; "
                      "merge=1 (merge-on-evict) is for the eviction policies: %s", c->spec.text, c->spec.name, names);
    if (ops->calib_full)
        return errorf(err, errlen, "'%s': %s chooses its full lanes by the recall of their streaming form on -calib "
                      "FILE, and with merge=1 every position stays covered, so every lane's recall would be 1 and the "
                      "choice empty: merge=1 is for the eviction policies: %s", c->spec.text, c->spec.name, names);
    if (!ops->evicts)
        return errorf(err, errlen, "'%s': %s never evicts (its lanes stop at -c), so merge=1 (merge-on-evict) would "
                      "have no victim to merge: it is for the eviction policies: %s", c->spec.text, c->spec.name,
                      names);
    c->merge_evict = v[0] == '1';
    return 0;
}

/* Bits per element of a storage type, for ordering precisions (f16 and bf16 both 16). */
static int type_precision(KVType t) { return t == KV_F32 ? 32 : t == KV_F16 || t == KV_BF16 ? 16 : kv_type_bits(t); }

/* Notes on stderr for a spec that runs but does not do what it seems to ask (after a successful init, so every lane's
 * bands are known): a precision band no lane reaches, a per-channel key group no lane can fill, precision rising with
 * age, a rank of head_dim. Each is legal (a test or a sweep may want it), so none is an error. */
static void spec_notes(const KVCache *c) {
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads, max_slots[KV_MAX_BANDS] = {0};
    for (int i = 0; i < n_lanes; i++)
        for (int b = 0; b < c->n_bands; b++)
            if (c->lanes[i].band_slots[b] > max_slots[b]) max_slots[b] = c->lanes[i].band_slots[b];
    for (int b = 1; b < c->n_bands; b++)
        if (!max_slots[b])
            fprintf(stderr, "kv: note: '%s': band %d (keys %s, values %s) is never reached: a lane holds %d slots, "
                    "all in the newer bands\n", c->spec.text, b + 1, kv_type_names[c->band_ktype[b]],
                    kv_type_names[c->band_vtype[b]], c->budget);
    for (int b = 0; b < c->n_bands; b++)
        if (c->band_kchan[b] && max_slots[b] && max_slots[b] < c->kgroup)
            fprintf(stderr, "kv: note: '%s': kgsize=%d is over the %d slots of the per-channel key band, so no group "
                    "ever fills and its keys stay in f32\n", c->spec.text, c->kgroup, max_slots[b]);
    for (int b = 0; b + 1 < c->n_bands; b++)
        if (type_precision(c->band_ktype[b]) < type_precision(c->band_ktype[b + 1])
            || type_precision(c->band_vtype[b]) < type_precision(c->band_vtype[b + 1])) {
            fprintf(stderr, "kv: note: '%s': precision rises with age (band %d %s/%s is newer than band %d %s/%s): "
                    "the newest tokens get the fewer bits\n", c->spec.text, b + 1, kv_type_names[c->band_ktype[b]],
                    kv_type_names[c->band_vtype[b]], b + 2, kv_type_names[c->band_ktype[b + 1]],
                    kv_type_names[c->band_vtype[b + 1]]);
            break;
        }
    if (c->krank == c->shape.head_dim || c->vrank == c->shape.head_dim)
        fprintf(stderr, "kv: note: '%s': a rank of head_dim (%d) keeps as many coefficients as the vector has "
                "elements, plus a basis per lane: it saves no bytes (a check of the reconstruction)\n", c->spec.text,
                c->shape.head_dim);
}

int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen) {
    return kv_cache_init_lanes(c, shape, spec, NULL, err, errlen);
}

/* kv_cache_init_lanes, with spec_notes said (notes) or not (a clone: its spec was noted when the original was made) */
static int cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, const int *caps, int notes, KVPool *pool,
                      char *err, size_t errlen);

/* alloc=pyramid: PyramidKV's schedule (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
 * Information Funneling", arXiv:2406.02069, §3.2): layer l of L keeps k_l = k_0 - (k_0 - k_top) l / (L - 1) slots in
 * every lane, k_top = B / β with β = 20 (its code's default), k_0 = 2B - k_top, so the mean over layers is B, the
 * budget; each k_l rounded down (at least 1), then one slot more per layer from layer 0 up until the total is B · L
 * exactly. caps: (n_layers * n_kv_heads). */
static void pyramid_caps(int *caps, const KVShape *s, int B) {
    int L = s->n_layers;
    long total = 0;
    double top = B / 20.0, bottom = 2.0 * B - top;
    int k[L];
    for (int l = 0; l < L; l++) {
        double kl = L == 1 ? B : bottom - (bottom - top) * l / (L - 1);
        k[l] = kl < 1 ? 1 : (int)kl;
        total += k[l];
    }
    for (int l = 0; total != (long)B * L; l = (l + 1) % L) {
        if (total < (long)B * L) { k[l]++; total++; }
        else if (k[l] > 1) { k[l]--; total--; }
    }
    for (int l = 0; l < L; l++)
        for (int g = 0; g < s->n_kv_heads; g++) caps[l * s->n_kv_heads + g] = k[l];
}

int kv_cache_init_lanes(KVCache *c, const KVShape *shape, const KVSpec *spec, const int *caps, char *err,
                        size_t errlen) {
    const char *al = kv_spec_value(spec, "alloc");
    if (!al || strcmp(al, "pyramid")) return cache_init(c, shape, spec, caps, 1, NULL, err, errlen);
    if (caps)
        return errorf(err, errlen, "'%s': alloc=pyramid splits the budget over layers, and %s chooses its lanes' "
                      "sizes itself: give one of them", spec->text, spec->name);
    const KVPolicyOps *ops = kv_policy_find(spec->name);
    if (!ops || !ops->evicts || !spec->budget)
        return errorf(err, errlen, "'%s': alloc=pyramid splits an eviction policy's budget in tokens over the layers "
                      "(PyramidKV); give one with a budget (h2o:256,alloc=pyramid)", spec->text);
    int n_lanes = shape->n_layers * shape->n_kv_heads, *pyr = malloc((size_t)n_lanes * sizeof(int));
    if (!pyr) return errorf(err, errlen, "out of memory");
    pyramid_caps(pyr, shape, spec->budget);
    /* the policy's budget rule (sinks, a recent window, ... inside the budget) must hold in the smallest lanes too,
       the top layer's: the policy's own check, run with their size */
    int top = shape->n_layers - 1, kmin = pyr[top * shape->n_kv_heads];
    if (ops->init) {
        KVSpec sp = *spec;
        KVPolicy p = {.ops = ops, .spec = &sp, .n_lanes = n_lanes, .n_kv_heads = shape->n_kv_heads,
                      .n_heads = shape->n_heads, .budget = kmin, .agg = spec->agg};
        char why[384];
        int bad = ops->init(&p, &sp, shape, kmin, why, sizeof why);
        free(p.state);
        if (bad) {
            free(pyr);
            return errorf(err, errlen, "'%s': alloc=pyramid gives layer %d's lanes %d slots (the budget / 20), too few "
                          "for %s: %s; a larger budget gives them more", spec->text, top, kmin, spec->name, why);
        }
    }
    int rc = cache_init(c, shape, spec, pyr, 1, NULL, err, errlen);
    free(pyr);
    return rc;
}

int kv_cache_init_pool(KVCache *c, const KVShape *shape, const KVSpec *spec, KVPool *pool, char *err, size_t errlen) {
    return cache_init(c, shape, spec, NULL, 1, pool, err, errlen);
}

/* 0, or -1 + message when a spec cannot keep its lanes in pages (kv_cache_init_pool says which cannot yet); `who`
 * names the lanes for the message. */
static int paged_check(const KVCache *c, const char *who, char *err, size_t errlen) {
    const char *why = c->n_bands > 1 ? "several precision bands (prec=, residual=)"
                    : c->kgroup ? "per-channel keys (kgroup=channel)"
                    : c->krank || c->vrank ? "low rank (rank=, krank=, vrank=)"
                    : c->spec.fast_bytes || c->spec.fast_frac > 0 ? "memory tiers (fast=)" : NULL;
    if (why) return errorf(err, errlen, "'%s': %s hold one storage form in pages; %s are not paged yet", c->spec.text,
                           who, why);
    return 0;
}

/* 0, or -1 + message when a spec cannot keep its lanes in a serving pool's pages; sets c->page_slots. */
static int pool_check(KVCache *c, KVPool *pool, char *err, size_t errlen) {
    if (paged_check(c, c->ada ? "alloc=ada's lanes (paged, here from the serving pool)" : "a serving pool's lanes",
                    err, errlen)) return -1;
    size_t pair = c->band_kb[0] + c->band_vb[0];
    int P = 1;
    while ((size_t)(2 * P) * pair <= pool->page_bytes && 2 * P <= (1 << 20)) P *= 2;
    if ((size_t)P * pair > pool->page_bytes)
        return errorf(err, errlen, "'%s': one slot of a lane (%zu B of key and value) does not fit the pool's page of "
                      "%zu B", c->spec.text, pair, pool->page_bytes);
    c->page_slots = P;
    return 0;
}

/* alloc=ada's spec (kv.h, "Budgets over a layer's kv heads"): 0, or -1 + a message naming alloc=ada when the policy or
 * the spec cannot share a layer's slots; reads safeguard= (refused without alloc=ada) into c->ada_safeguard and
 * c->ada_safe. What paged lanes refuse (prec=, kgroup=, rank=, fast=) is said later, by paged_check. */
static int ada_check(KVCache *c, const KVPolicyOps *ops, const int *caps, char *err, size_t errlen) {
    const char *sg = kv_spec_get(&c->spec, "safeguard"), *t = c->spec.text, *name = c->spec.name;
    if (!c->ada)
        return sg ? errorf(err, errlen, "'%s': safeguard= is alloc=ada's share of the budget every kv head keeps; it "
                           "takes alloc=ada (%s:256,alloc=ada,safeguard=0.2)", t, name) : 0;
    if (!ops->evicts || !ops->keep_score || ops->merge) {
        char names[160] = "";
        for (int i = 0; kv_policy_at(i); i++)
            if (kv_policy_at(i)->evicts && kv_policy_at(i)->keep_score && !kv_policy_at(i)->merge)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *names ? ", " : "",
                         kv_policy_at(i)->name);
        return errorf(err, errlen, "'%s': alloc=ada frees the lowest keep scores of a layer's kv heads together, and "
                      "%s %s; it takes the eviction policies that score their slots: %s", t, name,
                      !ops->evicts ? "does not evict (its lanes hold every token up to -c)"
                      : ops->merge ? "merges instead of evicting" : "gives no keep score", names);
    }
    if (c->spec.budget_bytes)
        return errorf(err, errlen, "'%s': give alloc=ada's budget in tokens (%s:256,alloc=ada): its lanes are paged "
                      "from a pool sized by the budget, and a byte budget is not resolved over that pool", t, name);
    if (!c->spec.budget)
        return errorf(err, errlen, "'%s': alloc=ada shares a budget in tokens among a layer's kv heads; give one "
                      "(%s:256,alloc=ada)", t, name);
    if (c->merge_evict)
        return errorf(err, errlen, "'%s': alloc=ada does not combine with merge=1: a layer-wide eviction shrinks a "
                      "lane, and merge-on-evict would keep its victims inside it", t);
    if (caps)
        return errorf(err, errlen, "'%s': alloc=ada sizes its lanes itself (each may take its layer's H x budget), so "
                      "it takes no ragged lanes", t);
    c->ada_safeguard = 0.2;
    if (sg && (parse_float(sg, 0, 1, &c->ada_safeguard) || !(c->ada_safeguard < 1)))
        return errorf(err, errlen, "bad safeguard=%s in '%s': the share of the budget each kv head keeps under "
                      "alloc=ada, a number in [0, 1)", sg, t);
    c->ada_safe = (int)floor(c->ada_safeguard * c->spec.budget);
    return 0;
}

/* alloc=ada: a lane's cap, min(-c, H·B) slots (never below B, as a uniform lane's). */
static int ada_lane_cap(const KVShape *s, int B) {
    long most = (long)s->n_kv_heads * B, ctx = s->seq_len > B ? s->seq_len : B;
    return (int)(most < ctx ? most : ctx);
}

/* alloc=ada in a single run: the cache's own pool, sized for the worst case of every layer (ada_pool_pages, pages of
 * ada_page_slots). Sets c->pool, c->pool_owned, c->page_slots. 0, or -1 + message. */
static int ada_pool_new(KVCache *c, char *err, size_t errlen) {
    if (paged_check(c, "alloc=ada's lanes", err, errlen)) return -1;
    int B = c->policy.budget, P = ada_page_slots(B);
    size_t page = (size_t)P * (c->band_kb[0] + c->band_vb[0]), pages = ada_pool_pages(&c->shape, B, P);
    if (!(c->pool = calloc(1, sizeof *c->pool))) return errorf(err, errlen, "out of memory");
    c->pool_owned = 1;
    c->page_slots = P;
    if (kv_pool_init(c->pool, pages * page, page, err, errlen)) return -1;
    return 0;
}

static int cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, const int *caps, int notes, KVPool *pool,
                      char *err, size_t errlen) {
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
    if (spec_merge(c, ops, err, errlen)) return -1;
    const char *al = kv_spec_get(&c->spec, "alloc");
    if (al && strcmp(al, "uniform") && strcmp(al, "pyramid") && strcmp(al, "ada"))
        return errorf(err, errlen, "unknown alloc=%s in '%s'; choices: uniform (every lane the budget), pyramid "
                      "(PyramidKV: more slots for lower layers), ada (Ada-KV: a layer's slots go to the kv heads "
                      "whose scores need them)", al, spec->text);
    c->ada = al && !strcmp(al, "ada");
    if (ada_check(c, ops, caps, err, errlen)) return -1;
    if (al && !strcmp(al, "pyramid") && (!caps || pool))
        return errorf(err, errlen, "'%s': alloc=pyramid makes ragged lanes, which %s", spec->text,
                      pool ? "a serving pool does not page yet" : "kv_cache_init_lanes sizes");
    int budget = spec->budget;
    if (spec->budget_bytes) {
        if (ops->select)
            return errorf(err, errlen, "'%s': %s stores every token up to the context (-c) and its budget is the "
                          "tokens one query reads, so a byte budget does not set its size (a fast memory tier, "
                          "fast=BYTES, sets what it keeps in fast memory); give it in tokens (%s:256)", spec->text,
                          spec->name, spec->name);
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
        if (ops->needs_budget && ops->select)
            return errorf(err, errlen, "'%s' needs a budget: %s:TOKENS, the tokens one query reads (e.g. %s:256)",
                          spec->text, spec->name, spec->name);
        if (ops->needs_budget)
            return errorf(err, errlen, "'%s' needs a budget: %s:TOKENS or %s:BYTES (e.g. %s:1024, %s:64MiB)",
                          spec->text, spec->name, spec->name, spec->name, spec->name);
        budget = shape->seq_len;
    }
    if (budget < 1) return errorf(err, errlen, "'%s': no budget and no context length", spec->text);
    if (c->merge_evict && budget < 2)
        return errorf(err, errlen, "'%s': merge=1 merges a victim into another kept slot, which a lane of one slot "
                      "never has: use a budget >= 2", spec->text);
    /* slots per lane: the budget; snapkv's lanes grow to -c after its compression (or stay at a larger budget); a
       selection policy's lanes hold every token up to -c whatever it reads (a budget above -c reads them all) */
    int n_lanes = shape->n_layers * shape->n_kv_heads;
    int slots = ops->select ? shape->seq_len : ops->grows ? (shape->seq_len > budget ? shape->seq_len : budget) : budget;
    if (c->ada) slots = ada_lane_cap(shape, budget);   /* a lane may take its layer's share (kv.h) */
    if (spec->residual > slots && slots == budget)
        return errorf(err, errlen, "residual=%d in '%s' exceeds the budget of %d tokens (residual tokens are part of "
                      "it)", spec->residual, spec->text, budget);
    if (spec->residual > slots)
        return errorf(err, errlen, "residual=%d in '%s' exceeds the %d slots of a lane (-c; residual tokens are part "
                      "of them)", spec->residual, spec->text, slots);
    c->budget = slots;
    if (caps) {
        c->budget = 0;
        for (int i = 0; i < n_lanes; i++) {
            if (caps[i] < 1) return errorf(err, errlen, "'%s': lane %d is given %d slots; every lane needs one",
                                           spec->text, i, caps[i]);
            c->budget = caps[i] > c->budget ? caps[i] : c->budget;
        }
    }
    c->n_bands = spec_bands(spec, c->band_ktype, c->band_vtype, c->band_want);
    int G = spec_kgroup(spec), any_chan = 0;
    c->krank = spec->krank;
    c->vrank = spec->vrank;
    c->calib = spec_calib(shape, spec);
    for (int b = 0; b < c->n_bands; b++) {   /* a low-rank side stores krank (vrank) coefficients per slot */
        c->band_kchan[b] = G && kv_type_bits(c->band_ktype[b]);
        any_chan |= c->band_kchan[b];
        c->band_kb[b] = c->band_kchan[b] ? band_key_bytes(c->band_ktype[b], 1, shape->head_dim)
                                         : kv_vector_bytes(c->band_ktype[b], c->krank ? c->krank : shape->head_dim);
        c->band_vb[b] = kv_vector_bytes(c->band_vtype[b], c->vrank ? c->vrank : shape->head_dim);
    }
    if (G && !any_chan)
        return errorf(err, errlen, "'%s': kgroup=channel quantizes keys per channel, but no band of it has quantized "
                      "keys: give a q8, q4 or q2 key type (type=, ktype= or prec=)", spec->text);
    int merge_on_evict = spec_merge_value(spec) == 1;
    if (G && (ops->merge || merge_on_evict || ops->select || spec->fast_bytes || spec->fast_frac > 0))
        return errorf(err, errlen, "'%s': kgroup=channel does not combine with %s yet (%s); it works with full and "
                      "the eviction policies (window, sink, h2o, ...) without merging, in one memory tier", spec->text,
                      ops->merge ? "a merging policy" : merge_on_evict ? "merge-on-evict, merge=1"
                      : ops->select ? "a selection policy" : "memory tiers, fast=",
                      ops->merge || merge_on_evict ? "a merged key would move its sealed group's ranges"
                      : ops->select ? "the selected reads are not built over sealed groups"
                      : "the fast tier moves vectors one at a time, a sealed group is one block");
    if ((spec->krank || spec->vrank) && G)
        return errorf(err, errlen, "'%s': low rank (rank=, krank=, vrank=) does not combine with kgroup=channel yet: "
                      "give one of them", spec->text);
    if ((spec->krank || spec->vrank) && lowrank_check(c, shape, spec, ops, err, errlen)) return -1;
    c->kgroup = G;
    c->stage_kb = c->krank ? kv_vector_bytes(c->band_ktype[0], shape->head_dim) : 0;
    c->stage_vb = c->vrank ? kv_vector_bytes(c->band_vtype[0], shape->head_dim) : 0;
    c->spec.ktype = c->band_ktype[c->n_bands - 1];   /* the base type (prec='s last band) */
    c->spec.vtype = c->band_vtype[c->n_bands - 1];
    c->residual = c->n_bands == 2 && c->band_ktype[0] == KV_F32 && c->band_vtype[0] == KV_F32
                  ? (c->band_want[0] < c->budget ? c->band_want[0] : c->budget) : 0;
    c->merges = ops->merge != NULL;
    c->policy.ops = ops;
    c->policy.spec = &c->spec;
    c->policy.budget = budget;
    c->policy.n_lanes = n_lanes;
    c->policy.n_kv_heads = shape->n_kv_heads;
    c->policy.n_heads = shape->n_heads;
    c->policy.agg = spec->agg;
    /* (a per-channel key changes when its group seals) */
    c->policy.keys_fixed = c->n_bands == 1 && !ops->evicts && !ops->prune && !ops->merge && !G;
    c->meta_bytes = ops->meta_bytes_per_slot ? ops->meta_bytes_per_slot(&c->spec, budget) : 0;
    c->policy.meta_bytes = c->meta_bytes;
    if (ops->init && ops->init(&c->policy, &c->spec, shape, budget, err, errlen)) {
        kv_cache_free(c);
        return -1;
    }
    if (spec_prompt(c, err, errlen)) { kv_cache_free(c); return -1; }
    for (int i = 0; i < c->spec.n_params; i++)
        if (!c->spec.used[i]) {
            errorf(err, errlen, "'%s' takes no option '%s' (in '%s'); its options: %s; every policy takes "
                   COMMON_KEYS "%s", spec->name, c->spec.keys[i], spec->text, *ops->options ? ops->options : "none",
                   ops->select ? "; every selection policy takes prompt" : "");
            kv_cache_free(c);
            return -1;
        }

    int hd = shape->head_dim, B = c->budget;
    if (pool && caps) { kv_cache_free(c); return errorf(err, errlen, "'%s': a pool cache takes no ragged caps yet", spec->text); }
    if (pool) {
        c->pool = pool;
        if (pool_check(c, pool, err, errlen)) { kv_cache_free(c); return -1; }
    } else if (c->ada && ada_pool_new(c, err, errlen)) { kv_cache_free(c); return -1; }
    c->k_bytes = c->band_kb[c->n_bands - 1];
    c->v_bytes = c->band_vb[c->n_bands - 1];
    /* one arena for every lane; calloc: large arenas come zeroed from the kernel page by page, so a cache costs
       memory as it fills (in 2 MiB huge pages where the kernel gives them: mem_advise_huge; attn_bench at 8,192
       tokens, 2 threads: f32 21.3 -> 19.8 ms per step, q8 11.0 -> 10.4); malloc's alignment (max_align_t, 16 bytes
       on the targets we build for) is what the arrays need */
    c->lanes = calloc((size_t)n_lanes, sizeof(KVLane));
    if (c->lanes)
        for (int i = 0; i < n_lanes; i++) c->arena_bytes += lane_carve(c, &c->lanes[i], caps ? caps[i] : B, NULL);
    c->arena = calloc(1, c->arena_bytes ? c->arena_bytes : 16);
    mem_advise_huge(c->arena, c->arena_bytes);   /* before the first touch */
    c->scores = calloc((size_t)shape->n_heads * B, sizeof(float));
    c->agg = calloc((size_t)shape->n_kv_heads * B, sizeof(float));
    c->mean = calloc((size_t)shape->n_kv_heads * B, sizeof(float));
    c->kbuf = calloc((size_t)shape->n_kv_heads * B * hd, sizeof(float));
    c->vbuf = calloc((size_t)shape->n_kv_heads * B * hd, sizeof(float));
    c->qbuf = calloc((size_t)shape->n_heads * hd, sizeof(float));
    c->vptr = calloc((size_t)shape->n_kv_heads * B, sizeof(float *));
    c->vrow = calloc((size_t)shape->n_kv_heads * B, sizeof(uint8_t *));
    c->vrow_type = calloc((size_t)shape->n_kv_heads * B, 1);
    c->victim_buf = calloc((size_t)B, sizeof(int));
    c->run_buf = calloc((size_t)B, sizeof(int));
    c->score_buf = calloc((size_t)B, sizeof(double));
    c->sel_score = calloc((size_t)B, sizeof(float));
    c->read_rank = calloc((size_t)shape->n_kv_heads * B, sizeof(int));
    c->read_n = calloc((size_t)shape->n_kv_heads, sizeof(int));
    if (G) c->kgbuf = malloc((size_t)G * hd * sizeof(float));
    if (spec->pos == POS_CACHE) c->rope_cs = calloc((size_t)B * hd, sizeof(float));
    c->rope_t = calloc((size_t)hd, sizeof(float));
    int H = shape->n_kv_heads;
    if (c->ada) {
        c->ada_score = calloc((size_t)H * B, sizeof(double));
        c->ada_taken = calloc((size_t)H * B, 1);
        c->ada_rank = calloc((size_t)H * H, sizeof(int));
        c->ada_vscore = calloc((size_t)H * H, sizeof(double));
    }
    c->rope_t_pos = -1;
    if (!c->arena || !c->lanes || !c->scores || !c->agg || !c->mean || !c->kbuf || !c->vbuf || !c->qbuf
        || !c->vptr || !c->vrow || !c->vrow_type || !c->victim_buf || !c->run_buf || !c->score_buf || !c->sel_score || !c->read_rank
        || !c->read_n || (spec->pos == POS_CACHE && !c->rope_cs) || !c->rope_t || (G && !c->kgbuf)
        || (c->ada && (!c->ada_score || !c->ada_taken || !c->ada_rank || !c->ada_vscore))) {
        size_t want = c->arena_bytes;
        kv_cache_free(c);
        return errorf(err, errlen, "cannot allocate the KV cache of '%s': %d slot%s per lane x %d lanes = %.2f GiB; "
                      "use a smaller -c or budget", spec->text, B, B == 1 ? "" : "s", n_lanes, want / 1073741824.0);
    }
    if (c->rope_cs)
        for (int i = 0; i < B; i++) rope_cs(c->rope_cs + (size_t)i * hd, shape, i);
    uint8_t *p = c->arena;
    for (int i = 0; i < n_lanes; i++) p += lane_carve(c, &c->lanes[i], caps ? caps[i] : B, p);
    if (c->krank || c->vrank) {   /* low rank: the staging rows of every lane in one block, the second moments */
        for (int i = 0; i < n_lanes; i++) {
            c->lanes[i].stage_off = c->stage_bytes;
            c->stage_bytes += (size_t)stage_rows(c->lanes[i].cap, c->calib) * (c->stage_kb + c->stage_vb);
        }
        c->stage = calloc(1, c->stage_bytes);
        c->lr_cov = calloc((size_t)n_lanes * 3 * hd * hd, sizeof(double));
        if (!c->stage || !c->lr_cov) {
            kv_cache_free(c);
            return errorf(err, errlen, "cannot allocate the low-rank staging of '%s'", spec->text);
        }
    }
    c->policy.lanes = c->lanes;
    if (kv_tier_init(c, err, errlen)) { kv_cache_free(c); return -1; }
    kv_cache_reset(c);
    if (notes) spec_notes(c);
    return 0;
}

/* A pool lane gives every page back (the last taken first, so a cached prefix's longer blocks leave the cache first). */
static void lane_release_pages(KVCache *c, KVLane *ln) {
    while (ln->n_pages > 0) kv_pool_release(c->pool, ln->page_id[--ln->n_pages]);
}

void kv_cache_reset(KVCache *c) {
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads;
    if (c->pool)
        for (int i = 0; i < n_lanes; i++) lane_release_pages(c, &c->lanes[i]);
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        ln->n_live = 0;
        for (int b = 0; b < c->n_bands; b++) {   /* each band pops its slots in increasing order */
            ln->kopen[b] = -1;
            ln->n_free[b] = c->pool ? 0 : ln->band_slots[b];   /* a pool lane's slots come with its pages */
            for (int s = 0; s < ln->band_slots[b]; s++) ln->free[b][s] = ln->band_first[b] + ln->band_slots[b] - 1 - s;
        }
        for (int s = 0; s < ln->cap; s++) ln->pos[s] = -1;
        if (ln->pos0) for (int s = 0; s < ln->cap; s++) ln->pos0[s] = -1;
        if (ln->mw) memset(ln->mw, 0, (size_t)ln->cap * sizeof(float));
        memset(ln->meta, 0, (size_t)ln->cap * c->meta_bytes);
        ln->lr_seen = ln->lr_fitted = 0;
    }
    if (c->krank || c->vrank) {   /* a new document calibrates again: the staging comes back until its fit */
        memset(c->lr_cov, 0, (size_t)n_lanes * 3 * c->shape.head_dim * c->shape.head_dim * sizeof(double));
        if (!c->stage && !(c->stage = calloc(1, c->stage_bytes))) {
            fprintf(stderr, "kv: out of memory for the low-rank staging of '%s' (%zu bytes)\n", c->spec.text,
                    c->stage_bytes);
            exit(EXIT_FAILURE);
        }
    }
    for (int g = 0; g < c->shape.n_kv_heads; g++) c->read_n[g] = -1;
    if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_RESET, -1, -1, -1, -1, -1, NULL, NULL);
    c->policy.prompt_len = c->policy.context_len = 0;
    if (c->policy.ops && c->policy.ops->reset) c->policy.ops->reset(&c->policy);
    c->live_bytes = 0;
    kv_tier_reset(c);
}

void kv_cache_free(KVCache *c) {
    if (c->pool && c->lanes)
        for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) lane_release_pages(c, &c->lanes[i]);
    if (c->pool_owned) { kv_pool_free(c->pool); free(c->pool); }
    free(c->ada_score); free(c->ada_taken); free(c->ada_rank); free(c->ada_vscore);
    if (c->policy.ops && c->policy.ops->free) c->policy.ops->free(&c->policy);
    else free(c->policy.state);
    free(c->arena); free(c->lanes); free(c->scores); free(c->agg); free(c->mean); free(c->kbuf);
    free(c->vbuf); free(c->qbuf); free(c->vptr); free(c->vrow); free(c->vrow_type);
    free(c->chunk_cs); free(c->vstart); free(c->vpart);
    free(c->rope_cs); free(c->rope_t); free(c->victim_buf); free(c->run_buf); free(c->score_buf);
    free(c->sel_score); free(c->read_rank); free(c->read_n); free(c->kgbuf);
    free(c->stage); free(c->lr_cov); free(c->lr_cs);
    kv_tier_free(c);
    memset(c, 0, sizeof *c);
}

int kv_cache_restore(KVCache *dst, const KVCache *src, char *err, size_t errlen) {
    if (src->device || dst->device || dst->on_slot)
        return errorf(err, errlen, "kv: a cache with a device mirror cannot be cloned or restored");
    if (src->pool || dst->pool)
        return errorf(err, errlen, "kv: '%s' keeps its lanes in pages (%s), which cannot be cloned or restored yet",
                      src->spec.text, src->pool_owned || dst->pool_owned ? "alloc=ada" : "a serving pool");
    int n_lanes = src->shape.n_layers * src->shape.n_kv_heads;
    if (strcmp(dst->spec.text, src->spec.text) || dst->arena_bytes != src->arena_bytes || dst->budget != src->budget
        || dst->policy.state_bytes != src->policy.state_bytes
        || dst->shape.n_layers * dst->shape.n_kv_heads != n_lanes)
        return errorf(err, errlen, "kv: restore of '%s' into a cache made from another spec or shape ('%s')",
                      src->spec.text, dst->spec.text);
    memcpy(dst->arena, src->arena, src->arena_bytes);
    for (int i = 0; i < n_lanes; i++) {
        KVLane *d = &dst->lanes[i];
        const KVLane *s = &src->lanes[i];
        if (d->cap != s->cap) return errorf(err, errlen, "kv: restore into lanes of other sizes");
        d->n_live = s->n_live;
        d->peak_live = s->peak_live;
        memcpy(d->n_free, s->n_free, sizeof d->n_free);
        memcpy(d->kopen, s->kopen, sizeof d->kopen);
        d->lr_seen = s->lr_seen;
        d->lr_fitted = s->lr_fitted;
    }
    if (src->krank || src->vrank) {   /* the bases came with the arena; the moments, the staging, the rotations */
        int hd = src->shape.head_dim;
        memcpy(dst->lr_cov, src->lr_cov, (size_t)n_lanes * 3 * hd * hd * sizeof(double));
        if (src->stage && !dst->stage && !(dst->stage = malloc(src->stage_bytes)))
            return errorf(err, errlen, "kv: out of memory for the low-rank staging of '%s'", src->spec.text);
        if (src->stage) memcpy(dst->stage, src->stage, src->stage_bytes);
        else { free(dst->stage); dst->stage = NULL; }
        if (src->lr_cs_n > 0 && lowrank_grow_cs(dst, src->lr_cs_n - 1))
            return errorf(err, errlen, "kv: out of memory for the rotations of '%s'", src->spec.text);
    }
    if (src->policy.state_bytes) memcpy(dst->policy.state, src->policy.state, src->policy.state_bytes);
    dst->policy.prompt_len = src->policy.prompt_len;
    dst->policy.context_len = src->policy.context_len;
    memcpy(dst->read_n, src->read_n, (size_t)src->shape.n_kv_heads * sizeof(int));
    memcpy(dst->read_rank, src->read_rank, (size_t)src->shape.n_kv_heads * src->budget * sizeof(int));
    dst->live_bytes = src->live_bytes;
    dst->peak_live_bytes = src->peak_live_bytes;
    dst->n_evictions = src->n_evictions;
    dst->n_merged = src->n_merged;
    dst->bytes_read = src->bytes_read;
    dst->steps_read = src->steps_read;
    dst->chunk_steps = src->chunk_steps;
    dst->bytes_moved = src->bytes_moved;
    dst->keys_scanned = src->keys_scanned;
    dst->slots_read = src->slots_read;
    kv_tier_copy(dst, src);
    return 0;
}

int kv_cache_clone(KVCache *dst, const KVCache *src, char *err, size_t errlen) {
    if (src->device) return errorf(err, errlen, "kv: a cache with a device mirror cannot be cloned");
    if (src->pool)
        return errorf(err, errlen, "kv: '%s' keeps its lanes in pages (%s), which cannot be cloned yet (its pages "
                      "would be shared)", src->spec.text, src->pool_owned ? "alloc=ada" : "a serving pool");
    int n_lanes = src->shape.n_layers * src->shape.n_kv_heads, *caps = malloc((size_t)n_lanes * sizeof(int));
    if (!caps) return errorf(err, errlen, "out of memory");
    for (int i = 0; i < n_lanes; i++) caps[i] = src->lanes[i].cap;
    KVSpec spec = src->spec;
    memset(spec.used, 0, sizeof spec.used);
    /* the spec as parsed (src->spec has the base type written over ktype/vtype, which the bands already hold) */
    int rc = cache_init(dst, &src->shape, &spec, caps, 0, NULL, err, errlen);
    free(caps);
    if (rc) return -1;
    dst->backend = src->backend;
    if (kv_cache_restore(dst, src, err, errlen)) { kv_cache_free(dst); return -1; }
    return 0;
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
void kv_set_context_len(KVCache *c, int n_tokens) { c->policy.context_len = n_tokens > 0 ? n_tokens : 0; }

/* 1 when each slot of c is one key and one value as stored and nothing else follows it: one storage band, no
 * per-channel keys, low rank, merging, memory tiers or device mirror (what kv_cache_transfer can move, and
 * kv_full_prefix asks first). */
static int lanes_plain(const KVCache *c) {
    return c->n_bands == 1 && !c->kgroup && !c->krank && !c->vrank && !c->merges && !c->merge_evict && !c->device
           && !c->on_slot && !c->tiers;
}

int kv_full_prefix(const KVCache *c) {
    const KVPolicyOps *ops = c->policy.ops;
    if (!ops->full_prefix || !lanes_plain(c) || c->band_ktype[0] != KV_F32 || c->band_vtype[0] != KV_F32
        || c->spec.pos != POS_ORIG || c->ada || c->pool)
        return 0;
    int n = ops->full_prefix(&c->policy);
    if (ops->select) {   /* it selects from the first query, or from the prompt's end under prompt=dense */
        int until = c->prompt_dense ? c->policy.prompt_len : 0;
        if (n > until) n = until;
    }
    for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++)
        if (c->lanes[i].cap < n) n = c->lanes[i].cap;   /* the first token that finds a lane full may evict */
    return n > 0 ? n : 0;
}

int kv_query_aware(const KVCache *c) {
    const char *q = kv_spec_value(&c->spec, "query");
    return c->policy.ops->prompt_end && !(q && !strcmp(q, "agnostic"));
}

/* A policy bug, never an input error: stop before the lists are corrupted. */
static void policy_bug(const KVCache *c, const char *verb, int l, int g, int rank, int n_live) {
    fprintf(stderr, "kv: policy '%s' named rank %d of layer %d kv head %d in %s, which holds %d live tokens (or named "
            "it twice)\n", c->spec.name, rank, l, g, verb, n_live);
    abort();
}

static void emit(KVCache *c, KVEventKind kind, int t, int l, int g, int pos, int pos0, int n, int band, double score) {
    if (!c->on_event) return;
    KVEvent ev = {kind, t, l, g, pos, pos0, n, -1, band, band >= 0 ? c->band_ktype[band] : KV_F32,
                  band >= 0 ? c->band_vtype[band] : KV_F32, score, kind == KV_EV_EVICT ? c->policy.ops->reason : ""};
    c->on_event(c->event_ctx, &ev);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Per-channel keys (kgroup=channel; kv.h states the rules): a band's rows in groups of G, the open group's keys in
 * f32, a sealed group's keys as codes against per-channel scales and minimums.
 * ------------------------------------------------------------------------------------------------------------- */

static uint8_t *chan_codes(const KVCache *c, const KVLane *ln, int b, int r) {   /* row r's codes */
    return kv_band_k(c, ln, b, r);
}
static uint8_t *chan_hdr(const KVCache *c, const KVLane *ln, int b, int j) {     /* group j's scales, minimums */
    return ln->k[b] + chan_hdr_off(c->band_kb[b], ln->band_slots[b]) + (size_t)j * chan_hdr_bytes(c->shape.head_dim);
}
static float *chan_open_row(const KVCache *c, const KVLane *ln, int b, int r) {   /* row r of the open group, f32 */
    int hd = c->shape.head_dim;
    uint8_t *open = ln->k[b] + chan_open_off(c->band_kb[b], ln->band_slots[b], c->kgroup, hd);
    return (float *)(void *)open + (size_t)(r % c->kgroup) * hd;
}

#ifdef __AVX512F__
/* Codes e .. e+15 of a row (bits 8, 4 or 2 per code, packed from the low bits of each byte as kv_chan_code reads
 * them) as 16 int32 lanes. Reads the 16, 8 or 4 bytes that hold them and no more (a row's codes end the row). */
static inline __m512i chan_codes16(const uint8_t *q, int bits, int e) {
    if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(q + e)));
    __m128i by;   /* byte i: the byte that holds code e + i */
    __m512i shift;
    if (bits == 4) {
        __m128i b8 = _mm_loadl_epi64((const __m128i *)(const void *)(q + e / 2));
        by = _mm_unpacklo_epi8(b8, b8);
        shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    } else {
        int32_t w;
        memcpy(&w, q + e / 4, 4);
        by = _mm_shuffle_epi8(_mm_cvtsi32_si128(w), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
        shift = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    }
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(by), shift), _mm512_set1_epi32((1 << bits) - 1));
}
#endif

/* Row r of a sealed group decoded into x (head_dim): x_e = d_e·q_e + m_e, kv_codec.h's q4 arithmetic per channel.
 * With AVX-512 16 channels at a time: the f16 scales and minimums widened by vcvtph2ps (exact, as kv_decode's F16),
 * the codes widened to floats (exact), then the multiply and the add each rounded as the loop below rounds them. */
static void chan_decode(const KVCache *c, const KVLane *ln, int b, int r, float *x) {
    int hd = c->shape.head_dim;
    const uint8_t *q = chan_codes(c, ln, b, r), *h = chan_hdr(c, ln, b, r / c->kgroup);
#ifdef __AVX512F__
    if (hd % 16 == 0) {
        int bits = kv_type_bits(c->band_ktype[b]);
        for (int e = 0; e < hd; e += 16) {
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + 2 * e)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + 2 * hd + 2 * e)));
            __m512 v = _mm512_cvtepi32_ps(chan_codes16(q, bits, e));
            _mm512_storeu_ps(x + e, _mm512_add_ps(_mm512_mul_ps(d, v), m));
        }
        return;
    }
#endif
    float d[hd], m[hd];
    kv_decode(d, KV_F16, h, hd);
    kv_decode(m, KV_F16, h + 2 * hd, hd);
    switch (kv_type_bits(c->band_ktype[b])) {   /* a constant width in each loop */
    case 8: for (int e = 0; e < hd; e++) x[e] = kv_add_rn(kv_mul_rn(d[e], (float)kv_chan_code(q, 8, e)), m[e]); break;
    case 4: for (int e = 0; e < hd; e++) x[e] = kv_add_rn(kv_mul_rn(d[e], (float)kv_chan_code(q, 4, e)), m[e]); break;
    default: for (int e = 0; e < hd; e++) x[e] = kv_add_rn(kv_mul_rn(d[e], (float)kv_chan_code(q, 2, e)), m[e]); break;
    }
}

const float *kv_chan_key(const KVCache *c, const KVLane *ln, int b, int slot, float *x) {
    int r = slot - ln->band_first[b];
    if (ln->kopen[b] == r / c->kgroup) return chan_open_row(c, ln, b, r);
    chan_decode(c, ln, b, r, x);
    return x;
}

/* Row r's codes of x (head_dim) against its group's scales and minimums (kv_code: rounded, clamped to the codes).
 * With AVX-512 16 channels at a time, kv_code's bits: (x - m) / d (one subtraction, one division), rounded half away
 * from zero as trunc(v) + sign(v) where |v - trunc(v)| >= 1/2 (exact: roundf), 0 where d is not > 0 or v is NaN,
 * clamped to [0, qmax]; then packed as kv_chan_code reads them. */
static void chan_encode_row(const KVCache *c, const KVLane *ln, int b, int r, const float *x) {
    int hd = c->shape.head_dim, bits = kv_type_bits(c->band_ktype[b]), qmax = (1 << bits) - 1, per = 8 / bits;
    uint8_t *q = chan_codes(c, ln, b, r);
    const uint8_t *h = chan_hdr(c, ln, b, r / c->kgroup);
    memset(q, 0, c->band_kb[b]);
#ifdef __AVX512F__
    if (hd % 16 == 0) {
        const __m512 zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f),
                     top = _mm512_set1_ps((float)qmax);
        for (int e = 0; e < hd; e += 16) {
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + 2 * e)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h + 2 * hd + 2 * e)));
            __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + e), m), d);
            __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
            __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN));
            __m512 rv = _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(one), sign)));
            rv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), rv);   /* d > 0, else 0 */
            rv = _mm512_min_ps(top, _mm512_max_ps(rv, zero));   /* max_ps(NaN, 0) is 0, as fmaxf */
            __m128i c8 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(rv));   /* code e + i in byte i */
            if (bits == 8) _mm_storeu_si128((__m128i *)(void *)(q + e), c8);
            else if (bits == 4)   /* byte i: codes 2i + 16·(2i + 1) */
                _mm_storel_epi64((__m128i *)(void *)(q + e / 2),
                                 _mm_packus_epi16(_mm_maddubs_epi16(c8, _mm_set1_epi16(0x1001)), _mm_setzero_si128()));
            else {   /* byte i: codes 4i + 4·(4i + 1) + 16·(4i + 2) + 64·(4i + 3) */
                __m128i w = _mm_madd_epi16(_mm_maddubs_epi16(c8, _mm_set1_epi16(0x0401)), _mm_set1_epi32(0x00100001));
                int32_t four = _mm_cvtsi128_si32(_mm_shuffle_epi8(w, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                                                              -1, -1, -1, -1, -1, -1)));
                memcpy(q + e / 4, &four, 4);
            }
        }
        return;
    }
#endif
    float d[hd], m[hd];
    kv_decode(d, KV_F16, h, hd);
    kv_decode(m, KV_F16, h + 2 * hd, hd);
    for (int e = 0; e < hd; e++) q[e / per] |= (uint8_t)(kv_code(x[e], m[e], d[e], qmax) << (bits * (e % per)));
}

/* 1 when x (head_dim) lies within every channel's code range [m, m + qmax·d] of group j: coded with the group's
 * scales it is then within d/2 of each element. */
static int chan_fits(const KVCache *c, const KVLane *ln, int b, int j, const float *x) {
    int hd = c->shape.head_dim, qmax = (1 << kv_type_bits(c->band_ktype[b])) - 1;
    const uint8_t *h = chan_hdr(c, ln, b, j);
    float d[hd], m[hd];
    kv_decode(d, KV_F16, h, hd);
    kv_decode(m, KV_F16, h + 2 * hd, hd);
    for (int e = 0; e < hd; e++)
        if (!(x[e] >= m[e] && (double)x[e] <= (double)m[e] + qmax * (double)d[e])) return 0;
    return 1;
}

/* Quantize group j over its live rows: per channel the minimum and scale of the rows' keys (src: the group's rows,
 * head_dim each, row i = the group's i-th), then every live row's codes. */
static void chan_quantize(KVCache *c, KVLane *ln, int b, int j, const float *src) {
    int hd = c->shape.head_dim, rows = chan_group_rows(c, ln, b, j), s0 = ln->band_first[b] + j * c->kgroup;
    int qmax = (1 << kv_type_bits(c->band_ktype[b])) - 1;
    uint8_t *h = chan_hdr(c, ln, b, j);
    for (int e = 0; e < hd; e++) {
        float mn = INFINITY, mx = -INFINITY;
        for (int i = 0; i < rows; i++)
            if (ln->pos[s0 + i] >= 0) {
                mn = kv_min_tie_first(mn, src[(size_t)i * hd + e]);
                mx = kv_max_tie_first(mx, src[(size_t)i * hd + e]);
            }
        if (mn > mx) return;   /* no live row: nothing to code */
        uint16_t mh, dh;
        kv_minscale(mn, mx, qmax, &mh, &dh);
        kv_put16(h + 2 * e, dh);
        kv_put16(h + 2 * hd + 2 * e, mh);
    }
    for (int i = 0; i < rows; i++)
        if (ln->pos[s0 + i] >= 0) chan_encode_row(c, ln, b, j * c->kgroup + i, src + (size_t)i * hd);
}

/* Key x (head_dim) into the free row of slot s of per-channel band b, s now holding a token (ln->pos[s] set): into
 * the open group (sealed when that fills it), else coded against its sealed group, re-quantized when x does not fit
 * (kv.h). Counts the group's bytes. */
static void chan_put(KVCache *c, KVLane *ln, int b, int s, const float *x) {
    int hd = c->shape.head_dim, G = c->kgroup, r = s - ln->band_first[b], j = r / G, n = chan_group_live(c, ln, b, j);
    size_t before = chan_live_bytes(c, ln, b, j, n - 1);
    if (n == 1 && ln->kopen[b] < 0) ln->kopen[b] = j;   /* an empty group opens */
    if (ln->kopen[b] == j) {
        memcpy(chan_open_row(c, ln, b, r), x, (size_t)hd * sizeof(float));
        if (n == chan_group_rows(c, ln, b, j)) {   /* full: seal it */
            chan_quantize(c, ln, b, j, chan_open_row(c, ln, b, j * G));
            ln->kopen[b] = -1;
        }
    } else if (n > 1 && chan_fits(c, ln, b, j, x)) chan_encode_row(c, ln, b, r, x);
    else {   /* re-quantize the group with x, its other live keys decoded */
        int s0 = ln->band_first[b] + j * G, rows = chan_group_rows(c, ln, b, j);
        for (int i = 0; i < rows; i++)
            if (ln->pos[s0 + i] >= 0 && s0 + i != s) chan_decode(c, ln, b, j * G + i, c->kgbuf + (size_t)i * hd);
        memcpy(c->kgbuf + (size_t)(r % G) * hd, x, (size_t)hd * sizeof(float));
        chan_quantize(c, ln, b, j, c->kgbuf);
    }
    c->live_bytes = c->live_bytes - before + chan_live_bytes(c, ln, b, j, n);
}

/* Slot s of per-channel band b was freed (ln->pos[s] = -1 already): the other keys of its group keep their bits;
 * counts the group's bytes. */
static void chan_release(KVCache *c, KVLane *ln, int b, int s) {
    int j = (s - ln->band_first[b]) / c->kgroup, n = chan_group_live(c, ln, b, j);
    c->live_bytes = c->live_bytes - chan_live_bytes(c, ln, b, j, n + 1) + chan_live_bytes(c, ln, b, j, n);
}

/* A free slot of band b, taken off its stack: the top one; in a per-channel band the best by kv.h's order (a row of
 * the open group, else of an empty group, else any: a hole in a sealed group). While a lane fills, the top is the
 * open group's next row, so the search is rare. */
static int band_pop(const KVCache *c, KVLane *ln, int b) {
    int n = ln->n_free[b], pick = n - 1;
    if (c->band_kchan[b]) {
        int G = c->kgroup, best = 3, floor = ln->kopen[b] >= 0 ? 0 : 1;
        for (int i = n - 1; i >= 0 && best > floor; i--) {
            int j = (ln->free[b][i] - ln->band_first[b]) / G;
            int rank = j == ln->kopen[b] ? 0 : chan_group_live(c, ln, b, j) == 0 ? 1 : 2;
            if (rank < best) { best = rank; pick = i; }
        }
        int t = ln->free[b][pick];
        ln->free[b][pick] = ln->free[b][n - 1];
        ln->free[b][n - 1] = t;
    }
    return ln->free[b][--ln->n_free[b]];
}

int kv_chan_room(const KVCache *c, const KVLane *ln, int b) {
    int j = ln->kopen[b];
    if (j < 0) {   /* the next store opens an empty group: band_pop's choice, the first such row from the stack's top */
        for (int i = ln->n_free[b] - 1; i >= 0 && j < 0; i--) {
            int x = (ln->free[b][i] - ln->band_first[b]) / c->kgroup;
            if (chan_group_live(c, ln, b, x) == 0) j = x;
        }
        if (j < 0) return 0;   /* only holes in sealed groups are free: a store there may re-quantize its group */
    }
    return chan_group_rows(c, ln, b, j) - 1 - chan_group_live(c, ln, b, j);
}

/* Mark slot s free (band's stack, bytes); the live list is compacted by lane_compact. */
static void slot_release(KVCache *c, KVLane *ln, int s) {
    int b = kv_slot_band(ln, s);
    ln->pos[s] = -1;
    if (ln->pos0) ln->pos0[s] = -1;
    ln->free[b][ln->n_free[b]++] = s;
    c->live_bytes -= token_bytes(c, ln, b);
    if (c->band_kchan[b]) chan_release(c, ln, b, s);
    kv_tier_release(c, (int)(ln - c->lanes), s);
}

/* Drop freed slots from the live list in one pass (so freeing many at once, as snapkv does, stays linear). */
static void lane_compact(KVCache *c, int lane, KVLane *ln) {
    int w = 0;
    for (int i = 0; i < ln->n_live; i++) {
        int s = ln->live[i];
        if (ln->pos[s] >= 0) ln->live[w++] = s;
        else if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_FREE, lane, s, -1, i, -1, NULL, NULL);
    }
    ln->n_live = w;
}

int kv_cache_truncate(KVCache *c, int n, char *err, size_t errlen) {
    if (c->pool || c->n_bands > 1 || c->kgroup || c->krank || c->vrank || c->merges || c->merge_evict || c->device
        || c->tiers)
        return errorf(err, errlen, "kv: '%s' keeps pages, several bands, per-channel keys, low rank, merged slots, "
                      "memory tiers or a device mirror: its tail cannot be dropped", c->spec.text);
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads;
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        for (int r = 0; r < ln->n_live; r++)
            if (ln->pos[ln->live[r]] >= n) slot_release(c, ln, ln->live[r]);
        lane_compact(c, i, ln);
    }
    for (int g = 0; g < c->shape.n_kv_heads; g++) c->read_n[g] = -1;   /* a selection made before is stale */
    return 0;
}

/* The stored vector of slot s as f32 (keys as stored: rotated under pos=orig, pre-RoPE under pos=cache). */
static void slot_read(const KVCache *c, const KVLane *ln, int s, int is_v, float *x) {
    int b = kv_slot_band(ln, s), row = s - ln->band_first[b];
    if (!is_v && c->band_kchan[b]) {
        const float *k = kv_chan_key(c, ln, b, s, x);
        if (k != x) memcpy(x, k, (size_t)c->shape.head_dim * sizeof(float));
    } else if (is_v) kv_decode(x, c->band_vtype[b], kv_band_v(c, ln, b, row), c->shape.head_dim);
    else kv_decode(x, c->band_ktype[b], kv_band_k(c, ln, b, row), c->shape.head_dim);
}

/* Slot s's key or value from x; a per-channel key goes through chan_put, so s must hold its token already (pos). */
static void slot_write(KVCache *c, KVLane *ln, int s, int is_v, const float *x) {
    int b = kv_slot_band(ln, s), row = s - ln->band_first[b];
    if (!is_v && c->band_kchan[b]) chan_put(c, ln, b, s, x);
    else if (is_v) kv_encode(kv_band_v(c, ln, b, row), c->band_vtype[b], x, c->shape.head_dim);
    else kv_encode(kv_band_k(c, ln, b, row), c->band_ktype[b], x, c->shape.head_dim);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Merge-on-evict (merge=1, any eviction policy): the victim the policy names is merged into the kept slot of its lane
 * whose key is most similar, instead of being freed alone. The rule combines two papers:
 *   D2O (Wan et al. 2024, "D2O: Dynamic Discriminative Operations for Efficient Generative Inference of Large
 *   Language Models", arXiv:2406.13035, its token-level merging): each evicted token is matched to the kept token of highest key
 *   cosine similarity. D2O merges only when that similarity passes a threshold it tracks as a moving average, and
 *   weighs the pair by their similarity;
 *   CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference"): the evicted token's
 *   attention decides how much of it is merged. CaM merges only the value, into the tokens after the victim, with a
 *   probability sampled from the attention ratio.
 * kvlab's rule is deterministic: every victim is merged (no threshold, no sampling), key and value alike, into the
 * kept slot of highest cosine (D2O's target), as the weighted average (w_v·x_v + w_t·x_t) / (w_v + w_t) with w each
 * slot's accumulated attention (CaM's signal, as a weight): the group-mean probabilities summed over every step the
 * slot was read (KVLane.mw, kept by the cache whatever the policy scores, so it works for sink and window too; a
 * merged slot's weight is the sum of its tokens', w_t += w_v), equal weights when both are 0.
 *   keys      as stored, decoded to f32: under pos=orig rotated by their positions (the merged key is then the
 *             weighted mean of rotated keys, so its score is the weighted mean of the two scores: exact for queries'
 *             dot products, but a softmax of a mean is not the mean of the probabilities); under pos=cache before
 *             RoPE, rotated later by the target's rank (the victim's offset is lost);
 *   cosine    in double from the f32 keys, d in order; a key of norm 0 has cosine 0 with every key; ties go to the
 *             oldest rank;
 *   targets   every live slot of the lane but the victims of this eviction (the token being stored is not stored
 *             yet): sinks and the newest tokens included, so protection decides who leaves, not who receives. A
 *             victim with no candidate (every live slot a victim: scissorhands freeing a whole lane) is freed alone;
 *   storage   each vector decoded from its own band's form, averaged in f32 (each operation rounded, none fused),
 *             encoded into the target's slot in the target's form (its band and type do not change);
 *   what stays the target keeps its position, band, tier and policy metadata (a policy's score stays the target's:
 *             the cache does not know its meaning); it covers the victim's positions for recall (eval.c);
 *   reads     the similarity pass reads every live key and the merge the two values: counted in bytes_read (the
 *             method's cost per step); with a fast tier these reads are made where the slots lie (no move counted),
 *             as a recode's are.
 * Several victims at once (scissorhands' drop=M) merge in the order the policy named them, each into a slot that is
 * not a victim, as it stands after the merges before it.
 * ------------------------------------------------------------------------------------------------------------- */

/* The candidate rank (skip[i] == 0) whose key is most similar to rank v's by cosine, as the rule above says; its
 * cosine in *cosine. -1 when there is none. Counts the keys it reads. */
static int merge_target(KVCache *c, const KVLane *ln, int v, const int *skip, double *cosine) {
    int hd = c->shape.head_dim, best = -1;
    float xv[hd], x[hd];
    slot_read(c, ln, ln->live[v], 0, xv);
    c->bytes_read += c->band_kb[kv_slot_band(ln, ln->live[v])];
    double nv = 0;
    for (int d = 0; d < hd; d++) nv += (double)xv[d] * xv[d];
    for (int i = 0; i < ln->n_live; i++) {
        if (skip[i]) continue;
        slot_read(c, ln, ln->live[i], 0, x);
        c->bytes_read += c->band_kb[kv_slot_band(ln, ln->live[i])];
        double dot = 0, nx = 0;
        for (int d = 0; d < hd; d++) { dot += (double)xv[d] * x[d]; nx += (double)x[d] * x[d]; }
        double cs = nv > 0 && nx > 0 ? dot / sqrt(nv * nx) : 0;
        if (best < 0 || cs > *cosine) { best = i; *cosine = cs; }
    }
    return best;
}

/* The merge verb: the victim at rank v is merged into the kept rank tgt (key and value weighted by mw, the target's
 * form), the target's weight becomes the sum, one KV_EV_MERGE (victim pos, into the target's) is reported, and the
 * victim's slot is freed (the live list is compacted by the caller). */
static void lane_merge_into(KVCache *c, int l, int g, KVLane *ln, int v, int tgt, double cosine, int t) {
    int hd = c->shape.head_dim, sv = ln->live[v], st = ln->live[tgt];
    float wv = ln->mw[sv], wt = ln->mw[st], a = wv, b = wt;
    if (!(a + b > 0)) a = b = 1;   /* neither was ever attended: equal weights */
    float xv[hd], xt[hd];
    for (int is_v = 0; is_v < 2; is_v++) {
        slot_read(c, ln, sv, is_v, xv);
        slot_read(c, ln, st, is_v, xt);
        for (int d = 0; d < hd; d++) xt[d] = (a * xv[d] + b * xt[d]) / (a + b);
        slot_write(c, ln, st, is_v, xt);
    }
    c->bytes_read += c->band_vb[kv_slot_band(ln, sv)] + c->band_vb[kv_slot_band(ln, st)];
    ln->mw[st] = wt + wv;
    if (c->on_event) {
        KVEvent ev = {KV_EV_MERGE, t, l, g, ln->pos[sv], ln->pos[sv], 2, ln->pos[st], -1, KV_F32, KV_F32, cosine, ""};
        c->on_event(c->event_ctx, &ev);
    }
    slot_release(c, ln, sv);
    c->n_merged++;
}

/* evict: free the n ranks the policy named, reporting each to the event log; with merge=1 each is merged into its
 * most similar kept slot instead (above). */
static void lane_evict(KVCache *c, int l, int g, KVLane *ln, const int *ranks, const double *score, int n, int t) {
    int *victim = c->run_buf;   /* (n_live) merge=1: 1 for the ranks named, which are no merge targets */
    if (c->merge_evict) {
        for (int i = 0; i < ln->n_live; i++) victim[i] = 0;
        for (int j = 0; j < n; j++) {
            int r = ranks[j];
            if (r < 0 || r >= ln->n_live || victim[r]) policy_bug(c, "evict", l, g, r, ln->n_live);
            victim[r] = 1;
        }
    }
    for (int j = 0; j < n; j++) {
        int r = ranks[j];
        if (r < 0 || r >= ln->n_live || ln->pos[ln->live[r]] < 0) policy_bug(c, "evict", l, g, r, ln->n_live);
        if (c->merge_evict) {
            double cosine = 0;
            int tgt = merge_target(c, ln, r, victim, &cosine);
            if (tgt >= 0) { lane_merge_into(c, l, g, ln, r, tgt, cosine, t); continue; }
        }
        int s = ln->live[r];
        emit(c, KV_EV_EVICT, t, l, g, ln->pos[s], ln->pos0 ? ln->pos0[s] : ln->pos[s], 1, -1, score[j]);
        slot_release(c, ln, s);
        c->n_evictions++;
    }
    lane_compact(c, l * c->shape.n_kv_heads + g, ln);
}

/* merge: each run of count[j] adjacent ranks from first[j] becomes one slot, the newest token's: key and value the
 * mean of the run's decoded vectors (summed in rank order in f32, then divided), encoded in that slot's form; it
 * covers pos0 of the run's oldest through pos of its newest. */
static void lane_merge(KVCache *c, int l, int g, KVLane *ln, const int *first, const int *count, int n, int t) {
    int hd = c->shape.head_dim, prev_end = 0;
    float sum[hd], x[hd];
    for (int j = 0; j < n; j++) {
        int r0 = first[j], m = count[j];
        if (m < 2 || r0 < prev_end || r0 + m > ln->n_live) policy_bug(c, "merge", l, g, r0, ln->n_live);
        prev_end = r0 + m;
        int dst = ln->live[r0 + m - 1], p0 = ln->pos0[ln->live[r0]];
        for (int is_v = 0; is_v < 2; is_v++) {
            for (int d = 0; d < hd; d++) sum[d] = 0;
            for (int i = r0; i < r0 + m; i++) {
                slot_read(c, ln, ln->live[i], is_v, x);
                for (int d = 0; d < hd; d++) sum[d] += x[d];
            }
            for (int d = 0; d < hd; d++) sum[d] /= (float)m;
            slot_write(c, ln, dst, is_v, sum);
        }
        emit(c, KV_EV_MERGE, t, l, g, ln->pos[dst], p0, m, -1, 0);
        for (int i = r0; i < r0 + m - 1; i++) slot_release(c, ln, ln->live[i]);
        ln->pos0[dst] = p0;
        c->n_merged += m - 1;
    }
    lane_compact(c, l * c->shape.n_kv_heads + g, ln);
}

/* recode: make room in band b (and every band it spills into) by moving its oldest token to the next band that has
 * slots, recoded into that band's form. The bands hold consecutive runs of ranks, band 0 the newest. */
static void band_make_room(KVCache *c, int l, int g, KVLane *ln, int b, int t) {
    if (ln->n_free[b] > 0) return;
    int next = b + 1;
    while (next < c->n_bands && ln->band_slots[next] == 0) next++;
    if (next == c->n_bands) {   /* the lane holds cap-1 tokens at most here: some band has room. A kv.c bug. */
        fprintf(stderr, "kv: no free slot in layer %d kv head %d (%d live of %d)\n", l, g, ln->n_live, ln->cap);
        abort();
    }
    band_make_room(c, l, g, ln, next, t);
    int newer = 0;
    for (int x = 0; x <= b; x++) newer += ln->band_slots[x] - ln->n_free[x];
    int i = ln->n_live - newer, hd = c->shape.head_dim;
    int from = ln->live[i], to = band_pop(c, ln, next);
    float x[hd];
    ln->pos[to] = ln->pos[from];
    for (int is_v = 0; is_v < 2; is_v++) {
        /* a form the two bands share moves as bytes (kprec=/vprec= apart); per-channel keys are their group's codes */
        KVType from_ty = is_v ? c->band_vtype[b] : c->band_ktype[b], to_ty = is_v ? c->band_vtype[next] : c->band_ktype[next];
        if (from_ty == to_ty && (is_v || (!c->band_kchan[b] && !c->band_kchan[next]))) {
            int rt = to - ln->band_first[next], rf = from - ln->band_first[b];
            if (is_v) memcpy(kv_band_v(c, ln, next, rt), kv_band_v(c, ln, b, rf), c->band_vb[b]);
            else memcpy(kv_band_k(c, ln, next, rt), kv_band_k(c, ln, b, rf), c->band_kb[b]);
        } else { slot_read(c, ln, from, is_v, x); slot_write(c, ln, to, is_v, x); }
    }
    if (ln->pos0) { ln->pos0[to] = ln->pos0[from]; ln->pos0[from] = -1; }
    if (ln->mw) { ln->mw[to] = ln->mw[from]; ln->mw[from] = 0; }
    ln->pos[from] = -1;
    if (c->band_kchan[b]) chan_release(c, ln, b, from);
    memcpy(ln->meta + (size_t)to * c->meta_bytes, ln->meta + (size_t)from * c->meta_bytes, c->meta_bytes);
    ln->live[i] = to;
    ln->free[b][ln->n_free[b]++] = from;
    int lane = l * c->shape.n_kv_heads + g;
    kv_tier_move(c, lane, from, to, band_pair_bytes(c, b));
    if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_MOVE, lane, to, from, i, ln->pos[to], NULL, NULL);
    emit(c, KV_EV_RECODE, t, l, g, ln->pos[to], ln->pos0 ? ln->pos0[to] : ln->pos[to], 1, next, 0);
    c->live_bytes = c->live_bytes - token_bytes(c, ln, b) + token_bytes(c, ln, next);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Pool lanes (kv_cache_init_pool): band 0 in pages of P slots from the pool. Page j holds slots jP .. jP+P-1 (those
 * below cap), keys first, then values. A lane takes a page when a token arrives and every slot of its pages is live,
 * and gives pages back when its live slots fit in fewer (lane_shed_pages).
 * ------------------------------------------------------------------------------------------------------------- */

/* One more page for a pool lane, its slots pushed on the free stack so the lowest pops first: 0, or -1 when the pool
 * has none free (or the lane holds pages for cap slots already, a kv.c bug). */
static int lane_take_page(KVCache *c, KVLane *ln) {
    int P = c->page_slots, j = ln->n_pages;
    if (j * P >= ln->cap) return -1;
    int id = kv_pool_take(c->pool);
    if (id < 0) return -1;
    uint8_t *page = kv_pool_page(c->pool, id);
    ln->page_id[j] = id;
    ln->kpg[0][j] = page;
    ln->vpg[0][j] = page + (size_t)P * c->band_kb[0];
    ln->n_pages++;
    int hi = (j + 1) * P < ln->cap ? (j + 1) * P : ln->cap;
    for (int s = hi - 1; s >= j * P; s--) ln->free[0][ln->n_free[0]++] = s;
    return 0;
}

/* Give back the pages a pool lane no longer needs: while its live slots, plus the one about to be stored, fit in
 * fewer pages than it holds (after snapkv's compression, or a policy that shrinks a lane), the live slots of its last
 * page move into free slots of the pages below (vectors, position, pos0, mw and policy metadata move with them; a
 * rank keeps its place in the live list, so attention and the policy see the same lane) and the page goes back. */
static void lane_shed_pages(KVCache *c, KVLane *ln) {
    int P = c->page_slots;
    while (ln->n_pages > 1 && ln->n_pages > kv_pool_pages_for(ln->n_live + 1, P)) {
        int j = ln->n_pages - 1, lo = j * P, w = 0;
        for (int i = 0; i < ln->n_live; i++) {
            int from = ln->live[i];
            if (from < lo) continue;
            int f = ln->n_free[0] - 1;   /* a free slot below the page: there are enough (n_live + 1 <= j P) */
            while (ln->free[0][f] >= lo) f--;
            int to = ln->free[0][f];
            ln->free[0][f] = ln->free[0][--ln->n_free[0]];
            memcpy(kv_band_k(c, ln, 0, to), kv_band_k(c, ln, 0, from), c->band_kb[0]);
            memcpy(kv_band_v(c, ln, 0, to), kv_band_v(c, ln, 0, from), c->band_vb[0]);
            ln->pos[to] = ln->pos[from]; ln->pos[from] = -1;
            if (ln->pos0) { ln->pos0[to] = ln->pos0[from]; ln->pos0[from] = -1; }
            if (ln->mw) { ln->mw[to] = ln->mw[from]; ln->mw[from] = 0; }
            memcpy(ln->meta + (size_t)to * c->meta_bytes, ln->meta + (size_t)from * c->meta_bytes, c->meta_bytes);
            ln->live[i] = to;
        }
        for (int f = 0; f < ln->n_free[0]; f++)   /* the page's free slots leave the stack, the others keep order */
            if (ln->free[0][f] < lo) ln->free[0][w++] = ln->free[0][f];
        ln->n_free[0] = w;
        kv_pool_release(c->pool, ln->page_id[--ln->n_pages]);
    }
}

int kv_pages_needed(const KVCache *c, int n) {
    if (!c->pool || c->pool_owned) return 0;
    int need = 0, H = c->shape.n_kv_heads, P = c->page_slots;
    /* alloc=ada: a layer's lanes hold ceil(H·B/P) + H pages at most together (kv.h), whatever each may grow to */
    int layer_most = c->ada ? kv_pool_pages_for(H * c->policy.budget, P) + H : INT_MAX;
    for (int l = 0; l < c->shape.n_layers; l++) {
        int lanes_more = 0, held = 0;
        for (int g = 0; g < H; g++) {
            const KVLane *ln = &c->lanes[l * H + g];
            int slots = ln->n_live + n < ln->cap ? ln->n_live + n : ln->cap;
            int more = kv_pool_pages_for(slots, P) - ln->n_pages;
            lanes_more += more > 0 ? more : 0;
            held += ln->n_pages;
        }
        int layer_more = layer_most == INT_MAX ? INT_MAX : layer_most - held > 0 ? layer_most - held : 0;
        need += lanes_more < layer_more ? lanes_more : layer_more;
    }
    return need;
}

int kv_pages_held(const KVCache *c) {
    int n = 0;
    if (c->pool)
        for (int i = 0; i < c->shape.n_layers * c->shape.n_kv_heads; i++) n += c->lanes[i].n_pages;
    return n;
}

int kv_lane_page_id(const KVCache *c, int lane, int j) {
    const KVLane *ln = &c->lanes[lane];
    return c->pool && j >= 0 && j < ln->n_pages ? ln->page_id[j] : -1;
}

int kv_cache_adopt_prefix(KVCache *c, const int *pages, int n_blocks, char *err, size_t errlen) {
    const KVPolicyOps *ops = c->policy.ops;
    int n_lanes = c->shape.n_layers * c->shape.n_kv_heads, P = c->page_slots;
    if (!c->pool) return errorf(err, errlen, "kv: prefix pages are for pool caches");
    if (ops->evicts || ops->merge || ops->prune || ops->select || c->merge_evict)
        return errorf(err, errlen, "kv: '%s' evicts, merges, prunes or selects, so its lanes' pages are not a "
                      "prefix's tokens in order: only full shares prefix pages", c->spec.text);
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        if (ln->n_live || ln->n_pages) return errorf(err, errlen, "kv: prefix pages go into an empty cache");
        if (n_blocks * P > ln->cap)
            return errorf(err, errlen, "kv: a prefix of %d tokens is over a lane's %d slots", n_blocks * P, ln->cap);
    }
    for (int i = 0; i < n_lanes; i++) {
        KVLane *ln = &c->lanes[i];
        for (int j = 0; j < n_blocks; j++) {
            int id = pages[(size_t)j * n_lanes + i];
            uint8_t *page = kv_pool_page(c->pool, id);
            ln->page_id[j] = id;
            ln->kpg[0][j] = page;
            ln->vpg[0][j] = page + (size_t)P * c->band_kb[0];
        }
        ln->n_pages = n_blocks;
        for (int s = 0; s < n_blocks * P; s++) {
            ln->pos[s] = s;
            if (ln->pos0) ln->pos0[s] = s;
            ln->live[ln->n_live++] = s;
            memset(ln->meta + (size_t)s * c->meta_bytes, 0, c->meta_bytes);
            if (ops->on_insert) ops->on_insert(&c->policy, i, ln, ln->n_live - 1, s);
        }
        c->live_bytes += (size_t)ln->n_live * token_bytes(c, ln, 0);
        if (ln->n_live > ln->peak_live) ln->peak_live = ln->n_live;
    }
    if (c->live_bytes > c->peak_live_bytes) c->peak_live_bytes = c->live_bytes;
    return 0;
}

/* The ranks of ln to drop so that keep remain: the n_live - keep lowest keep scores of dst's policy, ties the oldest
 * (rank order). drop (n_live): 1 for those; score (n_live) written. */
static void transfer_drop(const KVCache *dst, int lane, const KVLane *ln, int keep, int pos_next, double *score,
                          int *drop) {
    int n = ln->n_live;
    dst->policy.ops->keep_score(&dst->policy, lane, ln, pos_next, score);
    for (int i = 0; i < n; i++) drop[i] = 0;
    for (int k = 0; k < n - keep; k++) {   /* n - keep passes over n: a switch is rare, a lane small */
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!drop[i] && score[i] < INFINITY && (best < 0 || score[i] < score[best])) best = i;
        if (best < 0) break;   /* only protected ranks left: the policy's budget check rules this out */
        drop[best] = 1;
    }
}

int kv_cache_transfer(KVCache *dst, KVCache *src, int pos_next, char *err, size_t errlen) {
    const KVShape *s = &src->shape;
    int n_lanes = s->n_layers * s->n_kv_heads, hd = s->head_dim;
    const KVPolicyOps *dops = dst->policy.ops;
    int same_policy = dops == src->policy.ops;
    if (dst->shape.n_layers != s->n_layers || dst->shape.n_kv_heads != s->n_kv_heads || dst->shape.head_dim != hd
        || dst->spec.pos != src->spec.pos)
        return errorf(err, errlen, "kv: '%s' and '%s' differ in shape or pos=: their tokens cannot move",
                      src->spec.text, dst->spec.text);
    KVCache *both[2] = {src, dst};
    for (int x = 0; x < 2; x++)
        if (!lanes_plain(both[x]))
            return errorf(err, errlen, "kv: '%s' has several bands, per-channel keys, low rank, merging, memory tiers "
                          "or a device mirror: its tokens do not move between caches", both[x]->spec.text);
    if (!same_policy && src->meta_bytes)
        return errorf(err, errlen, "kv: '%s' keeps %s's metadata, which %s cannot read", src->spec.text,
                      src->policy.ops->name, dops->name);
    if (same_policy && src->meta_bytes != dst->meta_bytes)
        return errorf(err, errlen, "kv: '%s' and '%s' keep metadata of different sizes", src->spec.text, dst->spec.text);
    int max_live = 0, shrink = 0;
    for (int i = 0; i < n_lanes; i++) {
        const KVLane *a = &src->lanes[i], *b = &dst->lanes[i];
        if (b->n_live) return errorf(err, errlen, "kv: tokens move into an empty cache");
        if (a->n_live > max_live) max_live = a->n_live;
        shrink |= a->n_live > b->cap;
    }
    if (shrink && (!dops->keep_score || !same_policy))
        return errorf(err, errlen, "kv: '%s' holds more tokens than a lane of '%s' has slots, and %s cannot rank "
                      "them (keep_score, on a lane of its own policy)", src->spec.text, dst->spec.text, dops->name);
    if (dst->pool) {   /* the pages, lane by lane as the move goes: src's lane gives back, then dst's lane takes */
        if (!src->pool || src->pool != dst->pool)
            return errorf(err, errlen, "kv: a pool cache's tokens move into a cache of the same pool");
        long avail = kv_pool_n_free(dst->pool) + kv_pool_n_cached(dst->pool);
        for (int i = 0; i < n_lanes; i++) {
            int keep = src->lanes[i].n_live < dst->lanes[i].cap ? src->lanes[i].n_live : dst->lanes[i].cap;
            avail += src->lanes[i].n_pages - kv_pool_pages_for(keep, dst->page_slots);
            if (avail < 0) return 1;
        }
    }
    size_t mb = dst->meta_bytes, rows = max_live > 0 ? (size_t)max_live : 1;   /* one lane's tokens at a time */
    float *kx = malloc(rows * 2 * hd * sizeof(float));
    double *score = malloc(rows * sizeof(double));
    int *drop = malloc(rows * sizeof(int)), *pos = malloc(rows * sizeof(int));
    uint8_t *meta = malloc(rows * (mb ? mb : 1));
    if (!kx || !score || !drop || !pos || !meta) {
        free(kx); free(score); free(drop); free(pos); free(meta);
        return errorf(err, errlen, "out of memory");
    }
    for (int i = 0; i < n_lanes; i++) {
        KVLane *a = &src->lanes[i], *b = &dst->lanes[i];
        int l = i / s->n_kv_heads, g = i % s->n_kv_heads, n = a->n_live, keep = n < b->cap ? n : b->cap, w = 0;
        if (keep < n) transfer_drop(dst, i, a, keep, pos_next, score, drop);
        else for (int r = 0; r < n; r++) drop[r] = 0;
        for (int r = 0; r < n; r++) {
            int sl = a->live[r];
            if (drop[r]) {
                emit(src, KV_EV_EVICT, pos_next, l, g, a->pos[sl], a->pos[sl], 1, -1, score[r]);
                dst->n_evictions++;
                continue;
            }
            slot_read(src, a, sl, 0, kx + (size_t)w * 2 * hd);
            slot_read(src, a, sl, 1, kx + (size_t)w * 2 * hd + hd);
            pos[w] = a->pos[sl];
            if (same_policy && mb) memcpy(meta + (size_t)w * mb, a->meta + (size_t)sl * mb, mb);
            w++;
        }
        for (int r = 0; r < n; r++) slot_release(src, a, a->live[r]);   /* src's lane empty, its pages back */
        a->n_live = 0;
        if (src->pool) lane_release_pages(src, a);
        for (int j = 0; j < w; j++) {
            if (b->n_live == b->cap || (dst->pool && b->n_free[0] == 0 && lane_take_page(dst, b))) {
                /* the checks above rule both out */
                free(kx); free(score); free(drop); free(pos); free(meta);
                return errorf(err, errlen, "kv: lane %d of '%s' ran out of slots or pages in the middle of a move (a bug)",
                              i, dst->spec.text);
            }
            int slot = band_pop(dst, b, 0);
            b->pos[slot] = pos[j];
            slot_write(dst, b, slot, 0, kx + (size_t)j * 2 * hd);
            slot_write(dst, b, slot, 1, kx + (size_t)j * 2 * hd + hd);
            b->live[b->n_live++] = slot;
            dst->live_bytes += token_bytes(dst, b, 0);
            memset(b->meta + (size_t)slot * mb, 0, mb);
            if (dops->on_insert) dops->on_insert(&dst->policy, i, b, b->n_live - 1, pos[j]);
            if (same_policy && mb) memcpy(b->meta + (size_t)slot * mb, meta + (size_t)j * mb, mb);
        }
        if (b->n_live > b->peak_live) b->peak_live = b->n_live;
    }
    if (dst->live_bytes > dst->peak_live_bytes) dst->peak_live_bytes = dst->live_bytes;
    dst->policy.prompt_len = src->policy.prompt_len;
    dst->policy.context_len = src->policy.context_len;
    free(kx); free(score); free(drop); free(pos); free(meta);
    return 0;
}

void kv_cache_move(KVCache *dst, KVCache *src) {
    *dst = *src;
    dst->policy.spec = &dst->spec;
    memset(src, 0, sizeof *src);
}

/* ---------------------------------------------------------------------------------------------------------------
 * alloc=ada (kv.h, "Budgets over a layer's kv heads"; Ada-KV, Feng et al. 2024, arXiv:2407.11550): step 1 for
 * a whole layer, before any of its lanes stores the token at t.
 * ------------------------------------------------------------------------------------------------------------- */

/* If the layer's lanes hold more than H·B - H live slots, free the Σ n_live + H - H·B with the lowest keep scores
 * over the layer (ties: the oldest position, then the lowest kv head), never a +INFINITY one nor one of a lane's
 * ada_safe highest-scored ranks (the safeguard), each lane's victims through lane_evict (so -kvlog reports each with
 * its keep score, as a policy's own eviction is). Each choice scans every candidate of the layer: at most H victims
 * a step (the layer holds at most H·B before it), so O(H · H·B) a step, small beside attention's reads. 0, or -1
 * when too few candidates remain (a policy that protects more than its budget: its init refuses that). */
static int ada_evict(KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    int H = c->shape.n_kv_heads, B = c->policy.budget, S = c->budget, total = 0;
    KVLane *lanes = &c->lanes[l * H];
    for (int g = 0; g < H; g++) total += lanes[g].n_live;
    int need = total + H - H * B;
    if (need <= 0) return 0;
    if (need > H) {   /* each step stores H and frees down to H·B - H first, so a layer never holds more: a kv.c bug */
        fprintf(stderr, "kv: alloc=ada: layer %d holds %d live slots, over its %d\n", l, total, H * B);
        abort();
    }
    int left[H], n_vict[H];   /* ranks each lane may still give; ranks chosen in each */
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &lanes[g];
        double *sc = c->ada_score + (size_t)g * S;
        ops->keep_score(&c->policy, l * H + g, ln, t, sc);
        int n_inf = 0;
        for (int i = 0; i < ln->n_live; i++) n_inf += sc[i] == INFINITY;
        /* the safeguard's ada_safe best ranks include every protected one when there are more of them */
        int kept = n_inf > c->ada_safe ? n_inf : c->ada_safe;
        left[g] = ln->n_live > kept ? ln->n_live - kept : 0;
        n_vict[g] = 0;
        memset(c->ada_taken + (size_t)g * S, 0, (size_t)ln->n_live);
    }
    for (int j = 0; j < need; j++) {
        int bg = -1, bi = -1, bpos = 0;
        double bs = 0;
        for (int g = 0; g < H; g++) {   /* in increasing g and rank, so a strict comparison breaks ties as said */
            if (left[g] == 0) continue;
            const double *sc = c->ada_score + (size_t)g * S;
            const uint8_t *taken = c->ada_taken + (size_t)g * S;
            for (int i = 0; i < lanes[g].n_live; i++) {
                if (taken[i] || sc[i] == INFINITY) continue;
                int pos = kv_rank_pos(&lanes[g], i);
                if (bg < 0 || sc[i] < bs || (sc[i] == bs && pos < bpos)) { bg = g; bi = i; bs = sc[i]; bpos = pos; }
            }
        }
        if (bg < 0) {
            fprintf(stderr, "kv: alloc=ada: layer %d holds %d live slots at position %d and every one is protected "
                    "(+INFINITY or the safeguard's): none can be freed\n", l, total, t);
            return -1;
        }
        c->ada_taken[(size_t)bg * S + bi] = 1;
        left[bg]--;
        c->ada_rank[bg * H + n_vict[bg]] = bi;
        c->ada_vscore[bg * H + n_vict[bg]] = bs;
        n_vict[bg]++;
    }
    for (int g = 0; g < H; g++)
        if (n_vict[g]) lane_evict(c, l, g, &lanes[g], c->ada_rank + g * H, c->ada_vscore + g * H, n_vict[g], t);
    return 0;
}

int kv_append(KVCache *c, int l, int t, const float *k, const float *v) {
    const KVShape *s = &c->shape;
    const KVPolicyOps *ops = c->policy.ops;
    int hd = s->head_dim;
    float tmp[hd];
    if (c->krank && c->spec.pos == POS_ORIG && lowrank_grow_cs(c, t)) {
        fprintf(stderr, "kv: out of memory for the low-rank rotation table at position %d\n", t);
        exit(EXIT_FAILURE);
    }
    /* step 1 of alloc=ada: the layer's lanes shrink together, by their keep scores, before any of them stores */
    if (c->ada && ada_evict(c, l, t)) return -1;
    for (int g = 0; g < s->n_kv_heads; g++) {
        int lane = l * s->n_kv_heads + g;
        KVLane *ln = &c->lanes[lane];
        /* step 1: merge, then evict when full */
        if (ops->merge) {
            int n = ops->merge(&c->policy, lane, ln, t, c->victim_buf, c->run_buf, c->budget);
            if (n > 0) lane_merge(c, l, g, ln, c->victim_buf, c->run_buf, n, t);
        }
        if (ln->n_live >= ln->cap) {
            int n = ops->evict ? ops->evict(&c->policy, lane, ln, t, c->victim_buf, ln->cap, c->score_buf) : 0;
            if (n <= 0) return -1;
            lane_evict(c, l, g, ln, c->victim_buf, c->score_buf, n, t);
        }
        /* step 2: store, into band 0 (recoding older tokens down the bands to make room); a pool lane first gives
           back the pages it no longer needs, or takes one when every slot of its pages is live */
        if (c->pool) {
            lane_shed_pages(c, ln);
            if (ln->n_free[0] == 0 && lane_take_page(c, ln)) return -1;
        }
        band_make_room(c, l, g, ln, 0, t);
        int slot = band_pop(c, ln, 0);
        ln->pos[slot] = t;
        if (c->krank || c->vrank) lowrank_store(c, lane, ln, slot, t, k + (size_t)g * hd, v + (size_t)g * hd);
        else {
            memcpy(tmp, k + (size_t)g * hd, (size_t)hd * sizeof(float));
            if (c->spec.pos == POS_ORIG) kv_rope_apply(tmp, s, kv_rope_at(c, t));
            slot_write(c, ln, slot, 0, tmp);
            slot_write(c, ln, slot, 1, v + (size_t)g * hd);
        }
        if (ln->pos0) ln->pos0[slot] = t;
        if (ln->mw) ln->mw[slot] = 0;
        ln->live[ln->n_live++] = slot;
        c->live_bytes += token_bytes(c, ln, 0);
        if (c->live_bytes > c->peak_live_bytes) c->peak_live_bytes = c->live_bytes;
        if (ln->n_live > ln->peak_live) ln->peak_live = ln->n_live;
        if ((c->krank || c->vrank) && !ln->lr_fitted && ln->lr_seen == c->calib) lane_fit(c, lane, ln);
        memset(ln->meta + (size_t)slot * c->meta_bytes, 0, c->meta_bytes);
        kv_tier_store(c, lane, slot);
        if (c->on_slot) c->on_slot(c->slot_ctx, KV_SLOT_STORE, lane, slot, -1, ln->n_live - 1, t, k + (size_t)g * hd,
                                  v + (size_t)g * hd);
        if (ops->on_insert) ops->on_insert(&c->policy, lane, ln, ln->n_live - 1, t);
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
    if (kv_query_selects(c, t)) { kv_attend_select(c, out, l, t, q); return; }
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

/* Scores of a lane's keys against the GQA group's rotated queries qr (group, head_dim): for j < n and i = rank[j]
 * (rank NULL: i = j), s[hh * ld + i] = (q_hh·k_i)/√head_dim, each key decoded and rotated once (kv_lane_key) for
 * the whole group. Each dot is the definition's in-order f32 sum over d, 0 + q_0·k_0 + q_1·k_1 + ..., then times the
 * scale; SEL_KEYS keys go side by side (the block laid out dimension-major in kt), so the compiler can keep their
 * independent sums in vector registers without reordering any of them (-ffp-contract=off: no fused multiply-add). */
#define SEL_KEYS 32
static void lane_scores(float *s, size_t ld, const KVCache *c, const KVLane *ln, const int *rank, int n,
                        const float *qr, int group) {
    int hd = c->shape.head_dim;
    float scale = 1.0f / sqrtf((float)hd), kx[hd], kt[hd][SEL_KEYS], acc[SEL_KEYS];
    for (int j0 = 0; j0 < n; j0 += SEL_KEYS) {
        int nb = n - j0 < SEL_KEYS ? n - j0 : SEL_KEYS;
        for (int b = 0; b < SEL_KEYS; b++) {   /* a short last block is padded with zero keys, scored, never stored */
            const float *k = b < nb ? kv_lane_key(c, ln, rank ? rank[j0 + b] : j0 + b, kx) : NULL;
            for (int d = 0; d < hd; d++) kt[d][b] = k ? k[d] : 0;
        }
        for (int hh = 0; hh < group; hh++) {
            const float *qh = qr + (size_t)hh * hd;
            for (int b = 0; b < SEL_KEYS; b++) acc[b] = 0;
            for (int d = 0; d < hd; d++)
                for (int b = 0; b < SEL_KEYS; b++) acc[b] += qh[d] * kt[d][b];
            for (int b = 0; b < nb; b++) s[(size_t)hh * ld + (rank ? rank[j0 + b] : j0 + b)] = acc[b] * scale;
        }
    }
}

/* The ranks a query of lane (l, g) reads, as its selection policy chooses them: the group's queries q (group,
 * head_dim, before RoPE) rotated by position or rank `rot` into qr (group, head_dim); with select_scores every live
 * key's score against each query head into sg (group rows of c->budget) and their group mean into sel_score (the
 * heads' scores summed in order, then divided); with select_keys every live key as attention sees it, from the rank
 * the policy asks (select_keys_from), into this kv head's share of kbuf, row i = rank i (workspace: not a read of the
 * cache, the policy reports its own, select_bytes); then select(pos_now), its answer checked. Returns m, the ranks in
 * rr (increasing). kv_attend_select attends over them; kv_prefetch asks it what a predicted query would read. */
static int select_ranks(KVCache *c, int l, int g, int pos_now, int rot, const float *q, float *qr, float *sg,
                        int *rr) {
    const KVShape *s = &c->shape;
    const KVPolicyOps *ops = c->policy.ops;
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads, lane = l * s->n_kv_heads + g, B = c->budget;
    const KVLane *ln = &c->lanes[lane];
    int n = ln->n_live;
    for (int hh = 0; hh < group; hh++) {   /* the group's queries, rotated as kv_attend_ref rotates them */
        memcpy(qr + (size_t)hh * hd, q + (size_t)hh * hd, (size_t)hd * sizeof(float));
        kv_rope(qr + (size_t)hh * hd, s, rot);
    }
    if (ops->select_scores) {
        if (c->sel_pre)   /* the same numbers, computed ahead for a chunk (attn_cpu.c, attend_select) */
            for (int hh = 0; hh < group; hh++)
                memcpy(sg + (size_t)hh * B, c->sel_pre + ((size_t)g * group + hh) * B, (size_t)n * sizeof(float));
        else lane_scores(sg, (size_t)B, c, ln, NULL, n, qr, group);
        for (int i = 0; i < n; i++) {
            float sum = 0;
            for (int hh = 0; hh < group; hh++) sum += sg[(size_t)hh * B + i];
            c->sel_score[i] = sum / group;
        }
    }
    float *keys = NULL;
    if (ops->select_keys) {
        keys = c->kbuf + (size_t)g * B * hd;
        for (int i = ops->select_keys_from ? ops->select_keys_from(&c->policy, lane, ln) : 0; i < n; i++) {
            float *row = keys + (size_t)i * hd;
            const float *k = kv_lane_key(c, ln, i, row);
            if (k != row) memcpy(row, k, (size_t)hd * sizeof(float));
        }
    }
    int m = ops->select(&c->policy, lane, ln, pos_now, ops->select_scores ? c->sel_score : NULL, keys, qr, rr, B);
    if (m < 1 || m > n) policy_bug(c, "select", l, g, m, n);
    for (int j = 0; j < m; j++)
        if (rr[j] < 0 || rr[j] >= n || (j && rr[j] <= rr[j - 1])) policy_bug(c, "select", l, g, rr[j], n);
    return m;
}

/* Step 3 of a selection policy (kv.h): kv_attend_ref's arithmetic over the chosen ranks only. Each key and value is
 * decoded once per lane for the group's query heads; with select_scores the score pass's scores are the chosen
 * keys' scores too (the same dot products), so those keys are not read twice. */
void kv_attend_select(KVCache *c, float *out, int l, int t, const float *q) {
    const KVShape *s = &c->shape;
    const KVPolicyOps *ops = c->policy.ops;
    int hd = s->head_dim, n_kv = s->n_kv_heads, group = s->n_heads / n_kv, B = c->budget;
    float qr[group][hd], vx[hd];
    for (int g = 0; g < n_kv; g++) {
        int lane = l * n_kv + g;
        const KVLane *ln = &c->lanes[lane];
        int n = ln->n_live, *rr = c->read_rank + (size_t)g * B;
        float *sg = c->scores + (size_t)g * group * B;   /* (group, B): the group's scores, then probabilities */
        int m = select_ranks(c, l, g, t, c->spec.pos == POS_CACHE ? n - 1 : t, q + (size_t)g * group * hd, &qr[0][0],
                             sg, rr);
        c->read_n[g] = m;
        kv_tier_read(c, lane, rr, m);
        /* bytes read: every key scored to choose (select_scores) or the chosen keys, the chosen values, and what the
           policy read to choose (select_bytes: quest's page bounds) */
        for (int i = 0; ops->select_scores && i < n; i++) c->bytes_read += lane_kb(c, ln, kv_slot_band(ln, ln->live[i]));
        for (int j = 0; j < m; j++) {
            int b = kv_slot_band(ln, ln->live[rr[j]]);
            c->bytes_read += lane_vb(c, ln, b) + (ops->select_scores ? 0 : lane_kb(c, ln, b));
        }
        if (ln->lr_fitted) c->bytes_read += lowrank_basis_bytes(&c->spec, hd);   /* the bases it reconstructs from */
        if (ops->select_bytes) c->bytes_read += ops->select_bytes(&c->policy, lane, ln, t);
        c->keys_scanned += (uint64_t)(ops->select_scores ? n : m);
        if (ops->select_scanned) c->keys_scanned += ops->select_scanned(&c->policy, lane, ln, t);
        c->slots_read += (uint64_t)m;
        /* the chosen keys' scores (already there with select_scores), 0 off the chosen set */
        if (!ops->select_scores) lane_scores(sg, (size_t)B, c, ln, rr, m, &qr[0][0], group);
        for (int hh = 0; hh < group; hh++) {
            float *p = sg + (size_t)hh * B, mx = -INFINITY, sum = 0;
            for (int i = 0, j = 0; i < n; i++)
                if (j < m && rr[j] == i) { mx = p[i] > mx ? p[i] : mx; j++; }
                else p[i] = 0;
            /* softmax over the chosen ranks, max subtracted, sums in rank order */
            for (int j = 0; j < m; j++) { p[rr[j]] = expf(p[rr[j]] - mx); sum += p[rr[j]]; }
            for (int j = 0; j < m; j++) p[rr[j]] /= sum;
            float *o = out + (size_t)(g * group + hh) * hd;
            for (int d = 0; d < hd; d++) o[d] = 0;
        }
        /* out_h = Σ_j p_j·v_j, j in rank order, each value decoded once for the group */
        for (int j = 0; j < m; j++) {
            const float *v = kv_lane_value(c, ln, rr[j], vx);
            for (int hh = 0; hh < group; hh++) {
                float p = sg[(size_t)hh * B + rr[j]], *o = out + (size_t)(g * group + hh) * hd;
                for (int d = 0; d < hd; d++) o[d] += p * v[d];
            }
        }
    }
    if (l == 0) c->steps_read++;
    kv_attend_policy(c, l, t);
}

void kv_set_prefetch_queries(KVCache *c, int l, const float *q) { c->pf_q = q; c->pf_layer = l; }

void kv_prefetch(KVCache *c, int l, int t, const float *q) {
    if (!c->tiers || !c->spec.prefetch) return;
    const KVShape *s = &c->shape;
    const KVPolicyOps *ops = c->policy.ops;
    int hd = s->head_dim, n_kv = s->n_kv_heads, group = s->n_heads / n_kv;
    float qr[group * hd];
    for (int g = 0; g < n_kv; g++) {
        int lane = l * n_kv + g;
        const KVLane *ln = &c->lanes[lane];
        int n = ln->n_live;
        if (n == 0) continue;
        if (!kv_query_selects(c, t)) { kv_tier_prefetch_ranks(c, lane, NULL, n); continue; }
        /* the predicted query as the newest stored token's own: select at pos_now t-1 over the live ranks, the
           query rotated where token t's will be (position t, or rank n under pos=cache) */
        int *rr = c->victim_buf;
        float *sg = c->scores + (size_t)g * group * c->budget;   /* scratch: this step's scores come later */
        int m = select_ranks(c, l, g, t - 1, c->spec.pos == POS_CACHE ? n : t, q + (size_t)g * group * hd, qr, sg,
                             rr);
        for (int i = 0; ops->select_scores && i < n; i++)
            c->tier.predict_bytes += lane_kb(c, ln, kv_slot_band(ln, ln->live[i]));
        if (ops->select_bytes) c->tier.predict_bytes += ops->select_bytes(&c->policy, lane, ln, t - 1);
        kv_tier_prefetch_ranks(c, lane, rr, m);
    }
}

void kv_attend_policy(KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    int n_kv = c->shape.n_kv_heads, group = c->shape.n_heads / n_kv, budget = c->budget;
    /* what this token's attention at layer l read: every live slot of the layer's lanes (before any prune), every
       live rank for recall (kv_lane_read); a selecting query's reads were counted by kv_attend_select */
    if (!kv_query_selects(c, t)) {
        for (int g = 0; g < n_kv; g++) {
            c->bytes_read += lane_bytes(c, &c->lanes[l * n_kv + g]).vec_live;
            c->read_n[g] = -1;
            c->keys_scanned += (uint64_t)c->lanes[l * n_kv + g].n_live;
            c->slots_read += (uint64_t)c->lanes[l * n_kv + g].n_live;
            kv_tier_read(c, l * n_kv + g, NULL, c->lanes[l * n_kv + g].n_live);
        }
        if (l == 0) c->steps_read++;
    }
    /* step 4: show the policy the group's probabilities: agg= (mean or max) and the mean (thresholds use it); with
       merge=1 the cache adds the mean to each slot's accumulated attention (mw) itself */
    if (ops->observe || c->merge_evict)
        for (int g = 0; g < n_kv; g++) {
            const KVLane *ln = &c->lanes[l * n_kv + g];
            float *agg = c->agg + (size_t)g * budget, *mean = c->mean + (size_t)g * budget;
            const float *p = c->scores + (size_t)g * group * budget;   /* (group, budget): the group's heads */
            int n = ln->n_live;
            /* mean_i = (0 + p_0i + p_1i + ...) / group, agg_i the mean or max_h p_hi: loops over i innermost, so the
               compiler vectorizes them; each element's operations and their order are those of a loop over h */
            for (int i = 0; i < n; i++) mean[i] = 0;
            for (int hh = 0; hh < group; hh++)
                for (int i = 0; i < n; i++) mean[i] += p[(size_t)hh * budget + i];
            for (int i = 0; i < n; i++) mean[i] /= group;
            if (c->spec.agg == AGG_MAX) {
                for (int i = 0; i < n; i++) agg[i] = p[i];
                for (int hh = 1; hh < group; hh++)
                    for (int i = 0; i < n; i++) agg[i] = fmaxf(agg[i], p[(size_t)hh * budget + i]);
            } else memcpy(agg, mean, (size_t)n * sizeof(float));
            if (c->merge_evict) for (int i = 0; i < ln->n_live; i++) ln->mw[ln->live[i]] += mean[i];
            if (ops->observe) ops->observe(&c->policy, l * n_kv + g, ln, agg, c->spec.agg == AGG_MAX ? mean : agg, t);
        }
    if (ops->on_layer_done) ops->on_layer_done(&c->policy, l, t);
    if (ops->prune) {
        for (int g = 0; g < n_kv; g++) {
            KVLane *ln = &c->lanes[l * n_kv + g];
            int n = ops->prune(&c->policy, l * n_kv + g, ln, t, c->victim_buf, ln->cap, c->score_buf);
            if (n > 0) lane_evict(c, l, g, ln, c->victim_buf, c->score_buf, n, t);
        }
    }
}

int kv_capacity(const KVCache *c) {
    if (c->policy.ops->capacity) return c->policy.ops->capacity(&c->policy);
    return c->policy.ops->evicts ? INT_MAX : c->budget;
}

void kv_describe(const KVCache *c, char *buf, size_t len) {
    char pol[160] = "";
    if (c->policy.ops->describe) c->policy.ops->describe(&c->policy, pol, sizeof pol);
    char prec[160] = "";
    if (c->spec.n_prec[0] || c->spec.n_prec[1]) {
        /* the bands of the first lane, as resolved: ", prec f32:64/q8:192/q4:0", a band whose key and value forms
           differ as KEY+VALUE (kprec=, vprec=): ", prec f32:64/q4+f32:192/q4+q8:0" */
        size_t w = (size_t)snprintf(prec, sizeof prec, ", prec ");
        for (int b = 0; b < c->n_bands && w < sizeof prec; b++)
            w += (size_t)snprintf(prec + w, sizeof prec - w, "%s%s%s%s:%d", b ? "/" : "", kv_type_names[c->band_ktype[b]],
                                  c->band_ktype[b] == c->band_vtype[b] ? "" : "+",
                                  c->band_ktype[b] == c->band_vtype[b] ? "" : kv_type_names[c->band_vtype[b]],
                                  c->lanes[0].band_slots[b]);
    }
    char fast[96] = "";
    if (c->tiers)
        snprintf(fast, sizeof fast, ", fast tier %.2f MiB (%zu B per lane)%s", c->tier.cap / 1048576.0,
                 c->tier.lane_cap, c->spec.prefetch ? ", prefetch" : "");
    char kgroup[48] = "", lr[80] = "";
    if (c->kgroup) snprintf(kgroup, sizeof kgroup, ", keys per channel in groups of %d", c->kgroup);
    if (c->krank || c->vrank)
        snprintf(lr, sizeof lr, ", krank %d vrank %d calib %d", c->krank, c->vrank, c->calib);
    char ada[128] = "";
    if (c->ada)   /* alloc=ada: the share, the safeguard, the pages (kv.h) */
        snprintf(ada, sizeof ada, ", alloc=ada: a layer's %d lanes share %d slots, safeguard %g (%d slots), pages of %d",
                 c->shape.n_kv_heads, c->shape.n_kv_heads * c->policy.budget, c->ada_safeguard, c->ada_safe,
                 c->page_slots);
    snprintf(buf, len, "%s budget %d%s%s, %d slot%s per lane, k %s v %s%s, residual %d%s%s%s, pos %s, agg %s%s%s",
             c->spec.name, c->policy.budget, *pol ? " " : "", pol, c->budget, c->budget == 1 ? "" : "s",
             kv_type_names[c->spec.ktype], kv_type_names[c->spec.vtype], kgroup, c->residual, prec, lr, ada,
             c->spec.pos == POS_CACHE ? "cache" : "orig", c->spec.agg == AGG_MAX ? "max" : "mean", fast,
             c->merge_evict ? ", merge-on-evict" : "");
}

int kv_lane_read(const KVCache *c, int l, int g, int *spans, int max) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    int sel = c->read_n[g] >= 0, n = sel ? c->read_n[g] : ln->n_live, w = 0;
    for (int j = 0; j < n && w < max; j++) {
        int i = sel ? c->read_rank[(size_t)g * c->budget + j] : j;
        spans[2 * w] = kv_rank_pos0(ln, i);
        spans[2 * w + 1] = kv_rank_pos(ln, i);
        w++;
    }
    return w;
}

int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max) {
    const KVLane *ln = &c->lanes[l * c->shape.n_kv_heads + g];
    int n = ln->n_live < max ? ln->n_live : max;
    for (int i = 0; i < n; i++) positions[i] = ln->pos[ln->live[i]];
    return n;
}
