/* test_select.c: the selection policies quest, blocks and cluster (policies.c), each checked after every step of a
 * synthetic stream (kv_append + kv_attend_cpu, no model) against a reference written here, keyed by position:
 *   1. quest:B,page=P: pages of P positions (every position is held, so rank = position); each page's bound
 *      mean_h Σ_d max(q_hd·min_d, q_hd·max_d)/√head_dim, brute force in double from the stream's own keys and queries
 *      (rotated here in double when RoPE is on); the query reads floor(B/P) whole pages: its own (the newest) and the
 *      others of highest bound, ties to the older page, or every page when they fit (policies.c, quest). Which
 *      positions each query read, per lane and step, via kv_lane_read; near-ties within the f32 bound are counted,
 *      reported and not compared, as tests/test_verbs.c does for topk. Bytes read per step: the scored pages' bounds
 *      (2·head_dim f32 each) plus the read keys and values. Outputs: a softmax over the read set alone;
 *   2. blocks:B,local=L,global=G,stride=S: the exact position set (first G, newest L, every S-th between, the strided
 *      part cut oldest first at B), the default stride, the bytes read;
 *   3. cluster:B,k=K,sinks=S,local=W: a reference k-means per lane written here (a key joins when it leaves the
 *      local window; the first K found clusters, later ones the nearest centroid in squared L2, ties to the older;
 *      centroids the double mean of their members), each key's cluster compared with kvlab's metadata (or, within
 *      the f32 bound of a tie, kvlab's choice followed and counted); the read set: the first S and newest W
 *      positions, then the clusters by double centroid score (ties to the older) until B, the first that does not
 *      fit cut to its newest members; near-ties within the f32 bound counted, reported and not compared; a stream of
 *      repeated keys for exact ties; bytes read (the centroids scored + the read keys and values), resident bytes,
 *      outputs; and select called a second time per step (before with another query, after with the same) changing
 *      nothing;
 *   4. the budget rules' errors, and byte budgets refused;
 *   5. the oracle property on a one-layer scripted stream whose query heads share one query per GQA group: topk:B's
 *      recall of the attention mass (the share of the dense softmax over every stored position, in double) is >=
 *      quest's, blocks' and cluster's at the same B, at every lane and step;
 *   5. prompt=dense through kv_attend_chunk (chunks that cross the prompt's end): each prompt query reads every
 *      position, with the outputs, probabilities and bytes read of a `full` cache on the same stream bit for bit and
 *      a double softmax over every position within the f32 bound; each later query reads what the same policy with
 *      prompt=sparse reads (blocks: the pattern computed here), bit for bit; the spec errors.
 * Dimensions: L layers, NH query heads, NKV kv heads, HD head_dim, T tokens. u = 2^-24, the f32 unit roundoff. */
#include "tests/test_kv_util.h"

#define L 2
#define NH 4
#define NKV 2
#define HD 8
#define MAXT 64
#define GROUPSZ (NH / NKV)
#define U 5.9604644775390625e-08
#define VB (HD * 4)   /* bytes of one f32 key or value */
/* output tolerance of tests/test_verbs.c: 64 f32 ulps of 4 */
#define OUT_TOL (64 * 4 * 1.2e-7)

/* identity: RoPE the identity to f32 precision (tshape_norope) */
static KVShape sshape(int seq_len, int identity) {
    return identity ? tshape_norope(L, NH, NKV, HD, seq_len) : tshape(L, NH, NKV, HD, seq_len);
}

/* The stream: K, V (NKV*HD) and Q (NH*HD) before RoPE, positions 0..MAXT. With dup_page P: the keys of every page
 * p = 1 (mod 3) are scaled by 3, and every page p = 0 (mod 3), p >= 3, repeats page p-2 key for key, so (RoPE off)
 * the two have equal bounds: exact ties among the highest bounds. */
static float K[MAXT + 1][L][NKV * HD], V[MAXT + 1][L][NKV * HD], Q[MAXT + 1][L][NH * HD];
static void gen_stream(uint64_t seed, int dup_page) {
    for (int t = 0; t <= MAXT; t++)
        for (int l = 0; l < L; l++) {
            trng_seed(seed * 1000003ull + (uint64_t)(t * 131 + l * 7 + 1));
            for (int j = 0; j < NKV * HD; j++) { K[t][l][j] = trng_normal(); V[t][l][j] = trng_normal(); }
            for (int j = 0; j < NH * HD; j++) Q[t][l][j] = trng_normal();
            if (dup_page) {
                int p = t / dup_page;
                if (p % 3 == 1)
                    for (int j = 0; j < NKV * HD; j++) K[t][l][j] *= 3;
                if (p >= 3 && p % 3 == 0) memcpy(K[t][l], K[t - 2 * dup_page][l], sizeof K[t][l]);
            }
        }
}

/* x (HD) rotated by position p as kv_rope defines it (theta 10000, adjacent pairs), in double; identity: as is */
static void rot_double(const float *x, int p, int identity, double *r) {
    for (int i = 0; i < HD / 2; i++) {
        double a = identity ? 0 : p * pow(10000.0, -2.0 * i / HD), c = cos(a), sn = sin(a);
        r[2 * i] = x[2 * i] * c - x[2 * i + 1] * sn;
        r[2 * i + 1] = x[2 * i] * sn + x[2 * i + 1] * c;
    }
}

/* max |out - double softmax over pos[0..n) applied to v| for query head h at (t, l), keys and query rotated */
static double out_err(int t, int l, int h, const int *pos, int n, int identity, const float *out) {
    int g = h / GROUPSZ;
    double q[HD], k[(MAXT + 1) * HD];
    const float *v[MAXT + 1];
    rot_double(&Q[t][l][h * HD], t, identity, q);
    for (int i = 0; i < n; i++) {
        rot_double(&K[pos[i]][l][g * HD], pos[i], identity, k + i * HD);
        v[i] = &V[pos[i]][l][g * HD];
    }
    return tdense_err(q, k, v, n, HD, out + h * HD);
}

static int int_cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* After the step of (t, l): the positions lane (l, g) read (kv_lane_read, one position per span) against want;
 * outputs of its query heads against a double softmax over the read positions; c->scores 0 off them. Returns 1 when
 * the read set is want. */
typedef struct { int bad_zero; double max_err; } StepChecks;
static int check_read(const KVCache *c, int t, int l, int g, const int *want, int m, int identity, const float *out,
                      StepChecks *sc, int *got, int *w_out) {
    int spans[2 * MAXT + 2], w = kv_lane_read(c, l, g, spans, MAXT + 1), ok = w == m;
    for (int j = 0; j < w; j++) {
        got[j] = spans[2 * j];
        if (spans[2 * j + 1] != spans[2 * j]) ok = 0;
    }
    for (int j = 0; ok && j < w; j++) ok = got[j] == want[j];
    *w_out = w;
    for (int hh = 0; hh < GROUPSZ; hh++) {
        int h = g * GROUPSZ + hh;
        double e = out_err(t, l, h, got, w, identity, out);
        if (!(e <= sc->max_err)) sc->max_err = e;
        for (int i = 0, j = 0; i <= t; i++) {
            if (j < w && got[j] == i) { j++; continue; }
            sc->bad_zero += c->scores[(size_t)h * c->budget + i] != 0.0f;
        }
    }
    return ok;
}

