/* kv_codec.h: the KV cache's storage codec, one definition for kv.c (kv_encode, kv_decode, kv_vector_bytes) and for
 * attn.cu (its store kernels, its attention kernels and their CPU twin): the per-unit encoder, and the per-unit and
 * per-element decoders, of every storage type (f32, f16, bf16, q8, q4, q2), as static inline host + device (KV_HD)
 * functions. A UNIT is one group of G = gcd(head_dim, 32) elements for q8, q4 and q2, one element otherwise; units are
 * independent, so the device encodes a vector with one thread per unit and gets kv.c's bytes.
 * It does not loop over vectors, allocate or know slots and lanes: callers hand it one vector's bytes. The f16 and bf16
 * conversions it builds on are kv.h's.
 */
#ifndef KVLAB_KV_CODEC_H
#define KVLAB_KV_CODEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv.h"   /* KVType, KV_HD, kv_f32_to_f16 and the other conversions */

/* ---------------------------------------------------------------------------------------------------------------
 * Layouts. q8, q4 and q2 quantize a vector in groups of G = gcd(head_dim, 32) elements, q8 and q4 in the layouts of
 * llama.cpp's Q8_0 and Q4_1 (ggml-common.h, block_q8_0 and block_q4_1, there with G = 32), q2 as q4 with 2-bit codes
 * (KIVI's asymmetric min/scale quantization, Liu et al. 2024, arXiv:2402.02750, §3.1); 16-bit fields are
 * little-endian:
 *   f32:  4 bytes per element; f16, bf16: 2 bytes per element (IEEE binary16, bfloat16; round to nearest even);
 *   q8:   an f16 scale d, then G int8 values q;                x = d·q
 *   q4:   an f16 scale d, an f16 minimum m, then G/2 bytes;    x = d·q + m, q in 0..15; element j in the low nibble
 *         of byte j, element j + G/2 in the high nibble (Q4_1's order);
 *   q2:   an f16 scale d, an f16 minimum m, then ⌈G/4⌉ bytes;  x = d·q + m, q in 0..3; element j in bits 2·(j mod 4)
 *         and 2·(j mod 4) + 1 of byte ⌊j/4⌋ (the first element in the lowest bits; G = 2, for head_dim ≡ 2 mod 4,
 *         leaves the high half of its one byte 0).
 * Unlike llama.cpp, which rounds d = max|x|/127 to nearest, we round the f16 scale UP (and q4's and q2's minimum
 * DOWN), so every element maps inside the code range and none is clipped: the error of an element is then at most d/2
 * (plus f32 rounding), with d ≤ max|x|/127 (q8) or (max - m)/15 (q4) or (max - m)/3 (q2) rounded up to the next f16
 * (kv_minscale). An all-zero group has
 * d = 0 and decodes to exact zeros. Scales saturate at ±65504 (the largest f16), so a finite input never decodes to
 * inf or NaN; f16 and bf16 saturate the same way.
 *
 * Same bits on host and device. Every operation here is one IEEE-rounded f32 or f64 operation (nvcc's divisions are
 * correctly rounded by default, --prec-div=true, and so is its roundf), except q4's decoding d·q + m, which a compiler
 * may fuse into one multiply-add: it is written with kv_mul_rn and kv_add_rn, which on the device are the intrinsics
 * nvcc never fuses (__fmul_rn, __fadd_rn; nvcc fuses by default, --fmad=true) and on the host plain operators, so
 * host code must be compiled without contraction (GCC's default in ISO C, -std=c11 as kv.c is; attn.cu's host side
 * and tests/test_attn.cu are built with -ffp-contract=off). No other expression multiplies into an add, so none can
 * fuse, and --fmad=false is not needed. The float-to-int conversions convert integral values in range: exact.
 * ------------------------------------------------------------------------------------------------------------- */

#define KV_F16_MAX_BITS 0x7bffu   /* 65504, the largest finite f16 */

/* a · b, a + b, a - b, each rounded on its own (never fused into a multiply-add; see above). */
static inline KV_HD float kv_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
static inline KV_HD float kv_add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
static inline KV_HD float kv_sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

