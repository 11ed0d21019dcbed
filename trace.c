/* trace.c: the request trace of -m serve (trace.h): a small JSON reader, the document table, and the three sources
 * (JSON lines, the seeded generator, ShareGPT files) built on them. It reads and checks text; it does not tokenize,
 * cut documents to doc_tokens, or schedule. Parsers return messages (trace FILE:LINE: ...) and never exit, except on
 * out of memory, as the rest of kvlab.
 *
 * Dimensions: n (requests), n_doc (documents in the table), n_docs / n_turns (of one request).
 */
#include "trace.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kv.h"     /* splitmix64 */
#include "util.h"   /* errorf, fatal */

/* ---------------------------------------------------------------------------------------------------------------
 * Memory: a byte buffer (util.h's Line is printf-only; the string decoder appends runs of raw bytes) and copies.
 * Out of memory exits, as everywhere in kvlab.
 * ------------------------------------------------------------------------------------------------------------- */

typedef struct { char *s; size_t n, cap; } Buf;

static void *xrealloc(void *p, size_t bytes) {
    p = realloc(p, bytes ? bytes : 1);
    if (!p) fatal("out of memory");
    return p;
}
static void buf_add(Buf *b, const char *p, size_t k) {
    if (b->n + k + 1 > b->cap) {
        b->cap = 2 * (b->n + k + 1) + 64;
        b->s = xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, p, k);
    b->n += k;
    b->s[b->n] = 0;
}
static char *memdup_str(const char *p, size_t k) {
    char *s = xrealloc(NULL, k + 1);
    memcpy(s, p, k);
    s[k] = 0;
    return s;
}
static char *xstrdup(const char *s) { return memdup_str(s, strlen(s)); }
/* Grow an array of `size`-byte elements holding n to hold n + 1 (capacity doubling, *cap in elements). */
static void *grow(void *p, size_t n, size_t *cap, size_t size) {
    if (n < *cap) return p;
    *cap = *cap ? 2 * *cap : 8;
    return xrealloc(p, *cap * size);
}


/* ---------------------------------------------------------------------------------------------------------------
 * JSON (RFC 8259), read by recursive descent into a small tree: objects, arrays, strings (every escape, \uXXXX with
 * surrogate pairs to UTF-8), numbers, true/false/null. Deliberate departures, all for text that is bytes: raw bytes
 * >= 0x80 pass through unchecked (invalid UTF-8 included); a lone surrogate escape becomes U+FFFD; \u0000 is an
 * error (texts are C strings). Errors carry the byte offset; the callers turn it into FILE:LINE.
 * ------------------------------------------------------------------------------------------------------------- */

/* Far deeper than either format nests (ShareGPT: 4 levels), shallow enough to bound the recursion. */
#define JSON_MAX_DEPTH 64

typedef enum { JSON_NULL, JSON_FALSE, JSON_TRUE, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonType;

typedef struct Json Json;
struct Json {
    JsonType type;
    size_t at;       /* byte offset of its first character in the input */
    char *str;       /* JSON_STRING: the decoded bytes; JSON_NUMBER: the number as written (NUL-terminated) */
    size_t len;      /* JSON_STRING, JSON_NUMBER: bytes of str; JSON_ARRAY, JSON_OBJECT: members */
    int is_int;      /* JSON_NUMBER written without fraction or exponent, and within long long */
    long long i;     /* JSON_NUMBER: its value when is_int */
    Json *item;      /* (len) JSON_ARRAY: the elements; JSON_OBJECT: the members' values */
    char **key;      /* (len) JSON_OBJECT: the members' keys */
};

typedef struct {
    const char *s;   /* (n) the input */
    size_t n, pos;   /* bytes; where the reader is */
    size_t err_at;   /* the offending byte, after an error */
    char msg[192];   /* what is wrong there */
    Buf scratch;     /* a string being decoded */
} JsonIn;

static int json_fail(JsonIn *in, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int json_fail(JsonIn *in, size_t at, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(in->msg, sizeof in->msg, fmt, ap);
    va_end(ap);
    in->err_at = at;
    return -1;
}

/* "'x'" for a printable ASCII byte, "byte 0xNN" for any other */
static const char *byte_name(unsigned char c, char *buf, size_t len) {
    if (c >= 0x20 && c < 0x7f) snprintf(buf, len, "'%c'", c);
    else snprintf(buf, len, "byte 0x%02x", c);
    return buf;
}

static void json_ws(JsonIn *in) {
    while (in->pos < in->n && (in->s[in->pos] == ' ' || in->s[in->pos] == '\t' || in->s[in->pos] == '\n' ||
                               in->s[in->pos] == '\r'))
        in->pos++;
}

static void json_free(Json *v) {
    free(v->str);
    if (v->type == JSON_ARRAY || v->type == JSON_OBJECT) {
        for (size_t k = 0; k < v->len; k++) {
            json_free(&v->item[k]);
            if (v->key) free(v->key[k]);
        }
        free(v->item);
        free(v->key);
    }
    memset(v, 0, sizeof *v);
}

static int hex4(const char *p, unsigned *out) {
    unsigned x = 0;
    for (int k = 0; k < 4; k++) {
        char c = p[k];
        unsigned d = c >= '0' && c <= '9' ? (unsigned)(c - '0') : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
                   : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10) : 16u;
        if (d == 16) return -1;
        x = 16 * x + d;
    }
    *out = x;
    return 0;
}

static void buf_utf8(Buf *b, unsigned cp) {
    char u[4];
    size_t k;
    if (cp < 0x80) { u[0] = (char)cp; k = 1; }
    else if (cp < 0x800) { u[0] = (char)(0xC0 | cp >> 6); u[1] = (char)(0x80 | (cp & 0x3F)); k = 2; }
    else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | cp >> 12); u[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F)); k = 3;
    } else {
        u[0] = (char)(0xF0 | cp >> 18); u[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        u[2] = (char)(0x80 | (cp >> 6 & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F)); k = 4;
    }
    buf_add(b, u, k);
}

