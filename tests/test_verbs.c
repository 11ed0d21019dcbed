/* test_verbs.c: the verbs of the policy interface v2 and the cache rules around them, each checked after every step
 * of a synthetic stream (kv_append + kv_attend_cpu, no model) against a reference written here, keyed by position:
 *   1. select (topk:B): the read set is the B positions with the highest group-mean score mean_h(q_h·k_i)/√head_dim,
 *      computed here in double from the stream's own q and k, ties to the older (policies.c, topk; kv.h, step 3);
 *      the lane holds every position; outputs are a softmax over the read set alone; the cache stops at -c;
 *   2. merge (pool:N,group=G,recent=R[,sinks=S]): groups [S+jG, S+jG+G) pooled at step 1 of the token at
 *      S+jG+G-1+R, the oldest non-sink slot evicted when the lane still reaches N (policies.c, pool); a merged
 *      slot's key and value the mean of its rotated keys / values (kv.h, Merging) within a bound derived below;
 *      the budget rule's errors;
 *   3. recode (prec=): band 0 newest, a full band's oldest token recoded one band down (kv.h, Precision bands), the
 *      bytes of each token those of its chain of encodings, one KV_EV_RECODE per move, the live-byte accounting
 *      (kv.c, slot_meta_bytes); prec= parse errors;
 *   4. clone/restore: a clone and a restored copy continue bit-identically (merge-on-evict included);
 *   5. ragged budgets (kv_cache_init_lanes): per-lane capacity and memory.
 * Codec (kv_encode/kv_decode) and RoPE (kv_rope) are used as primitives where bytes must match exactly; the rules
 * under test (which positions, which band, which bytes) are the test's own.
 * Dimensions: L layers, NH query heads, NKV kv heads, HD head_dim, T tokens. u = 2^-24, the f32 unit roundoff. */
#include "tests/test_kv_util.h"
#include "kv_impl.h"

#define L 2
#define NH 4
#define NKV 2
#define HD 8
#define MAXT 64
#define GROUPSZ (NH / NKV)
#define U 5.9604644775390625e-08
/* output tolerance of test_policies.c's test_gqa_shared_set: 64 f32 ulps of 4 (|v| <= ~4, 8-term dots, a softmax
   over <= a few dozen slots; measured errors are reported) */
#define OUT_TOL (64 * 4 * 1.2e-7)

/* identity: RoPE the identity to f32 precision (scores are plain dot products, tshape_norope) */
static KVShape vshape(int seq_len, int identity) {
    return identity ? tshape_norope(L, NH, NKV, HD, seq_len) : tshape(L, NH, NKV, HD, seq_len);
}

/* the stream: K, V (NKV*HD) and Q (NH*HD) before RoPE, for positions 0..MAXT. With dups, every 9th token (t = 17,
 * 26, ...) repeats the key of t-4 and both query heads of its group look along it: an exact tie at the top. */
static float K[MAXT + 1][L][NKV * HD], V[MAXT + 1][L][NKV * HD], Q[MAXT + 1][L][NH * HD];
static void gen_stream(uint64_t seed, int dups) {
    for (int t = 0; t <= MAXT; t++)
        for (int l = 0; l < L; l++) {
            trng_seed(seed * 1000003ull + (uint64_t)(t * 131 + l * 7 + 1));
            for (int j = 0; j < NKV * HD; j++) { K[t][l][j] = trng_normal(); V[t][l][j] = trng_normal(); }
            for (int j = 0; j < NH * HD; j++) Q[t][l][j] = trng_normal();
            if (dups && t >= 9 && t % 9 == 8) {
                memcpy(K[t][l], K[t - 4][l], sizeof K[t][l]);
                for (int h = 0; h < NH; h++)
                    for (int d = 0; d < HD; d++)
                        Q[t][l][h * HD + d] = K[t][l][(h / GROUPSZ) * HD + d] + 0.1f * trng_normal();
            }
        }
}

/* max |out - softmax over pos[0..n) of q·k/√HD applied to v|, in double, RoPE the identity */
static double out_err(int t, int l, int h, const int *pos, int n, const float *out) {
    int g = h / GROUPSZ;
    double q[HD], k[(MAXT + 1) * HD];
    const float *v[MAXT + 1];
    for (int j = 0; j < HD; j++) q[j] = Q[t][l][h * HD + j];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < HD; j++) k[i * HD + j] = K[pos[i]][l][g * HD + j];
        v[i] = &V[pos[i]][l][g * HD];
    }
    return tdense_err(q, k, v, n, HD, out + h * HD);
}

