/* test_task.c: -m task's generators and scorer (task.h), no model needed. Each item's text is parsed here, by the
 * task's definition, independently of the generator's own bookkeeping:
 *   - niah and passkey: every needle sentence found in the text; the asked key's needles give the answer the
 *     question wants; it equals the item's expected answers, each present exactly once in the text; the asked
 *     needle sits after floor(depth * n + 0.5) filler sentences (-m passkey's placement), n of them in all;
 *   - vt: every "VAR X = Y." resolved in text order (each name assigned once, every reference to a name assigned
 *     before): the names holding the asked value are the expected five, the distractor chain holds another value;
 *   - cwe: the numbered list counted: entries 1..n, the expected words the 10 most frequent, each strictly more
 *     frequent than every other word;
 *   - seeded determinism (same seed, same item; another seed, another item; the expected answers do not depend on the
 *     filler count, which the runner shrinks to fit a length);
 *   - the scorer on scripted answers: right 1, wrong 0, empty 0, a digit short 0, partial the stated share;
 *   - a shared context (task_generate_shared): N needles of N keys; question q names key q, whose one needle holds
 *     expected[q]; needle 0 at the depth; the text ends with question 1.
 */
#include "task.h"
#include "tests/check.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char FILLER[] = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

static int count_occ(const char *hay, const char *s, const char *end) {
    int n = 0;
    size_t k = strlen(s);
    for (const char *p = strstr(hay, s); p && (!end || p + k <= end); p = strstr(p + 1, s)) n++;
    return n;
}
static int fillers_before(const char *text, size_t at) { return count_occ(text, FILLER, text + at); }

typedef struct { char key[32], value[32]; size_t at; } Needle;

/* every " One of the special magic numbers for KEY is VALUE." (niah) or " The pass key is VALUE." (passkey) */
static int parse_needles(const char *t, int passkey, Needle *nd, int max) {
    const char *pat = passkey ? " The pass key is " : " One of the special magic numbers for ";
    int n = 0;
    for (const char *p = strstr(t, pat); p && n < max; p = strstr(p + 1, pat)) {
        Needle *x = &nd[n];
        x->at = (size_t)(p - t);
        const char *q = p + strlen(pat);
        if (passkey) {
            if (sscanf(q, "%31[0-9]", x->value) != 1) continue;
            strcpy(x->key, "pass");
        } else if (sscanf(q, "%31[a-z] is %31[0-9].", x->key, x->value) != 2) continue;
        n++;
    }
    return n;
}

static int in_set(char (*set)[16], int n, const char *s) {
    for (int i = 0; i < n; i++) if (!strcmp(set[i], s)) return 1;
    return 0;
}