/* A \uXXXX escape at in->pos (the backslash); a high surrogate takes the low one that must follow, else U+FFFD. */
static int json_unicode(JsonIn *in, Buf *b) {
    size_t at = in->pos;
    unsigned cp, lo;
    if (in->n - in->pos < 6) return json_fail(in, at, "truncated \\u escape");
    if (hex4(in->s + in->pos + 2, &cp)) return json_fail(in, at, "\\u must be followed by 4 hex digits");
    in->pos += 6;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (in->n - in->pos >= 6 && in->s[in->pos] == '\\' && in->s[in->pos + 1] == 'u' &&
            !hex4(in->s + in->pos + 2, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            in->pos += 6;
        } else cp = 0xFFFD;
    } else if (cp >= 0xDC00 && cp <= 0xDFFF) cp = 0xFFFD;
    if (cp == 0) return json_fail(in, at, "\\u0000 in a string (texts here cannot hold a NUL character)");
    buf_utf8(b, cp);
    return 0;
}

/* A string at in->pos (the opening quote), decoded into in->scratch. */
static int json_string_raw(JsonIn *in) {
    size_t start = in->pos;
    Buf *b = &in->scratch;
    b->n = 0;
    buf_add(b, "", 0);
    in->pos++;
    for (;;) {
        if (in->pos >= in->n) return json_fail(in, start, "unterminated string");
        unsigned char c = (unsigned char)in->s[in->pos];
        if (c == '"') { in->pos++; return 0; }
        if (c < 0x20) {
            char nm[16];
            return json_fail(in, in->pos, "raw %s in a string (JSON writes control characters escaped)",
                             byte_name(c, nm, sizeof nm));
        }
        if (c != '\\') {
            size_t run = in->pos;
            while (run < in->n && in->s[run] != '"' && in->s[run] != '\\' && (unsigned char)in->s[run] >= 0x20) run++;
            buf_add(b, in->s + in->pos, run - in->pos);
            in->pos = run;
            continue;
        }
        if (in->pos + 1 >= in->n) return json_fail(in, start, "unterminated string");
        char e = in->s[in->pos + 1], out;
        switch (e) {
        case '"': out = '"'; break;
        case '\\': out = '\\'; break;
        case '/': out = '/'; break;
        case 'b': out = '\b'; break;
        case 'f': out = '\f'; break;
        case 'n': out = '\n'; break;
        case 'r': out = '\r'; break;
        case 't': out = '\t'; break;
        case 'u':
            if (json_unicode(in, b)) return -1;
            continue;
        default: {
            char nm[16];
            return json_fail(in, in->pos, "unknown escape \\ followed by %s",
                             byte_name((unsigned char)e, nm, sizeof nm));
        }
        }
        buf_add(b, &out, 1);
        in->pos += 2;
    }
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static int json_number(JsonIn *in, Json *v) {
    size_t p = in->pos;
    int frac = 0;
    if (p < in->n && in->s[p] == '-') p++;
    if (p < in->n && in->s[p] == '0') p++;
    else if (p < in->n && is_digit(in->s[p])) while (p < in->n && is_digit(in->s[p])) p++;
    else return json_fail(in, in->pos, "a number needs a digit after '-'");
    if (p < in->n && in->s[p] == '.') {
        frac = 1;
        if (++p >= in->n || !is_digit(in->s[p])) return json_fail(in, p, "a number needs a digit after '.'");
        while (p < in->n && is_digit(in->s[p])) p++;
    }
    if (p < in->n && (in->s[p] == 'e' || in->s[p] == 'E')) {
        frac = 1;
        if (++p < in->n && (in->s[p] == '+' || in->s[p] == '-')) p++;
        if (p >= in->n || !is_digit(in->s[p])) return json_fail(in, p, "a number needs a digit in its exponent");
        while (p < in->n && is_digit(in->s[p])) p++;
    }
    v->type = JSON_NUMBER;
    v->len = p - in->pos;
    v->str = memdup_str(in->s + in->pos, v->len);
    if (!frac) {
        errno = 0;
        char *end;
        v->i = strtoll(v->str, &end, 10);
        v->is_int = errno == 0 && *end == 0;
    }
    in->pos = p;
    return 0;
}

static int json_value(JsonIn *in, Json *v, int depth);

/* An array or an object at in->pos (its opening bracket). */
static int json_container(JsonIn *in, Json *v, int depth) {
    int obj = in->s[in->pos] == '{';
    char close = obj ? '}' : ']';
    size_t cap = 0;
    v->type = obj ? JSON_OBJECT : JSON_ARRAY;
    if (depth >= JSON_MAX_DEPTH) return json_fail(in, in->pos, "nested deeper than %d levels", JSON_MAX_DEPTH);
    in->pos++;
    json_ws(in);
    if (in->pos < in->n && in->s[in->pos] == close) { in->pos++; return 0; }
    for (;;) {
        char *key = NULL;
        if (obj) {
            if (in->pos >= in->n) return json_fail(in, in->pos, "unterminated object (expected a key)");
            if (in->s[in->pos] != '"') {
                char nm[16];
                return json_fail(in, in->pos, "expected a key (a string), found %s",
                                 byte_name((unsigned char)in->s[in->pos], nm, sizeof nm));
            }
            if (json_string_raw(in)) return -1;
            key = memdup_str(in->scratch.s, in->scratch.n);
            json_ws(in);
            if (in->pos >= in->n || in->s[in->pos] != ':') {
                free(key);
                return json_fail(in, in->pos, in->pos >= in->n ? "unterminated object (expected ':')"
                                                                 : "expected ':' after the key");
            }
            in->pos++;
        }
        size_t have = cap;
        v->item = grow(v->item, v->len, &cap, sizeof *v->item);
        if (obj && cap != have) v->key = xrealloc(v->key, cap * sizeof *v->key);
        Json *it = &v->item[v->len];
        memset(it, 0, sizeof *it);
        if (json_value(in, it, depth + 1)) { free(key); json_free(it); return -1; }
        if (obj) v->key[v->len] = key;
        v->len++;
        json_ws(in);
        if (in->pos >= in->n) return json_fail(in, in->pos, obj ? "unterminated object" : "unterminated array");
        if (in->s[in->pos] == ',') { in->pos++; json_ws(in); continue; }
        if (in->s[in->pos] == close) { in->pos++; return 0; }
        char nm[16];
        return json_fail(in, in->pos, "expected ',' or '%c', found %s", close,
                         byte_name((unsigned char)in->s[in->pos], nm, sizeof nm));
    }
}

/* One value at in->pos (after white space) into *v (zeroed by the caller); on error *v is still json_free-able. */
static int json_value(JsonIn *in, Json *v, int depth) {
    json_ws(in);
    v->at = in->pos;
    if (in->pos >= in->n) return json_fail(in, in->pos, "unexpected end of input (expected a value)");
    char c = in->s[in->pos];
    if (c == '{' || c == '[') return json_container(in, v, depth);
    if (c == '"') {
        if (json_string_raw(in)) return -1;
        v->type = JSON_STRING;
        v->str = memdup_str(in->scratch.s, in->scratch.n);
        v->len = in->scratch.n;
        return 0;
    }
    if (c == '-' || is_digit(c)) return json_number(in, v);
    static const char *const WORDS[3] = {"true", "false", "null"};
    static const JsonType TYPES[3] = {JSON_TRUE, JSON_FALSE, JSON_NULL};
    for (int k = 0; k < 3; k++) {
        size_t w = strlen(WORDS[k]);
        if (in->n - in->pos >= w && !memcmp(in->s + in->pos, WORDS[k], w)) {
            v->type = TYPES[k];
            in->pos += w;
            return 0;
        }
    }
    char nm[16];
    return json_fail(in, in->pos, "unexpected %s (expected a value)", byte_name((unsigned char)c, nm, sizeof nm));
}

/* The value of obj's member `key` (the last one when a key repeats, as Python's json reads it), or NULL. */
static const Json *json_get(const Json *obj, const char *key) {
    if (obj->type != JSON_OBJECT) return NULL;
    for (size_t k = obj->len; k-- > 0;)
        if (!strcmp(obj->key[k], key)) return &obj->item[k];
    return NULL;
}

/* What a value is, for messages: "a string", "an array", ..., or a number as written. */
static const char *json_what(const Json *v, char *buf, size_t len) {
    switch (v->type) {
    case JSON_NULL: return "null";
    case JSON_FALSE: return "false";
    case JSON_TRUE: return "true";
    case JSON_NUMBER: snprintf(buf, len, "%.24s", v->str); return buf;
    case JSON_STRING: return "a string";
    case JSON_ARRAY: return "an array";
    case JSON_OBJECT: return "an object";
    }
    return "?";
}

/* The 1-based line and column (in bytes) of offset `at` in s. */
static void line_col(const char *s, size_t at, int *line, size_t *col) {
    int l = 1;
    size_t bol = 0;
    for (size_t k = 0; k < at; k++)
        if (s[k] == '\n') { l++; bol = k + 1; }
    *line = l;
    *col = at - bol + 1;
}

/* A UTF-8 byte order mark, skipped where a file starts with one. */
static size_t bom_bytes(const char *s, size_t n) { return n >= 3 && !memcmp(s, "\xEF\xBB\xBF", 3) ? 3 : 0; }


/* ---------------------------------------------------------------------------------------------------------------
 * The trace: requests, the document table (each path read once), freeing.
 * ------------------------------------------------------------------------------------------------------------- */

/* No context a model here holds comes near this; it also bounds what a bad path (a huge file) can take. */
#define TRACE_MAX_DOC_BYTES ((size_t)256 << 20)

static const char *const PATTERN_NAMES[TRACE_NPATTERNS] = {"sequential", "random", "hotspot"};

int trace_pattern_parse(const char *name) {
    for (int p = 0; p < TRACE_NPATTERNS; p++) if (!strcmp(name, PATTERN_NAMES[p])) return p;
    return -1;
}
const char *trace_pattern_name(TracePattern p) { return p >= 0 && p < TRACE_NPATTERNS ? PATTERN_NAMES[p] : "?"; }

void trace_free(Trace *t) {
    for (int i = 0; i < t->n; i++) {
        TraceReq *r = &t->req[i];
        free(r->system);
        free(r->docs);
        free(r->doc_ids);
        for (int k = 0; k < r->n_turns; k++) {
            free(r->turns[k]);
            if (r->refs) free(r->refs[k]);
        }
        free(r->turns);
        free(r->refs);
        free(r->ref_bytes);
        free(r->source_id);
    }
    free(t->req);
    for (int d = 0; d < t->n_doc; d++) { free(t->doc[d].path); free(t->doc[d].text); }
    free(t->doc);
    free(t->path);
    memset(t, 0, sizeof *t);
}

/* A new zeroed request at the end (id = its index); *cap: the array's capacity in requests. */
static TraceReq *req_push(Trace *t, size_t *cap) {
    t->req = grow(t->req, (size_t)t->n, cap, sizeof *t->req);
    TraceReq *r = &t->req[t->n];
    memset(r, 0, sizeof *r);
    r->id = t->n++;
    return r;
}

/* A document file into text (NUL-terminated, *bytes long): regular files only (not a FIFO or a device, which could
 * block or never end), at most TRACE_MAX_DOC_BYTES, no NUL byte. 0, or -1 + message naming the path. */
static int doc_read(const char *path, char **text, size_t *bytes, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return errorf(err, errlen, "cannot read document '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode)) {
        fclose(f);
        return errorf(err, errlen, "document '%s' is not a regular file", path);
    }
    Buf b = {0};
    char chunk[1 << 15];
    size_t k;
    buf_add(&b, "", 0);
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0 && b.n <= TRACE_MAX_DOC_BYTES) buf_add(&b, chunk, k);
    int bad = ferror(f);
    fclose(f);
    const char *nul = memchr(b.s, 0, b.n);
    if (bad || b.n > TRACE_MAX_DOC_BYTES || nul) {
        if (bad) errorf(err, errlen, "cannot read document '%s'", path);
        else if (nul) errorf(err, errlen, "document '%s' holds a NUL byte (at byte %zu): documents are text", path,
                             (size_t)(nul - b.s));
        else errorf(err, errlen, "document '%s' is larger than %zu MiB", path, TRACE_MAX_DOC_BYTES >> 20);
        free(b.s);
        return -1;
    }
    *text = b.s;
    *bytes = b.n;
    return 0;
}

