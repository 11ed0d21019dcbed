/* cli.c: the command line of ./run: the flag table (which mode reads which flag; -h and README's table come from it),
 * the parser, the tokenize and detokenize modes, and main, which loads the model, checks every -kv spec, picks the
 * device and hands the job to run.c (generate, chat), eval.c (ppl, passkey, bench) or task.c (task). It runs no model
 * code itself.
 */
#include "cli.h"
#include "attn.h"
#include "eval.h"
#include "run.h"
#include "serve.h"
#include "task.h"
#include "task_code.h"
#include "task_text.h"
#include "trace.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The modes, and which flags each one reads: one table (FLAGS) drives the parser, the per-mode check, -h and
 * README's flag table (./run -h flags prints it; tests/test_flags.sh checks README against it). */
static const char *const MODES[] = {"generate", "chat", "ppl", "passkey", "bench", "tokenize", "detokenize", "task",
                                    "serve"};
#define N_MODES (int)(sizeof MODES / sizeof *MODES)
enum { M_GEN = 1, M_CHAT = 2, M_PPL = 4, M_PASSKEY = 8, M_BENCH = 16, M_TOK = 32, M_DETOK = 64, M_TASK = 128,
       M_SERVE = 256 };
#define M_ALL 511
#define M_CACHE (M_GEN | M_CHAT | M_PPL | M_PASSKEY | M_BENCH | M_TASK | M_SERVE)   /* the modes that run a KV cache */

typedef struct {
    const char *flag, *arg;   /* arg NULL: a switch without a value */
    unsigned modes;           /* M_* bits of the modes that read it */
    const char *help;
} FlagDef;

static const FlagDef FLAGS[] = {
    {"-m", "MODE", M_ALL, "generate (default), chat, ppl, passkey, bench, tokenize, detokenize, task, serve"},
    {"-i", "TEXT", M_GEN | M_CHAT | M_TOK, "prompt or text (token ids on an ids-only model)"},
    {"-f", "FILE", M_PPL | M_BENCH | M_TOK | M_DETOK,
     "text (ppl: repeatable, one document each; bench: the prompt text, repeated; detokenize: ids)"},
    {"-n", "N", M_GEN | M_CHAT | M_PPL | M_PASSKEY | M_BENCH | M_TASK | M_SERVE,
     "generate, chat: tokens to generate, default 256, 0 = up to the context; ppl: score at most N tokens; "
     "passkey: answer tokens, default 8; bench: decode steps, default 32; task: answer tokens, default per task "
     "(16 to 80); serve: tokens each turn generates (greedy), default 32, a trace's \"n\" overrides"},
    {"-t", "T", M_GEN | M_CHAT, "temperature, default 1.0, 0 = greedy"},
    {"-p", "P", M_GEN | M_CHAT, "top-p, default 0.9, in (0,1]"},
    {"-s", "SEED", M_GEN | M_CHAT | M_PASSKEY | M_TASK | M_SERVE, "seed: sampling (default: fresh each run, printed); "
     "passkey: the keys, task: the items, serve: the generated trace and arrivals (default 1)"},
    {"-c", "N", M_CACHE, "context: full's cache and the shadow's length, tokens; default: the trained context "
                         "(passkey, task, bench and serve: at most 2048)"},
    {"-y", "TEXT", M_CHAT | M_TASK | M_SERVE, "system prompt (default: the chat template's own, if it has one; serve: "
     "a request's own \"system\" wins)"},
    {"-kv", "SPEC", M_CACHE, "KV policy NAME[:BUDGET][,key=value...]; repeatable in ppl, passkey, bench, task, serve; serve also takes adapt:CHAIN (-h policies)"},
    {"-kvt", "TYPE", M_CACHE, "default storage type: f32 (default), f16, bf16, q8, q4, q2"},
    {"-calib", "FILE", M_CACHE, "calibration text (ids on an ids-only model) for a policy that chooses its lanes on "
                                "one (duo: recall of sink:B against the shadow over its first -c tokens); required by it"},
    {"-kvlog", "FILE", M_GEN | M_CHAT | M_PPL | M_PASSKEY | M_TASK, "cache events (evictions, merges, recodes) of every policy, JSON lines"},
    {"-d", "DEV", M_CACHE, "ref (attention by its definition, plain loops: slow, for checking), cpu, or cuda (generate "
                           "and chat); default cuda when usable, else cpu"},
    {"-o", "FILE", M_PPL | M_PASSKEY | M_BENCH | M_TASK | M_SERVE, "results, JSON lines, appended"},
    {"-link", "GB/s", M_CACHE, "the slow memory tier's link, for the modelled stall time of a fast= tier; default 64 "
                               "(PCIe 5 x16)"},
    {"-chunk", "N", M_PPL | M_PASSKEY | M_TASK | M_SERVE, "tokens per batched step, default 1 (ppl), 64 (passkey, "
     "task); same results; serve: prompt tokens a step, all sequences together, default 256"},
    {"-ppl-mode", "M", M_PPL, "stream (default) or chunked (llama-perplexity's)"},
    {"-tokenlog", "FILE", M_PPL, "per-token NLL and KL per policy, JSON lines (stream mode)"},
    {"-bucket", "N", M_PPL, "stream mode: perplexity per N-token bucket of position in each document (the decay "
     "curve), in -o (bucket_ppl) always and on stderr when given; default 1024"},
    {"-depths", "LIST", M_PASSKEY | M_TASK, "the key's (task: the asked needle's) relative depths, comma-separated in "
     "[0,1], default 0,0.25,0.5,0.75,1 (cwe has none)"},
    {"-lengths", "LIST", M_PASSKEY | M_BENCH | M_TASK | M_SERVE, "prompt lengths, comma-separated tokens, each <= -c "
     "(bench: with room for -n steps; task: prompt and answer); passkey and task default -c/4,-c/2,-c, bench 128, 512, "
     "2048, ... (x4) and -c; serve: MIN,MAX document tokens of a generated request, default 256,1024"},
    {"-passkey2", "N", M_PASSKEY, "1 (default): the two-turn variant after the grid, at the longest length; 0: "
                                    "skip it"},
    {"-task", "NAME", M_TASK, "the task: niah_single, niah_multikey, niah_multivalue, niah_multiquery (RULER's needles), "
     "vt (variable tracking), cwe (common words), passkey; code (completion of the next line of a pinned C header, "
     "$KVLAB_CODE_ROOT or /usr/include); summary, docqa, dialogue (natural text: the pinned licence texts, "
     "$KVLAB_TEXT_ROOT or /usr/share/common-licenses, or -docs; scored against full by token F1 and ROUGE-L)"},
    {"-items", "N", M_TASK, "items per (length, depth) cell, default 2"},
    {"-questions", "N", M_TASK, "niah_multikey as a shared context: N keys (2 to 10) asked of one context, one "
     "question each (SCBench)"},
    {"-shared", "MODE", M_TASK, "with -questions: turns (default: one chat, each answer in the cache) or requests (each "
     "question asked of the cache as it stood after the context)"},
    {"-trace", "FILE", M_SERVE, "requests, JSON lines: arrival, system, doc or docs, prompt or turns, n, doc_tokens "
     "(README, Serving)"},
    {"-sharegpt", "FILE", M_SERVE, "requests from a ShareGPT conversation file (vLLM's and SGLang's serving "
     "benchmarks): each human turn a turn"},
    {"-requests", "N", M_SERVE, "generated requests, default 64 (with -sharegpt: read at most N)"},
    {"-pattern", "P", M_SERVE, "which document a generated request reads: sequential (default), random, hotspot "
     "(Zipf, s = 1)"},
    {"-docs", "FILE", M_SERVE | M_TASK, "serve: a document of the generated trace; task summary, docqa, dialogue: "
     "a text to draw items from, read whole, in place of the pinned licences; repeatable"},
    {"-pool", "SIZE", M_SERVE, "the KV pool: bytes (512MiB) or P% of the trace's full-cache demand (f32), default "
     "100%"},
    {"-arrival", "STEPS", M_SERVE, "mean steps between arrivals (exponential, seeded), default 2 (generated), 0 "
     "(ShareGPT: all at once); 0 = all at step 0"},
    {"-max-seqs", "N", M_SERVE, "sequences decoded in one batch at most, default 16"},
    {"-prefix", "N", M_SERVE | M_TASK | M_PASSKEY, "1 (default): serve: prefix caching of full's prompt pages "
     "(vLLM's automatic prefix caching); task, passkey: policies that only store over a prompt's first tokens (full, "
     "window, sink, random, snapkv; quest and topk with prompt=dense) start from one shared full-cache prefill of "
     "them, bit for bit as their own; passkey: a prompt also reuses what the one before computed of the tokens the "
     "two share (the shared prefill, and the cache an evicting policy saved there); 0: off"},
    {"-shadow", "N", M_SERVE, "1: each finished request's KL and top-1 against its own full-cache shadow at every "
     "token it was served, in a second pass after the trace (its served tokens fed to full in f32, compared with the "
     "logits serving kept); 2: also replay each request alone through its policy and check its logits equal the "
     "served ones bit for bit; 0 (default): off"},
    {"-ids", NULL, M_GEN | M_CHAT, "print token ids instead of text"},
    {"-bos", NULL, M_GEN | M_TOK, "add BOS to the prompt or text"},
    {"-v", NULL, M_GEN | M_CHAT | M_PPL, "each prompt's token ids, and per-layer memory and policy detail; ppl: "
                                          "each low-rank cache's spectrum (energy at rank 8, 16, 32 per layer)"},
    {"-h", NULL, M_ALL, "help: -h (this), -h policies (every method, its keys and paper), -h flags (README's table)"},
};
#define N_FLAGS (int)(sizeof FLAGS / sizeof *FLAGS)

