/* test_merge.c: merge-on-evict (merge=1, kv.c lane_evict) and the recall of merged slots (eval.h, EvalCover), each
 * against a reference written here:
 *   1. the merge arithmetic, after every step of a synthetic stream (kv_append + kv_attend_cpu, no model): before
 *      each step the test reads every live slot as stored (kv_decode of its bytes, the codec used as a primitive),
 *      then for each victim the kept slot of highest key cosine (double, ties to the oldest) must be the target named
 *      in the KV_EV_MERGE event, its key and value (w_v·x_v + w_t·x_t) / (w_v + w_t) in double within the bound of
 *      its storage type, its weight w_t + w_v, every other slot's bytes unchanged, and after step 4 each slot's weight
 *      grown by the group mean of this step's probabilities; for f32, f16, q8, q4, precision bands and pos=cache;
 *   2. the tie rule and a key of norm 0, on hand-made keys (the target is the oldest of equals);
 *   3. recall: EvalCover on a hand-built trace (merges, a slot leaving alone, a reset), each sum computed by hand, and
 *      driven by a real cache's events (eval_cover_event), each slot's covered set read as a bitmask;
 *   4. bytes: allocated and live bytes, the byte budget and bytes read for a SmolLM2 shape after 4,096 tokens,
 *      against the formula with every term (the f32 weight per slot included);
 *   5. a fast tier stays consistent (kv_tier_check) through merges;
 *   6. bad specs: merge=2, merge=1 on policies that do not evict, merge by their own rule or choose lanes by recall
 *      (duo), a budget of 1.
 * Dimensions: L layers, NH query heads, NKV kv heads, HD head_dim. u = 2^-24, the f32 unit roundoff. */
#include "tests/test_kv_util.h"
#include "eval.h"
#include "kv_codec.h"
#include "kv_impl.h"

#define L 2
#define NH 4
#define NKV 2
#define HD 8
#define GROUPSZ (NH / NKV)
#define MAXT 64
#define U 5.9604644775390625e-08

static float K[MAXT][L][NKV * HD], V[MAXT][L][NKV * HD], Q[MAXT][L][NH * HD];
static void gen_stream(uint64_t seed) {
    for (int t = 0; t < MAXT; t++)
        for (int l = 0; l < L; l++) {
            trng_seed(seed * 7919ull + (uint64_t)(t * 31 + l * 3 + 1));
            for (int j = 0; j < NKV * HD; j++) { K[t][l][j] = trng_normal(); V[t][l][j] = trng_normal(); }
            for (int j = 0; j < NH * HD; j++) Q[t][l][j] = trng_normal();
        }
}

/* ---- the event log ---- */
#define MAXEV 64
static KVEvent evs[MAXEV];
static int n_ev;
static void ev_record(void *ctx, const KVEvent *e) { if (n_ev < MAXEV) evs[n_ev++] = *e; }

/* One live slot as the test reads it: position, key and value decoded from their bytes (double), weight, types. */
typedef struct { int pos, kt, vt; double k[HD], v[HD]; float w; uint8_t kb[HD * 4], vb[HD * 4]; } Slot;

static int lane_read(const KVCache *c, int l, int g, Slot *out) {
    const KVLane *ln = &c->lanes[l * NKV + g];
    for (int i = 0; i < ln->n_live; i++) {
        int s = ln->live[i], b = kv_slot_band(ln, s);
        Slot *x = &out[i];
        float f[HD];
        x->pos = kv_rank_pos(ln, i);
        x->kt = c->band_ktype[b];
        x->vt = c->band_vtype[b];
        x->w = kv_rank_weight(ln, i);
        memset(x->kb, 0, sizeof x->kb); memset(x->vb, 0, sizeof x->vb);
        memcpy(x->kb, kv_slot_k(c, ln, s), c->band_kb[b]);
        memcpy(x->vb, kv_slot_v(c, ln, s), c->band_vb[b]);
        kv_decode(f, (KVType)x->kt, x->kb, HD);
        for (int d = 0; d < HD; d++) x->k[d] = f[d];
        kv_decode(f, (KVType)x->vt, x->vb, HD);
        for (int d = 0; d < HD; d++) x->v[d] = f[d];
    }
    return ln->n_live;
}

