/* kv.h: the KV cache contract. Read this file first.
 *
 * The cache is made of LANES, one per (layer, kv_head). A lane holds at most `budget` SLOTS; a slot stores one token's
 * key and value vectors (head_dim each, in the lane's storage type), the token's original POSITION, and whatever
 * metadata the policy keeps for it. A slot is not a position: after an eviction, slot s can hold any position.
 * The policy (policies.c) decides which slots to free; this file and kv.c do not know any policy.
 * It deliberately does not batch over sequences (one stream per cache) and keeps policy decisions on the host.
 *
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget (slots per lane), seq_len (context, tokens).
 * Indices: l layer, h query head, g kv head (lane within a layer), t position, s slot, i rank in a lane's live list.
 */
#ifndef KVLAB_KV_H
#define KVLAB_KV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ----------------------------------------------------------------------------------------------------------------
 * One decode step, for the token at position t and layer l (docs/DESIGN.md, Semantics; the order is normative):
 *   1. for each lane: if it holds `budget` live slots, ask the policy for victims (chosen from its state after step
 *      t-1) and free them;
 *   2. store k_t, v_t in a free slot (pos=orig: k rotated with position t; pos=cache: k stored before RoPE);
 *   3. every query head attends over its lane's live slots, itself included: softmax(q·Kᵀ/√head_dim)·V, scores and
 *      softmax in f32 whatever the storage type;
 *   4. the policy is shown this step's attention probabilities, aggregated over the query heads of the GQA group
 *      (mean, or max with agg=max), and updates its state; a policy may then free slots (snapkv's one compression).
 * So the budget is both the number of tokens a query attends to (itself included) and the number of slots a lane
 * ever holds. `window:4` at t=9 attends {6,7,8,9}.
 *
 * Live slots are kept as an INDEX LIST per lane (`live`, slot ids in increasing position order): eviction removes
 * entries, insertion appends one (positions only grow), attention walks the list. We chose an index list over
 * compaction so a token's bytes move at most once (see residual below): a GPU copy of the cache only has to be told
 * which slots changed.
 *
 * Storage and the residual (KIVI, Liu et al. 2024, arXiv:2402.02750, §3: the newest R tokens stay in full precision). A
 * lane's slots (`budget`; -c for full and snapkv) are split in two regions: slots [0, budget-R) hold vectors in
 * ktype/vtype, slots [budget-R, budget) hold them in f32. A new token always goes to the f32 region; when that region
 * is full, its oldest token is encoded once into a free slot of the typed region (one exists: the lane holds at most
 * budget-1 tokens before the store) and its policy metadata moves with it. So every typed token is older than every f32
 * token, the f32 region holds the newest min(R, n_live) live tokens (fewer, transiently, after a policy freed several
 * of them at once), and residual tokens are part of the budget: no token is stored twice. Policies must not remember
 * slot ids across steps: they keep their per-slot state in the lane's `meta`, which kv.c moves with the token.
 *
 * Positions (pos=):
 *   orig: keys are rotated with their true position when stored and the query with t.
 *   cache (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453, §3.2): keys are stored before RoPE; at attention time
 *   the lane's n live keys, in position order, are rotated by their rank 0..n-1 and the query by n-1.
 * With nothing evicted the two give the same bits for f32 keys (a quantized key is rounded before rotation under
 * pos=cache and after it under pos=orig, so there the two differ by that rounding).
 *
 * Aggregation (agg=): the ranking policies (h2o, tova, snapkv) score with the group's mean or max probability;
 * threshold tests (scissorhands' 1/n, lru's τ/n) always use the group mean (docs/DESIGN.md), so agg= does not change them.
 *
 * Memory (kv_bytes): vectors (scales and minimums included), positions (int32), the live and free index lists (int
 * each) and policy metadata, per slot; allocated = every slot of every lane, live = the slots in use. Attention
 * scratch (probabilities, decoded keys, the RoPE table of pos=cache) is workspace, not cache, and is not counted.
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
    int seq_len;       /* context length, tokens: the budget of `full` and `snapkv`, and the shadow's length */
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
/* The value of a policy key, or NULL; kv_spec_get marks the key as read, kv_spec_value does not. */
const char *kv_spec_get(KVSpec *spec, const char *key);
const char *kv_spec_value(const KVSpec *spec, const char *key);
/* Checks a spec against the run mode ("generate", "chat", "ppl", "passkey", "bench"): a policy that acts at the end
 * of the prompt (snapkv) needs prefill=P in ppl mode, which has no prompt. 0, or -1 + message. */
int kv_spec_check_mode(const KVSpec *spec, const char *mode, char *err, size_t errlen);
/* Parse a storage type name; -1 if unknown. */
int kv_type_parse(const char *s);

/* One lane: (layer, kv_head). Slot ids are 0..budget-1; slots below budget - residual are typed, the rest f32. */
typedef struct {
    int n_live;            /* live slots now */
    int *live;             /* (budget) slot ids of the live tokens, in increasing position order */
    int32_t *pos;          /* (budget) original position of the token in each slot; -1 = free */
    int *free_q;           /* (budget - residual) stack of free typed slot ids; n_free_q of them */
    int *free_r;           /* (residual) stack of free f32 slot ids; n_free_r of them */
    int n_free_q, n_free_r;
    uint8_t *k;            /* (budget - residual, k_bytes) keys in ktype */
    uint8_t *v;            /* (budget - residual, v_bytes) values in vtype */
    float *kres, *vres;    /* (residual, head_dim) keys and values of the f32 region; slot s is row s - (budget-R) */
    uint8_t *meta;         /* (budget, meta_bytes) policy metadata of each slot, zeroed when a token is stored */
    int peak_live;         /* slots, the most ever live */
} KVLane;

typedef struct KVPolicy KVPolicy;
typedef struct KVCache KVCache;

/* The policy interface. A policy is a table of these callbacks plus its state; policies.c registers them by name.
 * Lane index `lane` = l * n_kv_heads + g. Positions are tokens' original positions. Every callback is optional. */
typedef struct {
    const char *name;
    const char *summary;       /* one line for -h */
    const char *paper;         /* the paper (or the classic method) it implements, for -h policies */
    const char *example;       /* a small spec that runs in every mode (budget 16): -h policies and the tests' loops
                                  over every registered policy use it */
    const char *options;       /* its own keys, for error messages ("sinks=S"), or "" */
    const char *reason;        /* why it evicts, for the -kvlog "reason" field ("lowest accumulated attention") */
    int needs_budget;          /* 1: NAME:BUDGET is required */
    int evicts;                /* 1: the lane stays within its budget by evicting; 0: it stops at -c (full, snapkv) */
    int grows;                 /* 1: lanes have room for -c tokens whatever the budget (snapkv grows after its
                                  compression); the budget is then the policy's own target */
    int prompt_end;            /* 1: acts at the end of the prompt (kv_set_prompt_len or prefill=P) */
    int needs_attention;       /* 1: wants step 4's probabilities */
    int cross_layer;           /* 1: its decisions at layer l may depend on other layers' attention of the same token,
                                  so a chunk cannot run layer by layer: forward_chunk and -chunk fall back to token
                                  by token. 0 (every policy today): layer-local, batched evaluation is exact */
    /* Read the policy's own keys from spec (kv_spec_get), set defaults, check them against the budget (which must
     * exceed what the policy protects, the current token counted, by at least one slot it chooses). 0, or -1 +
     * message; on -1 the caller still calls free. */
    int (*init)(KVPolicy *p, KVSpec *spec, const KVShape *shape, int budget, char *err, size_t errlen);
    void (*free)(KVPolicy *p);
    /* Bytes of policy metadata per slot (ln->meta), for the layout and the accounting. It depends on the spec and the
     * budget only, never on the state, so byte budgets can be resolved before init (read keys with kv_spec_value). */
    size_t (*meta_bytes_per_slot)(const KVSpec *spec, int budget);
    /* Forget all tokens (a new document); lanes are already empty and their meta zeroed. */
    void (*reset)(KVPolicy *p);
    /* A token at `pos` was stored in `slot` of `lane` (its meta is zero). */
    void (*on_insert)(KVPolicy *p, int lane, KVLane *ln, int slot, int pos);
    /* Step 1: the lane is full before storing the token at pos_now. Write up to `max` slots to free into victims and
     * a score for each (for the log), return how many (>= 1), or 0 when the policy cannot evict (the cache is full). */
    int (*victims)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *victims, int max, double *score);
    /* Step 4: prob (n_live) aggregated over the GQA group as agg= says, and mean (n_live) the group mean (the same
     * pointer when agg=mean), both in the order of ln->live; pos_now is the query's position. */
    void (*on_attend)(KVPolicy *p, int lane, KVLane *ln, const float *prob, const float *mean, int pos_now);
    /* After all lanes of layer l attended at pos_now (for per-layer policies such as TOVA per=layer). */
    void (*on_layer_done)(KVPolicy *p, int layer, int pos_now);
    /* After step 4 of each lane: slots to free now whatever the fill (snapkv's compression). Returns how many. */
    int (*prune)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *victims, int max, double *score);
    /* The resolved parameters, for the start-up line ("recent=128"). */
    void (*describe)(const KVPolicy *p, char *buf, size_t len);
} KVPolicyOps;