/* ---- the event log (c->on_event), normalized for comparison ---- */
typedef struct { int kind, pos_now, layer, kv_head, pos, pos0, n, band, ktype, vtype; } Ev;
#define MAXEV 256
static Ev got_ev[MAXEV], want_ev[MAXEV];
static int n_got, n_want;
static void ev_record(void *ctx, const KVEvent *e) {
    if (n_got == MAXEV) return;
    Ev x = {(int)e->kind, e->pos_now, e->layer, e->kv_head, e->pos, e->pos0, e->n, -1, 0, 0};
    if (e->kind == KV_EV_RECODE) { x.band = e->band; x.ktype = (int)e->ktype; x.vtype = (int)e->vtype; }
    got_ev[n_got++] = x;
}
static void ev_want(int kind, int t, int l, int g, int pos, int pos0, int n, int band, int type) {
    if (n_want < MAXEV) want_ev[n_want++] = (Ev){kind, t, l, g, pos, pos0, n, band, type, type};
}
static int ev_cmp(const void *a, const void *b) { return memcmp(a, b, sizeof(Ev)); }
/* the step's events as a set (kv.h fixes one event per token affected, not their order): 1 when equal */
static int ev_same(void) {
    qsort(got_ev, (size_t)n_got, sizeof(Ev), ev_cmp);
    qsort(want_ev, (size_t)n_want, sizeof(Ev), ev_cmp);
    return n_got == n_want && !memcmp(got_ev, want_ev, (size_t)n_got * sizeof(Ev));
}

/* ---- 1. selection: topk:B ---- */
typedef struct { double s, bound; int pos; } Cand;
static int cand_cmp(const void *a, const void *b) {   /* highest score first, the older among equals */
    const Cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->pos - y->pos;
}
static int int_cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static void run_topk(int B, int T) {
    char spec[32];
    snprintf(spec, sizeof spec, "topk:%d", B);
    KVShape s = vshape(T, 1);   /* -c = T */
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    float out[NH * HD];
    int bad_set = 0, bad_held = 0, bad_zero = 0, ambiguous = 0, ties = 0, checked = 0, spans[2 * MAXT], pos[MAXT];
    double max_err = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                int n = t + 1, m = B < n ? B : n, want[MAXT], amb = 0;
                Cand cd[MAXT];
                for (int i = 0; i < n; i++) {   /* the group-mean score in double, and its f32 error bound */
                    double sum = 0, abs_sum = 0;
                    for (int hh = 0; hh < GROUPSZ; hh++)
                        for (int d = 0; d < HD; d++) {
                            double x = (double)Q[t][l][(g * GROUPSZ + hh) * HD + d] * K[i][l][g * HD + d];
                            sum += x; abs_sum += fabs(x);
                        }
                    /* kvlab's f32: an 8-term dot (HD·u Σ|q_d k_d|), the scale and product (2u), the group sum and
                       division (2u), relative to Σ|q_d k_d|/√HD: (HD + 4)·u·mean_h Σ_d |q_d k_d| / √HD */
                    double norm = GROUPSZ * sqrt((double)HD);
                    cd[i] = (Cand){sum / norm, (HD + 4) * U * abs_sum / norm, i};
                }
                qsort(cd, (size_t)n, sizeof *cd, cand_cmp);
                for (int a = 0; a < m; a++)          /* a selected and an unselected key the f32 scores may order */
                    for (int b = m; b < n; b++)      /* otherwise (exact ties of equal keys are not ambiguous) */
                        if (fabs(cd[a].s - cd[b].s) <= cd[a].bound + cd[b].bound &&
                            memcmp(K[cd[a].pos][l] + g * HD, K[cd[b].pos][l] + g * HD, HD * sizeof(float)))
                            amb = 1;
                ties += m < n && cd[m - 1].s == cd[m].s;
                for (int j = 0; j < m; j++) want[j] = cd[j].pos;
                qsort(want, (size_t)m, sizeof *want, int_cmp);
                int w = kv_lane_read(&c, l, g, spans, MAXT), ok = w == m;
                for (int j = 0; ok && j < w; j++) ok = spans[2 * j] == want[j] && spans[2 * j + 1] == want[j];
                checked++;
                if (amb) ambiguous++;
                else if (!ok) {
                    if (!bad_set) {
                        int got[MAXT];
                        char a[512], b2[512];
                        for (int j = 0; j < w; j++) got[j] = spans[2 * j];
                        tprint_set(a, sizeof a, got, w);
                        tprint_set(b2, sizeof b2, want, m);
                        printf("  %s: t=%d layer %d kv head %d read {%s}, reference {%s}\n", spec, t, l, g, a, b2);
                    }
                    bad_set++;
                }
                int np = kv_lane_positions(&c, l, g, pos, MAXT), held = np == n;
                for (int i = 0; held && i < np; i++) held = pos[i] == i;
                bad_held += !held;
                int rd[MAXT];   /* the positions (= ranks: every position is held) the query read */
                for (int j = 0; j < w; j++) rd[j] = spans[2 * j];
                for (int hh = 0; hh < GROUPSZ; hh++) {
                    int h = g * GROUPSZ + hh;
                    double e = out_err(t, l, h, rd, w, out);
                    if (!(e <= max_err)) max_err = e;
                    for (int i = 0, j = 0; i < n; i++) {
                        if (j < w && rd[j] == i) { j++; continue; }
                        bad_zero += c.scores[(size_t)h * c.budget + i] != 0.0f;
                    }
                }
            }
        }
    CHECK(bad_set == 0 && checked == T * L * NKV, "%s: each query reads the %d positions of highest double group-mean "
          "score (ties to the older; all when fewer are stored), after each of %d steps (%d lane-steps, %d differ, "
          "%d ambiguous within the f32 bound and not compared, %d exact ties at the boundary)", spec, B, T, checked,
          bad_set, ambiguous, ties);
    CHECK(bad_held == 0, "%s: every lane holds positions 0..t at every step (%d lane-steps differ)", spec, bad_held);
    CHECK_LE(max_err, OUT_TOL, "%s: each query head's output equals a double softmax over the read positions alone "
             "(max err %.3g <= %.3g)", spec, max_err, OUT_TOL);
    CHECK(bad_zero == 0, "%s: c->scores is 0 at every unread rank (%d nonzero)", spec, bad_zero);
    int rc = kv_append(&c, 0, T, K[T][0], V[T][0]);
    CHECK(kv_capacity(&c) == T && rc == -1, "%s stops at -c like full: kv_capacity %d == %d, kv_append of position %d "
          "returns %d (want -1)", spec, kv_capacity(&c), T, T, rc);
