/* export_main.c: the command line of ./export (GGUF or llama2.c in, or a random model; model.bin out). The formats
 * themselves are export.c's; this file only reads flags and reports errors.
 */
#include "export.h"
#include "model_format.h"
#include "util.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


static const char *usage =
    "usage: ./export IN.gguf OUT.bin [--wtype f32|q8] [--vocab-only]\n"
    "       ./export --llama2c CKPT.bin [--tokenizer TOK.bin] OUT.bin [--wtype f32|q8]   (no tokenizer: ids-only)\n"
    "       ./export --random OUT.bin --dim D --hidden H --layers L --heads NH --kv-heads NKV --vocab V --seq S\n"
    "                --seed K [--head-dim HD] [--theta T] [--tied] [--rope-factors] [--wtype f32|q8]\n"
    "                [--vocab-from IN.gguf]   (its tokenizer, chat template included; V must be its token count)\n"
    "--wtype q8: the matrices as int8 groups of 32 with an f16 scale (ggml's Q8_0 layout), quantized from f32;\n"
    "            the embedding and norms stay f32, a tied classifier is written as its own q8 copy\n";

/* A whole decimal integer in [min, max] for flag, or -1 + message. */
static int parse_flag_long(const char *flag, const char *s, long min, long max, long *out, char *err, size_t errlen) {
    if (parse_long(s, LONG_MIN, LONG_MAX, out)) return errorf(err, errlen, "%s: '%s' is not an integer", flag, s);
    if (*out < min || *out > max) return errorf(err, errlen, "%s: %ld is out of range (%ld to %ld)", flag, *out, min, max);
    return 0;
}