/* ---- 1. quest ---- */
typedef struct { double s, bound, lo[HD], hi[HD]; int page; } PageRef;
static int page_cmp(const void *a, const void *b) {   /* highest bound first, the older page among equals */
    const PageRef *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->page - y->page;
}

/* spec quest:B,page=P[,pos=cache] over T positions (-c = T); identity: RoPE off; want_ties: the stream has exact
 * ties among the highest bounds, and some must fall at the boundary */
static void run_quest(int B, int P, int T, int identity, int pos_cache, int want_ties) {
    char spec[64];
    snprintf(spec, sizeof spec, "quest:%d,page=%d%s", B, P, pos_cache ? ",pos=cache" : "");
    KVShape s = sshape(T, identity);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    float out[NH * HD];
    int bad_set = 0, bad_held = 0, bad_bytes = 0, ambiguous = 0, ties = 0, checked = 0, chose = 0, pos[MAXT + 1];
    int n_read = B / P;
    StepChecks sc = {0, 0};
    static PageRef pr[MAXT + 1];
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            uint64_t before = c.bytes_read, want_bytes = 0;
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                int n = t + 1, n_pages = (n + P - 1) / P, want[MAXT + 1], m = 0, amb = 0;
                if (n_pages <= n_read) {
                    for (int i = 0; i < n; i++) want[m++] = i;
                    want_bytes += (uint64_t)n * 2 * VB;
                } else {
                    double q[GROUPSZ][HD], qabs[GROUPSZ][HD], eq[GROUPSZ][HD];
                    for (int hh = 0; hh < GROUPSZ; hh++) {   /* the query as attention rotates it: by t either way */
                        const float *qf = &Q[t][l][(g * GROUPSZ + hh) * HD];
                        rot_double(qf, t, identity, q[hh]);
                        for (int d = 0; d < HD; d++) {
                            qabs[hh][d] = fabs(q[hh][d]);
                            /* f32 rotation of one element: 3u (|x_d0| + |x_d1|) (cos/sin rounding, product, sum) */
                            eq[hh][d] = identity ? 0 : 3 * U * (fabs(qf[d & ~1]) + fabs(qf[d | 1]));
                        }
                    }
                    for (int j = 0; j < n_pages - 1; j++) {
                        PageRef *r = &pr[j];
                        double ek[HD];
                        r->page = j;
                        for (int d = 0; d < HD; d++) { r->lo[d] = INFINITY; r->hi[d] = -INFINITY; ek[d] = 0; }
                        for (int i = j * P; i < (j + 1) * P; i++) {
                            double k[HD];
                            const float *kf = &K[i][l][g * HD];
                            rot_double(kf, i, identity, k);
                            for (int d = 0; d < HD; d++) {
                                r->lo[d] = k[d] < r->lo[d] ? k[d] : r->lo[d];
                                r->hi[d] = k[d] > r->hi[d] ? k[d] : r->hi[d];
                                double e = identity ? 0 : 3 * U * (fabs(kf[d & ~1]) + fabs(kf[d | 1]));
                                ek[d] = e > ek[d] ? e : ek[d];
                            }
                        }
                        double sum = 0, abs_sum = 0, rot_err = 0;
                        for (int hh = 0; hh < GROUPSZ; hh++)
                            for (int d = 0; d < HD; d++) {
                                double a = q[hh][d] * r->lo[d], b = q[hh][d] * r->hi[d], x = a > b ? a : b;
                                double ext = fmax(fabs(r->lo[d]), fabs(r->hi[d]));
                                sum += x;
                                abs_sum += fabs(x);
                                rot_err += qabs[hh][d] * ek[d] + ext * eq[hh][d] + ek[d] * eq[hh][d];
                            }
                        double norm = GROUPSZ * sqrt((double)HD);
                        r->s = sum / norm;
                        /* kvlab's f32 (as topk's bound in tests/test_verbs.c): an HD-term sum (HD·u Σ|x_d|), the
                           products, scale, group sum and division (4u), relative to Σ|x_d|; twice the first-order
                           rotation errors of keys and queries when RoPE is on */
                        r->bound = ((HD + 4) * U * abs_sum + 2 * rot_err) / norm;
                    }
                    int nc = n_pages - 1, k = n_read - 1;   /* candidates, and how many are chosen */
                    qsort(pr, (size_t)nc, sizeof *pr, page_cmp);
                    for (int a = 0; a < k; a++)        /* a chosen and an unchosen page the f32 bounds may order */
                        for (int b = k; b < nc; b++)   /* otherwise (pages of equal keys tie exactly: not ambiguous) */
                            if (fabs(pr[a].s - pr[b].s) <= pr[a].bound + pr[b].bound &&
                                (memcmp(pr[a].lo, pr[b].lo, sizeof pr[a].lo) ||
                                 memcmp(pr[a].hi, pr[b].hi, sizeof pr[a].hi)))
                                amb = 1;
                    ties += pr[k - 1].s == pr[k].s;
                    int pages[MAXT + 1];
                    for (int j = 0; j < k; j++) pages[j] = pr[j].page;
                    pages[k] = n_pages - 1;
                    qsort(pages, (size_t)k + 1, sizeof *pages, int_cmp);
                    for (int j = 0; j <= k; j++)
                        for (int i = pages[j] * P; i < (pages[j] + 1) * P && i < n; i++) want[m++] = i;
                    want_bytes += (uint64_t)(n_pages - 1) * 2 * VB + (uint64_t)m * 2 * VB;
                    chose++;
                }
                int got[MAXT + 1], w;
                int ok = check_read(&c, t, l, g, want, m, identity, out, &sc, got, &w);
                checked++;
                if (amb) ambiguous++;
                else if (!ok) {
                    if (!bad_set) {
                        char a[512], b2[512];
                        tprint_set(a, sizeof a, got, w);
                        tprint_set(b2, sizeof b2, want, m);
                        printf("  %s: t=%d layer %d kv head %d read {%s}, reference {%s}\n", spec, t, l, g, a, b2);
                    }
                    bad_set++;
                }
                int np = kv_lane_positions(&c, l, g, pos, MAXT + 1), held = np == n;
                for (int i = 0; held && i < np; i++) held = pos[i] == i;
                bad_held += !held;
            }
            bad_bytes += c.bytes_read - before != want_bytes;
        }
    CHECK(bad_set == 0 && checked == T * L * NKV && chose > 0, "%s: each query reads %d whole pages of %d (its own and "
          "those of highest double bound, ties to the older; all when they fit) after each of %d steps (%d lane-steps, "
          "%d with a choice, %d differ, %d ambiguous within the f32 bound and not compared, %d exact ties at the "
          "boundary)", spec, n_read, P, T, checked, chose, bad_set, ambiguous, ties);
    if (want_ties)
        CHECK(ties > 0, "%s: the stream's equal pages tie exactly at the boundary (%d lane-steps), where the older "
              "page is read", spec, ties);
    CHECK(bad_held == 0, "%s: every lane holds positions 0..t at every step (%d lane-steps differ)", spec, bad_held);
    CHECK(bad_bytes == 0, "%s: bytes read per layer-step = the bounds of the pages scored (2 x %d f32 each, all but "
          "the newest; none when every page fits) + the keys and values read (%d layer-steps differ)", spec, HD,
          bad_bytes);
    CHECK_LE(sc.max_err, OUT_TOL, "%s: each query head's output equals a double softmax over the read positions alone "
             "(max err %.3g <= %.3g)", spec, sc.max_err, OUT_TOL);
    CHECK(sc.bad_zero == 0, "%s: c->scores is 0 at every unread rank (%d nonzero)", spec, sc.bad_zero);
    int rc = kv_append(&c, 0, T, K[T][0], V[T][0]);
    CHECK(kv_capacity(&c) == T && rc == -1, "%s stops at -c like full: kv_capacity %d == %d, kv_append of position %d "
          "returns %d (want -1)", spec, kv_capacity(&c), T, T, rc);
