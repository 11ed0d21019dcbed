/* attn_cpu.c: the fast CPU attention, steps 3 (and 4, through kv_attend_policy) of kv.h for one token
 * (kv_attend_cpu) or a chunk of one stream's consecutive tokens (kv_attend_chunk, prefill and batched evaluation):
 * 16-lane score trees, softmax and weighted-sum kernels, AVX-512/AVX2 with a portable C twin of the same order, split
 * over OpenMP threads in pieces whose arithmetic does not depend on the split. Every result is defined by an order of
 * operations, so it gives the same bits for any build, thread count or chunking (tests/test_kv_portable.sh), and is
 * checked against kv_attend_ref, the definition, within a bound derived from f32 rounding (tests/test_attn_ref.c).
 * It deliberately holds no storage logic: keys and values are read through kv_impl.h, as kv_attend_ref reads them.
 * Dimensions: n_heads, n_kv_heads, head_dim, budget (slots per lane). Indices: l layer, g kv head, h query head,
 * t position, i rank in a lane's live list, u token of a chunk. */
#include "kv.h"
#include "kv_impl.h"
#include "exp_neg.h"
#include "kv_codec.h"

#include <limits.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <sched.h>
#if defined(__AVX__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Attention scores. A score is q·k in a fixed order of f32 operations, each term a multiply then an add (no fused
 * multiply-add), the same with or without vector instructions, so its bits never depend on the build, the thread
 * count or how the work is split. Dimension d goes to lane d mod 16; lane j holds q_j·k_j + q_(j+16)·k_(j+16) + ...
 * (in increasing d, from its first product; a lane with no dimension, j ≥ head_dim, holds 0), and the 16 lanes are
 * added as a tree: x_j = a_j + a_(j+8), y_j = x_j + x_(j+4), z_j = y_j + y_(j+2), s = z_0 + z_1; the score is
 * s·(1/√head_dim). That is a 16-wide (or two 8-wide) vector dot product of one key, so the key is read in place, in
 * its row, and 16 keys' sums are reduced together by a transposing tree (no horizontal sum per key and no repacking
 * of the keys: decode at long contexts is bound by reading them). Its error against the exact dot product is within
 * the bound tests/test_attn_ref.c checks (at most ⌈head_dim/16⌉ + 4 roundings along any term's path before the
 * scaling, fewer than the head_dim + 1 of a sum in d order). */
#define SCORE_LANES 16

/* The scalar definition: one score (unscaled), for any head_dim */
static inline float dot_lanes(const float *q, const float *k, int hd) {
    float a[SCORE_LANES];
    for (int j = 0; j < SCORE_LANES; j++) {
        a[j] = j < hd ? q[j] * k[j] : 0.0f;
        for (int d = j + SCORE_LANES; d < hd; d += SCORE_LANES) a[j] += q[d] * k[d];
    }
    for (int w = SCORE_LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) a[j] = a[j] + a[j + w];
    return a[0];
}

#ifdef __AVX512F__
/* Columns 16c .. 16c+15 of a key in its stored form ty: an f32 row read in place, or a q8 row (codec group Gc, a
 * multiple of 16) decoded in registers to the bits kv_decode gives (the group's f16 scale times the widened integer,
 * one rounding), so that a q8 key is scored without a round trip through a buffer */
/* 16 columns of a q8 row: the codes at off in the group that starts at u, widened, times the group's scale s */
static inline __attribute__((always_inline)) __m512 q8_cols16(const uint8_t *u, int off, __m512 s) {
    return _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(u + 2 + off)))));
}
static inline __attribute__((always_inline)) __m512 key16(const void *k, int c, int ty, int Gc) {
    if (ty != KV_Q8) return _mm512_loadu_ps((const float *)k + 16 * c);
    const uint8_t *u = (const uint8_t *)k + (size_t)(16 * c / Gc) * (2 + Gc);
    return q8_cols16(u, 16 * c % Gc, _mm512_set1_ps(kv_f16_scale(u)));
}
/* Lane sums of one key (16 lanes in one register) against a query held in registers (hd = 16·C) */
static inline __attribute__((always_inline)) __m512 lanes16(const __m512 *qv, const void *k, int C, int ty, int Gc) {
    __m512 a = _mm512_mul_ps(qv[0], key16(k, 0, ty, Gc));
    for (int c = 1; c < C; c++) a = _mm512_add_ps(a, _mm512_mul_ps(qv[c], key16(k, c, ty, Gc)));
    return a;
}
/* 16 keys' lane sums a[0..16) to their 16 sums (lane i: key i), each by the tree above: the pairs (j, j+8), (j, j+4),
 * (j, j+2), (j, j+1) added while the registers are transposed; the last step leaves key 4r + q at lane 4q + r. */
static inline __m512 tree16(__m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)   /* b[i]: keys 2i, 2i+1 (256 bits each), x_0..x_7 */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* c[i]: keys 4i..4i+3 (128 bits each), y_0..y_3 */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)   /* d[i], 128-bit lane q: z_0, z_1 of key 8i+q, then of key 8i+4+q */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(back, s);
}
#elif defined(__AVX2__)
/* Lane sums of one key, folded once: x_j = a_j + a_(j+8) for j < 8 (lanes 0-7 from the even 8-float pieces of the
 * row, 8-15 from the odd ones), hd = 16·C */
static inline __attribute__((always_inline)) __m256 lanes8(const __m256 *qv, const float *k, int C) {
    __m256 lo = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), hi = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
    for (int c = 1; c < C; c++) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(qv[2 * c], _mm256_loadu_ps(k + 16 * c)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(qv[2 * c + 1], _mm256_loadu_ps(k + 16 * c + 8)));
    }
    return _mm256_add_ps(lo, hi);
}
/* 8 keys' folded sums x[0..8) to their 8 sums (lane i: key i): the pairs (j, j+4), (j, j+2), (j, j+1) */
static inline __m256 tree8(__m256 *x) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++)   /* b[i]: keys 2i, 2i+1 (128 bits each), y_0..y_3 */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)   /* c[i], 128-bit lane h: z_0, z_1 of key 4i+h, then of key 4i+2+h */
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));   /* key 2r + h was at 4h + r */
}
#endif

/* out[i] = scale·(q·kp[i]) for one query and nk keys (the order above), each key stored as ty: KV_F32, or KV_Q8 with
 * codec group Gc, decoded in registers, which only the AVX-512 case reads (q8_keys_read_as_stored: the AVX2 and
 * scalar cases take f32 keys). C = head_dim / 16 a constant in the vector cases, so the query stays in registers. */
static inline __attribute__((always_inline)) void scores_one(float *out, const float *q, const void *const *kp,
                                                             int nk, int hd, float scale, int C, int ty, int Gc) {
    int i = 0;
#ifdef __AVX512F__
    if (C > 0 && C <= 8) {
        __m512 qv[8], a[16], sc = _mm512_set1_ps(scale);
        for (int c = 0; c < C; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
        for (; i + 16 <= nk; i += 16) {
            for (int k = 0; k < 16; k++) a[k] = lanes16(qv, kp[i + k], C, ty, Gc);
            _mm512_storeu_ps(out + i, _mm512_mul_ps(tree16(a), sc));
        }
        if (i < nk) {   /* a short group: the missing keys repeat the group's first (scored, not stored) */
            float s[16];
            for (int k = 0; k < 16; k++) a[k] = lanes16(qv, kp[i + (i + k < nk ? k : 0)], C, ty, Gc);
            _mm512_storeu_ps(s, _mm512_mul_ps(tree16(a), sc));
            memcpy(out + i, s, (size_t)(nk - i) * sizeof(float));
        }
        return;
    }
#elif defined(__AVX2__)
    if (C > 0 && C <= 4) {
        __m256 qv[8], x[8], sc = _mm256_set1_ps(scale);
        for (int c = 0; c < 2 * C; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);
        for (; i + 8 <= nk; i += 8) {
            for (int k = 0; k < 8; k++) x[k] = lanes8(qv, (const float *)kp[i + k], C);
            _mm256_storeu_ps(out + i, _mm256_mul_ps(tree8(x), sc));
        }
        if (i < nk) {
            float s[8];
            for (int k = 0; k < 8; k++) x[k] = lanes8(qv, (const float *)kp[i + (i + k < nk ? k : 0)], C);
            _mm256_storeu_ps(s, _mm256_mul_ps(tree8(x), sc));
            memcpy(out + i, s, (size_t)(nk - i) * sizeof(float));
        }
        return;
    }
#endif
    (void)C;
    for (; i < nk; i++) out[i] = dot_lanes(q, (const float *)kp[i], hd) * scale;
}

#ifdef __AVX512F__
/* scores_one for Q = 2 or 3 queries at once, C ≤ 4: each key is loaded (and a q8 key decoded) once for all of them,
 * K = 16 / Q keys a time (the tree's inputs: keys 0..K-1 against query 0, then against query 1, ..; with Q = 3 the
 * 16th input is a zero) */
static inline __attribute__((always_inline)) void scores_group(float *const *out, const float *const *q, int Q,
                                                               const void *const *kp, int nk, float scale, int C,
                                                               int ty, int Gc) {
    const int K = 16 / Q;
    __m512 qv[3][4], a[16], sc = _mm512_set1_ps(scale);
    for (int f = 0; f < Q; f++)
        for (int c = 0; c < C; c++) qv[f][c] = _mm512_loadu_ps(q[f] + 16 * c);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i down[3];   /* query f's K scores moved down to lanes 0..K-1 */
    for (int f = 1; f < Q; f++)
        down[f] = _mm512_and_si512(_mm512_add_epi32(iota, _mm512_set1_epi32(f * K)), _mm512_set1_epi32(15));
    for (int j = Q * K; j < 16; j++) a[j] = _mm512_setzero_ps();
    for (int i = 0; i < nk; i += K) {
        for (int k = 0; k < K; k++) {
            const void *key = kp[i + (i + k < nk ? k : 0)];   /* a short group repeats its first key (not stored) */
            __m512 x = key16(key, 0, ty, Gc);
            for (int f = 0; f < Q; f++) a[f * K + k] = _mm512_mul_ps(qv[f][0], x);
            for (int c = 1; c < C; c++) {
                x = key16(key, c, ty, Gc);
                for (int f = 0; f < Q; f++) a[f * K + k] = _mm512_add_ps(a[f * K + k], _mm512_mul_ps(qv[f][c], x));
            }
        }
        __m512 s = _mm512_mul_ps(tree16(a), sc);
        __mmask16 m = (__mmask16)((1u << (nk - i < K ? nk - i : K)) - 1);
        _mm512_mask_storeu_ps(out[0] + i, m, s);
        for (int f = 1; f < Q; f++) _mm512_mask_storeu_ps(out[f] + i, m, _mm512_permutexvar_ps(down[f], s));
    }
}
#endif

/* A 64-byte aligned pointer into a scratch array of 16 floats more than it needs (keys decoded there are read a
 * cache line at a time, never across two) */
static inline float *align64(float *p) { return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* Scores of one block: out[f][i] = scale·(q[f]·kp[i]) for nq query rows and nk ≤ KV_KEY_BLOCK keys, read in place
 * in their stored form ty (f32 rows, or q8 rows of codec group Gc: see scores_one; q8_keys_read_as_stored says where). The
 * block's keys stay in L1 while the queries pass over them. The body for constant C, ty and Gc; block_scores picks
 * it: head_dim 64 (4 registers of 16 lanes) f32 and q8 with groups of 32 have their own cases, other multiples of 16
 * the general vector one, the rest the scalar definition. */
static inline __attribute__((always_inline)) void block_scores_c(float *const *out, const float *const *q, int nq,
                                                                 const void *const *kp, int nk, int hd, float scale,
                                                                 int C, int ty, int Gc) {
    int f = 0;
#ifdef __AVX512F__
    /* pairs of queries; q8 keys, where each key read is a decode, take an odd group's three at once (GQA 3) */
    if (C > 0 && C <= 4)
        while (nq - f >= 2) {
            if (ty == KV_Q8 && (nq - f) % 2) { scores_group(out + f, q + f, 3, kp, nk, scale, C, ty, Gc); f += 3; }
            else { scores_group(out + f, q + f, 2, kp, nk, scale, C, ty, Gc); f += 2; }
        }
#endif
    for (; f < nq; f++) scores_one(out[f], q[f], kp, nk, hd, scale, C, ty, Gc);
}
static void block_scores(float *const *out, const float *const *q, int nq, const void *const *kp, int nk, int hd,
                         float scale, int ty, int Gc) {
    int C = hd % SCORE_LANES ? 0 : hd / SCORE_LANES;
#ifdef __AVX512F__
    if (C == 4 && ty == KV_Q8 && Gc == 32) { block_scores_c(out, q, nq, kp, nk, hd, scale, 4, KV_Q8, 32); return; }
#endif
    if (C == 4 && ty == KV_F32) block_scores_c(out, q, nq, kp, nk, hd, scale, 4, KV_F32, 0);
    else block_scores_c(out, q, nq, kp, nk, hd, scale, C, ty, Gc);
}

#ifdef __AVX512F__
/* block_scores for many query rows (a chunk's tokens and heads) against one block of f32 keys, with the keys
 * transposed once into kt (group of 16 keys, dimension, key): a register then holds one lane of 16 keys, so each
 * lane's sum a_j = q_j·k_j + q_(j+16)·k_(j+16) + ... is a vector multiply and adds across the 16 keys at once and the
 * tree (x_j = a_j + a_(j+8), y_j = x_j + x_(j+4), z_j = y_j + y_(j+2), s = z_0 + z_1) is 15 vector adds, with no
 * shuffle: the definition above, operation for operation, so the same bits as block_scores; about 8 vector
 * operations a score against about 10 (the shuffles of tree16), for the transposition's cost once per block (in
 * attn_bench -chunk 64 at 4,096 tokens the chunk's attention ran 3.10-3.15 ms per token against 3.22-3.27). hd =
 * 16·C, C ≤ 8. Below SCORES_T_MIN_ROWS query rows (decode's GQA group of 3) the transposition costs more than it
 * saves, and block_scores reads the keys in place. */
#define SCORES_T_MIN_ROWS 16
_Static_assert(KV_KEY_BLOCK % 16 == 0, "block_scores_t transposes a key block in groups of 16 keys");
static inline __attribute__((always_inline)) void scores_t_one(float *out, const float *q, const float *kt, int nk,
                                                               float scale, int C) {
    __m512 x[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {   /* x_j = a_j + a_(j+8), each lane's products in increasing d */
        __m512 a[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const float *k0 = kt + (size_t)(j + 8 * h) * 16;
            a[h] = _mm512_mul_ps(_mm512_set1_ps(q[j + 8 * h]), _mm512_load_ps(k0));
#pragma GCC unroll 8
            for (int c = 1; c < C; c++)
                a[h] = _mm512_add_ps(a[h], _mm512_mul_ps(_mm512_set1_ps(q[16 * c + j + 8 * h]),
                                                         _mm512_load_ps(k0 + (size_t)c * 16 * 16)));
        }
        x[j] = _mm512_add_ps(a[0], a[1]);
    }
    for (int j = 0; j < 4; j++) x[j] = _mm512_add_ps(x[j], x[j + 4]);   /* y_j */
    for (int j = 0; j < 2; j++) x[j] = _mm512_add_ps(x[j], x[j + 2]);   /* z_j */
    __m512 s = _mm512_mul_ps(_mm512_add_ps(x[0], x[1]), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << nk) - 1), s);
}
/* The 16 x 16 floats at rows r[0..16) (16 each, from column d0) transposed: t[d·16 + b] = r[b][d0 + d] for d < 16
 * (unpacks and lane shuffles, no arithmetic) */
static inline void transpose16(float *t, const float *const *r, int d0) {
    __m512 a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_loadu_ps(r[i] + d0);
    for (int i = 0; i < 16; i += 2) {   /* pairs of rows interleaved by 32-bit element */
        b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)     /* then by 64-bit pair */
        for (int k = 0; k < 2; k++) {
            a[i + k] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[i + k]), _mm512_castps_pd(b[i + 2 + k])));
            a[i + 2 + k] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[i + k]), _mm512_castps_pd(b[i + 2 + k])));
        }
    /* then by 128-bit lane, within 256-bit halves and across them */
    for (int i = 0; i < 8; i++) {
        int lo = (i / 4) * 8 + i % 4, hi = lo + 4;
        b[i] = _mm512_shuffle_f32x4(a[lo], a[hi], 0x88);
        b[i + 8] = _mm512_shuffle_f32x4(a[lo], a[hi], 0xDD);
    }
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 2; k++) {
            a[i + 8 * k] = _mm512_shuffle_f32x4(b[i + 8 * k], b[i + 4 + 8 * k], 0x88);
            a[i + 4 + 8 * k] = _mm512_shuffle_f32x4(b[i + 8 * k], b[i + 4 + 8 * k], 0xDD);
        }
    /* register i now holds one column, rows 0..15 in order: column i with bits 0 and 1, and bits 2 and 3, swapped */
    static const int col[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    for (int i = 0; i < 16; i++) _mm512_store_ps(t + 16 * col[i], a[i]);
}
static void block_scores_t(float *const *out, const float *const *q, int nq, const float *const *kp, int nk, int hd,
                           float scale) {
    int C = hd / SCORE_LANES, groups = (nk + 15) / 16;
    float kmem[KV_KEY_BLOCK * 8 * SCORE_LANES + 16];
    float *kt = align64(kmem);   /* (groups, hd, 16): kt[(grp·hd + d)·16 + b] = key 16·grp + b, dimension d */
    for (int grp = 0; grp < groups; grp++) {
        const float *r[16];
        for (int b = 0; b < 16; b++)   /* past nk: the group's first key again (its scores are not stored) */
            r[b] = kp[16 * grp + b < nk ? 16 * grp + b : 16 * grp];
        for (int d0 = 0; d0 < hd; d0 += 16) transpose16(kt + ((size_t)grp * hd + d0) * 16, r, d0);
    }
    for (int grp = 0; grp < groups; grp++) {
        const float *kg = kt + (size_t)grp * hd * 16;
        int nk16 = nk - 16 * grp < 16 ? nk - 16 * grp : 16;
        for (int f = 0; f < nq; f++) {   /* one query row at a time: two would spill the 16 lane sums */
            if (C == 4) scores_t_one(out[f] + 16 * grp, q[f], kg, nk16, scale, 4);   /* head_dim 64 unrolled */
            else scores_t_one(out[f] + 16 * grp, q[f], kg, nk16, scale, C);
        }
    }
}
#endif