static void check_niah(TaskKind kind, int n_units, double depth, uint64_t seed, int *bad) {
    TaskItem it;
    char err[256];
    if (task_generate(&it, kind, n_units, depth, seed, err, sizeof err)) { (*bad)++; printf("  %s\n", err); return; }
    const char *t = it.text, *q = t + it.question_at;
    Needle nd[16];
    int passkey = kind == TASK_PASSKEY;
    int nn = parse_needles(t, passkey, nd, 16);
    int want_nn = kind == TASK_NIAH_SINGLE || passkey ? 1 : 4;
    /* the keys asked, read from the question */
    char asked[4][32];
    int n_asked = 0;
    if (passkey) { strcpy(asked[0], "pass"); n_asked = 1; }
    else if (kind == TASK_NIAH_MULTIQUERY)
        n_asked = sscanf(q, " What are all the special magic numbers for %31[a-z], %31[a-z], %31[a-z] and %31[a-z] "
                         "mentioned", asked[0], asked[1], asked[2], asked[3]);
    else n_asked = sscanf(q, kind == TASK_NIAH_MULTIVALUE ? " What are all the special magic numbers for %31[a-z] "
                                                           : " What is the special magic number for %31[a-z] ", asked[0]);
    int want_asked = kind == TASK_NIAH_MULTIQUERY ? 4 : 1;
    /* the answer by the definition: every value of a needle whose key is asked */
    char want[16][16];
    int n_want = 0, first_asked = -1;
    for (int i = 0; i < nn; i++)
        for (int a = 0; a < n_asked; a++)
            if (!strcmp(nd[i].key, asked[a])) {
                snprintf(want[n_want++], 16, "%s", nd[i].value);
                if (first_asked < 0 || nd[i].at < nd[first_asked].at) first_asked = i;
            }
    int ok = nn == want_nn && n_asked == want_asked && n_want == it.n_expected;
    for (int i = 0; ok && i < n_want; i++) ok = in_set(it.expected, it.n_expected, want[i]);
    /* single and multikey: one needle of the asked key (multikey: three of other keys); multivalue: four of one key */
    if (ok && kind == TASK_NIAH_MULTIKEY) {
        int same = 0;
        for (int i = 0; i < nn; i++) same += !strcmp(nd[i].key, asked[0]);
        ok = same == 1;
    }
    for (int i = 0; ok && i < it.n_expected; i++) ok = count_occ(t, it.expected[i], NULL) == (passkey ? 2 : 1);
    /* the needle the depth places: the one generated first, i.e. the one the generator says is at the depth */
    int at = (int)floor(depth * n_units + 0.5);
    int placed = -1;
    for (int i = 0; i < nn; i++) if (nd[i].at == it.needle_at[0]) placed = i;
    ok = ok && placed >= 0 && fillers_before(t, nd[placed].at) == at && count_occ(t, FILLER, NULL) == n_units;
    /* the depth needle is an asked one (multikey: the only one; multivalue, multiquery: the first value) */
    ok = ok && placed >= 0 && in_set(it.expected, it.n_expected, nd[placed].value) &&
         !strcmp(nd[placed].value, it.expected[0]);
    if (!ok) {
        (*bad)++;
        if (*bad <= 3)
            printf("  %s n=%d depth=%g seed=%llu: %d needles (want %d), %d keys asked, %d answers (item %d), depth "
                   "needle after %d fillers (want %d)\n", task_name(kind), n_units, depth, (unsigned long long)seed, nn,
                   want_nn, n_asked, n_want, it.n_expected, placed >= 0 ? fillers_before(t, nd[placed].at) : -1, at);
    }
    task_item_free(&it);
}

static int is_number(const char *s) {
    if (!*s) return 0;
    for (; *s; s++) if (!isdigit((unsigned char)*s)) return 0;
    return 1;
}