/* "generate, chat and tokenize" for a set of M_* bits */
static void modes_list(char *buf, size_t cap, unsigned modes) {
    int n = 0, k = 0;
    for (int i = 0; i < N_MODES; i++) n += (modes >> i) & 1;
    buf[0] = 0;
    for (int i = 0; i < N_MODES; i++)
        if ((modes >> i) & 1) {
            size_t len = strlen(buf);
            snprintf(buf + len, cap - len, "%s%s", k == 0 ? "" : k == n - 1 ? " and " : ", ", MODES[i]);
            k++;
        }
}

void usage(FILE *f) {
    fprintf(f, "usage: ./run MODEL.bin [options]     (modes that read a flag in brackets)\n");
    for (int i = 0; i < N_FLAGS; i++) {
        char lhs[32], text[512];
        snprintf(lhs, sizeof lhs, "%s%s%s", FLAGS[i].flag, FLAGS[i].arg ? " " : "", FLAGS[i].arg ? FLAGS[i].arg : "");
        char modes[96] = "";
        for (int m = 0; m < N_MODES && FLAGS[i].modes != M_ALL; m++)
            if ((FLAGS[i].modes >> m) & 1) snprintf(modes + strlen(modes), sizeof modes - strlen(modes), " %s", MODES[m]);
        snprintf(text, sizeof text, "%s [%s]", FLAGS[i].help, FLAGS[i].modes == M_ALL ? "all" : modes + 1);
        /* wrapped at 100 columns, continuation lines under the text */
        const char *p = text;
        int first = 1;
        while (*p) {
            size_t len = strlen(p), cut = len;
            if (len > 82) { cut = 82; while (cut > 0 && p[cut] != ' ') cut--; if (cut == 0) cut = 82; }
            fprintf(f, "  %-15s %.*s\n", first ? lhs : "", (int)cut, p);
            p += cut;
            while (*p == ' ') p++;
            first = 0;
        }
    }
    fprintf(f, "policies: %s (-h policies: their keys, defaults and papers)\n"
               "budget: tokens per lane (1024) or bytes for the whole cache (64MiB, 512KiB)\n"
               "keys of every policy (a few pairs are refused: -h policies): type|ktype|vtype=f32|f16|bf16|q8|q4|q2, residual=R, prec|kprec|vprec=T:N/.../T, "
               "pos=orig|cache, agg=mean|max, fast=BYTES|P%%, prefetch=0|1, kgroup=token|channel, kgsize=G, "
               "rank|krank|vrank=R, calib=N, alloc=uniform|pyramid|ada, safeguard=A (alloc=ada); of every eviction policy: merge=0|1\n"
               "threads: OMP_NUM_THREADS (see README, Threads)\n", kv_policy_names());
}