/* 1 where the score kernels read q8 keys of this head_dim as stored rather than decoded into a buffer: with AVX-512,
 * head_dim a multiple of 16 up to 128 and codec groups a multiple of 16 (kv_attend_cpu asks it for its plain lanes).
 * The scores' bits are those of the decoded keys either way. With AVX2 the keys are decoded once per block instead:
 * in attn_bench (SmolLM2's shape, one thread, 512 tokens) that ran 1.67-1.69 ms per step against 1.75-1.80 decoding
 * in registers, where on AVX-512 (1024 tokens) decoding in registers ran 2.48-2.60 ms against 2.66-2.76. */
static int q8_keys_read_as_stored(int hd) {
#ifdef __AVX512F__
    int C = hd % SCORE_LANES ? 0 : hd / SCORE_LANES;
    return C > 0 && C <= 8 && kv_group(hd) % 16 == 0;
#else
    (void)hd;
    return 0;
#endif
}

#define WSUM_COLS 16
/* value rows asked for ahead (in the passes of 16, 32 or 64 columns); the 64-column pass asks into L2 (prefetcht1,
 * whose queue holds more lines in flight than L1's fill buffers). The keys of decode are left to the hardware
 * prefetchers: asking for a whole block of them at once, or for each key 16 ahead in the score kernel, measured no
 * faster, and slower in the chunk path, whose many query passes over a block then ask again each time. attn_bench,
 * 2-core Xeon, 2 threads, interleaved: 8,192 f32 tokens 22.3-22.7 -> 19.7-20.2 ms per step (a busier hour than the
 * 19.5-20.0 the same build ran earlier), the chunk path at 2,048 tokens 1.79-1.84 -> 1.72-1.77 ms per token */
#define WSUM_AHEAD 16

/* The attention output of a GQA group over columns [d0, d0 + w) of its lane, w ≤ 16 (32 or 64 with G ≤ 3,
 * wsum_cols): o_h[d] =
 * Σ_i p_h[i]·v_i[d] for the group's G ≤ 4 query heads, for every (h, d) in the naive loop's order (0 + p_0 v_0[d] +
 * p_1 v_1[d] + ..., a multiply then an add). Each value row's columns are read once for the whole group, in its
 * stored form: row i is the lane's i-th live value in type vt[i] (vb[i] its bytes), decoded in registers 16 columns
 * at a time (kv_decode16), never into a buffer, to the bits kv_decode gives (the codec's arithmetic: a widening, an
 * f16 scale, a multiply, for q4 and q2 then an add of the minimum, each rounded as the scalar code rounds it). A q8
 * row (68 bytes at head_dim 64) is a quarter of an f32 row: decode attention at long contexts streams the cache, so
 * reading it in its stored form is what makes q8 and q4 lanes faster than f32 ones. With AVX the group's sums stay
 * in registers. */
/* One value row (v0..v3) into the sums of up to 3 heads, a00..a23, with the vector width's intrinsics (X: _mm256
 * or _mm512): s += p_h[i]·v, a multiply then an add. Names the body's own variables (G, p, i, ph). */
#define WSUM_HEAD4(X, h, s0, s1, s2, s3)                          \
    if (G > h) {                                                  \
        ph = X##_set1_ps(p[h][i]);                                \
        s0 = X##_add_ps(s0, X##_mul_ps(ph, v0));                  \
        s1 = X##_add_ps(s1, X##_mul_ps(ph, v1));                  \
        s2 = X##_add_ps(s2, X##_mul_ps(ph, v2));                  \
        s3 = X##_add_ps(s3, X##_mul_ps(ph, v3));                  \
    }
#define WSUM_ROW4(X) WSUM_HEAD4(X, 0, a00, a01, a02, a03) WSUM_HEAD4(X, 1, a10, a11, a12, a13) \
                     WSUM_HEAD4(X, 2, a20, a21, a22, a23)
