/* test_task_text.c: the natural tasks' pure parts (task_text.h), no model needed:
 *   - token F1 and ROUGE-L on scripted answers, each figure worked out by hand here (in the comments): a right answer
 *     scores 1, a wrong or empty one 0, a partial one its fraction; SQuAD's normalization (case, punctuation,
 *     articles); order matters to ROUGE-L and not to F1; repeated words count once per match; Lin's own example;
 *   - the pinned licence texts load with the digest sha256sum (coreutils, not kvlab) gives for each file; a root
 *     that does not exist, and one holding only an altered copy, are errors; a root with one good and one altered copy
 *     loads the good one and counts the other as skipped; -docs files load whole, a missing or blank one is an error;
 *   - paragraph starts of a scripted document;
 *   - the slice (a stand-in token count: bytes / 4 + 1): deterministic per seed, varies with it, starts at a paragraph
 *     start, ends at a paragraph's end, takes at most room tokens and at least room - room / 4, and the next paragraph
 *     would not fit;
 *   - docqa's quote: on scripted text, the sentence nearest the depth, a sentence whose quote repeats is passed over,
 *     the truth runs to the sentence's end; on real licence slices at five depths and several seeds, the quote
 *     occurs exactly once in the slice (whole words, whitespace collapsed) and the truth follows it there.
 */
#include "task_text.h"
#include "tests/check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int bytes_count(const char *data, size_t n, void *ctx) { (void)data; (void)ctx; return (int)(n / 4) + 1; }

static double f1(const char *a, const char *b) { return text_f1(a, strlen(a), b, strlen(b)); }
static double rl(const char *a, const char *b) { return text_rouge_l(a, strlen(a), b, strlen(b)); }

static int coreutils_sha(const char *path, char *hex) {
    char cmd[1300];
    snprintf(cmd, sizeof cmd, "sha256sum '%s' 2>/dev/null", path);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    int ok = fscanf(p, "%64s", hex) == 1;
    pclose(p);
    return ok && strlen(hex) == 64 ? 0 : -1;
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    fputs(text, f);
    fclose(f);
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

/* " w1 w2 ... " : the text's words joined by single spaces, with a space at each end (malloc'd) */
static char *collapse(const char *t, size_t n) {
    char *o = malloc(n + 3);
    size_t k = 0;
    o[k++] = ' ';
    for (size_t i = 0; i < n; i++) {
        if (is_ws(t[i])) { if (o[k - 1] != ' ') o[k++] = ' '; }
        else o[k++] = t[i];
    }
    if (o[k - 1] != ' ') o[k++] = ' ';
    o[k] = 0;
    return o;
}

static int count_of(const char *hay, const char *needle) {
    int c = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p++) c++;
    return c;
}

