/* bw: the machine's read bandwidth as decode sees it: an f32 sum over a 512 MiB array (far larger than any cache),
 * split over OpenMP threads (OMP_NUM_THREADS) in contiguous ranges, best of several passes. Each thread sums into 16
 * lanes so the loop vectorizes without -ffast-math. It measures reads only (no writes, no copies). The array asks for
 * transparent huge pages, as the KV cache's arena does (mem_advise_huge): the best stream the memory system gives
 * (on the 2-core Xeon of 2026-12-06, 31-33 GB/s against 24-27 on 4 KiB pages).
 * Usage: bw [MiB] [passes]   (default 512 MiB, 7 passes). Prints one line ending "X GB/s" (1e9 bytes/s).
 */
#include <stdio.h>
#include <stdlib.h>

#include "util.h"
#ifdef _OPENMP
#include <omp.h>
#endif

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 512;
    int passes = argc > 2 ? atoi(argv[2]) : 7;
    if (mib < 1 || passes < 1) { fprintf(stderr, "usage: bw [MiB] [passes]\n"); return 1; }
    size_t n = mib * 1048576 / sizeof(float);   /* elements */
    float *a = aligned_alloc(64, n * sizeof(float));
    if (!a) { fprintf(stderr, "bw: cannot allocate %zu MiB\n", mib); return 1; }
    mem_advise_huge(a, n * sizeof(float));   /* as the KV cache's arena: the best the memory system gives a stream */
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* first touch by the thread that will read each range, so pages sit near it */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 1023) * 1e-3f;
    double best = 1e30, total = 0;
    for (int p = 0; p < passes; p++) {
        double t0 = now_s();
        double sum = 0;
        #pragma omp parallel reduction(+ : sum)
        {
            int nt = 1, id = 0;
#ifdef _OPENMP
            nt = omp_get_num_threads();
            id = omp_get_thread_num();
#endif
            size_t lo = n / nt * id, hi = id == nt - 1 ? n : n / nt * (id + 1);
            float acc[16] = {0};
            size_t i = lo;
            for (; i + 16 <= hi; i += 16)
                for (int k = 0; k < 16; k++) acc[k] += a[i + k];
            for (; i < hi; i++) acc[0] += a[i];
            for (int k = 0; k < 16; k++) sum += acc[k];
        }
        double t = now_s() - t0;
        if (t < best) best = t;
        total += sum;
    }
    printf("bw: %d threads, %zu MiB f32 sum, best of %d passes (checksum %.6g): %.2f GB/s\n", threads, mib, passes,
           total, n * sizeof(float) / best / 1e9);
    free(a);
    return 0;
}