done:
    kv_cache_free(&c);
}

static void test_quest(void) {
    gen_stream(1, 4);
    run_quest(8, 4, 60, 1, 0, 1);    /* one chosen page: the equal pages tie at the boundary */
    run_quest(16, 4, 60, 1, 0, 0);
    run_quest(18, 4, 60, 1, 0, 0);   /* 18 rounds down to 4 pages */
    gen_stream(2, 0);
    run_quest(16, 5, 60, 1, 0, 0);   /* pages of 5: the newest page partial at most steps */
    run_quest(12, 3, 60, 0, 0, 0);   /* RoPE on: bounds of the rotated keys */
    run_quest(12, 3, 60, 0, 1, 0);   /* pos=cache: keys rotated by rank = position, the query by n-1 = t */
}

/* ---- 2. blocks ---- */
/* spec blocks:B[,global=G][,local=L][,stride=S] (0: not given, the default) over T positions with -c = ctx */
static void run_blocks(int B, int G, int Lc, int S, int T, int ctx) {
    char spec[80];
    int w = snprintf(spec, sizeof spec, "blocks:%d", B);
    if (G >= 0) w += snprintf(spec + w, sizeof spec - w, ",global=%d", G);
    if (Lc) w += snprintf(spec + w, sizeof spec - w, ",local=%d", Lc);
    if (S) w += snprintf(spec + w, sizeof spec - w, ",stride=%d", S);
    if (G < 0) G = 4;
    if (!Lc) Lc = B / 2;
    int given = S;
    if (!S)   /* the default: the smallest stride whose strided positions at t = ctx-1 fit in B - G - L */
        for (S = 1;; S++) {
            int cnt = 0;
            for (int p = G; p <= ctx - 1 - Lc; p++) cnt += p % S == 0;
            if (cnt <= B - G - Lc) break;
        }
    KVShape s = sshape(ctx, 1);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    char desc[256], want_desc[48];
    kv_describe(&c, desc, sizeof desc);
    snprintf(want_desc, sizeof want_desc, "local=%d global=%d stride=%d", Lc, G, S);
    if (!given) CHECK(strstr(desc, want_desc) != NULL, "%s with -c %d resolves to %s (%s)", spec, ctx, want_desc, desc);
    float out[NH * HD];
    int bad_set = 0, bad_bytes = 0, checked = 0, cut = 0;
    StepChecks sc = {0, 0};
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            uint64_t before = c.bytes_read, want_bytes = 0;
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                int want[MAXT + 1], n_cut, m = tblocks_ref(t, B, G, Lc, S, want, &n_cut), got[MAXT + 1], n;
                cut += n_cut > 0;
                want_bytes += (uint64_t)m * 2 * VB;
                int ok = check_read(&c, t, l, g, want, m, 1, out, &sc, got, &n);
                checked++;
                if (!ok && !bad_set) {
                    char a[512], b2[512];
                    tprint_set(a, sizeof a, got, n);
                    tprint_set(b2, sizeof b2, want, m);
                    printf("  %s: t=%d layer %d kv head %d read {%s}, reference {%s}\n", spec, t, l, g, a, b2);
                }
                bad_set += !ok;
            }
            bad_bytes += c.bytes_read - before != want_bytes;
        }
    CHECK(bad_set == 0 && checked == T * L * NKV, "%s (global %d, local %d, stride %d): each query reads the first %d, "
          "the %d newest and every %d-th position between, the strided part cut oldest first beyond %d, after each of "
          "%d steps (%d lane-steps, %d cut by the cap, %d differ)", spec, G, Lc, S, G, Lc, S, B, T, checked, cut,
          bad_set);
    CHECK(bad_bytes == 0, "%s: bytes read per layer-step = the keys and values of the set (%d layer-steps differ)",
          spec, bad_bytes);
    CHECK_LE(sc.max_err, OUT_TOL, "%s: each query head's output equals a double softmax over the read positions alone "
             "(max err %.3g <= %.3g)", spec, sc.max_err, OUT_TOL);
    CHECK(sc.bad_zero == 0, "%s: c->scores is 0 at every unread rank (%d nonzero)", spec, sc.bad_zero);
done:
    kv_cache_free(&c);
}

static void test_blocks(void) {
    gen_stream(3, 0);
    run_blocks(16, -1, 0, 0, 60, 60);   /* defaults: G 4, L 8, the stride that fits at -c 60 */
    run_blocks(16, 4, 8, 3, 60, 60);    /* stride 3: the cap cuts the oldest strided positions */
    run_blocks(10, 0, 3, 5, 60, 60);    /* no global part */
    run_blocks(12, 2, 9, 0, 60, 64);    /* one strided slot: the default stride for -c 64 */
    run_blocks(8, 3, 4, 1000, 60, 60);  /* a stride past the context: the A-shape, sink + local */
}

/* ---- 3. cluster ---- */
/* The stream of ties mode: every key one of three integer vectors (the seeds repeat them, so clusters of equal
 * centroids tie exactly, in distance and in score, and every centroid stays exact in f32); values and queries as
 * gen_stream. */
static void gen_cluster_ties(uint64_t seed) {
    /* no zero entry: RoPE made the identity leaves a nonzero x as it is, but turns a 0 beside y into ~1e-26·y */
    static const float vec[3][HD] = {{2, 1, -1, 1, -1, 2, -2, 1}, {-1, 2, 1, -2, 2, -1, 1, -2},
                                     {1, -2, 2, -1, 1, 1, 1, 2}};
    gen_stream(seed, 0);
    for (int t = 0; t <= MAXT; t++)
        for (int l = 0; l < L; l++)
            for (int g = 0; g < NKV; g++) memcpy(&K[t][l][g * HD], vec[(t * 2 + l + g) % 3], sizeof vec[0]);
}

/* The reference clustering of one lane, from the rules in policies.c (cluster): a key joins when it leaves the local
 * window; the first K found clusters; later ones the nearest centroid (squared L2; ties to the older); a centroid is
 * the double sum of its members, in the order they joined, over their count. ek: the largest f32 rotation error of a
 * member per channel, mabs: the largest |member| (RoPE on). */
typedef struct {
    int nc, count[MAXT + 1], of[MAXT + 1];   /* clusters, members of each, the cluster of each position (-1 none) */
    double sum[MAXT + 1][HD], ek[MAXT + 1][HD], mabs[MAXT + 1][HD];
} ClusterRef;
typedef struct { double s, bound, c[HD]; int id; } ClusterRank;
static int cluster_rank_cmp(const void *a, const void *b) {   /* highest score first, the older cluster among equals */
    const ClusterRank *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->id - y->id;
}