/* The largest error storing x (HD, one group: gcd(8, 32) = 8) in type ty may add (kv_codec.h: f16/bf16 half an ulp;
 * q8 half its scale d <= max|x|/127 rounded up to f16, q4 half of d <= (max - min)/15 rounded up, over a minimum
 * rounded down to f16), plus 16 u of max|x| for the f32 arithmetic of the merge (five rounded operations) and of a
 * decoding; x is the exact merged vector, the one encoded is within that f32 term of it. */
static double store_tol(int ty, const double *x) {
    double amax = 0, mn = x[0], mx = x[0];
    for (int d = 0; d < HD; d++) {
        amax = fmax(amax, fabs(x[d]));
        mn = fmin(mn, x[d]);
        mx = fmax(mx, x[d]);
    }
    double f32 = 16 * U * amax, up = 1 + 1.0 / 1024;   /* an f16 rounded up gains at most 2^-10 */
    switch (ty) {
    case KV_F32: return f32;
    case KV_F16: return amax / 2048 + f32;
    case KV_BF16: return amax / 256 + f32;
    case KV_Q8: return (amax + f32) * up / 127 / 2 + f32;
    case KV_Q4: return ((mx - mn) + fabs(mn) / 1024 + 2 * f32) * up / 15 / 2 + f32;
    }
    return 0;
}

static double cosine(const double *a, const double *b) {
    double dot = 0, na = 0, nb = 0;
    for (int d = 0; d < HD; d++) { dot += a[d] * b[d]; na += a[d] * a[d]; nb += b[d] * b[d]; }
    return na > 0 && nb > 0 ? dot / sqrt(na * nb) : 0;
}

/* ---- 1. the merge arithmetic, step by step ---- */
/* victim_rule: 0 = the policy's own (taken from the events, as test_policies tests it), 1 = the oldest live token
 * (window), 1 + S = the oldest after S sinks (sink,sinks=S) */
