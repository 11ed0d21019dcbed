/* task.h: -m task, RULER-style synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
 * Long-Context Language Models?", arXiv:2404.06654) generated in C from a seed, with exact answers, and their scorer.
 * The generators and the scorer need no model (tests/test_task.c checks them alone); run_task asks every -kv policy
 * the same items through the engine (task.c).
 *
 * The tasks (-task NAME), as RULER defines them; the haystack is RULER's "noise" filler, the passkey's sentence
 * " The grass is green. The sky is blue. ..." repeated (PK_FILLER), so every task reads the same filler:
 *   niah_single      one needle "One of the special magic numbers for KEY is VALUE." in the haystack; the question
 *                    asks KEY's number. Keys are made-up six-letter words, values 7-digit numbers.
 *   niah_multikey    four needles of four different keys (three are distractors); one key is asked.
 *   niah_multivalue  four needles of one key, each with its own value; all four values are asked.
 *   niah_multiquery  four needles of four keys; all four keys are asked at once, every value is expected.
 *   vt               variable tracking: a chain "VAR A = 12345." "VAR B = A." ... of 4 hops (5 variables, five
 *                    upper-case letters each) hidden in the haystack, and a second, distractor chain of the same shape
 *                    with another value (RULER's generator with num_chains = 2; its default is 1); the answer: every
 *                    variable of the chain asked.
 *   cwe              common word extraction: a numbered list of made-up words where the 10 common words appear
 *                    task_cwe_freq_common(n) times each and every other word at most 3 times; the answer: the 10.
 *                    The list is the whole context, so cwe has no depth.
 *   passkey          -m passkey's prompt (llama.cpp's instruction, key sentence and question), scored as the others.
 * Depth: the needle asked (niah: the first; vt: the chain's first assignment) sits before filler unit
 * floor(depth * n_units + 0.5), as -m passkey places its key; the other needles at seeded uniform units (vt: the
 * asked chain's later hops after its first, in order). */
#ifndef KVLAB_TASK_H
#define KVLAB_TASK_H

#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "run.h"

typedef enum {
    TASK_PASSKEY, TASK_NIAH_SINGLE, TASK_NIAH_MULTIKEY, TASK_NIAH_MULTIVALUE, TASK_NIAH_MULTIQUERY, TASK_VT, TASK_CWE,
    TASK_COUNT
} TaskKind;

#define TASK_MAX_NEEDLES 10    /* vt: two chains of 5 assignments */
#define TASK_MAX_EXPECTED 10   /* cwe: the top 10 */
#define TASK_CWE_TOP 10
#define TASK_CWE_FREQ_RARE 3   /* the most times any word outside the top 10 appears */
#define TASK_VT_HOPS 4

/* The kind for a -task name, or -1. */
int task_parse(const char *name);
/* -task's names, comma-separated, for error messages. */
const char *task_names(void);
/* The -task name of a kind ("niah_multikey"); its family ("niah", "vt", "cwe", "passkey") and RULER variant
 * ("multikey"; NULL for the tasks without variants). */
const char *task_name(TaskKind k);
const char *task_family(TaskKind k);
const char *task_variant(TaskKind k);
/* The answer tokens -m task generates by default (-n overrides): room for the expected answers, written out. */
int task_answer_tokens(TaskKind k);
/* How often each of cwe's top words appears in a list of n_units entries: n_units / 30 clamped to [4, 30] (RULER's
 * 30 at 4K tokens and more, fewer where the list is short, always more than TASK_CWE_FREQ_RARE). */
int task_cwe_freq_common(int n_units);

/* One generated item. Byte offsets are into text. */
typedef struct {
    TaskKind kind;
    char *text;                 /* the user's message: instruction, haystack with the needles, question (malloc'd) */
    char *prefix;               /* the answer's opening words, the start of the assistant's turn (malloc'd) */
    double depth;               /* as asked; NaN for cwe */
    int n_units;                /* filler sentences in the haystack (cwe: entries of the list) */
    int n_needles;
    int needle_unit[TASK_MAX_NEEDLES];     /* each needle sits just before this filler unit (0 .. n_units) */
    size_t needle_at[TASK_MAX_NEEDLES];    /* byte offset of each needle sentence (it starts with a space) */
    char needle[TASK_MAX_NEEDLES][80];     /* each needle sentence */
    size_t haystack_at, question_at;       /* byte offsets of the haystack's start and of the question */
    int n_expected;
    char expected[TASK_MAX_EXPECTED][16];  /* the answers, each a word or a number written in decimal */
    /* a shared context (task_generate_shared): text holds question 0 from question_at; each question in turn */
    int n_questions;
    char question[TASK_MAX_NEEDLES][128];  /* each question (it starts with a space) */
    char qprefix[TASK_MAX_NEEDLES][128];   /* its answer's opening words */
} TaskItem;