static inline __attribute__((always_inline)) void wsum_stored_body(float *const *o, const float *const *p,
                                                                  const uint8_t *const *vb, const uint8_t *vt, int n,
                                                                  int d0, int w, int G, int Gc) {
#ifdef __AVX512F__
    if (w == 64 && G <= 3) {   /* 64 columns, a whole f32 row at head_dim 64, in one pass: 12 sums in registers */
        __m512 z = _mm512_setzero_ps(), a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z,
               a20 = z, a21 = z, a22 = z, a23 = z;
        float row[64] __attribute__((aligned(64)));
        for (int i = 0; i < n; i++) {
            __m512 v0, v1, v2, v3, ph;
            if (i + WSUM_AHEAD < n) {
                const uint8_t *ahead = vb[i + WSUM_AHEAD] + kv_stored_offset(vt[i + WSUM_AHEAD], d0, Gc);
                for (int o = 0; o < (vt[i] == KV_F32 ? 256 : 128); o += 64) __builtin_prefetch(ahead + o, 0, 2);
            }
            if (vt[i] == KV_F32) {   /* read in place */
                const float *x = (const float *)(const void *)vb[i] + d0;
                v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16), v2 = _mm512_loadu_ps(x + 32);
                v3 = _mm512_loadu_ps(x + 48);
            } else if (vt[i] == KV_Q8 && Gc == 32) {   /* as below, each of the row's two groups' scales read once
                                                         (with the column a variable, key16's are not shared: the
                                                         general case below ran 2-4% slower at 8,192 q8 tokens) */
                const uint8_t *u = vb[i] + (size_t)(d0 / 32) * 34;
                __m512 s0 = _mm512_set1_ps(kv_f16_scale(u)), s1 = _mm512_set1_ps(kv_f16_scale(u + 34));
                v0 = q8_cols16(u, 0, s0), v1 = q8_cols16(u, 16, s0);
                v2 = q8_cols16(u + 34, 0, s1), v3 = q8_cols16(u + 34, 16, s1);
            } else if (vt[i] == KV_Q8 && Gc % 16 == 0) {   /* decoded in registers, kv_decode's bits (key16) */
                int c = d0 / 16;
                v0 = key16(vb[i], c, KV_Q8, Gc), v1 = key16(vb[i], c + 1, KV_Q8, Gc);
                v2 = key16(vb[i], c + 2, KV_Q8, Gc), v3 = key16(vb[i], c + 3, KV_Q8, Gc);
            } else {
                for (int k = 0; k < 4; k++) kv_decode16(row + 16 * k, vt[i], vb[i], d0 + 16 * k, Gc);
                v0 = _mm512_load_ps(row), v1 = _mm512_load_ps(row + 16), v2 = _mm512_load_ps(row + 32);
                v3 = _mm512_load_ps(row + 48);
            }
            WSUM_ROW4(_mm512)
        }
        __m512 a[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
        for (int hh = 0; hh < G; hh++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(o[hh] + d0 + 16 * k, a[hh][k]);
        return;
    }
#endif
#ifdef __AVX__
    if (w == 32 && G <= 3) {   /* 32 columns, two lines of an f32 row, in one pass: 12 sums in registers */
        __m256 z = _mm256_setzero_ps(), a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z,
               a20 = z, a21 = z, a22 = z, a23 = z;
        float row[32] __attribute__((aligned(32)));
        for (int i = 0; i < n; i++) {
            if (i + WSUM_AHEAD < n) {
                const uint8_t *ahead = vb[i + WSUM_AHEAD] + kv_stored_offset(vt[i + WSUM_AHEAD], d0, Gc);
                __builtin_prefetch(ahead);
                __builtin_prefetch(ahead + 64);
            }
            kv_decode16(row, vt[i], vb[i], d0, Gc);
            kv_decode16(row + 16, vt[i], vb[i], d0 + 16, Gc);
            __m256 v0 = _mm256_load_ps(row), v1 = _mm256_load_ps(row + 8), v2 = _mm256_load_ps(row + 16),
                   v3 = _mm256_load_ps(row + 24), ph;
            WSUM_ROW4(_mm256)
        }
        __m256 a[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
        for (int hh = 0; hh < G; hh++)
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(o[hh] + d0 + 8 * k, a[hh][k]);
        return;
    }
    if (w == 16) {
        __m256 z = _mm256_setzero_ps(), a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
        float row[16] __attribute__((aligned(32)));
        for (int i = 0; i < n; i++) {
            if (i + WSUM_AHEAD < n) __builtin_prefetch(vb[i + WSUM_AHEAD] + kv_stored_offset(vt[i + WSUM_AHEAD], d0, Gc));
            kv_decode16(row, vt[i], vb[i], d0, Gc);
            __m256 v0 = _mm256_load_ps(row), v1 = _mm256_load_ps(row + 8), ph;
#define WSUM_HEAD(h, s0, s1)                                      \
            if (G > h) {                                          \
                ph = _mm256_set1_ps(p[h][i]);                     \
                s0 = _mm256_add_ps(s0, _mm256_mul_ps(ph, v0));    \
                s1 = _mm256_add_ps(s1, _mm256_mul_ps(ph, v1));    \
            }
            WSUM_HEAD(0, a00, a01)
            WSUM_HEAD(1, a10, a11)
            WSUM_HEAD(2, a20, a21)
            WSUM_HEAD(3, a30, a31)
#undef WSUM_HEAD
        }
        __m256 a[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
        for (int hh = 0; hh < G; hh++) {
            _mm256_storeu_ps(o[hh] + d0, a[hh][0]);
            _mm256_storeu_ps(o[hh] + d0 + 8, a[hh][1]);
        }
        return;
    }
#endif
    float acc[4][64] = {{0}};
    for (int i = 0; i < n; i++)
        for (int dd = 0; dd < w; dd++) {
            float x = kv_decode_elem(vt[i], vb[i], d0 + dd, Gc);
            for (int hh = 0; hh < G; hh++) acc[hh][dd] += p[hh][i] * x;
        }
    for (int hh = 0; hh < G; hh++) memcpy(o[hh] + d0, acc[hh], (size_t)w * sizeof(float));
}
#undef WSUM_HEAD4
#undef WSUM_ROW4

/* Columns a weighted-sum pass covers for a group of G heads: 64 with AVX-512 and 32 with AVX where the group's sums
 * of up to 3 heads fit in registers (a whole f32 row of head_dim 64, or two cache lines of it, per pass over the
 * rows), else 16 (wsum_stored_body's cases; the portable loop takes up to 64) */
static int wsum_cols(int G, int hd) {
#ifdef __AVX512F__
    if (G <= 3 && hd % 64 == 0) return 4 * WSUM_COLS;
#endif
    return G <= 3 && hd % 32 == 0 ? 2 * WSUM_COLS : WSUM_COLS;
}

/* wsum_stored_body for any G: the group's heads four at a time, each case with its head count a constant; Gc = 32
 * (every head_dim that is a multiple of 32) a constant too, so that a column's group is a shift, not a division per
 * row */
static void weighted_sum_stored(float *const *o, const float *const *p, const uint8_t *const *vb, const uint8_t *vt,
                                int n, int d0, int w, int G, int Gc) {
#define WSUM_STORED_CASES(GC)                                                                    \
    switch (G - hh < 4 ? G - hh : 4) {                                                           \
    case 1: wsum_stored_body(o + hh, p + hh, vb, vt, n, d0, w, 1, GC); break;                    \
    case 2: wsum_stored_body(o + hh, p + hh, vb, vt, n, d0, w, 2, GC); break;                    \
    case 3: wsum_stored_body(o + hh, p + hh, vb, vt, n, d0, w, 3, GC); break;                    \
    default: wsum_stored_body(o + hh, p + hh, vb, vt, n, d0, w, 4, GC); break;                   \
    }
    for (int hh = 0; hh < G; hh += 4) {
        if (Gc == 32) { WSUM_STORED_CASES(32) }
        else { WSUM_STORED_CASES(Gc) }
    }
#undef WSUM_STORED_CASES
}

/* Value blocks. Every output is summed per value block, and the blocks' sums are added in order: o = S_0 + S_1 + ...
 * (left to right, from S_0 itself), S_b = 0 + p_i·v_i + p_(i+1)·v_(i+1) + ... over block b's ranks in rank order
 * (weighted_sum_stored's order). A block is a maximal run of consecutive rows whose positions share
 * ⌊position / KV_VALUE_BLOCK⌋: a rule of the tokens' positions alone, so the blocks do not depend on the thread count
 * or the chunking, and the chunk path over a union of rows (attend_union), which sums over a list that holds a
 * token's live ranks and others with probability 0 in between, meets the same blocks (a block of rows the token does
 * not see sums to +0, and adding +0 to a sum that is never -0 changes no bit). Decode spreads a lane's blocks over the
 * threads (flash-decoding's split-K, without its online softmax: the probabilities are normalized before), so at
 * long contexts every thread streams whole value rows of consecutive slots, the order the memory system reads
 * fastest. */
#define KV_VALUE_BLOCK 256

/* The rows an output phase sums, for their positions: the first n0 live ranks of lane ln, then rows at positions
 * pos0, pos0 + 1, ... (a chunk's new tokens), n rows in all; or, with upos, the rows at positions upos[0..n). Positions
 * increase along the rows (a lane's live list is in position order). */
typedef struct {
    const KVLane *ln;
    const int *upos;
    int n0, pos0, n;
} VRows;

static inline int vrow_pos(const VRows *r, int i) {
    return r->upos ? r->upos[i] : i < r->n0 ? kv_rank_pos(r->ln, i) : r->pos0 + (i - r->n0);
}

/* The end of row i's value block: the first row after i in another block, or r->n (a binary search: positions
 * increase along the rows) */
static int vblock_end(const VRows *r, int i) {
    long next = ((long)vrow_pos(r, i) / KV_VALUE_BLOCK + 1) * KV_VALUE_BLOCK;
    int lo = i + 1, hi = r->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (vrow_pos(r, mid) < next) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* weighted_sum_stored over the first n rows of r, block by block: o_h[d0, d0 + w) = S_0 + S_1 + ... (the order
 * above). o: G rows of head_dim floats. */
static void wsum_blocked(float *const *o, const float *const *p, const uint8_t *const *vb, const uint8_t *vt,
                         const VRows *r, int n, int d0, int w, int G, int hd, int Gc) {
    float tmem[G * hd], *t[G];
    const float *pb[G];
    for (int hh = 0; hh < G; hh++) {
        t[hh] = tmem + (size_t)hh * hd;
        for (int dd = 0; dd < w; dd++) o[hh][d0 + dd] = 0;   /* no rows: 0 */
    }
    for (int i0 = 0; i0 < n;) {
        int i1 = vblock_end(r, i0);
        i1 = i1 < n ? i1 : n;
        for (int hh = 0; hh < G; hh++) pb[hh] = p[hh] + i0;
        weighted_sum_stored(i0 ? t : o, pb, vb + i0, vt + i0, i1 - i0, d0, w, G, Gc);
        if (i0)
            for (int hh = 0; hh < G; hh++)
                for (int dd = 0; dd < w; dd++) o[hh][d0 + dd] += t[hh][d0 + dd];
        i0 = i1;
    }
}

/* 8 partial sums s_k folded as ((s0+s4)+(s1+s5)) + ((s2+s6)+(s3+s7)), the order of a vector reduction with hadd */
#ifdef __AVX__
static inline float fold8_sum(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));   /* [s0+s4, s1+s5, s2+s6, s3+s7] */
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#endif
static inline float fold8_sum_c(const float s[8]) {
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* In place, p[i] = e^(x_i − max) / Σ_j e^(x_j − max) over n scores, in a fixed order with or without AVX2: the sum
 * is 8 partial sums (sum k takes i ≡ k mod 8 below 8·⌊n/8⌋) folded by fold8_sum, plus the tail summed from 0. */
static void softmax_inplace(float *x, int n) {
    float mx = -INFINITY;
    int i = 0;
#ifdef __AVX__
    /* maxps(a, b) is a > b ? a : b, the scalar test below, so the maximum is the same (a NaN is skipped either way;
       which zero wins, +0 or -0, changes no x - max) */
    __m256 mv = _mm256_set1_ps(-INFINITY);
#ifdef __AVX512F__
    /* four running maxima of 16, so that the maxps do not wait on each other (one chain paced by its latency was
       half of a long row's softmax); the maximum does not depend on the order it is taken in */
    __m512 m4[4];
    for (int k = 0; k < 4; k++) m4[k] = _mm512_set1_ps(-INFINITY);
    for (; i + 64 <= n; i += 64)
        for (int k = 0; k < 4; k++) m4[k] = _mm512_max_ps(_mm512_loadu_ps(x + i + 16 * k), m4[k]);
    for (; i + 16 <= n; i += 16) m4[0] = _mm512_max_ps(_mm512_loadu_ps(x + i), m4[0]);
    m4[0] = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
    mv = _mm256_max_ps(_mm512_castps512_ps256(m4[0]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m4[0]), 1)));
#endif
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(_mm256_loadu_ps(x + i), mv);
    float mvals[8];
    _mm256_storeu_ps(mvals, mv);
    for (int k = 0; k < 8; k++) mx = mvals[k] > mx ? mvals[k] : mx;
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    i = 0;
    float sum;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), m8 = _mm256_set1_ps(mx);
#ifdef __AVX512F__
    /* 16 at a time, each half added to the 8 partial sums in turn: the same order */
    for (__m512 m16 = _mm512_set1_ps(mx); i + 16 <= n; i += 16) {
        __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m16));
        _mm512_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = fold8_sum(acc);
#else
    float s[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) { x[i + k] = exp_neg(x[i + k] - mx); s[k] += x[i + k]; }
    sum = fold8_sum_c(s);
#endif
    float tail = 0;
    for (; i < n; i++) { x[i] = exp_neg(x[i] - mx); tail += x[i]; }
    float inv = 1.0f / (sum + tail);
    for (i = 0; i < n; i++) x[i] *= inv;
}

/* *buf to at least n floats (ints) (contents not kept). 0, or -1 when out of memory (*buf unchanged). */
static int grow_floats(float **buf, size_t *cap, size_t n) {
    if (n <= *cap) return 0;
    float *b = malloc(n * sizeof(float));
    if (!b) return -1;
    free(*buf);
    *buf = b;
    *cap = n;
    return 0;
}
static int grow_ints(int **buf, size_t *cap, size_t n) {
    if (n <= *cap) return 0;
    int *b = malloc(n * sizeof(int));
    if (!b) return -1;
    free(*buf);
    *buf = b;
    *cap = n;
    return 0;
}

/* Multiply-adds per layer below which attention stays on one thread (as run.c's matmul does below 65536). */
#define KV_PARALLEL_MIN_WORK 65536
/* Step 3 in three phases, each split over the threads in pieces whose arithmetic does not depend on the split, so
 * any thread count gives the same bits:
 *   scores   per (lane, block of 64 live slots): each key decoded/rotated once for the whole GQA group, the block
 *            scored against every query head of the group (block_scores; the values only located there: they are
 *            read as stored in the output phase);
 *   softmax  per query head: max, exp, sum and normalization in rank order;
 *   output   per (lane, value block): the block's Σ_i p_hi v_i for the group's heads (each value row read once for
 *            the group, whole rows of consecutive slots), then per query head the blocks' sums added in order (the
 *            value blocks above). With fewer blocks than four per thread (short contexts) a block's columns are
 *            split too: a column's arithmetic is the same either way.
 * At long contexts decode attention is bound by reading the cache (f32 SmolLM2 at 2,048 tokens: 92 MiB per token),
 * so every phase reads each key and value once. */
