/* task_text.c: -m task -task summary|docqa|dialogue (task_text.h states the tasks, the documents and the scores):
 * the scores (token F1, ROUGE-L), the document set, the slice and the quote, and the runner that asks full (the
 * reference) and then every other -kv policy each item through the engine (chunked prefill, greedy decode: eval_impl.h's,
 * as the other task runners).
 *
 * Dimensions: room (tokens the document may take in a prompt), length (tokens of a cell: the prompt, the questions and
 * every answer), ctx (-c).
 */
#include "task_text.h"
#include "eval_impl.h"
#include "task.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const TEXT_NAMES[TEXT_COUNT] = {"summary", "docqa", "dialogue"};

int text_task_parse(const char *name) {
    for (int k = 0; k < TEXT_COUNT; k++) if (!strcmp(name, TEXT_NAMES[k])) return k;
    return -1;
}
const char *text_task_names(void) { return "summary, docqa, dialogue"; }
const char *text_task_name(TextKind k) { return TEXT_NAMES[k]; }
int text_answer_tokens(TextKind k) { return k == TEXT_SUMMARY ? 96 : k == TEXT_DOCQA ? 40 : 48; }

const char *const TEXT_DIALOGUE_TURNS[TEXT_TURNS] = {
    "What is the text above about? Answer in one sentence.",
    "Who is the text written for?",
    "Name three terms the text uses.",
    "Quote the first sentence of the text.",
    "What is the most important rule or fact in the text?",
    "Does the text warn against anything? Say what.",
    "Quote the last sentence of the text.",
    "Summarize our conversation so far in one sentence.",
};

/* Debian 12 (bookworm), base-files 12.4. The GPL, LGPL and GFDL links are left out: they name files listed here. */
typedef struct { const char *name, *sha256; } TextPin;
static const TextPin TEXT_PINS[] = {
    {"Apache-2.0", "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"},
    {"Artistic", "b7fd9b73ea99602016a326e0b62e6646060d18febdd065ceca8bb482208c3d88"},
    {"BSD", "5d588eb3b157d52112afea935c88a7ff9efddc1e2d95a42c25d3b96ad9055008"},
    {"CC0-1.0", "a2010f343487d3f7618affe54f789f5487602331c0a8d03f49e9a7c547cf0499"},
    {"GFDL-1.2", "d8e94ae5fdb5433fcae2961aeb1a8cf17174d6f4a0465d24bf37dd8a038bd439"},
    {"GFDL-1.3", "110535522396708cea37c72a802c5e7e81391139f5f7985631c93ef242b206a4"},
    {"GPL-1", "d77d235e41d54594865151f4751e835c5a82322b0e87ace266567c3391a4b912"},
    {"GPL-2", "8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643"},
    {"GPL-3", "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"},
    {"LGPL-2", "681e386e44a19d7d0674b4320272c90e66b6610b741e7e6305f8219c42e85366"},
    {"LGPL-2.1", "dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551"},
    {"LGPL-3", "e3a994d82e644b03a792a930f574002658412f62407f5fee083f2555c5f23118"},
    {"MPL-1.1", "f849fc26a7a99981611a3a370e83078deb617d12a45776d6c4cada4d338be469"},
    {"MPL-2.0", "fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85"},
};
enum { TEXT_N_PINS = (int)(sizeof TEXT_PINS / sizeof TEXT_PINS[0]) };

/* ---------------------------------------------------------------------------------------------------------------
 * The scores.
 * ------------------------------------------------------------------------------------------------------------- */

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static int is_punct(unsigned char c) { return c >= 33 && c <= 126 && !(c >= '0' && c <= '9') && !(c >= 'a' && c <= 'z')
                                              && !(c >= 'A' && c <= 'Z'); }

/* Normalized words (SQuAD's normalize_answer): w[i] points into buf, NUL-terminated. */
typedef struct { char *buf; char **w; int n; } Words;

static void words_of(Words *ws, const char *s, size_t n) {
    ws->buf = malloc(n + 1);
    ws->w = malloc((n / 2 + 1) * sizeof *ws->w);   /* a word and its separator take at least 2 bytes, but the last */
    if (!ws->buf || !ws->w) fatal("out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {   /* lower case, punctuation dropped (as SQuAD: removed, not a separator) */
        unsigned char c = (unsigned char)s[i];
        if (is_punct(c)) continue;
        ws->buf[k++] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
    }
    ws->buf[k] = 0;
    ws->n = 0;
    for (size_t i = 0; i < k;) {
        while (i < k && is_ws((unsigned char)ws->buf[i])) ws->buf[i++] = 0;
        if (i == k) break;
        char *w = ws->buf + i;
        while (i < k && !is_ws((unsigned char)ws->buf[i])) i++;
        if (i < k) ws->buf[i++] = 0;
        if (!strcmp(w, "a") || !strcmp(w, "an") || !strcmp(w, "the")) continue;
        ws->w[ws->n++] = w;
    }
}
static void words_free(Words *ws) { free(ws->buf); free(ws->w); }

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* P, R from a match count into the F-measure; both empty: 1, one empty: 0. */
static double f_measure(int common, int na, int nb) {
    if (na == 0 || nb == 0) return na == nb;
    if (common == 0) return 0;
    double p = (double)common / na, r = (double)common / nb;
    return 2 * p * r / (p + r);
}