done:
    kv_cache_free(&c);
}

static void test_topk(void) {
    gen_stream(1, 1);
    run_topk(4, 60);
    run_topk(1, 60);   /* at t = 17, 26, ...: positions t-4 and t tie at the top: the older, t-4, is read */
}

/* ---- 2. merging: pool:N,group=G,recent=R ---- */
typedef struct { int n, p0[MAXT], p[MAXT]; } PoolRef;

/* the key of position p rotated by p (theta 10000, adjacent pairs), in double */
static void rot_double(const float *x, int p, double *r) {
    for (int i = 0; i < HD / 2; i++) {
        double a = p * pow(10000.0, -2.0 * i / HD), c = cos(a), sn = sin(a);
        r[2 * i] = x[2 * i] * c - x[2 * i + 1] * sn;
        r[2 * i + 1] = x[2 * i] * sn + x[2 * i + 1] * c;
    }
}

static void run_pool(int N, int G, int R, int S, int T) {
    char spec[48];
    snprintf(spec, sizeof spec, "pool:%d,group=%d,recent=%d,sinks=%d", N, G, R, S);
    KVShape s = vshape(MAXT, 0);   /* real RoPE: merged keys are means of rotated keys */
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    c.on_event = ev_record;
    static PoolRef ref[L * NKV];
    memset(ref, 0, sizeof ref);
    float out[NH * HD], kx[HD], vx[HD];
    int bad_pos = 0, bad_ev = 0, bad_vec = 0, merges = 0, evicts = 0, pos[MAXT], spans[2 * MAXT];
    double worst = 0;   /* the largest error / bound ratio */
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            n_got = n_want = 0;
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            for (int g = 0; g < NKV; g++) {
                PoolRef *r = &ref[l * NKV + g];
                /* step 1: the group [S+jG, S+jG+G) whose newest left the recent window, if all G are held alone */
                int j0 = t - R - G + 1;
                if (j0 >= S && (j0 - S) % G == 0) {
                    int at = -1;
                    for (int i = 0; i + G <= r->n && at < 0; i++) {
                        int run = 1;
                        for (int x = 0; x < G; x++) run &= r->p0[i + x] == j0 + x && r->p[i + x] == j0 + x;
                        if (run) at = i;
                    }
                    if (at >= 0) {
                        r->p[at] = j0 + G - 1;
                        memmove(&r->p0[at + 1], &r->p0[at + G], (size_t)(r->n - at - G) * sizeof(int));
                        memmove(&r->p[at + 1], &r->p[at + G], (size_t)(r->n - at - G) * sizeof(int));
                        r->n -= G - 1;
                        ev_want(KV_EV_MERGE, t, l, g, j0 + G - 1, j0, G, -1, 0);
                        merges++;
                    }
                }
                if (r->n >= N) {   /* still N slots: the oldest that is not a sink goes */
                    int e = 0;
                    while (e < r->n && r->p0[e] < S) e++;
                    ev_want(KV_EV_EVICT, t, l, g, r->p[e], r->p0[e], 1, -1, 0);
                    memmove(&r->p0[e], &r->p0[e + 1], (size_t)(r->n - e - 1) * sizeof(int));
                    memmove(&r->p[e], &r->p[e + 1], (size_t)(r->n - e - 1) * sizeof(int));
                    r->n--;
                    evicts++;
                }
                r->p0[r->n] = r->p[r->n] = t;
                r->n++;
            }
            bad_ev += !ev_same();
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                PoolRef *r = &ref[l * NKV + g];
                const KVLane *ln = &c.lanes[l * NKV + g];
                int n = kv_lane_positions(&c, l, g, pos, MAXT), w = kv_lane_read(&c, l, g, spans, MAXT);
                int ok = n == r->n && w == r->n;
                for (int i = 0; ok && i < n; i++)
                    ok = pos[i] == r->p[i] && spans[2 * i] == r->p0[i] && spans[2 * i + 1] == r->p[i];
                if (!ok && !bad_pos) {
                    char a[512], b[512];
                    tprint_set(a, sizeof a, pos, n);
                    tprint_set(b, sizeof b, r->p, r->n);
                    printf("  %s: t=%d layer %d kv head %d holds {%s}, reference {%s}\n", spec, t, l, g, a, b);
                }
                bad_pos += !ok;
                if (!ok) continue;
                /* slot i covers m = p - p0 + 1 positions. Key bound per element d of pair (d0, d1), M = max over
                   the m keys of |x_d0| + |x_d1|: f32 rotation 3u·M (cos/sin rounding u, product u, sum u), the
                   f32 sum of m terms (m-1)u·M after /m, the division u·M: (m + 3)·u·M. Value: m·u·max|v|. */
                for (int i = 0; i < n; i++) {
                    int p0 = r->p0[i], m = r->p[i] - p0 + 1;
                    const float *k = kv_lane_key(&c, ln, i, kx), *v = kv_lane_value(&c, ln, i, vx);
                    double mk[HD] = {0}, mv[HD] = {0}, M[HD] = {0}, MV[HD] = {0}, rr[HD];
                    for (int p = p0; p <= r->p[i]; p++) {
                        const float *x = K[p][l] + g * HD, *y = V[p][l] + g * HD;
                        rot_double(x, p, rr);
                        for (int d = 0; d < HD; d++) {
                            double pair = fabs(x[d & ~1]) + fabs(x[d | 1]);
                            mk[d] += rr[d] / m; mv[d] += (double)y[d] / m;
                            if (pair > M[d]) M[d] = pair;
                            if (fabs(y[d]) > MV[d]) MV[d] = fabs(y[d]);
                        }
                    }
                    for (int d = 0; d < HD; d++) {
                        double ek = fabs(k[d] - mk[d]) / ((m + 3) * U * M[d] * (1 + 1e-3)),
                               ev = fabs(v[d] - mv[d]) / (m * U * MV[d] * (1 + 1e-3) + 1e-300);
                        if (!(ek <= 1 && ev <= 1)) bad_vec++;
                        if (ek > worst) worst = ek;
                        if (ev > worst) worst = ev;
                    }
                }
            }
        }
    CHECK(bad_pos == 0, "%s: held positions (newest covered) and covered spans (kv_lane_read) equal the reference "
          "after each of %d steps in every lane (%d lane-steps differ; %d merges, %d evictions)", spec, T, bad_pos,
          merges, evicts);
    CHECK(bad_ev == 0 && merges > 0 && evicts > 0, "%s: one KV_EV_MERGE (pos0..pos, n=%d) per pooled group and one "
          "KV_EV_EVICT per evicted slot, as the reference (%d of %d layer-steps differ)", spec, G, bad_ev, T * L);
    CHECK(bad_vec == 0, "%s: every slot's key and value equal the double mean of its rotated keys / values within "
          "(m+3)u·M and m·u·max|v| (%d elements over, worst error/bound %.3g)", spec, bad_vec, worst);
