/* tokenizer.c: SentencePiece BPE and byte-level BPE over the vocabulary in a model.bin tokenizer section.
 * Both merge with a priority queue over a linked list of symbols (O(n log n), never quadratic); byte-level BPE
 * first splits the text with a hand-written matcher for the pre-tokenizer's regex (unicode_tables.h gives the
 * letter/number/space classes). The reference is llama.cpp at commit c392e50: the same merge order, tie-breaks and
 * regex edge cases. What it deliberately does differently, only on bytes that are not valid UTF-8: each such byte is
 * its own symbol (byte token) instead of llama.cpp's U+FFFD, so decode(encode(bytes)) == bytes always.
 * Legend: n_tokens = vocab_size; a "string" is an encode-side byte string: ids < vocab_size are tokens, larger ones
 * are merge intermediates that are not tokens; a "symbol" is a run of input bytes being merged. */
#include "tokenizer.h"
#include "util.h"
#include "unicode_tables.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------------------------
 * errors, small helpers */

static uint64_t hash_bytes(const void *p, size_t n) {   /* FNV-1a, 64 bit */
    const unsigned char *s = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) { h ^= s[i]; h *= 1099511628211ull; }
    return h ^ (h >> 29);
}

static uint64_t hash_pair(int32_t a, int32_t b) {
    uint64_t h = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    h ^= h >> 33; h *= 0xff51afd7ed558ccdull; h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ull; h ^= h >> 33;
    return h;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* Length of the valid UTF-8 sequence at s (n bytes available), 0 if s[0] does not start one. Strict: no overlong
 * forms, no surrogates, nothing above U+10FFFF. *cp receives the code point. */
static int utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    int len; uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; v = c & 0x0F; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; v = c & 0x07; min = 0x10000; }
    else return 0;
    if ((size_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return len;
}

/* GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in
 * byte order, so every byte has a visible character and token texts never hold spaces or control bytes. */
static uint32_t byte_to_cp(int b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) return (uint32_t)b;
    int n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) n++;
    return 256u + (uint32_t)n;
}

/* ---------------------------------------------------------------------------------------------------------------
 * code point classes (unicode_tables.h) */

#define UCLASS_ANY 8   /* set for every code point inside the span being matched; 0 means "outside" */

static int uclass(uint32_t cp) {
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return UCLASS_LETTER;
        if (cp >= '0' && cp <= '9') return UCLASS_NUMBER;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return UCLASS_SPACE;
        return 0;
    }
    size_t lo = 0, hi = sizeof UNICODE_RANGES / sizeof UNICODE_RANGES[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp > UNICODE_RANGES[mid].last) lo = mid + 1;
        else if (cp < UNICODE_RANGES[mid].first) hi = mid;
        else return UNICODE_RANGES[mid].flags;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * string table: an arena of bytes plus an open-addressing hash from bytes to string index */

static int arena_put(Tokenizer *t, const void *p, size_t n, size_t *off) {
    if (t->arena_len + n + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 4096;
        while (cap < t->arena_len + n + 1) cap *= 2;
        char *a = realloc(t->arena, cap);
        if (!a) return -1;
        t->arena = a; t->arena_cap = cap;
    }
    *off = t->arena_len;
    if (n) memcpy(t->arena + t->arena_len, p, n);
    t->arena_len += n;
    t->arena[t->arena_len] = 0;   /* keeps the chat template and token texts NUL-terminated in place */
    t->arena_len += 1;
    return 0;
}

static int str_find(const Tokenizer *t, const void *p, size_t n) {
    size_t mask = t->str_hash_cap - 1;
    for (size_t i = hash_bytes(p, n) & mask;; i = (i + 1) & mask) {
        int32_t s = t->str_hash[i];
        if (s < 0) return -1;
        if (t->str[s].len == n && memcmp(t->arena + t->str[s].off, p, n) == 0) return s;
    }
}

/* Map bytes -> string s (replacing an earlier string with the same bytes: llama.cpp keeps the last token id). */
static void str_index(Tokenizer *t, int s) {
    const char *p = t->arena + t->str[s].off;
    size_t n = t->str[s].len, mask = t->str_hash_cap - 1;
    for (size_t i = hash_bytes(p, n) & mask;; i = (i + 1) & mask) {
        int32_t o = t->str_hash[i];
        if (o < 0 || (t->str[o].len == n && memcmp(t->arena + t->str[o].off, p, n) == 0)) {
            t->str_hash[i] = s;
            return;
        }
    }
}

/* The string with these bytes, added as a non-token intermediate when absent; -1 when out of memory. */
static int str_intern(Tokenizer *t, const void *p, size_t n) {
    int s = str_find(t, p, n);
    if (s >= 0) return s;
    if (t->n_str >= t->cap_str) return -1;   /* sized at init from the merge count: cannot happen */
    size_t off;
    if (arena_put(t, p, n, &off)) return -1;
    s = t->n_str++;
    t->str[s].off = off; t->str[s].len = (uint32_t)n;
    str_index(t, s);
    return s;
}

/* ---------------------------------------------------------------------------------------------------------------
 * section parser */

typedef struct { const unsigned char *p; size_t n, pos; int bad; } Reader;

