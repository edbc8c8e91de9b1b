/* kvpipe bench: what the target, the initiator and the sweep share. */
#ifndef TOOLS_BENCH_H
#define TOOLS_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "cli_opts.h"
#include "kvpipe/kvpipe.h"

typedef enum bench_mode { BENCH_BOTH, BENCH_TARGET, BENCH_INITIATOR } bench_mode;

typedef struct bench_opts {
    bench_mode mode; /* BENCH_BOTH: no --mode: both sides here */
    const char *metadata, *local_name, *segment, *protocol, *device_names;
    int write; /* --operation write */
    size_t blocks[CLI_LIST_MAX], batches[CLI_LIST_MAX], threads[CLI_LIST_MAX];
    size_t n_blocks, n_batches, n_threads;
    size_t buffer_size, slice_size;
    size_t local_span; /* --local-span: each thread's local bytes; 0: a block a request */
    int workers, conns, timeout_ms, metrics_port;
    double duration;
    int duration_set;
    double wait; /* --wait: seconds to wait for the store and (initiator) the segment */
    int verify, json, no_shm, sweep;
    int sync;      /* --sync: kvp_engine_read/write per request, not batches */
    int no_warmup; /* --no-warmup: no untimed pass over the span first */
    int pool;      /* --pool: the target serves kvp_engine_alloc memory */
    int unit;      /* index into bench_units */
    int precision; /* digits of the throughput (Mooncake's --report_precision) */
} bench_opts;

/* Mooncake's --report_unit names and their bytes per unit. */
typedef struct bench_unit {
    const char *name;
    double bytes;
} bench_unit;
extern const bench_unit bench_units[];

/* The initiator: one point, or every point of the sweep, against segment
 * o->segment; prints the results. Returns the exit code. */
int bench_initiator(const bench_opts *o);

/* Calls probe every 100 ms until it passes, fails for good, or --wait runs
 * out (saying once on stderr what it waits for, and at the end why it
 * failed); returns its last status. A failure that waiting may mend: the
 * store, the peer or its segment not up. probe writes why it failed. */
kvp_status bench_wait_for(const bench_opts *o, const char *what,
                          kvp_status (*probe)(const bench_opts *o, char *why, size_t cap));

/* An engine from the options (prints why on failure). With --mode, waits for
 * the metadata store first (bench_wait_for). */
kvp_status bench_engine(const bench_opts *o, const char *name, kvp_engine **out);

#endif
