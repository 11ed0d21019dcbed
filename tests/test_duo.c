/* test_duo.c: DuoAttention's retrieval and streaming lanes (policies.c duo) and the lane choice of allocation by
 * calibration (eval.c eval_choose_lanes), each against a reference written here:
 *   1. a duo cache made with a lane mask (ragged budgets: -c slots for a full lane, B for a streaming one) holds, after
 *      every step of a synthetic stream (kv_append + kv_attend_cpu, no model), every position in a full lane and
 *      exactly sink:B's positions in a streaming one (the S sinks and the B-S newest), per lane; each query head's
 *      output is a double softmax over its lane's positions; resident bytes are the ragged caps times the bytes of a
 *      slot; the cache stops at -c while a lane is full (kv_capacity, kv_append -1) and never without one;
 *   2. duo's spec errors (full= missing or outside [0, 1], a byte budget, a budget not below -c, sink's rule);
 *   3. eval_choose_lanes on hand-made recall arrays: ranking, ties to the lower lane, share 0 and 1, round() of
 *      share · n_lanes at and around halves, bad input.
 * Dimensions: L layers, NH query heads, NKV kv heads, HD head_dim, T tokens (= -c), B budget, S sinks. */
#include "tests/test_kv_util.h"
#include "eval.h"

#include <limits.h>

#define L 3
#define NH 4
#define NKV 2
#define HD 8
#define T 40
#define GROUPSZ (NH / NKV)
/* output tolerance of tests/test_verbs.c: 64 f32 ulps of 4 (|v| <= ~4, 8-term dots, a softmax over <= 40 slots;
   the measured error is printed) */
#define OUT_TOL (64 * 4 * 1.2e-7)

static float K[T + 8][L][NKV * HD], V[T + 8][L][NKV * HD], Q[T + 8][L][NH * HD];

static void gen_stream(uint64_t seed) {
    for (int t = 0; t < T + 8; t++)
        for (int l = 0; l < L; l++) {
            trng_seed(seed * 1000003ull + (uint64_t)(t * 131 + l * 7 + 1));
            for (int j = 0; j < NKV * HD; j++) { K[t][l][j] = trng_normal(); V[t][l][j] = trng_normal(); }
            for (int j = 0; j < NH * HD; j++) Q[t][l][j] = trng_normal();
        }
}

/* The positions a lane holds after step t (StreamingLLM's rolling cache, or everything): written into want. */
static int want_positions(int *want, int t, int full, int B, int S) {
    int n = 0;
    if (full || t + 1 <= B) { for (int p = 0; p <= t; p++) want[n++] = p; return n; }
    for (int p = 0; p < S; p++) want[n++] = p;
    for (int p = t - (B - S) + 1; p <= t; p++) want[n++] = p;
    return n;
}

/* max |out - softmax over pos[0..n) of q·k/√HD applied to v|, in double, RoPE the identity */
static double out_err(int t, int l, int h, const int *pos, int n, const float *out) {
    int g = h / GROUPSZ;
    double q[HD], k[(T + 8) * HD];
    const float *v[T + 8];
    for (int j = 0; j < HD; j++) q[j] = Q[t][l][h * HD + j];
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < HD; j++) k[(size_t)i * HD + j] = K[pos[i]][l][g * HD + j];
        v[i] = &V[pos[i]][l][g * HD];
    }
    return tdense_err(q, k, v, n, HD, out + (size_t)h * HD);
}

