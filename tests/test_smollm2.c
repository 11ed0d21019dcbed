/* test_smollm2: SmolLM2-135M-Instruct (models/smollm2-135m-instruct.bin from `make model`) against llama.cpp run on
 * the same f32 weights (tests/golden/smollm2, made as tests/golden/README.md says): for each golden prompt, the
 * first-step logits within a stated tolerance and the greedy ids, id for id, until EOS or 64 steps; and kvlab's
 * tokenizer gives llama.cpp's prompt ids for the plain-text prompts. SKIPs when the model is absent. */
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
        state_free(&s);
        kv_cache_free(&c);
    }
    free(want);
    model_close(&m);
    CHECK_EXIT();
}
