/* task_text.h: -m task's natural tasks, on real text no one here wrote: summary, docqa and dialogue. A 135M model's
 * answers to these have no single right text, so every policy is scored against the full cache's own answer to the
 * same prompt (full is asked first, as the reference); docqa also has an exact truth, the document's own words.
 *
 * The documents: the licence texts every Debian machine has (/usr/share/common-licenses, from base-files), pinned by
 * sha256 (the table in task_text.c, Debian 12): a text that is missing or whose digest differs is skipped and
 * counted, never read. $KVLAB_TEXT_ROOT points at another directory holding the same files (tests use a copy).
 * -docs FILE (repeatable) replaces them with the files named, read whole and recorded by their digest; the Debian
 * Reference is `-docs <(zcat /usr/share/debian-reference/debian-reference.en.txt.gz)`.
 *
 * An item: a slice of one document, paragraphs whole (a paragraph starts after a blank line), as long as the
 * prompt's room allows and at least 3/4 of it, drawn from the seed alone. The tasks:
 *   summary   the slice, then "Summarize the text above in a few sentences." The answer: up to -n tokens.
 *   docqa     the slice, then a question quoting the first TEXT_QA_QUOTE words of one of its sentences, the one
 *             starting nearest to word depth * (words in the slice): "In the text above, which words come right
 *             after "QUOTE"? Answer with the rest of that sentence." The truth: the sentence's next words, to its
 *             end or TEXT_QA_MAX words. The quote is chosen so that its words occur exactly once in the slice.
 *   dialogue  TEXT_TURNS user turns of one chat (the model's chat template): the slice and question 1, then
 *             questions 2..8 (fixed, written for any document), each answer left in the cache, as a chat runs.
 *             Agreement with full per turn.
 * The prompt is the model's chat template around the user's message (dialogue needs one; the others, without a
 * template, are plain text with BOS per the model).
 *
 * Scores, on words normalized as SQuAD's evaluation does (ASCII lower case, the ASCII punctuation dropped, the
 * articles a/an/the dropped, split on whitespace):
 *   F1        token F1 (Rajpurkar et al. 2016, SQuAD): the multiset overlap of the two word lists, 2PR / (P + R).
 *   ROUGE-L   (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries") the longest common subsequence
 *             of the two word lists, F-measure with beta = 1.
 * Both: 1 when both lists are empty, 0 when one is. same: the two answers equal byte for byte once leading and
 * trailing whitespace is dropped (dialogue's exact agreement).
 *
 * The pure parts (the scores, the document set, the slice, the quote) need no model: tests/test_task_text.c checks
 * them alone; run_task_text asks every -kv policy through the engine (task_text.c).
 */
#ifndef KVLAB_TASK_TEXT_H
#define KVLAB_TASK_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "run.h"

typedef enum { TEXT_SUMMARY, TEXT_DOCQA, TEXT_DIALOGUE, TEXT_COUNT } TextKind;

#define TEXT_ROOT_ENV "KVLAB_TEXT_ROOT"
#define TEXT_ROOT_DEFAULT "/usr/share/common-licenses"
#define TEXT_TURNS 8        /* dialogue's user turns */
#define TEXT_QA_QUOTE 6     /* docqa: the words quoted */
#define TEXT_QA_MIN 3       /* docqa: the fewest words the truth has */
#define TEXT_QA_MAX 24      /* docqa: the most words the truth has */

/* The kind for a -task name, or -1; the names, comma-separated; a kind's name. */
int text_task_parse(const char *name);
const char *text_task_names(void);
const char *text_task_name(TextKind k);
/* -n's default per kind (dialogue: per turn). */
int text_answer_tokens(TextKind k);
/* Dialogue's user turns after the document (turn 0 follows the document). */
extern const char *const TEXT_DIALOGUE_TURNS[TEXT_TURNS];

/* The scores above, on text a[0..na) (the candidate) and b[0..nb) (the reference); in [0, 1]. */
double text_f1(const char *a, size_t na, const char *b, size_t nb);
double text_rouge_l(const char *a, size_t na, const char *b, size_t nb);
int text_same(const char *a, size_t na, const char *b, size_t nb);

/* One document, read whole. paras: the byte offsets where its paragraphs start (the first non-blank line, and every
 * non-blank line after a blank one), increasing. */
typedef struct {
    char name[256];
    char sha256[65];
    char *data;        /* NUL-terminated (malloc'd) */
    size_t size;       /* bytes, without the NUL */
    size_t *paras;     /* (n_paras) */
    int n_paras;
} TextDoc;

typedef struct {
    char root[512];    /* the pinned texts' directory, or "" for -docs */
    TextDoc *docs;     /* (n) */
    int n;
    int n_skipped;     /* pinned texts missing or with another digest */
    char skipped[1024];/* "GPL-3 (sha256 differs), BSD (missing)", or "" */
} TextSet;

/* The directory of the pinned texts: $KVLAB_TEXT_ROOT when set and non-empty, else /usr/share/common-licenses. */
const char *text_root(void);
/* files[0..n_files) read whole when n_files > 0 (each must exist and hold a non-blank byte), else the pinned texts
 * under root. 0, or -1 + message (a file that cannot be read, root not a directory, no text left); then s holds
 * nothing to free. */
int text_load(TextSet *s, const char *const *files, int n_files, const char *root, char *err, size_t errlen);
void text_set_free(TextSet *s);

/* Tokens text[0..n) takes (the engine: the tokenizer's count, no BOS). */
typedef int (*TextCount)(const char *text, size_t n, void *ctx);

/* A slice: document doc's bytes [start, end), whole paragraphs, trailing whitespace left out; its token count. */
typedef struct { int doc; size_t start, end; int tokens; } TextSlice;
/* Draw the slice of `seed` for a room of `room` tokens: a document, then a paragraph to start at, uniformly
 * (splitmix64 from seed alone), and as many whole paragraphs after it as fit in room; a draw under room - room / 4
 * tokens is drawn again, up to 64 times. 0, or -1 when no draw fits. */
int text_draw_slice(TextSlice *sl, const TextSet *s, int room, uint64_t seed, TextCount count, void *ctx);

/* docqa's question on text[0..n): the sentence nearest word depth * words (a sentence starts at the first word and
 * after a word ending in '.', '?', '!', ';' or ':'; ties go to the earlier one) whose first TEXT_QA_QUOTE words occur
 * exactly once in the text and which has at least TEXT_QA_MIN words after them. quote: those words joined by single
 * spaces; truth: the next words to the sentence's end, at most TEXT_QA_MAX; word: the quote's index among the text's
 * words (whitespace-separated). 0, or -1 when no sentence qualifies. */
typedef struct { char quote[512], truth[2048]; int word, n_words; } TextQA;
int text_qa(TextQA *q, const char *text, size_t n, double depth);

/* -m task -task summary|docqa|dialogue: o->items items per -lengths value (default -c/4, -c/2, -c) and, for docqa,
 * per -depths value (default 0, .25, .5, .75, 1); asked of full first (the reference, whether or not -kv names it)
 * and then of every other -kv policy; answers of up to -n tokens (per turn for dialogue). A table per policy on
 * stderr, with -o one JSON line per (policy, item) and, for dialogue, per turn. Returns the exit status: 0, or 128
 * + the signal when SIGINT/SIGTERM stopped it. */
int run_task_text(Model *m, const Options *o);

#endif