/* ---- 1. the mask's lanes, step by step ---- */
static void run_mask(const char *spec_text, const int *mask, int B, int S) {
    gen_stream(7);
    KVShape s = tshape_norope(L, NH, NKV, HD, T);
    KVSpec sp;
    KVCache c;
    char err[512];
    int caps[L * NKV], n_full = 0;
    for (int i = 0; i < L * NKV; i++) { caps[i] = mask[i] ? T : B; n_full += mask[i]; }
    if (kv_spec_parse(&sp, spec_text, KV_F32, err, sizeof err) ||
        kv_cache_init_lanes(&c, &s, &sp, caps, err, sizeof err)) {
        CHECK(0, "kv_cache_init_lanes '%s' with a mask of %d full lanes: %s", spec_text, n_full, err);
        return;
    }
    /* resident bytes: per slot (kv.c slot_meta_bytes) an f32 key and value, one int32 position, a live- and a
       free-list int; duo keeps no metadata */
    size_t per_slot = 2 * (size_t)HD * sizeof(float) + sizeof(int32_t) + 2 * sizeof(int), want_alloc = 0;
    int lanes_ok = 1;
    for (int i = 0; i < L * NKV; i++) {
        want_alloc += (size_t)caps[i] * per_slot;
        lanes_ok &= kv_lane_bytes(&c, i / NKV, i % NKV).total_alloc == (size_t)caps[i] * per_slot;
    }
    KVBytes b = kv_bytes(&c);
    CHECK(b.total_alloc == want_alloc && lanes_ok, "%s, %d full lanes: total_alloc %zu B == sum of the caps x %zu B "
          "= %zu B, every lane its own cap x %zu B", spec_text, n_full, b.total_alloc, per_slot, want_alloc, per_slot);
    char desc[512], frag[48];
    kv_describe(&c, desc, sizeof desc);
    snprintf(frag, sizeof frag, "(%d of %d lanes full)", n_full, L * NKV);
    CHECK(strstr(desc, frag) != NULL, "%s: the start-up line says %s: %s", spec_text, frag, desc);
    int want_cap = n_full ? T : INT_MAX;
    CHECK(kv_capacity(&c) == want_cap, "%s, %d full lanes: kv_capacity %d == %d", spec_text, n_full, kv_capacity(&c),
          want_cap);

    float out[NH * HD];
    int pos[T + 8], want[T + 8], bad = 0, first_bad_t = -1, first_bad_lane = -1, steps = n_full ? T : T + 8;
    double max_err = 0;
    for (int t = 0; t < steps; t++)
        for (int l = 0; l < L; l++) {
            if (kv_append(&c, l, t, K[t][l], V[t][l])) { bad++; continue; }
            kv_attend_cpu(&c, out, l, t, Q[t][l]);
            for (int g = 0; g < NKV; g++) {
                int lane = l * NKV + g, nw = want_positions(want, t, mask[lane], B, S);
                int n = kv_lane_positions(&c, l, g, pos, T + 8), ok = n == nw;
                for (int i = 0; ok && i < n; i++) ok = pos[i] == want[i];
                if (!ok && first_bad_t < 0) { first_bad_t = t; first_bad_lane = lane; }
                bad += !ok;
                for (int hh = 0; hh < GROUPSZ; hh++) {
                    double e = out_err(t, l, g * GROUPSZ + hh, pos, n, out);
                    if (!(e <= max_err)) max_err = e;
                }
            }
        }
    char where[64] = "";
    if (bad) snprintf(where, sizeof where, "; the first at t=%d, lane %d", first_bad_t, first_bad_lane);
    CHECK(bad == 0, "%s, %d full lanes: after each of %d steps every full lane holds 0..t and every streaming lane "
          "sink:%d,sinks=%d's positions (%d lane-steps differ%s)", spec_text, n_full, steps, B, S, bad, where);
    CHECK_LE(max_err, OUT_TOL, "%s: each query head's output equals a double softmax over its lane's positions (max "
             "err %.3g <= %.3g)", spec_text, max_err, OUT_TOL);
    size_t live = 0;
    for (int i = 0; i < L * NKV; i++) live += (size_t)(mask[i] ? steps : B) * per_slot;
    CHECK(kv_bytes(&c).total_live == live, "%s: total_live %zu B == full lanes at %d slots, streaming ones at %d (%zu)",
          spec_text, kv_bytes(&c).total_live, steps, B, live);
    if (mask[0]) {   /* a full lane never evicts: position T does not fit in layer 0, as under full */
        int rc = kv_append(&c, 0, T, K[T][0], V[T][0]);
        CHECK(rc == -1, "%s: kv_append of position %d into layer 0, whose kv head 0 is full, returns %d (want -1: the "
              "cache is full)", spec_text, T, rc);
    }
    kv_cache_free(&c);
}

