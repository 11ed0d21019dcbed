/* test_attn.cu: the CUDA attention path (attn.cu) against kv_attend_ref, the definition (within the f32 bound of
 * tests/attn_ref_check.h), and against kv_attend_cpu (within the tolerances below). Part 1 runs everywhere: the
 * kernels' encoder and decoder compiled for the host against kv_encode/kv_decode (byte for byte), the launch plan, and
 * the CPU twin of every kernel (store, residual move, live-list upload, split attention, merge, probabilities) over
 * odd shapes: 1, 3, 37, 513, 4099 live slots; head_dim 8, 64, 80, 128; GQA ratios 1, 3, 4;
 * lanes with holes after random eviction; every storage type, mixed k/v types and the f32 residual; pos=orig and
 * pos=cache. Part 2 runs the same streams through the device mirror when a GPU is usable, else prints one SKIP line.
 * `test_attn --bench MODEL.bin` times decode attention for tests/gpu_check.sh (GPU builds only).
 * Compiled as C++ (host code only): the kernels live in attn.cu.
 * Dimensions: n_layers, n_heads, n_kv_heads, head_dim, budget.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "kv.h"
#include "run.h"
#include "tests/test_kv_util.h"
#include "tests/attn_ref_check.h"
}
#include "attn.h"

/* ---- encoder and decoder twins: byte for byte ---- */
static void test_codec_twins(void) {
    static const int hds[] = {2, 6, 8, 64, 80, 128};
    int bad_enc = 0, bad_dec = 0, cases = 0;
    char first[256] = "";
    trng_seed(7);
    for (int ty = 0; ty < KV_NTYPES; ty++)
        for (size_t hi = 0; hi < sizeof hds / sizeof hds[0]; hi++) {
            int hd = hds[hi];
            size_t nb = kv_vector_bytes((KVType)ty, hd);
            float x[128], a[128], b[128];
            uint8_t e1[600], e2[600];
            for (int rep = 0; rep < 300; rep++) {
                /* scales from subnormal-f16 territory to past f16's range; zeros, constants and ties sprinkled in */
                float scale = rep % 6 == 0 ? 1e-6f : rep % 6 == 1 ? 7e4f : rep % 6 == 2 ? 0.5f : rep % 6 == 3 ? 3e-3f : 1.0f;
                for (int e = 0; e < hd; e++) {
                    x[e] = trng_normal() * scale;
                    if (rep % 11 == 5) x[e] = 0;
                    if (rep % 13 == 7) x[e] = 1.25f;
                    if (rep % 17 == 3 && e % 3 == 0) x[e] = -x[e > 0 ? e - 1 : 0];
                }
                kv_encode(e1, (KVType)ty, x, hd);
                attn_encode_twin(e2, (KVType)ty, x, hd);
                cases++;
                if (memcmp(e1, e2, nb)) {
                    if (!bad_enc++) snprintf(first, sizeof first, "%s head_dim %d case %d", kv_type_names[ty], hd, rep);
                    continue;
                }
                kv_decode(a, (KVType)ty, e1, hd);
                for (int e = 0; e < hd; e++) b[e] = attn_decode_elem_twin((KVType)ty, e1, e, hd);
                if (memcmp(a, b, (size_t)hd * sizeof(float))) bad_dec++;
            }
        }
    CHECK(bad_enc == 0, "kernel encoder == kv_encode byte for byte: %d vectors, %d types, head_dim 2..128 (%d differ%s%s)",
          cases, (int)KV_NTYPES, bad_enc, *first ? ", first " : "", first);
    CHECK(bad_dec == 0, "kernel decoder == kv_decode bit for bit: %d vectors (%d differ)", cases, bad_dec);
}