/* The table index of the document at `path`, read on its first use. A linear search: traces name few documents. */
static int doc_intern(Trace *t, const char *path, size_t *cap, char *err, size_t errlen) {
    for (int d = 0; d < t->n_doc; d++) if (!strcmp(t->doc[d].path, path)) return d;
    if (t->n_doc == INT_MAX) return errorf(err, errlen, "too many documents");
    TraceDoc doc;
    if (doc_read(path, &doc.text, &doc.bytes, err, errlen)) return -1;
    doc.path = xstrdup(path);
    t->doc = grow(t->doc, (size_t)t->n_doc, cap, sizeof *t->doc);
    t->doc[t->n_doc] = doc;
    return t->n_doc++;
}

/* Attach table document d to request r (whose arrays hold r->n_docs so far). */
static void req_add_doc(Trace *t, TraceReq *r, int d) {
    r->docs = xrealloc(r->docs, (size_t)(r->n_docs + 1) * sizeof *r->docs);
    r->doc_ids = xrealloc(r->doc_ids, (size_t)(r->n_docs + 1) * sizeof *r->doc_ids);
    r->docs[r->n_docs] = t->doc[d].text;
    r->doc_ids[r->n_docs++] = d;
}

static size_t req_text_bytes(const TraceReq *r) {
    size_t n = r->system ? strlen(r->system) : 0;
    for (int k = 0; k < r->n_docs; k++) n += strlen(r->docs[k]);
    for (int k = 0; k < r->n_turns; k++) n += strlen(r->turns[k]);
    return n;
}