static void check_vt(int n_units, double depth, uint64_t seed, int *bad) {
    TaskItem it;
    char err[256];
    if (task_generate(&it, TASK_VT, n_units, depth, seed, err, sizeof err)) { (*bad)++; printf("  %s\n", err); return; }
    const char *t = it.text;
    char name[16][16], val[16][16];
    size_t first_at = 0;
    int n = 0, ok = 1;
    for (const char *p = strstr(t, " VAR "); p && n < 16; p = strstr(p + 1, " VAR ")) {
        char x[16], y[16];
        if (sscanf(p, " VAR %15[A-Z] = %15[A-Z0-9].", x, y) != 2) { ok = 0; break; }
        for (int i = 0; i < n; i++) if (!strcmp(name[i], x)) ok = 0;   /* each name assigned once */
        const char *v = NULL;
        if (is_number(y)) v = y;
        else for (int i = 0; i < n; i++) if (!strcmp(name[i], y)) v = val[i];
        if (!v) ok = 0;   /* a reference to a name not yet assigned: the chain would be broken or ambiguous */
        else {
            snprintf(name[n], 16, "%.15s", x);
            snprintf(val[n], 16, "%.15s", v);
        }
        n++;
    }
    char value[16] = "";
    const char *q = strstr(t + it.question_at, "hold the value ");
    ok = ok && q && sscanf(q, "hold the value %15[0-9]", value) == 1;
    int holders = 0, others = 0;
    char other[16] = "";
    for (int i = 0; ok && i < n; i++) {
        if (!strcmp(val[i], value)) {
            holders++;
            if (!in_set(it.expected, it.n_expected, name[i])) ok = 0;
        } else {
            others++;
            snprintf(other, sizeof other, "%.15s", val[i]);
        }
    }
    /* the chain asked: its value assigned directly first, at the depth */
    for (const char *p = strstr(t, " VAR "); p; p = strstr(p + 1, " VAR ")) {
        char x[16], y[16];
        if (sscanf(p, " VAR %15[A-Z] = %15[0-9].", x, y) == 2 && !strcmp(y, value)) { first_at = (size_t)(p - t); break; }
    }
    int at = (int)floor(depth * n_units + 0.5);
    ok = ok && n == 2 * (TASK_VT_HOPS + 1) && holders == TASK_VT_HOPS + 1 && it.n_expected == TASK_VT_HOPS + 1 &&
         others == TASK_VT_HOPS + 1 && strcmp(other, value) && fillers_before(t, first_at) == at;
    /* each expected name assigned exactly once and referenced at most once (the next hop) */
    for (int i = 0; ok && i < it.n_expected; i++) {
        char asg[32];
        snprintf(asg, sizeof asg, " VAR %s = ", it.expected[i]);
        ok = count_occ(t, asg, NULL) == 1 && count_occ(t, it.expected[i], NULL) <= 2;
    }
    if (!ok) {
        (*bad)++;
        if (*bad <= 3)
            printf("  vt n=%d depth=%g seed=%llu: %d statements, %d hold %s, first at %d fillers (want %d)\n", n_units,
                   depth, (unsigned long long)seed, n, holders, value, fillers_before(t, first_at), at);
    }
    task_item_free(&it);
}

static void check_cwe(int n_units, uint64_t seed, int *bad) {
    TaskItem it;
    char err[256];
    if (task_generate(&it, TASK_CWE, n_units, NAN, seed, err, sizeof err)) { (*bad)++; printf("  %s\n", err); return; }
    /* the list: " 1. w 2. w ..." between the instruction and the question */
    enum { MAXW = 4096 };
    static char words[MAXW][16];
    static int counts[MAXW];
    int n_words = 0, n_entries = 0, ok = 1;
    const char *p = it.text;
    char w[16];
    int num, used;
    p = strstr(p, " 1. ");
    while (p && sscanf(p, " %d. %15[a-z]%n", &num, w, &used) == 2) {
        if (num != n_entries + 1) { ok = 0; break; }
        n_entries++;
        int i = 0;
        while (i < n_words && strcmp(words[i], w)) i++;
        if (i == n_words) { if (n_words == MAXW) { ok = 0; break; } snprintf(words[n_words], 16, "%s", w); counts[n_words++] = 0; }
        counts[i]++;
        p += used;
    }
    int min_top = 1 << 30, max_rest = 0;
    for (int i = 0; i < n_words; i++) {
        if (in_set(it.expected, it.n_expected, words[i])) min_top = counts[i] < min_top ? counts[i] : min_top;
        else max_rest = counts[i] > max_rest ? counts[i] : max_rest;
    }
    int found = 0;
    for (int e = 0; e < it.n_expected; e++)
        for (int i = 0; i < n_words; i++) found += !strcmp(words[i], it.expected[e]);
    ok = ok && n_entries == n_units && it.n_expected == TASK_CWE_TOP && found == TASK_CWE_TOP && min_top > max_rest &&
         max_rest <= TASK_CWE_FREQ_RARE && min_top == task_cwe_freq_common(n_units);
    if (!ok) {
        (*bad)++;
        if (*bad <= 3)
            printf("  cwe n=%d seed=%llu: %d entries, %d distinct, top words found %d, least top count %d, most other "
                   "%d\n", n_units, (unsigned long long)seed, n_entries, n_words, found, min_top, max_rest);
    }
    task_item_free(&it);
}

