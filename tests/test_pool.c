/* test_pool.c: the KV pool (pool.c) without a model:
 *   1. init: its errors (a size 0, a page bigger than the pool, too many pages), the page count, mem's alignment,
 *      every page's bytes writable (the sanitizer build checks the bounds), kv_pool_pages_for;
 *   2. by hand: take every page then -1, release gives it back, ref counts, publish and lookup, a duplicate key,
 *      the LRU order of reclaim, a ref'd cached page leaving the LRU list, free pages before cached ones, the counters,
 *      and two prompts sharing a prefix as a serving loop would drive them;
 *   3. kv_pool_chain: deterministic, every input changes the key, no collision among 100,000 blocks, avalanche;
 *   4. kv_pool_check catches each kind of corruption put in by hand (so the soak's checks are not vacuous);
 *   5. a seeded random soak of 100,000 operations per pool size against a reference model written here (an array of
 *      page states; the LRU victim found by a scan for the oldest release stamp, where pool.c keeps a linked list),
 *      kv_pool_check and the model compared after every operation, and no leak at the end.
 * Dimensions: n pages. */
#include "pool.h"
#include "kv.h"   /* splitmix64: the test's random stream */
#include "tests/check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char err[256];

static int init_ok(KVPool *p, size_t bytes, size_t page_bytes) {
    if (kv_pool_init(p, bytes, page_bytes, err, sizeof err) == 0) return 1;
    CHECK(0, "kv_pool_init(%zu, %zu): %s", bytes, page_bytes, err);
    return 0;
}
static int check_ok(const KVPool *p) { return kv_pool_check(p, err, sizeof err) == 0; }

/* ---- 1. init ---- */
static void test_init(void) {
    KVPool p;
    CHECK(kv_pool_init(&p, 0, 64, err, sizeof err) == -1 && err[0] && p.mem == NULL, "init: 0 bytes refused (%s)", err);
    CHECK(kv_pool_init(&p, 4096, 0, err, sizeof err) == -1 && err[0], "init: 0-byte pages refused (%s)", err);
    CHECK(kv_pool_init(&p, 100, 101, err, sizeof err) == -1 && err[0], "init: a page above the pool refused (%s)", err);
    kv_pool_free(&p);   /* safe after a failed init */
    CHECK(kv_pool_init(&p, ((size_t)1 << 30) + 1, 1, err, sizeof err) == -1 && err[0],
          "init: 2^30 + 1 pages refused without allocating (%s)", err);

    if (!init_ok(&p, 100, 100)) return;
    CHECK(p.n_pages == 1 && p.n_buckets == 1 && kv_pool_n_free(&p) == 1 && check_ok(&p), "init: a pool of one page");
    kv_pool_free(&p);

    if (!init_ok(&p, 1000, 64)) return;
    CHECK(p.n_pages == 15 && p.n_buckets == 16 && p.page_bytes == 64, "init: 1000 B / 64 B = 15 pages, 16 buckets");
    CHECK(kv_pool_n_free(&p) == 15 && kv_pool_n_held(&p) == 0 && kv_pool_n_cached(&p) == 0 && check_ok(&p),
          "init: every page free, invariants hold");
    CHECK((uintptr_t)p.mem % KV_POOL_ALIGN == 0 && kv_pool_page(&p, 3) == p.mem + 192 &&
          (uintptr_t)kv_pool_page(&p, 14) % KV_POOL_ALIGN == 0, "init: mem and pages 64-byte aligned, page 3 at 192 B");
    kv_pool_free(&p);

    if (!init_ok(&p, 1000, 100)) return;   /* pages that are not a multiple of the alignment */
    for (int q = 0; q < p.n_pages; q++) memset(kv_pool_page(&p, q), q, p.page_bytes);
    int same = 1;
    for (int q = 0; q < p.n_pages; q++)
        for (size_t i = 0; i < p.page_bytes; i++) same &= kv_pool_page(&p, q)[i] == (uint8_t)q;
    CHECK(p.n_pages == 10 && (uintptr_t)p.mem % KV_POOL_ALIGN == 0 && same,
          "init: 10 pages of 100 B, each writable in full, apart from the others");
    kv_pool_free(&p);
    CHECK(p.mem == NULL && p.n_pages == 0, "free: the pool zeroed");

    CHECK(kv_pool_pages_for(0, 16) == 0 && kv_pool_pages_for(1, 16) == 1 && kv_pool_pages_for(16, 16) == 1 &&
          kv_pool_pages_for(17, 16) == 2 && kv_pool_pages_for(4096, KV_POOL_PAGE_SLOTS) == 256,
          "pages_for: 0, 1, 16, 17, 4096 tokens -> 0, 1, 1, 2, 256 pages of 16");
}

