/* lowrank.c: the second moment of a stream of vectors and its eigen-decomposition by cyclic Jacobi (lowrank.h), in
 * double, for the cache's low-rank lanes and the spectrum report. Plain loops in a fixed order: the same bits on
 * every build and thread count. It knows nothing of caches, keys or RoPE.
 * Dimensions: n (= head_dim). Indices: p, q the rotated pair, i, j rows and columns.
 */
#include "lowrank.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void lowrank_accumulate(double *m, const float *x, int n) {
    for (int i = 0; i < n; i++) {
        double xi = x[i];
        for (int j = 0; j < n; j++) m[(size_t)i * n + j] += xi * (double)x[j];
    }
}

/* off(A)² = Σ_{p≠q} a_pq² and ‖A‖_F² of the (n, n) a */
static void off_norms(const double *a, int n, double *off2, double *fro2) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double x = a[(size_t)i * n + j] * a[(size_t)i * n + j];
            if (i == j) diag += x; else off += x;
        }
    *off2 = off;
    *fro2 = off + diag;
}

int lowrank_eigen(double *w, double *v, const double *a_in, int n) {
    if (n < 1) return -1;
    double *a = malloc((size_t)n * n * sizeof(double));
    if (!a) return -1;
    for (int i = 0; i < n; i++)   /* symmetrized from the upper triangle */
        for (int j = 0; j < n; j++) a[(size_t)i * n + j] = i <= j ? a_in[(size_t)i * n + j] : a_in[(size_t)j * n + i];
    /* v holds the accumulated rotations J_1 J_2 ... as columns while sweeping: v[i][k] is row i of that product */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) v[(size_t)i * n + j] = i == j;
    double off2, fro2;
    off_norms(a, n, &off2, &fro2);
    double tol2 = DBL_EPSILON * DBL_EPSILON * fro2;
    int sweeps = 0;
    while (off2 > tol2 && sweeps < 100) {
        for (int p = 0; p < n - 1; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[(size_t)p * n + q];
                if (apq == 0) continue;
                /* sym.schur2: c, s with [c s; -s c]ᵀ [a_pp a_pq; a_pq a_qq] [c s; -s c] diagonal; t = tan θ the
                   smaller root of t² + 2τt - 1 = 0, so |θ| ≤ π/4 */
                double app = a[(size_t)p * n + p], aqq = a[(size_t)q * n + q];
                double tau = (aqq - app) / (2 * apq);
                double t = (tau >= 0 ? 1.0 : -1.0) / (fabs(tau) + sqrt(1 + tau * tau));
                double c = 1 / sqrt(1 + t * t), s = t * c;
                /* A = Jᵀ A J: rows and columns p, q; the diagonal by Rutishauser's form, a_pq set to its exact 0 */
                for (int k = 0; k < n; k++) {
                    if (k == p || k == q) continue;
                    double akp = a[(size_t)k * n + p], akq = a[(size_t)k * n + q];
                    double np = c * akp - s * akq, nq = s * akp + c * akq;
                    a[(size_t)k * n + p] = a[(size_t)p * n + k] = np;
                    a[(size_t)k * n + q] = a[(size_t)q * n + k] = nq;
                }
                a[(size_t)p * n + p] = app - t * apq;
                a[(size_t)q * n + q] = aqq + t * apq;
                a[(size_t)p * n + q] = a[(size_t)q * n + p] = 0;
                /* V = V J */
                for (int k = 0; k < n; k++) {
                    double vkp = v[(size_t)k * n + p], vkq = v[(size_t)k * n + q];
                    v[(size_t)k * n + p] = c * vkp - s * vkq;
                    v[(size_t)k * n + q] = s * vkp + c * vkq;
                }
            }
        sweeps++;
        off_norms(a, n, &off2, &fro2);
    }
    int converged = off2 <= tol2;
    /* eigenpairs sorted by decreasing eigenvalue (a stable insertion order: ties keep their column order); the
       eigenvectors, columns of V, become rows of the output */
    int *order = malloc((size_t)n * sizeof(int));
    double *vt = malloc((size_t)n * n * sizeof(double));
    if (!order || !vt) { free(order); free(vt); free(a); return -1; }
    for (int i = 0; i < n; i++) {
        int j = i;
        while (j > 0 && a[(size_t)order[j - 1] * n + order[j - 1]] < a[(size_t)i * n + i]) { order[j] = order[j - 1]; j--; }
        order[j] = i;
    }
    for (int i = 0; i < n; i++) {
        w[i] = a[(size_t)order[i] * n + order[i]];
        for (int k = 0; k < n; k++) vt[(size_t)i * n + k] = v[(size_t)k * n + order[i]];
    }
    memcpy(v, vt, (size_t)n * n * sizeof(double));
    free(order); free(vt); free(a);
    return converged ? sweeps : -1;
}

double lowrank_energy(const double *w, int n, int r) {
    double top = 0, all = 0;
    if (r > n) r = n;
    for (int i = 0; i < n; i++) { all += w[i]; if (i < r) top += w[i]; }
    return all != 0 ? top / all : 0;
}