done:
    kv_cache_free(&c);
}

/* 1 when spec_text parses, kv_cache_init fails, and the message holds needle and needle2 */
static int init_fails_with(const char *spec_text, const char *needle, const char *needle2, char *err, size_t errlen) {
    KVShape s = vshape(MAXT, 0);
    KVSpec sp;
    KVCache c;
    err[0] = 0;
    if (kv_spec_parse(&sp, spec_text, KV_F32, err, errlen)) return 0;   /* must parse, then fail init */
    if (!kv_cache_init(&c, &s, &sp, err, errlen)) { kv_cache_free(&c); return 0; }
    return strstr(err, needle) && strstr(err, needle2);
}

static void test_pool(void) {
    char err[512];
    gen_stream(2, 0);
    run_pool(12, 3, 4, 0, 60);
    run_pool(8, 2, 3, 0, 60);
    run_pool(12, 3, 4, 2, 60);   /* sinks=S: positions 0..S-1 never pooled or evicted, groups start at S */
    CHECK(init_fails_with("pool:6,group=3,recent=4,sinks=0", "recent + group", "= 7", err, sizeof err),
          "pool:6,group=3,recent=4,sinks=0 fails kv_cache_init naming the budget rule, recent + group = 7 (%s)", err);
    CHECK(init_fails_with("pool:6,group=3", "= 10", "a budget >= 13", err, sizeof err),
          "pool:6,group=3 (default recent=3, sinks=4) fails naming the rule, 4 + 3 + 3 = 10, and the smallest budget the "
          "defaults allow, 2(4 + 3) - 1 = 13 (%s)", err);
    CHECK(init_fails_with("pool:9,group=3,recent=4,sinks=3", "sinks + recent + group", "= 10", err, sizeof err),
          "pool:9,group=3,recent=4,sinks=3 fails kv_cache_init: sinks + recent + group = 10 (%s)", err);
    CHECK(init_fails_with("pool:12,group=1,recent=4", "group=1", "[2,", err, sizeof err),
          "pool:12,group=1,recent=4 fails kv_cache_init: group must be >= 2 (%s)", err);
}

