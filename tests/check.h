/* check.h: the few macros every C test uses. Each check prints one line, "PASS name" or "FAIL name: why", that
 * tests/run.sh counts; a test program exits non-zero when any of its checks failed. Comparisons are written in the
 * NaN-failing form (a NaN never passes). */
#ifndef KVLAB_CHECK_H
#define KVLAB_CHECK_H
#include <stdio.h>
#include <string.h>

static int check_failures = 0;

#define CHECK(cond, ...) do { \
        if (cond) { printf("PASS "); printf(__VA_ARGS__); printf("\n"); } \
        else { check_failures++; printf("FAIL "); printf(__VA_ARGS__); \
               printf("  [%s:%d: %s]\n", __FILE__, __LINE__, #cond); } \
        fflush(stdout); } while (0)

/* err <= tol, failing on NaN */
#define CHECK_LE(err, tol, ...) CHECK((err) <= (tol), __VA_ARGS__)

#define SKIP(...) do { printf("SKIP "); printf(__VA_ARGS__); printf("\n"); fflush(stdout); } while (0)

#define CHECK_EXIT() return check_failures ? 1 : 0
#endif