/* ---------------------------------------------------------------------------------------------------------------
 * -trace FILE: JSON lines.
 * ------------------------------------------------------------------------------------------------------------- */

static const char *const LINE_KEYS[] = {"arrival", "system", "docs", "doc", "prompt", "turns", "n", "doc_tokens"};
#define N_LINE_KEYS ((int)(sizeof LINE_KEYS / sizeof LINE_KEYS[0]))
#define LINE_KEY_LIST "arrival, system, docs, doc, prompt, turns, n, doc_tokens"

/* An integer member in [lo, hi]. */
static int line_int(const Json *v, const char *key, long long lo, long long hi, long long *out, char *err,
                    size_t errlen) {
    char w[32];
    if (v->type == JSON_NUMBER && v->is_int && v->i > hi)
        return errorf(err, errlen, "\"%s\" is too large: %s (at most %lld)", key, v->str, hi);
    if (v->type != JSON_NUMBER || !v->is_int || v->i < lo)
        return errorf(err, errlen, "\"%s\" must be an integer >= %lld, not %s", key, lo, json_what(v, w, sizeof w));
    *out = v->i;
    return 0;
}
static int line_str(const Json *v, const char *what, char *err, size_t errlen) {
    char w[32];
    if (v->type != JSON_STRING)
        return errorf(err, errlen, "%s must be a string, not %s", what, json_what(v, w, sizeof w));
    return 0;
}

