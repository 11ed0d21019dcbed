/* task_code.h: -m task -task code, code completion over C headers every Debian machine has (/usr/include, from
 * libc6-dev). An item is a header's first part, cut at a line boundary, as raw text (no chat template: the model just
 * continues); the expected answer is the header's next non-empty line. The model answers greedily; its answer is the
 * first non-empty line of what it wrote. Each policy is scored twice: against the file's line, and against the full
 * cache's own answer to the same item (full is asked first, as the reference).
 *
 * Pinning: each header is named with its sha256 (the table in task_code.c, Debian 12's libc6-dev 2.36). A header that
 * is missing or whose digest differs is skipped and counted, never read: the items are the same wherever they run.
 * The root is /usr/include, or $KVLAB_CODE_ROOT when set (tests point it at a copy).
 *
 * Line: the bytes between two '\n' (or the file's end), without the '\n'. Empty: no byte other than whitespace (space,
 * tab, \r, \v, \f). Match: the two lines equal byte for byte once leading and trailing whitespace is dropped from
 * each; an answer with nothing left is never right (the expected line is never empty).
 *
 * The pure parts (the pinned set, the cut chooser, the answer's line, the match) need no model: tests/test_task_code.c
 * checks them alone; run_task_code asks every -kv policy through the engine (task_code.c).
 */
#ifndef KVLAB_TASK_CODE_H
#define KVLAB_TASK_CODE_H

#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "run.h"

#define TASK_CODE_NAME "code"
#define TASK_CODE_ANSWER_TOKENS 48   /* -n's default: the longest prototype line of these headers, with room */
#define TASK_CODE_ROOT_ENV "KVLAB_CODE_ROOT"
#define TASK_CODE_ROOT_DEFAULT "/usr/include"

/* One pinned header: its name under the root and its sha256, 64 lower-case hex digits. */
typedef struct { const char *name, *sha256; } CodePin;
extern const CodePin CODE_PINS[];
extern const int CODE_N_PINS;

/* A header that matched its pin, read whole. cuts: the byte offsets just after a '\n' (never 0) that a non-empty
 * line follows, increasing: the places an item may cut. */
typedef struct {
    const CodePin *pin;
    char *data;        /* NUL-terminated (malloc'd) */
    size_t size;       /* bytes, without the NUL */
    size_t *cuts;      /* (n_cuts) */
    int n_cuts;
} CodeFile;

typedef struct {
    char root[512];
    CodeFile *files;   /* (n) the pinned headers found with their digest, in CODE_PINS order */
    int n;
    int n_skipped;     /* CODE_N_PINS - n */
    char skipped[1024];/* "math.h (sha256 differs), poll.h (missing)", or "" */
} CodeSet;

/* The root: $KVLAB_CODE_ROOT when set and non-empty, else /usr/include. */
const char *code_root(void);
/* Read the pinned headers under root. 0, or -1 + message when root is not a directory or no header is left (then s
 * holds nothing to free). */
int code_load(CodeSet *s, const char *root, char *err, size_t errlen);
void code_set_free(CodeSet *s);

/* The next non-empty line at or after byte `from` of data[0..size): its start and length (no '\n', trailing '\r'
 * kept; the match trims it). 0, or -1 when none is left. */
int code_next_line(const char *data, size_t size, size_t from, size_t *at, size_t *len);

/* Tokens the prompt data[0..n) takes (the engine: the tokenizer's count, BOS included where the model adds one). */
typedef int (*CodeCount)(const char *data, size_t n, void *ctx);

/* Per length, the cuts each header offers: those whose prompt takes at most `room` tokens and at least
 * room - room / 4 (the prompt fills most of the length, as the other tasks' do). lo[f] .. hi[f] index file f's cuts;
 * lo > hi: none. The search assumes a longer prefix never takes fewer tokens (the draw checks its cut). */
typedef struct { int room; int *lo, *hi; int n_files_usable; } CodePlan;
void code_plan(CodePlan *p, const CodeSet *s, int room, CodeCount count, void *ctx);
void code_plan_free(CodePlan *p);

/* One item: file, cut (the prompt is data[0..cut)), the expected line data[ans_at .. ans_at + ans_len), its 1-based
 * line number, the prompt's token count. */
typedef struct {
    int file;
    size_t cut, ans_at, ans_len;
    int line, prompt_tokens;
} CodeItem;
/* Draw the item of `seed` from the plan: a usable file, then one of its cuts, uniformly (splitmix64 from seed alone:
 * the same seed and plan give the same item). 0, or -1 when the plan has no usable file. */
int code_draw(CodeItem *it, const CodePlan *p, const CodeSet *s, uint64_t seed, CodeCount count, void *ctx);

/* The model's answer line: the first non-empty line of out, as a pointer into out and a length. */
void code_answer_line(const char *out, const char **line, size_t *len);
/* 1 when the lines a[0..na) and b[0..nb) match under the trim rule above, and a is not empty after trimming. */
int code_match(const char *a, size_t na, const char *b, size_t nb);

/* -m task -task code: o->items items per -lengths value (default -c/4, -c/2, -c), asked of full first (the
 * reference, whether or not -kv names it) and then of every other -kv policy; answers of up to -n tokens (default
 * TASK_CODE_ANSWER_TOKENS). A table per policy on stderr (match against the file, against full), with -o one JSON
 * line per (policy, item). Returns the exit status: 0, or 128 + the signal when SIGINT/SIGTERM stopped it. */
int run_task_code(Model *m, const Options *o);

#endif
