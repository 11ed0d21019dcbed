/* test_attn_ref.c: the fast CPU attention (attn_cpu.c) against kv_attend_ref, the definition (kv.h), within the bound
 * derived in tests/attn_ref_check.h, never against another fast path: kv_attend_cpu token by token, and
 * kv_attend_chunk in chunks of 5, 64, 1, 17, 2 and 40 tokens (batched while the lanes have room, token by token once
 * they evict), over 1, 3, 37 and 513 live slots (129 under KVLAB_SANITIZE), head_dim 8, 64, 80 and 128, GQA ratios
 * 1, 3 and 4, every storage type, mixed k/v types, the f32 residual and three precision bands (prec=), pos=orig
 * and pos=cache, lanes with holes (random eviction). Two caches take the same stream: one attends by kv_attend_ref, the other by the path under
 * test. Built twice: with this machine's vector instructions (tests/bin/test_attn_ref) and as portable C
 * (attn_ref_portable, which tests/test_attn_ref_portable.sh runs). Also: the REF backend makes kv_attend_chunk
 * kv_append + kv_attend_ref token by token, bit for bit, and kv_attend_ref shows the policy its probabilities (step 4).
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim (hd), budget (n). */
#include "tests/test_kv_util.h"
#include "tests/attn_ref_check.h"

#ifdef __AVX__
#define BUILD_NAME "vector build"
#else
#define BUILD_NAME "portable C build"
#endif

typedef struct { const char *name, *opts; } TypeCase;
static const TypeCase TYPES[] = {
    {"f32", "type=f32"}, {"f16", "type=f16"}, {"bf16", "type=bf16"}, {"q8", "type=q8"}, {"q4", "type=q4"}, {"q2", "type=q2"},
    {"k q8 v f16", "ktype=q8,vtype=f16"}, {"q8 + residual", "type=q8,residual=R"}, {"q4 + residual", "type=q4,residual=R"},
    {"prec f32/q8/q4", "prec=f32:R/q8:R/q4"}, {"q2 keys per channel", "type=q2,kgroup=channel,kgsize=8"},
    {"q4 keys per channel + residual", "ktype=q4,vtype=q8,kgroup=channel,residual=R"},
    {"prec f32/q8/q2 keys per channel", "prec=f32:R/q8:R/q2,kgroup=channel,kgsize=4"},
};
#define N_TYPES (int)(sizeof TYPES / sizeof TYPES[0])
#define LAYERS 2
#define NKV 2
#define CHUNK_MAX 64
static const int CHUNKS[] = {5, 64, 1, 17, 2, 40};

/* Cheap bell-shaped test values (sum of three uniforms, variance 1), as tests/test_attn.cu draws them. */
static inline float tnorm(void) { return (trng_unif() + trng_unif() + trng_unif() - 1.5f) * 2.0f; }

/* The steps compared: all of them in short lanes; in 513-slot lanes a spread of them (every 37th, the steps around the
 * first eviction and the last three), each an attention over hundreds of slots. Long lanes are filled up to 72
 * tokens short of their budget by kv_append alone (WARM): attending to every token of the fill would cost n²/2 key
 * visits per head, ten times the rest of the test in the portable build, and test the same code as the last 72. */
#define WARM(n) ((n) > 72 ? (n) - 72 : 0)
static int checked(int t, int n, int steps) {
    return n <= 37 || t % 37 == 0 || t == n - 1 || t == n || t >= steps - 3;
}

/* kv_attend_chunk's hook: the token's probabilities, per (layer, token of the chunk, head), rank order */
typedef struct { float *p; int pos0, nh, budget; } Capture;
static void capture(void *ctx, int l, const KVCache *c, int pos) {
    Capture *k = (Capture *)ctx;
    int G = c->shape.n_heads / c->shape.n_kv_heads;
    for (int h = 0; h < k->nh; h++)
        memcpy(k->p + (((size_t)l * CHUNK_MAX + (pos - k->pos0)) * k->nh + h) * k->budget,
               c->scores + (size_t)h * c->budget, (size_t)c->lanes[l * c->shape.n_kv_heads + h / G].n_live * sizeof(float));
}

/* One stream through two caches of spec (random:n, or full with -c 1 for n = 1) in lockstep; chunked: the cache under
 * test runs every token through kv_attend_chunk, else it attends by kv_attend_cpu at the checked steps. */