double text_f1(const char *a, size_t na, const char *b, size_t nb) {
    Words x, y;
    words_of(&x, a, na);
    words_of(&y, b, nb);
    qsort(x.w, (size_t)x.n, sizeof *x.w, cmp_str);   /* the multiset overlap: a merge of the two sorted lists */
    qsort(y.w, (size_t)y.n, sizeof *y.w, cmp_str);
    int common = 0;
    for (int i = 0, j = 0; i < x.n && j < y.n;) {
        int c = strcmp(x.w[i], y.w[j]);
        if (c == 0) { common++; i++; j++; } else if (c < 0) i++; else j++;
    }
    double f = f_measure(common, x.n, y.n);
    words_free(&x);
    words_free(&y);
    return f;
}

double text_rouge_l(const char *a, size_t na, const char *b, size_t nb) {
    Words x, y;
    words_of(&x, a, na);
    words_of(&y, b, nb);
    int *row = calloc((size_t)y.n + 1, sizeof *row);   /* LCS by dynamic programming, one row kept */
    if (!row) fatal("out of memory");
    for (int i = 1; i <= x.n; i++) {
        int diag = 0;   /* row[j - 1] of the previous row */
        for (int j = 1; j <= y.n; j++) {
            int up = row[j];
            row[j] = !strcmp(x.w[i - 1], y.w[j - 1]) ? diag + 1 : (row[j - 1] > up ? row[j - 1] : up);
            diag = up;
        }
    }
    double f = f_measure(row[y.n], x.n, y.n);
    free(row);
    words_free(&x);
    words_free(&y);
    return f;
}