void kv_attend_cpu(KVCache *c, float *out, int l, int t, const float *q) {
    if (kv_query_selects(c, t)) { kv_attend_select(c, out, l, t, q); return; }
    const KVShape *s = &c->shape;
    int hd = s->head_dim, n_kv = s->n_kv_heads, nh = s->n_heads, group = nh / n_kv, budget = c->budget;
    float scale = 1.0f / sqrtf((float)hd);
    const KVLane *lanes = &c->lanes[l * n_kv];
    const float *cs_t = kv_rope_at(c, t);
    int max_n = 0;
    for (int g = 0; g < n_kv; g++) max_n = lanes[g].n_live > max_n ? lanes[g].n_live : max_n;
    /* the queries, rotated: at the query's position (pos=orig) or at the newest rank of its lane (pos=cache) */
    for (int h = 0; h < nh; h++) {
        float *qh = c->qbuf + (size_t)h * hd;
        memcpy(qh, q + (size_t)h * hd, (size_t)hd * sizeof(float));
        if (c->spec.pos == POS_CACHE) kv_rope_apply(qh, s, c->rope_cs + (size_t)(lanes[h / group].n_live - 1) * hd);
        else kv_rope_apply(qh, s, cs_t);
    }
    int cols = wsum_cols(group, hd);
    int blocks = (max_n + KV_KEY_BLOCK - 1) / KV_KEY_BLOCK, col_blocks = (hd + cols - 1) / cols;
    int Gc = kv_group(hd);   /* the codec's group of a vector (q8, q4, q2) */
    /* plain: lanes of one band, a key per token (no per-channel groups), no low rank, pos=orig; their block walk
       takes the rows' addresses straight from the lane's pages. Their keys go to the score kernels as stored (f32,
       and q8 where q8_keys_read_as_stored) or are decoded once per block (kdec); values are read as stored by the
       output. */
    KVType kty = c->band_ktype[0];
    int plain = c->n_bands == 1 && !c->band_kchan[0] && !c->krank && !c->vrank && c->spec.pos == POS_ORIG;
    int kq8 = plain && kty == KV_Q8 && q8_keys_read_as_stored(hd);
    int kdec = kty != KV_F32 && !kq8;
    uint8_t vty = (uint8_t)c->band_vtype[0];
    /* the value blocks of each lane: lane g's are rows boff[g] .. boff[g + 1] - 1 of c->vpart, starting at ranks
       c->vstart[g·(max_n + 1) + b]; where that scratch cannot grow, each (lane, columns) goes block by block on one
       thread (wsum_blocked: the same sums) */
    VRows vr[n_kv];
    int boff[n_kv + 1];
    size_t vs_ld = (size_t)max_n + 1;
    int split_k = !grow_ints(&c->vstart, &c->vstart_cap, (size_t)n_kv * vs_ld);
    boff[0] = 0;
    for (int g = 0; g < n_kv; g++) {
        vr[g] = (VRows){&lanes[g], NULL, lanes[g].n_live, 0, lanes[g].n_live};
        int nb = 0, n = lanes[g].n_live, p0 = n ? kv_rank_pos(&lanes[g], 0) : 0;
        if (split_k && n && kv_rank_pos(&lanes[g], n - 1) - p0 == n - 1)
            /* positions strictly increase along the live list (a slot holds one token, a merged slot the newest of
               its own), so first and last n - 1 apart mean consecutive positions (a lane that never evicted): the
               blocks start where the position is a multiple of KV_VALUE_BLOCK, found without reading the positions
               between, whose reads miss the cache (vblock_end's: at 8,192 f32 tokens ~0.5 ms of a 20 ms step) */
            for (int i = 0; i < n; i = (i + KV_VALUE_BLOCK) - (p0 + i) % KV_VALUE_BLOCK) c->vstart[g * vs_ld + nb++] = i;
        else
            for (int i = 0; split_k && i < n; i = vblock_end(&vr[g], i)) c->vstart[g * vs_ld + nb++] = i;
        if (split_k) c->vstart[g * vs_ld + nb] = lanes[g].n_live;
        boff[g + 1] = boff[g] + nb;
    }
    split_k = split_k && !grow_floats(&c->vpart, &c->vpart_cap, (size_t)boff[n_kv] * group * hd);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int col_split = boff[n_kv] < 4 * threads ? col_blocks : 1;   /* pieces per block */
    /* small layers stay on one thread: waking the team costs more than the work (and much more on a loaded machine) */
    size_t work = (size_t)max_n * hd * nh;
    #pragma omp parallel if (work >= KV_PARALLEL_MIN_WORK)
    {
        #pragma omp for schedule(static)
        for (int item = 0; item < n_kv * blocks; item++) {
            int g = item / blocks, i0 = item % blocks * KV_KEY_BLOCK, n = lanes[g].n_live;
            int i1 = i0 + KV_KEY_BLOCK < n ? i0 + KV_KEY_BLOCK : n;
            if (i1 <= i0) continue;   /* this lane is shorter than the layer's longest */
            /* this thread's scratch, in L1 for the block: the keys that had to be decoded or rotated (f32 keys are
               read in place) */
            float kmem[KV_KEY_BLOCK * hd + 16];
            float *kx = align64(kmem);
            const void *kp[KV_KEY_BLOCK];
            const uint8_t **vb = c->vrow + (size_t)g * budget;
            uint8_t *vt = c->vrow_type + (size_t)g * budget;
            if (plain) {   /* one band, keys read in place: the rows' addresses from the lane's pages, directly */
                const KVLane *ln = &lanes[g];
                for (int i = i0; i < i1; i++) {   /* ask for the block's keys now, all at once */
                    int r = ln->live[i] - ln->band_first[0];
                    const uint8_t *kb = kv_band_k(c, ln, 0, r);
                    kp[i - i0] = kb;
                    vb[i] = kv_band_v(c, ln, 0, r);
                }
                if (kdec)   /* keys of a form the score kernels do not read: decoded once for the group's queries */
                    for (int i = 0; i < i1 - i0; i++) {
                        float *x = kx + (size_t)i * hd;
                        kv_decode_inline(x, kty, kp[i], hd);
                        kp[i] = x;
                    }
                memset(vt + i0, vty, (size_t)(i1 - i0));
            } else {
                /* ask for the block's stored keys now, all at once, rather than one miss at a time in the decoding
                   or the scoring */
                for (int i = i0; i < i1; i++) {
                    int slot = lanes[g].live[i];
                    const uint8_t *kb = kv_slot_k(c, &lanes[g], slot);
                    for (size_t o = 0; o < c->band_kb[kv_slot_band(&lanes[g], slot)]; o += 64) __builtin_prefetch(kb + o);
                }
                for (int i = i0; i < i1; i++) {
                    kp[i - i0] = kv_lane_key(c, &lanes[g], i, kx + (size_t)(i - i0) * hd);
                    vb[i] = kv_lane_value_stored(c, &lanes[g], i, c->vbuf + ((size_t)g * budget + i) * hd, &vt[i]);
                }
            }
            const float *qg[group];
            float *sg[group];
            for (int hh = 0; hh < group; hh++) {
                qg[hh] = c->qbuf + (size_t)(g * group + hh) * hd;
                sg[hh] = c->scores + (size_t)(g * group + hh) * budget + i0;
            }
            block_scores(sg, qg, group, kp, i1 - i0, hd, scale, kq8 ? KV_Q8 : KV_F32, Gc);
        }
        #pragma omp for schedule(static)
        for (int h = 0; h < nh; h++) softmax_inplace(c->scores + (size_t)h * budget, lanes[h / group].n_live);
        if (split_k) {
            #pragma omp for schedule(static)
            for (int item = 0; item < boff[n_kv] * col_split; item++) {
                int bi = item / col_split, g = 0;
                while (bi >= boff[g + 1]) g++;
                const int *st = c->vstart + g * vs_ld + (bi - boff[g]);
                float *o[group];
                const float *p[group];
                for (int hh = 0; hh < group; hh++) {
                    o[hh] = c->vpart + ((size_t)bi * group + hh) * hd;
                    p[hh] = c->scores + (size_t)(g * group + hh) * budget + st[0];
                }
                int d_lo = col_split > 1 ? item % col_split * cols : 0, d_hi = col_split > 1 ? d_lo + cols : hd;
                for (int d0 = d_lo; d0 < d_hi && d0 < hd; d0 += cols)
                    weighted_sum_stored(o, p, c->vrow + (size_t)g * budget + st[0],
                                        c->vrow_type + (size_t)g * budget + st[0], st[1] - st[0], d0,
                                        hd - d0 < cols ? hd - d0 : cols, group, Gc);
            }
            #pragma omp for schedule(static)
            for (int h = 0; h < nh; h++) {   /* the blocks' sums in order */
                int g = h / group;
                float *o = out + (size_t)h * hd;
                for (int d = 0; d < hd; d++) o[d] = 0;   /* an empty lane */
                for (int bi = boff[g]; bi < boff[g + 1]; bi++) {
                    const float *sb = c->vpart + ((size_t)bi * group + h % group) * hd;
                    if (bi == boff[g]) memcpy(o, sb, (size_t)hd * sizeof(float));
                    else for (int d = 0; d < hd; d++) o[d] += sb[d];
                }
            }
        } else {
            #pragma omp for schedule(static)
            for (int item = 0; item < n_kv * col_blocks; item++) {
                int g = item / col_blocks, d0 = item % col_blocks * cols;
                float *o[group];
                const float *p[group];
                for (int hh = 0; hh < group; hh++) {
                    o[hh] = out + (size_t)(g * group + hh) * hd;
                    p[hh] = c->scores + (size_t)(g * group + hh) * budget;
                }
                wsum_blocked(o, p, c->vrow + (size_t)g * budget, c->vrow_type + (size_t)g * budget, &vr[g],
                             lanes[g].n_live, d0, hd - d0 < cols ? hd - d0 : cols, group, hd, Gc);
            }
        }
    }
    kv_attend_policy(c, l, t);
}

/* ---------------------------------------------------------------------------------------------------------------
 * A chunk of tokens through one layer (kv_attend_chunk). Token by token, step 3 reads every key and value of the
 * layer once per token. When no slot of the layer can be freed or change while the chunk passes (chunk_room), each
 * token's live list is known in advance: the lane's live list now, then the chunk's tokens up to itself. Step 3 then
 * runs for all the chunk's tokens at once, reading each key and value once per chunk, with every score,
 * probability and output computed by the same arithmetic as kv_attend_cpu (block_scores, softmax_inplace,
 * wsum_stored_body's order), so the bits are those of token-by-token decode. Steps 1, 2 and 4 (and the caller's hook) still
 * run token by token, in order.
 * ------------------------------------------------------------------------------------------------------------- */

/* Scratch of the chunk path, bytes at most: chunks are cut so that (tokens, n_heads, budget) probabilities fit. */
#define KV_CHUNK_SCRATCH (64u << 20)

/* Tokens a chunk (attend_static, attend_union) may hold in layer l so that no per-channel key group (kgroup=channel) seals or
 * takes a key into a sealed group's hole while it passes: kv_chan_room of every per-channel band of every lane (each
 * token stores into a band once at most: its own store, or one recode from the band before). With eviction
 * (`evicting`), a band with no open group gives 0: an eviction may empty a sealed group, which the next store would
 * then open in place of the group kv_chan_room foresaw. INT_MAX without per-channel bands. */
static int chan_room(const KVCache *c, int l, int evicting) {
    int H = c->shape.n_kv_heads, room = INT_MAX;
    if (!c->kgroup) return room;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        for (int b = 0; b < c->n_bands; b++) {
            if (!c->band_kchan[b] || ln->band_slots[b] == 0) continue;
            int r = evicting && ln->kopen[b] < 0 ? 0 : kv_chan_room(c, ln, b);
            room = r < room ? r : room;
        }
    }
    return room;
}

/* How many of the next tokens of layer l, from position t, can attend as one chunk: every lane has room for them (no
 * step-1 eviction), the policy never frees or merges slots (no prune, no merge), none of them selects (a selection
 * policy's prompt queries under prompt=dense read every token), there is one precision band (a token recoded into
 * the next band changes its bits), one memory tier (the fast tier's bookkeeping follows each token's store and read
 * in turn) and attention runs on the CPU's fast backend (the reference goes token by token). Per-channel keys
 * (kgroup=channel) change their bits when their group seals: a chunk ends before the token whose store seals a group
 * or lands outside the open one (chan_room; that token goes alone), so its keys are the open group's f32 ones and
 * the sealed groups' codes, unchanged while it passes. A low-rank lane (krank=, vrank=) re-encodes
 * every slot at its fit, when its calib-th token is stored: a chunk ends before the token whose store fits (that one
 * goes alone), so each token sees every slot in one form, staged or fitted, and the new ones as chunk_key makes
 * them. 0 when none can. */
static int chunk_room(const KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    if (c->device || c->n_bands > 1 || ops->prune || ops->merge || kv_query_selects(c, t)
        || c->backend == KV_BACKEND_REF || c->tiers)
        return 0;
    int room = ops->select ? c->policy.prompt_len - t : c->budget;   /* up to the prompt's end */
    int H = c->shape.n_kv_heads, total = 0;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        int r = ln->cap - ln->n_live;
        room = r < room ? r : room;
        total += ln->n_live;
        if ((c->krank || c->vrank) && !ln->lr_fitted) {   /* tokens stored before the fit's */
            r = c->calib - 1 - ln->lr_seen;
            room = r < room ? r : room;
        }
    }
    /* alloc=ada frees slots layer-wide once the layer's lanes hold more than H·B - H (kv.h): token u of the chunk
       (from 0) frees none while total + (u + 1)·H <= H·B. Past that every token goes through kv_append and
       kv_attend_cpu one at a time, the layer-wide choice made from the keep scores after the previous token's step 4,
       exactly as at -chunk 1, so any chunking gives the same bits. */
    if (c->ada) {
        int r = (H * c->policy.budget - total) / H;
        room = r < room ? r : room;
    }
    int chan = chan_room(c, l, 0);   /* tokens stored before a per-channel key group seals */
    return chan < room ? chan : room;
}

/* The big chunk scratch, shared by every cache of the process (caches attend one after another: eval runs its
 * policies layer by layer in turn): rotated queries (tokens, n_heads, head_dim) and scores, then probabilities
 * (tokens, n_heads, budget). Grown when a larger chunk arrives, kept for the process (no per-chunk allocation). */
static struct {
    float *q, *p;
    size_t q_cap, p_cap;   /* floats */
} chunk_scratch;

/* Grows the chunk buffers to n tokens of this cache. 0, or -1 when out of memory (the caller then goes token by
 * token). */
static int chunk_reserve(KVCache *c, int n) {
    const KVShape *s = &c->shape;
    size_t nq = (size_t)n * s->n_heads * s->head_dim, np = (size_t)n * s->n_heads * c->budget;
    if (grow_floats(&chunk_scratch.q, &chunk_scratch.q_cap, nq) || grow_floats(&chunk_scratch.p, &chunk_scratch.p_cap, np))
        return -1;
    if (n <= c->chunk_cap) return 0;
    float *cs = malloc((size_t)n * s->head_dim * sizeof(float));
    if (!cs) return -1;
    free(c->chunk_cs);
    c->chunk_cs = cs;
    c->chunk_cap = n;
    c->chunk_cs_n = 0;   /* the new table holds no position yet */
    return 0;
}

/* x (head_dim) through storage form ty and back, in place: what a store of x into a slot of that form reads back
 * (kv_encode, then kv_decode; f32 keeps x). */
static void chunk_roundtrip(float *x, KVType ty, int hd) {
    if (ty == KV_F32) return;
    uint8_t b[4 * hd + 64];   /* any form's bytes of one vector (f32, the largest, is 4·head_dim) */
    kv_encode(b, ty, x, hd);
    kv_decode(x, ty, b, hd);
}

/* The f32 key a new token of lane ln's chunk will have at attention: what kv_append stores into band 0 (pos=orig:
 * rotated by its position, cs) read back as kv_lane_key reads it (decoded; pos=cache: rotated by its rank). A fitted
 * low-rank lane stores the pre-RoPE key's coefficients and kv_lowrank_key reconstructs, then rotates by the position
 * (its table lr_cs holds kv_rope_cs's numbers, as cs does) or the rank: the same steps here. Before the fit a
 * low-rank lane stages what a full-rank cache stores. x: head_dim. */
static const float *chunk_key(const KVCache *c, const KVLane *ln, float *x, const float *k, int rank, const float *cs) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim;
    if (c->krank && ln->lr_fitted) {
        kv_lowrank_new_key(c, ln, x, k);
        if (c->spec.pos == POS_ORIG) kv_rope_apply(x, s, cs);
    } else {   /* a per-channel band's new key waits in f32 in its open group (chunk_room: none seals) */
        memcpy(x, k, (size_t)hd * sizeof(float));
        if (c->spec.pos == POS_ORIG) kv_rope_apply(x, s, cs);
        if (!c->band_kchan[0]) chunk_roundtrip(x, c->band_ktype[0], hd);
    }
    if (c->spec.pos == POS_CACHE) kv_rope_apply(x, s, c->rope_cs + (size_t)rank * hd);
    return x;
}

/* The same for a new token's value: v itself (f32), or decoded from what kv_append stores into x, or reconstructed
 * from its coefficients in a fitted low-rank lane. */
static const float *chunk_value(const KVCache *c, const KVLane *ln, float *x, const float *v) {
    if (c->vrank && ln->lr_fitted) { kv_lowrank_new_value(c, ln, x, v); return x; }
    if (c->band_vtype[0] == KV_F32) return v;
    memcpy(x, v, (size_t)c->shape.head_dim * sizeof(float));
    chunk_roundtrip(x, c->band_vtype[0], c->shape.head_dim);
    return x;
}