/* ---- the launch plan ---- */
static void test_plan(void) {
    int tps, chunk, ok = 1;
    struct { int hd, tps; } want[] = {{8, 1}, {64, 8}, {80, 8}, {128, 16}, {256, 32}, {6, 1}, {96, 8}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (attn_plan_twin(want[i].hd, 3, 1000, 3, &tps, &chunk) || tps != want[i].tps) {
            ok = 0;
            printf("  head_dim %d: tps %d, want %d\n", want[i].hd, tps, want[i].tps);
        }
    }
    CHECK(ok, "threads per vector: head_dim 8 -> 1, 64 -> 8, 80 -> 8, 128 -> 16, 256 -> 32 (whole RoPE pairs each)");
    int refused = attn_plan_twin(72, 1, 100, 1, &tps, &chunk) != 0 && attn_plan_twin(1024, 1, 100, 1, &tps, &chunk) != 0;
    CHECK(refused, "head_dim 72 and 1024 are refused (the engine then stays on the CPU)");
    ok = 1;
    for (int n = 1; n <= 1 << 20; n *= 3)
        for (int g = 1; g <= 8; g++) {
            if (attn_plan_twin(128, g, n, 3, &tps, &chunk) || chunk < 64 || chunk % 32) ok = 0;
        }
    CHECK(ok, "chunks are multiples of 32, at least 64 ranks, for 1 .. 1M slots and groups 1 .. 8");
}

/* ---- attention: the mirror (twin or device) against kv_attend_cpu on the same cache ---- */

/* Cheap bell-shaped test values (sum of three uniforms, variance 1): Box-Muller's log and cos dominated the run time. */
static inline float tnorm(void) { return (trng_unif() + trng_unif() + trng_unif() - 1.5f) * 2.0f; }

/* Under pos=orig the host rotates a key before storing it with kv.c's rope_apply, which GCC 12 -O3 -march=native
 * vectorizes with fused multiply-adds (vfmaddsub, even under -ffp-contract=off) in its vector body but not in its tail,
 * so a rotated key may differ from the kernels' (separately rounded) rotation by an f32 rounding, which a storage type
 * can turn into one step of that type: key_tol is that step relative to the vector's largest element (f16 2^-10,
 * bf16 2^-7, q8 1/127 of a group's max, q4 1/15 and q2 1/3 of a group's range <= 2 max; f32 a few ulps). The
 * attention bounds under pos=orig follow: measured worst (CPU twin, this grid) f16 5.6e-5 / 1.2e-5, bf16 5.8e-5 /
 * 8.8e-6, q8 1.3e-4 / 2.1e-5, q4 7.4e-5 / 7.9e-6, q2 3.5e-6 / 1.2e-7 (output relative / probability absolute); the
 * bounds allow about 10x. Under pos=cache keys are stored unrotated and every byte must match. */
typedef struct { const char *name, *opts; double key_tol, orig_out, orig_prob; } TypeCase;
static const TypeCase TYPES[] = {
    {"f32", "type=f32", 1e-6, 3e-5, 5e-7},
    {"f16", "type=f16", 1.0 / 1024, 6e-4, 1.2e-4},
    {"bf16", "type=bf16", 1.0 / 128, 6e-4, 1.2e-4},
    {"q8", "type=q8", 1.01 / 127, 1.5e-3, 2.5e-4},
    {"q4", "type=q4", 2.02 / 15, 1.5e-3, 2.5e-4},
    {"q2", "type=q2", 2.02 / 3, 1.5e-3, 2.5e-4},
    {"k q8 v f16", "ktype=q8,vtype=f16", 1.01 / 127, 1.5e-3, 2.5e-4},
    {"q8 + residual", "type=q8,residual=R", 1.01 / 127, 1.5e-3, 2.5e-4},
    {"q4 + residual", "type=q4,residual=R", 2.02 / 15, 1.5e-3, 2.5e-4},
};
#define N_TYPES (int)(sizeof TYPES / sizeof TYPES[0])

typedef struct {
    double out_err, prob_err;   /* worst relative output error, worst absolute probability error */
    int configs, nonfinite, bytes_bad, sentinel_bad, attends;
    char where[200], bytes_msg[512], sentinel_msg[512];
} Tally;

/* Fill a cache with one token stream and compare the mirror's attention with kv_attend_ref's (into rt) and with
 * kv_attend_cpu's (into ty) at a few steps and at the end, for both layers. n: live slots per lane at the end.
 * Returns -1 when the cache cannot be made. */
