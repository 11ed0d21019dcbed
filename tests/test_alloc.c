/* Budgets split over lanes (alloc=, kv.h): alloc=pyramid gives PyramidKV's schedule (Cai et al. 2024, §3.2), checked
 * here against the formula written out independently: k_top = B/20, k_0 = 2B - k_top, linear in between, rounded down,
 * the remainder one slot per layer from layer 0; the total is B · n_layers · n_kv_heads (the budget stays the mean),
 * the lanes' memory follows (allocated vector bytes = the uniform cache's), and the lanes really evict at their own
 * caps. alloc=uniform is the default bit for bit (every lane at B, the same evictions over a random stream). ada and
 * unknown values, alloc=pyramid on a policy that does not evict and with a pool: errors naming alloc=. */
#include "test_kv_util.h"
#include "../pool.h"

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

    char err[512];
    const char *bad[][2] = {{"h2o:100,alloc=ada", "not built yet"}, {"h2o:100,alloc=wide", "unknown alloc=wide"},
                            {"full,alloc=pyramid", "eviction policy"}, {"snapkv:64,alloc=pyramid", "eviction policy"}};
    for (int i = 0; i < 4; i++) {
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
