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

/* adapt:CHAIN, a policy that follows the pool's pressure (-m serve only): CHAIN is MEMBER@OCC/MEMBER@OCC/..., each
 * member a -kv spec (or a storage type alone, meaning full in it) and the occupancy, in percent, from which it holds;
 * the first at 0, the occupancies increasing; `adapt` alone is the default chain, ADAPT_DEFAULT. A member without
 * type=, ktype= or vtype= keeps the storage types of the member before it (the chain only tightens: q8 then h2o:1024 is
 * h2o:1024 in q8). Besides full, the members are one policy P with a keep score (h2o, tova, lru, sink, window):
 * full members are then held as P with the context for budget, which never evicts and so attends as full does, but
 * accumulates P's scores from the first token, so a switch to P finds them ready. */
#define ADAPT_MAX 8
#define ADAPT_DEFAULT "full@0/q8@80/h2o:1024@90/h2o:256@95"
typedef struct {
    int n;                            /* members */
    int at[ADAPT_MAX];                /* occupancy (%) from which member m holds; at[0] = 0 */
    char spec[ADAPT_MAX][160];        /* member m as a -kv spec, types written out ("h2o:1024,type=q8") */
    int full[ADAPT_MAX];              /* 1: member m is full (held as scorer:-c when there is a scorer) */
    KVType ktype[ADAPT_MAX], vtype[ADAPT_MAX];   /* member m's storage types, as its spec resolves them */
    char scorer[24];                  /* P, or "" when every member is full */
} Adapt;
/* Parse "adapt" or "adapt:CHAIN" (default_type: -kvt). 1 when text is not an adapt spec, 0 parsed, -1 + message. */
int serve_adapt_parse(const char *text, KVType default_type, Adapt *a, char *err, size_t errlen);

#endif
