/* test_trace.c: the serving trace (trace.h), no model needed. Files are written to a fresh temporary directory
 * (mkdtemp) and removed at the end.
 *   1. JSON lines with every key: the requests as written, comments and blank lines skipped, one document table
 *      (requests on one file share its bytes), relative paths read from the current directory;
 *   2. string escapes: every short escape, \uXXXX to UTF-8, surrogate pairs, lone surrogates as U+FFFD, raw invalid
 *      UTF-8 passed through;
 *   3. every error: unknown keys, wrong types, truncated and invalid JSON, text after the object, arrival going
 *      backwards, no text, unreadable documents; each message names FILE:LINE and the key; nothing is left to free;
 *   4. generated traces: the same seed gives the same trace, another seed another; sequential cycles; hotspot and
 *      random counts within 4 binomial SDs of Zipf(1) and uniform; lengths in [min, max]; arrivals non-decreasing
 *      with the mean gap asked; the draws for documents, lengths and arrivals independent of one another;
 *   5. ShareGPT: a small file with every kind of conversation, the skips counted, the replies' bytes, the cap on
 *      requests, errors with FILE:LINE:COL; seeded arrivals on it.
 */
#include "trace.h"
#include "tests/check.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[256];
static char made[64][320];   /* files written, removed at the end */
static int n_made;

/* dir/name with the given bytes; returns the path (valid until the end). */
static const char *write_file(const char *name, const char *bytes, size_t n) {
    char *path = made[n_made++];
    snprintf(path, sizeof made[0], "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f)) { printf("FAIL cannot write %s\n", path); exit(1); }
    return path;
}
static const char *write_text(const char *name, const char *text) { return write_file(name, text, strlen(text)); }

/* the JSON-lines parser on text, named "t.jsonl" */
static int parse(Trace *t, const char *text, char *err, size_t errlen) {
    return trace_parse_lines(t, text, strlen(text), "t.jsonl", 16, err, errlen);
}

static int trace_is_empty(const Trace *t) { return t->n == 0 && t->req == NULL && t->doc == NULL && t->path == NULL; }

/* ---- 1. good JSON lines ---- */
static void test_lines(const char *doc_a, const char *doc_b) {
    char text[2048], err[512];
    snprintf(text, sizeof text,
             "# a trace: comments and blank lines are skipped\n"
             "{\"arrival\": 0, \"system\": \"You are terse.\", \"doc\": \"%s\", \"prompt\": \"Q1?\", \"n\": 7, "
             "\"doc_tokens\": 100}\n"
             "\n"
             "   \t\n"
             "   # an indented comment\n"
             "{\"docs\": [\"%s\", \"%s\"], \"turns\": [\"first\", \"second\"], \"arrival\": 3}\r\n"
             "  {\"arrival\": 3, \"prompt\": \"only a prompt\"}  ", doc_a, doc_a, doc_b);
    Trace t;
    int rc = parse(&t, text, err, sizeof err);
    CHECK(rc == 0 && t.n == 3 && t.n_doc == 2 && t.source == TRACE_FILE, "three requests on two documents: rc %d, '%s'",
          rc, rc ? err : "");
    if (rc) return;
    const TraceReq *r0 = &t.req[0], *r1 = &t.req[1], *r2 = &t.req[2];
    CHECK(r0->id == 0 && r1->id == 1 && r2->id == 2 && r0->line == 2 && r1->line == 6 && r2->line == 7,
          "ids 0, 1, 2 from lines 2, 6, 7 (got lines %d, %d, %d)", r0->line, r1->line, r2->line);
    CHECK(r0->arrival == 0 && r1->arrival == 3 && r2->arrival == 3, "arrivals 0, 3, 3 (equal arrivals allowed)");
    CHECK(r0->system && !strcmp(r0->system, "You are terse.") && !r1->system && !r2->system,
          "system on the first request only");
    CHECK(r0->n_docs == 1 && r1->n_docs == 2 && r2->n_docs == 0 && !strcmp(r0->docs[0], "alpha text\n") &&
          !strcmp(r1->docs[1], "beta text") && r0->docs[0] == r1->docs[0] && r0->doc_ids[0] == 0 &&
          r1->doc_ids[1] == 1 && !strcmp(t.doc[1].path, doc_b) && t.doc[0].bytes == 11,
          "documents read once: the first request's document is the second's first (same bytes, id 0)");
    CHECK(r0->n_turns == 1 && !strcmp(r0->turns[0], "Q1?") && r1->n_turns == 2 && !strcmp(r1->turns[0], "first") &&
          !strcmp(r1->turns[1], "second") && r2->n_turns == 1 && !strcmp(r2->turns[0], "only a prompt"),
          "prompt is one turn, turns in order");
    CHECK(r0->n_gen == 7 && r1->n_gen == 16 && r0->doc_tokens == 100 && r1->doc_tokens == 0 && !r0->refs &&
          !r0->ref_bytes && !r0->source_id, "n 7 where given, else the caller's 16; doc_tokens 100, else 0");
    char desc[256];
    trace_describe(&t, desc, sizeof desc);
    CHECK(strstr(desc, "3 requests from t.jsonl") && strstr(desc, "2 documents") && strstr(desc, "arrivals 0..3"),
          "describe: '%s'", desc);
    trace_free(&t);
    CHECK(trace_is_empty(&t), "trace_free leaves an empty trace");

    /* a relative path reads from the current directory; a BOM and no final newline are fine */
    char cwd[1024];
    int ok = getcwd(cwd, sizeof cwd) && chdir(dir) == 0;
    rc = ok ? parse(&t, "\xEF\xBB\xBF{\"doc\": \"a.txt\"}", err, sizeof err) : -1;
    CHECK(ok && rc == 0 && t.n == 1 && !strcmp(t.req[0].docs[0], "alpha text\n") && t.req[0].n_turns == 0,
          "a relative \"doc\" path is read from the current directory, a document alone is a request ('%s')",
          rc ? err : "");
    if (rc == 0) trace_free(&t);
    if (ok && chdir(cwd)) { printf("FAIL cannot return to %s\n", cwd); exit(1); }

    /* trace_load on a file */
    snprintf(text, sizeof text, "{\"prompt\": \"from a file\", \"arrival\": 9}\n");
    const char *path = write_text("file.jsonl", text);
    rc = trace_load(&t, path, 5, err, sizeof err);
    CHECK(rc == 0 && t.n == 1 && t.req[0].arrival == 9 && t.req[0].n_gen == 5 && !strcmp(t.path, path),
          "trace_load reads a file");
    if (rc == 0) trace_free(&t);
    snprintf(text, sizeof text, "%s/no-such.jsonl", dir);
    rc = trace_load(&t, text, 5, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "no-such.jsonl") && strstr(err, "cannot open") && trace_is_empty(&t),
          "a missing trace file: '%s'", err);
}

