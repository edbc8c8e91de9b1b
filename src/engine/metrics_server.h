/* Internal: the metrics endpoint, an HTTP server that answers GET /metrics
 * with Prometheus text (exposition format 0.0.4) of every source attached to
 * it (engines, pipes).
 *
 * One server per host:port in a process, shared: engines of one process that
 * ask for the same port (env KVPIPE_METRICS_PORT gives them all the same one)
 * are served together, each sample labelled with its engine. Port 0 asks for
 * a free port, never shared. Thread-safe.
 *
 * A build without libmicrohttpd has no endpoint: acquiring one fails with
 * KVP_ENOTSUP naming the CMake option. */
#ifndef KVPI_ENGINE_METRICS_SERVER_H
#define KVPI_ENGINE_METRICS_SERVER_H

#include "kvpipe/metrics.h"
#include "kvpipe/status.h"

typedef struct kvpi_metrics_server kvpi_metrics_server;

/* Add a source's samples to a snapshot being built for a scrape. */
typedef void (*kvpi_metrics_collect_fn)(void *ctx, kvp_metrics *into);

/* The server on host:port, started now or already running in this process
 * (then shared; port 0 always starts a new one). KVP_EBUSY when another
 * program holds the port, KVP_EIO when it cannot be bound, KVP_ENOTSUP
 * without libmicrohttpd. */
kvp_status kvpi_metrics_server_acquire(const char *host, int port, kvpi_metrics_server **out);

/* Drop a reference; the last one stops the server. NULL is a no-op. */
void kvpi_metrics_server_release(kvpi_metrics_server *srv);

/* The port it listens on. */
int kvpi_metrics_server_port(const kvpi_metrics_server *srv);

/* Serve fn(ctx)'s samples from now on, until removed. */
kvp_status kvpi_metrics_server_add(kvpi_metrics_server *srv, kvpi_metrics_collect_fn fn, void *ctx);

/* Stop serving ctx's samples; when it returns, no scrape calls fn(ctx). */
void kvpi_metrics_server_remove(kvpi_metrics_server *srv, void *ctx);

#endif
