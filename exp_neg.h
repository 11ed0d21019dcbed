/* exp_neg.h: kvlab's own e^x for x ≤ 0, in f32, one definition for every build: exp_neg (portable C) and exp_neg8
 * (8 lanes, AVX2) and exp_neg16 (16 lanes, AVX-512) give the same bits, so results computed with it do not depend on the instruction set. Used by
 * attention's softmax (kv.c) and the SwiGLU's sigmoid (run.c).
 */
#ifndef KVLAB_EXP_NEG_H
#define KVLAB_EXP_NEG_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* e^x for x ≤ 0 (a softmax's x − max, a sigmoid's −|x|), the same bits with or without AVX: x = n·ln2 + r with
 * n = round(x·log2 e) (the 1.5·2²³ trick) and r reduced in two steps (Cody-Waite), e^r by Cephes' degree-7 polynomial
 * for expf (S. Moshier; relative error about 1e-7), times 2ⁿ built in the exponent bits. Every step is one IEEE operation, a
 * multiply or an add, never fused. Below −87 (e^x < 2⁻¹²⁶) it is 0; NaN stays NaN. */
#define EXP_LO (-87.0f)
#define EXP_C1 0.693359375f
#define EXP_C2 (-2.12194440e-4f)
#define EXP_MAGIC 12582912.0f
static const float exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};
static inline float exp_neg(float x) {
    if (x != x) return x;   /* NaN stays NaN: a broken model shows */
    if (x < EXP_LO) return 0;
    float n = (x * 1.44269504088896341f + EXP_MAGIC) - EXP_MAGIC;
    float r = (x - n * EXP_C1) - n * EXP_C2;
    float y = exp_poly[0];
    for (int k = 1; k < 6; k++) y = y * r + exp_poly[k];
    y = (y * (r * r) + r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float p2;
    memcpy(&p2, &bits, sizeof p2);
    return y * p2;
}
#ifdef __AVX2__
static inline __m256 exp_neg8(__m256 x) {
    __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_NLT_UQ);   /* x ≥ −87, or NaN (which stays NaN) */
    x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);                        /* maxps returns x when x is NaN */
    __m256 magic = _mm256_set1_ps(EXP_MAGIC);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1))),
                             _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)));
    __m256 y = _mm256_set1_ps(exp_poly[0]);
    for (int k = 1; k < 6; k++) y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(exp_poly[k]));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), ok);
}
#endif
#ifdef __AVX512F__
/* exp_neg8 in 16 lanes: the same operations lane by lane, so the same bits */
static inline __m512 exp_neg16(__m512 x) {
    __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(EXP_LO), x);
    __m512 magic = _mm512_set1_ps(EXP_MAGIC);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_C1))),
                             _mm512_mul_ps(n, _mm512_set1_ps(EXP_C2)));
    __m512 y = _mm512_set1_ps(exp_poly[0]);
    for (int k = 1; k < 6; k++) y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(exp_poly[k]));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(ok, _mm512_mul_ps(y, _mm512_castsi512_ps(bits)));
}
#endif

#endif