/* README's flag table, as markdown: a flag per row, a column per mode. */
void usage_flags_markdown(FILE *f) {
    fprintf(f, "| flag |");
    for (int m = 0; m < N_MODES; m++) fprintf(f, " %s |", MODES[m]);
    fprintf(f, " meaning |\n|---|");
    for (int m = 0; m < N_MODES; m++) fprintf(f, ":-:|");
    fprintf(f, "---|\n");
    for (int i = 0; i < N_FLAGS; i++) {
        fprintf(f, "| `%s%s%s` |", FLAGS[i].flag, FLAGS[i].arg ? " " : "", FLAGS[i].arg ? FLAGS[i].arg : "");
        for (int m = 0; m < N_MODES; m++) fprintf(f, " %s |", (FLAGS[i].modes >> m) & 1 ? "x" : "");
        fprintf(f, " %s |\n", FLAGS[i].help);
    }
}

/* -h policies: every registered method with its keys, defaults and the paper it implements. */
void usage_policies(FILE *f) {
    fprintf(f, "KV policies (-kv NAME[:BUDGET][,key=value...]; a budget is tokens per lane or bytes for the whole "
               "cache, e.g. 64MiB):\n");
    for (int i = 0; kv_policy_at(i); i++) {
        const KVPolicyOps *p = kv_policy_at(i);
        fprintf(f, "\n  %s%s  (%s)\n    %s\n    keys: %s\n    example: %s\n    source: %s\n", p->name,
                p->needs_budget ? ":BUDGET" : "", p->family, p->summary, *p->options ? p->options : "none of its own",
                p->example, p->paper);
        if (p->calib_full) fprintf(f, "    needs: -calib FILE (its lanes are chosen on that text before the job)\n");
    }
    fprintf(f, "\nkeys every policy takes:\n"
               "  type=T, ktype=T, vtype=T  storage of keys and values: f32 (default, or -kvt), f16, bf16, q8, q4, q2\n"
               "  residual=R                the R newest tokens of a lane kept in f32 (KIVI's residual), default 0\n"
               "  kgroup=token|channel      quantized keys (q8, q4, q2) per token (default) or per channel over groups\n"
               "                            of kgsize=G tokens (default 32), the newest partial group in f32 (KIVI)\n"
               "  prec=T:N/T:N/.../T        precision by age, newest first: prec=f32:64/q8:512/q4 keeps a lane's 64\n"
               "                            newest tokens in f32, the next 512 in q8, the rest in q4 (instead of type=\n"
               "                            and residual=; residual=R with type=T is prec=f32:R/T); at most 4 bands,\n"
               "                            clipped to the lane (the last band takes what is left)\n"
               "  kprec=..., vprec=...      precision by age for keys and values apart (instead of prec=; kprec=\n"
               "                            excludes ktype=, vprec= vtype=): kprec=f32:64/q4,vprec=f32:256/q8; a\n"
               "                            lane's bands are the union of the two schedules' boundaries\n"
               "  pos=orig|cache            RoPE by original position (default) or by rank in the cache (StreamingLLM)\n"
               "  agg=mean|max              how a GQA group's attention is aggregated for the policy, default mean\n"
               "  fast=BYTES|P%%             a fast memory tier of BYTES (64MiB) or P%% of the cache's vector bytes over a\n"
               "                            slow one: the slots a step reads move in when missing, the least recently\n"
               "                            read leave first (split evenly over the lanes); moves and hits reported\n"
               "  prefetch=0|1              with fast=: move what the next layer's predicted query reads ahead\n"
               "                            (InfiniGen), default 0\n"
               "  rank=R, krank=R, vrank=R  low rank: per lane, keys (pre-RoPE) and values as R coefficients on a basis\n"
               "                            fitted (Jacobi eigenvectors of their second moment) on the first calib\n"
               "                            tokens, full rank until then; rank= both, krank=/vrank= apart; R <= head_dim\n"
               "  calib=N                   with a rank: the tokens the basis is fitted on, default 512 (clipped to -c)\n"
               "  alloc=uniform|pyramid|ada how an eviction policy's budget B is split over lanes: uniform (default,\n"
               "                            every lane B), pyramid (PyramidKV: layer 0 2B - B/20 slots down to B/20 at\n"
               "                            the top, linear, the mean B) or ada (Ada-KV: a layer's H kv heads share H x B\n"
               "                            slots, the lowest keep scores of the layer freed first; window, sink, h2o,\n"
               "                            tova, lru; lanes paged from the cache's own pool; a budget in tokens)\n"
               "  safeguard=A               alloc=ada: each kv head's A x B best-scored slots are never freed for another\n"
               "                            head, A in [0, 1), default 0.2 (Ada-KV's safeguard)\n"
               "  (not every pair combines yet: kgroup=channel takes no merging, selection, fast= or rank; a rank takes\n"
               "  no prec=, residual=, merging or fast=; the CUDA attention takes neither, nor merge=1; a refused one says why)\n"
               "\nkeys every eviction policy takes (");
    for (int i = 0, n = 0; kv_policy_at(i); i++)   /* those kv.c takes merge=1 on (spec_merge) */
        if (kv_policy_at(i)->evicts && !kv_policy_at(i)->merge && !kv_policy_at(i)->calib_full) fprintf(f, "%s%s", n++ ? ", " : "", kv_policy_at(i)->name);
    fprintf(f, "):\n"
               "  merge=0|1                 1: merge-on-evict: each victim is merged into the kept slot of its lane\n"
               "                            whose key is most similar (cosine), weighted by the two slots'\n"
               "                            accumulated attention (CaM, D2O); 4 B more per slot; default 0\n"
               "\nkeys every selection policy takes:\n"
               "  prompt=sparse|dense       sparse (default): every query selects; dense: the prompt's queries read\n"
               "                            every token (full attention, counted as full's reads) and only the later\n"
               "                            ones select (Quest's dense prefill); needs a prompt, so not in ppl\n"
               "\nadapt:CHAIN (-m serve only), a policy that follows the pool's occupancy: MEMBER@OCC/MEMBER@OCC/...\n"
               "  each member a spec (a storage type alone: full in it) held from that occupancy (%%) on, the first @0;\n"
               "  `adapt` alone is adapt:" ADAPT_DEFAULT ". A member without type= keeps the types of the\n"
               "  one before it. Besides full, one policy with a keep score (h2o, tova, lru, sink, window); full\n"
               "  members are held as it with the context for budget (never evicting), so its scores are ready at a\n"
               "  switch. Running\n"
               "  sequences switch when the occupancy reaches a later member's threshold (their tokens moved and\n"
               "  re-encoded, the lowest scores dropped); when a step's pages are short, one sequence steps one member\n"
               "  down before any is preempted. Prefix caching is off under adapt.\n");
}

