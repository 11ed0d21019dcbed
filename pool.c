/* pool.c: the KV pool of the serving mode (pool.h): the pages of one fixed allocation handed to sequences and taken
 * back, and the prefix cache through which prompts with a common prefix share pages. It is bookkeeping only: no byte
 * of a page is read or written here, and a sequence's block tables (its pages per lane) are the caller's.
 *
 * Pages (PagedAttention, Kwon et al. 2023, arXiv:2309.06180). vLLM cuts KV memory into blocks of B tokens (16 by
 * default); a sequence's logical blocks map to physical blocks through its block table, and a block is taken from one
 * free list only when the sequence needs it, so a sequence wastes at most its last, partial block (§4.2); a block
 * shared by several sequences (parallel samples, a common prompt) carries a reference count (§4.4). In kvlab a page
 * is P slots of ONE lane (one layer and kv head of one sequence), where a vLLM block spans every layer and head:
 * kvlab's policies keep different tokens in each lane, so lanes fill and free their pages apart.
 *
 * The three states of a page:
 *   free    ref 0, no key: on the free stack (the page freed last is taken first: its bytes are likeliest in cache);
 *   held    ref > 0: that many holders (block tables) list it; keyed or not;
 *   cached  ref 0 with a key: nobody holds it, but its bytes still hold the block its key names, which a later prompt
 *           may find (kv_pool_lookup) and hold again (kv_pool_ref); on the LRU list.
 * kv_pool_take: free -> held, else cached -> held (the key dropped: an eviction); kv_pool_ref: held -> held (ref + 1)
 * or cached -> held; kv_pool_release: held -> held (ref - 1), or at ref 0 -> cached when keyed, -> free when not;
 * kv_pool_publish: a held page gets its key. So every page is in exactly one state, and free + held + cached = n_pages.
 *
 * The prefix cache (vLLM's automatic prefix caching, its design page on docs.vllm.ai). A full block is identified by
 * its tokens and every token before it, so its key is hash(parent block's key, the block's tokens, extra keys):
 * kv_pool_chain, with the salt as the extra keys (here the lane and the cache's configuration). A table maps keys to
 * pages. A new prompt walks its blocks from the first, looks each key up and refs the page found, and computes only
 * from its first miss on, publishing the pages it fills. A block whose ref count falls to 0 keeps its bytes and its
 * key (cached) until the memory is needed; then the least recently released cached block goes first (LRU; vLLM breaks
 * ties by evicting the longest prefix first, which a caller gets by releasing a sequence's last block first). Free
 * pages are taken before any cached one, as vLLM's first prefix-caching allocator did (its free blocks, then its LRU
 * evictor); vLLM v1 keeps both in one queue by release time, which reclaims a cached block before an older free one.
 *
 * Collisions. Keys are 64-bit hashes and pages are matched by key alone. Two blocks that share a key would share a
 * page: a prompt would attend to another prefix's keys and values, silently. With K keyed pages, a lookup of a block
 * the pool does not hold hits a wrong page with probability K / 2^64 for a well-mixed hash: for 2^17 pages and 2^30
 * lookups, 2^47 / 2^64, about 1 in 130,000 over the whole run. A collision at publish only loses a share (it returns
 * 1). Comparing the block's token ids on a hit would remove the risk, at P ints a page; the pool does not store them
 * (a caller that wants the check can keep them beside its pages).
 *
 * The structures: the free stack an array; the LRU list doubly linked through lru_prev/lru_next, so a hit unlinks a
 * page in O(1); the hash table chained through chain[] (one link per page, so it never grows: n_buckets >= n_pages
 * buckets fixed at init, chains of at most one page on average). Every operation is O(1), publish and lookup
 * expected (they walk one bucket).
 */
#include "pool.h"
#include "kv.h"     /* kv_mix64 */
#include "util.h"   /* errorf, mem_advise_huge */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define POOL_MAX_PAGES (1 << 30)   /* n_buckets, a power of two >= n_pages, stays an int */
#define GOLDEN 0x9E3779B97F4A7C15ull   /* splitmix64's increment, 2^64 / the golden ratio */