/* ---- 2. by hand ---- */
static void test_take_release_ref(void) {
    KVPool p;
    if (!init_ok(&p, 4 * 32, 32)) return;
    int got[4], ok = 1;
    for (int i = 0; i < 4; i++) { got[i] = kv_pool_take(&p); ok &= got[i] == i && p.ref[i] == 1 && check_ok(&p); }
    CHECK(ok, "take: a fresh pool hands out pages 0, 1, 2, 3 with ref 1");
    CHECK(kv_pool_take(&p) == -1 && kv_pool_n_held(&p) == 4 && kv_pool_n_free(&p) == 0 && check_ok(&p),
          "take: -1 when every page is held");
    kv_pool_release(&p, 2);
    CHECK(p.ref[2] == 0 && kv_pool_n_free(&p) == 1 && kv_pool_n_held(&p) == 3 && check_ok(&p),
          "release: an unkeyed page goes back to the free list");
    CHECK(kv_pool_take(&p) == 2 && kv_pool_take(&p) == -1, "take: the released page comes back, then -1 again");

    kv_pool_ref(&p, 1);
    kv_pool_ref(&p, 1);
    CHECK(p.ref[1] == 3 && kv_pool_n_held(&p) == 4 && check_ok(&p), "ref: two more holders of page 1, ref 3");
    kv_pool_release(&p, 1);
    kv_pool_release(&p, 1);
    CHECK(p.ref[1] == 1 && kv_pool_n_free(&p) == 0 && check_ok(&p), "release: two holders less, ref 1, still held");
    kv_pool_release(&p, 1);
    CHECK(p.ref[1] == 0 && kv_pool_n_free(&p) == 1 && check_ok(&p), "release: the last holder frees it");
    for (int q = 0; q < 4; q++) if (p.ref[q]) kv_pool_release(&p, q);
    CHECK(kv_pool_n_free(&p) == 4 && kv_pool_n_held(&p) == 0 && p.taken == 5 && p.evicted == 0 && p.peak_held == 4 &&
          check_ok(&p), "counters: 5 taken, 0 evicted, peak 4 held; every page free at the end");
    kv_pool_free(&p);
}

