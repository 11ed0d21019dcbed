/* serve.h: -m serve (serve.c): a trace of requests replayed over one KV pool shared by every sequence, scheduled in
 * batches, with preemption and prefix caching; per-request and per-run figures on stderr and in -o.
 */
#ifndef KVLAB_SERVE_H
#define KVLAB_SERVE_H

#include "cli.h"
#include "model.h"

/* The whole mode: the trace from -trace, -sharegpt or the generator (-requests, -pattern, -docs, -lengths,
 * -arrival, -s), a pool of -pool bytes (or a share of the trace's full-cache demand), each -kv spec in turn (default
 * full). Returns 0, or 128 + the signal when SIGINT/SIGTERM stopped it (what ran is reported). Exits with a message
 * on bad input (a trace error, a spec the pool cannot page). */
int run_serve(Model *m, const Options *o);

#endif
