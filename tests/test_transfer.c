/* Moving a sequence's tokens between caches (kv_cache_transfer, kv.h; adapt: in -m serve switches with it):
 *   - a move into a cache of the same spec loses nothing: continued on the same stream, the moved cache's attention
 *     outputs equal those of the cache that never moved, bit for bit (its h2o scores came along);
 *   - a move that shrinks (h2o:512 -> h2o:64,type=q8) keeps exactly the tokens an independent ranking in this file
 *     picks from the scores read out of the source lane (the 32 newest protected, then the highest accumulated
 *     attention, ties to the newer), in position order, each key and value the q8 encoding of the source's f32;
 *   - in a pool: pages come back and go out lane by lane, the pool's invariants hold, the pages held are those the
 *     kept tokens need; a pool too small for the move answers 1 and changes nothing;
 *   - refusals: another policy's metadata, a shrink its policy cannot rank, pos= apart, a cache that is not empty. */
#include "test_kv_util.h"
#include "../pool.h"

/* one random token for every layer: append then attend (the policy observes) */
static int feed(KVCache *c, int L, int t, float *out_sum, uint64_t seed) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, G = s->n_kv_heads, H = s->n_heads;
    float k[G * hd], v[G * hd], q[H * hd], out[H * hd];
    trng_seed(seed * 1000003u + (uint64_t)t);
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < G * hd; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
        for (int i = 0; i < H * hd; i++) q[i] = 2 * trng_normal();
        if (kv_append(c, l, t, k, v)) return -1;
        kv_attend_ref(c, out, l, t, q);
        if (out_sum) memcpy(out_sum + (size_t)l * H * hd, out, sizeof out);
    }
    return 0;
}

typedef struct { double score; int pos, rank; } Cand;
static int cand_cmp(const void *a, const void *b) {   /* highest score first, then the newest */
    const Cand *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return y->pos - x->pos;
}
static int int_cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