static void run_arith(const char *spec, int victim_rule, int identity, int T) {
    KVShape s = identity ? tshape_norope(L, NH, NKV, HD, MAXT) : tshape(L, NH, NKV, HD, MAXT);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    c.on_event = ev_record;
    static Slot after[64];
    float out[NH * HD];
    long n_merges = 0, bad_target = 0, bad_vec = 0, bad_w = 0, bad_keep = 0, bad_obs = 0, bad_victim = 0;
    double worst = 0;   /* the largest merged-vector error measured, in units of its bound */
    for (int t = 0; t < T; t++)
        for (int l = 0; l < L; l++) {
            Slot pre[NKV][64];
            int n_pre[NKV];
            for (int g = 0; g < NKV; g++) n_pre[g] = lane_read(&c, l, g, pre[g]);
            n_ev = 0;
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { CHECK(0, "%s: kv_append at %d", spec, t); goto done; }
            for (int g = 0; g < NKV; g++) {
                Slot *cur = pre[g];
                int n = n_pre[g], is_victim[64] = {0}, merged[64] = {0};
                /* the victims this step named for the lane, in the order they merged */
                for (int e = 0; e < n_ev; e++) {
                    const KVEvent *ev = &evs[e];
                    if (ev->layer != l || ev->kv_head != g || ev->kind != KV_EV_MERGE) continue;
                    for (int i = 0; i < n; i++) if (cur[i].pos == ev->pos) is_victim[i] = 1;
                }
                if (n == c.lanes[l * NKV + g].cap) {
                    int want = victim_rule == 1 ? 0 : victim_rule - 1;
                    if (victim_rule && !is_victim[want]) bad_victim++;
                }
                for (int e = 0; e < n_ev; e++) {
                    const KVEvent *ev = &evs[e];
                    if (ev->layer != l || ev->kv_head != g || ev->kind == KV_EV_RECODE) continue;
                    if (ev->kind != KV_EV_MERGE || ev->into < 0 || ev->n != 2) { bad_target++; continue; }
                    int v = -1, best = -1;
                    double best_cos = 0;
                    for (int i = 0; i < n; i++) if (cur[i].pos == ev->pos) v = i;
                    for (int i = 0; i < n && v >= 0; i++) {   /* highest cosine among non-victims, ties to the oldest */
                        if (is_victim[i]) continue;
                        double cs = cosine(cur[v].k, cur[i].k);
                        if (best < 0 || cs > best_cos) { best = i; best_cos = cs; }
                    }
                    n_merges++;
                    if (v < 0 || best < 0 || cur[best].pos != ev->into || !(fabs(ev->score - best_cos) <= 1e-6)) {
                        bad_target++;
                        continue;
                    }
                    double a = cur[v].w, b = cur[best].w;
                    if (!(a + b > 0)) a = b = 1;
                    for (int d = 0; d < HD; d++) {
                        cur[best].k[d] = (a * cur[v].k[d] + b * cur[best].k[d]) / (a + b);
                        cur[best].v[d] = (a * cur[v].v[d] + b * cur[best].v[d]) / (a + b);
                    }
                    cur[best].w = (float)((double)cur[v].w + cur[best].w);
                    merged[best] = 1;
                }
                /* the lane now: the old slots but the victims, then the new token */
                int m = lane_read(&c, l, g, after), j = 0;
                int want_n = 1;
                for (int i = 0; i < n; i++) want_n += !is_victim[i];
                if (m != want_n) { bad_keep++; continue; }
                for (int i = 0; i < n; i++) {
                    if (is_victim[i]) continue;
                    Slot *x = &after[j++];
                    if (x->pos != cur[i].pos) { bad_keep++; continue; }
                    if (merged[i]) {
                        /* written in the target's form; recoded to the next band by this step's store, the bound of
                           that second encoding adds */
                        double tk = store_tol(cur[i].kt, cur[i].k), tv = store_tol(cur[i].vt, cur[i].v);
                        if (x->kt != cur[i].kt) tk += store_tol(x->kt, cur[i].k);
                        if (x->vt != cur[i].vt) tv += store_tol(x->vt, cur[i].v);
                        for (int d = 0; d < HD; d++) {
                            double ek = fabs(x->k[d] - cur[i].k[d]), ev = fabs(x->v[d] - cur[i].v[d]);
                            if (!(ek <= tk) || !(ev <= tv)) bad_vec++;
                            worst = fmax(worst, fmax(tk > 0 ? ek / tk : 0, tv > 0 ? ev / tv : 0));
                        }
                        /* the f32 sum w_t + w_v: one rounding */
                        if (!(fabs(x->w - cur[i].w) <= U * fabs(cur[i].w))) bad_w++;
                    } else if (x->kt == cur[i].kt && x->vt == cur[i].vt) {   /* not merged, not recoded: same bytes */
                        if (memcmp(x->kb, cur[i].kb, sizeof x->kb) || memcmp(x->vb, cur[i].vb, sizeof x->vb)
                            || x->w != cur[i].w)
                            bad_keep++;
                    }
                }
                if (after[m - 1].pos != t || after[m - 1].w != 0) bad_keep++;
            }
            /* step 4: every slot's weight grows by the group mean of this step's probabilities */
            float w0[NKV][64];
            for (int g = 0; g < NKV; g++)
                for (int i = 0; i < c.lanes[l * NKV + g].n_live; i++) w0[g][i] = kv_rank_weight(&c.lanes[l * NKV + g], i);
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                const KVLane *ln = &c.lanes[l * NKV + g];
                for (int i = 0; i < ln->n_live; i++) {
                    double mean = 0;
                    for (int hh = 0; hh < GROUPSZ; hh++) mean += c.scores[(size_t)(g * GROUPSZ + hh) * c.budget + i];
                    double want = w0[g][i] + mean / GROUPSZ;
                    /* two f32 roundings (the sum over the group, then the add), a third for the division */
                    if (!(fabs(kv_rank_weight(ln, i) - want) <= 4 * U * want)) bad_obs++;
                }
            }
        }
    CHECK(n_merges > 0 && bad_target == 0, "%s: %ld merges over %d steps, each into the kept slot of highest key "
          "cosine (double, ties to the oldest), the victims not candidates, cosine in the event (%ld wrong)", spec,
          n_merges, T, bad_target);
    CHECK(bad_victim == 0, "%s: the victim is the policy's (%ld steps named another)", spec, bad_victim);
    CHECK(bad_vec == 0, "%s: each merged key and value is (w_v x_v + w_t x_t)/(w_v + w_t) of the stored vectors, "
          "within its storage type's bound (%ld elements outside; worst %.3g of the bound)", spec, bad_vec, worst);
    CHECK(bad_w == 0 && bad_obs == 0, "%s: a merged slot's weight is w_t + w_v (%ld wrong) and every slot's weight "
          "grows by the group mean of each step's probabilities (%ld wrong)", spec, bad_w, bad_obs);
    CHECK(bad_keep == 0, "%s: every slot but the victims and targets keeps its bytes, position and weight; the new "
          "token is the newest with weight 0 (%ld wrong)", spec, bad_keep);