/* ---- 3. recode by age: prec= ---- */
typedef struct { int n, held[MAXT], band[MAXT + 1], path[MAXT + 1][KV_MAX_BANDS], npath[MAXT + 1]; } BandRef;

/* make room in band b as kv.h states it: a full band first makes room in the next band with slots, then moves its
   oldest token there (one KV_EV_RECODE) */
static void ref_make_room(BandRef *r, int nb, const int *slots, const KVType *ty, const KVType *vty, int b, int t,
                          int l, int g) {
    int in_b = 0, oldest = -1;
    for (int i = 0; i < r->n; i++)
        if (r->band[r->held[i]] == b) { if (oldest < 0) oldest = r->held[i]; in_b++; }
    if (in_b < slots[b]) return;
    int next = b + 1;
    while (next < nb && slots[next] == 0) next++;
    if (next == nb) return;   /* cannot happen with < cap tokens; the byte check would fail */
    ref_make_room(r, nb, slots, ty, vty, next, t, l, g);
    r->band[oldest] = next;
    r->path[oldest][r->npath[oldest]++] = next;
    ev_want(KV_EV_RECODE, t, l, g, oldest, oldest, 1, next, ty[next]);
    if (n_want) want_ev[n_want - 1].vtype = (int)vty[next];
}

/* the bytes of x after the chain of encodings path (each band's form in turn, decoded in between; a move between
   bands of the same form keeps the bytes: kv.h) */
static void chain_bytes(const float *x, const int *path, int np, const KVType *ty, uint8_t *dst) {
    float cur[HD];
    memcpy(cur, x, sizeof cur);
    for (int j = 0; j < np; j++) {
        if (j && ty[path[j]] == ty[path[j - 1]]) continue;
        kv_encode(dst, ty[path[j]], cur, HD);
        kv_decode(cur, ty[path[j]], dst, HD);
    }
}

/* spec with nb bands of key types ty, value types vty and wanted slots want (the last 0), lanes of cap slots; window:
   evicts the oldest */