int text_same(const char *a, size_t na, const char *b, size_t nb) {
    while (na && is_ws((unsigned char)*a)) { a++; na--; }
    while (na && is_ws((unsigned char)a[na - 1])) na--;
    while (nb && is_ws((unsigned char)*b)) { b++; nb--; }
    while (nb && is_ws((unsigned char)b[nb - 1])) nb--;
    return na == nb && !memcmp(a, b, na);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The documents.
 * ------------------------------------------------------------------------------------------------------------- */

const char *text_root(void) {
    const char *r = getenv(TEXT_ROOT_ENV);
    return r && *r ? r : TEXT_ROOT_DEFAULT;
}

/* 1 when data[a..b) holds a byte other than whitespace. */
static int has_text(const char *data, size_t a, size_t b) {
    for (size_t i = a; i < b; i++) if (!is_ws((unsigned char)data[i])) return 1;
    return 0;
}

static void doc_index(TextDoc *d) {
    d->paras = malloc((d->size / 2 + 2) * sizeof *d->paras);
    if (!d->paras) fatal("out of memory");
    d->n_paras = 0;
    int blank = 1;   /* the line before was blank (or there was none) */
    for (size_t i = 0; i < d->size;) {
        size_t e = i;
        while (e < d->size && d->data[e] != '\n') e++;
        int text = has_text(d->data, i, e);
        if (text && blank) d->paras[d->n_paras++] = i;
        blank = !text;
        i = e + 1;
    }
}

static void skip_note(TextSet *s, const char *name, const char *why) {
    size_t n = strlen(s->skipped);
    snprintf(s->skipped + n, sizeof s->skipped - n, "%s%s (%s)", n ? ", " : "", name, why);
    s->n_skipped++;
}

int text_load(TextSet *s, const char *const *files, int n_files, const char *root, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    struct stat st;
    int n_max = n_files ? n_files : TEXT_N_PINS;
    s->docs = calloc((size_t)n_max, sizeof *s->docs);
    if (!s->docs) fatal("out of memory");
    if (!n_files) {
        if (stat(root, &st)) { free(s->docs); s->docs = NULL;
            return errorf(err, errlen, "text root '%s' (%s, default %s): %s", root, TEXT_ROOT_ENV, TEXT_ROOT_DEFAULT,
                          strerror(errno)); }
        if (!S_ISDIR(st.st_mode)) { free(s->docs); s->docs = NULL;
            return errorf(err, errlen, "text root '%s' (%s) is not a directory", root, TEXT_ROOT_ENV); }
        snprintf(s->root, sizeof s->root, "%s", root);
    }
    for (int k = 0; k < n_max; k++) {
        char path[1024];
        if (n_files) snprintf(path, sizeof path, "%s", files[k]);
        else snprintf(path, sizeof path, "%s/%s", root, TEXT_PINS[k].name);
        TextDoc *d = &s->docs[s->n];
        if (!n_files && (stat(path, &st) || !S_ISREG(st.st_mode))) { skip_note(s, TEXT_PINS[k].name, "missing"); continue; }
        if (n_files && !stat(path, &st) && S_ISDIR(st.st_mode)) {
            errorf(err, errlen, "-docs '%s' is a directory, not a text file", path);
            text_set_free(s);
            return -1;
        }
        FILE *f = fopen(path, "rb");
        if (!f) {   /* -docs: a file named must be there (a pinned one was stat'ed) */
            errorf(err, errlen, "%s '%s': %s", n_files ? "-docs" : "pinned text", path, strerror(errno));
            text_set_free(s);
            return -1;
        }
        size_t cap = 1 << 16;   /* read to the end: a -docs file may be a pipe (<(zcat ...)) */
        d->data = malloc(cap + 1);
        if (!d->data) fatal("out of memory");
        for (size_t got; (got = fread(d->data + d->size, 1, cap - d->size, f)) > 0;) {
            d->size += got;
            if (d->size == cap && !(d->data = realloc(d->data, (cap *= 2) + 1))) fatal("out of memory");
        }
        int bad = ferror(f);
        fclose(f);
        d->data[d->size] = 0;
        if (bad) {
            errorf(err, errlen, "reading '%s' failed", path);
            s->n++;
            text_set_free(s);
            return -1;
        }
        sha256_hex(d->data, d->size, d->sha256);
        snprintf(d->name, sizeof d->name, "%s", n_files ? files[k] : TEXT_PINS[k].name);
        if (!n_files && strcmp(d->sha256, TEXT_PINS[k].sha256)) {
            skip_note(s, TEXT_PINS[k].name, "sha256 differs");
            free(d->data);
            memset(d, 0, sizeof *d);
            continue;
        }
        if (!has_text(d->data, 0, d->size)) {
            errorf(err, errlen, "-docs '%s' holds no text (%zu bytes, all whitespace)", path, d->size);
            s->n++;
            text_set_free(s);
            return -1;
        }
        doc_index(d);
        s->n++;
    }
    if (s->n == 0) {
        errorf(err, errlen, "no pinned text is left under '%s' (%d of %d skipped: %s)", root, s->n_skipped, TEXT_N_PINS,
               s->skipped);
        text_set_free(s);
        return -1;
    }
    return 0;
}

void text_set_free(TextSet *s) {
    for (int i = 0; i < s->n; i++) { free(s->docs[i].data); free(s->docs[i].paras); }
    free(s->docs);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The slice.
 * ------------------------------------------------------------------------------------------------------------- */

/* A token takes at least one byte and, in prose, far fewer than this many: paragraph ends further than room *
 * BYTES_PER_TOKEN_MAX bytes from the start cannot fit, so the search never encodes a whole long document. */
enum { BYTES_PER_TOKEN_MAX = 16, SLICE_TRIES = 64, MIN_ROOM = 16 };

/* The end of a slice that runs to paragraph k's start (k == n_paras: the document's end), trailing whitespace out. */
static size_t slice_end(const TextDoc *d, int k) {
    size_t e = k < d->n_paras ? d->paras[k] : d->size;
    while (e > 0 && is_ws((unsigned char)d->data[e - 1])) e--;
    return e;
}

int text_draw_slice(TextSlice *sl, const TextSet *s, int room, uint64_t seed, TextCount count, void *ctx) {
    memset(sl, 0, sizeof *sl);
    uint64_t rng = seed;
    int least = room - room / 4;
    for (int t = 0; t < SLICE_TRIES; t++) {
        const TextDoc *d = &s->docs[splitmix64(&rng) % (uint64_t)s->n];
        int p = (int)(splitmix64(&rng) % (uint64_t)d->n_paras);
        size_t start = d->paras[p];
        if (d->size - start < (size_t)least) continue;   /* fewer bytes left than the tokens wanted */
        int a = p + 1, b = p + 1;   /* the ends to search: paragraphs p+1 .. b (b: the last within reach) */
        while (b < d->n_paras && d->paras[b] - start <= (size_t)room * BYTES_PER_TOKEN_MAX) b++;
        if (count(d->data + start, slice_end(d, a) - start, ctx) > room) continue;   /* its first paragraph is too long */
        while (a < b) {   /* the furthest end that fits */
            int mid = a + (b - a + 1) / 2;
            if (count(d->data + start, slice_end(d, mid) - start, ctx) <= room) a = mid; else b = mid - 1;
        }
        size_t end = slice_end(d, a);
        int tok = count(d->data + start, end - start, ctx);
        if (tok < least || tok > room) continue;
        sl->doc = (int)(d - s->docs);
        sl->start = start;
        sl->end = end;
        sl->tokens = tok;
        return 0;
    }
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * docqa's quote.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { size_t at, len; } Span;

static int ends_sentence(const char *w, size_t len) {
    char c = w[len - 1];
    return c == '.' || c == '?' || c == '!' || c == ';' || c == ':';
}

static int same_words(const char *text, const Span *w, int i, int j, int n) {
    for (int k = 0; k < n; k++)
        if (w[i + k].len != w[j + k].len || memcmp(text + w[i + k].at, text + w[j + k].at, w[i + k].len)) return 0;
    return 1;
}

static void join_words(char *out, size_t cap, const char *text, const Span *w, int from, int n) {
    size_t k = 0;
    out[0] = 0;
    for (int i = from; i < from + n; i++) {
        int r = snprintf(out + k, cap - k, "%s%.*s", i > from ? " " : "", (int)w[i].len, text + w[i].at);
        if (r < 0 || (size_t)r >= cap - k) { out[k] = 0; return; }   /* cut at a word: the caps hold the maxima */
        k += (size_t)r;
    }
}

int text_qa(TextQA *q, const char *text, size_t n, double depth) {
    memset(q, 0, sizeof *q);
    Span *w = malloc((n / 2 + 1) * sizeof *w);
    if (!w) fatal("out of memory");
    int nw = 0;
    for (size_t i = 0; i < n;) {
        while (i < n && is_ws((unsigned char)text[i])) i++;
        if (i == n) break;
        size_t a = i;
        while (i < n && !is_ws((unsigned char)text[i])) i++;
        w[nw].at = a;
        w[nw++].len = i - a;
    }
    q->n_words = nw;
    /* the sentence starts, ordered by distance from the target word (the earlier first on a tie) */
    double target = depth * nw;
    int best = -1;
    double best_d = 0;
    char *tried = calloc((size_t)nw + 1, 1);
    if (!tried) fatal("out of memory");
    for (;;) {
        best = -1;
        for (int i = 0; i < nw; i++) {
            if (tried[i] || (i > 0 && !ends_sentence(text + w[i - 1].at, w[i - 1].len))) continue;
            double d = fabs(i - target);
            if (best < 0 || d < best_d) { best = i; best_d = d; }
        }
        if (best < 0) break;
        tried[best] = 1;
        int s = best, e = s;   /* e: the sentence's last word */
        while (e < nw - 1 && !ends_sentence(text + w[e].at, w[e].len)) e++;
        int rest = e - s + 1 - TEXT_QA_QUOTE;
        if (rest < TEXT_QA_MIN) continue;
        int long_word = 0;   /* a quote of a URL or a rule line: not a sentence to quote */
        for (int i = s; i < s + TEXT_QA_QUOTE; i++) long_word |= w[i].len > 60;
        if (long_word) continue;
        int seen = 0;
        for (int j = 0; j + TEXT_QA_QUOTE <= nw && seen < 2; j++) seen += same_words(text, w, s, j, TEXT_QA_QUOTE);
        if (seen != 1) continue;
        join_words(q->quote, sizeof q->quote, text, w, s, TEXT_QA_QUOTE);
        join_words(q->truth, sizeof q->truth, text, w, s + TEXT_QA_QUOTE, rest < TEXT_QA_MAX ? rest : TEXT_QA_MAX);
        q->word = s;
        free(tried);
        free(w);
        return 0;
    }
    free(tried);
    free(w);
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * -m task -task summary|docqa|dialogue.
 * ------------------------------------------------------------------------------------------------------------- */

/* The engine's count: the tokenizer's, plain text, no BOS (a slice sits inside the prompt). */
static int engine_count(const char *text, size_t n, void *ctx) {
    const Model *m = ctx;
    int *ids;
    size_t k;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)text, n, 0, &ids, &k, err, sizeof err))
        fatal("tokenizer: %s", err);
    free(ids);
    return (int)k;
}

/* The user's first message: the slice, a blank line, the instruction or question. */
static void first_message(Line *u, TextKind kind, const char *slice, size_t n, const TextQA *qa) {
    memset(u, 0, sizeof *u);
    line_printf(u, "%.*s\n\n", (int)n, slice);
    if (kind == TEXT_SUMMARY) line_printf(u, "Summarize the text above in a few sentences.");
    else if (kind == TEXT_DOCQA) line_printf(u, "In the text above, which words come right after \"%s\"? Answer with "
                                             "the rest of that sentence.", qa->quote);
    else line_printf(u, "%s", TEXT_DIALOGUE_TURNS[0]);
}

/* A user turn as ids: the chat template around it (first: with the system turn and BOS per the template; a later
 * one: with the close of the answer before it), or without a template (first turn only), BOS per the model, the
 * text and a newline. *stop: the id that ends the assistant's turn, or -1. */
static void turn_ids(const Model *m, const Options *o, const char *user, int first, int **ids, size_t *n, int *stop) {
    Line t;
    int bos;
    char err[256];
    if (chat_prompt_text(&t, &bos, stop, m, o->system, user, first) == 0) {
        int rc = tokenizer_encode_special(&m->tokenizer, (const unsigned char *)t.s, t.n, bos, ids, n, err, sizeof err);
        line_free(&t);
        if (rc) fatal("tokenizer: %s", err);
        return;
    }
    *stop = -1;
    Line p = {0};
    line_printf(&p, "%s\n", user);
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)p.s, p.n, m->tokenizer.add_bos, ids, n, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    line_free(&p);
}