static void run_case(RefTally *ty, int chunked, int n, int hd, int group, const TypeCase *tc, int pos_cache) {
    int nh = NKV * group;
    KVShape s = tshape(LAYERS, nh, NKV, hd, n);
    char opts[64], spec[160], where[320];
    snprintf(opts, sizeof opts, "%s", tc->opts);
    char *r = strstr(opts, "residual=R");
    if (r) snprintf(r, sizeof opts - (size_t)(r - opts), "residual=%d", n / 2 < 16 ? n / 2 : 16);
    char *pr = strstr(opts, "prec=f32:R/q8:R/");   /* three bands: a quarter of the lane each in f32 and q8 */
    if (pr) {
        char rest[64];
        snprintf(rest, sizeof rest, "%s", pr + strlen("prec=f32:R/q8:R/"));
        snprintf(pr, sizeof opts - (size_t)(pr - opts), "prec=f32:%d/q8:%d/%s", n / 4 > 0 ? n / 4 : 1,
                 n / 4 > 0 ? n / 4 : 1, rest);
    }
    if (n == 1) snprintf(spec, sizeof spec, "full,%s,pos=%s", opts, pos_cache ? "cache" : "orig");
    else snprintf(spec, sizeof spec, "random:%d,%s,pos=%s", n, opts, pos_cache ? "cache" : "orig");
    KVCache a, b;
    if (tcache(&a, &s, spec)) { ty->failed++; return; }
    if (tcache(&b, &s, spec)) { ty->failed++; kv_cache_free(&a); return; }
    RefAnswer ans;
    int steps = n == 1 ? 1 : n + (n / 2 < 40 ? n / 2 : 40) + 3;
    size_t qn = (size_t)nh * hd, kn = (size_t)NKV * hd, per = (size_t)LAYERS * CHUNK_MAX;
    float *q = (float *)malloc(per * qn * 4), *k = (float *)malloc(per * kn * 4), *v = (float *)malloc(per * kn * 4);
    float *out_r = (float *)malloc(qn * 4), *out_b = (float *)malloc(per * qn * 4);
    Capture cap = {(float *)malloc(per * nh * (size_t)n * 4), 0, nh, n};
    if (ref_answer_init(&ans, &a) || !q || !k || !v || !out_r || !out_b || !cap.p) {
        CHECK(0, "out of memory");
        exit(1);
    }
    trng_seed((uint64_t)n * 1000003u + (uint64_t)hd * 101u + (uint64_t)group * 7u + (uint64_t)pos_cache);
    for (int t = 0; t < WARM(n); t++)
        for (int l = 0; l < LAYERS; l++) {
            for (size_t j = 0; j < kn; j++) { k[j] = tnorm(); v[j] = tnorm() + 0.25f; }
            if (kv_append(&a, l, t, k, v) || kv_append(&b, l, t, k, v)) { CHECK(0, "kv_append '%s' at %d", spec, t); goto out; }
        }
    for (int t0 = WARM(n), ci = 0; t0 < steps; ci++) {
        int nc = chunked ? CHUNKS[ci % 6] : 1;
        nc = nc < steps - t0 ? nc : steps - t0;
        /* the chunk's inputs, (layer, token) */
        for (size_t i = 0; i < (size_t)LAYERS * nc; i++) {
            size_t row = i / nc * CHUNK_MAX + i % nc;
            for (size_t j = 0; j < kn; j++) { k[row * kn + j] = tnorm(); v[row * kn + j] = tnorm() + 0.25f; }
            for (size_t j = 0; j < qn; j++) q[row * qn + j] = tnorm();
        }
        for (int l = 0; l < LAYERS; l++) {
            size_t r0 = (size_t)l * CHUNK_MAX;
            if (chunked) {
                cap.pos0 = t0;
                if (kv_attend_chunk(&b, out_b + r0 * qn, l, t0, nc, q + r0 * qn, k + r0 * kn, v + r0 * kn, capture, &cap)) {
                    CHECK(0, "kv_attend_chunk '%s' at %d", spec, t0);
                    goto out;
                }
            }
            for (int u = 0; u < nc; u++) {
                int t = t0 + u;
                size_t row = r0 + u;
                if (kv_append(&a, l, t, k + row * kn, v + row * kn) ||
                    (!chunked && kv_append(&b, l, t, k + row * kn, v + row * kn))) {
                    CHECK(0, "kv_append '%s' at %d", spec, t);
                    goto out;
                }
                if (!checked(t, n, steps)) continue;
                kv_attend_ref(&a, out_r, l, t, q + row * qn);
                ref_answer_take(&ans, ty, &a, l, q + row * qn, out_r);
                snprintf(where, sizeof where, "'%s' head_dim %d group %d step %d layer %d", spec, hd, group, t, l);
                if (chunked) ref_answer_check(&ans, ty, out_b + row * qn, cap.p + row * nh * (size_t)n, (size_t)n, where);
                else {
                    kv_attend_cpu(&b, out_b, l, t, q + row * qn);
                    ref_answer_check(&ans, ty, out_b, b.scores, (size_t)b.budget, where);
                }
            }
        }
        t0 += nc;
    }
out:
    ref_answer_free(&ans);
    kv_cache_free(&a);
    kv_cache_free(&b);
    free(q); free(k); free(v); free(out_r); free(out_b); free(cap.p);
}

