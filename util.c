/* util.c: what every part of ./run shares and nothing in it knows a model or a cache: the error helper and the
 * exit with a message, strict number parsing, token id lists, whole files, JSON lines written whole, the SIGINT and
 * SIGTERM flag, notes held until a job starts, fresh seeds, threads, the clock and peak memory.
 */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kv.h"   /* splitmix64 */

int errorf(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}


/* ---------------------------------------------------------------------------------------------------------------
 * Numbers from the command line and from files, parsed strictly: the whole string, in range, or an error.
 * ------------------------------------------------------------------------------------------------------------- */

/* strtol and strtod skip leading white space; a number on the command line has none */
static int starts_like_number(const char *s) { return (*s >= '0' && *s <= '9') || *s == '-' || *s == '+' || *s == '.'; }

int parse_long(const char *s, long lo, long hi, long *out) {
    if (!s || !starts_like_number(s)) return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int parse_float(const char *s, double lo, double hi, double *out) {
    if (!s || !starts_like_number(s)) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}


double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Errors, notes, seeds, threads, memory
 * ------------------------------------------------------------------------------------------------------------- */

void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "run: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(EXIT_FAILURE);
}

/* Notes (not errors: "attention runs on the CPU") wait until the job starts, so an error always stands alone. */
static char notes[1024];
void run_note(const char *fmt, ...) {
    size_t n = strlen(notes);
    if (n + 16 >= sizeof notes) return;
    n += (size_t)snprintf(notes + n, sizeof notes - n, "run: note: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(notes + n, sizeof notes - n - 1, fmt, ap);
    va_end(ap);
    strcat(notes, "\n");
}
void run_job_start(void) {
    fputs(notes, stderr);
    notes[0] = 0;
}

/* A seed when -s is not given: 8 bytes of /dev/urandom, or else the nanosecond clock and the process id mixed, so
 * runs started in the same second draw different streams. */
uint64_t seed_fresh(void) {
    uint64_t x = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    int ok = f && fread(&x, sizeof x, 1, f) == 1;
    if (f) fclose(f);
    if (!ok) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
        x = splitmix64(&x);
    }
    return x;
}

int run_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