static int turn_tokens(const Model *m, const Options *o, const char *user, int first) {
    int *ids, stop;
    size_t n;
    turn_ids(m, o, user, first, &ids, &n, &stop);
    free(ids);
    return (int)n;
}

/* One item: its slice, docqa's quote, and the prompt's ids. */
typedef struct {
    TextSlice sl;
    TextQA qa;
    int *ids;
    size_t n;
    int stop;
} TextItem;

/* The tokens a cell's prompts take besides the slice: the first turn's template and instruction (docqa: with a
 * quote of the longest kind), dialogue's later turns, and every answer. */
static int cell_overhead(const Model *m, const Options *o, TextKind kind, int max_new) {
    TextQA qa;
    memset(&qa, 0, sizeof qa);
    for (int i = 0; i < TEXT_QA_QUOTE; i++) strcat(qa.quote, i ? " xxxxxxxxxxxxxxxx" : "xxxxxxxxxxxxxxxx");
    Line u;
    first_message(&u, kind, "", 0, &qa);
    int t = turn_tokens(m, o, u.s, 1) + max_new;
    line_free(&u);
    if (kind == TEXT_DIALOGUE)
        for (int k = 1; k < TEXT_TURNS; k++) t += turn_tokens(m, o, TEXT_DIALOGUE_TURNS[k], 0) + max_new;
    return t + 4;   /* a token or two where the slice meets the instruction, with room */
}

