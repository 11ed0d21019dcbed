/* Budgets split over lanes (alloc=, kv.h): alloc=pyramid gives PyramidKV's schedule (Cai et al. 2024, §3.2), checked
 * here against the formula written out independently: k_top = B/20, k_0 = 2B - k_top, linear in between, rounded down,
 * the remainder one slot per layer from layer 0; the total is B · n_layers · n_kv_heads (the budget stays the mean),
 * the lanes' memory follows (allocated vector bytes = the uniform cache's), and the lanes really evict at their own
 * caps. alloc=uniform is the default bit for bit (every lane at B, the same evictions over a random stream).
 * alloc=ada (Ada-KV, Feng et al. 2024, arXiv:2407.11550; kv.h, "Budgets over a layer's kv heads"): keep_score names the policy's
 * own victim (window, sink, h2o, tova); the layer-wide rule checked step by step against a selection the test makes
 * itself from the scores it reads before each append (safeguard on and off); the pages follow the live slots and go
 * back when a lane shrinks; live vector bytes equal uniform's at steady state; reset replays the same; a serving
 * pool's ada cache keeps the same positions and kv_pages_needed bounds what it takes; -chunk gives the same bits as
 * token by token; one kv head is uniform. Unknown values, and specs alloc=ada or alloc=pyramid cannot take: errors
 * naming alloc=. */
#include "test_kv_util.h"
#include "../pool.h"

#define MAXS 1024   /* slots a test lane may hold */

/* (a) keep_score: whenever a lane is full, its lowest keep score (ties: the oldest, the first rank) is the rank its
 * own evict names, and that rank is not protected (+INFINITY). Over a random stream; returns the full-lane steps. */
static int keep_score_names_the_victim(const char *spec) {
    KVShape s = tshape(2, 4, 2, 16, 256);
    KVCache c;
    if (tcache(&c, &s, spec)) return 0;
    const KVPolicyOps *ops = c.policy.ops;
    float k[2 * 16], v[2 * 16], q[4 * 16], out[4 * 16];
    double sc[MAXS], es[MAXS];
    int ranks[MAXS], agree = 1, checked = 0;
    trng_seed(11);
    for (int t = 0; t < 200; t++)
        for (int l = 0; l < 2; l++) {
            for (int i = 0; i < 2 * 16; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
            for (int i = 0; i < 4 * 16; i++) q[i] = trng_normal();
            for (int g = 0; g < 2; g++) {
                const KVLane *ln = &c.lanes[l * 2 + g];
                if (ln->n_live < ln->cap) continue;
                ops->keep_score(&c.policy, l * 2 + g, ln, t, sc);
                int lo = 0;
                for (int i = 1; i < ln->n_live; i++) if (sc[i] < sc[lo]) lo = i;
                int n = ops->evict(&c.policy, l * 2 + g, ln, t, ranks, ln->cap, es);
                agree &= n == 1 && ranks[0] == lo && sc[lo] != INFINITY;
                checked++;
            }
            if (kv_append(&c, l, t, k, v)) { CHECK(0, "%s: append failed at %d", spec, t); kv_cache_free(&c); return 0; }
            kv_attend_ref(&c, out, l, t, q);
        }
    CHECK(agree && checked > 300, "%s: at each of %d full-lane steps the lowest keep score (ties: oldest) is the rank "
          "evict names, never a protected one", spec, checked);
    kv_cache_free(&c);
    return checked;
}

/* A slot of a layer the test ranks: keep score, position, kv head. */
typedef struct { double s; int pos, g; } Cand;
static int cand_cmp(const void *a, const void *b) {   /* increasing score, then position, then kv head */
    const Cand *x = a, *y = b;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return (x->g > y->g) - (x->g < y->g);
}

/* What the rule says layer l of c frees before the token at t (kv.h): the test's own selection from the keep scores
 * it reads now. Each lane's ⌊safe·B⌋ best ranks (and its protected ones) are kept; of the other ranks of every lane,
 * the Σ n_live + H - H·B lowest by (score, position, kv head) go. Writes each freed position as 1 in gone[g][pos]
 * (cleared first); returns how many. */
static int expected_victims(const KVCache *c, int l, int t, int safe, unsigned char (*gone)[MAXS]) {
    int H = c->shape.n_kv_heads, B = c->policy.budget, total = 0, n = 0;
    static Cand all[8 * MAXS], lane[MAXS];
    for (int g = 0; g < H; g++) total += c->lanes[l * H + g].n_live;
    memset(gone, 0, (size_t)H * MAXS);
    int need = total + H - H * B;
    if (need <= 0) return 0;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        double sc[MAXS];
        c->policy.ops->keep_score(&c->policy, l * H + g, ln, t, sc);
        int n_inf = 0;
        for (int i = 0; i < ln->n_live; i++) {
            lane[i] = (Cand){sc[i], kv_rank_pos(ln, i), g};
            n_inf += sc[i] == INFINITY;
        }
        qsort(lane, (size_t)ln->n_live, sizeof(Cand), cand_cmp);
        int keep = n_inf > safe ? n_inf : safe;
        for (int i = 0; i < ln->n_live - keep; i++) all[n++] = lane[i];
    }
    qsort(all, (size_t)n, sizeof(Cand), cand_cmp);
    if (need > n) need = n;
    for (int j = 0; j < need; j++) gone[all[j].g][all[j].pos] = 1;
    return need;
}