static const FlagDef *flag_find(const char *a) {
    for (int i = 0; i < N_FLAGS; i++) if (!strcmp(a, FLAGS[i].flag)) return &FLAGS[i];
    if (!strcmp(a, "--help")) return flag_find("-h");
    return NULL;
}

/* A comma-separated list of numbers in [lo, hi] (integers when `integer`), at most max of them, none twice, into out;
 * *n how many. 0, or -1 + message naming the flag, the bad item and what it must be (`what`). */
static int parse_list(const char *flag, const char *v, double lo, double hi, int integer, const char *what,
                      double *out, int *n, int max, char *err, size_t errlen) {
    *n = 0;
    for (const char *p = v;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[32];
        double x;
        long k;
        if (len == 0) return errorf(err, errlen, "%s '%s' has an empty item: give %s, comma-separated", flag, v, what);
        if (len >= sizeof item) return errorf(err, errlen, "%s '%s': '%.*s...' is not %s", flag, v, 20, p, what);
        memcpy(item, p, len);
        item[len] = 0;
        if (integer ? parse_long(item, (long)lo, (long)hi, &k) : parse_float(item, lo, hi, &x))
            return errorf(err, errlen, "%s '%s': '%s' is not %s", flag, v, item, what);
        if (integer) x = (double)k;
        for (int i = 0; i < *n; i++)
            if (out[i] == x)
                return errorf(err, errlen, "%s '%s': %s is given twice%s", flag, v, item,
                              strcmp(flag, "-lengths") ? "" : " (serve's MIN,MAX of one length: give it once, -lengths N)");
        if (*n == max) return errorf(err, errlen, "%s '%s': at most %d values", flag, v, max);
        out[(*n)++] = x;
        if (!comma) return 0;
        p = comma + 1;
    }
}

