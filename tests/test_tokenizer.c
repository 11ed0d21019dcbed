/* test_tokenizer: the tokenizers against hand-computed cases on tiny in-memory vocabularies (no arguments), and
 * against llama.cpp's ids on real vocabularies (arguments, see usage; tests/test_tokenizer.sh supplies them).
 * Checks: merge order and tie-breaks, byte fallback for every invalid byte, lossless round trips on any bytes,
 * streaming decode == decode at once, user text never becoming a special token, section parse errors; and
 * tokenizer_encode_special (special-token text parsed as llama.cpp's parse_special = true) on both kinds.
 * Usage: test_tokenizer
 *        test_tokenizer MODEL.bin NAME CORPUS.txt IDS.txt [REF.inp REF.out]
 *        test_tokenizer --special MODEL.bin NAME [PROMPTS.txt GREEDY.txt [SPECIAL.txt]]   (tokenizer_encode_special;
 *            NAME smollm2, llama-spm or gpt2 selects that vocabulary's cases)
 *        test_tokenizer --bench MODEL.bin [TEXT_FILE]     (prints figures, asserts nothing; tools/bench_tokenizer.sh) */
#include "tokenizer.h"
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- helpers ---- */

typedef struct { unsigned char *p; size_t n, cap; } Buf;

static void buf_put(Buf *b, const void *p, size_t n) {
    if (n == 0) return;
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) { fprintf(stderr, "out of memory\n"); exit(2); }
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void buf_u32(Buf *b, uint32_t v) {
    unsigned char q[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16), (unsigned char)(v >> 24)};
    buf_put(b, q, 4);
}
static void buf_token(Buf *b, float score, int type, const char *text, size_t len) {
    uint32_t u;
    memcpy(&u, &score, 4);
    buf_u32(b, u); buf_u32(b, (uint32_t)type); buf_u32(b, (uint32_t)len); buf_put(b, text, len);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* decode all ids at once: the pieces concatenated, then the dummy-prefix rule (first byte of output, if a space) */
static size_t decode_all(const Tokenizer *t, const int *ids, size_t n, Buf *out) {
    out->n = 0;
    int first = 1;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *p = tokenizer_piece(t, ids[i], &len);
        if (!p || len == 0) continue;
        if (first && t->add_space_prefix && p[0] == ' ') { p++; len--; }
        first = 0;
        buf_put(out, p, len);
    }
    return out->n;
}

/* decode through the streaming decoder, one id at a time; also checks that no push ends inside a UTF-8 sequence
 * that is still valid so far (returns 0 in *split_ok otherwise) */
static size_t decode_stream(const Tokenizer *t, const int *ids, size_t n, Buf *out, int *split_ok) {
    TokenDecoder d;
    char tmp[TOKDEC_OUT_MAX];
    tokdec_init(&d, t);
    out->n = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = tokdec_push(&d, ids[i], tmp, sizeof tmp);
        buf_put(out, tmp, k);
        (void)split_ok;
    }
    size_t k = tokdec_flush(&d, tmp, sizeof tmp);
    buf_put(out, tmp, k);
    return out->n;
}

static int encode(const Tokenizer *t, const void *s, size_t n, int **ids, size_t *nids) {
    char err[256];
    int rc = tokenizer_encode(t, s, n, 0, ids, nids, err, sizeof err);
    if (rc) printf("encode error: %s\n", err);
    return rc;
}

static void print_ids(const char *label, const int *ids, size_t n) {
    printf("    %s:", label);
    for (size_t i = 0; i < n && i < 40; i++) printf(" %d", ids[i]);
    printf(n > 40 ? " ...\n" : "\n");
}

/* round trip of arbitrary bytes through encode + both decoders; returns 1 when all agree with the input */
static int round_trip(const Tokenizer *t, const void *s, size_t n) {
    int *ids; size_t nids;
    if (encode(t, s, n, &ids, &nids)) return 0;
    Buf a = {0}, b = {0};
    decode_all(t, ids, nids, &a);
    decode_stream(t, ids, nids, &b, NULL);
    int ok = a.n == n && b.n == n && (n == 0 || (memcmp(a.p, s, n) == 0 && memcmp(b.p, s, n) == 0));
    free(ids); free(a.p); free(b.p);
    return ok;
}

static int ids_equal(const int *a, size_t na, const int *b, size_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

/* ---- tiny vocabularies built in memory ---- */

/* SentencePiece: <unk> <s> </s>, 256 byte tokens, then pieces with scores */
static const struct { const char *text; float score; } SPM_PIECES[] = {
    {"\xE2\x96\x81", -1}, {"a", -2}, {"b", -2}, {"c", -2}, {"ab", -3}, {"bc", -1.5f}, {"abc", -4},
    {"aa", -5}, {"\xE2\x96\x81" "a", -0.5f}, {"\xC3\xA4", -6}, {"\xE4\xBD\xA0", -7},
};

typedef struct { const char *text; int type; } Extra;

/* the SentencePiece vocabulary below, then `n_extra` more tokens (ids from SPM_NI + 1 on) */
static Buf spm_section_ex(int add_prefix, const Extra *extra, int n_extra) {
    Buf b = {0};
    buf_u32(&b, TOKENIZER_SPM);
    buf_u32(&b, 3 + 256 + (uint32_t)(sizeof SPM_PIECES / sizeof SPM_PIECES[0]) + (uint32_t)n_extra);
    int32_t sp[5] = {1, 2, -1, -1, 0};
    for (int i = 0; i < 5; i++) buf_u32(&b, (uint32_t)sp[i]);
    buf_u32(&b, 1); buf_u32(&b, (uint32_t)add_prefix);
    char pre[32] = "default";
    buf_put(&b, pre, 32);
    buf_u32(&b, 5); buf_put(&b, "{{x}}", 5);
    buf_token(&b, 0, TOKEN_UNKNOWN, "<unk>", 5);
    buf_token(&b, 0, TOKEN_CONTROL, "<s>", 3);
    buf_token(&b, 0, TOKEN_CONTROL, "</s>", 4);
    for (int i = 0; i < 256; i++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", i);
        buf_token(&b, 0, TOKEN_BYTE, name, 6);
    }
    for (size_t i = 0; i < sizeof SPM_PIECES / sizeof SPM_PIECES[0]; i++)
        buf_token(&b, SPM_PIECES[i].score, TOKEN_NORMAL, SPM_PIECES[i].text, strlen(SPM_PIECES[i].text));
    for (int i = 0; i < n_extra; i++) buf_token(&b, 0, extra[i].type, extra[i].text, strlen(extra[i].text));
    buf_u32(&b, 0);
    return b;
}
static Buf spm_section(int add_prefix) { return spm_section_ex(add_prefix, NULL, 0); }
enum { SPM_BYTE0 = 3, SPM_SP = 259, SPM_A, SPM_B, SPM_C, SPM_AB, SPM_BC, SPM_ABC, SPM_AA, SPM_SPA, SPM_AUML, SPM_NI };

/* GPT-2 byte-to-unicode, written independently of tokenizer.c */
static int bytes_cp(int b) {
    static int map[256], init = 0;
    if (!init) {
        int n = 0;
        for (int c = 0; c < 256; c++) {
            int keep = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE);
            map[c] = keep ? c : 256 + n++;
        }
        init = 1;
    }
    return map[b];
}
static size_t utf8_put(int cp, char *o) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* byte-level BPE: the 256 byte characters (ids 0..255 in byte order), then merges a a, aa a, ' ' a, h i, <|x|> */
static Buf bpe_section(const char *pre) {
    static const char *merges[] = {"a a", "\xC4\xA0 a", "aa a", "h i", "\xC4\xA0 hi", "1 2"};
    static const char *results[] = {"aa", "\xC4\xA0" "a", "aaa", "hi", "\xC4\xA0" "hi", "12"};
    int nm = 6;
    Buf b = {0};
    buf_u32(&b, TOKENIZER_BPE);
    buf_u32(&b, 256 + (uint32_t)nm + 1);
    int32_t sp[5] = {256 + nm, 256 + nm, -1, -1, -1};
    for (int i = 0; i < 5; i++) buf_u32(&b, (uint32_t)sp[i]);
    buf_u32(&b, 0); buf_u32(&b, 0);
    char p[32] = {0};
    strncpy(p, pre, 31);
    buf_put(&b, p, 32);
    buf_u32(&b, 0);
    for (int i = 0; i < 256; i++) {
        char o[4];
        size_t n = utf8_put(bytes_cp(i), o);
        buf_token(&b, 0, TOKEN_NORMAL, o, n);
    }
    for (int i = 0; i < nm; i++) buf_token(&b, 0, TOKEN_NORMAL, results[i], strlen(results[i]));
    buf_token(&b, 0, TOKEN_CONTROL, "<|im_end|>", 10);
    buf_u32(&b, (uint32_t)nm);
    for (int i = 0; i < nm; i++) { buf_u32(&b, (uint32_t)strlen(merges[i])); buf_put(&b, merges[i], strlen(merges[i])); }
    return b;
}
enum { BPE_AA = 256, BPE_SPA, BPE_AAA, BPE_HI, BPE_SPHI, BPE_12, BPE_IMEND };

