/* util.h: the small pieces every part of ./run shares: the one error helper (parsers return a message, main exits
 * with it), strict number parsing, token id lists, whole files, JSON lines written a whole line at a time, the
 * SIGINT/SIGTERM flag, notes held until a job starts, fresh seeds, threads, clocks and memory figures. It knows no
 * model and no cache.
 */
#ifndef KVLAB_UTIL_H
#define KVLAB_UTIL_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Write a printf-style message into err (errlen bytes, always NUL-terminated; nothing when err is NULL) and return
 * -1: every parser's way to report an error to its caller, the one copy for every file. */
int errorf(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Print "run: message" on stderr and exit non-zero (main's way out; parsers return errors instead). */
void fatal(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* Strict number parsing: the whole string, in [lo, hi]. 0, or -1. */
int parse_long(const char *s, long lo, long hi, long *out);
int parse_float(const char *s, double lo, double hi, double *out);

/* A growable list of token ids. */
typedef struct { int *ids; size_t n, cap; } IdList;
void ids_push(IdList *l, int id);   /* exits on out of memory */
/* Whitespace-separated decimal token ids, each in [0, vocab), appended to out. 0, or -1 + message naming the bad id. */
int ids_parse_into(const char *text, int vocab, IdList *out, char *err, size_t errlen);
/* The same into a new array: *ids malloc'd, *n ids. */
int ids_parse(const char *text, int vocab, int **ids, size_t *n, char *err, size_t errlen);

/* Read a whole file (NUL-terminated copy, length in *len); exits with a message on error. */
char *read_file(const char *path, size_t *len);

/* One JSON line being composed (grown as needed), and a file it is written to whole (-o, -tokenlog, -kvlog). */
typedef struct { char *s; size_t n, cap; } Line;
typedef struct { int fd; const char *flag, *path; } OutFile;   /* fd -1: not open, lines are dropped */
#define OUTFILE_NONE {-1, NULL, NULL}
void line_printf(Line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void line_json_str(Line *l, const char *s);                 /* s as the body of a JSON string, escaped */
void line_shell_words(Line *l, int argc, char **argv);     /* argv as a shell command, quoted where needed */
void line_free(Line *l);
/* Open path for `flag` (named in errors): append (-o) or truncate. Exits with a message on error. */
void outfile_open(OutFile *f, const char *flag, const char *path, int append);
/* Write l in one piece and empty it; exits with a message on a write error. */
void outfile_line(OutFile *f, Line *l);
void outfile_close(OutFile *f);

/* SIGINT/SIGTERM: the first sets run_signal (the signal number); loops stop at their next boundary. */
extern volatile sig_atomic_t run_signal;
void run_catch_signals(void);
const char *run_signal_name(int sig);

/* A note for stderr, held until run_job_start() prints the pending ones (so errors found first stand alone). */
void run_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void run_job_start(void);
/* A seed for a run without -s: different for runs started at the same moment. */
uint64_t seed_fresh(void);
int run_threads(void);   /* OpenMP threads a parallel region uses (1 without OpenMP) */
double now_s(void);      /* monotonic clock, seconds */
long peak_rss_kib(void);
/* Asks for transparent huge pages over the 2 MiB-aligned part of [p, p + bytes) (Linux madvise; a hint, may be
 * ignored) */
void mem_advise_huge(void *p, size_t bytes);

#endif