done:
    kv_cache_free(&c);
}

static void test_arith(void) {
    gen_stream(1);
    run_arith("window:6,merge=1", 1, 0, 40);
    run_arith("sink:7,sinks=2,merge=1", 3, 0, 40);
    run_arith("h2o:8,recent=3,merge=1", 0, 0, 40);
    run_arith("scissorhands:8,recent=2,drop=3,merge=1", 0, 0, 40);   /* several victims at once */
    run_arith("tova:6,merge=1,type=f16", 0, 0, 40);
    run_arith("window:6,merge=1,type=q8", 1, 0, 40);
    run_arith("sink:7,sinks=1,merge=1,type=q4", 2, 0, 40);
    run_arith("window:8,merge=1,prec=f32:2/q8:3/q4", 1, 0, 40);   /* victim and target in other bands */
    run_arith("h2o:8,merge=1,pos=cache", 0, 0, 40);                /* keys pre-RoPE */
    run_arith("lru:6,merge=1,pos=cache,type=q8", 0, 1, 40);
    run_arith("random:6,merge=1", 0, 0, 40);
}

/* ---- 2. ties and a key of norm 0 ---- */
static void test_ties(void) {
    /* window:4,pos=cache: keys stored before RoPE, so equal keys are equal bits. Lane keys: 0 = e0, 1 = e0 + e1,
       2 = e0 + e1 (equal to 1), 3 = e2. At step 4 the victim is 0, whose cosine with 1 and 2 is 1/√2 and with 3 is 0:
       the target is 1, the older of the tied pair. */
    KVShape s = tshape(1, 2, 1, HD, 16);
    KVCache c;
    if (tcache(&c, &s, "window:4,pos=cache,merge=1")) return;
    c.on_event = ev_record;
    float k[6][HD] = {{0}}, v[HD] = {0}, q[2 * HD] = {0}, out[2 * HD];
    k[0][0] = 1; k[1][0] = 1; k[1][1] = 1; k[2][0] = 1; k[2][1] = 1; k[3][2] = 1;
    /* 4: 0 (a key of norm 0); at step 5 the victim is slot 1 (merged), candidates 2, 3 and 4; the cosine with 4 is 0
       by the rule, with 3 it is 0 too, with 2 it is positive: target 2 */
    n_ev = 0;
    for (int t = 0; t < 5; t++) { kv_append(&c, 0, t, k[t], v); kv_attend_cpu(&c, out, 0, t, q); }
    CHECK(n_ev == 1 && evs[0].kind == KV_EV_MERGE && evs[0].pos == 0 && evs[0].into == 1 &&
          fabs(evs[0].score - sqrt(0.5)) <= 1e-15,
          "ties: position 0 merges into 1, the older of two equal keys at cosine 1/sqrt 2 (%d events; pos %d into %d, "
          "cosine %.17g)", n_ev, n_ev ? evs[0].pos : -1, n_ev ? evs[0].into : -1, n_ev ? evs[0].score : 0);
    kv_cache_free(&c);
    /* a victim of norm 0: its cosine with every key is 0, so the oldest kept slot receives it */
    if (tcache(&c, &s, "window:3,merge=1")) return;
    c.on_event = ev_record;
    n_ev = 0;
    float z[HD] = {0};
    for (int t = 0; t < 4; t++) { kv_append(&c, 0, t, t == 0 ? z : k[t], v); kv_attend_cpu(&c, out, 0, t, q); }
    CHECK(n_ev == 1 && evs[0].pos == 0 && evs[0].into == 1 && evs[0].score == 0,
          "a key of norm 0 has cosine 0 with every key: position 0 merges into 1, the oldest kept (pos %d into %d)",
          n_ev ? evs[0].pos : -1, n_ev ? evs[0].into : -1);
    kv_cache_free(&c);
}