/* Store one flag's value into o. 0, or -1 + message. */
static int option_set(Options *o, const char *a, const char *v, char *err, size_t errlen) {
    long n;
    double x;
    if (!strcmp(a, "-m")) {
        for (int k = 0; k < N_MODES; k++) if (!strcmp(v, MODES[k])) { o->mode = MODES[k]; return 0; }
        return errorf(err, errlen, "unknown mode '-m %s'; modes: generate, chat, ppl, passkey, bench, tokenize, "
                      "detokenize, task, serve", v);
    } else if (!strcmp(a, "-i")) { o->prompt = v;
    } else if (!strcmp(a, "-f")) {
        if (o->n_files == MAX_FILES) return errorf(err, errlen, "too many -f files (at most %d)", MAX_FILES);
        o->files[o->n_files++] = v;
    } else if (!strcmp(a, "-n")) {
        if (parse_long(v, 0, 1 << 30, &n)) return errorf(err, errlen, "bad -n '%s': a token count in [0, %d]", v, 1 << 30);
        o->steps = (int)n;
        o->steps_set = 1;
    } else if (!strcmp(a, "-t")) {
        if (parse_float(v, 0, 100, &x)) return errorf(err, errlen, "bad -t '%s': a temperature in [0, 100]", v);
        o->temperature = (float)x;
    } else if (!strcmp(a, "-p")) {
        if (parse_float(v, 0, 1, &x) || x == 0) return errorf(err, errlen, "bad -p '%s': top-p in (0, 1]", v);
        o->topp = (float)x;
    } else if (!strcmp(a, "-s")) {
        char *end;
        errno = 0;
        unsigned long long s = strtoull(v, &end, 10);
        if (errno || *end || end == v || *v < '0' || *v > '9')
            return errorf(err, errlen, "bad -s '%s': a seed in [0, 2^64)", v);
        o->seed = s;
        o->seed_set = 1;
    } else if (!strcmp(a, "-c")) {
        if (parse_long(v, 1, 1 << 24, &n)) return errorf(err, errlen, "bad -c '%s': a context length in [1, %d]", v, 1 << 24);
        o->ctx = (int)n;
    } else if (!strcmp(a, "-y")) { o->system = v;
    } else if (!strcmp(a, "-kv")) {
        if (o->n_kv == MAX_POLICIES) return errorf(err, errlen, "too many -kv policies (at most %d)", MAX_POLICIES);
        o->kv[o->n_kv++] = v;
    } else if (!strcmp(a, "-kvt")) {
        int ty = kv_type_parse(v);
        if (ty < 0) return errorf(err, errlen, "unknown -kvt '%s'; types: f32, f16, bf16, q8, q4, q2", v);
        o->kvt = (KVType)ty;
    } else if (!strcmp(a, "-kvlog")) { o->kvlog = v;
    } else if (!strcmp(a, "-calib")) { o->calib = v;
    } else if (!strcmp(a, "-d")) {
        if (strcmp(v, "cpu") && strcmp(v, "cuda") && strcmp(v, "ref"))
            return errorf(err, errlen, "unknown device '-d %s'; devices: ref, cpu, cuda", v);
        o->device = v;
    } else if (!strcmp(a, "-o")) { o->out = v;
    } else if (!strcmp(a, "-link")) {
        if (parse_float(v, 0, 1e6, &x) || x == 0) return errorf(err, errlen, "bad -link '%s': GB/s in (0, 1e6]", v);
        o->link_gbs = x;
        o->link_set = 1;
    } else if (!strcmp(a, "-chunk")) {
        if (parse_long(v, 1, 1 << 16, &n)) return errorf(err, errlen, "bad -chunk '%s': a chunk size in [1, 65536]", v);
        o->chunk = (int)n;
    } else if (!strcmp(a, "-ppl-mode")) {
        if (strcmp(v, "stream") && strcmp(v, "chunked"))
            return errorf(err, errlen, "unknown -ppl-mode '%s'; modes: stream, chunked", v);
        o->ppl_mode = v;
    } else if (!strcmp(a, "-tokenlog")) { o->tokenlog = v;
    } else if (!strcmp(a, "-bucket")) {
        if (parse_long(v, 1, 1 << 24, &n)) return errorf(err, errlen, "bad -bucket '%s': tokens in [1, %d]", v, 1 << 24);
        o->bucket = (int)n;
        o->bucket_set = 1;
    } else if (!strcmp(a, "-depths")) {
        return parse_list(a, v, 0, 1, 0, "a depth in [0, 1] (0: right after the instruction, 1: right before the "
                          "question)", o->depths, &o->n_depths, MAX_PASSKEY_CELLS, err, errlen);
    } else if (!strcmp(a, "-lengths")) {
        double len[MAX_PASSKEY_CELLS];
        if (parse_list(a, v, 1, 1 << 24, 1, "a token count in [1, 16777216]", len, &o->n_lengths, MAX_PASSKEY_CELLS,
                       err, errlen))
            return -1;
        for (int i = 0; i < o->n_lengths; i++) o->lengths[i] = (int)len[i];
    } else if (!strcmp(a, "-passkey2")) {
        if (strcmp(v, "0") && strcmp(v, "1"))
            return errorf(err, errlen, "bad -passkey2 '%s': 1 (ask the two-turn variant, the default) or 0 (skip it)", v);
        o->passkey2 = v[0] == '1';
    } else if (!strcmp(a, "-task")) {
        if (task_parse(v) < 0 && strcmp(v, TASK_CODE_NAME) && text_task_parse(v) < 0)
            return errorf(err, errlen, "unknown -task '%s'; tasks: %s, %s, %s", v, task_names(), TASK_CODE_NAME,
                          text_task_names());
        o->task = v;
    } else if (!strcmp(a, "-items")) {
        if (parse_long(v, 1, 1 << 20, &n)) return errorf(err, errlen, "bad -items '%s': items per cell in [1, %d]", v, 1 << 20);
        o->items = (int)n;
    } else if (!strcmp(a, "-questions")) {
        if (parse_long(v, 2, TASK_MAX_NEEDLES, &n))
            return errorf(err, errlen, "bad -questions '%s': questions of one context in [2, %d]", v, TASK_MAX_NEEDLES);
        o->questions = (int)n;
    } else if (!strcmp(a, "-shared")) {
        if (strcmp(v, "turns") && strcmp(v, "requests"))
            return errorf(err, errlen, "unknown -shared '%s'; modes: turns, requests", v);
        o->shared = v;
    } else if (!strcmp(a, "-trace")) { o->trace = v;
    } else if (!strcmp(a, "-sharegpt")) { o->sharegpt = v;
    } else if (!strcmp(a, "-requests")) {
        if (parse_long(v, 1, 1 << 20, &n)) return errorf(err, errlen, "bad -requests '%s': a count in [1, %d]", v, 1 << 20);
        o->requests = (int)n;
    } else if (!strcmp(a, "-pattern")) {
        if (trace_pattern_parse(v) < 0)
            return errorf(err, errlen, "unknown -pattern '%s'; patterns: sequential, random, hotspot", v);
        o->pattern = v;
    } else if (!strcmp(a, "-docs")) {
        if (o->n_docs == MAX_FILES) return errorf(err, errlen, "too many -docs files (at most %d)", MAX_FILES);
        o->docs[o->n_docs++] = v;
    } else if (!strcmp(a, "-pool")) {
        size_t len = strlen(v);
        if (len > 1 && v[len - 1] == '%') {
            char pct[32];
            if (len >= sizeof pct || (memcpy(pct, v, len - 1), pct[len - 1] = 0, parse_float(pct, 0, 1000, &x)) || x <= 0)
                return errorf(err, errlen, "bad -pool '%s': a share of the trace's demand in (0%%, 1000%%]", v);
            o->pool_frac = x / 100;
        } else {
            size_t bytes;
            if (kv_parse_bytes(v, &bytes))
                return errorf(err, errlen, "bad -pool '%s': bytes with a unit (4096B, 64KiB, 512MiB, 1GiB) or P%% of "
                              "the trace's full-cache demand", v);
            o->pool_bytes = bytes;
        }
    } else if (!strcmp(a, "-arrival")) {
        if (parse_float(v, 0, 1e9, &x)) return errorf(err, errlen, "bad -arrival '%s': mean steps in [0, 1e9]", v);
        o->arrival = x;
        o->arrival_set = 1;
    } else if (!strcmp(a, "-max-seqs")) {
        if (parse_long(v, 1, 4096, &n)) return errorf(err, errlen, "bad -max-seqs '%s': sequences in [1, 4096]", v);
        o->max_seqs = (int)n;
    } else if (!strcmp(a, "-prefix")) {
        if (strcmp(v, "0") && strcmp(v, "1")) return errorf(err, errlen, "bad -prefix '%s': 1 (prefix sharing) or 0", v);
        o->prefix = v[0] == '1';
    } else if (!strcmp(a, "-shadow")) {
        if (strcmp(v, "0") && strcmp(v, "1") && strcmp(v, "2"))
            return errorf(err, errlen, "bad -shadow '%s': 1 (the second pass), 2 (it and a replay of the policy) or 0", v);
        o->shadow = v[0] - '0';
    } else if (!strcmp(a, "-ids")) { o->print_ids = 1;
    } else if (!strcmp(a, "-bos")) { o->add_bos = 1;
    } else if (!strcmp(a, "-v")) { o->verbose = 1;
    }
    return 0;
}

