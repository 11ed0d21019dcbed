/* matmul.c: the weight matmuls of the forward pass, y = W·x for f32 and q8 (Q8_0-layout) matrices over one token or
 * a chunk: register tiles of weight rows x tokens over row panels that stay in L2, rows split over OpenMP threads.
 * Each output has one fixed arithmetic (written down below), so results never depend on the thread count, the
 * chunk size or whether the build has AVX2. It does nothing else of the forward pass (run.c).
 *
 * Dimensions: rows, cols (of W), n (tokens). Indices: i row, j column, t token.
 */
#include "matmul.h"
#include "quant.h"
#include "util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The matmul kernels. A tile is R weight rows × T tokens (R ≤ 4, T ≤ TILE_MAX, both constants in each instantiation so the
 * accumulators live in registers): every 8-wide block of a weight row is loaded once per tile and used for T tokens,
 * every block of an x vector once per tile and used for R rows. The tile shape, the thread count and the chunk size
 * decide only which outputs are computed together, never how one is computed: each output has one fixed arithmetic,
 * written down below, so a token's logits are bit-identical in decode (n = 1) and in any chunk, on any thread count,
 * with or without AVX2 (the portable C does the same operations in the same order). */
#ifdef __AVX512VL__
#define TILE_MAX 6   /* 32 vector registers: tiles of 4 rows x 6 tokens (24 sums) */
#else
#define TILE_MAX 4
#endif

/* a·b + c: one fused multiply-add where the build has FMA (fmaf becomes the vfmadd instruction, no libm call), else a
 * multiply then an add; a build uses one or the other on all its paths. -std=c11 keeps GCC from contracting a*b+c
 * on its own, so the choice is made here only. */
#ifdef __FMA__
#define madd_f32(a, b, c) fmaf(a, b, c)
#define madd_ps(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define madd_f32(a, b, c) ((a) * (b) + (c))
#define madd_ps(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#endif

/* f32: out = Σ_j w[j]·x[j] as 8 partial sums a_k over j ≡ k (mod 8) in the whole 8-wide blocks (a_k = w·x + a_k by
 * madd_f32, j ascending), then s = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)) (the order of the 256→128→64→32-bit
 * AVX reduction), then the tail j ≥ cols − cols % 8 ascending, s = w[j]·x[j] + s by madd_f32. Eight lanes (one ymm
 * per output) leave room for 16 outputs in the 16 ymm registers; with FMA the sum rounds once per term. */
#ifdef __AVX2__
static inline float hsum8_ps(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));   /* a_k + a_k+4 */
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));                                           /* (a0+a4) + (a2+a6), ... */
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

/* out[t·ld_out + r·ld_r] = W_r · x_t for the tile's R rows (row r at w + r·ldw elements) and T tokens
 * (x: (T, cols)). */
static inline __attribute__((always_inline)) void dot_f32_tile(float *out, size_t ld_out, size_t ld_r,
                                                               const float *w, size_t ldw, const float *x, int R,
                                                               int T, int cols) {
    float a[TILE_MAX][TILE_MAX][8];
    int j = 0;
#ifdef __AVX2__
    __m256 acc[TILE_MAX][TILE_MAX];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (; j + 8 <= cols; j += 8) {
        __m256 wv[TILE_MAX];
        /* the empty asm pins each loaded block in a register: without it GCC reloads it as a memory operand of
         * every multiply-add (R·T + T loads per step instead of R + T), and the loads, not the FMAs, set the pace */
        for (int r = 0; r < R; r++) {
            wv[r] = _mm256_loadu_ps(w + r * ldw + j);
            __asm__("" : "+x"(wv[r]));
        }
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * cols + j);
            __asm__("" : "+x"(xv));
            for (int r = 0; r < R; r++) acc[r][t] = madd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = hsum8_ps(acc[r][t]);
            for (int jj = j; jj < cols; jj++) s = madd_f32(w[r * ldw + jj], x[(size_t)t * cols + jj], s);
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
    (void)a;
#else
    memset(a, 0, sizeof a);
    for (; j + 8 <= cols; j += 8)
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                for (int k = 0; k < 8; k++)
                    a[r][t][k] = madd_f32(w[r * ldw + j + k], x[(size_t)t * cols + j + k], a[r][t][k]);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            const float *v = a[r][t];
            float s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
            for (int jj = j; jj < cols; jj++) s = madd_f32(w[r * ldw + jj], x[(size_t)t * cols + jj], s);
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__FMA__)
#define F32_PAIRS 1
/* a pair tile: PAIR_P pairs (6 rows) x PAIR_T tokens, 24 zmm sums + 3 weight pairs + 1 x block of the 32 registers;
 * on the 2-core Xeon, 64 tokens through SmolLM2's matmuls (2 threads) 170-173 GFLOP/s with 4 x 6 ymm tiles, 181-189
 * with 4 pairs x 6 tokens, 187-209 with 3 x 8, 198-202 with 2 x 12 */