static uint32_t rd_u32(Reader *r) {
    if (r->bad || r->n - r->pos < 4) { r->bad = 1; return 0; }
    const unsigned char *q = r->p + r->pos;
    r->pos += 4;
    return (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
}

static const unsigned char *rd_bytes(Reader *r, size_t n) {
    if (r->bad || r->n - r->pos < n) { r->bad = 1; return NULL; }
    const unsigned char *q = r->p + r->pos;
    r->pos += n;
    return q;
}

static const struct { const char *name; int type; int ignore_merges; } PRE_NAMES[] = {
    /* GPT-2 pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) */
    {"gpt2", PRE_GPT2, 0}, {"gpt-2", PRE_GPT2, 0}, {"phi-2", PRE_GPT2, 0}, {"roberta-bpe", PRE_GPT2, 0},
    {"gigachat", PRE_GPT2, 0}, {"jina-es", PRE_GPT2, 0}, {"jina-de", PRE_GPT2, 0}, {"jina-v1-en", PRE_GPT2, 0},
    {"jina-v2-es", PRE_GPT2, 0}, {"jina-v2-de", PRE_GPT2, 0}, {"jina-v2-code", PRE_GPT2, 0},
    {"mpt", PRE_GPT2, 0}, {"olmo", PRE_GPT2, 0}, {"jais", PRE_GPT2, 0},
    /* every \p{N} its own piece, then the GPT-2 pattern on the text between */
    {"smollm", PRE_SMOLLM, 0}, {"starcoder", PRE_SMOLLM, 0}, {"refact", PRE_SMOLLM, 0},
    {"command-r", PRE_SMOLLM, 0}, {"codeshell", PRE_SMOLLM, 0}, {"exaone", PRE_SMOLLM, 0},
    {"minerva-7b", PRE_SMOLLM, 0},
    /* Llama 3 pattern; llama.cpp also emits a pre-token that is a whole token without merging for these four */
    {"llama-bpe", PRE_LLAMA3, 1}, {"llama3", PRE_LLAMA3, 1}, {"llama-v3", PRE_LLAMA3, 1}, {"falcon3", PRE_LLAMA3, 1},
    {"dbrx", PRE_LLAMA3, 0}, {"smaug-bpe", PRE_LLAMA3, 0},
};

void tokenizer_free(Tokenizer *t) {
    if (!t) return;
    free(t->scores); free(t->types); free(t->text); free(t->piece); free(t->str);
    free(t->arena); free(t->str_hash); free(t->merge); free(t->special);
    memset(t, 0, sizeof *t);
    t->bos_id = t->eos_id = t->eot_id = t->pad_id = t->unk_id = -1;
    t->chat_template = "";
}

/* The raw bytes a byte-level BPE token text stands for (n_out bytes into out, which holds n bytes); -1 when the
 * text has a character outside the byte-to-unicode table (such a token can never come out of merging). */
static int bpe_text_to_bytes(const int16_t *cp2byte, const unsigned char *s, size_t n, char *out, size_t *n_out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = utf8_decode(s + i, n - i, &cp);
        if (k == 0 || cp >= 512 || cp2byte[cp] < 0) return -1;
        out[o++] = (char)cp2byte[cp];
        i += (size_t)k;
    }
    *n_out = o;
    return 0;
}

typedef struct { uint32_t len; int id; } SpecialKey;

static int special_before(const void *a, const void *b) {   /* longer text first, then lower id */
    const SpecialKey *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The tokens tokenizer_encode_special splits out of text: llama.cpp's cache_special_tokens (types CONTROL,
 * USER_DEFINED, UNKNOWN), sorted by text length, longest first. A token with empty text is left out (llama.cpp would
 * match it at every offset and never advance). */
static int build_special(Tokenizer *t) {
    int n = 0;
    for (int i = 0; i < t->vocab_size; i++) {
        int ty = t->types[i];
        if ((ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED || ty == TOKEN_UNKNOWN) && t->text[i].len > 0) n++;
    }
    if (n == 0) return 0;
    SpecialKey *k = malloc((size_t)n * sizeof *k);
    t->special = malloc((size_t)n * sizeof *t->special);
    if (!k || !t->special) { free(k); return -1; }
    n = 0;
    for (int i = 0; i < t->vocab_size; i++) {
        int ty = t->types[i];
        if ((ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED || ty == TOKEN_UNKNOWN) && t->text[i].len > 0)
            k[n++] = (SpecialKey){t->text[i].len, i};
    }
    qsort(k, (size_t)n, sizeof *k, special_before);
    for (int i = 0; i < n; i++) t->special[i] = k[i].id;
    t->n_special = n;
    free(k);
    return 0;
}