int options_parse(Options *o, int argc, char **argv, char *err, size_t errlen) {
    memset(o, 0, sizeof *o);
    o->mode = "generate";
    o->steps = 256;
    o->temperature = 1.0f;
    o->topp = 0.9f;
    o->kvt = KV_F32;
    o->device = "auto";
    o->ppl_mode = "stream";
    o->link_gbs = 64;
    o->passkey2 = 1;
    o->max_seqs = 16;
    o->prefix = 1;
    o->argc = argc;
    o->argv = argv;
    if (argc < 2) return errorf(err, errlen, "no model given; usage: ./run MODEL.bin [options] (-h for help)");
    int first = 2;
    if (flag_find(argv[1]) == flag_find("-h")) first = 1;   /* ./run -h [topic] */
    else o->model_path = argv[1];
    const FlagDef *given[N_FLAGS];
    int n_given = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        const FlagDef *fd = flag_find(a);
        if (!fd) return errorf(err, errlen, "unknown flag '%s' (-h lists the flags)", a);
        if (!strcmp(fd->flag, "-h")) {
            o->help = "usage";
            if (i + 1 < argc && (!strcmp(argv[i + 1], "policies") || !strcmp(argv[i + 1], "flags"))) o->help = argv[i + 1];
            return 0;
        }
        const char *v = NULL;
        if (fd->arg) {
            if (i + 1 >= argc) return errorf(err, errlen, "flag %s needs a value %s (-h lists the flags)", a, fd->arg);
            v = argv[++i];
        }
        if (option_set(o, fd->flag, v, err, errlen)) return -1;
        int seen = 0;
        for (int k = 0; k < n_given; k++) seen |= given[k] == fd;
        if (!seen) given[n_given++] = fd;
    }
    if (!o->model_path) return errorf(err, errlen, "no model given; usage: ./run MODEL.bin [options] (-h for help)");
    /* every flag given must be one the mode reads: a flag that would be ignored is an error */
    int mi = 0;
    while (strcmp(MODES[mi], o->mode)) mi++;
    for (int k = 0; k < n_given; k++)
        if (!((given[k]->modes >> mi) & 1)) {
            char modes[96];
            modes_list(modes, sizeof modes, given[k]->modes);
            return errorf(err, errlen, "%s is not used by -m %s (it is for %s)", given[k]->flag, o->mode, modes);
        }
    /* conflicts inside a mode */
    int multi = !strcmp(o->mode, "ppl") || !strcmp(o->mode, "passkey") || !strcmp(o->mode, "bench") ||
                !strcmp(o->mode, "task") || !strcmp(o->mode, "serve");
    if (o->n_kv > 1 && !multi)
        return errorf(err, errlen, "-kv given %d times: several policies run only in ppl, passkey, bench, task and "
                      "serve modes", o->n_kv);
    if (!strcmp(o->mode, "task") && !o->task)
        return errorf(err, errlen, "-m task needs -task NAME; tasks: %s", task_names());
    if (o->shared && !o->questions)
        return errorf(err, errlen, "-shared %s says how -questions are asked: give -questions N too", o->shared);
    if (o->questions && strcmp(o->task, "niah_multikey"))
        return errorf(err, errlen, "-questions asks the keys of niah_multikey's haystack: use -task niah_multikey, "
                      "not %s", o->task);
    if (o->questions && !o->shared) o->shared = "turns";
    if (o->prompt && o->n_files && !strcmp(o->mode, "tokenize"))
        return errorf(err, errlen, "give the text with -i or -f, not both");
    if (o->n_files > 1 && strcmp(o->mode, "ppl")) return errorf(err, errlen, "-f is repeatable only in ppl mode");
    if (!strcmp(o->mode, "serve")) {   /* one source of requests */
        int src = !!o->trace + !!o->sharegpt + (o->n_docs > 0);
        if (src == 0) return errorf(err, errlen, "-m serve needs requests: -trace FILE, -sharegpt FILE, or -docs FILE "
                                    "(repeatable) for a generated trace");
        if (src > 1) return errorf(err, errlen, "-m serve takes one source of requests: -trace, -sharegpt or -docs");
        if ((o->trace || o->sharegpt) && (o->pattern || o->n_lengths))
            return errorf(err, errlen, "-pattern and -lengths shape a generated trace (-docs), not -%s",
                          o->trace ? "trace" : "sharegpt");
        if (o->trace && (o->requests || o->arrival_set))
            return errorf(err, errlen, "-requests and -arrival shape a generated or ShareGPT trace; a -trace file "
                          "gives its own requests and arrivals");
        if (o->n_lengths > 2 || (o->n_lengths == 2 && o->lengths[0] > o->lengths[1]))
            return errorf(err, errlen, "-m serve: -lengths is MIN,MAX document tokens (MIN <= MAX)");
        if (!o->chunk) o->chunk = 256;
    }
    if (o->tokenlog && !strcmp(o->ppl_mode, "chunked"))
        return errorf(err, errlen, "-tokenlog is for -ppl-mode stream (chunked mode scores no shadow)");
    if (o->bucket_set && !strcmp(o->ppl_mode, "chunked"))
        return errorf(err, errlen, "-bucket is for -ppl-mode stream (chunked mode restarts the cache every -c "
                      "tokens, so it has no decay over position)");
    return 0;
}


