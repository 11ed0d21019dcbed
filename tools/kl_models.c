/* kl_models: the accuracy cost of one model file against another on the same token stream, typically the same
 * weights in f32 (A, the reference) and q8 (B). The text is tokenized once (A's tokenizer; B's must have the same
 * vocabulary), cut to N tokens, and teacher-forced through both models with a `full` f32 KV cache, in chunks
 * (forward_chunk, bit-identical to token-by-token). Per position it computes, in double, KL(p_A ‖ p_B) over the
 * vocabulary, whether both argmaxes agree, and each model's NLL of the next token. Prints the means and both
 * perplexities; it changes nothing in the engine and is not part of ./run.
 * Usage: kl_models A.bin B.bin TEXT_FILE [N tokens, default 4096] [chunk, default 64]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

typedef struct {
    Model m;
    RunState s;
    KVCache cache;
} Side;

static void side_open(Side *x, const char *path, int n_ctx, int chunk) {
    char err[512];
    if (model_open(&x->m, path, err, sizeof err)) fatal("%s", err);
    if (x->m.vocab_only) fatal("'%s' has no weights", path);
    KVSpec spec;
    KVShape shape = model_kv_shape(&x->m, n_ctx);
    if (state_init_chunk(&x->s, &x->m.config, chunk)) fatal("out of memory");
    if (kv_spec_parse(&spec, "full", KV_F32, err, sizeof err) || kv_cache_init(&x->cache, &shape, &spec, err, sizeof err))
        fatal("kv cache: %s", err);
}

/* log-softmax normalizer of logits (n): max + log Σ exp(l - max), in double */
static double log_norm(const float *l, int n) {
    double mx = l[0], s = 0;
    for (int i = 1; i < n; i++) if (l[i] > mx) mx = l[i];
    for (int i = 0; i < n; i++) s += exp(l[i] - mx);
    return mx + log(s);
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: kl_models A.bin B.bin TEXT_FILE [N tokens] [chunk]\n"); return 1; }
    long n_want = 4096, chunk = 64;
    if (argc > 4 && parse_long(argv[4], 2, 1 << 24, &n_want)) fatal("bad token count '%s'", argv[4]);
    if (argc > 5 && parse_long(argv[5], 1, 4096, &chunk)) fatal("bad chunk '%s'", argv[5]);
    Side a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    side_open(&a, argv[1], (int)n_want, (int)chunk);
    side_open(&b, argv[2], (int)n_want, (int)chunk);
    int V = a.m.config.vocab_size;
    if (b.m.config.vocab_size != V || !a.m.has_tokenizer)
        fatal("the models need one tokenizer and the same vocabulary (%d and %d)", V, b.m.config.vocab_size);
    size_t len;
    char *text = read_file(argv[3], &len), err[256];
    int *ids;
    size_t n_ids;
    if (tokenizer_encode(&a.m.tokenizer, (const unsigned char *)text, len, a.m.tokenizer.add_bos, &ids, &n_ids, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    free(text);
    int n = n_ids < (size_t)n_want ? (int)n_ids : (int)n_want;
    if (n < 2) fatal("the text has fewer than 2 tokens");
    if (n > a.m.config.seq_len) fprintf(stderr, "kl_models: note: %d tokens run past the trained context %d\n", n,
                                        a.m.config.seq_len);
    double kl = 0, nll_a = 0, nll_b = 0, kl_max = 0;
    long agree = 0, scored = 0;
    double t0 = now_s();
    for (int p0 = 0; p0 < n - 1; p0 += (int)chunk) {
        int k = n - 1 - p0 < chunk ? n - 1 - p0 : (int)chunk;   /* the last token is only a target */
        if (forward_chunk(&a.m, &a.s, &a.cache, ids + p0, k, p0) || forward_chunk(&b.m, &b.s, &b.cache, ids + p0, k, p0))
            fatal("the cache filled up");
        for (int t = 0; t < k; t++) {
            const float *la = a.s.logits + (size_t)t * V, *lb = b.s.logits + (size_t)t * V;
            double za = log_norm(la, V), zb = log_norm(lb, V), d = 0;
            for (int i = 0; i < V; i++) {
                double lpa = la[i] - za, lpb = lb[i] - zb;
                d += exp(lpa) * (lpa - lpb);
            }
            int next = ids[p0 + t + 1];
            kl += d;
            if (d > kl_max) kl_max = d;
            nll_a -= la[next] - za;
            nll_b -= lb[next] - zb;
            agree += sample_argmax(la, V) == sample_argmax(lb, V);
            scored++;
        }
    }
    double secs = now_s() - t0;
    printf("kl_models: %ld scored tokens (%d fed, chunk %ld, %.0f s)\n", scored, n, chunk, secs);
    printf("  A %s: ppl %.4f\n  B %s: ppl %.4f (ΔNLL %+.5f nats/token)\n", argv[1], exp(nll_a / scored), argv[2],
           exp(nll_b / scored), (nll_b - nll_a) / scored);
    printf("  KL(A ‖ B) mean %.6f nats/token, max %.4f; top-1 agreement %.4f\n", kl / scored, kl_max,
           (double)agree / scored);
    free(ids);
    return 0;
}