int main(int argc, char **argv) {
    char err[EXPORT_ERR_LEN] = "";
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) { fprintf(stderr, "export: this host is big-endian; model.bin is little-endian\n"); return 1; }
    const char *pos[3];
    int n_pos = 0, vocab_only = 0, tied = 0, rope_factors = 0;
    const char *wtype = NULL, *llama2c = NULL, *tokenizer = NULL, *random_out = NULL;
    /* --random's integer flags, in ExportRandomSpec order */
    static const char *int_flags[] = {"--dim", "--hidden", "--layers", "--heads", "--kv-heads", "--head-dim",
                                      "--vocab", "--seq", "--seed"};
    long ints[9] = {0};
    int have[9] = {0};
    const char *theta = NULL, *vocab_from = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { fputs(usage, stdout); return 0; }
        if (a[0] != '-' || a[1] == 0) {
            if (n_pos == 3) { fprintf(stderr, "export: too many arguments ('%s')\n%s", a, usage); return 1; }
            pos[n_pos++] = a;
            continue;
        }
        if (!strcmp(a, "--vocab-only")) { vocab_only = 1; continue; }
        if (!strcmp(a, "--tied")) { tied = 1; continue; }
        if (!strcmp(a, "--rope-factors")) { rope_factors = 1; continue; }
        const char **str_dst = !strcmp(a, "--wtype") ? &wtype : !strcmp(a, "--llama2c") ? &llama2c
                             : !strcmp(a, "--tokenizer") ? &tokenizer : !strcmp(a, "--random") ? &random_out
                             : !strcmp(a, "--theta") ? &theta : !strcmp(a, "--vocab-from") ? &vocab_from : NULL;
        int k = -1;
        for (int j = 0; j < 9; j++) if (!strcmp(a, int_flags[j])) k = j;
        if (!str_dst && k < 0) { fprintf(stderr, "export: unknown flag '%s'\n%s", a, usage); return 1; }
        if (i + 1 >= argc || (argv[i + 1][0] == '-' && argv[i + 1][1] == '-')) {
            fprintf(stderr, "export: flag %s needs a value\n%s", a, usage);
            return 1;
        }
        const char *v = argv[++i];
        if (str_dst) { *str_dst = v; continue; }
        long max = k == 8 ? LONG_MAX : k == 6 ? MODEL_MAX_VOCAB : k == 7 ? MODEL_MAX_SEQ : k == 1 ? MODEL_MAX_HIDDEN : MODEL_MAX_DIM;
        if (parse_flag_long(a, v, k == 8 ? 0 : 1, max, &ints[k], err, sizeof err)) goto error;
        have[k] = 1;
    }
    int wt = EXPORT_WTYPE_F32;
    if (wtype) {
        if (!strcmp(wtype, "q8")) wt = EXPORT_WTYPE_Q8;
        else if (!strcmp(wtype, "q4")) { fprintf(stderr, "export: --wtype q4 is not yet available (f32, q8)\n"); return 1; }
        else if (strcmp(wtype, "f32")) {
            fprintf(stderr, "export: --wtype: unknown type '%s' (valid: f32, q8)\n", wtype);
            return 1;
        }
        if (vocab_only) { fprintf(stderr, "export: --wtype has no meaning with --vocab-only (no weights)\n"); return 1; }
    }
    int modes = (llama2c != NULL) + (random_out != NULL);
    if (modes > 1) { fprintf(stderr, "export: --llama2c and --random exclude each other\n%s", usage); return 1; }
    if (random_out) {
        if (n_pos || tokenizer || vocab_only) {
            fprintf(stderr, "export: --random takes only the shape flags, --wtype and --vocab-from\n%s", usage);
            return 1;
        }
        for (int j = 0; j < 9; j++)
            if (!have[j] && j != 5) { fprintf(stderr, "export: --random needs %s\n%s", int_flags[j], usage); return 1; }
        ExportRandomSpec s = {(int)ints[0], (int)ints[1], (int)ints[2], (int)ints[3], (int)ints[4], (int)ints[5],
                              (int)ints[6], (int)ints[7], (uint64_t)ints[8], 10000.0f, tied, rope_factors, wt,
                              vocab_from};
        if (theta) {
            char *end;
            s.rope_theta = strtof(theta, &end);
            if (end == theta || *end || !(s.rope_theta > 0) || !isfinite(s.rope_theta)) {
                fprintf(stderr, "export: --theta: '%s' is not a positive number\n", theta);
                return 1;
            }
        }
        if (export_random(&s, random_out, err, sizeof err)) goto error;
        fprintf(stderr, "export: wrote %s (random, seed %llu%s)\n", random_out, (unsigned long long)s.seed,
                wt == EXPORT_WTYPE_Q8 ? ", q8 matrices" : "");
        return 0;
    }
    for (int j = 0; j < 9; j++)
        if (have[j]) { fprintf(stderr, "export: %s is only for --random\n%s", int_flags[j], usage); return 1; }
    if (theta || tied || rope_factors || vocab_from) {
        fprintf(stderr, "export: --theta, --tied, --rope-factors, --vocab-from are only for --random\n");
        return 1;
    }
    if (llama2c) {
        if (n_pos != 1 || vocab_only) {
            fprintf(stderr, "export: --llama2c takes CKPT.bin [--tokenizer TOK.bin] OUT.bin [--wtype f32|q8]\n%s", usage);
            return 1;
        }
        if (export_from_llama2c(llama2c, tokenizer, pos[0], wt, err, sizeof err)) goto error;
        fprintf(stderr, "export: wrote %s from %s%s%s\n", pos[0], llama2c, tokenizer ? "" : " (ids-only)",
                wt == EXPORT_WTYPE_Q8 ? " (q8 matrices)" : "");
        return 0;
    }
    if (tokenizer) { fprintf(stderr, "export: --tokenizer is only for --llama2c\n%s", usage); return 1; }
    if (n_pos != 2) { fprintf(stderr, "export: expected IN.gguf OUT.bin\n%s", usage); return 1; }
    if (export_from_gguf(pos[0], pos[1], vocab_only, wt, err, sizeof err)) goto error;
    fprintf(stderr, "export: wrote %s from %s%s\n", pos[1], pos[0],
            vocab_only ? " (vocab only)" : wt == EXPORT_WTYPE_Q8 ? " (q8 matrices)" : "");
    return 0;
error:
    fprintf(stderr, "export: %s\n", err);
    return 1;
}