struct KVPolicy {
    const KVPolicyOps *ops;
    const KVSpec *spec;
    int n_lanes, n_kv_heads, n_heads;
    int budget;            /* tokens per lane, the policy's budget (snapkv: its compression target) */
    int prompt_len;        /* tokens of the prompt (positions 0..prompt_len-1), 0 = not known; kv_set_prompt_len */
    AggMode agg;
    KVLane *lanes;         /* (n_lanes) the cache's lanes, for per-layer policies */
    void *state;
};

/* Registry (policies.c). */
const KVPolicyOps *kv_policy_find(const char *name);
/* The i-th registered policy (0-based, registration order), or NULL past the last: -h policies and the tests'
 * lists of policies come from here. */
const KVPolicyOps *kv_policy_at(int i);
/* Names of all policies, comma-separated, for error messages. */
const char *kv_policy_names(void);

/* Memory accounting in bytes (docs/DESIGN.md, Accounting). allocated: what the lanes hold room for; live: what is in use.
 * The vector part of one slot is k_bytes + v_bytes in the typed region and 2 * head_dim * 4 in the f32 region. */
typedef struct {
    size_t vec_alloc, vec_live;     /* key and value vectors, scales and minimums included */
    size_t meta_alloc, meta_live;   /* positions, index lists, policy metadata */
    size_t total_alloc, total_live;
    size_t peak_live;               /* the most total_live ever reached since init or reset */
    size_t formula_alloc;           /* 2 · n_layers · n_kv_heads · head_dim · slots · bytes per element (f32 = 4,
                                       f16/bf16 = 2, q8 = 1, q4 = 0.5, k and v types apart, residual ignored): the
                                       vector part people quote */
} KVBytes;

