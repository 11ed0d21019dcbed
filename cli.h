/* cli.h: the command line of ./run (cli.c): its options, the flag table every mode is checked against, usage.
 * The evaluation modes and generate/chat read the parsed Options; only cli.c parses them.
 */
#ifndef KVLAB_CLI_H
#define KVLAB_CLI_H

#include <stdio.h>

#include "kv.h"

#define MAX_FILES 64
#define MAX_POLICIES 32
#define MAX_PASSKEY_CELLS 16   /* values of -depths and of -lengths */
typedef struct {
    const char *model_path, *mode, *prompt, *system, *kvlog, *device, *out, *ppl_mode, *tokenlog;
    const char *calib;   /* -calib FILE: the text allocation by calibration (duo) chooses its lanes on */
    const char *files[MAX_FILES];
    int n_files;
    const char *kv[MAX_POLICIES];
    int n_kv;
    /* (n_layers * n_kv_heads) slots of each lane for kv[k], when the driver chose them before the job (cli_main:
       duo's full lanes on -calib, eval_calib), or NULL: the budget for every lane. Not set by options_parse. */
    const int *kv_caps[MAX_POLICIES];
    int steps, steps_set, ctx, chunk, print_ids, add_bos, verbose, seed_set;
    int bucket, bucket_set;             /* -bucket N: ppl's position bucket, tokens (0: the default, 1024) */
    double depths[MAX_PASSKEY_CELLS];   /* -depths, in [0, 1]; n_depths 0: the default 0, .25, .5, .75, 1 */
    int n_depths;
    int lengths[MAX_PASSKEY_CELLS];     /* -lengths, tokens; n_lengths 0: the default -c/4, -c/2, -c */
    int n_lengths;
    int passkey2;                       /* -passkey2: 1 (default) asks the two-turn variant, 0 skips it */
    const char *task;                   /* -task NAME (task.h), checked by the parser */
    int items;                          /* -items: items per cell of -m task; 0: the default, 2 */
    int questions;                      /* -questions N: a shared context's questions (task.h); 0: none */
    const char *shared;                 /* -shared turns|requests; "turns" when -questions is given alone */
    /* -m serve (serve.h) */
    const char *trace, *sharegpt, *pattern;   /* -trace FILE, -sharegpt FILE, -pattern NAME */
    const char *docs[MAX_FILES];              /* -docs FILE, repeatable: the generated trace's documents */
    int n_docs;
    int requests;                             /* -requests N: generated requests (ShareGPT: at most N); 0 default */
    size_t pool_bytes;                        /* -pool BYTES; 0: pool_frac of the trace's full-cache demand */
    double pool_frac;                         /* -pool P%: a share of that demand; 0: 100% */
    double arrival;                           /* -arrival STEPS: mean steps between arrivals */
    int arrival_set;
    int max_seqs;                             /* -max-seqs N: sequences a step at most */
    int prefix;                               /* -prefix 0|1: prefix caching (full) */
    int shadow;                               /* -shadow 1: quality against each request's full-cache shadow; 2: and a replay */
    const char *help;    /* NULL, or what -h asks for: "usage", "policies", "flags" */
    float temperature, topp;
    double link_gbs;     /* -link: the slow tier's bandwidth, GB/s (1e9 bytes/s) */
    int link_set;        /* -link was given */
    unsigned long long seed;
    KVType kvt;
    int argc;            /* the command line, for the records of -o */
    char **argv;
} Options;

/* The command line (README's flag table). 0, or -1 + message naming the bad flag or value. Never exits. */
int options_parse(Options *o, int argc, char **argv, char *err, size_t errlen);
void usage(FILE *f);
/* README's flag table (markdown): which mode reads which flag. */
void usage_flags_markdown(FILE *f);
/* -h policies: every registered policy with its keys, defaults and source. */
void usage_policies(FILE *f);
/* ./run's whole job: parse, load, check, dispatch to a mode; returns the exit status (main.c calls it). */
int cli_main(int argc, char **argv);

#endif