#define PAIR_P 3
#define PAIR_T 8
/* The f32 arithmetic above, rows two at a time: one zmm holds the 8-wide blocks of rows 2p and 2p+1 (lanes 0-7 and
 * 8-15) against the token's block broadcast to both halves, so every lane runs the same fused multiply-add sequence
 * as its ymm lane in dot_f32_tile and each half is reduced by hsum8_ps: the same bits, twice the products per
 * instruction (where the core has two 512-bit FMA units, as the 2-core Xeon this was measured on). Rows 2p, 2p+1 of
 * the tile; P pairs, T tokens. */
static inline __attribute__((always_inline)) void dot_f32_pairs(float *out, size_t ld_out, size_t ld_r,
                                                                const float *w, size_t ldw, const float *x, int P,
                                                                int T, int cols) {
    __m512 acc[PAIR_P][PAIR_T];
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++) acc[p][t] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 8 <= cols; j += 8) {
        __m512 wv[PAIR_P];
        for (int p = 0; p < P; p++) {
            wv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + 2 * p * ldw + j)),
                                       _mm256_loadu_ps(w + (2 * p + 1) * ldw + j), 1);
            __asm__("" : "+v"(wv[p]));
        }
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (size_t)t * cols + j));
            __asm__("" : "+v"(xv));
            for (int p = 0; p < P; p++) acc[p][t] = _mm512_fmadd_ps(wv[p], xv, acc[p][t]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < 2; h++) {
                int r = 2 * p + h;
                float s = hsum8_ps(h ? _mm512_extractf32x8_ps(acc[p][t], 1) : _mm512_castps512_ps256(acc[p][t]));
                for (int jj = j; jj < cols; jj++) s = madd_f32(w[r * ldw + jj], x[(size_t)t * cols + jj], s);
                out[(size_t)t * ld_out + r * ld_r] = s;
            }
}
#endif

/* q8: out = Σ_g dw_g·dx_g·Σ_j qw[j]·qx[j] over the groups of one weight row, the arithmetic tests/test_q8.c writes
 * out: per group, 8 exact int32 sums s_m of 4 consecutive products (values 4m..4m+3), then acc_m += (float)s_m ·
 * (dw·dx) in 8 f32 lanes (a multiply, then an add: no fused multiply-add), then the 8 lanes summed in order 0..7.
 * With AVX2 the int8 products come from vpmaddubsw on |qw| and qx·sign(qw) (each pair sum ≤ 2·127·127 fits int16,
 * as values are in [-127, 127]) and vpmaddwd, whose int32 lane m is exactly s_m (with AVX512-VNNI one vpdpbusd
 * gives the same s_m: q8 prefill of 1,024 tokens 366 -> 385-407 tok/s, decode about 2% faster, on a 2-core Xeon);
 * dw·dx is one vmulps of two broadcasts (the same rounding as the scalar product); without AVX2, portable C
 * computes the same sums. */