/* G, the elements of a q8, q4 or q2 group: gcd(head_dim, 32) (32 for the usual head dims, fewer for odd ones). */
static inline KV_HD int kv_group(int head_dim) {
    int a = head_dim, b = 32;
    while (b) { int t = a % b; a = b; b = t; }
    return a;
}
/* The functions below take G = kv_group(head_dim), computed once by the caller, instead of head_dim. */

/* 1 for the grouped types (q8, q4, q2), whose unit is a group of G elements. */
static inline KV_HD int kv_type_grouped(int ty) { return ty == KV_Q8 || ty == KV_Q4 || ty == KV_Q2; }
/* Units of a vector of head_dim elements in type ty (a KVType): head_dim / G groups for q8, q4 and q2, else
 * head_dim. */
static inline KV_HD int kv_codec_units(int ty, int head_dim, int G) {
    return kv_type_grouped(ty) ? head_dim / G : head_dim;
}
/* Bytes of one unit (scales and minimums included); 0 for an unknown type. Unit u starts at byte u · kv_unit_bytes. */
static inline KV_HD int kv_unit_bytes(int ty, int G) {
    switch (ty) {
    case KV_F32: return 4;
    case KV_F16: case KV_BF16: return 2;
    case KV_Q8: return 2 + G;
    case KV_Q4: return 4 + G / 2;
    case KV_Q2: return 4 + (G + 3) / 4;
    default: return 0;
    }
}

static inline KV_HD void kv_put16(uint8_t *p, uint16_t h) { p[0] = (uint8_t)(h & 0xff); p[1] = (uint8_t)(h >> 8); }
static inline KV_HD uint16_t kv_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* The smallest f16 >= x (x >= 0), saturating at 65504. Positive f16 bit patterns are ordered like their values. */
static inline KV_HD uint16_t kv_f16_ceil(float x) {
    uint16_t h = kv_f32_to_f16(x);
    if (h >= 0x7c00u) return KV_F16_MAX_BITS;
    while (kv_f16_to_f32(h) < x && h < KV_F16_MAX_BITS) h++;
    return h;
}
/* The largest f16 <= x, saturating at -65504. */
static inline KV_HD uint16_t kv_f16_floor(float x) {
    uint16_t h = kv_f32_to_f16(x);
    if ((h & 0x7fffu) >= 0x7c00u) return (uint16_t)(h & 0x8000u ? 0x8000u | KV_F16_MAX_BITS : KV_F16_MAX_BITS);
    if (kv_f16_to_f32(h) > x) {                   /* one step toward -inf */
        if ((h & 0x7fffu) == 0) h = 0x8001u;      /* +0 or -0 -> the smallest negative subnormal */
        else if (h & 0x8000u) h++;
        else h--;
    }
    if ((h & 0x7fffu) > KV_F16_MAX_BITS) h = 0x8000u | KV_F16_MAX_BITS;
    return h;
}
/* x rounded to f16 (bf16), ±inf saturated to the largest finite value; NaN in gives 0 (inputs are finite by
 * contract, this only keeps the output defined). */
static inline KV_HD uint16_t kv_f16_saturate(float x) {
    uint16_t h = kv_f32_to_f16(x);
    if ((h & 0x7fffu) > 0x7c00u) return 0;
    if ((h & 0x7fffu) == 0x7c00u) return (uint16_t)((h & 0x8000u) | KV_F16_MAX_BITS);
    return h;
}
static inline KV_HD uint16_t kv_bf16_saturate(float x) {
    uint16_t h = kv_f32_to_bf16(x);
    if ((h & 0x7fffu) > 0x7f80u) return 0;
    if ((h & 0x7fffu) == 0x7f80u) return (uint16_t)((h & 0x8000u) | 0x7f7fu);
    return h;
}

/* The minimum m and scale d (f16 bits, into *mh and *dh) of asymmetric quantization with codes 0..qmax of values in
 * [mn, mx] (finite): m is mn rounded DOWN to f16, d the smallest f16 with d·qmax ≥ mx - m (computed in double), so
 * every value maps inside the code range and none is clipped; both saturate at ±65504. q4, q2 and the per-channel
 * keys (kv.c, kgroup=channel) share it. */