int tokenizer_init(Tokenizer *t, const void *section, size_t nbytes, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    tokenizer_free(t);
    Reader r = {section, nbytes, 0, 0};
    char tmp[TOKENIZER_MAX_TOKEN_BYTES * 4];
    int16_t cp2byte[512];

    uint32_t kind = rd_u32(&r), n_tokens = rd_u32(&r);
    int32_t special[5];
    for (int i = 0; i < 5; i++) special[i] = (int32_t)rd_u32(&r);
    uint32_t add_bos = rd_u32(&r), add_prefix = rd_u32(&r);
    const unsigned char *pre = rd_bytes(&r, 32);
    uint32_t tlen = rd_u32(&r);
    const unsigned char *tmpl = rd_bytes(&r, tlen);
    if (r.bad) { errorf(err, errlen, "tokenizer section truncated in its header (%zu bytes)", nbytes); goto fail; }
    if (kind != TOKENIZER_SPM && kind != TOKENIZER_BPE) {
        errorf(err, errlen, "tokenizer kind %u unknown (1 = SentencePiece BPE, 2 = byte-level BPE)", kind);
        goto fail;
    }
    /* each token takes at least 12 bytes, which bounds n_tokens by the section length */
    if (n_tokens == 0 || n_tokens > (nbytes - r.pos) / 12 || n_tokens > (1u << 30)) {
        errorf(err, errlen, "tokenizer n_tokens %u does not fit the %zu-byte section", n_tokens, nbytes);
        goto fail;
    }
    t->kind = (int)kind;
    t->vocab_size = (int)n_tokens;
    t->add_bos = add_bos != 0;
    t->add_space_prefix = add_prefix != 0;
    memcpy(t->pre, pre, 32);
    t->pre[32] = 0;
    static const char *special_names[5] = {"bos_id", "eos_id", "eot_id", "pad_id", "unk_id"};
    for (int i = 0; i < 5; i++)
        if (special[i] < -1 || special[i] >= (int32_t)n_tokens) {
            errorf(err, errlen, "tokenizer %s %d out of range (vocab_size %u)", special_names[i], special[i],
                    n_tokens);
            goto fail;
        }
    t->bos_id = special[0]; t->eos_id = special[1]; t->eot_id = special[2]; t->pad_id = special[3];
    t->unk_id = special[4];
    if (t->kind == TOKENIZER_BPE) {
        for (size_t i = 0; i < sizeof PRE_NAMES / sizeof PRE_NAMES[0]; i++)
            if (strcmp(t->pre, PRE_NAMES[i].name) == 0) {
                t->pre_type = PRE_NAMES[i].type;
                t->ignore_merges = PRE_NAMES[i].ignore_merges;
            }
        if (t->pre_type == PRE_NONE) {
            errorf(err, errlen, "unknown byte-level BPE pre-tokenizer '%s' (known: gpt2, gpt-2, smollm, llama-bpe, "
                    "llama3 and llama.cpp's aliases of these)", t->pre);
            goto fail;
        }
    }

    /* the token list: first pass sizes the tables (merges come after it) */
    size_t tok_start = r.pos;
    for (uint32_t i = 0; i < n_tokens; i++) {
        rd_u32(&r); rd_u32(&r);
        uint32_t len = rd_u32(&r);
        if (!r.bad && len > TOKENIZER_MAX_TOKEN_BYTES) {
            errorf(err, errlen, "token %u is %u bytes long (limit %d)", i, len, TOKENIZER_MAX_TOKEN_BYTES);
            goto fail;
        }
        rd_bytes(&r, len);
    }
    uint32_t n_merges = rd_u32(&r);
    if (r.bad || n_merges > (nbytes - r.pos) / 4) {
        errorf(err, errlen, "tokenizer section truncated in its token list or merge count");
        goto fail;
    }
    if (t->kind == TOKENIZER_BPE && n_merges == 0) {
        errorf(err, errlen, "byte-level BPE vocabulary without merges");
        goto fail;
    }
    size_t cap_str = (size_t)n_tokens + 3 * (size_t)n_merges + 256;
    t->cap_str = (int)cap_str;
    t->str_hash_cap = pow2_at_least(2 * cap_str);
    t->merge_cap = pow2_at_least(2 * (size_t)n_merges + 2);
    t->scores = malloc(n_tokens * sizeof *t->scores);
    t->types = malloc(n_tokens * sizeof *t->types);
    t->text = malloc(n_tokens * sizeof *t->text);
    t->piece = malloc(n_tokens * sizeof *t->piece);
    t->str = malloc(cap_str * sizeof *t->str);
    t->str_hash = malloc(t->str_hash_cap * sizeof *t->str_hash);
    t->merge = malloc(t->merge_cap * sizeof *t->merge);
    if (!t->scores || !t->types || !t->text || !t->piece || !t->str || !t->str_hash || !t->merge) goto oom;
    memset(t->str_hash, 0xFF, t->str_hash_cap * sizeof *t->str_hash);
    for (size_t i = 0; i < t->merge_cap; i++) t->merge[i].left = -1;
    size_t off;
    if (arena_put(t, tmpl, tlen, &off)) goto oom;
    t->chat_template_len = tlen;

    for (int i = 0; i < 512; i++) cp2byte[i] = -1;
    for (int b = 0; b < 256; b++) cp2byte[byte_to_cp(b)] = (int16_t)b;

    /* second pass: scores, types, stored text, encode-side string, decoded piece */
    r.pos = tok_start;
    for (uint32_t i = 0; i < n_tokens; i++) {
        uint32_t sb = rd_u32(&r);
        float score;
        memcpy(&score, &sb, 4);
        t->scores[i] = score;
        t->types[i] = (int32_t)rd_u32(&r);
        uint32_t len = rd_u32(&r);
        const unsigned char *s = rd_bytes(&r, len);
        if (arena_put(t, s, len, &off)) goto oom;
        t->text[i].off = off; t->text[i].len = len;
        int type = t->types[i];
        size_t n_enc = 0;
        int encodable = len > 0;
        if (t->kind == TOKENIZER_BPE) {
            if (encodable && bpe_text_to_bytes(cp2byte, s, len, tmp, &n_enc)) encodable = 0;
            if (encodable) { if (arena_put(t, tmp, n_enc, &off)) goto oom; }
            else { n_enc = 0; if (arena_put(t, "", 0, &off)) goto oom; }
        } else {
            n_enc = len;
            off = t->text[i].off;
        }
        t->str[i].off = off; t->str[i].len = (uint32_t)n_enc;
        if (encodable) str_index(t, (int)i);

        /* the piece: what llama.cpp's token_to_piece(special = false) writes */
        size_t np = 0;
        if (type == TOKEN_USER_DEFINED) {
            memcpy(tmp, s, len); np = len;
        } else if (type == TOKEN_NORMAL && t->kind == TOKENIZER_BPE) {
            for (size_t k = 0; k < len;) {   /* a character outside the table is copied as is */
                uint32_t cp;
                int m = utf8_decode(s + k, len - k, &cp);
                if (m == 0) { tmp[np++] = (char)s[k++]; continue; }
                if (cp < 512 && cp2byte[cp] >= 0) tmp[np++] = (char)cp2byte[cp];
                else { memcpy(tmp + np, s + k, (size_t)m); np += (size_t)m; }
                k += (size_t)m;
            }
        } else if (type == TOKEN_NORMAL) {   /* SentencePiece: U+2581 stands for a space */
            for (size_t k = 0; k < len;) {
                if (k + 3 <= len && s[k] == 0xE2 && s[k + 1] == 0x96 && s[k + 2] == 0x81) { tmp[np++] = ' '; k += 3; }
                else tmp[np++] = (char)s[k++];
            }
        } else if (type == TOKEN_BYTE && t->kind == TOKENIZER_SPM) {
            static const char hex[] = "0123456789ABCDEF";
            const char *h1 = len == 6 ? memchr(hex, s[3], 16) : NULL, *h2 = len == 6 ? memchr(hex, s[4], 16) : NULL;
            if (len == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' && h1 && h2 && s[3] && s[4])
                tmp[np++] = (char)((h1 - hex) * 16 + (h2 - hex));
        }
        if (arena_put(t, tmp, np, &off)) goto oom;
        t->piece[i].off = off; t->piece[i].len = (uint32_t)np;
        if (n_enc > t->max_token_bytes) t->max_token_bytes = n_enc;
    }
    t->n_str = (int)n_tokens;
    rd_u32(&r);   /* n_merges, read above */

    /* merges (byte-level BPE): "left right", split at the first space after the first byte, as llama.cpp does */
    for (uint32_t m = 0; m < n_merges; m++) {
        uint32_t len = rd_u32(&r);
        const unsigned char *s = rd_bytes(&r, len);
        if (r.bad) { errorf(err, errlen, "tokenizer section truncated in merge %u", m); goto fail; }
        if (t->kind != TOKENIZER_BPE || len > TOKENIZER_MAX_TOKEN_BYTES * 2) continue;
        const unsigned char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) continue;
        size_t nl, nr;
        char *lb = tmp, *rb = tmp + TOKENIZER_MAX_TOKEN_BYTES * 2;
        if (bpe_text_to_bytes(cp2byte, s, (size_t)(sp - s), lb, &nl)) continue;
        if (bpe_text_to_bytes(cp2byte, sp + 1, len - (size_t)(sp - s) - 1, rb, &nr)) continue;
        int a = str_intern(t, lb, nl), b = str_intern(t, rb, nr);
        memmove(lb + nl, rb, nr);
        int c = str_intern(t, lb, nl + nr);
        if (a < 0 || b < 0 || c < 0) goto oom;
        size_t mask = t->merge_cap - 1;
        for (size_t i = hash_pair(a, b) & mask;; i = (i + 1) & mask) {
            if (t->merge[i].left < 0) {
                t->merge[i].left = a; t->merge[i].right = b; t->merge[i].result = c; t->merge[i].rank = (int32_t)m;
                break;
            }
            if (t->merge[i].left == a && t->merge[i].right == b) break;   /* the first (lowest) rank wins */
        }
    }
    if (r.pos != r.n) {   /* a section longer than its contents means a corrupt header or section */
        errorf(err, errlen, "tokenizer section is %zu bytes but its contents end after %zu", r.n, r.pos);
        goto fail;
    }
    /* the fallback for each byte */
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        int s = -1;
        if (t->kind == TOKENIZER_SPM) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            s = str_find(t, name, 6);
            if (s < 0) s = str_find(t, &c, 1);
            if (s < 0) s = t->unk_id;
        } else {
            s = str_intern(t, &c, 1);
            if (s < 0) goto oom;
        }
        t->byte_str[b] = s;
    }

    /* no eot in the file: llama.cpp finds one by text; the first of its list present wins (documented order) */
    if (t->eot_id < 0) {
        static const char *eot_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                          "<EOT>"};
        for (size_t i = 0; i < sizeof eot_texts / sizeof eot_texts[0] && t->eot_id < 0; i++)
            t->eot_id = tokenizer_find(t, eot_texts[i]);
    }
    if (build_special(t)) goto oom;
    t->chat_template = t->arena;   /* the first string put in the arena; the arena does not move any more */
    if (t->kind == TOKENIZER_BPE) {   /* what an invalid byte without a token of its own becomes */
        int *ids;
        size_t n;
        if (tokenizer_encode(t, (const unsigned char *)"\xEF\xBF\xBD", 3, 0, &ids, &n, err, errlen)) goto fail;
        for (size_t i = 0; i < n && i < 4; i++) t->replacement[t->n_replacement++] = ids[i];
        free(ids);
    }
    return 0;
