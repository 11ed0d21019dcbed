/* replay_main.c: a main() for the fuzz targets so they build with any C compiler (no libFuzzer): it feeds each file
 * named on the command line (a directory: every file in it) to LLVMFuzzerTestOneInput once and prints one line per
 * directory or file. tests/test_fuzz_replay.sh runs it over the committed corpora and crash reproducers, in the
 * normal and the sanitizer build. A crash ends the process (the test then fails); a clean pass exits 0. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "replay: cannot open %s\n", path); return -1; }
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    if (!buf) { fprintf(stderr, "replay: out of memory\n"); return -1; }
    /* an exact-size copy, so a read past the input is caught by AddressSanitizer as under libFuzzer */
    uint8_t *exact = malloc(n ? n : 1);
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    int bad = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st)) { fprintf(stderr, "replay: cannot stat %s\n", argv[i]); bad = 1; continue; }
        if (!S_ISDIR(st.st_mode)) {
            bad |= replay_file(argv[i]) != 0;
            printf("replayed %s\n", argv[i]);
            continue;
        }
        DIR *d = opendir(argv[i]);
        if (!d) { fprintf(stderr, "replay: cannot open %s\n", argv[i]); bad = 1; continue; }
        char **names = NULL;
        size_t n = 0;
        for (struct dirent *e; (e = readdir(d));) {
            if (e->d_name[0] == '.') continue;
            names = realloc(names, (n + 1) * sizeof *names);
            names[n] = malloc(strlen(argv[i]) + strlen(e->d_name) + 2);
            sprintf(names[n++], "%s/%s", argv[i], e->d_name);
        }
        closedir(d);
        if (n) qsort(names, n, sizeof *names, cmp_str);
        for (size_t k = 0; k < n; k++) { bad |= replay_file(names[k]) != 0; free(names[k]); }
        free(names);
        printf("replayed %zu files from %s\n", n, argv[i]);
    }
    return bad;
}