/* An event the cache reports to an optional eviction log (-kvlog). */
typedef void (*KVEvictFn)(void *ctx, int pos_now, int layer, int kv_head, int evicted_pos, double score,
                          const char *reason);

/* Changes to a lane's slots, reported in order to an optional observer: the CUDA mirror (attn.cu), which is told
 * which slots changed instead of rescanning or copying the cache (the reason for the index-list design above).
 *   KV_SLOT_STORE  this step's k, v (before RoPE) went into `slot`, now the lane's last live entry (`rank`);
 *   KV_SLOT_MOVE   the residual token in f32 slot `from` was encoded into typed slot `slot`; live[rank] changed;
 *   KV_SLOT_FREE   `slot` was freed; live entries from `rank` on are no longer where they were (compaction);
 *   KV_SLOT_RESET  every lane is empty (lane, slot, from, rank are -1).
 * Within one kv_append a MOVE comes before the STORE that reuses its f32 slot. */
typedef enum { KV_SLOT_STORE, KV_SLOT_MOVE, KV_SLOT_FREE, KV_SLOT_RESET } KVSlotEvent;
typedef void (*KVSlotFn)(void *ctx, KVSlotEvent ev, int lane, int slot, int from, int rank, int pos,
                         const float *k, const float *v);   /* STORE: position, k and v (head_dim each, k before RoPE) */

/* Which CPU attention the forward pass's entry point (kv_attend_chunk) runs: FAST, kv_attend_cpu and the batched
 * chunk path (attn_cpu.c); REF, kv_attend_ref token by token (-d ref: a whole job on the definition). */
typedef enum { KV_BACKEND_FAST = 0, KV_BACKEND_REF } KVBackend;