static inline __attribute__((always_inline)) void dot_q8_tile(float *out, size_t ld_out, size_t ld_r,
                                                              const BlockQ8 *w, size_t ldw, const int8_t *xq,
                                                              const float *xd, int R, int T,
                                                              int n_groups) {
    float acc[TILE_MAX][TILE_MAX][8];
    size_t cols = (size_t)n_groups * Q8_GROUP;
#ifdef __AVX2__
    __m256 va[TILE_MAX][TILE_MAX];
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) va[r][t] = _mm256_setzero_ps();
    for (int g = 0; g < n_groups; g++) {
        __m256i qw[TILE_MAX], aw[TILE_MAX];
        __m256 dw[TILE_MAX];
        for (int r = 0; r < R; r++) {
            const BlockQ8 *b = w + r * ldw + g;
            qw[r] = _mm256_loadu_si256((const __m256i *)b->q);
            aw[r] = _mm256_sign_epi8(qw[r], qw[r]);
            __asm__("" : "+x"(qw[r]), "+x"(aw[r]));   /* kept in registers, as the f32 tile's blocks */
#ifdef __F16C__
            dw[r] = _mm256_set1_ps(_cvtsh_ss(b->d));   /* exact, as kv_f16_to_f32 */
#else
            dw[r] = _mm256_set1_ps(kv_f16_to_f32(b->d));
#endif
        }
        for (int t = 0; t < T; t++) {
            __m256i qx = _mm256_loadu_si256((const __m256i *)(xq + t * cols + (size_t)g * Q8_GROUP));
            __m256 dx = _mm256_broadcast_ss(xd + (size_t)t * n_groups + g);
            __asm__("" : "+x"(qx));
            for (int r = 0; r < R; r++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                /* vpdpbusd: the 4 products of each int32 lane summed in one instruction, the same exact s_m */
                __m256i s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw[r], _mm256_sign_epi8(qx, qw[r]));
#else
                __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(qx, qw[r])), ones);
#endif
                __m256 sc = _mm256_mul_ps(dw[r], dx);
                va[r][t] = _mm256_add_ps(va[r][t], _mm256_mul_ps(_mm256_cvtepi32_ps(s32), sc));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) _mm256_storeu_ps(acc[r][t], va[r][t]);
#else
    memset(acc, 0, sizeof acc);
    for (int g = 0; g < n_groups; g++)
        for (int r = 0; r < R; r++) {
            const BlockQ8 *b = w + r * ldw + g;
            float dw = kv_f16_to_f32(b->d);
            for (int t = 0; t < T; t++) {
                const int8_t *qx = xq + t * cols + (size_t)g * Q8_GROUP;
                float sc = dw * xd[(size_t)t * n_groups + g];
                for (int m = 0; m < 8; m++) {
                    int32_t s = 0;
                    for (int k = 0; k < 4; k++) s += (int32_t)b->q[4 * m + k] * qx[4 * m + k];
                    acc[r][t][m] += (float)s * sc;
                }
            }
        }
#endif
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float s = acc[r][t][0];
            for (int m = 1; m < 8; m++) s += acc[r][t][m];
            out[(size_t)t * ld_out + r * ld_r] = s;
        }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define Q8_PAIRS 1
#define Q8_PAIR_P 2   /* pairs of a q8 pair tile (4 rows) x Q8_PAIR_T tokens: 12 zmm sums */
#define Q8_PAIR_T 6
/* The q8 arithmetic above, rows two at a time: one zmm holds a group of rows 2p and 2p+1 (bytes 0-31 and 32-63, so
 * int32 lanes 0-7 and 8-15) against the token's group broadcast to both halves; vpdpbusd of |qw| and qx negated where
 * qw < 0 (a masked subtract: AVX-512 has no vpsignb) gives each lane's exact s_m, and the scale (dw of the lane's row
 * times dx), the multiply and the add are those of the ymm lane: the same bits, two rows per instruction. Rows 2p,
 * 2p+1 at w + (2p)·ldw and w + (2p+1)·ldw; P pairs, T tokens. */