/* ---- 2. escapes ---- */
static void test_escapes(void) {
    const char *line = "{\"prompt\": \"q\\\"\\\\\\/\\b\\f\\n\\r\\t|\\u00e9\\u00E9|\\u4e2d|\\ud83d\\ude00|\\ud800x|\\udc00y|"
                       "\\ud83d\\u0041\", \"system\": \"raw \xff\xfe\xc3 bytes \xe2\x82\xac\"}";
    const char *want = "q\"\\/\b\f\n\r\t|\xc3\xa9\xc3\xa9|\xe4\xb8\xad|\xf0\x9f\x98\x80|\xef\xbf\xbdx|\xef\xbf\xbdy|"
                       "\xef\xbf\xbd" "A";
    Trace t;
    char err[512];
    int rc = parse(&t, line, err, sizeof err);
    CHECK(rc == 0 && t.n == 1 && !strcmp(t.req[0].turns[0], want),
          "escapes: \\\" \\\\ \\/ \\b \\f \\n \\r \\t, \\u00e9 (either case) -> C3 A9, \\u4e2d -> E4 B8 AD, the pair "
          "\\ud83d\\ude00 -> F0 9F 98 80, lone surrogates -> U+FFFD (a high one followed by \\u0041 keeps the A)");
    CHECK(rc == 0 && !strcmp(t.req[0].system, "raw \xff\xfe\xc3 bytes \xe2\x82\xac"),
          "raw bytes, invalid UTF-8 included, pass through unchanged");
    if (rc == 0) trace_free(&t);
}

/* ---- 3. errors ---- */
typedef struct { const char *line2, *want; } BadLine;

