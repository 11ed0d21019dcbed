/* quant.h: int8 group quantization of weight matrices and activations, shared by export.c (which writes q8 weights)
 * and run.c (which reads them and quantizes activations). One group is Q8_GROUP consecutive values of a row with one
 * scale d = max|x| / 127 and int8 values q = round(x / d) in [-127, 127] (round half away from zero), so x ≈ d·q.
 * A stored weight group is a BlockQ8: an f16 scale then the 32 int8 values, 34 bytes, the layout of ggml's
 * block_q8_0 (ggml-common.h) and of its reference quantizer quantize_row_q8_0_ref (the scale is computed in f32,
 * the values are quantized with it, then the scale is rounded to f16 for storage). Activations keep an f32 scale.
 * It does not do matrix products (run.c's matmul_n) and knows no file format beyond one block; the f16 conversions
 * are kv.h's.
 */
#ifndef KVLAB_QUANT_H
#define KVLAB_QUANT_H

#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "kv.h"   /* kv_f16_to_f32, kv_f32_to_f16: the one copy of the f16 conversions */

#define Q8_GROUP 32   /* values per group (elements) */

typedef struct {
    uint16_t d;            /* f16 scale (IEEE binary16 bits) */
    int8_t q[Q8_GROUP];    /* values in [-127, 127] */
} BlockQ8;
_Static_assert(sizeof(BlockQ8) == 34, "BlockQ8 must be 34 bytes, as ggml's block_q8_0");

/* q (Q8_GROUP) = x (Q8_GROUP) quantized with d = max|x| / 127; returns d (f32, 0 for an all-zero group). A NaN
 * value becomes 0 and infinities saturate, so any input is defined behaviour (files and activations can hold
 * anything). The definition, in scalar C; quant_q8_group gives its bits. */
static inline float quant_q8_group_c(int8_t *q, const float *x) {
    float amax = 0;
    for (int j = 0; j < Q8_GROUP; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < Q8_GROUP; j++) {
        float v = x[j] * id;
        q[j] = (int8_t)(v >= 127.0f ? 127 : v <= -127.0f ? -127 : v == v ? (int)roundf(v) : 0);
    }
    return d;
}

/* quant_q8_group_c's bits, 16 values a step with AVX-512: the maximum as its comparison keeps it (a NaN never
 * wins), the same scale and product, and round half away from zero as trunc(v) + sign(v) where |v - trunc(v)| >=
 * 1/2 (v - trunc(v) is exact), which is roundf. Activations are quantized before every q8 matmul, on one thread,
 * where roundf's call per value took about 7% of a q8 decode step (perf, context 256, 2 threads); test_q8 checks
 * it against quant_q8_group_c on edge values and random groups. */
static inline float quant_q8_group(int8_t *q, const float *x) {
#ifdef __AVX512F__
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < Q8_GROUP; j += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m);
    float amax = _mm512_reduce_max_ps(m);
    float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
    const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f), half = _mm512_set1_ps(0.5f),
                 one = _mm512_set1_ps(1.0f), vid = _mm512_set1_ps(id);
    for (int j = 0; j < Q8_GROUP; j += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + j), vid);
        __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
        __m512 sgn = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(one),   /* ±1 with v's sign */
                                                         _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))));
        __m512 r = _mm512_mask_add_ps(t, up, t, sgn);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_setzero_ps());
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, top, _CMP_GE_OQ), r, top);
        r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, bottom, _CMP_LE_OQ), r, bottom);
        _mm_storeu_si128((__m128i *)(void *)(q + j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
    }
    return d;
#else
    return quant_q8_group_c(q, x);
#endif
}

#endif
