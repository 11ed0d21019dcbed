/* test_tier.c: the memory tiers (fast=, prefetch=1; kv_tier.c) on synthetic streams (kv_append + kv_attend_cpu, no
 * model), against
 *   1. a trace computed by hand (full, one lane, a fast tier of three slots, five steps);
 *   2. a reference tier written here, by another route (a timestamp per position and a scan for the least recent
 *      one, where kv_tier.c keeps a linked recency list of slots), fed the same events: the slot evicted (window),
 *      the token recoded into the next band (prec=), the token stored, the positions the query read (kv_lane_read),
 *      and for prefetch the positions the predicted query reads (blocks: a fixed pattern of positions, computed
 *      here; full: every live one). After every step and lane: the resident positions, and the counters (reads, hits,
 *      demand bytes, prefetched bytes and slots, prefetch hits, wasted bytes);
 *   3. the bound: after every step the fast tier holds at most its share per lane and fast= in all (kv_tier_check,
 *      which also checks its list against its states), and bytes_moved = demand + prefetched;
 *   4. clone/restore carry the tier; the spec errors.
 * Dimensions: NL layers, NH query heads, NKV kv heads, HD head_dim, T tokens. */
#include "tests/test_kv_util.h"

#define NL 2
#define NH 4
#define NKV 2
#define HD 8
#define NLANE (NL * NKV)
#define MAXT 96

static float K[MAXT][NL][NKV * HD], V[MAXT][NL][NKV * HD], Q[MAXT][NL][NH * HD], QP[MAXT][NL][NH * HD];

static void gen(uint64_t seed) {
    trng_seed(seed);
    for (int t = 0; t < MAXT; t++)
        for (int l = 0; l < NL; l++) {
            for (int j = 0; j < NKV * HD; j++) { K[t][l][j] = trng_normal(); V[t][l][j] = trng_normal(); }
            for (int j = 0; j < NH * HD; j++) { Q[t][l][j] = trng_normal(); QP[t][l][j] = trng_normal(); }
        }
}

/* ---- 1. by hand: full, one lane (1 layer, 1 head, head_dim 4, f32: 32 B a slot), fast=96B = three slots ----
 * t=0..2 fill it (every read hits). t=3: storing 3 drops the least recent, 0; the read of 0..3 finds 1, 2, 3, moves 0
 * in (32 B), which drops 1 -> {2, 3, 0}. t=4: storing 4 drops 2 -> {3, 0, 4}; the read finds 0, 3, 4 (now most
 * recent in that order), moves 1 in (drops 0) and 2 (drops 3) -> {4, 1, 2}: 64 B more. */
static void test_by_hand(void) {
    KVShape s = tshape(1, 1, 1, 4, 16);
    KVCache c;
    if (tcache(&c, &s, "full,fast=96B")) return;
    static const int reads[5] = {1, 3, 6, 10, 15}, hits[5] = {1, 3, 6, 9, 12}, demand[5] = {0, 0, 0, 32, 96};
    static const int fast[5][5] = {{1, 0, 0, 0, 0}, {1, 1, 0, 0, 0}, {1, 1, 1, 0, 0}, {1, 0, 1, 1, 0},
                                   {0, 1, 1, 0, 1}};
    int ok = c.tier.lane_cap == 96;
    for (int t = 0; t < 5; t++) {
        float k[4] = {1, 0, 0, (float)t}, v[4] = {0, 1, 0, 0}, q[4] = {1, 1, 0, 0}, out[4];
        kv_append(&c, 0, t, k, v);
        kv_attend_cpu(&c, out, 0, t, q);
        ok &= c.tier.reads == (uint64_t)reads[t] && c.tier.hits == (uint64_t)hits[t] &&
              c.tier.demand_bytes == (uint64_t)demand[t] && kv_tier_check(&c) == 0;
        for (int p = 0; p <= t; p++) ok &= kv_tier_resident(&c, 0, 0, p) == fast[t][p];
    }
    CHECK(ok, "tier by hand: full,fast=96B over one lane of 32 B slots, five steps: resident sets {0} {0,1} {0,1,2} "
          "{0,2,3} {1,2,4}, reads 1 3 6 10 15, hits 1 3 6 9 12, demand bytes 0 0 0 32 96");
    kv_cache_free(&c);
}