/* One request's object into r; messages without the FILE:LINE prefix (the caller adds it). */
static int line_request(Trace *t, TraceReq *r, const Json *o, int n_gen, size_t *doc_cap, char *err, size_t errlen) {
    char w[32], what[48];
    long long x;
    r->n_gen = n_gen;
    for (size_t m = 0; m < o->len; m++) {
        const char *key = o->key[m];
        const Json *v = &o->item[m];
        int k = 0;
        while (k < N_LINE_KEYS && strcmp(key, LINE_KEYS[k])) k++;
        if (k == N_LINE_KEYS) return errorf(err, errlen, "unknown key \"%.40s\" (keys: " LINE_KEY_LIST ")", key);
        for (size_t e = 0; e < m; e++)
            if (!strcmp(o->key[e], key)) return errorf(err, errlen, "key \"%s\" given twice", key);
        if (!strcmp(key, "arrival")) {
            if (line_int(v, key, 0, LONG_MAX, &x, err, errlen)) return -1;
            r->arrival = (long)x;
        } else if (!strcmp(key, "n")) {
            if (line_int(v, key, 1, INT_MAX, &x, err, errlen)) return -1;
            r->n_gen = (int)x;
        } else if (!strcmp(key, "doc_tokens")) {
            if (line_int(v, key, 0, INT_MAX, &x, err, errlen)) return -1;
            r->doc_tokens = (int)x;
        } else if (!strcmp(key, "system")) {
            if (line_str(v, "\"system\"", err, errlen)) return -1;
            r->system = xstrdup(v->str);
        } else if (!strcmp(key, "doc") || !strcmp(key, "docs")) {
            if (json_get(o, "doc") && json_get(o, "docs"))
                return errorf(err, errlen, "give \"doc\" or \"docs\", not both");
            int one = !strcmp(key, "doc");
            if (!one && v->type != JSON_ARRAY)
                return errorf(err, errlen, "\"docs\" must be an array of file paths, not %s",
                              json_what(v, w, sizeof w));
            for (size_t d = 0; d < (one ? 1 : v->len); d++) {
                const Json *p = one ? v : &v->item[d];
                if (one) snprintf(what, sizeof what, "\"doc\" (a file path)");
                else snprintf(what, sizeof what, "\"docs\"[%zu] (a file path)", d);
                if (line_str(p, what, err, errlen)) return -1;
                int id = doc_intern(t, p->str, doc_cap, err, errlen);
                if (id < 0) return -1;
                req_add_doc(t, r, id);
            }
        } else {   /* prompt, turns */
            if (json_get(o, "prompt") && json_get(o, "turns"))
                return errorf(err, errlen, "give \"prompt\" or \"turns\", not both");
            int one = !strcmp(key, "prompt");
            if (!one && v->type != JSON_ARRAY)
                return errorf(err, errlen, "\"turns\" must be an array of strings, not %s", json_what(v, w, sizeof w));
            size_t n = one ? 1 : v->len;
            if (n > INT_MAX) return errorf(err, errlen, "too many turns");
            r->turns = xrealloc(NULL, n * sizeof *r->turns);
            for (size_t d = 0; d < n; d++) {
                const Json *p = one ? v : &v->item[d];
                if (one) snprintf(what, sizeof what, "\"prompt\"");
                else snprintf(what, sizeof what, "\"turns\"[%zu]", d);
                if (line_str(p, what, err, errlen)) return -1;
                r->turns[r->n_turns++] = xstrdup(p->str);
            }
        }
    }
    if (req_text_bytes(r) == 0)
        return errorf(err, errlen, "a request with no text (give a non-empty \"prompt\", \"turns\", \"doc\", \"docs\" "
                      "or \"system\")");
    return 0;
}

int trace_parse_lines(Trace *t, const char *text, size_t len, const char *name, int n_gen, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    t->source = TRACE_FILE;
    if (n_gen < 1) return errorf(err, errlen, "trace %s: tokens to generate must be >= 1, not %d", name, n_gen);
    t->path = xstrdup(name);
    JsonIn in = {0};
    size_t req_cap = 0, doc_cap = 0, p = bom_bytes(text, len);
    int line = 0, rc = 0;
    char msg[384];
    while (p < len && rc == 0) {
        line++;
        const char *nl = memchr(text + p, '\n', len - p);
        size_t end = nl ? (size_t)(nl - text) : len, next = nl ? end + 1 : len;
        if (end > p && text[end - 1] == '\r') end--;
        size_t q = p;
        while (q < end && (text[q] == ' ' || text[q] == '\t' || text[q] == '\r')) q++;
        if (q == end || text[q] == '#') { p = next; continue; }
        in.s = text + p;
        in.n = end - p;
        in.pos = 0;
        Json o = {0};
        if (json_value(&in, &o, 0)) {
            rc = errorf(err, errlen, "trace %s:%d: byte %zu: %s", name, line, in.err_at + 1, in.msg);
            json_free(&o);
            break;
        }
        json_ws(&in);
        if (in.pos < in.n) {
            rc = errorf(err, errlen, "trace %s:%d: byte %zu: unexpected text after the request's object", name, line,
                        in.pos + 1);
        } else if (o.type != JSON_OBJECT) {
            char w[32];
            rc = errorf(err, errlen, "trace %s:%d: a request is a JSON object ({\"prompt\": ...}), not %s", name, line,
                        json_what(&o, w, sizeof w));
        } else if (t->n == INT_MAX) {
            rc = errorf(err, errlen, "trace %s:%d: too many requests", name, line);
        } else {
            TraceReq *r = req_push(t, &req_cap);
            r->line = line;
            if (line_request(t, r, &o, n_gen, &doc_cap, msg, sizeof msg))
                rc = errorf(err, errlen, "trace %s:%d: %s", name, line, msg);
            else if (r->id > 0 && r->arrival < t->req[r->id - 1].arrival)
                rc = errorf(err, errlen, "trace %s:%d: arrival %ld is before the previous request's %ld (a trace is "
                            "in arrival order)", name, line, r->arrival, t->req[r->id - 1].arrival);
        }
        json_free(&o);
        p = next;
    }
    free(in.scratch.s);
    if (rc == 0 && t->n == 0) rc = errorf(err, errlen, "trace %s: no requests", name);
    if (rc) trace_free(t);
    return rc;
}