/* ---------------------------------------------------------------------------------------------------------------
 * Misuse: a bug in the caller, never an input error: stop before the lists are corrupted.
 * ------------------------------------------------------------------------------------------------------------- */

static void pool_bug(const char *verb, int page, const char *why) {
    fprintf(stderr, "pool: %s of page %d: %s\n", verb, page, why);
    abort();
}
static void check_page(const KVPool *p, const char *verb, int page) {
    if (page < 0 || page >= p->n_pages) pool_bug(verb, page, "no such page");
}

/* ---------------------------------------------------------------------------------------------------------------
 * The LRU list of cached pages (head the least recent) and the hash table of keyed pages
 * ------------------------------------------------------------------------------------------------------------- */

static void lru_unlink(KVPool *p, int page) {
    int a = p->lru_prev[page], b = p->lru_next[page];
    if (a >= 0) p->lru_next[a] = b; else p->lru_head = b;
    if (b >= 0) p->lru_prev[b] = a; else p->lru_tail = a;
    p->lru_prev[page] = p->lru_next[page] = -1;
    p->n_cached--;
}
static void lru_push_recent(KVPool *p, int page) {
    p->lru_prev[page] = p->lru_tail;
    p->lru_next[page] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = page; else p->lru_head = page;
    p->lru_tail = page;
    p->n_cached++;
}

/* A key's bucket. kv_pool_chain's keys are mixed already; mixed again so that keys made another way (small integers
 * in the tests) spread as well. */
static int bucket_of(const KVPool *p, uint64_t key) { return (int)(kv_mix64(key) & (uint64_t)(p->n_buckets - 1)); }

static void table_insert(KVPool *p, int page, uint64_t key) {
    int b = bucket_of(p, key);
    p->key[page] = key;
    p->keyed[page] = 1;
    p->chain[page] = p->bucket[b];
    p->bucket[b] = page;
}
static void table_remove(KVPool *p, int page) {
    int *at = &p->bucket[bucket_of(p, p->key[page])];   /* the link that points at page: a bucket head or a chain[] */
    while (*at != page) at = &p->chain[*at];
    *at = p->chain[page];
    p->chain[page] = -1;
    p->keyed[page] = 0;
}

