/* fuzz_trace.c: libFuzzer target for the serving trace's parsers (trace.h): the same bytes through the JSON-lines
 * parser (trace_parse_lines, -trace FILE) and the ShareGPT parser (trace_parse_sharegpt), then seeded arrivals and
 * the start-up line on whatever was accepted. A parsed trace must hold what trace.h promises: ids in order,
 * arrivals >= 0 and non-decreasing, n_gen >= 1, every request some text, documents from the table, each reply's
 * bytes its length; a rejected one leaves nothing behind. Input: byte 0 is ShareGPT's max_requests (mod 8, 0 = all)
 * and the arrival seed; the rest is the file. Documents named in the input are read from the current directory (the
 * seeds name LICENSE). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "trace.h"

static void check(const Trace *t, int lines) {
    if (t->n < 1) abort();
    for (int i = 0; i < t->n; i++) {
        const TraceReq *r = &t->req[i];
        if (r->id != i || r->arrival < 0 || (i > 0 && r->arrival < t->req[i - 1].arrival) || r->n_gen < 1 ||
            r->doc_tokens < 0 || r->n_docs < 0 || r->n_turns < 0)
            abort();
        size_t text = r->system ? strlen(r->system) : 0;
        for (int k = 0; k < r->n_docs; k++) {
            if (r->doc_ids[k] < 0 || r->doc_ids[k] >= t->n_doc || r->docs[k] != t->doc[r->doc_ids[k]].text) abort();
            text += t->doc[r->doc_ids[k]].bytes;
        }
        for (int k = 0; k < r->n_turns; k++) {
            text += strlen(r->turns[k]);
            if (!lines && strlen(r->refs[k]) != r->ref_bytes[k]) abort();
        }
        if (text == 0 || (lines && r->refs) || (!lines && (r->n_turns < 1 || r->n_docs != 0))) abort();
    }
    for (int d = 0; d < t->n_doc; d++)
        if (strlen(t->doc[d].text) != t->doc[d].bytes) abort();
}

static void use(Trace *t, int lines, uint64_t seed) {
    check(t, lines);
    char desc[512], err[256];
    trace_describe(t, desc, sizeof desc);
    if (trace_assign_arrivals(t, 1.0 + (double)(seed & 7), seed, err, sizeof err)) abort();
    check(t, lines);
    trace_free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > (1u << 20)) return 0;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    Trace t;
    char err[512];
    if (trace_parse_lines(&t, text, len, "fuzz.jsonl", 16, err, sizeof err) == 0) use(&t, 1, data[0]);
    else if (t.n || t.req || t.doc || t.path || !err[0]) abort();
    if (trace_parse_sharegpt(&t, text, len, "fuzz.json", 16, data[0] % 8, err, sizeof err) == 0) use(&t, 0, data[0]);
    else if (t.n || t.req || t.doc || t.path || !err[0]) abort();
    return 0;
}