int main(void) {
    KVShape s = tshape(2, 4, 2, 16, 1024);
    int L = s.n_layers, G = s.n_kv_heads, hd = s.head_dim, H = s.n_heads, n_lanes = L * G;
    char err[512];
    KVSpec sp;

    /* 1. same spec: lossless */
    KVCache a, b, c;
    if (tcache(&a, &s, "h2o:512") || tcache(&b, &s, "h2o:512") || tcache(&c, &s, "h2o:512")) CHECK_EXIT();
    for (int t = 0; t < 300; t++)
        if (feed(&a, L, t, NULL, 1) || feed(&b, L, t, NULL, 1)) { CHECK(0, "feed %d", t); CHECK_EXIT(); }
    int rc = kv_cache_transfer(&c, &b, 300, err, sizeof err);
    CHECK(rc == 0, "h2o:512 -> h2o:512 after 300 tokens moves: %s", rc ? err : "ok");
    int empty = 1;
    for (int i = 0; i < n_lanes; i++) empty &= b.lanes[i].n_live == 0;
    CHECK(empty && c.lanes[0].n_live == 300, "the source is empty after the move, the destination holds 300 a lane");
    kv_cache_free(&b);
    KVCache moved;
    kv_cache_move(&moved, &c);   /* and the struct moved to another address still works */
    float oa[L * H * hd], oc[L * H * hd];
    int same = 1;
    for (int t = 300; t < 700; t++) {
        if (feed(&a, L, t, oa, 1) || feed(&moved, L, t, oc, 1)) { CHECK(0, "feed %d", t); CHECK_EXIT(); }
        same &= !memcmp(oa, oc, sizeof oa);
    }
    int pa[512], pc[512], same_pos = 1;
    for (int i = 0; i < n_lanes; i++) {
        int na = kv_lane_positions(&a, i / G, i % G, pa, 512), nc = kv_lane_positions(&moved, i / G, i % G, pc, 512);
        same_pos &= na == nc && !memcmp(pa, pc, (size_t)na * sizeof(int));
    }
    CHECK(same && same_pos, "400 tokens on, through 188 evictions a lane: outputs and kept positions of the moved "
          "cache equal the unmoved one's bit for bit (the scores moved with the tokens)");
    kv_cache_free(&moved);
    kv_cache_free(&a);

    /* 2. a shrinking move into q8, against the ranking written out here */
    KVCache src, dst;
    if (tcache(&src, &s, "h2o:512") || tcache(&dst, &s, "h2o:64,type=q8")) CHECK_EXIT();
    for (int t = 0; t < 400; t++) feed(&src, L, t, NULL, 2);
    int want[n_lanes][64], nwant[n_lanes];
    float wk[n_lanes][64][16], wv[n_lanes][64][16];
    for (int i = 0; i < n_lanes; i++) {
        const KVLane *ln = &src.lanes[i];
        Cand cd[512];
        int n = 0, k = 0;
        for (int r = 0; r < ln->n_live; r++) {
            int p = kv_rank_pos(ln, r);
            float sc;
            memcpy(&sc, kv_rank_meta(ln, r, 4), 4);
            cd[n++] = (Cand){p > 400 - 32 ? INFINITY : sc, p, r};   /* h2o:64's recent=32 protects 369..399 */
        }
        qsort(cd, (size_t)n, sizeof *cd, cand_cmp);
        for (k = 0; k < 64; k++) want[i][k] = cd[k].pos;
        nwant[i] = k;
        qsort(want[i], 64, sizeof(int), int_cmp);
        for (int j = 0; j < 64; j++)   /* the q8 encoding of the source's f32 vectors, by position */
            for (int r = 0; r < ln->n_live; r++)
                if (kv_rank_pos(ln, r) == want[i][j]) {
                    uint8_t buf[64];
                    kv_decode(wk[i][j], KV_F32, kv_slot_k(&src, ln, ln->live[r]), hd);
                    kv_encode(buf, KV_Q8, wk[i][j], hd);
                    kv_decode(wk[i][j], KV_Q8, buf, hd);
                    kv_decode(wv[i][j], KV_F32, kv_slot_v(&src, ln, ln->live[r]), hd);
                    kv_encode(buf, KV_Q8, wv[i][j], hd);
                    kv_decode(wv[i][j], KV_Q8, buf, hd);
                }
    }
    rc = kv_cache_transfer(&dst, &src, 400, err, sizeof err);
    CHECK(rc == 0, "h2o:512 (400 tokens a lane) -> h2o:64,type=q8 moves: %s", rc ? err : "ok");
    int pos_ok = 1, vec_ok = 1;
    for (int i = 0; i < n_lanes; i++) {
        const KVLane *ln = &dst.lanes[i];
        pos_ok &= ln->n_live == 64 && nwant[i] == 64;
        for (int j = 0; j < ln->n_live && j < 64; j++) {
            float x[16], y[16];
            pos_ok &= kv_rank_pos(ln, j) == want[i][j];
            kv_decode(x, KV_Q8, kv_slot_k(&dst, ln, ln->live[j]), hd);
            kv_decode(y, KV_Q8, kv_slot_v(&dst, ln, ln->live[j]), hd);
            vec_ok &= !memcmp(x, wk[i][j], sizeof x) && !memcmp(y, wv[i][j], sizeof y);
        }
    }
    CHECK(pos_ok, "every lane keeps the 64 positions the independent ranking picks (recent=32 protected, then the "
          "heaviest), in position order");
    CHECK(vec_ok, "each kept key and value is the q8 encoding of the source's f32 vector");
    CHECK(dst.n_evictions == n_lanes * (400 - 64), "the %d dropped tokens count as the destination's evictions (%d)",
          n_lanes * (400 - 64), dst.n_evictions);
    CHECK(feed(&dst, L, 400, NULL, 2) == 0 && dst.lanes[0].n_live == 64, "the moved cache goes on at its budget");
    kv_cache_free(&src);
    kv_cache_free(&dst);

    /* 3. in a pool */
    KVPool pool;
    size_t page = 16 * 2 * (size_t)hd * 4;   /* an f32 page of 16 slots: a q8 lane fits more in it */
    if (kv_pool_init(&pool, 100 * page, page, err, sizeof err)) { CHECK(0, "pool: %s", err); CHECK_EXIT(); }
    KVCache ps, pd, pe;
    if (kv_spec_parse(&sp, "h2o:512", KV_F32, err, sizeof err) || kv_cache_init_pool(&ps, &s, &sp, &pool, err, sizeof err))
        { CHECK(0, "pool cache: %s", err); CHECK_EXIT(); }
    for (int t = 0; t < 300; t++) feed(&ps, L, t, NULL, 3);   /* 4 lanes x 19 pages = 76 of 100 */
    int held0 = kv_pages_held(&ps);
    if (kv_spec_parse(&sp, "h2o:512,type=q8", KV_F32, err, sizeof err) || kv_cache_init_pool(&pd, &s, &sp, &pool, err, sizeof err))
        { CHECK(0, "pool cache: %s", err); CHECK_EXIT(); }
    rc = kv_cache_transfer(&pd, &ps, 300, err, sizeof err);
    int held1 = kv_pages_held(&pd), Pq = kv_page_slots(&pd);
    CHECK(rc == 0 && held0 == 76 && Pq > 16 && held1 == 4 * ((300 + Pq - 1) / Pq) && kv_pages_held(&ps) == 0 && kv_pool_n_held(&pool) == held1
          && !kv_pool_check(&pool, err, sizeof err),
          "f32 -> q8 in the pool: %d pages become %d (pages of %d q8 slots), the source holds none, the pool "
          "agrees and its invariants hold", held0, held1, Pq);
    kv_cache_free(&ps);
    /* back to f32 needs 76 pages with 80 free: fits; with a second sequence holding 60 of them it does not */
    KVCache hog;
    if (kv_spec_parse(&sp, "full", KV_F32, err, sizeof err) || kv_cache_init_pool(&hog, &s, &sp, &pool, err, sizeof err))
        { CHECK(0, "pool cache: %s", err); CHECK_EXIT(); }
    for (int t = 0; t < 240; t++) feed(&hog, L, t, NULL, 4);   /* 4 x 15 = 60 pages */
    if (kv_spec_parse(&sp, "h2o:512", KV_F32, err, sizeof err) || kv_cache_init_pool(&pe, &s, &sp, &pool, err, sizeof err))
        { CHECK(0, "pool cache: %s", err); CHECK_EXIT(); }
    int free0 = kv_pool_n_free(&pool);
    rc = kv_cache_transfer(&pe, &pd, 300, err, sizeof err);
    CHECK(rc == 1 && kv_pages_held(&pd) == held1 && kv_pages_held(&pe) == 0 && kv_pool_n_free(&pool) == free0,
          "q8 -> f32 with %d pages free (76 needed, 20 given back on the way): 1, nothing changed", free0);
    kv_cache_free(&hog);
    rc = kv_cache_transfer(&pe, &pd, 300, err, sizeof err);
    CHECK(rc == 0 && kv_pages_held(&pe) == 76 && !kv_pool_check(&pool, err, sizeof err),
          "once the other sequence left it fits: 76 pages again");
    kv_cache_free(&pd);
    kv_cache_free(&pe);
    CHECK(kv_pool_n_held(&pool) == 0, "every page back in the pool at the end");
    kv_pool_free(&pool);

    /* 4. refusals */
    const char *bad[][3] = {{"h2o:512", "tova:512", "metadata"}, {"full", "window:64", "cannot rank"},
                            {"h2o:512", "h2o:512,pos=cache", "pos="}, {"h2o:512", "h2o:512,prec=f32:16/q8", "bands"}};
    for (int x = 0; x < 4; x++) {
        KVCache u, w;
        if (tcache(&u, &s, bad[x][0]) || tcache(&w, &s, bad[x][1])) CHECK_EXIT();
        for (int t = 0; t < 100; t++) feed(&u, L, t, NULL, 5);
        rc = kv_cache_transfer(&w, &u, 100, err, sizeof err);
        CHECK(rc == -1 && strstr(err, bad[x][2]) && u.lanes[0].n_live == 100, "%s -> %s is refused, nothing moved: %s",
              bad[x][0], bad[x][1], err);
        kv_cache_free(&u);
        kv_cache_free(&w);
    }
    CHECK_EXIT();
}