/* (b), (c): alloc=ada over a random stream, step by step: every layer's positions after each append are the ones
 * before, less the victims the test chose itself, plus t; the layer holds at most H·B; each lane keeps its protected
 * recent tokens (h2o's recent=R; 1, the token itself, for tova); each lane holds ceil(n_live / P) pages, and pages go
 * back when a lane shrinks; at steady state the live vector bytes are the uniform cache's; a reset replays the same
 * positions. Returns 0, or -1 on setup failure. */
static int ada_against_the_rule(const char *ada_spec, const char *uni_spec, double safeguard, int recent) {
    KVShape s = tshape(3, 8, 4, 16, 512);
    int L = s.n_layers, H = s.n_kv_heads, T = 260;
    KVCache c, u;
    if (tcache(&c, &s, ada_spec)) return -1;
    if (tcache(&u, &s, uni_spec)) { kv_cache_free(&c); return -1; }
    int B = c.policy.budget, P = c.page_slots, safe = (int)floor(safeguard * B);
    static unsigned char gone[8][MAXS];
    static int before[8][MAXS], after[MAXS], first_pass[3 * 4][MAXS], first_n[3 * 4];
    int n_before[8];
    float k[4 * 16], v[4 * 16], q[8 * 16], out[8 * 16];
    int rule_ok = 1, within = 1, recent_ok = 1, pages_ok = 1, steady_ok = 1, shrinks = 0, given_back = 0, freed = 0;
    int uneven = 0;
    for (int pass = 0; pass < 2; pass++) {
        trng_seed(5);
        for (int t = 0; t < T; t++)
            for (int l = 0; l < L; l++) {
                for (int i = 0; i < 4 * 16; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
                for (int i = 0; i < 8 * 16; i++) q[i] = 3 * trng_normal();   /* peaked attention: scores differ */
                int pages0[8];
                for (int g = 0; g < H; g++) {
                    n_before[g] = kv_lane_positions(&c, l, g, before[g], MAXS);
                    pages0[g] = c.lanes[l * H + g].n_pages;
                }
                freed += expected_victims(&c, l, t, safe, gone);
                if (kv_append(&c, l, t, k, v) || kv_append(&u, l, t, k, v)) {
                    CHECK(0, "%s: append failed at %d", ada_spec, t);
                    kv_cache_free(&c); kv_cache_free(&u);
                    return -1;
                }
                kv_attend_ref(&c, out, l, t, q);
                kv_attend_ref(&u, out, l, t, q);
                int total = 0;
                for (int g = 0; g < H; g++) {
                    const KVLane *ln = &c.lanes[l * H + g];
                    int n = kv_lane_positions(&c, l, g, after, MAXS), w = 0, same = 1;
                    for (int i = 0; i < n_before[g]; i++)
                        if (!gone[g][before[g][i]]) same &= w < n && after[w++] == before[g][i];
                    rule_ok &= same && w == n - 1 && after[n - 1] == t;
                    for (int p = t - recent + 1; p <= t; p++) {
                        if (p < 0) continue;
                        int found = 0;
                        for (int i = 0; i < n; i++) found |= after[i] == p;
                        recent_ok &= found;
                    }
                    pages_ok &= ln->n_pages == kv_pool_pages_for(n, P);
                    shrinks += n < n_before[g];
                    given_back += ln->n_pages < pages0[g];
                    total += n;
                }
                within &= total <= H * B;
            }
        for (int i = 0; i < L * H; i++) uneven |= c.lanes[i].n_live != B;
        for (int i = 0; i < L * H && pass == 0; i++)
            first_n[i] = kv_lane_positions(&c, i / H, i % H, first_pass[i], MAXS);
        KVBytes a = kv_bytes(&c), b = kv_bytes(&u);
        steady_ok &= a.vec_live == b.vec_live && a.total_live == b.total_live;
        if (pass == 1) break;
        kv_cache_reset(&c);
        kv_cache_reset(&u);
        CHECK(kv_pages_held(&c) == 0 && kv_pool_n_free(c.pool) == c.pool->n_pages && kv_bytes(&c).vec_live == 0,
              "%s: kv_cache_reset gives every page back to the cache's own pool (%d free of %d)", ada_spec,
              kv_pool_n_free(c.pool), c.pool->n_pages);
    }
    int replay = 1, pl[MAXS];
    for (int i = 0; i < L * H; i++) {
        int n = kv_lane_positions(&c, i / H, i % H, pl, MAXS);
        replay &= n == first_n[i] && !memcmp(pl, first_pass[i], (size_t)n * sizeof(int));
    }
    CHECK(rule_ok && freed > 500, "%s: after every append, each lane holds its positions before, less exactly the "
          "victims the test chose from the keep scores it read (%d over the stream; safeguard %d slots), plus t",
          ada_spec, freed, safe);
    CHECK(within && recent_ok && uneven, "%s: every layer holds at most H x B = %d live slots, every lane its newest "
          "%d, and the lanes differ in size", ada_spec, H * B, recent);
    CHECK(pages_ok && shrinks > 0 && given_back > 0, "%s: every lane holds ceil(n_live / %d) pages after each step; "
          "lanes shrank %d times and gave pages back %d times", ada_spec, P, shrinks, given_back);
    KVBytes a = kv_bytes(&c), b = kv_bytes(&u);
    size_t pair = 2 * 16 * sizeof(float), want = (size_t)L * (kv_pool_pages_for(H * B, P) + H) * P * pair;
    CHECK(steady_ok && a.vec_alloc == want && a.vec_alloc > b.vec_alloc, "%s: at steady state live bytes = %s's "
          "(%zu = %zu B of vectors); allocated vectors = the cache's own pool, %d layers x (ceil(%d/%d) + %d) pages "
          "of %d slots = %zu B (uniform: %zu)", ada_spec, uni_spec, a.vec_live, b.vec_live, L, H * B, P, H, P,
          a.vec_alloc, b.vec_alloc);
    CHECK(replay, "%s: after kv_cache_reset the same stream gives the same positions in every lane", ada_spec);
    kv_cache_free(&c);
    kv_cache_free(&u);
    return 0;
}

/* alloc=ada with a serving pool (kv_cache_init_pool): the same positions as the cache with its own pool, and
 * kv_pages_needed(c, n) bounds the pages the next n tokens take, by at most ceil(H·B/P) + H a layer, below the per-lane
 * bound (every lane's pages for min(n_live + n, cap)) at steady state. */
static void ada_in_a_serving_pool(void) {
    KVShape s = tshape(2, 8, 4, 16, 512);
    int L = s.n_layers, H = s.n_kv_heads, T = 200, N = 4;
    KVPool pool;
    KVSpec sp;
    KVCache pc, c;
    char err[512];
    if (kv_pool_init(&pool, 1 << 22, 512, err, sizeof err) ||
        kv_spec_parse(&sp, "h2o:24,recent=4,alloc=ada", KV_F32, err, sizeof err) ||
        kv_cache_init_pool(&pc, &s, &sp, &pool, err, sizeof err)) { CHECK(0, "pool cache: %s", err); return; }
    if (tcache(&c, &s, "h2o:24,recent=4,alloc=ada")) { kv_cache_free(&pc); kv_pool_free(&pool); return; }
    int P = pc.page_slots, B = 24, bound_ok = 1, tighter = 0, layer_ok = 1;
    static float k[200][2][4 * 16], v[200][2][4 * 16], q[200][2][8 * 16];
    float out[8 * 16];
    trng_seed(9);
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < 4 * 16; i++) { k[t][l][i] = trng_normal(); v[t][l][i] = trng_normal(); }
            for (int i = 0; i < 8 * 16; i++) q[t][l][i] = 3 * trng_normal();
        }
    for (int t = 0; t < T; t++) {
        int need = kv_pages_needed(&pc, N), held0 = kv_pages_held(&pc), most = held0, per_lane = 0, layer_room = 0;
        for (int i = 0; i < L * H; i++) {
            const KVLane *ln = &pc.lanes[i];
            int want = kv_pool_pages_for(ln->n_live + N < ln->cap ? ln->n_live + N : ln->cap, P) - ln->n_pages;
            per_lane += want > 0 ? want : 0;
        }
        for (int l = 0; l < L; l++) {
            int held = 0;
            for (int g = 0; g < H; g++) held += pc.lanes[l * H + g].n_pages;
            layer_ok &= held <= kv_pool_pages_for(H * B, P) + H;
            int room = kv_pool_pages_for(H * B, P) + H - held;
            layer_room += room > 0 ? room : 0;
        }
        for (int u = t; u < t + N && u < T; u++)
            for (int l = 0; l < L; l++) {
                if (kv_append(&pc, l, u, k[u][l], v[u][l])) { CHECK(0, "pool append failed at %d", u); goto done; }
                kv_attend_ref(&pc, out, l, u, q[u][l]);
                if (kv_pages_held(&pc) > most) most = kv_pages_held(&pc);
            }
        bound_ok &= most - held0 <= need && need <= per_lane && need <= layer_room;
        tighter += need < per_lane;
        /* rewind: replay the pool cache from scratch to t + 1 so each window starts from the stream's state */
        kv_cache_reset(&pc);
        for (int u = 0; u <= t; u++)
            for (int l = 0; l < L; l++) {
                kv_append(&pc, l, u, k[u][l], v[u][l]);
                kv_attend_ref(&pc, out, l, u, q[u][l]);
            }
        for (int l = 0; l < L; l++) {
            kv_append(&c, l, t, k[t][l], v[t][l]);
            kv_attend_ref(&c, out, l, t, q[t][l]);
        }
    }
    int same = 1, a[MAXS], b[MAXS];
    for (int i = 0; i < L * H; i++) {
        int na = kv_lane_positions(&pc, i / H, i % H, a, MAXS), nb = kv_lane_positions(&c, i / H, i % H, b, MAXS);
        same &= na == nb && !memcmp(a, b, (size_t)na * sizeof(int));
    }
    CHECK(same, "h2o:24,alloc=ada in a serving pool (P = %d) keeps the positions of the cache with its own pool", P);
    CHECK(bound_ok && layer_ok && tighter > 100, "kv_pages_needed(c, %d) bounds the pages the next %d tokens take at "
          "every step, within ceil(H x B / P) + H a layer, and is below the per-lane bound at %d of %d steps", N, N,
          tighter, T);
