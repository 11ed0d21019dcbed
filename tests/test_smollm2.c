/* test_smollm2: SmolLM2-135M-Instruct (models/smollm2-135m-instruct.bin from `make model`) against llama.cpp run on
 * the same f32 weights (tests/golden/smollm2, made as tests/golden/README.md says): for each golden prompt, the
 * first-step logits within a stated tolerance and the greedy ids, id for id, until EOS or 64 steps; and kvlab's
 * tokenizer gives llama.cpp's prompt ids for the plain-text prompts. Then the reference attention (kv_set_backend
 * REF: kv_attend_ref token by token) against the fast path through the whole forward pass: the same greedy ids for
 * every golden prompt, and the perplexity of a few hundred tokens within a stated tolerance. SKIPs when the model is
 * absent or KVLAB_SANITIZE is set. */
#include "run.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

#define MODEL "models/smollm2-135m-instruct.bin"
#define GOLD "tests/golden/smollm2/"

typedef struct { int ids[256]; int n; } Ids;

/* Read "prefix N ids: a b c" lines into out[N]. */
static int read_ids(const char *path, const char *prefix, Ids *out, int max) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char *line = NULL;
    size_t cap = 0;
    int count = 0;
    while (getline(&line, &cap, f) > 0) {
        int k;
        size_t pl = strlen(prefix);
        if (strncmp(line, prefix, pl) || sscanf(line + pl, "%d", &k) != 1 || k < 0 || k >= max) continue;
        char *p = strstr(line, "ids:");
        if (!p) continue;
        p += 4;
        out[k].n = 0;
        char *end;
        for (;;) {
            long v = strtol(p, &end, 10);
            if (end == p || out[k].n == 256) break;
            out[k].ids[out[k].n++] = (int)v;
            p = end;
        }
        if (k + 1 > count) count = k + 1;
    }
    free(line);
    fclose(f);
    return count;
}

/* The plain prompts of prompts.txt (no ChatML markers), by index; escapes \n and \\ undone. */
static int read_prompts(char prompts[][512], int max) {
    FILE *f = fopen(GOLD "prompts.txt", "r");
    if (!f) return -1;
    char line[2048];
    int n = 0;
    while (n < max && fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        line[strcspn(line, "\n")] = 0;
        char *o = prompts[n];
        for (char *p = line; *p && o < prompts[n] + 511; p++) {
            if (p[0] == '\\' && p[1] == 'n') { *o++ = '\n'; p++; }
            else if (p[0] == '\\' && p[1] == '\\') { *o++ = '\\'; p++; }
            else *o++ = *p;
        }
        *o = 0;
        n++;
    }
    fclose(f);
    return n;
}

/* Greedy ids from prompt p, at most max steps or up to EOS, with the cache's attention on backend b; the prompt goes
 * through forward_prefill 64 tokens at a time, as generate does. Returns how many ids, or -1. */
static int greedy(Model *m, const Ids *p, KVBackend b, int max, int *out) {
    char err[512];
    KVShape shape = model_kv_shape(m, 2048);
    KVSpec spec;
    KVCache c;
    RunState s;
    if (kv_spec_parse(&spec, "full", KV_F32, err, sizeof err) || kv_cache_init(&c, &shape, &spec, err, sizeof err))
        return -1;
    if (kv_set_backend(&c, b) || state_init_chunk(&s, &m->config, 64)) { kv_cache_free(&c); return -1; }
    int n = -1, pos = p->n;
    if (!forward_prefill(m, &s, &c, p->ids, (size_t)p->n, 0, 64))
        for (n = 0; n < max;) {
            out[n++] = sample_argmax(s.logits, m->config.vocab_size);
            if (out[n - 1] == m->tokenizer.eos_id || n == max || forward(m, &s, &c, out[n - 1], pos++)) break;
        }
    state_free(&s);
    kv_cache_free(&c);
    return n;
}