struct KVCache {
    KVShape shape;
    KVSpec spec;
    KVPolicy policy;
    int budget;              /* slots per lane: the policy's budget, or -c for full and snapkv */
    int residual;            /* slots per lane in the f32 region (spec.residual; 0 when both types are f32) */
    size_t k_bytes, v_bytes; /* bytes of one typed key / value vector */
    size_t meta_bytes;       /* bytes of policy metadata per slot */
    KVLane *lanes;           /* (n_layers * n_kv_heads) */
    uint8_t *arena;          /* one allocation for every lane array */
    size_t arena_bytes;
    /* scratch for attention (workspace, not counted as cache) */
    float *scores;           /* (n_heads, budget) probabilities of the last step, per query head */
    float *agg, *mean;       /* (n_kv_heads, budget) aggregated over a GQA group */
    float *kbuf;             /* (n_kv_heads, budget, head_dim) dequantized / rotated keys */
    float *ktbuf;            /* (n_kv_heads, budget rounded up to 64, head_dim) keys in panels for the scores
                                (attn_cpu.c) */
    float *vbuf;             /* (n_kv_heads, budget, head_dim) dequantized values */
    const float **vptr;      /* (n_kv_heads, budget) each live value's f32 row: in the cache or in vbuf */
    float *qbuf;             /* (n_heads, head_dim) rotated queries */
    /* scratch of kv_attend_chunk, grown to the largest chunk seen (its large buffers are shared by all caches,
       attn_cpu.c) */
    float *chunk_cs;         /* (chunk, head_dim/2, 2) cos, sin of positions chunk_cs_pos0.. (chunk_cs_n of them) */
    int chunk_cap, chunk_cs_pos0, chunk_cs_n;
    float *rope_cs;          /* (budget, head_dim/2, 2) cos, sin by rank, pos=cache only */
    float *rope_t;           /* (head_dim/2, 2) cos, sin of position rope_t_pos, shared by the layers of a step */
    int rope_t_pos;
    int *victim_buf;         /* (budget) */
    double *score_buf;       /* (budget) */
    size_t live_bytes;       /* total live bytes now, kept as slots fill, move and free (kv_bytes recounts them) */
    size_t peak_live_bytes;
    KVEvictFn on_evict; void *evict_ctx;
    int n_evictions;         /* tokens evicted, all lanes, since init */
    /* the second axis, since init: KV bytes attention read (every slot a query attended, in its stored form: vectors,
       scales and minimums; counted once per kv head, as GQA's query heads share the read) and the tokens that read
       them; bytes per decode step = the difference of bytes_read over the difference of steps_read */
    uint64_t bytes_read;
    long steps_read;
    uint64_t bytes_moved;    /* between memory tiers: 0 until a cache has a slow tier */
    KVSlotFn on_slot; void *slot_ctx;   /* the device mirror's observer, or NULL */
    void *device;            /* the device mirror (AttnDevice, attn.h) when attention runs on a GPU; NULL: the CPU */
    KVBackend backend;       /* the CPU attention kv_attend_chunk runs (kv_set_backend); KV_BACKEND_FAST after init */
};

/* Create a cache for a model shape from a parsed spec (the policy's own keys are checked here). Budget: spec->budget
 * tokens per lane, or the largest that fits spec->budget_bytes, or shape->seq_len for policies without a budget.
 * Returns 0, or -1 + message (budget 0, budget not above what the policy protects, unknown key, byte budget too
 * small). */
int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen);
void kv_cache_free(KVCache *c);
/* Forget every token (between documents): all lanes empty, policy state reset, the prompt length back to prefill=.
 * Peaks (KVLane.peak_live, kv_bytes().peak_live) and n_evictions are kept: they count since kv_cache_init. */
void kv_cache_reset(KVCache *c);
/* Tell a prompt-end policy (snapkv) that positions 0..n_tokens-1 are the prompt. Call it before feeding position 0
 * (generate, chat, passkey); the compression then happens right after the attention of position n_tokens-1, from
 * the attention of the last obs prompt queries, which the policy gathers as they pass. It compresses once per
 * document: a later call (a second chat turn) is ignored until kv_cache_reset. Other policies ignore it. */
void kv_set_prompt_len(KVCache *c, int n_tokens);