static void test_scores(void) {
    /* normalization: case, punctuation and the articles go: [cat sat on mat] both */
    CHECK(f1("The cat sat on the mat.", "the cat sat on a mat") == 1 && rl("The cat sat on the mat.", "cat sat on mat") == 1,
          "F1 and ROUGE-L: 1 for the same words after SQuAD's normalization (case, punctuation, a/an/the)");
    CHECK(f1("dont email", "don't e-mail") == 1, "punctuation inside a word is dropped, not a split: don't = dont");
    /* partial: [cat sat] vs [cat sat on mat]: common 2, P 1, R 1/2: F1 = 2/3; LCS 2: the same */
    CHECK(fabs(f1("cat sat", "the cat sat on the mat") - 2.0 / 3) < 1e-12 &&
          fabs(rl("cat sat", "the cat sat on the mat") - 2.0 / 3) < 1e-12, "a partial answer: F1 = ROUGE-L = 2/3 (%.6f, %.6f)",
          f1("cat sat", "the cat sat on the mat"), rl("cat sat", "the cat sat on the mat"));
    /* order: [mat on sat cat] vs [cat sat on mat]: F1 1, LCS 1: P = R = 1/4 */
    CHECK(f1("mat on sat cat", "cat sat on mat") == 1 && fabs(rl("mat on sat cat", "cat sat on mat") - 0.25) < 1e-12,
          "order: F1 1 for the words reversed, ROUGE-L 1/4 (%.6f)", rl("mat on sat cat", "cat sat on mat"));
    /* multiset: [dog dog dog] vs [dog cat]: 1 in common, P 1/3, R 1/2: 2/5 */
    CHECK(fabs(f1("dog dog dog", "dog cat") - 0.4) < 1e-12 && fabs(rl("dog dog dog", "dog cat") - 0.4) < 1e-12,
          "a repeated word matches once: F1 = ROUGE-L = 2/5 (%.6f, %.6f)", f1("dog dog dog", "dog cat"),
          rl("dog dog dog", "dog cat"));
    /* Lin (2004), section 3.1: reference "police killed the gunman"; S1 "police kill the gunman" has LCS 2 of 3
     * (after the article goes), S2 "the gunman kill police" LCS 1 */
    CHECK(fabs(rl("police kill the gunman", "police killed the gunman") - 2.0 / 3) < 1e-12 &&
          fabs(rl("the gunman kill police", "police killed the gunman") - 1.0 / 3) < 1e-12 &&
          fabs(f1("the gunman kill police", "police killed the gunman") - 2.0 / 3) < 1e-12,
          "Lin's example: ROUGE-L S1 2/3, S2 1/3, F1 of S2 2/3 (%.6f %.6f)",
          rl("police kill the gunman", "police killed the gunman"), rl("the gunman kill police", "police killed the gunman"));
    CHECK(f1("a horse", "the cat") == 0 && rl("a horse", "the cat") == 0, "a wrong answer scores 0");
    CHECK(f1("", "the cat") == 0 && rl("", "the cat") == 0 && f1("cat", "") == 0, "an empty answer scores 0 (and "
          "against an empty reference)");
    CHECK(f1("  ", "") == 1 && rl("The. ", "a") == 1, "two answers with no words after normalization: 1");
    CHECK(text_same(" cat sat\n", 9, "cat sat", 7) && !text_same("cat  sat", 8, "cat sat", 7) && !text_same("", 0, "x", 1),
          "same: equal once trimmed; inner whitespace counts");
}

static void test_docs(void) {
    char err[1024];
    TextSet s;
    const char *root = "/usr/share/common-licenses";
    if (text_load(&s, NULL, 0, root, err, sizeof err)) {
        SKIP("the pinned licence texts are not here: %s", err);
    } else {
        int ok = s.n > 0;
        for (int i = 0; i < s.n; i++) {
            char path[1200], hex[65];
            snprintf(path, sizeof path, "%s/%s", root, s.docs[i].name);
            ok &= coreutils_sha(path, hex) == 0 && !strcmp(hex, s.docs[i].sha256) && s.docs[i].n_paras > 0;
        }
        CHECK(ok, "%d pinned licence texts loaded (%d skipped), each with sha256sum's digest", s.n, s.n_skipped);
        text_set_free(&s);
    }
    CHECK(text_load(&s, NULL, 0, "/nonexistent-kvlab", err, sizeof err) == -1 && strstr(err, "/nonexistent-kvlab"),
          "a root that does not exist: %s", err);
    const char *tmp = "tests/tmp/task_text_c";
    mkdir("tests/tmp", 0755);
    mkdir(tmp, 0755);
    char p1[256], p2[256];
    snprintf(p1, sizeof p1, "%s/BSD", tmp);
    snprintf(p2, sizeof p2, "%s/MPL-2.0", tmp);
    write_file(p2, "not the MPL\n");
    unlink(p1);
    CHECK(text_load(&s, NULL, 0, tmp, err, sizeof err) == -1 && strstr(err, "MPL-2.0 (sha256 differs)"),
          "a root holding only an altered copy: %s", err);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "cp %s/BSD %s/ 2>/dev/null", root, tmp);
    if (system(cmd) == 0 && text_load(&s, NULL, 0, tmp, err, sizeof err) == 0) {
        CHECK(s.n == 1 && !strcmp(s.docs[0].name, "BSD") && strstr(s.skipped, "MPL-2.0 (sha256 differs)") &&
              strstr(s.skipped, "GPL-3 (missing)") && s.n_skipped == 13, "one good copy loads, %d skipped: %s",
              s.n_skipped, s.skipped);
        text_set_free(&s);
    } else SKIP("no /usr/share/common-licenses/BSD to copy");

    /* -docs: read whole; paragraph starts */
    snprintf(p1, sizeof p1, "%s/doc.txt", tmp);
    write_file(p1, "a\nb\n\n\nc\n  \nd");   /* paragraphs at 0 (a, b), 6 (c), 11 (d) */
    const char *files[2] = {p1, p2};
    if (text_load(&s, files, 1, "", err, sizeof err) == 0) {
        CHECK(s.n == 1 && s.docs[0].size == 12 && s.docs[0].n_paras == 3 && s.docs[0].paras[0] == 0 &&
              s.docs[0].paras[1] == 6 && s.docs[0].paras[2] == 11, "-docs: read whole, paragraphs at 0, 6, 11 (%d)",
              s.docs[0].n_paras);
        text_set_free(&s);
    } else CHECK(0, "-docs doc.txt loads: %s", err);
    files[1] = "tests/tmp/task_text_c/missing.txt";
    CHECK(text_load(&s, files, 2, "", err, sizeof err) == -1 && strstr(err, "missing.txt"), "-docs naming a missing "
          "file: %s", err);
    write_file(p2, " \n\t\n");
    files[0] = p2;
    CHECK(text_load(&s, files, 1, "", err, sizeof err) == -1 && strstr(err, "no text"), "-docs naming a blank file: "
          "%s", err);
}