/* log p(next) from one row of logits (vocab), in double */
static double log_prob(const float *lg, size_t V, int next) {
    double mx = lg[0], sum = 0;
    for (size_t i = 1; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
    for (size_t i = 0; i < V; i++) sum += exp(lg[i] - mx);
    return lg[next] - mx - log(sum);
}

/* Teacher-forced NLL of ids (summed over n - 1 predictions, nats) through spec with the fast backend (nll[0]) and the
 * reference (nll[1]) in lockstep, 64 tokens at a time, and the largest logit difference between them. 0, or -1. */
static int nll_both(Model *m, const int *ids, int n, const char *spec_text, double nll[2], double *worst) {
    char err[512];
    KVShape shape = model_kv_shape(m, 2048);
    KVSpec spec;
    KVCache c[2];
    RunState s[2];
    size_t V = (size_t)m->config.vocab_size;
    int made = 0;
    nll[0] = nll[1] = 0;
    *worst = 0;
    if (kv_spec_parse(&spec, spec_text, KV_F32, err, sizeof err)) return -1;
    for (; made < 2; made++) {
        if (kv_cache_init(&c[made], &shape, &spec, err, sizeof err)) break;
        if (kv_set_backend(&c[made], made ? KV_BACKEND_REF : KV_BACKEND_FAST) ||
            state_init_chunk(&s[made], &m->config, 64)) { kv_cache_free(&c[made]); break; }
    }
    int rc = made < 2 ? -1 : 0;
    for (int t0 = 0; t0 < n - 1 && !rc; t0 += 64) {
        int nt = n - 1 - t0 < 64 ? n - 1 - t0 : 64;
        for (int b = 0; b < 2 && !rc; b++) rc = forward_chunk(m, &s[b], &c[b], ids + t0, nt, t0);
        for (int u = 0; u < nt && !rc; u++) {
            const float *lf = s[0].logits + (size_t)u * V, *lr = s[1].logits + (size_t)u * V;
            nll[0] -= log_prob(lf, V, ids[t0 + u + 1]);
            nll[1] -= log_prob(lr, V, ids[t0 + u + 1]);
            for (size_t i = 0; i < V; i++) {
                double e = fabs((double)lf[i] - lr[i]);
                if (!(e <= *worst)) *worst = e;   /* a NaN stays */
            }
        }
    }
    for (int b = 0; b < made; b++) { state_free(&s[b]); kv_cache_free(&c[b]); }
    return rc;
}

/* The REF backend against the fast path through the whole model: greedy ids from each golden prompt (the fast
 * path's are gen[k]'s first match[k] ids, checked against llama.cpp above), and the perplexity of a fixed text. */
static void test_ref_backend(Model *m, const Ids *prompt, const Ids *gen, const int *match, int n_prompts) {
    int ok = 1, steps = 0, ref[256];
    for (int k = 0; k < n_prompts; k++) {
        int nr = greedy(m, &prompt[k], KV_BACKEND_REF, gen[k].n, ref);
        if (match[k] != gen[k].n || nr != match[k] || memcmp(ref, gen[k].ids, (size_t)match[k] * sizeof(int))) {
            ok = 0;
            printf("  prompt %d: the fast path gave %d of %d golden ids, the reference %d ids\n", k, match[k],
                   gen[k].n, nr);
        }
        steps += nr > 0 ? nr : 0;
    }
    CHECK(ok, "reference attention (kv_set_backend REF) gives the fast path's greedy ids for all %d golden prompts, "
          "up to 64 steps or EOS (%d ids)", n_prompts, steps);
    /* perplexity of LICENSE then prompts.txt (both fixed texts of this repository) */
    char text[4096];
    size_t len = 0;
    const char *files[] = {"LICENSE", GOLD "prompts.txt"};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "rb");
        if (f) { len += fread(text + len, 1, sizeof text - len, f); fclose(f); }
    }
    int *ids = NULL;
    size_t n = 0;
    char err[512];
    if (len < 1000 || tokenizer_encode(&m->tokenizer, (const unsigned char *)text, len, 0, &ids, &n, err, sizeof err)
        || n < 300) {
        CHECK(0, "read and tokenize LICENSE and %sprompts.txt (%zu bytes, %zu tokens)", GOLD, len, n);
        free(ids);
        return;
    }
    /* f32 `full`, and a cache that evicts (4 sinks + a window) and rotates keys by rank (pos=cache). f32 storage
       only: with a rounded type, an f32 rounding difference in a k or v fed to the cache can cross a rounding
       boundary of the type and move that element by a whole step (q8: max/127), which later layers amplify (measured
       over this text: ppl rel diff 2.6e-5 for sink:128,type=f16,pos=cache, 3e-3 for full,type=q8). The types are
       checked per attention, where both paths read the same bytes, by tests/test_attn_ref.c. */
    const char *specs[] = {"full", "sink:128,pos=cache"};
    for (int i = 0; i < 2; i++) {
        double nll[2], worst;
        int rc = nll_both(m, ids, (int)n, specs[i], nll, &worst);
        double pf = exp(nll[0] / (n - 1)), pr = exp(nll[1] / (n - 1)), rel = fabs(pr / pf - 1);
        /* Tolerances. Logits: 1e-3, the golden test's bound above (far below the smallest greedy margin that matters,
           0.0021, and any real bug, O(0.1) or more); measured 1.1e-4 for both specs (the attention outputs differ by
           ~1e-6 of A_d, tests/test_attn_ref.c, grown through 30 layers and 512 positions). Perplexity: |ln(ppl_ref /
           ppl_fast)| is the mean NLL difference, at most 2 x the largest logit difference (NLL = logsumexp - logit),
           so the logit bound alone allows 2e-3; the check asks 1e-5, as the NLLs of different tokens do not all move
           one way: measured 1.5e-7 (full) and 1.3e-7 (sink). */
        CHECK(!rc && worst <= 1e-3 && rel <= 1e-5, "'%s': reference attention vs fast over %zu tokens of LICENSE + "
              "prompts.txt: ppl %.6f vs %.6f (rel diff %.2g, bound 1e-5), max logit diff %.2g (bound 1e-3)", specs[i],
              n - 1, pr, pf, rel, worst);
    }
    free(ids);
}