/* Four consecutive tokens' attention outputs for one query head over columns [d0, d0 + 16) of a lane, in pieces of
 * value rows: token k (k = 0..3) sums over value rows 0..n-1+k with probabilities p + k·ld_p into o + k·ld_o, each
 * output in wsum_stored_body's order (0 + p_0 v_0 + p_1 v_1 + ..., a multiply then an add). wsum_quad_rows adds rows
 * [i0, i1) (i1 ≤ n, the rows all four see) for all four tokens to the sums in o (first: the sums start from 0);
 * wsum_quad_tail adds the last three rows (n: tokens 1-3, n+1: tokens 2-3, n+2: token 3) to the sums in o. Storing
 * a sum and loading it back changes no bit, so the pieces give wsum_stored_body's outputs. The macros name the functions'
 * own variables (o, ld_o, p, ld_p, d0, i, ph, v0, v1). */
#ifdef __AVX512F__
/* With AVX-512 one register holds a token's 16 columns: the same multiply then add per column, in the same order, so
 * the same bits as the two 8-column halves below, with half the instructions. */
#define WSUM_TOKEN(k, s)                                              \
    s = _mm512_add_ps(s, _mm512_mul_ps(_mm512_set1_ps(p[(size_t)(k) * ld_p + i]), v0));
#define WSUM_LOAD(k, s) s = _mm512_loadu_ps(o + (size_t)(k) * ld_o + d0);
#define WSUM_STORE(k, s) _mm512_storeu_ps(o + (size_t)(k) * ld_o + d0, s);
static void wsum_quad_rows(float *o, size_t ld_o, const float *p, size_t ld_p, const float *const *v, int i0, int i1,
                           int d0, int first) {
    __m512 a0, a1, a2, a3, v0;
    if (first) a0 = a1 = a2 = a3 = _mm512_setzero_ps();
    else { WSUM_LOAD(0, a0) WSUM_LOAD(1, a1) WSUM_LOAD(2, a2) WSUM_LOAD(3, a3) }
    for (int i = i0; i < i1; i++) {
        v0 = _mm512_loadu_ps(v[i] + d0);
        WSUM_TOKEN(0, a0) WSUM_TOKEN(1, a1) WSUM_TOKEN(2, a2) WSUM_TOKEN(3, a3)
    }
    WSUM_STORE(0, a0) WSUM_STORE(1, a1) WSUM_STORE(2, a2) WSUM_STORE(3, a3)
}
static void wsum_quad_tail(float *o, size_t ld_o, const float *p, size_t ld_p, const float *const *v, int n, int d0) {
    __m512 a1, a2, a3, v0;
    int i = n;
    WSUM_LOAD(1, a1) WSUM_LOAD(2, a2) WSUM_LOAD(3, a3)
    v0 = _mm512_loadu_ps(v[i] + d0);
    WSUM_TOKEN(1, a1) WSUM_TOKEN(2, a2) WSUM_TOKEN(3, a3)
    i++;
    v0 = _mm512_loadu_ps(v[i] + d0);
    WSUM_TOKEN(2, a2) WSUM_TOKEN(3, a3)
    i++;
    v0 = _mm512_loadu_ps(v[i] + d0);
    WSUM_TOKEN(3, a3)
    WSUM_STORE(1, a1) WSUM_STORE(2, a2) WSUM_STORE(3, a3)
}
#undef WSUM_TOKEN
#undef WSUM_LOAD
#undef WSUM_STORE
#elif defined(__AVX__)
#define WSUM_TOKEN(k, s0, s1)                                         \
    ph = _mm256_set1_ps(p[(size_t)(k) * ld_p + i]);                   \
    s0 = _mm256_add_ps(s0, _mm256_mul_ps(ph, v0));                    \
    s1 = _mm256_add_ps(s1, _mm256_mul_ps(ph, v1));
#define WSUM_LOAD(k, s0, s1)                                          \
    s0 = _mm256_loadu_ps(o + (size_t)(k) * ld_o + d0);                \
    s1 = _mm256_loadu_ps(o + (size_t)(k) * ld_o + d0 + 8);
#define WSUM_STORE(k, s0, s1)                                         \
    _mm256_storeu_ps(o + (size_t)(k) * ld_o + d0, s0);                \
    _mm256_storeu_ps(o + (size_t)(k) * ld_o + d0 + 8, s1);
static void wsum_quad_rows(float *o, size_t ld_o, const float *p, size_t ld_p, const float *const *v, int i0, int i1,
                           int d0, int first) {
    __m256 a00, a01, a10, a11, a20, a21, a30, a31, v0, v1, ph;
    if (first) a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = _mm256_setzero_ps();
    else { WSUM_LOAD(0, a00, a01) WSUM_LOAD(1, a10, a11) WSUM_LOAD(2, a20, a21) WSUM_LOAD(3, a30, a31) }
    for (int i = i0; i < i1; i++) {
        v0 = _mm256_loadu_ps(v[i] + d0);
        v1 = _mm256_loadu_ps(v[i] + d0 + 8);
        WSUM_TOKEN(0, a00, a01) WSUM_TOKEN(1, a10, a11) WSUM_TOKEN(2, a20, a21) WSUM_TOKEN(3, a30, a31)
    }
    WSUM_STORE(0, a00, a01) WSUM_STORE(1, a10, a11) WSUM_STORE(2, a20, a21) WSUM_STORE(3, a30, a31)
}
static void wsum_quad_tail(float *o, size_t ld_o, const float *p, size_t ld_p, const float *const *v, int n, int d0) {
    __m256 a10, a11, a20, a21, a30, a31, v0, v1, ph;
    int i = n;
    WSUM_LOAD(1, a10, a11) WSUM_LOAD(2, a20, a21) WSUM_LOAD(3, a30, a31)
    v0 = _mm256_loadu_ps(v[i] + d0);
    v1 = _mm256_loadu_ps(v[i] + d0 + 8);
    WSUM_TOKEN(1, a10, a11) WSUM_TOKEN(2, a20, a21) WSUM_TOKEN(3, a30, a31)
    i++;
    v0 = _mm256_loadu_ps(v[i] + d0);
    v1 = _mm256_loadu_ps(v[i] + d0 + 8);
    WSUM_TOKEN(2, a20, a21) WSUM_TOKEN(3, a30, a31)
    i++;
    v0 = _mm256_loadu_ps(v[i] + d0);
    v1 = _mm256_loadu_ps(v[i] + d0 + 8);
    WSUM_TOKEN(3, a30, a31)
    WSUM_STORE(1, a10, a11) WSUM_STORE(2, a20, a21) WSUM_STORE(3, a30, a31)
}
#undef WSUM_TOKEN
#undef WSUM_LOAD
#undef WSUM_STORE
#endif

/* Value rows per piece of the output phase: a piece's rows (64 x head_dim floats, 16 KiB at head_dim 64) stay in L1
 * while every (token, head, 16 columns) of a work item passes over them. */
#define WSUM_ROWS 64
/* Tokens per work item of the output phase: each value row comes from L2 or L3 once per item */
#define WSUM_TOKENS 16

#ifdef __AVX__
/* Four tokens' value-block sums acc (token k at acc + k·ld_a, G rows of head_dim) into their outputs (token k at
 * o + k·ld_o, G rows of head_dim): o = acc for the first block, else o + acc (the value blocks' order). */
static void quad_fold(float *o, size_t ld_o, const float *acc, size_t ld_a, int G, int hd, int first) {
    for (int k = 0; k < 4; k++)
        for (int x = 0; x < G * hd; x++) {
            float *d = o + (size_t)k * ld_o + x;
            *d = first ? acc[(size_t)k * ld_a + x] : *d + acc[(size_t)k * ld_a + x];
        }
}
#endif

/* The outputs of tokens [u0, u1) of a chunk for lane g's query heads: token u sums rows 0 .. n0 + u of the lane's
 * rows vr (vp: f32 rows; vb, vt: the same rows as weighted_sum_stored reads them) with its probabilities P + u·ld_u +
 * h·ld_h, into out (tokens, n_heads·hd), value block by value block. With AVX and head_dim a multiple of 16, four
 * tokens at a time in pieces of WSUM_ROWS value rows (a piece never crosses a block), each piece read from L2 or L3
 * once for all the item's tokens and heads, the block's sums kept in acc and added to the outputs when it ends; a
 * quad whose last three rows (the rows only its later tokens see) start a new block, and the tokens left over (fewer
 * than four), go one at a time (wsum_blocked). Every output in the value blocks' order. */
static void wsum_tokens(float *out, const float *P, size_t ld_u, size_t ld_h, const float *const *vp,
                        const uint8_t *const *vb, const uint8_t *vt, const VRows *vr, int g, int n0, int u0, int u1,
                        int nh, int G, int hd) {
    size_t q_dim = (size_t)nh * hd;
    int u = u0, uq = u0;
    char cross[WSUM_TOKENS / 4 + 1];
#ifdef __AVX__
    if (hd % WSUM_COLS == 0) {
        uq = u0 + (u1 - u0) / 4 * 4;   /* tokens [u0, uq) go in fours; four tokens from u4 share rows 0..n0 + u4,
                                          and the last three rows as wsum_quad_tail adds them */
        size_t ld_a = (size_t)G * hd;
        float acc[(size_t)(uq > u0 ? uq - u0 : 1) * G * hd];   /* (token, head, column): each quad's block sums */
        for (int u4 = u0; u4 < uq; u4 += 4) {
            int S = n0 + u4 + 1;
            cross[(u4 - u0) / 4] = vblock_end(vr, S - 1) < S + 3;
        }
        int last = n0 + uq - 3, end0 = vblock_end(vr, 0);   /* the most rows any quad shares; the first block's end */
        for (int b0 = 0, b1; b0 < last; b0 = b1) {
            b1 = vblock_end(vr, b0);
            for (int i0 = b0; i0 < b1 && i0 < last; i0 += WSUM_ROWS) {
                int ie = i0 + WSUM_ROWS < b1 ? i0 + WSUM_ROWS : b1;
                for (int u4 = u0; u4 < uq; u4 += 4) {
                    int S = n0 + u4 + 1, i1 = ie < S ? ie : S;
                    if (cross[(u4 - u0) / 4] || i1 <= i0) continue;
                    float *a = acc + (size_t)(u4 - u0) * ld_a;
                    for (int d0 = 0; d0 < hd; d0 += WSUM_COLS)
                        for (int hh = 0; hh < G; hh++)
                            wsum_quad_rows(a + (size_t)hh * hd, ld_a, P + u4 * ld_u + (g * G + hh) * ld_h, ld_u, vp,
                                           i0, i1, d0, i0 == b0);
                    if (i1 == b1)   /* the block ends before the quad's last shared row (b1 = S would cross) */
                        quad_fold(out + (size_t)u4 * q_dim + (size_t)g * G * hd, q_dim, a, ld_a, G, hd, b0 == 0);
                }
            }
        }
        for (int u4 = u0; u4 < uq; u4 += 4) {   /* the last block: the tail rows, then into the outputs */
            if (cross[(u4 - u0) / 4]) continue;
            int S = n0 + u4 + 1;
            float *a = acc + (size_t)(u4 - u0) * ld_a;
            for (int d0 = 0; d0 < hd; d0 += WSUM_COLS)
                for (int hh = 0; hh < G; hh++)
                    wsum_quad_tail(a + (size_t)hh * hd, ld_a, P + u4 * ld_u + (g * G + hh) * ld_h, ld_u, vp, S, d0);
            quad_fold(out + (size_t)u4 * q_dim + (size_t)g * G * hd, q_dim, a, ld_a, G, hd, S - 1 < end0);
        }
        u = uq;
    }
#endif
    for (int x = u0; x < u1; x++) {
        if (x < uq && !cross[(x - u0) / 4]) continue;   /* done above */
        float *oa[G];
        const float *pa[G];
        for (int hh = 0; hh < G; hh++) {
            oa[hh] = out + (size_t)x * q_dim + (size_t)(g * G + hh) * hd;
            pa[hh] = P + x * ld_u + (g * G + hh) * ld_h;
        }
        for (int d0 = 0; d0 < hd; d0 += WSUM_COLS)
            wsum_blocked(oa, pa, vb, vt, vr, n0 + x + 1, d0, hd - d0 < WSUM_COLS ? hd - d0 : WSUM_COLS, G, hd,
                         kv_group(hd));
    }
    (void)u;
}

/* Inside a parallel region, split over its threads: the chunk's queries q (n, n_heads, head_dim) rotated into Q
 * as kv_attend_cpu rotates them, at the token's position (pos=orig, c->chunk_cs) or at its newest rank n0 + u of its
 * lane (pos=cache). */
static void chunk_queries(const KVCache *c, float *Q, const float *q, int n, const int *n0) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, nh = s->n_heads, G = nh / s->n_kv_heads;
    #pragma omp for schedule(static)
    for (int uh = 0; uh < n * nh; uh++) {
        int u = uh / nh, h = uh % nh;
        float *qh = Q + (size_t)uh * hd;
        memcpy(qh, q + (size_t)uh * hd, (size_t)hd * sizeof(float));
        if (c->spec.pos == POS_CACHE) kv_rope_apply(qh, s, c->rope_cs + (size_t)(n0[h / G] + u) * hd);
        else kv_rope_apply(qh, s, c->chunk_cs + (size_t)u * hd);
    }
}

/* The scores of lane g's keys kp at list ranks [j0, j1) against the chunk's queries that see them: token u sees
 * ranks up to n0 + u, so the block's first such token, then every (token, head) of the group after it (scores past
 * a token's last rank are computed and never read), into P + (u·n_heads + h)·ld + j. */
