/* kl_models: the accuracy cost of one model file against another on the same token stream, typically the same
 * weights in f32 (A, the reference) and q8 (B). The text is tokenized once (A's tokenizer; B's must have the same
 * vocabulary) and teacher-forced through both models with a `full` f32 KV cache, in chunks (forward_chunk,
 * bit-identical to token-by-token). Per scored position it takes eval.c's per-token figures (eval_token, the code
 * ./run's shadow comparison uses): KL(p_A ‖ p_B) over the vocabulary in double, whether both argmaxes agree, and each
 * model's NLL of the next token. Prints the means and both perplexities; it changes nothing in the engine and is not
 * part of ./run.
 *
 * Two ways to cut the stream:
 *  - default: the first N tokens as one stream from position 0, every position but the last scored;
 *  - --ctx N_CTX: llama-perplexity's (examples/perplexity, as `--kl-divergence` scores it): N_CTX-token chunks (a
 *    trailing partial chunk dropped; at most --chunks K of them), BOS replacing each chunk's first token when the
 *    model adds BOS, the cache cleared per chunk, and only the second half scored: the logits at positions
 *    N_CTX/2 .. N_CTX-2 of each chunk, N_CTX - 1 - N_CTX/2 per chunk. tests/golden/smollm2/kl_q8.txt compares this
 *    mode with llama-perplexity.
 * Usage: kl_models [--ctx N_CTX [--chunks K]] A.bin B.bin TEXT_FILE [N tokens, default 4096] [chunk, default 64]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval.h"
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

typedef struct {
    double kl, kl_max, nll_a, nll_b;
    long agree, scored;
} Sums;

/* Feeds ids[0..n_feed) at positions 0.. through both sides (caches reset first) and scores the logits at positions
 * first..n_feed-1 against the next token in `next` (next[t] follows position t). */
static void run_span(Side *a, Side *b, const int *ids, const int *next, int n_feed, int first, int chunk, Sums *s) {
    int V = a->m.config.vocab_size;
    kv_cache_reset(&a->cache);
    kv_cache_reset(&b->cache);
    for (int p0 = 0; p0 < n_feed; p0 += chunk) {
        int k = n_feed - p0 < chunk ? n_feed - p0 : chunk;
        if (forward_chunk(&a->m, &a->s, &a->cache, ids + p0, k, p0) ||
            forward_chunk(&b->m, &b->s, &b->cache, ids + p0, k, p0))
            fatal("the cache filled up");
        for (int t = p0 < first ? first - p0 : 0; t < k; t++) {
            const float *la = a->s.logits + (size_t)t * V, *lb = b->s.logits + (size_t)t * V;
            EvalToken e = eval_token(la, eval_logsumexp(la, V), lb, eval_logsumexp(lb, V), next[p0 + t], V);
            s->kl += e.kl;
            if (e.kl > s->kl_max) s->kl_max = e.kl;
            s->nll_b += e.nll;
            s->nll_a += e.nll - e.dnll;
            s->agree += e.top1;
            s->scored++;
        }
    }
}