static int run_case(Tally *ty, RefTally *rt, int on_gpu, int n, int hd, int group, const TypeCase *tc, int pos_cache) {
    int n_kv = 2, n_heads = n_kv * group, n_layers = 2;
    KVShape s = tshape(n_layers, n_heads, n_kv, hd, n);
    char opts[64], spec[160];
    snprintf(opts, sizeof opts, "%s", tc->opts);
    char *r = strstr(opts, "residual=R");
    if (r) sprintf(r, "residual=%d", n / 2 < 16 ? n / 2 : 16);
    /* random eviction leaves holes anywhere in a lane; one slot cannot evict, so n = 1 is `full` with -c 1 */
    if (n == 1) snprintf(spec, sizeof spec, "full,%s,pos=%s", opts, pos_cache ? "cache" : "orig");
    else snprintf(spec, sizeof spec, "random:%d,%s,pos=%s", n, opts, pos_cache ? "cache" : "orig");
    KVCache c;
    if (tcache(&c, &s, spec)) return -1;
    char err[200];
    int rc = on_gpu ? attn_dev_attach(&c, err, sizeof err) : attn_twin_attach(&c, err, sizeof err);
    if (rc) { CHECK(0, "attach a mirror to '%s' head_dim %d: %s", spec, hd, err); kv_cache_free(&c); return -1; }
    /* past the budget each step evicts one random token (a hole anywhere); long lanes get 40 holes, which keeps the
       O(budget) victim scans of random from dominating the test's time */
    int steps = n == 1 ? 1 : n + (n / 2 < 40 ? n / 2 : 40) + 3;
    size_t qn = (size_t)n_heads * hd, kn = (size_t)n_kv * hd;
    float *q = (float *)malloc(qn * 4), *k = (float *)malloc(kn * 4), *v = (float *)malloc(kn * 4);
    float *out_m = (float *)malloc(qn * 4), *out_c = (float *)malloc(qn * 4);
    float *probs = (float *)malloc((size_t)n_heads * c.budget * 4), *out_r = (float *)malloc(qn * 4);
    RefAnswer ans;
    char where[320];
    if (ref_answer_init(&ans, &c)) { CHECK(0, "out of memory"); exit(1); }
    trng_seed((uint64_t)n * 1000003u + (uint64_t)hd * 101u + (uint64_t)group * 7u + (uint64_t)pos_cache);
    for (int t = 0; t < steps; t++) {
        int check = t == steps - 1 || (n <= 513 && t == steps / 2) || (n <= 37 && t % 5 == 0);
        for (int l = 0; l < n_layers; l++) {
            for (size_t i = 0; i < kn; i++) { k[i] = tnorm(); v[i] = tnorm() + 0.25f; }
            if (kv_append(&c, l, t, k, v)) { CHECK(0, "kv_append '%s' at %d", spec, t); goto out; }
            if (!check) continue;
            for (size_t i = 0; i < qn; i++) q[i] = tnorm();
            attn_mirror_attend(&c, out_m, probs, l, t, q);
            /* the definition first (its step 4 changes nothing: random keeps no attention state), then the CPU path */
            kv_attend_ref(&c, out_r, l, t, q);
            ref_answer_take(&ans, rt, &c, l, q, out_r);
            snprintf(where, sizeof where, "'%s' head_dim %d group %d step %d layer %d", spec, hd, group, t, l);
            ref_answer_check(&ans, rt, out_m, probs, (size_t)c.budget, where);
            kv_attend_cpu(&c, out_c, l, t, q);
            ty->attends++;
            for (int h = 0; h < n_heads; h++) {
                const KVLane *ln = &c.lanes[l * n_kv + h / group];
                double mx = 0, e = 0;
                for (int d = 0; d < hd; d++) {
                    float a = out_m[(size_t)h * hd + d], b = out_c[(size_t)h * hd + d];
                    if (!isfinite(a)) ty->nonfinite++;
                    mx = fmax(mx, fabs(b));
                    e = fmax(e, fabs((double)a - b));
                }
                double rel = e / (mx > 1e-6 ? mx : 1e-6);
                if (!(rel <= ty->out_err)) {   /* NaN lands here too */
                    ty->out_err = isnan(rel) ? INFINITY : rel;
                    snprintf(ty->where, sizeof ty->where, "n %d head_dim %d group %d pos=%s step %d layer %d head %d",
                             n, hd, group, pos_cache ? "cache" : "orig", t, l, h);
                }
                for (int i = 0; i < ln->n_live; i++) {
                    float a = probs[(size_t)h * c.budget + i], b = c.scores[(size_t)h * c.budget + i];
                    if (!isfinite(a)) ty->nonfinite++;
                    double pe = fabs((double)a - b);
                    if (!(pe <= ty->prob_err)) ty->prob_err = isnan(pe) ? INFINITY : pe;
                }
            }
        }
    }
    if (!ty->bytes_bad && attn_mirror_check_bytes(&c, pos_cache ? 0 : tc->key_tol, err, sizeof err)) {
        ty->bytes_bad = 1;
        snprintf(ty->bytes_msg, sizeof ty->bytes_msg, "'%s' head_dim %d group %d: %s", spec, hd, group, err);
    }
    if (!ty->sentinel_bad && attn_mirror_check_sentinels(&c, err, sizeof err)) {
        ty->sentinel_bad = 1;
        snprintf(ty->sentinel_msg, sizeof ty->sentinel_msg, "'%s' head_dim %d: %s", spec, hd, err);
    }
    ty->configs++;
out:
    attn_mirror_detach(&c);
    kv_cache_free(&c);
    free(q); free(k); free(v); free(out_m); free(out_c); free(probs); free(out_r);
    ref_answer_free(&ans);
    return 0;
}