/* made without a mask (kv_cache_init), duo is sink:B with the same sinks: the same positions and the same bits */
static void test_unmasked_is_sink(void) {
    gen_stream(11);
    KVShape s = tshape(L, NH, NKV, HD, T);
    KVCache d, k;
    if (tcache(&d, &s, "duo:10,full=0.5,sinks=3")) return;
    if (tcache(&k, &s, "sink:10,sinks=3")) { kv_cache_free(&d); return; }
    float od[NH * HD], ok[NH * HD];
    int diff = 0, pd[T + 8], pk[T + 8];
    for (int t = 0; t < T + 8; t++)
        for (int l = 0; l < L; l++) {
            kv_append(&d, l, t, K[t][l], V[t][l]);
            kv_append(&k, l, t, K[t][l], V[t][l]);
            kv_attend_cpu(&d, od, l, t, Q[t][l]);
            kv_attend_cpu(&k, ok, l, t, Q[t][l]);
            diff += memcmp(od, ok, sizeof od) != 0;
            for (int g = 0; g < NKV; g++) {
                int n = kv_lane_positions(&d, l, g, pd, T + 8), m = kv_lane_positions(&k, l, g, pk, T + 8);
                diff += n != m || memcmp(pd, pk, (size_t)n * sizeof(int));
            }
        }
    CHECK(diff == 0 && kv_capacity(&d) == INT_MAX && kv_bytes(&d).total_alloc == kv_bytes(&k).total_alloc,
          "duo:10,full=0.5,sinks=3 made with kv_cache_init is sink:10,sinks=3: same positions and output bits over %d "
          "steps (%d differ), no capacity limit, the same bytes", T + 8, diff);
    kv_cache_free(&d); kv_cache_free(&k);
}

/* ---- 2. spec errors ---- */
static void expect_init_error(const char *spec_text, const char *needle, const char *needle2) {
    KVShape s = tshape(L, NH, NKV, HD, T);
    char err[512];
    int rc = tcache_error(&s, spec_text, err, sizeof err);
    CHECK(rc == -1 && strstr(err, needle) && strstr(err, needle2), "'%s' (-c %d) is an error naming '%s' and '%s': %s",
          spec_text, T, needle, needle2, err);
}

static void test_spec_errors(void) {
    expect_init_error("duo:10", "needs full=F", "[0, 1]");
    expect_init_error("duo:10,full=1.5", "bad full=1.5", "[0, 1]");
    expect_init_error("duo:10,full=-0.25", "bad full=-0.25", "[0, 1]");
    expect_init_error("duo:10,full=abc", "bad full=abc", "[0, 1]");
    expect_init_error("duo:10,full=nan", "bad full=nan", "[0, 1]");
    expect_init_error("duo:4KiB,full=0.5", "in tokens", "-c");
    expect_init_error("duo:40,full=0.5", "below -c", "-c 40");
    expect_init_error("duo:10,full=0.5,sinks=9", "sinks=9", "sinks <= 8");
    expect_init_error("duo:10,full=0.5,recent=3", "'recent'", "full=F");
}

/* ---- 3. the lane choice ---- */

/* The reference: lane i is chosen when fewer than n lanes come before it, a lane j coming before i when its recall
 * is lower, or equal with j < i; n = the nearest integer to share · n_lanes, halves up (all shares here are >= 0). */
static int choose_ref(int *chosen, const double *recall, int n_lanes, double share) {
    int n = (int)floor(share * n_lanes + 0.5);
    for (int i = 0; i < n_lanes; i++) {
        int before = 0;
        for (int j = 0; j < n_lanes; j++) before += recall[j] < recall[i] || (recall[j] == recall[i] && j < i);
        chosen[i] = before < n;
    }
    return n;
}

static void check_choice(const char *what, const double *recall, int n_lanes, double share, int want_n) {
    int got[128], ref[128];
    int n = eval_choose_lanes(got, recall, n_lanes, share), nr = choose_ref(ref, recall, n_lanes, share), same = 1;
    for (int i = 0; i < n_lanes; i++) same &= got[i] == ref[i];
    char gs[512], rs[512];
    int gl[128], rl[128], ng = 0, nrl = 0;
    for (int i = 0; i < n_lanes; i++) { if (got[i]) gl[ng++] = i; if (ref[i]) rl[nrl++] = i; }
    tprint_set(gs, sizeof gs, gl, ng);
    tprint_set(rs, sizeof rs, rl, nrl);
    CHECK(n == want_n && nr == want_n && same, "%s: share %g of %d lanes chooses %d (want %d), lanes {%s} (reference "
          "{%s})", what, share, n_lanes, n, want_n, gs, rs);
}

