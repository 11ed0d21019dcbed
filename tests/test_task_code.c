/* test_task_code.c: -task code's pure parts (task_code.h), no model needed:
 *   - the pinned table finds real headers under /usr/include: each one loaded has the digest sha256sum (coreutils,
 *     not kvlab) gives for the file; SKIPs where the machine's libc6-dev differs and nothing is left;
 *   - a root that does not exist, and one whose only header is altered, are errors naming the problem; a root with one
 *     good copy and one altered copy loads the good one and counts the altered one as skipped;
 *   - the cut chooser (with a stand-in token count: bytes / 4 + 1) is deterministic per seed, varies with the seed,
 *     cuts just after a '\n', and the prompt takes at most room tokens and at least room - room / 4;
 *   - the expected answer is the header's next non-empty line after the cut, found here by reading the file again
 *     line by line with getline, and its line number;
 *   - the answer's line (the first non-empty line of the output) and the trim rule on scripted answers: right 1;
 *     wrong, empty, whitespace-only and partial 0; leading and trailing whitespace ignored, inner whitespace kept.
 */
#include "task_code.h"
#include "tests/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int bytes_count(const char *data, size_t n, void *ctx) { (void)data; (void)ctx; return (int)(n / 4) + 1; }

/* sha256sum's digest of path into hex (65 bytes); 0 or -1 */
static int coreutils_sha(const char *path, char *hex) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "sha256sum '%s' 2>/dev/null", path);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    int ok = fscanf(p, "%64s", hex) == 1;
    pclose(p);
    return ok && strlen(hex) == 64 ? 0 : -1;
}

static int blank(const char *s) {
    for (; *s; s++) if (!strchr(" \t\r\v\f\n", *s)) return 0;
    return 1;
}

/* the first non-empty line starting at byte >= cut, read from the file on disk: its text (no '\n'), offset, number */
static int disk_next_line(const char *path, size_t cut, char *out, size_t cap, size_t *at, int *lineno) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char *buf = NULL;
    size_t bcap = 0, off = 0;
    ssize_t r;
    int no = 0, found = -1;
    while ((r = getline(&buf, &bcap, f)) > 0) {
        no++;
        if (off >= cut && !blank(buf)) {
            size_t n = (size_t)r;
            if (n && buf[n - 1] == '\n') n--;
            snprintf(out, cap, "%.*s", (int)n, buf);
            *at = off;
            *lineno = no;
            found = 0;
            break;
        }
        off += (size_t)r;
    }
    free(buf);
    fclose(f);
    return found;
}

static int copy_file(const char *from, const char *to, int alter) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    if (!a || !b) { if (a) fclose(a); if (b) fclose(b); return -1; }
    int c;
    while ((c = fgetc(a)) != EOF) fputc(c, b);
    if (alter) fputs("/* altered */\n", b);
    fclose(a);
    fclose(b);
    return 0;
}

static void test_pinned(void) {
    char err[1024];
    CodeSet s;
    if (code_load(&s, TASK_CODE_ROOT_DEFAULT, err, sizeof err)) {
        SKIP("no pinned header matches under %s on this machine: %s", TASK_CODE_ROOT_DEFAULT, err);
        return;
    }
    int bad = 0;
    for (int i = 0; i < s.n; i++) {
        char path[1024], hex[80];
        snprintf(path, sizeof path, "%s/%s", TASK_CODE_ROOT_DEFAULT, s.files[i].pin->name);
        if (coreutils_sha(path, hex) || strcmp(hex, s.files[i].pin->sha256)) {
            bad++;
            printf("  %s: sha256sum %s, pinned %s\n", path, hex, s.files[i].pin->sha256);
        }
    }
    CHECK(s.n >= 1 && bad == 0 && s.n + s.n_skipped == CODE_N_PINS,
          "%d of %d pinned headers found under %s, each with sha256sum's digest (%d skipped: %s)", s.n, CODE_N_PINS,
          TASK_CODE_ROOT_DEFAULT, s.n_skipped, s.skipped);
    code_set_free(&s);
}

static void test_roots(void) {
    char err[1024];
    CodeSet s;
    int rc = code_load(&s, "/nonexistent/kvlab-code-root", err, sizeof err);
    CHECK(rc == -1 && strstr(err, "/nonexistent/kvlab-code-root") && strstr(err, "No such file"),
          "a root that does not exist is an error: %s", err);
    char dir[] = "/tmp/kvlab_code_XXXXXX";
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp"); return; }
    char from[1024], to[1024];
    /* the first two pins that exist and match here */
    int k0 = -1, k1 = -1;
    for (int k = 0; k < CODE_N_PINS && k1 < 0; k++) {
        char hex[80];
        snprintf(from, sizeof from, "%s/%s", TASK_CODE_ROOT_DEFAULT, CODE_PINS[k].name);
        if (coreutils_sha(from, hex) || strcmp(hex, CODE_PINS[k].sha256)) continue;
        if (k0 < 0) k0 = k; else k1 = k;
    }
    if (k1 < 0) { SKIP("fewer than two pinned headers match here"); return; }
    snprintf(from, sizeof from, "%s/%s", TASK_CODE_ROOT_DEFAULT, CODE_PINS[k0].name);
    snprintf(to, sizeof to, "%s/%s", dir, CODE_PINS[k0].name);
    copy_file(from, to, 1);   /* altered: a comment appended */
    rc = code_load(&s, dir, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "no pinned header is left") && strstr(err, "sha256 differs"),
          "a root whose only header is altered is an error: %s", err);
    snprintf(from, sizeof from, "%s/%s", TASK_CODE_ROOT_DEFAULT, CODE_PINS[k1].name);
    snprintf(to, sizeof to, "%s/%s", dir, CODE_PINS[k1].name);
    copy_file(from, to, 0);
    rc = code_load(&s, dir, err, sizeof err);
    char want[128];
    snprintf(want, sizeof want, "%s (sha256 differs)", CODE_PINS[k0].name);
    CHECK(rc == 0 && s.n == 1 && s.files[0].pin == &CODE_PINS[k1] && s.n_skipped == CODE_N_PINS - 1 &&
          strstr(s.skipped, want),
          "a root with %s altered and %s copied: 1 loaded, %d skipped (%s among them)", CODE_PINS[k0].name,
          CODE_PINS[k1].name, s.n_skipped, want);
    if (rc == 0) code_set_free(&s);
    remove(to);
    snprintf(to, sizeof to, "%s/%s", dir, CODE_PINS[k0].name);
    remove(to);
    rmdir(dir);
}