static void chunk_block_scores(float *P, size_t ld, const float *Q, const float *const *kp, int g, int j0, int j1,
                               int n0, int n, int nh, int G, int hd, float scale) {
    int f0 = (j0 > n0 ? j0 - n0 : 0) * G, nf = n * G;
    const float *qf[nf - f0];
    float *of[nf - f0];
    for (int f = f0; f < nf; f++) {
        size_t row = (size_t)(f / G) * nh + g * G + f % G;
        qf[f - f0] = Q + row * hd;
        of[f - f0] = P + row * ld + j0;
    }
#ifdef __AVX512F__
    if (hd % SCORE_LANES == 0 && hd <= 8 * SCORE_LANES && nf - f0 >= SCORES_T_MIN_ROWS) {
        block_scores_t(of, qf, nf - f0, kp, j1 - j0, hd, scale);
        return;
    }
#endif
    block_scores(of, qf, nf - f0, (const void *const *)kp, j1 - j0, hd, scale, KV_F32, 0);
}

/* Steps 1-2 and 4 of attend_static's n tokens, token by token: the stores land in free slots (nothing is evicted:
 * chunk_room), and the policy and the hook see each token's probabilities in c->scores, pointed at the token's rows of
 * P while they look. It reads and writes nothing the output phase uses, so the two run at the same time. */
static int chunk_steps_124(KVCache *c, const float *P, int l, int pos0, int n, const int *n0, const float *k,
                           const float *v, KVAttnHook hook, void *hook_ctx) {
    int n_kv = c->shape.n_kv_heads, nh = c->shape.n_heads, B = c->budget, kv_dim = n_kv * c->shape.head_dim;
    KVLane *lanes = &c->lanes[l * n_kv];
    float *scores = c->scores;
    for (int u = 0; u < n; u++) {
        if (kv_append(c, l, pos0 + u, k + (size_t)u * kv_dim, v + (size_t)u * kv_dim)) return -1;
        for (int g = 0; g < n_kv; g++)
            if (lanes[g].n_live != n0[g] + u + 1) {   /* chunk_room promised no eviction: a kv.c bug, not input */
                fprintf(stderr, "kv: layer %d kv head %d holds %d tokens at position %d, %d expected\n", l, g,
                        lanes[g].n_live, pos0 + u, n0[g] + u + 1);
                abort();
            }
        c->scores = (float *)P + (size_t)u * nh * B;
        kv_attend_policy(c, l, pos0 + u);
        if (hook) hook(hook_ctx, l, c, pos0 + u);
        c->scores = scores;
    }
    return 0;
}

/* As after kv_attend_cpu, scores (n_heads, budget: the cache's c->scores) gets the last of a chunk's n tokens'
 * probabilities from P (tokens, n_heads, budget), each head's over its lane's live ranks. */
static void chunk_last_scores(const KVCache *c, float *scores, const float *P, int l, int n) {
    int nh = c->shape.n_heads, G = nh / c->shape.n_kv_heads, B = c->budget;
    const KVLane *lanes = &c->lanes[l * c->shape.n_kv_heads];
    for (int h = 0; h < nh; h++)
        memcpy(scores + (size_t)h * B, P + ((size_t)(n - 1) * nh + h) * B, (size_t)lanes[h / G].n_live * sizeof(float));
}

/* The start of attend_static's and attend_select's chunk of n tokens of layer l from pos0: n0[g] the live tokens of
 * lane g before it, and under pos=orig the rotations of its positions (c->chunk_cs, shared by the layers). Returns
 * the longest lane the chunk makes, max_g n0[g] + n. */
static int chunk_start(KVCache *c, int l, int pos0, int n, int *n0) {
    const KVShape *s = &c->shape;
    int max_n = 0;
    for (int g = 0; g < s->n_kv_heads; g++) {
        n0[g] = c->lanes[l * s->n_kv_heads + g].n_live;
        max_n = n0[g] + n > max_n ? n0[g] + n : max_n;
    }
    if (c->spec.pos == POS_ORIG && (c->chunk_cs_pos0 != pos0 || c->chunk_cs_n < n)) {
        for (int u = 0; u < n; u++) kv_rope_cs(c->chunk_cs + (size_t)u * s->head_dim, s, pos0 + u);
        c->chunk_cs_pos0 = pos0;
        c->chunk_cs_n = n;
    }
    return max_n;
}

/* Steps 1-4 for n tokens of layer l at positions pos0.. (chunk_room(c, l) ≥ n, chunk buffers reserved). Phases, each
 * split over the threads in pieces whose arithmetic does not depend on the split:
 *   queries  per (token, query head): rotated as kv_attend_cpu rotates them;
 *   scores   per (lane, block of 64 ranks): the block's keys (live and new) and values made ready as attention sees
 *            them, then the keys against every query of the group that sees them;
 *   softmax  per (token, query head), over the token's live list;
 *   then, at the same time: steps 1-2 and 4 token by token on one thread (chunk_steps_124), and the outputs per
 *   (lane, WSUM_TOKENS tokens), in pieces of WSUM_ROWS value rows that stay in L1 for the item's tokens and heads. */