static void test_against_ref(int chunked) {
    static const int hds[] = {8, 64, 80, 128}, groups[] = {1, 3, 4};
    /* under the sanitizers (make test-debug) the long lanes hold 129 slots (three key blocks) instead of 513 */
    int ns[] = {1, 3, 37, getenv("KVLAB_SANITIZE") ? 129 : 513};
    const char *path = chunked ? "kv_attend_chunk (chunks of 5, 64, 1, 17, 2, 40)" : "kv_attend_cpu";
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int pc = 0; pc < 2; pc++) {
            RefTally ty;
            memset(&ty, 0, sizeof ty);
            for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
                for (size_t b = 0; b < sizeof hds / sizeof hds[0]; b++)
                    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++)
                        run_case(&ty, chunked, ns[a], hds[b], groups[g], &TYPES[ti], pc);
            CHECK(ty.attends > 0 && !ty.failed && !ty.nonfinite && !ty.bad_data,
                  "%s, %s == kv_attend_ref within the f32 bound, %s pos=%s: %d attends, 48 shapes (up to %d slots), "
                  "%ld values; worst err/bound %.2g (outputs) %.2g (probabilities); worst err %.2g of A_d, %.2g of "
                  "p_i; %d non-finite%s%s",
                  BUILD_NAME, path, TYPES[ti].name, pc ? "cache" : "orig", ty.attends, ns[3], ty.values, ty.worst_out,
                  ty.worst_prob, ty.err_out, ty.err_prob, ty.nonfinite, *ty.where ? "; " : "", ty.where);
        }
}

/* ---- the REF backend: kv_attend_chunk becomes kv_append + kv_attend_ref + hook, token by token ---- */
/* dst (n_heads, budget) = c->scores after layer l's step 4: each head's n_live probabilities, zeros after them (what
 * lies past n_live is undefined) */
static void copy_probs(float *dst, const KVCache *c, int l) {
    int G = c->shape.n_heads / c->shape.n_kv_heads;
    memset(dst, 0, (size_t)c->shape.n_heads * c->budget * sizeof(float));
    for (int h = 0; h < c->shape.n_heads; h++)
        memcpy(dst + (size_t)h * c->budget, c->scores + (size_t)h * c->budget,
               (size_t)c->lanes[l * c->shape.n_kv_heads + h / G].n_live * sizeof(float));
}
static void keep_probs(void *ctx, int l, const KVCache *c, int pos) {
    copy_probs((float *)ctx + ((size_t)pos * LAYERS + l) * c->shape.n_heads * c->budget, c, l);
}