static void test_choose_lanes(void) {
    double r6[6] = {0.9, 0.2, 0.7, 0.4, 0.95, 0.1};
    check_choice("ranking", r6, 6, 0.5, 3);        /* lanes 5, 1, 3 */
    int c6[6];
    eval_choose_lanes(c6, r6, 6, 0.5);
    CHECK(c6[5] && c6[1] && c6[3] && !c6[0] && !c6[2] && !c6[4], "share 0.5 of {0.9,0.2,0.7,0.4,0.95,0.1} chooses "
          "lanes 1, 3 and 5, the three lowest");
    double tie[6] = {0.5, 0.3, 0.5, 0.3, 0.5, 0.5};
    check_choice("ties", tie, 6, 0.5, 3);          /* 1, 3, then the lower of the 0.5s: 0 */
    eval_choose_lanes(c6, tie, 6, 0.5);
    CHECK(c6[1] && c6[3] && c6[0] && !c6[2] && !c6[4] && !c6[5], "ties go to the lower lane: {0.5,0.3,0.5,0.3,0.5,0.5} "
          "at share 0.5 chooses 1, 3 and 0");
    check_choice("share 0", r6, 6, 0, 0);
    check_choice("share 1", r6, 6, 1, 6);
    double r90[90], r10[10], r3[3] = {0.3, 0.2, 0.1};
    for (int i = 0; i < 90; i++) r90[i] = 0.5 + 0.4 * sin(1.7 * i);
    for (int i = 0; i < 10; i++) r10[i] = 1.0 / (1 + (i * 7) % 10);
    check_choice("SmolLM2's 90 lanes", r90, 90, 0.25, 23);   /* 22.5 rounds up */
    check_choice("21.6 rounds up", r90, 90, 0.24, 22);
    check_choice("23.4 rounds down", r90, 90, 0.26, 23);
    check_choice("a half", r3, 3, 0.5, 2);                   /* 1.5 rounds up */
    check_choice("a third", r10, 10, 1.0 / 3, 3);            /* 3.33 */
    check_choice("two thirds", r10, 10, 2.0 / 3, 7);         /* 6.67 */
    check_choice("one lane", r10, 1, 0.49, 0);
    check_choice("one lane, share 0.5", r10, 1, 0.5, 1);
    int untouched[3] = {7, 7, 7};
    double bad[3] = {0.1, NAN, 0.3};
    int rc1 = eval_choose_lanes(untouched, bad, 3, 0.5), rc2 = eval_choose_lanes(untouched, r3, 3, 1.5),
        rc3 = eval_choose_lanes(untouched, r3, 3, -0.1), rc4 = eval_choose_lanes(untouched, r3, 0, 0.5),
        rc5 = eval_choose_lanes(untouched, r3, 3, NAN);
    CHECK(rc1 == -1 && rc2 == -1 && rc3 == -1 && rc4 == -1 && rc5 == -1 && untouched[0] == 7 && untouched[2] == 7,
          "bad input is -1 and leaves chosen untouched: a NaN recall %d, share 1.5 %d, -0.1 %d, no lanes %d, NaN %d",
          rc1, rc2, rc3, rc4, rc5);
}

int main(void) {
    int mask_some[L * NKV] = {1, 0, 0, 1, 0, 1}, mask_none[L * NKV] = {0}, mask_all[L * NKV] = {1, 1, 1, 1, 1, 1};
    run_mask("duo:10,full=0.5,sinks=3", mask_some, 10, 3);
    run_mask("duo:12,full=0.5", mask_some, 12, 4);   /* sink's default, 4 sinks */
    run_mask("duo:10,full=0,sinks=3", mask_none, 10, 3);
    run_mask("duo:10,full=1,sinks=2", mask_all, 10, 2);
    test_unmasked_is_sink();
    test_spec_errors();
    test_choose_lanes();
    CHECK_EXIT();
}