/* The whole file, or -1 + message; text is NUL-terminated (not needed by the parsers, kept for safety). */
static int file_read(const char *kind, const char *path, char **text, size_t *len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return errorf(err, errlen, "%s %s: cannot open: %s", kind, path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) || S_ISDIR(st.st_mode)) {
        fclose(f);
        return errorf(err, errlen, "%s %s: not a file", kind, path);
    }
    Buf b = {0};
    char chunk[1 << 16];
    size_t k;
    buf_add(&b, "", 0);
    while ((k = fread(chunk, 1, sizeof chunk, f)) > 0) buf_add(&b, chunk, k);
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(b.s); return errorf(err, errlen, "%s %s: read error", kind, path); }
    *text = b.s;
    *len = b.n;
    return 0;
}

int trace_load(Trace *t, const char *path, int n_gen, char *err, size_t errlen) {
    char *text;
    size_t len;
    memset(t, 0, sizeof *t);
    if (file_read("trace", path, &text, &len, err, errlen)) return -1;
    int rc = trace_parse_lines(t, text, len, path, n_gen, err, errlen);
    free(text);
    return rc;
}


/* ---------------------------------------------------------------------------------------------------------------
 * Generated traces and arrivals.
 * ------------------------------------------------------------------------------------------------------------- */

/* Generic questions about any text: requests on one document share the document and differ in the question. */
static const char *const QUESTIONS[] = {
    "Summarize the text above in one sentence.",
    "What is the main topic of the text above?",
    "List three key points made in the text above.",
    "Who or what is the text above mainly about?",
    "Explain the text above to a twelve-year-old.",
    "What question does the text above answer?",
    "Give the text above a short title.",
    "What is the most surprising statement in the text above?",
};
#define N_QUESTIONS ((uint64_t)(sizeof QUESTIONS / sizeof QUESTIONS[0]))

/* A draw as a uniform number in [0, 1): its top 53 bits. (Integers in [0, n) are a draw mod n: the bias, under
 * n / 2^64, is far below anything a trace measures.) */
static double unit(uint64_t draw) { return (double)(draw >> 11) * 0x1.0p-53; }

/* Arrivals have a stream of their own, so changing the mean moves no document or length: the seed xor'd with
 * "arrivals" in ASCII. */
#define ARRIVAL_STREAM 0x6172726976616c73ull

int trace_assign_arrivals(Trace *t, double mean_interarrival, uint64_t seed, char *err, size_t errlen) {
    if (!(mean_interarrival >= 0) || !isfinite(mean_interarrival))
        return errorf(err, errlen, "mean inter-arrival time must be a finite number of steps >= 0, not %g",
                      mean_interarrival);
    uint64_t rng = seed;
    double time = 0;   /* steps since request 0 */
    for (int i = 0; i < t->n; i++) {
        if (i > 0 && mean_interarrival > 0) time += -mean_interarrival * log(1.0 - unit(splitmix64(&rng)));
        if (!(time < (double)LONG_MAX))
            return errorf(err, errlen, "arrivals pass %ld steps (mean inter-arrival %g steps)", LONG_MAX,
                          mean_interarrival);
        t->req[i].arrival = (long)floor(time);
    }
    t->mean_interarrival = mean_interarrival;
    return 0;
}

int trace_generate(Trace *t, int n_requests, const char *pattern, char **doc_paths, int n_docs, uint64_t seed,
                   int min_tokens, int max_tokens, double mean_interarrival, int n_gen, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    t->source = TRACE_GENERATED;
    int pat = pattern ? trace_pattern_parse(pattern) : -1;
    if (pat < 0) return errorf(err, errlen, "unknown trace pattern '%s' (sequential, random, hotspot)",
                               pattern ? pattern : "");
    if (n_requests < 1) return errorf(err, errlen, "a generated trace needs at least 1 request, not %d", n_requests);
    if (n_docs < 1 || !doc_paths) return errorf(err, errlen, "a generated trace needs at least one document");
    if (!(min_tokens == 0 && max_tokens == 0) && !(min_tokens >= 1 && min_tokens <= max_tokens))
        return errorf(err, errlen, "document lengths [%d, %d] tokens: need 1 <= min <= max (or both 0: whole "
                      "documents)", min_tokens, max_tokens);
    if (n_gen < 1) return errorf(err, errlen, "tokens to generate must be >= 1, not %d", n_gen);
    t->pattern = (TracePattern)pat;
    t->seed = seed;
    t->min_tokens = min_tokens;
    t->max_tokens = max_tokens;
    size_t doc_cap = 0, req_cap = 0;
    int *table = xrealloc(NULL, (size_t)n_docs * sizeof *table);   /* doc_paths[k] -> table index (repeats share) */
    for (int k = 0; k < n_docs; k++) {
        char msg[320];
        table[k] = doc_intern(t, doc_paths[k], &doc_cap, msg, sizeof msg);
        if (table[k] < 0) {
            free(table);
            trace_free(t);
            return errorf(err, errlen, "trace: %s", msg);
        }
    }
    /* Zipf, s = 1: cdf[k] = H_{k+1} / H_n, summed in one order so every machine gets the same doubles */
    double *cdf = xrealloc(NULL, (size_t)n_docs * sizeof *cdf), h = 0;
    for (int k = 0; k < n_docs; k++) cdf[k] = h += 1.0 / (k + 1);
    for (int k = 0; k < n_docs; k++) cdf[k] /= h;
    cdf[n_docs - 1] = 1.0;
    uint64_t rng = seed;
    for (int i = 0; i < n_requests; i++) {
        TraceReq *r = req_push(t, &req_cap);
        /* three draws per request whatever the pattern, so lengths and questions do not depend on it */
        uint64_t d_doc = splitmix64(&rng), d_len = splitmix64(&rng), d_question = splitmix64(&rng);
        int k = 0;
        if (t->pattern == TRACE_SEQUENTIAL) k = i % n_docs;
        else if (t->pattern == TRACE_RANDOM) k = (int)(d_doc % (uint64_t)n_docs);
        else {
            double u = unit(d_doc);
            int lo = 0, hi = n_docs - 1;   /* the first k with u < cdf[k] */
            while (lo < hi) {
                int mid = lo + (hi - lo) / 2;
                if (u < cdf[mid]) hi = mid; else lo = mid + 1;
            }
            k = lo;
        }
        r->doc_tokens = max_tokens ? min_tokens + (int)(d_len % ((uint64_t)(max_tokens - min_tokens) + 1)) : 0;
        r->turns = xrealloc(NULL, sizeof *r->turns);
        r->turns[0] = xstrdup(QUESTIONS[d_question % N_QUESTIONS]);
        r->n_turns = 1;
        r->n_gen = n_gen;
        req_add_doc(t, r, table[k]);
    }
    free(cdf);
    free(table);
    if (trace_assign_arrivals(t, mean_interarrival, seed ^ ARRIVAL_STREAM, err, errlen)) {
        trace_free(t);
        return -1;
    }
    return 0;
}


