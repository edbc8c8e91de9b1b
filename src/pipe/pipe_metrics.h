/* Internal: a pipe's metrics, for kvp_pipe_metrics() and the engine's
 * metrics endpoint. */
#ifndef KVPI_PIPE_PIPE_METRICS_H
#define KVPI_PIPE_PIPE_METRICS_H

#include "kvpipe/metrics.h"
#include "kvpipe/pipe.h"

/* Add the pipe's own samples (not its engine's) to m. */
void kvpi_pipe_metrics_collect(kvp_pipe *p, kvp_metrics *m);

/* The endpoint's source for a pipe (ctx is the pipe): its samples under its
 * engine's label. */
void kvpi_pipe_metrics_serve(void *pipe, kvp_metrics *into);

#endif
