/* kv.h: the KV cache contract. Read this file first.
 *
 * The cache is made of LANES, one per (layer, kv_head). A lane holds at most `budget` SLOTS; a slot stores one token's
 * key and value vectors (head_dim each, in the lane's storage type), the token's original POSITION, and whatever
 * metadata the policy keeps for it. A slot is not a position: after an eviction, slot s can hold any position.
 * The policy (policies.c) decides which slot to free when a lane is full; this file does not know any policy.
 * It deliberately does not batch over sequences (one stream per cache) and keeps policy decisions on the host.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget (slots per lane), seq_len (context, tokens).
 * Indices: l layer, h query head, g kv head (lane within a layer), t position, s slot.
 */
#ifndef KVLAB_KV_H
#define KVLAB_KV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ----------------------------------------------------------------------------------------------------------------
 * One decode step, for the token at position t and layer l (DESIGN.md, Semantics; the order is normative):
 *   1. for each lane: if it holds `budget` live slots, ask the policy for a victim (chosen from its state after step
 *      t-1) and free it;
 *   2. store k_t, v_t in a free slot (pos=orig: k rotated with position t; pos=cache: k stored before RoPE);
 *   3. every query head attends over its lane's live slots, itself included: softmax(q·Kᵀ/√head_dim)·V, scores and
 *      softmax in f32 whatever the storage type;
 *   4. the policy is shown this step's attention probabilities, aggregated over the query heads of the GQA group
 *      (mean, or max with agg=max), and updates its state.
 * So the budget is both the number of tokens a query attends to (itself included) and the number of slots a lane
 * ever holds. `window:4` at t=9 attends {6,7,8,9}.
 *
 * Live slots are kept as an INDEX LIST per lane (`live`, slot ids in increasing position order): eviction removes one
 * entry, insertion appends one (positions only grow), and attention walks the list. We chose an index list over
 * compaction so a slot's bytes never move: a GPU copy of the cache only has to be told which slot changed.
 *
 * Positions (pos=): orig: keys are rotated with their true position when stored and the query with t.
 * cache (StreamingLLM): keys are stored before RoPE; at attention time the lane's n live keys, in position order,
 * are rotated by their rank 0..n-1 and the query by n-1. With nothing evicted the two are identical.
 * ------------------------------------------------------------------------------------------------------------- */

typedef enum { KV_F32 = 0, KV_F16, KV_BF16, KV_Q8, KV_Q4, KV_NTYPES } KVType;
typedef enum { POS_ORIG = 0, POS_CACHE } PosMode;
typedef enum { AGG_MEAN = 0, AGG_MAX } AggMode;

extern const char *const kv_type_names[KV_NTYPES];   /* "f32", "f16", "bf16", "q8", "q4" */

/* The model's attention geometry, as the cache needs it. */
typedef struct {
    int n_layers;
    int n_heads;       /* query heads */
    int n_kv_heads;    /* lanes per layer */
    int head_dim;
    int seq_len;       /* context length, tokens: the budget of `full` and the shadow's length */
    float rope_theta;
    int rope_pairing;  /* 0: adjacent pairs (2i, 2i+1); 1: halves (i, i + head_dim/2) */
    const float *rope_factors; /* (head_dim/2) or NULL: Llama 3.1 frequency factors, freq_i /= factor_i */
} KVShape;

/* A parsed -kv spec: NAME[:BUDGET][,key=value...]. The keys every policy takes are parsed into fields here; the
 * rest stay as strings for the policy to read (kv_spec_get). */
#define KV_MAX_PARAMS 8
typedef struct {
    char name[24];
    int budget;               /* tokens per lane; 0 = none given */
    size_t budget_bytes;      /* whole cache, bytes; 0 = the budget is in tokens */
    KVType ktype, vtype;
    int residual;             /* tokens kept in f32 at the recent end of a lane (KIVI's residual), part of budget */
    PosMode pos;
    AggMode agg;
    int n_params;
    char keys[KV_MAX_PARAMS][24];
    char vals[KV_MAX_PARAMS][40];
    int used[KV_MAX_PARAMS];  /* set when a policy reads a key: an unread key is an error (a typo is never ignored) */
    char text[160];           /* the spec as given, for reports */
} KVSpec;

