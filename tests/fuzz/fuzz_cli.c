/* fuzz_cli.c: libFuzzer target for the command line: options_parse on an argv made of the input split at NUL bytes
 * (argv[0] = "./run"), and the strict number parsers parse_long / parse_float on each piece. A parsed Options must
 * hold what the parser promises: counts within their arrays, numbers within their documented ranges. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    char *buf = malloc(size + 1);
    memcpy(buf, data, size);
    buf[size] = 0;
    char *argv[130];
    int argc = 0;
    argv[argc++] = "./run";
    for (char *p = buf; p <= buf + size && argc < 129; p += strlen(p) + 1) argv[argc++] = p;
    argv[argc] = NULL;
    for (int i = 1; i < argc; i++) {
        long l;
        double x;
        if (parse_long(argv[i], -1000, 1000, &l) == 0 && (l < -1000 || l > 1000)) abort();
        if (parse_float(argv[i], 0, 1, &x) == 0 && !(x >= 0 && x <= 1)) abort();
    }
    Options o;
    char err[512];
    if (options_parse(&o, argc, argv, err, sizeof err) == 0 && !o.help) {
        if (o.n_files < 0 || o.n_files > MAX_FILES || o.n_kv < 0 || o.n_kv > MAX_POLICIES) abort();
        if (o.steps < 0 || o.ctx < 0 || o.chunk < 0) abort();
        if (!(o.temperature >= 0 && o.temperature <= 100) || !(o.topp > 0 && o.topp <= 1)) abort();
        if (!o.model_path || !o.mode) abort();
    }
    free(buf);
    return 0;
}