/* Generate item `kind` with n_units filler units and the asked needle at `depth` in [0, 1] (ignored by cwe), from
 * `seed` alone: the same seed gives the same keys, values and words at any n_units (so a runner can shrink
 * n_units to fit a token length), and the same item. 0, or -1 + message (n_units below task_min_units, depth
 * outside [0, 1]); on error *it holds nothing to free. */
int task_generate(TaskItem *it, TaskKind kind, int n_units, double depth, uint64_t seed, char *err, size_t errlen);
/* The fewest filler units an item of this kind takes (cwe: the list's top words each TASK_CWE_FREQ_RARE + 1 times,
 * and as many rare entries; the others: 4, as -m passkey). */
int task_min_units(TaskKind kind);
/* A shared context for SCBench's protocol (Li et al. 2024, "SCBench: A KV Cache-Centric Analysis of Long-Context
 * Methods", arXiv:2412.10319): niah_multikey's haystack with n_questions needles of n_questions keys (needle 0 at
 * the depth, the others at seeded units), then n_questions questions, question q asking key q: expected[q] is its
 * value. text is the instruction, the haystack and question 0 (question_at: where it starts). 0, or -1 + message
 * (n_questions outside [2, TASK_MAX_NEEDLES], n_units below 4, depth outside [0, 1]). */
int task_generate_shared(TaskItem *it, int n_units, int n_questions, double depth, uint64_t seed, char *err,
                         size_t errlen);
void task_item_free(TaskItem *it);

/* RULER's score (string_match_all): an expected answer counts as found when it occurs in the output, ASCII case
 * ignored; score = found / expected, the score -m task reports per item and averages; exact = every expected answer
 * found (1 or 0). One expected answer: score = exact. */
typedef struct {
    int found, n_expected;
    double score;   /* found / n_expected, in [0, 1] */
    int exact;
} TaskScore;
TaskScore task_score(const TaskItem *it, const char *output);
/* The same for n expected answers (a shared context's question q: its one expected answer). */
TaskScore task_score_answers(const char (*expected)[16], int n, const char *output);

/* -m task: o->task's items at each -lengths (default -c/4, -c/2, -c) and -depths (default 0, .25, .5, .75, 1; cwe:
 * none) cell, o->items per cell, asked of every -kv policy (the same items for each: drawn from -s, default 1). Each
 * prompt is the model's chat template around the item's text (plain text when the model has none) with the answer's
 * prefix, as long as fits in the length with the -n answer tokens; greedy answer. A table per policy on stderr, with
 * -o one JSON line per item. With -questions N (niah_multikey only): N questions of one shared context per item,
 * -shared turns (one after another in one chat, each answer in the cache) or requests (each asked of the cache as it
 * stood after the context: kv_cache_clone, kv_cache_restore), one JSON line per question. Returns the exit status: 0, or 128 + the signal when SIGINT/SIGTERM stopped it (every
 * item answered before is printed and written). */
int run_task(Model *m, const Options *o);
/* -lengths resolved into lens[MAX_PASSKEY_CELLS] (default -c/4, -c/2, -c), each <= ctx and above max_new (else exits
 * with a message); returns how many. Shared by the task runners (task.c, task_code.c, task_text.c). */
int task_lengths(const Options *o, int ctx, int max_new, int *lens);
/* The policies of a runner that scores against full's answers (task_code.c, task_text.c): full first, the -kv full
 * given (with its -caps) or, when none is, full added with a note naming the task; then every other -kv in order,
 * into specs and caps (MAX_POLICIES + 1 entries each). Returns how many; *given: 1 when -kv named full. */
int task_reference_policies(const Options *o, const char *task, const char **specs, const int **caps, int *given);

#endif