/* ---------------------------------------------------------------------------------------------------------------
 * ShareGPT files.
 * ------------------------------------------------------------------------------------------------------------- */

/* a += "\n\n" + s, or a = s when a is empty */
static void join_text(Buf *a, const char *s, size_t n) {
    if (a->n) buf_add(a, "\n\n", 2);
    buf_add(a, s, n);
}

/* The reply gathered for the last turn so far becomes its ref ("" when it had none). */
static void close_reply(TraceReq *r, Buf *reply) {
    r->refs[r->n_turns - 1] = reply->s ? reply->s : xstrdup("");
    r->ref_bytes[r->n_turns - 1] = reply->n;
    memset(reply, 0, sizeof *reply);
}

typedef enum { CONV_OK, CONV_MALFORMED, CONV_NO_HUMAN, CONV_NOT_HUMAN_FIRST } ConvVerdict;
enum { ROLE_HUMAN, ROLE_GPT, ROLE_SYSTEM };

/* One conversation: its verdict and, when CONV_OK, the request it makes (arrays in r, texts copied). */
static ConvVerdict sharegpt_conversation(TraceReq *r, const Json *c, int n_gen) {
    if (c->type != JSON_OBJECT) return CONV_MALFORMED;
    const Json *turns = json_get(c, "conversations");
    if (!turns) turns = json_get(c, "conversation");
    if (!turns || turns->type != JSON_ARRAY) return CONV_MALFORMED;
    int n_human = 0, n_nonempty = 0, first = -1;   /* first: the role of the first turn after the system turns */
    for (size_t k = 0; k < turns->len; k++) {
        const Json *from = json_get(&turns->item[k], "from"), *value = json_get(&turns->item[k], "value");
        if (!from || !value || from->type != JSON_STRING || value->type != JSON_STRING) return CONV_MALFORMED;
        int role = !strcmp(from->str, "human") ? ROLE_HUMAN : !strcmp(from->str, "gpt") ? ROLE_GPT
                 : !strcmp(from->str, "system") ? ROLE_SYSTEM : -1;
        if (role < 0 || (role == ROLE_SYSTEM && first >= 0)) return CONV_MALFORMED;
        if (role != ROLE_SYSTEM && first < 0) first = role;
        n_human += role == ROLE_HUMAN;
        n_nonempty += role == ROLE_HUMAN && value->len > 0;
    }
    if (n_nonempty == 0) return CONV_NO_HUMAN;
    if (first != ROLE_HUMAN) return CONV_NOT_HUMAN_FIRST;
    if (n_human > INT_MAX) return CONV_MALFORMED;
    Buf sys = {0}, reply = {0};
    r->turns = xrealloc(NULL, (size_t)n_human * sizeof *r->turns);
    r->refs = xrealloc(NULL, (size_t)n_human * sizeof *r->refs);
    r->ref_bytes = xrealloc(NULL, (size_t)n_human * sizeof *r->ref_bytes);
    for (size_t k = 0; k < turns->len; k++) {
        const Json *from = json_get(&turns->item[k], "from"), *value = json_get(&turns->item[k], "value");
        if (!strcmp(from->str, "system")) join_text(&sys, value->str, value->len);
        else if (!strcmp(from->str, "gpt")) join_text(&reply, value->str, value->len);
        else {   /* human: the turn before it (if any) has its whole reply */
            if (r->n_turns) close_reply(r, &reply);
            r->turns[r->n_turns++] = memdup_str(value->str, value->len);
        }
    }
    close_reply(r, &reply);
    r->system = sys.s;
    r->n_gen = n_gen;
    const Json *id = json_get(c, "id");
    if (id && (id->type == JSON_STRING || id->type == JSON_NUMBER)) r->source_id = xstrdup(id->str);
    return CONV_OK;
}

/* The top-level array's conversations into t (max_requests > 0: stop after that many requests). 0, or -1 with the
 * error in in->msg at in->err_at. */