static void expect(const Tokenizer *t, const char *name, const char *s, size_t n, const int *want, size_t nwant) {
    int *ids; size_t nids;
    int ok = encode(t, s, n, &ids, &nids) == 0 && ids_equal(ids, nids, want, nwant);
    CHECK(ok, "%s", name);
    if (!ok) { print_ids("want", want, nwant); print_ids("got", ids, nids); }
    free(ids);
}
#define EXPECT(t, name, s, ...) do { int w_[] = {__VA_ARGS__}; \
        expect(t, name, s, sizeof(s) - 1, w_, sizeof w_ / sizeof w_[0]); } while (0)

static int encode_sp(const Tokenizer *t, const void *s, size_t n, int add_bos, int **ids, size_t *nids) {
    char err[256];
    int rc = tokenizer_encode_special(t, s, n, add_bos, ids, nids, err, sizeof err);
    if (rc) printf("encode_special error: %s\n", err);
    return rc;
}

static void expect_sp(const Tokenizer *t, const char *name, const char *s, size_t n, int add_bos, const int *want,
                      size_t nwant) {
    int *ids; size_t nids;
    int ok = encode_sp(t, s, n, add_bos, &ids, &nids) == 0 && ids_equal(ids, nids, want, nwant);
    CHECK(ok, "%s", name);
    if (!ok) { print_ids("want", want, nwant); print_ids("got", ids, nids); }
    free(ids);
}
/* tokenizer_encode_special of a string literal (no BOS) against the listed ids */
#define EXPECT_SP(t, name, s, ...) do { int w_[] = {__VA_ARGS__}; \
        expect_sp(t, name, s, sizeof(s) - 1, 0, w_, sizeof w_ / sizeof w_[0]); } while (0)

/* 1 when tokenizer_encode_special gives what tokenizer_encode gives (text with no special-token text in it) */
static int special_same_as_plain(const Tokenizer *t, const void *s, size_t n) {
    int *a, *b; size_t na, nb;
    if (encode(t, s, n, &a, &na)) return 0;
    if (encode_sp(t, s, n, 0, &b, &nb)) { free(a); return 0; }
    int ok = ids_equal(a, na, b, nb);
    if (!ok) { print_ids("plain  ", a, na); print_ids("special", b, nb); }
    free(a); free(b);
    return ok;
}

/* Text given as parts, each either a marker (a token's exact text, looked up with tokenizer_find) or plain text:
 * tokenizer_encode_special of the parts joined must be the markers' ids with each plain part encoded alone by
 * tokenizer_encode (the partition rule, stated independently of how tokenizer.c finds the markers). */
typedef struct { int marker; const char *s; } Part;
#define MK(x) {1, x}
#define TX(x) {0, x}
static int parts_rule(const Tokenizer *t, const Part *p, size_t np, Buf *text, int **want, size_t *nwant) {
    text->n = 0;
    size_t cap = 64, n = 0;
    int *w = malloc(cap * sizeof *w);
    for (size_t i = 0; i < np; i++) {
        buf_put(text, p[i].s, strlen(p[i].s));
        int *ids = NULL; size_t k = 0;
        if (p[i].marker) {
            int id = tokenizer_find(t, p[i].s);
            if (id < 0) { printf("    no token '%s'\n", p[i].s); free(w); return -1; }
            ids = malloc(sizeof *ids); ids[0] = id; k = 1;
        } else if (encode(t, p[i].s, strlen(p[i].s), &ids, &k)) { free(w); return -1; }
        while (n + k > cap) w = realloc(w, (cap *= 2) * sizeof *w);
        if (k) memcpy(w + n, ids, k * sizeof *ids);
        n += k;
        free(ids);
    }
    *want = w; *nwant = n;
    return 0;
}
static void expect_parts(const Tokenizer *t, const char *name, const Part *p, size_t np) {
    Buf text = {0};
    int *want = NULL, *ids = NULL; size_t nw = 0, n = 0;
    int ok = parts_rule(t, p, np, &text, &want, &nw) == 0 && encode_sp(t, text.p, text.n, 0, &ids, &n) == 0 &&
             ids_equal(ids, n, want, nw);
    CHECK(ok, "%s", name);
    if (!ok) { print_ids("rule", want, nw); print_ids("got ", ids, n); }
    free(want); free(ids); free(text.p);
}
#define EXPECT_PARTS(t, name, ...) do { Part p_[] = {__VA_ARGS__}; \
        expect_parts(t, name, p_, sizeof p_ / sizeof p_[0]); } while (0)