/* The centroid of cluster j in double, and ec, a bound on |kvlab's f32 centroid - it| per channel: with RoPE off the
 * sums are the same double operations on the same f32 keys, so kvlab's centroid is this one rounded to f32 and ec
 * is that rounding, exactly; with RoPE on, the members' rotation errors, the rounding (u) and the double sum's. */
static void ref_centroid(const ClusterRef *r, int j, int identity, double *c, double *ec) {
    for (int d = 0; d < HD; d++) {
        c[d] = r->sum[j][d] / r->count[j];
        ec[d] = identity ? fabs(c[d] - (double)(float)c[d])
                         : r->ek[j][d] + U * (fabs(c[d]) + r->ek[j][d]) + 1e-14 * r->mabs[j][d];
    }
}

/* kvlab's cluster of lane (l, g)'s rank i (its metadata: 0 none, else 1 + the cluster) */
static int impl_cluster(const KVCache *c, int l, int g, int i) {
    int32_t id;
    memcpy(&id, kv_rank_meta(&c->lanes[l * NKV + g], i, 4), 4);
    return id - 1;
}

typedef struct { int bad_assign, amb_assign, tie_assign, amb_set, tie_set, cut; } ClusterCounts;

/* The key at position p joins lane (l, g)'s reference; kvlab's choice (from its metadata) is compared, or followed
 * where the distances are within the f32 bound of each other. */
static void ref_join(ClusterRef *r, const KVCache *c, int K_, int l, int g, int p, int identity, ClusterCounts *cc) {
    const float *kf = &K[p][l][g * HD];
    double k[HD], ek[HD];
    rot_double(kf, p, identity, k);
    for (int d = 0; d < HD; d++) ek[d] = identity ? 0 : 3 * U * (fabs(kf[d & ~1]) + fabs(kf[d | 1]));
    int got = impl_cluster(c, l, g, p), j = r->nc;
    if (r->nc < K_) r->nc++;
    else {
        double dist[MAXT + 1], bound[MAXT + 1];
        j = 0;
        for (int i = 0; i < K_; i++) {
            double cen[HD], ec[HD], d2 = 0, b = 0;
            ref_centroid(r, i, identity, cen, ec);
            for (int d = 0; d < HD; d++) {
                double x = k[d] - cen[d], e = ek[d] + ec[d];
                d2 += x * x;
                b += 2 * fabs(x) * e + e * e;
            }
            /* with no error to bound, kvlab computes these very double operations: no rounding apart */
            dist[i] = d2;
            bound[i] = b > 0 ? b + 1e-14 * (d2 + 1) : 0;
            if (d2 < dist[j]) j = i;
        }
        int amb = 0, tie = 0, got_ok = 0;
        for (int i = 0; i < K_; i++) {
            if (i != j && dist[i] - dist[j] <= bound[i] + bound[j]) {
                if (bound[i] + bound[j] > 0) amb = 1;
                else tie = 1;   /* exact: the older, j, by the rule */
            }
            if (i == got) got_ok = dist[i] - dist[j] <= bound[i] + bound[j];
        }
        cc->tie_assign += tie;
        if (amb) { cc->amb_assign++; if (got_ok) j = got; }
    }
    cc->bad_assign += got != j;
    r->count[j]++;
    r->of[p] = j;
    for (int d = 0; d < HD; d++) {
        r->sum[j][d] += k[d];
        r->ek[j][d] = ek[d] > r->ek[j][d] ? ek[d] : r->ek[j][d];
        r->mabs[j][d] = fabs(k[d]) > r->mabs[j][d] ? fabs(k[d]) : r->mabs[j][d];
    }
}

/* The reference read set of lane (l, g) at t: want (positions, increasing); *amb when the f32 scores may order the
 * clusters that decide it otherwise; returns the count, and the centroids scored in *scored. */
static int ref_cluster_read(const ClusterRef *r, int B, int S, int W, int t, int l, int g, int identity, int *want,
                            int *amb, int *scored, ClusterCounts *cc) {
    int n = t + 1, m = 0, n_static = 0;
    *amb = 0;
    *scored = 0;
    if (n <= B) { for (int p = 0; p < n; p++) want[m++] = p; return m; }
    for (int p = 0; p < n; p++) n_static += p < S || p > t - W;
    double q[GROUPSZ][HD], eq[GROUPSZ][HD];
    for (int hh = 0; hh < GROUPSZ; hh++) {   /* the query as attention rotates it: by t either way */
        const float *qf = &Q[t][l][(g * GROUPSZ + hh) * HD];
        rot_double(qf, t, identity, q[hh]);
        for (int d = 0; d < HD; d++) eq[hh][d] = identity ? 0 : 3 * U * (fabs(qf[d & ~1]) + fabs(qf[d | 1]));
    }
    static ClusterRank cr[MAXT + 1];
    for (int j = 0; j < r->nc; j++) {
        double ec[HD], sum = 0, abs_sum = 0, cen_err = 0;
        ref_centroid(r, j, identity, cr[j].c, ec);
        for (int hh = 0; hh < GROUPSZ; hh++)
            for (int d = 0; d < HD; d++) {
                double x = q[hh][d] * cr[j].c[d];
                sum += x;
                abs_sum += fabs(x);
                cen_err += fabs(q[hh][d]) * ec[d] + fabs(cr[j].c[d]) * eq[hh][d] + ec[d] * eq[hh][d];
            }
        double norm = GROUPSZ * sqrt((double)HD);
        cr[j].id = j;
        cr[j].s = sum / norm;
        /* kvlab's f32: an HD-term dot (HD·u Σ|x_d|), the products, the scale (itself rounded twice), the group's sum
           and division ((HD + 6)·u in all, relative to Σ|x_d|), plus the centroid's error (ec) and the query's
           rotation error */
        cr[j].bound = ((HD + 6) * U * abs_sum + cen_err) / norm;
    }
    *scored = r->nc;
    qsort(cr, (size_t)r->nc, sizeof *cr, cluster_rank_cmp);
    int take[MAXT + 1] = {0}, room = B - n_static, last = -1;
    for (int j = 0; j < r->nc && room > 0; j++) {
        int id = cr[j].id;
        take[id] = r->count[id] < room ? r->count[id] : room;
        cc->cut += take[id] < r->count[id];
        room -= take[id];
        last = j;
    }
    /* an order the f32 scores may swap across the last cluster read changes the set; equal centroids tie exactly */
    for (int a = 0; a <= last; a++)
        for (int b = a + 1 > last ? a + 1 : last; b < r->nc; b++) {
            if (b == a) continue;
            int same = !memcmp(cr[a].c, cr[b].c, sizeof cr[a].c);
            if (same) cc->tie_set += cr[a].s == cr[b].s && b > a;
            else if (fabs(cr[a].s - cr[b].s) <= cr[a].bound + cr[b].bound) *amb = 1;
        }
    for (int p = t; p >= 0; p--)   /* newest first: a cut cluster keeps its newest members */
        if (p < S || p > t - W || take[r->of[p]]-- > 0) want[m++] = p;
    qsort(want, (size_t)m, sizeof *want, int_cmp);
    return m;
}

