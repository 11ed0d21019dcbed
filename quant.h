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
 * anything). */
static inline float quant_q8_group(int8_t *q, const float *x) {
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

#endif