/* ---- 3. recall: what a merged slot covers ---- */
static double mass(const EvalCover *cv, int lane, const int *pos, int n, const float *p) {
    double r;
    eval_cover_masses(cv, lane, pos, n, p, 0, 1, &r);
    return r;
}

static int forwarded;
static void count_forward(void *ctx, const KVEvent *e) { forwarded++; ev_record(ctx, e); }

static void test_recall(void) {
    /* a hand-built trace on one lane of 8 positions: 0 into 2, 1 into 3, 2 (covering {2, 0}) into 4 */
    EvalCover cv;
    if (eval_cover_init(&cv, 1, 1, 8)) { CHECK(0, "eval_cover_init"); return; }
    float p[8] = {0.05f, 0.10f, 0.15f, 0.20f, 0.25f, 0.25f, 0, 0}, bits[8];
    for (int x = 0; x < 8; x++) bits[x] = (float)(1 << x);   /* a mass over bits[] is the covered set as a bitmask */
    eval_cover_merge(&cv, 0, 0, 2);
    eval_cover_merge(&cv, 0, 1, 3);
    eval_cover_merge(&cv, 0, 2, 4);
    eval_cover_merge(&cv, 0, 9, 4);   /* beyond ctx: ignored */
    int live[3] = {3, 4, 5}, s3 = 3, s4 = 4;
    double all = mass(&cv, 0, live, 3, p), left = mass(&cv, 0, live + 1, 2, p);
    /* by hand: {3,1} ∪ {4,2,0} ∪ {5} is every position, 1; with slot 3 gone alone, {4,2,0} ∪ {5} =
       0.25 + 0.15 + 0.05 + 0.25 = 0.70 */
    CHECK(fabs(all - 1.0) <= 1e-7 && fabs(left - 0.70) <= 1e-7,
          "EvalCover: slots {3,4,5} after merges 0->2, 1->3, 2->4 cover all the mass (%.9g, want 1); without 3, "
          "0.70 (%.9g)", all, left);
    double m3 = mass(&cv, 0, &s3, 1, bits), m4 = mass(&cv, 0, &s4, 1, bits);
    CHECK(m3 == 10 && m4 == 21, "EvalCover: slot 3 covers {1,3} (bitmask %g, want 10), slot 4 {0,2,4} (%g, want 21)",
          m3, m4);
    eval_cover_merge(&cv, 0, 4, 3);   /* a merged slot merged again: its whole set moves */
    m3 = mass(&cv, 0, &s3, 1, bits);
    CHECK(m3 == 31, "EvalCover: 4 (covering {0,2,4}) merged into 3 (covering {1,3}): 3 covers {0..4} (%g, want 31)", m3);
    eval_cover_reset(&cv);
    m4 = mass(&cv, 0, &s4, 1, bits);
    CHECK(m4 == 16, "EvalCover: after a reset slot 4 covers {4} alone (%g)", m4);
    eval_cover_free(&cv);

    /* the same trace from a real cache's events: window:3,merge=1, RoPE the identity, keys chosen so that 0 merges
       into 2 (e0 + 0.1 e2 is nearest e0), 1 into 3 (e1 + 0.1 e3 nearest e1), then 2 into 4 (e0) */
    KVShape s = tshape_norope(1, 2, 1, HD, 16);
    KVCache c;
    if (tcache(&c, &s, "window:3,merge=1")) return;
    if (eval_cover_init(&cv, 1, 1, 16)) { CHECK(0, "eval_cover_init"); kv_cache_free(&c); return; }
    cv.fn = count_forward;
    cv.fn_ctx = NULL;
    c.on_event = eval_cover_event;
    c.event_ctx = &cv;
    float k[6][HD] = {{0}}, v[HD] = {0}, q[2 * HD] = {0}, out[2 * HD], bits16[16];
    k[0][0] = 1; k[1][1] = 1; k[2][0] = 1; k[2][2] = 0.1f; k[3][1] = 1; k[3][3] = 0.1f; k[4][0] = 1; k[5][4] = 1;
    for (int x = 0; x < 16; x++) bits16[x] = (float)(1 << x);
    forwarded = 0; n_ev = 0;
    for (int t = 0; t < 6; t++) { kv_append(&c, 0, t, k[t], v); kv_attend_cpu(&c, out, 0, t, q); }
    int pos[4], n = kv_lane_positions(&c, 0, 0, pos, 4);
    double sets[3] = {0};
    for (int i = 0; i < n && i < 3; i++) sets[i] = mass(&cv, 0, &pos[i], 1, bits16);
    CHECK(n == 3 && pos[0] == 3 && pos[1] == 4 && pos[2] == 5 && sets[0] == 10 && sets[1] == 21 && sets[2] == 32,
          "window:3,merge=1's events: slots 3, 4, 5 cover {1,3}, {0,2,4}, {5} (bitmasks %g %g %g, want 10 21 32)",
          sets[0], sets[1], sets[2]);
    CHECK(forwarded == 3 && n_ev == 3, "eval_cover_event passes each of the 3 merge events on to the observer it "
          "replaced (%d)", forwarded);
    eval_cover_free(&cv);
    kv_cache_free(&c);
}