done:
    kv_cache_free(&pc);
    kv_cache_free(&c);
    CHECK(kv_pool_n_held(&pool) == 0, "the freed ada cache gave every page back to the serving pool");
    kv_pool_free(&pool);
}

/* (d) -chunk: one ada cache fed through kv_attend_chunk one token at a time, another in chunks of 37 tokens per
 * layer (the batched path while the layers have room, token by token once they evict): the same outputs bit for bit
 * and the same positions. */
static void ada_chunked(const char *spec) {
    KVShape s = tshape(2, 8, 4, 16, 512);
    enum { T = 300, CH = 37 };
    int L = s.n_layers, H = s.n_kv_heads, qd = 8 * 16, kd = 4 * 16;
    KVCache a, b;
    if (tcache(&a, &s, spec)) return;
    if (tcache(&b, &s, spec)) { kv_cache_free(&a); return; }
    static float q[2][T][8 * 16], k[2][T][4 * 16], v[2][T][4 * 16], oa[2][T][8 * 16], ob[2][T][8 * 16];
    trng_seed(21);
    for (int l = 0; l < L; l++)
        for (int t = 0; t < T; t++) {
            for (int i = 0; i < kd; i++) { k[l][t][i] = trng_normal(); v[l][t][i] = trng_normal(); }
            for (int i = 0; i < qd; i++) q[l][t][i] = 3 * trng_normal();
        }
    int ok = 1;
    for (int t = 0; t < T && ok; t++)
        for (int l = 0; l < L; l++) ok &= !kv_attend_chunk(&a, oa[l][t], l, t, 1, q[l][t], k[l][t], v[l][t], NULL, NULL);
    for (int t = 0; t < T && ok; t += CH) {
        int n = T - t < CH ? T - t : CH;
        for (int l = 0; l < L; l++) ok &= !kv_attend_chunk(&b, ob[l][t], l, t, n, q[l][t], k[l][t], v[l][t], NULL, NULL);
    }
    int same = ok && !memcmp(oa, ob, sizeof oa), pa[MAXS], pb[MAXS];
    for (int i = 0; i < L * H; i++) {
        int na = kv_lane_positions(&a, i / H, i % H, pa, MAXS), nb = kv_lane_positions(&b, i / H, i % H, pb, MAXS);
        same &= na == nb && !memcmp(pa, pb, (size_t)na * sizeof(int));
    }
    CHECK(same && a.n_evictions > 1000, "%s: kv_attend_chunk in chunks of %d gives the outputs of one token at a time "
          "bit for bit, and the same positions (%d evictions)", spec, CH, a.n_evictions);
    kv_cache_free(&a);
    kv_cache_free(&b);
}