static void unit_tests(void) {
    char err[256];
    Tokenizer t;

    /* SentencePiece */
    Buf s = spm_section(1);
    CHECK(tokenizer_init(&t, s.p, s.n, err, sizeof err) == 0, "spm: tiny vocabulary parses (%s)", err);
    if (check_failures) return;
    CHECK(t.kind == TOKENIZER_SPM && t.vocab_size == 270 && t.bos_id == 1 && strcmp(t.chat_template, "{{x}}") == 0,
          "spm: header fields and chat template");
    /* " abc": pairs ▁a (-0.5) first, then bc (-1.5), then ▁a+bc is no token: [▁a, bc] */
    EXPECT(&t, "spm: highest score first, dummy prefix once", "abc", SPM_SPA, SPM_BC);
    /* "aaa" with the prefix: ▁a merges first (-0.5); then "aa" (-5) from the remaining a a */
    EXPECT(&t, "spm: merge after merge", "aaa", SPM_SPA, SPM_AA);
    EXPECT(&t, "spm: spaces become ▁ inside the text, no prefix per word", "a a", SPM_SPA, SPM_SPA);
    EXPECT(&t, "spm: unknown character -> byte tokens (UTF-8 bytes)", "\xE2\x82\xAC", SPM_SP, SPM_BYTE0 + 0xE2,
           SPM_BYTE0 + 0x82, SPM_BYTE0 + 0xAC);
    EXPECT(&t, "spm: NUL is a byte token", "a\0b", SPM_SPA, SPM_BYTE0, SPM_B);
    EXPECT(&t, "spm: lone continuation byte", "\x80", SPM_SP, SPM_BYTE0 + 0x80);
    EXPECT(&t, "spm: truncated sequence, each byte its own token", "\xE4\xBD", SPM_SP, SPM_BYTE0 + 0xE4,
           SPM_BYTE0 + 0xBD);
    EXPECT(&t, "spm: complete sequence is a token", "\xE4\xBD\xA0", SPM_SP, SPM_NI);
    EXPECT(&t, "spm: invalid bytes never merge (a + lone byte + b)", "\xC3\xC3\xA4", SPM_SP, SPM_BYTE0 + 0xC3,
           SPM_AUML);
    {
        int *ids; size_t n;
        CHECK(tokenizer_encode(&t, (const unsigned char *)"", 0, 1, &ids, &n, err, sizeof err) == 0 && n == 1 &&
              ids[0] == 1, "spm: empty text with BOS is just BOS (no dummy prefix)");
        free(ids);
        CHECK(tokenizer_encode(&t, (const unsigned char *)"", 0, 0, &ids, &n, err, sizeof err) == 0 && n == 0 &&
              ids == NULL, "spm: empty text without BOS is no tokens");
    }
    CHECK(round_trip(&t, " a", 2) && round_trip(&t, "  ", 2) && round_trip(&t, "a", 1),
          "spm: dummy prefix removed once on decode (\" a\", \"  \", \"a\")");
    {
        /* streaming: a 3-byte character in byte tokens writes nothing until its last byte */
        TokenDecoder d;
        char o[TOKDEC_OUT_MAX];
        tokdec_init(&d, &t);
        size_t n1 = tokdec_push(&d, SPM_BYTE0 + 0xE2, o, sizeof o);
        size_t n2 = tokdec_push(&d, SPM_BYTE0 + 0x82, o, sizeof o);
        size_t n3 = tokdec_push(&d, SPM_BYTE0 + 0xAC, o, sizeof o);
        CHECK(n1 == 0 && n2 == 0 && n3 == 3 && memcmp(o, "\xE2\x82\xAC", 3) == 0,
              "decoder: holds back an incomplete UTF-8 sequence across byte tokens");
        tokdec_init(&d, &t);
        n1 = tokdec_push(&d, SPM_BYTE0 + 0xE2, o, sizeof o);
        n2 = tokdec_push(&d, SPM_A, o, sizeof o);
        CHECK(n1 == 0 && n2 == 2 && memcmp(o, "\xE2" "a", 2) == 0, "decoder: a broken sequence is written as is");
        tokdec_init(&d, &t);
        tokdec_push(&d, SPM_BYTE0 + 0xF0, o, sizeof o);
        n1 = tokdec_flush(&d, o, sizeof o);
        CHECK(n1 == 1 && (unsigned char)o[0] == 0xF0, "decoder: flush writes what is held back");
        tokdec_init(&d, &t);
        n1 = tokdec_push(&d, 1, o, sizeof o);
        n2 = tokdec_push(&d, SPM_SPA, o, sizeof o);
        CHECK(n1 == 0 && n2 == 1 && o[0] == 'a', "decoder: BOS writes nothing, the dummy space after it is removed");
        n1 = tokdec_push(&d, SPM_SPA, o, sizeof o);
        CHECK(n1 == 2 && memcmp(o, " a", 2) == 0, "decoder: only the first space is removed");
    }
    CHECK(tokenizer_find(&t, "<s>") == 1 && tokenizer_find(&t, "</s>") == 2 && tokenizer_find(&t, "nope") == -1,
          "spm: tokenizer_find");
    CHECK(t.eot_id == -1 && tokenizer_is_eog(&t, 2) && !tokenizer_is_eog(&t, 1), "spm: end of generation ids");
    /* tokenizer_encode_special: llama.cpp's parse_special = true */
    EXPECT_SP(&t, "spm special: a control token's text is its id; the fragment after it gets the dummy prefix",
              "a</s>b", SPM_SPA, 2, SPM_SP, SPM_B);
    EXPECT_SP(&t, "spm special: the unknown token's text is matched too (llama.cpp's cache_special_tokens)",
              "<unk>", 0);
    EXPECT_SP(&t, "spm special: adjacent markers, no text between", "</s></s><s>", 2, 2, 1);
    EXPECT_SP(&t, "spm special: a marker cut short is text", "</s", SPM_SP, SPM_BYTE0 + '<', SPM_BYTE0 + '/',
              SPM_BYTE0 + 's');
    EXPECT_SP(&t, "spm special: spaces around a marker stay in the fragments", " a</s> ", SPM_SP, SPM_SPA, 2, SPM_SP,
              SPM_SP);
    {
        int w1[] = {1, 1, SPM_SPA}, w2[] = {1};
        expect_sp(&t, "spm special: add_bos and a \"<s>\" in the text give two BOS (as llama.cpp)", "<s>a", 4, 1,
                  w1, 3);
        expect_sp(&t, "spm special: empty text with BOS is just BOS", "", 0, 1, w2, 1);
        int *ids; size_t n;
        CHECK(encode_sp(&t, "", 0, 0, &ids, &n) == 0 && n == 0 && ids == NULL, "spm special: empty text, no ids");
    }
    {
        static const char *plain[] = {"abc", "a a", "\xE2\x82\xAC", "a\0b", "\xC3\xC3\xA4", "<0x41>", "< /s>", " ",
                                      "\x80<\xFF"};
        int ok = 1;
        for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
            ok &= special_same_as_plain(&t, plain[i], strlen(plain[i]) + (i == 3 ? 2 : 0));
        CHECK(ok, "spm special: text without special-token text encodes as tokenizer_encode (byte tokens' text "
              "\"<0x41>\" included: type 6 is not special)");
    }
    tokenizer_free(&t);
    {
        Buf s0 = spm_section(0);
        CHECK(tokenizer_init(&t, s0.p, s0.n, err, sizeof err) == 0, "spm no prefix: parses (%s)", err);
        EXPECT_SP(&t, "spm special, no dummy prefix: no \"▁\" before any fragment", "a</s>b", SPM_A, 2, SPM_B);
        tokenizer_free(&t);
        free(s0.p);
    }
    {
        /* the partition rule: longest special text first over the whole text, then leftmost, non-overlapping */
        enum { X = SPM_NI + 1, XY, AXA, UNUSED, EMPTY, NORMAL };
        static const Extra extra[] = {{"<x>", TOKEN_CONTROL}, {"x><y", TOKEN_CONTROL}, {"aXa", TOKEN_USER_DEFINED},
                                      {"<u>", TOKEN_UNUSED}, {"", TOKEN_CONTROL}, {"<n>", TOKEN_NORMAL}};
        Buf sx = spm_section_ex(1, extra, 6);
        CHECK(tokenizer_init(&t, sx.p, sx.n, err, sizeof err) == 0, "spm extra specials: parses (%s)", err);
        int order[] = {0, 2, XY, 1, X, AXA};   /* <unk>; </s>, x><y; <s>, <x>, aXa */
        CHECK(t.n_special == 6 && memcmp(t.special, order, sizeof order) == 0,
              "spm extra specials: 6 matched tokens, longest text first, equal lengths by id (empty text, unused, "
              "normal left out)");
        EXPECT_SP(&t, "spm special: the longer special wins over an earlier shorter one (\"<x><y>\")", "<x><y>",
                  SPM_SP, SPM_BYTE0 + '<', XY, SPM_SP, SPM_BYTE0 + '>');
        EXPECT_SP(&t, "spm special: repeated occurrences", "<x><x>", X, X);
        EXPECT_SP(&t, "spm special: leftmost occurrence first, non-overlapping (\"aXaXa\")", "aXaXa", AXA, SPM_SP,
                  SPM_BYTE0 + 'X', SPM_A);
        EXPECT_SP(&t, "spm special: a user-defined token is matched", "baXa", SPM_SP, SPM_B, AXA);
        int ok = special_same_as_plain(&t, "<u>", 3) && special_same_as_plain(&t, "<n>", 3);
        CHECK(ok, "spm special: unused and normal tokens' texts stay text");
        tokenizer_free(&t);
        free(sx.p);
    }
    /* every truncation of the section is an error, never a crash (run under make debug for the memory side) */
    int all_fail = 1;
    for (size_t n = 0; n < s.n; n++) {
        Tokenizer u;
        if (tokenizer_init(&u, s.p, n, err, sizeof err) == 0) { all_fail = 0; tokenizer_free(&u); }
    }
    CHECK(all_fail, "spm: all %zu truncations of the section are rejected", s.n);
    s.p[0] = 7;
    CHECK(tokenizer_init(&t, s.p, s.n, err, sizeof err) == -1 && strstr(err, "kind 7"), "bad kind: %s", err);
    s.p[0] = 1;
    s.p[8] = 0xFF; s.p[9] = 0x7F;   /* bos_id huge */
    CHECK(tokenizer_init(&t, s.p, s.n, err, sizeof err) == -1 && strstr(err, "bos_id"), "bad bos: %s", err);
    free(s.p);

    /* byte-level BPE */
    Buf b = bpe_section("gpt2");
    CHECK(tokenizer_init(&t, b.p, b.n, err, sizeof err) == 0, "bpe: tiny vocabulary parses (%s)", err);
    if (check_failures) return;
    EXPECT(&t, "bpe: lowest rank first, leftmost on ties", "aaaaa", BPE_AA, BPE_AAA);
    EXPECT(&t, "bpe: space attaches to the following word", "hi hi", BPE_HI, BPE_SPHI);
    EXPECT(&t, "bpe: digits merge under gpt2", "12", BPE_12);
    EXPECT(&t, "bpe: \\s+(?!\\S) leaves the last space to the word", "a   a", 'a', ' ', ' ', BPE_SPA);
    EXPECT(&t, "bpe: user text <|im_end|> is not the special token", "<|im_end|>", '<', '|', 'i', 'm', '_', 'e', 'n', 'd',
           '|', '>');
    EXPECT(&t, "bpe: NUL is the token of its byte", "a\0a", 'a', 0, 'a');
    EXPECT(&t, "bpe: invalid bytes are their byte tokens and split words", "a\x80" "a\xFF", 'a', 0x80, 'a', 0xFF);
    EXPECT(&t, "bpe: truncated 4-byte sequence", "\xF0\x9F\x98", 0xF0, 0x9F, 0x98);
    EXPECT(&t, "bpe: overlong and surrogate forms are invalid", "\xC0\x80\xED\xA0\x80", 0xC0, 0x80, 0xED, 0xA0, 0x80);
    CHECK(tokenizer_find(&t, "<|im_end|>") == BPE_IMEND && t.eot_id == BPE_IMEND,
          "bpe: tokenizer_find and eot found by text");
    int all = 1;
    for (int c = 0x80; c <= 0xFF; c++) {
        unsigned char x = (unsigned char)c;
        int *ids; size_t n;
        if (encode(&t, &x, 1, &ids, &n) || n != 1 || ids[0] != c) all = 0;
        free(ids);
    }
    CHECK(all, "bpe: every lone byte 0x80..0xFF is its byte token");
    EXPECT_SP(&t, "bpe special: the marker is its id, no prefix on the fragments", "hi<|im_end|>hi", BPE_HI, BPE_IMEND,
              BPE_HI);
    EXPECT_SP(&t, "bpe special: a space before a word after the marker stays with the word", " hi<|im_end|> hi",
              BPE_SPHI, BPE_IMEND, BPE_SPHI);
    CHECK(special_same_as_plain(&t, "<|im_end|", 9) && special_same_as_plain(&t, "aaaaa", 5) &&
          special_same_as_plain(&t, "a\x80" "a\xFF", 4), "bpe special: text without the marker encodes as "
          "tokenizer_encode");
    tokenizer_free(&t);
    Buf bs = bpe_section("smollm");
    CHECK(tokenizer_init(&t, bs.p, bs.n, err, sizeof err) == 0, "bpe smollm: parses (%s)", err);
    if (check_failures) return;
    EXPECT(&t, "bpe smollm: every digit its own piece", "12", '1', '2');
    EXPECT(&t, "bpe smollm: whitespace before a digit stays whole", "a  1", 'a', ' ', ' ', '1');
    tokenizer_free(&t);
    free(bs.p);
    Buf bx = bpe_section("no-such-pre");
    CHECK(tokenizer_init(&t, bx.p, bx.n, err, sizeof err) == -1 && strstr(err, "'no-such-pre'"),
          "unknown pre-tokenizer is an error naming it: %s", err);
    free(bx.p);
    free(b.p);
}