/* Tolerances. The mirror holds the same bytes as the host cache (checked exactly below), so both sides decode the
 * same f32 keys and values whatever the storage type; they differ only in f32 summation order (dot products over
 * head_dim, sums over up to 4099 slots split in chunks) and in expf's last bit. For scores of size ~3 and probability
 * sums of n terms the rounding is a few eps (6e-8) times log-depth sums: measured worst 1.2e-6 relative on the
 * outputs and 2e-8 absolute on the probabilities over this grid; the bounds allow 20x (CPU twin) and 50x (GPU,
 * whose expf differs from glibc's by up to 2 ulp). */
#define TOL_OUT_TWIN 2.5e-5
#define TOL_PROB_TWIN 5e-7
#define TOL_OUT_GPU 6e-5
#define TOL_PROB_GPU 1e-6

static void test_attention(int on_gpu) {
    static const int ns[] = {1, 3, 37, 513, 4099}, hds[] = {8, 64, 80, 128}, groups[] = {1, 3, 4};
    const char *who = on_gpu ? "GPU" : "CPU twin";
    /* under the sanitizers (make test-debug) the 4099-slot lanes are left out: minutes there, seconds here */
    int n_ns = getenv("KVLAB_SANITIZE") && !on_gpu ? 4 : 5, want = n_ns * 12;
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int pc = 0; pc < 2; pc++) {
            double tol_out = on_gpu ? TOL_OUT_GPU : TOL_OUT_TWIN, tol_prob = on_gpu ? TOL_PROB_GPU : TOL_PROB_TWIN;
            if (!pc) {   /* pos=orig: a stored key may be one type step away (see TYPES) */
                tol_out = fmax(tol_out, TYPES[ti].orig_out * (on_gpu ? 2 : 1));
                tol_prob = fmax(tol_prob, TYPES[ti].orig_prob * (on_gpu ? 2 : 1));
            }
            Tally ty;
            RefTally rt;
            memset(&ty, 0, sizeof ty);
            memset(&rt, 0, sizeof rt);
            for (int a = 0; a < n_ns; a++)
                for (size_t b = 0; b < sizeof hds / sizeof hds[0]; b++)
                    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++)
                        run_case(&ty, &rt, on_gpu, ns[a], hds[b], groups[g], &TYPES[ti], pc);
            const char *pos = pc ? "cache" : "orig";
            CHECK(rt.attends > 0 && !rt.failed && !rt.nonfinite && !rt.bad_data,
                  "%s attention == kv_attend_ref within the f32 bound, %s pos=%s: %d attends, %ld values; worst "
                  "err/bound %.2g (outputs) %.2g (probabilities); worst err %.2g of A_d, %.2g of p_i; %d non-finite%s%s",
                  who, TYPES[ti].name, pos, rt.attends, rt.values, rt.worst_out, rt.worst_prob, rt.err_out,
                  rt.err_prob, rt.nonfinite, *rt.where ? "; " : "", rt.where);
            CHECK(ty.configs == want && ty.nonfinite == 0 && ty.out_err <= tol_out && ty.prob_err <= tol_prob,
                  "%s attention == kv_attend_cpu, %s pos=%s: %d shapes, %d attends; output rel err %.2g (bound %.1g), "
                  "prob abs err %.2g (bound %.1g), %d non-finite%s%s", who, TYPES[ti].name, pos, ty.configs,
                  ty.attends, ty.out_err, tol_out, ty.prob_err, tol_prob, ty.nonfinite, *ty.where ? "; worst at " : "",
                  ty.where);
            CHECK(!ty.bytes_bad, "%s mirror stores kv.c's bytes and live lists exactly%s, %s pos=%s%s%s", who,
                  pc ? "" : " (keys within one type step)", TYPES[ti].name, pos, ty.bytes_bad ? ": " : "", ty.bytes_msg);
            CHECK(!ty.sentinel_bad, "%s sentinel bytes after scores, splits, output, max/sum intact, %s pos=%s%s%s", who,
                  TYPES[ti].name, pos, ty.sentinel_bad ? ": " : "", ty.sentinel_msg);
        }
}