static void run_prec(const char *spec, int nb, const KVType *ty, const KVType *vty, const int *want, int cap,
                     int window, int T) {
    KVShape s = vshape(T, 0);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    c.on_event = ev_record;
    int slots[KV_MAX_BANDS], left = cap;
    for (int b = 0; b < nb; b++) { slots[b] = b == nb - 1 ? left : want[b] < left ? want[b] : left; left -= slots[b]; }
    size_t meta = sizeof(int32_t) + 2 * sizeof(int);   /* kv.c slot_meta_bytes: pos, live + free entries */
    static BandRef ref[L * NKV];
    memset(ref, 0, sizeof ref);
    float out[NH * HD], kr[HD];
    uint8_t wk[64], wv[64];
    int bad_pos = 0, bad_age = 0, bad_bytes = 0, bad_ev = 0, bad_acct = 0, moves = 0, pos[MAXT];
    int n_last = 0, n_direct = 0;
    size_t want_live = 0, got_live = 0, got_inc = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            n_got = n_want = 0;
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            for (int g = 0; g < NKV; g++) {
                BandRef *r = &ref[l * NKV + g];
                if (window && r->n >= cap) {
                    ev_want(KV_EV_EVICT, t, l, g, r->held[0], r->held[0], 1, -1, 0);
                    memmove(r->held, r->held + 1, (size_t)--r->n * sizeof(int));
                }
                int before = n_want;
                ref_make_room(r, nb, slots, ty, vty, 0, t, l, g);
                moves += n_want - before;
                r->held[r->n++] = t;
                r->band[t] = 0; r->path[t][0] = 0; r->npath[t] = 1;
            }
            bad_ev += !ev_same();
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            want_live = 0;
            for (int lane = 0; lane < L * NKV; lane++)
                for (int i = 0; i < ref[lane].n; i++) {
                    int b = ref[lane].band[ref[lane].held[i]];
                    want_live += kv_vector_bytes(ty[b], HD) + kv_vector_bytes(vty[b], HD) + meta;
                }
            got_live = kv_bytes(&c).total_live; got_inc = c.live_bytes;
            bad_acct += got_live != want_live || got_inc != want_live;
            for (int g = 0; g < NKV; g++) {
                BandRef *r = &ref[l * NKV + g];
                const KVLane *ln = &c.lanes[l * NKV + g];
                int n = kv_lane_positions(&c, l, g, pos, MAXT), ok = n == r->n;
                for (int i = 0; ok && i < n; i++) ok = pos[i] == r->held[i];
                bad_pos += !ok;
                if (!ok) continue;
                for (int i = 0; i < n; i++) {
                    int p = pos[i], slot = ln->live[i], b = kv_slot_band(ln, slot), age = n - 1 - i;
                    /* the closed form with nothing freed out of order: newest slots[0] in band 0, and so on */
                    int want_b = 0;
                    for (int acc = slots[0]; want_b < nb - 1 && age >= acc; acc += slots[++want_b]) {}
                    bad_age += b != want_b;
                    if (b != r->band[p] || c.band_ktype[b] != ty[b] || c.band_vtype[b] != vty[b]) {
                        if (!bad_bytes) printf("  %s: t=%d lane (%d,%d) position %d in band %d (%s), reference %d\n",
                                               spec, t, l, g, p, b, kv_type_names[c.band_ktype[b]], r->band[p]);
                        bad_bytes++;
                        continue;
                    }
                    memcpy(kr, K[p][l] + g * HD, sizeof kr);
                    kv_rope(kr, &s, p);   /* pos=orig: the key is stored rotated by its position */
                    chain_bytes(kr, r->path[p], r->npath[p], ty, wk);
                    chain_bytes(V[p][l] + g * HD, r->path[p], r->npath[p], vty, wv);
                    if (b == nb - 1 && r->npath[p] > 2 && ty[nb - 3] != ty[nb - 2] && ty[nb - 2] != ty[nb - 1]) {   /* would a direct encoding have passed? (it must not) */
                        uint8_t direct[64];
                        kv_encode(direct, ty[b], kr, HD);
                        n_last++;
                        n_direct += memcmp(direct, wk, kv_vector_bytes(ty[b], HD)) != 0;
                    }
                    size_t row = (size_t)(slot - ln->band_first[b]);
                    bad_bytes += memcmp(ln->k[b] + row * c.band_kb[b], wk, kv_vector_bytes(ty[b], HD)) != 0 ||
                                 memcmp(ln->v[b] + row * c.band_vb[b], wv, kv_vector_bytes(vty[b], HD)) != 0;
                }
            }
        }
    CHECK(bad_pos == 0 && bad_bytes == 0, "%s: every live token sits in the reference's band and its key and value "
          "bytes are its chain of encodings along its bands (each new form encoding the last one's decoding; a form two "
          "bands share keeps its bytes) after each of %d steps "
          "(%d lane-steps with other positions, %d tokens differ; %d of %d last-band keys differ from a direct "
          "encoding)", spec, T, bad_pos, bad_bytes, n_direct, n_last);
    CHECK(bad_age == 0, "%s: bands by age: the newest %d tokens in band 0, the next %d in band 1, and so on, the "
          "last band the rest (%d tokens differ)", spec, slots[0], slots[1], bad_age);
    CHECK(bad_ev == 0 && moves > 0, "%s: one KV_EV_RECODE per move with its band and types (and one KV_EV_EVICT per "
          "eviction), %d moves, %d of %d layer-steps differ", spec, moves, bad_ev, T * L);
    CHECK(bad_acct == 0, "%s: kv_bytes total_live and live_bytes equal the sum of per-band vector bytes plus %zu B of "
          "metadata per live token at every step (%d differ; at the end %zu, %zu, want %zu)", spec, meta, bad_acct,
          got_live, got_inc, want_live);
done:
    kv_cache_free(&c);
}

static void expect_parse_error(const char *spec, const char *needle) {
    KVSpec sp;
    char err[512] = "";
    int rc = kv_spec_parse(&sp, spec, KV_F32, err, sizeof err);
    CHECK(rc == -1 && strstr(err, needle), "kv_spec_parse('%s') returns -1 (got %d) with a message naming '%s' (%s)",
          spec, rc, needle, err);
}