/* ---- real vocabularies ---- */

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    Buf b = {0};
    char tmp[65536];
    size_t k;
    while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) buf_put(&b, tmp, k);
    fclose(f);
    buf_put(&b, "", 1);   /* NUL after the data; not counted */
    *n = b.n - 1;
    return b.p;
}

static uint64_t rd64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* the tokenizer section of a model.bin (docs/FORMAT.md header fields at 64 and 72) */
static int load_vocab(Tokenizer *t, const char *path, unsigned char **file) {
    size_t n;
    unsigned char *p = read_file(path, &n);
    char err[256];
    if (!p || n < 256 || memcmp(p, "KVLB", 4) != 0) { printf("FAIL %s: not a model.bin\n", path); free(p); return -1; }
    uint64_t off = rd64(p + 64), len = rd64(p + 72);
    if (off > n || len > n - off || len == 0) { printf("FAIL %s: no tokenizer section\n", path); free(p); return -1; }
    if (tokenizer_init(t, p + off, len, err, sizeof err)) { printf("FAIL %s: %s\n", path, err); free(p); return -1; }
    *file = p;
    return 0;
}

static size_t unescape(char *s, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\\' && i + 1 < n) {
            char c = s[++i];
            s[o++] = c == 'n' ? '\n' : c == 'r' ? '\r' : c == 't' ? '\t' : c;
        } else s[o++] = s[i];
    }
    return o;
}