oom:
    errorf(err, errlen, "out of memory reading the tokenizer section");
fail:
    tokenizer_free(t);
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * lookups */

const char *tokenizer_piece(const Tokenizer *t, int id, size_t *len) {
    if (id < 0 || id >= t->vocab_size) { *len = 0; return NULL; }
    *len = t->piece[id].len;
    return t->arena + t->piece[id].off;
}

int tokenizer_find(const Tokenizer *t, const char *text) {
    size_t n = strlen(text);
    for (int i = 0; i < t->vocab_size; i++)
        if (t->text[i].len == n && memcmp(t->arena + t->text[i].off, text, n) == 0) return i;
    return -1;
}

int tokenizer_is_eog(const Tokenizer *t, int id) {
    return id >= 0 && (id == t->eos_id || id == t->eot_id);
}

/* ---------------------------------------------------------------------------------------------------------------
 * the merge engine shared by both kinds: symbols in a linked list, candidate pairs in a max-heap */

typedef struct {
    size_t start;       /* byte offset of the symbol in the text being merged */
    uint32_t n;         /* bytes; 0 = merged into its left neighbour */
    int32_t prev, next; /* neighbours, -1 at the ends */
    int32_t str;        /* string index of the symbol's bytes, -1 when none (or an unmergeable invalid byte) */
} Sym;

