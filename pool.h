/* pool.h: the KV pool of the serving mode: one allocation of fixed bytes cut into pages that many sequences share, as
 * vLLM's PagedAttention does (block tables over one free list), with pages of a shared prompt prefix shared through a
 * prefix cache (vLLM's automatic prefix caching). pool.c's opening comment explains the three page states and the
 * prefix cache. A page is P slots (KV_POOL_PAGE_SLOTS by default) of ONE lane; what its bytes mean is the caller's
 * business: this is the allocator and the cache's bookkeeping only, with no model, no attention and no block tables
 * (a sequence's list of pages per lane is kept by the caller).
 *
 * Dimensions: n_pages, page_bytes, n_buckets (hash buckets). Indices: page a page id in [0, n_pages).
 * Misuse (a page id out of range, a release of a page nobody holds, a ref of a free page, publishing a page nobody
 * holds or re-keying a keyed one) is a bug in the caller, not an input error: the pool prints it and aborts.
 */
#ifndef KVLAB_POOL_H
#define KVLAB_POOL_H

#include <stddef.h>
#include <stdint.h>

#define KV_POOL_PAGE_SLOTS 16   /* slots (tokens) of one lane per page: vLLM's default block size */
#define KV_POOL_ALIGN 64        /* bytes: mem's alignment, a cache line (and an AVX-512 vector) */

typedef struct KVPool {
    size_t page_bytes;   /* bytes of one page */
    int n_pages;         /* pages in the pool: floor(bytes / page_bytes) */
    int n_buckets;       /* hash buckets: the smallest power of two >= n_pages */
    uint8_t *mem;        /* (n_pages, page_bytes): the only KV allocation of a serving run, KV_POOL_ALIGN-aligned */
    int *ref;            /* (n_pages) holders of each page; 0 = free or cached-unreferenced */
    /* the free list: a stack of page ids, free_stack[n_free - 1] taken next */
    int *free_stack;     /* (n_pages) */
    int n_free;          /* pages */
    /* the prefix cache */
    uint64_t *key;       /* (n_pages) the block a keyed page holds (kv_pool_chain's key); meaningless when unkeyed */
    uint8_t *keyed;      /* (n_pages) 1: key[page] is in the hash table */
    int *bucket;         /* (n_buckets) the first keyed page of each bucket's chain, -1 when empty */
    int *chain;          /* (n_pages) the next keyed page in the same bucket, -1 at the end */
    int *lru_prev;       /* (n_pages) the LRU list of cached pages (keyed, ref 0): the next less recent, -1 none */
    int *lru_next;       /* (n_pages) the next more recent, -1 none */
    int lru_head;        /* the least recently released cached page (reclaimed first), -1 when none */
    int lru_tail;        /* the most recently released one, -1 when none */
    int n_cached;        /* pages: keyed with ref 0, on the LRU list */
    int n_held;          /* pages with ref > 0 */
    /* counters since init */
    long taken;          /* pages handed out by kv_pool_take */
    long evicted;        /* of them, cached pages reclaimed (LRU evictions: their blocks left the prefix cache) */
    int peak_held;       /* pages: the most held at once */
} KVPool;

/* Create a pool of floor(bytes / page_bytes) pages (bytes and page_bytes in bytes), every page free. The pages' bytes
 * are not cleared. mem is one block aligned to KV_POOL_ALIGN bytes; page p starts at mem + p * page_bytes, so every
 * page is aligned when page_bytes is a multiple of KV_POOL_ALIGN. Metadata beside it: at most 37 B a page.
 * Returns 0, or -1 + message: a size is 0, fewer than one page fits, more than 2^30 pages, out of memory. On error
 * the pool is left empty (kv_pool_free is safe on it). */
int kv_pool_init(KVPool *p, size_t bytes, size_t page_bytes, char *err, size_t errlen);
/* Free everything the pool allocated and zero it (safe on a zeroed or failed pool). */
void kv_pool_free(KVPool *p);

/* A page for a new holder, with ref 1 and no key: a free page (the most recently freed one), else the least recently
 * released cached page (its block leaves the prefix cache: an LRU eviction), else -1 when every page is held.
 * (PagedAttention, Kwon et al. 2023, arXiv:2309.06180, §4.2: blocks allocated on demand from one free list.) */
int kv_pool_take(KVPool *p);
/* One more holder of a held or cached page (a prefix hit, or a fork sharing a page: PagedAttention §4.4's reference
 * counts); a cached page leaves the LRU list and is held again with ref 1. Aborts on a free page. */
void kv_pool_ref(KVPool *p, int page);
/* One holder less of a held page. At ref 0 a keyed page joins the LRU list as the most recent (it stays findable by
 * kv_pool_lookup until kv_pool_take reclaims it), an unkeyed one goes back to the free list. Aborts when ref is 0.
 * Releasing a sequence's pages last block first makes its longer prefixes leave the cache first, vLLM's order. */
void kv_pool_release(KVPool *p, int page);
/* The bytes of a page: (page_bytes). */
static inline uint8_t *kv_pool_page(const KVPool *p, int page) { return p->mem + (size_t)page * p->page_bytes; }

/* The key of a block of n tokens (token ids, n >= 0) whose prefix is the block keyed `parent` (0 for a sequence's
 * first block), salted by `salt` (the caller's lane and configuration: layer, kv head, storage spec), so the same
 * tokens of another lane or cache spec get another page. vLLM's block hash: hash(parent hash, the block's tokens, extra
 * keys) (automatic prefix caching design, docs.vllm.ai). The hash is kv_mix64 (kv.h, splitmix64's finalizer) folded
 * over parent, salt, n and the tokens; distinct blocks share a key with probability about 2^-64 (pool.c: what a
 * collision would do). Not collision-resistant against inputs chosen to collide. */
uint64_t kv_pool_chain(uint64_t parent, const int *tokens, int n, uint64_t salt);
/* A held page now holds the block `key` (its bytes are complete: nobody writes them again while it is keyed): 0.
 * 1 when another page already holds that key: nothing changes, the caller keeps its page unkeyed (and may release it
 * and ref the other). 0 when the page already holds this key. Aborts when the page is not held or holds another key. */
int kv_pool_publish(KVPool *p, int page, uint64_t key);
/* The page holding block `key` (held or cached), or -1; no ref change: ref it to use it. */
int kv_pool_lookup(const KVPool *p, uint64_t key);

/* Pages in each state: free (ref 0, unkeyed), cached (ref 0, keyed), held (ref > 0); the three sum to n_pages. */
int kv_pool_n_free(const KVPool *p);
int kv_pool_n_cached(const KVPool *p);
int kv_pool_n_held(const KVPool *p);
/* The pages a lane of n_tokens tokens needs, page_slots tokens a page: ceil(n_tokens / page_slots). */
static inline int kv_pool_pages_for(int n_tokens, int page_slots) { return (n_tokens + page_slots - 1) / page_slots; }

/* The invariants, checked from the arrays (O(n_pages + n_buckets), for tests): every ref >= 0; every page in exactly
 * one state, each count equal to its field (free + held + cached = n_pages); the free stack holds exactly the free
 * pages, once each; the LRU list holds exactly the cached pages, once each, links symmetric, head and tail its ends;
 * the hash table holds exactly the keyed pages, each in its key's bucket, no key twice; peak_held >= n_held.
 * 0, or -1 + which one broke (and -1 when the check's scratch cannot be allocated). */
int kv_pool_check(const KVPool *p, char *err, size_t errlen);

#endif