/* Parse a spec. default_type is the -kvt storage type. Returns 0, or -1 with a message naming the bad part and the
 * valid choices in err. Never exits. The policy-specific part is checked by kv_cache_init (it needs the policy). */
int kv_spec_parse(KVSpec *spec, const char *text, KVType default_type, char *err, size_t errlen);
/* The value of a policy key, or NULL; marks the key as read. */
const char *kv_spec_get(KVSpec *spec, const char *key);
/* Parse a storage type name; -1 if unknown. */
int kv_type_parse(const char *s);

/* One lane: (layer, kv_head). */
typedef struct {
    int n_live;            /* live slots now */
    int *live;             /* (budget) slot ids of the live tokens, in increasing position order */
    int32_t *pos;          /* (budget) original position of the token in each slot; -1 = free */
    int *free_slots;       /* (budget) stack of free slot ids; n_free of them */
    int n_free;
    uint8_t *k;            /* (budget, k_bytes) keys in ktype */
    uint8_t *v;            /* (budget, v_bytes) values in vtype */
    float *kres, *vres;    /* (residual, head_dim) f32 copies of the newest `residual` tokens, ring by position */
    int peak_live;         /* slots, the most ever live */
} KVLane;

typedef struct KVPolicy KVPolicy;
typedef struct KVCache KVCache;

/* The policy interface. A policy is a table of these callbacks plus its state; policies.c registers them by name.
 * Lane index `lane` = l * n_kv_heads + g. Positions are tokens' original positions. */
typedef struct {
    const char *name;
    const char *summary;       /* one line for -h */
    int needs_budget;          /* 1: NAME:BUDGET is required */
    int evicts;                /* 0 for full (and snapkv after its one compression) */
    int needs_attention;       /* 1: wants step 4's probabilities */
    /* Read the policy's own keys from spec (kv_spec_get), set defaults, check them against the budget; allocate state
     * for n_lanes lanes of `budget` slots. 0, or -1 + message. */
    int (*init)(KVPolicy *p, KVSpec *spec, const KVShape *shape, int budget, char *err, size_t errlen);
    void (*free)(KVPolicy *p);
    /* Policy metadata per slot, in bytes, for the accounting. Must not depend on the state: p may be NULL. */
    size_t (*meta_bytes_per_slot)(const KVPolicy *p);
    /* Forget all tokens (a new document). */
    void (*reset)(KVPolicy *p);
    /* A token at `pos` was stored in `slot` of `lane`. */
    void (*on_insert)(KVPolicy *p, int lane, int slot, int pos);
    /* Step 1: lane is full before storing the token at pos_now. Write up to `max` slots to free into victims,
     * return how many (>= 1), or 0 when the policy cannot evict (full: the cache is full). */
    int (*victims)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *victims, int max, double *score);
    /* Step 4: probabilities (n_live), aggregated over the GQA group, in the order of ln->live. */
    void (*on_attend)(KVPolicy *p, int lane, const KVLane *ln, const float *prob, int pos_now);
    /* Called after all lanes of layer l attended at pos_now (for per-layer policies such as TOVA per=layer). */
    void (*on_layer_done)(KVPolicy *p, int layer, int pos_now);
} KVPolicyOps;

struct KVPolicy {
    const KVPolicyOps *ops;
    const KVSpec *spec;
    int n_lanes, budget, n_kv_heads;
    AggMode agg;
    void *state;
};

/* Registry (policies.c). */
const KVPolicyOps *kv_policy_find(const char *name);
/* Names of all policies, comma-separated, for error messages. */
const char *kv_policy_names(void);