static void test_publish_lookup(void) {
    KVPool p;
    if (!init_ok(&p, 8 * 16, 16)) return;
    uint64_t k1 = 0x1111, k2 = 0x2222;
    int a = kv_pool_take(&p), b = kv_pool_take(&p);
    CHECK(kv_pool_lookup(&p, k1) == -1, "lookup: -1 for a key nobody published");
    CHECK(kv_pool_publish(&p, a, k1) == 0 && kv_pool_lookup(&p, k1) == a && p.keyed[a] && check_ok(&p),
          "publish: page a holds k1, lookup finds it");
    CHECK(kv_pool_publish(&p, a, k1) == 0 && check_ok(&p), "publish: the same key again on the same page is 0");
    CHECK(kv_pool_publish(&p, b, k1) == 1 && !p.keyed[b] && kv_pool_lookup(&p, k1) == a && check_ok(&p),
          "publish: a duplicate key returns 1, b stays unkeyed, k1 still on a");
    kv_pool_release(&p, b);
    CHECK(kv_pool_n_free(&p) == 7 && kv_pool_n_cached(&p) == 0, "release: the unkeyed duplicate goes to the free list");
    kv_pool_release(&p, a);
    CHECK(kv_pool_n_cached(&p) == 1 && kv_pool_n_held(&p) == 0 && kv_pool_lookup(&p, k1) == a && check_ok(&p),
          "release: a keyed page at ref 0 is cached and still found");
    kv_pool_ref(&p, a);
    CHECK(p.ref[a] == 1 && kv_pool_n_cached(&p) == 0 && kv_pool_n_held(&p) == 1 && p.lru_head == -1 && check_ok(&p),
          "ref: a prefix hit takes the cached page off the LRU list, held again");
    kv_pool_ref(&p, a);
    kv_pool_release(&p, a);
    CHECK(p.ref[a] == 1 && kv_pool_n_cached(&p) == 0, "ref/release on a keyed held page: it stays held");
    int c = kv_pool_take(&p);
    CHECK(kv_pool_publish(&p, c, k2) == 0 && kv_pool_lookup(&p, k2) == c && kv_pool_lookup(&p, k1) == a && check_ok(&p),
          "publish: two keys on two pages, each found");
    kv_pool_release(&p, a);
    kv_pool_release(&p, c);
    CHECK(kv_pool_n_cached(&p) == 2 && kv_pool_n_free(&p) == 6 && check_ok(&p), "release: both cached");
    kv_pool_free(&p);
}

static void test_lru(void) {
    KVPool p;
    if (!init_ok(&p, 4 * 8, 8)) return;
    uint64_t key[4] = {101, 202, 303, 404};
    for (int i = 0; i < 4; i++) { int q = kv_pool_take(&p); kv_pool_publish(&p, q, key[q]); }
    int order[4] = {2, 0, 3, 1}, ok = 1;
    for (int i = 0; i < 4; i++) { kv_pool_release(&p, order[i]); ok &= check_ok(&p); }
    CHECK(ok && kv_pool_n_cached(&p) == 4 && p.lru_head == 2 && p.lru_tail == 1,
          "LRU: released 2, 0, 3, 1, all cached");
    kv_pool_ref(&p, 0);   /* a hit on 0: it leaves the LRU list, so it is never reclaimed while held */
    CHECK(kv_pool_n_cached(&p) == 3 && check_ok(&p), "LRU: the ref'd page 0 left the list");
    int r1 = kv_pool_take(&p);
    CHECK(r1 == 2 && kv_pool_lookup(&p, key[2]) == -1 && !p.keyed[2] && p.evicted == 1 && check_ok(&p),
          "LRU: the least recently released page (2) is reclaimed first, its key dropped");
    kv_pool_release(&p, 0);   /* 0 is now the most recent: order 3, 1, 0 */
    int r2 = kv_pool_take(&p), r3 = kv_pool_take(&p), r4 = kv_pool_take(&p);
    CHECK(r2 == 3 && r3 == 1 && r4 == 0 && kv_pool_take(&p) == -1 && p.evicted == 4 && check_ok(&p),
          "LRU: then 3, 1 and 0 (released again after its hit: the most recent); then -1");
    CHECK(kv_pool_lookup(&p, 101) == -1 && kv_pool_lookup(&p, 202) == -1 && kv_pool_lookup(&p, 303) == -1 &&
          kv_pool_lookup(&p, 404) == -1 && kv_pool_n_cached(&p) == 0, "LRU: every reclaimed page's key is gone");

    for (int q = 0; q < 4; q++) kv_pool_release(&p, q);   /* all free now (unkeyed) */
    int a = kv_pool_take(&p);
    kv_pool_publish(&p, a, 7);
    kv_pool_release(&p, a);   /* one cached page, three free */
    long ev = p.evicted;
    int f1 = kv_pool_take(&p), f2 = kv_pool_take(&p), f3 = kv_pool_take(&p);
    CHECK(f1 != a && f2 != a && f3 != a && p.evicted == ev && kv_pool_lookup(&p, 7) == a, "take: free pages first");
    CHECK(kv_pool_take(&p) == a && p.evicted == ev + 1 && kv_pool_lookup(&p, 7) == -1 && check_ok(&p),
          "take: the cached page only when no free one is left");
    kv_pool_free(&p);
}