static inline __attribute__((always_inline)) void dot_q8_pairs(float *out, size_t ld_out, size_t ld_r,
                                                               const BlockQ8 *w, size_t ldw, const int8_t *xq,
                                                               const float *xd, int P, int T, int n_groups) {
    __m512 va[Q8_PAIR_P][Q8_PAIR_T];
    size_t cols = (size_t)n_groups * Q8_GROUP;
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++) va[p][t] = _mm512_setzero_ps();
    for (int g = 0; g < n_groups; g++) {
        __m512i aw[Q8_PAIR_P];
        __mmask64 neg[Q8_PAIR_P];
        __m512 dw[Q8_PAIR_P];
        for (int p = 0; p < P; p++) {
            const BlockQ8 *b0 = w + 2 * p * ldw + g, *b1 = w + (2 * p + 1) * ldw + g;
            __m512i qw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b0->q)),
                                            _mm256_loadu_si256((const __m256i *)b1->q), 1);
            neg[p] = _mm512_movepi8_mask(qw);
            aw[p] = _mm512_abs_epi8(qw);
            __asm__("" : "+v"(aw[p]));
            dw[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(_cvtsh_ss(b0->d))),
                                       _mm256_set1_ps(_cvtsh_ss(b1->d)), 1);   /* exact, as kv_f16_to_f32 */
        }
        for (int t = 0; t < T; t++) {
            __m512i qx = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + t * cols + (size_t)g * Q8_GROUP)));
            __m512 dx = _mm512_set1_ps(xd[(size_t)t * n_groups + g]);
            __asm__("" : "+v"(qx));
            for (int p = 0; p < P; p++) {
                __m512i sx = _mm512_mask_sub_epi8(qx, neg[p], _mm512_setzero_si512(), qx);
                __m512i s32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[p], sx);
                __m512 sc = _mm512_mul_ps(dw[p], dx);
                va[p][t] = _mm512_add_ps(va[p][t], _mm512_mul_ps(_mm512_cvtepi32_ps(s32), sc));
            }
        }
    }
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++) {
            float a[16];
            _mm512_storeu_ps(a, va[p][t]);
            for (int h = 0; h < 2; h++) {
                float s = a[8 * h];
                for (int m = 1; m < 8; m++) s += a[8 * h + m];
                out[(size_t)t * ld_out + (2 * p + h) * ld_r] = s;
            }
        }
}

#endif

/* The quantized activations of a q8 matmul: grown when a larger (n, cols) arrives, kept for the process (no
 * per-token allocation). */
static struct {
    int8_t *q;    /* (n, cols) */
    float *d;     /* (n, cols / 32) scales */
    size_t cap;   /* elements of q */
} act_q8;

/* One tile with R and T turned into constants (a switch over the shapes the loops below produce), so each case is
 * compiled with its accumulators in registers. */
#define TILE_CASE(R, T)                                                                                              \
    case (R) * 8 + (T):                                                                                              \
        if (q8) dot_q8_tile(out, ld_out, ld_r, (const BlockQ8 *)w, ld_r * (cols / Q8_GROUP), xq, xd, R, T,         \
                            cols / Q8_GROUP);                                                                        \
        else dot_f32_tile(out, ld_out, ld_r, (const float *)w, ld_r * cols, x, R, T, cols);                          \
        break;
static void matmul_tile(float *out, size_t ld_out, size_t ld_r, const void *w, const float *x, const int8_t *xq,
                        const float *xd, int q8, int R, int T, int cols) {
    switch (R * 8 + T) {
    TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
    TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
    TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
    TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
#if TILE_MAX > 4
    TILE_CASE(1, 5) TILE_CASE(1, 6) TILE_CASE(2, 5) TILE_CASE(2, 6)
    TILE_CASE(3, 5) TILE_CASE(3, 6) TILE_CASE(4, 5) TILE_CASE(4, 6)
#endif
    }
}
#undef TILE_CASE

