/* eval.h: the evaluation modes of ./run (eval.c): perplexity through each policy next to the f32 shadow, the
 * passkey, and the speed and memory bench. They run the engine (run.h); the engine knows nothing of them.
 */
#ifndef KVLAB_EVAL_H
#define KVLAB_EVAL_H

#include "cli.h"
#include "run.h"

/* Each returns the exit status: 0, or 128 + the signal when SIGINT/SIGTERM stopped it (what it measured up to then
 * is printed and written, marked partial). */
int run_ppl(Model *m, const Options *o);
int run_bench(Model *m, const Options *o);
int run_passkey(Model *m, const Options *o);
/* The passkey answer's score: the first run of decimal digits in text as a number (leading zeros dropped, at most 9
 * digits read), or -1 when text has no digit. */
long passkey_first_integer(const char *text);
/* SHA-256 (FIPS 180-4) of data as 64 hex digits and a NUL in hex. */
void sha256_hex(const void *data, size_t len, char *hex);

#endif