/* With one kv head a layer is one lane: alloc=ada frees what the policy's evict frees, position for position. */
static void ada_one_head_is_uniform(void) {
    KVShape s = tshape(2, 4, 1, 16, 512);
    KVCache a, u;
    if (tcache(&a, &s, "tova:20,alloc=ada")) return;
    if (tcache(&u, &s, "tova:20")) { kv_cache_free(&a); return; }
    float k[16], v[16], q[4 * 16], out[4 * 16];
    trng_seed(2);
    for (int t = 0; t < 150; t++)
        for (int l = 0; l < 2; l++) {
            for (int i = 0; i < 16; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
            for (int i = 0; i < 4 * 16; i++) q[i] = trng_normal();
            kv_append(&a, l, t, k, v); kv_attend_ref(&a, out, l, t, q);
            kv_append(&u, l, t, k, v); kv_attend_ref(&u, out, l, t, q);
        }
    int same = 1, pa[MAXS], pb[MAXS];
    for (int l = 0; l < 2; l++) {
        int na = kv_lane_positions(&a, l, 0, pa, MAXS), nb = kv_lane_positions(&u, l, 0, pb, MAXS);
        same &= na == nb && !memcmp(pa, pb, (size_t)na * sizeof(int));
    }
    CHECK(same, "with one kv head, tova:20,alloc=ada keeps tova:20's positions");
    kv_cache_free(&a);
    kv_cache_free(&u);
}

int main(void) {
    KVShape s = tshape(12, 8, 2, 16, 512);
    int B = 100, L = s.n_layers, G = s.n_kv_heads;
    KVCache pyr, uni, def;
    if (tcache(&pyr, &s, "h2o:100,alloc=pyramid") || tcache(&uni, &s, "h2o:100,alloc=uniform") ||
        tcache(&def, &s, "h2o:100")) CHECK_EXIT();
    /* the formula */
    int want[12];
    long total = 0;
    for (int l = 0; l < L; l++) {
        double top = B / 20.0, k0 = 2.0 * B - top;
        want[l] = (int)(k0 - (k0 - top) * l / (L - 1));
        total += want[l];
    }
    for (int l = 0; total < (long)B * L; l++, total++) want[l]++;
    int ok = 1, decreasing = 1;
    long sum = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < G; g++) {
            ok &= pyr.lanes[l * G + g].cap == want[l];
            sum += pyr.lanes[l * G + g].cap;
            if (l) decreasing &= pyr.lanes[l * G + g].cap <= pyr.lanes[(l - 1) * G + g].cap;
        }
    CHECK(ok && decreasing && sum == (long)B * L * G && want[0] == 196 && want[L - 1] == 5,
          "h2o:100,alloc=pyramid over 12 layers: lane caps %d .. %d (PyramidKV's line from 2B - B/20 to B/20), "
          "non-increasing with depth, %ld slots in all = 100 x 12 x 2", pyr.lanes[0].cap, pyr.lanes[(L - 1) * G].cap, sum);
    KVBytes bp = kv_bytes(&pyr), bu = kv_bytes(&uni);
    CHECK(bp.vec_alloc == bu.vec_alloc && pyr.policy.budget == B,
          "the pyramid allocates the uniform cache's vector bytes (%zu = %zu B) and the policy's budget stays %d",
          bp.vec_alloc, bu.vec_alloc, pyr.policy.budget);
    /* a random stream: every lane ends at its own cap; uniform = the default, position for position */
    float k[2 * 16], v[2 * 16], q[8 * 16], out[8 * 16];
    trng_seed(3);
    int same = 1;
    KVCache *cs[3] = {&pyr, &uni, &def};
    for (int t = 0; t < 400; t++) {
        for (int l = 0; l < L; l++) {
            for (int i = 0; i < 2 * 16; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
            for (int i = 0; i < 8 * 16; i++) q[i] = trng_normal();
            for (int x = 0; x < 3; x++) {
                if (kv_append(cs[x], l, t, k, v)) { CHECK(0, "append failed at %d", t); CHECK_EXIT(); }
                kv_attend_ref(cs[x], out, l, t, q);
            }
        }
    }
    int at_cap = 1, pa[200], pb[200];
    for (int i = 0; i < L * G; i++) {
        at_cap &= pyr.lanes[i].n_live == pyr.lanes[i].cap;
        int na = kv_lane_positions(&uni, i / G, i % G, pa, 200), nb = kv_lane_positions(&def, i / G, i % G, pb, 200);
        same &= na == nb && !memcmp(pa, pb, (size_t)na * sizeof(int));
    }
    CHECK(at_cap, "after 400 tokens every pyramid lane holds exactly its cap (layer 0: %d, layer 11: %d live)",
          pyr.lanes[0].n_live, pyr.lanes[(L - 1) * G].n_live);
    CHECK(same, "alloc=uniform keeps the same positions as no alloc= in every lane");
    for (int x = 0; x < 3; x++) kv_cache_free(cs[x]);

    /* alloc=ada */
    const char *scored[] = {"window:16", "sink:16,sinks=4", "h2o:16,recent=8", "h2o:16,recent=1", "tova:16", "lru:16"};
    for (int i = 0; i < 6; i++) keep_score_names_the_victim(scored[i]);
    ada_against_the_rule("h2o:128,recent=8,alloc=ada", "h2o:128,recent=8", 0.2, 8);   /* pages of 4 slots */
    ada_against_the_rule("h2o:64,recent=4,alloc=ada,safeguard=0", "h2o:64,recent=4", 0, 4);   /* 2 slots */
    ada_against_the_rule("tova:64,alloc=ada,safeguard=0.5", "tova:64", 0.5, 1);
    ada_in_a_serving_pool();
    ada_chunked("h2o:24,recent=4,alloc=ada");
    ada_chunked("tova:24,alloc=ada");
    ada_one_head_is_uniform();
    KVCache ac, clone;
    char err[512];
    if (!tcache(&ac, &s, "h2o:100,alloc=ada")) {
        int rc = kv_cache_clone(&clone, &ac, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "alloc=ada"), "an alloc=ada cache is not cloned: %s", err);
        CHECK(ac.page_slots == 2 && ac.lanes[0].cap == 200, "h2o:100,alloc=ada: pages of %d slots (the largest power "
              "of two <= 100/32), lanes of %d slots (H x B)", ac.page_slots, ac.lanes[0].cap);
        size_t at = kv_alloc_bytes_for(&s, &ac.spec, ac.policy.ops, ac.policy.budget);
        CHECK(at == kv_bytes(&ac).total_alloc, "h2o:100,alloc=ada: kv_alloc_bytes_for (%zu B) = kv_bytes' allocated "
              "(%zu B)", at, kv_bytes(&ac).total_alloc);
        char line[512];
        kv_describe(&ac, line, sizeof line);
        CHECK(strstr(line, "alloc=ada: a layer's 2 lanes share 200 slots, safeguard 0.2 (20 slots), pages of 2") != NULL,
              "kv_describe says alloc=ada's share, safeguard and pages: %s", line);
        kv_cache_free(&ac);
    }

    const char *bad[][2] = {{"h2o:100,alloc=wide", "unknown alloc=wide"},
                            {"full,alloc=pyramid", "eviction policy"}, {"snapkv:64,alloc=pyramid", "eviction policy"},
                            {"full,alloc=ada", "alloc=ada"}, {"snapkv:64,alloc=ada", "alloc=ada"},
                            {"topk:64,alloc=ada", "alloc=ada"}, {"quest:64,page=4,alloc=ada", "alloc=ada"},
                            {"scissorhands:64,alloc=ada", "no keep score"}, {"pool:64,alloc=ada", "alloc=ada"},
                            {"h2o:1MiB,alloc=ada", "in tokens"}, {"h2o:64,alloc=ada,merge=1", "merge=1"},
                            {"h2o:64,alloc=ada,residual=8,type=q8", "alloc=ada"}, {"h2o:64,alloc=ada,prec=f32:16/q8", "alloc=ada"},
                            {"h2o:64,alloc=ada,type=q8,kgroup=channel", "alloc=ada"},
                            {"h2o:64,alloc=ada,rank=8", "alloc=ada"}, {"h2o:64,alloc=ada,fast=50%", "alloc=ada"},
                            {"tova:64,alloc=ada,per=layer", "alloc=ada"}, {"h2o:64,safeguard=0.2", "alloc=ada"},
                            {"h2o:64,alloc=ada,safeguard=1", "safeguard=1"},
                            {"sink:40,sinks=4,alloc=pyramid", "too few for sink"}};
    int n_bad = (int)(sizeof bad / sizeof bad[0]);
    for (int i = 0; i < n_bad; i++) {
        int rc = tcache_error(&s, bad[i][0], err, sizeof err);
        CHECK(rc != 0 && strstr(err, bad[i][1]), "'%s' is refused: %s", bad[i][0], err);
    }
    KVPool pool;
    KVSpec sp;
    KVCache pc;
    if (!kv_pool_init(&pool, 1 << 20, 2048, err, sizeof err) && !kv_spec_parse(&sp, "h2o:100,alloc=pyramid", KV_F32, err, sizeof err)) {
        int rc = kv_cache_init_pool(&pc, &s, &sp, &pool, err, sizeof err);
        CHECK(rc == -1 && strstr(err, "alloc=pyramid"), "alloc=pyramid in a serving pool is refused: %s", err);
        kv_pool_free(&pool);
    }
    CHECK_EXIT();
}
