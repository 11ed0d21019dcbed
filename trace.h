/* trace.h: the request trace that -m serve replays against one shared KV pool: a list of requests, each a text
 * (system prompt, documents, user turns) with an arrival step and the tokens to generate. Three sources: a JSON-lines
 * file (-trace FILE), a seeded generator over document files, and ShareGPT conversation files (the input of vLLM's
 * and SGLang's serving benchmarks). Requests are text, not tokens: the serving side tokenizes them and cuts each
 * document to doc_tokens. This file neither tokenizes nor schedules.
 *
 * Units: arrival in decode steps (the scheduler's clock), n_gen and doc_tokens in tokens, byte counts in bytes.
 * Texts are bytes (invalid UTF-8 passes through), NUL-terminated, with no NUL inside.
 */
#ifndef KVLAB_TRACE_H
#define KVLAB_TRACE_H

#include <stddef.h>
#include <stdint.h>

/* One request. The trace owns everything; documents live once in the trace's document table (Trace.doc), shared by
 * every request that names them, so two requests on one document point at the same bytes. */
typedef struct {
    int id;             /* 0 .. n-1, in trace order */
    long arrival;       /* decode step at which it arrives: >= 0, non-decreasing over the trace */
    char *system;       /* the system prompt, or NULL */
    char **docs;        /* (n_docs) document texts: pointers into Trace.doc[].text, not owned by the request */
    int *doc_ids;       /* (n_docs) each document's index in Trace.doc */
    int n_docs;
    char **turns;       /* (n_turns) the user messages, asked one after another (the first after the documents) */
    int n_turns;
    int n_gen;          /* tokens to generate after each turn (>= 1) */
    int doc_tokens;     /* tokens of each document to use, its prefix (0 = the whole document); the tokenizer side
                           cuts it */
    char **refs;        /* (n_turns) ShareGPT: the reply that followed each turn in the source ("" when none);
                           else NULL */
    size_t *ref_bytes;  /* (n_turns) ShareGPT: bytes of each refs[i]; else NULL */
    char *source_id;    /* ShareGPT: the conversation's "id" as text (NULL when it has none); else NULL */
    int line;           /* the source line it was read from (ShareGPT: where its object opens); 0 when generated */
} TraceReq;

/* A document file, read once. */
typedef struct {
    char *path;         /* as given (relative paths: to the current directory) */
    char *text;         /* its bytes, NUL-terminated */
    size_t bytes;       /* strlen(text) */
} TraceDoc;

typedef enum { TRACE_FILE, TRACE_GENERATED, TRACE_SHAREGPT } TraceSource;
typedef enum { TRACE_SEQUENTIAL, TRACE_RANDOM, TRACE_HOTSPOT, TRACE_NPATTERNS } TracePattern;

typedef struct {
    TraceReq *req;      /* (n) the requests, in arrival order */
    int n;
    TraceDoc *doc;      /* (n_doc) the document table */
    int n_doc;
    TraceSource source;
    char *path;         /* the file read (TRACE_FILE, TRACE_SHAREGPT), or NULL */
    /* generated traces: how */
    TracePattern pattern;
    uint64_t seed;
    int min_tokens, max_tokens;     /* doc_tokens drawn uniformly in [min_tokens, max_tokens] */
    double mean_interarrival;       /* steps; 0: every request at step 0 */
    /* ShareGPT: conversations left out */
    int skipped_no_human;           /* no "human" turn with text */
    int skipped_not_human_first;    /* the first turn after the system turns is not "human" */
    int skipped_malformed;          /* not an object with a "conversations" array of {"from", "value"} strings, an
                                       unknown "from", or a "system" turn after the first human turn */
} Trace;

/* -trace FILE: JSON lines, one request per line (blank lines and lines whose first non-blank character is # are
 * skipped). Keys, all optional but at least one text must be given and be non-empty:
 *   "arrival"    integer >= 0, default 0, not less than the previous request's
 *   "system"     string
 *   "docs"       array of file paths (read relative to the current directory), or "doc": one path (not both)
 *   "prompt"     string: the question, one turn; or "turns": array of strings, the chat turns (not both)
 *   "n"          integer >= 1: tokens to generate per turn, default n_gen
 *   "doc_tokens" integer >= 0: each document's prefix in tokens, default 0 (whole)
 * Any other key, a key given twice, a wrong type, invalid or truncated JSON, anything after the object, an arrival
 * going backwards, a document that cannot be read (or holds a NUL byte), a request with no text: -1 and the message
 * "trace FILE:LINE: ..." (JSON errors add the byte within the line). No requests at all is an error too.
 * n_gen >= 1. On error *t holds nothing to free. */