static inline KV_HD void kv_minscale(float mn, float mx, int qmax, uint16_t *mh, uint16_t *dh) {
    *mh = kv_f16_floor(mn);
    float m = kv_f16_to_f32(*mh);
    double range = (double)mx - m;             /* >= 0 unless the minimum saturated */
    uint16_t h = kv_f16_ceil(range > 0 ? (float)(range / qmax) : 0.0f);
    float d = kv_f16_to_f32(h);
    while ((double)d * qmax < range && h < KV_F16_MAX_BITS) d = kv_f16_to_f32(++h);
    *dh = h;
}
/* The smaller (larger) of a and b, a when they compare equal: -0 and +0 are equal, and fminf/fmaxf may return either
 * (the compiler's choice, which moved with an unrelated inlining change), so a group of -0 and +0 would store a
 * minimum of either sign. With these the first element seen wins, in every build and on the device. */
static inline KV_HD float kv_min_tie_first(float a, float b) { return b < a ? b : a; }
static inline KV_HD float kv_max_tie_first(float a, float b) { return b > a ? b : a; }
/* The code of x with minimum m and scale d: round((x - m)/d) in 0..qmax (0 when d = 0). */
static inline KV_HD int kv_code(float x, float m, float d, int qmax) {
    float v = d > 0 ? roundf((x - m) / d) : 0.0f;
    return (int)fminf((float)qmax, fmaxf(0.0f, v));
}

/* Per-channel key codes (kgroup=channel, kv.c): a key of head_dim elements stored as head_dim codes of `bits` bits
 * (8, 4 or 2 for q8, q4, q2) against its group's per-channel scale and minimum; element e in bits
 * bits·(e mod (8/bits)) upwards of byte ⌊e·bits/8⌋ (the first element in the lowest bits). Bytes of one key's codes: */
static inline KV_HD int kv_type_bits(int ty) { return ty == KV_Q8 ? 8 : ty == KV_Q4 ? 4 : ty == KV_Q2 ? 2 : 0; }
static inline KV_HD int kv_chan_code_bytes(int bits, int head_dim) { return (head_dim * bits + 7) / 8; }
static inline KV_HD int kv_chan_code(const uint8_t *codes, int bits, int e) {
    int per = 8 / bits;
    return (codes[e / per] >> (bits * (e % per))) & ((1 << bits) - 1);
}

/* Encode unit u (0 .. kv_codec_units - 1) of x (head_dim, finite) into the vector at dst (kv_codec_units ·
 * kv_unit_bytes bytes): writes that unit's bytes only, reads that unit's elements only. */
static inline KV_HD void kv_encode_unit(uint8_t *dst, int ty, const float *x, int G, int u) {
    uint8_t *b = dst + (size_t)u * kv_unit_bytes(ty, G);
    switch (ty) {
    case KV_F32: memcpy(b, &x[u], 4); break;
    case KV_F16: kv_put16(b, kv_f16_saturate(x[u])); break;
    case KV_BF16: kv_put16(b, kv_bf16_saturate(x[u])); break;
    case KV_Q8: {
        const float *xg = x + (size_t)u * G;
        float amax = 0;
        for (int j = 0; j < G; j++) amax = fmaxf(amax, fabsf(xg[j]));
        uint16_t h = kv_f16_ceil(amax / 127.0f);
        float d = kv_f16_to_f32(h);
        while (d * 127.0f < amax && h < KV_F16_MAX_BITS) d = kv_f16_to_f32(++h);   /* d·127 is exact in f32 */
        kv_put16(b, h);
        for (int j = 0; j < G; j++) {
            float q = d > 0 ? roundf(xg[j] / d) : 0.0f;
            q = fminf(127.0f, fmaxf(-127.0f, q));   /* only a saturated scale clips; NaN becomes -127 */
            b[2 + j] = (uint8_t)(int8_t)q;
        }
        break;
    }
    case KV_Q4: case KV_Q2: {
        const float *xg = x + (size_t)u * G;
        float mn = xg[0], mx = xg[0];
        for (int j = 1; j < G; j++) { mn = kv_min_tie_first(mn, xg[j]); mx = kv_max_tie_first(mx, xg[j]); }
        uint16_t mh, h;
        kv_minscale(mn, mx, ty == KV_Q4 ? 15 : 3, &mh, &h);
        float m = kv_f16_to_f32(mh), d = kv_f16_to_f32(h);
        kv_put16(b, h);
        kv_put16(b + 2, mh);
        if (ty == KV_Q4)
            for (int j = 0; j < G / 2; j++)
                b[4 + j] = (uint8_t)(kv_code(xg[j], m, d, 15) | (kv_code(xg[j + G / 2], m, d, 15) << 4));
        else
            for (int j0 = 0; j0 < G; j0 += 4) {
                int byte = 0;
                for (int j = j0; j < j0 + 4 && j < G; j++) byte |= kv_code(xg[j], m, d, 3) << (2 * (j - j0));
                b[4 + j0 / 4] = (uint8_t)byte;
            }
        break;
    }
    default: break;
    }
}