static int sharegpt_array(JsonIn *in, Trace *t, int n_gen, int max_requests) {
    size_t req_cap = 0, line_at = 0;   /* line_at: newlines counted up to here */
    int line = 1;
    char nm[16];
    json_ws(in);
    if (in->pos >= in->n || in->s[in->pos] != '[')
        return json_fail(in, in->pos, "a ShareGPT file is a JSON array of conversations ([{\"conversations\": ...}])");
    in->pos++;
    json_ws(in);
    if (in->pos < in->n && in->s[in->pos] == ']') in->pos++;
    else for (;;) {
        Json c = {0};
        if (json_value(in, &c, 1)) { json_free(&c); return -1; }
        for (; line_at < c.at; line_at++) line += in->s[line_at] == '\n';
        if (t->n == INT_MAX) { json_free(&c); return json_fail(in, line_at, "too many conversations"); }
        TraceReq r = {0};
        ConvVerdict verdict = sharegpt_conversation(&r, &c, n_gen);
        json_free(&c);
        t->skipped_malformed += verdict == CONV_MALFORMED;
        t->skipped_no_human += verdict == CONV_NO_HUMAN;
        t->skipped_not_human_first += verdict == CONV_NOT_HUMAN_FIRST;
        if (verdict == CONV_OK) {
            TraceReq *slot = req_push(t, &req_cap);
            r.id = slot->id;
            r.line = line;
            *slot = r;
            if (max_requests > 0 && t->n >= max_requests) return 0;   /* the rest of the file is not read */
        }
        json_ws(in);
        if (in->pos >= in->n) return json_fail(in, in->pos, "unterminated array of conversations");
        if (in->s[in->pos] == ']') { in->pos++; break; }
        if (in->s[in->pos] != ',')
            return json_fail(in, in->pos, "expected ',' or ']' after a conversation, found %s",
                             byte_name((unsigned char)in->s[in->pos], nm, sizeof nm));
        in->pos++;
    }
    json_ws(in);
    if (in->pos < in->n) return json_fail(in, in->pos, "unexpected text after the array of conversations");
    return 0;
}

int trace_parse_sharegpt(Trace *t, const char *text, size_t len, const char *name, int n_gen, int max_requests,
                         char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    t->source = TRACE_SHAREGPT;
    if (n_gen < 1) return errorf(err, errlen, "sharegpt %s: tokens to generate must be >= 1, not %d", name, n_gen);
    t->path = xstrdup(name);
    JsonIn in = {.s = text, .n = len, .pos = bom_bytes(text, len)};
    int rc = sharegpt_array(&in, t, n_gen, max_requests);
    if (rc) {
        int l;
        size_t col;
        line_col(text, in.err_at, &l, &col);
        errorf(err, errlen, "sharegpt %s:%d:%zu: %s", name, l, col, in.msg);
    } else if (t->n == 0) {
        rc = errorf(err, errlen, "sharegpt %s: no conversation to replay (skipped: %d without a human turn, %d not "
                    "opening with one, %d malformed)", name, t->skipped_no_human, t->skipped_not_human_first,
                    t->skipped_malformed);
    }
    free(in.scratch.s);
    if (rc) trace_free(t);
    return rc;
}

int trace_load_sharegpt(Trace *t, const char *path, int n_gen, int max_requests, char *err, size_t errlen) {
    char *text;
    size_t len;
    memset(t, 0, sizeof *t);
    if (file_read("sharegpt", path, &text, &len, err, errlen)) return -1;
    int rc = trace_parse_sharegpt(t, text, len, path, n_gen, max_requests, err, errlen);
    free(text);
    return rc;
}


/* ---------------------------------------------------------------------------------------------------------------
 * The start-up line.
 * ------------------------------------------------------------------------------------------------------------- */

/* snprintf at buf + *k, *k advanced (and kept within len) */
static void describe_add(char *buf, size_t len, size_t *k, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void describe_add(char *buf, size_t len, size_t *k, const char *fmt, ...) {
    if (*k + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *k, len - *k, fmt, ap);
    va_end(ap);
    if (w > 0) *k = *k + (size_t)w < len ? *k + (size_t)w : len - 1;
}

void trace_describe(const Trace *t, char *buf, size_t len) {
    if (!len) return;
    buf[0] = 0;
    if (t->n == 0) { snprintf(buf, len, "empty trace"); return; }
    long first = t->req[0].arrival, last = t->req[t->n - 1].arrival;
    int turns = 0;
    for (int i = 0; i < t->n; i++) turns += t->req[i].n_turns;
    size_t k = 0;
    describe_add(buf, len, &k, "%d request%s", t->n, t->n == 1 ? "" : "s");
    if (t->source == TRACE_GENERATED) {
        describe_add(buf, len, &k, " generated (%s%s, seed %llu) over %d document%s, ", trace_pattern_name(t->pattern),
                     t->pattern == TRACE_HOTSPOT ? ", Zipf s=1" : "", (unsigned long long)t->seed, t->n_doc,
                     t->n_doc == 1 ? "" : "s");
        if (t->max_tokens) describe_add(buf, len, &k, "%d..%d document tokens", t->min_tokens, t->max_tokens);
        else describe_add(buf, len, &k, "whole documents");
        describe_add(buf, len, &k, ", arrivals 0..%ld (mean gap %g steps)", last, t->mean_interarrival);
    } else if (t->source == TRACE_SHAREGPT) {
        describe_add(buf, len, &k, " from ShareGPT %s, %d turns (skipped: %d without a human turn, %d not opening with "
                     "one, %d malformed), arrivals %ld..%ld", t->path ? t->path : "?", turns, t->skipped_no_human,
                     t->skipped_not_human_first, t->skipped_malformed, first, last);
    } else {
        describe_add(buf, len, &k, " from %s, %d turns over %d document%s, arrivals %ld..%ld", t->path ? t->path : "?",
                     turns, t->n_doc, t->n_doc == 1 ? "" : "s", first, last);
    }
}