/* Steps 1 and 2 for every lane of layer l: evict if full, then store the token at position t.
 * k, v: (n_kv_heads * head_dim) before RoPE. Returns 0, or -1 when a lane is full and the policy cannot evict
 * (`full` past its context). */
int kv_append(KVCache *c, int l, int t, const float *k, const float *v);
/* Steps 3 and 4 by their definition, THE reference every attention path is checked against (kv_attend_cpu,
 * kv_attend_chunk in every build, attn.cu's kernels and their CPU twin: tests/test_attn_ref.c, tests/test_attn.cu).
 * q (n_heads * head_dim, before RoPE) is the token at position t, stored by kv_append(c, l, t, ...) just before; for
 * each query head h, with lane (l, h / (n_heads / n_kv_heads)) holding n live slots k_i, v_i in rank (position) order:
 *   keys    the f32 key as stored: the f32 residual region as is, f16/bf16/q8/q4 decoded (kv_decode); under pos=orig
 *           it was rotated by its position when stored, under pos=cache it is rotated now by its rank i (StreamingLLM,
 *           Xiao et al. 2023, §3.2), and the query by t (pos=orig) or by n-1 (pos=cache) (RoPE: Su et al. 2021);
 *   scores  s_i = (q·k_i)/√head_dim (scaled dot-product attention, Vaswani et al. 2017, eq. 1), f32;
 *   probs   p_i = e^(s_i − max_j s_j) / Σ_j e^(s_j − max_j s_j), f32, libm's expf;
 *   output  out_h = Σ_i p_i·v_i (head_dim), v_i decoded as k_i (never rotated).
 * Every sum is a plain f32 loop in increasing index order (d for the dot, i for the softmax and the output): no SIMD
 * beyond what the compiler does without reassociating, no threads, so its bits are those of its C on any build. It
 * is slow (each key decoded once per query head) and not bit-identical to the fast paths, which agree with it within
 * a bound derived from f32 rounding over head_dim and n (tests/attn_ref_check.h). As kv_attend_cpu, it leaves p_i of
 * query head h in c->scores[h * budget + i] and ends with step 4 (kv_attend_policy). No errors: n >= 1 (the token
 * itself is live). */
void kv_attend_ref(KVCache *c, float *out, int l, int t, const float *q);
/* Steps 3 and 4 as kv_attend_ref defines them, fast (attn_cpu.c): the same contract and outputs within the bound of
 * tests/attn_ref_check.h; the probabilities of query head h stay in c->scores[h * budget + i] (rank i). Lanes run in
 * parallel under OpenMP; each output is computed by one thread in an order of operations fixed by the code, so any
 * thread count, and a build with or without AVX, give the same bits. */
void kv_attend_cpu(KVCache *c, float *out, int l, int t, const float *q);
/* Called after step 4 of each token (eval's shadow and recall bookkeeping): c->scores holds that token's
 * probabilities for the lane's n_live ranks, as after kv_attend_cpu (what lies past n_live is undefined). */
typedef void (*KVAttnHook)(void *ctx, int l, const KVCache *c, int pos);
/* Steps 1-4 for n consecutive tokens of layer l at positions pos0..pos0+n-1, in order, with hook (may be NULL) after
 * each token's step 4: the same bits as kv_append + kv_attend_cpu + hook token by token, for any n and thread count.
 * The forward pass's CPU entry point (run.c, forward_layer). q, out: (n, n_heads * head_dim); k, v: (n, n_kv_heads *
 * head_dim), before RoPE. While no slot of the layer can be freed (every lane has room, no prune, no residual region,
 * CPU attention, the fast backend) step 3 runs for the whole chunk at once, reading each key and value once per chunk
 * instead of once per token. With c->backend KV_BACKEND_REF it is kv_append + kv_attend_ref + hook token by token.
 * Not reentrant: its large scratch is shared by every cache of the process (call it for one cache at a time).
 * Returns 0, or -1 as kv_append. */
int kv_attend_chunk(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k, const float *v,
                    KVAttnHook hook, void *hook_ctx);
/* Step 4 alone: show the policy the probabilities in c->scores (per query head, rank order, as kv_attend_cpu leaves
 * them), then on_layer_done and prune. kv_attend_ref and kv_attend_cpu end with it; a device path calls it after
 * copying its probabilities into c->scores, so the policy code is the same on every device. */