/* Memory accounting in bytes (DESIGN.md, Accounting). allocated: what the lanes hold room for; live: what is in use. */
typedef struct {
    size_t vec_alloc, vec_live;     /* key and value vectors, scales and offsets included */
    size_t meta_alloc, meta_live;   /* positions, policy metadata, index lists, residual copies */
    size_t total_alloc, total_live;
    size_t peak_live;
    size_t formula_alloc;           /* 2 · n_layers · n_kv_heads · head_dim · budget · bytes per element (f32 = 4,
                                       f16/bf16 = 2, q8 = 1, q4 = 0.5): the vector part people quote */
} KVBytes;

/* An event the cache reports to an optional eviction log (-kvlog). */
typedef void (*KVEvictFn)(void *ctx, int pos_now, int layer, int kv_head, int evicted_pos, double score,
                          const char *reason);

struct KVCache {
    KVShape shape;
    KVSpec spec;
    KVPolicy policy;
    int budget;              /* slots per lane */
    size_t k_bytes, v_bytes; /* bytes of one stored key / value vector */
    KVLane *lanes;           /* (n_layers * n_kv_heads) */
    uint8_t *arena;          /* one allocation for every lane array */
    size_t arena_bytes;
    /* scratch for attention */
    float *scores;           /* (n_heads, budget) probabilities of the last step, per query head */
    float *agg;              /* (budget) aggregated over a GQA group */
    float *kbuf;             /* (n_threads?, budget, head_dim) dequantized / rotated keys */
    int kbuf_rows;
    size_t peak_live_bytes;
    KVEvictFn on_evict; void *evict_ctx;
    int n_evictions;
};

/* Create a cache for a model shape from a parsed spec (the policy's own keys are checked here). Budget: spec->budget
 * tokens per lane, or the largest that fits spec->budget_bytes, or shape->seq_len for policies without a budget.
 * Returns 0, or -1 + message (budget 0, budget below what the policy protects, unknown key, byte budget too small). */
int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen);
void kv_cache_free(KVCache *c);
/* Forget every token (between documents): all lanes empty, policy state reset. */
void kv_cache_reset(KVCache *c);

/* Steps 1 and 2 for every lane of layer l: evict if full, then store the token at position t.
 * k, v: (n_kv_heads * head_dim) before RoPE. Returns 0, or -1 when a lane is full and the policy cannot evict
 * (`full` past its context). */
int kv_append(KVCache *c, int l, int t, const float *k, const float *v);
/* Steps 3 and 4: out (n_heads * head_dim) = attention of q (n_heads * head_dim, before RoPE) at position t over the
 * live slots of layer l; then the policy is shown the aggregated probabilities. This is the CPU reference that the
 * CUDA kernels are checked against. */
void kv_attend_cpu(KVCache *c, float *out, int l, int t, const float *q);

/* RoPE in place on one head vector x (head_dim) at position pos (RoFormer, Su et al. 2021, eq. 34; pairing per
 * shape->rope_pairing; frequencies theta^(-2i/head_dim), divided by rope_factors[i] when present). */
void kv_rope(float *x, const KVShape *shape, int pos);

/* Bytes of one stored vector of head_dim elements in type ty (scales included). */
size_t kv_vector_bytes(KVType ty, int head_dim);
/* Accounting for the whole cache now. */
KVBytes kv_bytes(const KVCache *c);
/* The allocated bytes a cache of this shape and spec would take with `budget` slots per lane. */
size_t kv_alloc_bytes_for(const KVShape *shape, const KVSpec *spec, const KVPolicyOps *ops, int budget);

/* Slots of a lane that are live now, as positions (for tests and logs): writes up to max positions, returns count. */
int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max);

/* ---- storage type conversions (IEEE 754 binary16, bfloat16), round to nearest even; shared by export.c ---- */
static inline float kv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
}
static inline uint16_t kv_f32_to_f16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);            /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                                             /* below 2^-14: subnormal or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;                    /* below 2^-25: rounds to 0 */
        /* value = m * 2^(e-150); a subnormal half counts units of 2^-24, so h = round(m * 2^(e-126)) */
        uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((ax >> 13) - ((127 - 15) << 10)), rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}
static inline float kv_bf16_to_f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline uint16_t kv_f32_to_bf16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);   /* quiet NaN stays NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

#endif