/* A mirror attached to a cache that already holds tokens uploads them, and a reset empties it. */
static void test_attach_late_and_reset(int on_gpu) {
    KVShape s = tshape(1, 6, 2, 64, 64);
    KVCache c;
    if (tcache(&c, &s, "window:16,type=q8,residual=4,pos=cache")) return;
    float k[128], v[128], q[384], o1[384], o2[384], probs[6 * 16];
    trng_seed(99);
    for (int t = 0; t < 40; t++) {
        for (int i = 0; i < 128; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
        kv_append(&c, 0, t, k, v);
    }
    char err[256];
    int rc = on_gpu ? attn_dev_attach(&c, err, sizeof err) : attn_twin_attach(&c, err, sizeof err);
    CHECK(rc == 0, "%s: attach to a cache holding 16 tokens per lane%s%s", on_gpu ? "GPU" : "twin", rc ? ": " : "", rc ? err : "");
    if (rc) { kv_cache_free(&c); return; }
    for (int i = 0; i < 384; i++) q[i] = trng_normal();
    attn_mirror_attend(&c, o1, probs, 0, 39, q);
    kv_attend_cpu(&c, o2, 0, 39, q);
    double e = 0;
    for (int i = 0; i < 384; i++) e = fmax(e, fabs((double)o1[i] - o2[i]));
    CHECK(e <= 1e-4, "%s: a late-attached mirror attends like kv_attend_cpu (max abs err %.2g)", on_gpu ? "GPU" : "twin", e);
    kv_cache_reset(&c);
    for (int t = 0; t < 5; t++) {
        for (int i = 0; i < 128; i++) { k[i] = trng_normal(); v[i] = trng_normal(); }
        kv_append(&c, 0, t, k, v);
    }
    attn_mirror_attend(&c, o1, probs, 0, 4, q);
    kv_attend_cpu(&c, o2, 0, 4, q);
    e = 0;
    for (int i = 0; i < 384; i++) e = fmax(e, fabs((double)o1[i] - o2[i]));
    rc = attn_mirror_check_bytes(&c, 0, err, sizeof err);
    CHECK(e <= 1e-4 && rc == 0, "%s: after kv_cache_reset the mirror follows the new document (max abs err %.2g)%s%s",
          on_gpu ? "GPU" : "twin", e, rc ? ": " : "", rc ? err : "");
    attn_mirror_detach(&c);
    kv_cache_free(&c);
}

#ifdef KVLAB_CUDA
/* test_attn --bench MODEL.bin: decode attention over all lanes of the model's shape at 1K, 8K, 32K, 128K tokens per
 * lane for f16 and q8, and a device-to-device copy, as one table. */
static int bench(const char *model_path) {
    Model m;
    char err[512], name[256], why[256];
    if (!attn_cuda_usable(name, sizeof name, why, sizeof why)) { printf("SKIP bench: %s\n", why); return 0; }
    if (model_open(&m, model_path, err, sizeof err)) { fprintf(stderr, "test_attn: %s\n", err); return 1; }
    KVShape s = model_kv_shape(&m, m.config.seq_len);
    double copy_gbps = 0, copy_ms = 0;
    if (attn_bench_copy((size_t)1 << 30, 20, &copy_gbps, &copy_ms, err, sizeof err)) {
        fprintf(stderr, "test_attn: %s\n", err);
        return 1;
    }
    printf("device %s; model %s: %d layers x %d kv heads = %d lanes, %d query heads, head_dim %d\n", name, model_path,
           s.n_layers, s.n_kv_heads, s.n_layers * s.n_kv_heads, s.n_heads, s.head_dim);
    printf("device-to-device copy of 1 GiB: %.3f ms median of 20, %.0f GB/s (read + written)\n", copy_ms, copy_gbps);
    printf("\n| type | tokens/lane | K+V bytes read | median ms | GB/s | %% of copy | chunk x splits | valid |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    static const int ns[] = {1024, 8192, 32768, 131072};
    static const KVType tys[] = {KV_F16, KV_Q8};
    int rc = 0;
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 4; b++) {
            AttnBench r;
            if (attn_bench(&s, tys[a], ns[b], 25, &r, err, sizeof err)) {
                printf("| %s | %d | error: %s |\n", kv_type_names[tys[a]], ns[b], err);
                rc = 1;
                continue;
            }
            printf("| %s | %d | %.1f MiB | %.4f | %.0f | %.0f%% | %d x %d | %s |\n", kv_type_names[tys[a]], ns[b],
                   r.bytes / 1048576.0, r.ms_median, r.gbps, 100.0 * r.gbps / copy_gbps, r.chunk, r.splits,
                   r.bad ? "NO" : "yes");
            if (r.bad) rc = 1;
            fflush(stdout);
        }
    printf("\nbandwidth = bytes of K, V and scales read / kernel time (all %d lanes of one decode step, CUDA events, "
           "median of 25, L2 flushed between repeats); copy = (bytes read + bytes written) / time.\n",
           s.n_layers * s.n_kv_heads);
    model_close(&m);
    return rc;
}
#endif

/* What the mirror does not take yet is refused when it attaches, with a message naming the spec and the CPU way. */
static void test_refused(void) {
    const char *specs[] = {"full,prec=f32:4/q8:8/q4", "full,prec=q8:4/q4", "pool:16,group=2,recent=8", "topk:8",
                           "h2o:16,merge=1", "full,type=q2,kgroup=channel", "h2o:16,type=q4,kgroup=channel,residual=4"};
    for (int i = 0; i < 7; i++) {
        KVShape s = tshape(2, 4, 2, 64, 32);
        KVCache c;
        char err[512] = "";
        if (tcache(&c, &s, specs[i])) continue;
        int rc = attn_twin_attach(&c, err, sizeof err);
        CHECK(rc != 0 && strstr(err, specs[i]) && strstr(err, "-d cpu") && !c.device,
              "the mirror refuses '%s' (%s)", specs[i], rc ? err : "attached");
        if (!rc) attn_mirror_detach(&c);
        kv_cache_free(&c);
    }
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--bench")) {
#ifdef KVLAB_CUDA
        return bench(argv[2]);
#else
        printf("SKIP bench: this build has no CUDA attention (nvcc was not found at build time)\n");
        return 0;
#endif
    }
    test_codec_twins();
    test_plan();
    test_refused();
    test_attention(0);
    test_attach_late_and_reset(0);
    char name[256], why[256];
    if (attn_cuda_usable(name, sizeof name, why, sizeof why)) {
        printf("GPU: %s\n", name);
        test_attention(1);
        test_attach_late_and_reset(1);
    } else {
        SKIP("GPU part of test_attn (every check above, on the device): %s", why);
    }
    CHECK_EXIT();
}