static void run_tokenize(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("this model.bin has no tokenizer (ids-only)");
    size_t len = 0;
    char *text = NULL;
    if (o->n_files) text = read_file(o->files[0], &len);
    else if (o->prompt) len = strlen(o->prompt);
    else fatal("tokenize needs text: -i TEXT or -f FILE");
    int *ids;
    size_t n;
    char err[256];
    if (tokenizer_encode(&m->tokenizer, (const unsigned char *)(text ? text : o->prompt), len, o->add_bos, &ids, &n,
                         err, sizeof err))
        fatal("tokenizer: %s", err);
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    free(text);
}

static void run_detokenize(Model *m, const Options *o) {
    if (!m->has_tokenizer) fatal("this model.bin has no tokenizer (ids-only)");
    if (!o->n_files) fatal("detokenize needs a file of ids: -f FILE");
    size_t len;
    char *text = read_file(o->files[0], &len), err[256];
    if (strlen(text) != len) fatal("'%s' holds a NUL byte: a file of ids is decimal numbers", o->files[0]);
    IdList ids = {0};
    if (ids_parse_into(text, m->tokenizer.vocab_size, &ids, err, sizeof err)) fatal("'%s': %s", o->files[0], err);
    TokenDecoder d;
    tokdec_init(&d, &m->tokenizer);
    char buf[TOKDEC_OUT_MAX];
    for (size_t i = 0; i < ids.n; i++) fwrite(buf, 1, tokdec_push(&d, ids.ids[i], buf, sizeof buf), stdout);
    fwrite(buf, 1, tokdec_flush(&d, buf, sizeof buf), stdout);
    free(ids.ids);
    free(text);
}

/* stdout is the product: a write error (a full disk, a closed pipe) is an error exit, not a silent success */
static int finish_output(void) {
    if (fflush(stdout) || ferror(stdout)) {
        fprintf(stderr, "run: error writing the output: %s\n", strerror(errno));
        return EXIT_FAILURE;
    }
    return 0;
}

#define THREADS_SPINCOUNT "10000"   /* polls before a waiting thread sleeps: chosen with tools/loaded.sh (README) */

/* OpenMP threads that wait for each other spin by default (libgomp: about 300,000 polls); where other jobs hold the
 * cores, a spinning thread burns the time slice the thread it waits for needs, and generation collapses (README,
 * Threads: measured with tools/loaded.sh, the quick start at 2.8 tok/s beside one busy process against 55 on a quiet
 * machine). So, when the user set none of OpenMP's knobs, kvlab (1) lets a waiting thread spin only briefly, and (2)
 * starts as many threads as there are cores not already running something (/proc/stat's procs_running, this process
 * included), at least one. libgomp reads its settings once, when it loads, before main: so kvlab sets them and runs
 * itself again (one exec, about a millisecond). Results never depend on the thread count. KVLAB_THREADS_DEFAULT=0
 * keeps OpenMP's own defaults. */
static void threads_default(char **argv) {
#ifdef _OPENMP
    const char *mode = getenv("KVLAB_THREADS_DEFAULT");
    if ((mode && strcmp(mode, "1")) || getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv("KMP_BLOCKTIME"))
        return;
    setenv("KVLAB_THREADS_DEFAULT", "done", 1);   /* the exec'd process keeps what it is given */
    setenv("GOMP_SPINCOUNT", THREADS_SPINCOUNT, 1);
    setenv("KMP_BLOCKTIME", "1", 1);                  /* the same for LLVM's libomp: 1 ms of spinning */
    /* the fewest runnable processes seen in 10 looks 1 ms apart: a neighbour that holds a core shows in every look, a
       shell or pipe that is only starting up does not */
    long cores = sysconf(_SC_NPROCESSORS_ONLN), running = LONG_MAX;
    for (int k = 0; k < 10; k++) {
        long r = 1;
        FILE *f = fopen("/proc/stat", "r");
        char line[256];
        while (f && fgets(line, sizeof line, f))
            if (sscanf(line, "procs_running %ld", &r) == 1) break;
        if (f) fclose(f);
        if (r < running) running = r;
        usleep(1000);
    }
    long free_cores = cores - (running - 1);
    if (!getenv("OMP_NUM_THREADS") && cores > 1 && free_cores < cores) {
        char n[24];
        snprintf(n, sizeof n, "%ld", free_cores > 1 ? free_cores : 1);
        setenv("OMP_NUM_THREADS", n, 1);
    }
    execv("/proc/self/exe", argv);                    /* returns only on failure: then run with OpenMP's defaults */
#endif
    (void)argv;
}

/* An output file (-o, -tokenlog, -kvlog) must not be an input (the model, a -f file) or another output: writing
 * would destroy the input (a truncated, mmapped model crashes the run) or interleave two writers' lines. Files are
 * compared by device and inode, so links and other spellings of one file are caught. */
static void outputs_check(const Options *o) {
    const char *out_flag[3] = {"-o", "-tokenlog", "-kvlog"}, *out[3] = {o->out, o->tokenlog, o->kvlog};
    struct stat so[3], si;
    int have[3];
    for (int i = 0; i < 3; i++) have[i] = out[i] && stat(out[i], &so[i]) == 0;
    const char *in[MAX_FILES + 2];
    int n_in = 0;
    in[n_in++] = o->model_path;
    if (o->calib) in[n_in++] = o->calib;
    for (int k = 0; k < o->n_files; k++) in[n_in++] = o->files[k];
    for (int i = 0; i < 3; i++) {
        if (!out[i]) continue;
        for (int j = 0; j < i; j++)
            if (out[j] && (!strcmp(out[i], out[j]) || (have[i] && have[j] && so[i].st_dev == so[j].st_dev &&
                                                          so[i].st_ino == so[j].st_ino)))
                fatal("%s '%s' and %s '%s' are the same file: give each output its own", out_flag[j], out[j],
                      out_flag[i], out[i]);
        if (!have[i]) continue;
        for (int k = 0; k < n_in; k++)
            if (stat(in[k], &si) == 0 && si.st_dev == so[i].st_dev && si.st_ino == so[i].st_ino)
                fatal("%s '%s' is the input '%s': writing it would destroy it", out_flag[i], out[i], in[k]);
    }
}