typedef struct {
    double prio;        /* higher first: SentencePiece the token score, BPE minus the merge rank */
    int32_t left, right;/* symbol indices */
    uint32_t size;      /* bytes of the pair when queued; differs once either side changed (then stale) */
    int32_t result;     /* string index of the merged bytes */
} Cand;

typedef struct {
    const Tokenizer *t;
    const unsigned char *text;  /* the bytes symbols point into */
    int *ids; size_t n_ids, cap_ids;
    Sym *sym; size_t cap_sym;
    Cand *heap; size_t n_heap, cap_heap;
    int oom;
} Enc;

/* ties go to the leftmost pair, as in llama.cpp's comparators */
static int cand_before(const Cand *a, const Cand *b) {
    return a->prio > b->prio || (a->prio == b->prio && a->left < b->left);
}

static void heap_push(Enc *e, Cand c) {
    if (e->n_heap == e->cap_heap) {
        size_t cap = e->cap_heap ? e->cap_heap * 2 : 256;
        Cand *h = realloc(e->heap, cap * sizeof *h);
        if (!h) { e->oom = 1; return; }
        e->heap = h; e->cap_heap = cap;
    }
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_before(&c, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = c;
}

static Cand heap_pop(Enc *e) {
    Cand top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, best = l;
        if (l >= n) break;
        if (l + 1 < n && cand_before(&e->heap[l + 1], &e->heap[l])) best = l + 1;
        if (!cand_before(&e->heap[best], &last)) break;
        e->heap[i] = e->heap[best];
        i = best;
    }
    if (n) e->heap[i] = last;
    return top;
}

static void emit(Enc *e, int id) {
    if (e->n_ids == e->cap_ids) {
        size_t cap = e->cap_ids ? e->cap_ids * 2 : 64;
        int *p = realloc(e->ids, cap * sizeof *p);
        if (!p) { e->oom = 1; return; }
        e->ids = p; e->cap_ids = cap;
    }
    e->ids[e->n_ids++] = id;
}

static int reserve_sym(Enc *e, size_t n) {
    if (n <= e->cap_sym) return 0;
    Sym *s = realloc(e->sym, n * sizeof *s);
    if (!s) { e->oom = 1; return -1; }
    e->sym = s; e->cap_sym = n;
    return 0;
}

/* Queue the pair (left, right) if it can merge. SentencePiece: the joined bytes are a string (token); BPE: the two
 * strings form a merge rule. */
static void try_pair(Enc *e, int left, int right) {
    if (left < 0 || right < 0) return;
    const Tokenizer *t = e->t;
    const Sym *a = &e->sym[left], *b = &e->sym[right];
    if (a->str < 0 || b->str < 0) return;
    Cand c = {0, left, right, a->n + b->n, -1};
    if (t->kind == TOKENIZER_SPM) {
        if (c.size > t->max_token_bytes) return;
        int s = str_find(t, e->text + a->start, c.size);
        if (s < 0 || s >= t->vocab_size) return;
        c.prio = t->scores[s];
        c.result = s;
    } else {
        size_t mask = t->merge_cap - 1;
        for (size_t i = hash_pair(a->str, b->str) & mask;; i = (i + 1) & mask) {
            if (t->merge[i].left < 0) return;
            if (t->merge[i].left == a->str && t->merge[i].right == b->str) {
                c.prio = -(double)t->merge[i].rank;
                c.result = t->merge[i].result;
                break;
            }
        }
    }
    heap_push(e, c);
}