static int attend_static(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k,
                         const float *v, KVAttnHook hook, void *hook_ctx) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, n_kv = s->n_kv_heads, nh = s->n_heads, G = nh / n_kv, B = c->budget;
    int kv_dim = n_kv * hd;
    float scale = 1.0f / sqrtf((float)hd);
    KVLane *lanes = &c->lanes[l * n_kv];
    int n0[n_kv], max_n = chunk_start(c, l, pos0, n, n0);   /* live tokens per lane before the chunk */
    int blocks = (max_n + KV_KEY_BLOCK - 1) / KV_KEY_BLOCK;
    float *P = chunk_scratch.p, *Q = chunk_scratch.q;
    size_t work = (size_t)max_n * hd * nh * n;
    int rc = 0;
    float *scores = c->scores;
    #pragma omp parallel if (work >= KV_PARALLEL_MIN_WORK)
    {
        chunk_queries(c, Q, q, n, n0);
        #pragma omp for schedule(static)
        for (int item = 0; item < n_kv * blocks; item++) {
            int g = item / blocks, j0 = item % blocks * KV_KEY_BLOCK, j1 = j0 + KV_KEY_BLOCK;
            if (j1 > n0[g] + n) j1 = n0[g] + n;
            if (j1 <= j0) continue;
            /* the block's keys and values as attention sees them: the lane's live ones, then the chunk's new ones */
            const float *kp[KV_KEY_BLOCK];
            for (int j = j0; j < j1; j++) {
                size_t row = (size_t)g * B + j;
                float *kx = c->kbuf + row * hd, *vx = c->vbuf + row * hd;
                if (j < n0[g]) {
                    kp[j - j0] = kv_lane_key(c, &lanes[g], j, kx);
                    c->vptr[row] = kv_lane_value(c, &lanes[g], j, vx);
                } else {
                    int u = j - n0[g];
                    kp[j - j0] = chunk_key(c, &lanes[g], kx, k + (size_t)u * kv_dim + (size_t)g * hd, j,
                                           c->chunk_cs + (size_t)u * hd);
                    c->vptr[row] = chunk_value(c, &lanes[g], vx, v + (size_t)u * kv_dim + (size_t)g * hd);
                }
                c->vrow[row] = (const uint8_t *)(const void *)c->vptr[row];   /* decoded: f32 rows for the tail */
                c->vrow_type[row] = KV_F32;
            }
            chunk_block_scores(P, B, Q, kp, g, j0, j1, n0[g], n, nh, G, hd, scale);
        }
        #pragma omp for schedule(static)
        for (int uh = 0; uh < n * nh; uh++)
            softmax_inplace(P + (size_t)uh * B, n0[uh % nh / G] + uh / nh + 1);
        /* steps 1-2 and 4 on one thread while the others start on the outputs (dynamic: it joins them after) */
        #pragma omp single nowait
        rc = chunk_steps_124(c, P, l, pos0, n, n0, k, v, hook, hook_ctx);
        /* the outputs per (lane, WSUM_TOKENS tokens): with AVX and head_dim a multiple of 16, four tokens at a time in
           pieces of WSUM_ROWS value rows, each piece read from L2 or L3 once for all the item's tokens and heads; the
           tokens left over (fewer than four) one at a time */
        int n_items = (n + WSUM_TOKENS - 1) / WSUM_TOKENS;
        #pragma omp for schedule(dynamic)
        for (int item = 0; item < n_kv * n_items; item++) {
            int g = item / n_items, u0 = item % n_items * WSUM_TOKENS, u1 = u0 + WSUM_TOKENS < n ? u0 + WSUM_TOKENS : n;
            VRows vr = {&lanes[g], NULL, n0[g], pos0, n0[g] + n};
            wsum_tokens(out, P, (size_t)nh * B, B, c->vptr + (size_t)g * B, c->vrow + (size_t)g * B,
                        c->vrow_type + (size_t)g * B, &vr, g, n0[g], u0, u1, nh, G, hd);
        }
    }
    if (!rc) chunk_last_scores(c, scores, P, l, n);
    if (!rc) c->chunk_steps += n;
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * A chunk over a union of rows (attend_union), for two kinds of lanes whose live lists change while the chunk
 * passes, so that attend_static's one list per lane does not hold:
 *
 * Evicting lanes (sink, window, h2o, tova, ... at steady state). Token by token, token u's live list is the lane's
 * list after its own store: the list before it minus the slots its step 1 freed, plus its own slot at the end.
 * Eviction takes slots out of the list without reordering it and a store appends, so every token's live list is an
 * ordered subsequence of one list, the union U: the lane's live tokens when the chunk begins, then the chunk's n
 * tokens.
 *
 * Banded lanes (residual=, prec=, kprec=, vprec=) that evict nothing while the chunk passes. A store recodes the
 * oldest token of every full band into the next band's form (kv.c, band_make_room), so a token's key and value
 * change while the chunk passes: token u sees rank j in the band of its age then. A lane filled newest first and
 * never evicted from (packed: band 0 holds the newest band_slots[0] tokens, band 1 the next band_slots[1], ...)
 * stays packed, so that band is a function of the age alone (packed_band). With a chunk no longer than any band but
 * the oldest, a token of the lane crosses at most one band boundary while the chunk passes and a new token stays in
 * band 0. U holds each live rank in its band now, then, right after it, in the band it will have reached by the
 * chunk's last token (computed as band_make_room recodes it: decoded from its band's form, encoded into the next),
 * when that differs; then the chunk's n tokens in band 0. Each token sees one row of each of its ranks.
 *
 * Step 3 then goes a chunk at a time, exactly:
 *   scores   every query of the chunk against every key of U (as attend_static: the lane's keys read once per chunk
 *            before any store, the new ones as kv_append will store them, chunk_key), into rows of U;
 *   steps    token by token on one thread, in order: kv_append (step 1 chooses victims from the policy's state after
 *            the previous token's step 4, as at -chunk 1; the store recodes), then for each head the scores of the
 *            token's live ranks gathered from U's rows, found by the rank's position and band, into c->scores,
 *            softmax_inplace over them (the same n_live values in the same rank order as kv_attend_cpu, so the same
 *            bits), step 4 and the hook; the probabilities are put back at their rows of U, every other row up to
 *            the token's own (evicted before this token, stored after it, or the rank in a band it is not in now) 0;
 *   outputs  attend_static's output phase over U's rows. An output is 0 + p_0 v_0 + p_1 v_1 + ... over U in order;
 *            a row the token does not see adds 0·v = ±0, which leaves a sum started from +0 unchanged bit for bit
 *            (a sum that is ±0 here is +0: x + (-x) rounds to +0), so each output is kv_attend_cpu's sum over the
 *            token's live ranks. The values are copied (decoded) before the steps, since a store may reuse the
 *            slot of a value an earlier token of the chunk still reads.
 * A rank the gather does not find in U (the band of a rank other than predicted) is a kv.c bug: it aborts. Only under
 * pos=orig (under pos=cache a key's rotation is its rank, which changes as slots are freed) and where attend_static's
 * other conditions hold. An evicting lane with bands goes a chunk at a time only where its policy promises victims
 * from the oldest band alone (KVPolicyOps.protects: recent= of h2o and scissorhands, window, sink), so that it
 * stays packed and U is built as for a banded lane (a rank that recodes while the chunk passes, twice), the steps'
 * gather finding each live rank by its position and its band then; other evicting lanes with bands go token by
 * token (which band an eviction frees, and so which tokens recode, would depend on the policy's choice).
 * Per-channel keys (kgroup=channel) in any band: a chunk ends before any group would seal or take a key into a
 * sealed group's hole (chan_room), so a key keeps its form while the chunk passes but where it crosses into a
 * per-channel band, whose open group takes it decoded, in f32 (union_recode).
 * tests/test_eval.sh checks every registered policy and banded and per-channel specs, evicting ones among them, at
 * -chunk 5, 7 and 64 against -chunk 1, bit for bit. */

/* The band that holds the token of age r (0: the newest) in a packed lane: the bands fill newest first. */
static int packed_band(const KVCache *c, const KVLane *ln, int r) {
    int b = 0;
    for (int end = 0; b < c->n_bands - 1; b++) {
        end += ln->band_slots[b];
        if (r < end) break;
    }
    return b;
}

/* Whether every band of the lane holds the tokens packed_band gives it: band b's live slots are the newest tokens
 * left after the newer bands took theirs. */
static int lane_packed(const KVCache *c, const KVLane *ln) {
    int left = ln->n_live;
    for (int b = 0; b < c->n_bands; b++) {
        int live = ln->band_slots[b] - ln->n_free[b], want = left < ln->band_slots[b] ? left : ln->band_slots[b];
        if (live != want) return 0;
        left -= want;
    }
    return 1;
}

/* Whether attend_union may not run from position t whatever the lanes hold: chunk_room's conditions but the bands,
 * and pos=orig, no alloc=ada (its lanes shrink together, layer-wide), no merge on eviction (chunk_evicts and
 * chunk_banded both ask). */
static int union_refused(const KVCache *c, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    return c->device || ops->prune || ops->merge || ops->select || kv_query_selects(c, t)
           || c->backend == KV_BACKEND_REF || c->tiers || c->krank || c->vrank || c->ada || c->merge_evict
           || c->spec.pos != POS_ORIG;
}

/* Tokens a chunk of layer l's banded lanes may hold so that each crosses one band boundary at most: the fewest
 * slots of any band but the oldest, over the lanes (INT_MAX when no lane has such a band); *newer: the most slots a
 * lane holds in those bands. 0 when a lane is not packed. */
static int packed_room(const KVCache *c, int l, int *newer) {
    int H = c->shape.n_kv_heads, room = INT_MAX;
    *newer = 0;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        if (!lane_packed(c, ln)) return 0;
        int oldest = c->n_bands - 1, sum = 0;
        while (oldest > 0 && ln->band_slots[oldest] == 0) oldest--;
        for (int b = 0; b < oldest; b++) {
            sum += ln->band_slots[b];
            room = ln->band_slots[b] < room ? ln->band_slots[b] : room;
        }
        *newer = sum > *newer ? sum : *newer;
    }
    return room;
}

/* How many of the next tokens of layer l, from position t, attend_union may run as one chunk of evicting lanes:
 * not union_refused, a policy that evicts; INT_MAX with one band. With bands, only where the policy's victims
 * always come from the oldest band (protects: R - 1 at least the slots of every newer band) and every lane is
 * packed now, so that each token's band stays a rule of its age while the chunk passes; then packed_room (one
 * boundary at most per token: chunk_banded's rule). 0 when none can. */
static int chunk_evicts(const KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    if (union_refused(c, t) || !ops->evict) return 0;
    int chan = chan_room(c, l, 1);
    if (c->n_bands < 2) return chan;
    if (!ops->protects || c->pool) return 0;
    int newer, room = packed_room(c, l, &newer);
    room = chan < room ? chan : room;
    return ops->protects(&c->policy) - 1 >= newer ? room : 0;
}

/* How many of the next tokens of layer l, from position t, may attend as one chunk of a banded lane (attend_union,
 * above): not union_refused, no memory pool (a pool lane's band 0 grows by pages), every lane packed; no more than
 * any lane's free slots (nothing is evicted) and packed_room (one boundary at most per token). 0 when none can. */
static int chunk_banded(const KVCache *c, int l, int t) {
    if (c->n_bands < 2 || union_refused(c, t) || c->pool) return 0;
    int H = c->shape.n_kv_heads, newer, room = packed_room(c, l, &newer), chan = chan_room(c, l, 0);
    room = c->budget < room ? c->budget : room;
    room = chan < room ? chan : room;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        room = ln->cap - ln->n_live < room ? ln->cap - ln->n_live : room;
    }
    return room;
}

/* One wait of a spinning thread: the x86 pause instruction (it lends the core to its sibling), and every 1,024th
 * time the processor to the OS, so that more threads than cores do not starve the one being waited for. */
static inline void spin_pause(unsigned *spins) {
    if (++*spins % 1024 == 0) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
}

/* attend_union's scratch, shared as chunk_scratch is: probabilities (tokens, n_heads, W) at U's rows (W: the longest
 * U), U's values decoded (n_kv_heads, W, head_dim) with their row pointers, and for each row of U (n_kv_heads, W) its
 * token position, its band, its source (a live rank of the lane, or n0 + u for the chunk's token u) and, in a banded
 * lane, the first and last token that sees it (vis0, vis1) and the ranks seen in two bands (dup, up to W a lane). */
static struct {
    float *p, *v;
    char *rows;   /* the block the per-row arrays below are carved from, rows_cap rows of each */
    const float **vp;
    const uint8_t **vb;
    int *upos, *usrc, *vis0, *vis1, *dup;
    uint8_t *vt, *uband;
    size_t p_cap, v_cap, rows_cap;
} union_scratch;

static int union_reserve(KVCache *c, int n, int W) {
    const KVShape *s = &c->shape;
    size_t np = (size_t)n * s->n_heads * W, nv = (size_t)s->n_kv_heads * W * s->head_dim;
    size_t nr = (size_t)s->n_kv_heads * W;
    if (grow_floats(&union_scratch.p, &union_scratch.p_cap, np)
        || grow_floats(&union_scratch.v, &union_scratch.v_cap, nv))
        return -1;
    if (nr > union_scratch.rows_cap) {   /* pointers first, then ints, then bytes: each array aligned */
        char *m = malloc(nr * (2 * sizeof(void *) + 5 * sizeof(int) + 2));
        if (!m) return -1;
        free(union_scratch.rows);
        union_scratch.rows = m;
        union_scratch.vp = (const float **)(void *)m;
        union_scratch.vb = (const uint8_t **)(void *)(m += nr * sizeof(void *));
        int *ints = (int *)(void *)(m + nr * sizeof(void *));
        union_scratch.upos = ints;
        union_scratch.usrc = ints + nr;
        union_scratch.vis0 = ints + 2 * nr;
        union_scratch.vis1 = ints + 3 * nr;
        union_scratch.dup = ints + 4 * nr;
        union_scratch.vt = (uint8_t *)(ints + 5 * nr);
        union_scratch.uband = union_scratch.vt + nr;
        union_scratch.rows_cap = nr;
    }
    return chunk_reserve(c, n);
}

/* x (head_dim, the vector as band `from` of the lane holds it, at p: x itself or a row of the cache) as band `to`
 * will hold it: recoded band by band as band_make_room moves it (the bands with slots between; a form the two bands
 * share moves as bytes, so nothing changes). Returns p, or x when it had to be recoded. */
static const float *union_recode(const KVCache *c, const KVLane *ln, float *x, const float *p, int from, int to,
                                 int is_v) {
    const KVType *ty = is_v ? c->band_vtype : c->band_ktype;
    for (int b = from + 1, at = from; b <= to; b++) {
        if (ln->band_slots[b] == 0) continue;
        /* a key entering a per-channel band is decoded into its open group (none seals while the chunk passes) */
        if (ty[b] != ty[at] && !(!is_v && c->band_kchan[b])) {
            if (p != x) memcpy(x, p, (size_t)c->shape.head_dim * sizeof(float));
            p = x;
            chunk_roundtrip(x, ty[b], c->shape.head_dim);
        }
        at = b;
    }
    return p;
}

/* Steps 1-4 for n tokens of layer l at positions pos0.. (chunk_evicts(c), or chunk_banded(c, l) ≥ n with banded;
 * union_reserve(c, n, W) done with W ≥ the longest U), as the comment above says. 0, or -1 when a store fails (as
 * kv_append). */
static int attend_union(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k,
                        const float *v, KVAttnHook hook, void *hook_ctx, int W, int banded) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, n_kv = s->n_kv_heads, nh = s->n_heads, G = nh / n_kv, B = c->budget;
    int kv_dim = n_kv * hd;
    float scale = 1.0f / sqrtf((float)hd);
    KVLane *lanes = &c->lanes[l * n_kv];
    int *upos = union_scratch.upos, *usrc = union_scratch.usrc;
    uint8_t *uband = union_scratch.uband;
    /* U of each lane: its live ranks (a banded lane's recoding ones twice), then the chunk's n tokens; n0[g] rows
       before the chunk's tokens, n0[g] + n in all. In a banded lane each row's tokens [vis0, vis1]: the rank's age at
       token u is live0 + u - j, its band then packed_band's; dup lists the ranks seen in two bands, n_dup[g] of them */
    int n0[n_kv], live0[n_kv], n_dup[n_kv], max_n = 0;
    for (int g = 0; g < n_kv; g++) {
        const KVLane *ln = &lanes[g];
        int *src = usrc + (size_t)g * W, *vis0 = union_scratch.vis0 + (size_t)g * W;
        int *vis1 = union_scratch.vis1 + (size_t)g * W, *dup = union_scratch.dup + (size_t)g * W, rows = 0;
        uint8_t *band = uband + (size_t)g * W;
        live0[g] = ln->n_live;
        n_dup[g] = 0;
        for (int j = 0; j < ln->n_live; j++) {
            int now = kv_slot_band(ln, ln->live[j]);
            src[rows] = j;
            band[rows] = (uint8_t)now;
            vis0[rows] = 0;
            vis1[rows++] = n - 1;
            int then = packed_band(c, ln, ln->n_live + n - 1 - j);   /* one band: 0, as now */
            if (then != now) {   /* it recodes at token sw */
                int sw = 0;
                while (packed_band(c, ln, ln->n_live + sw - j) == now) sw++;
                vis1[rows - 1] = sw - 1;
                src[rows] = j;
                band[rows] = (uint8_t)then;
                vis0[rows] = sw;
                vis1[rows++] = n - 1;
                dup[n_dup[g]++] = rows - 2;
            }
        }
        n0[g] = rows;
        for (int u = 0; u < n; u++) {
            src[rows] = ln->n_live + u;
            band[rows] = 0;
            vis0[rows] = u;
            vis1[rows++] = n - 1;
        }
        if (rows > W) {   /* the caller's bound: a kv.c bug, not input */
            fprintf(stderr, "kv: layer %d kv head %d needs %d rows in a chunk, %d reserved\n", l, g, rows, W);
            abort();
        }
        max_n = rows > max_n ? rows : max_n;
    }
    if (c->chunk_cs_pos0 != pos0 || c->chunk_cs_n < n) {   /* the positions' rotations, shared by the layers */
        for (int u = 0; u < n; u++) kv_rope_cs(c->chunk_cs + (size_t)u * hd, s, pos0 + u);
        c->chunk_cs_pos0 = pos0;
        c->chunk_cs_n = n;
    }
    int blocks = (max_n + KV_KEY_BLOCK - 1) / KV_KEY_BLOCK;
    float *P = union_scratch.p, *Q = chunk_scratch.q, *Pr = chunk_scratch.p, *scores = c->scores;
    const float **vp = union_scratch.vp;
    size_t work = (size_t)max_n * hd * nh * n;
    int rc = 0, done = 0;   /* done: tokens whose steps have run */
    #pragma omp parallel if (work >= KV_PARALLEL_MIN_WORK)
    {
        chunk_queries(c, Q, q, n, live0);   /* pos=orig here */
        #pragma omp for schedule(static)
        for (int item = 0; item < n_kv * blocks; item++) {
            int g = item / blocks, j0 = item % blocks * KV_KEY_BLOCK, j1 = j0 + KV_KEY_BLOCK;
            if (j1 > n0[g] + n) j1 = n0[g] + n;
            if (j1 <= j0) continue;
            /* U's keys and values in this block: the lane's live ones (read before any store of the chunk, recoded
               into the band the row stands for), then the chunk's new ones as they will be stored; every value
               decoded into the scratch */
            const KVLane *ln = &lanes[g];
            float kmem[KV_KEY_BLOCK * hd + 16];
            const float *kp[KV_KEY_BLOCK];
            for (int j = j0; j < j1; j++) {
                size_t row = (size_t)g * W + j;
                float *kx = align64(kmem) + (size_t)(j - j0) * hd, *vx = union_scratch.v + row * hd;
                const float *vv;
                int r = usrc[row];
                if (r < live0[g]) {
                    int now = kv_slot_band(ln, ln->live[r]);
                    kp[j - j0] = union_recode(c, ln, kx, kv_lane_key(c, ln, r, kx), now, uband[row], 0);
                    vv = union_recode(c, ln, vx, kv_lane_value(c, ln, r, vx), now, uband[row], 1);
                    upos[row] = ln->pos[ln->live[r]];
                } else {
                    int u = r - live0[g];
                    kp[j - j0] = chunk_key(c, ln, kx, k + (size_t)u * kv_dim + (size_t)g * hd, j,
                                           c->chunk_cs + (size_t)u * hd);
                    vv = chunk_value(c, ln, vx, v + (size_t)u * kv_dim + (size_t)g * hd);
                    upos[row] = pos0 + u;
                }
                if (vv != vx) memcpy(vx, vv, (size_t)hd * sizeof(float));
                vp[row] = vx;
                union_scratch.vb[row] = (const uint8_t *)(const void *)vx;
                union_scratch.vt[row] = KV_F32;
            }
            chunk_block_scores(P, W, Q, kp, g, j0, j1, n0[g], n, nh, G, hd, scale);
        }
        /* a banded lane's probabilities, every (token, head) at once: token u's rows of U gathered in rank order
           into Pr (tokens, n_heads, budget), softmax_inplace over them, put back (0 at the rows it does not see) */
        if (banded) {
            #pragma omp for schedule(static)
            for (int uh = 0; uh < n * nh; uh++) {
                int u = uh / nh, g = uh % nh / G, m = 0;
                const int *vis0 = union_scratch.vis0 + (size_t)g * W, *vis1 = union_scratch.vis1 + (size_t)g * W;
                float *row = P + (size_t)uh * W, *pr = Pr + (size_t)uh * B;
                for (int r = 0; r <= n0[g] + u; r++)
                    if (vis0[r] <= u && u <= vis1[r]) pr[m++] = row[r];
                softmax_inplace(pr, m);
                m = 0;
                for (int r = 0; r <= n0[g] + u; r++) row[r] = vis0[r] <= u && u <= vis1[r] ? pr[m++] : 0.0f;
            }
        }
        /* the steps on one thread; the others start on the outputs of the tokens done so far and it joins them
           after (token u's outputs read only its own row of P, final once `done` passes u) */
        #pragma omp single nowait
        {
        for (int u = 0; u < n; u++) {
            if (kv_append(c, l, pos0 + u, k + (size_t)u * kv_dim, v + (size_t)u * kv_dim)) { __atomic_store_n(&rc, -1, __ATOMIC_RELAXED); break; }
            if (banded) {
                /* the lane as predicted: nothing evicted, each rank that recodes in the band its row says (the
                   others keep theirs: the lane stays packed); else a kv.c bug, not input */
                for (int g = 0; g < n_kv; g++) {
                    const KVLane *ln = &lanes[g];
                    const int *dup = union_scratch.dup + (size_t)g * W, *vis0 = union_scratch.vis0 + (size_t)g * W;
                    int bad = -1;
                    for (int x = 0; x < n_dup[g] && bad < 0; x++) {
                        int r = dup[x] + (u >= vis0[dup[x] + 1]);   /* the row token u sees */
                        if (kv_slot_band(ln, ln->live[usrc[(size_t)g * W + r]]) != uband[(size_t)g * W + r]) bad = r;
                    }
                    if (ln->n_live != live0[g] + u + 1 || bad >= 0) {
                        fprintf(stderr, "kv: layer %d kv head %d at position %d holds %d tokens (%d predicted)%s\n", l,
                                g, pos0 + u, ln->n_live, live0[g] + u + 1, bad >= 0 ? ", a rank in another band" : "");
                        abort();
                    }
                }
                c->scores = Pr + (size_t)u * nh * B;
                kv_attend_policy(c, l, pos0 + u);
                if (hook) hook(hook_ctx, l, c, pos0 + u);
                c->scores = scores;
                __atomic_store_n(&done, u + 1, __ATOMIC_RELEASE);
                continue;
            }
            /* rank i's row of U, found by its token position and band: U is in increasing position order, a rank's
               rows adjacent (slot ids are not used: a pool lane may move its slots to give back a page) */
            for (int g = 0; g < n_kv; g++) {
                const KVLane *ln = &lanes[g];
                const int *up = upos + (size_t)g * W;
                const uint8_t *ub = uband + (size_t)g * W;
                int *at = c->run_buf;   /* (n_live) */
                for (int i = 0, j = 0; i < ln->n_live; i++, j++) {
                    int pos = ln->pos[ln->live[i]], band = c->n_bands > 1 ? kv_slot_band(ln, ln->live[i]) : 0;
                    while (j <= n0[g] + u && (up[j] != pos || ub[j] != band)) j++;
                    if (j > n0[g] + u) {   /* a live token the chunk never saw: a kv.c bug, not input */
                        fprintf(stderr, "kv: layer %d kv head %d holds position %d in band %d, not in the chunk's "
                                "list\n", l, g, pos, band);
                        abort();
                    }
                    at[i] = j;
                }
                for (int h = g * G; h < (g + 1) * G; h++) {
                    float *row = P + ((size_t)u * nh + h) * W, *p = c->scores + (size_t)h * B;
                    for (int i = 0; i < ln->n_live; i++) p[i] = row[at[i]];
                    softmax_inplace(p, ln->n_live);
                    memset(row, 0, (size_t)(n0[g] + u + 1) * sizeof(float));
                    for (int i = 0; i < ln->n_live; i++) row[at[i]] = p[i];
                }
            }
            kv_attend_policy(c, l, pos0 + u);
            if (hook) hook(hook_ctx, l, c, pos0 + u);
            __atomic_store_n(&done, u + 1, __ATOMIC_RELEASE);
        }
        __atomic_store_n(&done, n, __ATOMIC_RELEASE);   /* also after a failed store: no one waits for ever */
        }
        /* the outputs, as attend_static's output phase, over U's rows, in token order (each item waits for its
           tokens' steps) */
        int n_items = (n + WSUM_TOKENS - 1) / WSUM_TOKENS;
        #pragma omp for schedule(dynamic)
        for (int item = 0; item < n_kv * n_items; item++) {
            int g = item % n_kv, u0 = item / n_kv * WSUM_TOKENS, u1 = u0 + WSUM_TOKENS < n ? u0 + WSUM_TOKENS : n;
            unsigned spins = 0;   /* a banded lane's probabilities are final already */
            while (!banded && __atomic_load_n(&done, __ATOMIC_ACQUIRE) < u1) spin_pause(&spins);
            if (__atomic_load_n(&rc, __ATOMIC_RELAXED)) continue;
            VRows vr = {NULL, upos + (size_t)g * W, 0, 0, n0[g] + n};
            wsum_tokens(out, P, (size_t)nh * W, W, vp + (size_t)g * W, union_scratch.vb + (size_t)g * W,
                        union_scratch.vt + (size_t)g * W, &vr, g, n0[g], u0, u1, nh, G, hd);
        }
    }
    if (banded && !rc) chunk_last_scores(c, scores, Pr, l, n);   /* the evicting steps left them in c->scores */
    if (!rc) c->chunk_steps += n;
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * A chunk of a selection policy that scores every key (select_scores: topk). Token by token each query scores every
 * live key of its lane (kv.c, lane_scores), the policy chooses from those scores, and attention reads the chosen ranks
 * (kv_attend_select). The policy keeps every token and nothing else changes a stored key while the chunk passes
 * (chunk_selects), so token u's live list is the lane's list now, then the chunk's tokens up to its own, as in
 * attend_static. The scores of every (token, query head) against every key it sees are computed in one pass over the
 * keys, with lane_scores' arithmetic: the rotated query as kv_attend_select rotates it (kv_rope: the numbers of
 * chunk_queries' tables), each dot an in-order f32 sum over d from 0, a multiply then an add, then times 1/√head_dim.
 * Then, token by token on one thread, kv_append and kv_attend_select, which reads the token's scores (c->sel_pre)
 * instead of scoring, and chooses, accounts and attends as at -chunk 1: the same bits.
 * ------------------------------------------------------------------------------------------------------------- */

/* How many of the next tokens of layer l, from position t, attend_select may run as one chunk: a select_scores
 * policy whose every query selects from t on (kv_query_selects stays true once it is), one band, keys per token, full
 * rank, one memory tier, the CPU's fast backend, nothing pruned, merged or evicted: every lane's free slots. 0 when
 * none. */
static int chunk_selects(const KVCache *c, int l, int t) {
    const KVPolicyOps *ops = c->policy.ops;
    if (!ops->select_scores || ops->select_keys || !kv_query_selects(c, t) || c->device || c->n_bands > 1 || c->kgroup
        || c->krank || c->vrank || c->tiers || c->backend == KV_BACKEND_REF || ops->prune || ops->merge || c->ada
        || c->merge_evict)
        return 0;
    int H = c->shape.n_kv_heads, room = c->budget;
    for (int g = 0; g < H; g++) {
        const KVLane *ln = &c->lanes[l * H + g];
        room = ln->cap - ln->n_live < room ? ln->cap - ln->n_live : room;
    }
    return room;
}

/* The scores of keys kp (ranks [j0, j1) of lane g, f32 as attention sees them) against every (token, head) of the
 * chunk that sees the block (token u sees ranks up to n0 + u; later ones are scored too and never read), into P +
 * (u·n_heads + h)·ld + j: lane_scores' sums, the block laid out dimension-major so the compiler keeps the keys'
 * independent sums side by side in vector registers. */
static void select_block_scores(float *P, size_t ld, const float *Q, const float *const *kp, int g, int j0, int j1,
                                int n0, int n, int nh, int G, int hd, float scale) {
    int nk = j1 - j0;
    float kt[hd][KV_KEY_BLOCK], acc[KV_KEY_BLOCK];
    for (int d = 0; d < hd; d++)
        for (int b = 0; b < KV_KEY_BLOCK; b++) kt[d][b] = b < nk ? kp[b][d] : 0;
    for (int u = j0 > n0 ? j0 - n0 : 0; u < n; u++)
        for (int hh = 0; hh < G; hh++) {
            size_t row = (size_t)u * nh + g * G + hh;
            const float *qh = Q + row * hd;
            for (int b = 0; b < KV_KEY_BLOCK; b++) acc[b] = 0;
            for (int d = 0; d < hd; d++)
                for (int b = 0; b < KV_KEY_BLOCK; b++) acc[b] += qh[d] * kt[d][b];
            float *o = P + row * ld + j0;
            for (int b = 0; b < nk; b++) o[b] = acc[b] * scale;
        }
}

/* Steps 1-4 for n tokens of layer l at positions pos0.. (chunk_selects(c, l, pos0) ≥ n, chunk buffers reserved), as
 * the comment above says. 0, or -1 when a store fails (as kv_append). */
static int attend_select(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k,
                         const float *v, KVAttnHook hook, void *hook_ctx) {
    const KVShape *s = &c->shape;
    int hd = s->head_dim, n_kv = s->n_kv_heads, nh = s->n_heads, G = nh / n_kv, B = c->budget;
    int kv_dim = n_kv * hd, q_dim = nh * hd;
    float scale = 1.0f / sqrtf((float)hd);
    KVLane *lanes = &c->lanes[l * n_kv];
    int n0[n_kv], max_n = chunk_start(c, l, pos0, n, n0);
    int blocks = (max_n + KV_KEY_BLOCK - 1) / KV_KEY_BLOCK;
    float *P = chunk_scratch.p, *Q = chunk_scratch.q;
    size_t work = (size_t)max_n * hd * nh * n;
    #pragma omp parallel if (work >= KV_PARALLEL_MIN_WORK)
    {
        chunk_queries(c, Q, q, n, n0);
        #pragma omp for schedule(static)
        for (int item = 0; item < n_kv * blocks; item++) {
            int g = item / blocks, j0 = item % blocks * KV_KEY_BLOCK, j1 = j0 + KV_KEY_BLOCK;
            if (j1 > n0[g] + n) j1 = n0[g] + n;
            if (j1 <= j0) continue;
            const float *kp[KV_KEY_BLOCK];
            for (int j = j0; j < j1; j++) {   /* the lane's live keys, then the chunk's as they will be stored */
                float *kx = c->kbuf + ((size_t)g * B + j) * hd;
                kp[j - j0] = j < n0[g] ? kv_lane_key(c, &lanes[g], j, kx)
                                       : chunk_key(c, &lanes[g], kx, k + (size_t)(j - n0[g]) * kv_dim + (size_t)g * hd,
                                                   j, c->chunk_cs + (size_t)(j - n0[g]) * hd);
            }
            select_block_scores(P, B, Q, kp, g, j0, j1, n0[g], n, nh, G, hd, scale);
        }
    }
    for (int u = 0; u < n; u++) {
        if (kv_append(c, l, pos0 + u, k + (size_t)u * kv_dim, v + (size_t)u * kv_dim)) return -1;
        c->sel_pre = P + (size_t)u * nh * B;
        kv_attend_select(c, out + (size_t)u * q_dim, l, pos0 + u, q + (size_t)u * q_dim);
        c->sel_pre = NULL;
        if (hook) hook(hook_ctx, l, c, pos0 + u);
    }
    c->chunk_steps += n;
    return 0;
}

int kv_attend_chunk(KVCache *c, float *out, int l, int pos0, int n, const float *q, const float *k, const float *v,
                    KVAttnHook hook, void *hook_ctx) {
    const KVShape *s = &c->shape;
    int q_dim = s->n_heads * s->head_dim, kv_dim = s->n_kv_heads * s->head_dim;
    size_t per_token = (size_t)s->n_heads * c->budget * sizeof(float);
    int most = per_token * 2 > KV_CHUNK_SCRATCH ? 1 : (int)(KV_CHUNK_SCRATCH / per_token);
    for (int t = 0; t < n;) {
        int nt = n - t, room = chunk_room(c, l, pos0 + t);
        nt = nt < room ? nt : room;
        nt = nt < most ? nt : most;
        if (nt >= 2 && !chunk_reserve(c, nt)) {
            if (attend_static(c, out + (size_t)t * q_dim, l, pos0 + t, nt, q + (size_t)t * q_dim,
                              k + (size_t)t * kv_dim, v + (size_t)t * kv_dim, hook, hook_ctx)) return -1;
            t += nt;
            continue;
        }
        int sel = n - t >= 2 ? chunk_selects(c, l, pos0 + t) : 0;
        if (sel >= 2) {
            int ns = sel < n - t ? sel : n - t;
            ns = ns < most ? ns : most;
            if (ns >= 2 && !chunk_reserve(c, ns)) {
                if (attend_select(c, out + (size_t)t * q_dim, l, pos0 + t, ns, q + (size_t)t * q_dim,
                                  k + (size_t)t * kv_dim, v + (size_t)t * kv_dim, hook, hook_ctx)) return -1;
                t += ns;
                continue;
            }
        }
        int banded = n - t >= 2 ? chunk_banded(c, l, pos0 + t) : 0;
        int evicts = n - t >= 2 && banded < 2 ? chunk_evicts(c, l, pos0 + t) : 0;
        if (banded >= 2 || evicts >= 2) {   /* a union of rows (attend_union) */
            int room = banded >= 2 ? banded : evicts, ne = room < n - t ? room : n - t, longest = 0;
            for (int g = 0; g < s->n_kv_heads; g++) {
                int m = c->lanes[l * s->n_kv_heads + g].n_live;
                longest = m > longest ? m : longest;
            }
            /* a banded lane's U holds a rank twice when it crosses a band boundary: at most ne per boundary */
            int extra = c->n_bands - 1;
            while (ne > 2 && (size_t)ne * s->n_heads * (longest + ne + extra * ne) * sizeof(float) > KV_CHUNK_SCRATCH)
                ne /= 2;
            int W = longest + ne + extra * ne;
            if (!union_reserve(c, ne, W)) {
                if (attend_union(c, out + (size_t)t * q_dim, l, pos0 + t, ne, q + (size_t)t * q_dim,
                                 k + (size_t)t * kv_dim, v + (size_t)t * kv_dim, hook, hook_ctx, W, banded >= 2))
                    return -1;
                t += ne;
                continue;
            }
        }
        if (c->pf_q && c->pf_layer == l) kv_prefetch(c, l, pos0 + t, c->pf_q + (size_t)t * q_dim);
        if (kv_append(c, l, pos0 + t, k + (size_t)t * kv_dim, v + (size_t)t * kv_dim)) return -1;
        if (c->backend == KV_BACKEND_REF) kv_attend_ref(c, out + (size_t)t * q_dim, l, pos0 + t, q + (size_t)t * q_dim);
        else kv_attend_cpu(c, out + (size_t)t * q_dim, l, pos0 + t, q + (size_t)t * q_dim);
        if (hook) hook(hook_ctx, l, c, pos0 + t);
        t++;
    }
    return 0;
}