/* ref 0 -> 1: one page more held */
static void hold(KVPool *p, int page) {
    p->ref[page] = 1;
    if (++p->n_held > p->peak_held) p->peak_held = p->n_held;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The pool
 * ------------------------------------------------------------------------------------------------------------- */

int kv_pool_init(KVPool *p, size_t bytes, size_t page_bytes, char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    if (bytes == 0 || page_bytes == 0)
        return errorf(err, errlen, "KV pool: the pool and page sizes must be above 0 (pool %zu B, page %zu B)", bytes,
                      page_bytes);
    if (bytes < page_bytes)
        return errorf(err, errlen, "KV pool: a page of %zu B does not fit in a pool of %zu B", page_bytes, bytes);
    size_t n = bytes / page_bytes;
    if (n > POOL_MAX_PAGES)
        return errorf(err, errlen, "KV pool: %zu pages of %zu B is more than %d", n, page_bytes, POOL_MAX_PAGES);
    int nb = 1;
    while ((size_t)nb < n) nb <<= 1;
    /* aligned_alloc (C11) wants a multiple of the alignment; n * page_bytes <= bytes cannot overflow */
    size_t mem_bytes = n * page_bytes;
    if (mem_bytes <= SIZE_MAX - KV_POOL_ALIGN) {
        mem_bytes = (mem_bytes + KV_POOL_ALIGN - 1) / KV_POOL_ALIGN * KV_POOL_ALIGN;
        p->mem = aligned_alloc(KV_POOL_ALIGN, mem_bytes);
        mem_advise_huge(p->mem, mem_bytes);   /* as a single run's arena (kv.c) */
    }
    p->ref = calloc(n, sizeof *p->ref);
    p->free_stack = malloc(n * sizeof *p->free_stack);
    p->key = calloc(n, sizeof *p->key);
    p->keyed = calloc(n, sizeof *p->keyed);
    p->bucket = malloc((size_t)nb * sizeof *p->bucket);
    p->chain = malloc(n * sizeof *p->chain);
    p->lru_prev = malloc(n * sizeof *p->lru_prev);
    p->lru_next = malloc(n * sizeof *p->lru_next);
    if (!p->mem || !p->ref || !p->free_stack || !p->key || !p->keyed || !p->bucket || !p->chain || !p->lru_prev ||
        !p->lru_next) {
        kv_pool_free(p);
        return errorf(err, errlen, "KV pool: out of memory for %zu pages of %zu B", n, page_bytes);
    }
    p->page_bytes = page_bytes;
    p->n_pages = (int)n;
    p->n_buckets = nb;
    for (int i = 0; i < p->n_pages; i++) {
        p->free_stack[i] = p->n_pages - 1 - i;   /* page 0 on top: a fresh pool hands out 0, 1, 2, ... */
        p->chain[i] = p->lru_prev[i] = p->lru_next[i] = -1;
    }
    for (int b = 0; b < nb; b++) p->bucket[b] = -1;
    p->n_free = p->n_pages;
    p->lru_head = p->lru_tail = -1;
    return 0;
}

void kv_pool_free(KVPool *p) {
    free(p->mem); free(p->ref); free(p->free_stack); free(p->key); free(p->keyed);
    free(p->bucket); free(p->chain); free(p->lru_prev); free(p->lru_next);
    memset(p, 0, sizeof *p);
}

int kv_pool_take(KVPool *p) {
    int page;
    if (p->n_free > 0) page = p->free_stack[--p->n_free];
    else if (p->lru_head >= 0) {   /* reclaim the least recently released cached page: its block leaves the cache */
        page = p->lru_head;
        lru_unlink(p, page);
        table_remove(p, page);
        p->evicted++;
    } else return -1;
    p->taken++;
    hold(p, page);
    return page;
}

void kv_pool_ref(KVPool *p, int page) {
    check_page(p, "ref", page);
    if (p->ref[page] > 0) { p->ref[page]++; return; }
    if (!p->keyed[page]) pool_bug("ref", page, "it is free");
    lru_unlink(p, page);   /* a prefix hit on a cached page: held again */
    hold(p, page);
}

void kv_pool_release(KVPool *p, int page) {
    check_page(p, "release", page);
    if (p->ref[page] <= 0) pool_bug("release", page, "nobody holds it");
    if (--p->ref[page] > 0) return;
    p->n_held--;
    if (p->keyed[page]) lru_push_recent(p, page);
    else p->free_stack[p->n_free++] = page;
}

/* One step of the chain: kv_mix64 is a bijection with kv_mix64(0) = 0, so the increment keeps a zero state fed zeros
 * from staying 0 (splitmix64's step on h ^ x). */
static uint64_t chain_step(uint64_t h, uint64_t x) { return kv_mix64((h ^ x) + GOLDEN); }

uint64_t kv_pool_chain(uint64_t parent, const int *tokens, int n, uint64_t salt) {
    /* parent mixed on its own first, so (parent, salt) pairs with equal parent ^ salt do not collide */
    uint64_t h = chain_step(chain_step(parent, 0), salt);
    h = chain_step(h, (uint64_t)(uint32_t)n);   /* the block's length is part of what it is, then its tokens */
    for (int i = 0; i < n; i++) h = chain_step(h, (uint64_t)(uint32_t)tokens[i]);
    return h;
}

int kv_pool_publish(KVPool *p, int page, uint64_t key) {
    check_page(p, "publish", page);
    if (p->ref[page] <= 0) pool_bug("publish", page, "nobody holds it");
    if (p->keyed[page]) {
        if (p->key[page] == key) return 0;
        pool_bug("publish", page, "it holds another block already");
    }
    if (kv_pool_lookup(p, key) >= 0) return 1;
    table_insert(p, page, key);
    return 0;
}

int kv_pool_lookup(const KVPool *p, uint64_t key) {
    for (int q = p->bucket[bucket_of(p, key)]; q >= 0; q = p->chain[q])
        if (p->key[q] == key) return q;
    return -1;
}

int kv_pool_n_free(const KVPool *p) { return p->n_free; }
int kv_pool_n_cached(const KVPool *p) { return p->n_cached; }
int kv_pool_n_held(const KVPool *p) { return p->n_held; }

/* ---------------------------------------------------------------------------------------------------------------
 * The invariants
 * ------------------------------------------------------------------------------------------------------------- */

enum { ON_FREE = 1, ON_LRU = 2, IN_TABLE = 4 };   /* bits of the check's scratch, per page */

/* The first broken invariant, or NULL; *at the page involved (-1: none). seen (n_pages, zeroed) is scratch. */
static const char *first_broken(const KVPool *p, uint8_t *seen, int *at) {
    int n = p->n_pages, held = 0, cached = 0, free_ = 0, keyed = 0;
    *at = -1;
    if (p->n_free + p->n_held + p->n_cached != n) return "n_free + n_held + n_cached is not n_pages";
    for (int q = 0; q < n; q++) {
        *at = q;
        if (p->ref[q] < 0) return "a negative ref";
        if (p->keyed[q] > 1) return "keyed is neither 0 nor 1";
        if (p->ref[q] > 0) held++; else if (p->keyed[q]) cached++; else free_++;
        keyed += p->keyed[q];
        if ((p->ref[q] || !p->keyed[q]) && (p->lru_prev[q] != -1 || p->lru_next[q] != -1))
            return "a page off the LRU list has LRU links";
        if (!p->keyed[q] && p->chain[q] != -1) return "an unkeyed page has a hash chain link";
    }
    *at = -1;
    if (held != p->n_held) return "n_held is not the count of pages with ref > 0";
    if (cached != p->n_cached) return "n_cached is not the count of keyed pages with ref 0";
    if (free_ != p->n_free) return "n_free is not the count of unkeyed pages with ref 0";
    if (p->peak_held < p->n_held) return "peak_held is below n_held";
    /* n_free distinct entries, each free: the stack holds exactly the free pages */
    for (int i = 0; i < p->n_free; i++) {
        int q = p->free_stack[i];
        *at = q;
        if (q < 0 || q >= n) return "a free stack entry out of range";
        if (seen[q] & ON_FREE) return "a page twice on the free stack";
        if (p->ref[q] || p->keyed[q]) return "a page on the free stack is not free";
        seen[q] |= ON_FREE;
    }
    int listed = 0, prev = -1;
    for (int q = p->lru_head; q != -1; prev = q, q = p->lru_next[q]) {
        *at = q;
        if (q < 0 || q >= n) return "an LRU link out of range";
        if (seen[q] & ON_LRU) return "a page twice on the LRU list (a cycle)";
        if (p->lru_prev[q] != prev) return "LRU links are not symmetric";
        if (p->ref[q] || !p->keyed[q]) return "a page on the LRU list is not cached";
        seen[q] |= ON_LRU;
        listed++;
    }
    *at = prev;
    if (prev != p->lru_tail) return "lru_tail is not the LRU list's last page";
    if (listed != p->n_cached) return "the LRU list's length is not n_cached";
    listed = 0;
    for (int b = 0; b < p->n_buckets; b++)
        for (int q = p->bucket[b]; q != -1; q = p->chain[q]) {
            *at = q;
            if (q < 0 || q >= n) return "a hash link out of range";
            if (seen[q] & IN_TABLE) return "a page twice in the hash table (a cycle)";
            if (!p->keyed[q]) return "an unkeyed page in the hash table";
            if (bucket_of(p, p->key[q]) != b) return "a keyed page in another key's bucket";
            if (kv_pool_lookup(p, p->key[q]) != q) return "two pages hold one key";
            seen[q] |= IN_TABLE;
            listed++;
        }
    *at = -1;
    if (listed != keyed) return "a keyed page is missing from the hash table";
    return NULL;
}

int kv_pool_check(const KVPool *p, char *err, size_t errlen) {
    uint8_t *seen = calloc(p->n_pages > 0 ? (size_t)p->n_pages : 1, 1);
    if (!seen) return errorf(err, errlen, "KV pool check: out of memory");
    int at;
    const char *why = first_broken(p, seen, &at);
    free(seen);
    if (!why) return 0;
    return errorf(err, errlen, "KV pool check: %s (page %d)", why, at);
}