/* spec cluster:B[,k=K][,sinks=S][,local=W] (0 or -1 for S: not given, the default) over T positions (-c = T);
 * identity: RoPE off; want_ties: the stream must bring exact ties in assignment and at the read boundary; want_cut:
 * some query must read a cluster in part */
static void run_cluster(int B, int K_, int S, int W, int T, int identity, int pos_cache, int want_ties, int want_cut) {
    char spec[96];
    int w = snprintf(spec, sizeof spec, "cluster:%d", B);
    if (K_) w += snprintf(spec + w, sizeof spec - w, ",k=%d", K_);
    if (S >= 0) w += snprintf(spec + w, sizeof spec - w, ",sinks=%d", S);
    if (W) w += snprintf(spec + w, sizeof spec - w, ",local=%d", W);
    if (pos_cache) snprintf(spec + w, sizeof spec - w, ",pos=cache");
    if (!K_) K_ = B / 4 > 1 ? B / 4 : 1;
    if (S < 0) S = 4;
    if (!W) W = B / 4 > 1 ? B / 4 : 1;
    KVShape s = sshape(T, identity);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    char desc[256], want_desc[64];
    kv_describe(&c, desc, sizeof desc);
    snprintf(want_desc, sizeof want_desc, "k=%d sinks=%d local=%d", K_, S, W);
    CHECK(strstr(desc, want_desc) != NULL, "%s resolves to %s (%s)", spec, want_desc, desc);
    float out[NH * HD];
    static ClusterRef ref[L * NKV];
    memset(ref, 0, sizeof ref);
    for (int i = 0; i < L * NKV; i++) for (int p = 0; p <= MAXT; p++) ref[i].of[p] = -1;
    ClusterCounts cc = {0};
    int bad_set = 0, bad_held = 0, bad_bytes = 0, bad_meta = 0, checked = 0, chose = 0, pos[MAXT + 1];
    StepChecks sc = {0, 0};
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append failed at t=%d", spec, t); goto done; }
            uint64_t before = c.bytes_read, want_bytes = 0;
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                ClusterRef *r = &ref[l * NKV + g];
                if (t - W >= S && t - W >= 0) ref_join(r, &c, K_, l, g, t - W, identity, &cc);
                for (int p = 0; p <= t; p++)   /* not clustered: the sinks and the local window */
                    bad_meta += (p < S || p > t - W) && impl_cluster(&c, l, g, p) != -1;
                int want[MAXT + 1], amb, scored, m = ref_cluster_read(r, B, S, W, t, l, g, identity, want, &amb,
                                                                       &scored, &cc);
                want_bytes += (uint64_t)scored * VB + (uint64_t)m * 2 * VB;
                chose += t + 1 > B;
                int got[MAXT + 1], nr;
                int ok = check_read(&c, t, l, g, want, m, identity, out, &sc, got, &nr);
                checked++;
                if (amb) cc.amb_set++;
                else if (!ok) {
                    if (!bad_set) {
                        char a[512], b2[512];
                        tprint_set(a, sizeof a, got, nr);
                        tprint_set(b2, sizeof b2, want, m);
                        printf("  %s: t=%d layer %d kv head %d read {%s}, reference {%s}\n", spec, t, l, g, a, b2);
                    }
                    bad_set++;
                }
                int np = kv_lane_positions(&c, l, g, pos, MAXT + 1), held = np == t + 1;
                for (int i = 0; held && i < np; i++) held = pos[i] == i;
                bad_held += !held;
            }
            bad_bytes += c.bytes_read - before != want_bytes;
        }
    CHECK(cc.bad_assign == 0 && bad_meta == 0, "%s: each key joins the reference's cluster when it leaves the local "
          "window (first %d found clusters, then the nearest centroid in double, ties to the older): %d differ, %d "
          "within the f32 bound (kvlab's choice followed), %d exact ties; sinks and local window unclustered (%d "
          "not)", spec, K_, cc.bad_assign, cc.amb_assign, cc.tie_assign, bad_meta);
    CHECK(bad_set == 0 && checked == T * L * NKV && chose > 0, "%s: each query reads the first %d, the %d newest and "
          "the clusters of highest double centroid score (ties to the older), the first that does not fit cut to "
          "its newest, %d in all, after each of %d steps (%d lane-steps, %d with a choice, %d differ, %d ambiguous "
          "within the f32 bound and not compared, %d exact ties across the boundary, %d cuts)", spec, S, W, B, T,
          checked, chose, bad_set, cc.amb_set, cc.tie_set, cc.cut);
    if (want_ties)
        CHECK(cc.tie_assign > 0 && cc.tie_set > 0, "%s: the stream's equal keys tie exactly in assignment (%d joins) "
              "and across the read boundary (%d), where the older cluster wins", spec, cc.tie_assign, cc.tie_set);
    if (want_cut) CHECK(cc.cut > 0, "%s: some queries read a cluster in part, its newest members (%d)", spec, cc.cut);
    CHECK(bad_held == 0, "%s: every lane holds positions 0..t at every step (%d lane-steps differ)", spec, bad_held);
    CHECK(bad_bytes == 0, "%s: bytes read per layer-step = the centroids scored (%d f32 each; none when every key "
          "fits) + the keys and values read (%d layer-steps differ)", spec, HD, bad_bytes);
    CHECK_LE(sc.max_err, OUT_TOL, "%s: each query head's output equals a double softmax over the read positions alone "
             "(max err %.3g <= %.3g)", spec, sc.max_err, OUT_TOL);
    CHECK(sc.bad_zero == 0, "%s: c->scores is 0 at every unread rank (%d nonzero)", spec, sc.bad_zero);
    KVBytes kb = kv_bytes(&c);
    KVShape s0 = sshape(T, identity);
    KVCache f;
    if (!tcache(&f, &s0, "full")) {
        size_t want = kv_bytes(&f).total_alloc + (size_t)L * NKV * T * 4;
        CHECK(kb.total_alloc == want, "%s: resident bytes = full's + 4 bytes of cluster id per slot (%zu == %zu)", spec,
              kb.total_alloc, want);
        kv_cache_free(&f);
    }
    int rc = kv_append(&c, 0, T, K[T][0], V[T][0]);
    CHECK(kv_capacity(&c) == T && rc == -1, "%s stops at -c like full: kv_capacity %d == %d, kv_append of position %d "
          "returns %d (want -1)", spec, kv_capacity(&c), T, T, rc);
done:
    kv_cache_free(&c);
}

/* select called twice per lane and step, once before the attention with another query (the next step's, as a
 * prefetch would predict it) and once after with the step's own: the second cache reads what the first reads, with
 * the same output bits and clusters, and the call after returns the set the attention read. RoPE off, f32: the keys
 * attention sees are the stream's own. */