#ifdef F32_PAIRS
/* an f32 tile of a chunk, R <= 2 PAIR_P rows x T <= PAIR_T tokens: the row pairs in zmm, an odd last row in ymm */
#define PAIR_CASE(P, T)                                                                                              \
    case (P) * 16 + (T): dot_f32_pairs(out, ld_out, 1, w, cols, x, P, T, cols); break;
static void f32_pair_tile(float *out, size_t ld_out, const float *w, const float *x, int R, int T, int cols) {
    for (int t = 0; R % 2 && t < T; t += TILE_MAX)   /* matmul_tile's shapes take at most TILE_MAX tokens */
        matmul_tile(out + (size_t)t * ld_out + R - 1, ld_out, 1, w + (size_t)(R - 1) * cols, x + (size_t)t * cols,
                    NULL, NULL, 0, 1, T - t < TILE_MAX ? T - t : TILE_MAX, cols);
    switch (R / 2 * 16 + T) {
    PAIR_CASE(1, 1) PAIR_CASE(1, 2) PAIR_CASE(1, 3) PAIR_CASE(1, 4) PAIR_CASE(1, 5) PAIR_CASE(1, 6) PAIR_CASE(1, 7)
    PAIR_CASE(1, 8) PAIR_CASE(2, 1) PAIR_CASE(2, 2) PAIR_CASE(2, 3) PAIR_CASE(2, 4) PAIR_CASE(2, 5) PAIR_CASE(2, 6)
    PAIR_CASE(2, 7) PAIR_CASE(2, 8) PAIR_CASE(3, 1) PAIR_CASE(3, 2) PAIR_CASE(3, 3) PAIR_CASE(3, 4) PAIR_CASE(3, 5)
    PAIR_CASE(3, 6) PAIR_CASE(3, 7) PAIR_CASE(3, 8)
    }
}
#undef PAIR_CASE
#endif
#ifdef Q8_PAIRS
/* a q8 tile of a chunk, R <= 2 Q8_PAIR_P rows x T <= Q8_PAIR_T tokens: the row pairs in zmm, an odd last row in ymm */
#define Q8_PAIR_CASE(P, T)                                                                                           \
    case (P) * 16 + (T): dot_q8_pairs(out, ld_out, 1, w, n_groups, xq, xd, P, T, n_groups); break;
static void q8_pair_tile(float *out, size_t ld_out, const BlockQ8 *w, const int8_t *xq, const float *xd, int R, int T,
                         int n_groups) {
    for (int t = 0; R % 2 && t < T; t += TILE_MAX)   /* matmul_tile's shapes take at most TILE_MAX tokens */
        matmul_tile(out + (size_t)t * ld_out + R - 1, ld_out, 1, w + (size_t)(R - 1) * n_groups, NULL,
                    xq + (size_t)t * n_groups * Q8_GROUP, xd + (size_t)t * n_groups, 1, 1,
                    T - t < TILE_MAX ? T - t : TILE_MAX, n_groups * Q8_GROUP);
    switch (R / 2 * 16 + T) {
    Q8_PAIR_CASE(1, 1) Q8_PAIR_CASE(1, 2) Q8_PAIR_CASE(1, 3) Q8_PAIR_CASE(1, 4) Q8_PAIR_CASE(1, 5) Q8_PAIR_CASE(1, 6)
    Q8_PAIR_CASE(2, 1) Q8_PAIR_CASE(2, 2) Q8_PAIR_CASE(2, 3) Q8_PAIR_CASE(2, 4) Q8_PAIR_CASE(2, 5) Q8_PAIR_CASE(2, 6)
    }
}
#undef Q8_PAIR_CASE
#endif

/* Bytes of weight rows a thread works through for every block of tokens before moving on: the panel stays in L2
 * (512 KiB per core) while a block of up to 4 tokens' x (≤ 24 KiB at cols 1536) stays in L1 (32 KiB). */