static void test_errors(const char *doc_a) {
    char deep[400];
    int k = 0;
    k += snprintf(deep + k, sizeof deep - k, "{\"turns\": ");
    for (int i = 0; i < 100; i++) deep[k++] = '[';
    deep[k] = 0;
    char missing[400], both_docs[600], dir_doc[400];
    snprintf(missing, sizeof missing, "{\"docs\": [\"%s\", \"%s/missing.txt\"], \"prompt\": \"q\"}", doc_a, dir);
    snprintf(both_docs, sizeof both_docs, "{\"doc\": \"%s\", \"docs\": [\"%s\"]}", doc_a, doc_a);
    snprintf(dir_doc, sizeof dir_doc, "{\"doc\": \"%s\"}", dir);
    char nul_doc[400];
    snprintf(nul_doc, sizeof nul_doc, "{\"doc\": \"%s\"}", write_file("nul.txt", "ab\0cd", 5));
    const BadLine bad[] = {
        {"{\"prompt\": \"x\", \"foo\": 1}", "unknown key \"foo\""},
        {"{\"Prompt\": \"x\"}", "unknown key \"Prompt\""},
        {"{\"prompt\": \"x\", \"prompt\": \"y\"}", "key \"prompt\" given twice"},
        {"{\"prompt\": \"x\", \"arrival\": \"3\"}", "\"arrival\" must be an integer >= 0, not a string"},
        {"{\"prompt\": \"x\", \"arrival\": -1}", "\"arrival\" must be an integer >= 0, not -1"},
        {"{\"prompt\": \"x\", \"arrival\": 2.5}", "\"arrival\" must be an integer >= 0, not 2.5"},
        {"{\"prompt\": \"x\", \"arrival\": 1e2}", "\"arrival\" must be an integer >= 0, not 1e2"},
        {"{\"prompt\": \"x\", \"arrival\": 99999999999999999999}", "\"arrival\" must be an integer"},
        {"{\"prompt\": \"x\", \"n\": 0}", "\"n\" must be an integer >= 1, not 0"},
        {"{\"prompt\": \"x\", \"n\": true}", "\"n\" must be an integer >= 1, not true"},
        {"{\"prompt\": \"x\", \"n\": 3000000000}", "\"n\" is too large: 3000000000"},
        {"{\"prompt\": \"x\", \"doc_tokens\": -5}", "\"doc_tokens\" must be an integer >= 0, not -5"},
        {"{\"prompt\": \"x\", \"doc_tokens\": null}", "\"doc_tokens\" must be an integer >= 0, not null"},
        {"{\"prompt\": \"x\", \"system\": 3}", "\"system\" must be a string, not 3"},
        {"{\"prompt\": [\"x\"]}", "\"prompt\" must be a string, not an array"},
        {"{\"turns\": \"x\"}", "\"turns\" must be an array of strings, not a string"},
        {"{\"turns\": [\"x\", {}]}", "\"turns\"[1] must be a string, not an object"},
        {"{\"docs\": \"a.txt\"}", "\"docs\" must be an array of file paths, not a string"},
        {"{\"docs\": [1], \"prompt\": \"q\"}", "\"docs\"[0] (a file path) must be a string, not 1"},
        {"{\"doc\": false}", "\"doc\" (a file path) must be a string, not false"},
        {"{\"prompt\": \"x\", \"turns\": [\"y\"]}", "give \"prompt\" or \"turns\", not both"},
        {both_docs, "give \"doc\" or \"docs\", not both"},
        {"{\"arrival\": 4}", "a request with no text"},
        {"{\"prompt\": \"\", \"turns\": []}", "give \"prompt\" or \"turns\", not both"},
        {"{\"prompt\": \"\"}", "a request with no text"},
        {"{\"turns\": [], \"system\": \"\"}", "a request with no text"},
        {"{\"prompt\": \"x\", \"arrival\": 1}", "arrival 1 is before the previous request's 2"},
        {missing, "cannot read document '"},
        {dir_doc, "is not a regular file"},
        {nul_doc, "holds a NUL byte (at byte 2)"},
        {"{\"prompt\": \"abc", "byte 12: unterminated string"},
        {"{\"prompt\": \"abc\"", "byte 17: unterminated object"},
        {"{\"prompt\"", "byte 10: unterminated object (expected ':')"},
        {"{\"prompt\": ", "byte 12: unexpected end of input"},
        {"{\"prompt\": \"a\",}", "byte 16: expected a key (a string), found '}'"},
        {"{\"prompt\": \"a\" \"n\": 3}", "byte 16: expected ',' or '}', found '\"'"},
        {"{'prompt': 'a'}", "byte 2: expected a key (a string), found '''"},
        {"{\"prompt\": \"a\"} {}", "byte 17: unexpected text after the request's object"},
        {"{\"prompt\": \"a\"}}", "byte 16: unexpected text after"},
        {"[\"a\"]", "a request is a JSON object"},
        {"\"just a string\"", "a request is a JSON object ({\"prompt\": ...}), not a string"},
        {"{\"prompt\": \"tab\there\"}", "byte 16: raw byte 0x09 in a string"},
        {"{\"prompt\": \"bad \\x escape\"}", "byte 17: unknown escape \\ followed by 'x'"},
        {"{\"prompt\": \"\\u12\"}", "byte 13: \\u must be followed by 4 hex digits"},
        {"{\"prompt\": \"\\u12", "byte 13: truncated \\u escape"},
        {"{\"prompt\": \"a\\u0000b\"}", "\\u0000 in a string"},
        {"{\"prompt\": \"x\", \"n\": 01}", "byte 23: expected ',' or '}', found '1'"},
        {"{\"prompt\": \"x\", \"n\": -}", "a number needs a digit after '-'"},
        {"{\"prompt\": \"x\", \"n\": 1.}", "a number needs a digit after '.'"},
        {"{\"prompt\": \"x\", \"n\": 1e}", "a number needs a digit in its exponent"},
        {"{\"prompt\": \"x\", \"n\": tru}", "unexpected 't' (expected a value)"},
        {"{\"prompt\": \"x\", \"n\": NaN}", "unexpected 'N' (expected a value)"},
        {deep, "nested deeper than 64 levels"},
        {"{\"prompt\": \"x\"\x01}", "byte 15: expected ',' or '}', found byte 0x01"},
    };
    int n_bad = (int)(sizeof bad / sizeof bad[0]);
    for (int i = 0; i < n_bad; i++) {
        char text[1024], err[512];
        snprintf(text, sizeof text, "{\"prompt\": \"fine\", \"arrival\": 2}\n%s\n"
                 "{\"prompt\": \"after\", \"arrival\": 9}\n", bad[i].line2);
        Trace t;
        memset(&t, 0x5a, sizeof t);   /* the parser must not read what the caller left there */
        err[0] = 0;
        int rc = parse(&t, text, err, sizeof err);
        CHECK(rc == -1 && !strncmp(err, "trace t.jsonl:2: ", 17) && strstr(err, bad[i].want) && trace_is_empty(&t),
              "bad line %d, %.60s: -1, '%s'", i, bad[i].line2, err);
        if (rc == 0) trace_free(&t);
    }
    /* a NUL byte inside a line (in memory: the parser takes a length) */
    char err[512];
    Trace t;
    const char nul_line[] = "{\"prompt\": \"a\0b\"}\n";
    int rc = trace_parse_lines(&t, nul_line, sizeof nul_line - 1, "t.jsonl", 16, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "trace t.jsonl:1: byte 14: raw byte 0x00 in a string"), "a NUL byte: '%s'", err);
    rc = parse(&t, "# only comments\n\n   \n", err, sizeof err);
    CHECK(rc == -1 && strstr(err, "trace t.jsonl: no requests") && trace_is_empty(&t), "no requests: '%s'", err);
    rc = parse(&t, "", err, sizeof err);
    CHECK(rc == -1 && strstr(err, "no requests"), "an empty file: '%s'", err);
    rc = trace_parse_lines(&t, "{\"prompt\": \"x\"}", 15, "t.jsonl", 0, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "must be >= 1"), "the caller's n_gen 0: '%s'", err);
    /* a line at the end without its newline, cut short */
    rc = parse(&t, "{\"prompt\": \"x\"}\n{\"prompt\": \"y\", \"arrival\"", err, sizeof err);
    CHECK(rc == -1 && strstr(err, "trace t.jsonl:2: byte 26: unterminated object"), "a truncated last line: '%s'", err);
}