/* ---- 2. the reference tier ---- */
typedef struct {
    int res[MAXT];          /* 0 slow, 1 fast, 2 prefetched and unread */
    long stamp[MAXT];       /* the last use; the least recent resident position leaves first */
    size_t bytes;
} RefLane;
typedef struct {
    RefLane lane[NLANE];
    long clock;
    size_t lane_cap;
    uint64_t reads, hits, demand, prefetch, pf_slots, pf_hits, wasted;
} RefTier;

typedef struct {
    const char *spec;
    int window;             /* window:W evicts position t-W at step t (0: nothing evicted) */
    int f32_newest;         /* prec=f32:R/q8: the R newest positions in f32, older ones q8 (0: f32 only) */
    int blocks_b, blocks_local, blocks_global, blocks_stride;   /* blocks: its pattern (0: every live position) */
    int prefetch;
} TierCase;

static size_t pos_bytes(const TierCase *tc, int p, int t) {
    int f32 = !tc->f32_newest || p > t - tc->f32_newest;   /* t: the newest position stored */
    return f32 ? 2 * HD * sizeof(float) : 2 * kv_vector_bytes(KV_Q8, HD);
}

static void ref_drop(RefTier *r, RefLane *ln, int p, size_t b) {
    if (ln->res[p] == 2) r->wasted += b;
    ln->res[p] = 0;
    ln->bytes -= b;
}

/* drop the least recent (the smallest stamp) until the lane fits; newest: the newest position stored */
static void ref_fit(RefTier *r, RefLane *ln, const TierCase *tc, int newest) {
    while (ln->bytes > r->lane_cap) {
        int lru = -1;
        for (int p = 0; p <= newest; p++)
            if (ln->res[p] && (lru < 0 || ln->stamp[p] < ln->stamp[lru])) lru = p;
        if (lru < 0) return;
        ref_drop(r, ln, lru, pos_bytes(tc, lru, newest));
    }
}

/* one use of positions set[0..n) (increasing): the ones resident at the start become the most recent, then the ones
 * missing at the start are moved in, in order (a position read in the first pass is not moved in again) */
static void ref_use(RefTier *r, RefLane *ln, const TierCase *tc, const int *set, int n, int newest, int prefetch) {
    int was[MAXT];
    for (int j = 0; j < n; j++) was[j] = ln->res[set[j]] != 0;   /* found there, or missing, at the start */
    for (int j = 0; j < n; j++) {
        int p = set[j];
        if (!was[j]) continue;
        if (!prefetch) { r->hits++; if (ln->res[p] == 2) { r->pf_hits++; ln->res[p] = 1; } }
        ln->stamp[p] = ++r->clock;
    }
    for (int j = 0; j < n; j++) {
        int p = set[j];
        if (was[j]) continue;
        size_t b = pos_bytes(tc, p, newest);
        if (prefetch) { r->prefetch += b; r->pf_slots++; } else r->demand += b;
        ln->res[p] = prefetch ? 2 : 1;
        ln->stamp[p] = ++r->clock;
        ln->bytes += b;
        ref_fit(r, ln, tc, newest);
    }
    if (!prefetch) r->reads += (uint64_t)n;
}

/* blocks' positions at query position t over positions 0..t (tests/test_kv_util.h, tblocks_ref) */
static int blocks_set(const TierCase *tc, int t, int *set) {
    int n_cut;
    return tblocks_ref(t, tc->blocks_b, tc->blocks_global, tc->blocks_local, tc->blocks_stride, set, &n_cut);
}