int cli_main(int argc, char **argv) {
    threads_default(argv);
    Options o;
    char err[512];
    if (options_parse(&o, argc, argv, err, sizeof err)) {
        fprintf(stderr, "run: %s\n", err);
        return EXIT_FAILURE;
    }
    if (o.help) {
        if (!strcmp(o.help, "policies")) usage_policies(stdout);
        else if (!strcmp(o.help, "flags")) usage_flags_markdown(stdout);
        else usage(stdout);
        return finish_output();
    }
    Model m;
    if (model_open(&m, o.model_path, err, sizeof err)) fatal("%s", err);
    if (!strcmp(o.mode, "tokenize")) { run_tokenize(&m, &o); model_close(&m); return finish_output(); }
    if (!strcmp(o.mode, "detokenize")) { run_detokenize(&m, &o); model_close(&m); return finish_output(); }
    if (m.vocab_only) fatal("'%s' holds only a tokenizer (--vocab-only): it can tokenize and detokenize, not run",
                          o.model_path);
    outputs_check(&o);
    /* every -kv spec is checked before anything runs or any note is printed; -calib must have a spec that reads it */
    int calib_readers = 0, tiers = 0;
    for (int k = 0; k < o.n_kv; k++) {
        KVSpec spec;
        Adapt ad;
        int arc = serve_adapt_parse(o.kv[k], o.kvt, &ad, err, sizeof err);
        if (arc < 0) fatal("-kv: %s", err);
        if (arc == 0 && strcmp(o.mode, "serve"))
            fatal("-kv %s: adapt: switches a sequence's policy with a serving pool's occupancy, so it runs under -m "
                  "serve only", o.kv[k]);
        if (arc == 0) continue;
        if (kv_spec_parse(&spec, o.kv[k], o.kvt, err, sizeof err) || kv_spec_check_mode(&spec, o.mode, err, sizeof err))
            fatal("-kv: %s", err);
        tiers |= spec.fast_bytes || spec.fast_frac > 0;
        if (!kv_policy_find(spec.name)->calib_full) continue;
        calib_readers++;
        if (!o.calib)
            fatal("-kv %s chooses its full lanes on a calibration text: give it with -calib FILE (the lanes where "
                  "%s's streaming form keeps the least of the shadow's attention over the text's first -c tokens "
                  "keep every token)", o.kv[k], spec.name);
    }
    if (o.link_set && !tiers)   /* -link is read by fast= tiers only: given without one it would change nothing */
        fatal("-link sets the slow memory tier's bandwidth for the stall time of a fast= tier, and no -kv "
              "spec has one (add fast=BYTES or fast=P%% to a spec, or drop -link)");
    if (o.calib) {   /* said now, before any work; read_file reads it whole when the calibration runs */
        FILE *f = fopen(o.calib, "rb");
        if (!f) fatal("-calib '%s': cannot open it: %s", o.calib, strerror(errno));
        fclose(f);
    }
    if (o.calib && !calib_readers) {
        char names[128] = "";
        for (int i = 0; kv_policy_at(i); i++)
            if (kv_policy_at(i)->calib_full)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *names ? ", " : "",
                         kv_policy_at(i)->name);
        fatal("-calib %s is read only by a policy that chooses its lanes on a calibration text (%s): no -kv here does",
              o.calib, names);
    }
    /* the device: -d cpu, -d cuda, or (default) cuda when this build has it and a GPU is usable */
    char dev_name[256], why[256];
    int want = !strcmp(o.device, "cuda") || !strcmp(o.device, "auto");
    int cuda = want && attn_cuda_usable(dev_name, sizeof dev_name, why, sizeof why);
    if (!cuda && !strcmp(o.device, "cuda")) fatal("-d cuda: %s; use -d cpu", why);
    if (!cuda && ATTN_CUDA_BUILT && want) run_note("%s: attention runs on the CPU", why);
    if (cuda && strcmp(o.mode, "generate") && strcmp(o.mode, "chat"))
        run_note("-m %s runs attention on the CPU (the CUDA path serves generate and chat)", o.mode);
    if (o.ctx > m.config.seq_len) run_note("-c %d is past the trained context of %d tokens", o.ctx, m.config.seq_len);
    run_catch_signals();
    /* allocation by calibration: each such spec's lanes are chosen on -calib before the job (eval_calib) */
    for (int k = 0; k < o.n_kv; k++) {
        o.kv_caps[k] = eval_calib(&m, &o, k);
        if (run_signal) {
            fprintf(stderr, "run: stopped by %s during the calibration of '%s': nothing else was run\n",
                    run_signal_name(run_signal), o.kv[k]);
            model_close(&m);
            return 128 + run_signal;
        }
    }
    int rc = 0;
    if (!strcmp(o.mode, "ppl")) rc = run_ppl(&m, &o);
    else if (!strcmp(o.mode, "bench")) rc = run_bench(&m, &o);
    else if (!strcmp(o.mode, "passkey")) rc = run_passkey(&m, &o);
    else if (!strcmp(o.mode, "task")) rc = !strcmp(o.task, TASK_CODE_NAME) ? run_task_code(&m, &o)
                                         : text_task_parse(o.task) >= 0 ? run_task_text(&m, &o) : run_task(&m, &o);
    else if (!strcmp(o.mode, "serve")) rc = run_serve(&m, &o);
    else {
        rc = run_generate_chat(&m, &o, cuda);
    }
    for (int k = 0; k < o.n_kv; k++) free((void *)o.kv_caps[k]);
    model_close(&m);
    int out_rc = finish_output();
    return rc ? rc : out_rc;
}