/* ---- 4. generated traces ---- */
static int same_trace(const Trace *a, const Trace *b) {
    if (a->n != b->n) return 0;
    for (int i = 0; i < a->n; i++) {
        const TraceReq *x = &a->req[i], *y = &b->req[i];
        if (x->arrival != y->arrival || x->doc_ids[0] != y->doc_ids[0] || x->doc_tokens != y->doc_tokens ||
            strcmp(x->turns[0], y->turns[0]) || x->n_gen != y->n_gen)
            return 0;
    }
    return 1;
}

/* FNV-1a over every request's document, length, question and arrival */
static uint64_t trace_hash(const Trace *t) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < t->n; i++) {
        const TraceReq *r = &t->req[i];
        long long v[3] = {r->doc_ids[0], r->doc_tokens, r->arrival};
        for (int k = 0; k < 3; k++)
            for (int b = 0; b < 8; b++)
                h = (h ^ (uint64_t)((unsigned long long)v[k] >> (8 * b) & 0xff)) * 0x100000001b3ull;
        for (const char *p = r->turns[0]; *p; p++) h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    }
    return h;
}

#define NDOC 10
#define NREQ 1000

static void test_generate(char **docs) {
    char err[512];
    Trace a, b, c;
    int rc = trace_generate(&a, NREQ, "hotspot", docs, NDOC, 7, 64, 512, 2.5, 32, err, sizeof err);
    CHECK(rc == 0 && a.n == NREQ && a.n_doc == NDOC && a.source == TRACE_GENERATED, "hotspot, 1000 requests: '%s'",
          rc ? err : "");
    if (rc) return;
    trace_generate(&b, NREQ, "hotspot", docs, NDOC, 7, 64, 512, 2.5, 32, err, sizeof err);
    trace_generate(&c, NREQ, "hotspot", docs, NDOC, 8, 64, 512, 2.5, 32, err, sizeof err);
    int diff_docs = 0, diff_len = 0, diff_q = 0, diff_arr = 0;
    for (int i = 0; i < NREQ; i++) {
        diff_docs += a.req[i].doc_ids[0] != c.req[i].doc_ids[0];
        diff_len += a.req[i].doc_tokens != c.req[i].doc_tokens;
        diff_q += strcmp(a.req[i].turns[0], c.req[i].turns[0]) != 0;
        diff_arr += a.req[i].arrival != c.req[i].arrival;
    }
    CHECK(same_trace(&a, &b), "seed 7 twice: the same trace");
    CHECK(diff_docs > 100 && diff_len > 900 && diff_q > 500 && diff_arr > 900,
          "seed 8: another trace (documents differ at %d, lengths at %d, questions at %d, arrivals at %d of 1000)",
          diff_docs, diff_len, diff_q, diff_arr);
    /* pinned: splitmix64 and IEEE doubles are the same everywhere, so this trace is too. Recorded from this test's
     * first run (gcc 12, glibc 2.36, x86-64) and matched by a separate Python transcription of trace.h's draws
     * (Python's integers for splitmix64, math.log); the arrivals pass through libm's log (trace.h) */
    uint64_t hash = trace_hash(&a);
    CHECK(hash == 0xda3ae9011e898855ull && a.req[0].doc_ids[0] == 1 && a.req[0].doc_tokens == 474 &&
          !strcmp(a.req[0].turns[0], "List three key points made in the text above.") && a.req[999].doc_ids[0] == 5 &&
          a.req[999].arrival == 2493, "seed 7 gives the recorded trace (hash %016llx; request 0: document %d, %d "
          "tokens; request 999: document %d, step %ld)", (unsigned long long)hash, a.req[0].doc_ids[0],
          a.req[0].doc_tokens, a.req[999].doc_ids[0], a.req[999].arrival);

    /* hotspot: Zipf with s = 1 over 10 documents, p_k = 1/((k+1) H_10), H_10 = 2.928968; the count of document k is
     * binomial(1000, p_k): within 4 SDs, sqrt(1000 p (1 - p)) (document 0: p = 0.3414, 341.4 +- 4 * 15.0) */
    int count[NDOC] = {0}, bad_range = 0, seen_q = 0, arrivals_ok = a.req[0].arrival == 0;
    double h = 0;
    for (int k = 0; k < NDOC; k++) h += 1.0 / (k + 1);
    for (int i = 0; i < NREQ; i++) {
        const TraceReq *r = &a.req[i];
        count[r->doc_ids[0]]++;
        bad_range += r->doc_tokens < 64 || r->doc_tokens > 512 || r->n_docs != 1 || r->n_turns != 1 || r->n_gen != 32 ||
                     r->docs[0] != a.doc[r->doc_ids[0]].text || r->system != NULL || r->id != i;
        if (i > 0) arrivals_ok &= r->arrival >= a.req[i - 1].arrival;
        if (r->doc_ids[0] == 0 && strcmp(r->turns[0], a.req[0].turns[0])) seen_q = 1;
    }
    int most = 1, zipf_ok = 1;
    char counts[256];
    int w = 0;
    for (int k = 0; k < NDOC; k++) {
        double p = 1.0 / ((k + 1) * h), mean = NREQ * p, sd = sqrt(NREQ * p * (1 - p));
        zipf_ok &= fabs(count[k] - mean) <= 4 * sd;
        most &= k == 0 || count[k] < count[0];
        w += snprintf(counts + w, sizeof counts - w, " %d", count[k]);
    }
    CHECK(most && zipf_ok, "hotspot: document 0 the most requested (%d, expected 1000/H_10 = %.1f), every document "
          "within 4 binomial SDs of 1000/((k+1) H_10); counts%s", count[0], NREQ / h, counts);
    CHECK(bad_range == 0, "every doc_tokens in [64, 512], one document and one question each, n_gen 32, the document "
          "from the table (%d wrong)", bad_range);
    CHECK(seen_q, "requests on document 0 share it and differ in their question");
    /* arrivals: request 999 at floor(sum of 999 gaps), mean 2.5; the mean gap's SD is 2.5 / sqrt(999) = 0.079, so
     * 4 SDs = 0.32 steps (the floor adds under 1/999) */
    double mean_gap = (double)a.req[NREQ - 1].arrival / (NREQ - 1);
    CHECK(arrivals_ok && fabs(mean_gap - 2.5) <= 0.32, "arrivals from 0, non-decreasing, mean gap %.3f steps (2.5 "
          "asked, +- 0.32 = 4 SDs)", mean_gap);
    char desc[256];
    trace_describe(&a, desc, sizeof desc);
    CHECK(strstr(desc, "1000 requests generated (hotspot, Zipf s=1, seed 7) over 10 documents, 64..512 document "
                 "tokens, arrivals 0..") && strstr(desc, "mean gap 2.5 steps"), "describe: '%s'", desc);

    /* the pattern and the mean change what they drive only */
    Trace s, z;
    trace_generate(&s, NREQ, "sequential", docs, NDOC, 7, 64, 512, 2.5, 32, err, sizeof err);
    trace_generate(&z, NREQ, "hotspot", docs, NDOC, 7, 64, 512, 0, 32, err, sizeof err);
    int cyc = 1, same_len = 1, same_docs = 1, zero = 1;
    for (int i = 0; i < NREQ; i++) {
        cyc &= s.req[i].doc_ids[0] == i % NDOC;
        same_len &= s.req[i].doc_tokens == a.req[i].doc_tokens && !strcmp(s.req[i].turns[0], a.req[i].turns[0]) &&
                    s.req[i].arrival == a.req[i].arrival;
        same_docs &= z.req[i].doc_ids[0] == a.req[i].doc_ids[0] && z.req[i].doc_tokens == a.req[i].doc_tokens;
        zero &= z.req[i].arrival == 0;
    }
    CHECK(cyc, "sequential: request i on document i mod 10");
    CHECK(same_len, "sequential on seed 7: the same lengths, questions and arrivals as hotspot on seed 7");
    CHECK(same_docs && zero, "mean 0: every request at step 0, the same documents and lengths as with mean 2.5");
    trace_free(&s);
    trace_free(&z);

    /* random: uniform, each count binomial(1000, 0.1): 100 +- 4 * 9.49 */
    Trace u;
    trace_generate(&u, NREQ, "random", docs, NDOC, 11, 5, 8, 1.0, 4, err, sizeof err);
    int ucount[NDOC] = {0}, lens[4] = {0}, uniform_ok = 1;
    for (int i = 0; i < NREQ; i++) {
        ucount[u.req[i].doc_ids[0]]++;
        if (u.req[i].doc_tokens >= 5 && u.req[i].doc_tokens <= 8) lens[u.req[i].doc_tokens - 5]++;
    }
    w = 0;
    for (int k = 0; k < NDOC; k++) {
        uniform_ok &= fabs(ucount[k] - 100.0) <= 4 * sqrt(1000 * 0.1 * 0.9);
        w += snprintf(counts + w, sizeof counts - w, " %d", ucount[k]);
    }
    CHECK(uniform_ok, "random: every document within 4 binomial SDs of 100 (+- 38); counts%s", counts);
    int lens_ok = lens[0] + lens[1] + lens[2] + lens[3] == NREQ;
    for (int k = 0; k < 4; k++) lens_ok &= fabs(lens[k] - 250.0) <= 4 * sqrt(1000 * 0.25 * 0.75);
    CHECK(lens_ok,
          "lengths in [5, 8], both ends drawn (%d %d %d %d; 250 +- 4 * 13.7 each)", lens[0], lens[1], lens[2], lens[3]);
    trace_free(&u);

    /* whole documents, one document listed twice (one table entry) */
    char *twice[2] = {docs[0], docs[0]};
    rc = trace_generate(&u, 5, "sequential", twice, 2, 1, 0, 0, 0, 1, err, sizeof err);
    CHECK(rc == 0 && u.n_doc == 1 && u.req[0].doc_tokens == 0 && u.req[1].docs[0] == u.req[0].docs[0],
          "min = max = 0: whole documents; a path given twice is one document");
    if (rc == 0) {
        trace_describe(&u, desc, sizeof desc);
        CHECK(strstr(desc, "5 requests generated (sequential, seed 1) over 1 document, whole documents"),
              "describe: '%s'", desc);
        trace_free(&u);
    }

    /* errors */
    char *missing[1] = {"/nonexistent/kvlab/doc.txt"};
    rc = trace_generate(&u, 10, "zipf", docs, NDOC, 1, 1, 2, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "unknown trace pattern 'zipf' (sequential, random, hotspot)") && trace_is_empty(&u),
          "unknown pattern: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 9, 3, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "[9, 3]"), "min above max: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 0, 3, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "1 <= min <= max"), "min 0 with max 3: '%s'", err);
    rc = trace_generate(&u, 0, "random", docs, NDOC, 1, 1, 3, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "at least 1 request"), "no requests: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, 0, 1, 1, 3, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "at least one document"), "no documents: '%s'", err);
    rc = trace_generate(&u, 10, "random", missing, 1, 1, 1, 3, 1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "cannot read document '/nonexistent/kvlab/doc.txt'") && trace_is_empty(&u),
          "a missing document: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 1, 3, -1, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "mean inter-arrival"), "a negative mean: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 1, 3, NAN, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "mean inter-arrival") && trace_is_empty(&u), "a NaN mean: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 1, 3, 1e300, 1, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "arrivals pass") && trace_is_empty(&u), "arrivals past a long: '%s'", err);
    rc = trace_generate(&u, 10, "random", docs, NDOC, 1, 1, 3, 1, 0, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "must be >= 1"), "n_gen 0: '%s'", err);
    CHECK(trace_pattern_parse("hotspot") == TRACE_HOTSPOT && trace_pattern_parse("Hotspot") == -1 &&
          !strcmp(trace_pattern_name(TRACE_SEQUENTIAL), "sequential"), "pattern names");
    trace_free(&a);
    trace_free(&b);
    trace_free(&c);
}

