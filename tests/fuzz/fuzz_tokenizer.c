/* fuzz_tokenizer.c: libFuzzer target for tokenizer_init on an arbitrary model.bin tokenizer section (docs/FORMAT.md),
 * then everything ./run does with a vocabulary it accepted: encode a few fixed texts (all 256 byte values among them;
 * one with chat markers through tokenizer_encode_special), look up the chat markers, and decode every id (and a few
 * out of range) one by one through the streaming decoder. The input is the section's bytes. Arbitrary text against fixed vocabularies is fuzz_encode's job. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Tokenizer t;
    char err[512];
    if (tokenizer_init(&t, data, size, err, sizeof err)) { tokenizer_free(&t); return 0; }
    static const char tail[] = " the abc 12 it's \xe4\xb8\xad \xf0\x9f\x98\x80 ";
    unsigned char all[256 + sizeof tail - 1];
    for (int i = 0; i < 256; i++) all[i] = (unsigned char)i;
    memcpy(all + 256, tail, sizeof tail - 1);
    static const char *texts[] = {"", "Hello world", " the abc\n\n12345 it's", "\xe2\x96\x81\xe2\x96\x81x"};
    for (int k = 0; k < 5; k++) {
        const unsigned char *s = k < 4 ? (const unsigned char *)texts[k] : all;
        size_t n = k < 4 ? strlen(texts[k]) : sizeof all;
        int *ids = NULL;
        size_t n_ids = 0;
        if (tokenizer_encode(&t, s, n, k & 1, &ids, &n_ids, err, sizeof err) == 0) {
            for (size_t i = 0; i < n_ids; i++)
                if (ids[i] < 0 || ids[i] >= t.vocab_size) abort();   /* encode must return ids inside the vocab */
            free(ids);
        }
    }
    static const char marked[] = "<s>a</s><|im_start|>user\n<unk>x<|im_end|>";
    int *sids = NULL;
    size_t n_sids = 0;
    if (tokenizer_encode_special(&t, (const unsigned char *)marked, sizeof marked - 1, 0, &sids, &n_sids, err,
                                 sizeof err) == 0) {
        for (size_t i = 0; i < n_sids; i++)
            if (sids[i] < 0 || sids[i] >= t.vocab_size) abort();
        free(sids);
    }
    tokenizer_find(&t, "<|im_start|>");
    tokenizer_find(&t, "<s>");
    TokenDecoder d;
    char buf[TOKDEC_OUT_MAX];
    tokdec_init(&d, &t);
    int n = t.vocab_size < 4096 ? t.vocab_size : 4096;
    for (int id = -2; id < n + 2; id++) {
        size_t len;
        tokenizer_piece(&t, id, &len);
        tokenizer_is_eog(&t, id);
        if (tokdec_push(&d, id, buf, sizeof buf) > sizeof buf) abort();
    }
    tokdec_flush(&d, buf, sizeof buf);
    tokenizer_free(&t);
    return 0;
}
