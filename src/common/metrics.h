/* Internal: counters, gauges and histograms cheap enough for the paths that
 * move bytes, and the assembly of a kvp_metrics snapshot from them
 * (include/kvpipe/metrics.h is the public face).
 *
 * Counting is one relaxed atomic addition per value (a histogram: two, plus a
 * scan of its bounds), so several threads may count into the same metric
 * without locks; nothing orders a count with the data it counts, which is all
 * a metric needs. */
#ifndef KVPI_COMMON_METRICS_H
#define KVPI_COMMON_METRICS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpipe/metrics.h"
#include "kvpipe/status.h"

/* A relaxed atomic value of type T, its type named name, with name_add and
 * name_get: a counter (only grows) or a gauge (goes both ways). */
#define KVPI_ATOMIC_METRIC(name, T)                                                                \
    typedef struct name {                                                                          \
        _Atomic T v;                                                                               \
    } name;                                                                                        \
    static inline void name##_add(name *m, T n)                                                    \
    {                                                                                              \
        atomic_fetch_add_explicit(&m->v, n, memory_order_relaxed);                                 \
    }                                                                                              \
    static inline T name##_get(const name *m)                                                      \
    {                                                                                              \
        return atomic_load_explicit(&((name *)m)->v, memory_order_relaxed);                        \
    }

KVPI_ATOMIC_METRIC(kvpi_counter, uint64_t)
KVPI_ATOMIC_METRIC(kvpi_gauge, int64_t)

/* What one transport's server counts (kvpi_server_ctx.served): requests
 * served to peers, by opcode. */
typedef struct kvpi_served {
    kvpi_counter requests[2];
    kvpi_counter bytes[2];
    kvpi_counter refused; /* requests answered "address rejected" */
} kvpi_served;

/* A request served: write 0 for a peer's READ, 1 for its WRITE. */
static inline void kvpi_served_add(kvpi_served *s, int write, uint64_t bytes)
{
    kvpi_counter_add(&s->requests[write], 1);
    kvpi_counter_add(&s->bytes[write], bytes);
}

/* Bounds of every latency histogram, as Mooncake's transfer engine buckets its
 * task latency: 10 us to 10 s in 1-2-5 steps. */
#define KVPI_LATENCY_BUCKETS 19
extern const uint64_t kvpi_latency_bounds_ns[KVPI_LATENCY_BUCKETS];

/* A latency histogram: buckets[i] counts observations in (bound[i-1],
 * bound[i]], buckets[KVPI_LATENCY_BUCKETS] those above the last bound. */
typedef struct kvpi_histogram {
    _Atomic uint64_t buckets[KVPI_LATENCY_BUCKETS + 1];
    _Atomic uint64_t sum_ns;
} kvpi_histogram;

static inline void kvpi_histogram_observe_ns(kvpi_histogram *h, uint64_t ns)
{
    size_t i = 0;
    while (i < KVPI_LATENCY_BUCKETS && ns > kvpi_latency_bounds_ns[i])
        i++;
    atomic_fetch_add_explicit(&h->buckets[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

/* Add h's counts to into's (into: not shared with other threads); returns
 * the number of observations added, read from the same loads. */
uint64_t kvpi_histogram_merge(kvpi_histogram *into, const kvpi_histogram *h);

/* Per-bucket (not cumulative) counts of h, read once each; returns their sum. */
uint64_t kvpi_histogram_read(const kvpi_histogram *h, uint64_t counts[KVPI_LATENCY_BUCKETS + 1]);

/* A metric family: every sample of one name shares its help and type. */
typedef struct kvpi_metric_family {
    const char *name;
    const char *help;
    kvp_metric_type type;
} kvpi_metric_family;

/* ---- building a snapshot ---- */

/* An empty snapshot, or NULL when out of memory. */
kvp_metrics *kvpi_metrics_new(void);

/* Labels that every sample added after this gets in front of its own (the
 * endpoint's engine="host:port"): name=value pairs, NULL-terminated; none
 * clears them. Copies the strings. At most 2 pairs. */
void kvpi_metrics_base_labels(kvp_metrics *m, ...);

/* Add a counter or gauge sample of family f with labels as NULL-terminated
 * name, value pairs of strings (copied). At most 4 label pairs in all. */
void kvpi_metrics_add(kvp_metrics *m, const kvpi_metric_family *f, double value, ...);

/* Add a histogram sample (durations, shown in seconds). */
void kvpi_metrics_add_histogram(kvp_metrics *m, const kvpi_metric_family *f,
                                const kvpi_histogram *h, ...);

/* KVP_OK, or KVP_ENOMEM when an addition since kvpi_metrics_new() ran out of
 * memory (the snapshot is then incomplete; free it). */
kvp_status kvpi_metrics_status(const kvp_metrics *m);

/* Short names of status codes, for an error label: "ETIMEDOUT", ... */
const char *kvpi_metrics_status_name(kvp_status st);

#endif