/* Two prompts of 3 blocks of 4 tokens in one lane, sharing their first two blocks: the second finds the first two
 * pages by their chained keys and computes only its third block. */
static void test_shared_prefix(void) {
    KVPool p;
    if (!init_ok(&p, 5 * 64, 64)) return;
    int A[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, B[12] = {1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96};
    uint64_t salt = 3, parent = 0;
    int pa[3], pb[3];
    for (int i = 0; i < 3; i++) {
        parent = kv_pool_chain(parent, A + 4 * i, 4, salt);
        pa[i] = kv_pool_take(&p);
        kv_pool_publish(&p, pa[i], parent);
    }
    for (int i = 2; i >= 0; i--) kv_pool_release(&p, pa[i]);   /* last block first: vLLM's eviction order */
    int hits = 0;
    parent = 0;
    for (int i = 0; i < 3; i++) {
        parent = kv_pool_chain(parent, B + 4 * i, 4, salt);
        int q = kv_pool_lookup(&p, parent);
        if (q >= 0) { kv_pool_ref(&p, q); hits++; pb[i] = q; }
        else { pb[i] = kv_pool_take(&p); kv_pool_publish(&p, pb[i], parent); }
    }
    CHECK(hits == 2 && pb[0] == pa[0] && pb[1] == pa[1] && pb[2] != pa[2] && check_ok(&p),
          "prefix: the second prompt shares the first two pages, computes the third");
    CHECK(kv_pool_n_held(&p) == 3 && kv_pool_n_cached(&p) == 1 && kv_pool_n_free(&p) == 1 && p.evicted == 0,
          "prefix: A's third block still cached, one page free, nothing evicted");
    kv_pool_free(&p);
}

/* ---- 3. kv_pool_chain ---- */
static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
static void test_chain(void) {
    int t[16];
    for (int i = 0; i < 16; i++) t[i] = 1000 + i;
    uint64_t k = kv_pool_chain(0, t, 16, 5);
    CHECK(k == kv_pool_chain(0, t, 16, 5), "chain: deterministic");
    CHECK(k != kv_pool_chain(1, t, 16, 5) && k != kv_pool_chain(0, t, 16, 6) && k != kv_pool_chain(0, t, 15, 5),
          "chain: parent, salt and length each change the key");
    CHECK(kv_pool_chain(1, t, 16, 0) != kv_pool_chain(0, t, 16, 1), "chain: (parent 1, salt 0) != (parent 0, salt 1)");
    int all = 1;
    for (int i = 0; i < 16; i++) { t[i]++; all &= kv_pool_chain(0, t, 16, 5) != k; t[i]--; }
    CHECK(all, "chain: changing any one of the 16 tokens changes the key");
    int s[16];
    memcpy(s, t, sizeof s);
    s[3] = t[4]; s[4] = t[3];
    CHECK(kv_pool_chain(0, s, 16, 5) != k, "chain: token order matters");
    int z[4] = {0, 0, 0, 0};
    CHECK(kv_pool_chain(0, z, 4, 0) != 0 && kv_pool_chain(0, z, 0, 0) != 0, "chain: zeros do not hash to 0");

    enum { NB = 100000 };
    uint64_t *keys = malloc(NB * sizeof *keys), rng = 12345;
    if (!keys) { CHECK(0, "chain: out of memory"); return; }
    for (int i = 0; i < NB; i++) {   /* blocks of 16 ids from a vocabulary of 50 (so many blocks are near-duplicates) */
        for (int j = 0; j < 16; j++) t[j] = (int)(splitmix64(&rng) % 50);
        keys[i] = kv_pool_chain(0, t, 16, 0);
    }
    qsort(keys, NB, sizeof *keys, cmp_u64);
    int dups = 0;
    for (int i = 1; i < NB; i++) dups += keys[i] == keys[i - 1];
    /* 100,000 random blocks of 50^16 equal ones with probability ~ 1e-22 */
    CHECK(dups == 0, "chain: 100,000 random blocks, no two with one key (%d)", dups);
    free(keys);

    /* avalanche: flipping one bit of one token flips each key bit with probability 1/2: 32 of 64 on average, the mean
     * over 10,000 flips within 0.04 (its standard deviation, 4 / 100) of it; 31.5..32.5 is 12 of those */
    double sum = 0;
    for (int i = 0; i < 10000; i++) {
        for (int j = 0; j < 16; j++) t[j] = (int)(splitmix64(&rng) % 50000);
        uint64_t a = kv_pool_chain(i, t, 16, 0);
        t[splitmix64(&rng) % 16] ^= 1 << (splitmix64(&rng) % 16);
        sum += __builtin_popcountll(a ^ kv_pool_chain(i, t, 16, 0));
    }
    CHECK(sum / 10000 >= 31.5 && sum / 10000 <= 32.5, "chain: a one-bit change flips %.2f of 64 key bits", sum / 10000);
}

/* ---- 4. the check catches corruption ---- */
static void expect_caught(const KVPool *p, const char *what) {
    err[0] = 0;
    CHECK(kv_pool_check(p, err, sizeof err) == -1, "check: catches %s (%s)", what, err);
}
static void test_check_catches(void) {
    KVPool p;
    if (!init_ok(&p, 6 * 8, 8)) return;
    int a = kv_pool_take(&p), b = kv_pool_take(&p), c = kv_pool_take(&p);
    kv_pool_publish(&p, a, 1); kv_pool_publish(&p, b, 2); kv_pool_publish(&p, c, 3);
    kv_pool_release(&p, a); kv_pool_release(&p, b);   /* a then b cached (LRU a -> b), c held, 3 free */
    CHECK(check_ok(&p), "check: a pool with free, held and cached pages passes");
    int f0 = p.free_stack[0], f1 = p.free_stack[1];
    p.ref[a] = -1; expect_caught(&p, "a negative ref"); p.ref[a] = 0;
    p.ref[f0] = 1; expect_caught(&p, "a free page that claims a holder"); p.ref[f0] = 0;
    p.n_free--; expect_caught(&p, "a wrong n_free"); p.n_free++;
    p.n_held++; p.n_cached--; expect_caught(&p, "n_held and n_cached off by one each"); p.n_held--; p.n_cached++;
    p.peak_held = 0; expect_caught(&p, "peak_held below n_held"); p.peak_held = 3;
    p.free_stack[1] = f0; expect_caught(&p, "a page twice on the free stack"); p.free_stack[1] = f1;
    p.free_stack[1] = c; expect_caught(&p, "a held page on the free stack"); p.free_stack[1] = f1;
    p.lru_prev[b] = -1; expect_caught(&p, "asymmetric LRU links"); p.lru_prev[b] = a;
    p.lru_tail = a; expect_caught(&p, "a wrong lru_tail"); p.lru_tail = b;
    p.lru_next[b] = a; expect_caught(&p, "a cycle in the LRU list"); p.lru_next[b] = -1;
    p.keyed[a] = 0; expect_caught(&p, "a cached page that lost its key"); p.keyed[a] = 1;
    p.keyed[c] = 0; expect_caught(&p, "an unkeyed page left in the hash table"); p.keyed[c] = 1;
    p.key[b] = 1; expect_caught(&p, "two pages with one key"); p.key[b] = 2;
    /* a keyed page unlinked from its bucket's chain, by the test's own walk */
    int *bucket = malloc((size_t)p.n_buckets * sizeof *bucket), *chain = malloc((size_t)p.n_pages * sizeof *chain);
    if (!bucket || !chain) { CHECK(0, "check: out of memory"); return; }
    memcpy(bucket, p.bucket, (size_t)p.n_buckets * sizeof *bucket);
    memcpy(chain, p.chain, (size_t)p.n_pages * sizeof *chain);
    for (int k = 0; k < p.n_buckets; k++) if (p.bucket[k] == a) p.bucket[k] = p.chain[a];
    for (int q = 0; q < p.n_pages; q++) if (p.chain[q] == a) p.chain[q] = p.chain[a];
    p.chain[a] = -1;
    expect_caught(&p, "a keyed page missing from the hash table");
    memcpy(p.bucket, bucket, (size_t)p.n_buckets * sizeof *bucket);
    memcpy(p.chain, chain, (size_t)p.n_pages * sizeof *chain);
    free(bucket); free(chain);
    CHECK(check_ok(&p), "check: the pool passes again once every corruption is undone");
    kv_pool_free(&p);
}

/* ---- 5. the soak ---- */
typedef struct { int ref, keyed; uint64_t key; long stamp; } MPage;   /* the model's page; stamp: when it was cached */

static int model_find(const MPage *m, int n, uint64_t key) {
    for (int q = 0; q < n; q++) if (m[q].keyed && m[q].key == key) return q;
    return -1;
}

/* The model's reclaim: the cached page released longest ago (the smallest stamp), -1 when none is cached. */
static int model_lru_victim(const MPage *m, int n) {
    int want = -1;
    for (int q = 0; q < n; q++)
        if (!m[q].ref && m[q].keyed && (want < 0 || m[q].stamp < m[want].stamp)) want = q;
    return want;
}
static int model_n_free(const MPage *m, int n) {
    int k = 0;
    for (int q = 0; q < n; q++) k += !m[q].ref && !m[q].keyed;
    return k;
}

/* One more holder of page q (held or cached) in the pool, the model and the holders' list. */
static void soak_ref(KVPool *p, MPage *m, int *holders, int *n_hold, int q) {
    kv_pool_ref(p, q);
    m[q].ref++;
    holders[(*n_hold)++] = q;
}

/* Publish `key` on held page q in the pool and the model; 0 when they agree. *dups counts the duplicate keys. */
static int soak_publish(KVPool *p, MPage *m, int n, int q, uint64_t key, long *dups) {
    int other = model_find(m, n, key), want = other >= 0 && other != q;
    *dups += want;
    if (kv_pool_publish(p, q, key) != want) return -1;
    if (!want) { m[q].keyed = 1; m[q].key = key; }
    return 0;
}

static void soak(int n, long n_ops, uint64_t seed) {
    KVPool p;
    if (!init_ok(&p, (size_t)n * 48, 48)) return;
    enum { NKEYS_PER_PAGE = 3 };
    int n_keys = n * NKEYS_PER_PAGE, max_hold = 4 * n, n_hold = 0;
    MPage *m = calloc((size_t)n, sizeof *m);
    int *holders = malloc((size_t)max_hold * sizeof *holders);   /* one entry per holder: the page it holds */
    uint64_t *keys = malloc((size_t)n_keys * sizeof *keys), rng = seed;
    if (!m || !holders || !keys) { CHECK(0, "soak: out of memory"); return; }
    for (int i = 0; i < n_keys; i++) keys[i] = kv_pool_chain(0, &i, 1, seed);
    long taken = 0, evicted = 0, fails = 0, dups = 0, full = 0, revived = 0;   /* the last three: what was exercised */
    int peak = 0;
    char first[300] = "";
    for (long op = 0; op < n_ops; op++) {
        int r = (int)(splitmix64(&rng) % 100), bad = 0;
        if (n_hold == max_hold) r = 40;              /* as many holders as the test keeps: release one */
        if (r < 30) {                                /* take, and half the time publish a key at once */
            int any_free = model_n_free(m, n) > 0, got = kv_pool_take(&p);
            /* any free page will do (which one is the stack's business); a cached one must be the oldest */
            if (any_free) bad = got < 0 || got >= n || m[got].ref || m[got].keyed;
            else bad = got != model_lru_victim(m, n);
            full += got < 0;
            if (!bad && got >= 0) {
                if (!any_free) { m[got].keyed = 0; evicted++; }
                m[got].ref = 1;
                taken++;
                holders[n_hold++] = got;
                if (splitmix64(&rng) & 1) bad = soak_publish(&p, m, n, got, keys[splitmix64(&rng) % n_keys], &dups);
            }
        } else if (r < 60) {                         /* release a random holder */
            if (n_hold) {
                int i = (int)(splitmix64(&rng) % n_hold), q = holders[i];
                holders[i] = holders[--n_hold];
                kv_pool_release(&p, q);
                if (--m[q].ref == 0 && m[q].keyed) m[q].stamp = op;
            }
        } else if (r < 75) {                         /* a prefix hit: look a key up, hold what is found */
            uint64_t key = keys[splitmix64(&rng) % n_keys];
            int want = model_find(m, n, key), got = kv_pool_lookup(&p, key);
            bad = got != want;
            if (!bad && got >= 0) { revived += !m[got].ref; soak_ref(&p, m, holders, &n_hold, got); }
        } else if (r < 85) {                         /* a fork: one more holder of a held page */
            if (n_hold) soak_ref(&p, m, holders, &n_hold, holders[splitmix64(&rng) % n_hold]);
        } else if (r < 95) {                         /* publish on a held page: its own key again, or a random one */
            if (n_hold) {
                int q = holders[splitmix64(&rng) % n_hold];
                bad = soak_publish(&p, m, n, q, m[q].keyed ? m[q].key : keys[splitmix64(&rng) % n_keys], &dups);
            }
        } else {                                     /* a lookup alone */
            uint64_t key = keys[splitmix64(&rng) % n_keys];
            bad = kv_pool_lookup(&p, key) != model_find(m, n, key);
        }
        int held = 0, cached = 0, free_ = 0;
        for (int q = 0; q < n; q++) {
            bad |= p.ref[q] != m[q].ref || p.keyed[q] != m[q].keyed || (m[q].keyed && p.key[q] != m[q].key);
            if (m[q].ref) held++; else if (m[q].keyed) cached++; else free_++;
        }
        if (held > peak) peak = held;
        bad |= kv_pool_n_held(&p) != held || kv_pool_n_cached(&p) != cached || kv_pool_n_free(&p) != free_;
        bad |= p.taken != taken || p.evicted != evicted || p.peak_held != peak;
        if (kv_pool_check(&p, err, sizeof err)) bad = 1;
        else if (bad) snprintf(err, sizeof err, "the pool and the model differ");
        if (bad && !fails++) snprintf(first, sizeof first, "op %ld (kind %d): %s", op, r, err);
    }
    CHECK(fails == 0, "soak: %d pages, %ld operations, seed %llu: kv_pool_check and the model agree after each%s%s",
          n, n_ops, (unsigned long long)seed, fails ? "; first failure: " : "", first);
    CHECK(evicted > 0 && taken > n && peak == n && (dups > 0 || n == 1) && full > 0 && revived > 0,
          "soak: %d pages exercised: %ld taken, %ld evicted, peak %d held, %ld duplicate keys published, %ld takes "
          "of a full pool, %ld cached pages held again", n, taken, evicted, peak, dups, full, revived);

    while (n_hold) kv_pool_release(&p, holders[--n_hold]);
    CHECK(kv_pool_n_held(&p) == 0 && kv_pool_n_free(&p) + kv_pool_n_cached(&p) == n && check_ok(&p),
          "soak: %d pages: after every release, %d free + %d cached, nothing held", n, kv_pool_n_free(&p),
          kv_pool_n_cached(&p));
    int all = 1;
    for (int i = 0; i < n; i++) all &= kv_pool_take(&p) >= 0;
    CHECK(all && kv_pool_take(&p) == -1 && kv_pool_n_cached(&p) == 0 && check_ok(&p),
          "soak: %d pages: no leak, every page can be taken again", n);
    free(m); free(holders); free(keys);
    kv_pool_free(&p);
}

int main(void) {
    test_init();
    test_take_release_ref();
    test_publish_lookup();
    test_lru();
    test_shared_prefix();
    test_chain();
    test_check_catches();
    soak(1, 100000, 1);
    soak(8, 100000, 2);
    soak(61, 100000, 3);   /* not a power of two: 64 buckets */
    CHECK_EXIT();
}