/* ---- 5. ShareGPT ---- */
static const char SHAREGPT[] =
    "[\n"
    " {\"id\": \"a1\", \"conversations\": [{\"from\": \"system\", \"value\": \"Be brief.\"}, {\"from\": \"human\", "
    "\"value\": \"Hi \\u00e9\"}, {\"from\": \"gpt\", \"value\": \"Hello!\"}, {\"from\": \"human\", \"value\": \"Bye\"}, "
    "{\"from\": \"gpt\", \"value\": \"See you\"}], \"model\": \"ignored\"},\n"
    " {\"id\": \"no-human\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"I talk alone\"}]},\n"
    " {\"id\": \"gpt-first\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}, {\"from\": \"human\", "
    "\"value\": \"y\"}]},\n"
    " {\"id\": 42, \"conversation\": [{\"from\": \"human\", \"value\": \"one\"}, {\"from\": \"human\", \"value\": "
    "\"two\"}, {\"from\": \"gpt\", \"value\": \"r1\"}, {\"from\": \"gpt\", \"value\": \"r2\"}]},\n"
    " {\"id\": \"bing\", \"conversations\": [{\"from\": \"human\", \"value\": \"?\"}, {\"from\": \"bing\", "
    "\"value\": \"!\"}]},\n"
    " {\"id\": \"late-system\", \"conversations\": [{\"from\": \"human\", \"value\": \"q\"}, {\"from\": \"system\", "
    "\"value\": \"s\"}]},\n"
    " {\"id\": \"no-value\", \"conversations\": [{\"from\": \"human\"}]},\n"
    " \"not an object\",\n"
    " {\"id\": \"empty\", \"conversations\": []},\n"
    " {\"id\": \"empty-human\", \"conversations\": [{\"from\": \"human\", \"value\": \"\"}]},\n"
    " {\"conversations\": [{\"from\": \"system\", \"value\": \"S1\"}, {\"from\": \"system\", \"value\": \"S2\"}, "
    "{\"from\": \"human\", \"value\": \"unanswered\"}]}\n"
    "]\n";

