/* test_matmul: the f32 matmul's one arithmetic (matmul.c) whatever the call's shape: matmul_n over n tokens must give
 * bit for bit what n one-token calls give, for row counts that leave a tile's last row alone (odd, and below a tile)
 * and token counts on both sides of the batch path (n <= 16) and through the chunk path's tiles (row pairs on
 * AVX-512: 6 rows x 8 tokens, the odd last row in 256-bit tiles of at most 6 tokens), with cols a multiple of 8 and
 * not; and on 1 and 2 threads. The reference is the documented arithmetic, computed here in plain C: 8 partial sums
 * (lane j mod 8, one multiply-add each, fused where the build has FMA), folded ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)),
 * then the tail. */
#include "check.h"
#include "matmul_check.h"
#include "matmul.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static uint64_t rng = 42;
static float urand(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) * 0x1p-24) - 0.5f;
}

#ifdef __FMA__
#define MADD(a, b, c) fmaf(a, b, c)
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

static float dot_spec(const float *w, const float *x, int cols) {
    float a[8] = {0};
    int j = 0;
    for (; j + 8 <= cols; j += 8)
        for (int k = 0; k < 8; k++) a[k] = MADD(w[j + k], x[j + k], a[k]);
    float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (; j < cols; j++) s = MADD(w[j], x[j], s);
    return s;
}

int main(void) {
    static const int shapes[][2] = {{1, 64}, {5, 72}, {7, 64}, {13, 100}, {50, 576}, {97, 1536}, {385, 96}};
    static const int ns[] = {1, 2, 7, 9, 16, 17, 23, 31, 64, 70};
    int spec_bad = 0, n_bad = 0, thr_bad = 0, cases = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], nmax = 70;
        float *W = malloc((size_t)rows * cols * 4), *x = malloc((size_t)nmax * cols * 4);
        float *y1 = malloc((size_t)nmax * rows * 4), *yn = malloc((size_t)nmax * rows * 4);
        for (size_t i = 0; i < (size_t)rows * cols; i++) W[i] = urand();
        for (size_t i = 0; i < (size_t)nmax * cols; i++) x[i] = urand() * (i % 89 == 3 ? 30.0f : 1.0f);
        Matrix M = {W, WTYPE_F32};
        for (int t = 0; t < nmax; t++) matmul(y1 + (size_t)t * rows, x + (size_t)t * cols, M, rows, cols);
        for (int t = 0; t < nmax; t++)
            for (int i = 0; i < rows; i++) {
                float want = dot_spec(W + (size_t)i * cols, x + (size_t)t * cols, cols);
                if (memcmp(&want, &y1[(size_t)t * rows + i], 4)) spec_bad++;
            }
        n_bad += matmul_n_differs(yn, y1, x, M, rows, cols, ns, (int)(sizeof ns / sizeof *ns));
        cases += (int)(sizeof ns / sizeof *ns);
        thr_bad += matmul_threads_differ(yn, x, M, rows, cols, nmax);
        free(W); free(x); free(y1); free(yn);
    }
    CHECK(spec_bad == 0, "f32 matmul, one token: bit-identical to the documented arithmetic (7 shapes, rows 1..385, "
          "cols 64..1536, 70 tokens; %d outputs differ)", spec_bad);
    CHECK(n_bad == 0, "f32 matmul_n for n = 1 .. 70 (batch and chunk tiles, odd rows): bit-identical to one token at a "
          "time (%d of %d cases differ)", n_bad, cases);
#ifdef _OPENMP
    CHECK(thr_bad == 0, "f32 matmul_n of 70 tokens: 1 and 2 threads bit-identical (%d shapes differ)", thr_bad);
#else
    SKIP("no OpenMP: threads not compared");
#endif
    CHECK_EXIT();
}
