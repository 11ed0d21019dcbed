/* lowrank.h: the linear algebra of the cache's low-rank lanes (rank=, krank=, vrank= in kv.c) and of the spectrum
 * report: the second moment of a stream of vectors, and the eigen-decomposition of that small symmetric matrix by
 * cyclic Jacobi rotations, in double. head_dim is small (64 to 256), so the O(n^3)-per-sweep method is cheap and
 * needs no library; it does not handle large or sparse matrices, and it does not fit anything itself (kv.c does).
 * Dimensions: n (= head_dim), r (a rank, 1..n). Matrices are row-major (n, n).
 */
#ifndef KVLAB_LOWRANK_H
#define KVLAB_LOWRANK_H

/* m += x·xᵀ for x (n), f32 in, every product and sum in double: the uncentered second moment of the vectors added so
 * far (the covariance about 0), m (n, n) kept whole (both triangles, the same values). */
void lowrank_accumulate(double *m, const float *x, int n);

/* The eigenvalues and orthonormal eigenvectors of the symmetric a (n, n, not modified; only its upper triangle is
 * read) by the cyclic Jacobi method (Jacobi 1846; Golub & Van Loan, Matrix Computations, 4th ed., §8.5.2-8.5.3,
 * Algorithms 8.5.1 sym.schur2 and 8.5.3 cyclic Jacobi, with Rutishauser's update of the diagonal): sweeps of
 * rotations over every pair p < q in row order, each zeroing a_pq, until off(A) = sqrt(Σ_{p≠q} a_pq²) is at most
 * DBL_EPSILON·‖A‖_F (the test of §8.5.3, with tol the unit roundoff), at most 100 sweeps (quadratic convergence takes
 * about 6 to 10 at n = 64). Outputs: w (n) the eigenvalues in decreasing order; v (n, n) row i the unit eigenvector
 * of w[i] (a·v_i = w[i]·v_i), the rows orthonormal to rounding (the product of rotations). Returns the sweeps taken,
 * or -1 when it did not converge (w and v then hold the last iterate) or n < 1. A zero matrix gives zeros and I. */
int lowrank_eigen(double *w, double *v, const double *a, int n);

/* The share of the energy (trace) that the r largest eigenvalues w[0..r) of a positive semi-definite matrix carry:
 * Σ_{i<r} w[i] / Σ_i w[i] (negative rounding noise of a semi-definite spectrum counted as it is), 0 for a zero trace.
 * w (n) in decreasing order as lowrank_eigen gives it; r is clipped to n. */
double lowrank_energy(const double *w, int n, int r);

#endif