static void run_case(const TierCase *tc, int T) {
    KVShape s = tshape(NL, NH, NKV, HD, MAXT);
    KVCache c;
    if (tcache(&c, &s, tc->spec)) return;
    RefTier r;
    memset(&r, 0, sizeof r);
    r.lane_cap = c.tier.lane_cap;
    int ok_bound = 1, ok_state = 1, ok_count = 1, ok_moved = 1, bad_t = -1;
    for (int t = 0; t < T; t++) {
        for (int l = 0; l < NL; l++) {
            /* the reference's prefetch: the predicted query's set at t-1 over the stored positions */
            if (tc->prefetch && l > 0 && t > 0) {
                kv_prefetch(&c, l, t, QP[t][l]);
                for (int g = 0; g < NKV; g++) {
                    int set[MAXT], n = 0, lo = tc->window ? (t - tc->window > 0 ? t - tc->window : 0) : 0;
                    if (tc->blocks_b) n = blocks_set(tc, t - 1, set);
                    else for (int p = lo; p < t; p++) set[n++] = p;
                    ref_use(&r, &r.lane[l * NKV + g], tc, set, n, t - 1, 1);
                }
            }
            kv_append(&c, l, t, K[t][l], V[t][l]);
            float out[NH * HD];
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                RefLane *ln = &r.lane[l * NKV + g];
                /* step 1: window's victim */
                if (tc->window && t >= tc->window && ln->res[t - tc->window])
                    ref_drop(&r, ln, t - tc->window, pos_bytes(tc, t - tc->window, t - 1));
                /* the recode of the token leaving f32 (its bytes shrink where it lies) */
                if (tc->f32_newest && t >= tc->f32_newest && ln->res[t - tc->f32_newest]) {
                    int p = t - tc->f32_newest;
                    ln->bytes = ln->bytes - pos_bytes(tc, p, t - 1) + pos_bytes(tc, p, t);
                    ref_fit(&r, ln, tc, t);
                }
                /* step 2: the new token enters as the most recent */
                ln->res[t] = 1;
                ln->stamp[t] = ++r.clock;
                ln->bytes += pos_bytes(tc, t, t);
                ref_fit(&r, ln, tc, t);
                /* step 3: what the query read */
                int spans[2 * MAXT], set[MAXT], n = 0, m = kv_lane_read(&c, l, g, spans, MAXT);
                for (int j = 0; j < m; j++) for (int p = spans[2 * j]; p <= spans[2 * j + 1]; p++) set[n++] = p;
                ref_use(&r, ln, tc, set, n, t, 0);
                for (int rank = 0, lo = tc->window ? (t - tc->window + 1 > 0 ? t - tc->window + 1 : 0) : 0;
                     lo + rank <= t; rank++)
                    if (kv_tier_resident(&c, l, g, rank) != (ln->res[lo + rank] != 0)) {
                        if (ok_state) bad_t = t;
                        ok_state = 0;
                    }
                for (int p = 0; p <= t && tc->window; p++)   /* nothing evicted stays resident in the reference */
                    if (p <= t - tc->window && ln->res[p]) ok_state = 0;
            }
            ok_bound &= kv_tier_check(&c) == 0 && c.tier.fast_bytes <= c.tier.cap && c.tier.fast_peak <= c.tier.cap;
            ok_moved &= c.bytes_moved == c.tier.demand_bytes + c.tier.prefetch_bytes;
            if (c.tier.reads != r.reads || c.tier.hits != r.hits || c.tier.demand_bytes != r.demand ||
                c.tier.prefetch_bytes != r.prefetch || c.tier.prefetch_slots != r.pf_slots ||
                c.tier.prefetch_hits != r.pf_hits || c.tier.wasted_bytes != r.wasted) {
                if (ok_count)
                    printf("  at t=%d l=%d: reads %llu/%llu hits %llu/%llu demand %llu/%llu prefetch %llu/%llu "
                           "pf_hits %llu/%llu wasted %llu/%llu (kvlab/reference)\n", t, l,
                           (unsigned long long)c.tier.reads, (unsigned long long)r.reads,
                           (unsigned long long)c.tier.hits, (unsigned long long)r.hits,
                           (unsigned long long)c.tier.demand_bytes, (unsigned long long)r.demand,
                           (unsigned long long)c.tier.prefetch_bytes, (unsigned long long)r.prefetch,
                           (unsigned long long)c.tier.prefetch_hits, (unsigned long long)r.pf_hits,
                           (unsigned long long)c.tier.wasted_bytes, (unsigned long long)r.wasted);
                ok_count = 0;
            }
        }
    }
    CHECK(ok_state, "tier '%s', %d steps: the resident positions of every lane after every step equal the reference's "
          "(first difference at t=%d)", tc->spec, T, bad_t);
    CHECK(ok_count, "tier '%s': reads %llu, hits %llu, demand %llu B, prefetched %llu B (%llu slots, %llu hits), "
          "wasted %llu B, all equal to the reference's after every layer", tc->spec, (unsigned long long)c.tier.reads,
          (unsigned long long)c.tier.hits, (unsigned long long)c.tier.demand_bytes,
          (unsigned long long)c.tier.prefetch_bytes, (unsigned long long)c.tier.prefetch_slots,
          (unsigned long long)c.tier.prefetch_hits, (unsigned long long)c.tier.wasted_bytes);
    CHECK(ok_bound, "tier '%s': after every layer of every step each lane holds at most %zu B in the fast tier and the "
          "whole at most fast= (%zu B; peak %zu B), its list consistent", tc->spec, c.tier.lane_cap, c.tier.cap,
          c.tier.fast_peak);
    CHECK(ok_moved, "tier '%s': bytes_moved = demand + prefetched bytes at every step", tc->spec);
    kv_cache_free(&c);
}

