/* fuzz_gguf.c: libFuzzer target for export.c's GGUF side. The input is one GGUF file. In memory: gguf_parse, the
 * lookups, and the dequantization of every tensor it accepted (so its offsets and sizes must lie inside the input).
 * Through files (the exporter's interface takes paths; they go to /dev/shm when it exists): export_from_gguf with and
 * without --vocab-only, and when it writes a model.bin, ./run's loader must accept it (export_and_load says the one
 * exception). Tensors over 2^20 elements are not dequantized
 * in memory (time), only by the exporter. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "export.h"
#include "run.h"

static char in_path[256], out_path[256];

/* Export, then load the result as ./run would (model_parse + tokenizer_init on the bytes). export and run check the
 * same bounds, so a file export writes must load; the one exception is a pre-tokenizer name export copies as is and
 * run does not implement (run says so by name; a real GGUF can carry any name). */
static void export_and_load(int vocab_only) {
    char err[EXPORT_ERR_LEN];
    if (export_from_gguf(in_path, out_path, vocab_only, 0, err, sizeof err)) return;
    FILE *f = fopen(out_path, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || n <= 0 || fread(buf, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    unlink(out_path);
    Model m;
    memset(&m, 0, sizeof m);
    if (model_parse(&m, buf, (size_t)n, err, sizeof err)) {
        fprintf(stderr, "fuzz_gguf: export wrote a model.bin (vocab_only %d) that run rejects: %s\n", vocab_only, err);
        abort();
    }
    if (m.tokenizer_section) {
        if (tokenizer_init(&m.tokenizer, m.tokenizer_section, m.tokenizer_bytes, err, sizeof err)) {
            if (!strstr(err, "pre-tokenizer")) {
                fprintf(stderr, "fuzz_gguf: export wrote a tokenizer that run rejects: %s\n", err);
                abort();
            }
        } else {
            if (!m.vocab_only && m.tokenizer.vocab_size != m.config.vocab_size) abort();
            tokenizer_free(&m.tokenizer);
        }
    }
    free(m.w.layers);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Gguf g;
    char err[EXPORT_ERR_LEN];
    if (gguf_parse(&g, data, size, err, sizeof err) == 0) {
        for (uint64_t i = 0; i < g.n_tensors; i++) {
            const GgufTensor *t = &g.tensors[i];
            size_t be, bb;
            if (t->n_elems > (1u << 20) || export_ggml_type_size(t->type, &be, &bb) || t->n_elems % be) continue;
            float *y = malloc(t->n_elems * sizeof(float) + 1);
            if (y) export_dequantize(y, t->data, t->type, t->n_elems);
            free(y);
        }
        gguf_find_kv(&g, "general.architecture");
        gguf_find_tensor(&g, "token_embd.weight");
        gguf_free(&g);
    }
    if (!in_path[0]) {
        const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(in_path, sizeof in_path, "%s/kvlab-fuzz-gguf-%d.gguf", dir, (int)getpid());
        snprintf(out_path, sizeof out_path, "%s/kvlab-fuzz-gguf-%d.bin", dir, (int)getpid());
    }
    if (size == 0) return 0;   /* the exporter rejects an empty file before reading it */
    FILE *f = fopen(in_path, "wb");
    if (!f) return 0;
    fwrite(data, 1, size, f);
    fclose(f);
    export_and_load(0);
    export_and_load(1);
    unlink(in_path);
    return 0;
}