void kv_attend_policy(KVCache *c, int l, int t);
/* Choose the attention kv_attend_chunk runs for this cache from now on (a whole job: set it before the first token;
 * kv_cache_reset keeps it). 0, or -1 (nothing changed) when b is not a KVBackend or a device mirror is attached
 * (c->device: the forward pass then attends on the device and never reaches kv_attend_chunk; a mirror attached
 * after REF was set takes it there too, so -d ref attaches none). */
int kv_set_backend(KVCache *c, KVBackend b);

/* RoPE in place on one head vector x (head_dim) at position pos (RoFormer, Su et al. 2021, eq. 34; pairing per
 * shape->rope_pairing; frequencies theta^(-2i/head_dim), divided by rope_factors[i] when present). */
void kv_rope(float *x, const KVShape *shape, int pos);
/* The cos, sin table kv_rope uses for position pos: cs (head_dim/2, 2), angles in double, then rounded to float. */
void kv_rope_cs(float *cs, const KVShape *shape, int pos);

/* Bytes of one stored vector of head_dim elements in type ty (scales included). */
size_t kv_vector_bytes(KVType ty, int head_dim);
/* Encode x (head_dim, finite) into dst (kv_vector_bytes bytes) and decode it back; exposed for tests and kernels.
 * Groups of gcd(head_dim, 32); kv_codec.h (the codec they loop over, shared with attn.cu) has the layouts and their
 * error bounds. */
void kv_encode(uint8_t *dst, KVType ty, const float *x, int head_dim);
void kv_decode(float *x, KVType ty, const uint8_t *src, int head_dim);
/* Accounting for the whole cache now, and for one lane (its peak_live is that lane's peak slots in bytes). */
KVBytes kv_bytes(const KVCache *c);
KVBytes kv_lane_bytes(const KVCache *c, int l, int g);
/* The allocated bytes a cache of this shape and spec would take with `budget` slots per lane (= kv_bytes's
 * total_alloc after kv_cache_init). */
size_t kv_alloc_bytes_for(const KVShape *shape, const KVSpec *spec, const KVPolicyOps *ops, int budget);
/* One line: policy, resolved budget and parameters, types, residual, pos, agg (for the start-up line and -v). */
void kv_describe(const KVCache *c, char *buf, size_t len);
/* The capacity rule, the one place it is decided: how many tokens a stream can feed this cache. An evicting policy
 * takes any number (INT_MAX); a non-evicting one (full, snapkv after its compression) stops when its lanes are full,
 * at its slots per lane (c->budget: -c for full and snapkv, or full:N's N). */
int kv_capacity(const KVCache *c);
/* 1 when the cache's policy is layer-local (batched evaluation is exact), 0 when it declares cross_layer. */
static inline int kv_layer_local(const KVCache *c) { return !c->policy.ops->cross_layer; }

/* Slots of a lane that are live now, as positions in increasing order (for tests and logs): writes up to max
 * positions, returns count. */
int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max);

/* splitmix64 (Steele, Lea, Flood 2014): a tiny, well-mixed generator whose output is the same on every platform; any
 * seed, 0 included, gives a good stream. One copy for the sampler, the passkeys, export's random models and the tests.
 * Each call adds the golden-ratio increment to the state and returns kv_mix64 of it; kv_mix64, its finalizer, is a
 * bijection of 64-bit words in which every input bit flips each output bit with probability about 1/2. Called on a
 * copy of a key (splitmix64(&key) with key by value) it is a counter-based hash: policies.c's `random` draws from it. */
static inline uint64_t kv_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline uint64_t splitmix64(uint64_t *state) { return kv_mix64(*state += 0x9E3779B97F4A7C15ull); }

/* ---- storage type conversions (IEEE 754 binary16, bfloat16), round to nearest even; shared by export.c and, compiled
 * for the device too (KV_HD), by attn.cu ---- */
#ifdef __CUDACC__
#define KV_HD __host__ __device__
#else
#define KV_HD
#endif
static inline KV_HD float kv_f16_to_f32(uint16_t h) {
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
static inline KV_HD uint16_t kv_f32_to_f16(float f) {
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
static inline KV_HD float kv_bf16_to_f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline KV_HD uint16_t kv_f32_to_bf16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);   /* quiet NaN stays NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

#endif
