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
 *   1. for each lane: a merging policy may first merge runs of adjacent old tokens into one slot each; then, if the
 *      lane holds `cap` live slots, the policy names ranks to evict (chosen from its state after step t-1), freed;
 *   2. store k_t, v_t in a free slot (pos=orig: k rotated with position t; pos=cache: k stored before RoPE);
 *   3. every query head reads its lane's live slots, itself included, or the ranks a selection policy chose for this
 *      query (one set per lane: the group's query heads share it): softmax(q·Kᵀ/√head_dim)·V over them, scores and
 *      softmax in f32 whatever the storage type;
 *   4. the policy observes this step's attention probabilities, aggregated over the query heads of the GQA group
 *      (mean, or max with agg=max), and updates its state; a policy may then free slots (snapkv's one compression).
 * So for eviction and merging the budget is both the number of tokens a query attends to (itself included) and the
 * number of slots a lane ever holds (`window:4` at t=9 attends {6,7,8,9}); for selection it is what one query reads,
 * and the lane holds every token up to -c.
 *
 * Live slots are kept as an INDEX LIST per lane (`live`, slot ids in increasing position order): eviction removes
 * entries, insertion appends one (positions only grow), attention walks the list. We chose an index list over
 * compaction so a token's bytes move at most once per band (see below): a GPU copy of the cache only has to be told
 * which slots changed.
 *
 * Precision bands, precision by age (recode). A lane's slots (`cap`; -c for full, snapkv and selection) are split into
 * bands, newest first: prec=f32:64/q8:512/q4 gives band 0 = 64 slots in f32, band 1 = 512 in q8, band 2 = the rest
 * in q4 (clipped when the lane is smaller). A new token always goes to band 0; when a band is full its oldest token is
 * recoded once into the next band (that band making room the same way first), so some band always has room (the lane
 * holds at most cap-1 tokens before the store), and the policy metadata moves with the token. So every token of band
 * i+1 is older than every token of band i, band 0 holds the newest min(its slots, n_live) tokens (fewer, transiently,
 * after a policy freed several at once), and no token is stored twice. residual=R (KIVI, Liu et al. 2024,
 * arXiv:2402.02750, §3: the newest R tokens stay in full precision) is the special case prec=f32:R/TYPE. Policies
 * must not remember slot ids across steps: they see ranks, and keep per-slot state in `meta`, which moves with the
 * token.
 *
 * Keys per channel (kgroup=channel, kgsize=G; KIVI, Liu et al. 2024, arXiv:2402.02750, §3.2-3.3: keys quantized per
 * channel over groups of G tokens, values per token). In a band whose keys are quantized (q8, q4, q2), the band's
 * slot rows are cut into GROUPS of G consecutive rows (the last one shorter when the band is). A group is EMPTY, OPEN
 * or SEALED; a band has at most one open group, whose keys are held in f32 (KIVI's full-precision residual of the
 * newest partial group) in a buffer of min(G, band slots) keys beside the band. A key entering the band goes to a free
 * row of the open group, else to a row of an empty group (which opens), else to a free row of a sealed group (below).
 * When every row of the open group holds a key, the group is SEALED: for each of the head_dim channels an f16 scale d
 * and f16 minimum m over its G keys (kv_minscale: m rounded down, d up, so none is clipped), and each key stored as
 * head_dim codes of 8, 4 or 2 bits, x = d·q + m, error at most the channel's d/2. Values stay per token in the band's
 * value type. The newest tokens of a lane are thus held in f32 twice over with residual=R: the R of band 0, then up to
 * G-1 in the open group of band 1 (KIVI's residual counts both).
 * Eviction inside a sealed group frees the slot at once: the other keys keep their bits (their group's scales and
 * minimums still decode them) and the freed row may take a later key. That key is coded with the group's scales when
 * it lies within every channel's range [m, m + qmax·d] (error at most d/2, as the others); otherwise the group is
 * re-quantized: its live keys decoded, the new one added, scales and minimums recomputed over them, all re-encoded (the
 * old keys then carry their first rounding plus at most the new d/2). We chose this over the two alternatives: masking
 * the freed slot until its group empties would leave a full lane no slot for the new token after its policy evicted
 * (the budget would no longer be the slots a lane holds), and re-quantizing at every eviction would round every other
 * key of the group again for nothing. kgroup=channel applies to the keys of every quantized band (prec= bands
 * included: a key recoded from one band to the next is decoded and enters the next band's open group); f32, f16 and
 * bf16 keys stay per token. It is refused with merging and selection policies and with memory tiers (fast=), and the
 * CUDA mirror does not take it. Bytes: each slot's codes and its value, each group's scales and minimums (4·head_dim)
 * and the open buffer are allocated; live are the sealed keys' codes, the headers of non-empty sealed groups and the
 * open group's f32 keys (4·head_dim each), and a step reads what is live.
 *
 * Merging (pool): the merged slot's key and value are the mean of the run's decoded f32 vectors (keys as stored:
 * rotated under pos=orig, so the merged score is the mean of the tokens' scores, the dot product being linear;
 * pre-RoPE under pos=cache, rotated later by the slot's one rank, which loses the tokens' offsets within the run),
 * encoded into the newest token's slot in that slot's storage form; it keeps the newest token's position and covers pos0..pos for
 * recall. The other slots of the run are freed.
 *
 * Merge-on-evict (merge=1, any evicting policy but pool): when the policy names a victim, the cache merges it into the
 * kept slot of the same lane whose key is most similar by cosine instead of freeing it alone (D2O's choice of target,
 * CaM's attention weights; kv.c, lane_evict, says what differs from the papers): key and value become
 * (w_v·x_victim + w_t·x_target) / (w_v + w_t), w the slots' accumulated attention (KVLane.mw, kept by the cache),
 * equal weights when both are 0; the target keeps its position and storage form, its weight becomes w_t + w_v, and
 * it covers the victim's positions for recall (a set, not a range: eval.c follows it from the KV_EV_MERGE events).
 * Low rank (rank=R for keys and values, krank=R / vrank=R apart, calib=N; ShadowKV, Sun et al. 2024,
 * arXiv:2410.21465, stores pre-RoPE keys at low rank, there from an SVD of the prompt's keys; Palu, Chang et al. 2024,
 * arXiv:2407.21118, gets low-rank keys and values by factoring the projections instead): per lane, the basis of
 * a side is the R eigenvectors with the largest eigenvalues of the uncentered second moment Σ x·xᵀ (no mean is
 * stored, so no bytes for one: attention's scores are linear in the key, and the mean direction, if it matters, is
 * among the top ones) of that lane's pre-RoPE keys (values) over the first N tokens of the stream (default 512,
 * clipped to -c), every token stored counted whether the policy evicts it later or not, fitted by lowrank.c's Jacobi
 * solver when the lane's N-th token is stored. Before that the lane is a full-rank cache (the same bits as the spec
 * without rank=), its vectors held in a staging block of min(cap, N) full-rank rows per lane; at the fit every live
 * slot is projected once and, after the last lane's fit, the staging is freed. From then on a slot holds R
 * coefficients of the pre-RoPE vector in the lane's storage type (q8, q4 over R elements in groups of gcd(R, 32);
 * q4 needs R even); a key is reconstructed (basis times coefficients, f32) and then rotated by its position
 * (pos=orig, from a table by position) or by its rank (pos=cache); a value is reconstructed. A document's reset
 * calibrates again. Accounting: the slots hold R-coefficient room from init; the bases (R·head_dim f32 per side) are
 * allocated once per lane and live once fitted; the staging counts while it is held, so the peak and a byte
 * budget include it; a step reads the bases of every lane it reconstructs from. One storage band only (no prec=,
 * residual=), no merging policy, no fast= tier, no CUDA mirror: refused or said where it applies. kv_attend_chunk
 * runs a non-evicting low-rank lane a chunk at a time up to the token whose store fits it (that token alone), and an
 * evicting one token by token.
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
 * Budgets over a layer's kv heads (alloc=ada; Ada-KV, Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
 * Adaptive Budget Allocation for Efficient LLM Inference", arXiv:2407.11550: the slots of a layer go to the heads
 * whose attention needs them, by ranking the policy's scores of every head together). The budget B stays the mean
 * per lane: the H = n_kv_heads lanes of a layer hold at most H·B slots together, each lane up to min(-c, H·B) (one
 * head may take the others' share). The rule, at step 1 of the token at pos_now in layer l, before any lane stores:
 * if Σ_g n_live(l, g) + H > H·B, the layer frees the Σ_g n_live + H − H·B live slots with the lowest keep scores
 * (KVPolicyOps.keep_score) over all H lanes, ties to the oldest position, then the lowest kv head, never a +INFINITY
 * one: that is the moment a lane shrinks. The safeguard (safeguard=A, default 0.2): each lane's ⌊A·B⌋ highest-scored
 * ranks (ties: the newest) are not candidates, so no head is squeezed below that share by the others; A in [0, 1),
 * 0 turns it off. The safeguard is taken from Ada-KV's released implementations, which let
 * each head keep a fraction α of the budget: the authors' first code gives each head α·B plus (1 − α) of its
 * top-k share (α = 0.5 in its example configuration), the later head-wise implementation the authors reviewed keeps
 * each head's ⌊α·B⌋ best tokens before the layer-wide ranking (α = 0.2 by default), which is the form taken here.
 * Ada-KV allocates once, when the prompt is compressed; kvlab applies the ranking at every decode step. The per-lane
 * evict verb still fires if a lane reaches its own cap (a stream past -c). In steady state a layer holds H·B live
 * slots, as uniform lanes do.
 * Memory follows the split: the lanes are paged (as a serving pool's, below) from a pool the cache owns, of
 * n_layers · (ceil(H·B/P) + H) pages of P slots (each lane may hold one part-filled page), P the largest power of two
 * <= B/32 (at least 1, at most 16), so rounding wastes at most H·P <= H·B/32 slots a layer. Each lane's metadata
 * (positions, live and free lists, policy data, page table) is sized by its cap, H·B. With kv_cache_init_pool the
 * pages come from the serving pool instead. Refused: a policy without keep_score or that does not evict, a byte
 * budget, merge=1, ragged caps, and what paged lanes refuse (prec=, residual=, kgroup=channel, rank=, fast=).
 *
 * Memory (kv_bytes): vectors (scales and minimums included; low rank: coefficients, bases, staging), positions (int32,
 * two with a merging policy), the live and free index lists (int each), policy metadata and, with merge=1, the f32
 * weight mw, per slot; allocated = every slot of every lane, live = the
 * slots in use; with alloc=ada the vectors allocated are the cache's whole page pool and the metadata
 * counts each lane's page table and the pool's bookkeeping. Attention
 * scratch (probabilities, decoded keys, the RoPE table of pos=cache) is workspace, not cache, and is not counted.
 * ------------------------------------------------------------------------------------------------------------- */

typedef enum { KV_F32 = 0, KV_F16, KV_BF16, KV_Q8, KV_Q4, KV_Q2, KV_NTYPES } KVType;
typedef enum { POS_ORIG = 0, POS_CACHE } PosMode;
typedef enum { AGG_MEAN = 0, AGG_MAX } AggMode;

extern const char *const kv_type_names[KV_NTYPES];   /* "f32", "f16", "bf16", "q8", "q4", "q2" */

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

/* Precision bands of a lane (precision by age): band 0 holds the newest tokens, each later band older ones in its
 * own storage form; the last band takes the rest of the lane. residual=R with type T is the two bands f32:R/T;
 * prec=f32:64/q8:512/q4 is three. Keys and values may age apart: kprec=f32:64/q4 with vprec=f32:256/q8 gives the
 * bands f32+f32:64, q4+f32:192, q4+q8 (key form + value form), the union of the two schedules' boundaries; a token
 * moving between bands whose key (value) form is the same keeps its key (value) bytes as they are. Adjacent bands of
 * the same form are one band. ("Tier" is kept for memory tiers, fast and slow memory, which bands are not.) */
#define KV_MAX_PREC 4                     /* bands one prec=, kprec= or vprec= may give */
#define KV_MAX_BANDS (2 * KV_MAX_PREC)    /* bands of a lane: kprec= and vprec= boundaries together (at most 7) */
/* kgroup=channel's tokens per key group: the default (KIVI's G = 32) and the largest kgsize= */
#define KV_KGSIZE_DEFAULT 32
#define KV_KGSIZE_MAX 4096

/* A parsed -kv spec: NAME[:BUDGET][,key=value...]. The keys every policy takes are parsed into fields here; the
 * rest stay as strings for the policy to read (kv_spec_get). */
#define KV_MAX_PARAMS 12
typedef struct {
    char name[24];
    int budget;               /* tokens per lane; 0 = none given */
    size_t budget_bytes;      /* whole cache, bytes; 0 = the budget is in tokens */
    KVType ktype, vtype;
    int residual;             /* tokens kept in f32 at the recent end of a lane (KIVI's residual), part of budget */
    /* Precision by age, keys [0] and values [1] apart: prec=T0:N0/.../TL sets both, kprec= keys only, vprec= values
     * only (0 bands: none given for that kind; then type/ktype/vtype and residual decide). The lane's bands are the
     * union of the two schedules' boundaries (spec_bands in kv.c). */
    int n_prec[2];
    KVType prec_type[2][KV_MAX_PREC];  /* storage form of each band, newest first */
    int prec_slots[2][KV_MAX_PREC];    /* slots of each band but the last, which takes the rest (0) */
    PosMode pos;
    AggMode agg;
    int n_params;
    char keys[KV_MAX_PARAMS][24];
    char vals[KV_MAX_PARAMS][40];
    int used[KV_MAX_PARAMS];  /* set when a policy reads a key: an unread key is an error (a typo is never ignored) */
    size_t fast_bytes;        /* fast=BYTES: the fast memory tier's bytes, whole cache; 0 = one tier (or fast_frac) */
    double fast_frac;         /* fast=P%: the fast tier as a share of the cache's allocated vector bytes; 0 = none */
    char fast_text[24];       /* fast='s value as given, for messages */
    int prefetch;             /* prefetch=1: move what the next layer's predicted query reads ahead (kv_prefetch) */
    int kgroup_channel;       /* kgroup=channel: quantized keys per channel over groups of kgsize tokens (above); 0:
                                 kgroup=token, the default (per token, groups of elements as the type's layout says) */
    int kgsize;               /* kgsize=G: tokens per key group with kgroup=channel; 0 = not given (32) */
    int krank, vrank;         /* rank= (both), krank=, vrank=: coefficients per key / value of a low-rank lane, in
                                 [1, head_dim] (checked by kv_cache_init); 0 = full rank */
    int rank_joint;           /* 1: the rank came as rank= (both sides), so messages name rank= */
    int calib;                /* calib=N: tokens of the stream the low-rank basis is fitted on; 0 = the default */
    char text[256];           /* the spec as given, for reports */
} KVSpec;

/* Parse a spec. default_type is the -kvt storage type. Returns 0, or -1 with a message naming the bad part and the
 * valid choices in err. Never exits. The policy-specific part is checked by kv_cache_init (it needs the policy). */
int kv_spec_parse(KVSpec *spec, const char *text, KVType default_type, char *err, size_t errlen);
/* The value of a policy key, or NULL; kv_spec_get marks the key as read, kv_spec_value does not. */
const char *kv_spec_get(KVSpec *spec, const char *key);
const char *kv_spec_value(const KVSpec *spec, const char *key);
/* Checks a spec against the run mode ("generate", "chat", "ppl", "passkey", "bench"): prompt=dense needs a prompt,
 * which ppl has not; then its policy's check_mode (snapkv needs prefill=P in ppl). 0, or -1 + message. */
int kv_spec_check_mode(const KVSpec *spec, const char *mode, char *err, size_t errlen);
/* A size in bytes with its unit: "4096B", "512KiB", "64MiB", "1GiB" (> 0). 0, or -1. */
int kv_parse_bytes(const char *s, size_t *bytes);
/* Parse a storage type name; -1 if unknown. */
int kv_type_parse(const char *s);

/* One lane: (layer, kv_head). Slot ids are 0..cap-1; each band owns a contiguous range of them, band 0 (the newest
 * tokens) the highest ids, the last band (the oldest) from 0: with one band slot s is row s of k and v. */
typedef struct {
    int cap;               /* slots of this lane: its budget (budgets may differ per lane); memory is for cap slots */
    int n_live;            /* live slots now */
    int *live;             /* (cap) slot ids of the live tokens, in increasing position order */
    int32_t *pos;          /* (cap) original position of the token in each slot (the newest one it covers after a
                              merge); -1 = free */
    int32_t *pos0;         /* (cap) the oldest position a slot covers (a merged slot covers pos0..pos), or NULL when
                              the policy never merges (every slot covers its pos alone) */
    int band_first[KV_MAX_BANDS];   /* first slot id of each band (0 for the last) */
    int band_slots[KV_MAX_BANDS];   /* slots of each band (0: the lane is too small to reach it) */
    int *free[KV_MAX_BANDS];        /* (band_slots) stack of each band's free slot ids; n_free of them */
    int n_free[KV_MAX_BANDS];
    uint8_t *k[KV_MAX_BANDS];       /* (band_slots, k bytes of the band) keys in the band's key type */
    uint8_t *v[KV_MAX_BANDS];       /* (band_slots, v bytes of the band) values in the band's value type */
    /* Paging: row r of band b (slot band_first[b] + r) lives in page r >> pg_shift, at row r & pg_mask of it:
     * kpg[b][page] + (r & pg_mask) * key bytes, values in vpg[b][page] (kv_band_k, kv_band_v). A lane of a single run
     * holds each band in one page, its arena block (kpg[b] = &k[b], pg_shift 30); a lane of a pool (kv_cache_init_pool)
     * holds band 0 in pages of 2^pg_shift slots taken from the pool as it fills, their ids in page_id. */
    uint8_t **kpg[KV_MAX_BANDS], **vpg[KV_MAX_BANDS];
    int pg_shift, pg_mask;
    int n_pages;           /* pool lanes: pages held (the first n_pages entries of kpg[0], vpg[0], page_id) */
    int *page_id;          /* pool lanes: (pages of cap slots) the pool's id of each page held; NULL in a single run */
    float *mw;             /* (cap) merge=1 (merge-on-evict): each slot's accumulated attention, the group-mean
                              probabilities summed over the steps it was seen (a merged slot's: its tokens' sum), zeroed
                              when a token is stored; NULL without merge=1 */
    int kopen[KV_MAX_BANDS];        /* kgroup=channel: the band's open key group (index of G rows), or -1 */
    uint8_t *meta;         /* (cap, meta_bytes) policy metadata of each slot, zeroed when a token is stored. It lives
                              beside the vectors, not with them: the policy owns it and may write it through a
                              const KVLane (kv_rank_meta) */
    int peak_live;         /* slots, the most ever live */
    /* low rank (krank/vrank of the cache > 0; see "Low rank" above): the lane's bases, carved beside its slots */
    float *kbasis;         /* (krank, head_dim) f32, row j the j-th direction of the pre-RoPE keys; NULL: keys full */
    float *vbasis;         /* (vrank, head_dim) f32, the values' directions; NULL: values full rank */
    int lr_seen;           /* tokens stored since reset, up to the calibration span (calib) */
    int lr_fitted;         /* 1: the bases are fitted and the slots hold coefficients; 0: full-rank staging */
    size_t stage_off;      /* this lane's rows in the cache's staging block (KVCache.stage), bytes */
} KVLane;

/* The read-only lane view a policy works from: ranks 0..n_live-1 are the live tokens, oldest first. A policy never
 * sees slot ids, free lists or vectors; it answers with ranks. Its metadata for rank i: kv_rank_meta. */
static inline int kv_rank_pos(const KVLane *ln, int i) { return ln->pos[ln->live[i]]; }
static inline int kv_rank_pos0(const KVLane *ln, int i) { return ln->pos0 ? ln->pos0[ln->live[i]] : kv_rank_pos(ln, i); }
/* merge=1: the accumulated attention of rank i (KVLane.mw); 0 without merge=1. */
static inline float kv_rank_weight(const KVLane *ln, int i) { return ln->mw ? ln->mw[ln->live[i]] : 0.0f; }
static inline uint8_t *kv_rank_meta(const KVLane *ln, int i, size_t meta_bytes) {
    return ln->meta + (size_t)ln->live[i] * meta_bytes;
}

typedef struct KVPolicy KVPolicy;
typedef struct KVCache KVCache;

/* The policy interface (v2). A policy is a table of these callbacks plus its state; policies.c registers them by
 * name. It is shown a lane as the read-only view above and answers with VERBS on ranks that the cache carries out,
 * accounts for, logs (-kvlog) and mirrors to the device:
 *   evict   (step 1, and prune after step 4) the ranks to free;
 *   select  (step 3) the ranks this query reads; without it every live rank;
 *   merge   (step 1) runs of adjacent ranks that become one slot, key and value their mean;
 *   observe (step 4) this step's attention probabilities over the lane's ranks;
 *   recode  moving a token to another storage form is the cache's own rule (prec=, by age), taken by any policy.
 * clone/restore (kv_cache_clone) copy a cache with its policy state: a policy's state is the one block `state` of
 * `state_bytes` (policy_state_alloc in policies.c), copied as bytes, so it holds no pointers.
 * Lane index `lane` = l * n_kv_heads + g. Positions are tokens' original positions. Every callback is optional. */
typedef struct {
    const char *name;
    const char *summary;       /* one line for -h */
    const char *paper;         /* the paper (or the classic method) it implements, for -h policies */
    const char *example;       /* a small spec that runs in every mode (budget 16): -h policies and the tests' loops
                                  over every registered policy use it */
    const char *options;       /* its own keys, for error messages ("sinks=S"), or "" */
    const char *reason;        /* why it evicts, for the -kvlog "reason" field ("lowest accumulated attention") */
    const char *family;        /* eviction, merging, selection, allocation (-h policies) */
    int needs_budget;          /* 1: NAME:BUDGET is required */
    int evicts;                /* 1: the lane stays within its budget by evicting (or merging); 0: it stops at -c
                                  (full, snapkv, the selection policies) */
    int grows;                 /* 1: lanes have room for -c tokens whatever the budget (snapkv grows after its
                                  compression, a selection policy stores every token); the budget is then the
                                  policy's own target (snapkv) or what a query reads (selection) */
    int prompt_end;            /* 1: acts at the end of the prompt (kv_set_prompt_len or prefill=P) */
    int select_scores;         /* 1: select is given the group-mean scores of every live key (topk); their full
                                  key pass is counted as read */
    int select_keys;           /* 1: select is given the f32 key of every live rank as attention sees it (decoded
                                  from its band, rotated: under pos=orig by its position, under pos=cache by its
                                  rank), (n_live, head_dim) row by row, from the rank select_keys_from names (quest
                                  builds its page bounds from them). They are handed over so the policy needs no copy
                                  of the vectors; they are NOT counted as read: what the policy reads to choose it
                                  reports with select_bytes */
    int cross_layer;           /* 1: its decisions at layer l may depend on other layers' attention of the same token,
                                  so a chunk cannot run layer by layer: forward_chunk and -chunk fall back to token
                                  by token. 0 (every policy today): layer-local, batched evaluation is exact */
    /* Read the policy's own keys from spec (kv_spec_get), set defaults, check them against the budget (which must
     * exceed what the policy protects, the current token counted, by at least one slot it chooses). 0, or -1 +
     * message; on -1 the caller still calls free. */
    int (*init)(KVPolicy *p, KVSpec *spec, const KVShape *shape, int budget, char *err, size_t errlen);
    void (*free)(KVPolicy *p);
    /* Checks a spec against the run mode ("generate", "chat", "ppl", "passkey", "bench"), e.g. snapkv needs prefill=
     * in ppl, which has no prompt. 0, or -1 + message. */
    int (*check_mode)(const KVSpec *spec, const char *mode, char *err, size_t errlen);
    /* Bytes of policy metadata per slot (ln->meta), for the layout and the accounting. It depends on the spec and the
     * budget only, never on the state, so byte budgets can be resolved before init (read keys with kv_spec_value). */
    size_t (*meta_bytes_per_slot)(const KVSpec *spec, int budget);
    /* Forget all tokens (a new document); lanes are already empty and their meta zeroed. */
    void (*reset)(KVPolicy *p);
    /* A token at `pos` was stored at rank `rank` (the lane's newest) of `lane`; its meta is zero. */
    void (*on_insert)(KVPolicy *p, int lane, const KVLane *ln, int rank, int pos);
    /* Step 1, merge: before the fullness check of the token at pos_now. Write up to `max` runs of adjacent ranks
     * (first[j], count[j] >= 2, in increasing order, not overlapping) to merge; return how many (0: none). The
     * merged slot takes the newest token's slot, position and metadata and covers the run's positions. */
    int (*merge)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *first, int *count, int max);
    /* Step 1, evict: the lane is full before storing the token at pos_now. Write up to `max` ranks to free into
     * ranks (any order, no repeats) and a score for each (for the log), return how many (>= 1), or 0 when the policy
     * cannot evict (the cache is full). */
    int (*evict)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *ranks, int max, double *score);
    /* Step 3, select: write the ranks the query at pos_now reads (increasing, the newest rank n_live-1 among them
     * unless the policy says otherwise in its comment), at most `max`; return how many (>= 1). score (n_live): with
     * select_scores, the group mean over the GQA group's query heads of q·k_i/√head_dim for every live rank, else
     * NULL. keys (n_live, head_dim): with select_keys, every live rank's f32 key as attention sees it (the rows from
     * select_keys_from's rank on), else NULL.
     * q (n_heads / n_kv_heads, head_dim): the GQA group's query heads at pos_now, rotated as attention rotates them
     * (by pos_now under pos=orig, by n_live-1 under pos=cache), always given. */
    int (*select)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, const float *score, const float *keys,
                  const float *q, int *ranks, int max);
    /* Step 3, before select, with select_keys: the first rank whose key select needs now; kv.c fills only the rows
     * of keys from it on (the rows below hold nothing defined). A policy that keeps what it derived from older keys
     * while they cannot change (KVPolicy.keys_fixed: quest's page bounds) asks for the new ones only. NULL: 0. */
    int (*select_keys_from)(const KVPolicy *p, int lane, const KVLane *ln);
    /* Step 3, after select: the bytes the policy read to make that choice (its own index, e.g. quest's page bounds),
     * beyond the chosen ranks' keys and values, which kv.c counts itself; added to bytes_read. NULL: 0. */
    uint64_t (*select_bytes)(const KVPolicy *p, int lane, const KVLane *ln, int pos_now);
    /* Step 3, after select: how many entries of its own index the policy scored to choose (quest: a page's bound,
     * a cluster's centroid), each counted as one key scanned (keys_scanned). NULL: 0. */
    uint64_t (*select_scanned)(const KVPolicy *p, int lane, const KVLane *ln, int pos_now);
    /* Step 4, observe: prob (n_live) aggregated over the GQA group as agg= says, and mean (n_live) the group mean
     * (the same pointer when agg=mean), both in rank order (0 for a rank the query did not read); pos_now is the
     * query's position. */
    void (*observe)(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int pos_now);
    /* After all lanes of layer l attended at pos_now (for per-layer policies such as TOVA per=layer). */
    void (*on_layer_done)(KVPolicy *p, int layer, int pos_now);
    /* After step 4 of each lane: ranks to free now whatever the fill (snapkv's compression), as evict. */
    int (*prune)(KVPolicy *p, int lane, const KVLane *ln, int pos_now, int *ranks, int max, double *score);
    /* The resolved parameters, for the start-up line ("recent=128"). */
    void (*describe)(const KVPolicy *p, char *buf, size_t len);
    /* Tokens a stream can feed the cache when that depends on its lanes (duo: its full lanes stop at -c, its
     * streaming lanes evict); kv_capacity asks it. NULL: the rule of `evicts`. */
    int (*capacity)(const KVPolicy *p);
    /* Allocation by calibration (duo): the share of lanes, in [0, 1], that the driver gives -c slots, chosen on a
     * calibration text (-calib FILE; eval_calib, eval_choose_lanes in eval.h); the driver then makes the cache with
     * kv_cache_init_lanes, -c slots for the chosen lanes and the budget for the others. A driver that has no text
     * must not run it (made with kv_cache_init every lane gets the budget). NULL: the policy takes no lane choice. */
    double (*calib_full)(const KVPolicy *p);
    /* Shrinking and allocation (alloc=ada, adapt:): write into score (n_live) how much the policy wants to keep each
     * live rank of ln before the token at pos_now is stored, higher = kept longer, +INFINITY for a rank it protects;
     * the rank its evict would name is the lowest (ties: the oldest). The scores of the lanes of one layer compare
     * (H2O's accumulated attention, TOVA's last attention: probabilities of one softmax each), so a layer's slots can
     * be ranked together (Ada-KV). Computed from the lane view and the policy's parameters only, never from per-lane
     * state, so it may score a lane of another cache that holds this policy's metadata. NULL: the policy cannot. */
    void (*keep_score)(const KVPolicy *p, int lane, const KVLane *ln, int pos_now, double *score);
    /* Sharing a full cache's prefill (kv_full_prefix): the tokens, counted from a reset, over which the policy does
     * nothing but store, as `full` does: no verb, and its state and every slot's metadata stay as reset and on_insert
     * leave them (its observe changes nothing yet). INT_MAX: until a lane is full (window, sink, random: they act
     * only when they must free a slot), or for a selection policy until its first selecting query (kv_full_prefix
     * caps it: the prompt's end under prompt=dense, none otherwise; quest, topk). Asked after kv_set_prompt_len / kv_set_context_len (snapkv: its observation
     * window opens obs tokens before its compression point). NULL: none (a policy that scores from the first
     * token, h2o, tova, ...). */
    int (*full_prefix)(const KVPolicy *p);
    /* The newest positions evict never names: R such that every rank it frees before storing the token at pos_now
     * holds a position <= pos_now - R (h2o, scissorhands: recent=R; window:W, W; sink:N,sinks=S, N - S). With
     * bands (residual=, prec=), R - 1 at least the slots of every band but the oldest means victims come from the
     * oldest band only, so the lane stays packed and which tokens recode is a rule of their ages: a chunk of such a
     * lane may attend over a union of rows (attn_cpu.c, attend_union). NULL: none promised (token by token). */
    int (*protects)(const KVPolicy *p);
} KVPolicyOps;

struct KVPolicy {
    const KVPolicyOps *ops;
    const KVSpec *spec;
    int n_lanes, n_kv_heads, n_heads;
    int budget;            /* tokens per lane, the policy's budget (snapkv: its compression target; selection: what a
                              query reads) */
    int prompt_len;        /* tokens of the prompt (positions 0..prompt_len-1), 0 = not known; kv_set_prompt_len */
    int context_len;       /* tokens of the shared context before the prompt's question, 0 = not known;
                              kv_set_context_len (snapkv query=agnostic compresses there) */
    AggMode agg;
    int keys_fixed;        /* 1: a live rank's key as attention sees it never changes while the lane holds it (one
                              precision band, so no recode, and lanes that never free or merge a slot, so a rank, and
                              under pos=cache its rotation, stays), so what a policy derives from it may be kept */
    size_t meta_bytes;     /* bytes of metadata per slot (meta_bytes_per_slot's answer) */
    const KVLane *lanes;   /* (n_lanes) the cache's lanes, for per-layer policies */
    void *state;           /* one block of state_bytes, or NULL */
    size_t state_bytes;
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
    size_t basis_bytes;             /* low rank: the lanes' bases (in vec_alloc; in vec_live once fitted) */
    size_t stage_bytes;             /* low rank: the full-rank staging held until every lane is fitted (in
                                       vec_alloc; its rows in use in vec_live) */
    size_t formula_alloc;           /* 2 · n_layers · n_kv_heads · head_dim · slots · bytes per element (f32 = 4,
                                       f16/bf16 = 2, q8 = 1, q4 = 0.5, q2 = 0.25, k and v types apart, residual
                                       ignored): the
                                       vector part people quote */
} KVBytes;

/* An event the cache reports to an optional log (-kvlog), one per token affected:
 *   KV_EV_EVICT   the token at `pos` was freed (score: the policy's, reason: the policy's `reason`);
 *   KV_EV_MERGE   the tokens pos0..pos (n slots, adjacent ranks) became one slot at position pos (pool; into -1);
 *                 or, merge-on-evict (merge=1), the victim at `pos` was merged into the kept slot at position `into`
 *                 (n = 2, pos0 = pos, score = the two keys' cosine);
 *   KV_EV_RECODE  the token at `pos` moved to band `band`, stored as ktype/vtype from now on. */
typedef enum { KV_EV_EVICT, KV_EV_MERGE, KV_EV_RECODE } KVEventKind;
typedef struct {
    KVEventKind kind;
    int pos_now, layer, kv_head;
    int pos, pos0, n;       /* the token (merge: the newest; pos0 the oldest covered, n slots merged) */
    int into;               /* merge-on-evict: the position of the kept slot the victim was merged into; else -1 */
    int band;               /* recode: the band it moved to */
    KVType ktype, vtype;    /* recode: its storage form there */
    double score;           /* evict: the policy's score; merge-on-evict: the cosine of the victim's and target's keys */
    const char *reason;     /* evict: why (the policy's reason) */
} KVEvent;
typedef void (*KVEventFn)(void *ctx, const KVEvent *ev);

/* Memory tiers (fast=BYTES or fast=P%, prefetch=1; kv_tier.c has the model): every token's home is the slow tier;
 * the fast tier holds copies of at most lane_cap vector bytes per lane (fast= split evenly over the lanes), the least
 * recently read slot leaving first. Counters since kv_cache_init (kv_cache_reset keeps them); slot counts are per
 * lane (a slot read by a kv head's queries counts once, as bytes_read does). */
typedef struct {
    size_t cap, lane_cap;       /* bytes of the fast tier, whole cache and per lane; cap 0: one tier */
    size_t vec_alloc;           /* the cache's allocated vector bytes (what fast=P% is a share of) */
    size_t fast_bytes, fast_peak;   /* vector bytes in the fast tier now, and the most at any moment */
    uint64_t reads, hits;       /* slots attention read, and those it found in the fast tier (new tokens included) */
    uint64_t demand_bytes;      /* moved in because a read missed: the step waits for them */
    uint64_t prefetch_bytes, prefetch_slots;   /* moved in ahead by prefetch=1 (overlapping compute) */
    uint64_t prefetch_hits;     /* prefetched slots that a read then found there */
    uint64_t wasted_bytes;      /* prefetched slots that left the fast tier (or were freed) unread */
    uint64_t predict_bytes;     /* KV bytes the predictor read to choose (a selection policy's scores or index) */
} KVTierStats;
typedef struct KVTierLane KVTierLane;

/* Changes to a lane's slots, reported in order to an optional observer: the CUDA mirror (attn.cu), which is told
 * which slots changed instead of rescanning or copying the cache (the reason for the index-list design above).
 *   KV_SLOT_STORE  this step's k, v (before RoPE) went into `slot`, now the lane's last live entry (`rank`);
 *   KV_SLOT_MOVE   the token in slot `from` was recoded into slot `slot` of the next band; live[rank] changed;
 *   KV_SLOT_FREE   `slot` was freed; live entries from `rank` on are no longer where they were (compaction);
 *   KV_SLOT_RESET  every lane is empty (lane, slot, from, rank are -1).
 * Within one kv_append a MOVE comes before the STORE that reuses its slot. (The CUDA mirror takes one or two bands
 * and no merge or selection; attn.cu refuses the rest when it attaches.) */
typedef enum { KV_SLOT_STORE, KV_SLOT_MOVE, KV_SLOT_FREE, KV_SLOT_RESET } KVSlotEvent;
typedef void (*KVSlotFn)(void *ctx, KVSlotEvent ev, int lane, int slot, int from, int rank, int pos,
                         const float *k, const float *v);   /* STORE: position, k and v (head_dim each, k before RoPE) */

/* Which CPU attention the forward pass's entry point (kv_attend_chunk) runs: FAST, kv_attend_cpu and the batched
 * chunk path (attn_cpu.c); REF, kv_attend_ref token by token (-d ref: a whole job on the definition). */
typedef enum { KV_BACKEND_FAST = 0, KV_BACKEND_REF } KVBackend;

struct KVPool;
struct KVCache {
    KVShape shape;
    KVSpec spec;
    KVPolicy policy;
    int budget;              /* slots per lane, the most of any lane (the row stride of scores): the policy's budget,
                                or -c for full, snapkv and selection */
    int n_bands;             /* precision bands (1: none) */
    KVType band_ktype[KV_MAX_BANDS], band_vtype[KV_MAX_BANDS];
    size_t band_kb[KV_MAX_BANDS], band_vb[KV_MAX_BANDS];   /* bytes of one key / value vector in each band (a
                                                              per-channel band: one key's codes) */
    int band_kchan[KV_MAX_BANDS];  /* 1: the band's keys are per channel (kgroup=channel and a quantized key type) */
    int kgroup;              /* G, tokens per key group of a per-channel band; 0: no band is per channel */
    float *kgbuf;            /* (kgroup, head_dim) scratch of a group's keys while it is (re-)quantized */
    int band_want[KV_MAX_BANDS];   /* slots each band asks for (prec=, residual=), the last 0: the rest */
    int residual;            /* slots of band 0 when there are two bands and band 0 is f32 (residual=R), else 0: what
                                the CUDA mirror takes */
    size_t k_bytes, v_bytes; /* bytes of one key / value vector of the last band (the base type) */
    size_t meta_bytes;       /* bytes of policy metadata per slot */
    int merges;              /* 1: the policy merges: lanes keep pos0 */
    int merge_evict;         /* 1: merge=1, merge-on-evict: a victim is merged into its most similar kept slot
                                (kv.c, lane_evict) and lanes keep mw */
    int prompt_dense;        /* 1: prompt=dense (selection policies): queries before the prompt's end read every
                                token through the ordinary attention, later ones select (kv_set_prompt_len) */
    KVLane *lanes;           /* (n_layers * n_kv_heads) */
    struct KVPool *pool;     /* the pool the lanes' pages come from: the serving pool (kv_cache_init_pool), or the
                                cache's own (alloc=ada in a single run), or NULL */
    int pool_owned;          /* 1: pool is the cache's own (alloc=ada): made at init, freed with the cache */
    int page_slots;          /* pool caches: P, slots per page (a power of two); 0 in a single run without ada */
    /* alloc=ada (above, "Budgets over a layer's kv heads") */
    int ada;                 /* 1: a layer's lanes share H·B slots, freed by the lowest keep scores layer-wide */
    int ada_safe;            /* slots: ⌊safeguard · B⌋, each lane's highest-scored ranks that are never candidates */
    double ada_safeguard;    /* safeguard=A, the share of B */
    double *ada_score;       /* (n_kv_heads, budget) each lane's keep scores at a layer step */
    uint8_t *ada_taken;      /* (n_kv_heads, budget) 1: the rank is chosen to be freed at this step */
    int *ada_rank;           /* (n_kv_heads, n_kv_heads) the ranks each lane frees at a step (at most n_kv_heads) */
    double *ada_vscore;      /* (n_kv_heads, n_kv_heads) and their keep scores, for the log */
    uint8_t *arena;          /* one allocation for every lane array */
    size_t arena_bytes;
    /* scratch for attention (workspace, not counted as cache) */
    float *scores;           /* (n_heads, budget) probabilities of the last step, per query head */
    float *agg, *mean;       /* (n_kv_heads, budget) aggregated over a GQA group */
    float *kbuf;             /* (n_kv_heads, budget, head_dim) dequantized / rotated keys */
    float *vbuf;             /* (n_kv_heads, budget, head_dim) dequantized values */
    const float **vptr;      /* (n_kv_heads, budget) each live value's f32 row: in the cache or in vbuf */
    const uint8_t **vrow;    /* (n_kv_heads, budget) each live value as stored (a decode step reads it in place) */
    uint8_t *vrow_type;      /* (n_kv_heads, budget) and its type (KVType) */
    float *qbuf;             /* (n_heads, head_dim) rotated queries */
    /* scratch of kv_attend_chunk, grown to the largest chunk seen (its large buffers are shared by all caches,
       attn_cpu.c) */
    float *chunk_cs;         /* (chunk, head_dim/2, 2) cos, sin of positions chunk_cs_pos0.. (chunk_cs_n of them) */
    int chunk_cap, chunk_cs_pos0, chunk_cs_n;
    /* scratch of the output phase's value blocks (attn_cpu.c), grown to the most seen */
    int *vstart;             /* (n_kv_heads, blocks + 1) the first rank of each value block of a lane, then its end */
    float *vpart;            /* (value blocks of all lanes, G, head_dim) a decode step's sums per value block */
    size_t vstart_cap, vpart_cap;
    float *rope_cs;          /* (budget, head_dim/2, 2) cos, sin by rank, pos=cache only */
    float *rope_t;           /* (head_dim/2, 2) cos, sin of position rope_t_pos, shared by the layers of a step */
    int rope_t_pos;
    int *victim_buf;         /* (budget) ranks a verb names */
    int *run_buf;            /* (budget) merge run lengths */
    double *score_buf;       /* (budget) */
    float *sel_score;        /* (budget) group-mean scores for select */
    const float *sel_pre;    /* NULL, or (n_heads, budget): this step's scores of every live key, computed ahead by the
                                chunk path (attn_cpu.c, attend_select) with lane_scores' arithmetic; a select_scores
                                policy's step then reads them instead of scoring (kv.c, select_ranks) */
    int *read_rank;          /* (n_kv_heads, budget) the ranks the last step of the layer read, per kv head */
    int *read_n;             /* (n_kv_heads) how many; -1 = every live rank */
    size_t live_bytes;       /* total live bytes now, kept as slots fill, move and free (kv_bytes recounts them) */
    size_t peak_live_bytes;
    KVEventFn on_event; void *event_ctx;
    int n_evictions;         /* tokens evicted, all lanes, since init */
    int n_merged;            /* slots merged away, all lanes, since init */
    /* the second axis, since init: KV bytes attention read (every slot a query attended, in its stored form: vectors,
       scales and minimums; counted once per kv head, as GQA's query heads share the read; a selection policy's full
       score pass counts every key, and what it reports reading to choose, select_bytes, is added) and the tokens
       that read them; bytes per decode step = the difference of bytes_read over the difference of steps_read */
    uint64_t bytes_read;
    long steps_read;
    long chunk_steps;        /* (token, layer) pairs whose step 3 ran a chunk at a time (attn_cpu.c: attend_static,
                                attend_union), since init: which tokens the batched paths took, for tests */
    /* per lane and step, summed: keys scanned (scores computed to attend or to choose: every live key, or a
       selection policy's full score pass, or the chosen keys plus the index entries it scored, select_scanned) and
       slots read (the set attended); per query = the sum over steps_read x lanes */
    uint64_t keys_scanned, slots_read;
    uint64_t bytes_moved;    /* into the fast tier (tier.demand_bytes + tier.prefetch_bytes); 0 with one tier */
    KVTierStats tier;        /* the memory tiers' counters (fast=); tier.cap 0: one tier */
    KVTierLane *tiers;       /* (n_layers * n_kv_heads) kv_tier.c's per-lane state, or NULL: one tier */
    const float *pf_q;       /* kv_set_prefetch_queries: the predicted queries of layer pf_layer, (chunk, q_dim) */
    int pf_layer;
    KVSlotFn on_slot; void *slot_ctx;   /* the device mirror's observer, or NULL */
    void *device;            /* the device mirror (AttnDevice, attn.h) when attention runs on a GPU; NULL: the CPU */
    KVBackend backend;       /* the CPU attention kv_attend_chunk runs (kv_set_backend); KV_BACKEND_FAST after init */
    /* low rank (rank=, krank=, vrank=): ranks (0: that side full rank), the calibration span in tokens, the staging */
    int krank, vrank, calib;
    size_t stage_kb, stage_vb;   /* bytes of one full-rank staging key / value (0 for a full-rank side) */
    uint8_t *stage;          /* every lane's staging rows, min(cap, calib) per lane, or NULL once all are fitted */
    size_t stage_bytes;
    double *lr_cov;          /* (n_layers * n_kv_heads, 3, head_dim, head_dim) second moments over the calibration
                                span: pre-RoPE keys, keys rotated by their positions, values (workspace, not cache) */
    float *lr_cs;            /* (lr_cs_n, head_dim/2, 2) cos, sin by position, for rotating reconstructed keys under
                                pos=orig (workspace, grown as positions arrive) */
    int lr_cs_n;
};

/* Create a cache for a model shape from a parsed spec (the policy's own keys are checked here). Budget: spec->budget
 * tokens per lane, or the largest that fits spec->budget_bytes, or shape->seq_len for policies without a budget.
 * Returns 0, or -1 + message (budget 0, budget not above what the policy protects, unknown key, byte budget too
 * small). */
int kv_cache_init(KVCache *c, const KVShape *shape, const KVSpec *spec, char *err, size_t errlen);
/* As kv_cache_init, with ragged budgets: lane i gets caps[i] slots (each >= 1; NULL: the budget for every lane), and
 * memory for exactly those slots (a lane's unused share is never allocated). The policy's budget stays the spec's;
 * allocation rules (alloc=) that split a total budget over lanes call this. 0, or -1 + message. */
int kv_cache_init_lanes(KVCache *c, const KVShape *shape, const KVSpec *spec, const int *caps, char *err,
                        size_t errlen);
void kv_cache_free(KVCache *c);
/* As kv_cache_init, for one sequence of a serving pool (pool.h): every lane holds its slots in pages taken from the
 * pool as it fills (none at first) and given back when the cache is reset or freed, or when a lane's live slots fit
 * in fewer pages (its slots on the last page move down into free slots of the others: a policy never sees slot ids, so
 * nothing it computes changes); the metadata (positions, live lists, policy data, page tables) lives beside the pool,
 * never in it. A page holds P slots, P the largest power of two with P (key + value bytes) <= the pool's page_bytes,
 * keys first then values. Results are those of a single run's cache of the same spec, bit for bit. Refused (-1 +
 * message): several precision bands (prec=, residual=), per-channel keys, low rank, memory tiers, ragged caps, a page
 * too small for one slot. kv_append returns -1 when a lane needs a page and the pool has none (kv_pages_needed says
 * before a step how many it may take, so a scheduler reserves them). */
int kv_cache_init_pool(KVCache *c, const KVShape *shape, const KVSpec *spec, struct KVPool *pool, char *err,
                       size_t errlen);
/* Pool caches: pages the cache may take appending n more tokens to every lane: over the lanes, pages for
 * min(n_live + n, cap) slots beyond those held (an upper bound: freed slots are reused before a page is taken, and a
 * policy that evicts keeps a lane at cap). With alloc=ada, per layer the smaller of that sum and ceil(H·B/P) + H
 * pages beyond those the layer holds (its lanes never hold more together). 0 for a single run's cache (alloc=ada's
 * own pool included: it is sized for the worst case). */
int kv_pages_needed(const KVCache *c, int n);
/* Pool caches: pages held now, all lanes. */
int kv_pages_held(const KVCache *c);
/* Pool caches: the pool's id of lane's j-th page (0 <= j < its n_pages), or -1. */
int kv_lane_page_id(const KVCache *c, int lane, int j);
/* Prefix caching (pool caches of a policy that never evicts, merges, prunes or selects: full): an empty cache takes
 * n_blocks pages per lane that hold positions 0 .. n_blocks·P - 1 of another sequence with the same tokens, spec and
 * model (pages: (n_blocks, n_lanes), the caller having taken a reference to each), as if it had stored them itself:
 * lane i's slot s holds position s. 0, or -1 + message (not empty, another policy, more slots than a lane's cap). */
int kv_cache_adopt_prefix(KVCache *c, const int *pages, int n_blocks, char *err, size_t errlen);
/* Switching a sequence's cache (adapt:, -m serve): move src's tokens into dst, an empty cache made from another spec
 * of the same shape and pos= (another storage type, budget or policy; one storage band each, no merging, no
 * per-channel keys, low rank or device mirror), lane by lane: when a lane of src holds more live tokens than dst's lane
 * has slots, dst's policy ranks them with its keep_score (on src's lane: the two must be the same policy, or src's a
 * policy without metadata) and the lowest go, ties the oldest (KV_EV_EVICT events on src, counted in dst's
 * n_evictions); the kept tokens enter dst in position order, each key and value decoded from src's form to f32 (keys
 * as stored: rotated under pos=orig, pre-RoPE under pos=cache) and encoded in dst's, with its position and, between
 * caches of the same policy, its metadata (a score-based policy's scores survive the move; dst's on_insert is called
 * first). pos_next: the position the sequence stores next (keep_score's pos_now). For pool caches each lane of src
 * gives its pages back before dst's lane takes its own, so the move needs at most one lane's pages beyond what src
 * held; it first checks, in that order, that the pool's free and cached pages suffice, and returns 1 with nothing
 * changed when they do not. After 0 src holds no tokens and no pages (free it); -1 + message: specs that cannot
 * move (checked before anything changes). */
int kv_cache_transfer(KVCache *dst, KVCache *src, int pos_next, char *err, size_t errlen);
/* Move a cache struct to another address (src is left zeroed; nothing is copied but the struct): a KVCache points into
 * itself (its policy's spec), so a plain struct copy is not a cache. */
void kv_cache_move(KVCache *dst, KVCache *src);
/* Pool caches: slots per page (P); 0 for a single run's cache. */
static inline int kv_page_slots(const KVCache *c) { return c->page_slots; }
/* clone/restore: dst becomes a copy of src (same shape and spec, every lane, every policy's state, the counters);
 * kv_cache_clone creates dst, kv_cache_restore copies src into a dst made from the same spec (a clone of it). Used to
 * run several continuations from one shared context. Neither cache may have a device mirror attached; the event
 * and slot observers are not copied. 0, or -1 + message. */
int kv_cache_clone(KVCache *dst, const KVCache *src, char *err, size_t errlen);
int kv_cache_restore(KVCache *dst, const KVCache *src, char *err, size_t errlen);
/* Forget every token (between documents): all lanes empty, policy state reset, the prompt length back to prefill=.
 * Peaks (KVLane.peak_live, kv_bytes().peak_live) and n_evictions are kept: they count since kv_cache_init. */
void kv_cache_reset(KVCache *c);
/* Tell the cache that positions 0..n_tokens-1 are the prompt. Call it before feeding the prompt's first token
 * (generate, chat and bench at each prompt, passkey per question). A prompt-end policy (snapkv) compresses right
 * after the attention of position n_tokens-1, from the attention of the last obs prompt queries, which it gathers as
 * they pass, once per document: a later call (a second chat turn) does not compress again until kv_cache_reset. A
 * selection policy with prompt=dense reads every token for the queries at positions < n_tokens (Quest's dense
 * prefill) and selects for the later ones. Other policies ignore it. */
void kv_set_prompt_len(KVCache *c, int n_tokens);
/* Tell the cache that positions 0..n_tokens-1 are the context the prompt's question is asked about (-m task: the
 * tokens before the first question). Only a prompt-end policy that must not see the question reads it (snapkv
 * query=agnostic compresses right after position n_tokens-1 instead of the prompt's end). Call it with
 * kv_set_prompt_len; kv_cache_reset clears it. */
void kv_set_context_len(KVCache *c, int n_tokens);
/* 1 when the policy compresses at the prompt's end and its observation window may hold the question (snapkv with
 * query=aware, the default); 0 for every other policy and for query=agnostic. */
int kv_query_aware(const KVCache *c);
/* The tokens n such that feeding positions 0..n-1 to c, just reset (and told its prompt and context lengths), leaves
 * it exactly as moving in (kv_cache_transfer) the lanes of a `full,type=f32` cache (pos=orig) fed the same tokens
 * would: same slots, positions, key and value bits, metadata and policy state. The policy's full_prefix, capped by
 * the smallest lane; 0 unless the cache is plain (one f32 band, pos=orig, no merging, per-channel keys, low rank,
 * memory tiers, alloc=ada, pool or device mirror). Lets several policies share one prefill of a prompt's first
 * tokens (-m task), which is exact because the forward pass gives the same bits whatever the chunking. */
int kv_full_prefix(const KVCache *c);
/* Drop every token at position >= n from every lane (a request's own tokens after a shared context, so the context's
 * cache can serve the next request): no event, not counted as evictions, the policy's metadata of the kept tokens
 * untouched. Single-run caches of one storage band without merging, per-channel keys, low rank, memory tiers or a
 * device mirror only; 0, or -1 + message. */
int kv_cache_truncate(KVCache *c, int n, char *err, size_t errlen);

/* Steps 1 and 2 for every lane of layer l: merge what the policy merges, evict if full, then store the token at
 * position t (recoding older tokens into later bands as bands fill).
 * k, v: (n_kv_heads * head_dim) before RoPE. Returns 0, or -1 when a lane is full and the policy cannot evict
 * (`full` past its context). */
int kv_append(KVCache *c, int l, int t, const float *k, const float *v);
/* Steps 3 and 4 by their definition, THE reference every attention path is checked against (kv_attend_cpu,
 * kv_attend_chunk in every build, attn.cu's kernels and their CPU twin: tests/test_attn_ref.c, tests/test_attn.cu).
 * q (n_heads * head_dim, before RoPE) is the token at position t, stored by kv_append(c, l, t, ...) just before; for
 * each query head h, with lane (l, h / (n_heads / n_kv_heads)) holding n live slots k_i, v_i in rank (position) order:
 *   keys    the f32 key as stored: an f32 band as is, f16/bf16/q8/q4/q2 decoded (kv_decode); under pos=orig
 *           it was rotated by its position when stored, under pos=cache it is rotated now by its rank i (StreamingLLM,
 *           Xiao et al. 2023, §3.2), and the query by t (pos=orig) or by n-1 (pos=cache) (RoPE: Su et al. 2021);
 *   scores  s_i = (q·k_i)/√head_dim (scaled dot-product attention, Vaswani et al. 2017, eq. 1), f32;
 *   probs   p_i = e^(s_i − max_j s_j) / Σ_j e^(s_j − max_j s_j), f32, libm's expf;
 *   output  out_h = Σ_i p_i·v_i (head_dim), v_i decoded as k_i (never rotated).
 * Every sum is a plain f32 loop in increasing index order (d for the dot, i for the softmax and the output): no SIMD
 * beyond what the compiler does without reassociating, no threads, so its bits are those of its C on any build. It
 * is slow (each key decoded once per query head) and not bit-identical to the fast paths, which agree with it within
 * a bound derived from f32 rounding over head_dim and n (tests/attn_ref_check.h). As kv_attend_cpu, it leaves p_i of
 * query head h in c->scores[h * budget + i] and ends with step 4 (kv_attend_policy). A selection policy's query
 * goes through kv_attend_select instead, on every backend, but for the prompt's queries under prompt=dense, which
 * read every live slot as here. No errors: n >= 1 (the token itself is live). */
void kv_attend_ref(KVCache *c, float *out, int l, int t, const float *q);
/* Steps 3 and 4 of a selection policy, by definition and for every backend: for each lane, the group-mean scores of
 * every live key (when the policy asks for them, select_scores) and every live key as attention sees it from the
 * rank it asks (select_keys, select_keys_from), the group's rotated queries, the policy's chosen ranks S; then each
 * query head of the group attends over S alone with kv_attend_ref's arithmetic over all ranks (probabilities 0 off
 * S, in c->scores), and step 4 (the read set stays in c->read_rank for recall: kv_lane_read). Each key and value is
 * decoded once per lane (not once per query head), and a key scored for select_scores is not scored again: the
 * same dot products, so the same bits. Bytes read per lane: every live key with select_scores, else the keys of S;
 * the values of S; plus the policy's select_bytes (keys handed over by select_keys are not counted). Under
 * prompt=dense the prompt's queries do not come here (kv_attend_ref, kv_attend_cpu, kv_attend_chunk attend them
 * over every token, counted as full's). */
void kv_attend_select(KVCache *c, float *out, int l, int t, const float *q);
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
 * head_dim), before RoPE. While no slot of the layer can be freed or moved (every lane has room, no prune, merge or
 * selecting query (a selection policy's prompt under prompt=dense is read densely), one band, CPU attention, the
 * fast backend) step 3 runs for the whole chunk at once, reading each key and value once per chunk instead of once
 * per token. With c->backend KV_BACKEND_REF it is kv_append + kv_attend_ref + hook token by token.
 * Not reentrant: its large scratch is shared by every cache of the process (call it for one cache at a time).
 * Returns 0, or -1 as kv_append. */
int kv_attend_chunk(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k, const float *v,
                    KVAttnHook hook, void *hook_ctx);
/* Memory tiers (kv_tier.c). kv_prefetch: before layer l stores and attends the token at position t, move into the
 * fast tier what a query q (n_heads * head_dim, before RoPE: the forward pass's prediction of layer l's query) would
 * read now: the policy's select over the live slots (asked as if the newest stored token were the query's own,
 * pos_now = t - 1, the query rotated by t, or by the rank the new token will take under pos=cache), or every live
 * slot for a policy that reads them all. What the predictor read (the scores' keys, select_bytes) is counted in
 * tier.predict_bytes, not in bytes_read. A no-op without prefetch=1 or at an empty layer.
 * kv_set_prefetch_queries: the predictions for a chunk of layer l's tokens (q: (n, q_dim), row j for position
 * pos0 + j, valid until the next call); kv_attend_chunk calls kv_prefetch with row j before token j's step 1. NULL:
 * none. */
void kv_prefetch(KVCache *c, int l, int t, const float *q);
void kv_set_prefetch_queries(KVCache *c, int l, const float *q);
/* Test hooks: 0 when every lane's fast tier is consistent (its list, bytes and states agree) and within its share
 * and the whole within fast=, else -1 (0 with one tier); 1 when rank `rank` of lane (l, g) is in the fast tier. */
/* Figures of a fast tier between two snapshots of its counters (before NULL: since init), over `steps` tokens:
 * per token (bytes), rates, and the modelled stall: a step waits for its demand bytes over the link
 * (link_bytes_s, bytes/s), and for the part of its prefetched bytes that outlasts its compute (compute_s, seconds per
 * token as measured), prefetches being issued a layer ahead and overlapping the compute in between. */
typedef struct {
    double hit_rate;            /* hits / reads (1 when nothing was read) */
    double demand, prefetch;    /* bytes moved per token on a miss / ahead */
    double wasted, predict;     /* prefetched bytes per token that left unread; bytes the predictor read per token */
    double prefetch_hit_rate;   /* prefetched slots later read / prefetched slots (0 with none) */
    double stall_s;             /* modelled seconds per token the step waits for the link */
} KVTierFigures;
KVTierFigures kv_tier_figures(const KVTierStats *now, const KVTierStats *before, long steps, double compute_s,
                              double link_bytes_s);
/* One line of those figures for a report (no newline). */
void kv_tier_line(char *buf, size_t len, const KVCache *c, const KVTierFigures *f, double compute_s);
int kv_tier_check(const KVCache *c);
int kv_tier_resident(const KVCache *c, int l, int g, int rank);

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

/* The spectrum of layer l's calibration span (low rank): for each of the n_ranks ranks r, the share of the energy
 * (the sum of the r largest eigenvalues of the second moment over its trace, lowrank_energy) averaged over the
 * layer's kv heads, into share (3, n_ranks): row 0 the pre-RoPE keys, row 1 the keys rotated by their positions, row 2
 * the values. Returns the tokens the span holds (calib once fitted, fewer before), 0 when the cache is full rank (share
 * untouched), -1 when out of memory. */
int kv_lowrank_spectrum(const KVCache *c, int l, const int *ranks, int n_ranks, double *share);
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
/* The capacity rule, the one place it is decided: how many tokens a stream can feed this cache. The policy's own
 * answer when it has one (capacity: duo, whose full lanes stop at -c); else an evicting policy takes any number
 * (INT_MAX), and a non-evicting one (full, snapkv after its compression) stops when its lanes are full, at its slots
 * per lane (c->budget: -c for full and snapkv, or full:N's N). */
int kv_capacity(const KVCache *c);
/* 1 when the cache's policy is layer-local (batched evaluation is exact), 0 when it declares cross_layer. */
static inline int kv_layer_local(const KVCache *c) { return !c->policy.ops->cross_layer; }

/* Slots of a lane that are live now, as positions in increasing order (for tests and logs): writes up to max
 * positions, returns count. */
int kv_lane_positions(const KVCache *c, int l, int g, int *positions, int max);
/* What the last query of layer l read in lane (l, g), for recall: the ranks it attended (every live rank, or a
 * selection policy's set), as ranges of covered positions: writes up to max (first, last) pairs into spans (a merged
 * slot covers several positions, any other one its own), returns how many. */
int kv_lane_read(const KVCache *c, int l, int g, int *spans, int max);
/* The band of a slot and its stored key / value bytes (kv_slot_k, kv_slot_v), for attention paths and the mirror. */
static inline int kv_slot_band(const KVLane *ln, int slot) {
    int b = 0;
    while (slot < ln->band_first[b]) b++;
    return b;
}
static inline uint8_t *kv_band_k(const KVCache *c, const KVLane *ln, int b, int r) {   /* row r of band b */
    return ln->kpg[b][r >> ln->pg_shift] + (size_t)(r & ln->pg_mask) * c->band_kb[b];
}
static inline uint8_t *kv_band_v(const KVCache *c, const KVLane *ln, int b, int r) {
    return ln->vpg[b][r >> ln->pg_shift] + (size_t)(r & ln->pg_mask) * c->band_vb[b];
}
static inline const uint8_t *kv_slot_k(const KVCache *c, const KVLane *ln, int slot) {
    int b = kv_slot_band(ln, slot);
    return kv_band_k(c, ln, b, slot - ln->band_first[b]);
}
static inline const uint8_t *kv_slot_v(const KVCache *c, const KVLane *ln, int slot) {
    int b = kv_slot_band(ln, slot);
    return kv_band_v(c, ln, b, slot - ln->band_first[b]);
}

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