static void run_cluster_twice(const char *spec, int T) {
    KVShape s = sshape(T, 1);
    KVCache a, b;
    if (tcache(&a, &s, spec)) return;
    if (tcache(&b, &s, spec)) { kv_cache_free(&a); return; }
    const KVPolicyOps *ops = b.policy.ops;
    float oa[NH * HD], ob[NH * HD], keys[(MAXT + 1) * HD];
    int bad_out = 0, bad_again = 0, bad_meta = 0, ranks[MAXT + 1], sa[2 * MAXT + 2], sb[2 * MAXT + 2];
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&a, l, t, K[t][l], V[t][l]);
            kv_append(&b, l, t, K[t][l], V[t][l]);
            for (int g = 0; g < NKV; g++) {
                for (int p = 0; p <= t; p++) memcpy(keys + p * HD, &K[p][l][g * HD], sizeof(float) * HD);
                ops->select(&b.policy, l * NKV + g, &b.lanes[l * NKV + g], t, NULL, keys,
                            &Q[t + 1][l][g * GROUPSZ * HD], ranks, b.budget);
            }
            kv_attend_cpu(&a, oa, l, t, Q[t][l]);
            kv_attend_cpu(&b, ob, l, t, Q[t][l]);
            bad_out += memcmp(oa, ob, sizeof oa) != 0;
            for (int g = 0; g < NKV; g++) {
                for (int p = 0; p <= t; p++) memcpy(keys + p * HD, &K[p][l][g * HD], sizeof(float) * HD);
                int m = ops->select(&b.policy, l * NKV + g, &b.lanes[l * NKV + g], t, NULL, keys,
                                    &Q[t][l][g * GROUPSZ * HD], ranks, b.budget);
                int na = kv_lane_read(&a, l, g, sa, MAXT + 1), nb = kv_lane_read(&b, l, g, sb, MAXT + 1);
                int same = na == nb && na == m && !memcmp(sa, sb, sizeof(int) * 2 * (size_t)na);
                for (int j = 0; same && j < m; j++) same = sb[2 * j] == ranks[j];
                bad_again += !same;
                for (int p = 0; p <= t; p++) bad_meta += impl_cluster(&a, l, g, p) != impl_cluster(&b, l, g, p);
            }
        }
    CHECK(bad_out == 0 && bad_again == 0 && bad_meta == 0, "%s: with select called again before each step's "
          "attention (with the next query) and after it (with its own), every query reads the same set with the same "
          "output bits and clusters as without (%d layer-steps differ in output, %d lane-steps in the set or the "
          "repeated call's answer, %d cluster ids)", spec, bad_out, bad_again, bad_meta);
    /* kv_cache_reset forgets the clustering: the stream fed again reads what it read the first time */
    static float rec[MAXT][L][NH * HD];
    int bad_reset = 0;
    kv_cache_reset(&a);
    kv_cache_reset(&b);
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&a, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&a, rec[t][l], l, t, Q[t][l]);
        }
    kv_cache_reset(&a);
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&a, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&a, oa, l, t, Q[t][l]);
            bad_reset += memcmp(oa, rec[t][l], sizeof oa) != 0;
        }
    CHECK(bad_reset == 0, "%s: after kv_cache_reset the same stream gives the same output bits (%d layer-steps "
          "differ)", spec, bad_reset);
    kv_cache_free(&a);
    kv_cache_free(&b);
}

static void test_cluster(void) {
    gen_stream(5, 0);
    run_cluster(16, 0, -1, 0, 60, 1, 0, 0, 1);   /* defaults: k 4, sinks 4, local 4 */
    run_cluster(16, 6, 2, 3, 60, 1, 0, 0, 1);
    run_cluster(10, 3, 0, 1, 60, 1, 0, 0, 1);    /* no sinks, the local window the query alone */
    run_cluster(12, 64, 2, 2, 60, 1, 0, 0, 0);   /* more clusters than keys: one key each, the top keys by score */
    run_cluster(16, 4, -1, 0, 60, 0, 0, 0, 1);   /* RoPE on: clusters of the rotated keys */
    run_cluster(16, 4, -1, 0, 60, 0, 1, 0, 1);   /* pos=cache: keys rotated by rank = position, the query by n-1 = t */
    gen_cluster_ties(6);
    run_cluster(12, 5, 1, 2, 60, 1, 0, 1, 1);
    gen_stream(7, 0);
    run_cluster_twice("cluster:16,k=4", 60);
    run_cluster_twice("cluster:12,k=3,sinks=1,local=2,pos=cache", 60);
}

/* ---- 4. budget rules ---- */
static void expect_init_error(const char *spec, const char *needle, const char *needle2) {
    KVShape s = sshape(64, 1);
    char err[512];
    int rc = tcache_error(&s, spec, err, sizeof err);
    CHECK(rc == -1 && strstr(err, needle) && (!needle2 || strstr(err, needle2)), "'%s' is refused with a message "
          "naming '%s'%s%s (%s)", spec, needle, needle2 ? " and " : "", needle2 ? needle2 : "", err);
}

static void test_budgets(void) {
    expect_init_error("quest:8,page=8", "at least two pages", "page <= 4");
    expect_init_error("quest:16", "page=16", "a budget >= 32");   /* the paper's page of 16 needs B >= 32 */
    expect_init_error("quest:1,page=1", "a budget >= 2", NULL);
    expect_init_error("quest:16,page=0", "bad page=0", NULL);
    expect_init_error("quest:1MiB", "quest:256", NULL);
    expect_init_error("quest:16,page=4,local=2", "takes no option 'local'", "page=P");
    expect_init_error("blocks:8", "global=4 and local=4", "local <= 3");   /* defaults: G + L = 8 */
    expect_init_error("blocks:16,local=12", "global=4 and local=12", "a budget >= 17");
    expect_init_error("blocks:16,stride=0", "bad stride=0", NULL);
    expect_init_error("blocks:16KiB", "blocks:256", NULL);
    expect_init_error("blocks", "needs a budget", NULL);
    expect_init_error("cluster:5", "sinks=4 and local=1", "a budget >= 6, or fewer sinks (local=1 and sinks <= 3)");
    expect_init_error("cluster:16,sinks=15", "sinks=15 and local=4", "fewer sinks (local=1 and sinks <= 14)");
    expect_init_error("cluster:16,local=12", "sinks=4 and local=12", "local <= 11");
    expect_init_error("cluster:8,sinks=4,local=4", "a budget >= 9", "local <= 3");
    expect_init_error("cluster:16,k=0", "bad k=0", "[1, 4096]");
    expect_init_error("cluster:16,k=5000", "bad k=5000", NULL);
    expect_init_error("cluster:16,local=0", "bad local=0", NULL);
    expect_init_error("cluster:1MiB", "cluster:256", NULL);
    expect_init_error("cluster", "needs a budget", NULL);
    expect_init_error("cluster:16,page=4", "takes no option 'page'", "k=K");
}

/* ---- 5. the oracle property ---- */
#define OT 128
#define OL 1
static float OK_[OT][NKV * HD], OV[OT][NKV * HD], OQ[OT][NH * HD];

/* One layer; the query heads of a group share one query (so the group-mean score topk ranks by is each head's score,
 * and its top B carry the most probability). The script: every third query looks at an earlier key (a retrieval),
 * every third at one of the 3 newest (local), the rest random; keys and values normal. */
