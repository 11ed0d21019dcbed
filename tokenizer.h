/* tokenizer.h: text <-> token ids for the two vocabularies kvlab reads from a model.bin tokenizer section
 * (docs/FORMAT.md): SentencePiece BPE (kind 1: Llama 2, TinyLlama, llama2.c tokenizer.bin) and byte-level BPE
 * (kind 2: GPT-2, SmolLM, Llama 3). The goal is id-for-id agreement with llama.cpp's tokenizer (commit c392e50,
 * src/llama-vocab.cpp and src/unicode.cpp) on valid UTF-8, and a defined, lossless result on any other bytes.
 * Two encoders: tokenizer_encode reads all of its input as plain text (special-token text such as "<|im_end|>" in
 * user input stays ordinary text; llama.cpp's parse_special = false, except that it does not split user-defined
 * tokens (type 4) out of the text first as llama.cpp does: no supported vocabulary has any), and
 * tokenizer_encode_special recognizes special-token text (llama.cpp's parse_special = true), for a rendered chat
 * template. It does not implement WordPiece, Unigram or RWKV vocabularies. */
#ifndef KVLAB_TOKENIZER_H
#define KVLAB_TOKENIZER_H
#include <stddef.h>
#include <stdint.h>

enum { TOKENIZER_SPM = 1, TOKENIZER_BPE = 2 };   /* Tokenizer.kind, as stored in the section */

/* GGUF token types (tokenizer.ggml.token_type), as stored per token in the section */
enum { TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4, TOKEN_UNUSED = 5,
       TOKEN_BYTE = 6 };

/* Longest token text accepted, bytes. Real vocabularies stay far below (GPT-2: 256, Llama 2: 48). It bounds the
 * bytes one decoded token can produce, hence TOKDEC_OUT_MAX. */
#define TOKENIZER_MAX_TOKEN_BYTES 1024

/* Byte-level BPE pre-tokenizers (the `pre` name in the section selects one; aliases as llama.cpp maps them) */
enum { PRE_NONE = 0, PRE_GPT2, PRE_SMOLLM, PRE_LLAMA3 };

typedef struct {          /* one entry of the string table: a token's encode-side text, or a merge intermediate */
    size_t off;           /* byte offset into Tokenizer.arena */
    uint32_t len;         /* bytes */
} TokString;

typedef struct {
    /* --- public: what callers read --- */
    int kind;             /* TOKENIZER_SPM or TOKENIZER_BPE */
    int vocab_size;       /* number of tokens (ids 0 .. vocab_size-1) */
    int bos_id, eos_id;   /* -1 = absent */
    int eot_id;           /* end of turn; when the section has none, found by text as llama.cpp does, else -1 */
    int pad_id, unk_id;   /* -1 = absent */
    int add_bos;          /* 1: a prompt starts with BOS (tokenizer.ggml.add_bos_token) */
    int add_space_prefix; /* 1: SentencePiece dummy prefix: one "▁" before a non-empty text */
    char pre[33];         /* pre-tokenizer name as stored, NUL-terminated */
    int pre_type;         /* PRE_* (byte-level BPE only) */
    int ignore_merges;    /* Llama 3 rule: a pre-token that is itself in the vocabulary is emitted whole */
    const char *chat_template;  /* NUL-terminated template text ("" when absent), owned by the tokenizer */
    size_t chat_template_len;   /* bytes, without the NUL */

    /* --- private: the vocabulary and lookup tables --- */
    float *scores;        /* (vocab_size) SentencePiece merge priority */
    int *types;           /* (vocab_size) TOKEN_* */
    TokString *text;      /* (vocab_size) the token text exactly as stored (for tokenizer_find) */
    TokString *piece;     /* (vocab_size) the bytes decoding writes (empty for control tokens) */
    TokString *str;       /* (n_str) encode-side strings: ids < vocab_size are tokens, the rest merge intermediates */
    int n_str, cap_str;
    char *arena;          /* (arena_len) all text bytes the tables point into */
    size_t arena_len, arena_cap;
    int32_t *str_hash;    /* (str_hash_cap) open addressing: string index or -1 */
    size_t str_hash_cap;  /* power of two */
    int byte_str[256];    /* encode-side string index of each single byte: SPM its byte token, BPE its char */
    /* byte-level BPE merges: (left string, right string) -> (rank, result string), open addressing */
    struct { int32_t left, right, result, rank; } *merge;  /* (merge_cap) left == -1 marks an empty slot */
    size_t merge_cap;     /* power of two */
    size_t max_token_bytes;  /* longest encode-side token text, bytes (bounds SentencePiece lookups) */
    int replacement[4];   /* (n_replacement) byte-level BPE: the tokens of U+FFFD, for invalid bytes without a token */
    int n_replacement;
    int *special;         /* (n_special) the tokens tokenizer_encode_special matches, longest text first */
    int n_special;
} Tokenizer;

/* Parse a model.bin tokenizer section (docs/FORMAT.md, "Tokenizer section"): `section` points at its first byte,
 * nbytes is its length. Every size is checked against nbytes. Returns 0, or -1 with a message in err (errlen bytes,
 * NUL-terminated) and *t left empty (safe to tokenizer_free). Never exits. Errors: truncated or inconsistent data,
 * unknown kind, an unknown byte-level pre-tokenizer name (the message names it and lists the known ones), a special
 * id out of range, a token longer than TOKENIZER_MAX_TOKEN_BYTES, out of memory. */
int tokenizer_init(Tokenizer *t, const void *section, size_t nbytes, char *err, size_t errlen);
void tokenizer_free(Tokenizer *t);

