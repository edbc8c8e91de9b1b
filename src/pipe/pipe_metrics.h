/* Internal: a pipe's metrics, for kvp_pipe_metrics() and the engine's
 * metrics endpoint. */
#ifndef KVPI_PIPE_PIPE_METRICS_H
#define KVPI_PIPE_PIPE_METRICS_H

#include "common/metrics.h"
#include "engine/metrics.h" /* kvpi_engine_metrics_attach, for pipe.c */
#include "kvpipe/metrics.h"
#include "kvpipe/pipe.h"

/* What a pipe counts besides kvp_pipe_stats. */
typedef struct kvpi_pipe_counters {
    kvpi_counter send_timeouts; /* sends that ran out of time (room or announcement) */
    kvpi_counter recv_timeouts; /* receives that ended at their timeout */
    kvpi_counter corrupt;       /* messages received whose digest differed (integrity) */
} kvpi_pipe_counters;

/* pipe.c: the pipe's counters. */
const kvpi_pipe_counters *kvpi_pipe_counters_of(const kvp_pipe *p);

/* Add the pipe's own samples (not its engine's) to m. */
void kvpi_pipe_metrics_collect(kvp_pipe *p, kvp_metrics *m);

/* The endpoint's source for a pipe (ctx is the pipe): its samples under its
 * engine's label. */
void kvpi_pipe_metrics_serve(void *pipe, kvp_metrics *into);

#endif