long peak_rss_kib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* Transparent huge pages (2 MiB) where the kernel offers them on request (Linux's "madvise" mode): a stream over a
 * KV cache of hundreds of MiB then crosses a page every 2 MiB instead of every 4 KiB (fewer TLB misses, and the
 * hardware prefetchers, which stop at a page's end, run further). Only the 2 MiB-aligned part of [p, p + bytes) can
 * be backed so, and only pages not touched yet (calloc's fresh pages). A hint: where it is refused or unknown,
 * nothing changes; the bits never depend on it. */
#define HUGE_PAGE_BYTES ((uintptr_t)2 << 20)
void mem_advise_huge(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    uintptr_t a = ((uintptr_t)p + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1);
    uintptr_t b = ((uintptr_t)p + bytes) & ~(HUGE_PAGE_BYTES - 1);
    if (p && b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * Token id lists
 * ------------------------------------------------------------------------------------------------------------- */

void ids_push(IdList *l, int id) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->ids = realloc(l->ids, l->cap * sizeof(int));
        if (!l->ids) fatal("out of memory");
    }
    l->ids[l->n++] = id;
}

/* Parse "12 34 56" (whitespace-separated decimal ids) for ids-only prompts and detokenize. */
int ids_parse_into(const char *text, int vocab, IdList *out, char *err, size_t errlen) {
    const char *p = text;
    for (;;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) return 0;
        const char *s = p;
        while (*p && *p != ' ' && *p != '\n' && *p != '\t' && *p != '\r') p++;
        char tok[32];
        size_t len = (size_t)(p - s);
        if (len >= sizeof tok) return errorf(err, errlen, "token id '%.20s...' is not a number", s);
        memcpy(tok, s, len);
        tok[len] = 0;
        long v;
        if (parse_long(tok, LONG_MIN, LONG_MAX, &v)) return errorf(err, errlen, "token id '%s' is not a number", tok);
        if (v < 0 || v >= vocab) return errorf(err, errlen, "token id %s is out of range [0, %d)", tok, vocab);
        ids_push(out, (int)v);
    }
}

int ids_parse(const char *text, int vocab, int **ids, size_t *n, char *err, size_t errlen) {
    IdList l = {0};
    if (ids_parse_into(text, vocab, &l, err, errlen)) { free(l.ids); return -1; }
    *ids = l.ids;
    *n = l.n;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Output files (-o, -tokenlog, -kvlog): JSON lines, each composed in memory and written whole with write(2), so a
 * reader (or an interrupted run) never sees half a record; a write error is an error exit.
 * ------------------------------------------------------------------------------------------------------------- */

void line_printf(Line *l, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = l->cap - l->n;
        int k = vsnprintf(l->cap ? l->s + l->n : NULL, room, fmt, ap);
        va_end(ap);
        if (k < 0) fatal("cannot format an output record");
        if ((size_t)k < room) { l->n += (size_t)k; return; }
        l->cap = 2 * (l->n + (size_t)k + 64);
        l->s = realloc(l->s, l->cap);
        if (!l->s) fatal("out of memory");
    }
}

void line_json_str(Line *l, const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') line_printf(l, "\\%c", *p);
        else if (*p < 0x20) line_printf(l, "\\u%04x", *p);
        else line_printf(l, "%c", *p);
    }
}

void line_free(Line *l) { free(l->s); memset(l, 0, sizeof *l); }

void outfile_open(OutFile *f, const char *flag, const char *path, int append) {
    f->flag = flag;
    f->path = path;
    f->fd = open(path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    if (f->fd < 0) fatal("cannot write %s '%s': %s", flag, path, strerror(errno));
}

void outfile_line(OutFile *f, Line *l) {
    size_t off = 0;
    while (f->fd >= 0 && off < l->n) {
        ssize_t k = write(f->fd, l->s + off, l->n - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) fatal("cannot write %s '%s': %s", f->flag, f->path, k < 0 ? strerror(errno) : "nothing written");
        off += (size_t)k;
    }
    l->n = 0;
}

void outfile_close(OutFile *f) {
    if (f->fd >= 0 && close(f->fd)) fatal("cannot write %s '%s': %s", f->flag, f->path, strerror(errno));
    f->fd = -1;
}

/* The command line as a shell would read it back: words with characters outside a safe set single-quoted. */
void line_shell_words(Line *l, int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int safe = *a != 0;
        for (const char *p = a; *p; p++) safe &= strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789_./:=,+-@%", *p) != NULL;
        if (i) line_printf(l, " ");
        if (safe) { line_printf(l, "%s", a); continue; }
        line_printf(l, "'");
        for (const char *p = a; *p; p++) line_printf(l, *p == '\'' ? "'\\''" : "%c", *p);
        line_printf(l, "'");
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * SIGINT and SIGTERM: the first one only sets run_signal; the long loops stop at their next token (or chunk)
 * boundary, keep what they measured and exit 128 + the signal. A second one ends the process at once (the files stay
 * whole: every record is written in one piece).
 * ------------------------------------------------------------------------------------------------------------- */

volatile sig_atomic_t run_signal = 0;

static void on_signal(int sig) { run_signal = sig; }

void run_catch_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND;   /* no SA_RESTART: a read of stdin (chat) returns and the loop ends */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

const char *run_signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal"; }

char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) fatal("cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) || S_ISDIR(st.st_mode)) fatal("'%s' is not a regular file", path);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) fatal("out of memory");
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) { cap *= 2; buf = realloc(buf, cap + 1); if (!buf) fatal("out of memory"); }
    }
    if (ferror(f)) fatal("cannot read '%s'", path);
    fclose(f);
    buf[n] = 0;
    *len = n;
    return buf;
}

