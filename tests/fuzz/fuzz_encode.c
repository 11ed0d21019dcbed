/* fuzz_encode.c: libFuzzer target for tokenizer_encode and the streaming decoder on arbitrary bytes, against fixed
 * vocabularies: the vocab-only model.bin files listed in KVLAB_FUZZ_VOCABS (a directory, or paths separated by ':';
 * tools/fuzz.sh makes small SentencePiece and byte-level BPE ones, and a run may add real ones). Input: byte 0 picks
 * the vocabulary, the rest is the text. The text is encoded (with and without BOS, by tokenizer_encode and by
 * tokenizer_encode_special), every id must be in range, the
 * ids are decoded back through the streaming decoder, and the text's bytes are also decoded taken two at a time as
 * ids (arbitrary id streams, out-of-range ones included). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

#define MAX_VOCABS 16
static Model vocabs[MAX_VOCABS];
static int n_vocabs;

static void load(const char *path) {
    char err[512];
    if (n_vocabs == MAX_VOCABS) return;
    if (model_open(&vocabs[n_vocabs], path, err, sizeof err) || !vocabs[n_vocabs].has_tokenizer) {
        fprintf(stderr, "fuzz_encode: skipping %s: %s\n", path, err);
        return;
    }
    fprintf(stderr, "fuzz_encode: vocabulary %d: %s (%d tokens)\n", n_vocabs, path,
            vocabs[n_vocabs].tokenizer.vocab_size);
    n_vocabs++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *list = getenv("KVLAB_FUZZ_VOCABS");
    if (!list) list = "build/fuzz/seeds/vocabs";
    char *copy = strdup(list);
    for (char *p = strtok(copy, ":"); p; p = strtok(NULL, ":")) {
        DIR *d = opendir(p);
        if (!d) { load(p); continue; }
        char *names[MAX_VOCABS];
        int n = 0;
        for (struct dirent *e; (e = readdir(d)) && n < MAX_VOCABS;)
            if (e->d_name[0] != '.') {
                names[n] = malloc(strlen(p) + strlen(e->d_name) + 2);
                sprintf(names[n++], "%s/%s", p, e->d_name);
            }
        closedir(d);
        for (int i = 0; i < n; i++)   /* a fixed order, so byte 0 of an input picks the same vocabulary every run */
            for (int j = i + 1; j < n; j++)
                if (strcmp(names[j], names[i]) < 0) { char *x = names[i]; names[i] = names[j]; names[j] = x; }
        for (int i = 0; i < n; i++) { load(names[i]); free(names[i]); }
    }
    free(copy);
    if (!n_vocabs) { fprintf(stderr, "fuzz_encode: no vocabulary (KVLAB_FUZZ_VOCABS=%s)\n", list); exit(1); }
    return 0;
}

/* Streams ids through the decoder; out (cap bytes) receives what fits; returns the total length. */
static size_t decode(const Tokenizer *t, const int *ids, size_t n, char *out, size_t cap) {
    TokenDecoder d;
    char buf[TOKDEC_OUT_MAX];
    size_t len = 0;
    tokdec_init(&d, t);
    for (size_t i = 0; i < n; i++) {
        size_t k = tokdec_push(&d, ids[i], buf, sizeof buf);
        if (k > sizeof buf) abort();
        if (len + k <= cap) memcpy(out + len, buf, k);
        len += k;
    }
    size_t k = tokdec_flush(&d, buf, sizeof buf);
    if (len + k <= cap) memcpy(out + len, buf, k);
    return len + k;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || !n_vocabs) return 0;
    const Tokenizer *t = &vocabs[data[0] % n_vocabs].tokenizer;
    const unsigned char *text = data + 1;
    size_t len = size - 1;
    char err[256];
    for (int mode = 0; mode < 4; mode++) {   /* with and without BOS; plain, then special-token text parsed */
        int bos = mode & 1;
        int *ids = NULL;
        size_t n = 0;
        int rc = mode < 2 ? tokenizer_encode(t, text, len, bos && t->bos_id >= 0, &ids, &n, err, sizeof err)
                          : tokenizer_encode_special(t, text, len, bos && t->bos_id >= 0, &ids, &n, err, sizeof err);
        if (rc) continue;
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= t->vocab_size) {
                fprintf(stderr, "fuzz_encode: id %d out of range\n", ids[i]);
                abort();
            }
        char out[256];
        decode(t, ids, n, out, sizeof out);
        free(ids);
    }
    /* the bytes as a stream of 16-bit ids, any value */
    size_t n = len / 2;
    int *ids = malloc((n ? n : 1) * sizeof(int));
    for (size_t i = 0; i < n; i++) ids[i] = (int)(text[2 * i] | text[2 * i + 1] << 8) - 16;
    char out[64];
    decode(t, ids, n, out, sizeof out);
    free(ids);
    return 0;
}
