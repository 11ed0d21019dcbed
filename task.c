/* task.c: -m task: RULER-style synthetic tasks (task.h names them and states RULER's definitions), generated from a
 * seed with exact answers, scored by RULER's string match, asked of every -kv policy through the engine exactly as in
 * generation (chunked prefill, greedy decode). It adds no model code, and no task that needs an outside text: the
 * haystack is the passkey's filler. Shared-context questions (SCBench's two protocols) are here; the natural tasks are in task_code.c and task_text.c.
 *
 * Dimensions: n_units (filler units of an item), length (tokens of a cell: prompt and answer), ctx (-c).
 */
#include "task.h"
#include "eval_impl.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------------------------
 * Names.
 * ------------------------------------------------------------------------------------------------------------- */

static const char *const TASK_NAMES[TASK_COUNT] = {"passkey", "niah_single", "niah_multikey", "niah_multivalue",
                                                   "niah_multiquery", "vt", "cwe"};

int task_parse(const char *name) {
    for (int k = 0; k < TASK_COUNT; k++) if (!strcmp(name, TASK_NAMES[k])) return k;
    return -1;
}
const char *task_names(void) {
    return "passkey, niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe";
}
const char *task_name(TaskKind k) { return TASK_NAMES[k]; }
const char *task_family(TaskKind k) {
    return k == TASK_PASSKEY ? "passkey" : k == TASK_VT ? "vt" : k == TASK_CWE ? "cwe" : "niah";
}
const char *task_variant(TaskKind k) {
    return k >= TASK_NIAH_SINGLE && k <= TASK_NIAH_MULTIQUERY ? TASK_NAMES[k] + 5 : NULL;
}
/* SmolLM2 writes a 7-digit number as 7 tokens, a made-up word as 2 to 4: each answer list written out with
 * separators and a little slack */
