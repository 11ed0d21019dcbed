/* fuzz_gguf.c: libFuzzer target for export.c's GGUF side. The input is one GGUF file. In memory: gguf_parse, the
 * lookups, and the dequantization of every tensor it accepted (so its offsets and sizes must lie inside the input).
 * Through files (the exporter's interface takes paths; they go to /dev/shm when it exists): export_from_gguf with and
 * without --vocab-only, and when it writes a model.bin, ./run's loader must accept it: export and run check the same
 * bounds, so an exported file that run rejects is a bug and aborts. Tensors over 2^20 elements are not dequantized
 * in memory (time), only by the exporter. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "export.h"
#include "run.h"

static char in_path[256], out_path[256];

static void export_and_load(int vocab_only) {
    char err[EXPORT_ERR_LEN];
    if (export_from_gguf(in_path, out_path, vocab_only, err, sizeof err)) return;
    Model m;
    if (model_open(&m, out_path, err, sizeof err)) {
        fprintf(stderr, "fuzz_gguf: export wrote a model.bin (vocab_only %d) that run rejects: %s\n", vocab_only, err);
        abort();
    }
    model_close(&m);
    unlink(out_path);
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
