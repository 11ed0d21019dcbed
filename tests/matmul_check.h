/* matmul_check.h: the shape checks test_matmul (f32) and test_q8 (q8) both make of matmul_n: one call over n tokens
 * against y1, the same tokens one at a time, for each n of ns; and 1 against 2 threads over nmax tokens. */
#ifndef KVLAB_MATMUL_CHECK_H
#define KVLAB_MATMUL_CHECK_H
#include "matmul.h"
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* the number of ns[k] (k < n_ns) whose call differs from y1 (rows per token); yn: room for nmax tokens' outputs */
static int matmul_n_differs(float *yn, const float *y1, const float *x, Matrix M, int rows, int cols, const int *ns,
                            int n_ns) {
    int bad = 0;
    for (int k = 0; k < n_ns; k++) {
        matmul_n(yn, x, M, rows, cols, ns[k]);
        if (memcmp(yn, y1, (size_t)ns[k] * rows * 4)) bad++;
    }
    return bad;
}

/* 1 when nmax tokens on 1 and on 2 threads differ (0 without OpenMP) */
static int matmul_threads_differ(float *yn, const float *x, Matrix M, int rows, int cols, int nmax) {
    int bad = 0;
#ifdef _OPENMP
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    matmul_n(yn, x, M, rows, cols, nmax);
    float *y2 = malloc((size_t)nmax * rows * 4);
    omp_set_num_threads(2);
    matmul_n(y2, x, M, rows, cols, nmax);
    bad = memcmp(yn, y2, (size_t)nmax * rows * 4) != 0;
    omp_set_num_threads(nt);
    free(y2);
#else
    (void)yn; (void)x; (void)M; (void)rows; (void)cols; (void)nmax;
#endif
    return bad;
}
#endif
