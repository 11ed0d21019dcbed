/* matmul.h: y = W·x for the model's weight matrices (f32 or q8), over one token or a chunk of tokens: register
 * tiles over row panels, rows split over threads (matmul.c). Every output has one fixed arithmetic, so results do not
 * depend on the thread count, the chunk size or the build's vector instructions.
 */
#ifndef KVLAB_MATMUL_H
#define KVLAB_MATMUL_H

#include "model.h"

/* out (rows) = W (rows, cols) · x (cols), rows split over threads (results independent of the thread count).
 * W f32: f32 products in 8 lanes. W q8: x is quantized per group of 32 (f32 scale), int8 products summed exactly
 * per 4 values, scaled and accumulated in 8 f32 lanes (see matmul.c). cols must be a multiple of 32 for q8. */
void matmul(float *out, const float *x, Matrix W, int rows, int cols);
/* out (n, rows) = x (n, cols) · Wᵀ: the same per-output arithmetic as matmul, for n tokens at once (bit-identical
 * to n calls of matmul). Not reentrant for q8 (one scratch buffer for the quantized x): call it from one thread. */
void matmul_n(float *out, const float *x, Matrix W, int rows, int cols, int n);

#endif
