/* kvpipe metrics: what an engine and a pipe have done, as named counters,
 * gauges and histograms.
 *
 *   kvp_metrics *m;
 *   if (kvp_engine_metrics(engine, &m) == KVP_OK) {
 *       const kvp_metric *x = kvp_metrics_find(m, "kvpipe_engine_bytes_total",
 *                                              "op=read,transport=tcp");
 *       if (x) printf("read over tcp: %.0f bytes\n", x->value);
 *       for (size_t i = 0; (x = kvp_metrics_at(m, i)); i++)
 *           printf("%s %g\n", x->name, x->value);
 *       kvp_metrics_free(m);
 *   }
 *
 * A snapshot holds one entry per sample: a metric name (the Prometheus
 * family, for example kvpipe_engine_requests_total), its labels (op="read",
 * transport="tcp") and its value; every metric and label is listed in
 * docs/metrics.md. New metrics are new entries, so a program that looks its
 * metrics up by name keeps working when a later version adds others; the
 * struct kvp_metric may gain fields at its end, never lose or reorder them,
 * so read it through the pointers handed out and never allocate one.
 *
 * The same samples are served as Prometheus text (exposition format 0.0.4)
 * on an optional HTTP endpoint (kvp_engine_opts.metrics_port, env
 * KVPIPE_METRICS_PORT; off by default), and kvp_metrics_format_prometheus()
 * renders a snapshot as that text.
 *
 * Counting is cheap: relaxed atomic additions on the paths that move bytes.
 * A snapshot reads each value once, so values of one snapshot may be a few
 * requests apart from each other; each counter, and each histogram's count,
 * only grows.
 *
 * Threads: a snapshot is immutable; it may be read from several threads at
 * once and is freed once, after the last read. Taking one is thread-safe.
 */
#ifndef KVPIPE_METRICS_H
#define KVPIPE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_engine kvp_engine;
typedef struct kvp_pipe kvp_pipe;
typedef struct kvp_metrics kvp_metrics;

typedef enum kvp_metric_type {
    KVP_METRIC_COUNTER = 0,   /* only grows (name ends in _total) */
    KVP_METRIC_GAUGE = 1,     /* goes up and down */
    KVP_METRIC_HISTOGRAM = 2, /* observations counted in buckets */
} kvp_metric_type;

typedef struct kvp_metric_label {
    const char *name;  /* "op", "transport", "status", ... */
    const char *value; /* "read", "tcp", "ETIMEDOUT", ... */
} kvp_metric_label;

typedef struct kvp_metric {
    const char *name; /* Prometheus family name: [a-zA-Z_:][a-zA-Z0-9_:]* */
    const char *help; /* one line of English */
    kvp_metric_type type;
    const kvp_metric_label *labels;
    size_t n_labels;
    /* Counter and gauge: the value. Histogram: the number of observations
     * (as count). */
    double value;
    /* Histograms only (0 and NULL otherwise). Durations are in seconds. */
    size_t n_buckets;              /* finite upper bounds; +Inf is implied */
    const double *bucket_bounds;   /* ascending upper bounds */
    const uint64_t *bucket_counts; /* cumulative: observations <= bucket_bounds[i] */
    uint64_t count;                /* all observations (the +Inf bucket) */
    double sum;                    /* sum of the observed values */
} kvp_metric;

/* A snapshot of the engine's metrics (docs/metrics.md lists them): requests,
 * bytes and errors of its transfers, descriptor lookups, a latency histogram,
 * in-flight requests and bytes, its buffer pool. *out is freed with
 * kvp_metrics_free(). Does not block on the network. Errors: KVP_EINVAL (NULL
 * argument), KVP_ENOMEM. */
KVP_API kvp_status kvp_engine_metrics(kvp_engine *engine, kvp_metrics **out);

/* A snapshot of a pipe's metrics (messages, bytes, timeouts, ACKs, in-flight
 * messages and bytes) followed by those of its engine. As kvp_engine_metrics(). */
KVP_API kvp_status kvp_pipe_metrics(kvp_pipe *pipe, kvp_metrics **out);

/* Free a snapshot and every string and array it handed out. NULL is a no-op. */
KVP_API void kvp_metrics_free(kvp_metrics *metrics);

/* Number of samples in the snapshot. */
KVP_API size_t kvp_metrics_count(const kvp_metrics *metrics);

/* Sample i (from 0), or NULL past the end; valid until the snapshot is freed.
 * Samples of one name come one after another. */
KVP_API const kvp_metric *kvp_metrics_at(const kvp_metrics *metrics, size_t i);

/* The first sample named name whose labels include every pair of labels, a
 * comma-separated list of name=value ("op=read,transport=tcp"; NULL or "":
 * any labels); NULL when none matches. */
KVP_API const kvp_metric *kvp_metrics_find(const kvp_metrics *metrics, const char *name,
                                           const char *labels);

/* The snapshot as Prometheus text, exposition format 0.0.4: for each name a
 * "# HELP" and a "# TYPE" line, then its samples; histograms as _bucket{le=...}
 * (cumulative, ending with le="+Inf"), _sum and _count. *text is
 * NUL-terminated, malloc'ed (the caller frees it) and *len its length; both
 * set only on success. Errors: KVP_EINVAL, KVP_ENOMEM. */
KVP_API kvp_status kvp_metrics_format_prometheus(const kvp_metrics *metrics, char **text,
                                                 size_t *len);

/* The port the engine's metrics endpoint listens on (GET /metrics), or 0 when
 * it has none. */
KVP_API int kvp_engine_metrics_port(const kvp_engine *engine);

#ifdef __cplusplus
}
#endif
#endif
