/* task_code.c: -m task -task code (task_code.h states the task, the trim rule and the pinning): the pinned headers,
 * the cut chooser, the answer's line and its match, and the runner that asks full (the reference) and then every
 * other -kv policy each item through the engine (chunked prefill, greedy decode: eval_impl.h's, as -m task's).
 *
 * Dimensions: room (prompt tokens an item may take: length - answer tokens), length (tokens of a cell), ctx (-c).
 */
#include "task_code.h"
#include "eval_impl.h"
#include "task.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Debian 12 (bookworm), libc6-dev 2.36. poll.h is left out: it is one #include line, nothing to complete. */
const CodePin CODE_PINS[] = {
    {"stdio.h", "cf8eec642c164a95d6ffcdbea90db9e277c204532989492b0e9c0b4f55659d57"},
    {"stdlib.h", "2b535c0953b3441ef72729d09e83d98d22f87ca68f8b0e8f85d2fd2285afbc91"},
    {"string.h", "aa84f9ec0e15576219ff099be4ed2bd8ec5e23122a89f1d223bfbc3335f851fa"},
    {"unistd.h", "99eb4050035a1a816090762770f0843c728666745d7e727e64dc347d8a99ac28"},
    {"fcntl.h", "5e6b12d71c0d8fabb5ab7ee9ba9f1e1eb6b19bef0e5e7938f1da68c28ab8044d"},
    {"signal.h", "b3192bbf63b429913c573418396b97955b0adfbecd53171bd5e6bcec0d0f3b2f"},
    {"pthread.h", "e54517e7ee53dc85fbe051da9897014f40fc358c8ba5bbdcbbbc1f9286752b9b"},
    {"time.h", "95e0b2dfbc153daa0a857b05c9b1a9cfc29b111d707401dbbe38de551b32c14e"},
    {"errno.h", "c46073c84e5396855c6861272a8b02e352bb20d658bbfc12690e483a4be73053"},
    {"math.h", "4a0b7f8fe8b7d97eab417c8c295a6aecaba8b7d49bc240e40c35fd01b87ffad2"},
    {"ctype.h", "f24a6f94415830e9353adb3e9343b0b0a0f804bd369a083d589c26c009865f05"},
    {"locale.h", "7966d040727bbfcddef55ba07c096f264229725af5c8ca93c21f764c9c41dce2"},
    {"setjmp.h", "274f6ccdca2237211aa8cfeee2adb06aab2e2d8bcd008ab455d01663794edfd3"},
    {"dirent.h", "7c24a1339f41ccd4614b274411f39a95aa02e25d8811c4993cba07368e87c1cc"},
    {"getopt.h", "adf46a037aa6758f473afbe545732a2c4c24494457821578d7232754795e8758"},
    {"sched.h", "c61636209796fdca0aa5330af947a828deac93e8d9f89a5a25bbe4fff68bd6c4"},
    {"wchar.h", "47d3e95f977bf7b14a18973e2780a56665d40d4947e96b0b490c3368163617be"},
};
const int CODE_N_PINS = (int)(sizeof CODE_PINS / sizeof CODE_PINS[0]);

/* ---------------------------------------------------------------------------------------------------------------
 * The pinned set.
 * ------------------------------------------------------------------------------------------------------------- */