/* Merge symbols[0 .. n) (a linked list in order) until no queued pair applies, then emit their tokens. */
static void merge_and_emit(Enc *e, int n) {
    const Tokenizer *t = e->t;
    Sym *sym = e->sym;
    e->n_heap = 0;
    for (int i = 1; i < n; i++) try_pair(e, i - 1, i);
    while (e->n_heap > 0 && !e->oom) {
        Cand c = heap_pop(e);
        Sym *a = &sym[c.left], *b = &sym[c.right];
        if (a->n == 0 || b->n == 0 || a->n + b->n != c.size) continue;   /* stale: a side has changed */
        a->n += b->n;
        a->str = c.result;
        b->n = 0;
        a->next = b->next;
        if (b->next >= 0) sym[b->next].prev = c.left;
        try_pair(e, a->prev, c.left);
        try_pair(e, c.left, a->next);
    }
    for (int i = 0; i >= 0 && n > 0; i = sym[i].next) {
        if (sym[i].str >= 0 && sym[i].str < t->vocab_size) { emit(e, sym[i].str); continue; }
        /* not a token: one byte token per byte (llama.cpp's byte fallback); a byte the vocabulary has no token
         * for is dropped, as llama.cpp drops it (SmolLM2 has none for 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D) */
        for (uint32_t k = 0; k < sym[i].n; k++) {
            int id = t->byte_str[e->text[sym[i].start + k]];
            if (id >= 0 && id < t->vocab_size) emit(e, id);
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * SentencePiece BPE: "▁" for every space, one dummy "▁" in front, then merge by score over the whole text */

static int spm_encode(Enc *e, const unsigned char *text, size_t len) {
    if (len == 0) return 0;
    size_t cap = 3 * len + 3;
    unsigned char *buf = malloc(cap);
    if (!buf || reserve_sym(e, len + 1)) { free(buf); e->oom = 1; return -1; }
    size_t o = 0;
    int n = 0;
    const Tokenizer *t = e->t;
    Sym *sym = e->sym;
    if (t->add_space_prefix) {
        memcpy(buf, "\xE2\x96\x81", 3);
        sym[n++] = (Sym){0, 3, -1, -1, 0};
        o = 3;
    }
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int k = utf8_decode(text + i, len - i, &cp);
        Sym s = {o, 0, n - 1, -1, 0};
        if (k == 0) {                      /* invalid byte: a symbol that never merges */
            buf[o++] = text[i]; s.n = 1; s.str = -1; i++;
        } else if (cp == ' ') {
            memcpy(buf + o, "\xE2\x96\x81", 3); o += 3; s.n = 3; i++;
        } else {
            memcpy(buf + o, text + i, (size_t)k); o += (size_t)k; s.n = (uint32_t)k; i += (size_t)k;
        }
        sym[n++] = s;
    }
    e->text = buf;
    for (int i = 0; i < n; i++) {
        sym[i].next = i + 1 < n ? i + 1 : -1;
        if (sym[i].str == 0) {             /* a valid character: its string if the vocabulary has it */
            int s = str_find(t, buf + sym[i].start, sym[i].n);
            /* not a token itself but it may still be part of one: any index >= vocab_size means "byte fallback" */
            sym[i].str = s >= 0 ? s : INT32_MAX;
        }
    }
    merge_and_emit(e, n);
    free(buf);
    e->text = NULL;
    return e->oom ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * byte-level BPE: pre-tokenize into words, merge each word by rank */

static void bpe_word(Enc *e, const unsigned char *w, size_t n) {
    const Tokenizer *t = e->t;
    if (n == 0) return;
    if (t->ignore_merges) {
        int s = str_find(t, w, n);
        if (s >= 0 && s < t->vocab_size) { emit(e, s); return; }
    }
    if (reserve_sym(e, n)) return;
    for (size_t i = 0; i < n; i++)
        e->sym[i] = (Sym){(size_t)(w - e->text) + i, 1, (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1,
                          t->byte_str[w[i]]};
    merge_and_emit(e, (int)n);
}

/* One span of code points [0, n) with classes fl[] (UCLASS_* | UCLASS_ANY); positions past n read as class 0, which
 * is how llama.cpp's matchers see the end of a span. off[i] is the byte offset of code point i in e->text. */
typedef struct { const uint32_t *cp; const uint8_t *fl; const size_t *off; size_t n; Enc *e; size_t done; } Span;

static int sp_fl(const Span *s, size_t i) { return i < s->n ? s->fl[i] : 0; }
static uint32_t sp_cp(const Span *s, size_t i) { return i < s->n ? s->cp[i] : 0xFFFFFFFFu; }
static int is_other(int f) { return (f & UCLASS_ANY) && !(f & (UCLASS_LETTER | UCLASS_NUMBER | UCLASS_SPACE)); }

static void sp_cut(Span *s, size_t end) {   /* the piece from the previous cut to code point `end` */
    if (end > s->done) bpe_word(s->e, s->e->text + s->off[s->done], s->off[end] - s->off[s->done]);
    s->done = end;
}

static uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* A contraction at pos ('s 't 're 've 'm 'll 'd): its length in code points, else 0. */
static size_t contraction(const Span *s, size_t pos, int any_case) {
    if (sp_cp(s, pos) != '\'' || pos + 1 >= s->n) return 0;
    uint32_t a = sp_cp(s, pos + 1), b = pos + 2 < s->n ? sp_cp(s, pos + 2) : 0;
    if (any_case) { a = ascii_lower(a); b = ascii_lower(b); }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void pre_gpt2(Span *s) {
    size_t pos = 0;
    while (pos < s->n) {
        uint32_t c = s->cp[pos];
        size_t k = contraction(s, pos, 0);
        if (k) { pos += k; sp_cut(s, pos); continue; }
        int f2 = c == ' ' ? sp_fl(s, pos + 1) : sp_fl(s, pos);
        if (f2 & (UCLASS_LETTER | UCLASS_NUMBER)) {
            int cls = f2 & (UCLASS_LETTER | UCLASS_NUMBER);
            pos += c == ' ';
            while (sp_fl(s, pos) & cls) pos++;
            sp_cut(s, pos);
            continue;
        }
        if (is_other(f2)) {
            pos += c == ' ';
            while (is_other(sp_fl(s, pos))) pos++;
            sp_cut(s, pos);
            continue;
        }
        size_t nws = 0;
        while (sp_fl(s, pos + nws) & UCLASS_SPACE) nws++;
        if (nws > 1 && pos + nws < s->n) { pos += nws - 1; sp_cut(s, pos); continue; }   /* \s+(?!\S) */
        pos += nws ? nws : 1;
        sp_cut(s, pos);
    }
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static void pre_llama3(Span *s) {
    size_t pos = 0;
    while (pos < s->n) {
        uint32_t c = s->cp[pos];
        int f = sp_fl(s, pos);
        size_t k = contraction(s, pos, 1);
        if (k) { pos += k; sp_cut(s, pos); continue; }
        if (!(c == '\r' || c == '\n' || (f & UCLASS_NUMBER)) &&
            ((f & UCLASS_LETTER) || (sp_fl(s, pos + 1) & UCLASS_LETTER))) {
            pos++;
            while (sp_fl(s, pos) & UCLASS_LETTER) pos++;
            sp_cut(s, pos);
            continue;
        }
        if (f & UCLASS_NUMBER) {   /* groups of three from the left */
            size_t ini = pos;
            while (sp_fl(s, pos) & UCLASS_NUMBER)
                if (++pos - ini >= 3) { sp_cut(s, pos); ini = pos; }
            sp_cut(s, pos);
            continue;
        }
        int f2 = c == ' ' ? sp_fl(s, pos + 1) : f;
        if (is_other(f2)) {
            pos += c == ' ';
            while (is_other(sp_fl(s, pos))) pos++;
            while (sp_cp(s, pos) == '\r' || sp_cp(s, pos) == '\n') pos++;
            sp_cut(s, pos);
            continue;
        }
        size_t nws = 0, end_nl = 0;
        while (sp_fl(s, pos + nws) & UCLASS_SPACE) {
            uint32_t w = sp_cp(s, pos + nws);
            if (w == '\r' || w == '\n') end_nl = pos + nws + 1;
            nws++;
        }
        if (end_nl) { pos = end_nl; sp_cut(s, pos); continue; }                           /* \s*[\r\n]+ */
        if (nws > 1 && pos + nws < s->n) { pos += nws - 1; sp_cut(s, pos); continue; }   /* \s+(?!\S) */
        pos += nws ? nws : 1;
        sp_cut(s, pos);
    }
}

static void pre_span(Enc *e, const uint32_t *cp, const uint8_t *fl, const size_t *off, size_t n) {
    if (n == 0) return;
    Span s = {cp, fl, off, n, e, 0};
    if (e->t->pre_type == PRE_LLAMA3) pre_llama3(&s);
    else pre_gpt2(&s);
}

static int t_lacks_byte(const Tokenizer *t, int b) {
    return t->byte_str[b] < 0 || t->byte_str[b] >= t->vocab_size;
}

static int bpe_encode(Enc *e, const unsigned char *text, size_t len) {
    if (len == 0) return 0;
    uint32_t *cp = malloc(len * sizeof *cp);
    uint8_t *fl = malloc(len);
    size_t *off = malloc((len + 1) * sizeof *off);
    if (!cp || !fl || !off) { free(cp); free(fl); free(off); e->oom = 1; return -1; }
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        int k = utf8_decode(text + i, len - i, &cp[n]);
        off[n] = i;
        if (k == 0) { cp[n] = 0xFFFFFFFFu; fl[n] = 0; k = 1; }   /* invalid byte: class 0 marks it */
        else fl[n] = (uint8_t)(uclass(cp[n]) | UCLASS_ANY);
        i += (size_t)k;
        n++;
    }
    off[n] = len;
    e->text = text;
    /* spans: an invalid byte is a piece of its own, and so (SmolLM) is every \p{N}; the pattern runs between */
    size_t start = 0;
    for (size_t i = 0; i < n && !e->oom; i++) {
        int alone = fl[i] == 0 || (e->t->pre_type == PRE_SMOLLM && (fl[i] & UCLASS_NUMBER));
        if (!alone) continue;
        pre_span(e, cp + start, fl + start, off + start, i - start);
        int b = text[off[i]];
        if (fl[i] == 0 && t_lacks_byte(e->t, b))   /* invalid byte, no token: U+FFFD, as llama.cpp reads it */
            for (int k = 0; k < e->t->n_replacement; k++) emit(e, e->t->replacement[k]);
        else
            bpe_word(e, text + off[i], off[i + 1] - off[i]);
        start = i + 1;
    }
    if (!e->oom) pre_span(e, cp + start, fl + start, off + start, n - start);
    free(cp); free(fl); free(off);
    e->text = NULL;
    return e->oom ? -1 : 0;
}

/* One piece of plain text, appended to e's ids: SentencePiece with its dummy prefix, or byte-level BPE. */
static void encode_plain(Enc *e, const unsigned char *text, size_t len) {
    if (e->t->kind == TOKENIZER_SPM) spm_encode(e, text, len);
    else bpe_encode(e, text, len);
}

/* The end of encoding: free the scratch, hand the ids over (or the error). */
static int encode_finish(Enc *e, size_t len, int **ids, size_t *n_ids, char *err, size_t errlen) {
    free(e->sym);
    free(e->heap);
    if (e->oom) {
        free(e->ids);
        errorf(err, errlen, "out of memory encoding %zu bytes", len);
        return -1;
    }
    if (e->n_ids == 0) { free(e->ids); e->ids = NULL; }
    *ids = e->ids;
    *n_ids = e->n_ids;
    return 0;
}

int tokenizer_encode(const Tokenizer *t, const unsigned char *text, size_t len, int add_bos, int **ids,
                     size_t *n_ids, char *err, size_t errlen) {
    Enc e = {0};
    e.t = t;
    *ids = NULL;
    *n_ids = 0;
    if (add_bos) {
        if (t->bos_id < 0) { errorf(err, errlen, "add_bos: the vocabulary has no BOS token"); return -1; }
        emit(&e, t->bos_id);
    }
    encode_plain(&e, text, len);
    return encode_finish(&e, len, ids, n_ids, err, errlen);
}

/* The first occurrence of p (m > 0 bytes) in h (n bytes), or NULL: memchr for the first byte, then memcmp (memmem
 * is not standard C). O(n * m) at worst, O(n) on text that rarely holds p's first byte. */
static const unsigned char *find_bytes(const unsigned char *h, size_t n, const unsigned char *p, size_t m) {
    if (m == 0 || n < m) return NULL;
    const unsigned char *last = h + (n - m);
    while (h <= last) {
        const unsigned char *c = memchr(h, p[0], (size_t)(last - h) + 1);
        if (!c) return NULL;
        if (memcmp(c + 1, p + 1, m - 1) == 0) return c;
        h = c + 1;
    }
    return NULL;
}

/* A fragment of the text being split: plain text (id -1) or one occurrence of special token id. */
typedef struct { size_t off, len; int id; } Frag;

typedef struct { Frag *f; size_t n, cap; } FragList;

static int frag_push(FragList *l, size_t off, size_t len, int id) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        Frag *f = realloc(l->f, cap * sizeof *f);
        if (!f) return -1;
        l->f = f; l->cap = cap;
    }
    l->f[l->n++] = (Frag){off, len, id};
    return 0;
}

int tokenizer_encode_special(const Tokenizer *t, const unsigned char *text, size_t len, int add_bos, int **ids,
                             size_t *n_ids, char *err, size_t errlen) {
    *ids = NULL;
    *n_ids = 0;
    if (add_bos && t->bos_id < 0) { errorf(err, errlen, "add_bos: the vocabulary has no BOS token"); return -1; }
    /* split: each special token in turn (longest first) cuts every plain fragment at each of its occurrences,
     * leftmost first, as llama.cpp's tokenizer_st_partition does; the list is rebuilt only when it matched */
    FragList cur = {0}, next = {0};
    int oom = len > 0 && frag_push(&cur, 0, len, -1);
    for (int s = 0; s < t->n_special && !oom; s++) {
        int id = t->special[s];
        const unsigned char *pat = (const unsigned char *)t->arena + t->text[id].off;
        size_t plen = t->text[id].len;
        int hit = 0;
        next.n = 0;
        for (size_t i = 0; i < cur.n && !oom; i++) {
            Frag f = cur.f[i];
            if (f.id >= 0 || f.len < plen) { oom |= hit && frag_push(&next, f.off, f.len, f.id); continue; }
            size_t pos = f.off, end = f.off + f.len;
            for (;;) {
                const unsigned char *m = find_bytes(text + pos, end - pos, pat, plen);
                if (!m) break;
                if (!hit) {   /* first match of this token: copy the fragments before this one */
                    hit = 1;
                    for (size_t k = 0; k < i && !oom; k++) oom |= frag_push(&next, cur.f[k].off, cur.f[k].len, cur.f[k].id);
                }
                size_t at = (size_t)(m - text);
                if (at > pos) oom |= frag_push(&next, pos, at - pos, -1);
                oom |= frag_push(&next, at, plen, id);
                pos = at + plen;
            }
            if (hit && pos < end) oom |= frag_push(&next, pos, end - pos, -1);
        }
        if (hit) { FragList tmp = cur; cur = next; next = tmp; }
    }
    free(next.f);
    Enc e = {0};
    e.t = t;
    e.oom = oom;
    if (add_bos) emit(&e, t->bos_id);
    /* encode: an occurrence is its id, plain text as tokenizer_encode would encode it alone */
    for (size_t i = 0; i < cur.n && !e.oom; i++) {
        if (cur.f[i].id >= 0) emit(&e, cur.f[i].id);
        else encode_plain(&e, text + cur.f[i].off, cur.f[i].len);
    }
    free(cur.f);
    return encode_finish(&e, len, ids, n_ids, err, errlen);
}

/* ---------------------------------------------------------------------------------------------------------------
 * streaming decoder */

void tokdec_init(TokenDecoder *d, const Tokenizer *t) {
    memset(d, 0, sizeof *d);
    d->t = t;
    d->at_start = 1;
}

/* How many bytes at the end of buf[0 .. n) form an incomplete (so far valid-looking) UTF-8 sequence: 0..3. */
static int utf8_incomplete_tail(const unsigned char *buf, size_t n) {
    for (int back = 1; back <= 3 && (size_t)back <= n; back++) {
        unsigned c = buf[n - (size_t)back];
        if ((c & 0xC0) == 0x80) continue;   /* continuation: keep looking for the lead byte */
        int need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
        return need > back ? back : 0;
    }
    return 0;
}

size_t tokdec_push(TokenDecoder *d, int id, char *out, size_t cap) {
    size_t len;
    const char *p = tokenizer_piece(d->t, id, &len);
    if (!p || len == 0) return 0;
    if (d->at_start) {
        if (d->t->add_space_prefix && p[0] == ' ') { p++; len--; }
        d->at_start = 0;
    }
    unsigned char buf[TOKDEC_OUT_MAX];
    size_t n = (size_t)d->n_held;
    memcpy(buf, d->held, n);
    memcpy(buf + n, p, len);
    n += len;
    int tail = utf8_incomplete_tail(buf, n);
    size_t ready = n - (size_t)tail;
    memcpy(d->held, buf + ready, (size_t)tail);
    d->n_held = tail;
    if (ready > cap) ready = cap;
    memcpy(out, buf, ready);
    return ready;
}

size_t tokdec_flush(TokenDecoder *d, char *out, size_t cap) {
    size_t n = (size_t)d->n_held < cap ? (size_t)d->n_held : cap;
    memcpy(out, d->held, n);
    d->n_held = 0;
    return n;
}