/* Draw item `seed` whose prompt fits `length` with its answers; docqa's quote at `depth`. 0, or -1. */
static int item_make(TextItem *it, const Model *m, const Options *o, const TextSet *set, TextKind kind, int length,
                     int overhead, double depth, uint64_t seed) {
    memset(it, 0, sizeof *it);
    uint64_t rng = seed;
    for (int t = 0; t < SLICE_TRIES; t++) {
        if (text_draw_slice(&it->sl, set, length - overhead, splitmix64(&rng), engine_count, (void *)m)) return -1;
        const TextDoc *d = &set->docs[it->sl.doc];
        if (kind == TEXT_DOCQA && text_qa(&it->qa, d->data + it->sl.start, it->sl.end - it->sl.start, depth)) continue;
        Line u;
        first_message(&u, kind, d->data + it->sl.start, it->sl.end - it->sl.start, &it->qa);
        turn_ids(m, o, u.s, 1, &it->ids, &it->n, &it->stop);
        line_free(&u);
        return 0;
    }
    return -1;
}

typedef struct { double f1_truth, rouge_truth, f1_full, rouge_full; int same, n; } TextCell;

static void cell_print(const char *label, const TextCell *c, int truth) {
    fprintf(stderr, "%12s", label);
    if (!c->n) { fprintf(stderr, " %8s\n", "-"); return; }
    if (truth) fprintf(stderr, " %8.3f %8.3f", c->f1_truth / c->n, c->rouge_truth / c->n);
    fprintf(stderr, " %8.3f %8.3f %8.3f %6d\n", c->f1_full / c->n, c->rouge_full / c->n, (double)c->same / c->n, c->n);
}