const char *code_root(void) {
    const char *r = getenv(TASK_CODE_ROOT_ENV);
    return r && *r ? r : TASK_CODE_ROOT_DEFAULT;
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

/* 1 when data[a..b) holds a byte other than whitespace. */
static int has_text(const char *data, size_t a, size_t b) {
    for (size_t i = a; i < b; i++) if (!is_space(data[i]) && data[i] != '\n') return 1;
    return 0;
}

int code_next_line(const char *data, size_t size, size_t from, size_t *at, size_t *len) {
    size_t i = from;
    while (i < size) {
        size_t e = i;
        while (e < size && data[e] != '\n') e++;
        if (has_text(data, i, e)) { *at = i; *len = e - i; return 0; }
        i = e + 1;
    }
    return -1;
}

static void skip_note(CodeSet *s, const char *name, const char *why) {
    size_t n = strlen(s->skipped);
    snprintf(s->skipped + n, sizeof s->skipped - n, "%s%s (%s)", n ? ", " : "", name, why);
    s->n_skipped++;
}

int code_load(CodeSet *s, const char *root, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    struct stat st;
    if (stat(root, &st)) return errorf(err, errlen, "code root '%s' (%s, default %s): %s", root, TASK_CODE_ROOT_ENV,
                                       TASK_CODE_ROOT_DEFAULT, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return errorf(err, errlen, "code root '%s' (%s) is not a directory", root,
                                            TASK_CODE_ROOT_ENV);
    snprintf(s->root, sizeof s->root, "%s", root);
    s->files = calloc((size_t)CODE_N_PINS, sizeof *s->files);
    if (!s->files) fatal("out of memory");
    for (int k = 0; k < CODE_N_PINS; k++) {
        char path[1024], hex[65];
        snprintf(path, sizeof path, "%s/%s", root, CODE_PINS[k].name);
        if (stat(path, &st) || !S_ISREG(st.st_mode)) { skip_note(s, CODE_PINS[k].name, "missing"); continue; }
        CodeFile *f = &s->files[s->n];
        f->data = read_file(path, &f->size);
        sha256_hex(f->data, f->size, hex);
        if (strcmp(hex, CODE_PINS[k].sha256)) {
            skip_note(s, CODE_PINS[k].name, "sha256 differs");
            free(f->data);
            memset(f, 0, sizeof *f);
            continue;
        }
        f->pin = &CODE_PINS[k];
        f->cuts = malloc((f->size + 1) * sizeof *f->cuts);
        if (!f->cuts) fatal("out of memory");
        size_t at, len;
        for (size_t i = 0; i < f->size; i++)
            if (f->data[i] == '\n' && code_next_line(f->data, f->size, i + 1, &at, &len) == 0)
                f->cuts[f->n_cuts++] = i + 1;
        s->n++;
    }
    if (s->n == 0) {
        errorf(err, errlen, "no pinned header is left under '%s' (%d of %d skipped: %s)", root, s->n_skipped,
               CODE_N_PINS, s->skipped);
        code_set_free(s);
        return -1;
    }
    return 0;
}

void code_set_free(CodeSet *s) {
    for (int i = 0; i < s->n; i++) { free(s->files[i].data); free(s->files[i].cuts); }
    free(s->files);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------------------------------------------------------
 * The cut chooser.
 * ------------------------------------------------------------------------------------------------------------- */

/* A token takes at least one byte and, in these headers, far fewer than this many: cuts further in than
 * room * BYTES_PER_TOKEN_MAX bytes cannot fit, so the search never encodes a whole long header. */
enum { BYTES_PER_TOKEN_MAX = 16 };

void code_plan(CodePlan *p, const CodeSet *s, int room, CodeCount count, void *ctx) {
    p->room = room;
    p->n_files_usable = 0;
    p->lo = malloc((size_t)s->n * sizeof *p->lo);
    p->hi = malloc((size_t)s->n * sizeof *p->hi);
    if (!p->lo || !p->hi) fatal("out of memory");
    int least = room - room / 4;
    for (int fi = 0; fi < s->n; fi++) {
        const CodeFile *f = &s->files[fi];
        p->lo[fi] = 0;
        p->hi[fi] = -1;
        int n = 0;
        while (n < f->n_cuts && f->cuts[n] <= (size_t)room * BYTES_PER_TOKEN_MAX) n++;
        if (n == 0 || count(f->data, f->cuts[0], ctx) > room) continue;
        int a = 0, b = n - 1;   /* hi: the last cut that fits */
        while (a < b) {
            int mid = a + (b - a + 1) / 2;
            if (count(f->data, f->cuts[mid], ctx) <= room) a = mid; else b = mid - 1;
        }
        int hi = a;
        if (count(f->data, f->cuts[hi], ctx) < least) continue;   /* the header is too short for this length */
        a = 0, b = hi;          /* lo: the first cut that takes at least `least` */
        while (a < b) {
            int mid = a + (b - a) / 2;
            if (count(f->data, f->cuts[mid], ctx) >= least) b = mid; else a = mid + 1;
        }
        p->lo[fi] = a;
        p->hi[fi] = hi;
        p->n_files_usable++;
    }
}

void code_plan_free(CodePlan *p) {
    free(p->lo);
    free(p->hi);
    memset(p, 0, sizeof *p);
}

int code_draw(CodeItem *it, const CodePlan *p, const CodeSet *s, uint64_t seed, CodeCount count, void *ctx) {
    memset(it, 0, sizeof *it);
    if (p->n_files_usable == 0) return -1;
    uint64_t rng = seed;
    int pick = (int)(splitmix64(&rng) % (uint64_t)p->n_files_usable), fi = 0;
    for (int seen = 0; fi < s->n; fi++)
        if (p->lo[fi] <= p->hi[fi] && seen++ == pick) break;
    const CodeFile *f = &s->files[fi];
    int c = p->lo[fi] + (int)(splitmix64(&rng) % (uint64_t)(p->hi[fi] - p->lo[fi] + 1));
    int t = count(f->data, f->cuts[c], ctx);
    while (t > p->room && c > 0) t = count(f->data, f->cuts[--c], ctx);   /* a prefix that took fewer tokens */
    it->file = fi;
    it->cut = f->cuts[c];
    it->prompt_tokens = t;
    if (code_next_line(f->data, f->size, it->cut, &it->ans_at, &it->ans_len)) return -1;   /* cuts have one */
    it->line = 1;
    for (size_t i = 0; i < it->ans_at; i++) it->line += f->data[i] == '\n';
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The answer and the match.
 * ------------------------------------------------------------------------------------------------------------- */

void code_answer_line(const char *out, const char **line, size_t *len) {
    size_t n = strlen(out), at;
    if (code_next_line(out, n, 0, &at, len)) { *line = out + n; *len = 0; return; }
    *line = out + at;
}

static void trim(const char **s, size_t *n) {
    while (*n && is_space(**s)) { (*s)++; (*n)--; }
    while (*n && is_space((*s)[*n - 1])) (*n)--;
}

/* 1 when a and b are equal once trimmed (two empty lines are equal). */
static int code_same(const char *a, size_t na, const char *b, size_t nb) {
    trim(&a, &na);
    trim(&b, &nb);
    return na == nb && !memcmp(a, b, na);
}

int code_match(const char *a, size_t na, const char *b, size_t nb) {
    const char *t = a;
    size_t nt = na;
    trim(&t, &nt);
    return nt > 0 && code_same(a, na, b, nb);
}

/* ---------------------------------------------------------------------------------------------------------------
 * -m task -task code.
 * ------------------------------------------------------------------------------------------------------------- */

/* The engine's count: the tokenizer's, plain text (a header is no chat), BOS where the model adds one. */
static int engine_count(const char *data, size_t n, void *ctx) {
    const Model *m = ctx;
    int *ids;
    size_t k;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)data, n, m->tokenizer.add_bos, &ids, &k, err,
                         sizeof err))
        fatal("tokenizer: %s", err);
    free(ids);
    return (int)k;
}

typedef struct { int file, full, n; } CodeCell;   /* per length: items matching the file, matching full, asked */

int run_task_code(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("-m task needs a model with a tokenizer");
    if (o->n_docs) fatal("-docs is for the natural tasks (summary, docqa, dialogue): -task code reads the pinned headers");
    if (o->n_depths) fatal("-task code has no depth (an item is a header's first part): drop -depths");
    int ctx = run_context(m, o), chunk = o->chunk ? o->chunk : PREFILL_CHUNK, items = o->items ? o->items : 2;
    if (o->steps_set && o->steps == 0) fatal("-m task -n 0 leaves no token to answer with: give the answer's length "
                                             "(default %d for code)", TASK_CODE_ANSWER_TOKENS);
    int max_new = o->steps_set ? o->steps : TASK_CODE_ANSWER_TOKENS;
    int lens[MAX_PASSKEY_CELLS], n_lens = task_lengths(o, ctx, max_new, lens);
    char err[1024];
    CodeSet set;
    if (code_load(&set, code_root(), err, sizeof err)) fatal("-task code: %s", err);
    CodePlan *plans = calloc((size_t)n_lens, sizeof *plans);
    if (!plans) fatal("out of memory");
    for (int li = 0; li < n_lens; li++) {
        code_plan(&plans[li], &set, lens[li] - max_new, engine_count, m);
        if (!plans[li].n_files_usable)
            fatal("-lengths: %d tokens: no pinned header under '%s' has a line boundary whose prompt takes %d to %d "
                  "tokens (with %d answer tokens)", lens[li], set.root, plans[li].room - plans[li].room / 4,
                  plans[li].room, max_new);
    }
    if (set.n_skipped) run_note("-task code: %d of %d pinned headers skipped under '%s': %s", set.n_skipped,
                                CODE_N_PINS, set.root, set.skipped);
    /* full first, as the reference: the -kv full given, or one added */
    const char *specs[MAX_POLICIES + 1];
    const int *caps[MAX_POLICIES + 1];
    int full_given, n_pol = task_reference_policies(o, "code", specs, caps, &full_given);
    uint64_t seed = o->seed_set ? o->seed : 1;
    Sha256 text_sha;
    sha_init(&text_sha);
    for (int i = 0; i < set.n; i++) sha_update(&text_sha, set.files[i].data, set.files[i].size);
    TaskJob job;
    task_job_open(&job, m, o, ctx, &text_sha, seed);   /* every -kv spec checked first */
    Line ln = {0};
    fprintf(stderr, "task code: %d of %d pinned headers under %s (%d skipped%s%s), lengths", set.n, CODE_N_PINS,
            set.root, set.n_skipped, set.n_skipped ? ": " : "", set.skipped);
    for (int li = 0; li < n_lens; li++) fprintf(stderr, " %d", lens[li]);
    fprintf(stderr, " tokens, %d items per length, %d answer tokens, seed %llu; raw text, no chat template; match: "
            "the answer's first non-empty line equals the file's next non-empty line (file) or full's answer (full), "
            "leading and trailing whitespace ignored\n", items, max_new, (unsigned long long)seed);
    int n_items = n_lens * items;
    char **ref = calloc((size_t)n_items, sizeof *ref);   /* full's answer line per item */
    CodeCell *cells = calloc((size_t)n_lens, sizeof *cells);
    double (*totals)[2] = calloc((size_t)n_pol, sizeof *totals);
    int *asked = calloc((size_t)n_pol, sizeof *asked);
    if (!ref || !cells || !totals || !asked) fatal("out of memory");
    long total_tokens = (long)n_pol * items, done_tokens = 0, per = 0;
    for (int li = 0; li < n_lens; li++) per += lens[li];
    total_tokens *= per;
    int stopped = 0;
    double t_job = now_s();
    char output[4096];
    for (int k = 0; k < n_pol && !stopped; k++) {
        uint64_t rng = seed;   /* every policy is asked the same items */
        PolicyRun r;
        policy_run_init(&r, m, o, specs[k], ctx, 0, chunk, caps[k]);
        if (o->kvlog) kvlog_attach(&r.kvlog, &job.kvlog, m, &r.asked, &r.cache);
        memset(cells, 0, (size_t)n_lens * sizeof *cells);
        double t_policy = now_s();
        for (int li = 0; li < n_lens && !stopped; li++)
            for (int rep = 0; rep < items; rep++) {
                uint64_t item_seed = splitmix64(&rng);
                CodeItem it;
                if (code_draw(&it, &plans[li], &set, item_seed, engine_count, m))
                    fatal("-task code: no item at length %d", lens[li]);
                const CodeFile *f = &set.files[it.file];
                int *ids;
                size_t n;
                if (tokenizer_encode(&m->tokenizer, (const unsigned char *)f->data, it.cut, m->tokenizer.add_bos,
                                     &ids, &n, err, sizeof err))
                    fatal("tokenizer: %s", err);
                kv_cache_reset(&r.cache);
                kv_set_prompt_len(&r.cache, (int)n);
                r.asked.n = 0;
                for (size_t i = 0; i < n; i++) ids_push(&r.asked, ids[i]);
                int pos = 0;
                output[0] = 0;
                /* greedy decoding: the tokens after the line's end do not change the line, so the answer is cut
                 * from eval_answer's output rather than stopped at the newline */
                int rc = prefill(m, &r, ids, n, &pos, chunk);
                if (!rc) rc = eval_answer(m, &r, &pos, max_new, -1, output, sizeof output);
                free(ids);
                if (rc == PK_STOPPED) { stopped = 1; break; }
                note_bytes(&r);
                const char *a;
                size_t na;
                code_answer_line(output, &a, &na);
                int slot = li * items + rep;
                if (k == 0) {
                    ref[slot] = malloc(na + 1);
                    if (!ref[slot]) fatal("out of memory");
                    memcpy(ref[slot], a, na);
                    ref[slot][na] = 0;
                }
                int mf = code_match(a, na, f->data + it.ans_at, it.ans_len);
                int mr = code_same(a, na, ref[slot], strlen(ref[slot]));
                cells[li].file += mf;
                cells[li].full += mr;
                cells[li].n++;
                if (job.out.fd >= 0) {
                    line_printf(&ln, "{\"mode\":\"task\",\"task\":\"code\",\"family\":\"code\",\"variant\":null,"
                                "\"kv\":\"");
                    line_json_str(&ln, r.cache.spec.text);
                    line_printf(&ln, "\",\"budget\":%d,\"reference\":%s,\"length\":%d,\"item\":%d,\"item_seed\":%llu,"
                                "\"root\":\"", r.cache.policy.budget, k == 0 ? "true" : "false", lens[li], rep,
                                (unsigned long long)item_seed);
                    line_json_str(&ln, set.root);
                    line_printf(&ln, "\",\"file\":\"%s\",\"file_sha256\":\"%s\",\"files\":%d,\"skipped\":%d,"
                                "\"skipped_files\":\"", f->pin->name, f->pin->sha256, set.n, set.n_skipped);
                    line_json_str(&ln, set.skipped);
                    line_printf(&ln, "\",\"cut\":%zu,\"line\":%d,\"prompt_tokens\":%zu,\"answer_tokens\":%d,"
                                "\"expected\":\"", it.cut, it.line, n, pos - (int)n);
                    Line e = {0};
                    line_printf(&e, "%.*s", (int)it.ans_len, f->data + it.ans_at);
                    line_json_str(&ln, e.s);
                    line_free(&e);
                    line_printf(&ln, "\",\"answer\":\"");
                    line_printf(&e, "%.*s", (int)na, a);
                    line_json_str(&ln, e.s);
                    line_free(&e);
                    line_printf(&ln, "\",\"output\":\"");
                    line_json_str(&ln, output);
                    KVBytes bytes = kv_bytes(&r.cache);
                    line_printf(&ln, "\",\"match_file\":%d,\"match_full\":%d,\"cache_full\":%s,\"kv_live_bytes\":%zu,"
                                "\"kv_peak_live_bytes\":%zu,\"kv_alloc_bytes\":%zu,", mf, mr,
                                rc == PK_CACHE_FULL ? "true" : "false", bytes.total_live, bytes.peak_live,
                                bytes.total_alloc);
                    json_provenance_end(&ln, &job.pv);
                    outfile_line(&job.out, &ln);
                }
                done_tokens += lens[li];
                progress(t_job, done_tokens, total_tokens, "task code");
            }
        fprintf(stderr, "\n%s%s, code: matches by length (file: the header's line; full: full's answer)\n%8s %15s "
                "%15s\n", r.cache.spec.text, k == 0 ? " (reference)" : "", "length", "file", "full");
        int sf = 0, sr = 0, sn = 0;
        for (int li = 0; li < n_lens; li++) {
            const CodeCell *c = &cells[li];
            char a1[32] = "-", a2[32] = "-";
            if (c->n) {
                snprintf(a1, sizeof a1, "%.3f (%d/%d)", (double)c->file / c->n, c->file, c->n);
                snprintf(a2, sizeof a2, "%.3f (%d/%d)", (double)c->full / c->n, c->full, c->n);
            }
            fprintf(stderr, "%8d %15s %15s\n", lens[li], a1, a2);
            sf += c->file;
            sr += c->full;
            sn += c->n;
        }
        totals[k][0] = sn ? (double)sf / sn : 0;
        totals[k][1] = sn ? (double)sr / sn : 0;
        asked[k] = sn;
        fprintf(stderr, "%s, code: file %.3f (%d/%d), full %.3f (%d/%d), peak KV %.2f MiB, %.1f s%s\n",
                r.cache.spec.text, totals[k][0], sf, sn, totals[k][1], sr, sn, r.peak.peak_live / 1048576.0,
                now_s() - t_policy, stopped ? " (stopped early)" : "");
        policy_run_free(&r);
    }
    fprintf(stderr, "\ncode: fraction of items matching, per policy\n%-28s %8s %8s %6s\n", "kv", "file", "full",
            "items");
    for (int k = 0; k < n_pol; k++)
        if (asked[k]) fprintf(stderr, "%-28s %8.3f %8.3f %6d%s\n", specs[k], totals[k][0], totals[k][1], asked[k],
                              k == 0 && !full_given ? " (reference, not asked with -kv)" : "");
    if (stopped) fprintf(stderr, "task code: stopped by %s: the item being asked was dropped; every answer above is "
                         "recorded\n", run_signal_name(run_signal));
    for (int i = 0; i < n_items; i++) free(ref[i]);
    free(ref);
    free(cells);
    free(totals);
    free(asked);
    for (int li = 0; li < n_lens; li++) code_plan_free(&plans[li]);
    free(plans);
    code_set_free(&set);
    line_free(&ln);
    task_job_close(&job);
    return stopped ? 128 + run_signal : 0;
}
