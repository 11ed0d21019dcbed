/* fuzz_model.c: libFuzzer target for the model.bin loader (run.c's model_parse) and what model_open does after it
 * (tokenizer_init on the tokenizer section, the vocab check), then one short use of whatever loaded: two forward
 * steps through a `full` cache of 4 tokens and a tokenize/detokenize round, as ./run would do. The input is one
 * model.bin file. It does not mmap (model_open's file handling is covered by tests/test_run.sh). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Model m;
    char err[512];
    memset(&m, 0, sizeof m);
    if (model_parse(&m, data, size, err, sizeof err)) { free(m.w.layers); return 0; }
    int ok = 1;
    if (m.tokenizer_section) {
        if (tokenizer_init(&m.tokenizer, m.tokenizer_section, m.tokenizer_bytes, err, sizeof err)) ok = 0;
        else m.has_tokenizer = 1;
        if (ok && !m.vocab_only && m.tokenizer.vocab_size != m.config.vocab_size) ok = 0;
    }
    if (ok && m.has_tokenizer) {
        static const char text[] = "Hello w\xc3\xb6rld, the abc 12 \xff\xfe\x00 \xe4\xb8\xad\n";
        int *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(&m.tokenizer, (const unsigned char *)text, sizeof text - 1, 1, &ids, &n, err,
                             sizeof err) == 0) {
            TokenDecoder d;
            char buf[TOKDEC_OUT_MAX];
            tokdec_init(&d, &m.tokenizer);
            for (size_t i = 0; i < n; i++) tokdec_push(&d, ids[i], buf, sizeof buf);
            tokdec_flush(&d, buf, sizeof buf);
            free(ids);
        }
    }
    if (ok && !m.vocab_only) {
        RunState s;
        KVSpec spec;
        KVCache cache;
        KVShape shape = model_kv_shape(&m, 4);
        memset(&s, 0, sizeof s);
        if (state_init(&s, &m.config) == 0 && kv_spec_parse(&spec, "full", KV_F32, err, sizeof err) == 0 &&
            kv_cache_init(&cache, &shape, &spec, err, sizeof err) == 0) {
            forward(&m, &s, &cache, 0, 0);
            forward(&m, &s, &cache, m.config.vocab_size - 1, 1);
            (void)sample_argmax(s.logits, m.config.vocab_size);
            kv_cache_free(&cache);
        }
        state_free(&s);
    }
    if (m.has_tokenizer) tokenizer_free(&m.tokenizer);
    free(m.w.layers);
    return 0;
}