int trace_load(Trace *t, const char *path, int n_gen, char *err, size_t errlen);
/* The same on text[0 .. len) in memory (need not be NUL-terminated); `name` stands for FILE in messages. */
int trace_parse_lines(Trace *t, const char *text, size_t len, const char *name, int n_gen, char *err, size_t errlen);

/* A generated trace of n_requests requests over the documents doc_paths[0 .. n_docs), each read once. Request i:
 *   - one document, by `pattern`: "sequential" (document i mod n_docs), "random" (uniform), "hotspot" (Zipf with
 *     exponent s = 1: document k with probability (1/(k+1)) / H_n, H_n = 1 + 1/2 + ... + 1/n_docs; document 0 the
 *     hottest);
 *   - doc_tokens uniform in [min_tokens, max_tokens] (both 0: whole documents; else 1 <= min_tokens <= max_tokens);
 *   - one turn, a question drawn uniformly from a fixed list of generic questions about "the text above", so requests
 *     on one document share its prefix and differ after it;
 *   - n_gen tokens; arrival by trace_assign_arrivals(mean_interarrival) on a stream of its own, so the documents,
 *     lengths and questions do not depend on the mean.
 * Draws come from splitmix64 (kv.h) seeded with `seed`: the same seed gives the same trace on every machine (IEEE
 * doubles; the arrivals also go through libm's log, see trace_assign_arrivals). 0, or -1 + message (unknown pattern,
 * an unreadable document, a count or range out of bounds); on error *t holds nothing to free. */
int trace_generate(Trace *t, int n_requests, const char *pattern, char **doc_paths, int n_docs, uint64_t seed,
                   int min_tokens, int max_tokens, double mean_interarrival, int n_gen, char *err, size_t errlen);

/* ShareGPT (a JSON array of {"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]};
 * "conversation" is read where "conversations" is missing, as SGLang's benchmark does; other keys are ignored). Each
 * conversation becomes one request, in file order: leading "system" values (joined by a blank line) the system
 * prompt, each "human" value a turn, the "gpt" values after it (joined by a blank line) its refs/ref_bytes, n_gen
 * per turn, arrival 0 (trace_assign_arrivals sets others), no documents. Left out and counted (Trace.skipped_*):
 * conversations with no human turn with text, those whose first turn after the system turns is not human, and
 * malformed ones. vLLM's sampler (its benchmarks' ShareGPTDataset) keeps conversations of 2 entries or more, takes
 * entry 0 as the prompt and entry 1 as the reply whatever their "from", shuffles them (seeded), and drops prompts
 * under 4 tokens, replies under 4 tokens, prompts over 1024 and prompt + reply over 2048. Here every turn is kept, in
 * file order, and the first must be human; the length rules need a tokenizer and are left to the caller (n_gen = the
 * reply's tokens: tokenize refs[i]; ref_bytes[i] / 4 is a rough stand-in). At most max_requests requests are read
 * (<= 0: all); the file after the last one read is not looked at. Invalid JSON or a top level that is not an array:
 * -1 and "sharegpt FILE:LINE:COL: ...". No request left is an error too. On error *t holds nothing to free. */
int trace_load_sharegpt(Trace *t, const char *path, int n_gen, int max_requests, char *err, size_t errlen);
int trace_parse_sharegpt(Trace *t, const char *text, size_t len, const char *name, int n_gen, int max_requests,
                         char *err, size_t errlen);

/* Arrivals for every request: request 0 at step 0, request i at floor(T_i), T_i the sum of i exponential gaps of
 * mean mean_interarrival steps (inverse CDF, -mean * log(1 - u), u uniform in [0, 1) from splitmix64(seed)); mean 0:
 * all at step 0. Rounding the running time, not each gap, keeps the mean gap at the mean. Same seed, same arrivals
 * wherever libm's log gives glibc's doubles (glibc's log is within 0.52 ulp, not always correctly rounded); where it
 * does not, a step can differ only where T_i lies within an ulp or so of an integer. 0, or -1 + message (mean
 * negative or not finite, or arrivals past LONG_MAX steps). */
int trace_assign_arrivals(Trace *t, double mean_interarrival, uint64_t seed, char *err, size_t errlen);

/* The pattern for a name ("sequential", "random", "hotspot"), or -1; the name of a pattern. */
int trace_pattern_parse(const char *name);
const char *trace_pattern_name(TracePattern p);

/* One line for the start-up notes: requests, where from, documents, pattern, arrivals ("1000 requests generated
 * (hotspot, Zipf s=1, seed 7) over 10 documents, 64..512 document tokens, arrivals 0..2493 (mean gap 2.5 steps)"). */
void trace_describe(const Trace *t, char *buf, size_t len);

void trace_free(Trace *t);

#endif