int main(int argc, char **argv) {
    long n_ctx = 0, max_chunks = 0;
    int ai = 1;
    for (; ai + 1 < argc && argv[ai][0] == '-' && argv[ai][1] == '-'; ai += 2) {
        if (!strcmp(argv[ai], "--ctx")) {
            if (parse_long(argv[ai + 1], 4, 1 << 20, &n_ctx)) fatal("bad --ctx '%s'", argv[ai + 1]);
        } else if (!strcmp(argv[ai], "--chunks")) {
            if (parse_long(argv[ai + 1], 1, 1 << 20, &max_chunks)) fatal("bad --chunks '%s'", argv[ai + 1]);
        } else fatal("unknown option '%s'", argv[ai]);
    }
    if (max_chunks && !n_ctx) fatal("--chunks goes with --ctx");
    if (argc - ai < 3) {
        fprintf(stderr, "usage: kl_models [--ctx N_CTX [--chunks K]] A.bin B.bin TEXT_FILE [N tokens] [chunk]\n");
        return 1;
    }
    long n_want = 4096, chunk = 64;
    if (argc > ai + 3 && parse_long(argv[ai + 3], 2, 1 << 24, &n_want)) fatal("bad token count '%s'", argv[ai + 3]);
    if (argc > ai + 4 && parse_long(argv[ai + 4], 1, 4096, &chunk)) fatal("bad chunk '%s'", argv[ai + 4]);
    if (n_ctx && argc > ai + 3) fatal("--ctx takes the chunks from --chunks, not a token count");
    const char *pa = argv[ai], *pb = argv[ai + 1];
    Side a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    int cache_len = n_ctx ? (int)n_ctx : (int)n_want;
    side_open(&a, pa, cache_len, (int)chunk);
    side_open(&b, pb, cache_len, (int)chunk);
    int V = a.m.config.vocab_size;
    if (b.m.config.vocab_size != V || !a.m.has_tokenizer)
        fatal("the models need one tokenizer and the same vocabulary (%d and %d)", V, b.m.config.vocab_size);
    size_t len;
    char *text = read_file(argv[ai + 2], &len), err[256];
    int *ids;
    size_t n_ids;
    if (tokenizer_encode(&a.m.tokenizer, (const unsigned char *)text, len, a.m.tokenizer.add_bos, &ids, &n_ids, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    free(text);
    Sums s = {0};
    double t0 = now_s();
    if (n_ctx) {
        long n_chunks = (long)(n_ids / (size_t)n_ctx);
        if (max_chunks && max_chunks < n_chunks) n_chunks = max_chunks;
        if (n_chunks < 1) fatal("the text has %zu tokens, fewer than one chunk of %ld", n_ids, n_ctx);
        int *in = malloc((size_t)n_ctx * sizeof(int));
        if (!in) fatal("out of memory");
        for (long ch = 0; ch < n_chunks; ch++) {
            const int *tok = ids + ch * n_ctx;
            memcpy(in, tok, (size_t)n_ctx * sizeof(int));
            if (a.m.tokenizer.add_bos) in[0] = a.m.tokenizer.bos_id;
            /* the targets are the chunk's own tokens (never the BOS that replaced the first) */
            run_span(&a, &b, in, tok + 1, (int)n_ctx - 1, (int)n_ctx / 2, (int)chunk, &s);
        }
        free(in);
        printf("kl_models: %ld chunks of %ld tokens (llama-perplexity's: positions %ld..%ld scored), %ld scored "
               "tokens (chunk %ld, %.0f s)\n", n_chunks, n_ctx, n_ctx / 2, n_ctx - 2, s.scored, chunk, now_s() - t0);
    } else {
        int n = n_ids < (size_t)n_want ? (int)n_ids : (int)n_want;
        if (n < 2) fatal("the text has fewer than 2 tokens");
        if (n > a.m.config.seq_len) fprintf(stderr, "kl_models: note: %d tokens run past the trained context %d\n", n,
                                            a.m.config.seq_len);
        run_span(&a, &b, ids, ids + 1, n - 1, 0, (int)chunk, &s);   /* the last token is only a target */
        printf("kl_models: %ld scored tokens (%d fed, chunk %ld, %.0f s)\n", s.scored, n, chunk, now_s() - t0);
    }
    printf("  A %s: ppl %.4f\n  B %s: ppl %.4f (ΔNLL %+.5f nats/token)\n", pa, exp(s.nll_a / s.scored), pb,
           exp(s.nll_b / s.scored), (s.nll_b - s.nll_a) / s.scored);
    printf("  KL(A ‖ B) mean %.6f nats/token, max %.4f; top-1 agreement %.4f\n", s.kl / s.scored, s.kl_max,
           (double)s.agree / s.scored);
    printf("kl_models: kl_mean %.9g tokens %ld\n", s.kl / s.scored, s.scored);   /* for scripts */
    free(ids);
    return 0;
}