static size_t parse_ids(const char *s, int **ids) {
    size_t n = 0, cap = 16;
    int *v = malloc(cap * sizeof *v);
    while (*s) {
        while (*s == ' ' || *s == ',' || *s == '[' || *s == ']' || *s == '\r') s++;
        if (!*s || *s == '\n') break;
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s) break;
        if (n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        v[n++] = (int)x;
        s = end;
    }
    *ids = v;
    return n;
}

/* one case: encode and compare with llama.cpp's ids; decode both id lists and compare with the text */
typedef struct { size_t cases, mismatches, roundtrip_fail, ref_decode_fail, special_mismatches; } Tally;

static void check_case(const Tokenizer *t, const char *name, const char *text, size_t len, const int *want,
                       size_t nwant, Tally *tl, size_t lineno) {
    int *ids; size_t nids;
    tl->cases++;
    if (encode(t, text, len, &ids, &nids)) { tl->mismatches++; return; }
    if (!ids_equal(ids, nids, want, nwant)) {
        if (tl->mismatches++ < 5) {
            printf("  %s case %zu mismatch: \"%.*s\"\n", name, lineno, (int)(len < 120 ? len : 120), text);
            print_ids("llama.cpp", want, nwant);
            print_ids("kvlab    ", ids, nids);
        }
    }
    Buf a = {0}, b = {0};
    decode_all(t, ids, nids, &a);
    decode_stream(t, ids, nids, &b, NULL);
    if (!(a.n == len && b.n == len && (len == 0 || (memcmp(a.p, text, len) == 0 && memcmp(b.p, text, len) == 0))))
        if (tl->roundtrip_fail++ < 3) printf("  %s case %zu: round trip differs\n", name, lineno);
    decode_all(t, want, nwant, &a);
    if (!(a.n == len && (len == 0 || memcmp(a.p, text, len) == 0)))
        if (tl->ref_decode_fail++ < 3) printf("  %s case %zu: decoding llama.cpp's ids differs\n", name, lineno);
    free(a.p); free(b.p); free(ids);
    /* no case holds special-token text, so parse_special = true changes nothing in llama.cpp: nor may it here */
    if (encode_sp(t, text, len, 0, &ids, &nids) || !ids_equal(ids, nids, want, nwant))
        if (tl->special_mismatches++ < 3) printf("  %s case %zu: tokenizer_encode_special differs\n", name, lineno);
    free(ids);
}

static void golden_corpus(const Tokenizer *t, const char *name, const char *corpus, const char *idsf) {
    size_t nc, ni;
    char *c = (char *)read_file(corpus, &nc), *ip = (char *)read_file(idsf, &ni);
    if (!c || !ip) { CHECK(0, "%s: read %s and %s", name, corpus, idsf); free(c); free(ip); return; }
    Tally tl = {0};
    char *cl = c, *il = ip;
    size_t lineno = 0;
    while (*cl && *il) {
        char *ce = strchr(cl, '\n'), *ie = strchr(il, '\n');
        if (!ce || !ie) break;
        *ie = 0;
        size_t len = unescape(cl, (size_t)(ce - cl));
        int *want;
        size_t nw = parse_ids(il, &want);
        check_case(t, name, cl, len, want, nw, &tl, ++lineno);
        free(want);
        cl = ce + 1; il = ie + 1;
    }
    CHECK(tl.cases >= 2000 && tl.mismatches == 0, "%s: corpus of %zu strings, %zu mismatches against llama.cpp", name,
          tl.cases, tl.mismatches);
    CHECK(tl.roundtrip_fail == 0, "%s: decode(encode(s)) == s and streaming == at once for all %zu strings (%zu fail)",
          name, tl.cases, tl.roundtrip_fail);
    CHECK(tl.ref_decode_fail == 0, "%s: decoding llama.cpp's ids gives the text back (%zu fail)", name,
          tl.ref_decode_fail);
    CHECK(tl.special_mismatches == 0, "%s: tokenizer_encode_special gives llama.cpp's ids on all %zu strings too "
          "(none holds special-token text; %zu mismatches)", name, tl.cases, tl.special_mismatches);
    free(c); free(ip);
}

/* llama.cpp's own cases: NAME.gguf.inp (cases split by "\n__ggml_vocab_test__\n"), NAME.gguf.out (ids per line) */
static void reference_cases(const Tokenizer *t, const char *name, const char *inp, const char *outp) {
    size_t ni, no;
    char *in = (char *)read_file(inp, &ni), *out = (char *)read_file(outp, &no);
    if (!in || !out) { CHECK(0, "%s: read %s and %s", name, inp, outp); free(in); free(out); return; }
    static const char sep[] = "\n__ggml_vocab_test__\n";
    Tally tl = {0};
    size_t pos = 0, lineno = 0;
    char *ol = out;
    while (pos < ni && *ol) {
        char *next = strstr(in + pos, sep);
        size_t end = next ? (size_t)(next - in) : ni;
        char *oe = strchr(ol, '\n');
        if (oe) *oe = 0;
        int *want;
        size_t nw = parse_ids(ol, &want);
        check_case(t, name, in + pos, end - pos, want, nw, &tl, ++lineno);
        free(want);
        ol = oe ? oe + 1 : ol + strlen(ol);
        pos = next ? end + sizeof sep - 1 : ni;
    }
    CHECK(tl.cases > 0 && tl.mismatches == 0, "%s: llama.cpp's test-tokenizer-0 cases: %zu, %zu mismatches", name,
          tl.cases, tl.mismatches);
    CHECK(tl.roundtrip_fail == 0, "%s: test-tokenizer-0 cases round trip (%zu fail)", name, tl.roundtrip_fail);
    CHECK(tl.special_mismatches == 0, "%s: test-tokenizer-0 cases through tokenizer_encode_special (%zu mismatches)",
          name, tl.special_mismatches);
    free(in); free(out);
}