static void test_reference(void) {
    gen(7);
    /* f32 slot: 2 * 8 * 4 = 64 B; fast per lane = fast / 4 lanes */
    static const TierCase cases[] = {
        {"full,fast=1536B", 0, 0, 0, 0, 0, 0, 0},                 /* 6 slots a lane: every read thrashes past t=5 */
        {"window:8,fast=1536B", 8, 0, 0, 0, 0, 0, 0},             /* evictions free resident slots */
        {"full,prec=f32:4/q8,fast=1024B", 0, 4, 0, 0, 0, 0, 0},   /* slots shrink when recoded */
        {"blocks:12,local=4,global=2,stride=3,fast=2048B", 0, 0, 12, 4, 2, 3, 0},   /* 8 slots a lane, reads 12 */
        {"blocks:12,local=4,global=2,stride=3,fast=4096B", 0, 0, 12, 4, 2, 3, 0},   /* 16: the set fits */
        {"blocks:12,local=4,global=2,stride=3,fast=2048B,prefetch=1", 0, 0, 12, 4, 2, 3, 1},
        {"blocks:12,local=4,global=2,stride=3,fast=4096B,prefetch=1", 0, 0, 12, 4, 2, 3, 1},
        {"full,fast=2560B,prefetch=1", 0, 0, 0, 0, 0, 0, 1},
        {"quest:12,page=3,fast=2048B", 0, 0, 0, 0, 0, 0, 0},     /* data-dependent read sets */
        {"cluster:12,k=3,local=3,fast=2048B", 0, 0, 0, 0, 0, 0, 0},
        {"window:8,prec=f32:3/q8,fast=1024B,prefetch=1", 8, 3, 0, 0, 0, 0, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) run_case(&cases[i], 48);
}

/* ---- 4. clone/restore and errors ---- */
static void test_clone(void) {
    gen(11);
    KVShape s = tshape(NL, NH, NKV, HD, MAXT);
    KVCache a, b;
    char err[256];
    if (tcache(&a, &s, "blocks:12,local=4,global=2,stride=3,fast=2048B,prefetch=1")) return;
    float out[NH * HD], out2[NH * HD];
    for (int t = 0; t < 20; t++)
        for (int l = 0; l < NL; l++) { kv_append(&a, l, t, K[t][l], V[t][l]); kv_attend_cpu(&a, out, l, t, Q[t][l]); }
    int rc = kv_cache_clone(&b, &a, err, sizeof err);
    CHECK(rc == 0, "tier clone: %s", rc ? err : "ok");
    if (rc) { kv_cache_free(&a); return; }
    int same = 1;
    for (int t = 20; t < 40; t++)
        for (int l = 0; l < NL; l++) {
            if (l > 0) { kv_prefetch(&a, l, t, QP[t][l]); kv_prefetch(&b, l, t, QP[t][l]); }
            kv_append(&a, l, t, K[t][l], V[t][l]);
            kv_append(&b, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&a, out, l, t, Q[t][l]);
            kv_attend_cpu(&b, out2, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++)
                for (int i = 0; i <= t; i++) same &= kv_tier_resident(&a, l, g, i) == kv_tier_resident(&b, l, g, i);
        }
    same &= !memcmp(&a.tier, &b.tier, sizeof a.tier) && kv_tier_check(&b) == 0;
    CHECK(same, "tier clone: the clone and the original go on with the same resident slots and counters");
    kv_cache_free(&a);
    kv_cache_free(&b);
}

static void expect_error(const char *spec, const char *needle) {
    KVShape s = tshape(NL, NH, NKV, HD, MAXT);
    char err[512];
    int rc = tcache_error(&s, spec, err, sizeof err);
    CHECK(rc != 0 && strstr(err, needle), "tier spec '%s' refused: %s", spec, err);
}

static void test_errors(void) {
    expect_error("full,fast=255B", "less than one slot");        /* 4 lanes x 64 B: 256 B at least */
    expect_error("full,prefetch=1", "needs a fast tier");
    expect_error("full,fast=0", "bad fast=0");
    expect_error("full,fast=0%", "bad fast=0%");
    expect_error("full,fast=101%", "bad fast=101%");
    expect_error("full,fast=12XB", "bad fast=12XB");
    expect_error("full,prefetch=2,fast=1MiB", "bad prefetch=2");
    expect_error("full,fast=1MiB,fast=2MiB", "given twice");
    KVShape s = tshape(NL, NH, NKV, HD, MAXT);
    KVCache c;
    if (tcache(&c, &s, "full,fast=25%") == 0) {
        CHECK(c.tier.cap == c.tier.vec_alloc / 4 && c.tier.vec_alloc == kv_bytes(&c).vec_alloc,
              "fast=25%%: the fast tier is a quarter of the cache's %zu vector bytes (%zu B)", c.tier.vec_alloc,
              c.tier.cap);
        kv_cache_free(&c);
    }
}

/* nothing is dropped by selection: quest's, topk's and blocks' caches hold full's vectors (their metadata aside) */
static void test_selection_memory(void) {
    KVShape s = tshape(NL, NH, NKV, HD, MAXT);
    static const char *specs[] = {"quest:16,page=4", "topk:16", "blocks:16,local=8,global=4"};
    KVCache f, c;
    if (tcache(&f, &s, "full")) return;
    for (int i = 0; i < 3; i++) {
        if (tcache(&c, &s, specs[i])) continue;
        CHECK(kv_bytes(&c).vec_alloc == kv_bytes(&f).vec_alloc && c.tier.cap == 0,
              "'%s' allocates full's %zu vector bytes at -c %d (selection drops nothing) and has one tier", specs[i],
              kv_bytes(&f).vec_alloc, MAXT);
        kv_cache_free(&c);
    }
    kv_cache_free(&f);
}

int main(void) {
    test_by_hand();
    test_selection_memory();
    test_reference();
    test_clone();
    test_errors();
    CHECK_EXIT();
}