#define PANEL_BYTES (192 * 1024)
/* rows a decode tile reads at once, each from its own stretch of W: 3 measured fastest (1: 13.3, 2: 8.7-9.7,
 * 3: 8.2, 4: 7.8-8.9 ms per q8 token on one core) */
#define DECODE_STREAMS 3
/* tokens up to which a matmul reads the weights as decode does (one token, or a batch of sequences' steps) */
#define DECODE_TOKENS 16

/* out (n, rows) = x (n, cols) · W (rows, cols)ᵀ: row i of out[t] is W_i · x_t. Each thread takes one contiguous
 * range of rows (whole tiles, so each streams its part of W once per panel pass), cut into panels that stay in L2;
 * a panel is swept once per block of tokens by tiles of rows × tokens. Decode (n = 1) reads DECODE_STREAMS rows
 * per tile, each from its own contiguous stretch of the thread's rows. For q8 weights every x_t is quantized once
 * (groups of 32, f32 scale, quant.h), before the rows. */
void matmul_n(float *out, const float *x, Matrix W, int rows, int cols, int n) {
    int q8 = W.type == WTYPE_Q8;
    if (q8) {
        size_t need = (size_t)n * cols;
        if (need > act_q8.cap) {
            free(act_q8.q);
            free(act_q8.d);
            act_q8.q = malloc(need);
            act_q8.d = malloc(need / Q8_GROUP * sizeof(float));
            if (!act_q8.q || !act_q8.d) fatal("out of memory");
            act_q8.cap = need;
        }
        for (size_t g = 0; g < need / Q8_GROUP; g++)
            act_q8.d[g] = quant_q8_group(act_q8.q + g * Q8_GROUP, x + g * Q8_GROUP);
    }
    size_t row_bytes = matrix_bytes(W.type, 1, cols);
    /* tile shapes (rows × tokens) for chunks: f32 chunks use 3 × 4 (12 accumulators + 3 weight + 1 x register, 16
     * ymm; measured on Zen 3), or 4 × 6 where AVX-512VL gives 32 (24 + 4 + 1; on Zen 4, 64 tokens through
     * SmolLM2's layer matmuls: 195 against 178 GFLOP/s), or 6 × 8 as 3 row pairs in zmm where AVX-512F/DQ are
     * there (dot_f32_pairs; not measured on Zen 4, whose 512-bit FMAs run as two 256-bit halves); q8 chunks 2 × 3,
     * whose per-row registers (qw, |qw|, dw) leave room for 6 sums */
#ifdef F32_PAIRS
    int tr = n == 1 ? 1 : q8 ? 2 : 2 * PAIR_P, tt = n == 1 ? 1 : q8 ? 3 : PAIR_T;
#ifdef Q8_PAIRS
    if (q8 && n > 1) tr = 2 * Q8_PAIR_P, tt = Q8_PAIR_T;   /* chunks only: a batch's decode steps (n <= 16) ran
                                                              slower in pairs (S = 8: 34 -> 39 ms per step) */
#endif
#elif TILE_MAX > 4
    int tr = n == 1 ? 1 : q8 ? 2 : 4, tt = n == 1 ? 1 : q8 ? 3 : 6;
#else
    int tr = n == 1 ? 1 : q8 ? 2 : 3, tt = n == 1 ? 1 : q8 ? 3 : 4;
#endif
    int panel = (int)(PANEL_BYTES / row_bytes) / tr * tr;
    /* a batch of a few tokens (n <= 16: many sequences' decode steps, forward_batch) sweeps each row tile for all
       its tokens before the next: the weights are then one stream from memory, each tile's rows read once from L1
       (measured on the 49,152 x 576 classifier at n = 8, 2 threads: 8.5-9.2 ms against 9.6-11.3 with L2 panels) */
    if (panel < tr || n <= 16) panel = tr;
    /* small matrices stay on one thread: waking the team costs more than the work */
    #pragma omp parallel if ((size_t)rows * cols * n >= 65536)
    {
        int nth = 1, tid = 0;
#ifdef _OPENMP
        nth = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        int per = ((rows + nth - 1) / nth + tr - 1) / tr * tr;
        int i_end = rows < (tid + 1) * per ? rows : (tid + 1) * per;
        if (n <= DECODE_TOKENS && tid * per < i_end) {
            /* decode (one token, or a few: many sequences' steps): DECODE_STREAMS rows at a time, taken from equal,
             * contiguous sub-ranges of this thread's rows, so each is one unbroken stream through memory that the
             * prefetchers follow (adjacent rows in one tile break the streams every row and ran ~2x slower); the
             * tile's rows stay in L1 for every block of tokens */
            int b = tid * per, h = (i_end - b) / DECODE_STREAMS, ts = q8 ? 2 : TILE_MAX;
            for (int i = b; i < i_end; i++) {
                int streams = i < b + h ? DECODE_STREAMS : 1;
                if (i >= b + h && i < b + DECODE_STREAMS * h) continue;   /* the other streams' rows */
                for (int t = 0; t < n; t += ts)
                    matmul_tile(out + (size_t)t * rows + i, rows, h, (const uint8_t *)W.data + (size_t)i * row_bytes,
                                x + (size_t)t * cols, q8 ? act_q8.q + (size_t)t * cols : NULL,
                                q8 ? act_q8.d + (size_t)t * (cols / Q8_GROUP) : NULL, q8, streams,
                                n - t < ts ? n - t : ts, cols);
            }
        } else
        for (int p = tid * per; p < i_end; p += panel) {
            int p_end = i_end < p + panel ? i_end : p + panel;
            /* the next panel comes from memory while this one is swept: a few of its lines are asked for into L2
               after each tile, spread over the sweep (the first sweep of a panel otherwise waits on DRAM) */
            const char *next = (const char *)W.data + (size_t)p_end * row_bytes;
            size_t next_bytes = (size_t)((i_end < p_end + panel ? i_end : p_end + panel) - p_end) * row_bytes;
            size_t tiles = (size_t)((n + tt - 1) / tt) * ((p_end - p + tr - 1) / tr), ahead = 0;
            size_t per_tile = (next_bytes / 64 + tiles - 1) / tiles * 64;
            for (int t = 0; t < n; t += tt) {
                int nt = n - t < tt ? n - t : tt;
                for (int i = p; i < p_end; i += tr) {
#ifdef Q8_PAIRS
                    if (q8)
                        q8_pair_tile(out + (size_t)t * rows + i, rows,
                                     (const BlockQ8 *)((const uint8_t *)W.data + (size_t)i * row_bytes),
                                     act_q8.q + (size_t)t * cols, act_q8.d + (size_t)t * (cols / Q8_GROUP),
                                     p_end - i < tr ? p_end - i : tr, nt, cols / Q8_GROUP);
                    else
#endif
#ifdef F32_PAIRS
                    if (!q8)
                        f32_pair_tile(out + (size_t)t * rows + i, rows, (const float *)W.data + (size_t)i * cols,
                                      x + (size_t)t * cols, p_end - i < tr ? p_end - i : tr, nt, cols);
                    else
#endif
                    matmul_tile(out + (size_t)t * rows + i, rows, 1, (const uint8_t *)W.data + (size_t)i * row_bytes,
                                x + (size_t)t * cols, q8 ? act_q8.q + (size_t)t * cols : NULL,
                                q8 ? act_q8.d + (size_t)t * (cols / Q8_GROUP) : NULL, q8,
                                p_end - i < tr ? p_end - i : tr, nt, cols);
                    for (size_t b = 0; b < per_tile && ahead < next_bytes; b += 64, ahead += 64)
                        __builtin_prefetch(next + ahead, 0, 2);
                }
            }
        }
    }
}
void matmul(float *out, const float *x, Matrix W, int rows, int cols) { matmul_n(out, x, W, rows, cols, 1); }