/* a scripted document: 200 paragraphs of 1 to 6 lines */
static char *scripted_doc(void) {
    size_t cap = 1 << 20, k = 0;
    char *d = malloc(cap);
    uint64_t r = 7;
    for (int p = 0; p < 200; p++) {
        int lines = 1 + (int)(splitmix64(&r) % 6);
        for (int l = 0; l < lines; l++) k += (size_t)sprintf(d + k, "Paragraph %d line %d says something. \n", p, l);
        k += (size_t)sprintf(d + k, "\n");
    }
    d[k] = 0;
    return d;
}

static void test_slice(void) {
    char err[512];
    const char *path = "tests/tmp/task_text_c/scripted.txt";
    char *text = scripted_doc();
    write_file(path, text);
    free(text);
    TextSet s;
    const char *files[1] = {path};
    if (text_load(&s, files, 1, "", err, sizeof err)) { CHECK(0, "scripted document loads: %s", err); return; }
    const TextDoc *d = &s.docs[0];
    int room = 300, ok = 1, distinct = 0;
    size_t first = 0;
    for (uint64_t seed = 1; seed <= 40; seed++) {
        TextSlice a, b;
        if (text_draw_slice(&a, &s, room, seed, bytes_count, NULL) || text_draw_slice(&b, &s, room, seed, bytes_count, NULL)) {
            ok = 0; break;
        }
        ok &= a.start == b.start && a.end == b.end && a.tokens == b.tokens;
        int is_start = 0, next = -1;
        for (int i = 0; i < d->n_paras; i++) {
            if (d->paras[i] == a.start) is_start = 1;
            if (d->paras[i] > a.end && next < 0) next = i;
        }
        ok &= is_start && a.end > a.start && !is_ws(d->data[a.end - 1]) && (a.end == d->size || is_ws(d->data[a.end]));
        ok &= a.tokens == bytes_count(d->data + a.start, a.end - a.start, NULL);
        ok &= a.tokens <= room && a.tokens >= room - room / 4;
        if (next >= 0) {   /* the slice with the next paragraph too would not fit */
            size_t e = next + 1 < d->n_paras ? d->paras[next + 1] : d->size;
            while (is_ws(d->data[e - 1])) e--;
            ok &= bytes_count(d->data + a.start, e - a.start, NULL) > room;
        }
        if (seed == 1) first = a.start; else distinct += a.start != first;
    }
    CHECK(ok, "slices of 40 seeds: the same per seed, start at a paragraph, end at one, take %d - %d tokens, and the "
          "next paragraph would not fit", room - room / 4, room);
    CHECK(distinct > 20, "the slice varies with the seed (%d of 39 start elsewhere than seed 1's)", distinct);
    TextSlice z;
    CHECK(text_draw_slice(&z, &s, 100000, 1, bytes_count, NULL) == -1, "a room longer than the document: no slice");
    text_set_free(&s);
}