static void test_cuts(void) {
    char err[1024];
    CodeSet s;
    if (code_load(&s, TASK_CODE_ROOT_DEFAULT, err, sizeof err)) { SKIP("no pinned header here: %s", err); return; }
    const int rooms[] = {200, 1000, 3000};
    for (int ri = 0; ri < 3; ri++) {
        int room = rooms[ri];
        CodePlan p;
        code_plan(&p, &s, room, bytes_count, NULL);
        int n = 0, same = 1, boundary = 1, fits = 1, next_ok = 1, distinct = 0;
        size_t first_cut = 0;
        int first_file = -1;
        for (uint64_t seed = 1; seed <= 40; seed++) {
            CodeItem a, b;
            if (code_draw(&a, &p, &s, seed, bytes_count, NULL) || code_draw(&b, &p, &s, seed, bytes_count, NULL))
                continue;
            n++;
            same &= !memcmp(&a, &b, sizeof a);
            const CodeFile *f = &s.files[a.file];
            boundary &= a.cut > 0 && f->data[a.cut - 1] == '\n';
            int t = bytes_count(f->data, a.cut, NULL);
            fits &= t == a.prompt_tokens && t <= room && t >= room - room / 4;
            if (first_file < 0) { first_file = a.file; first_cut = a.cut; }
            else if (a.file != first_file || a.cut != first_cut) distinct = 1;
            char path[1024], line[4096];
            size_t at;
            int no;
            snprintf(path, sizeof path, "%s/%s", TASK_CODE_ROOT_DEFAULT, f->pin->name);
            if (disk_next_line(path, a.cut, line, sizeof line, &at, &no) || at != a.ans_at || no != a.line ||
                strlen(line) != a.ans_len || memcmp(line, f->data + a.ans_at, a.ans_len)) {
                if (next_ok) printf("  %s cut %zu: getline finds line %d at %zu, the item says line %d at %zu\n",
                                    f->pin->name, a.cut, no, at, a.line, a.ans_at);
                next_ok = 0;
            }
        }
        CHECK(n == 40 && p.n_files_usable >= 1, "room %d: %d usable headers, 40 items drawn (%d)", room,
              p.n_files_usable, n);
        CHECK(same && distinct, "room %d: the same seed draws the same item, other seeds other items", room);
        CHECK(boundary && fits, "room %d: every cut follows a '\\n', every prompt takes %d to %d tokens", room,
              room - room / 4, room);
        CHECK(next_ok, "room %d: the expected answer is the header's next non-empty line (getline's)", room);
        code_plan_free(&p);
    }
    CodePlan p;
    code_plan(&p, &s, 3, bytes_count, NULL);
    CodeItem it;
    CHECK(p.n_files_usable == 0 && code_draw(&it, &p, &s, 1, bytes_count, NULL) == -1,
          "room 3: no header has a cut that short: no item");
    code_plan_free(&p);
    code_set_free(&s);
}

static int scripted(const char *output, const char *expected) {
    const char *l;
    size_t n;
    code_answer_line(output, &l, &n);
    return code_match(l, n, expected, strlen(expected));
}

static void test_match(void) {
    const char *want = "extern int fclose (FILE *__stream);";
    const char *l;
    size_t n;
    code_answer_line("\n  \n\t  foo (x);\nbar\n", &l, &n);
    CHECK(n == 11 && !memcmp(l, "\t  foo (x);", 11), "the answer's line: the first non-empty line of the output");
    CHECK(scripted("extern int fclose (FILE *__stream);\nextern int fflush", want) == 1, "right: 1");
    CHECK(scripted("\n\n   extern int fclose (FILE *__stream);  \r\n", want) == 1,
          "right after blank lines, with leading and trailing whitespace: 1");
    CHECK(scripted("extern int fclose (FILE *__stream);", "  extern int fclose (FILE *__stream);\r") == 1,
          "the expected line trimmed too: 1");
    CHECK(scripted("extern int fclose (FILE * __stream);", want) == 0, "inner whitespace differs: 0");
    CHECK(scripted("extern int fflush (FILE *__stream);", want) == 0, "wrong: 0");
    CHECK(scripted("", want) == 0 && scripted("\n \t\n", want) == 0, "empty and whitespace-only: 0");
    CHECK(scripted("extern int fclose (FILE", want) == 0, "partial (the line cut short): 0");
    CHECK(scripted("extern int fclose (FILE *__stream); /* more */", want) == 0, "the line and more: 0");
    CHECK(code_match("", 0, "", 0) == 0, "an empty answer never matches, even an empty line");
}

int main(void) {
    test_pinned();
    test_roots();
    test_cuts();
    test_match();
    CHECK_EXIT();
}