static void test_prec(void) {
    gen_stream(3, 0);
    KVType ty[3] = {KV_F32, KV_Q8, KV_Q4};
    int w1[3] = {3, 5, 0}, w2[3] = {4, 6, 0};
    run_prec("window:20,prec=f32:3/q8:5/q4", 3, ty, ty, w1, 20, 1, 40);
    run_prec("full,prec=f32:4/q8:6/q4", 3, ty, ty, w2, 40, 0, 40);
    /* keys and values aging apart: the union of the boundaries 4, 9 (keys) and 3, 9 (values) */
    KVType kty[4] = {KV_F32, KV_F32, KV_Q8, KV_Q4}, vty[4] = {KV_F32, KV_F16, KV_F16, KV_Q8};
    int w3[4] = {3, 1, 5, 0};
    run_prec("window:20,kprec=f32:4/q8:5/q4,vprec=f32:3/f16:6/q8", 4, kty, vty, w3, 20, 1, 40);
    KVType kty2[2] = {KV_F32, KV_Q8}, vty2[2] = {KV_F32, KV_F32};
    int w4[2] = {5, 0};
    run_prec("full,kprec=f32:5/q8", 2, kty2, vty2, w4, 40, 0, 40);   /* values one band: f32 (the default type) */
    KVType kty3[3] = {KV_F16, KV_F16, KV_Q4}, vty3[3] = {KV_F32, KV_Q8, KV_Q8};
    int w5[3] = {2, 4, 0};
    run_prec("window:20,vprec=f32:2/q8,kprec=f16:6/q4", 3, kty3, vty3, w5, 20, 1, 40);
    expect_parse_error("full,kprec=f32:4/q8,ktype=q8", "conflicts with kprec=");
    expect_parse_error("full,vprec=f32:4/q8,type=q8", "conflicts with vprec=");
    expect_parse_error("full,kprec=f32:4/q8,prec=f32:4/q8", "prec= conflicts with kprec= and vprec=");
    expect_parse_error("full,vprec=f32:4/q8,residual=4", "residual= conflicts with vprec=");
    expect_parse_error("full,kprec=f32:4/q8,kprec=f32:4/q4", "given twice");
    expect_parse_error("full,vprec=f32:4/zz", "unknown storage type 'zz' in vprec=");
    expect_parse_error("full,prec=f32:4/q8,type=q8", "conflicts with prec=");
    expect_parse_error("full,type=q8,prec=f32:4/q8", "prec= conflicts with type=");
    expect_parse_error("full,prec=f32/q8", "every band but the last gives its tokens");
    expect_parse_error("full,prec=q8:4", "every band but the last gives its tokens");
    expect_parse_error("full,prec=zz:3/q4", "unknown storage type 'zz'");
}

/* ---- 4. clone/restore ---- */
/* every lane's positions and read spans, and the live bytes, into sig; returns its length */
static int cache_sig(const KVCache *c, int *sig) {
    int w = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < NKV; g++) {
            int n = kv_lane_positions(c, l, g, sig + w + 1, MAXT);
            sig[w] = n; w += n + 1;
            n = kv_lane_read(c, l, g, sig + w + 1, MAXT);
            sig[w] = n; w += 2 * n + 1;
        }
    sig[w++] = (int)kv_bytes(c).total_live;
    return w;
}

static void run_clone(const char *spec) {
    KVShape s = vshape(MAXT, 0);
    KVCache a, b, saved;
    char err[512];
    if (tcache(&a, &s, spec)) return;
    float oa[NH * HD], ob[NH * HD];
    static float rec[20][L][NH * HD];
    static int sa[4 * MAXT * 4], sb[4 * MAXT * 4];
    for (int t = 0; t < 30; t++)
        for (int l = 0; l < L; l++) { kv_append(&a, l, t, K[t][l], V[t][l]); kv_attend_cpu(&a, oa, l, t, Q[t][l]); }
    if (kv_cache_clone(&b, &a, err, sizeof err)) {
        CHECK(0, "%s: kv_cache_clone: %s", spec, err); kv_cache_free(&a); return;
    }
    if (kv_cache_clone(&saved, &a, err, sizeof err)) {
        CHECK(0, "%s: kv_cache_clone: %s", spec, err); kv_cache_free(&a); kv_cache_free(&b); return;
    }
    int bad_out = 0, bad_sig = 0, bad_replay = 0, bad_rsig = 0, rc;
    for (int t = 30; t < 50; t++) {
        for (int l = 0; l < L; l++) {
            int ra = kv_append(&a, l, t, K[t][l], V[t][l]), rb = kv_append(&b, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&a, oa, l, t, Q[t][l]);
            kv_attend_cpu(&b, ob, l, t, Q[t][l]);
            bad_out += ra || rb || memcmp(oa, ob, sizeof oa) != 0;
            memcpy(rec[t - 30][l], oa, sizeof oa);
        }
        int na = cache_sig(&a, sa), nb = cache_sig(&b, sb);
        bad_sig += na != nb || memcmp(sa, sb, (size_t)na * sizeof(int));
    }
    CHECK(bad_out == 0 && bad_sig == 0, "%s: a clone taken at step 30 and the original fed positions 30..49 give "
          "bit-identical outputs (%d layer-steps differ) and equal held positions, read spans and bytes (%d steps "
          "differ)", spec, bad_out, bad_sig);
    rc = kv_cache_restore(&b, &saved, err, sizeof err);
    for (int t = 30; t < 50 && !rc; t++) {
        for (int l = 0; l < L; l++) {
            kv_append(&b, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&b, ob, l, t, Q[t][l]);
            bad_replay += memcmp(rec[t - 30][l], ob, sizeof ob) != 0;
        }
        if (t == 49) {
            int na = cache_sig(&a, sa), nb = cache_sig(&b, sb);
            bad_rsig = na != nb || memcmp(sa, sb, (size_t)na * sizeof(int));
        }
    }
    CHECK(rc == 0 && bad_replay == 0 && bad_rsig == 0, "%s: kv_cache_restore to the step-30 copy (rc %d %s) and a "
          "replay of 30..49 give the same output bits (%d layer-steps differ) and the same final lanes", spec, rc,
          rc ? err : "", bad_replay);
    kv_cache_free(&a); kv_cache_free(&b); kv_cache_free(&saved);
}