/* ---- 4. bytes on SmolLM2's shape after 4,096 tokens ---- */
static void run_bytes(const char *spec, int B, int res, int base_ty, size_t policy_meta) {
    KVShape s = tshape(30, 9, 3, 64, 8192);
    KVCache c;
    if (tcache(&c, &s, spec)) return;
    int n_lanes = 30 * 3, T = 4096, hd = 64;
    float k[3 * 64], v[3 * 64];
    for (int t = 0; t < T; t++)
        for (int l = 0; l < 30; l++) {
            for (int j = 0; j < 3 * hd; j++) { k[j] = (float)((t * 7 + l * 3 + j) % 13) - 6; v[j] = (float)(j % 5); }
            kv_append(&c, l, t, k, v);
            /* step 4 with uniform probabilities (no attention is computed: accounting is what is tested) */
            for (int h = 0; h < 9; h++)
                for (int i = 0; i < c.lanes[l * 3].n_live; i++)
                    c.scores[(size_t)h * c.budget + i] = 1.0f / (float)c.lanes[l * 3 + h / 3].n_live;
            kv_attend_policy(&c, l, t);
        }
    /* the formula: per slot, a key and a value (f32: 4·64 B each; q8: 64/32 groups of 2 + 32 B), a position (int32),
       a live-list and a free-list entry (int each), the policy's metadata and the f32 merge weight */
    size_t f32v = 64 * 4, q8v = 2 * (2 + 32), vec = base_ty == KV_Q8 ? q8v : f32v;
    size_t per_slot_meta = 4 + 4 + 4 + policy_meta + 4;
    size_t want = (size_t)n_lanes * ((size_t)res * 2 * f32v + (size_t)(B - res) * 2 * vec + (size_t)B * per_slot_meta);
    KVBytes b = kv_bytes(&c);
    KVSpec sp;
    char err[256];
    kv_spec_parse(&sp, spec, KV_F32, err, sizeof err);
    size_t formula = kv_alloc_bytes_for(&s, &sp, kv_policy_find(sp.name), B);
    CHECK(b.total_alloc == want && b.total_live == want && formula == want && b.meta_alloc == (size_t)n_lanes * B *
          per_slot_meta, "%s after %d tokens on SmolLM2's shape: allocated %zu B, live %zu B, kv_alloc_bytes_for %zu B, "
          "formula %zu B (90 lanes x %d slots x (vectors + %zu B of position, lists, policy meta and the 4 B merge "
          "weight))", spec, T, b.total_alloc, b.total_live, formula, want, B, per_slot_meta);
    long want_merged = (long)n_lanes * (T - B);
    CHECK(c.n_merged == want_merged && c.n_evictions == 0, "%s: every victim merged (%d merged, %d evicted alone; "
          "want %ld, 0)", spec, c.n_merged, c.n_evictions, want_merged);
    if (res == 0) {
        /* bytes read, every token: attention over the live slots (t + 1 while filling, then B); once full, the merge
           reads the victim's key and the B - 1 others (B keys) and the two values */
        uint64_t r = 0;
        for (int t = 0; t < T; t++) {
            int n = t + 1 < B ? t + 1 : B;
            r += (uint64_t)n * 2 * vec;
            if (t >= B) r += (uint64_t)B * vec + 2 * vec;
        }
        r *= (uint64_t)n_lanes;
        CHECK(c.bytes_read == r, "%s: bytes read %llu = attention's plus the merges' similarity pass and values (%llu)",
              spec, (unsigned long long)c.bytes_read, (unsigned long long)r);
    }
    /* a byte budget of these bytes gives this token budget; 1 B less, one slot fewer */
    char bspec[96];
    snprintf(bspec, sizeof bspec, "%s", spec);
    char *colon = strchr(bspec, ':'), *comma = strchr(bspec, ',');
    if (colon && comma) {
        char tail[64];
        snprintf(tail, sizeof tail, "%s", comma);
        snprintf(colon + 1, sizeof bspec - (size_t)(colon + 1 - bspec), "%zuB%s", want - 1, tail);
        KVCache d;
        if (!tcache(&d, &s, bspec)) {
            CHECK(d.policy.budget == B - 1, "%s: a byte budget 1 B under %zu B resolves to %d tokens (%d)", bspec, want,
                  B - 1, d.policy.budget);
            kv_cache_free(&d);
        }
    }
    kv_cache_free(&c);
}