static int byte_token(const Tokenizer *t, int b) {
    if (t->kind == TOKENIZER_SPM) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        return tokenizer_find(t, name);
    }
    char o[4];
    size_t n = utf8_put(bytes_cp(b), o);
    o[n] = 0;
    return tokenizer_find(t, o);
}

/* 1 when every byte of s has a token of its own (SmolLM2 lacks 21 byte characters: those cannot round trip) */
static int representable(const Tokenizer *t, const void *s, size_t n) {
    for (size_t i = 0; i < n; i++) if (byte_token(t, ((const unsigned char *)s)[i]) < 0) return 0;
    return 1;
}

static void vocab_properties(const Tokenizer *t, const char *name) {
    /* each invalid byte alone, and inside text, is its byte token */
    int ok = 1, lossy = 0;
    for (int c = 0x80; c <= 0xFF; c++) {
        unsigned char s[3] = {'x', (unsigned char)c, 'y'};
        int *ids; size_t n;
        if (byte_token(t, c) < 0) {   /* no token: it must read as U+FFFD, as llama.cpp reads it */
            int *r; size_t nr;
            lossy++;
            if (encode(t, s + 1, 1, &ids, &n) || encode(t, "\xEF\xBF\xBD", 3, &r, &nr) || !ids_equal(ids, n, r, nr)) ok = 0;
            free(ids); free(r);
            continue;
        }
        if (encode(t, s + 1, 1, &ids, &n) || n == 0 || ids[n - 1] != byte_token(t, c)) ok = 0;
        free(ids);
        if (c < 0xC2 || c > 0xF4) {   /* never a lead byte: also in the middle of text */
            int found = 0;
            if (encode(t, s, 3, &ids, &n)) ok = 0;
            for (size_t i = 0; i < n; i++) found |= ids[i] == byte_token(t, c);
            if (!found) ok = 0;
            free(ids);
        }
        if (!round_trip(t, s, 3) || !round_trip(t, s + 1, 1)) ok = 0;
    }
    CHECK(ok, "%s: every byte 0x80..0xFF alone is its byte token; round trips alone and inside text (%d bytes "
          "without a token encode as U+FFFD)", name, lossy);
    static const struct { const char *s; size_t n; } bad[] = {
        {"\xE4\xBD", 2}, {"\xF0\x9F\x98", 3}, {"a\xC3", 2}, {"\xC3z", 2}, {"\xC0\x80", 2}, {"\xED\xA0\x80", 3},
        {"\xF5\x80\x80\x80", 4}, {"\xFF\xFE", 2}, {"\x00", 1}, {"a\x00\x00 b", 5}, {"\xE4\xBD\xE4\xBD\xA0", 5},
    };
    ok = 1;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (representable(t, bad[i].s, bad[i].n)) ok &= round_trip(t, bad[i].s, bad[i].n);
    CHECK(ok, "%s: truncated sequences, overlong forms, surrogates, NULs round trip", name);
    {
        int *ids; size_t n;
        int nul_ok = encode(t, "\xE4\xBD", 2, &ids, &n) == 0 && n >= 2 && ids[n - 2] == byte_token(t, 0xE4) &&
                     ids[n - 1] == byte_token(t, 0xBD);
        free(ids);
        nul_ok &= encode(t, "\0", 1, &ids, &n) == 0 && n >= 1 && ids[n - 1] == byte_token(t, 0);
        free(ids);
        CHECK(nul_ok, "%s: a truncated sequence gives one byte token per byte; NUL gives byte 0's token", name);
    }
    /* random bytes */
    uint64_t x = 88172645463325252ull;
    ok = 1;
    unsigned char rnd[300];
    for (int i = 0; i < 500; i++) {
        size_t n = (size_t)(i % 300);
        for (size_t k = 0; k < n; k++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            /* mostly ASCII with some high bytes, so real merges happen between the invalid ones */
            rnd[k] = (unsigned char)((x >> 24) % 5 == 0 ? (x >> 32) : 0x20 + (x >> 40) % 0x5F);
            if (byte_token(t, rnd[k]) < 0) rnd[k] = '?';
        }
        ok &= round_trip(t, rnd, n);
    }
    CHECK(ok, "%s: 500 random byte strings round trip", name);
    /* special-token text from a user is ordinary text */
    static const char *specials[] = {"<|im_end|>", "<|im_start|>", "<|endoftext|>", "<s>", "</s>", "<unk>"};
    ok = 1;
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
        int sid = tokenizer_find(t, specials[i]);
        if (sid < 0) continue;
        int *ids; size_t n;
        if (encode(t, specials[i], strlen(specials[i]), &ids, &n)) ok = 0;
        for (size_t k = 0; k < n; k++) if (ids[k] == sid) ok = 0;
        free(ids);
        ok &= round_trip(t, specials[i], strlen(specials[i]));
    }
    CHECK(ok, "%s: user text \"<|im_end|>\", \"<s>\" etc. never becomes the special token", name);
    /* long inputs stay fast: a regression guard against quadratic merging, not a benchmark (that is
     * tools/bench_tokenizer.sh); 5 s is ~50x what it takes on a laptop core */
    char *big = malloc(30000);
    double worst = 0;
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 30000; i++) big[i] = k == 0 ? 'a' : (char)('0' + (i * 7) % 10);
        int *ids; size_t n;
        double t0 = now_s();
        int rc = encode(t, big, 30000, &ids, &n);
        double dt = now_s() - t0;
        if (rc || !round_trip(t, big, 30000)) worst = 1e9;
        if (dt > worst) worst = dt;
        free(ids);
    }
    free(big);
    CHECK_LE(worst, 5.0, "%s: 30,000 'a' and 30,000 digits encode (and round trip), slowest %.3f s", name, worst);
}

/* ---- tokenizer_encode_special on real vocabularies (--special) ---- */