int task_answer_tokens(TaskKind k) {
    static const int n[TASK_COUNT] = {16, 24, 24, 48, 48, 40, 80};
    return n[k];
}
int task_cwe_freq_common(int n_units) {
    int f = n_units / 30;
    return f < TASK_CWE_FREQ_RARE + 1 ? TASK_CWE_FREQ_RARE + 1 : f > 30 ? 30 : f;
}
int task_min_units(TaskKind kind) {
    return kind == TASK_CWE ? (TASK_CWE_FREQ_RARE + 2) * TASK_CWE_TOP : 4;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Generators.
 * ------------------------------------------------------------------------------------------------------------- */

/* A made-up word of six lower-case letters, consonant-vowel three times (14 * 5 syllables: 343,000 words). All words
 * have one length, so no word is part of another and the scorer's substring match is a word match. */
static void draw_word(char *w, uint64_t *rng) {
    static const char C[] = "bdfgklmnprstvz", V[] = "aeiou";
    for (int i = 0; i < 3; i++) {
        uint64_t r = splitmix64(rng);
        w[2 * i] = C[r % 14];
        w[2 * i + 1] = V[(r >> 32) % 5];
    }
    w[6] = 0;
}
/* Five upper-case letters, RULER's variable names. */
static void draw_var(char *w, uint64_t *rng) {
    for (int i = 0; i < 5; i++) w[i] = (char)('A' + splitmix64(rng) % 26);
    w[5] = 0;
}
static int seen_in(char (*words)[16], int n, const char *w) {
    for (int i = 0; i < n; i++) if (!strcmp(words[i], w)) return 1;
    return 0;
}
/* n distinct strings into words, by draw(), redrawing a repeat. */
static void draw_distinct(char (*words)[16], int n, void (*draw)(char *, uint64_t *), uint64_t *rng) {
    for (int i = 0; i < n; i++)
        do draw(words[i], rng); while (seen_in(words, i, words[i]));
}
/* n distinct decimal numbers of `digits` digits (leading digit non-zero) into out. */
static void draw_numbers(char (*out)[16], int n, int digits, uint64_t *rng) {
    long lo = 1;
    for (int i = 1; i < digits; i++) lo *= 10;
    for (int i = 0; i < n; i++)
        do snprintf(out[i], sizeof out[i], "%ld", lo + (long)(splitmix64(rng) % (uint64_t)(9 * lo)));
        while (seen_in(out, i, out[i]));
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* The haystack: units 0 .. n_units - 1 of filler, needle k just before unit needle_unit[k] (needles at one unit in
 * index order); records each needle's byte offset. */
static void emit_haystack(Str *b, TaskItem *it) {
    it->haystack_at = b->n;
    for (int u = 0; u <= it->n_units; u++) {
        for (int k = 0; k < it->n_needles; k++)
            if (it->needle_unit[k] == u) {
                it->needle_at[k] = b->n;
                str_add(b, it->needle[k]);
            }
        if (u < it->n_units) str_add(b, PK_FILLER);
    }
    it->question_at = b->n;
}

/* cwe: the list of n_units entries " 1. word" ..., the top words task_cwe_freq_common(n_units) times each, rare words
 * TASK_CWE_FREQ_RARE times each (the last rare word fewer when the rest does not divide), in seeded order. The words
 * come first from the seed (the first 10 the top), so they do not depend on n_units beyond how many are used. */
static void emit_cwe(Str *b, TaskItem *it, uint64_t *rng) {
    int n = it->n_units, fc = task_cwe_freq_common(n);
    int n_rare = (n - TASK_CWE_TOP * fc + TASK_CWE_FREQ_RARE - 1) / TASK_CWE_FREQ_RARE;
    int n_words = TASK_CWE_TOP + n_rare;
    char (*words)[16] = malloc((size_t)n_words * sizeof *words);
    int *slot = malloc((size_t)n * sizeof *slot);
    if (!words || !slot) fatal("out of memory");
    draw_distinct(words, n_words, draw_word, rng);
    int s = 0;
    for (int w = 0; w < TASK_CWE_TOP; w++) for (int i = 0; i < fc; i++) slot[s++] = w;
    for (int w = TASK_CWE_TOP; s < n; w++) for (int i = 0; i < TASK_CWE_FREQ_RARE && s < n; i++) slot[s++] = w;
    for (int i = n - 1; i > 0; i--) {   /* Fisher-Yates */
        int j = (int)(splitmix64(rng) % (uint64_t)(i + 1)), t = slot[i];
        slot[i] = slot[j];
        slot[j] = t;
    }
    it->haystack_at = b->n;
    char entry[40];
    for (int i = 0; i < n; i++) {
        snprintf(entry, sizeof entry, " %d. %s", i + 1, words[slot[i]]);
        str_add(b, entry);
    }
    it->question_at = b->n;
    for (int w = 0; w < TASK_CWE_TOP; w++) memcpy(it->expected[w], words[w], sizeof it->expected[w]);
    it->n_expected = TASK_CWE_TOP;
    free(words);
    free(slot);
}

static char *str_dup(const char *s) {
    char *d = strdup(s);
    if (!d) fatal("out of memory");
    return d;
}

int task_generate(TaskItem *it, TaskKind kind, int n_units, double depth, uint64_t seed, char *err, size_t errlen) {
    memset(it, 0, sizeof *it);
    if ((int)kind < 0 || kind >= TASK_COUNT) return errorf(err, errlen, "unknown task %d", (int)kind);
    if (n_units < task_min_units(kind))
        return errorf(err, errlen, "%s needs at least %d filler units, not %d", task_name(kind), task_min_units(kind),
                      n_units);
    if (kind != TASK_CWE && !(depth >= 0 && depth <= 1))
        return errorf(err, errlen, "depth %g is outside [0, 1]", depth);
    it->kind = kind;
    it->n_units = n_units;
    it->depth = kind == TASK_CWE ? NAN : depth;
    uint64_t rng = seed;
    int at = (int)floor(depth * n_units + 0.5);   /* the asked needle's unit, as -m passkey places its key */
    Str b = {0};
    char q[256], p[256];
    if (kind == TASK_CWE) {
        str_add(&b, "Below is a numbered list of words. Some of them appear more often than the others; remember which "
                    "ones.");
        emit_cwe(&b, it, &rng);
        snprintf(q, sizeof q, " Question: which %d words appear most often in the list above?", TASK_CWE_TOP);
        snprintf(p, sizeof p, "The %d words that appear most often in the list are:", TASK_CWE_TOP);
    } else if (kind == TASK_PASSKEY) {
        draw_numbers(it->expected, 1, 5, &rng);
        it->n_expected = 1;
        it->n_needles = 1;
        it->needle_unit[0] = at;
        snprintf(it->needle[0], sizeof it->needle[0], " The pass key is %s. Remember it. %s is the pass key.",
                 it->expected[0], it->expected[0]);
        str_add(&b, PK_PREFIX);
        emit_haystack(&b, it);
        snprintf(q, sizeof q, " What is the pass key?");
        snprintf(p, sizeof p, "The pass key is");
    } else if (kind == TASK_VT) {
        char vars[2 * (TASK_VT_HOPS + 1)][16], values[2][16];
        draw_distinct(vars, 2 * (TASK_VT_HOPS + 1), draw_var, &rng);
        draw_numbers(values, 2, 5, &rng);
        int per = TASK_VT_HOPS + 1;
        it->n_needles = 2 * per;
        for (int c = 0; c < 2; c++) {   /* chain 0 is asked: its first assignment at the depth, the hops after it */
            int u[TASK_VT_HOPS + 1];
            for (int h = 0; h < per; h++) {
                int lo = c == 0 ? at : 0;
                u[h] = lo + (int)(splitmix64(&rng) % (uint64_t)(n_units - lo + 1));
            }
            if (c == 0) u[0] = at;
            qsort(c == 0 ? u + 1 : u, c == 0 ? per - 1 : per, sizeof *u, cmp_int);
            for (int h = 0; h < per; h++) {
                int k = c * per + h;
                it->needle_unit[k] = u[h];
                if (h == 0) snprintf(it->needle[k], sizeof it->needle[k], " VAR %s = %s.", vars[k], values[c]);
                else snprintf(it->needle[k], sizeof it->needle[k], " VAR %s = %s.", vars[k], vars[k - 1]);
            }
        }
        for (int h = 0; h < per; h++) memcpy(it->expected[h], vars[h], sizeof it->expected[h]);
        it->n_expected = per;
        str_add(&b, "Follow the chains of variable assignments hidden in the text below; a question about them comes "
                    "after it.");
        emit_haystack(&b, it);
        snprintf(q, sizeof q, " Question: which variables hold the value %s, assigned directly or through other "
                 "variables, in the text above?", values[0]);
        snprintf(p, sizeof p, "Following the assignments in the text above, the variables that hold the value %s are:",
                 values[0]);
    } else {   /* niah */
        int n_keys = kind == TASK_NIAH_SINGLE ? 1 : kind == TASK_NIAH_MULTIVALUE ? 1 : 4;
        int n_needles = kind == TASK_NIAH_SINGLE ? 1 : 4;
        char keys[4][16], values[4][16];
        draw_distinct(keys, n_keys, draw_word, &rng);
        draw_numbers(values, n_needles, 7, &rng);
        it->n_needles = n_needles;
        for (int k = 0; k < n_needles; k++) {
            it->needle_unit[k] = k == 0 ? at : (int)(splitmix64(&rng) % (uint64_t)(n_units + 1));
            snprintf(it->needle[k], sizeof it->needle[k], " One of the special magic numbers for %s is %s.",
                     keys[n_keys == 1 ? 0 : k], values[k]);
        }
        /* single and multikey ask needle 0's key (one value); multivalue and multiquery every value */
        it->n_expected = kind == TASK_NIAH_SINGLE || kind == TASK_NIAH_MULTIKEY ? 1 : n_needles;
        for (int k = 0; k < it->n_expected; k++) memcpy(it->expected[k], values[k], sizeof it->expected[k]);
        str_add(&b, "Some special magic numbers are hidden in the long text below. Find them and remember them; a "
                    "question about them comes after the text.");
        emit_haystack(&b, it);
        if (kind == TASK_NIAH_MULTIQUERY) {
            snprintf(q, sizeof q, " What are all the special magic numbers for %s, %s, %s and %s mentioned in the text "
                     "above?", keys[0], keys[1], keys[2], keys[3]);
            snprintf(p, sizeof p, "The special magic numbers for %s, %s, %s and %s mentioned in the text above are",
                     keys[0], keys[1], keys[2], keys[3]);
        } else if (kind == TASK_NIAH_MULTIVALUE) {
            snprintf(q, sizeof q, " What are all the special magic numbers for %s mentioned in the text above?", keys[0]);
            snprintf(p, sizeof p, "The special magic numbers for %s mentioned in the text above are", keys[0]);
        } else {
            snprintf(q, sizeof q, " What is the special magic number for %s mentioned in the text above?", keys[0]);
            snprintf(p, sizeof p, "The special magic number for %s mentioned in the text above is", keys[0]);
        }
    }
    str_add(&b, q);
    it->text = b.s;
    it->prefix = str_dup(p);
    return 0;
}

int task_generate_shared(TaskItem *it, int n_units, int n_questions, double depth, uint64_t seed, char *err,
                         size_t errlen) {
    memset(it, 0, sizeof *it);
    if (n_questions < 2 || n_questions > TASK_MAX_NEEDLES)
        return errorf(err, errlen, "a shared context takes 2 to %d questions, not %d", TASK_MAX_NEEDLES, n_questions);
    if (n_units < task_min_units(TASK_NIAH_MULTIKEY))
        return errorf(err, errlen, "a shared context needs at least %d filler units, not %d",
                      task_min_units(TASK_NIAH_MULTIKEY), n_units);
    if (!(depth >= 0 && depth <= 1)) return errorf(err, errlen, "depth %g is outside [0, 1]", depth);
    it->kind = TASK_NIAH_MULTIKEY;
    it->n_units = n_units;
    it->depth = depth;
    uint64_t rng = seed;
    char keys[TASK_MAX_NEEDLES][16], values[TASK_MAX_NEEDLES][16];
    draw_distinct(keys, n_questions, draw_word, &rng);
    draw_numbers(values, n_questions, 7, &rng);
    it->n_needles = it->n_questions = it->n_expected = n_questions;
    for (int k = 0; k < n_questions; k++) {
        it->needle_unit[k] = k == 0 ? (int)floor(depth * n_units + 0.5) : (int)(splitmix64(&rng) % (uint64_t)(n_units + 1));
        snprintf(it->needle[k], sizeof it->needle[k], " One of the special magic numbers for %.15s is %.15s.", keys[k],
                 values[k]);
        memcpy(it->expected[k], values[k], sizeof it->expected[k]);
        snprintf(it->question[k], sizeof it->question[k], " What is the special magic number for %.15s mentioned in the "
                 "text above?", keys[k]);
        snprintf(it->qprefix[k], sizeof it->qprefix[k], "The special magic number for %.15s mentioned in the text "
                 "above is", keys[k]);
    }
    Str b = {0};
    str_add(&b, "Some special magic numbers are hidden in the long text below. Find them and remember them; questions "
                "about them come after the text.");
    emit_haystack(&b, it);
    str_add(&b, it->question[0]);
    it->text = b.s;
    it->prefix = str_dup(it->qprefix[0]);
    return 0;
}

void task_item_free(TaskItem *it) {
    free(it->text);
    free(it->prefix);
    memset(it, 0, sizeof *it);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The scorer.
 * ------------------------------------------------------------------------------------------------------------- */

/* 1 when needle occurs in hay, ASCII case ignored (an empty needle never counts). */
static int contains_nocase(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    if (n == 0) return 0;
    for (; *hay; hay++) {
        size_t i = 0;
        while (i < n && hay[i] && tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i])) i++;
        if (i == n) return 1;
    }
    return 0;
}

TaskScore task_score(const TaskItem *it, const char *output) {
    return task_score_answers(it->expected, it->n_expected, output);
}
TaskScore task_score_answers(const char (*expected)[16], int n, const char *output) {
    TaskScore s = {0, n, 0, 0};
    for (int k = 0; k < n; k++) s.found += contains_nocase(output, expected[k]);
    s.score = s.n_expected ? (double)s.found / s.n_expected : 0;
    s.exact = s.n_expected > 0 && s.found == s.n_expected;
    return s;
}

/* ---------------------------------------------------------------------------------------------------------------
 * -m task: prompts fitted to a length, asked of every policy.
 * ------------------------------------------------------------------------------------------------------------- */

/* The prompt of an item as ./run feeds it: the chat template around the item's text, then the answer's prefix (or,
 * without a template, BOS per the model, the text and the prefix), as text and as ids. */
typedef struct {
    Line text;       /* what is encoded */
    int bos;         /* BOS goes first */
    int special;     /* encoded with special tokens recognized (a rendered chat) */
    size_t user_at;  /* byte offset of the item's text in it */
    int *ids;
    size_t n;
} Prompt;

static void encode_prefix(const Model *m, const Prompt *p, size_t bytes, int **ids, size_t *n) {
    char err[256];
    const unsigned char *t = (const unsigned char *)p->text.s;
    int rc = p->special ? tokenizer_encode_special(&m->tokenizer, t, bytes, p->bos, ids, n, err, sizeof err)
                        : tokenizer_encode(&m->tokenizer, t, bytes, p->bos, ids, n, err, sizeof err);
    if (rc) fatal("tokenizer: %s", err);
}

/* stop: the id that ends the assistant's turn (-1: only EOS). */
static void prompt_build(Prompt *p, const Model *m, const Options *o, const TaskItem *it, int *stop) {
    memset(p, 0, sizeof *p);
    Line chat = {0};
    if (chat_prompt_text(&chat, &p->bos, stop, m, o->system, it->text, 1) == 0) {
        p->special = 1;
        const char *u = strstr(chat.s, it->text);
        if (!u) fatal("the chat template changed the task's text");
        p->user_at = (size_t)(u - chat.s);
        line_printf(&chat, "%s", it->prefix);
        p->text = chat;
    } else {
        *stop = -1;
        p->bos = m->tokenizer.add_bos;
        line_printf(&p->text, "%s %s", it->text, it->prefix);
    }
    encode_prefix(m, p, p->text.n, &p->ids, &p->n);
}
static void prompt_free(Prompt *p) {
    line_free(&p->text);
    free(p->ids);
}
/* Tokens before byte offset `at` of the item's text in the prompt (its parts start with a space, where the
 * pre-tokenizer splits, so the count is the same as in the whole prompt). */
static int prompt_tokens_before(const Model *m, const Prompt *p, size_t at) {
    int *ids;
    size_t n;
    encode_prefix(m, p, p->user_at + at, &ids, &n);
    free(ids);
    return (int)n;
}

/* An item whose prompt takes at most `room` tokens, as many filler units as that allows: generated at a first guess
 * from two sizes' token counts, then shrunk until it fits. 0, or -1 when even task_min_units does not fit (nothing
 * to free then). */
static int item_gen(TaskItem *it, TaskKind kind, int n_units, double depth, uint64_t seed, int questions, char *err,
                    size_t errlen) {
    return questions ? task_generate_shared(it, n_units, questions, depth, seed, err, errlen)
                     : task_generate(it, kind, n_units, depth, seed, err, errlen);
}

static int item_fit(TaskItem *it, Prompt *p, int *stop, const Model *m, const Options *o, TaskKind kind, double depth,
                    uint64_t seed, int room, int *smallest) {
    char err[256];
    int qs = o->questions;
    int lo = task_min_units(kind), probe = lo + 64, t_lo, t_probe;
    if (item_gen(it, kind, lo, depth, seed, qs, err, sizeof err)) fatal("-task %s: %s", task_name(kind), err);
    prompt_build(p, m, o, it, stop);
    t_lo = (int)p->n;
    *smallest = t_lo;
    if (t_lo > room) { prompt_free(p); task_item_free(it); return -1; }
    prompt_free(p);
    task_item_free(it);
    if (item_gen(it, kind, probe, depth, seed, qs, err, sizeof err)) fatal("-task %s: %s", task_name(kind), err);
    prompt_build(p, m, o, it, stop);
    t_probe = (int)p->n;
    prompt_free(p);
    task_item_free(it);
    double per = (double)(t_probe - t_lo) / (probe - lo);
    int n = lo + (int)((room - t_lo) / per);
    for (;;) {
        if (item_gen(it, kind, n, depth, seed, qs, err, sizeof err)) fatal("-task %s: %s", task_name(kind), err);
        prompt_build(p, m, o, it, stop);
        if ((int)p->n <= room) return 0;
        int over = (int)p->n - room, step = (int)ceil(over / per);
        prompt_free(p);
        task_item_free(it);
        n -= step > 1 ? step : 1;
        if (n < lo) n = lo;   /* lo fits (t_lo <= room) */
    }
}

/* The tokens an item's prompt may take in a cell of `length` tokens: the rest is the answer's. With -questions,
 * room for every later turn too (its question and prefix, TURN_TOKENS at most for niah_multikey's made-up keys,
 * measured: 41 for SmolLM2's ChatML) and every answer, as -shared turns keeps them all in the cache; -shared
 * requests gets the same context, so that the two protocols ask the same items. */
enum { TURN_TOKENS = 48 };
static int prompt_room(const Options *o, int length, int max_new) {
    if (!o->questions) return length - max_new;
    return length - o->questions * max_new - (o->questions - 1) * TURN_TOKENS;
}

/* Per policy: the score and exact sums and the count of items of each (length, depth) cell. */
typedef struct { double score; int exact, n; } Cell;

/* One item asked of one policy, and where its results go. */
typedef struct {
    Model *m;
    const Options *o;
    PolicyRun *r;
    const TaskItem *it;
    const Prompt *p;
    TaskKind kind;
    int length;
    double depth;          /* NaN: none (cwe) */
    int rep;
    uint64_t item_seed;
    int needle_pos, question_pos;
    int stop, chunk, max_new;
    OutFile *out;
    Line *ln;
    const Provenance *pv;
    Cell *cell;
    double *qsum;          /* (TASK_MAX_NEEDLES) -questions: Σ score per question */
    int *qn;               /* (TASK_MAX_NEEDLES) and the count */
} ItemRun;

/* One answer's record; question -1 for an item that is not a shared context. question_pos: the position where this
 * question's tokens start (a later turn of -shared turns starts after the answers before it). */
static void record_write(const ItemRun *ir, int question, int question_pos, int prompt_tokens, int answer_tokens,
                         const char (*expected)[16], int n_expected, const char *answer, int cache_full, TaskScore sc) {
    if (ir->out->fd < 0) return;
    Line *ln = ir->ln;
    const PolicyRun *r = ir->r;
    line_printf(ln, "{\"mode\":\"task\",\"task\":\"%s\",\"family\":\"%s\",\"variant\":", task_name(ir->kind),
                task_family(ir->kind));
    if (task_variant(ir->kind)) line_printf(ln, "\"%s\"", task_variant(ir->kind));
    else line_printf(ln, "null");
    line_printf(ln, ",\"kv\":\"");
    line_json_str(ln, r->cache.spec.text);
    line_printf(ln, "\",\"budget\":%d,\"length\":%d,\"depth\":", r->cache.policy.budget, ir->length);
    if (isnan(ir->depth)) line_printf(ln, "null");
    else line_printf(ln, "%.6g", ir->depth);
    if (question >= 0) line_printf(ln, ",\"shared\":\"%s\",\"questions\":%d,\"question\":%d", ir->o->shared,
                                   ir->o->questions, question + 1);
    line_printf(ln, ",\"item\":%d,\"item_seed\":%llu,\"prompt_tokens\":%d,\"answer_tokens\":%d,\"fillers\":%d,"
                "\"needle_pos\":%d,\"question_pos\":%d,\"chat\":%s,\"expected\":[", ir->rep,
                (unsigned long long)ir->item_seed, prompt_tokens, answer_tokens, ir->it->n_units, ir->needle_pos,
                question_pos, ir->p->special ? "true" : "false");
    for (int e = 0; e < n_expected; e++) {
        line_printf(ln, "%s\"", e ? "," : "");
        line_json_str(ln, expected[e]);
        line_printf(ln, "\"");
    }
    line_printf(ln, "],\"answer\":\"");
    line_json_str(ln, answer);
    KVBytes bytes = kv_bytes(&r->cache);
    line_printf(ln, "\",\"cache_full\":%s,\"found\":%d,\"score\":%.6g,\"exact\":%d,\"kv_live_bytes\":%zu,"
                "\"kv_peak_live_bytes\":%zu,\"kv_alloc_bytes\":%zu,", cache_full ? "true" : "false", sc.found, sc.score,
                sc.exact, bytes.total_live, bytes.peak_live, bytes.total_alloc);
    json_provenance_end(ln, ir->pv);
    outfile_line(ir->out, ln);
}

static void cell_add(Cell *c, TaskScore sc) {
    c->score += sc.score;
    c->exact += sc.exact;
    c->n++;
}

/* Feed ids[0..n) after what the cache holds (for -kvlog's text too) and answer: 0, PK_CACHE_FULL or PK_STOPPED. */
static int feed_and_answer(const ItemRun *ir, const int *ids, size_t n, int *pos, char *answer, size_t cap) {
    for (size_t i = 0; i < n; i++) ids_push(&ir->r->asked, ids[i]);
    answer[0] = 0;
    int rc = prefill(ir->m, ir->r, ids, n, pos, ir->chunk);
    return rc ? rc : eval_answer(ir->m, ir->r, pos, ir->max_new, ir->stop, answer, cap);
}

/* An empty cache for the item's prompt: reset, told the prompt's and the context's lengths. */
static void item_cache_start(KVCache *c, const ItemRun *ir) {
    kv_cache_reset(c);
    kv_set_prompt_len(c, (int)ir->p->n);
    kv_set_context_len(c, ir->question_pos);   /* snapkv query=agnostic compresses before the question */
}

/* The item's prompt from an empty cache, answered and scored; its first `from` tokens moved in from `shared`, a
 * `full,type=f32` cache that holds them (from <= kv_full_prefix of the policy's cache, so that is bit for bit what
 * the policy's own prefill of them leaves), or none (from 0). 0 or PK_STOPPED (nothing recorded then). */
static int ask_one(ItemRun *ir, const KVCache *shared, int from) {
    char answer[2048];
    PolicyRun *r = ir->r;
    item_cache_start(&r->cache, ir);
    r->asked.n = 0;
    int pos = 0;
    if (from > 0) {
        share_move_in(&r->cache, shared, from, "-m task");
        for (int i = 0; i < from; i++) ids_push(&r->asked, ir->p->ids[i]);
        pos = from;
    }
    int rc = feed_and_answer(ir, ir->p->ids + from, ir->p->n - (size_t)from, &pos, answer, sizeof answer);
    if (rc == PK_STOPPED) return rc;
    note_bytes(r);
    TaskScore sc = task_score(ir->it, answer);
    cell_add(ir->cell, sc);
    record_write(ir, -1, ir->question_pos, (int)ir->p->n, pos - (int)ir->p->n, ir->it->expected, ir->it->n_expected, answer,
                 rc == PK_CACHE_FULL, sc);
    return 0;
}

/* A shared context's questions (SCBench's protocol). turns: the prompt (context and question 1) answered, then each
 * later question as a new user turn of the same chat, every answer left in the cache. requests: the context alone
 * prefilled once and its cache cloned (policy state included); each question is asked of the clone restored, as
 * its own request: the question's tokens are the prompt's own from where the question starts. A query-aware
 * prompt-end policy (snapkv query=aware, kv_query_aware) under requests compresses with question 1 in its window, as
 * SCBench's query-aware methods do: question 1's whole prompt is prefilled (and compressed at its end), the clone is
 * that cache with question 1's tokens dropped (kv_cache_truncate) and no compression left to do, and questions 2..N
 * are asked of it. 0 or PK_STOPPED. */
static int ask_shared(ItemRun *ir) {
    char answer[2048], err[512];
    PolicyRun *r = ir->r;
    const Model *m = ir->m;
    const TaskItem *it = ir->it;
    int requests = !strcmp(ir->o->shared, "requests");
    kv_cache_reset(&r->cache);
    r->asked.n = 0;
    int pos = 0, rc = 0;
    KVCache saved;
    int n_ctx = ir->question_pos;   /* the context's tokens: everything before question 1 */
    int aware = requests && kv_query_aware(&r->cache);   /* requests, question 1 compressed with the context */
    kv_set_context_len(&r->cache, n_ctx);
    if (aware) {
        kv_set_prompt_len(&r->cache, (int)ir->p->n);
        for (size_t i = 0; i < ir->p->n; i++) ids_push(&r->asked, ir->p->ids[i]);
        rc = prefill(ir->m, r, ir->p->ids, ir->p->n, &pos, ir->chunk);
        if (rc == PK_STOPPED) return rc;
        if (rc == 0) {
            if (kv_cache_clone(&saved, &r->cache, err, sizeof err) || kv_cache_truncate(&saved, n_ctx, err, sizeof err))
                fatal("-shared requests: %s", err);
            kv_set_prompt_len(&saved, 0);   /* compressed once: the later questions' prompts compress nothing */
            kv_set_context_len(&saved, 0);
        }
    } else if (requests) {
        kv_set_prompt_len(&r->cache, n_ctx);   /* a prefill-time policy compresses the context, not seeing a question */
        for (int i = 0; i < n_ctx; i++) ids_push(&r->asked, ir->p->ids[i]);
        rc = prefill(ir->m, r, ir->p->ids, (size_t)n_ctx, &pos, ir->chunk);
        if (rc == PK_STOPPED) return rc;
        if (rc == 0 && kv_cache_clone(&saved, &r->cache, err, sizeof err)) fatal("-shared requests: %s", err);
    } else kv_set_prompt_len(&r->cache, (int)ir->p->n);
    int failed = rc;   /* PK_CACHE_FULL while prefilling the context: every question records it */
    for (int q = 0; q < it->n_questions; q++) {
        int n_prompt = 0, fed = 0, before = pos;
        answer[0] = 0;
        if (failed) rc = failed;
        else if (aware && q == 0) {   /* question 1's prompt is in the cache, compressed: its answer */
            n_prompt = fed = (int)ir->p->n;
            before = 0;
            rc = eval_answer(ir->m, r, &pos, ir->max_new, ir->stop, answer, sizeof answer);
        } else if (requests) {
            /* the prompt for question q: the same context, question q in place of question 1 */
            TaskItem one = *it;
            Line user = {0};
            line_printf(&user, "%.*s%s", (int)it->question_at, it->text, it->question[q]);
            one.text = user.s;
            one.prefix = (char *)it->qprefix[q];
            Prompt pq;
            int stop;
            prompt_build(&pq, m, ir->o, &one, &stop);
            if (pq.n < (size_t)n_ctx || memcmp(pq.ids, ir->p->ids, (size_t)n_ctx * sizeof(int)))
                fatal("-shared requests: question %d's prompt does not begin with the context's tokens", q + 1);
            if (kv_cache_restore(&r->cache, &saved, err, sizeof err)) fatal("-shared requests: %s", err);
            r->asked.n = (size_t)n_ctx;
            pos = before = n_ctx;
            n_prompt = (int)pq.n;
            fed = n_prompt - n_ctx;
            rc = feed_and_answer(ir, pq.ids + n_ctx, pq.n - (size_t)n_ctx, &pos, answer, sizeof answer);
            prompt_free(&pq);
            line_free(&user);
        } else if (q == 0) {
            rc = feed_and_answer(ir, ir->p->ids, ir->p->n, &pos, answer, sizeof answer);
            n_prompt = fed = (int)ir->p->n;
        } else {
            /* the next user turn of the same chat, after the answer so far */
            Line t;
            int bos, stop;
            if (chat_prompt_text(&t, &bos, &stop, m, ir->o->system, it->question[q] + 1, 0))
                fatal("-shared turns needs a model with a chat template");
            line_printf(&t, "%s", it->qprefix[q]);
            int *ids;
            size_t n;
            if (tokenizer_encode_special(&m->tokenizer, (const unsigned char *)t.s, t.n, 0, &ids, &n, err, sizeof err))
                fatal("tokenizer: %s", err);
            line_free(&t);
            rc = feed_and_answer(ir, ids, n, &pos, answer, sizeof answer);
            n_prompt = fed = (int)n;
            free(ids);
        }
        if (rc == PK_STOPPED) {
            if (requests && !failed) kv_cache_free(&saved);
            return rc;
        }
        note_bytes(r);
        TaskScore sc = task_score_answers(&it->expected[q], 1, answer);
        cell_add(ir->cell, sc);
        ir->qsum[q] += sc.score;
        ir->qn[q]++;
        record_write(ir, q, requests || q == 0 ? ir->question_pos : before, n_prompt, rc == PK_CACHE_FULL ? 0 : pos - before - fed, &it->expected[q], 1, answer,
                     rc == PK_CACHE_FULL, sc);
        if (rc == PK_CACHE_FULL && !requests) failed = rc;   /* the chat cannot continue */
    }
    if (requests && !failed) kv_cache_free(&saved);
    return 0;
}

int task_lengths(const Options *o, int ctx, int max_new, int *lens) {
    int n_lens = o->n_lengths ? o->n_lengths : 3;
    for (int li = 0; li < n_lens; li++) lens[li] = o->n_lengths ? o->lengths[li] : ctx / (1 << (2 - li));
    for (int li = 0; li < n_lens; li++) {
        if (lens[li] > ctx)
            fatal("-lengths: %d tokens is over -c %d, the cache of full and of the selection policies; use -c %d or a "
                  "shorter length", lens[li], ctx, lens[li]);
        if (lens[li] <= max_new)
            fatal("-lengths: %d tokens leaves no room for a prompt beside the %d answer tokens (-n)", lens[li], max_new);
    }
    return n_lens;
}

int task_reference_policies(const Options *o, const char *task, const char **specs, const int **caps, int *given) {
    int ref_k = -1;
    for (int k = 0; k < o->n_kv; k++) if (!strcmp(o->kv[k], "full")) { ref_k = k; break; }
    if (ref_k < 0) run_note("-task %s: no -kv full given: full runs first anyway, as the reference every policy's "
                            "answers are scored against (its table is marked reference)", task);
    specs[0] = "full";
    caps[0] = ref_k >= 0 ? o->kv_caps[ref_k] : NULL;
    int n = 1;
    for (int k = 0; k < o->n_kv; k++)
        if (k != ref_k) { specs[n] = o->kv[k]; caps[n] = o->kv_caps[k]; n++; }
    *given = ref_k >= 0;
    return n;
}

int run_task(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("-m task needs a model with a tokenizer");
    int kind_i = task_parse(o->task ? o->task : "");
    if (kind_i < 0) fatal("-m task needs -task NAME; tasks: %s", task_names());
    if (o->n_docs) fatal("-docs is for the natural tasks (summary, docqa, dialogue): -task %s generates its own text", o->task);
    TaskKind kind = (TaskKind)kind_i;
    int ctx = run_context(m, o), chunk = o->chunk ? o->chunk : PREFILL_CHUNK, items = o->items ? o->items : 2;
    if (o->steps_set && o->steps == 0) fatal("-m task -n 0 leaves no token to answer with: give the answer's length "
                                             "(default %d for %s)", task_answer_tokens(kind), task_name(kind));
    int max_new = o->steps_set ? o->steps : task_answer_tokens(kind);
    static const double default_depths[] = {0.0, 0.25, 0.5, 0.75, 1.0};
    double no_depth = NAN;
    const double *depths = kind == TASK_CWE ? &no_depth : o->n_depths ? o->depths : default_depths;
    int n_depths = kind == TASK_CWE ? 1 : o->n_depths ? o->n_depths : 5;
    int lens[MAX_PASSKEY_CELLS], n_lens = task_lengths(o, ctx, max_new, lens);
    for (int li = 0; li < n_lens; li++) {   /* the smallest prompt of the first item must fit (said before any work) */
        TaskItem it;
        Prompt p;
        int stop;
        uint64_t r0 = o->seed_set ? o->seed : 1;
        int room = prompt_room(o, lens[li], max_new), smallest;
        if (item_fit(&it, &p, &stop, m, o, kind, 0, splitmix64(&r0), room, &smallest))
            fatal("-lengths: %d tokens is too short for -task %s: its smallest prompt takes %d tokens, which with %d "
                  "answer tokens%s needs a length of at least %d", lens[li], task_name(kind), smallest, max_new,
                  o->questions ? " per question and the later turns" : "", smallest + lens[li] - room);
        prompt_free(&p);
        task_item_free(&it);
    }
    if (kind == TASK_CWE && o->n_depths) run_note("-task cwe has no depth (the list is the whole context): -depths is "
                                                  "not used");
    int n_pol = o->n_kv ? o->n_kv : 1;
    uint64_t seed = o->seed_set ? o->seed : 1;
    Sha256 text_sha;
    sha_init(&text_sha);
    sha_update(&text_sha, PK_FILLER, strlen(PK_FILLER));   /* the filler is the text every item is made of */
    TaskJob job;
    task_job_open(&job, m, o, ctx, &text_sha, seed);   /* every -kv spec checked first */
    Line ln = {0};
    fprintf(stderr, "task %s: lengths", task_name(kind));
    for (int li = 0; li < n_lens; li++) fprintf(stderr, " %d", lens[li]);
    if (kind == TASK_CWE) fprintf(stderr, " tokens, no depth");
    else {
        fprintf(stderr, " tokens, depths");
        for (int di = 0; di < n_depths; di++) fprintf(stderr, " %g", depths[di]);
    }
    fprintf(stderr, ", %d items per cell, %d answer tokens, seed %llu; score: the share of expected answers in the "
            "output (RULER's string match), exact: all of them\n", items, max_new, (unsigned long long)seed);
    long total_tokens = 0, done_tokens = 0;
    for (int li = 0; li < n_lens; li++) total_tokens += (long)lens[li] * n_depths * items * n_pol;
    /* Item by item, every policy in turn, all asked the same items. The policies that only store over a prompt's
     * first n tokens (kv_full_prefix: full; window, sink and random until a lane is full; snapkv until its
     * observation window; quest and topk under prompt=dense until the prompt's end) start from one `full,type=f32` prefill of the item's prompt, moved into their cache at their n: the forward
     * pass gives the same bits whatever the chunking, so their answers and bytes are those of their own prefill
     * (tests/test_task.sh compares with -prefix 0). Shared-context questions (-questions) prefill alone. */
    int share = o->prefix && !o->questions;
    PolicyRun *runs = calloc((size_t)n_pol, sizeof *runs), pre;
    Cell *cells = calloc((size_t)n_pol * n_lens * n_depths, sizeof *cells);
    double *qsum = calloc((size_t)n_pol * TASK_MAX_NEEDLES, sizeof *qsum), *secs = calloc((size_t)n_pol, sizeof *secs);
    int *qn = calloc((size_t)n_pol * TASK_MAX_NEEDLES, sizeof *qn), *from = calloc((size_t)n_pol, sizeof *from),
        *order = calloc((size_t)n_pol, sizeof *order);
    if (!runs || !cells || !qsum || !secs || !qn || !from || !order) fatal("out of memory");
    for (int k = 0; k < n_pol; k++) {
        policy_run_init(&runs[k], m, o, o->n_kv ? o->kv[k] : "full", ctx, 0, chunk, o->n_kv ? o->kv_caps[k] : NULL);
        if (o->kvlog) kvlog_attach(&runs[k].kvlog, &job.kvlog, m, &runs[k].asked, &runs[k].cache);
    }
    if (share) policy_run_init(&pre, m, o, "full,type=f32", ctx, 0, chunk, NULL);
    long shared_tokens = 0, own_tokens = 0;   /* prompt tokens moved in from the shared prefill, and prefilled alone */
    double pre_secs = 0;
    int stopped = 0;
    double t_job = now_s();
    uint64_t rng = seed;
    for (int li = 0; li < n_lens && !stopped; li++)
        for (int di = 0; di < n_depths && !stopped; di++)
            for (int rep = 0; rep < items && !stopped; rep++) {
                uint64_t item_seed = splitmix64(&rng);
                TaskItem it;
                Prompt p;
                int stop;
                int smallest;
                if (item_fit(&it, &p, &stop, m, o, kind, kind == TASK_CWE ? 0 : depths[di], item_seed,
                             prompt_room(o, lens[li], max_new), &smallest))
                    fatal("-lengths: %d tokens is too short for -task %s at depth %g: its smallest prompt takes "
                          "%d tokens", lens[li], task_name(kind), depths[di], smallest);
                ItemRun ir = {m, o, NULL, &it, &p, kind, lens[li], kind == TASK_CWE ? NAN : depths[di], rep,
                              item_seed, it.n_needles ? prompt_tokens_before(m, &p, it.needle_at[0]) : -1,
                              prompt_tokens_before(m, &p, it.question_at), stop, chunk, max_new, &job.out, &ln, &job.pv,
                              NULL, NULL, NULL};
                /* each policy's share of the prefill (share_from), the policies in increasing order of it, so the
                   shared cache only grows */
                for (int k = 0; k < n_pol; k++) {
                    from[k] = 0;
                    if (share) {
                        item_cache_start(&runs[k].cache, &ir);
                        from[k] = share_from(&runs[k].cache, p.n, chunk);
                    }
                    share_order(from, k, order);
                }
                int pre_pos = 0;
                if (share) item_cache_start(&pre.cache, &ir);
                for (int j = 0; j < n_pol && !stopped; j++) {
                    int k = order[j];
                    if (from[k] > pre_pos) {
                        double t0 = now_s();
                        int rc = prefill(m, &pre, p.ids + pre_pos, (size_t)(from[k] - pre_pos), &pre_pos, chunk);
                        pre_secs += now_s() - t0;
                        if (rc == PK_STOPPED) { stopped = 1; break; }
                        if (rc) fatal("-m task: the shared prefill of %d tokens did not fit -c %d", from[k], ctx);
                    }
                    ir.r = &runs[k];
                    ir.cell = &cells[((size_t)k * n_lens + li) * n_depths + di];
                    ir.qsum = qsum + (size_t)k * TASK_MAX_NEEDLES;
                    ir.qn = qn + (size_t)k * TASK_MAX_NEEDLES;
                    double t0 = now_s();
                    int rc = o->questions ? ask_shared(&ir) : ask_one(&ir, share ? &pre.cache : NULL, from[k]);
                    secs[k] += now_s() - t0;
                    if (rc == PK_STOPPED) { stopped = 1; break; }
                    shared_tokens += from[k];
                    own_tokens += (long)p.n - from[k];
                    done_tokens += lens[li];
                    progress(t_job, done_tokens, total_tokens, "task");
                }
                prompt_free(&p);
                task_item_free(&it);
            }
    for (int k = 0; k < n_pol; k++) {
        const PolicyRun *r = &runs[k];
        const Cell *pc = &cells[(size_t)k * n_lens * n_depths];
        /* the table: mean score by length (rows) and depth (columns), exact answers beside it */
        fprintf(stderr, "\n%s, %s: mean score (exact/items) by length (rows)%s\n%8s", r->cache.spec.text,
                task_name(kind), kind == TASK_CWE ? "" : " and depth (columns)", "");
        for (int di = 0; di < n_depths; di++)
            if (kind == TASK_CWE) fprintf(stderr, " %13s", "-");
            else fprintf(stderr, " %13.4g", depths[di]);
        fprintf(stderr, "\n");
        double sum = 0;
        int ex = 0, n = 0;
        for (int li = 0; li < n_lens; li++) {
            fprintf(stderr, "%8d", lens[li]);
            for (int di = 0; di < n_depths; di++) {
                const Cell *c = &pc[li * n_depths + di];
                char cell[32];
                if (c->n) snprintf(cell, sizeof cell, "%.3f (%d/%d)", c->score / c->n, c->exact, c->n);
                else snprintf(cell, sizeof cell, "-");
                fprintf(stderr, " %13s", cell);
                sum += c->score;
                ex += c->exact;
                n += c->n;
            }
            fprintf(stderr, "\n");
        }
        if (o->questions) {
            fprintf(stderr, "%s, %s -questions %d -shared %s: mean score by question:", r->cache.spec.text,
                    task_name(kind), o->questions, o->shared);
            for (int q = 0; q < o->questions; q++) {
                int nq = qn[(size_t)k * TASK_MAX_NEEDLES + q];
                fprintf(stderr, " %d: %.3f", q + 1, nq ? qsum[(size_t)k * TASK_MAX_NEEDLES + q] / nq : 0);
            }
            fprintf(stderr, "\n");
        }
        fprintf(stderr, "%s, %s: score %.3f, exact %d/%d items, peak KV %.2f MiB, %.1f s%s\n", r->cache.spec.text,
                task_name(kind), n ? sum / n : 0, ex, n, r->peak.peak_live / 1048576.0, secs[k],
                stopped ? " (stopped early)" : "");
    }
    if (share)   /* with -prefix 1 always, so a run that shared nothing says so */
        fprintf(stderr, "task: %ld prompt tokens moved in from one shared full-cache prefill per item (%.1f s), %ld "
                "prefilled by the policies themselves (-prefix 0: all of them)\n", shared_tokens, pre_secs, own_tokens);
    for (int k = 0; k < n_pol; k++) policy_run_free(&runs[k]);
    if (share) policy_run_free(&pre);
    free(runs); free(qsum); free(secs); free(qn); free(from); free(order);
    if (stopped) fprintf(stderr, "task: stopped by %s: the item being asked was dropped; every answer above is "
                         "recorded\n", run_signal_name(run_signal));
    free(cells);
    line_free(&ln);
    task_job_close(&job);
    return stopped ? 128 + run_signal : 0;
}