static void gen_oracle(uint64_t seed) {
    trng_seed(seed);
    for (int t = 0; t < OT; t++) {
        for (int j = 0; j < NKV * HD; j++) { OK_[t][j] = trng_normal(); OV[t][j] = trng_normal(); }
        for (int g = 0; g < NKV; g++) {
            float q[HD];
            int kind = t % 3, r = kind == 0 ? (int)(trng_u64() % (uint64_t)(t + 1))
                                            : t - (int)(trng_u64() % (uint64_t)(t < 3 ? t + 1 : 3));
            for (int d = 0; d < HD; d++)
                q[d] = kind == 2 ? 1.5f * trng_normal() : 2.0f * OK_[r][g * HD + d] + 0.5f * trng_normal();
            for (int hh = 0; hh < GROUPSZ; hh++) memcpy(&OQ[t][(g * GROUPSZ + hh) * HD], q, sizeof q);
        }
    }
}

static void test_oracle(void) {
    gen_oracle(7);
    const char *specs[] = {"topk:16", "quest:16,page=4", "quest:16,page=8", "blocks:16",
                           "blocks:16,global=4,local=8,stride=8", "blocks:16,global=1,local=14,stride=1000",
                           "cluster:16", "cluster:16,k=8,sinks=1,local=2", "cluster:16,k=64,sinks=0,local=1"};
    enum { NS = sizeof specs / sizeof specs[0] };
    KVShape s = tshape_norope(OL, NH, NKV, HD, OT);   /* the scores are the plain dot products the script aims */
    KVCache c[NS];
    int ok_init = 1;
    for (int i = 0; i < NS; i++)
        if (tcache(&c[i], &s, specs[i])) {
            for (int j = 0; j < i; j++) kv_cache_free(&c[j]);
            ok_init = 0;
            break;
        }
    if (!ok_init) return;
    float out[NH * HD];
    double sum_rec[NS] = {0}, worst = INFINITY;   /* worst: min over lane-steps and policies of topk - other */
    int below[NS] = {0}, steps = 0, worst_t = -1, worst_pol = 0, spans[2 * OT];
    for (int t = 0; t < OT; t++) {
        for (int i = 0; i < NS; i++) {
            kv_append(&c[i], 0, t, OK_[t], OV[t]);
            kv_attend_cpu(&c[i], out, 0, t, OQ[t]);
        }
        for (int g = 0; g < NKV; g++) {
            /* the dense softmax over every stored position, in double (shared query: one per group) */
            double p[OT], mx = -1e300, z = 0, rec[NS];
            for (int i = 0; i <= t; i++) {
                double d = 0;
                for (int j = 0; j < HD; j++) d += (double)OQ[t][g * GROUPSZ * HD + j] * OK_[i][g * HD + j];
                p[i] = d / sqrt((double)HD);
                mx = p[i] > mx ? p[i] : mx;
            }
            for (int i = 0; i <= t; i++) { p[i] = exp(p[i] - mx); z += p[i]; }
            for (int x = 0; x < NS; x++) {
                int w = kv_lane_read(&c[x], 0, g, spans, OT);
                rec[x] = 0;
                for (int j = 0; j < w; j++)
                    for (int pp = spans[2 * j]; pp <= spans[2 * j + 1]; pp++) rec[x] += p[pp] / z;
                sum_rec[x] += rec[x];
            }
            /* topk's f32 ranking may swap keys whose double scores are within ~1e-6: a probability of that order */
            for (int x = 1; x < NS; x++) {
                double d = rec[0] - rec[x];
                below[x] += d < -1e-6;
                if (d < worst) { worst = d; worst_t = t; worst_pol = x; }
            }
            steps++;
        }
    }
    int bad = 0;
    for (int x = 1; x < NS; x++) bad += below[x];
    CHECK(bad == 0, "oracle: on %d lane-steps of a one-layer scripted stream (query heads sharing one query per group), "
          "topk:16's attention-mass recall is >= every other selection policy's at the same budget (%d lane-steps "
          "below by more than 1e-6; the smallest margin %.3g, %s at t=%d)", steps, bad, worst, specs[worst_pol],
          worst_t);
    char line[512];
    int o = 0;
    for (int x = 0; x < NS; x++)
        o += snprintf(line + o, sizeof line - (size_t)o, "%s%s %.4f", x ? ", " : "", specs[x], sum_rec[x] / steps);
    CHECK(sum_rec[0] / steps < 1 && sum_rec[0] > sum_rec[1], "oracle: mean recall over %d lane-steps: %s", steps, line);
    for (int i = 0; i < NS; i++) kv_cache_free(&c[i]);
}

/* ---- 5. prompt=dense ---- */
/* What kv_attend_chunk's hook saw after each token's step 4: the positions read (kv_lane_read, one per span), the
 * probabilities, the bytes read by that token's layer-step. */
typedef struct {
    const KVCache *c;
    uint64_t last_bytes, bytes[MAXT][L];
    int n_read[MAXT][L][NKV], read[MAXT][L][NKV][MAXT], spans_ok;
    float p[MAXT][L][NH][MAXT];
    float out[MAXT][L][NH * HD];
} Trace;
static Trace traces[3];

static void trace_hook(void *ctx, int l, const KVCache *c, int pos) {
    Trace *tr = ctx;
    int spans[2 * MAXT];
    tr->bytes[pos][l] = c->bytes_read - tr->last_bytes;
    tr->last_bytes = c->bytes_read;
    for (int g = 0; g < NKV; g++) {
        int w = kv_lane_read(c, l, g, spans, MAXT);
        tr->n_read[pos][l][g] = w;
        for (int j = 0; j < w; j++) {
            tr->read[pos][l][g][j] = spans[2 * j];
            tr->spans_ok &= spans[2 * j] == spans[2 * j + 1];
        }
    }
    for (int h = 0; h < NH; h++)
        for (int i = 0; i <= pos; i++) tr->p[pos][l][h][i] = c->scores[(size_t)h * c->budget + i];
}

/* The stream's T tokens through cache c, layer by layer in chunks of `chunk` tokens (kv_attend_chunk, as
 * forward_chunk runs a prompt), the prompt's end told first. 0, or -1 after a failed check. */
static int trace_run(KVCache *c, Trace *tr, int T, int prompt, int chunk, int ref) {
    memset(tr, 0, sizeof *tr);
    tr->spans_ok = 1;
    if (ref && kv_set_backend(c, KV_BACKEND_REF)) { CHECK(0, "kv_set_backend REF"); return -1; }
    kv_set_prompt_len(c, prompt);
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        for (int l = 0; l < L; l++) {
            float q[MAXT * NH * HD], k[MAXT * NKV * HD], v[MAXT * NKV * HD], out[MAXT * NH * HD];
            for (int u = 0; u < n; u++) {
                memcpy(q + u * NH * HD, Q[t0 + u][l], sizeof Q[0][0]);
                memcpy(k + u * NKV * HD, K[t0 + u][l], sizeof K[0][0]);
                memcpy(v + u * NKV * HD, V[t0 + u][l], sizeof V[0][0]);
            }
            if (kv_attend_chunk(c, out, l, t0, n, q, k, v, trace_hook, tr)) {
                CHECK(0, "kv_attend_chunk '%s' at %d", c->spec.text, t0);
                return -1;
            }
            for (int u = 0; u < n; u++) memcpy(tr->out[t0 + u][l], out + u * NH * HD, sizeof tr->out[0][0]);
        }
    }
    return 0;
}