static void test_qa(void) {
    TextQA q;
    const char *t = "One two three four five six seven eight nine. Alpha beta gamma delta epsilon zeta eta theta. "
                    "Red green blue cyan magenta yellow black white grey brown.";
    CHECK(text_qa(&q, t, strlen(t), 0) == 0 && !strcmp(q.quote, "One two three four five six") &&
          !strcmp(q.truth, "seven eight nine.") && q.word == 0, "depth 0: the first sentence ('%s' -> '%s')", q.quote,
          q.truth);
    CHECK(text_qa(&q, t, strlen(t), 1) == 0 && !strcmp(q.quote, "Red green blue cyan magenta yellow") &&
          !strcmp(q.truth, "black white grey brown.") && q.word == 17, "depth 1: the last sentence ('%s' -> '%s', word "
          "%d)", q.quote, q.truth, q.word);
    /* words 9..16: 2 words after its quote; depth 1/3 aims at it (word 9): the nearer of the others (17) is taken */
    CHECK(text_qa(&q, t, strlen(t), 1.0 / 3) == 0 && q.word == 17, "a sentence with too few words after its quote is "
          "passed over for the nearest other (word %d)", q.word);
    const char *rep = "Same six words here and there, once more and again. Another sentence with enough words to be "
                      "asked now. Same six words here and there, twice with more words.";
    const char *rep2 = "Same six words here and there, one. Same six words here and there, two.";
    CHECK(text_qa(&q, rep, strlen(rep), 0) == 0 && !strcmp(q.quote, "Another sentence with enough words to"),
          "a quote that occurs twice is passed over for the next sentence ('%s')", q.quote);
    CHECK(text_qa(&q, rep2, strlen(rep2), 0) == -1, "no question when every quote occurs twice");
    char longs[4096];
    size_t k = 0;
    for (int i = 0; i < 40; i++) k += (size_t)sprintf(longs + k, "w%d ", i);
    sprintf(longs + k, "end.");
    CHECK(text_qa(&q, longs, strlen(longs), 0) == 0 && !strncmp(q.truth, "w6 ", 3) &&
          count_of(q.truth, " ") + 1 == TEXT_QA_MAX, "the truth stops at %d words", TEXT_QA_MAX);

    /* real slices: the quote once in the slice, the truth right after it */
    char err[512];
    TextSet s;
    if (text_load(&s, NULL, 0, "/usr/share/common-licenses", err, sizeof err)) { SKIP("no licence texts: %s", err); return; }
    int asked = 0, ok = 1;
    for (uint64_t seed = 1; seed <= 8; seed++)
        for (int di = 0; di <= 4; di++) {
            TextSlice sl;
            if (text_draw_slice(&sl, &s, 400, seed, bytes_count, NULL)) continue;
            const char *x = s.docs[sl.doc].data + sl.start;
            if (text_qa(&q, x, sl.end - sl.start, di / 4.0)) continue;
            char *c = collapse(x, sl.end - sl.start), needle[4096];
            snprintf(needle, sizeof needle, " %s ", q.quote);
            int once = count_of(c, needle) == 1;
            snprintf(needle, sizeof needle, " %s %s ", q.quote, q.truth);
            int follows = strstr(c, needle) != NULL;
            if (!once || !follows) { ok = 0; printf("  seed %llu depth %g: '%s' x%d, truth '%s'%s\n",
                                                    (unsigned long long)seed, di / 4.0, q.quote, count_of(c, needle),
                                                    q.truth, follows ? "" : " not after it"); }
            free(c);
            asked++;
        }
    CHECK(ok && asked >= 30, "%d quotes on licence slices: each occurs once (whole words) and its truth follows it",
          asked);
    text_set_free(&s);
}

int main(void) {
    test_scores();
    test_docs();
    test_slice();
    test_qa();
    CHECK_EXIT();
}