/* Element j (0 .. G-1) of the q8 group at b (scale d = b's f16 scale) and of the q4 and q2 groups at b (scale d,
 * minimum m): the one statement of each decoding, shared by the per-unit and the per-element decoders. */
static inline KV_HD float kv_q8_elem(const uint8_t *b, float d, int j) { return d * (float)(int8_t)b[2 + j]; }
static inline KV_HD float kv_q4_elem(const uint8_t *b, int G, float d, float m, int j) {
    int q = j < G / 2 ? b[4 + j] & 15 : b[4 + j - G / 2] >> 4;
    return kv_add_rn(kv_mul_rn(d, (float)q), m);
}
static inline KV_HD float kv_q2_elem(const uint8_t *b, float d, float m, int j) {
    int q = (b[4 + j / 4] >> (2 * (j % 4))) & 3;
    return kv_add_rn(kv_mul_rn(d, (float)q), m);
}

/* Element e (0 .. head_dim - 1) of the vector at src (for kernels whose threads hold slices that need not align with
 * groups); kv_decode_unit gives the same bits. 0 for an unknown type. */
static inline KV_HD float kv_decode_elem(int ty, const uint8_t *src, int e, int G) {
    const uint8_t *b = src + (size_t)(kv_type_grouped(ty) ? e / G : e) * kv_unit_bytes(ty, G);
    switch (ty) {
    case KV_F32: { float f; memcpy(&f, b, 4); return f; }
    case KV_F16: return kv_f16_to_f32(kv_get16(b));
    case KV_BF16: return kv_bf16_to_f32(kv_get16(b));
    case KV_Q8: return kv_q8_elem(b, kv_f16_to_f32(kv_get16(b)), e % G);
    case KV_Q4: return kv_q4_elem(b, G, kv_f16_to_f32(kv_get16(b)), kv_f16_to_f32(kv_get16(b + 2)), e % G);
    case KV_Q2: return kv_q2_elem(b, kv_f16_to_f32(kv_get16(b)), kv_f16_to_f32(kv_get16(b + 2)), e % G);
    default: return 0;
    }
}

/* Decode unit u of the vector at src into x (head_dim): writes that unit's elements only (x[u] for f32, f16, bf16;
 * x[u·G .. u·G + G - 1] for q8, q4, q2), reading a group's scale and minimum once. */
static inline KV_HD void kv_decode_unit(float *x, int ty, const uint8_t *src, int G, int u) {
    const uint8_t *b = src + (size_t)u * kv_unit_bytes(ty, G);
    switch (ty) {
    case KV_Q8: {
        float d = kv_f16_to_f32(kv_get16(b));
        for (int j = 0; j < G; j++) x[(size_t)u * G + j] = kv_q8_elem(b, d, j);
        break;
    }
    case KV_Q4: {
        float d = kv_f16_to_f32(kv_get16(b)), m = kv_f16_to_f32(kv_get16(b + 2));
        for (int j = 0; j < G / 2; j++) {   /* both nibbles of byte j at once: the compiler sees which is which */
            x[(size_t)u * G + j] = kv_q4_elem(b, G, d, m, j);
            x[(size_t)u * G + j + G / 2] = kv_q4_elem(b, G, d, m, j + G / 2);
        }
        break;
    }
    case KV_Q2: {
        float d = kv_f16_to_f32(kv_get16(b)), m = kv_f16_to_f32(kv_get16(b + 2));
        for (int j = 0; j < G; j++) x[(size_t)u * G + j] = kv_q2_elem(b, d, m, j);
        break;
    }
    case KV_F32: case KV_F16: case KV_BF16: x[u] = kv_decode_elem(ty, src, u, G); break;   /* one element */
    default: break;
    }
}

#endif