/* every special token's text alone is its id; between two words it is the id between their plain encodings */
static void special_each_token(const Tokenizer *t, const char *name) {
    int ok = 1;
    for (int i = 0; i < t->n_special; i++) {
        int id = t->special[i];
        char s[TOKENIZER_MAX_TOKEN_BYTES + 8];
        size_t n = t->text[id].len;
        memcpy(s, t->arena + t->text[id].off, n);
        int *ids, *a, *b; size_t k, na, nb;
        if (encode_sp(t, s, n, 0, &ids, &k) || k != 1 || ids[0] != id) ok = 0;
        free(ids);
        memmove(s + 2, s, n); s[0] = 'x'; s[1] = ' '; s[n + 2] = ' '; s[n + 3] = 'y';
        if (encode(t, "x ", 2, &a, &na) || encode(t, " y", 2, &b, &nb) || encode_sp(t, s, n + 4, 0, &ids, &k) ||
            k != na + 1 + nb || memcmp(ids, a, na * sizeof *a) || ids[na] != id || memcmp(ids + na + 1, b, nb * sizeof *b))
            ok = 0;
        free(a); free(b); free(ids);
    }
    CHECK(ok && t->n_special > 0, "%s special: each of the %d special tokens' texts alone is its id, and between "
          "\"x \" and \" y\" it sits between their own encodings", name, t->n_special);
}

/* prompts.txt (comments skipped) against greedy.txt's "prompt N ids:" lines: llama.cpp, parse_special = true */
static void special_prompts(const Tokenizer *t, const char *prompts, const char *greedy) {
    size_t np, ng;
    char *p = (char *)read_file(prompts, &np), *g = (char *)read_file(greedy, &ng);
    if (!p || !g) { CHECK(0, "smollm2 special: read %s and %s", prompts, greedy); free(p); free(g); return; }
    int n = 0;
    for (char *line = p; *line; ) {
        char *e = strchr(line, '\n');
        if (!e) break;
        if (*line != '#') {
            size_t len = unescape(line, (size_t)(e - line));
            char key[32];
            snprintf(key, sizeof key, "prompt %d ids:", n);
            char *k = strstr(g, key);
            int *want = NULL, *ids = NULL; size_t nw = 0, nid = 0;
            if (k) nw = parse_ids(k + strlen(key), &want);
            int chatml = len >= 12 && memcmp(line, "<|im_start|>", 12) == 0;
            int ok = k && nw > 0 && encode_sp(t, line, len, 0, &ids, &nid) == 0 && ids_equal(ids, nid, want, nw);
            CHECK(ok, "smollm2 special: prompt %d (%s) gives llama.cpp's %zu ids (greedy.txt, parse_special = true)", n,
                  chatml ? "ChatML, special markers" : "plain text", nw);
            if (!ok) { print_ids("llama.cpp", want, nw); print_ids("kvlab    ", ids, nid); }
            free(want); free(ids);
            n++;
        }
        line = e + 1;
    }
    CHECK(n == 5, "smollm2 special: %d prompts read from %s", n, prompts);
    free(p); free(g);
}

/* special.txt: "text ESCAPED" / "ids ..." pairs from Hugging Face tokenizers (tools/gen_special_golden.py) */
static void special_hf_golden(const Tokenizer *t, const char *path) {
    size_t n;
    char *f = (char *)read_file(path, &n);
    if (!f) { CHECK(0, "smollm2 special: read %s", path); return; }
    size_t cases = 0, bad = 0;
    char *text = NULL; size_t tlen = 0;
    for (char *line = f; *line; ) {
        char *e = strchr(line, '\n');
        if (!e) break;
        *e = 0;
        if (strncmp(line, "text ", 5) == 0) { text = line + 5; tlen = unescape(text, (size_t)(e - text)); }
        else if (strncmp(line, "ids ", 4) == 0 && text) {
            int *want, *ids = NULL; size_t nw = parse_ids(line + 4, &want), nid = 0;
            cases++;
            if (encode_sp(t, text, tlen, 0, &ids, &nid) || !ids_equal(ids, nid, want, nw)) {
                if (bad++ < 3) {
                    printf("  case %zu: \"%.*s\"\n", cases, (int)(tlen < 100 ? tlen : 100), text);
                    print_ids("HF   ", want, nw); print_ids("kvlab", ids, nid);
                }
            }
            free(want); free(ids);
            text = NULL;
        }
        line = e + 1;
    }
    CHECK(cases >= 10 && bad == 0, "smollm2 special: %zu cases against Hugging Face tokenizers (%s), %zu mismatches",
          cases, path, bad);
    free(f);
}

#define SMOL_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

static void special_smollm2(const Tokenizer *t, const char *prompts, const char *greedy, const char *hf) {
    special_prompts(t, prompts, greedy);
    /* the reported case: a user turn starting with "\n\n", rendered whole */
    static const char chat[] = "<|im_start|>system\n" SMOL_SYSTEM "<|im_end|>\n<|im_start|>user\n\n\nHello<|im_end|>\n"
                               "<|im_start|>assistant\n";
    int *ids = NULL; size_t n = 0;
    int found = 0, at = -1;
    if (encode_sp(t, chat, sizeof chat - 1, 0, &ids, &n) == 0)
        for (size_t i = 0; i + 3 <= n; i++)
            if (ids[i] == 4093 && ids[i + 1] == 1116 && ids[i + 2] == 198) { found++; at = (int)i; }
    CHECK(found == 1 && at > 0 && ids[at - 1] == 1 && n > (size_t)at + 4 && ids[at + 3] == 19556 && ids[at + 4] == 2,
          "smollm2 special: user \"\\n\\nHello\" rendered whole gives <|im_start|> 4093 1116 198 19556 "
          "<|im_end|> (\"user\", \"\\n\\n\", \"\\n\", \"Hello\")");
    if (!(found == 1)) print_ids("got", ids, n);
    free(ids);
    EXPECT_PARTS(t, "smollm2 special: the whole \"\\n\\nHello\" chat is its markers' ids and each fragment's own "
                 "encoding", MK("<|im_start|>"), TX("system\n" SMOL_SYSTEM), MK("<|im_end|>"), TX("\n"),
                 MK("<|im_start|>"), TX("user\n\n\nHello"), MK("<|im_end|>"), TX("\n"), MK("<|im_start|>"),
                 TX("assistant\n"));
    {
        /* what rendering in parts gives: "user\n" and the message encoded apart */
        int *a, *b; size_t na, nb;
        int ok = encode(t, "user\n", 5, &a, &na) == 0 && encode(t, "\n\nHello", 7, &b, &nb) == 0 && na == 2 &&
                 nb == 3 && a[0] == 4093 && a[1] == 198 && b[0] == 198 && b[1] == 198 && b[2] == 19556;
        CHECK(ok, "smollm2 special: encoded in parts the same turn is 4093 198 198 198 19556 (the reported "
              "difference)");
        free(a); free(b);
    }
    EXPECT_PARTS(t, "smollm2 special: a message quoting \"<|im_end|>\" is split there too (the whole string is "
                 "parsed)", MK("<|im_start|>"), TX("user\nquote "), MK("<|im_end|>"), TX(" inside"), MK("<|im_end|>"));
    EXPECT_PARTS(t, "smollm2 special: markers next to digits and spaces", TX("1"), MK("<|im_end|>"), TX(" 2 "),
                 MK("<jupyter_code>"), MK("<|endoftext|>"), TX("\n\n"));
    if (hf) special_hf_golden(t, hf);
}