int run_task_text(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("-m task needs a model with a tokenizer");
    TextKind kind = (TextKind)text_task_parse(o->task);
    int dialogue = kind == TEXT_DIALOGUE, docqa = kind == TEXT_DOCQA;
    if (!docqa && o->n_depths) fatal("-task %s has no depth (the text is the whole context): drop -depths; docqa "
                                     "takes one", text_task_name(kind));
    if (o->questions) fatal("-task %s takes no -questions (dialogue asks %d turns of its own)", text_task_name(kind),
                            TEXT_TURNS);
    if (dialogue) {
        Line t;
        int bos, stop;
        if (chat_prompt_text(&t, &bos, &stop, m, o->system, "x", 1)) fatal("-task dialogue needs a model with a chat "
                                                                          "template (its 8 turns are a chat)");
        line_free(&t);
    }
    int ctx = run_context(m, o), chunk = o->chunk ? o->chunk : PREFILL_CHUNK, items = o->items ? o->items : 2;
    if (o->steps_set && o->steps == 0) fatal("-m task -n 0 leaves no token to answer with: give the answer's length "
                                             "(default %d for %s)", text_answer_tokens(kind), text_task_name(kind));
    int max_new = o->steps_set ? o->steps : text_answer_tokens(kind);
    int turns = dialogue ? TEXT_TURNS : 1;
    int lens[MAX_PASSKEY_CELLS], n_lens = task_lengths(o, ctx, max_new, lens);
    for (int li = 0; li < n_lens; li++)
        if (lens[li] <= max_new * turns)
            fatal("-lengths: %d tokens leaves no room for a document beside dialogue's %d answers of %d tokens (-n, "
                  "per turn): %d tokens", lens[li], turns, max_new, max_new * turns);
    static const double default_depths[] = {0.0, 0.25, 0.5, 0.75, 1.0};
    double no_depth = NAN;
    const double *depths = !docqa ? &no_depth : o->n_depths ? o->depths : default_depths;
    int n_depths = !docqa ? 1 : o->n_depths ? o->n_depths : 5;
    char err[1024];
    TextSet set;
    if (text_load(&set, o->docs, o->n_docs, text_root(), err, sizeof err)) fatal("-task %s: %s", text_task_name(kind),
                                                                                err);
    if (set.n_skipped) run_note("-task %s: %d of %d pinned texts skipped under '%s': %s", text_task_name(kind),
                                set.n_skipped, TEXT_N_PINS, set.root, set.skipped);
    int overhead = cell_overhead(m, o, kind, max_new);
    uint64_t seed = o->seed_set ? o->seed : 1;
    for (int li = 0; li < n_lens; li++) {   /* every length has an item (said before any work) */
        TextItem it;
        int room = lens[li] - overhead;
        if (room < MIN_ROOM)
            fatal("-lengths: %d tokens is too short for -task %s: the prompt's template, %s and answers take %d tokens "
                  "of it, leaving %d for the text (at least %d)", lens[li], text_task_name(kind),
                  dialogue ? "the 8 turns" : "the instruction", overhead, room, MIN_ROOM);
        if (item_make(&it, m, o, &set, kind, lens[li], overhead, docqa ? depths[0] : 0, splitmix64(&(uint64_t){seed})))
            fatal("-lengths: %d tokens: no slice of whole paragraphs %s takes %d to %d tokens (the prompt's template, "
                  "%s and answers take %d of the length)", lens[li], set.root[0] ? "of the pinned texts" : "of -docs",
                  room - room / 4, room, dialogue ? "the 8 turns" : "the instruction", overhead);
        free(it.ids);
    }
    /* full first, as the reference: the -kv full given, or one added */
    const char *specs[MAX_POLICIES + 1];
    const int *caps[MAX_POLICIES + 1];
    int full_given, n_pol = task_reference_policies(o, text_task_name(kind), specs, caps, &full_given);
    Sha256 text_sha;
    sha_init(&text_sha);
    for (int i = 0; i < set.n; i++) sha_update(&text_sha, set.docs[i].data, set.docs[i].size);
    TaskJob job;
    task_job_open(&job, m, o, ctx, &text_sha, seed);   /* every -kv spec checked first */
    Line ln = {0};
    fprintf(stderr, "task %s: %d texts (%s, %d skipped), lengths", text_task_name(kind), set.n,
            set.root[0] ? set.root : "-docs", set.n_skipped);
    for (int li = 0; li < n_lens; li++) fprintf(stderr, " %d", lens[li]);
    if (docqa) {
        fprintf(stderr, " tokens, depths");
        for (int di = 0; di < n_depths; di++) fprintf(stderr, " %g", depths[di]);
    } else fprintf(stderr, " tokens");
    fprintf(stderr, ", %d items per cell, %d answer tokens%s, seed %llu; scores: token F1 and ROUGE-L%s against full's "
            "answer (same: identical)\n", items, max_new, dialogue ? " per turn, 8 turns" : "",
            (unsigned long long)seed, docqa ? " against the document's words (truth) and" : "");
    int n_cells = n_lens * n_depths, n_items = n_cells * items;
    char **ref = calloc((size_t)n_items * turns, sizeof *ref);   /* full's answers, per item and turn */
    TextCell *cells = calloc((size_t)n_cells, sizeof *cells), per_turn[TEXT_TURNS], *totals =
        calloc((size_t)n_pol, sizeof *totals);
    if (!ref || !cells || !totals) fatal("out of memory");
    long total_tokens = 0, done_tokens = 0;
    for (int li = 0; li < n_lens; li++) total_tokens += (long)lens[li] * n_depths * items * n_pol;
    int stopped = 0;
    double t_job = now_s();
    char answer[8192];
    for (int k = 0; k < n_pol && !stopped; k++) {
        uint64_t rng = seed;   /* every policy is asked the same items */
        PolicyRun r;
        policy_run_init(&r, m, o, specs[k], ctx, 0, chunk, caps[k]);
        if (o->kvlog) kvlog_attach(&r.kvlog, &job.kvlog, m, &r.asked, &r.cache);
        memset(cells, 0, (size_t)n_cells * sizeof *cells);
        memset(per_turn, 0, sizeof per_turn);
        double t_policy = now_s();
        for (int li = 0; li < n_lens && !stopped; li++)
            for (int di = 0; di < n_depths && !stopped; di++)
                for (int rep = 0; rep < items && !stopped; rep++) {
                    uint64_t item_seed = splitmix64(&rng);
                    TextItem it;
                    if (item_make(&it, m, o, &set, kind, lens[li], overhead, docqa ? depths[di] : 0, item_seed))
                        fatal("-task %s: no item at length %d (seed %llu)", text_task_name(kind), lens[li],
                              (unsigned long long)item_seed);
                    const TextDoc *d = &set.docs[it.sl.doc];
                    int slot = (li * n_depths + di) * items + rep;
                    kv_cache_reset(&r.cache);
                    kv_set_prompt_len(&r.cache, (int)it.n);
                    r.asked.n = 0;
                    int pos = 0, failed = 0;
                    for (int turn = 0; turn < turns && !stopped; turn++) {
                        int *ids = it.ids, stop = it.stop;
                        size_t n = it.n;
                        if (turn > 0) turn_ids(m, o, TEXT_DIALOGUE_TURNS[turn], 0, &ids, &n, &stop);
                        int before = pos, rc = failed;
                        answer[0] = 0;
                        if (!rc) {
                            for (size_t i = 0; i < n; i++) ids_push(&r.asked, ids[i]);
                            rc = prefill(m, &r, ids, n, &pos, chunk);
                            if (!rc) rc = eval_answer(m, &r, &pos, max_new, stop, answer, sizeof answer);
                        }
                        if (turn > 0) free(ids);
                        if (rc == PK_STOPPED) { stopped = 1; break; }
                        if (rc == PK_CACHE_FULL) failed = rc;   /* the chat cannot go on: later turns answer nothing */
                        note_bytes(&r);
                        size_t na = strlen(answer);
                        char **refp = &ref[slot * turns + turn];
                        if (k == 0) {
                            *refp = malloc(na + 1);
                            if (!*refp) fatal("out of memory");
                            memcpy(*refp, answer, na + 1);
                        }
                        size_t nr = strlen(*refp), nt = strlen(it.qa.truth);
                        TextCell one = {0};
                        if (docqa) {
                            one.f1_truth = text_f1(answer, na, it.qa.truth, nt);
                            one.rouge_truth = text_rouge_l(answer, na, it.qa.truth, nt);
                        }
                        one.f1_full = text_f1(answer, na, *refp, nr);
                        one.rouge_full = text_rouge_l(answer, na, *refp, nr);
                        one.same = text_same(answer, na, *refp, nr);
                        TextCell *cs[3] = {&cells[li * n_depths + di], &per_turn[turn], &totals[k]};
                        for (int c = 0; c < 3; c++) {
                            cs[c]->f1_truth += one.f1_truth;
                            cs[c]->rouge_truth += one.rouge_truth;
                            cs[c]->f1_full += one.f1_full;
                            cs[c]->rouge_full += one.rouge_full;
                            cs[c]->same += one.same;
                            cs[c]->n++;
                        }
                        if (job.out.fd < 0) continue;
                        line_printf(&ln, "{\"mode\":\"task\",\"task\":\"%s\",\"family\":\"natural\",\"variant\":null,"
                                    "\"kv\":\"", text_task_name(kind));
                        line_json_str(&ln, r.cache.spec.text);
                        line_printf(&ln, "\",\"budget\":%d,\"reference\":%s,\"length\":%d,", r.cache.policy.budget,
                                    k == 0 ? "true" : "false", lens[li]);
                        if (docqa) line_printf(&ln, "\"depth\":%g,", depths[di]); else line_printf(&ln, "\"depth\":null,");
                        line_printf(&ln, "\"item\":%d,\"item_seed\":%llu,\"turn\":", rep, (unsigned long long)item_seed);
                        if (dialogue) line_printf(&ln, "%d", turn); else line_printf(&ln, "null");
                        line_printf(&ln, ",\"doc\":\"");
                        line_json_str(&ln, d->name);
                        line_printf(&ln, "\",\"doc_sha256\":\"%s\",\"docs\":%d,\"skipped\":%d,\"slice_start\":%zu,"
                                    "\"slice_end\":%zu,\"slice_tokens\":%d,\"prompt_tokens\":%zu,\"answer_tokens\":%d,"
                                    "\"question\":\"", d->sha256, set.n, set.n_skipped, it.sl.start, it.sl.end,
                                    it.sl.tokens, n, rc ? 0 : pos - before - (int)n);
                        if (docqa) line_json_str(&ln, it.qa.quote);
                        else line_json_str(&ln, dialogue ? TEXT_DIALOGUE_TURNS[turn] : "summarize");
                        line_printf(&ln, "\",\"truth\":");
                        if (docqa) { line_printf(&ln, "\""); line_json_str(&ln, it.qa.truth); line_printf(&ln, "\""); }
                        else line_printf(&ln, "null");
                        line_printf(&ln, ",\"answer\":\"");
                        line_json_str(&ln, answer);
                        line_printf(&ln, "\",\"full_answer\":\"");
                        line_json_str(&ln, *refp);
                        KVBytes bytes = kv_bytes(&r.cache);
                        line_printf(&ln, "\",\"cache_full\":%s,", rc == PK_CACHE_FULL ? "true" : "false");
                        if (docqa) line_printf(&ln, "\"f1_truth\":%.6g,\"rouge_l_truth\":%.6g,", one.f1_truth,
                                               one.rouge_truth);
                        line_printf(&ln, "\"f1_full\":%.6g,\"rouge_l_full\":%.6g,\"same_full\":%d,\"kv_live_bytes\":%zu,"
                                    "\"kv_peak_live_bytes\":%zu,\"kv_alloc_bytes\":%zu,", one.f1_full, one.rouge_full,
                                    one.same, bytes.total_live, bytes.peak_live, bytes.total_alloc);
                        json_provenance_end(&ln, &job.pv);
                        outfile_line(&job.out, &ln);
                    }
                    free(it.ids);
                    if (stopped) break;
                    done_tokens += lens[li];
                    progress(t_job, done_tokens, total_tokens, "task text");
                }
        fprintf(stderr, "\n%s%s, %s by length%s:\n", r.cache.spec.text, k == 0 ? " (reference)" : "",
                text_task_name(kind), docqa ? " and depth" : "");
        if (docqa) fprintf(stderr, "%12s %8s %8s %8s %8s %8s %6s\n", "length@depth", "F1truth", "RLtruth", "F1full",
                           "RLfull", "same", "items");
        else fprintf(stderr, "%12s %8s %8s %8s %6s\n", "length", "F1full", "RLfull", "same", "answers");
        for (int li = 0; li < n_lens; li++)
            for (int di = 0; di < n_depths; di++) {
                char label[32];
                if (docqa) snprintf(label, sizeof label, "%d@%g", lens[li], depths[di]);
                else snprintf(label, sizeof label, "%d", lens[li]);
                cell_print(label, &cells[li * n_depths + di], docqa);
            }
        if (dialogue) {
            fprintf(stderr, "per turn:\n");
            for (int t = 0; t < TEXT_TURNS; t++) {
                char label[32];
                snprintf(label, sizeof label, "turn %d", t + 1);
                cell_print(label, &per_turn[t], 0);
            }
        }
        const TextCell *c = &totals[k];
        if (c->n) {
            fprintf(stderr, "%s, %s: F1 vs full %.3f, ROUGE-L vs full %.3f, same %.3f", r.cache.spec.text,
                    text_task_name(kind), c->f1_full / c->n, c->rouge_full / c->n, (double)c->same / c->n);
            if (docqa) fprintf(stderr, ", F1 vs truth %.3f", c->f1_truth / c->n);
            fprintf(stderr, ", %d answers, peak KV %.2f MiB, %.1f s%s\n", c->n, r.peak.peak_live / 1048576.0,
                    now_s() - t_policy, stopped ? " (stopped early)" : "");
        }
        policy_run_free(&r);
    }
    fprintf(stderr, "\n%s: mean scores per policy (against full's answers%s)\n%-28s %8s %8s %8s%s %7s\n",
            text_task_name(kind), docqa ? "; truth: the document's words" : "", "kv", "F1full", "RLfull", "same",
            docqa ? "  F1truth  RLtruth" : "", "answers");
    for (int k = 0; k < n_pol; k++) {
        const TextCell *c = &totals[k];
        if (!c->n) continue;
        fprintf(stderr, "%-28s %8.3f %8.3f %8.3f", specs[k], c->f1_full / c->n, c->rouge_full / c->n,
                (double)c->same / c->n);
        if (docqa) fprintf(stderr, " %8.3f %8.3f", c->f1_truth / c->n, c->rouge_truth / c->n);
        fprintf(stderr, " %7d%s\n", c->n, k == 0 && !full_given ? " (reference, not asked with -kv)" : "");
    }
    if (stopped) fprintf(stderr, "task %s: stopped by %s: the item being asked was dropped; every answer above is "
                         "recorded\n", text_task_name(kind), run_signal_name(run_signal));
    for (int i = 0; i < n_items * turns; i++) free(ref[i]);
    free(ref);
    free(cells);
    free(totals);
    text_set_free(&set);
    line_free(&ln);
    task_job_close(&job);
    return stopped ? 128 + run_signal : 0;
}