/* Encode `len` raw bytes. Any bytes are accepted: each byte that is not part of a valid UTF-8 sequence becomes its
 * own byte token (SentencePiece: <0xNN>; byte-level BPE: the token of its mapped character) and never merges; NUL
 * is valid UTF-8 and is encoded as text. A byte the vocabulary has no token for at all (SmolLM2 lacks 21 of the 256
 * byte characters) cannot round trip: as in llama.cpp, an invalid one becomes U+FFFD's tokens and a valid one (a
 * control character) is dropped; with SentencePiece such a byte becomes unk_id. Special-token text in the input is
 * encoded as ordinary text. add_bos: put bos_id first. On success *ids is a malloc'd array (caller frees; NULL when
 * *n_ids == 0) of *n_ids token ids and 0 is returned. On error (out of memory, or add_bos without a BOS token): -1
 * and a message in err. Time O(len log len), memory O(len). */
int tokenizer_encode(const Tokenizer *t, const unsigned char *text, size_t len, int add_bos, int **ids,
                     size_t *n_ids, char *err, size_t errlen);

/* Encode `len` raw bytes in which special-token text is recognized, as llama.cpp's tokenize does with
 * parse_special = true (src/llama-vocab.cpp, tokenizer_st_partition and tokenize, commit c392e50): for a chat
 * template rendered to one string. The special tokens are those of type CONTROL, USER_DEFINED or UNKNOWN with a
 * non-empty text (llama.cpp's cache_special_tokens; so "<unk>" is one too); a token's text is matched byte for byte
 * as stored (tokenizer_find's text). They are taken longest text first (equal lengths: lower id first, where
 * llama.cpp's order is unspecified; it matters only when two such texts of one length overlap in the input); each
 * splits every text fragment still unclaimed at each of its occurrences, leftmost first and non-overlapping, and a
 * match never spans two fragments. Each occurrence becomes the token's id; each plain fragment between them is
 * encoded exactly as tokenizer_encode encodes it alone (same byte handling), so with a SentencePiece dummy prefix
 * every fragment, the one after a special token included, starts with its own "▁" (llama.cpp prefixes a fragment
 * when the previous fragment was special or it is the first, and two plain fragments are never adjacent); byte-level
 * BPE adds no prefix. add_bos: put bos_id first (a "<s>" in the text is then a second BOS, as in llama.cpp). Not
 * done: llama.cpp's LSTRIP/RSTRIP whitespace trimming around special tokens, which it sets by model or pre-tokenizer
 * name (Phi-3's markers, Jina v2's "<mask>") and kvlab's section does not record; and llama.cpp's retyping to CONTROL
 * of an EOT/EOM/FIM marker it finds by text but that is stored with another type (types are used as stored; in the
 * Llama 2, GPT-2 and SmolLM2 vocabularies such markers are CONTROL already). Output, return value and errors as
 * tokenizer_encode.
 * Time: the split searches the text once per special token (O(n_special * len); O(n_special * len * the longest
 * special text) at worst), then the encoding as tokenizer_encode; memory O(len). */
int tokenizer_encode_special(const Tokenizer *t, const unsigned char *text, size_t len, int add_bos, int **ids,
                             size_t *n_ids, char *err, size_t errlen);

/* The bytes token `id` decodes to (its piece), *len bytes, not NUL-terminated; NULL with *len = 0 for an id out of
 * range. Control, unknown and unused tokens decode to nothing: that is llama.cpp's token_to_piece(special=false),
 * the usual choice for printing generated text; the dummy-prefix rule is the TokenDecoder's job, not this one's. */
const char *tokenizer_piece(const Tokenizer *t, int id, size_t *len);

/* Look up a token by its exact stored text (e.g. "<|im_start|>", "[INST]", "<s>"); -1 if absent. O(vocab_size). */
int tokenizer_find(const Tokenizer *t, const char *text);

/* 1 when id ends generation: eos_id or eot_id. */
int tokenizer_is_eog(const Tokenizer *t, int id);

/* Streaming decoder. Concatenating everything tokdec_push and tokdec_flush write equals decoding all the ids at once:
 * an incomplete UTF-8 sequence at the end of the output so far is held back (at most 3 bytes) until the bytes that
 * complete it arrive or flush is called, so a stream never shows a U+FFFD the model did not produce. With a
 * SentencePiece dummy prefix, the one leading space of the output (the first byte of the first non-empty piece,
 * when it is a space) is removed; unlike llama.cpp's llama_detokenize this also holds after a leading BOS. */
#define TOKDEC_OUT_MAX (TOKENIZER_MAX_TOKEN_BYTES + 4)   /* a push or flush never writes more than this */
typedef struct {
    const Tokenizer *t;
    unsigned char held[4];  /* incomplete UTF-8 tail not yet written */
    int n_held;             /* bytes in held */
    int at_start;           /* no byte written or held yet: the dummy-prefix space may still come */
} TokenDecoder;
void tokdec_init(TokenDecoder *d, const Tokenizer *t);
/* Decode one id; writes the bytes now ready to out (cap bytes; cap >= TOKDEC_OUT_MAX always suffices, a smaller cap
 * truncates) and returns how many. An id out of range decodes to nothing. */
size_t tokdec_push(TokenDecoder *d, int id, char *out, size_t cap);
/* Write whatever is held back (an incomplete sequence at the end of the stream, as is) and reset the holdback. */
size_t tokdec_flush(TokenDecoder *d, char *out, size_t cap);

#endif