static void test_backend_switch(void) {
    enum { T = 150, NH = 6, HD = 64 };
    const char *spec = "h2o:40,type=q8,residual=4,pos=cache";   /* evicts by attention: step 4 must see the same */
    KVShape s = tshape(LAYERS, NH, NKV, HD, 64);
    KVCache a, b;
    if (tcache(&a, &s, spec)) return;
    if (tcache(&b, &s, spec)) { kv_cache_free(&a); return; }
    int set = kv_set_backend(&b, KV_BACKEND_REF), bad = kv_set_backend(&b, (KVBackend)7);
    static float q[T][LAYERS][NH * HD], k[T][LAYERS][NKV * HD], v[T][LAYERS][NKV * HD];
    static float oa[T][LAYERS][NH * HD], ob[LAYERS][T][NH * HD], pa[T][LAYERS][NH * 40], pb[T][LAYERS][NH * 40];
    trng_seed(5);
    for (int t = 0; t < T; t++)
        for (int l = 0; l < LAYERS; l++) {
            for (int j = 0; j < NKV * HD; j++) { k[t][l][j] = tnorm(); v[t][l][j] = tnorm(); }
            for (int j = 0; j < NH * HD; j++) q[t][l][j] = tnorm();
        }
    int rc = 0;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < LAYERS; l++) {
            rc |= kv_append(&a, l, t, k[t][l], v[t][l]);
            kv_attend_ref(&a, oa[t][l], l, t, q[t][l]);
            copy_probs(pa[t][l], &a, l);
        }
    /* the same tokens through kv_attend_chunk on the REF backend, as the forward pass feeds a layer: per layer, in
       chunks (every one of which the fast backend would batch while the lanes have room) */
    for (int t0 = 0, ci = 0; t0 < T; ci++) {
        int nc = CHUNKS[ci % 6] < T - t0 ? CHUNKS[ci % 6] : T - t0;
        float qc[CHUNK_MAX * NH * HD], kc[CHUNK_MAX * NKV * HD], vc[CHUNK_MAX * NKV * HD];
        for (int l = 0; l < LAYERS; l++) {
            for (int u = 0; u < nc; u++) {
                memcpy(qc + u * NH * HD, q[t0 + u][l], sizeof q[0][0]);
                memcpy(kc + u * NKV * HD, k[t0 + u][l], sizeof k[0][0]);
                memcpy(vc + u * NKV * HD, v[t0 + u][l], sizeof v[0][0]);
            }
            rc |= kv_attend_chunk(&b, ob[l][t0], l, t0, nc, qc, kc, vc, keep_probs, pb);
        }
        t0 += nc;
    }
    int same = 1;
    for (int t = 0; t < T; t++)
        for (int l = 0; l < LAYERS; l++) same &= !memcmp(oa[t][l], ob[l][t], sizeof oa[t][l]);
    int pos_a[40], pos_b[40], kept = 1;
    for (int l = 0; l < LAYERS; l++)
        for (int g = 0; g < NKV; g++) {
            int na = kv_lane_positions(&a, l, g, pos_a, 40), nb = kv_lane_positions(&b, l, g, pos_b, 40);
            kept &= na == nb && !memcmp(pos_a, pos_b, (size_t)na * sizeof(int));
        }
    CHECK(set == 0 && bad == -1 && b.backend == KV_BACKEND_REF && rc == 0 && same && !memcmp(pa, pb, sizeof pa) && kept
          && a.n_evictions > 0 && a.n_evictions == b.n_evictions,
          "kv_set_backend(REF): kv_attend_chunk in chunks of 5..64 gives kv_append + kv_attend_ref's outputs and "
          "probabilities bit for bit over %d tokens of '%s' (%d evictions, the same tokens kept); an unknown backend "
          "is refused", T, spec, b.n_evictions);
    kv_cache_reset(&b);
    b.device = &b;   /* a device mirror attached (never used: kv_set_backend only looks) */
    int dev = kv_set_backend(&b, KV_BACKEND_FAST);
    b.device = NULL;
    CHECK(dev == -1 && b.backend == KV_BACKEND_REF, "kv_set_backend refuses a cache with a device mirror and keeps its "
          "backend; kv_cache_reset keeps the backend");
    kv_cache_free(&a);
    kv_cache_free(&b);
}

/* ---- step 4: kv_attend_ref shows the policy the group mean of its probabilities, in rank order ---- */
static float seen[NKV][64];
static int seen_n[NKV];
static void record_attend(KVPolicy *p, int lane, const KVLane *ln, const float *prob, const float *mean, int pos_now) {
    memcpy(seen[lane % NKV], prob, (size_t)ln->n_live * sizeof(float));
    seen_n[lane % NKV] = ln->n_live;
}

static void test_policy_step(void) {
    enum { NH = 8, HD = 80, T = 30 };
    KVShape s = tshape(1, NH, NKV, HD, 64);
    KVCache c;
    if (tcache(&c, &s, "window:12,type=bf16,pos=cache")) return;
    KVPolicyOps ops = *c.policy.ops;
    ops.observe = record_attend;
    c.policy.ops = &ops;
    float q[NH * HD], k[NKV * HD], v[NKV * HD], out[NH * HD];
    int ok = 1, G = NH / NKV;
    trng_seed(3);
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < NKV * HD; j++) { k[j] = tnorm(); v[j] = tnorm(); }
        for (int j = 0; j < NH * HD; j++) q[j] = tnorm();
        kv_append(&c, 0, t, k, v);
        memset(seen_n, 0, sizeof seen_n);
        kv_attend_ref(&c, out, 0, t, q);
        for (int g = 0; g < NKV; g++) {
            ok &= seen_n[g] == c.lanes[g].n_live;
            for (int i = 0; i < seen_n[g]; i++) {
                float sum = 0;   /* kv_attend_policy's mean: heads summed in order, then divided */
                for (int hh = 0; hh < G; hh++) sum += c.scores[(size_t)(g * G + hh) * c.budget + i];
                ok &= seen[g][i] == sum / G;
            }
        }
    }
    CHECK(ok && c.n_evictions > 0, "kv_attend_ref runs step 4: the policy sees each lane's group-mean probabilities "
          "of c->scores in rank order at every step (%d steps, %d evictions)", T, c.n_evictions);
    c.policy.ops = kv_policy_find("window");
    kv_cache_free(&c);
}

int main(void) {
    test_backend_switch();
    test_policy_step();
    test_against_ref(0);
    test_against_ref(1);
    CHECK_EXIT();
}