int main(void) {
    Model m;
    char err[512];
    const char *san = getenv("KVLAB_SANITIZE");   /* make test-debug: minutes under ASan; the normal build runs them */
    if (san && *san && strcmp(san, "0")) { SKIP("SmolLM2 goldens: KVLAB_SANITIZE is set"); CHECK_EXIT(); }
    FILE *probe = fopen(MODEL, "rb");
    if (!probe) { SKIP("SmolLM2 goldens: %s missing (make model)", MODEL); CHECK_EXIT(); }
    fclose(probe);
    if (model_open(&m, MODEL, err, sizeof err)) { CHECK(0, "open %s: %s", MODEL, err); CHECK_EXIT(); }
    Ids prompt[8], gen[8];
    char text[8][512];
    int n = read_ids(GOLD "greedy.txt", "prompt ", prompt, 8);
    int ng = read_ids(GOLD "greedy.txt", "gen ", gen, 8);
    int nt = read_prompts(text, 8);
    CHECK(n >= 3 && n == ng && n == nt, "read %d golden prompts", n);
    int V = m.config.vocab_size;
    float *want = malloc((size_t)V * sizeof(float));
    int matched[8] = {0};
    for (int k = 0; k < n; k++) {
        /* the tokenizer on prompts without chat markers */
        if (!strstr(text[k], "<|im_start|>")) {
            int *ids;
            size_t nids;
            int ok = tokenizer_encode(&m.tokenizer, (const unsigned char *)text[k], strlen(text[k]), 0, &ids, &nids,
                                      err, sizeof err) == 0 && nids == (size_t)prompt[k].n &&
                     memcmp(ids, prompt[k].ids, nids * sizeof(int)) == 0;
            CHECK(ok, "prompt %d: kvlab's tokenizer gives llama.cpp's %d prompt ids", k, prompt[k].n);
            free(ids);
        }
        KVShape shape = model_kv_shape(&m, 2048);
        KVSpec spec;
        KVCache c;
        RunState s;
        if (kv_spec_parse(&spec, "full", KV_F32, err, sizeof err) || kv_cache_init(&c, &shape, &spec, err, sizeof err)
            || state_init(&s, &m.config)) {
            CHECK(0, "cache: %s", err);
            break;
        }
        int pos = 0;
        for (int i = 0; i < prompt[k].n; i++) forward(&m, &s, &c, prompt[k].ids[i], pos++);
        /* first-step logits */
        char path[256];
        snprintf(path, sizeof path, GOLD "logits_p%d.f32", k);
        FILE *f = fopen(path, "rb");
        double worst = INFINITY;
        if (f && fread(want, sizeof(float), (size_t)V, f) == (size_t)V) {
            worst = 0;
            for (int i = 0; i < V; i++) {
                double e = fabs((double)s.logits[i] - want[i]);
                if (!(e <= worst)) worst = e;
            }
        }
        if (f) fclose(f);
        /* both engines f32 with different summation orders over 30 layers; llama.cpp and a float64 NumPy reference
           differ by up to 2.6e-5 on logits in [-20, 30]; kvlab measured 3.1e-5 to 5.3e-5 here. 1e-3 is far below the
           smallest greedy margin that matters (0.0021, prompt 3 step 6) and any real bug (O(0.1) or more). */
        CHECK_LE(worst, 1e-3, "prompt %d: first-step logits match llama.cpp f32 (max abs err %.3g over %d)", k, worst, V);
        int match = 0;
        for (int step = 0; step < gen[k].n; step++) {
            int next = sample_argmax(s.logits, V);
            if (next != gen[k].ids[step]) break;
            match++;
            if (next == m.tokenizer.eos_id) break;
            forward(&m, &s, &c, next, pos++);
        }
        CHECK(match == gen[k].n, "prompt %d: greedy ids equal llama.cpp's for all %d steps (first %d agree)", k,
              gen[k].n, match);
        matched[k] = match;
        state_free(&s);
        kv_cache_free(&c);
    }
    free(want);
    test_ref_backend(&m, prompt, gen, matched, n);
    model_close(&m);
    CHECK_EXIT();
}
