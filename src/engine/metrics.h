/* Internal: what an engine counts, and its two readers besides
 * kvp_engine_metrics(): the metrics endpoint (env KVPIPE_METRICS_PORT or
 * kvp_engine_opts.metrics_port) and Mooncake's periodic throughput line (env
 * MC_TE_METRIC, MC_TE_METRIC_INTERVAL_SECONDS). docs/metrics.md lists the
 * metrics. */
#ifndef KVPI_ENGINE_METRICS_H
#define KVPI_ENGINE_METRICS_H

#include <pthread.h>

#include "common/metrics.h"
#include "kvpipe/engine.h"

/* Entries of kvpi_transports[] an engine can count (the engine keeps as many
 * server slots). */
#define KVPI_TRANSPORTS_MAX 8
#define KVPI_STATUS_SLOTS 32

/* The initiator's counts, per request (not per slice). Each thread counts
 * into a shard of its own (threads are spread over KVPI_METRIC_SHARDS of
 * them), so that the engine's workers do not pass the counters' cache lines
 * to one another on every request; a snapshot adds the shards up. */
#define KVPI_METRIC_SHARDS 8

typedef struct kvpi_engine_shard {
    /* Submission to completion of the completed requests, by opcode and
     * transport. Their counts are the request counts: one value, so that a
     * snapshot's requests_total and histogram count always agree. */
    _Alignas(64) kvpi_histogram latency[2][KVPI_TRANSPORTS_MAX];
    kvpi_counter bytes[2][KVPI_TRANSPORTS_MAX];
    kvpi_counter errors[2][KVPI_STATUS_SLOTS]; /* failed, by opcode and status */
    /* Added at submission, taken away at completion (a shard's may go below
     * zero: only their sum is a count). */
    kvpi_gauge inflight_requests, inflight_bytes;
} kvpi_engine_shard;

typedef struct kvpi_engine_metrics {
    kvpi_engine_shard shards[KVPI_METRIC_SHARDS];
    /* A transport ran a request again on a new connection. */
    kvpi_counter retries;
    /* Peer descriptors fetched from the store (or by handshake), and those of
     * them that replaced one dropped after an error or a range it missed. */
    kvpi_counter lookups, refreshes;
    /* Cached descriptors dropped because the store held another (the
     * metadata watch or poll, segment.c). */
    kvpi_counter changes;
    /* Notifications: queued as received, refused (queue full, malformed),
     * sent and acknowledged by the peer. */
    kvpi_counter notifies_received, notifies_refused, notifies_sent;
    /* The target side, per transport. */
    kvpi_served served[KVPI_TRANSPORTS_MAX];
} kvpi_engine_metrics;

/* A slice to or from seg failed its integrity check (KVP_ECORRUPT) on the
 * transport ops: kvpipe_engine_corrupt_total{peer,transport}. */
struct kvpi_segment;
void kvpi_metrics_corrupt(struct kvpi_segment *seg, const void *ops);

/* The calling thread's shard. */
kvpi_engine_shard *kvpi_metrics_shard(kvpi_engine_metrics *m);

/* A batch of n requests of bytes in all was submitted. */
void kvpi_metrics_submitted(kvpi_engine_metrics *m, size_t n, uint64_t bytes);

/* A request of the initiator finished with st: len bytes by the transport
 * ops (NULL when it failed before one was chosen), latency_ns after its
 * submission (used when st is KVP_OK). */
void kvpi_metrics_request_done(kvpi_engine_metrics *m, kvp_opcode op, size_t len, const void *ops,
                               kvp_status st, uint64_t latency_ns);

struct kvp_engine;

/* At engine creation, once the segment is named: the endpoint (when asked for)
 * and the MC_TE_METRIC reporter. KVP_ECONFIG for a bad KVPIPE_METRICS_PORT,
 * MC_TE_METRIC_INTERVAL_SECONDS, the endpoint's errors otherwise. */
kvp_status kvpi_engine_metrics_start(struct kvp_engine *e);

/* Before teardown: stop both. Safe after a failed or no start. */
void kvpi_engine_metrics_stop(struct kvp_engine *e);

/* Add this engine's samples to m (the pipe adds them to its own). */
void kvpi_engine_metrics_collect(struct kvp_engine *e, kvp_metrics *m);

/* Serve fn(ctx)'s samples on the engine's endpoint too, under the engine's
 * label, until detached (a pipe's). No-op without an endpoint. */
typedef void (*kvpi_engine_metrics_fn)(void *ctx, kvp_metrics *into);
kvp_status kvpi_engine_metrics_attach(struct kvp_engine *e, kvpi_engine_metrics_fn fn, void *ctx);
void kvpi_engine_metrics_detach(struct kvp_engine *e, void *ctx);

#endif