static void test_clone(void) {
    gen_stream(4, 0);
    run_clone("h2o:10");
    run_clone("pool:12,group=3,recent=4");
    run_clone("topk:6");
    run_clone("cluster:12,k=3,local=3");
    run_clone("h2o:10,merge=1");                      /* merge-on-evict: merged vectors and the weights mw */
    run_clone("sink:10,sinks=2,merge=1,prec=f32:3/q8");
    /* a restore across specs is refused */
    KVShape s = vshape(MAXT, 0);
    KVCache a, b;
    char err[512] = "";
    if (tcache(&a, &s, "h2o:10")) return;
    if (tcache(&b, &s, "window:10")) { kv_cache_free(&a); return; }
    int rc = kv_cache_restore(&a, &b, err, sizeof err);
    CHECK(rc == -1, "kv_cache_restore of a window:10 cache into an h2o:10 one fails (rc %d: %s)", rc, err);
    kv_cache_free(&a); kv_cache_free(&b);
}

/* ---- 5. ragged budgets ---- */
static void test_ragged(void) {
    gen_stream(5, 0);
    KVShape s = vshape(MAXT, 1);
    KVSpec sp;
    KVCache c, u;
    char err[512];
    int caps[L * NKV] = {4, 9, 6, 12}, pos[MAXT], T = 20;
    if (kv_spec_parse(&sp, "window:12", KV_F32, err, sizeof err) ||
        kv_cache_init_lanes(&c, &s, &sp, caps, err, sizeof err)) {
        CHECK(0, "kv_cache_init_lanes window:12 caps {4,9,6,12}: %s", err);
        return;
    }
    if (kv_cache_init(&u, &s, &sp, err, sizeof err)) { CHECK(0, "window:12: %s", err); kv_cache_free(&c); return; }
    /* per slot (kv.c slot_meta_bytes): f32 key and value, one int32 position, a live- and a free-list int */
    size_t per_slot = 2 * kv_vector_bytes(KV_F32, HD) + sizeof(int32_t) + 2 * sizeof(int), want = 0, want_lane_ok = 1;
    for (int i = 0; i < L * NKV; i++) {
        want += (size_t)caps[i] * per_slot;
        want_lane_ok &= kv_lane_bytes(&c, i / NKV, i % NKV).total_alloc == (size_t)caps[i] * per_slot;
    }
    KVBytes bc = kv_bytes(&c), bu = kv_bytes(&u);
    CHECK(bc.total_alloc == want && want_lane_ok && bu.total_alloc == (size_t)L * NKV * 12 * per_slot &&
          bc.total_alloc < bu.total_alloc, "window:12 with caps {4,9,6,12}: total_alloc %zu B == 31 slots x %zu B "
          "(%zu), each lane's cap x %zu B, below the uniform cache's %zu B (48 slots)", bc.total_alloc, per_slot, want,
          per_slot, bu.total_alloc);
    CHECK(c.arena_bytes < u.arena_bytes, "ragged arena %zu B < uniform arena %zu B", c.arena_bytes, u.arena_bytes);
    float out[NH * HD];
    int bad = 0;
    double max_err = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&c, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                int cap = caps[l * NKV + g], want_n = t + 1 < cap ? t + 1 : cap;
                int n = kv_lane_positions(&c, l, g, pos, MAXT), ok = n == want_n;
                for (int i = 0; ok && i < n; i++) ok = pos[i] == t - want_n + 1 + i;
                bad += !ok;
                for (int hh = 0; hh < GROUPSZ; hh++) {
                    double e = out_err(t, l, g * GROUPSZ + hh, pos, n, out);
                    if (!(e <= max_err)) max_err = e;
                }
            }
        }
    CHECK(bad == 0, "window:12 with caps {4,9,6,12}: each lane holds its min(t+1, cap) newest positions after each of "
          "%d steps (%d lane-steps differ)", T, bad);
    CHECK_LE(max_err, OUT_TOL, "ragged lanes: each query head's output equals a double softmax over its lane's "
             "positions (max err %.3g <= %.3g)", max_err, OUT_TOL);
    size_t live_want = 0;
    for (int i = 0; i < L * NKV; i++) live_want += (size_t)(T < caps[i] ? T : caps[i]) * per_slot;
    CHECK(kv_bytes(&c).total_live == live_want, "ragged: total_live %zu B == every lane full (31 x %zu B = %zu)",
          kv_bytes(&c).total_live, per_slot, live_want);
    kv_cache_free(&c); kv_cache_free(&u);
}

int main(void) {
    test_topk();
    test_pool();
    test_prec();
    test_clone();
    test_ragged();
    CHECK_EXIT();
}