/* The same token at (t, l) in two traces: the same positions read, outputs and probabilities bit for bit, the same
 * bytes. */
static int trace_same(const Trace *a, const Trace *b, int t, int l) {
    if (a->bytes[t][l] != b->bytes[t][l] || memcmp(a->out[t][l], b->out[t][l], sizeof a->out[t][l])) return 0;
    for (int g = 0; g < NKV; g++) {
        if (a->n_read[t][l][g] != b->n_read[t][l][g]) return 0;
        for (int j = 0; j < a->n_read[t][l][g]; j++)
            if (a->read[t][l][g][j] != b->read[t][l][g][j]) return 0;
    }
    for (int h = 0; h < NH; h++)
        if (memcmp(a->p[t][l][h], b->p[t][l][h], (size_t)(t + 1) * sizeof(float))) return 0;
    return 1;
}

/* spec (a selection policy, prompt= left out) with prompt=dense against `full` and against spec itself (sparse), T
 * tokens of which the first `prompt` are the prompt, in chunks of `chunk`; ref: on the REF backend; blocks_b > 0:
 * spec is blocks:blocks_b with its defaults (G 4, L b/2, stride from -c = T), whose pattern is checked here. */
static void run_dense(const char *spec, int T, int prompt, int chunk, int ref, int blocks_b) {
    char dense[80];
    snprintf(dense, sizeof dense, "%s,prompt=dense", spec);
    KVShape s = sshape(T, 0);
    KVCache c[3];
    const char *specs[3] = {"full", dense, spec};
    for (int i = 0; i < 3; i++)
        if (tcache(&c[i], &s, specs[i])) {
            for (int j = 0; j < i; j++) kv_cache_free(&c[j]);
            return;
        }
    Trace *full = &traces[0], *dn = &traces[1], *sp = &traces[2];
    for (int i = 0; i < 3; i++)
        if (trace_run(&c[i], &traces[i], T, prompt, chunk, ref)) goto done;
    const char *path = ref ? "REF backend" : "fast backend";
    int bad_full = 0, bad_all = 0, bad_sparse = 0, bad_pattern = 0, selected = 0, sparse_selected = 0;
    double max_err = 0;
    uint64_t bad_bytes = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            if (t < prompt) {
                bad_full += !trace_same(dn, full, t, l);
                /* every position read, and the bytes of every key and value (f32) */
                for (int g = 0; g < NKV; g++) {
                    int all = dn->n_read[t][l][g] == t + 1;
                    for (int j = 0; all && j <= t; j++) all = dn->read[t][l][g][j] == j;
                    bad_all += !all;
                    sparse_selected += sp->n_read[t][l][g] < t + 1;
                }
                bad_bytes += dn->bytes[t][l] != (uint64_t)(t + 1) * NKV * 2 * VB;
                int pos[MAXT];
                for (int i = 0; i <= t; i++) pos[i] = i;
                for (int h = 0; h < NH; h++) {
                    double e = out_err(t, l, h, pos, t + 1, 0, dn->out[t][l]);
                    if (!(e <= max_err)) max_err = e;
                }
            } else {
                bad_sparse += !trace_same(dn, sp, t, l);
                for (int g = 0; g < NKV; g++) {
                    selected += dn->n_read[t][l][g] < t + 1;
                    if (!blocks_b) continue;
                    int want[MAXT], n_cut, S = 1, m;
                    for (;; S++) {   /* the default stride at -c = T, as run_blocks computes it */
                        int cnt = 0;
                        for (int p = 4; p <= T - 1 - blocks_b / 2; p++) cnt += p % S == 0;
                        if (cnt <= blocks_b - 4 - blocks_b / 2) break;
                    }
                    m = tblocks_ref(t, blocks_b, 4, blocks_b / 2, S, want, &n_cut);
                    int ok = dn->n_read[t][l][g] == m;
                    for (int j = 0; ok && j < m; j++) ok = dn->read[t][l][g][j] == want[j];
                    bad_pattern += !ok;
                }
            }
        }
    CHECK(bad_full == 0 && dn->spans_ok, "%s (%s, chunks of %d, prompt %d of %d tokens): each prompt query's outputs, "
          "probabilities, positions read and bytes read are full's on the same stream, bit for bit (%d layer-steps "
          "differ)", dense, path, chunk, prompt, T, bad_full);
    CHECK(bad_all == 0 && bad_bytes == 0 && sparse_selected > 0, "%s (%s): each prompt query reads positions 0..t, "
          "(t+1) x %d kv heads x %d B (%d lane-steps differ, %llu layer-steps of bytes), where %s selects (in %d "
          "lane-steps)", dense, path, NKV, 2 * VB, bad_all, (unsigned long long)bad_bytes, spec, sparse_selected);
    CHECK_LE(max_err, OUT_TOL, "%s (%s): each prompt query's output equals a double softmax over every position "
             "(max err %.3g <= %.3g)", dense, path, max_err, OUT_TOL);
    CHECK(bad_sparse == 0 && selected > 0, "%s (%s): each query after the prompt reads what %s reads, outputs, "
          "probabilities and bytes bit for bit (%d of %d layer-steps differ; %d lane-steps read a strict subset)",
          dense, path, spec, bad_sparse, (T - prompt) * L, selected);
    if (blocks_b)
        CHECK(bad_pattern == 0, "%s (%s): each query after the prompt reads the first 4, the %d newest and the "
              "strided positions computed here (%d lane-steps differ)", dense, path, blocks_b / 2, bad_pattern);
done:
    for (int i = 0; i < 3; i++) kv_cache_free(&c[i]);
}

static void test_dense(void) {
    gen_stream(5, 0);
    run_dense("topk:8", 60, 37, 16, 0, 0);   /* the prompt ends inside a chunk */
    run_dense("topk:8", 60, 37, 16, 1, 0);
    run_dense("quest:8,page=2", 60, 41, 5, 0, 0);
    run_dense("quest:12,page=3,pos=cache", 60, 33, 64, 0, 0);
    run_dense("blocks:16", 60, 30, 7, 0, 16);
    expect_init_error("topk:8,prompt=yes", "unknown prompt=yes", "dense");
    expect_init_error("h2o:8,prompt=dense", "h2o does not select", "topk, quest, blocks");
    expect_init_error("full,prompt=sparse", "full does not select", NULL);
    KVSpec sp;
    char err[512] = "";
    int rc = kv_spec_parse(&sp, "quest:8,page=2,prompt=dense", KV_F32, err, sizeof err);
    rc = rc ? rc : kv_spec_check_mode(&sp, "ppl", err, sizeof err);
    CHECK(rc == -1 && strstr(err, "no prompt"), "prompt=dense is refused in ppl mode, which has no prompt (%s)", err);
    rc = kv_spec_parse(&sp, "quest:8,page=2,prompt=dense", KV_F32, err, sizeof err);
    rc = rc ? rc : kv_spec_check_mode(&sp, "passkey", err, sizeof err);
    CHECK(rc == 0, "prompt=dense is accepted in passkey mode (%s)", rc ? err : "ok");
}

int main(void) {
    test_quest();
    test_blocks();
    test_cluster();
    test_budgets();
    test_oracle();
    test_dense();
    CHECK_EXIT();
}