static void test_sharegpt(void) {
    char err[512];
    Trace t;
    const char *path = write_text("sharegpt.json", SHAREGPT);
    int rc = trace_load_sharegpt(&t, path, 64, 0, err, sizeof err);
    CHECK(rc == 0 && t.n == 3 && t.source == TRACE_SHAREGPT && t.n_doc == 0, "ShareGPT: 3 of 11 conversations kept "
          "('%s')", rc ? err : "");
    if (rc) return;
    CHECK(t.skipped_no_human == 3 && t.skipped_not_human_first == 1 && t.skipped_malformed == 4,
          "skipped: 3 without a human turn with text (gpt only, empty, one empty human turn), 1 opening with gpt, 4 "
          "malformed (a 'bing' turn, a system turn after a human one, a turn without a value, a string); got %d, %d, %d",
          t.skipped_no_human, t.skipped_not_human_first, t.skipped_malformed);
    const TraceReq *a = &t.req[0], *b = &t.req[1], *c = &t.req[2];
    CHECK(a->system && !strcmp(a->system, "Be brief.") && a->n_turns == 2 && !strcmp(a->turns[0], "Hi \xc3\xa9") &&
          !strcmp(a->turns[1], "Bye") && !strcmp(a->refs[0], "Hello!") && a->ref_bytes[0] == 6 &&
          !strcmp(a->refs[1], "See you") && a->ref_bytes[1] == 7 && !strcmp(a->source_id, "a1") && a->line == 2 &&
          a->n_gen == 64 && a->arrival == 0 && a->n_docs == 0 && a->id == 0,
          "a1: system, two turns, each with its reply and its bytes (6, 7), line 2");
    CHECK(b->n_turns == 2 && !strcmp(b->turns[0], "one") && !strcmp(b->turns[1], "two") && !strcmp(b->refs[0], "") &&
          b->ref_bytes[0] == 0 && !strcmp(b->refs[1], "r1\n\nr2") && b->ref_bytes[1] == 6 && !strcmp(b->source_id, "42")
          && !b->system && b->line == 5 && b->id == 1,
          "\"conversation\" and a numeric id read; two human turns in a row: the first has no reply, two replies in a "
          "row join with a blank line");
    CHECK(c->system && !strcmp(c->system, "S1\n\nS2") && c->n_turns == 1 && !strcmp(c->refs[0], "") &&
          c->ref_bytes[0] == 0 && !c->source_id && c->line == 12,
          "leading system turns join; an unanswered last turn has an empty reply; no id: NULL");
    char desc[320];
    trace_describe(&t, desc, sizeof desc);
    CHECK(strstr(desc, "3 requests from ShareGPT") && strstr(desc, "5 turns") &&
          strstr(desc, "skipped: 3 without a human turn, 1 not opening with one, 4 malformed"), "describe: '%s'", desc);

    /* seeded arrivals */
    Trace t2;
    trace_parse_sharegpt(&t2, SHAREGPT, sizeof SHAREGPT - 1, "s.json", 64, 0, err, sizeof err);
    trace_assign_arrivals(&t, 100, 5, err, sizeof err);
    trace_assign_arrivals(&t2, 100, 5, err, sizeof err);
    CHECK(t.req[0].arrival == 0 && t.req[1].arrival == t2.req[1].arrival && t.req[2].arrival == t2.req[2].arrival &&
          t.req[1].arrival <= t.req[2].arrival && t.req[2].arrival > 0, "arrivals: seed 5 twice gives 0, %ld, %ld both "
          "times", t.req[1].arrival, t.req[2].arrival);
    rc = trace_assign_arrivals(&t, INFINITY, 5, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "finite"), "an infinite mean: '%s'", err);
    rc = trace_assign_arrivals(&t, 1e300, 5, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "arrivals pass"), "a mean whose arrivals overflow a long: '%s'", err);
    trace_free(&t);
    trace_free(&t2);

    /* the cap: reading stops after max_requests requests, the rest is not looked at */
    char capped[sizeof SHAREGPT + 16];
    snprintf(capped, sizeof capped, "%.*s garbage", (int)(strstr(SHAREGPT, " {\"id\": \"bing\"") - SHAREGPT), SHAREGPT);
    rc = trace_parse_sharegpt(&t, capped, strlen(capped), "s.json", 8, 2, err, sizeof err);
    CHECK(rc == 0 && t.n == 2 && !strcmp(t.req[1].source_id, "42") && t.skipped_no_human == 1 &&
          t.skipped_not_human_first == 1, "max_requests 2: two requests, the text after the second not read");
    if (rc == 0) trace_free(&t);
    rc = trace_parse_sharegpt(&t, capped, strlen(capped), "s.json", 8, 0, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "sharegpt s.json:6:2: unexpected 'g'") && trace_is_empty(&t),
          "no cap: the same text is an error at its line ('%s')", err);

    /* errors, with FILE:LINE:COL */
    struct { const char *text, *want; } bad[] = {
        {"{\"conversations\": []}", "sharegpt s.json:1:1: a ShareGPT file is a JSON array"},
        {"", "sharegpt s.json:1:1: a ShareGPT file is a JSON array"},
        {"[\n {\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}]},\n]", "sharegpt s.json:3:1: unexpected ']'"},
        {"[\n {\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}]}\n", "sharegpt s.json:3:1: unterminated array"},
        {"[\n {\"conversations\": [{\"from\": \"human\", \"value\": \"x\n\"}]}]", "sharegpt s.json:2:50: raw byte 0x0a"},
        {"[{\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}]} {}]", "s.json:1:55: expected ',' or ']'"},
        {"[{\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}]}] x", "s.json:1:56: unexpected text after"},
        {"[]", "sharegpt s.json: no conversation to replay (skipped: 0 without"},
        {"[{\"conversations\": [{\"from\": \"gpt\", \"value\": \"x\"}]}]", "no conversation to replay (skipped: 1 without"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rc = trace_parse_sharegpt(&t, bad[i].text, strlen(bad[i].text), "s.json", 8, 0, err, sizeof err);
        CHECK(rc == -1 && strstr(err, bad[i].want) && trace_is_empty(&t), "bad ShareGPT %zu: '%s'", i, err);
        if (rc == 0) trace_free(&t);
    }
    rc = trace_load_sharegpt(&t, "/nonexistent/kvlab/sharegpt.json", 8, 0, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "cannot open"), "a missing ShareGPT file: '%s'", err);
}

int main(void) {
    snprintf(dir, sizeof dir, "%s/kvlab_trace_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(dir)) { printf("FAIL mkdtemp %s\n", dir); return 1; }
    const char *doc_a = write_text("a.txt", "alpha text\n");
    const char *doc_b = write_text("b.txt", "beta text");
    char names[NDOC][320], *docs[NDOC];
    for (int k = 0; k < NDOC; k++) {
        char name[32], body[64];
        snprintf(name, sizeof name, "doc%d.txt", k);
        snprintf(body, sizeof body, "Document %d says something.", k);
        snprintf(names[k], sizeof names[k], "%s", write_text(name, body));
        docs[k] = names[k];
    }
    test_lines(doc_a, doc_b);
    test_escapes();
    test_errors(doc_a);
    test_generate(docs);
    test_sharegpt();
    for (int i = 0; i < n_made; i++) unlink(made[i]);
    if (rmdir(dir)) printf("FAIL cannot remove %s\n", dir);
    CHECK_EXIT();
}