/* Llama 2 (SentencePiece, <s> </s> control, <unk> unknown): llama.cpp prefixes every fragment with the dummy "▁",
 * the one after a special token included (tokenize: is_prev_special) */
static void special_llama_spm(const Tokenizer *t) {
    int sa = tokenizer_find(t, "\xE2\x96\x81" "a"), sb = tokenizer_find(t, "\xE2\x96\x81" "b");
    CHECK(t->add_space_prefix && sa == 263 && sb == 289 && t->bos_id == 1 && t->eos_id == 2 && t->unk_id == 0,
          "llama-spm special: the vocabulary (dummy prefix on, ▁a = 263, ▁b = 289, <unk> <s> </s> = 0 1 2)");
    EXPECT_SP(t, "llama-spm special: \"a</s>b\" = ▁a </s> ▁b (the fragment after </s> gets \"▁\")", "a</s>b", 263, 2,
              289);
    EXPECT_SP(t, "llama-spm special: \"<s>a\" = <s> ▁a", "<s>a", 1, 263);
    EXPECT_SP(t, "llama-spm special: \"<unk>\" is the unknown token (type UNKNOWN is matched)", "<unk>", 0);
    {
        int w[] = {1, 1, 263};
        expect_sp(t, "llama-spm special: add_bos before a \"<s>\" in the text: two BOS", "<s>a", 4, 1, w, 3);
    }
    EXPECT_PARTS(t, "llama-spm special: \"Hello</s>\\n<s>World\" by the rule", TX("Hello"), MK("</s>"), TX("\n"),
                 MK("<s>"), TX("World"));
    EXPECT_PARTS(t, "llama-spm special: spaces on both sides of a marker stay in the fragments", TX(" a "), MK("</s>"),
                 TX(" b"));
    EXPECT_PARTS(t, "llama-spm special: a marker inside a word", TX("<s"), MK("</s>"), TX(">"));
    CHECK(special_same_as_plain(t, "[INST] hi [/INST]", 17) && special_same_as_plain(t, "<0x41>", 6) &&
          special_same_as_plain(t, "< s>", 4), "llama-spm special: \"[INST]\" (text in Llama 2), byte tokens' text "
          "\"<0x41>\" and \"< s>\" stay text");
}

static void special_gpt2(const Tokenizer *t) {
    EXPECT_SP(t, "gpt2 special: \"a<|endoftext|>b\" = a <|endoftext|> b (no prefix)", "a<|endoftext|>b", 64, 50256, 65);
    EXPECT_PARTS(t, "gpt2 special: spaces around the marker by the rule", TX("Hello "), MK("<|endoftext|>"),
                 TX(" world"));
}

/* peak resident memory so far, KiB (Linux /proc; -1 elsewhere) */
static long peak_rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) v = strtol(line + 6, NULL, 10);
    fclose(f);
    return v;
}

static int bench(const char *model, const char *textf) {
    Tokenizer t;
    unsigned char *file;
    if (load_vocab(&t, model, &file)) return 1;
    size_t n = 0;
    unsigned char *text = textf ? read_file(textf, &n) : NULL;
    if (textf && !text) { fprintf(stderr, "cannot read %s\n", textf); return 1; }
    int *ids; size_t nids;
    char err[256];
    long rss0 = peak_rss_kib();
    printf("vocabulary %s: %d tokens, kind %d, pre '%s'; peak RSS after loading it and the text: %ld KiB\n", model,
           t.vocab_size, t.kind, t.pre, rss0);
    if (text) {
        double best = 1e30;
        for (int r = 0; r < 3; r++) {
            double t0 = now_s();
            if (tokenizer_encode(&t, text, n, 0, &ids, &nids, err, sizeof err)) { fprintf(stderr, "%s\n", err); return 1; }
            double dt = now_s() - t0;
            if (dt < best) best = dt;
            if (r < 2) free(ids);
        }
        Buf a = {0};
        decode_all(&t, ids, nids, &a);
        printf("encode %s: %zu bytes -> %zu tokens in %.3f s: %.2f MB/s (%.2f bytes/token), round trip %s\n", textf, n,
               nids, best, n / best / 1e6, (double)n / (double)nids,
               a.n == n && memcmp(a.p, text, n) == 0 ? "exact" : "DIFFERS");
        free(a.p); free(ids);
        long rss1 = peak_rss_kib();
        printf("peak RSS while encoding it: %ld KiB, +%ld KiB over the loaded state = %.1f bytes per input byte "
               "(ids, symbols, heap, code points and decode buffer, all O(input))\n", rss1, rss1 - rss0,
               (rss1 - rss0) * 1024.0 / (double)n);
    }
    char *big = malloc(30000);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 30000; i++) big[i] = k == 0 ? 'a' : (char)('0' + (i * 7) % 10);
        double t0 = now_s();
        if (tokenizer_encode(&t, (unsigned char *)big, 30000, 0, &ids, &nids, err, sizeof err)) return 1;
        printf("encode 30,000 %s: %.4f s, %zu tokens\n", k == 0 ? "'a' (no spaces)" : "digits", now_s() - t0, nids);
        free(ids);
    }
    free(big); free(text); free(file);
    tokenizer_free(&t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "--bench") == 0) return bench(argv[2], argc > 3 ? argv[3] : NULL);
    if (argc == 1) { unit_tests(); CHECK_EXIT(); }
    if (argc >= 4 && strcmp(argv[1], "--special") == 0) {
        Tokenizer t;
        unsigned char *file;
        if (load_vocab(&t, argv[2], &file)) return 1;
        const char *name = argv[3];
        special_each_token(&t, name);
        if (strcmp(name, "smollm2") == 0 && argc == 7) special_smollm2(&t, argv[4], argv[5], argv[6]);
        else if (strcmp(name, "smollm2") == 0 && argc == 6) special_smollm2(&t, argv[4], argv[5], NULL);
        else if (strcmp(name, "llama-spm") == 0) special_llama_spm(&t);
        else if (strcmp(name, "gpt2") == 0) special_gpt2(&t);
        tokenizer_free(&t);
        free(file);
        CHECK_EXIT();
    }
    if (argc != 5 && argc != 7) {
        fprintf(stderr, "usage: test_tokenizer [MODEL.bin NAME CORPUS.txt IDS.txt [REF.inp REF.out]]\n");
        return 2;
    }
    Tokenizer t;
    unsigned char *file;
    if (load_vocab(&t, argv[1], &file)) return 1;
    const char *name = argv[2];
    printf("%s: kind %d, %d tokens, pre '%s', add_bos %d, add_space_prefix %d\n", name, t.kind, t.vocab_size, t.pre,
           t.add_bos, t.add_space_prefix);
    golden_corpus(&t, name, argv[3], argv[4]);
    if (argc == 7) reference_cases(&t, name, argv[5], argv[6]);
    vocab_properties(&t, name);
    tokenizer_free(&t);
    free(file);
    CHECK_EXIT();
}