static int same_item(const TaskItem *a, const TaskItem *b) {
    if (strcmp(a->text, b->text) || strcmp(a->prefix, b->prefix) || a->n_expected != b->n_expected) return 0;
    for (int i = 0; i < a->n_expected; i++) if (strcmp(a->expected[i], b->expected[i])) return 0;
    return 1;
}
static int same_expected(const TaskItem *a, const TaskItem *b) {
    if (a->n_expected != b->n_expected) return 0;
    for (int i = 0; i < a->n_expected; i++) if (strcmp(a->expected[i], b->expected[i])) return 0;
    return 1;
}

int main(void) {
    static const double depths[] = {0, 0.1, 0.25, 0.5, 0.75, 1};
    static const int sizes[] = {4, 5, 17, 60, 200};
    char err[256];
    for (int k = 0; k < TASK_COUNT; k++) {
        TaskKind kind = (TaskKind)k;
        int bad = 0, items = 0;
        for (uint64_t seed = 1; seed <= 8; seed++)
            for (int si = 0; si < 5; si++)
                for (int di = 0; di < 6; di++) {
                    int n = kind == TASK_CWE ? task_min_units(kind) + sizes[si] * 7 : sizes[si];
                    if (kind == TASK_CWE) { if (di == 0) check_cwe(n, seed * 7919, &bad); else continue; }
                    else if (kind == TASK_VT) check_vt(n, depths[di], seed * 7919, &bad);
                    else check_niah(kind, n, depths[di], seed * 7919, &bad);
                    items++;
                }
        CHECK(bad == 0, "%s: %d items parsed by the definition: the answer is where the definition says, present "
              "once (%d wrong)", task_name(kind), items, bad);
        /* determinism */
        TaskItem a, b, c, d;
        int n = kind == TASK_CWE ? 300 : 40;
        task_generate(&a, kind, n, 0.5, 42, err, sizeof err);
        task_generate(&b, kind, n, 0.5, 42, err, sizeof err);
        task_generate(&c, kind, n, 0.5, 43, err, sizeof err);
        task_generate(&d, kind, n + 37, 0.5, 42, err, sizeof err);
        CHECK(same_item(&a, &b) && !same_item(&a, &c) && !same_expected(&a, &c) && same_expected(&a, &d),
              "%s: seed 42 twice gives one item, seed 43 another (other answers), seed 42 with %d more filler units "
              "the same answers", task_name(kind), 37);
        /* the scorer on scripted answers */
        char right[512] = "", partial[512] = "", upper[512] = "", short_digit[64] = "";
        for (int e = 0; e < a.n_expected; e++) {
            snprintf(right + strlen(right), sizeof right - strlen(right), "%s%s", e ? ", " : " ", a.expected[e]);
            if (e < a.n_expected / 2)
                snprintf(partial + strlen(partial), sizeof partial - strlen(partial), " %s", a.expected[e]);
        }
        for (size_t i = 0; right[i]; i++) upper[i] = (char)toupper((unsigned char)right[i]);
        snprintf(short_digit, sizeof short_digit, " %.*s", (int)strlen(a.expected[0]) - 1, a.expected[0]);
        TaskScore sr = task_score(&a, right), se = task_score(&a, ""), sw = task_score(&a, c.text + c.question_at),
                  sp = task_score(&a, partial), su = task_score(&a, upper), ss = task_score(&a, short_digit),
                  so = task_score(&a, c.expected[0]);
        double share = (double)(a.n_expected / 2) / a.n_expected;
        CHECK(sr.score == 1 && sr.exact && su.score == 1 && su.exact && se.score == 0 && !se.exact && sw.score == 0 &&
              ss.score == 0 && so.score == 0 && !so.exact &&
              (a.n_expected == 1 ? sp.score == 0 && !sp.exact : sp.score == share && !sp.exact &&
                                                              sp.found == a.n_expected / 2),
              "%s scorer: right %g (upper case %g), empty %g, another item's question %g, another item's answer %g, "
              "a digit/letter short %g, the first %d of %d answers %g (exact %d)", task_name(kind), sr.score, su.score,
              se.score, sw.score, so.score, ss.score, a.n_expected / 2, a.n_expected, sp.score, sp.exact);
        task_item_free(&a);
        task_item_free(&b);
        task_item_free(&c);
        task_item_free(&d);
    }
    /* shared contexts */
    int bad_shared = 0, n_shared = 0;
    for (int nq = 2; nq <= TASK_MAX_NEEDLES; nq += 4)
        for (uint64_t seed = 1; seed <= 10; seed++)
            for (int di = 0; di < 6; di++) {
                TaskItem sh;
                int n = 5 + (int)seed * 11;
                if (task_generate_shared(&sh, n, nq, depths[di], seed, err, sizeof err)) { bad_shared++; continue; }
                n_shared++;
                Needle nd[16];
                int nn = parse_needles(sh.text, 0, nd, 16), ok = nn == nq && sh.n_questions == nq;
                for (int q = 0; ok && q < nq; q++) {
                    char key[32];
                    ok = sscanf(sh.question[q], " What is the special magic number for %31[a-z] ", key) == 1;
                    int holders = 0;
                    for (int i = 0; ok && i < nn; i++)
                        if (!strcmp(nd[i].key, key)) { holders++; ok = !strcmp(nd[i].value, sh.expected[q]); }
                    ok = ok && holders == 1 && count_occ(sh.text, sh.expected[q], NULL) == 1 && strstr(sh.qprefix[q], key);
                }
                int at = (int)floor(depths[di] * n + 0.5);
                ok = ok && fillers_before(sh.text, sh.needle_at[0]) == at && strstr(nd[0].key, "") &&
                     !strcmp(sh.text + sh.question_at, sh.question[0]);
                for (int i = 0; ok && i < nn; i++)
                    if (nd[i].at == sh.needle_at[0]) ok = !strcmp(nd[i].value, sh.expected[0]);
                bad_shared += !ok;
                task_item_free(&sh);
            }
    CHECK(bad_shared == 0 && n_shared == 180, "shared contexts: %d of 2, 6, 10 questions parsed: each question's key "
          "in one needle holding its expected value, needle 0 at the depth, question 1 last (%d wrong)", n_shared,
          bad_shared);
    TaskItem it;
    CHECK(task_generate_shared(&it, 20, 1, 0.5, 1, err, sizeof err) == -1 && strstr(err, "2 to 10 questions"),
          "a shared context of 1 question: -1, '%s'", err);
    /* bad input */
    int r1 = task_generate(&it, TASK_NIAH_SINGLE, 3, 0.5, 1, err, sizeof err);
    CHECK(r1 == -1 && strstr(err, "at least 4"), "niah_single with 3 filler units: -1, '%s'", err);
    int r2 = task_generate(&it, TASK_VT, 10, 1.5, 1, err, sizeof err);
    CHECK(r2 == -1 && strstr(err, "outside [0, 1]"), "vt at depth 1.5: -1, '%s'", err);
    int r3 = task_generate(&it, TASK_CWE, task_min_units(TASK_CWE) - 1, NAN, 1, err, sizeof err);
    CHECK(r3 == -1 && strstr(err, "cwe needs at least"), "cwe below its smallest list: -1, '%s'", err);
    CHECK(task_parse("niah_multikey") == TASK_NIAH_MULTIKEY && task_parse("niah") == -1 && task_parse("") == -1 &&
          !strcmp(task_family(TASK_NIAH_MULTIVALUE), "niah") && !strcmp(task_variant(TASK_NIAH_MULTIVALUE), "multivalue")
          && task_variant(TASK_VT) == NULL,
          "names: niah_multikey parses, niah and the empty name do not; multivalue is niah's variant, vt has none");
    CHECK_EXIT();
}