static void test_bytes(void) {
    run_bytes("h2o:64,merge=1", 64, 0, KV_F32, 4);
    run_bytes("sink:64,merge=1,type=q8,residual=16", 64, 16, KV_Q8, 0);
}

/* ---- 5. a fast tier through merges ---- */
static void test_tier(void) {
    gen_stream(3);
    KVShape s = tshape(L, NH, NKV, HD, MAXT);
    KVCache c;
    if (tcache(&c, &s, "h2o:10,merge=1,fast=50%")) return;
    float out[NH * HD];
    int bad = 0;
    for (int t = 0; t < 50; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&c, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            bad += kv_tier_check(&c) != 0;
        }
    CHECK(bad == 0 && c.n_merged > 0, "h2o:10,merge=1,fast=50%%: the fast tier's lists and bytes stay consistent "
          "through %d merges (%d steps inconsistent)", c.n_merged, bad);
    kv_cache_free(&c);
}

/* ---- 6. bad specs ---- */
static void expect_error(const char *spec, const char *needle) {
    KVShape s = tshape(L, NH, NKV, HD, MAXT);
    char err[512];
    int rc = tcache_error(&s, spec, err, sizeof err);
    CHECK(rc == -1 && strstr(err, needle), "'%s' is an error naming '%s' (%s)", spec, needle, err);
}

static void test_bad_specs(void) {
    expect_error("h2o:16,merge=2", "bad merge=2");
    expect_error("h2o:16,merge=yes", "bad merge=yes");
    expect_error("full,merge=1", "full never evicts");
    expect_error("snapkv:16,merge=1", "snapkv never evicts");
    expect_error("topk:16,merge=1", "topk never evicts");
    expect_error("quest:16,merge=1", "quest never evicts");
    expect_error("pool:16,merge=1", "pool merges by its own rule");
    expect_error("window:1,merge=1", "use a budget >= 2");
    expect_error("duo:8,full=0.5,merge=1", "the choice empty");
    expect_error("full,merge=1", "window, sink, h2o");   /* the message lists the policies it works on */
    /* merge=0 is the default said aloud: taken by every policy, and the cache is the plain one */
    const char *plain[] = {"full,merge=0", "pool:16,merge=0", "topk:16,merge=0", "h2o:16,merge=0"};
    for (int i = 0; i < 4; i++) {
        KVShape s = tshape(L, NH, NKV, HD, MAXT);
        KVCache c;
        if (tcache(&c, &s, plain[i])) continue;
        CHECK(!c.merge_evict, "'%s' makes a cache without merge-on-evict", plain[i]);
        kv_cache_free(&c);
    }
}

int main(void) {
    test_arith();
    test_ties();
    test_recall();
    test_bytes();
    test_tier();
    test_bad_specs();
    CHECK_EXIT();
}
